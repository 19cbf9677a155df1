#!/bin/bash
# Session 35 (issue 25): cuDNN's dense attention graphs (documents of one length), the only right cuDNN backward at head
# dim 256. Stages (OUT=... bash dev/gpu_session35.sh build STAGES):
#   opcheck  — `lathe op-check --op attention[_backward]` on cuda (every case against the CPU reference) and the
#              kernels the cases resolve to
#   tests    — the GPU tests that train or decode through attention at head dim 256 or on one document: Qwen35Cuda
#              (transformers fixtures), the rollout families on CUDA, PlanGpu, the attention op checks
#   attn     — bench/attention_bench at head dim 256 (one document of 32,768 and 131,072 tokens, equal documents,
#              documents whose length is no multiple of 128) and one D = 128 shape; ATTN_SHAPES replaces the shapes
#              ("TOKENS DOCS HQ HKV D", comma-separated), ATTN_UNEVEN=1 gives the documents unequal lengths
#   longprof — `lathe bench --profile` of the Qwen3.5-0.8B shape at 131,072 tokens on one GPU (session 29's row);
#              LONG_BENCH_ARGS adds options (e.g. --recompute-keeps-gdn)
#   plangpu  — the PlanGpu tests (the planner's peak against the measured, kept delta rule results included)
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli attention_bench test_qwen3_5 test_rollout test_plan_gpu test_ops}"
source dev/gpu_common.sh "$@"
if has opcheck; then
  ./build/lathe op-check --op attention --device cuda -v >$L/opcheck.txt 2>&1
  summary "op-check attention: $(grep 'op-check:' $L/opcheck.txt | tail -1)"
  grep -E "FAIL" $L/opcheck.txt | head -20 | tee -a $OUT/summary.txt
  grep -E "bf16|f16" $L/opcheck.txt | grep -E "d=256|2x128|3x100|3x128|one_doc" | cut -c1-220 >> $OUT/summary.txt
fi
if has tests; then
  (cd build && timeout 420 ctest -R "Qwen35Cuda|RolloutFamilies.Cuda|PlanGpu|OpCheck.Cuda/attention" \
     --output-on-failure >$L/ctest.txt 2>&1)
  summary "ctest: $(grep -E 'tests passed|tests failed' $L/ctest.txt)"
  grep -E "\(Failed\)|\(Timeout\)" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
  grep -E "plan on cuda|qwen3_5 cuda" build/Testing/Temporary/LastTest.log | head -12 >> $OUT/summary.txt
fi
if has attn; then
  IFS=, read -ra shapes <<< "${ATTN_SHAPES:-16384 4 16 8 128,8192 2 8 2 256,8000 2 8 2 256,16384 4 16 4 256,32768 1 4 1 256,131072 1 4 1 256,131072 1 8 2 256}"
  for shape in "${shapes[@]}"; do
    iters=10; [[ $shape == 131072* ]] && iters=3
    timeout 300 ./build/bench/attention_bench $shape bf16 $iters ${ATTN_UNEVEN:+uneven} >> $L/bench.txt 2>> $L/bench_err.txt
  done
  cat $L/bench.txt >> $OUT/summary.txt; grep -v "^cudnn plan" $L/bench_err.txt | tail -8 >> $OUT/summary.txt
fi
if has longprof; then
  timeout 200 ./build/lathe bench --shape q35-0.8b --seq 131072 --micro-batch 1 --recompute --nondeterministic \
    --recompute-keeps-attention --steps 2 --warmup 1 --profile ${LONG_BENCH_ARGS:-} >$L/q35_long.txt 2>&1
  summary "[q35 131072 one GPU] rc=$?: $(grep -E 'tokens/s|MFU' $L/q35_long.txt | tail -n 2 | tr '\n' ' ' | cut -c1-400)"
  cp $L/q35_long.txt $OUT/
fi
if has plangpu; then
  (cd build && timeout 300 ctest -R "PlanGpu" --output-on-failure >$L/plangpu.txt 2>&1)
  summary "ctest PlanGpu: $(grep -E 'tests passed|tests failed' $L/plangpu.txt)"
  grep -E "plan on cuda" build/Testing/Temporary/LastTest.log | head -12 >> $OUT/summary.txt
fi
