#!/usr/bin/env python3
"""Writes the golden LoRA fixtures for tests/models/test_lora.cpp: PEFT adapters (random A and B, so every
gradient is non-trivial) on the tiny Qwen3 fixture models, and for each the logits, loss and the gradient of
every LoRA matrix on the same packed batch as the Qwen3 fixtures, computed with transformers + peft.

Run on the GPU machine from the repo root (CPU only; after dev/ref/qwen3_fixtures.py wrote the base models):
    python3 dev/ref/lora_fixtures.py tests/models/fixtures/qwen3 tests/models/fixtures/lora

For each fixture NAME it writes OUT_DIR/NAME/
    adapter/                  adapter_config.json (peft's own save) and adapter_model.safetensors (float32,
                              keys as peft saves them: base_model.model.<module>.lora_A.weight ...)
    reference.safetensors     input_ids, cu_seqlens, position_ids, labels (int32), logits, loss and
                              grad.<adapter key> (float32)
    README.txt                base model, LoRA settings, versions
Golden values are computed in float64 (the Qwen3 fixtures' float64 patches), stored as float32. The script also
checks that peft reloads the written adapter onto the float32 base and reproduces the logits.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_fixtures as q3  # noqa: E402

LORA_STD = 0.1
FIXTURES = {
    "tied_gqa_all_linear": dict(
        base="tied_gqa", seed=101,
        lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"], use_rslora=False),
        about="all seven projections, r=4, alpha=8 (scaling 2)"),
    "untied_mqa_some_rslora": dict(
        base="untied_mqa", seed=202,
        lora=dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_rslora=True),
        about="q, v, o, down only, r=3, alpha=5, rsLoRA (scaling 5/sqrt(3))"),
    "headdim_regex": dict(
        base="headdim_differs", seed=303,
        lora=dict(r=2, lora_alpha=2, target_modules=r".*\.layers\.1\..*(k_proj|up_proj)", use_rslora=False),
        about="regex target: k_proj and up_proj of layer 1 only, r=2, alpha=2"),
}


def peft_model(base_dir, spec, double):
    from peft import LoraConfig, get_peft_model
    model = q3.load_model(base_dir, double=double)
    config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec["lora"])
    return get_peft_model(model, config)


def write_reference(fixture_dir, batch, logits, loss, grads, metadata):
    """fixture_dir/reference.safetensors: the batch (int32), logits, loss and grad.<adapter key> (float32), with the
    library versions added to `metadata`."""
    import peft
    import transformers
    from safetensors.torch import save_file
    tensors = {"input_ids": batch["input_ids"].to(torch.int32), "cu_seqlens": batch["cu_seqlens"].to(torch.int32),
               "position_ids": batch["position_ids"].to(torch.int32), "labels": batch["labels"].to(torch.int32),
               "logits": logits.float(), "loss": loss.reshape(1).float()}
    for k, g in grads.items():
        tensors["grad." + k] = g.float()
    metadata = dict(metadata, transformers=transformers.__version__, peft=peft.__version__, torch=torch.__version__)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(fixture_dir, "reference.safetensors"),
              metadata=metadata)


def adapter_state(model, grads, name):
    """The adapter as peft saves it, in float32; exits unless its keys are exactly the gradients' keys."""
    from peft import get_peft_model_state_dict
    state = {k: v.float().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    if set(state) != set(grads):
        sys.exit(f"{name}: saved keys {sorted(state)[:3]} differ from the gradient keys {sorted(grads)[:3]}")
    return state


def save_adapter(model, state, adapter_dir):
    """adapter_dir/adapter_config.json (peft's own save) and adapter_model.safetensors (`state`)."""
    from safetensors.torch import save_file
    model.peft_config["default"].save_pretrained(adapter_dir)
    save_file(state, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


def key_of(name):
    """peft parameter name -> the key peft saves: drop the adapter name."""
    return name.replace(".default.", ".")


def forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
                        for ids in batch["docs"]])
    labels = batch["labels"]
    loss = F.cross_entropy(logits, labels, ignore_index=q3.IGNORE, reduction="sum") / int((labels != q3.IGNORE).sum())
    loss.backward()
    grads = {key_of(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not grads or any(g is None for g in grads.values()):
        sys.exit("forward_backward: a LoRA parameter got no gradient")
    return logits.detach(), loss.detach(), grads


def write_fixture(base_root, out_dir, name, spec):
    import peft
    import transformers
    from peft import PeftModel

    base_dir = os.path.join(base_root, spec["base"], "model")
    fixture_dir = os.path.join(out_dir, name)
    adapter_dir = os.path.join(fixture_dir, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    ref = q3.load_model(base_dir)
    vocab = ref.config.vocab_size
    batch = q3.make_batch(vocab, q3.FIXTURES[spec["base"]]["seed"])

    q3.set_fp64_patches(True)
    try:
        model = peft_model(base_dir, spec, double=True)
        gen = torch.Generator().manual_seed(spec["seed"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(LORA_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        logits, loss, grads = forward_backward(model, batch)
    finally:
        q3.set_fp64_patches(False)

    # The adapter as peft writes it, in float32.
    save_adapter(model, adapter_state(model, grads, name), adapter_dir)

    # peft reads it back onto the float32 base and gives the same logits.
    reloaded = PeftModel.from_pretrained(q3.load_model(base_dir), adapter_dir).eval()
    with torch.no_grad():
        l32 = torch.cat([reloaded(input_ids=ids[None], use_cache=False).logits[0] for ids in batch["docs"]])
    diff = (l32.double() - logits).abs().max().item()
    if diff > 1e-3:
        sys.exit(f"{name}: peft-reloaded float32 logits differ from the golden float64 ones by {diff:.3g}")

    write_reference(fixture_dir, batch, logits, loss, grads, {"fixture": name, "base": spec["base"]})
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\nbase model: tests/models/fixtures/qwen3/{spec['base']}/model\n")
        f.write(f"LoRA A and B drawn N(0, {LORA_STD}^2) (seed {spec['seed']}); batch and labels as the base fixture\n")
        f.write(f"written by dev/ref/lora_fixtures.py with transformers {transformers.__version__}, peft {peft.__version__}, "
                f"torch {torch.__version__}\n")
    print(f"{name}: loss {loss.item():.6f}, {len(grads)} LoRA grads, peft float32 reload vs golden logits {diff:.2e}")


def main():
    parser = argparse.ArgumentParser(description="Write golden LoRA fixtures (transformers + peft).")
    parser.add_argument("base_root", help="folder of the Qwen3 fixtures, e.g. tests/models/fixtures/qwen3")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/lora")
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    for name, spec in FIXTURES.items():
        write_fixture(args.base_root, args.out_dir, name, spec)


if __name__ == "__main__":
    main()
