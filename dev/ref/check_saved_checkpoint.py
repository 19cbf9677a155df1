#!/usr/bin/env python3
"""Checks that a model folder written by Lathe's saver loads in Hugging Face transformers and is the
same model as a reference HF folder (usually the one Lathe loaded from).

    python3 dev/ref/check_saved_checkpoint.py --model SAVED_DIR [--reference ORIGINAL_DIR]

Both folders are loaded with AutoModelForCausalLM (float32, eager attention). With --reference it
fails unless: loading the saved folder reports no missing, unexpected or mismatched keys beyond
those the reference itself reports; the architecture fields of the two configs agree; every
state-dict tensor is bit-identical (same names, shapes, dtypes, values); and the logits of a fixed
random token sequence differ by less than --tol (1e-5). Without --reference it only checks that
the folder loads and gives finite logits. Prints PASS or FAIL and exits 0 or 1.
"""
import argparse
import sys

import torch

CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                 "tie_word_embeddings", "attention_bias", "max_position_embeddings", "use_sliding_window",
                 "bos_token_id", "eos_token_id")


def rope_of(config):
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"]), rp.get("rope_type", rp.get("type", "default"))
    return float(getattr(config, "rope_theta", float("nan"))), "default"


def load(path):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    return model.eval(), info


def loading_problems(info):
    """Set of 'kind: key' strings from from_pretrained's loading info."""
    out = set()
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        items = info.get(kind) if isinstance(info, dict) else getattr(info, kind, None)
        for item in items or []:
            out.add(f"{kind}: {item}")
    return out


def logits_of(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens[None], use_cache=False).logits[0]            # (S, V)


def main():
    parser = argparse.ArgumentParser(description="Check a Lathe-saved HF folder against a reference folder.")
    parser.add_argument("--model", required=True, help="folder written by Lathe's saver")
    parser.add_argument("--reference", help="original HF folder to compare with")
    parser.add_argument("--length", type=int, default=32, help="token sequence length (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-5, help="max abs logit difference (default 1e-5)")
    args = parser.parse_args()

    problems = []
    model, info = load(args.model)
    config = model.config
    length = min(args.length, config.max_position_embeddings)
    tokens = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(args.seed))
    logits = logits_of(model, tokens)
    if not torch.isfinite(logits).all():
        problems.append("logits of the saved model are not all finite")

    if args.reference:
        ref, ref_info = load(args.reference)
        for p in sorted(loading_problems(info) - loading_problems(ref_info)):
            problems.append(f"loading {args.model}: {p}")

        for field in CONFIG_FIELDS:
            a, b = getattr(config, field, None), getattr(ref.config, field, None)
            if a != b:
                problems.append(f"config.{field}: saved {a!r}, reference {b!r}")
        if rope_of(config) != rope_of(ref.config):
            problems.append(f"rope (theta, type): saved {rope_of(config)}, reference {rope_of(ref.config)}")

        sd, ref_sd = model.state_dict(), ref.state_dict()
        for k in sorted(set(sd) ^ set(ref_sd)):
            problems.append(f"state dict key only in {'saved' if k in sd else 'reference'}: {k}")
        identical = 0
        for k in sorted(set(sd) & set(ref_sd)):
            a, b = sd[k], ref_sd[k]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{k}: saved {a.dtype} {tuple(a.shape)}, reference {b.dtype} {tuple(b.shape)}")
            elif not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item()
                problems.append(f"{k}: values differ (max abs diff {diff:.3g})")
            else:
                identical += 1
        print(f"state dict: {identical}/{len(ref_sd)} reference tensors bit-identical")

        ref_logits = logits_of(ref, tokens)
        if logits.shape != ref_logits.shape:
            problems.append(f"logits shape: saved {tuple(logits.shape)}, reference {tuple(ref_logits.shape)}")
        else:
            diff = (logits.double() - ref_logits.double()).abs().max().item()
            print(f"logits ({length} tokens): max abs diff {diff:.3e} (tol {args.tol:g})")
            if not diff < args.tol:
                problems.append(f"logits differ by {diff:.3e} >= {args.tol:g}")

    for p in problems:
        print(f"  {p}")
    print(f"check_saved_checkpoint: {args.model}: {'FAIL' if problems else 'PASS'}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
