#!/bin/bash
# Session 38 (issue 25): the Gated DeltaNet scans' instructions (a cp 2 rank's share of the long Qwen3.5 document).
# Stages (OUT=... bash dev/gpu_session38.sh build STAGES):
#   scanncu — bench/gdn_bench at one document of 131,072 tokens and 8 value heads under `ncu --set full` with source
#             correlation (give CMAKE_EXTRA=-DCMAKE_CUDA_FLAGS=-lineinfo): the scans' stall reasons into the summary,
#             their per-instruction and per-line samples as CSV under $OUT
#   verify  — the delta rule's op checks on cuda (both directions, against the CPU reference), ctest GdnCuda (bitwise
#             repeatable backwards) and Qwen35Cuda (the transformers fixtures); the script ends here if any fails
#   gdntime — ncu's time for each kernel at 8 value heads, and bench/gdn_bench at one document of 131,072 tokens
#             (8 and 16 value heads), 2 x 4,096 tokens (16) and its default (4 x 4,096 tokens, 32: the
#             single-buffered scans)
#   long    — `lathe bench --profile` of the Qwen3.5-0.8B shape at 131,072 tokens on one GPU, both cores' results
#             kept (session 36's row)
export BUILD_TARGET="${BUILD_TARGET-lathe_cli gdn_bench test_gdn_cuda test_qwen3_5_cuda}"
source dev/gpu_common.sh "$@"
if has scanncu; then
  for k in scan_forward scan_backward; do
    timeout 300 ncu --set full --import-source yes -k "regex:$k" --launch-skip 1 --launch-count 1 \
      -o $L/$k ./build/bench/gdn_bench 131072 1 8 8 128 bf16 1 >$L/ncu_$k.txt 2>&1
    summary "[ncu full $k] rc=$? $(grep -E '==PROF==|==ERROR==' $L/ncu_$k.txt | tail -n 2 | tr '\n' ' ' | cut -c1-300)"
    ncu -i $L/$k.ncu-rep --page details --print-details all >$L/${k}_details.txt 2>&1
    grep -E "^ +(Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall [A-Z]|Registers Per Thread|Executed Ipc A)" \
      $L/${k}_details.txt | sed "s/^/[$k] /" >>$OUT/summary.txt
    ncu -i $L/$k.ncu-rep --page source --csv --print-source sass >$OUT/${k}_sass.csv 2>&1
    ncu -i $L/$k.ncu-rep --page source --csv --print-source cuda,sass >$OUT/${k}_cuda_sass.csv 2>&1
  done
fi
if has verify; then
  ok=1
  for op in gated_delta_rule gated_delta_rule_backward; do
    timeout 200 ./build/lathe op-check --op $op --device cuda -v >$L/opcheck_$op.txt 2>&1 || ok=0
    summary "[op-check $op] $(grep 'op-check:' $L/opcheck_$op.txt | tail -n 1)"
    grep -E "^\[FAIL\]" $L/opcheck_$op.txt | cut -c1-200 | head -5 | tee -a $OUT/summary.txt
  done
  (cd build && timeout 240 ctest -R "GdnCuda|Qwen35Cuda" --output-on-failure >$L/ctest.txt 2>&1) || ok=0
  summary "[ctest GdnCuda|Qwen35Cuda] $(grep -E 'tests passed|tests failed' $L/ctest.txt)"
  [ $ok = 1 ] || { summary "verify FAILED: no timings"; exit 1; }
fi
if has gdntime; then
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    ./build/bench/gdn_bench 131072 1 8 8 128 bf16 1 >$OUT/ncu_8.txt 2>&1
  summary "[ncu gdn_bench 8 heads] rc=$?"
  for shape in "131072 1 8 8 128" "131072 1 16 16 128" "8192 2 16 16 128" "16384 4 16 32 128"; do
    timeout 100 ./build/bench/gdn_bench $shape bf16 10 2>&1 | grep -E '^\{' | cut -c1-330 | tee -a $OUT/summary.txt
  done
fi
if has long; then
  timeout 200 ./build/lathe bench --shape q35-0.8b --seq 131072 --micro-batch 1 --recompute --nondeterministic \
    --recompute-keeps-attention --recompute-keeps-gdn --steps 2 --warmup 1 --profile >$OUT/q35_long.txt 2>&1
  summary "[q35 131072 one GPU] rc=$?: $(grep -E 'ms/step' $OUT/q35_long.txt | tail -n 1 | cut -c1-330)"
  grep -E "gated_delta_rule|by kind" $OUT/q35_long.txt | head -4 | tee -a $OUT/summary.txt
fi
