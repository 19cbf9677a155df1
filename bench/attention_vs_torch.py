"""Causal packed attention, lathe vs torch, on the same GPU in the same run.

Runs bench/attention_bench (lathe's attention ops, whatever the registry resolves -- the kernel names are printed --
and, by name, the tiled kernels the registry falls back to) and times, on the same shapes,
torch.nn.functional.scaled_dot_product_attention with the flash backend (is_causal, the documents as a batch of
equal sequences, GQA through enable_gqa), flash_attn_varlen_func when flash_attn is installed, and SDPA's cuDNN
backend for reference. A configuration with documents of unequal length runs lathe only. Same timing method as the lathe side: random inputs, 3 warm-up rounds,
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

CONFIGS = [  # tokens, documents, q heads, kv heads, head dim, uneven documents (lathe only)
    (16384, 4, 16, 8, 128, False),
    (16384, 4, 32, 8, 128, False),
    (16384, 4, 16, 4, 64, False),
    (16384, 4, 16, 4, 256, False),
    (16384, 8, 16, 8, 128, True),
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
    for tokens, docs, hq, hkv, d, uneven in CONFIGS:
        cmd = [args.lathe_bin, str(tokens), str(docs), str(hq), str(hkv), str(d), "bf16", str(args.iters),
               "uneven" if uneven else "equal"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        for line in out.stderr.splitlines():
            print(f"  lathe: {line}")
        if out.returncode != 0:
            raise SystemExit(f"lathe bench failed: {out.stderr}")
        lathe = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(lathe))
        cu = [0]
        for b in range(docs):  # the bench's document lengths (uneven: proportional to b + 1)
            length = tokens * 2 * (b + 1) // (docs * (docs + 1)) if uneven else tokens // docs
            cu.append(tokens if b == docs - 1 else cu[-1] + length)
        fwd_flop = sum(2 * 2 * (cu[b + 1] - cu[b]) ** 2 / 2 * hq * d for b in range(docs))
        rows = [{"impl": "lathe", "fwd_ms": lathe["fwd_ms"], "fwdbwd_ms": lathe["fwdbwd_ms"], "note": lathe["kernels"]}]
        if "flash_fwd_ms" in lathe:
            rows.append({"impl": "lathe tiled (fallback)", "fwd_ms": lathe["flash_fwd_ms"],
                         "fwdbwd_ms": lathe["flash_fwdbwd_ms"], "note": "cuda/flash_attention*"})
        if not uneven:
            for r in torch_rows(tokens, docs, hq, hkv, d, args.iters):
                print(json.dumps(r))
                rows.append(r)
        torch.cuda.empty_cache()
        table.append(((tokens, docs, hq, hkv, d, uneven), fwd_flop, rows, lathe))
    print()
    print(f"{'config':34} {'impl':20} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9} "
          f"{'fwd ratio':>9} {'f+b ratio':>9}")
    for (tokens, docs, hq, hkv, d, uneven), fwd_flop, rows, lathe in table:
        cfg = f"T={tokens} docs={docs}{'(uneven)' if uneven else ''} Hq={hq} Hkv={hkv} D={d}"
        base = rows[0]
        for r in rows:
            if "error" in r:
                print(f"{cfg:34} {r['impl']:20} error: {r['error']}")
                continue
            fwd_tf = fwd_flop / (r["fwd_ms"] * 1e-3) / 1e12
            both_tf = 3.5 * fwd_flop / (r["fwdbwd_ms"] * 1e-3) / 1e12
            ratio_f = r["fwd_ms"] / base["fwd_ms"]  # > 1: lathe faster
            ratio_b = r["fwdbwd_ms"] / base["fwdbwd_ms"]
            print(f"{cfg:34} {r['impl']:20} {r['fwd_ms']:8.3f} {fwd_tf:9.1f} {r['fwdbwd_ms']:8.3f} {both_tf:9.1f} "
                  f"{ratio_f:9.3f} {ratio_b:9.3f}")
        print(f"{'':34} lathe kernels: {lathe['kernels']}; backward bitwise repeatable: {lathe['deterministic']}; "
              f"first call (plan build) fwd {lathe['first_fwd_ms']:.0f} ms, bwd {lathe['first_bwd_ms']:.0f} ms"
              + (f"; cuDNN non-deterministic bwd {lathe['cudnn_nondeterministic_bwd_ms']:.3f} ms vs "
                 f"{lathe['bwd_ms']:.3f} ms" if "cudnn_nondeterministic_bwd_ms" in lathe else ""))
        print(f"{'':34} gradient nmse [dq, dk, dv] against lathe's: tiled {lathe.get('flash_grad_nmse', '-')}, "
              f"cuDNN non-deterministic {lathe.get('cudnn_nondeterministic_grad_nmse', '-')}")
    print("ratio = that implementation's time / lathe's time (above 1: lathe is faster)")


if __name__ == "__main__":
    main()
