#!/usr/bin/env python3
"""Writes the golden Qwen3.5 (text) fixtures for tests/models/test_qwen3_5.cpp (DESIGN.md, parity ladder rung 2):
tiny random qwen3_5_text models mixing Gated DeltaNet ("linear_attention") and gated full-attention layers and, for
each, the logits, loss and every parameter gradient of a packed batch of three documents, computed with Hugging
Face transformers (Qwen3_5ForCausalLM). One more fixture holds the same weights in the multimodal release layout
(model.language_model.*, a text_config-nested config.json, a dummy vision tensor and an MTP tensor).

Run on the GPU machine from the repo root (CPU only; no network needed):
    python3 dev/ref/qwen3_5_fixtures.py tests/models/fixtures/qwen3_5

For each config NAME it writes OUT_DIR/NAME/
    model/                  config.json (rope fields rewritten to the spelling README.txt names) and
                            model.safetensors, float32
    reference.safetensors   input_ids, cu_seqlens, position_ids, labels (int32), logits, loss and
                            grad.<HF parameter name> (float32)
    README.txt              what the config covers, the code path transformers took, versions

Packing is done here, not by transformers: each document runs as its own batch-of-one sequence (positions
0..len-1, no padding, no cache), logits are concatenated, loss = summed cross-entropy at labelled positions /
labelled count, one backward (the helpers of qwen3_fixtures.py).

Numerics: goldens are computed in float64 and stored as float32. Stock HF qwen3_5 computes several parts in
float32 even in a float64 model: the zero-centred RMSNorm and the gated RMSNorm (x.float()), the softmax of eager
attention, the log-decay g (a.float()), and the GDN core torch_chunk_gated_delta_rule / causal_conv1d_fn fallbacks
(they cast q, k, v, g, beta to float32). set_fp64_patches() swaps those for float64 versions written from the HF
code (the GDN core as the plain token-by-token recurrence, the same maths as the chunked form) while the goldens
are computed; the script exits if a patch is never called or if stock float64 HF disagrees with the patched
result by more than 1e-4. Without flash-linear-attention (a CPU run) stock HF takes the torch fallbacks; the code
path found is printed and written to README.txt.
"""
import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen3_fixtures import (DOC_LENGTHS, EXTRA_IGNORED, IGNORE, check_tying, make_batch,  # noqa: E402
                            max_rel_grad_diff, packed_forward_backward)

INIT_STD = 0.2      # normal std of every matrix
CONV_STD = 0.3      # normal std of the depthwise conv taps
NORM_SPREAD = 0.1   # zero-centred norm weights uniform in +-NORM_SPREAD; gated norm weights in 1 +- NORM_SPREAD

# rope_spelling of config.json: "rope_parameters" = {"rope_type", "rope_theta", "partial_rotary_factor"} inside
# rope_parameters (transformers 5, released Qwen3.5); "legacy" = top-level rope_theta and partial_rotary_factor.
FIXTURES = {
    "hv_gt_hk_untied": dict(
        seed=101, rope_spelling="rope_parameters",
        about="untied; layers linear, linear, linear, full; GDN H_k 2 / H_v 4 (H_v > H_k), d_k 16, d_v 12, conv 4; "
              "attention 4 q / 2 kv heads, head_dim 32, partial rotary 0.25 (8 channels), theta 1e4",
        arch=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, rope_theta=10000.0, partial_rotary_factor=0.25)),
    "tied_hd64": dict(
        seed=202, rope_spelling="rope_parameters",
        about="tied; layers full, linear, linear, full; GDN H_k = H_v = 2, d_k = d_v = 8, conv 3; attention 2 q / "
              "1 kv head, head_dim 64, partial rotary 0.25 (16 channels), theta 1e6, eps 1e-5",
        arch=dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                  layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=3,
                  tie_word_embeddings=True, rope_theta=1000000.0, partial_rotary_factor=0.25)),
    "interval_legacy_rope": dict(
        seed=303, rope_spelling="legacy",
        about="untied; no layer_types, full_attention_interval 2 (linear, full, linear, full); GDN H_k 1 / H_v 3, "
              "d_k 12, d_v 8, conv 4; attention 2 q / 2 kv heads, head_dim 16, partial rotary 0.5; top-level "
              "rope_theta 1e4 and partial_rotary_factor",
        arch=dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  full_attention_interval=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, rope_theta=10000.0, partial_rotary_factor=0.5)),
}
# Same weights and goldens as its twin, written in the multimodal release layout.
MULTIMODAL = {"multimodal_layout": "hv_gt_hk_untied"}


