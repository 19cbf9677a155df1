"""Probe (session 35): torch's cuDNN SDPA backend at head dim 256 -- are its gradients right (against fp32 math on a
small causal shape) and how fast is its backward at long documents. Prints the cuDNN version torch loaded.
Usage: python3 dev/attn256_probe.py"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())


def grads(q, k, v, do, backend):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(o, (q, k, v), do)


def nmse(a, b):
    a, b = a.double(), b.double()
    return ((a - b) ** 2).sum().item() / (b ** 2).sum().item()


gen = torch.Generator(device="cuda").manual_seed(1)
for (b, h, s, d) in [(1, 4, 1024, 256), (2, 8, 4096, 256), (2, 8, 4096, 128)]:
    q, k, v, do = ((torch.rand(b, h, s, d, device="cuda", generator=gen) * 2 - 1) for _ in range(4))
    ref = grads(q, k, v, do, SDPBackend.MATH)  # fp32 math
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            got = grads(qb, kb, vb, dob, backend)
            print(f"B={b} H={h} S={s} D={d} {name}: nmse dq {nmse(got[0], ref[0]):.2e} dk {nmse(got[1], ref[1]):.2e} "
                  f"dv {nmse(got[2], ref[2]):.2e}")
        except Exception as e:  # noqa: BLE001
            print(f"B={b} H={h} S={s} D={d} {name}: {type(e).__name__}: {str(e)[:200]}")

for (b, h, s, d) in [(1, 4, 32768, 256), (1, 4, 131072, 256)]:
    q, k, v, do = ((torch.rand(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) - 0.5) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            times = []
            for _ in range(4):
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                en.record()
                en.synchronize()
                times.append(st.elapsed_time(en))
            ms = sorted(times)[len(times) // 2]
            flop = 2.5 * 2 * 2 * s * s / 2 * h * d * b
            print(f"B={b} H={h} S={s} D={d} {name} backward {ms:.2f} ms {flop / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            print(f"B={b} H={h} S={s} D={d} {name}: {type(e).__name__}: {str(e)[:200]}")
