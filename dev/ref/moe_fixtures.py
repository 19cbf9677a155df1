#!/usr/bin/env python3
"""Writes the golden mixture-of-experts fixtures for the MoE model parity tests (DESIGN.md, parity ladder rung 2):
tiny random models of the three MoE families of transformers 5.17 -- qwen3_moe (Qwen3MoeForCausalLM),
qwen3_5_moe_text (Qwen3_5MoeForCausalLM: Gated DeltaNet + gated attention, shared expert) and qwen3_next
(Qwen3NextForCausalLM: the same hybrid with the fused GDN projections in_proj_qkvz / in_proj_ba) -- and, for each,
the logits, loss, load-balancing loss, routing and every parameter gradient of a packed batch of three documents.

Run on the GPU machine from the repo root (CPU only; no network needed):
    python3 dev/ref/moe_fixtures.py tests/models/fixtures/moe

For each config NAME it writes OUT_DIR/NAME/
    model/                  config.json (RoPE fields rewritten to the spelling README.txt names, the MoE fields
                            written out as released checkpoints spell them) and model.safetensors, float32, with the
                            experts in the fixture's layout:
                              per-expert  model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight  (I,H) (I,H) (H,I)
                              fused       model.layers.L.mlp.experts.gate_up_proj (E, 2I, H) = [gate; up] on dim 1
                                          model.layers.L.mlp.experts.down_proj    (E, H, I)   (no .weight suffix)
    reference.safetensors   input_ids, cu_seqlens, position_ids, labels, routing.<L> (int32); logits, loss, aux_loss,
                            loss_with_aux, grad.<HF parameter name>, grad_aux.<HF parameter name> (float32)
    README.txt              config summary, checkpoint layout and how it was written, routing margins, experts that
                            received no token, stock-vs-golden and fp32-vs-golden differences, versions

Packing, as in qwen3_fixtures.py (whose packed_forward_backward computes logits, loss and grad.*): each document runs
as its own batch-of-one sequence (positions 0..len-1, no padding, no cache), logits are concatenated, loss = summed
cross-entropy at labelled positions / labelled count. The router logits of every sparse layer are observed with
forward hooks on the router modules and concatenated per layer over the documents in batch order, so
    aux_loss      = load_balancing_loss_func(tuple over sparse layers of (T, E) logits, E, top_k, attention_mask=None)
                    over ALL rows of the packed batch (one call, not a per-document average)
    loss_with_aux = loss + router_aux_loss_coef * aux_loss
    grad_aux.*    = d loss_with_aux / d param = grad.* + router_aux_loss_coef * d aux_loss / d param (a second pass)
    routing.L     = the experts chosen per token in sparse layer L, (T, k), in top-k order (descending probability).
The model's own output_router_logits path is checked to return the same logits (and aux) as the hooks.

Routing robustness: router rows are drawn with std ROUTER_LOGIT_STD / sqrt(hidden) (router logits of std ~1.5: a large
std makes the probabilities so peaked that the k-th and (k+1)-th are both tiny and nearly equal), and redrawn (a
fixed sequence of draws, the draw used is in README.txt) until, in every sparse layer, every token's k-th and
(k+1)-th router probabilities differ by more than TOPK_GAP, so that float32 and bfloat16 engines choose the same
experts; stock float32 HF must choose the same experts as the golden run. A fixture may name an (layer, expert) that
receives no token: its router row is solved (least squares over the batch's router inputs) so that its logit is
-EMPTY_LOGIT on every token.

Numerics: goldens are computed in float64 and stored as float32. Stock HF computes in float32 even in a float64 model:
the router softmax (softmax(..., dtype=torch.float)), the RMSNorms (.to(float32) / x.float()), the gated RMSNorm,
RoPE's angles, eager attention's softmax, the GDN log-decay g (a.float()) and the GDN torch fallbacks
(torch_chunk_gated_delta_rule casts to float32), and load_balancing_loss_func accumulates in float32.
set_fp64_patches() swaps the module parts for float64 versions written from the HF code (those of qwen3_fixtures.py
and qwen3_5_fixtures.py where the HF code is the same), load_balancing_fp64() is the aux loss without its float32
accumulators; the script exits if a patch is never called or if stock float64 HF (with its own
load_balancing_loss_func) disagrees with the golden result by more than STOCK_TOL, or routes differently. The experts
run transformers' eager implementation (experts_implementation="eager", no float32 part to patch): every experts call
is checked to dispatch to the class's own eager forward and to match what that forward recomputes.

Checkpoints: save_pretrained (transformers 5) reverts the load-time expert fusion of conversion_mapping.py
(qwen2_moe pattern: MergeModulelist + Concatenate on load, Chunk + SplitModulelist on save), so it writes the
per-expert layout; the script compares what it wrote with the wanted layout built from the model's own state dict and
rewrites model.safetensors with safetensors.save_file when they differ (the fused fixtures). Both layouts are then
reloaded with from_pretrained and must give the built model's parameters, config fields and logits.
"""
import argparse
import importlib
import json
import math
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_saved_checkpoint as csc  # noqa: E402
import qwen3_5_fixtures as q35  # noqa: E402
import qwen3_fixtures as q3  # noqa: E402
from qwen3_fixtures import (DOC_LENGTHS, EXTRA_IGNORED, check_tying, make_batch,  # noqa: E402
                            max_rel_grad_diff, packed_forward_backward)

INIT_STD, CONV_STD, NORM_SPREAD = q35.INIT_STD, q35.CONV_STD, q35.NORM_SPREAD
ROUTER_LOGIT_STD = 1.5    # router rows ~ normal(0, ROUTER_LOGIT_STD / sqrt(hidden)): logits of std ~1.5
TOPK_GAP = 1e-3           # every token's k-th and (k+1)-th router probabilities must differ by more than this
MAX_ROUTER_DRAWS = 64     # router draws tried before giving up on TOPK_GAP (about half the draws pass)
EMPTY_LOGIT = 20.0        # a deliberately empty expert's router logit on every token of the batch is -EMPTY_LOGIT
STOCK_TOL = 1e-4          # stock float64 HF vs golden: logits (abs), gradients and aux loss (relative)

