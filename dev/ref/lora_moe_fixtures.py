#!/usr/bin/env python3
"""Writes the golden LoRA fixtures of the mixture-of-experts families for tests/models/test_lora_moe.cpp: PEFT
adapters (random A and B) on the tiny MoE fixture models of moe_fixtures.py, targeting attention / GDN projections,
dense and shared-expert MLPs (target_modules) and the routed experts' fused parameters (target_parameters, peft's
ParamWrapper), and for each the logits, loss and the gradient of every LoRA matrix on the base fixture's packed batch,
computed with transformers + peft.

Run on the GPU machine from the repo root (CPU only; after dev/ref/moe_fixtures.py wrote the base models):
    python3 dev/ref/lora_moe_fixtures.py tests/models/fixtures/moe tests/models/fixtures/lora_moe

For each fixture NAME it writes OUT_DIR/NAME/
    adapter/                  adapter_config.json (peft's own save) and adapter_model.safetensors (float32, the keys
                              peft saves; the experts' wrappers nest, see README.txt for the keys and shapes)
    reference.safetensors     input_ids, cu_seqlens, position_ids, labels (int32), logits, loss and
                              grad.<adapter key> (float32)
    README.txt                base model, LoRA settings, the expert keys with their shapes, routing margins, versions
The loss is the cross-entropy only (no load-balancing term). Golden values are computed in float64 (moe_fixtures.py's
float64 patches), stored as float32. The script checks
  - peft's delta of every expert wrapper against the layout Lathe reads (docs/lora.md): for a parameter (E, out, in)
    used as F.linear(x, W[e]) (transformers 5's experts),
        lora_A (r E, in): A_e = rows e r .. e r + r - 1 (expert-major),
        lora_B (out, r E): B_e = columns j E + e, j = 0 .. r - 1 (expert-minor),
        delta[e] (out, in) = scaling B_e A_e,
  - that the adapter moves the logits, that every token's k-th and (k+1)-th router probabilities still differ by more
    than moe_fixtures.TOPK_GAP with the adapter applied (so float32 engines route as the golden run; the adapter is
    redrawn, seed + 1000 each time, up to MAX_DRAWS times), and
  - that peft reloads the written adapter onto the float32 base and reproduces the logits.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_fixtures as mfx  # noqa: E402
import qwen3_fixtures as q3  # noqa: E402
from lora_fixtures import adapter_state, key_of, save_adapter, write_reference  # noqa: E402
from lora_qwen3_5_fixtures import read_batch  # noqa: E402

LORA_STD = 0.1
MAX_DRAWS = 8  # adapter draws tried per fixture before giving up on the routing margin
FIXTURES = {
    "qwen3_moe_experts": dict(
        base="qwen3_moe_fused", seed=601,
        lora=dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  use_rslora=False),
        about="qwen3_moe (fused checkpoint, expert 4 of layer 1 gets no token): q, o and gate/up/down_proj, which peft "
              "0.21 converts for this model type into the experts' gate_up_proj (rank 4, alpha 8) and down_proj "
              "(two nested ParamWrappers; the dense layers' MLPs are left alone); r=2, alpha=4"),
    "qwen3_5_moe_shared": dict(
        base="qwen3_5_moe", seed=602,
        lora=dict(r=3, lora_alpha=6, target_modules=["in_proj_qkv", "out_proj", "q_proj", "v_proj", "gate_proj",
                                                     "up_proj", "down_proj"],
                  target_parameters=["experts.down_proj"], use_rslora=True),
        about="qwen3_5_moe_text: GDN in_proj_qkv and out_proj, attention q and v, the shared expert's gate/up/down "
              "(by suffix), and the experts' down_proj only (one ParamWrapper); r=3, alpha=6, rsLoRA"),
    "qwen3_next_gate_up": dict(
        base="qwen3_next", seed=603,
        lora=dict(r=2, lora_alpha=2, target_modules=["in_proj_qkvz", "in_proj_ba", "k_proj"],
                  target_parameters=["mlp.experts.gate_up_proj"], use_rslora=False),
        about="qwen3_next (per-expert checkpoint): the fused GDN in_proj_qkvz / in_proj_ba, attention k, and the "
              "experts' gate_up_proj only; r=2, alpha=2"),
}


def die(msg):
    sys.exit(f"lora_moe_fixtures: {msg}")


def run_docs(model, batch):
    return torch.cat([model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
                      for ids in batch["docs"]])


def forward_backward(model, batch, router_cls, top_k):
    """Logits, cross-entropy loss, LoRA gradients, and the smallest top-k margin of any router call."""
    margins = []

    def hook(module, args, output):
        margins.append(float(mfx.topk_gaps(output[0].detach(), top_k).min()))
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router_cls)]
    try:
        model.zero_grad(set_to_none=True)
        logits = run_docs(model, batch)
        labels = batch["labels"]
        loss = F.cross_entropy(logits, labels, ignore_index=q3.IGNORE, reduction="sum") / int((labels != q3.IGNORE).sum())
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not margins:
        die("no router call was observed")
    grads = {key_of(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not grads or any(g is None for g in grads.values()):
        die("forward_backward: a LoRA parameter got no gradient")
    return logits.detach(), loss.detach(), grads, min(margins)


def check_expert_wrappers(model):
    """Every ParamWrapper's delta against the layout Lathe reads; returns README lines (key, shapes)."""
    from peft.tuners.lora.layer import ParamWrapper
    lines = []
    for name, m in model.named_modules():
        if not isinstance(m, ParamWrapper):
            continue
        param = m.get_param()
        e, d_out, d_in = param.shape
        a = m.lora_A["default"].weight.detach()
        b = m.lora_B["default"].weight.detach()
        r = m.r["default"]
        if a.shape != (r * e, d_in) or b.shape != (d_out, r * e):
            die(f"{name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} for a parameter {tuple(param.shape)}")
        want = torch.stack([m.scaling["default"] * b[:, [j * e + i for j in range(r)]] @ a[i * r:(i + 1) * r]
                            for i in range(e)])
        got = m.get_delta_weight("default").detach()
        if (got - want).abs().max() > 1e-12 * max(1.0, float(want.abs().max())):
            die(f"{name} ({m.parameter_name}): peft's delta differs from the layout Lathe reads")
        lines.append(f"  {key_of(name)}.lora_A.weight {tuple(a.shape)} / lora_B.weight {tuple(b.shape)}: "
                     f"{m.parameter_name} {tuple(param.shape)}, r {r}, scaling {m.scaling['default']}")
    return lines


