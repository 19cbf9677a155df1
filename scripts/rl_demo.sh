#!/usr/bin/env bash
# The RL demo: installs, builds and runs examples/rl_demo.yaml — an SFT warm start of a small Qwen3-architecture model
# on part of the arithmetic task (examples/rl_demo_sft.yaml), then GRPO with an exact-answer reward on sums it never
# saw, with the held-out accuracy printed before and after (about ten minutes on 2 cores).
# Extra arguments go to `lathe rl` (e.g. --set device=cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
./build/lathe rl examples/rl_demo.yaml "$@"
