#!/usr/bin/env bash
# lathe rl on one GPU (run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
# `dev/gpu_rl.sh STAGE...`:
#   build — configure and build lathe and test_rl (BUILD_TARGET), then Rl.CudaOnPolicyAndLearns (the on-policy ratio
#           within bf16 noise, the engine-trainer log-prob gap, the reward rising)
#   demo  — examples/rl_demo.yaml with --set device=cuda (SFT warm start, then GRPO), its held-out accuracy before and
#           after and its wall time
#   bench — bench/rl_side_by_side.py's Lathe side: a GRPO step of the Qwen3-1.7B shape (64 x 8 x RL_NEW tokens,
#           default 1024), lathe rl with rl.offload_optimizer auto, then true (the handover measured), split into its
#           phases, each run cut at RL_LATHE_S seconds; RL_OFFLOADS: which settings (default "auto true");
#           RL_BENCH_ARGS: more arguments
#   torch — its PyTorch side (transformers' generate + a training loop), cut at RL_END_S seconds of the call, each
#           phase logged as it ends
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

if has bench; then  # lathe (offload auto, then forced: the handover's cost), then PyTorch with what time is left
  for offload in ${RL_OFFLOADS:-auto true}; do
    timeout ${RL_LATHE_S:-240} python3 bench/rl_side_by_side.py --lathe-bin build/lathe --new ${RL_NEW:-1024} --skip-torch \
      --offload $offload ${RL_BENCH_ARGS:-} --out /tmp/rl_bench_$offload >$L/rl_lathe_$offload.log 2>&1
    summary "lathe (offload $offload): $(grep -E '^(lathe|card)' $L/rl_lathe_$offload.log | tr '\n' ' ')"
    cp /tmp/rl_bench_$offload/results.json $OUT/rl_lathe_$offload.json 2>/dev/null
    cp /tmp/rl_bench_$offload/lathe_run/metrics.jsonl $OUT/rl_lathe_${offload}_metrics.jsonl 2>/dev/null
  done
fi

if has torch; then  # the PyTorch side, cut at RL_END_S seconds of the call (its phases are logged as they end)
  timeout $((${RL_END_S:-570} - SECONDS)) python3 bench/rl_side_by_side.py --lathe-bin build/lathe --new ${RL_NEW:-1024} \
    --skip-lathe ${RL_BENCH_ARGS:-} --out /tmp/rl_bench_torch >$L/rl_torch.log 2>&1
  summary "torch (each phase as it ends; cut at ${RL_END_S:-570} s of the call): $(grep -E '^torch' $L/rl_torch.log | tr '\n' ' ')"
  cp /tmp/rl_bench_torch/results.json $OUT/rl_torch.json 2>/dev/null
fi
