#!/usr/bin/env bash
# Decode graphs on one GPU (run from the repo root with OUT set; carry .gpu-debs and the tokenizer models).
# `dev/gpu_graphs.sh STAGE...`:
#   build — configure and build; the engine's CUDA tests (CudaGraphsEqualEagerSteps, CudaMatchesTheCpu, Rl.Cuda)
#   speed — bench/generate_side_by_side.py without transformers: 64 requests of 512 + 512 and batch 1, with decode
#           graphs and without, Qwen3-1.7B and Qwen3.5-0.8B shapes
#   timing — batch 1 of the 1.7B shape with --graphs on and off under lathe generate --time-forwards: the device time
#           of a replayed decode step against an eager one
#   nsys  — where Nsight Systems is installed: 128 batch-1 steps of the 1.7B shape with graphs and without, the GPU
#           time of every kernel (cuda_gpu_kern_sum) to $OUT
#   compare — 1.7B batch 1 with graphs, without and padded, 64 requests without graphs, and the kernel tables of the
#           eager and padded batch-1 steps (--profile-step)
#   modes — every --graphs mode at 64 requests and at batch 1, Qwen3.5-0.8B then Qwen3-1.7B
source dev/gpu_common.sh "$@"

if has build; then
  (cd build && OMP_NUM_THREADS=2 ctest -j8 --output-on-failure -R "CudaGraphsEqualEagerSteps|CudaMatchesTheCpu|Rl.Cuda|GenerateEngineCuda|CudaParametersMove" \
     >$L/ctest.txt 2>&1)
  summary "ctest (engine on CUDA): $(grep -E 'tests passed' $L/ctest.txt)"
  grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Not Run|graphs recorded" $L/ctest.txt | head -12 | tee -a $OUT/summary.txt
fi

if has speed; then
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs-off-too --out /tmp/gen_bench \
    ${SPEED_ARGS:-} >$L/gen_bench.log 2>&1
  summary "$(grep -E '^(card|1.7b|q35)' $L/gen_bench.log)"
  cp /tmp/gen_bench/results.json $OUT/ 2>/dev/null
fi

if has nsys; then
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  summary "nsys: ${NSYS:-not installed}"
  if [ -n "$NSYS" ] && [ -d /tmp/gen_bench/1.7b ]; then
    for g in auto off; do
      $NSYS profile -o /tmp/nsys_$g --cuda-graph-trace=node -t cuda --force-overwrite true build/lathe generate \
        --model /tmp/gen_bench/1.7b --input /tmp/gen_bench/1.7b.one.jsonl --output /tmp/nsys_out.jsonl --device cuda \
        --max-new-tokens 128 --ignore-eos --max-running 1 --cache-mib 4096 --graphs $g >$L/nsys_$g.log 2>&1
      $NSYS stats -r cuda_gpu_kern_sum,cuda_gpu_mem_time_sum,cuda_api_sum --format csv -o $OUT/nsys_$g \
        /tmp/nsys_$g.nsys-rep >>$L/nsys_$g.log 2>&1
      summary "nsys $g: $(ls $OUT | grep nsys_$g | tr '\n' ' ')"
    done
  fi
fi

if has compare; then  # batch 1 with graphs, without, and padded without recording; their kernel tables (profile)
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs-off-too --batch1-graphs \
    auto,off,padded --shapes 1.7b --out /tmp/gen_cmp >$L/gen_cmp.log 2>&1
  summary "$(grep -E '^(1.7b)' $L/gen_cmp.log)"
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs off --shapes 1.7b --skip-batch1 \
    --out /tmp/gen_cmp >$L/gen_cmp_off64.log 2>&1
  summary "64 without graphs: $(grep -E '^(1.7b)' $L/gen_cmp_off64.log)"
  for g in off padded; do
    build/lathe generate --model /tmp/gen_cmp/1.7b --input /tmp/gen_cmp/1.7b.one.jsonl --output /tmp/p.jsonl \
      --device cuda --max-new-tokens 200 --ignore-eos --max-running 1 --cache-mib 4096 --graphs $g \
      --profile-step 100 >$OUT/profile_batch1_$g.txt 2>>$L/profile.log
  done
fi

if has modes; then  # every --graphs mode at 64 requests and at batch 1: Qwen3.5-0.8B first, then Qwen3-1.7B
  for shape in q35-0.8b 1.7b; do
    for g in padded auto off; do
      python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs $g --graphs-off-too --time-forwards \
        --batch1-graphs $g --shapes $shape --out /tmp/gen_modes >$L/modes_${shape}_$g.log 2>&1
      summary "[$g] $(grep -E '^(1.7b|q35)' $L/modes_${shape}_$g.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
    done
  done
fi

if has timing; then  # batch 1, 1.7B shape: each decode step's device time, replayed against eager (lathe generate
                     # --time-forwards), to tell a slower replay on the GPU from host-side costs
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs-off-too --batch1-graphs on,off \
    --time-forwards --shapes 1.7b --skip-batched --out /tmp/gen_timing >$L/gen_timing.log 2>&1
  summary "$(grep -E '^(1.7b)' $L/gen_timing.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
fi
