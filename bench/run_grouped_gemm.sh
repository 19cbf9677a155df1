#!/usr/bin/env bash
# Times lathe's MoE grouped GEMMs (grouped_matmul forward, its dx and the weight grad) at Qwen3-30B-A3B's expert shapes
# (4096 tokens x top-8 over 128 experts, H = 2048, I = 768; even, uneven and hot spreads) against one dense matmul
# of the same FLOPs, a loop of per-expert matmuls and the padded batched form, measured in the same run. Prints the
# card, driver, CUDA version and commit, then one JSON line per row.
# Usage: bench/run_grouped_gemm.sh BUILD_DIR [dtype] [iters]
set -euo pipefail
build=${1:?build dir}
dtype=${2:-bf16}
iters=${3:-20}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "cuda: $(nvcc --version | tail -1); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
"$build/bench/grouped_gemm_bench" "$dtype" "$iters"
