#!/usr/bin/env python3
"""Training throughput, Hugging Face transformers against `lathe bench`, same shapes, batch and card (issue 7).

For each row, the transformers baseline runs in a subprocess of its own (random init from a Qwen3Config,
attn_implementation="sdpa", torch.optim.AdamW(fused=True), synthetic random batch, steps timed between
torch.cuda.synchronize() calls, peak = torch.cuda.max_memory_allocated()), then `lathe bench` with the same shape,
sequence length and micro-batch, also in a subprocess, so no memory carries over from one measurement to the next.
Prints a table (tokens/s, MFU, peak memory of each and the ratio) and writes the results as JSON.

Rows (the issue's recipe, seq 4096):
  0.6b  fp32 parameters (the masters) + bf16 autocast, micro-batch 4
  1.7b  fp32 parameters + bf16 autocast, micro-batch 2
  4b    bf16 parameters, no autocast, micro-batch 1
  lora  (--lora) rank 16, alpha 32, all linear modules (peft), 0.6b shape, bf16 base + bf16 autocast, seq 2048,
        micro-batch 8
  q35-0.8b  the Qwen3.5-0.8B shape of issue 8 (24 layers, 3 Gated DeltaNet + 1 gated attention repeated, hidden 1024,
        8/2 attention heads of 256, 16/16 GDN heads of 128, FFN 3584, tied vocab 248320), bf16 parameters, seq 4096,
        micro-batch 2. transformers runs its own GDN path: the flash-linear-attention kernels when that package is
        installed, else its PyTorch fallback (torch_chunk_gated_delta_rule); the row records which ("gdn_path").
  30b-a3b  the Qwen3-30B-A3B shape of issue 9 (hidden 2048, 128 experts, top 8, expert FFN 768, 32/4 heads of 128,
        untied vocab 151936) cut to MOE_LAYERS (14) layers, as many as fit one H100 80GB for transformers' full
        fine-tuning (15 run out of memory there; --moe-layers N for another count), bf16 parameters, seq 4096,
        micro-batch 1; transformers runs its default experts implementation (recorded as "experts_implementation";
        --hf-experts eager runs its per-expert loop instead); MFU counts the active experts only.
A training step on both sides: zero grads, forward + loss, backward, global grad norm (clipping at 1.0), AdamW step.
Lathe keeps bf16 parameters with fp32 AdamW masters (its training default) for every row; with --lathe-bf16-states,
the full fine-tuning rows whose HF recipe is bf16 parameters (4b, q35-0.8b, 30b-a3b) run `lathe bench
--optimizer-states bf16` instead: no masters, bf16 moments, the parameters updated in place, as
torch.optim.AdamW(fused=True) does on bf16 parameters (docs/optim.md). With --lathe-nondeterministic, Lathe's
attention backward may sum dQ in any order (`lathe bench --nondeterministic`), as torch's SDPA backward does; with
--lathe-gemm-autotune, Lathe times cuBLASLt's candidate algorithms per GEMM shape (`lathe bench --gemm-autotune`).
The LoRA row keeps fp32 states: peft upcasts the bf16 adapter weights to fp32 (autocast_adapter_dtype=True), so HF
trains fp32 adapters there. Each row records
"lathe_optimizer_states".
MFU for both sides by one FLOP model (DESIGN.md "Measuring", src/train/flops.h): 6 N_matmul per token plus causal
attention 6 L Hq D S; LoRA: 4 N_matmul + 6 N_adapter + attention; Qwen3.5: attention over its full-attention layers
only, plus the chunked GDN core per GDN layer and value head (research/gated-deltanet.md sec. 3.6, chunk 64:
22 dk dv + 24 C dk + 14 C dv + 4 C^2); against 989 TFLOP/s (H100/H200 bf16 dense).

Usage (GPU machine): python3 bench/hf_side_by_side.py --lathe-bin build/lathe [--shapes 0.6b,1.7b,4b] [--lora]
                     [--lathe-bf16-states] [--lathe-nondeterministic]
                     [--lathe-gemm-autotune] [--steps 5] [--warmup 2] [--out side_by_side.json]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

SHAPES = {  # layers, hidden, FFN, query heads (8 KV heads of 128, tied 151936 vocab for all)
    "0.6b": (28, 1024, 3072, 16),
    "1.7b": (28, 2048, 6144, 16),
    "4b": (36, 2560, 9728, 32),
}
VOCAB, KV_HEADS, HEAD_DIM = 151936, 8, 128
# Qwen3.5 shapes: layers, hidden, FFN, attention heads, KV heads, head dim, GDN key heads, value heads, GDN head dim,
# vocab (tied; one full-attention layer every 4).
Q35_SHAPES = {"q35-0.8b": (24, 1024, 3584, 8, 2, 256, 16, 16, 128, 248320)}
# The Qwen3-30B-A3B shape of issue 9 (hidden 2048, 128 experts, top 8, expert FFN 768, 32/4 heads of 128, untied
# vocab 151936), cut to MOE_LAYERS layers: the most with which transformers' full fine-tuning (bf16 parameters and
# AdamW moments) fits one H100 80GB; measured 2026-11-27, docs/benchmarks.md "Session 13": 14 layers peak at 69.7 GiB,
# 15 run out of memory in the backward (Lathe fits 15; 16 run out of memory on both sides).
MOE_SHAPES = {"30b-a3b": dict(hidden=2048, experts=128, top_k=8, expert_ffn=768, heads=32, kv=4, vocab=151936)}
MOE_LAYERS = 14
ROWS = {
    "0.6b": dict(shape="0.6b", seq=4096, micro_batch=4, params="fp32", autocast=True, lora_rank=0),
    "1.7b": dict(shape="1.7b", seq=4096, micro_batch=2, params="fp32", autocast=True, lora_rank=0),
    "4b": dict(shape="4b", seq=4096, micro_batch=1, params="bf16", autocast=False, lora_rank=0),
    "lora": dict(shape="0.6b", seq=2048, micro_batch=8, params="bf16", autocast=True, lora_rank=16),
    "q35-0.8b": dict(shape="q35-0.8b", seq=4096, micro_batch=2, params="bf16", autocast=False, lora_rank=0),
    "30b-a3b": dict(shape="30b-a3b", seq=4096, micro_batch=1, params="bf16", autocast=False, lora_rank=0,
                    layers=MOE_LAYERS),
}
PEAK = 989e12


def matmul_params(shape):
    layers, h, ffn, heads = SHAPES[shape]
    per_layer = h * HEAD_DIM * (heads + 2 * KV_HEADS) + heads * HEAD_DIM * h + 3 * h * ffn
    return layers * per_layer + VOCAB * h  # the tied embedding once, as the LM head


def q35_flops_per_token(shape, seq):
    layers, h, ffn, heads, kv, d, hk, hv, dg, vocab = Q35_SHAPES[shape]
    full = layers // 4
    gdn = layers - full
    attn_w = h * d * (2 * heads + 2 * kv) + heads * d * h  # q_proj holds query and gate
    gdn_w = h * (2 * hk * dg + 2 * hv * dg + 2 * hv) + hv * dg * h  # in_proj_qkv, _z, _b, _a; out_proj
    n = full * attn_w + gdn * gdn_w + layers * 3 * h * ffn + vocab * h
    c = 64
    core = (6 * dg * dg + 6 * c * dg + 4 * c * dg) + (16 * dg * dg + 18 * c * dg + 10 * c * dg + 4 * c * c)
    return 6.0 * n + 6.0 * full * heads * d * seq + gdn * hv * core


def q35_config(shape):
    from transformers import Qwen3_5TextConfig
    layers, h, ffn, heads, kv, d, hk, hv, dg, vocab = Q35_SHAPES[shape]
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=d, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=dg, linear_value_head_dim=dg, linear_conv_kernel_dim=4, hidden_act="silu",
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, use_cache=False)


def moe_flops_per_token(shape, seq, layers):
    m = MOE_SHAPES[shape]
    h, d = m["hidden"], HEAD_DIM
    attn_w = h * d * (m["heads"] + 2 * m["kv"]) + m["heads"] * d * h
    mlp_w = h * m["experts"] + 3 * h * m["top_k"] * m["expert_ffn"]  # the router and the k active experts
    n = layers * (attn_w + mlp_w) + m["vocab"] * h
    return 6.0 * n + 6.0 * layers * m["heads"] * d * seq


def moe_config(shape, layers):
    from transformers import Qwen3MoeConfig
    m = MOE_SHAPES[shape]
    return Qwen3MoeConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=m["heads"], num_key_value_heads=m["kv"], head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        num_experts=m["experts"], num_experts_per_tok=m["top_k"], moe_intermediate_size=m["expert_ffn"],
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        max_position_embeddings=40960, use_cache=False)


def flops_per_token(shape, seq, adapter_params=0, lora=False, layers=0):
    if shape in Q35_SHAPES:
        return q35_flops_per_token(shape, seq)
    if shape in MOE_SHAPES:
        return moe_flops_per_token(shape, seq, layers)
    layers, _, _, heads = SHAPES[shape]
    attention = 6.0 * layers * heads * HEAD_DIM * seq  # one document of seq tokens: sum S^2 / S = S
    n = matmul_params(shape)
    return (4.0 * n + 6.0 * adapter_params if lora else 6.0 * n) + attention


def qwen3_config(shape):
    from transformers import Qwen3Config
    layers, h, ffn, heads = SHAPES[shape]
    return Qwen3Config(vocab_size=VOCAB, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=True, max_position_embeddings=40960, use_cache=False)


def gdn_path():
    """Which GDN implementation transformers' qwen3_5 uses here: the fla kernels or its PyTorch fallback."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    except ImportError:
        return None
    fast = getattr(m, "is_fast_path_available", None)
    return "flash-linear-attention" if fast else "torch fallback (torch_chunk_gated_delta_rule)"


