#!/usr/bin/env bash
# Session 29's one-GPU calls (run from the repo root with OUT set; carry .gpu-debs and the tokenizer assets).
#   longprof — where a long document's training step goes on one GPU (issue 25's cp 2 target is bounded by it):
#              `lathe bench --profile` of the Qwen3-1.7B shape at 65,536 tokens and the Qwen3.5-0.8B shape at 131,072,
#              one document, train.recompute, with the deterministic attention backward and without it
#              (LONG_KEEP=1 also with train.recompute_keeps_attention)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli}"
source dev/gpu_common.sh "$@"

bench_row() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t ./build/lathe bench "$@" >$L/bench_$name.txt 2>&1
  summary "[$name] rc=$?: $(grep -E 'tokens/s|MFU' $L/bench_$name.txt | tail -n 2 | tr '\n' ' ' | cut -c1-400)"
  cp $L/bench_$name.txt $OUT/
}
if has longprof; then
  K=""; [ "${LONG_KEEP:-0}" = 1 ] && K="--recompute-keeps-attention"
  bench_row q17_det 150 --shape 1.7b --seq 65536 --micro-batch 1 --recompute --steps 2 --warmup 1 --profile
  bench_row q17_nondet 150 --shape 1.7b --seq 65536 --micro-batch 1 --recompute --nondeterministic --steps 2 \
    --warmup 1 --profile $K
  bench_row q35_nondet 180 --shape q35-0.8b --seq 131072 --micro-batch 1 --recompute --nondeterministic --steps 2 \
    --warmup 1 --profile $K
fi
