#!/usr/bin/env bash
# Session 22, one call on one GPU: build everything, then the CUDA and GPU tests (the planner's peak against a run,
# the families against the transformers fixtures, the rollout engine, RL on policy), the op check, and the SFT demo on
# cuda; summary.txt and logs.tgz to $OUT.
source dev/gpu_common.sh build
(cd build && timeout 330 ctest -j4 -R "Cuda|Gpu|cuda" --output-on-failure >$L/ctest_cuda.txt 2>&1)
summary "ctest cuda: $(grep -E 'tests passed|tests failed' $L/ctest_cuda.txt)"
grep -E "\(Failed\)|\(Timeout\)" $L/ctest_cuda.txt | head -20 | tee -a $OUT/summary.txt
grep -hE "^(plan on cuda|\[qwen3 cuda|\[rl cuda)" $L/ctest_cuda.txt build/Testing/Temporary/LastTest.log 2>/dev/null | sort -u | head -12 |
  tee -a $OUT/summary.txt
timeout 90 build/lathe op-check >$L/opcheck.txt 2>&1
summary "$(grep 'op-check:' $L/opcheck.txt | tail -1)"
grep FAIL $L/opcheck.txt | head -10 | tee -a $OUT/summary.txt
start=$SECONDS
timeout $((590 - SECONDS)) build/lathe train examples/demo.yaml --set device=cuda --set output_dir=/tmp/demo_cuda >$L/demo.txt 2>&1
summary "demo on cuda (rc $?, $((SECONDS - start)) s): $(grep -E 'held-out|final_eval|accuracy' $L/demo.txt | tail -3 | tr '\n' ' ')"
