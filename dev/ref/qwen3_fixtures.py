#!/usr/bin/env python3
"""Writes the golden Qwen3 (dense) fixtures for the model parity tests (DESIGN.md, parity ladder
rung 2): tiny random Qwen3 models and, for each, the logits, loss and every parameter gradient of a
packed batch of three documents, computed with Hugging Face transformers.

Run on the GPU machine from the repo root (CPU only; no network needed):
    python3 dev/ref/qwen3_fixtures.py tests/models/fixtures/qwen3

For each config NAME it writes OUT_DIR/NAME/
    model/                    save_pretrained output (config.json, model.safetensors), float32;
                              config.json's RoPE spelling is rewritten to the one README.txt names
    reference.safetensors     input_ids, cu_seqlens, position_ids, labels (int32), logits, loss and
                              grad.<HF parameter name> (float32)
    README.txt                what the config covers and which RoPE spelling its config.json uses

Packing is done here, not by transformers: each document runs as its own batch-of-one sequence
(positions 0..len-1, no padding, eager attention); logits are concatenated in document order;
loss = sum over documents of the summed cross-entropy at labelled positions / labelled count, and
that one scalar is backpropagated. labels[i] is already the target of position i (next token of the
same document, -100 = ignored), so labels are never passed to the HF model (it would shift again).

Convention: the golden values are computed in float64 and stored as float32, so they are exact to
float32 precision. Stock HF Qwen3 computes RMSNorm, RoPE and the attention softmax in float32 even
in a float64 model; set_fp64_patches() swaps those three for float64 versions while the goldens
are computed, and the script checks that the stock and patched float64 results agree.
"""
import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

DOC_LENGTHS = (7, 12, 5)   # packed batch: T = 24, cu_seqlens = 0, 7, 19, 24
EXTRA_IGNORED = 3          # labelled positions additionally set to -100
INIT_STD = 0.2             # normal std of every matrix (embeddings, projections, lm_head)
NORM_SPREAD = 0.1          # RMSNorm weights uniform in 1 +- NORM_SPREAD
IGNORE = -100

# rope_spelling: how config.json spells RoPE after save_model():
#   "rope_theta"      top-level "rope_theta" plus "rope_scaling": null (released Qwen3 checkpoints,
#                     transformers 4.x)
#   "rope_parameters" "rope_parameters": {"rope_type": "default", "rope_theta": ...} (transformers 5)
FIXTURES = {
    "tied_gqa": dict(
        seed=11, rope_spelling="rope_theta",
        about="tied embeddings, GQA 4 q heads / 2 kv heads, head_dim = hidden/heads = 16, theta 1e4",
        arch=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, rope_theta=10000.0)),
    "untied_mqa": dict(
        seed=22, rope_spelling="rope_parameters",
        about="untied lm_head, MQA 4 q heads / 1 kv head, head_dim = hidden/heads = 12, theta 1e4, eps 1e-5",
        arch=dict(vocab_size=192, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_theta=10000.0)),
    "headdim_differs": dict(
        seed=33, rope_spelling="rope_theta",
        about="untied, head_dim 24 != hidden/heads = 16 (q_proj 64->96), 4 q / 2 kv heads, theta 1e6",
        arch=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=1000000.0)),
    "rope_in_params": dict(
        seed=44, rope_spelling="rope_parameters",
        about="tied, 4 q / 2 kv heads, head_dim 8, theta 1e6 given only inside rope_parameters",
        arch=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, rope_theta=1000000.0)),
}


# ---- model building (shared with check_logprobs.py) ----

