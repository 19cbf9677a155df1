#!/bin/bash
# Session 38 (issue 25): where a cp 2 rank's Gated DeltaNet scans spend their walk. Stages
# (OUT=... bash dev/gpu_session38.sh build STAGES):
#   scanncu — bench/gdn_bench at one document of 131,072 tokens and 8 value heads (a cp 2 rank's share) under
#             `ncu --set full` with source correlation (the build gets -lineinfo): the scans' warp stall reasons and
#             per-instruction samples, as text under $OUT
#   gdntime — the same bench under ncu timing only (8 and 16 heads), its default shape (4 x 4,096 tokens, 32 value
#             heads: the single-buffered scans), and the op checks of both directions
export BUILD_TARGET="${BUILD_TARGET-lathe_cli gdn_bench}"
export CMAKE_EXTRA="${CMAKE_EXTRA--DCMAKE_CUDA_FLAGS=-lineinfo}"
source dev/gpu_common.sh "$@"
if has scanncu; then
  for k in scan_forward scan_backward; do
    timeout 300 ncu --set full --import-source yes -k "regex:$k" --launch-skip 1 --launch-count 1 \
      -o $L/$k ./build/bench/gdn_bench 131072 1 8 8 128 bf16 1 >$L/ncu_$k.txt 2>&1
    summary "[ncu full $k] rc=$? $(grep -E '==PROF==|==ERROR==' $L/ncu_$k.txt | tail -n 2 | tr '\n' ' ' | cut -c1-300)"
    ncu -i $L/$k.ncu-rep --page details --print-details all >$OUT/${k}_details.txt 2>&1
    ncu -i $L/$k.ncu-rep --page source --csv --print-source sass >$OUT/${k}_sass.csv 2>&1
    ncu -i $L/$k.ncu-rep --page source --csv --print-source cuda >$OUT/${k}_cuda.csv 2>&1
  done
  ls -la $OUT | tee -a $OUT/summary.txt
fi
if has gdntime; then
  for heads in 8 16; do
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
      ./build/bench/gdn_bench 131072 1 $heads $heads 128 bf16 1 >$L/ncu_$heads.txt 2>&1
    summary "[ncu gdn_bench $heads heads] rc=$?"
    cp $L/ncu_$heads.txt $OUT/
    timeout 100 ./build/bench/gdn_bench 131072 1 $heads $heads 128 bf16 10 >$L/bench_$heads.txt 2>&1
    summary "[gdn_bench $heads heads] $(grep -E '^\{' $L/bench_$heads.txt | tail -n 3 | cut -c1-400)"
  done
  timeout 100 ./build/bench/gdn_bench >$L/bench_default.txt 2>&1  # 4 x 4,096 tokens, 32 value heads: 256 blocks
  summary "[gdn_bench default] $(grep -E '^\{' $L/bench_default.txt | tail -n 3 | cut -c1-400)"
  for op in gated_delta_rule gated_delta_rule_backward; do
    timeout 200 ./build/lathe op-check --op $op --device cuda >$L/opcheck_$op.txt 2>&1
    summary "[op-check $op] rc=$? $(grep -E 'passed|failed' $L/opcheck_$op.txt | tail -n 1)"
  done
fi
