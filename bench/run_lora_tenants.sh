#!/usr/bin/env bash
# Multi-tenant LoRA throughput on one GPU: K = 1, 2, 4, 8 tenants over one frozen Qwen3-0.6B-shaped base, rank 16,
# seq 2048, the same total batch (8 sequences) for every K; prints each K's aggregate tokens/s and the ratio to
# K = 1 measured in the same process on the same card (target: K = 8 at least 0.9x). Extra arguments go to the
# bench binary (e.g. --layers 4 for a quick run). Usage: bench/run_lora_tenants.sh BUILD_DIR [flags...]
set -euo pipefail
build=${1:?build dir}; shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
"$build/bench/lora_tenants_bench" --device cuda --k 1,2,4,8 "$@" | tee /tmp/lora_tenants.jsonl
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/lora_tenants.jsonl") if l.startswith("{")]
base = next(r for r in rows if r["k"] == 1)["tokens_per_s"]
for r in rows:
    print(f"lora tenants k={r['k']}: {r['tokens_per_s']:.0f} tokens/s aggregate, {r['step_ms']:.1f} ms/step, "
          f"ratio to k=1 {r['tokens_per_s'] / base:.3f}, peak {r['peak_mib']:.0f} MiB ({r['card']})")
PY
