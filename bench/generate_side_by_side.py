#!/usr/bin/env python3
"""Generation throughput, Hugging Face transformers' generate against `lathe generate --input` (the rollout engine),
same random weights, prompts, lengths and card (issue 27).

For each shape a random model is written once as an HF folder (bf16), with a JSONL of R prompts of P random token ids.
transformers generates them as one batch (greedy, exactly N new tokens, its static cache where the family takes it,
else its default cache), timed with torch.cuda.synchronize(); then `lathe generate --input` generates the same lines
(greedy, --ignore-eos, --max-new-tokens N, all R running at once) and its stderr summary gives tokens/s. A batch-1 row
(one prompt) times the decoding step against the time to read the weights once at the card's measured copy bandwidth.

Shapes: 1.7b (Qwen3-1.7B: 28 layers, hidden 2048, FFN 6144, 16/8 heads of 128, vocab 151936), q35-0.8b (the
Qwen3.5-0.8B text shape: 24 layers, 3 Gated DeltaNet + 1 gated attention repeated, hidden 1024, FFN 3584, 8/2 heads of
256, GDN 16/16 heads of 128, vocab 248320) and 30b-a3b-Nl (the Qwen3-30B-A3B shape cut to N layers: 128 experts of
768, top 8, 32/4 heads of 128; with --skip-hf, for the engine's decode graphs of a mixture-of-experts model).

Usage (GPU machine): python3 bench/generate_side_by_side.py --lathe-bin build/lathe [--shapes 1.7b,q35-0.8b]
                     [--requests 64] [--prompt 512] [--new 512] [--out /tmp/gen_bench]
Prints one line per measurement and writes OUT/results.json.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time


def log(*a):
    print(*a, flush=True)


def make_model(shape, folder):
    import torch
    from transformers import AutoModelForCausalLM
    if shape == "1.7b":
        from transformers import Qwen3Config
        config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                             max_position_embeddings=40960, rope_theta=1000000.0)
    elif shape == "q35-0.8b":
        from transformers import Qwen3_5TextConfig
        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6
        config = Qwen3_5TextConfig(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=256, layer_types=types,
                                   linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                                   max_position_embeddings=40960)
    elif shape.startswith("30b-a3b-"):  # the Qwen3-30B-A3B shape cut to N layers: 30b-a3b-Nl
        from transformers import Qwen3MoeConfig
        config = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                num_hidden_layers=int(shape[len("30b-a3b-"):-1]), num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960,
                                rope_theta=1000000.0)
    else:
        sys.exit(f"unknown shape {shape}")
    torch.manual_seed(0)
    with torch.device("cuda"):  # drawn on the card: minutes on the host for the larger shapes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return config.vocab_size


def hf_generate(folder, prompts, new_tokens, max_time):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kinds = ["static", None]
    for cache in kinds:
        try:
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(ids), max_time=max_time)
            if cache:
                kw["cache_implementation"] = cache
            model.generate(ids[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            steps = out.shape[1] - ids.shape[1]
            if steps < new_tokens:  # max_time ended it: the rate over the steps it made (prefill included)
                log(f"transformers generate stopped by max_time {max_time} s after {steps} of {new_tokens} tokens")
            label = (cache or "default") + ("" if steps == new_tokens else f", {steps} steps")
            return steps * out.shape[0] / dt, label, dt
        except Exception as e:  # the static cache is not offered for every family
            log(f"transformers generate with cache {cache}: {type(e).__name__}: {str(e)[:200]}")
    return None, None, None


def lathe_generate(lathe_bin, folder, prompts_path, out_path, new_tokens, running, cache_mib, timeout_s=150,
                   profile_step=-1, graphs="auto", time_forwards=False):
    cmd = [lathe_bin, "generate", "--model", folder, "--input", prompts_path, "--output", out_path, "--device", "cuda",
           "--max-new-tokens", str(new_tokens), "--ignore-eos", "--max-running", str(running), "--cache-mib",
           str(cache_mib), "--graphs", graphs] + (["--profile-step", str(profile_step)] if profile_step >= 0 else []) \
          + (["--time-forwards"] if time_forwards else [])
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log(f"lathe generate passed its {timeout_s} s limit: {(e.stderr or b'')[-800:]}")
        return None, f"timed out after {timeout_s} s"
    if r.returncode != 0:
        log(f"lathe generate failed ({r.returncode}): {r.stderr[-1500:]}")
        return None, r.stderr
    if profile_step >= 0:
        with open(out_path + ".profile.txt", "w") as f:
            f.write(r.stdout)
    m = re.search(r"\(([\d.]+) tokens/s\)", r.stderr)
    timed = [t.group(0) for t in (re.search(r"decode steps on the device: .*", r.stderr),
                                  re.search(r"step wall times: .*", r.stderr)) if t]
    summary = "; ".join([r.stderr.strip().splitlines()[-1]] + timed)
    return (float(m.group(1)) if m else None), summary


def copy_bandwidth():
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)  # read + write bytes per second


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe-bin", required=True)
    ap.add_argument("--shapes", default="1.7b,q35-0.8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--out", default="/tmp/gen_bench")
    ap.add_argument("--skip-hf", action="store_true", help="only lathe (no transformers baseline)")
    ap.add_argument("--hf-max-time", type=float, default=150.0,
                    help="transformers' generate stops after this many seconds; its rate is then over the steps made")
    ap.add_argument("--cache-mib", type=int, default=16384, help="lathe's KV cache")
    ap.add_argument("--skip-batch1", action="store_true", help="no batch-1 row")
    ap.add_argument("--skip-batched", action="store_true", help="only the batch-1 rows")
    ap.add_argument("--profile-step", type=int, default=-1, help="pass --profile-step to lathe generate")
    ap.add_argument("--graphs-off-too", action="store_true", help="batch 1 also without decode graphs")
    ap.add_argument("--graphs", default="auto", help="lathe generate --graphs for the batched run")
    ap.add_argument("--batch1-graphs", default="auto,off", help="with --graphs-off-too: the --graphs values at batch 1")
    ap.add_argument("--time-forwards", action="store_true",
                    help="batch 1: lathe generate --time-forwards (each decode step's device time, replayed and eager, "
                         "and the median step's wall time, which is then the step reported)")
    a = ap.parse_args()
    import torch
    os.makedirs(a.out, exist_ok=True)
    card = torch.cuda.get_device_name(0)
    bw = copy_bandwidth()
    log(f"card {card}; device copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {"card": card, "copy_bandwidth_gbs": bw / 1e9, "rows": []}
    for shape in a.shapes.split(","):
        folder = os.path.join(a.out, shape)
        if os.path.exists(os.path.join(folder, "config.json")):  # made by an earlier run into the same --out
            with open(os.path.join(folder, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
        else:
            vocab = make_model(shape, folder)
        weights = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt)] for _ in range(a.requests)]
        path = os.path.join(a.out, f"{shape}.jsonl")
        with open(path, "w") as f:
            for p in prompts:
                f.write(json.dumps({"tokens": p}) + "\n")
        hf, cache, hf_s = (None, None, None) if a.skip_hf else hf_generate(folder, prompts, a.new, a.hf_max_time)
        torch.cuda.empty_cache()
        cache_mib = a.cache_mib
        # A short run first, not reported: the first lathe process of a call ran slower (session 20, H200: 6,714
        # against 10,546 tok/s for the same 64-request run later in the call).
        lathe_generate(a.lathe_bin, folder, path, os.path.join(a.out, f"{shape}.warmup.out.jsonl"), 16, a.requests,
                       cache_mib, graphs=a.graphs)
        lt, summary = (None, "skipped") if a.skip_batched else lathe_generate(
            a.lathe_bin, folder, path, os.path.join(a.out, f"{shape}.r{a.requests}.out.jsonl"), a.new, a.requests,
            cache_mib, profile_step=a.profile_step, graphs=a.graphs, time_forwards=a.time_forwards)
        row = {"shape": shape, "requests": a.requests, "prompt": a.prompt, "new": a.new, "hf_tokens_per_s": hf,
               "hf_cache": cache, "lathe_tokens_per_s": lt, "lathe_summary": summary,
               "ratio": (lt / hf) if (lt and hf) else None}
        log(f"{shape}: {a.requests} x ({a.prompt} + {a.new}): transformers ({cache} cache) "
            f"{hf or 0:,.0f} tok/s, lathe {lt or 0:,.0f} tok/s, ratio {row['ratio'] or 0:.2f}x; {summary}")
        results["rows"].append(row)
        if a.skip_batch1:
            continue
        # Batch 1: one prompt, the decoding step against one read of the weights.
        one = os.path.join(a.out, f"{shape}.one.jsonl")
        with open(one, "w") as f:
            f.write(json.dumps({"tokens": prompts[0]}) + "\n")
        bound_ms = weights / (bw / 2) * 1e3  # reading the weights once at the copy's read rate
        # With decode graphs (auto) and without (off), in the same call: the graphs' effect at batch 1.
        for graphs in (a.batch1_graphs.split(",") if a.graphs_off_too else ["auto"]):
            lt1, summary1 = lathe_generate(a.lathe_bin, folder, one, os.path.join(a.out, f"{shape}.one.out.jsonl"),
                                           a.new, 1, cache_mib, profile_step=a.profile_step, graphs=graphs,
                                           time_forwards=a.time_forwards)
            # The decode step: the median step's wall time where lathe reports it (--time-forwards), else the run's
            # mean (which carries the first step: the prompt's prefill, graph recording, first kernel loads).
            median = re.search(r"median ([\d.]+) ms", summary1 or "")
            step_ms = float(median.group(1)) if median else (1e3 / lt1 if lt1 else None)
            key = "batch1" if graphs == "auto" else f"batch1_graphs_{graphs}"
            row.update({f"{key}_tokens_per_s": lt1, f"{key}_step_ms": step_ms, "weights_bytes": weights,
                        f"{key}_step_is_median": bool(median), "weights_read_ms": bound_ms,
                        f"{key}_over_bound": (step_ms / bound_ms) if step_ms else None})
            log(f"{shape} batch 1 (graphs {graphs}): {lt1 or 0:,.1f} tok/s over the run; a decode step "
                f"{step_ms or 0:.2f} ms ({'median' if median else 'mean over the run'}); reading "
                f"{weights / 1e9:.2f} GB of weights takes {bound_ms:.2f} ms ({(step_ms or 0) / bound_ms:.2f}x the "
                f"bound); {summary1}")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