def die(msg):
    sys.exit(f"qwen3_5_fixtures: {msg}")


def hf_qwen3_5():
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: F401
    except ImportError as e:
        die(f"transformers has no qwen3_5 model ({e}); transformers >= 5.x with models/qwen3_5 is needed")
    return mq


# ---- model building ----

def make_config(arch):
    """Qwen3_5TextConfig from a dict of architecture fields."""
    from transformers import Qwen3_5TextConfig
    arch = dict(arch)
    theta = float(arch.pop("rope_theta"))
    factor = float(arch.pop("partial_rotary_factor"))
    config = Qwen3_5TextConfig(**arch, hidden_act="silu", attention_bias=False, max_position_embeddings=256,
                               rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                "partial_rotary_factor": factor})
    rp = config.rope_parameters
    if rp.get("rope_theta") != theta or rp.get("partial_rotary_factor", 1.0) != factor:
        die(f"make_config: asked for theta {theta}, partial {factor}; the config holds {rp}")
    want = arch.get("layer_types") or ["full_attention" if (i + 1) % arch["full_attention_interval"] == 0
                                       else "linear_attention" for i in range(arch["num_hidden_layers"])]
    if list(config.layer_types) != want:
        die(f"make_config: layer_types {config.layer_types}, expected {want}")
    if config.head_dim != arch["head_dim"]:
        die(f"make_config: head_dim {config.head_dim}, expected {arch['head_dim']}")
    return config


