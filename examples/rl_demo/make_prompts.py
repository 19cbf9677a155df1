"""Writes the RL demo's prompts (examples/rl_demo/prompts.jsonl) from the SFT demo's training rows: each row's user
turn with its answer, {"messages": [user turn], "answer": "55"}. The held-out pairs (examples/demo/heldout.jsonl) never
appear. Deterministic; the committed file was made with `python3 examples/rl_demo/make_prompts.py`.
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
rows = []
with open(HERE.parent / "demo" / "train.jsonl") as f:
    for line in f:
        msgs = json.loads(line)["messages"]
        rows.append(json.dumps({"messages": msgs[:1], "answer": msgs[1]["content"]}))
with open(HERE / "prompts.jsonl", "w") as f:
    f.write("\n".join(rows) + "\n")
print(f"{len(rows)} prompts")