FAMILIES = {
    "qwen3_moe": dict(
        module="transformers.models.qwen3_moe.modeling_qwen3_moe", config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM", norm="Qwen3MoeRMSNorm", rotary="Qwen3MoeRotaryEmbedding",
        router="Qwen3MoeTopKRouter", experts="Qwen3MoeExperts", sparse_block="Qwen3MoeSparseMoeBlock",
        gated_norm=None, gdn=None, fused_gdn_projections=False, zero_centred_norm=False,
        router_always_normalises=False, sparse_step=True, shared_expert=False,
        moe_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")),
    "qwen3_5_moe_text": dict(
        module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", config="Qwen3_5MoeTextConfig",
        model="Qwen3_5MoeForCausalLM", norm="Qwen3_5MoeRMSNorm", rotary="Qwen3_5MoeTextRotaryEmbedding",
        router="Qwen3_5MoeTopKRouter", experts="Qwen3_5MoeExperts", sparse_block="Qwen3_5MoeSparseMoeBlock",
        gated_norm="Qwen3_5MoeRMSNormGated", gdn="Qwen3_5MoeGatedDeltaNet", fused_gdn_projections=False,
        zero_centred_norm=True, router_always_normalises=True, sparse_step=False, shared_expert=True,
        moe_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "router_aux_loss_coef", "output_router_logits")),
    "qwen3_next": dict(
        module="transformers.models.qwen3_next.modeling_qwen3_next", config="Qwen3NextConfig",
        model="Qwen3NextForCausalLM", norm="Qwen3NextRMSNorm", rotary="Qwen3NextRotaryEmbedding",
        router="Qwen3NextTopKRouter", experts="Qwen3NextExperts", sparse_block="Qwen3NextSparseMoeBlock",
        gated_norm="Qwen3NextRMSNormGated", gdn="Qwen3NextGatedDeltaNet", fused_gdn_projections=True,
        zero_centred_norm=True, router_always_normalises=False, sparse_step=True, shared_expert=True,
        moe_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                    "output_router_logits")),
}

# layout: the experts' checkpoint layout (see the module docstring). rope_spelling of config.json: "rope_theta" =
# top-level rope_theta + "rope_scaling": null (released Qwen3-MoE), "rope_parameters" = inside rope_parameters
# (transformers 5), "legacy" = top-level rope_theta and partial_rotary_factor (released Qwen3-Next).
# empty_expert: (layer, expert) made to receive no token of the batch.
FIXTURES = {
    "qwen3_moe_per_expert": dict(
        family="qwen3_moe", seed=501, layout="per_expert", rope_spelling="rope_theta", empty_expert=None,
        about="qwen3_moe, per-expert checkpoint layout, untied; E 8, top-2, norm_topk_prob false, moe_intermediate 24; "
              "decoder_sparse_step 1 with mlp_only_layers [1] (layers 0, 2, 3 sparse, layer 1 a dense MLP of 64); "
              "GQA 4 q / 2 kv heads, head_dim 16 != hidden/heads 8, theta 1e6; router_aux_loss_coef 0.05",
        arch=dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=1000000.0,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                  decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.05)),
    "qwen3_moe_fused": dict(
        family="qwen3_moe", seed=502, layout="fused", rope_spelling="rope_parameters", empty_expert=(1, 4),
        about="qwen3_moe, fused checkpoint layout, tied; E 6, top-3, norm_topk_prob true, moe_intermediate 16; "
              "decoder_sparse_step 2 (layers 1, 3 sparse; 0, 2 dense MLPs of 64); expert 4 of layer 1 receives no "
              "token (deliberately); MQA 4 q / 1 kv head, head_dim 12, theta 1e4, eps 1e-5; router_aux_loss_coef 0.02",
        arch=dict(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, rope_theta=10000.0,
                  num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
                  decoder_sparse_step=2, mlp_only_layers=[], router_aux_loss_coef=0.02)),
    "qwen3_5_moe": dict(
        family="qwen3_5_moe_text", seed=503, layout="fused", rope_spelling="rope_parameters", empty_expert=None,
        about="qwen3_5_moe_text (Qwen3_5MoeForCausalLM), fused checkpoint layout, untied; layers linear, full, "
              "linear, full, all sparse; E 6, top-2 (always renormalised), moe_intermediate 16, shared expert 24 "
              "with its sigmoid gate; GDN H_k 2 / H_v 4, d_k 8, d_v 12, conv 4; gated attention 4 q / 2 kv heads, "
              "head_dim 16, partial rotary 0.5 (8 channels), theta 1e6; router_aux_loss_coef 0.05",
        arch=dict(vocab_size=96, hidden_size=32, num_hidden_layers=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, rope_theta=1000000.0, partial_rotary_factor=0.5,
                  num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, router_aux_loss_coef=0.05)),
    "qwen3_next": dict(
        family="qwen3_next", seed=504, layout="per_expert", rope_spelling="legacy", empty_expert=None,
        about="qwen3_next (Qwen3NextForCausalLM), per-expert checkpoint layout (as released), untied; layers linear, "
              "linear, full, linear; mlp_only_layers [1] (layers 0, 2, 3 sparse, layer 1 a dense MLP of 48); E 8, "
              "top-2, norm_topk_prob true, moe_intermediate 16, shared expert 24 with its sigmoid gate; GDN with the "
              "fused in_proj_qkvz / in_proj_ba, H_k 2 / H_v 6, d_k 8, d_v 8, conv 4; gated attention 2 q / 1 kv head, "
              "head_dim 32, partial rotary 0.25 (8 channels); top-level rope_theta 1e6 and partial_rotary_factor; "
              "router_aux_loss_coef 0.1",
        arch=dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, rope_theta=1000000.0, partial_rotary_factor=0.25,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.1)),
}
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def die(msg):
    sys.exit(f"moe_fixtures: {msg}")


