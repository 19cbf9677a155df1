# The training-run helpers of the GPU benchmark scripts (dev/gpu_parallel.sh, dev/gpu_multi.sh), sourced after
# dev/gpu_common.sh (summary, $L, $OUT): a call has 600 s.
# Skips (with a summary line) what would start after `start_by` s of the call.
left() { (( SECONDS < $1 )) || { summary "skipped (only $((600 - SECONDS)) s left): $2"; return 1; }; }
# `lathe ${SUB:-train}` of the folder's config into folder/run, ended (its process group) once metrics.jsonl has `steps`
# timed rows, or after timeout_s (at most what the call has left). A train run's `lathe plan` goes first to
# $L/plans.txt, its configured row (or refusal) to the summary (not where PLAN_ROWS=0; RUN_PLANS=0: no plan);
# PLAN_ONLY: only that. A benchmark needs no checkpoint, and the one written at a run's last step is 14 bytes a
# parameter (98 GiB of f32 optimizer state for the 8B shape: minutes on the machine's disk).
run_steps() {  # folder run steps timeout_s args...
  local d=$1 run=$2 n=$3 t=$4; shift 4
  local log start=$SECONDS end="killed after $n steps" row; log=$L/$(basename $d)_$run.log
  if [ "${SUB:-train}" = train ] && [ "${RUN_PLANS:-1}" = 1 ]; then
    row=$(./build/lathe plan $d/config.yaml --set output_dir=$d/$run --set train.max_steps=1000 --memory-gib 139 \
      "$@" 2>&1)
    echo "$(basename $d) $run: $row" >>$L/plans.txt  # the whole table and the plan's notes
    row=$(echo "$row" | grep -aE '^\*|error|^  - ' | tr -s ' \n' ' ')
    [ "${PLAN_ROWS:-1}" = 0 ] && [ -z "${PLAN_ONLY:-}" ] ||
      summary "$(basename $d) $run plan: $(echo "${row#\* }" | cut -c1-240)"
  fi
  [ -n "${PLAN_ONLY:-}" ] && return
  (( t > 585 - SECONDS )) && t=$((585 - SECONDS))
  (( t >= 20 )) || { summary "skipped (only $((600 - SECONDS)) s left): $(basename $d) $run"; return; }
  setsid ./build/lathe ${SUB:-train} $d/config.yaml --set output_dir=$d/$run --set train.max_steps=1000 "$@" \
    >$log 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    if [ -f $d/$run/metrics.jsonl ] && [ "$(grep -c tokens_per_s $d/$run/metrics.jsonl)" -ge $n ]; then break; fi
    if (( SECONDS - start > t )); then end="TIMED OUT after $t s"; break; fi
    sleep 1
  done
  kill -0 $pid 2>/dev/null || end="ended by itself"
  kill -TERM -- -$pid 2>/dev/null; sleep 2; kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  summary "$(basename $d) $run: $end ($((SECONDS - start)) s) $(grep -a 'lathe: error' $log | head -2 | cut -c1-300)"
  grep -a -E "^parallel:|^train: .*parameters" $log | head -2 | cut -c1-200 >>$OUT/summary.txt
}
# Median tokens/s, step time and MFU per GPU (x 989: TFLOP/s per GPU on an H200) over the steps after the first `skip`,
# the ranks' peaks and the loss; each run after the first also as a multiple of the first's tokens/s.
report() {  # folder skip runs...
  python3 - "$@" <<'PY' | tee -a $OUT/summary.txt
import json, os, statistics, sys
d, skip, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
name, base = os.path.basename(d), None
for i, run in enumerate(runs):
    p = f"{d}/{run}/metrics.jsonl"
    rows = [json.loads(l) for l in open(p) if '"tokens_per_s"' in l][skip:] if os.path.exists(p) else []
    if not rows: print(f"{name} {run}: no timed steps (failed?)"); continue
    med = lambda k: statistics.median(r.get(k) or 0 for r in rows)
    t, mfu = med("tokens_per_s"), med("mfu")
    base = t if i == 0 else base
    x = f", {t / base:.2f}x {runs[0]}" if i and base else ""
    peak = [m or 0 for m in rows[-1].get("memory_mib_ranks", [rows[-1].get("memory_mib")])]
    print(f"{name} {run}: {t:,.0f} tok/s{x}, {med('step_time_s') * 1e3:.0f} ms a step, MFU {100 * mfu:.1f}% per GPU "
          f"= {989 * mfu:.0f} TFLOP/s ({len(rows)} steps); peak a rank {min(peak):,.0f}-{max(peak):,.0f} MiB "
          f"({len(peak)} ranks); loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
}
