#!/usr/bin/env bash
# The README's test command: installs, builds and runs the whole test suite (ctest). GPU tests skip with a
# visible reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 1200
