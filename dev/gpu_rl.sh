#!/usr/bin/env bash
# lathe rl on one GPU (run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
# `dev/gpu_rl.sh STAGE...`:
#   build — configure and build lathe and test_rl (BUILD_TARGET), then Rl.CudaOnPolicyAndLearns (the on-policy ratio
#           within bf16 noise, the engine-trainer log-prob gap, the reward rising)
#   demo  — examples/rl_demo.yaml with --set device=cuda (SFT warm start, then GRPO), its held-out accuracy before and
#           after and its wall time
#   bench — bench/rl_side_by_side.py: a GRPO step of the Qwen3-1.7B shape (64 x 8 x RL_NEW tokens, default 1024),
#           lathe rl against transformers' generate + a PyTorch training loop, split into its phases (RL_BENCH_ARGS:
#           more arguments, e.g. --skip-torch)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli test_rl}"
source dev/gpu_common.sh "$@"

if has build; then
  build/tests/test_rl --gtest_filter='*Cuda*' >$L/test_rl.txt 2>&1
  summary "test_rl CUDA: $(grep -E '^\[rl cuda\]|PASSED|FAILED' $L/test_rl.txt | tr '\n' ' ')"
fi

if has demo; then
  start=$SECONDS
  build/lathe rl examples/rl_demo.yaml --set device=cuda --set overwrite=true >$L/rl_demo.txt 2>&1
  summary "rl demo on cuda: $(grep -E '^rl:' $L/rl_demo.txt | tr '\n' ' ') in $((SECONDS - start)) s"
fi

if has bench; then
  python3 bench/rl_side_by_side.py --lathe-bin build/lathe --new ${RL_NEW:-1024} ${RL_BENCH_ARGS:-} --out /tmp/rl_bench \
    >$L/rl_bench.log 2>&1
  summary "$(grep -E '^(lathe|torch|card)' $L/rl_bench.log)"
  cp /tmp/rl_bench/results.json $OUT/rl_bench.json 2>/dev/null
fi
