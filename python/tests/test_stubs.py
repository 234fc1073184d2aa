"""The committed type stub of the extension is what nanobind's stubgen writes today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fusedmoe

STUB = Path(__file__).resolve().parents[1] / "fusedmoe" / "_ext.pyi"


def _body(text: str) -> list:
    # compare everything after the module docstring; __version__ is added by hand
    lines = text.split('"""', 2)[2].splitlines()
    return [l for l in lines if l.strip() and not l.startswith(("__version__", "cuda_built"))]


def test_stub_is_current(tmp_path):
    pytest.importorskip("nanobind.stubgen")
    out = tmp_path / "_ext.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "fusedmoe._ext", "-o",
                    str(out)], check=True, capture_output=True)
    assert _body(out.read_text()) == _body(STUB.read_text()), (
        "python/fusedmoe/_ext.pyi is stale: regenerate with "
        "python -m nanobind.stubgen -m fusedmoe._ext")


def test_public_api():
    for name in fusedmoe.__all__:
        assert hasattr(fusedmoe, name), name
    assert fusedmoe.__version__.count(".") == 2
