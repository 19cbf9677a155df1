#!/usr/bin/env bash
# Session 21, one call on one GPU (warm machine, build/ already there): the 1.7B shape at 64 requests with decode
# graphs and without, twice each (median steps), then the batch-256 profile (the step's split between GEMMs,
# attention and the rest).
export BUILD_TARGET=lathe_cli
source dev/gpu_common.sh modes256
for g in on off on off; do
  python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --skip-batch1 --graphs $g --time-forwards \
    --shapes 1.7b --out /tmp/gen_modes >$L/modes_$g.log 2>&1
  summary "[64, graphs $g] $(grep -E '^1.7b' $L/modes_$g.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
done
timeout $((580 - SECONDS)) python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --profile-step 100 \
  --shapes 1.7b --requests 256 --cache-mib 40000 --skip-batch1 --out /tmp/gen_modes >$L/prof256.log 2>&1
summary "$(grep -E '^(1.7b)' $L/prof256.log)"
cp /tmp/gen_modes/*.profile.txt $OUT/ 2>/dev/null