def hf_worker(row, steps, warmup, experts=None, accum=1):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if row["shape"] in Q35_SHAPES:
        cfg = q35_config(row["shape"])
        vocab = cfg.vocab_size
    elif row["shape"] in MOE_SHAPES:  # transformers' own MoE path (its default experts implementation)
        cfg = moe_config(row["shape"], row["layers"])
        vocab = cfg.vocab_size
    else:
        cfg = qwen3_config(row["shape"])
        vocab = VOCAB
    dtype = torch.float32 if row["params"] == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", torch_dtype=dtype)
    model = model.to(device="cuda", dtype=dtype)
    if experts and row["shape"] in MOE_SHAPES:  # --hf-experts: another of transformers' experts implementations
        model.set_experts_implementation(experts)
    model.train()
    torch.cuda.reset_peak_memory_stats()  # the peak of training, the model included; not of its construction
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    adapter_params = 0
    if row["lora_rank"]:
        import peft
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=row["lora_rank"], lora_alpha=2 * row["lora_rank"], lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
        adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        versions["peft"] = peft.__version__
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    ids = torch.randint(0, vocab, (row["micro_batch"], row["seq"]), device="cuda")

    def step():  # `accum` micro-batches (each loss / accum), then one optimizer step
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=row["autocast"]):
                loss = model(input_ids=ids, labels=ids).loss  # labels shifted inside: next-token loss per row
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    tokens = row["micro_batch"] * row["seq"] * accum
    fpt = flops_per_token(row["shape"], row["seq"], adapter_params, bool(row["lora_rank"]), row.get("layers", 0))
    card = torch.cuda.get_device_name()
    peak = PEAK if ("H100" in card or "H200" in card) else 0
    attn = getattr(model.config, "_attn_implementation", None) or getattr(model.config, "attn_implementation", None)
    return {"tokens_per_s": tokens / step_s, "step_ms": 1e3 * step_s, "step_ms_min": 1e3 * min(times),
            "mfu": fpt * tokens / step_s / peak if peak else None, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "flops_per_token": fpt, "card": card, "attn_implementation": attn, "params_dtype": str(dtype),
            "autocast_bf16": row["autocast"], "adapter_params": adapter_params, "loss_first": losses[0],
            "loss_last": losses[-1], "gdn_path": gdn_path() if row["shape"] in Q35_SHAPES else None,
            "experts_implementation": getattr(model.config, "_experts_implementation", None), **versions}


