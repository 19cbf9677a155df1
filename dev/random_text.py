"""Writes FOLDER/train.jsonl: LINES rows of WORDS random words each (about 2.5 tokens a word), the same rows every
time (seed 0): the benchmark data of dev/gpu_parallel.sh and dev/gpu_multi.sh. Usage: random_text.py FOLDER LINES WORDS"""
import json
import os
import random
import sys

d, lines, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(0)
words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randrange(2, 9))) for _ in range(5000)]
os.makedirs(d, exist_ok=True)
with open(f"{d}/train.jsonl", "w") as f:
    for i in range(lines):
        f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(n))}) + "\n")