def hf_module(fam):
    """The family's modeling module, after checking it has every name this script relies on."""
    try:
        mq = importlib.import_module(fam["module"])
    except ImportError as e:
        die(f"transformers has no {fam['module']} ({e}); transformers 5.x (5.17 tested) is needed")
    names = [fam[k] for k in ("model", "norm", "rotary", "router", "experts", "sparse_block", "gated_norm", "gdn")
             if fam[k]] + ["eager_attention_forward", "load_balancing_loss_func"]
    if fam["gdn"]:
        names += ["torch_chunk_gated_delta_rule", "causal_conv1d_fn"]
    missing = [n for n in names if not hasattr(mq, n)]
    if missing:
        die(f"{fam['module']} has no {missing}: transformers' MoE internals changed, update FAMILIES / the patches")
    return mq


def config_class(fam):
    module = fam["module"].replace(".modeling_", ".configuration_")
    try:
        return getattr(importlib.import_module(module), fam["config"])
    except (ImportError, AttributeError) as e:
        die(f"cannot import {module}.{fam['config']}: {e}")


# ---- model building ----

def make_config(fam, arch):
    """The family's config from a dict of architecture fields; every field is read back."""
    arch = dict(arch)
    theta = float(arch.pop("rope_theta"))
    rope = {"rope_type": "default", "rope_theta": theta}
    if "partial_rotary_factor" in arch:
        rope["partial_rotary_factor"] = float(arch.pop("partial_rotary_factor"))
    config = config_class(fam)(**arch, hidden_act="silu", attention_bias=False, max_position_embeddings=256,
                               output_router_logits=False, rope_parameters=rope)
    rp = config.rope_parameters
    if rp.get("rope_theta") != theta or rp.get("partial_rotary_factor", 1.0) != rope.get("partial_rotary_factor", 1.0):
        die(f"make_config: asked for rope {rope}, the config holds {rp}")
    for key, value in arch.items():
        got = getattr(config, key, None)
        if (list(got) if isinstance(got, (list, tuple)) else got) != value:
            die(f"make_config: asked for {key} = {value!r}, the {fam['config']} holds {got!r}")
    return config


def sparse_layers(model, fam):
    block = getattr(hf_module(fam), fam["sparse_block"])
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, block)]


def expected_sparse_layers(config, fam):
    """Which layers transformers makes sparse, from the config (Qwen3MoeDecoderLayer / Qwen3NextDecoderLayer)."""
    n = config.num_hidden_layers
    if not fam["sparse_step"]:
        return list(range(n))                       # Qwen3_5MoeDecoderLayer: every layer is sparse
    return [i for i in range(n) if i not in config.mlp_only_layers and config.num_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0]


