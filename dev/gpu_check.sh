#!/usr/bin/env bash
# One GPU-machine session: build, make the HF fixtures, run the suite, the op check, the HF parity scripts and
# the GEMM benchmark. Usage (on the GPU machine, from the repo root): OUT=dir bash dev/gpu_check.sh
# Everything lands in $OUT (logs, fixtures.tgz); a short summary is printed last.
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"

if ! { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 &&
       cmake --build build -j16 >"$OUT/build.log" 2>&1; }; then
  grep -E "error|Error" "$OUT/build.log" "$OUT/cmake.log" | head -30
  exit 1
fi
summary "build: ok"

# Golden fixtures from transformers (committed afterwards from fixtures.tgz).
if python3 dev/ref/qwen3_fixtures.py /tmp/fixtures/qwen3 >"$OUT/fixtures.log" 2>&1; then
  rm -rf tests/models/fixtures/qwen3 && mkdir -p tests/models/fixtures && cp -r /tmp/fixtures/qwen3 tests/models/fixtures/
  tar -czf "$OUT/fixtures.tgz" -C /tmp/fixtures qwen3
  summary "fixtures: $(tail -n 4 "$OUT/fixtures.log" | tr '\n' ' ')"
else
  summary "fixtures: FAILED (see fixtures.log)"; tail -n 30 "$OUT/fixtures.log"
fi
for extra in dev/ref/tokenizer_fixtures.py dev/ref/chat_template_fixtures.py; do
  [ -f "$extra" ] && { python3 "$extra" >"$OUT/$(basename "$extra" .py).log" 2>&1; summary "$extra: rc=$?"; }
done

(cd build && ctest -j8 --output-on-failure >"$OUT/ctest.txt" 2>&1)
summary "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.txt")"
grep -E "^\s+[0-9]+ - .*\(Failed\)" "$OUT/ctest.txt" | head -20
grep "qwen3 cuda bf16" "$OUT/ctest.txt" build/Testing/Temporary/LastTest.log 2>/dev/null | sort -u | head -8 | tee -a "$OUT/summary.txt"

./build/lathe op-check -v >"$OUT/opcheck.txt" 2>&1
summary "$(grep 'op-check:' "$OUT/opcheck.txt" | tail -1)"
grep FAIL "$OUT/opcheck.txt" | head -20
./build/lathe kernels >"$OUT/kernels.txt" 2>&1

python3 dev/ref/check_logprobs.py --lathe build/lathe --out /tmp/lp >"$OUT/check_logprobs.log" 2>&1
summary "$(tail -n 1 "$OUT/check_logprobs.log")"
python3 dev/ref/check_logprobs.py --lathe build/lathe --out /tmp/lp_cuda --device cuda --tol 0.1 >"$OUT/check_logprobs_cuda.log" 2>&1
summary "cuda bf16 logprobs (tol 0.1): $(tail -n 1 "$OUT/check_logprobs_cuda.log")"

fx=$(ls -d tests/models/fixtures/qwen3/*/ 2>/dev/null | head -1)
if [ -n "$fx" ]; then
  ./build/lathe convert --model "$fx/model" --output /tmp/converted >"$OUT/convert.log" 2>&1
  python3 dev/ref/check_saved_checkpoint.py --model /tmp/converted --reference "$fx/model" >>"$OUT/convert.log" 2>&1
  summary "saved checkpoint in transformers: $(tail -n 1 "$OUT/convert.log")"
fi
bash bench/run_gemm.sh build >"$OUT/gemm.txt" 2>&1
summary "$(tail -n 1 "$OUT/gemm.txt")"
