"""Causal packed attention, lathe vs torch, on the same GPU in the same run.

Runs bench/attention_bench (lathe's attention ops, whatever the registry resolves) and times, on the same
shapes, torch.nn.functional.scaled_dot_product_attention with the flash backend (is_causal, the documents as a
batch of equal sequences, GQA through enable_gqa), flash_attn_varlen_func when flash_attn is installed, and
SDPA's cuDNN backend for reference. Same timing method as the lathe side: random inputs, 3 warm-up rounds,
median of event-timed iterations. FLOP model (causal, per document of length L): forward 2*2*L^2/2*Hq*D,
backward 2.5x forward.

Usage: python3 bench/attention_vs_torch.py [--lathe-bin build/bench/attention_bench] [--iters 20]
Prints the card, driver, CUDA and torch versions, one JSON line per measurement and a table with the ratios.
"""
import argparse
import json
import subprocess

import torch
import torch.nn.functional as F

CONFIGS = [  # tokens, documents, q heads, kv heads, head dim
    (16384, 4, 16, 8, 128),
    (16384, 4, 32, 8, 128),
]


def median_ms(fn, iters):
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def time_impl(fwd, iters, q, k, v, do):
    """fwd(q, k, v) -> o. Returns (fwd_ms, fwdbwd_ms)."""
    for _ in range(3):
        o = fwd(q, k, v)
        torch.autograd.grad(o, (q, k, v), do)
    with torch.no_grad():
        fwd_ms = median_ms(lambda: fwd(q, k, v), iters)

    def both():
        o = fwd(q, k, v)
        torch.autograd.grad(o, (q, k, v), do)

    return fwd_ms, median_ms(both, iters)


def torch_rows(tokens, docs, hq, hkv, d, iters):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    length = tokens // docs
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)

    # Same (tokens, heads, D) memory layout as lathe's packed tensors, seen as (B, H, L, D).
    q = rand(docs, length, hq, d).transpose(1, 2).requires_grad_()
    k = rand(docs, length, hkv, d).transpose(1, 2).requires_grad_()
    v = rand(docs, length, hkv, d).transpose(1, 2).requires_grad_()
    do = rand(docs, length, hq, d).transpose(1, 2)
    rows = []
    for name, backend in (("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION), ("torch_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        note = "enable_gqa"

        def fwd(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        try:
            fwd_ms, both_ms = time_impl(fwd, iters, q, k, v, do)
        except RuntimeError as e:  # no GQA in this backend: repeat K/V heads (the repeat is timed too)
            note = "repeat_interleave kv"

            def fwd(q, k, v, backend=backend):
                g = q.shape[1] // k.shape[1]
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                          is_causal=True)

            try:
                fwd_ms, both_ms = time_impl(fwd, iters, q, k, v, do)
            except RuntimeError as e2:
                rows.append({"impl": name, "error": f"{str(e)[:120]} / {str(e2)[:120]}"})
                continue
        rows.append({"impl": name, "fwd_ms": fwd_ms, "fwdbwd_ms": both_ms, "note": note})
    try:
        from flash_attn import flash_attn_varlen_func

        cu = torch.arange(0, tokens + 1, length, device="cuda", dtype=torch.int32)
        qp, kp, vp = (x.detach().transpose(1, 2).reshape(tokens, x.shape[1], d).requires_grad_() for x in (q, k, v))
        dop = do.transpose(1, 2).reshape(tokens, hq, d)

        def fwd(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu, cu, length, length, causal=True)

        fwd_ms, both_ms = time_impl(fwd, iters, qp, kp, vp, dop)
        rows.append({"impl": "flash_attn_varlen", "fwd_ms": fwd_ms, "fwdbwd_ms": both_ms, "note": "flash_attn"})
    except ImportError:
        pass
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe-bin", default="build/bench/attention_bench")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"card: {smi}; torch {torch.__version__} (CUDA {torch.version.cuda}); commit {commit or 'unknown'}")
    table = []
    for tokens, docs, hq, hkv, d in CONFIGS:
        fwd_flop = docs * 2 * 2 * (tokens // docs) ** 2 / 2 * hq * d
        out = subprocess.run([args.lathe_bin, str(tokens), str(docs), str(hq), str(hkv), str(d), "bf16", str(args.iters)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"lathe bench failed: {out.stderr}")
        lathe = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(lathe))
        rows = [{"impl": "lathe", "fwd_ms": lathe["fwd_ms"], "fwdbwd_ms": lathe["fwdbwd_ms"], "note": lathe["kernels"]}]
        for r in torch_rows(tokens, docs, hq, hkv, d, args.iters):
            print(json.dumps(r))
            rows.append(r)
        torch.cuda.empty_cache()
        table.append(((tokens, docs, hq, hkv, d), fwd_flop, rows))
    print()
    print(f"{'config':34} {'impl':20} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9} "
          f"{'fwd ratio':>9} {'f+b ratio':>9}")
    for (tokens, docs, hq, hkv, d), fwd_flop, rows in table:
        cfg = f"T={tokens} docs={docs} Hq={hq} Hkv={hkv} D={d}"
        lathe = rows[0]
        for r in rows:
            if "error" in r:
                print(f"{cfg:34} {r['impl']:20} error: {r['error']}")
                continue
            fwd_tf = fwd_flop / (r["fwd_ms"] * 1e-3) / 1e12
            both_tf = 3.5 * fwd_flop / (r["fwdbwd_ms"] * 1e-3) / 1e12
            ratio_f = r["fwd_ms"] / lathe["fwd_ms"]  # > 1: lathe faster
            ratio_b = r["fwdbwd_ms"] / lathe["fwdbwd_ms"]
            print(f"{cfg:34} {r['impl']:20} {r['fwd_ms']:8.3f} {fwd_tf:9.1f} {r['fwdbwd_ms']:8.3f} {both_tf:9.1f} "
                  f"{ratio_f:9.3f} {ratio_b:9.3f}")
    print("ratio = that implementation's time / lathe's time (above 1: lathe is faster)")


if __name__ == "__main__":
    main()
