#!/usr/bin/env bash
# Copies the CUDA test and bench binaries of a build directory, and the shared
# libraries they need that a bare device image may lack, into .devbin/ (git
# ignores it via .git/info/exclude) for `run` calls to carry.
set -euo pipefail
build=${1:-build-cuda}
rm -rf .devbin && mkdir -p .devbin/lib
for t in test_cuda_routing test_cuda_align test_cuda_gemm test_cuda_runner test_cuda_conformance_hf; do
  cp "$build/tests/$t" .devbin/
done
cp "$build/bench_cuda_moe" "$build/fusedmoe" .devbin/
for lib in libcudart.so.13; do
  p=$( (ldd .devbin/test_cuda_runner .devbin/fusedmoe || true) | awk -v l="$lib" '$1 == l {print $3}' | head -1)
  [ -n "$p" ] && cp -L "$p" .devbin/lib/
done
mkdir -p .git/info
grep -qx '/.devbin/' .git/info/exclude 2>/dev/null || echo '/.devbin/' >> .git/info/exclude
du -sh .devbin