def init_weights(model, seed, fam):
    """Larger-than-default random weights, as in qwen3_fixtures.py / qwen3_5_fixtures.py; routers: draw_routers()."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

    with torch.no_grad():
        for name, p in model.named_parameters():   # a tied lm_head appears once, as embed_tokens
            if name.endswith(".mlp.gate.weight"):                      # routers: draw_routers()
                continue
            if name.endswith("linear_attn.norm.weight"):               # gated norm: plain weight
                p.copy_(uniform(p.shape, 1.0 - NORM_SPREAD, 1.0 + NORM_SPREAD))
            elif name.endswith("norm.weight"):
                if fam["zero_centred_norm"]:                            # (1 + w) norms
                    p.copy_(uniform(p.shape, -NORM_SPREAD, NORM_SPREAD))
                else:
                    p.copy_(uniform(p.shape, 1.0 - NORM_SPREAD, 1.0 + NORM_SPREAD))
            elif name.endswith("A_log"):
                p.copy_(uniform(p.shape, 0.1, 2.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(uniform(p.shape, 0.5, 1.5))
            elif name.endswith("conv1d.weight"):
                p.copy_(CONV_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) or p.dim() == 2:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                die(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")


def build_model(fam, arch, seed):
    """A float32 model of the family with eager attention, eager experts and init_weights() weights."""
    config = make_config(fam, arch)
    cls = getattr(hf_module(fam), fam["model"])
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="eager").float().eval()
    if type(model).__name__ != fam["model"]:
        die(f"build_model: built {type(model).__name__}, not {fam['model']}")
    if model.config._attn_implementation != "eager" or model.config._experts_implementation != "eager":
        die(f"build_model: attention {model.config._attn_implementation}, experts "
            f"{model.config._experts_implementation}; eager and eager expected")
    if model.model.embed_tokens.padding_idx is not None:
        die("build_model: embed_tokens has a padding_idx (its gradient row would be zeroed)")
    if sparse_layers(model, fam) != expected_sparse_layers(model.config, fam):
        die(f"build_model: sparse layers {sparse_layers(model, fam)}, the config says "
            f"{expected_sparse_layers(model.config, fam)}")
    check_tying(model)
    init_weights(model, seed, fam)
    return model


def load_model(fam, model_dir, double=False, with_info=False):
    """from_pretrained in float32 with eager attention and eager experts, eval mode; float64 copy if double."""
    cls = getattr(hf_module(fam), fam["model"])
    model, info = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                      experts_implementation="eager", output_loading_info=True)
    model.eval()
    check_tying(model)
    if model.config._attn_implementation != "eager" or model.config._experts_implementation != "eager":
        die(f"load_model: attention {model.config._attn_implementation}, experts "
            f"{model.config._experts_implementation}; eager and eager expected")
    model = model.double() if double else model
    return (model, info) if with_info else model


# ---- observing the routers and the experts ----

class RouterCapture:
    """Forward hooks on the router of every sparse layer: per call, its input rows and (logits, weights, choices)."""

    def __init__(self, model, fam):
        self.layers = sparse_layers(model, fam)
        self.routers = {layer: model.model.layers[layer].mlp.gate for layer in self.layers}
        self.calls = {layer: [] for layer in self.layers}
        self._handles = []

    def __enter__(self):
        for layer, router in self.routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False

    def _hook(self, layer):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                die(f"the router of layer {layer} returned {type(output).__name__}, not (logits, weights, choices)")
            self.calls[layer].append((args[0].detach(), output))
        return hook

    def rows(self, part):
        """{layer: the rows of every call concatenated in call (= document) order}; part: inputs, logits, choices."""
        counts = {len(calls) for calls in self.calls.values()}
        if len(counts) != 1 or 0 in counts:
            die(f"router calls per sparse layer: { {k: len(v) for k, v in self.calls.items()} }")
        pick = {"inputs": lambda c: c[0], "logits": lambda c: c[1][0], "choices": lambda c: c[1][2]}[part]
        return {layer: torch.cat([pick(c) for c in self.calls[layer]]) for layer in self.layers}


class ExpertsCheck:
    """Forward hooks on every experts module. @use_experts_implementation replaces the class's forward by a dispatcher
    that runs ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation, eager forward); each call must
    resolve to the eager forward (forward.__wrapped__), and its output must match what that forward recomputes
    (to 1e-5 relative: CPU BLAS results may depend on buffer alignment, so not bitwise)."""

    def __init__(self, model, fam):
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        except ImportError as e:
            die(f"cannot import transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS ({e})")
        self.interface = ALL_EXPERTS_FUNCTIONS
        cls = getattr(hf_module(fam), fam["experts"])
        self.modules = [m for m in model.modules() if isinstance(m, cls)]
        self.eager = getattr(cls.forward, "__wrapped__", None)
        if self.eager is None or not self.modules:
            die(f"cannot find {fam['experts']} modules or their eager forward (forward.__wrapped__)")
        self.calls = 0
        self._handles = []

    def __enter__(self):
        for m in self.modules:
            impl = getattr(m.config, "_experts_implementation", None)
            if impl != "eager" or self.interface.get_interface(impl, self.eager) is not self.eager:
                die(f"an experts module runs experts_implementation {impl!r}, not transformers' eager forward")
            self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False

    def _hook(self, module, args, kwargs, output):
        with torch.no_grad():
            want = self.eager(module, *args, **kwargs)
        output = output.detach()
        scale = float(want.abs().max().clamp_min(1e-30))
        if want.shape != output.shape or float((want - output).abs().max()) > 1e-5 * scale:
            die("an experts call differs from the eager experts forward: another experts implementation ran")
        self.calls += 1


# ---- float64 versions of the parts stock HF computes in float32 ----

PATCH_CALLS = {}
_ORIGINALS = {}


def _router_fp64(always_normalises):
    def forward(self, hidden_states):
        """TopKRouter.forward with the softmax in the input dtype (HF: softmax(..., dtype=torch.float))."""
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)                  # (T, E)
        probs = torch.softmax(router_logits, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)          # (T, k)
        if always_normalises or self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value, top_index
    return forward


@torch.no_grad()
def _rotary_partial_fp64(self, x, position_ids, **kwargs):
    """RotaryEmbedding.forward of qwen3_next / qwen3_5_moe_text (partial rotary) in float64. Qwen3.5's mRoPE gets
    (3, B, S) positions; for text all three rows are equal, so its section recomposition is the identity."""
    theta, rope_type = q3.rope_theta_of(self.config)
    if rope_type != "default" or self.attention_scaling != 1.0:
        die(f"rotary: rope_type {rope_type}, attention_scaling {self.attention_scaling}; default and 1 expected")
    factor = float(self.config.rope_parameters.get("partial_rotary_factor", 1.0))
    head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
    dim = int(head_dim * factor)
    if position_ids.dim() == 3:
        if not bool((position_ids == position_ids[:1]).all()):
            die("rotary: mRoPE position rows differ; the fixtures are text-only")
        position_ids = position_ids[0]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]      # (B, S, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _next_gdn_forward_fp64(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Qwen3NextGatedDeltaNet.forward without cache and without its float32 casts: the fused projections split by
    HF's own fix_query_key_value_ordering, then the conv, gates and core of qwen3_5_fixtures.py in float64."""
    if cache_params is not None:
        die("gdn forward: a cache was passed (use_cache=False expected)")
    if attention_mask is not None and not bool(torch.all(attention_mask == 1)):
        die("gdn forward: padding mask given; the fixtures use unpadded one-document batches")
    bsz, seq_len, _ = hidden_states.shape
    query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                   self.in_proj_ba(hidden_states))
    query, key, value = (x.reshape(bsz, seq_len, -1) for x in (query, key, value))
    mixed = torch.cat((query, key, value), dim=-1).transpose(1, 2)                  # (B, conv_dim, S)
    mixed = q35._conv_fp64(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)
    mixed = mixed.transpose(1, 2)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(bsz, seq_len, -1, self.head_k_dim)
    key = key.reshape(bsz, seq_len, -1, self.head_k_dim)
    value = value.reshape(bsz, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
    core, _ = q35._gdn_core_fp64(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(bsz, seq_len, -1))


def load_balancing_fp64(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func with attention_mask=None, without its float32 accumulators."""
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float64)
    prob_per_expert = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for layer_gate in gate_logits:                                               # (T, E) each
        routing_weights = torch.softmax(layer_gate, dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        tokens_per_expert = tokens_per_expert + torch.bincount(selected.reshape(-1), minlength=num_experts).double()
        prob_per_expert = prob_per_expert + routing_weights.sum(dim=0)
        rows += routing_weights.shape[0]
    return torch.sum((tokens_per_expert / rows) * (prob_per_expert / rows)) * num_experts


def patch_table(fam, mq):
    """(counter, owner, attribute, float64 replacement) for every part stock HF computes in float32."""
    rows = [("rms_norm", getattr(mq, fam["norm"]), "forward",
             q35._rms_norm_fp64 if fam["zero_centred_norm"] else q3._rms_norm_fp64),
            ("rotary", getattr(mq, fam["rotary"]), "forward", _rotary_partial_fp64 if fam["gdn"] else q3._rotary_fp64),
            ("attention", mq, "eager_attention_forward", q3._eager_attention_fp64),
            ("router", getattr(mq, fam["router"]), "forward", _router_fp64(fam["router_always_normalises"]))]
    if fam["gdn"]:
        rows += [("gated_norm", getattr(mq, fam["gated_norm"]), "forward", q35._gated_norm_fp64),
                 ("gdn_forward", getattr(mq, fam["gdn"]), "forward",
                  _next_gdn_forward_fp64 if fam["fused_gdn_projections"] else q35._gdn_forward_fp64)]
    return rows


def _counted(name, fn):
    def wrapped(*args, **kwargs):
        PATCH_CALLS[name] = PATCH_CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapped


def set_fp64_patches(fam, enabled):
    mq = hf_module(fam)
    for counter, owner, attr, fn in patch_table(fam, mq):
        key = (fam["module"], owner.__name__, attr)
        if key not in _ORIGINALS:
            _ORIGINALS[key] = getattr(owner, attr)
        setattr(owner, attr, _counted(counter, fn) if enabled else _ORIGINALS[key])


def count_stock_gdn(fam, enabled):
    """Stock runs of the hybrids: count which GDN torch fallbacks transformers really calls (the code path)."""
    if not fam["gdn"]:
        return
    mq = hf_module(fam)
    for fn in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        key = (fam["module"], fn)
        if key not in _ORIGINALS:
            _ORIGINALS[key] = getattr(mq, fn)
        setattr(mq, fn, q35._counting(fn, _ORIGINALS[key]) if enabled else _ORIGINALS[key])


# ---- routing ----

def topk_gaps(router_logits, k):
    """(T,) gap between each row's k-th and (k+1)-th largest router probability."""
    probs = torch.softmax(router_logits.double(), dim=-1).sort(dim=-1, descending=True).values
    return probs[:, k - 1] - probs[:, k]


def route_batch(model, batch, fam):
    """The float64 (patched) routing of the batch by a float32 model, converted to float64 and back in place."""
    set_fp64_patches(fam, True)
    model.double()
    try:
        with torch.no_grad(), RouterCapture(model, fam) as cap:
            for ids in batch["docs"]:
                model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False)
    finally:
        model.float()
        set_fp64_patches(fam, False)
    return cap


def draw_routers(model, batch, spec, fam):
    """Draws the routers until every token's top-k choice has a margin above TOPK_GAP (and the fixture's empty expert
    is empty); returns the draw used and its smallest gap per sparse layer."""
    config = model.config
    hidden, experts, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    if experts <= k:
        die(f"{experts} experts with top-{k}: nothing to choose")
    routers = {layer: model.model.layers[layer].mlp.gate.weight for layer in sparse_layers(model, fam)}
    names = {n for n, _ in model.named_parameters() if n.endswith(".mlp.gate.weight")}
    if names != {f"model.layers.{layer}.mlp.gate.weight" for layer in routers}:
        die(f"router parameters {sorted(names)} are not the sparse layers' {sorted(routers)}")
    empty = spec["empty_expert"]
    if empty is not None and (empty[0] not in routers or not 0 <= empty[1] < experts):
        die(f"empty_expert {empty}: not a (sparse layer, expert) of this config")
    for draw in range(MAX_ROUTER_DRAWS):
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + draw)
        with torch.no_grad():
            for layer in sorted(routers):
                w = routers[layer]
                w.copy_(ROUTER_LOGIT_STD / math.sqrt(hidden) * torch.randn(w.shape, generator=gen, dtype=torch.float64))
        if empty is not None:
            layer, expert = empty
            rows = route_batch(model, batch, fam).rows("inputs")[layer]               # (T, H) router inputs
            target = torch.full((rows.shape[0],), -EMPTY_LOGIT, dtype=torch.float64)
            with torch.no_grad():
                routers[layer][expert].copy_(torch.linalg.pinv(rows) @ target)        # min-norm: rows @ w = target
        cap = route_batch(model, batch, fam)
        logits, choices = cap.rows("logits"), cap.rows("choices")
        gaps = {layer: float(topk_gaps(logits[layer], k).min()) for layer in cap.layers}
        ok = min(gaps.values()) > TOPK_GAP
        if empty is not None:
            layer, expert = empty
            ok = ok and float(logits[layer][:, expert].max()) < -EMPTY_LOGIT / 2 and \
                not bool((choices[layer] == expert).any())
        if ok:
            return draw, gaps
    die(f"no router draw of {MAX_ROUTER_DRAWS} gives every token a top-{k} margin above {TOPK_GAP}"
        + (f" with expert {empty[1]} of layer {empty[0]} empty" if empty else "") + "; change the seed")


