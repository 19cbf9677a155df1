#!/usr/bin/env python3
"""Checks `lathe generate` greedy decoding of qwen3_5 models against Hugging Face transformers' cached generate.

For each model folder (default: the committed text-layout fixtures tests/models/fixtures/qwen3_5/*/model) and a few
token prompts (lengths 1, 5 and 12, seeded), both generate --max-new-tokens (20) tokens greedily, EOS ignored:
    LATHE generate --model DIR --prompt-tokens 1,2,3 --max-new-tokens 20 --print-tokens --ignore-eos \
        --device DEV --dtype DT
    model.generate(ids, do_sample=False, use_cache=True, max_new_tokens=20, eos_token_id=None)
(HF's own caches: the conv state and recurrent state of its GDN layers, a KV cache for the attention layers) and
the token sequences must be identical. HF runs in float64 with eager attention (stock code: some parts of HF's
qwen3_5 compute in float32 even in a float64 model, so logits agree to ~1e-6, not 1e-12); lathe runs in --dtype
(default f64 on cpu, f32 on cuda). Each case also reports the smallest gap between the two largest logits along HF's
path, so a mismatch at a near tie is recognisable, and whether HF's cached tokens equal HF's uncached ones
(use_cache=False), which separates a problem of HF's cache from one of lathe's.
Folders in the multimodal layout (config model_type qwen3_5) are skipped by default: Qwen3_5ForCausalLM loads the
text layout; pass them with --model only if your transformers version loads them.
Prints one line per case and `check_generate_qwen3_5: N cases, PASS|FAIL`; exits 1 on any mismatch or failed run.

Run on the GPU machine from the repo root:
    python3 dev/ref/check_generate_qwen3_5.py --lathe build/lathe [--device cuda] [--dtype f32] [--model DIR ...]
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import torch

PROMPT_LENGTHS = (1, 5, 12)


def load_hf(model_dir):
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model.double()


def hf_greedy(model, prompt, n, use_cache):
    """Greedy tokens and the smallest top-1/top-2 logit gap over the n steps."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             use_cache=use_cache, eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True, temperature=None, top_k=None, top_p=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    gap = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return tokens, gap


def lathe_greedy(args, model_dir, prompt, n):
    cmd = [args.lathe, "generate", "--model", model_dir, "--prompt-tokens", ",".join(map(str, prompt)),
           "--max-new-tokens", str(n), "--print-tokens", "--ignore-eos", "--device", args.device, "--dtype", args.dtype]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None, f"`{' '.join(cmd)}` exited {run.returncode}:\n{run.stdout}{run.stderr}"
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["tokens"], None
    except (IndexError, ValueError, KeyError) as e:
        return None, f"`{' '.join(cmd)}` printed no result line ({e}):\n{run.stdout}"


def model_type(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("model_type")


def main():
    parser = argparse.ArgumentParser(description="Check `lathe generate` on qwen3_5 against HF cached generate.")
    parser.add_argument("--lathe", required=True, help="path of the lathe binary")
    parser.add_argument("--device", default="cpu", help="passed to lathe generate --device (default cpu)")
    parser.add_argument("--dtype", help="passed to lathe generate --dtype (default f64 on cpu, f32 otherwise)")
    parser.add_argument("--model", action="append", help="model folder (repeatable; default: the fixtures)")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    args = parser.parse_args()
    args.dtype = args.dtype or ("f64" if args.device == "cpu" else "f32")

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    models = args.model
    if not models:
        models = []
        for d in sorted(glob.glob(os.path.join(repo, "tests/models/fixtures/qwen3_5/*/model"))):
            if model_type(d) == "qwen3_5_text":
                models.append(d)
            else:
                print(f"{d}: skipped (model_type {model_type(d)}: multimodal layout)")
    if not models:
        sys.exit("check_generate_qwen3_5: no model folders found")
    cases, failed = 0, False
    for model_dir in models:
        path = os.path.normpath(model_dir)
        name = os.path.basename(os.path.dirname(path)) if os.path.basename(path) == "model" else os.path.basename(path)
        model = load_hf(model_dir)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(5)
        for length in PROMPT_LENGTHS:
            prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
            want, gap = hf_greedy(model, prompt, args.max_new_tokens, use_cache=True)
            uncached, _ = hf_greedy(model, prompt, args.max_new_tokens, use_cache=False)
            got, error = lathe_greedy(args, model_dir, prompt, args.max_new_tokens)
            cases += 1
            ok = error is None and got == want
            failed = failed or not ok
            print(f"{name} prompt length {length}: min top-2 gap {gap:.2e}, HF cached == HF uncached: "
                  f"{uncached == want}, {'PASS' if ok else 'FAIL'}")
            if error:
                print(f"  {error}")
            elif not ok:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                print(f"  first difference at step {first}\n  lathe {got}\n  HF    {want}\n  HF (no cache) {uncached}")
    print(f"check_generate_qwen3_5: {cases} cases, {'FAIL' if failed else 'PASS'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
