#!/usr/bin/env bash
# Pipeline parallelism on two GPUs (run on an nvidia-h200-x2 machine from the repo root, OUT set): the demo trained
# 40 steps at grad_accum 4 on one GPU and at pp 2 over NCCL (--nproc 2), both bf16, their loss curves side by side;
# then `lathe logprobs` of the one-GPU model on one GPU and at --pp 2. Writes summary.txt to $OUT.
set -uo pipefail
OUT=${OUT:?set OUT}
export NCCL_NVLS_ENABLE=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "cards: $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' ')"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/tmp/cmake.log 2>&1 && cmake --build build -j32 --target lathe_cli >/tmp/build.log 2>&1 ||
  { grep -E "error" /tmp/build.log | head; exit 1; }
args="--set device=cuda --set train.max_steps=40 --set train.grad_accum=4 --set final_eval.file= --set train.save_every=20"
./build/lathe train examples/demo.yaml $args --set output_dir=/tmp/one >/tmp/one.log 2>&1; summary "one GPU rc=$?: $(tail -n 1 /tmp/one.log)"
./build/lathe train examples/demo.yaml $args --set output_dir=/tmp/pp --set parallel.pp=2 --nproc 2 >/tmp/pp.log 2>&1
summary "pp 2 rc=$?: $(tail -n 1 /tmp/pp.log)"; grep -E "pipeline:|error" /tmp/pp.log | head -3 | tee -a $OUT/summary.txt
python3 - <<'PY' | tee -a $OUT/summary.txt
import json
def losses(d): return [json.loads(l)["loss"] for l in open(d + "/metrics.jsonl") if '"loss"' in l]
a, b = losses("/tmp/one"), losses("/tmp/pp")
print("steps", len(a), len(b))
for s in (0, 9, 19, 39):
    if s < min(len(a), len(b)): print(f"step {s+1}: one GPU {a[s]:.5f}  pp 2 {b[s]:.5f}  rel diff {abs(a[s]-b[s])/abs(a[s]):.2e}")
print("max rel diff over the steps", max(abs(x - y) / abs(x) for x, y in zip(a, b)))
PY
python3 -c "import json,random;r=random.Random(0);[print(json.dumps({'tokens':[r.randrange(151000) for _ in range(n)]})) for n in (5,17,40,64)]" >/tmp/lp_in.jsonl
./build/lathe logprobs --model /tmp/one/final --input /tmp/lp_in.jsonl --output /tmp/lp_one.jsonl --device cuda >/tmp/lp.log 2>&1
./build/lathe logprobs --model /tmp/one/final --input /tmp/lp_in.jsonl --output /tmp/lp_pp.jsonl --device cuda --pp 2 --nproc 2 >>/tmp/lp.log 2>&1
summary "logprobs rc=$?: $(tail -n 1 /tmp/lp.log)"
python3 - <<'PY' | tee -a $OUT/summary.txt
import json
a = [json.loads(l)["logprobs"] for l in open("/tmp/lp_one.jsonl")]
b = [json.loads(l)["logprobs"] for l in open("/tmp/lp_pp.jsonl")]
print("logprobs: lines", len(a), len(b), "max abs diff", max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)))
PY
cp /tmp/one.log /tmp/pp.log /tmp/lp.log $OUT/ 2>/dev/null
