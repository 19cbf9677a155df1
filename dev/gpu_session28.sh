#!/usr/bin/env bash
# Session 28's GPU calls (one GPU; run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
# Each stage bounded by its own timeout, most important first:
#   checks — the whole op check on CUDA (every kernel covered: the pipelined paged-attention kernel, the dropout
#            kernels' row shift and column slice), the paged_attention cases' lines
#   paged  — bench/paged_attention_bench at decode shapes: the registered kernels and the pipelines, against a
#            device copy in the same run (1.7B: 16 / 8 heads of 128; 4B-8B: 32 / 8; Qwen3.5: 8 / 2 of 256)
#   gen    — lathe generate, the 1.7B shape at 256 and 512 requests of 512 + 512 (graphs auto), median decode step
#   engine — the engine's CUDA rows (decode graphs against eager steps, graphs serving adapters, CUDA against CPU)
#   rl     — the paged_attention op check listed by kernel, then bench/rl_side_by_side.py: the Lathe GRPO step
#            (offload auto), then the PyTorch way, in this one call
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli paged_attention_bench test_rollout}"
source dev/gpu_common.sh "$@"

if has checks; then
  timeout 240 ./build/lathe op-check --device cuda >$L/opcheck.txt 2>&1
  summary "op-check (cuda, every op) rc=$?: $(tail -n 1 $L/opcheck.txt)"
  grep -E "FAIL" $L/opcheck.txt | head -8 | tee -a $OUT/summary.txt
  summary "paged_attention rows: $(grep -c 'paged_attention_pipelined' $L/opcheck.txt) pipelined, $(grep -c 'cuda/paged_attention\b' $L/opcheck.txt) general"
fi

if has paged; then
  for shape in "256 810 300 16 8 128 16" "512 540 250 16 8 128 16" "64 1000 24 16 8 128 16" "256 810 300 32 8 128 16" \
               "64 1000 24 8 2 256 16" "8 4000 100 16 8 128 16"; do
    timeout 60 ./build/bench/paged_attention_bench $shape bf16 30 >>$L/paged_bench.txt 2>&1
  done
  cp $L/paged_bench.txt $OUT/
  summary "paged bench: $(grep -c gb_s $L/paged_bench.txt) rows (paged_bench.txt)"
fi

if has gen; then
  for n in 256 512; do
    timeout 150 python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --skip-batch1 --time-forwards \
      --shapes 1.7b --requests $n --cache-mib 60000 --out /tmp/gen_$n >$L/gen_$n.log 2>&1
    summary "[$n requests] rc=$?: $(grep -E '^1.7b' $L/gen_$n.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
  done
fi

if has engine; then
  (cd build && timeout 200 ctest -j4 -V -R "CudaGraphsEqualEagerSteps|CudaGraphsServeAdapters|CudaMatchesTheCpu" \
     >$L/ctest_engine.txt 2>&1)
  summary "ctest (engine CUDA rows): $(grep -E 'tests passed' $L/ctest_engine.txt)"
  grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|graphs recorded" $L/ctest_engine.txt | head -14 | tee -a $OUT/summary.txt
fi

if has rl; then  # both sides in one run of the script (one model folder): the Lathe step, then the PyTorch way
  timeout 60 ./build/lathe op-check --device cuda --op paged_attention -v >$L/opcheck_paged.txt 2>&1
  summary "op-check paged_attention: $(tail -n 1 $L/opcheck_paged.txt); by kernel: $(grep -oE 'cuda/paged_attention[a-z_]*' \
    $L/opcheck_paged.txt | sort | uniq -c | tr '\n' ' ')"
  timeout $((${RL_END_S:-585} - SECONDS)) python3 bench/rl_side_by_side.py --lathe-bin build/lathe --offload auto \
    --out /tmp/rl >$L/rl.log 2>&1
  summary "rl rc=$?: $(grep -E '^(lathe|torch|card|ratio)' $L/rl.log | tr '\n' ' ')"
  cp /tmp/rl/results.json $OUT/rl.json 2>/dev/null
  cp /tmp/rl/lathe_run/metrics.jsonl $OUT/rl_lathe_metrics.jsonl 2>/dev/null
fi
