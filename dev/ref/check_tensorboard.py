#!/usr/bin/env python3
"""Reads a folder of TensorBoard event files written by lathe (src/train/tensorboard.h) with tensorboard's own
EventAccumulator, prints every scalar series, and exits 1 when there is none or an --expect does not hold.

Run where tensorboard is installed (the GPU machine), e.g. on the files of the writer tests:
    TEST_TMPDIR=/tmp/tbcheck build/tests/test_metrics --gtest_filter='TensorBoard.*'
    python3 dev/ref/check_tensorboard.py /tmp/tbcheck/lathe_tb/run \\
        --expect train/loss:1=2.5 --expect train/loss:2=1.25 --expect eval/loss:300000=-3
    python3 dev/ref/check_tensorboard.py /tmp/tbcheck/lathe_tb_resume \\
        --expect-steps train/loss=1,2,3,4 --expect train/loss:3=23
or on a training run's folder: python3 dev/ref/check_tensorboard.py OUTPUT_DIR/tb (an rl.mode async run: --expect-histogram rl/staleness)
"""
import argparse
import math
import sys

from tensorboard.backend.event_processing import event_accumulator


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir", help="folder holding events.out.tfevents.* files (or one such file)")
    ap.add_argument("--expect", action="append", default=[], metavar="TAG:STEP=VALUE",
                    help="require this value (float32 tolerance) at this step")
    ap.add_argument("--expect-steps", action="append", default=[], metavar="TAG=S1,S2,...",
                    help="require exactly these steps, in this order (after TensorBoard's purge of orphaned steps)")
    ap.add_argument("--expect-histogram", action="append", default=[], metavar="TAG",
                    help="require a histogram series under this tag (each point printed: min, max, count)")
    args = ap.parse_args()

    acc = event_accumulator.EventAccumulator(args.logdir, size_guidance={event_accumulator.SCALARS: 0,
                                                                         event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    tags = sorted(acc.Tags().get("scalars", []))
    if not tags:
        print(f"check_tensorboard: no scalars in {args.logdir}")
        return 1
    series = {}
    for tag in tags:
        events = acc.Scalars(tag)
        series[tag] = {e.step: e.value for e in events}
        shown = events if len(events) <= 20 else events[:5] + events[-5:]
        points = ", ".join(f"{e.step}:{e.value:.6g}" for e in shown)
        print(f"{tag}: {len(events)} points{' (first and last 5)' if len(events) > 20 else ''}: {points}")
        steps = [e.step for e in events]
        if steps != sorted(set(steps)):
            print(f"check_tensorboard: {tag}: steps are not strictly increasing: {steps[:50]}")
            return 1

    failed = False
    for tag in args.expect_histogram:
        if tag not in acc.Tags().get("histograms", []):
            print(f"check_tensorboard: no histogram {tag} (histograms: {acc.Tags().get('histograms', [])})")
            failed = True
            continue
        for e in acc.Histograms(tag)[:10]:
            h = e.histogram_value
            print(f"{tag} step {e.step}: min {h.min:g} max {h.max:g} count {h.num:g} "
                  f"buckets {list(zip(h.bucket_limit, h.bucket))}")
    for spec in args.expect:
        tag, rest = spec.rsplit(":", 1)
        step, value = rest.split("=")
        got = series.get(tag, {}).get(int(step))
        if got is None or not math.isclose(got, float(value), rel_tol=1e-6, abs_tol=1e-30):
            print(f"check_tensorboard: expected {tag} at step {step} = {value}, got {got}")
            failed = True
    for spec in args.expect_steps:
        tag, steps = spec.split("=")
        want = [int(s) for s in steps.split(",")]
        got = sorted(series.get(tag, {}))
        if got != want:
            print(f"check_tensorboard: expected {tag} at steps {want}, got {got}")
            failed = True
    if failed:
        return 1
    print(f"check_tensorboard: {len(tags)} scalar tags read by tensorboard from {args.logdir}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