def rope_theta_of(config):
    """RoPE theta of a loaded config, whichever spelling transformers normalised it to."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        return float(rp["rope_theta"]), rope_type
    return float(config.rope_theta), "default"


def make_config(arch):
    """Qwen3Config from a dict of architecture fields (rope_theta given as a plain number)."""
    from transformers import Qwen3Config
    arch = dict(arch)
    theta = float(arch.pop("rope_theta"))
    config = Qwen3Config(**arch, hidden_act="silu", attention_bias=False, max_position_embeddings=256,
                         use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    got = rope_theta_of(config)
    if got != (theta, "default"):
        sys.exit(f"make_config: asked for rope theta {theta}, the config holds {got}")
    if config.head_dim != arch["head_dim"]:
        sys.exit(f"make_config: asked for head_dim {arch['head_dim']}, the config holds {config.head_dim}")
    return config


def check_tying(model):
    """Tied configs must share one tensor between embed_tokens and lm_head; untied ones must not."""
    def shared():
        return (model.get_input_embeddings().weight.data_ptr()
                == model.get_output_embeddings().weight.data_ptr())
    tied = bool(model.config.tie_word_embeddings)
    if tied and not shared():
        model.tie_weights()
    if tied != shared():
        sys.exit(f"check_tying: tie_word_embeddings={tied} but lm_head shares embed_tokens: {shared()}")


def init_weights(model, seed):
    """Larger-than-default random weights so that activations and gradients are not tiny."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():   # tied lm_head appears once, as embed_tokens
            if name.endswith("norm.weight"):        # input/post_attention_layernorm, q/k_norm, norm
                r = torch.rand(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(1.0 + NORM_SPREAD * (2.0 * r - 1.0))
            elif p.dim() == 2:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                sys.exit(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")


def build_model(arch, seed):
    """A float32 Qwen3ForCausalLM with eager attention and init_weights() weights."""
    from transformers import AutoModelForCausalLM
    config = make_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    if model.model.embed_tokens.padding_idx is not None:
        sys.exit("build_model: embed_tokens has a padding_idx (its gradient row would be zeroed)")
    check_tying(model)
    init_weights(model, seed)
    return model


def load_model(model_dir, double=False):
    """from_pretrained in float32, eager attention, eval mode; float64 copy if double."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    check_tying(model)
    if model.config._attn_implementation != "eager":
        sys.exit(f"load_model: attention implementation is {model.config._attn_implementation}, not eager")
    return model.double() if double else model


def save_model(model, model_dir, rope_spelling):
    """save_pretrained, then rewrite config.json's RoPE fields to exactly one spelling.

    transformers 5 dropped save_pretrained's safe_serialization argument (safetensors is the only
    format), and 4.x defaults it to True, so it is not passed."""
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    model.save_pretrained(model_dir)
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    theta, rope_type = rope_theta_of(model.config)
    assert rope_type == "default", rope_type
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        config.pop(key, None)
    if rope_spelling == "rope_theta":
        config["rope_theta"] = theta
        config["rope_scaling"] = None
    elif rope_spelling == "rope_parameters":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        raise ValueError(rope_spelling)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    weights = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if weights != ["model.safetensors"]:
        sys.exit(f"save_model: expected one model.safetensors in {model_dir}, found {weights}")


# ---- float64 versions of the parts stock HF Qwen3 computes in float32 ----

PATCH_CALLS = {"rms_norm": 0, "rotary": 0, "attention": 0}
_ORIGINALS = {}


def _rms_norm_fp64(self, x):
    PATCH_CALLS["rms_norm"] += 1
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


@torch.no_grad()
def _rotary_fp64(self, x, position_ids, **kwargs):
    PATCH_CALLS["rotary"] += 1
    theta, rope_type = rope_theta_of(self.config)
    assert rope_type == "default" and self.attention_scaling == 1.0, (rope_type, self.attention_scaling)
    dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]   # (B, S, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _eager_attention_fp64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    PATCH_CALLS["attention"] += 1
    from transformers.models.qwen3.modeling_qwen3 import repeat_kv
    key = repeat_kv(key, module.num_key_value_groups)       # (B, H, S, D)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    scores = scores.masked_fill(~causal, float("-inf"))     # causal even if HF passed no mask
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :k_len]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def set_fp64_patches(enabled):
    from transformers.models.qwen3 import modeling_qwen3 as mq
    if not _ORIGINALS:
        _ORIGINALS.update(rms_norm=mq.Qwen3RMSNorm.forward, rotary=mq.Qwen3RotaryEmbedding.forward,
                          attention=mq.eager_attention_forward)
    mq.Qwen3RMSNorm.forward = _rms_norm_fp64 if enabled else _ORIGINALS["rms_norm"]
    mq.Qwen3RotaryEmbedding.forward = _rotary_fp64 if enabled else _ORIGINALS["rotary"]
    mq.eager_attention_forward = _eager_attention_fp64 if enabled else _ORIGINALS["attention"]


# ---- the packed batch and its reference ----

def make_batch(vocab_size, seed):
    """Three random documents packed; labels = next token in the same document, some ignored."""
    gen = torch.Generator().manual_seed(seed + 1000)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in DOC_LENGTHS]
    cu_seqlens = [0]
    for n in DOC_LENGTHS:
        cu_seqlens.append(cu_seqlens[-1] + n)
    labels = []
    for d in docs:
        lab = torch.full_like(d, IGNORE)
        lab[:-1] = d[1:]
        labels.append(lab)
    labels = torch.cat(labels)
    labelled = (labels != IGNORE).nonzero().flatten()
    labels[labelled[torch.randperm(len(labelled), generator=gen)[:EXTRA_IGNORED]]] = IGNORE
    return dict(docs=docs,
                input_ids=torch.cat(docs),                                          # (T,)
                cu_seqlens=torch.tensor(cu_seqlens),                                # (docs+1,)
                position_ids=torch.cat([torch.arange(n) for n in DOC_LENGTHS]),     # (T,)
                labels=labels)                                                      # (T,)


def packed_forward_backward(model, batch):
    """(logits (T, V), loss, {param name: grad}) of the packed batch, one document at a time."""
    model.zero_grad(set_to_none=True)
    logits = []
    for ids in batch["docs"]:
        out = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False)
        logits.append(out.logits[0])                                                # (len, V)
    logits = torch.cat(logits)                                                      # (T, V)
    labels = batch["labels"]
    count = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") / count
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            sys.exit(f"packed_forward_backward: {name} got no gradient")
        grads[name] = p.grad.detach().clone()
    return logits.detach(), loss.detach(), grads


def max_rel_grad_diff(a, b):
    """Largest over parameters of max|a - b| / max|b|."""
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30))
               for k in b)


def write_fixture(out_dir, name, spec):
    import transformers
    from safetensors.torch import save_file

    fixture_dir = os.path.join(out_dir, name)
    model_dir = os.path.join(fixture_dir, "model")
    os.makedirs(fixture_dir, exist_ok=True)
    arch, seed = spec["arch"], spec["seed"]

    built = build_model(arch, seed)
    save_model(built, model_dir, spec["rope_spelling"])
    batch = make_batch(arch["vocab_size"], seed)

    # The folder as transformers reads it must be the model we built: same weights, same theta.
    model32 = load_model(model_dir)
    if rope_theta_of(model32.config) != (float(arch["rope_theta"]), "default"):
        sys.exit(f"{name}: reloaded config has rope {rope_theta_of(model32.config)}, wrote {arch['rope_theta']}")
    built_sd, loaded_sd = built.state_dict(), model32.state_dict()
    if set(built_sd) != set(loaded_sd) or any(not torch.equal(built_sd[k], loaded_sd[k]) for k in built_sd):
        sys.exit(f"{name}: weights reloaded from {model_dir} differ from the saved model")
    with torch.no_grad():
        ids = batch["docs"][1]
        diff = (built(input_ids=ids[None], use_cache=False).logits
                - model32(input_ids=ids[None], use_cache=False).logits).abs().max().item()
    if diff > 1e-6:
        sys.exit(f"{name}: reloaded model's logits differ from the built model's by {diff:.3g} "
                 "(config.json rewrite misread?)")

    # Golden values: float64 throughout (patched), then stock float64 and stock float32 as checks.
    for k in PATCH_CALLS:
        PATCH_CALLS[k] = 0
    set_fp64_patches(True)
    try:
        logits, loss, grads = packed_forward_backward(load_model(model_dir, double=True), batch)
    finally:
        set_fp64_patches(False)
    if min(PATCH_CALLS.values()) == 0:
        sys.exit(f"{name}: a float64 patch was never called ({PATCH_CALLS}); transformers' Qwen3 "
                 "internals changed, update set_fp64_patches()")
    stock_logits, stock_loss, stock_grads = packed_forward_backward(load_model(model_dir, double=True), batch)
    stock_diff = (stock_logits - logits).abs().max().item()
    stock_grad = max_rel_grad_diff(stock_grads, grads)
    if stock_diff > 1e-4 or stock_grad > 1e-4:
        sys.exit(f"{name}: stock HF float64 disagrees with the patched float64 reference: logits "
                 f"{stock_diff:.3g}, grads (rel) {stock_grad:.3g}")
    f32_logits, f32_loss, f32_grads = packed_forward_backward(model32, batch)

    tensors = {
        "input_ids": batch["input_ids"].to(torch.int32),
        "cu_seqlens": batch["cu_seqlens"].to(torch.int32),
        "position_ids": batch["position_ids"].to(torch.int32),
        "labels": batch["labels"].to(torch.int32),
        "logits": logits.float(),
        "loss": loss.reshape(1).float(),
    }
    for pname, g in grads.items():
        tensors["grad." + pname] = g.float()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    metadata = {"config": name, "rope_spelling": spec["rope_spelling"], "seed": str(seed),
                "compute": "float64 (RMSNorm, RoPE, softmax patched to float64), stored float32",
                "transformers": transformers.__version__, "torch": torch.__version__}
    save_file(tensors, os.path.join(fixture_dir, "reference.safetensors"), metadata=metadata)

    theta = float(arch["rope_theta"])
    spelling = ('top-level "rope_theta": %r with "rope_scaling": null (released Qwen3 checkpoints)' % theta
                if spec["rope_spelling"] == "rope_theta" else
                '"rope_parameters": {"rope_type": "default", "rope_theta": %r}, no top-level rope_theta' % theta)
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\n")
        f.write(f"rope spelling in model/config.json: {spelling}\n")
        f.write(f"documents {list(DOC_LENGTHS)} packed (T = {sum(DOC_LENGTHS)}); labels = next token in the "
                f"document, -100 at each document's last token and {EXTRA_IGNORED} random others\n")
        f.write(f"written by dev/ref/qwen3_fixtures.py (seed {seed}) with transformers "
                f"{transformers.__version__}, torch {torch.__version__}; see dev/ref/README.md\n")

    size = sum(os.path.getsize(os.path.join(d, fn)) for d, _, fns in os.walk(fixture_dir) for fn in fns)
    print(f"{name}: loss {loss.item():.6f}, max |logit| {logits.abs().max().item():.4f}, "
          f"{int((batch['labels'] != IGNORE).sum())} labelled, {len(grads)} grads, {size / 1e6:.2f} MB; "
          f"stock-fp64 vs golden: logits {stock_diff:.2e}, grads(rel) {stock_grad:.2e}; "
          f"fp32 vs golden: logits {(f32_logits.double() - logits).abs().max().item():.2e}, "
          f"loss {abs(f32_loss.item() - loss.item()):.2e}, grads(rel) {max_rel_grad_diff(f32_grads, grads):.2e}")


def main():
    parser = argparse.ArgumentParser(description="Write golden Qwen3 fixtures (logits, loss, grads) from HF.")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/qwen3")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="write only these configs")
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    for name, spec in FIXTURES.items():
        if not args.only or name in args.only:
            write_fixture(args.out_dir, name, spec)


if __name__ == "__main__":
    main()
