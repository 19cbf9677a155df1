#!/usr/bin/env bash
# The README's main command: installs, builds and runs the default job. Until the trainer lands, the
# default job is the kernel report and the op check on every device of this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
./build/lathe kernels
./build/lathe op-check
