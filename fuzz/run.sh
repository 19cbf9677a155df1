#!/usr/bin/env bash
# Builds fuzz/safetensors_header_fuzz.cpp with clang++ and libFuzzer (+ASan, UBSan) against the reader
# source directly (no CMake, no rest of the tree) and runs it for N seconds (default 60).
# Convention: the committed seed corpus fuzz/corpus/ is only read; new inputs go to build-fuzz/corpus/.
# Usage: fuzz/run.sh [seconds]   (needs: apt-get install -y clang libclang-rt-14-dev libfmt-dev nlohmann-json3-dev)
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LATHE_FUZZ_BUILD:-$root/build-fuzz}"
cxx="${CXX_FUZZ:-clang++}"
mkdir -p "$build/corpus"

"$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I "$root/src" \
  "$root/fuzz/safetensors_header_fuzz.cpp" "$root/src/io/safetensors.cpp" \
  "$root/src/core/error.cpp" "$root/src/core/dtype.cpp" \
  -lfmt -o "$build/safetensors_header_fuzz"

# JSON and safetensors tokens help the mutator reach the field checks quickly.
cat > "$build/safetensors.dict" <<'EOF'
"{"
"}"
"["
"]"
":"
","
"\""
"\"dtype\""
"\"shape\""
"\"data_offsets\""
"\"__metadata__\""
"\"F64\""
"\"F32\""
"\"BF16\""
"\"F16\""
"\"I64\""
"\"I32\""
"\"U8\""
"\"BOOL\""
"\"I8\""
"\"F8_E4M3\""
"-1"
"1.5"
"1e3"
"18446744073709551615"
"9223372036854775808"
"4294967296"
"null"
"true"
"\\u0000"
"\\ud800"
EOF

# Extra libFuzzer flags may be passed through LATHE_FUZZ_FLAGS (e.g. "-jobs=2 -workers=2").
# shellcheck disable=SC2086
"$build/safetensors_header_fuzz" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict="$build/safetensors.dict" -artifact_prefix="$build/" -print_final_stats=1 \
  ${LATHE_FUZZ_FLAGS:-} \
  "$build/corpus" "$root/fuzz/corpus"
