#!/usr/bin/env bash
# The rollout engine on one GPU (run from the repo root with OUT set; carry .gpu-debs, see dev/gpu_deps.sh).
# `dev/gpu_rollout.sh STAGE...`:
#   build  — configure and build; the CUDA rows of the engine's tests (RolloutFamilies.CudaMatchesTheCpu and
#            CudaGraphsEqualEagerSteps, the matmul (skinny_linear) / paged_attention / scatter_rows /
#            row_argmax_logsumexp / sample_rows op checks, SampleRows' distributions, PagedAttention against the
#            training attention op, the padded-rows cross-entropy, the RL and generation CUDA rows, the parameters'
#            host round trip); the CPU-only rows run in CI
#   speed  — bench/generate_side_by_side.py: transformers' generate against `lathe generate --input`, 64 requests of
#            512 + 512 tokens, Qwen3-1.7B and Qwen3.5-0.8B shapes, and the batch-1 step against one read of the weights,
#            with decode graphs and without (SPEED_ARGS: more arguments, e.g. --skip-hf)
#   profile — the same engine runs without transformers, each with --profile-step 100 (the kernels of 10 decoding
#            steps), and the 1.7B shape with 256 requests; the tables go to $OUT (BUILD_TARGET=lathe_cli builds only
#            the binary)
#   parallel — (two GPUs) ParallelGpu.Generate*: `lathe generate --input` at --tp 2 / --ep 2 on two GPUs against one
#   q35hf  — the Qwen3.5-0.8B side by side alone (HF_MAX_TIME, default 200 s), no batch-1 row
#   moe    — decode graphs of a mixture-of-experts model (MOE_SHAPE, default 30b-a3b-12l: the Qwen3-30B-A3B shape cut
#            to 12 layers): 64 requests of 512 + 512 with graphs (auto) and without (off), batch 1 both ways, and the
#            op check of grouped_matmul_routed on the GPU, and the CUDA rows of every family's engine tests
# Writes summary.txt and logs.tgz to $OUT.
source dev/gpu_common.sh "$@"

if has build; then
  (cd build && ctest -j8 --output-on-failure \
     -R "CudaMatchesTheCpu|CudaGraphsEqualEagerSteps|OpCheck.Cuda/(matmul|paged_attention|scatter_rows|row_argmax|sample_rows|penalize_rows|cross_entropy|qk_norm_rope)|PagedAttention|CrossEntropy|SampleRows|Rl.Cuda|GenerateEngineCuda|CudaParametersMove" \
     >$L/ctest.txt 2>&1)
  summary "ctest (rollout, paged ops, decoding; CUDA included): $(grep -E 'tests passed' $L/ctest.txt)"
  grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Not Run" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
  grep -E "Skipped|SKIPPED" $L/ctest.txt | grep -i cuda | head -5 | tee -a $OUT/summary.txt
fi

if has speed; then
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --hf-max-time ${HF_MAX_TIME:-150} --out /tmp/gen_bench \
    --graphs-off-too ${SPEED_ARGS:-} >$L/gen_bench.log 2>&1
  summary "$(grep -E '^(card|1.7b|q35)' $L/gen_bench.log)"
  cp /tmp/gen_bench/results.json $OUT/ 2>/dev/null
fi

if has profile; then
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --profile-step 100 --out /tmp/gen_prof \
    >$L/gen_prof.log 2>&1
  summary "$(grep -E '^(card|1.7b|q35)' $L/gen_prof.log)"
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --profile-step 100 --shapes 1.7b \
    --requests 256 --cache-mib 40000 --skip-batch1 --out /tmp/gen_prof >$L/gen_prof256.log 2>&1
  summary "$(grep -E '^(1.7b)' $L/gen_prof256.log)"
  cp /tmp/gen_prof/*.profile.txt $OUT/ 2>/dev/null
fi

if has parallel; then
  (cd build && ctest --output-on-failure -V -R "ParallelGpu.Generate" >$L/ctest_parallel.txt 2>&1)
  summary "ctest (generate at tp 2 / ep 2 on two GPUs): $(grep -E 'tests passed' $L/ctest_parallel.txt)"
  grep -E "generate:|f32: tokens|Failure|Expected|Which is" $L/ctest_parallel.txt | head -30 | tee -a $OUT/summary.txt
fi

if has q35hf; then
  timeout ${Q35_LIMIT:-420} python3 bench/generate_side_by_side.py --lathe-bin build/lathe --shapes q35-0.8b \
    --hf-max-time ${HF_MAX_TIME:-200} --skip-batch1 --out /tmp/gen_q35 \
    >$L/gen_q35.log 2>&1
  summary "q35hf rc=$?: $(grep -E '^(card|q35|transformers)' $L/gen_q35.log)"
  cp /tmp/gen_q35/results.json $OUT/q35_results.json 2>/dev/null
fi

if has moe; then
  (cd build && ctest -j4 -V -R "CudaGraphsEqualEagerSteps|CudaMatchesTheCpu" >$L/ctest_graphs.txt 2>&1)
  summary "ctest (decode graphs and CUDA against CPU, every family): $(grep -E 'tests passed' $L/ctest_graphs.txt)"
  grep -E "\(Failed\)|graphs recorded" $L/ctest_graphs.txt | head -12 | tee -a $OUT/summary.txt
  ./build/lathe op-check --device cuda --op grouped_matmul_routed >$L/opcheck_routed.txt 2>&1
  summary "op-check grouped_matmul_routed (cuda): $(tail -n 1 $L/opcheck_routed.txt)"
  for g in auto off; do
    python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --shapes ${MOE_SHAPE:-30b-a3b-12l} \
      --graphs $g --graphs-off-too --batch1-graphs $g --time-forwards --cache-mib 20000 --out /tmp/gen_moe \
      >$L/gen_moe_$g.log 2>&1
    summary "[moe graphs $g] $(grep -E '^30b' $L/gen_moe_$g.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
  done
fi
