"""Writes the demo's bundled synthetic chat task: adding a one-digit number to a two-digit one, with
checkable answers (carries included).

train.jsonl: {"messages": [{"role": "user", "content": "What is 47 + 8?"}, {"role": "assistant", "content": "55"}]}
heldout.jsonl: {"messages": [user turn only], "answer": "55"} for pairs that never appear in train.jsonl.
Each training pair appears in all four phrasings.
Deterministic (seeded); the committed files were made with `python3 examples/demo/make_data.py`.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
rng = random.Random(1234)
pairs = [(a, b) for a in range(10, 100) for b in range(1, 10)]
rng.shuffle(pairs)
heldout, train = pairs[:100], pairs[100:]
templates = ["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}."]


def conversation(a, b):
    question = rng.choice(templates).format(a=a, b=b)
    return [{"role": "user", "content": question}]


with open(HERE / "train.jsonl", "w") as f:
    rows = []
    for a, b in train:
        for t in templates:
            msgs = [{"role": "user", "content": t.format(a=a, b=b)}, {"role": "assistant", "content": str(a + b)}]
            rows.append(json.dumps({"messages": msgs}))
    rng.shuffle(rows)
    f.write("\n".join(rows) + "\n")
with open(HERE / "heldout.jsonl", "w") as f:
    for a, b in heldout:
        f.write(json.dumps({"messages": conversation(a, b), "answer": str(a + b)}) + "\n")
print(f"train {len(train)} rows, heldout {len(heldout)} rows")