# ---- the checkpoint ----

PER_EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED_KEY = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def describe_layout(keys):
    per, fused = any(PER_EXPERT_KEY.search(k) for k in keys), any(FUSED_KEY.search(k) for k in keys)
    return {(True, False): "per-expert", (False, True): "fused", (True, True): "mixed"}.get((per, fused), "no-expert")


def checkpoint_tensors(model, layout):
    """The model's tensors as a checkpoint of `layout` holds them: HF names, a tied lm_head left out, the fused
    expert parameters kept (fused) or split per expert (gate = gate_up_proj[e, :I], up = gate_up_proj[e, I:],
    down = down_proj[e])."""
    tied = bool(model.config.tie_word_embeddings)
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if tied and name == "lm_head.weight":
            continue
        if layout == "per_expert" and name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif layout == "per_expert" and name.endswith(".mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        elif layout in ("per_expert", "fused"):
            out[name] = t.clone().contiguous()
        else:
            raise ValueError(layout)
    if describe_layout(out) != layout.replace("_", "-"):
        die(f"checkpoint_tensors: built a {describe_layout(out)} layout, not {layout}")
    return out


def rewrite_moe_fields(model_dir, config, fam):
    """config.json with every MoE field of the family under its public name (Qwen3MoeConfig stores num_experts as
    num_local_experts through its attribute_map; released checkpoints and this file say num_experts)."""
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for alias, stored in type(config).attribute_map.items():
        if alias in fam["moe_fields"]:
            data.pop(stored, None)
    for field in fam["moe_fields"]:
        value = getattr(config, field)
        data[field] = list(value) if isinstance(value, (list, tuple)) else value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def save_model(model, model_dir, spec, fam):
    """save_pretrained plus the RoPE rewrite of qwen3(_5)_fixtures.py, the MoE fields, then the wanted expert layout;
    returns how model.safetensors was written."""
    from safetensors.torch import load_file, save_file
    if fam["gdn"]:
        q35.save_model(model, model_dir, spec)
    else:
        q3.save_model(model, model_dir, spec["rope_spelling"])
    rewrite_moe_fields(model_dir, model.config, fam)
    path = os.path.join(model_dir, "model.safetensors")
    written = load_file(path)
    by_hf = describe_layout(written)
    want = checkpoint_tensors(model, spec["layout"])
    same = set(written) == set(want) and all(torch.equal(written[k], want[k]) for k in want)
    del written                          # may map the file: unlink it rather than truncate it under the mapping
    if same:
        return f"as save_pretrained wrote it ({by_hf} layout: transformers reverts its expert fusion on save)"
    os.remove(path)
    save_file(want, path, metadata={"format": "pt"})
    return (f"rewritten with safetensors.save_file from the model's state dict in the {describe_layout(want)} layout "
            f"(tied lm_head left out); save_pretrained had written the {by_hf} layout")


def check_reload(fam, spec, built, model_dir, batch, name):
    """The folder as transformers reads it must be the model we built: config fields, weights, logits."""
    model32, info = load_model(fam, model_dir, with_info=True)
    problems = csc.loading_problems(info)
    if built.config.tie_word_embeddings:
        problems -= {"missing_keys: lm_head.weight"}
    if problems:
        die(f"{name}: loading {model_dir} reported {sorted(problems)}")
    arch, config = spec["arch"], model32.config
    for key, value in arch.items():
        got = config.rope_parameters.get(key, 1.0) if key in ROPE_KEYS else getattr(config, key, None)
        if (list(got) if isinstance(got, (list, tuple)) else got) != value:
            die(f"{name}: reloaded config has {key} = {got!r}, wrote {value!r} (config.json rewrite misread?)")
    if config.rope_parameters.get("rope_type", "default") != "default":
        die(f"{name}: reloaded rope_parameters {config.rope_parameters}")
    built_sd, loaded_sd = built.state_dict(), model32.state_dict()
    if set(built_sd) != set(loaded_sd) or any(not torch.equal(built_sd[k], loaded_sd[k]) for k in built_sd):
        die(f"{name}: parameters reloaded from {model_dir} differ from the built model's ({spec['layout']} layout "
            "merged wrongly?)")
    with torch.no_grad():
        ids = batch["docs"][1]
        diff = (built(input_ids=ids[None], use_cache=False).logits
                - model32(input_ids=ids[None], use_cache=False).logits).abs().max().item()
    if diff > 1e-6:
        die(f"{name}: reloaded model's logits differ from the built model's by {diff:.3g}")


# ---- the packed batch: two passes ----

def packed_passes(fam, model, batch, aux_fn):
    """Pass 1: qwen3_fixtures' packed_forward_backward (logits, loss, d loss) with the routers observed. Pass 2: the
    forward again and d aux_fn(router logits of all sparse layers over the whole packed batch)."""
    config = model.config
    experts, k, coef = config.num_experts, config.num_experts_per_tok, config.router_aux_loss_coef
    with RouterCapture(model, fam) as cap, ExpertsCheck(model, fam) as check:
        logits, loss, grads = packed_forward_backward(model, batch)
    router_logits = {layer: v.detach() for layer, v in cap.rows("logits").items()}
    choices = cap.rows("choices")
    total = int(batch["input_ids"].numel())
    if any(v.shape != (total, experts) for v in router_logits.values()):
        die(f"router logits of shapes {[tuple(v.shape) for v in router_logits.values()]}, "
            f"({total}, {experts}) expected")

    model.zero_grad(set_to_none=True)
    with RouterCapture(model, fam) as cap2, ExpertsCheck(model, fam) as check2:
        for ids in batch["docs"]:
            model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False)
    logits2 = cap2.rows("logits")
    aux = aux_fn(tuple(logits2[layer] for layer in cap2.layers), experts, k)
    if not (torch.is_tensor(aux) and aux.requires_grad):
        die(f"the load-balancing loss is {aux!r}, not a differentiable tensor")
    aux.backward()
    if any(not torch.equal(v, choices[layer]) for layer, v in cap2.rows("choices").items()):
        die("the second pass routed differently from the first")
    if check.calls == 0 or check2.calls == 0:
        die("no experts call was observed")
    aux_grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters()}
    return dict(logits=logits, loss=loss, grads=grads, aux=aux.detach().double(),
                grads_aux={n: grads[n] + coef * aux_grads[n] for n in grads},
                router_logits=router_logits, choices=choices, coef=coef)


