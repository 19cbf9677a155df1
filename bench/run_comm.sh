#!/usr/bin/env bash
# `bash bench/run_comm.sh BUILD [RANKS]`: bench/comm_bench.cpp on RANKS GPUs of this machine (default 2), started with
# Lathe's own rendezvous (the variables `lathe train --nproc` sets for its ranks); rank 0's JSON lines on stdout.
set -euo pipefail
B=${1:?usage: run_comm.sh BUILD [RANKS]}
N=${2:-2}
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
R=$(mktemp -d)
pids=()
for ((r = 0; r < N; r++)); do
  LATHE_RANK=$r LATHE_WORLD=$N LATHE_LOCAL_RANK=$r LATHE_RENDEZVOUS=$R "$B/bench/comm_bench" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
rm -rf "$R"
exit $rc
