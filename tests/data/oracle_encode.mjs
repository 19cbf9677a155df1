// Oracles for the tokenizer tests: encodes a JSONL corpus and writes the expected ids, plus decode
// cases built from those ids. Two engines:
//   --engine js (default): @lenml/tokenizers, an independent JS port of transformers.js;
//                          writes corpus_oracle_js.jsonl and decode_oracle_js.jsonl.
//   --engine hf:           `tokenizers` from npm, Hugging Face's own Rust library (the same crate as
//                          the Python package) through its Node binding; writes corpus_hf_node.jsonl
//                          and decode_hf_node.jsonl, decoding the cases of decode_oracle_js.jsonl.
// Convention: output line i belongs to corpus line i; fields "nfc"/"decoded" appear only when they
// differ from the input text (keeps the committed fixture small).
// Consumed by tests/data/test_tokenizer.cpp (Qwen3.Corpus*, Qwen3.Decode* tests).
//
// Usage (from the repo root, after scripts/fetch_npm_assets.sh):
//   node tests/data/oracle_encode.mjs                 # JS oracle, Qwen3 defaults
//   node tests/data/oracle_encode.mjs --engine hf     # HF Rust oracle, Qwen3 defaults
//   node tests/data/oracle_encode.mjs --tokenizer T.json [--config C.json] --corpus in.jsonl \
//        --out ids.jsonl [--decode-out decode.jsonl]
import { readFileSync, writeFileSync, existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { createRequire } from "node:module";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..", "..");
const npmModules = join(root, "third_party", "npm", "node_modules");
const qwenModels = join(npmModules, "@lenml", "tokenizer-qwen3", "models");
const fixtures = join(here, "fixtures");

function parseArgs(argv) {
  const args = {
    engine: "js",
    tokenizer: join(qwenModels, "tokenizer.json"),
    config: null,
    corpus: join(fixtures, "corpus.jsonl"),
    out: null,
    decodeOut: null,
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i], value = argv[i + 1];
    if (value === undefined) throw new Error(`missing value for ${key}`);
    if (key === "--engine") args.engine = value;
    else if (key === "--tokenizer") args.tokenizer = value;
    else if (key === "--config") args.config = value;
    else if (key === "--corpus") args.corpus = value;
    else if (key === "--out") args.out = value;
    else if (key === "--decode-out") args.decodeOut = value;
    else throw new Error(`unknown argument ${key}`);
  }
  if (args.engine !== "js" && args.engine !== "hf") throw new Error(`--engine must be js or hf`);
  const suffix = args.engine === "js" ? "oracle_js" : "hf_node";
  args.out ??= join(fixtures, `corpus_${suffix}.jsonl`);
  args.decodeOut ??= join(fixtures, `decode_${suffix}.jsonl`);
  if (args.config === null) {
    const sibling = join(dirname(args.tokenizer), "tokenizer_config.json");
    args.config = existsSync(sibling) ? sibling : "";
  }
  return args;
}

function requireEntry(path) {
  if (!existsSync(path)) throw new Error(`${path} not found; run scripts/fetch_npm_assets.sh first`);
  return path;
}

// The same small interface over both engines: encode(text) -> ids, decode(ids, skip) -> text.
async function loadEngine(args) {
  if (args.engine === "hf") {
    const require = createRequire(requireEntry(join(npmModules, "tokenizers", "package.json")));
    const { Tokenizer } = require("tokenizers");
    const tok = Tokenizer.fromFile(args.tokenizer);
    return {
      encode: async (text) => (await tok.encode(text, null, { addSpecialTokens: false })).getIds(),
      decode: async (ids, skip) => tok.decode(ids, skip),
      byteTokenId: (ch) => tok.tokenToId(ch),
      imStart: tok.tokenToId("<|im_start|>"),
    };
  }
  const entry = requireEntry(join(npmModules, "@lenml", "tokenizers", "dist", "main.mjs"));
  const { TokenizerLoader } = await import(pathToFileURL(entry).href);
  const tokenizerJSON = JSON.parse(readFileSync(args.tokenizer, "utf8"));
  const tokenizerConfig = args.config ? JSON.parse(readFileSync(args.config, "utf8")) : {};
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  return {
    encode: async (text) => tok.encode(text, { add_special_tokens: false }),
    // @lenml/tokenizers refuses an empty id list; the answer is "" anyway.
    decode: async (ids, skip) => (ids.length ? tok.decode(ids, { skip_special_tokens: skip }) : ""),
    byteTokenId: (ch) => tok.model.tokens_to_ids.get(ch),
    imStart: tok.model.tokens_to_ids.get("<|im_start|>"),
  };
}

