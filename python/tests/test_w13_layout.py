"""fusedmoe.interleave_w13 and fused_experts' w13_layout argument on the CPU:
the exact row permutation (NumPy, torch CPU), the argument errors. The CUDA
results with w13_layout="interleaved128" are in test_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import fusedmoe
from conftest import experts_case


def _interleaved_by_loop(w13: np.ndarray) -> np.ndarray:
    """The kInterleaved128 order, one row at a time: block b of 128
    intermediate rows is gate rows b*128.. then up rows I + b*128..."""
    E, I2, H = w13.shape
    inter = I2 // 2
    out = np.empty_like(w13)
    for e in range(E):
        for b in range(inter // 128):
            for r in range(128):
                out[e, 256 * b + r] = w13[e, 128 * b + r]
                out[e, 256 * b + 128 + r] = w13[e, inter + 128 * b + r]
    return out


def _distinct(E, I, H, dtype=np.float32) -> np.ndarray:
    """[E, 2I, H] with every element different: float32 0, 1, 2, ... or, for
    2-byte dtypes, the bit patterns 0, 1, 2, ... (compare those as uint16)."""
    n = E * 2 * I * H
    assert n <= 65536
    if np.dtype(dtype).itemsize == 4:
        return np.arange(n, dtype=dtype).reshape(E, 2 * I, H)
    return np.arange(n, dtype=np.uint16).view(dtype).reshape(E, 2 * I, H)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


@pytest.mark.parametrize("E,I,H", [(3, 256, 5), (2, 128, 4), (1, 384, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.float16])
def test_interleave_w13_numpy_matches_the_loop(E, I, H, dtype):
    w13 = _distinct(E, I, H, dtype)
    before = w13.copy()
    got = fusedmoe.interleave_w13(w13)
    assert isinstance(got, np.ndarray) and got.dtype == w13.dtype and got.shape == w13.shape
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(_bits(got), _interleaved_by_loop(_bits(w13)))
    np.testing.assert_array_equal(_bits(w13), _bits(before))  # the input is not changed
    assert not np.shares_memory(got, w13)  # a new array, also for I = 128 (no row moves)


def test_interleave_w13_numpy_non_contiguous_and_bfloat16():
    full = _distinct(2, 256, 6)
    w13 = full[:, :, ::2]  # column-strided view
    np.testing.assert_array_equal(fusedmoe.interleave_w13(w13), _interleaved_by_loop(w13))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    wb = _distinct(2, 256, 6, np.uint16).view(ml_dtypes.bfloat16)
    got = fusedmoe.interleave_w13(wb)
    assert got.dtype == wb.dtype
    np.testing.assert_array_equal(_bits(got), _interleaved_by_loop(_bits(wb)))


def _torch():
    torch = pytest.importorskip("torch")
    if fusedmoe._torch is None:
        pytest.skip("fusedmoe was imported without torch (FUSEDMOE_NO_TORCH)")
    return torch


@pytest.mark.parametrize("I", [128, 256])
def test_interleave_w13_torch_cpu_matches_the_loop(I):
    torch = _torch()
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.float32:
            w13 = torch.from_numpy(_distinct(3, I, 5))
        else:  # bit patterns 0, 1, 2, ...
            w13 = torch.from_numpy(_distinct(3, I, 5, np.int16)).view(torch.bfloat16)
        before = w13.clone()
        got = fusedmoe.interleave_w13(w13)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == w13.device
        assert got.shape == w13.shape and got.is_contiguous()
        assert got.untyped_storage().data_ptr() != w13.untyped_storage().data_ptr()

        def bits(t):
            return t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy()

        np.testing.assert_array_equal(bits(got), _interleaved_by_loop(bits(w13)))
        np.testing.assert_array_equal(bits(w13), bits(before))


def test_interleave_w13_torch_without_fusedmoe_importing_torch():
    """FUSEDMOE_NO_TORCH: fusedmoe does not import torch, but a tensor passed
    in still comes back a tensor, interleaved."""
    pytest.importorskip("torch")
    code = ("import fusedmoe, torch\n"
            "assert fusedmoe._torch is None\n"
            "w = torch.arange(256 * 3, dtype=torch.float32).reshape(1, 256, 3)\n"
            "o = fusedmoe.interleave_w13(w)\n"
            "assert isinstance(o, torch.Tensor) and o.shape == w.shape\n"
            "assert torch.equal(o, w) and o.data_ptr() != w.data_ptr()\n")
    env = dict(os.environ, FUSEDMOE_NO_TORCH="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


_ERRORS = [
    ((256, 8), r"^w13: expected a 3-d array \[E, 2I, H\], got shape \(256, 8\)"),
    ((2, 257, 8), r"^w13: expected \[E, 2I, H\] with an even middle size 2I .*"
                  r"got shape \(2, 257, 8\)"),
    ((2, 128, 8), r"^w13: expected \[E, 2I, H\] with I a positive multiple of 128 .*"
                  r"got I = 64 \(shape \(2, 128, 8\)\)"),
    ((2, 0, 8), r"^w13: .*positive multiple of 128 .*got I = 0"),
]


def _error_inputs():
    for shape, match in _ERRORS:
        yield np.zeros(shape, np.float32), ValueError, match
    yield [[[1.0]]], TypeError, r"^w13: expected a NumPy array or torch tensor, got list"
    yield None, TypeError, r"^w13: expected a NumPy array or torch tensor, got None"


@pytest.mark.parametrize("w13,exc,match", list(_error_inputs()))
def test_interleave_w13_errors_name_w13(w13, exc, match):
    with pytest.raises(exc, match=match):
        fusedmoe.interleave_w13(w13)


def test_interleave_w13_errors_torch():
    torch = _torch()
    with pytest.raises(ValueError, match=r"^w13: expected a 3-d array .*got shape \(256, 8\)"):
        fusedmoe.interleave_w13(torch.zeros(256, 8))
    with pytest.raises(ValueError, match=r"^w13: .*multiple of 128 .*got I = 192"):
        fusedmoe.interleave_w13(torch.zeros(2, 384, 8, dtype=torch.bfloat16))


def test_interleave_w13_other_dlpack_arrays_are_named():
    class Dl:
        ndim, shape = 3, (1, 256, 2)

        def __dlpack__(self, stream=None):
            raise AssertionError("not read")

    with pytest.raises(TypeError, match=r"^w13: expected a NumPy array, torch tensor or CuPy "
                                        r"array, got .*Dl"):
        fusedmoe.interleave_w13(Dl())


# ---- fused_experts(w13_layout=...) on the CPU -----------------------------------------


@pytest.fixture
def case(rng):
    return experts_case(rng, I=128, w2_scale=11)


def _args(c, lib=None):
    keys = ("x", "w13", "w2", "tw", "ids")
    return [lib.from_numpy(c[k]) if lib else c[k] for k in keys]


def test_w13_layout_standard_is_the_default(case):
    want = fusedmoe.fused_experts(*_args(case))
    np.testing.assert_array_equal(fusedmoe.fused_experts(*_args(case), w13_layout="standard"),
                                  want)


def test_w13_layout_interleaved128_is_refused_on_the_cpu(case):
    c = dict(case, w13=fusedmoe.interleave_w13(case["w13"]))
    with pytest.raises(ValueError, match=r'^w13_layout: "interleaved128" runs on the CUDA '
                                         r'backend only .*w13_layout="standard"'):
        fusedmoe.fused_experts(*_args(c), w13_layout="interleaved128")


@pytest.mark.parametrize("value", ["interleaved", "Interleaved128", "kInterleaved128", ""])
def test_w13_layout_unknown_values_list_the_allowed_ones(case, value):
    with pytest.raises(ValueError, match=f'^w13_layout: expected "standard" or "interleaved128", '
                                         f'got "{value}"$'):
        fusedmoe.fused_experts(*_args(case), w13_layout=value)


@pytest.mark.parametrize("value", [None, 128, b"standard"])
def test_w13_layout_non_str_is_a_type_error(case, value):
    with pytest.raises(TypeError, match="^w13_layout: expected 'standard' or 'interleaved128', "
                                        "got") as e:
        fusedmoe.fused_experts(*_args(case), w13_layout=value)
    assert "incompatible function arguments" not in str(e.value)


def test_w13_layout_torch_cpu(case):
    torch = _torch()
    args = _args(case, torch)
    want = fusedmoe.fused_experts(*_args(case))
    np.testing.assert_array_equal(fusedmoe.fused_experts(*args, w13_layout="standard").numpy(),
                                  want)
    with pytest.raises(ValueError, match=r'^w13_layout: "interleaved128" runs on the CUDA '
                                         r'backend only'):
        fusedmoe.fused_experts(*args, w13_layout="interleaved128")
    with pytest.raises(ValueError, match='^w13_layout: expected "standard" or "interleaved128"'):
        torch.ops.fusedmoe.fused_experts(*args, w13_layout="blocked")
    with pytest.raises(TypeError, match="^w13_layout: expected"):
        fusedmoe.fused_experts(*args, w13_layout=1)
    # the op's schema and fake take the argument (torch.compile traces it)
    torch.library.opcheck(torch.ops.fusedmoe.fused_experts.default, tuple(args),
                          {"w13_layout": "standard"})
    f = torch.compile(lambda *a: fusedmoe.fused_experts(*a, w13_layout="standard"),
                      fullgraph=True, backend="aot_eager")
    np.testing.assert_array_equal(f(*args).numpy(), want)
