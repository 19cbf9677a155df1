#!/usr/bin/env python3
"""Checks `lathe logprobs` against Hugging Face transformers on tiny random Qwen3 models that are
not the committed fixtures (other sizes, seeds, 3 layers, 8 q / 2 kv heads, head_dim != hidden/heads,
tied and untied, both RoPE spellings in config.json).

For each config it saves the model (float32, save_pretrained) under OUT/NAME/model, writes
OUT/NAME/input.jsonl ({"tokens": [...]} per line, lengths 1..40), runs
    LATHE logprobs --model OUT/NAME/model --input OUT/NAME/input.jsonl --output OUT/NAME/output.jsonl --device DEV
and compares each line's "logprobs" (entry i = log p(tokens[i+1] | tokens[..i]); empty for one
token) with stock HF in float64 (log_softmax of the logits, gathered at the next token).
Exits 1 if any line is missing, has the wrong length, or differs by more than --tol (1e-4).

Run on the GPU machine from the repo root:
    python3 dev/ref/check_logprobs.py --lathe build/lathe --out /tmp/check_logprobs [--device cpu]
"""
import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen3_fixtures import build_model, load_model, save_model  # noqa: E402

LENGTHS = (1, 2, 5, 17, 33, 40)

CONFIGS = {
    "three_layers_tied": dict(
        seed=101, rope_spelling="rope_theta",
        arch=dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, rope_theta=10000.0)),
    "q8_kv2_untied": dict(
        seed=202, rope_spelling="rope_parameters",
        arch=dict(vocab_size=400, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=1000000.0)),
    "headdim32_untied": dict(
        seed=303, rope_spelling="rope_theta",
        arch=dict(vocab_size=256, hidden_size=48, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_theta=1000000.0)),
    "mha_tied": dict(
        seed=404, rope_spelling="rope_parameters",
        arch=dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=24, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, rope_theta=500000.0)),
}


def reference_logprobs(model, tokens):
    """log p(tokens[i+1] | tokens[..i]) for i = 0..n-2, in float64, stock HF."""
    if len(tokens) < 2:
        return []
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()     # (n, V)
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, ids[1:, None]).squeeze(1).tolist()


def check_config(args, name, spec):
    """Returns (max abs diff, list of problems)."""
    work = os.path.join(args.out, name)
    model_dir = os.path.join(work, "model")
    in_path = os.path.join(work, "input.jsonl")
    out_path = os.path.join(work, "output.jsonl")
    os.makedirs(work, exist_ok=True)
    arch, seed = spec["arch"], spec["seed"]

    save_model(build_model(arch, seed), model_dir, spec["rope_spelling"])
    gen = torch.Generator().manual_seed(seed + 7)
    sequences = [torch.randint(0, arch["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]
    with open(in_path, "w", encoding="utf-8") as f:
        for tokens in sequences:
            f.write(json.dumps({"tokens": tokens}) + "\n")
    if os.path.exists(out_path):
        os.remove(out_path)

    cmd = [args.lathe, "logprobs", "--model", model_dir, "--input", in_path, "--output", out_path,
           "--device", args.device]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return float("inf"), [f"`{' '.join(cmd)}` exited {run.returncode}:\n{run.stdout}{run.stderr}"]
    with open(out_path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if len(lines) != len(sequences):
        return float("inf"), [f"{len(lines)} output lines for {len(sequences)} inputs"]

    model = load_model(model_dir, double=True)
    worst, problems = 0.0, []
    for i, (tokens, line) in enumerate(zip(sequences, lines)):
        got = line.get("logprobs")
        want = reference_logprobs(model, tokens)
        if not isinstance(got, list) or len(got) != len(want):
            problems.append(f"line {i}: {len(want)} logprobs expected, got "
                            f"{len(got) if isinstance(got, list) else repr(got)}")
            worst = float("inf")
            continue
        for j, (g, w) in enumerate(zip(got, want)):
            d = abs(float(g) - w) if g is not None else float("inf")
            if not d <= args.tol:   # also catches NaN
                problems.append(f"line {i} (length {len(tokens)}) entry {j}: lathe {g}, HF {w:.8f}")
            worst = max(worst, d) if d == d else float("inf")
    return worst, problems


def main():
    parser = argparse.ArgumentParser(description="Check `lathe logprobs` against HF transformers.")
    parser.add_argument("--lathe", required=True, help="path of the lathe binary")
    parser.add_argument("--out", required=True, help="work folder (models, inputs, outputs)")
    parser.add_argument("--device", default="cpu", help="passed to lathe logprobs --device (default cpu)")
    parser.add_argument("--tol", type=float, default=1e-4, help="max abs logprob difference (default 1e-4)")
    args = parser.parse_args()

    overall, failed = 0.0, False
    for name, spec in CONFIGS.items():
        worst, problems = check_config(args, name, spec)
        overall = max(overall, worst)
        failed = failed or bool(problems)
        print(f"{name}: max abs diff {worst:.3e}, {'PASS' if not problems else 'FAIL'}")
        for p in problems[:10]:
            print(f"  {p}")
        if len(problems) > 10:
            print(f"  ... {len(problems) - 10} more")
    print(f"check_logprobs: {len(CONFIGS)} configs, max abs diff {overall:.3e}, {'FAIL' if failed else 'PASS'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
