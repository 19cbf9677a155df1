"""The PyTorch recipe Lathe's data parallelism is measured against (issue 24): transformers' Qwen3ForCausalLM at the
Qwen3-1.7B shape (random weights), f32 parameters with bf16 autocast (DDP) or bf16 compute with f32 reduction
(FSDP2's MixedPrecisionPolicy), torch's fused AdamW, one micro-batch of 2 x 4096 tokens per GPU per step, SDPA
attention. Run with `torchrun --nproc_per_node N dev/torch_dp_baseline.py ddp|fsdp2 [steps]`; rank 0 prints the median
tokens/s over the steps after the fourth (all ranks' tokens) and each rank's peak memory."""
import os, statistics, sys, time

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

mode = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
shape = os.environ.get("SHAPE", "1.7b")
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
torch.manual_seed(0)
dims = {"1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
        "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32)}[shape]
cfg = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  rope_theta=1000000, max_position_embeddings=40960, attn_implementation="sdpa", **dims)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg)  # f32 parameters
if mode == "ddp":
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
elif mode == "fsdp2":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    autocast = lambda: torch.autocast("cuda", enabled=False)
else:
    raise SystemExit(f"mode {mode}: ddp or fsdp2")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
gen = torch.Generator(device="cuda").manual_seed(rank)
times = []
for step in range(steps):
    ids = torch.randint(0, cfg.vocab_size, (2, 4096), device="cuda", generator=gen)
    torch.cuda.synchronize(); t = time.perf_counter()
    with autocast():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device="cuda")
peaks = [torch.zeros_like(peak) for _ in range(world)]
dist.all_gather(peaks, peak)
if rank == 0:
    dt = statistics.median(times[4:])
    print(f"torch {mode} {shape} on {world} GPUs: {world * 8192 / dt:,.0f} tok/s ({dt * 1e3:.1f} ms a step, loss "
          f"{loss.item():.3f}); peak memory per rank {', '.join(f'{p.item():,.0f}' for p in peaks)} MiB")
dist.destroy_process_group()
