#!/usr/bin/env bash
# Copies the CUDA test and bench binaries of a build directory, and the shared
# libraries they need that a bare device image may lack, into .devbin/ (git
# ignores it via .git/info/exclude) for `run` calls to carry.
set -euo pipefail
build=${1:-build-cuda}
rm -rf .devbin && mkdir -p .devbin/lib
find "$build/tests" -maxdepth 1 -type f -perm -u+x -name 'test_cuda_*' -exec cp {} .devbin/ \;
cp "$build/bench_cuda_moe" "$build/bench_cuda_layer" "$build/bench_cuda_dram" "$build/fusedmoe" .devbin/
# Every shared library the binaries need beyond glibc and libstdc++ (CUDA
# runtime, OpenBLAS for the CLI's bench baseline, Open MPI): the device image
# may lack them (NCCL excepted). Compressed: OpenBLAS alone is 35 MB and a call carries 64 MiB.
for b in .devbin/*; do ldd "$b" || true; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
  grep -v '/libnccl\.so' |  # 218 MB; the device has NCCL in its PyTorch (device_run.sh)
  while read -r p; do cp -L "$p" .devbin/lib/; done
tar -C .devbin -cJf .devbin/lib.tar.xz lib && rm -rf .devbin/lib
# The Python extension for the device's python3 (3.12), when built (e.g.
# cmake -B build-py312 -DFUSEDMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE=.../python3.12).
for so in ${PY_BUILD:-build-py312}/python/_ext.cpython-*.so; do [ -f "$so" ] && cp "$so" .devbin/; done
# Symbol tables are not needed there; the call carries at most 64 MiB with the tree.
strip --strip-unneeded .devbin/test_cuda_* .devbin/bench_cuda_* .devbin/fusedmoe .devbin/_ext.*.so 2>/dev/null || true
# The binaries share most of their device code: one xz stream over all of them
# is a fraction of their size (device_run.sh unpacks it).
(cd .devbin && tar -cf - --exclude=lib.tar.xz . | xz -9 -T1 >../.devbin-bin.tar.xz) &&
  find .devbin -mindepth 1 -maxdepth 1 ! -name lib.tar.xz -exec rm -rf {} + &&
  mv .devbin-bin.tar.xz .devbin/bin.tar.xz
mkdir -p .git/info
grep -qx '/.devbin/' .git/info/exclude 2>/dev/null || echo '/.devbin/' >> .git/info/exclude
du -sh .devbin
