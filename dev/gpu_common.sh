# Sourced by the dev/gpu_*.sh scripts (with their arguments, the stages): OUT must be set; defines has STAGE,
# summary TEXT (also into $OUT/summary.txt) and the logs folder $L (packed into $OUT/logs.tgz on exit); unpacks the
# carried libraries (dev/gpu_deps.sh), keeps NVLink multicast off, prints the card and builds into build/ with
# BUILD_JOBS jobs (default 16) — only BUILD_TARGET if set, with CMAKE_EXTRA's cache options if set — ending the script
# if the build fails.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:?set OUT}
STAGES="${*:-build}"
has() { [[ " $STAGES " == *" $1 "* ]]; }
L=/tmp/logs; mkdir -p $L
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf $OUT/logs.tgz -C /tmp logs; }
trap finish EXIT
source dev/gpu_deps.sh  # PCRE2 and ICU from the carried .gpu-debs
summary "card: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tr '\n' ';') stages $STAGES"
{ cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-} >$L/cmake.log 2>&1 &&
    cmake --build build -j${BUILD_JOBS:-16} ${BUILD_TARGET:+--target $BUILD_TARGET} >$L/build.log 2>&1; } && summary "built in $SECONDS s" ||
  { grep -E "error" $L/build.log $L/cmake.log | head -20 | tee -a $OUT/summary.txt; exit 1; }
