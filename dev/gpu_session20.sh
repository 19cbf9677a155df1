export BUILD_TARGET=lathe_cli
source dev/gpu_common.sh bench
python3 bench/generate_side_by_side.py --lathe-bin build/lathe --skip-hf --graphs-off-too --batch1-graphs on,off,on,off \
  --time-forwards --shapes 1.7b --skip-batched --out /tmp/gen_timing >$L/gen_timing.log 2>&1
summary "$(grep -E '^(1.7b)' $L/gen_timing.log | sed -E 's/; generate: .* on cuda:0 \(bf16\);/;/')"
timeout 200 python3 bench/rl_side_by_side.py --lathe-bin build/lathe --new 1024 --skip-torch --out /tmp/rl_bench >$L/rl_lathe.log 2>&1
summary "lathe: $(grep -E '^(lathe|card)' $L/rl_lathe.log)"; cp /tmp/rl_bench/results.json $OUT/rl_lathe.json
cp /tmp/rl_bench/lathe_run/metrics.jsonl $OUT/rl_lathe_metrics.jsonl
timeout $((570 - SECONDS)) python3 bench/rl_side_by_side.py --lathe-bin build/lathe --new 1024 --skip-lathe --out /tmp/rl_bench >$L/rl_torch.log 2>&1
summary "torch: $(grep -E "^(torch|card)" $L/rl_torch.log | tr "\n" " ")"; cp /tmp/rl_bench/results.json $OUT/rl_torch.json
tail -5 $L/rl_torch.log
