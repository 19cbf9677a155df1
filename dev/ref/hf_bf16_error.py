#!/usr/bin/env python3
"""Measures transformers' own error on the fixtures of tests/models/fixtures/qwen3_5 or .../moe: the stock HF model
of the fixture's model_type (AutoModelForCausalLM) loaded in bfloat16 (and, as a check of this script, float32) on one
device, run on the fixture's packed batch exactly as the fixture scripts ran it (one document at a time, positions
0..len-1, summed cross-entropy on float logits / labelled count, one backward; no aux loss), compared with the float64
goldens by the relative L2 error that tests/models/test_qwen3_5_cuda.cpp and test_moe_cuda.cpp use: logits, loss,
every parameter gradient (`grad.*`, mean and worst). These figures are the honest yardstick for lathe's bf16 bounds.

Run on the GPU machine from the repo root (no network needed):
    python3 dev/ref/hf_bf16_error.py tests/models/fixtures/qwen3_5 [--device cuda]
    python3 dev/ref/hf_bf16_error.py tests/models/fixtures/moe

Prints one JSON line per fixture and dtype, with the GDN code path transformers took (flash-linear-attention or
the torch fallbacks, which compute the GDN core in float32 even in a bf16 model) and the dtype A_log was loaded in.
The multimodal_layout fixture holds the weights of another fixture in the release layout (Qwen3_5ForCausalLM does
not load it); it is skipped.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

IGNORE = -100


def rel_l2(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def code_path():
    try:
        from transformers.utils import is_flash_linear_attention_available
        fla = bool(is_flash_linear_attention_available())
    except Exception as e:  # noqa: BLE001
        fla = f"unknown ({e})"
    try:
        import causal_conv1d  # noqa: F401
        conv = True
    except ImportError:
        conv = False
    return {"flash_linear_attention_available": fla, "causal_conv1d_installed": conv}


def measure(fixture, dtype, device):
    from transformers import AutoModelForCausalLM
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(fixture, "model"), dtype=dtype,
                                               attn_implementation="eager").to(device).eval()
    ids = ref["input_ids"].long().to(device)
    cu = ref["cu_seqlens"].long().tolist()
    labels = ref["labels"].long().to(device)
    model.zero_grad(set_to_none=True)
    logits = []
    for s, e in zip(cu[:-1], cu[1:]):
        out = model(input_ids=ids[s:e][None], position_ids=torch.arange(e - s, device=device)[None], use_cache=False)
        logits.append(out.logits[0])
    logits = torch.cat(logits)
    count = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum") / count
    loss.backward()
    params = dict(model.named_parameters())
    errs = {}
    for key in ref:
        if not key.startswith("grad."):
            continue
        name = key[len("grad."):]
        if name not in params or params[name].grad is None:
            raise SystemExit(f"{fixture}: no HF gradient for {name}")
        errs[name] = rel_l2(params[name].grad, ref[key])
    worst = max(errs, key=errs.get)
    a_log = next((p for n, p in params.items() if n.endswith("A_log")), None)
    return {"fixture": os.path.basename(fixture), "dtype": str(dtype).replace("torch.", ""), "device": device,
            "logits_rel_l2": rel_l2(logits.detach(), ref["logits"]), "loss": loss.item(), "loss_golden": ref["loss"].item(),
            "grad_rel_l2_mean": sum(errs.values()) / len(errs), "grad_rel_l2_worst": errs[worst], "worst": worst,
            "A_log_dtype": str(a_log.dtype).replace("torch.", "") if a_log is not None else None,
            "model": type(model).__name__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fixtures")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    import transformers
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__, "card": card,
                      "code_path": code_path()}))
    for name in sorted(os.listdir(args.fixtures)):
        fixture = os.path.join(args.fixtures, name)
        if not os.path.isdir(fixture) or name == "multimodal_layout":
            continue
        for dtype in (torch.bfloat16, torch.float32):
            print(json.dumps(measure(fixture, dtype, args.device)), flush=True)


if __name__ == "__main__":
    main()
