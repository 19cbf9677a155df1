#!/usr/bin/env bash
# Training throughput against Hugging Face transformers on one GPU (issue 7): prints the card, driver, CUDA and the
# commit, then runs bench/hf_side_by_side.py (the HF baseline and `lathe bench` on the same shapes, batch and card,
# one subprocess per measurement). Extra arguments go to the script, e.g. --shapes 0.6b,1.7b --lora --steps 5, or
# --shapes 4b --lathe-bf16-states (lathe without fp32 AdamW masters where HF trains bf16 parameters).
# Usage: bench/run_side_by_side.sh BUILD_DIR [args...]   (results: side_by_side.json, or --out PATH)
set -euo pipefail
build=${1:?build dir}; shift
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
nvidia-smi 2>/dev/null | grep -o "CUDA Version: [0-9.]*" || true
if [ -z "${LATHE_COMMIT:-}" ]; then  # set it where the copy has no .git
  LATHE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || LATHE_COMMIT="$LATHE_COMMIT+dirty"
fi
commit=$LATHE_COMMIT
echo "commit: $commit; date: $(date -u +%Y-%m-%dT%H:%MZ)"
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)" 2>/dev/null || true
LATHE_COMMIT=$commit python3 "$(dirname "$0")/hf_side_by_side.py" --lathe-bin "$build/lathe" "$@"
