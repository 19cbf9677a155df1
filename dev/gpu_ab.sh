#!/usr/bin/env bash
# A/B of two trees on one GPU (run on the GPU machine from the repo root, OUT set, .gpu-debs and .base carried):
# .base holds the earlier tree (here: `rm -rf .base && mkdir .base && git archive <commit> | tar -x -C .base`), the
# working tree the later one. Builds lathe_cli in both, runs `lathe bench` alternated ROUNDS times (default 2), then
# one profiled step of each (profile_base.txt, profile_new.txt under $OUT). BENCH overrides the bench arguments.
set -uo pipefail
OUT=${OUT:?set OUT}
source dev/gpu_deps.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/summary.txt
for d in . .base; do
  (cd $d && cmake -S . -B build-ab -G Ninja -DCMAKE_BUILD_TYPE=Release >/tmp/cfg.txt 2>&1 &&
   cmake --build build-ab -j16 --target lathe_cli >/tmp/build_ab.txt 2>&1) || echo "build failed in $d" | tee -a $OUT/summary.txt
done
B=${BENCH:-"--shape 1.7b --micro-batch 2 --seq 4096 --nondeterministic --warmup 3"}
for i in $(seq ${ROUNDS:-2}); do
  for d in .base .; do
    $d/build-ab/lathe bench $B --steps 6 >/tmp/b.txt 2>&1
    echo "$d: $(grep '^bench:' /tmp/b.txt | sed 's/.*): //' | cut -c1-70)" | tee -a $OUT/summary.txt
  done
done
for d in .base .; do
  name=$([ $d = . ] && echo new || echo base)
  $d/build-ab/lathe bench $B --steps 3 --profile >$OUT/profile_$name.txt 2>&1
  echo "$d profile:" | tee -a $OUT/summary.txt
  sed -n '/between timed/,/composites/p' $OUT/profile_$name.txt | head -6 | tee -a $OUT/summary.txt
done
