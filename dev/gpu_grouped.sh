#!/usr/bin/env bash
# The Hopper grouped GEMM on one GPU (run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
# `dev/gpu_grouped.sh STAGE...`:
#   check — test_grouped_matmul (HopperKernelMatchesPlainLoops and the rest) and the CUDA op check of the grouped ops
#           (the routed ones too)
#   moecuda — test_moe_cuda (the fixtures in f32 and bf16, the groups on the device against the host's)
#   groups — issue 26's one-GPU row (as `step`, without the profile) with the groups on the device and read on the host
#           (--moe-host-groups), in one call
#   bench — bench/run_grouped_gemm.sh (the resolved kernel against cuBLAS's grouped call, dense and a per-expert loop)
#   step  — `lathe bench --profile` of issue 26's one-GPU row (30b-a3b, 14 layers, grad_accum 8, bf16 states)
#   side  — that row against transformers in one call (bench/run_side_by_side.sh)
#   gputests — with BUILD_TARGET naming them: test_moe_cuda, the MoE rollout tests (CUDA against the CPU, graphs),
#           test_lora_moe's CUDA parity and the op check's coverage pass on the card (every registered kernel run)
#   moe   — the MoE tests with a GPU (ctest -R "Moe|MoE|Grouped|moe"; session 33's 400 s ran 63 of 80, the CPU
#           finite-difference ones left)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli test_grouped_matmul test_moe_cuda grouped_gemm_bench}"
source dev/gpu_common.sh "$@"

if has check; then
  timeout 120 ./build/tests/test_grouped_matmul >$L/test_grouped.txt 2>&1
  summary "test_grouped_matmul rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' $L/test_grouped.txt | tr '\n' ' ')"
  grep -E -A8 '\[ RUN      \] GroupedMatmul.Hopper' $L/test_grouped.txt | grep -v "^\[ RUN" | head -12 | tee -a $OUT/summary.txt
  for op in grouped_matmul grouped_matmul_weight_grad grouped_matmul_routed grouped_matmul_weight_grad_routed; do
    timeout 120 ./build/lathe op-check --device cuda --op $op >$L/opcheck_$op.txt 2>&1
    summary "op-check $op rc=$?: $(tail -n 1 $L/opcheck_$op.txt)"
    grep FAIL $L/opcheck_$op.txt | head -5 | tee -a $OUT/summary.txt
  done
fi
if has moecuda; then
  timeout 240 ./build/tests/test_moe_cuda >$L/test_moe_cuda.txt 2>&1
  summary "test_moe_cuda rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' $L/test_moe_cuda.txt | tr '\n' ' ')"
  grep -E "^\[moe cuda|Failure|FAILED" $L/test_moe_cuda.txt | head -30 | tee -a $OUT/summary.txt
fi
if has bench; then
  timeout 240 bash bench/run_grouped_gemm.sh build bf16 10 >$L/grouped_bench.txt 2>&1
  summary "grouped bench rc=$?"
  cp $L/grouped_bench.txt $OUT/
fi
STEP="--shape 30b-a3b --layers 14 --seq 4096 --micro-batch 1 --grad-accum 8 --optimizer-states bf16 --nondeterministic"
if has step; then
  timeout 200 ./build/lathe bench $STEP --steps 3 --warmup 1 --profile >$L/step.txt 2>&1
  summary "step rc=$?: $(tail -n 1 $L/step.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["step_ms_each"], d["tokens_per_s"], d["mfu"], d["loss_first"], d["loss_last"], [(k["kernel"], round(k["ms"],1), round(k.get("tflops",0))) for k in d["profile"]["kernels"][:4]])' 2>&1)"
  cp $L/step.txt $OUT/
fi
if has groups; then
  for how in "" "--moe-host-groups"; do
    timeout 200 ./build/lathe bench $STEP --steps 4 --warmup 2 $how >$L/groups$how.txt 2>&1
    summary "groups ${how:-on the device} rc=$?: $(grep -E '^reads back' $L/groups$how.txt) $(tail -n 1 $L/groups$how.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["step_ms_each"], round(d["step_ms"],1), round(d["tokens_per_s"]), round(d["mfu"],4), d["reads_per_step"], d["loss_first"], d["loss_last"])' 2>&1)"
    cp $L/groups$how.txt $OUT/
  done
fi
if has side; then
  timeout 420 bash bench/run_side_by_side.sh build --shapes 30b-a3b --steps 4 --warmup 2 --grad-accum 8 \
    --lathe-bf16-states --lathe-nondeterministic --out $OUT/side_by_side.json >$L/side.txt 2>&1
  summary "side rc=$?: $(tail -n 4 $L/side.txt | tr '\n' ' ' | cut -c1-600)"
fi
if has gputests; then
  timeout 240 ./build/tests/test_moe_cuda >$L/gt_moe_cuda.txt 2>&1
  summary "test_moe_cuda rc=$?: $(grep -E '^\[  (PASSED|FAILED)' $L/gt_moe_cuda.txt | tr '\n' ' ')"
  grep -E "groups on the device|Failure" $L/gt_moe_cuda.txt | head -8 | tee -a $OUT/summary.txt
  timeout 240 ./build/tests/test_rollout --gtest_filter='Families/RolloutFamilies.Cuda*' >$L/gt_rollout.txt 2>&1
  summary "test_rollout (every family on CUDA, graphs) rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' $L/gt_rollout.txt | tr '\n' ' ')"
  grep -E "Failure|FAILED  \]" $L/gt_rollout.txt | head -8 | tee -a $OUT/summary.txt
  timeout 240 ./build/tests/test_lora_moe --gtest_filter='*Cuda*' >$L/gt_lora_moe.txt 2>&1
  summary "test_lora_moe (cuda) rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' $L/gt_lora_moe.txt | tr '\n' ' ')"
  timeout 300 ./build/tests/test_ops --gtest_filter='OpCheckCoverage.*' >$L/gt_coverage.txt 2>&1
  summary "op check coverage rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)|passed|never' $L/gt_coverage.txt | tail -4 | tr '\n' ' ' | cut -c1-500)"
fi
if has moe; then
  cmake --build build -j16 >$L/build_all.log 2>&1 || summary "full build failed"
  (cd build && timeout 480 ctest -R "Moe|MoE|Grouped|moe" -j8 >$L/ctest_moe.txt 2>&1)
  summary "ctest moe: $(grep -E 'tests passed|tests failed' $L/ctest_moe.txt)"
  grep -E "\*\*\*Failed|Timeout" $L/ctest_moe.txt | head | tee -a $OUT/summary.txt
fi