def check_hf_router_logits(fam, model, batch):
    """The model's own output_router_logits path returns the logits the hooks saw, and its aux_loss is
    load_balancing_loss_func of them (checks the set and order of sparse layers, E and top-k)."""
    mq = hf_module(fam)
    ids = batch["docs"][0]
    with torch.no_grad(), RouterCapture(model, fam) as cap:
        try:
            out = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False,
                        output_router_logits=True)
        except Exception as e:  # noqa: BLE001
            die(f"forward with output_router_logits=True failed: {e!r}")
    mine = cap.rows("logits")
    theirs = getattr(out, "router_logits", None)
    if theirs is None or len(theirs) != len(cap.layers):
        die(f"output_router_logits gave {None if theirs is None else len(theirs)} tensors for sparse layers "
            f"{cap.layers}")
    for layer, t in zip(cap.layers, theirs):
        if t.numel() != mine[layer].numel() or not torch.equal(t.reshape(mine[layer].shape), mine[layer]):
            die(f"output_router_logits differs from the router hook's logits in layer {layer}")
    want = mq.load_balancing_loss_func(tuple(mine[layer] for layer in cap.layers), model.config.num_experts,
                                       model.config.num_experts_per_tok, None)
    got = getattr(out, "aux_loss", None)
    if got is None or abs(float(got) - float(want)) > 1e-9 * max(1.0, abs(float(want))):
        die(f"the model's aux_loss {got} is not load_balancing_loss_func of its router logits ({float(want)})")


def same_choices(a, b):
    """Per layer, per token, the same set of experts (the order within the top-k may differ)."""
    return all(torch.equal(a[layer].sort(dim=-1).values, b[layer].sort(dim=-1).values) for layer in b)


