#!/usr/bin/env bash
# Installs what fusedmoe's build and tests need on Debian 12 (bookworm) or a
# recent Ubuntu: compiler, CMake, Ninja, ccache, GoogleTest, Google Benchmark,
# CLI11, nlohmann-json, single-threaded OpenBLAS, python3 (used by the CLI tests),
# OpenMPI (the MPI communicator and the mpirun tests of src/parallel).
# Runs as root, or through sudo otherwise. Safe to run again: when every
# package is already installed it does nothing.
set -euo pipefail

packages=(
  build-essential g++ cmake ninja-build ccache
  libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
  libopenblas-serial-dev
  openmpi-bin libopenmpi-dev
  python3 python3-venv python3-dev
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  echo "install-deps.sh: need root or sudo to install: ${missing[*]}" >&2
  exit 1
fi

echo "install-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
