"""Writes the multi-tenant LoRA example's data: two new skills taught to the demo's addition model
(runs/demo/final), one adapter each, trained together over the one frozen base.

sub/train.jsonl: "What is 47 - 8?" -> "39"            sub/heldout.jsonl: pairs never trained on, with "answer"
max/train.jsonl: "Which is larger, 47 or 8?" -> "47"  max/heldout.jsonl: likewise
Deterministic (seeded); the committed files were made with `python3 examples/tenants/make_data.py`.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TASKS = {
    "sub": (["What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} = ?", "Subtract {b} from {a}."], lambda a, b: a - b),
    "max": (["Which is larger, {a} or {b}?", "Which is bigger: {a} or {b}?", "max({a}, {b}) = ?",
             "Pick the larger of {a} and {b}."], lambda a, b: max(a, b)),
}
for name, (templates, answer) in TASKS.items():
    rng = random.Random(name)
    pairs = [(a, b) for a in range(10, 100) for b in range(1, 10)]
    rng.shuffle(pairs)
    heldout, train = pairs[:100], pairs[100:]
    (HERE / name).mkdir(exist_ok=True)
    rows = []
    for a, b in train:
        for t in templates:
            msgs = [{"role": "user", "content": t.format(a=a, b=b)}, {"role": "assistant", "content": str(answer(a, b))}]
            rows.append(json.dumps({"messages": msgs}))
    rng.shuffle(rows)
    (HERE / name / "train.jsonl").write_text("\n".join(rows) + "\n")
    with open(HERE / name / "heldout.jsonl", "w") as f:
        for a, b in heldout:
            msgs = [{"role": "user", "content": rng.choice(templates).format(a=a, b=b)}]
            f.write(json.dumps({"messages": msgs, "answer": str(answer(a, b))}) + "\n")
    print(f"{name}: train {len(train) * len(templates)} rows, heldout {len(heldout)} rows")
