#!/usr/bin/env bash
# Installs what fusedmoe's build and tests need on Debian 12 (bookworm) or a
# recent Ubuntu: compiler, CMake, Ninja, ccache, GoogleTest, Google Benchmark,
# CLI11, nlohmann-json, OpenBLAS (threaded: the bench baseline calls it from
# several threads at once), python3 (used by the CLI tests),
# OpenMPI (the MPI communicator and the mpirun tests of src/parallel), and the
# CUTLASS C++ headers (the sm_90a grouped GEMM of the CUDA backend) from the
# pinned PyPI wheel nvidia-cutlass, unpacked into $FUSEDMOE_DEPS_DIR
# (default /opt/fusedmoe-deps; CMake looks there, FUSEDMOE_CUTLASS_DIR overrides).
# Runs as root, or through sudo otherwise. Safe to run again: when every
# package is already installed it does nothing.
set -euo pipefail

packages=(
  build-essential g++ cmake ninja-build ccache
  libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
  libopenblas-pthread-dev
  openmpi-bin libopenmpi-dev
  python3 python3-venv python3-dev
)

# ---- CUTLASS headers (header-only; the wheel ships them under cutlass_library/source) ----
cutlass_version=4.2.0.0
cutlass_dir=${FUSEDMOE_DEPS_DIR:-/opt/fusedmoe-deps}/cutlass-${cutlass_version}
if [ ! -f "$cutlass_dir/include/cutlass/cutlass.h" ]; then
  echo "install-deps.sh: fetching the CUTLASS ${cutlass_version} headers into $cutlass_dir" >&2
  tmp=$(mktemp -d)
  if ! python3 -m pip --version >/dev/null 2>&1; then
    python3 -m venv "$tmp/venv" && PY="$tmp/venv/bin/python3"
  else
    PY=python3
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: "nvidia-cutlass==${cutlass_version}" -d "$tmp"
  mkdir -p "$cutlass_dir"
  python3 - "$tmp" "$cutlass_dir" <<'PYEOF'
import glob, os, sys, zipfile
tmp, dst = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]
prefixes = {"cutlass_library/source/include/": "include/",
            "cutlass_library/source/tools/util/include/": "include/"}
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        for src, out in prefixes.items():
            if name.startswith(src) and not name.endswith("/"):
                path = os.path.join(dst, out, name[len(src):])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with z.open(name) as f, open(path, "wb") as g:
                    g.write(f.read())
PYEOF
  rm -rf "$tmp"
fi

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
