#!/usr/bin/env bash
# Builds the Python package from this checkout into a virtual environment
# (build/venv, created on first use), then runs its pytest suite
# (python/tests). Needs python3 with its venv module and development headers,
# and PyPI (numpy, pytest, and the build tools scikit-build-core + nanobind).
# Torch tests run only if torch is installed in that environment (it is not
# by default), CUDA tests only with torch, a GPU and the CUDA backend (built
# when nvcc is found); PYTHON=/path/to/python picks the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=build/venv
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# After the README's CMake build (build/), compile with the same compilers so
# that ccache (used by CMakeLists.txt when installed) serves the objects that
# build already made (ccache hashes the compiler's name, and pip's build may
# find g++ where CMake found c++); the CUTLASS files may still compile again. FUSEDMOE_CUDA=OFF builds the CPU backend only.
settings=()
if [ -f build/CMakeCache.txt ]; then
  for lang in C CXX; do
    c=$(sed -n "s/^CMAKE_${lang}_COMPILER:[A-Z]*=//p" build/CMakeCache.txt)
    [ -n "$c" ] && settings+=(-C "cmake.define.CMAKE_${lang}_COMPILER=$c")
  done
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${settings[@]}" ".[test]"
# -rs: each skipped test with its reason (e.g. "skipped: no CUDA device").
exec "$venv/bin/python" -m pytest -q -rs python/tests
