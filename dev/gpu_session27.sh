#!/usr/bin/env bash
# Session 27's GPU call (two GPUs; run from the repo root with OUT set; carry .gpu-debs, see dev/gpu_deps.sh). Each
# stage bounded by its own timeout, most important first:
#   checks — op checks of grouped_matmul_routed and gated_delta_rule_state (the register kernel at 128 x 128 heads),
#            the engine's CUDA rows for every family (CUDA against CPU, decode graphs against eager, graphs serving
#            adapters)
#   q35    — the Qwen3.5-0.8B side by side with transformers (64 x (512 + 512)) and its batch-1 step
#   parallel — ParallelGpu.Generate*: lathe generate --input at --tp 2 / --ep 2 on two GPUs against one
#   moe    — decode graphs of the Qwen3-30B-A3B shape cut to MOE_LAYERS (default 6) layers: 64 requests of
#            512 + 512 and batch 1, graphs auto and off
# Writes summary.txt and logs.tgz to $OUT.
source dev/gpu_common.sh "$@"

if has checks; then
  for op in grouped_matmul_routed gated_delta_rule_state; do
    timeout 60 ./build/lathe op-check --device cuda --op $op >$L/opcheck_$op.txt 2>&1
    summary "op-check $op (cuda): $(tail -n 1 $L/opcheck_$op.txt)"
    grep -E "FAIL" $L/opcheck_$op.txt | head -5 | tee -a $OUT/summary.txt
  done
  (cd build && timeout 150 ctest -j4 -V -R "CudaGraphsEqualEagerSteps|CudaGraphsServeAdapters|CudaMatchesTheCpu" \
     >$L/ctest_engine.txt 2>&1)
  summary "ctest (engine CUDA rows, every family): $(grep -E 'tests passed' $L/ctest_engine.txt)"
  grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|graphs recorded" $L/ctest_engine.txt | head -14 | tee -a $OUT/summary.txt
fi

if has q35; then
  timeout 200 python3 bench/generate_side_by_side.py --lathe-bin build/lathe --shapes q35-0.8b --hf-max-time 120 \
    --out /tmp/gen_q35 >$L/gen_q35.log 2>&1
  summary "q35 rc=$?: $(grep -E '^(card|q35)' $L/gen_q35.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
  cp /tmp/gen_q35/results.json $OUT/q35_results.json 2>/dev/null
fi

if has parallel; then
  (cd build && timeout 150 ctest -V -R "ParallelGpu.Generate" >$L/ctest_parallel.txt 2>&1)
  summary "ctest (generate at tp 2 / ep 2 on two GPUs): $(grep -E 'tests passed' $L/ctest_parallel.txt)"
  grep -E "generate:$|f32: tokens|Failure|Which is" $L/ctest_parallel.txt | head -20 | tee -a $OUT/summary.txt
fi

if has moe; then
  for g in auto off; do
    timeout 150 python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf \
      --shapes 30b-a3b-${MOE_LAYERS:-6}l --graphs $g --graphs-off-too --batch1-graphs $g --time-forwards \
      --cache-mib 20000 --out /tmp/gen_moe >$L/gen_moe_$g.log 2>&1
    summary "[moe graphs $g] rc=$?: $(grep -E '^30b' $L/gen_moe_$g.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
  done
fi
