#!/usr/bin/env bash
# Builds the Python package from this checkout into a virtual environment
# (build/venv, created on first use), then runs its pytest suite
# (python/tests). Needs python3 with its venv module and development headers,
# and PyPI (numpy, pytest, and the build tools scikit-build-core + nanobind).
# Torch tests run only if torch is installed in that environment (it is not
# by default); PYTHON=/path/to/python picks the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=build/venv
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check ".[test]"
exec "$venv/bin/python" -m pytest -q python/tests
