#!/usr/bin/env bash
# The attention kernels' GPU check (run on the GPU machine from the repo root, OUT set, after
# `source dev/gpu_deps.sh`): build lathe and attention_bench; `lathe kernels`; the attention op checks on CPU and
# CUDA (every registered attention kernel against the CPU f64 reference, forward and backward) with the cuDNN plan
# log and cuDNN's own warning log; the whole CUDA op check (for its coverage pass); bench/attention_vs_torch.py.
# Each step has its own time limit, so one call of the device tool (5 minutes) brings back whatever finished.
# Stages: `check` (no benchmark), `bench` (benchmark only, after the build), `all`. Writes summary.txt and the logs
# to $OUT (docs/benchmarks.md, cuDNN attention section).
set -uo pipefail
OUT=${OUT:?set OUT}
STAGE=${1:-all}
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "card: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
start=$(date +%s)
{ cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >$OUT/cmake.log 2>&1 &&
  cmake --build build -j16 --target lathe_cli attention_bench >$OUT/build.log 2>&1; } ||
  { grep -E "error|Error" $OUT/build.log $OUT/cmake.log | head -20; exit 1; }
summary "build: $(( $(date +%s) - start )) s; $(grep 'lathe: cuDNN' $OUT/cmake.log)"
if [ "$STAGE" != bench ]; then
  timeout 30 ./build/lathe kernels >$OUT/kernels.log 2>&1
  summary "$(grep -E 'cuda:0' $OUT/kernels.log)"; grep -E 'attention' $OUT/kernels.log | tee -a $OUT/summary.txt
  LATHE_CUDNN_ATTENTION_LOG=1 CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=$OUT/cudnn_log.txt \
    timeout 150 ./build/lathe op-check --op attention -v >$OUT/opcheck.log 2>&1
  summary "op-check rc=$?: $(tail -n 1 $OUT/opcheck.log)"
  grep -E "FAIL|refused" $OUT/opcheck.log | head -20 | tee -a $OUT/summary.txt
  grep -c "" $OUT/cudnn_log.txt 2>/dev/null | sed 's/^/cudnn log lines: /' | tee -a $OUT/summary.txt
  [ -f $OUT/cudnn_log.txt ] && truncate -s '<8M' $OUT/cudnn_log.txt
  # Every op on CUDA, for the coverage pass (each registered kernel reached by some case).
  timeout 90 ./build/lathe op-check --device cuda >$OUT/opcheck_all.log 2>&1
  summary "op-check (all ops, cuda) rc=$?: $(tail -n 1 $OUT/opcheck_all.log)"
  grep -E "coverage" $OUT/opcheck_all.log | head -20 | tee -a $OUT/summary.txt
fi
if [ "$STAGE" != check ]; then
  left=$(( 280 - ($(date +%s) - start) ))
  PYTHONUNBUFFERED=1 timeout $(( left > 20 ? left : 20 )) python3 bench/attention_vs_torch.py \
    --lathe-bin build/bench/attention_bench --iters ${ITERS:-20} >$OUT/bench.log 2>&1
  summary "bench rc=$?"; grep -A40 "^config" $OUT/bench.log | tee -a $OUT/summary.txt
fi
