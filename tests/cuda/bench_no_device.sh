#!/usr/bin/env bash
# The CUDA benchmarks (bench_cuda_moe, bench_cuda_layer, bench_cuda_dram) on a
# machine without a GPU: an error
# (exit 1, one "error: no CUDA device found" line on stderr), as `fusedmoe bench
# --backend cuda` gives, not a "skipped" benchmark with exit code 0. Where a GPU
# is present there is nothing to check: exit 77 (CTest: skipped).
# Usage: bash bench_no_device.sh BENCH_PROGRAM...
set -uo pipefail
if nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  echo "skipped: a CUDA device is present (this test checks the no-device error)"
  exit 77
fi
failures=0
for bin in "$@"; do
  rc=0
  err=$("$bin" 2>&1 >/dev/null) || rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "error: no CUDA device found" <<<"$err"; then
    echo "FAIL $(basename "$bin"): exit $rc, stderr: $err"
    failures=$((failures + 1))
  else
    echo "ok   $(basename "$bin"): $err"
  fi
done
[ "$failures" -eq 0 ]