def differences(run, golden):
    return dict(logits=(run["logits"].double() - golden["logits"]).abs().max().item(),
                loss=abs(run["loss"].item() - golden["loss"].item()),
                aux=abs(run["aux"].item() - golden["aux"].item()) / max(abs(golden["aux"].item()), 1e-30),
                grads=max_rel_grad_diff(run["grads"], golden["grads"]),
                grads_aux=max_rel_grad_diff(run["grads_aux"], golden["grads_aux"]),
                same_experts=same_choices(run["choices"], golden["choices"]),
                order_differs=sum(int((run["choices"][layer] != golden["choices"][layer]).any(dim=-1).sum())
                                  for layer in golden["choices"]))


def fmt(d):
    return (f"logits {d['logits']:.2e}, loss {d['loss']:.2e}, aux(rel) {d['aux']:.2e}, grads(rel) {d['grads']:.2e}, "
            f"grads_aux(rel) {d['grads_aux']:.2e}, same experts {d['same_experts']}")


def compute(fam, model_dir, batch, name):
    """Golden (patched float64), stock float64 and stock float32 runs, with their checks."""
    mq = hf_module(fam)
    expected = {row[0] for row in patch_table(fam, mq)}
    PATCH_CALLS.clear()
    set_fp64_patches(fam, True)
    try:
        model = load_model(fam, model_dir, double=True)
        golden = packed_passes(fam, model, batch, load_balancing_fp64)
        check_hf_router_logits(fam, model, batch)
    finally:
        set_fp64_patches(fam, False)
    never = sorted(c for c in expected if PATCH_CALLS.get(c, 0) == 0)
    if never:
        die(f"{name}: float64 patches never called: {never} ({PATCH_CALLS}); transformers' internals changed, "
            "update patch_table()")

    def stock_aux(gate_logits, experts, k):
        return mq.load_balancing_loss_func(gate_logits, experts, k, None)

    q35.STOCK_CALLS.clear()
    count_stock_gdn(fam, True)
    try:
        stock = packed_passes(fam, load_model(fam, model_dir, double=True), batch, stock_aux)
    finally:
        count_stock_gdn(fam, False)
    path = q35.code_path() if fam["gdn"] else None
    stock_diff = differences(stock, golden)
    if not stock_diff["same_experts"]:
        die(f"{name}: stock float64 HF chooses other experts than the golden run")
    worst = max(stock_diff["logits"], stock_diff["grads"], stock_diff["grads_aux"], stock_diff["aux"])
    if worst > STOCK_TOL:
        die(f"{name}: stock HF float64 disagrees with the patched float64 reference: {fmt(stock_diff)}")
    f32 = packed_passes(fam, load_model(fam, model_dir), batch, stock_aux)
    f32_diff = differences(f32, golden)
    if not f32_diff["same_experts"]:
        die(f"{name}: stock float32 HF chooses other experts than the golden run")
    return golden, stock_diff, f32_diff, f32, path


# ---- fixtures ----

def config_summary(fam_name, fam, config, sparse):
    dense = [i for i in range(config.num_hidden_layers) if i not in sparse]
    parts = [f"family {fam_name} ({fam['model']}), vocab {config.vocab_size}, hidden {config.hidden_size}, "
             f"{config.num_hidden_layers} layers, tie_word_embeddings {config.tie_word_embeddings}"]
    if fam["gdn"]:
        parts.append(f"layer_types {list(config.layer_types)}; GDN H_k {config.linear_num_key_heads}, H_v "
                     f"{config.linear_num_value_heads}, d_k {config.linear_key_head_dim}, d_v "
                     f"{config.linear_value_head_dim}, conv {config.linear_conv_kernel_dim}"
                     + (", fused in_proj_qkvz / in_proj_ba" if fam["fused_gdn_projections"] else ""))
    parts.append(f"attention {config.num_attention_heads} q / {config.num_key_value_heads} kv heads, head_dim "
                 f"{config.head_dim}, rope {config.rope_parameters}")
    norm = ("always renormalised (qwen3_5_moe_text has no norm_topk_prob)" if fam["router_always_normalises"]
            else f"norm_topk_prob {config.norm_topk_prob}")
    parts.append(f"experts E {config.num_experts}, top-{config.num_experts_per_tok}, moe_intermediate_size "
                 f"{config.moe_intermediate_size}, top-k weights {norm}"
                 + (f", shared expert {config.shared_expert_intermediate_size} with its sigmoid gate"
                    if fam["shared_expert"] else ""))
    layers = f"sparse layers {sparse}, dense layers {dense}"
    if fam["sparse_step"]:
        layers += (f" (decoder_sparse_step {config.decoder_sparse_step}, mlp_only_layers {config.mlp_only_layers}"
                   + (f", dense MLP intermediate_size {config.intermediate_size}" if dense else "") + ")")
    parts.append(layers + f"; router_aux_loss_coef {config.router_aux_loss_coef}")
    return "\n".join(parts)