def write_fixture(base_root, out_dir, name, spec):
    import peft
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    base_fixture = os.path.join(base_root, spec["base"])
    base_dir = os.path.join(base_fixture, "model")
    family = mfx.FIXTURES[spec["base"]]["family"]
    fam = mfx.FAMILIES[family]
    router_cls = getattr(mfx.hf_module(fam), fam["router"])
    fixture_dir = os.path.join(out_dir, name)
    adapter_dir = os.path.join(fixture_dir, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    batch = read_batch(base_fixture)

    # Adapters are drawn until every token's routing keeps its margin (seed, seed + 1000, ...).
    for attempt in range(MAX_DRAWS):
        seed = spec["seed"] + 1000 * attempt
        mfx.PATCH_CALLS.clear()
        mfx.set_fp64_patches(fam, True)
        try:
            base = mfx.load_model(fam, base_dir, double=True)
            config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec["lora"])
            model = get_peft_model(base, config).double()
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(LORA_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            wrappers = check_expert_wrappers(model)
            logits, loss, grads, margin = forward_backward(model, batch, router_cls, base.config.num_experts_per_tok)
        finally:
            mfx.set_fp64_patches(fam, False)
        if not mfx.PATCH_CALLS or min(mfx.PATCH_CALLS.values()) == 0:
            die(f"{name}: a float64 patch was never called ({mfx.PATCH_CALLS})")
        if margin > mfx.TOPK_GAP:
            break
        print(f"{name}: seed {seed}: a token's top-k margin is {margin:.3g} <= {mfx.TOPK_GAP}; drawing again")
    else:
        die(f"{name}: no draw of {MAX_DRAWS} keeps every top-k margin above {mfx.TOPK_GAP}")
    if not wrappers:
        die(f"{name}: target_parameters wrapped no expert parameter")
    moved = (logits - batch["logits"].double()).abs().max().item()
    if moved < 1e-3:
        die(f"{name}: the adapter changed the logits by only {moved:.3g}; is LoRA in the forward path?")

    state = adapter_state(model, grads, name)
    save_adapter(model, state, adapter_dir)

    reloaded = PeftModel.from_pretrained(mfx.load_model(fam, base_dir), adapter_dir).eval()
    with torch.no_grad():
        l32 = run_docs(reloaded, batch)
    diff = (l32.double() - logits).abs().max().item()
    if diff > 1e-3:
        die(f"{name}: peft-reloaded float32 logits differ from the golden float64 ones by {diff:.3g}")

    write_reference(fixture_dir, batch, logits, loss, grads,
                    {"fixture": name, "base": spec["base"], "compute": "float64 (moe_fixtures.py patches), stored float32"})
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\nbase model: tests/models/fixtures/moe/{spec['base']}/model\n")
        saved = model.peft_config["default"]
        f.write(f"asked: {spec['lora']}\nas peft applied it: target_modules {sorted(saved.target_modules or [])}, "
                f"target_parameters {sorted(saved.target_parameters or [])}, rank_pattern {saved.rank_pattern}, "
                f"alpha_pattern {saved.alpha_pattern}: {len(state) // 2} A/B pairs\n")
        f.write("expert wrappers (saved key, shapes, parameter):\n" + "\n".join(wrappers) + "\n")
        f.write(f"smallest top-k router margin with the adapter: {margin:.3g} (> {mfx.TOPK_GAP})\n")
        f.write(f"LoRA A and B drawn N(0, {LORA_STD}^2) (seed {seed}); batch and labels of the base fixture\n")
        f.write(f"written by dev/ref/lora_moe_fixtures.py with transformers {transformers.__version__}, "
                f"peft {peft.__version__}, torch {torch.__version__}\n")
    print(f"{name}: loss {loss.item():.6f}, {len(grads)} LoRA grads, logits moved {moved:.3g}, margin {margin:.3g}, "
          f"peft float32 reload vs golden logits {diff:.2e}")
    print("\n".join(wrappers))


def main():
    parser = argparse.ArgumentParser(description="Write golden MoE LoRA fixtures (transformers + peft).")
    parser.add_argument("base_root", help="folder of the MoE fixtures, e.g. tests/models/fixtures/moe")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/lora_moe")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES))
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    for name, spec in FIXTURES.items():
        if not args.only or name in args.only:
            write_fixture(args.base_root, args.out_dir, name, spec)


if __name__ == "__main__":
    main()