def json_line(text):
    lines = [l for l in text.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def run_hf(name, row, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--steps", str(args.steps), "--warmup",
           str(args.warmup)]
    if args.hf_experts:
        cmd += ["--hf-experts", args.hf_experts]
    if row.get("layers"):
        cmd += ["--moe-layers", str(row["layers"])]
    cmd += ["--grad-accum", str(args.grad_accum)]
    return run_json(cmd, args.timeout)


def lathe_states(row, args):
    """Lathe's AdamW state dtype for a row: bf16 with --lathe-bf16-states where HF trains bf16 parameters (full
    fine-tuning rows with params == "bf16"; peft's LoRA adapters are fp32 even on a bf16 base), else f32."""
    return "bf16" if args.lathe_bf16_states and row["params"] == "bf16" and not row["lora_rank"] else "f32"


def run_lathe(row, args):
    cmd = [args.lathe_bin, "bench", "--device", "cuda", "--shape", row["shape"], "--seq", str(row["seq"]),
           "--micro-batch", str(row["micro_batch"]), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--optimizer-states", lathe_states(row, args), "--grad-accum", str(args.grad_accum)]
    if row["lora_rank"]:
        cmd += ["--lora-rank", str(row["lora_rank"])]
    if row.get("layers"):
        cmd += ["--layers", str(row["layers"])]
    if args.lathe_nondeterministic:
        cmd += ["--nondeterministic"]
    if args.lathe_gemm_autotune:
        cmd += ["--gemm-autotune"]
    out = run_json(cmd, args.timeout)
    if "error" in out and "out of memory" in out["error"].lower():  # AdamW states and activations: retry recomputing
        print(f"  lathe: {out['error']}; again with --recompute", flush=True)
        out = run_json(cmd + ["--recompute"], args.timeout)
    return out


def run_json(cmd, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "command": " ".join(cmd)}
    out = json_line(p.stdout)
    if p.returncode != 0 or out is None:
        tail = (p.stdout + p.stderr).strip().splitlines()[-6:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail), "command": " ".join(cmd)}
    for line in p.stdout.splitlines():
        if line.startswith("bench:"):
            print("  " + line, flush=True)
    out["command"] = " ".join(cmd)
    out["wall_s"] = time.time() - t0
    return out


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lathe-bin", default="build/lathe")
    ap.add_argument("--shapes", default="0.6b,1.7b,4b", help="comma-separated rows among 0.6b, 1.7b, 4b, q35-0.8b, 30b-a3b")
    ap.add_argument("--lora", action="store_true", help="add the LoRA row (rank 16, 0.6b shape, seq 2048)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per measurement")
    ap.add_argument("--out", default="side_by_side.json")
    ap.add_argument("--only", choices=["hf", "lathe"], help="run one side only")
    ap.add_argument("--lathe-bf16-states", action="store_true",
                    help="lathe keeps bf16 AdamW states (no fp32 masters) in the rows where HF trains bf16 parameters")
    ap.add_argument("--lathe-nondeterministic", action="store_true",
                    help="lathe bench --nondeterministic: the attention backward may sum dQ in any order, as torch's "
                         "SDPA backward does (docs/training.md)")
    ap.add_argument("--lathe-gemm-autotune", action="store_true",
                    help="lathe bench --gemm-autotune: the fastest of cuBLASLt's candidate algorithms per GEMM shape")
    ap.add_argument("--hf-experts", help="MoE rows: transformers' experts implementation to run instead of its default "
                    "(model.set_experts_implementation: eager is the per-expert loop, grouped_mm the default)")
    ap.add_argument("--moe-layers", type=int, default=MOE_LAYERS,
                    help=f"MoE rows: decoder layers of the cut model (default {MOE_LAYERS})")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches a step on both sides (the optimizer once a step; issue 26's MoE row: 8)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for row in ROWS.values():
        if "layers" in row:
            row["layers"] = args.moe_layers
    if args.worker:
        print(json.dumps(hf_worker(ROWS[args.worker], args.steps, args.warmup, args.hf_experts, args.grad_accum)),
              flush=True)
        return 0
    names = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    if args.lora:
        names.insert(min(2, len(names)), "lora")  # before 4b: the largest row runs last
    results = []
    for name in names:
        row = ROWS[name]
        layers = f", {row['layers']} layers" if row.get("layers") else ""
        print(f"{name}: seq {row['seq']} x micro-batch {row['micro_batch']} x grad_accum {args.grad_accum}{layers}",
              flush=True)
        hf = run_hf(name, row, args) if args.only != "lathe" else {}
        if "error" in hf:
            print(f"  HF: {hf['error']}", flush=True)
        elif hf:
            print(f"  HF: {hf['tokens_per_s']:.0f} tokens/s, {hf['step_ms']:.1f} ms/step, peak {hf['peak_mib']:.0f} MiB",
                  flush=True)
        lathe = run_lathe(row, args) if args.only != "hf" else {}
        if "error" in lathe:
            print(f"  lathe: {lathe['error']}", flush=True)
        ratio = (lathe["tokens_per_s"] / hf["tokens_per_s"]
                 if "tokens_per_s" in hf and "tokens_per_s" in lathe else None)
        results.append({"row": name, **row, "lathe_optimizer_states": lathe_states(row, args), "hf": hf,
                        "lathe": lathe, "ratio": ratio})
    card = next((r[s]["card"] for r in results for s in ("hf", "lathe") if "card" in r[s]), "unknown")
    print(f"\ncard: {card}; {datetime.date.today()}; steps {args.steps} after {args.warmup} warm-up, mean step time")
    head = (f"{'row':<6} {'seq x mb':>10} {'HF params':>9} {'lathe states':>12} {'HF tok/s':>10} {'lathe tok/s':>12} "
            f"{'lathe/HF':>9} {'HF MFU':>7} {'lathe MFU':>10} {'HF peak GiB':>12} {'lathe peak GiB':>15}")
    print(head)
    print("-" * len(head))
    for r in results:
        hf, la = r["hf"], r["lathe"]
        pct = lambda x: f"{100 * x:.1f}%" if isinstance(x, float) else "-"
        gib = lambda d: d.get("peak_mib", 0) / 1024 if "peak_mib" in d else None
        states = "bf16" if r["lathe_optimizer_states"] == "bf16" else "f32 masters"
        print(f"{r['row']:<6} {str(r['seq']) + ' x ' + str(r['micro_batch']):>10} {r['params']:>9} {states:>12} "
              f"{fmt(hf.get('tokens_per_s'), '.0f'):>10} "
              f"{fmt(la.get('tokens_per_s'), '.0f'):>12} {fmt(r['ratio'], '.3f'):>9} {pct(hf.get('mfu')):>7} "
              f"{pct(la.get('mfu')):>10} {fmt(gib(hf), '.1f'):>12} {fmt(gib(la), '.1f'):>15}")
    for r in results:
        if r["lathe"].get("recompute"):
            print(f"{r['row']}: lathe ran with --recompute (out of memory without it)")
    with open(args.out, "w") as f:
        json.dump({"date": str(datetime.date.today()), "card": card, "commit": os.environ.get("LATHE_COMMIT", ""),
                   "steps": args.steps, "warmup": args.warmup, "peak_flops": PEAK,
                   "lathe_bf16_states": args.lathe_bf16_states,
                   "lathe_nondeterministic": args.lathe_nondeterministic,
                   "lathe_gemm_autotune": args.lathe_gemm_autotune, "rows": results}, f, indent=2)
    print(f"results: {args.out}")
    return 0 if all("error" not in r["hf"] and "error" not in r["lathe"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