// Decode cases: prefixes and windows of each encoded line, cut at deterministic points so that many
// end inside a multi-byte character, plus explicit byte-token sequences that are ill-formed UTF-8.
function decodeCases(engine, encoded) {
  const cases = [];
  const byteId = (b) => {
    // GPT-2 bytes_to_unicode, to find the single-byte token of byte b.
    const printable = (x) => (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    let next = 256, ch = null;
    for (let x = 0; x < 256; ++x) {
      const c = printable(x) ? x : next++;
      if (x === b) ch = String.fromCodePoint(c);
    }
    return engine.byteTokenId(ch);
  };
  const byteSequences = [
    [0xe2, 0x82], [0xe2], [0xf0, 0x9f, 0x98], [0xf0, 0x80, 0x80], [0xed, 0xa0, 0x80], [0xc0, 0xaf],
    [0xff, 0xfe], [0x80, 0x80, 0x41], [0xf4, 0x90, 0x80, 0x80], [0xe0, 0x80], [0xc2, 0x41, 0xc2],
    [0x41, 0xf0, 0x9f, 0x98, 0x80, 0x42], [0xf5, 0x80], [0xe1, 0x80, 0xe1, 0x80, 0x80],
  ];
  for (const seq of byteSequences) cases.push({ ids: seq.map(byteId), skip_special: false });
  encoded.forEach((ids, line) => {
    if (ids.length < 2 || line % 2 === 1) return;
    const n = ids.length;
    for (const cut of [1, Math.floor(n / 3), Math.floor(n / 2), n - 1]) {
      if (cut > 0 && cut < n && cases.length < 400) cases.push({ ids: ids.slice(0, Math.min(cut, 64)), skip_special: false });
    }
    const start = Math.floor(n / 4);
    if (n > 3) cases.push({ ids: ids.slice(start, Math.min(n, start + 3)), skip_special: line % 4 === 0 });
  });
  if (engine.imStart === 151644) {  // Qwen2/3 special-token cases
    cases.push({ ids: [151644, 872, 198, 9707, 151645, 151643], skip_special: true });
    cases.push({ ids: [151644, 872, 198, 9707, 151645, 151643], skip_special: false });
    cases.push({ ids: [151667, 198, 151668], skip_special: true });
  }
  return cases;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const engine = await loadEngine(args);

  const lines = readFileSync(args.corpus, "utf8").split("\n").filter((l) => l.length > 0);
  const out = [];
  const encoded = [];
  for (const line of lines) {
    const { text } = JSON.parse(line);
    const ids = await engine.encode(text);
    encoded.push(ids);
    const record = { ids };
    const nfc = text.normalize("NFC");
    if (nfc !== text) record.nfc = nfc;
    const decoded = await engine.decode(ids, false);
    if (decoded !== nfc) record.decoded = decoded;
    out.push(JSON.stringify(record));
  }
  writeFileSync(args.out, out.join("\n") + "\n");
  console.log(`wrote ${out.length} lines to ${args.out}`);

  // Decode cases come from the JS run; the HF run decodes the very same id lists.
  const jsCases = join(fixtures, "decode_oracle_js.jsonl");
  const cases = args.engine === "hf" && args.decodeOut.startsWith(fixtures) && existsSync(jsCases)
      ? readFileSync(jsCases, "utf8").split("\n").filter((l) => l).map((l) => JSON.parse(l))
      : decodeCases(engine, encoded);
  const decodedCases = [];
  for (const c of cases) {
    const text = await engine.decode(c.ids, c.skip_special);
    decodedCases.push(JSON.stringify({ ids: c.ids, skip_special: c.skip_special, text }));
  }
  writeFileSync(args.decodeOut, decodedCases.join("\n") + "\n");
  console.log(`wrote ${decodedCases.length} decode cases to ${args.decodeOut}`);
}

main().catch((e) => {
  console.error(`oracle_encode: ${e.message}`);
  process.exit(1);
});
