#!/usr/bin/env bash
# The README's main command: installs, builds and runs the default job — examples/demo.yaml trains a small
# Qwen3-architecture model from scratch with the real Qwen3 tokenizer on a synthetic arithmetic chat task,
# shows the loss falling, and ends by answering held-out questions with the accuracy printed.
# Extra arguments go to `lathe train` (e.g. --set device=cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
./build/lathe train examples/demo.yaml "$@"
