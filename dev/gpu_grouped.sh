#!/usr/bin/env bash
# The Hopper grouped GEMM on one GPU (run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
# `dev/gpu_grouped.sh STAGE...`:
#   check — test_grouped_matmul (HopperKernelMatchesPlainLoops and the rest) and the CUDA op check of the grouped ops
#   bench — bench/run_grouped_gemm.sh (the resolved kernel against cuBLAS's grouped call, dense and a per-expert loop)
#   step  — `lathe bench --profile` of issue 26's one-GPU row (30b-a3b, 14 layers, grad_accum 8, bf16 states)
#   side  — that row against transformers in one call (bench/run_side_by_side.sh)
#   moe   — the MoE tests with a GPU (ctest -R "Moe|MoE|Grouped|moe"; session 33's 400 s ran 63 of 80, the CPU
#           finite-difference ones left)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli test_grouped_matmul grouped_gemm_bench}"
source dev/gpu_common.sh "$@"

if has check; then
  timeout 120 ./build/tests/test_grouped_matmul >$L/test_grouped.txt 2>&1
  summary "test_grouped_matmul rc=$?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' $L/test_grouped.txt | tr '\n' ' ')"
  grep -E -A8 '\[ RUN      \] GroupedMatmul.Hopper' $L/test_grouped.txt | grep -v "^\[ RUN" | head -12 | tee -a $OUT/summary.txt
  for op in grouped_matmul grouped_matmul_weight_grad; do
    timeout 120 ./build/lathe op-check --device cuda --op $op >$L/opcheck_$op.txt 2>&1
    summary "op-check $op rc=$?: $(tail -n 1 $L/opcheck_$op.txt)"
    grep FAIL $L/opcheck_$op.txt | head -5 | tee -a $OUT/summary.txt
  done
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
if has side; then
  timeout 420 bash bench/run_side_by_side.sh build --shapes 30b-a3b --steps 4 --warmup 2 --grad-accum 8 \
    --lathe-bf16-states --lathe-nondeterministic --out $OUT/side_by_side.json >$L/side.txt 2>&1
  summary "side rc=$?: $(tail -n 4 $L/side.txt | tr '\n' ' ' | cut -c1-600)"
fi
if has moe; then
  cmake --build build -j16 >$L/build_all.log 2>&1 || summary "full build failed"
  (cd build && timeout 480 ctest -R "Moe|MoE|Grouped|moe" -j8 >$L/ctest_moe.txt 2>&1)
  summary "ctest moe: $(grep -E 'tests passed|tests failed' $L/ctest_moe.txt)"
  grep -E "\*\*\*Failed|Timeout" $L/ctest_moe.txt | head | tee -a $OUT/summary.txt
fi
