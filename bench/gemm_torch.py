"""Baseline for bench/gemm_bench.cpp: torch.matmul on the same shape, dtype and timing method
(random inputs, 5 warm-up products, median of event-timed iterations). Prints one JSON line."""
import json
import sys

import torch

m, n, k = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 8192, 8192)
dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[sys.argv[4] if len(sys.argv) > 4 else "bf16"]
iters = int(sys.argv[5]) if len(sys.argv) > 5 else 50
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.empty(m, k, device="cuda").uniform_(-1, 1).to(dtype)
b = torch.empty(k, n, device="cuda").uniform_(-1, 1).to(dtype)
c = torch.empty(m, n, device="cuda", dtype=dtype)
for _ in range(5):
    torch.matmul(a, b, out=c)
times = []
for _ in range(iters):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.matmul(a, b, out=c)
    e.record()
    e.synchronize()
    times.append(s.elapsed_time(e))
times.sort()
med = times[len(times) // 2]
print(json.dumps({"impl": "torch", "m": m, "n": n, "k": k, "dtype": sys.argv[4] if len(sys.argv) > 4 else "bf16",
                  "ms": round(med, 4), "tflops": round(2 * m * n * k / (med * 1e-3) / 1e12, 1),
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
