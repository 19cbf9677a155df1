#!/usr/bin/env python3
"""Writes the golden LoRA fixtures of the Qwen3.5 family for tests/models/test_lora_qwen3_5.cpp: PEFT adapters
(random A and B, so every gradient is non-trivial) on the qwen3_5 fixture models (Gated DeltaNet in_proj_qkv /
in_proj_z / in_proj_b / in_proj_a / out_proj, gated attention q_proj (query and gate interleaved per head) / k / v /
o_proj, MLP gate / up / down_proj), and for each the logits, loss and the gradient of every LoRA matrix on the
base fixture's packed batch, computed with transformers + peft. One fixture uses the multimodal release layout
(Qwen3_5ForConditionalGeneration, modules model.language_model.layers.N...).

Run on the GPU machine from the repo root (CPU only; after dev/ref/qwen3_5_fixtures.py wrote the base models):
    python3 dev/ref/lora_qwen3_5_fixtures.py tests/models/fixtures/qwen3_5 tests/models/fixtures/lora_qwen3_5

For each fixture NAME it writes OUT_DIR/NAME/
    adapter/                  adapter_config.json (peft's own save) and adapter_model.safetensors (float32,
                              keys as peft saves them: base_model.model.<module>.lora_A.weight ...)
    reference.safetensors     input_ids, cu_seqlens, position_ids, labels (int32, copied from the base fixture's
                              reference.safetensors), logits, loss and grad.<adapter key> (float32)
    README.txt                base model, LoRA settings, versions
Golden values are computed in float64 with qwen3_5_fixtures.py's float64 patches (the GDN forward patch calls the
projection modules, so peft's LoRA layers are in the path), stored as float32. The script checks that every patch
ran, that the saved keys are the gradient keys, that the keys name the layout's modules, and that peft reloads the
written adapter onto the float32 base and reproduces the logits.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_5_fixtures as q35  # noqa: E402
from lora_fixtures import adapter_state, key_of, save_adapter, write_reference  # noqa: E402

LORA_STD = 0.1
ALL12 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# The text stack only (the multimodal class also holds vision-tower linears that short names could reach).
TEXT_ONLY_ALL = (r".*language_model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
                 r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))")
FIXTURES = {
    "hv_gt_hk_all_linear": dict(
        base="hv_gt_hk_untied", seed=101, multimodal=False,
        lora=dict(r=4, lora_alpha=8, target_modules=ALL12, use_rslora=False),
        about="every projection of GDN, attention and MLP layers (12 names), r=4, alpha=8 (scaling 2)"),
    "tied_hd64_some_rslora": dict(
        base="tied_hd64", seed=202, multimodal=False,
        lora=dict(r=3, lora_alpha=5, target_modules=["in_proj_qkv", "in_proj_a", "q_proj", "o_proj", "down_proj"],
                  use_rslora=True),
        about="in_proj_qkv, in_proj_a, q_proj, o_proj, down_proj, r=3, alpha=5, rsLoRA (scaling 5/sqrt(3))"),
    "interval_regex": dict(
        base="interval_legacy_rope", seed=303, multimodal=False,
        lora=dict(r=2, lora_alpha=2, use_rslora=False,
                  target_modules=r".*\.layers\.[01]\.(linear_attn\.(in_proj_z|in_proj_b|out_proj)|self_attn\.(q_proj|v_proj))"),
        about="regex target: in_proj_z, in_proj_b, out_proj of layer 0 (GDN) and q_proj, v_proj of layer 1 "
              "(attention), r=2, alpha=2"),
    "multimodal_all_text": dict(
        base="multimodal_layout", seed=404, multimodal=True,
        lora=dict(r=2, lora_alpha=6, target_modules=TEXT_ONLY_ALL, use_rslora=False),
        about="multimodal release layout (Qwen3_5ForConditionalGeneration): every projection of the text stack "
              "by a regex over model.language_model.layers.N..., r=2, alpha=6"),
}


def die(msg):
    sys.exit(f"lora_qwen3_5_fixtures: {msg}")


def load_base(model_dir, multimodal, double=False):
    if not multimodal:
        return q35.load_model(model_dir, double=double)
    from transformers import Qwen3_5ForConditionalGeneration
    model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    return model.double() if double else model


def read_batch(base_fixture_dir):
    """The base fixture's packed batch, as stored in its reference.safetensors."""
    from safetensors.torch import load_file
    ref = load_file(os.path.join(base_fixture_dir, "reference.safetensors"))
    ids, cu = ref["input_ids"].long(), ref["cu_seqlens"].long()
    docs = [ids[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    return dict(docs=docs, input_ids=ids, cu_seqlens=cu, position_ids=ref["position_ids"].long(),
                labels=ref["labels"].long(), logits=ref["logits"])


def forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
                        for ids in batch["docs"]])
    labels = batch["labels"]
    loss = F.cross_entropy(logits, labels, ignore_index=q35.IGNORE, reduction="sum") / int((labels != q35.IGNORE).sum())
    loss.backward()
    grads = {key_of(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not grads or any(g is None for g in grads.values()):
        die("forward_backward: a LoRA parameter got no gradient")
    return logits.detach(), loss.detach(), grads


def write_fixture(base_root, out_dir, name, spec):
    import peft
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    base_fixture = os.path.join(base_root, spec["base"])
    base_dir = os.path.join(base_fixture, "model")
    fixture_dir = os.path.join(out_dir, name)
    adapter_dir = os.path.join(fixture_dir, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    batch = read_batch(base_fixture)

    for k in q35.PATCH_CALLS:
        q35.PATCH_CALLS[k] = 0
    q35.set_fp64_patches(True)
    try:
        base = load_base(base_dir, spec["multimodal"], double=True)
        config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec["lora"])
        model = get_peft_model(base, config).double()   # the LoRA matrices in float64 as well
        gen = torch.Generator().manual_seed(spec["seed"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(LORA_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        logits, loss, grads = forward_backward(model, batch)
    finally:
        q35.set_fp64_patches(False)
    if min(q35.PATCH_CALLS.values()) == 0:
        die(f"{name}: a float64 patch was never called ({q35.PATCH_CALLS}); update qwen3_5_fixtures.set_fp64_patches()")
    # The base model's goldens come from the same patched path: with the adapter the logits must move.
    moved = (logits - batch["logits"].double()).abs().max().item()
    if moved < 1e-3:
        die(f"{name}: the adapter changed the logits by only {moved:.3g}; is LoRA in the forward path?")

    # The adapter as peft writes it, in float32; its keys name the layout's modules.
    state = adapter_state(model, grads, name)
    prefix = "base_model.model.model.language_model.layers." if spec["multimodal"] else "base_model.model.model.layers."
    odd = [k for k in state if not k.startswith(prefix)]
    if odd:
        die(f"{name}: peft saved keys outside {prefix}*, e.g. {odd[0]} (Lathe adapts the text decoder layers only)")
    save_adapter(model, state, adapter_dir)

    # peft reads it back onto the float32 base and gives the same logits.
    reloaded = PeftModel.from_pretrained(load_base(base_dir, spec["multimodal"]), adapter_dir).eval()
    with torch.no_grad():
        l32 = torch.cat([reloaded(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
                         for ids in batch["docs"]])
    diff = (l32.double() - logits).abs().max().item()
    if diff > 1e-3:
        die(f"{name}: peft-reloaded float32 logits differ from the golden float64 ones by {diff:.3g}")

    write_reference(fixture_dir, batch, logits, loss, grads,
                    {"fixture": name, "base": spec["base"], "compute": "float64 (qwen3_5_fixtures.py patches), stored float32"})
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\nbase model: tests/models/fixtures/qwen3_5/{spec['base']}/model\n")
        f.write(f"adapted module names: {', '.join(modules)} ({len(state) // 2} modules)\n")
        f.write(f"LoRA A and B drawn N(0, {LORA_STD}^2) (seed {spec['seed']}); batch and labels of the base fixture\n")
        f.write(f"written by dev/ref/lora_qwen3_5_fixtures.py with transformers {transformers.__version__}, "
                f"peft {peft.__version__}, torch {torch.__version__}\n")
    print(f"{name}: loss {loss.item():.6f}, {len(grads)} LoRA grads over {json.dumps(modules)}, logits moved {moved:.3g} "
          f"by the adapter, peft float32 reload vs golden logits {diff:.2e}")


def main():
    parser = argparse.ArgumentParser(description="Write golden Qwen3.5 LoRA fixtures (transformers + peft).")
    parser.add_argument("base_root", help="folder of the Qwen3.5 fixtures, e.g. tests/models/fixtures/qwen3_5")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/lora_qwen3_5")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES))
    args = parser.parse_args()
    q35.hf_qwen3_5()
    torch.set_grad_enabled(True)
    for name, spec in FIXTURES.items():
        if not args.only or name in args.only:
            write_fixture(args.base_root, args.out_dir, name, spec)


if __name__ == "__main__":
    main()