def init_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

    with torch.no_grad():
        for name, p in model.named_parameters():   # a tied lm_head appears once, as embed_tokens
            if name.endswith("linear_attn.norm.weight"):               # gated norm: plain weight
                p.copy_(uniform(p.shape, 1.0 - NORM_SPREAD, 1.0 + NORM_SPREAD))
            elif name.endswith("norm.weight"):                          # zero-centred norms (1 + w)
                p.copy_(uniform(p.shape, -NORM_SPREAD, NORM_SPREAD))
            elif name.endswith("A_log"):
                p.copy_(uniform(p.shape, 0.1, 2.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(uniform(p.shape, 0.5, 1.5))
            elif name.endswith("conv1d.weight"):
                p.copy_(CONV_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() == 2:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                die(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")


def build_model(arch, seed):
    from transformers import AutoModelForCausalLM
    config = make_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    if type(model).__name__ != "Qwen3_5ForCausalLM":
        die(f"build_model: AutoModelForCausalLM built {type(model).__name__} for model_type "
            f"{config.model_type}, not Qwen3_5ForCausalLM")
    if model.model.embed_tokens.padding_idx is not None:
        die("build_model: embed_tokens has a padding_idx (its gradient row would be zeroed)")
    check_tying(model)
    init_weights(model, seed)
    return model


def load_model(model_dir, double=False):
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    check_tying(model)
    return model.double() if double else model


def rewrite_rope(config, spelling, theta, factor):
    for key in ("rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"):
        config.pop(key, None)
    if spelling == "rope_parameters":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    elif spelling == "legacy":
        config["rope_theta"] = theta
        config["partial_rotary_factor"] = factor
    else:
        raise ValueError(spelling)


def save_model(model, model_dir, spec):
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    model.save_pretrained(model_dir)
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    rewrite_rope(config, spec["rope_spelling"], float(spec["arch"]["rope_theta"]),
                 float(spec["arch"]["partial_rotary_factor"]))
    if "full_attention_interval" in spec["arch"]:   # keep the config as short as released ones: interval only
        config.pop("layer_types", None)
        config["full_attention_interval"] = spec["arch"]["full_attention_interval"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    weights = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if weights != ["model.safetensors"]:
        die(f"save_model: expected one model.safetensors in {model_dir}, found {weights}")


# ---- float64 versions of the parts stock HF qwen3_5 computes in float32 ----

PATCH_CALLS = {"rms_norm": 0, "gated_norm": 0, "attention": 0, "gdn_forward": 0, "gdn_core": 0, "conv": 0}
STOCK_CALLS = {}
_ORIGINALS = {}


def _rms_norm_fp64(self, x):
    PATCH_CALLS["rms_norm"] += 1
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_norm_fp64(self, hidden_states, gate):
    PATCH_CALLS["gated_norm"] += 1
    x = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * F.silu(gate)


def _eager_attention_fp64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    PATCH_CALLS["attention"] += 1
    mq = hf_qwen3_5()
    key = mq.repeat_kv(key, module.num_key_value_groups)
    value = mq.repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    scores = scores.masked_fill(~causal, float("-inf"))
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :k_len]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _conv_fp64(hidden_states, weight, bias=None, activation=None, **kwargs):
    PATCH_CALLS["conv"] += 1
    _, channels, seq_len = hidden_states.shape
    out = F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=channels)[:, :, :seq_len]
    if activation is not None:
        if activation not in ("silu", "swish"):
            die(f"conv activation {activation}")
        out = F.silu(out)
    return out


def _gdn_core_fp64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """The gated delta rule token by token, in the input dtype (float64 here). (B, T, H, d) layout as in HF."""
    PATCH_CALLS["gdn_core"] += 1
    if initial_state is not None or cu_seqlens is not None:
        die("gdn core: unexpected initial_state / cu_seqlens in a no-cache, one-document call")
    b, t, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * dk ** -0.5
    state = torch.zeros(b, hv, dk, dv, dtype=value.dtype)
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        pred = (state * key[:, i, :, :, None]).sum(-2)                       # (b, hv, dv)
        delta = (value[:, i] - pred) * beta[:, i, :, None]
        state = state + key[:, i, :, :, None] * delta[:, :, None, :]
        out.append((state * query[:, i, :, :, None]).sum(-2))
    return torch.stack(out, dim=1), (state if output_final_state else None)


def _gdn_forward_fp64(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Qwen3_5GatedDeltaNet.forward without cache and without its float32 casts (g from a.float())."""
    PATCH_CALLS["gdn_forward"] += 1
    if cache_params is not None:
        die("gdn forward: a cache was passed (use_cache=False expected)")
    if attention_mask is not None and not bool(torch.all(attention_mask == 1)):
        die("gdn forward: padding mask given; the fixtures use unpadded one-document batches")
    bsz, seq_len, _ = hidden_states.shape
    mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
    z = self.in_proj_z(hidden_states).reshape(bsz, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    mixed = _conv_fp64(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)
    mixed = mixed.transpose(1, 2)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(bsz, seq_len, -1, self.head_k_dim)
    k = k.reshape(bsz, seq_len, -1, self.head_k_dim)
    v = v.reshape(bsz, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
    core, _ = _gdn_core_fp64(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(bsz, seq_len, -1))


def _counting(name, fn):
    def wrapped(*args, **kwargs):
        STOCK_CALLS[name] = STOCK_CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapped


def set_fp64_patches(enabled):
    mq = hf_qwen3_5()
    if not _ORIGINALS:
        for cls, attr in (("Qwen3_5RMSNorm", "forward"), ("Qwen3_5RMSNormGated", "forward"),
                          ("Qwen3_5GatedDeltaNet", "forward")):
            if not hasattr(mq, cls):
                die(f"transformers' modeling_qwen3_5 has no {cls}: update set_fp64_patches()")
        for fn in ("eager_attention_forward", "torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            if not hasattr(mq, fn):
                die(f"transformers' modeling_qwen3_5 has no {fn}: update set_fp64_patches()")
        _ORIGINALS.update(rms_norm=mq.Qwen3_5RMSNorm.forward, gated_norm=mq.Qwen3_5RMSNormGated.forward,
                          gdn=mq.Qwen3_5GatedDeltaNet.forward, attention=mq.eager_attention_forward,
                          core=mq.torch_chunk_gated_delta_rule, conv=mq.causal_conv1d_fn)
    mq.Qwen3_5RMSNorm.forward = _rms_norm_fp64 if enabled else _ORIGINALS["rms_norm"]
    mq.Qwen3_5RMSNormGated.forward = _gated_norm_fp64 if enabled else _ORIGINALS["gated_norm"]
    mq.Qwen3_5GatedDeltaNet.forward = _gdn_forward_fp64 if enabled else _ORIGINALS["gdn"]
    mq.eager_attention_forward = _eager_attention_fp64 if enabled else _ORIGINALS["attention"]
    # Stock runs: count which GDN functions transformers really calls (the code path, reported).
    mq.torch_chunk_gated_delta_rule = _ORIGINALS["core"] if enabled else _counting("torch_chunk_gated_delta_rule",
                                                                                    _ORIGINALS["core"])
    mq.causal_conv1d_fn = _ORIGINALS["conv"] if enabled else _counting("causal_conv1d_fn", _ORIGINALS["conv"])


def code_path():
    """What stock transformers would run for the GDN layer on this machine."""
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
    return {"flash_linear_attention_available": fla, "causal_conv1d_installed": conv,
            "stock_calls": dict(STOCK_CALLS)}


# ---- fixtures ----

def compute(model_dir, batch, name):
    for k in PATCH_CALLS:
        PATCH_CALLS[k] = 0
    set_fp64_patches(True)
    try:
        logits, loss, grads = packed_forward_backward(load_model(model_dir, double=True), batch)
    finally:
        set_fp64_patches(False)
    if min(PATCH_CALLS.values()) == 0:
        die(f"{name}: a float64 patch was never called ({PATCH_CALLS}); transformers' qwen3_5 internals changed, "
            "update set_fp64_patches()")
    STOCK_CALLS.clear()
    stock_logits, _, stock_grads = packed_forward_backward(load_model(model_dir, double=True), batch)
    stock_diff = (stock_logits - logits).abs().max().item()
    stock_grad = max_rel_grad_diff(stock_grads, grads)
    if stock_diff > 1e-4 or stock_grad > 1e-4:
        die(f"{name}: stock HF float64 disagrees with the patched float64 reference: logits {stock_diff:.3g}, "
            f"grads (rel) {stock_grad:.3g}")
    path = code_path()
    f32_logits, f32_loss, f32_grads = packed_forward_backward(load_model(model_dir), batch)
    summary = (f"stock-fp64 vs golden: logits {stock_diff:.2e}, grads(rel) {stock_grad:.2e}; fp32 vs golden: "
               f"logits {(f32_logits.double() - logits).abs().max().item():.2e}, loss "
               f"{abs(f32_loss.item() - loss.item()):.2e}, grads(rel) {max_rel_grad_diff(f32_grads, grads):.2e}")
    return logits, loss, grads, path, summary


def write_reference(fixture_dir, batch, logits, loss, grads, metadata, rename=lambda n: n):
    from safetensors.torch import save_file
    tensors = {
        "input_ids": batch["input_ids"].to(torch.int32),
        "cu_seqlens": batch["cu_seqlens"].to(torch.int32),
        "position_ids": batch["position_ids"].to(torch.int32),
        "labels": batch["labels"].to(torch.int32),
        "logits": logits.float(),
        "loss": loss.reshape(1).float(),
    }
    for pname, g in grads.items():
        tensors["grad." + rename(pname)] = g.float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(fixture_dir, "reference.safetensors"),
              metadata=metadata)


def write_fixture(out_dir, name, spec):
    import transformers
    fixture_dir = os.path.join(out_dir, name)
    model_dir = os.path.join(fixture_dir, "model")
    os.makedirs(fixture_dir, exist_ok=True)
    arch, seed = spec["arch"], spec["seed"]
    built = build_model(arch, seed)
    save_model(built, model_dir, spec)
    batch = make_batch(arch["vocab_size"], seed)

    model32 = load_model(model_dir)
    built_sd, loaded_sd = built.state_dict(), model32.state_dict()
    if set(built_sd) != set(loaded_sd) or any(not torch.equal(built_sd[k], loaded_sd[k]) for k in built_sd):
        die(f"{name}: weights reloaded from {model_dir} differ from the saved model")
    with torch.no_grad():
        ids = batch["docs"][1]
        diff = (built(input_ids=ids[None], use_cache=False).logits
                - model32(input_ids=ids[None], use_cache=False).logits).abs().max().item()
    if diff > 1e-6:
        die(f"{name}: reloaded model's logits differ from the built model's by {diff:.3g} (config.json rewrite "
            f"'{spec['rope_spelling']}' misread by transformers? drop this spelling)")

    logits, loss, grads, path, summary = compute(model_dir, batch, name)
    metadata = {"config": name, "seed": str(seed), "rope_spelling": spec["rope_spelling"],
                "compute": "float64 (norms, gated norm, softmax, GDN gates/conv/core patched to float64), stored float32",
                "code_path": json.dumps(path), "transformers": transformers.__version__, "torch": torch.__version__}
    write_reference(fixture_dir, batch, logits, loss, grads, metadata)
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\n")
        f.write(f"rope spelling in model/config.json: {spec['rope_spelling']}\n")
        f.write(f"documents {list(DOC_LENGTHS)} packed (T = {sum(DOC_LENGTHS)}); labels = next token in the document, "
                f"-100 at each document's last token and {EXTRA_IGNORED} random others\n")
        f.write(f"stock transformers GDN code path on the generating machine: {json.dumps(path)}\n")
        f.write(f"{summary}\n")
        f.write(f"written by dev/ref/qwen3_5_fixtures.py (seed {seed}) with transformers {transformers.__version__}, "
                f"torch {torch.__version__}\n")
    print(f"{name}: loss {loss.item():.6f}, max |logit| {logits.abs().max().item():.4f}, {len(grads)} grads; "
          f"{summary}; GDN path {path}")
    return dict(model=model32, batch=batch, logits=logits, loss=loss, grads=grads, metadata=metadata, spec=spec)


def write_multimodal(out_dir, name, twin, check_hf=True):
    """The twin's weights and goldens in the multimodal release layout."""
    from safetensors.torch import load_file, save_file
    fixture_dir = os.path.join(out_dir, name)
    model_dir = os.path.join(fixture_dir, "model")
    twin_model_dir = os.path.join(out_dir, twin["spec"]["name"], "model")
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    os.makedirs(model_dir)

    def rename(n):
        return "model.language_model." + n[len("model."):] if n.startswith("model.") else n

    weights = load_file(os.path.join(twin_model_dir, "model.safetensors"))
    out = {rename(k): v for k, v in weights.items()}
    hidden = twin["spec"]["arch"]["hidden_size"]
    vision = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "in_channels": 3, "patch_size": 2, "temporal_patch_size": 1, "spatial_merge_size": 1,
              "out_hidden_size": hidden, "num_position_embeddings": 4}
    gen = torch.Generator().manual_seed(7)
    out["model.visual.pos_embed.weight"] = torch.randn(4, 16, generator=gen)          # a dummy vision tensor
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)              # a dummy MTP tensor
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(twin_model_dir, "config.json"), encoding="utf-8") as f:
        text = json.load(f)
    for k in ("architectures", "dtype", "torch_dtype", "transformers_version"):
        text.pop(k, None)
    text["model_type"] = "qwen3_5_text"
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "dtype": "float32",
              "text_config": text, "vision_config": vision,
              "tie_word_embeddings": bool(text.get("tie_word_embeddings", False))}
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

    if check_hf:   # transformers reads this folder as the same text model
        try:
            from transformers import Qwen3_5ForConditionalGeneration
            mm = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
        except Exception as e:  # noqa: BLE001
            die(f"{name}: Qwen3_5ForConditionalGeneration cannot load {model_dir}: {e!r} "
                "(rerun with --skip-multimodal-check to write the folder unverified)")
        with torch.no_grad():
            ids = twin["batch"]["docs"][1]
            pos = torch.arange(len(ids))[None]
            got = mm(input_ids=ids[None], position_ids=pos, use_cache=False).logits
            want = twin["model"](input_ids=ids[None], position_ids=pos, use_cache=False).logits
        diff = (got - want).abs().max().item()
        if diff > 1e-5:
            die(f"{name}: the multimodal folder gives logits {diff:.3g} away from its text twin")
        print(f"{name}: Qwen3_5ForConditionalGeneration reads the folder as the same text model (logits diff {diff:.2e})")
    metadata = dict(twin["metadata"], config=name, layout="multimodal (model.language_model.*)")
    write_reference(fixture_dir, twin["batch"], twin["logits"], twin["loss"], twin["grads"], metadata, rename)
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: the weights and goldens of {twin['spec']['name']} in the multimodal release layout: "
                "config.json with model_type qwen3_5, text_config (plus mtp_* fields) and a tiny vision_config; "
                "tensors model.language_model.*, lm_head.weight, one dummy model.visual.* tensor and one dummy "
                "mtp.* tensor (both unused by the text model); grad names follow the layout\n")
    print(f"{name}: written (twin {twin['spec']['name']})")


def main():
    parser = argparse.ArgumentParser(description="Write golden Qwen3.5 text fixtures (logits, loss, grads) from HF.")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/qwen3_5")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES) + sorted(MULTIMODAL))
    parser.add_argument("--skip-multimodal-check", action="store_true",
                        help="do not load the multimodal folder with Qwen3_5ForConditionalGeneration")
    args = parser.parse_args()
    hf_qwen3_5()
    torch.set_grad_enabled(True)
    written = {}
    wanted = set(args.only or list(FIXTURES) + list(MULTIMODAL))
    for mm_name, twin in MULTIMODAL.items():
        if mm_name in wanted:
            wanted.add(twin)
    for name, spec in FIXTURES.items():
        if name in wanted:
            written[name] = write_fixture(args.out_dir, name, spec)
            written[name]["spec"]["name"] = name
    for mm_name, twin in MULTIMODAL.items():
        if mm_name in wanted:
            write_multimodal(args.out_dir, mm_name, written[twin], check_hf=not args.skip_multimodal_check)


if __name__ == "__main__":
    main()
