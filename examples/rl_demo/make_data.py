"""Writes the RL demo's data from the SFT demo's training rows (examples/demo/train.jsonl: two-digit plus one-digit
sums, each pair in four phrasings). The pairs are split in two, so that RL rewards sums the starting model never saw:
sft.jsonl: the rows of 400 pairs, for the warm start (examples/rl_demo_sft.yaml);
prompts.jsonl: the other 310 pairs' questions with their answers, {"messages": [user turn], "answer": "55"}, for RL.
The held-out pairs (examples/demo/heldout.jsonl) are in neither. Deterministic; the committed files were made with
`python3 examples/rl_demo/make_data.py`.
"""
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
rows = [json.loads(line) for line in open(HERE.parent / "demo" / "train.jsonl")]


def pair(row):
    a, b = re.findall(r"\d+", row["messages"][0]["content"])
    return int(a), int(b)


pairs = sorted({pair(r) for r in rows})
random.Random(7).shuffle(pairs)
sft_pairs = set(pairs[:400])
with open(HERE / "sft.jsonl", "w") as f:
    for r in rows:
        if pair(r) in sft_pairs:
            f.write(json.dumps(r) + "\n")
with open(HERE / "prompts.jsonl", "w") as f:
    for r in rows:
        if pair(r) not in sft_pairs:
            f.write(json.dumps({"messages": r["messages"][:1], "answer": r["messages"][1]["content"]}) + "\n")
print(f"{len(pairs)} pairs: {len(sft_pairs)} for SFT, {len(pairs) - len(sft_pairs)} for RL")