def write_fixture(out_dir, name, spec):
    import transformers
    from safetensors.torch import save_file
    fam = FAMILIES[spec["family"]]
    fixture_dir = os.path.join(out_dir, name)
    model_dir = os.path.join(fixture_dir, "model")
    os.makedirs(fixture_dir, exist_ok=True)
    arch, seed = spec["arch"], spec["seed"]

    built = build_model(fam, arch, seed)
    batch = make_batch(arch["vocab_size"], seed)
    draw, _ = draw_routers(built, batch, spec, fam)
    check_tying(built)
    how_written = save_model(built, model_dir, spec, fam)
    check_reload(fam, spec, built, model_dir, batch, name)

    golden, stock_diff, f32_diff, f32, path = compute(fam, model_dir, batch, name)
    k, experts = arch["num_experts_per_tok"], arch["num_experts"]
    gaps = {layer: float(topk_gaps(v, k).min()) for layer, v in golden["router_logits"].items()}
    if min(gaps.values()) <= TOPK_GAP:
        die(f"{name}: golden top-{k} margins {gaps} not above {TOPK_GAP}")
    f32_gaps = {layer: float(topk_gaps(v, k).min()) for layer, v in f32["router_logits"].items()}
    empty = [(layer, e) for layer, c in golden["choices"].items()
             for e in range(experts) if not bool((c == e).any())]
    if spec["empty_expert"] is not None:
        layer, e = spec["empty_expert"]
        if (layer, e) not in empty or float(golden["router_logits"][layer][:, e].max()) > -EMPTY_LOGIT / 2:
            die(f"{name}: expert {e} of layer {layer} is not empty in the golden routing")
    for layer, e in empty:   # HF runs only the experts that got tokens: the others' slices get no gradient
        for grads in (golden["grads"], golden["grads_aux"]):
            for proj in ("gate_up_proj", "down_proj"):
                if bool(grads[f"model.layers.{layer}.mlp.experts.{proj}"][e].any()):
                    die(f"{name}: expert {e} of layer {layer} got no token but its {proj} has a gradient")

    loss, aux, coef = golden["loss"], golden["aux"], golden["coef"]
    tensors = {
        "input_ids": batch["input_ids"].to(torch.int32),
        "cu_seqlens": batch["cu_seqlens"].to(torch.int32),
        "position_ids": batch["position_ids"].to(torch.int32),
        "labels": batch["labels"].to(torch.int32),
        "logits": golden["logits"].float(),
        "loss": loss.reshape(1).float(),
        "aux_loss": aux.reshape(1).float(),
        "loss_with_aux": (loss + coef * aux).reshape(1).float(),
    }
    for pname, g in golden["grads"].items():
        tensors["grad." + pname] = g.float()
    for pname, g in golden["grads_aux"].items():
        tensors["grad_aux." + pname] = g.float()
    for layer, c in golden["choices"].items():
        tensors[f"routing.{layer}"] = c.to(torch.int32)
    empty_text = [f"layer {layer} expert {e}" + (" (deliberate)" if (layer, e) == spec["empty_expert"] else "")
                  for layer, e in empty]
    metadata = {"config": name, "family": spec["family"], "seed": str(seed), "layout": spec["layout"],
                "rope_spelling": spec["rope_spelling"], "router_draw": str(draw),
                "router_aux_loss_coef": repr(coef), "empty_experts": json.dumps(empty_text),
                "compute": "float64 (router softmax, norms, gated norm, RoPE, softmax, GDN gates/conv/core and the "
                           "load-balancing loss patched to float64), stored float32",
                "transformers": transformers.__version__, "torch": torch.__version__}
    if path is not None:
        metadata["code_path"] = json.dumps(path)
    save_file({key: v.contiguous() for key, v in tensors.items()}, os.path.join(fixture_dir, "reference.safetensors"),
              metadata=metadata)

    sparse = sorted(golden["choices"])
    layout = {"per_expert": "per-expert: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight, (I, H), (I, H), "
                            "(H, I)",
              "fused": "fused: model.layers.L.mlp.experts.gate_up_proj (E, 2I, H) = [gate; up] along dim 1 and "
                       "model.layers.L.mlp.experts.down_proj (E, H, I), no .weight suffix"}[spec["layout"]]
    with open(os.path.join(fixture_dir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"{name}: {spec['about']}\n")
        f.write(config_summary(spec["family"], fam, load_model(fam, model_dir).config, sparse) + "\n")
        f.write(f"experts checkpoint layout: {layout}; model.safetensors {how_written}; reloaded with "
                f"from_pretrained: no missing or unexpected keys, parameters equal to the built model's\n")
        f.write(f"rope spelling in model/config.json: {spec['rope_spelling']}\n")
        f.write(f"documents {list(DOC_LENGTHS)} packed (T = {sum(DOC_LENGTHS)}); labels = next token in the document, "
                f"-100 at each document's last token and {EXTRA_IGNORED} random others\n")
        f.write(f"router rows normal(0, {ROUTER_LOGIT_STD}/sqrt(hidden)), draw {draw} (seed {seed} * 1000 + draw); "
                f"smallest gap between the k-th and (k+1)-th router probability per sparse layer: golden "
                f"{ {layer: round(g, 5) for layer, g in gaps.items()} }, stock float32 "
                f"{ {layer: round(g, 5) for layer, g in f32_gaps.items()} }\n")
        f.write("(layer, expert) pairs that receive no token in the golden routing: "
                + (", ".join(empty_text) if empty_text else "none")
                + (f"; the deliberate one's router row was solved so that its logit is -{EMPTY_LOGIT:g} on every "
                   "token of the batch" if spec["empty_expert"] else "") + "\n")
        f.write(f"routing.L rows are in top-k order (descending golden probability); stock float32 HF chooses the "
                f"same experts for every token (rows whose top-k order differs: {f32_diff['order_differs']})\n")
        f.write(f"loss {loss.item():.6f}, aux_loss {aux.item():.6f} (load_balancing_loss_func over all "
                f"{sum(DOC_LENGTHS)} rows of every sparse layer), loss_with_aux = loss + {coef} * aux_loss\n")
        if path is not None:
            f.write(f"stock transformers GDN code path on the generating machine: {json.dumps(path)}\n")
        f.write(f"stock-fp64 vs golden: {fmt(stock_diff)}\nfp32 vs golden: {fmt(f32_diff)}\n")
        f.write(f"written by dev/ref/moe_fixtures.py (seed {seed}) with transformers {transformers.__version__}, "
                f"torch {torch.__version__}\n")
    print(f"{name}: loss {loss.item():.6f}, aux {aux.item():.6f}, router draw {draw}, min top-k gap "
          f"{min(gaps.values()):.2e}, empty experts {empty}; stock-fp64 vs golden: {fmt(stock_diff)}; fp32 vs golden: "
          f"{fmt(f32_diff)}" + (f"; GDN path {path}" if path is not None else ""))


def main():
    parser = argparse.ArgumentParser(description="Write golden MoE fixtures (logits, losses, routing, grads) from HF.")
    parser.add_argument("out_dir", help="output folder, e.g. tests/models/fixtures/moe")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="write only these configs")
    args = parser.parse_args()
    wanted = [name for name in FIXTURES if not args.only or name in args.only]
    for name in wanted:
        hf_module(FAMILIES[FIXTURES[name]["family"]])
    torch.set_grad_enabled(True)
    for name in wanted:
        write_fixture(args.out_dir, name, FIXTURES[name])


if __name__ == "__main__":
    main()
