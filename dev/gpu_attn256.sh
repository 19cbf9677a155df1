#!/bin/bash
# Session 35's head-dim-256 attention backward probe (one GPU): torch's cuDNN SDPA at D = 256 (right? how fast?) and
# lathe's cuDNN graphs in the dense form, whole and with V split in two, against the tiled kernel
# (bench/attention_bench with LATHE_ATTENTION_DENSE_EXPERIMENT). OUT=... bash dev/gpu_attn256.sh build torch bench
export BUILD_TARGET="${BUILD_TARGET:-attention_bench}"
source dev/gpu_common.sh
if has torch; then timeout 300 python3 dev/attn256_probe.py > $L/torch.txt 2>&1; cat $L/torch.txt >> $OUT/summary.txt; fi
if has bench; then
  for shape in "16384 4 16 8 128" "8192 2 8 2 256" "16384 4 16 4 256" "32768 1 4 1 256" "131072 1 4 1 256"; do
    iters=10; [[ $shape == 131072* ]] && iters=3
    LATHE_ATTENTION_DENSE_EXPERIMENT=1 timeout 300 ./build/bench/attention_bench $shape bf16 $iters >> $L/bench.txt 2>> $L/bench_err.txt
  done
  cat $L/bench.txt >> $OUT/summary.txt; grep -v "^cudnn plan" $L/bench_err.txt | tail -20 >> $OUT/summary.txt
  grep "cudnn plan" $L/bench_err.txt | sort -u | tail -30 >> $OUT/summary.txt
fi
