#!/usr/bin/env bash
# Runs lathe's GEMM benchmark and the torch.matmul baseline back to back on the same GPU and prints the
# ratio. Usage: bench/run_gemm.sh BUILD_DIR [M N K dtype]. Interleaves the two twice to expose drift.
set -euo pipefail
build=${1:?build dir}; shift
if [ $# -eq 0 ]; then set -- 8192 8192 8192 bf16; fi
args=("$@")
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "cuda: $(nvcc --version | tail -1); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
for round in 1 2; do
  "$build/bench/gemm_bench" "${args[@]}" | tee -a /tmp/gemm_results.jsonl
  python3 "$(dirname "$0")/gemm_torch.py" "${args[@]}" | tee -a /tmp/gemm_results.jsonl
done
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/gemm_results.jsonl")]
lathe = max(r["tflops"] for r in rows if r["impl"] == "lathe")
torch = max(r["tflops"] for r in rows if r["impl"] == "torch")
print(f"gemm {rows[0]['m']}x{rows[0]['n']}x{rows[0]['k']} {rows[0]['dtype']}: lathe {lathe} TFLOP/s, torch {torch} TFLOP/s, ratio {lathe/torch:.3f}")
PY
rm -f /tmp/gemm_results.jsonl
