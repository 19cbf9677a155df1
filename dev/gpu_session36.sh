#!/bin/bash
# Session 36 (issue 25): train.recompute_layers on one GPU, and where the Gated DeltaNet forward's time goes. Stages
# (OUT=... bash dev/gpu_session36.sh build STAGES):
#   plangpu — the PlanGpu tests (the planner's peak against the measured; the first layers recomputing included)
#   recl    — `lathe bench` of two long-document rows with every layer recomputing and with the fewest that
#             `lathe plan` says fit (RECL_17, RECL_35): the Qwen3-1.7B shape at 65,536 tokens and the Qwen3.5-0.8B
#             shape at 131,072, both keeping attention outputs (and the second the delta rule's results)
#   gdnprof — bench/gdn_bench at one document of 131,072 tokens (16 and 8 value heads) under ncu: each kernel's time
#   gputests — every single-GPU test (ctest -R "Cuda|Gpu" -E ParallelGpu), in this script's environment (the carried
#              libraries: calls 5 and 6 of session 36 ran ctest outside it first); give BUILD_TARGET= to build all
export BUILD_TARGET="${BUILD_TARGET-lathe_cli test_plan_gpu gdn_bench}"
source dev/gpu_common.sh "$@"
if has gputests; then
  (cd build && timeout 480 ctest -R "Cuda|Gpu" -E "ParallelGpu" -j3 --timeout 200 >$L/gputests.txt 2>&1)
  summary "ctest single-GPU: $(grep -E 'tests passed|tests failed' $L/gputests.txt)"
  grep -E "\(Failed\)|\(Timeout\)" $L/gputests.txt | head -20 | tee -a $OUT/summary.txt
fi
if has plangpu; then
  (cd build && timeout 360 ctest -R "PlanGpu" --output-on-failure >$L/plangpu.txt 2>&1)
  summary "ctest PlanGpu: $(grep -E 'tests passed|tests failed' $L/plangpu.txt)"
  grep -E "\(Failed\)|\(Timeout\)" $L/plangpu.txt | head -10 | tee -a $OUT/summary.txt
  grep -E "plan on cuda" build/Testing/Temporary/LastTest.log | head -12 >> $OUT/summary.txt
fi
if has recl; then
  common="--micro-batch 1 --recompute --nondeterministic --recompute-keeps-attention --steps 3 --warmup 1"
  for n in -1 ${RECL_17:-8}; do
    timeout 200 ./build/lathe bench --shape 1.7b --seq 65536 $common --recompute-layers $n >$L/q17_$n.txt 2>&1
    summary "[1.7b 65536 recompute_layers $n] rc=$?: $(grep -E 'tokens/s|MFU|peak' $L/q17_$n.txt | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
  done
  for n in -1 ${RECL_35:-20}; do
    timeout 240 ./build/lathe bench --shape q35-0.8b --seq 131072 $common --recompute-keeps-gdn --recompute-layers $n \
      >$L/q35_$n.txt 2>&1
    summary "[q35 131072 recompute_layers $n] rc=$?: $(grep -E 'tokens/s|MFU|peak' $L/q35_$n.txt | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
  done
fi
if has gdnprof; then
  for heads in 16 8; do
    timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
      ./build/bench/gdn_bench 131072 1 $heads $heads 128 bf16 1 >$L/ncu_$heads.txt 2>&1
    summary "[ncu gdn_bench $heads heads] rc=$?"
    cp $L/ncu_$heads.txt $OUT/
  done
fi
