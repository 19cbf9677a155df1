"""Compares `lathe logprobs` output with transformers on the same model folder and input.

Usage (GPU machine): python3 dev/ref/compare_logprobs.py MODEL_DIR INPUT.jsonl LATHE_OUTPUT.jsonl [--tol 1e-4]
                                                       [--adapter PEFT_DIR]
With --adapter, the PEFT adapter is loaded onto the model with peft's PeftModel.from_pretrained.
INPUT lines are {"tokens": [...]}; LATHE_OUTPUT lines {"logprobs": [...]}. transformers runs in float64 on
the CPU (weights upcast from whatever the folder stores), so the comparison is against exact arithmetic.
Prints the max abs difference and PASS/FAIL; exits 1 on FAIL.
"""
import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("input")
p.add_argument("lathe_output")
p.add_argument("--tol", type=float, default=1e-4)
p.add_argument("--adapter", help="PEFT adapter folder to load onto the model")
a = p.parse_args()
try:  # MoE models: eager experts (torch's grouped_mm has no float64)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
except (TypeError, ValueError):
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float64, attn_implementation="eager").eval()
if a.adapter:
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, a.adapter).double().eval()
rows = [json.loads(l) for l in open(a.input) if l.strip()]
outs = [json.loads(l) for l in open(a.lathe_output) if l.strip()]
assert len(rows) == len(outs), f"{len(rows)} inputs, {len(outs)} outputs"
worst = 0.0
with torch.no_grad():
    for r, o in zip(rows, outs):
        ids = torch.tensor([r["tokens"]])
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        ref = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
        got = torch.tensor(o["logprobs"], dtype=torch.float64)
        assert got.shape == ref.shape, (got.shape, ref.shape)
        worst = max(worst, (got - ref).abs().max().item() if len(ref) else 0.0)
ok = worst <= a.tol
print(f"compare_logprobs: {len(rows)} lines, max abs diff {worst:.3e} (tol {a.tol}): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
