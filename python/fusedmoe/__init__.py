"""fusedmoe: the Mixture-of-Experts layer of HF models (router, expert GEMMs,
shared experts) on the CPU and on NVIDIA GPUs (CUDA backend), from Python.

Arrays go in and out through DLPack: NumPy arrays, PyTorch CPU/CUDA tensors
and CuPy arrays are read without a copy when their layout allows (rows
contiguous for activations, fully contiguous for weights; otherwise a
contiguous copy is made). Outputs are NumPy arrays for NumPy inputs, torch
tensors (allocated by PyTorch, on the inputs' device) for torch inputs and
CuPy arrays for CuPy inputs.

CUDA arrays (builds with the CUDA backend, ``fusedmoe.cuda_built``) run on the
CUDA backend: all arrays of a call on one device, the current one; the work is
enqueued on the caller's current stream (torch.cuda.current_stream(),
cupy.cuda.get_current_stream()) without synchronisation and without device
allocation outside the caller's framework, so calls can be captured in a CUDA
graph. The CUDA backend computes in bf16 or fp16 (f32 accumulation): expert
weights bf16 or float16, hidden states f32, bf16 or float16 (converted to the
weights' type; the output has the hidden states' dtype, and a float16 output
value beyond 65504 becomes inf, as torch's ``.half()``).
Without the CUDA backend a CUDA array raises NotImplementedError.

dtypes: hidden states and topk_weights are float32, topk_ids int32 (int64 is
converted); router logits of any floating dtype are converted to float32;
expert weights are float32 or bfloat16 — torch.bfloat16 tensors, ml_dtypes
``bfloat16`` NumPy arrays, or uint16 NumPy arrays holding bf16 bit patterns
with ``weight_dtype="bf16"``. ``compute_dtype="bf16"`` rounds the expert inputs
and the intermediate to bf16 (f32 accumulation).

Errors: a wrong shape or value raises ValueError and a wrong dtype TypeError,
both naming the argument (anything but an array where an array is expected:
TypeError naming the argument and the type given; an empty path: ValueError);
an unreadable file raises OSError; something this build does not handle
raises NotImplementedError.

When PyTorch is importable the ops are also registered as
``torch.ops.fusedmoe.*`` (see ``fusedmoe._torch_ops``), with fake
implementations so that ``torch.compile(fullgraph=True)`` traces them; the
functions below route torch tensors through those ops. They are
inference-only: backward through their outputs raises RuntimeError. Set the environment
variable ``FUSEDMOE_NO_TORCH=1`` to skip importing torch.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import itertools
import os
import sys
import uuid
import weakref
from typing import Any, Mapping, Optional, Tuple

import numpy as np
# numpy.ma now, not at the first call's check: NumPy 2 imports it lazily, under an import
# lock that a fork() while another thread takes it leaves held in the child for ever.
from numpy import ma as _np_ma  # noqa: F401


def _preload_pip_nccl() -> None:
    """Loads PyTorch's NCCL (the nvidia-nccl-cu* wheel), when installed, before
    the extension. A CUDA build of the extension links libnccl.so.2 (the CUDA
    toolkit's), and whichever libnccl.so.2 a process loads first serves every
    library that needs one: loaded first, an older toolkit NCCL left torch's
    libtorch_cuda without the newer symbols it needs (``import fusedmoe`` then
    ``import torch`` failed). NCCL 2.x keeps its ABI, so the extension runs on
    the wheel's. FUSEDMOE_NO_NCCL_PRELOAD=1 skips this (0 or unset: preload;
    another value fails the import, as FUSEDMOE_NO_TORCH does)."""
    no_preload = os.environ.get("FUSEDMOE_NO_NCCL_PRELOAD", "")
    if no_preload not in ("", "0", "1"):
        raise ValueError(f"FUSEDMOE_NO_NCCL_PRELOAD: expected 0 or 1, got {no_preload!r}")
    if sys.platform != "linux" or no_preload == "1":
        return
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    for folder in spec.submodule_search_locations or []:
        lib = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.isfile(lib):
            try:
                import ctypes
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:  # unloadable: the extension takes its own
                pass
            return


_preload_pip_nccl()

from . import _ext  # noqa: E402

__version__: str = _ext.__version__

__all__ = [
    "MoELayer",
    "CudaWorkspace",
    "ExpertParallelGroup",
    "nccl_unique_id",
    "fused_topk",
    "grouped_topk",
    "select_experts",
    "fused_experts",
    "interleave_w13",
    "inspect",
    "set_num_threads",
    "get_num_threads",
    "cuda_built",
    "cuda_fused_experts_workspace_bytes",
    "__version__",
]

cuda_built: bool = _ext.cuda_built

# torch, when importable (never required); FUSEDMOE_NO_TORCH=1 skips it.
_no_torch = os.environ.get("FUSEDMOE_NO_TORCH", "")
if _no_torch not in ("", "0", "1"):
    raise ValueError(f"FUSEDMOE_NO_TORCH: expected 0 or 1, got {_no_torch!r}")
_torch: Any = None
if _no_torch != "1" and importlib.util.find_spec("torch") is not None:
    try:
        import torch as _torch  # noqa: F401
    except Exception:  # a broken torch install must not break fusedmoe
        _torch = None


def set_num_threads(num_threads: int) -> None:
    """Threads of the global pool used by the functional ops and by layers
    created without ``threads``: 1..1024, or 0 for all cores (as ``fusedmoe
    run --threads 0``); anything else raises ValueError."""
    _ext.set_num_threads(_num_threads(num_threads, "num_threads"))


def cuda_fused_experts_workspace_bytes(num_tokens: int, hidden_size: int, intermediate_size: int,
                                       num_experts: int, top_k: int,
                                       apply_router_weight_on_input: bool = False,
                                       w13_layout: str = "standard") -> int:
    """Device bytes of workspace ``fused_experts`` needs on CUDA for these sizes
    (the functions below allocate it with the caller's framework). ``w13_layout``:
    the one the call passes; "interleaved128" needs fewer (no rows of the w13
    GEMM before the activation: T * top_k * 2 * intermediate_size halves).
    ``num_tokens`` >= 0, the other sizes >= 1 (else ValueError naming the
    argument, in any build); ``top_k`` may exceed ``num_experts`` (slots of
    -1, as ``fused_experts`` takes them)."""
    sizes = {"num_tokens": num_tokens, "hidden_size": hidden_size,
             "intermediate_size": intermediate_size, "num_experts": num_experts, "top_k": top_k}
    sizes = {k: _int_in(v, k, 0 if k == "num_tokens" else 1, _I64_MAX) for k, v in sizes.items()}
    on_input = _bool(apply_router_weight_on_input, "apply_router_weight_on_input")
    w13_layout = _str(w13_layout, "w13_layout", "'standard' or 'interleaved128'")
    if not cuda_built:
        raise NotImplementedError("this build of fusedmoe has no CUDA backend")
    return _ext.cuda_fused_experts_workspace_bytes(**sizes, apply_router_weight_on_input=on_input,
                                                   w13_layout=w13_layout)


def get_num_threads() -> int:
    return _ext.get_num_threads()


# ---- array helpers ----------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def _int(v: Any, name: str) -> int:
    """An integer argument: Python/NumPy integers; bool and floats raise TypeError."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    return int(v)


def _float(v: Any, name: str) -> float:
    """A real-number argument: Python/NumPy ints and floats; bool and str raise TypeError."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__} {v!r}")
    return float(v)


def _bool(v: Any, name: str) -> bool:
    """A flag: Python/NumPy bools only (a str such as 'no' would be truthy)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
    return bool(v)


def _str(v: Any, name: str, what: str) -> str:
    """A str argument (the extension's conversion would fail with nanobind's
    signature list)."""
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected {what}, got {type(v).__name__} {v!r}")
    return v


def _int_in(v: Any, name: str, lo: int, hi: int, what: str = "") -> int:
    """An integer argument in [lo, hi] (checked here: the extension's int
    conversion would fail with nanobind's signature list for a huge value)."""
    v = _int(v, name)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected {lo}..{'2**63-1' if hi == _I64_MAX else hi}{what}, "
                         f"got {v}")
    return v


_I64_MAX = 2**63 - 1


def _num_threads(v: Any, name: str) -> int:
    return _int_in(v, name, 0, _ext.max_num_threads, " (0: all cores)")


def _path(v: Any, name: str) -> str:
    """A filesystem path argument: str, bytes or os.PathLike, as a str. An
    empty path is a wrong value (ValueError), as ``fusedmoe run --model ""``
    says, not a file that cannot be opened; so is one with a NUL or bytes that
    are not UTF-8."""
    if not isinstance(v, (str, bytes, os.PathLike)):
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got "
                        f"{type(v).__name__} {v!r}")
    path = os.fsdecode(os.fspath(v))
    if not path:
        raise ValueError(f"{name}: expected a path, got an empty string")
    # The C++ library takes the path as a C string of UTF-8 text: a NUL would cut it
    # short (another file named), and bytes that are not UTF-8 cannot be passed.
    if "\0" in path:
        raise ValueError(f"{name}: expected a path without NUL characters, got {v!r}")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name}: expected a path that is valid UTF-8 (the library takes "
                         f"paths as UTF-8 text), got {v!r}") from None
    return path


def _same_library(**arrays: Any) -> None:
    """The array arguments of one call come from one library: where any is a
    torch tensor, every other one given (not None) must be one too (torch.ops
    take tensors only, and the outputs follow the inputs' library): TypeError
    naming the first that is not, and the first torch tensor, in argument order."""
    ref_name = next((n for n, v in arrays.items() if _is_torch(v)), None)
    if ref_name is None:
        return
    for name, v in arrays.items():
        if v is not None and not _is_torch(v):
            raise TypeError(f"{name}: expected a torch.Tensor like {ref_name}, "
                            f"got {type(v).__name__}")


def _dl(x: Any) -> Any:
    """What the extension imports: torch tensors as DLPack capsules made with
    no stream synchronisation (the extension enqueues on the caller's current
    stream, where the data was produced; Tensor.__dlpack__ without a stream
    would make the legacy default stream wait, which fails inside CUDA-graph
    capture), CuPy arrays likewise; anything else as is."""
    if _is_torch(x):
        if x.is_neg() or x.is_conj():  # lazy negation / conjugation: DLPack drops the bit
            x = x.resolve_conj().resolve_neg()
        return _to_dlpack(x)
    if x is not None and _is_cupy(x):
        try:
            return x.__dlpack__(stream=-1)  # -1: no synchronisation (array API)
        except Exception:
            return x.__dlpack__()
    return x


_to_dlpack: Any = None
_raw_stream: Any = None
if _torch is not None:
    from torch.utils.dlpack import to_dlpack as _to_dlpack  # noqa: F811

    _raw_stream = getattr(_torch._C, "_cuda_getCurrentRawStream", None)


def _stream(x: Any) -> int:
    """The caller's current CUDA stream (a cudaStream_t as an int) for arrays
    on a CUDA device, else 0."""
    if _is_torch(x):
        if not x.is_cuda:
            return 0
        idx = x.device.index
        if _raw_stream is not None:
            return _raw_stream(idx)
        return _torch.cuda.current_stream(x.device).cuda_stream
    if _is_cupy(x):
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0


def _ndim(x: Any, name: str, ndim: int, what: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array {what}, got shape {tuple(x.shape)}")


_FLOAT, _INT = "a floating dtype", "an integer dtype (int32)"
# The integer dtypes other than int32 that topk_ids / token_ids are converted from.
_WIDE_INTEGERS = ("int8", "int16", "int64", "uint8", "uint16", "uint32", "uint64")
# Router logits: what _f32_logits converts (not NumPy's float8 arrays: ml_dtypes).
_LOGITS = "dtype float32, bfloat16, float16 or float64"
_HIDDEN_CPU = "dtype float32"  # hidden_states on the CPU (_hidden_dtype has the CUDA ones)


def _is_array(x: Any) -> bool:
    """A NumPy array, a torch tensor or another DLPack array (CuPy, ...); not
    an array class (np.ndarray itself has __dlpack__ too)."""
    if isinstance(x, type):
        return False
    return isinstance(x, np.ndarray) or _is_torch(x) or hasattr(x, "__dlpack__")


def _is_fx_proxy(x: Any) -> bool:
    fx = getattr(_torch, "fx", None) if _torch is not None else None
    return fx is not None and isinstance(x, fx.Proxy)


def _check_array(x: Any, name: str) -> None:
    """An array argument: anything but an array (None, a list, a scalar, ...)
    raises TypeError naming `name` and the type given; a list or a scalar is
    not converted (its float64 / object dtype would be named instead). A NumPy
    masked array raises TypeError too: its mask cannot be honoured."""
    if _is_fx_proxy(x):  # has every attribute: it would pass as an array
        raise TypeError(f"{name}: a torch.fx Proxy: torch.fx.symbolic_trace cannot trace into "
                        "fusedmoe's functions and layers; trace with torch.compile or "
                        "torch.export, or call the torch.ops.fusedmoe ops directly")
    if not _is_array(x):
        t = type(x)
        got = ("None" if x is None else t.__name__ if t.__module__ == "builtins"
               else f"{t.__module__}.{t.__name__}")  # numpy.float32: a scalar, not an array
        if isinstance(x, type):  # np.ndarray, torch.Tensor: the class, not an instance
            got = f"the class {x.__module__}.{x.__qualname__} (not an array of it)"
        raise TypeError(f"{name}: expected a NumPy array or torch tensor, got {got}")
    if _is_torch(x) and x.is_nested:  # before any op dispatch, which would not name it
        raise TypeError(f"{name}: expected a dense (strided) tensor, got a nested tensor")
    if isinstance(x, np.ma.MaskedArray):  # an ndarray, whose mask DLPack would drop
        raise TypeError(f"{name}: expected a NumPy array or torch tensor, got "
                        "numpy.ma.MaskedArray (its mask would be ignored; pass its "
                        ".filled(value), the masked elements set to value, or its .data)")


def _dtype_name(x: Any) -> str:
    """The dtype name of an array: "float32", "bfloat16", ... for NumPy, torch
    and other DLPack arrays alike (torch.float32, a NumPy scalar type as dtype,
    another library's "paddle.float32" all give "float32")."""
    dt = x.dtype
    if isinstance(dt, np.dtype):
        return dt.name
    if _torch is not None and isinstance(dt, _torch.dtype):  # no np.dtype(): Dynamo traces this
        return str(dt).rsplit(".", 1)[-1]
    try:
        return np.dtype(dt).name  # a NumPy scalar type, a dtype-like name
    except Exception:
        return str(dt).rsplit(".", 1)[-1]


def _as_array(x: Any, name: str, expected: str = "a numeric dtype") -> Any:
    """NumPy arrays and torch tensors pass through; DLPack objects too (the
    extension imports them); anything else raises TypeError (_check_array). A
    NumPy dtype with no DLPack form raises TypeError naming `name` and
    `expected`."""
    _check_array(x, name)
    if not (isinstance(x, np.ndarray) or _is_torch(x)
            or all(hasattr(x, a) for a in ("shape", "ndim", "dtype"))):
        # An object with the DLPack protocol and not all of shape / ndim / dtype:
        # imported as a NumPy array (a CPU one; NumPy names another device).
        try:
            x = np.from_dlpack(x)
        except Exception as e:
            raise TypeError(f"{name}: a DLPack object NumPy cannot import "
                            f"({type(e).__name__}: {e})") from e
    if isinstance(x, np.ndarray):
        # Object, string, void, structured, datetime and ml_dtypes' float8 arrays
        # have no DLPack form: the extension could only refuse them with its raw
        # signature. ml_dtypes.bfloat16 passes (weights and logits convert it;
        # hidden_states and topk_weights name it as a wrong dtype).
        if x.dtype.kind not in "biufc" and x.dtype.name != "bfloat16":
            raise TypeError(f"{name}: expected {expected}, got {x.dtype}")
        if not x.dtype.isnative:  # big-endian: DLPack carries native byte order only
            x = _native_byte_order(x, name)
        return x
    if _is_torch(x):
        if x.layout != _torch.strided:  # sparse, ...: no DLPack form
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
        return x
    # Another library's array: its shape as the extension will read it.
    try:
        dims = tuple(int(d) for d in x.shape)
    except Exception as e:
        raise TypeError(f"{name}: shape {x.shape!r} is not a sequence of integers") from e
    if any(d < 0 for d in dims):
        raise ValueError(f"{name}: shape {dims} has a negative dimension")
    return x


def _native_byte_order(x: Any, name: str) -> Any:
    """A NumPy array of the other byte order in native order: a broadcast
    view (stride 0) is swapped in its distinct elements and broadcast again,
    so its dtype and shape reach the usual checks first; any other copy is
    checked against the machine's memory first (MemoryError naming `name`)."""
    idx = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                for st, n in zip(x.strides, x.shape))
    distinct = x[idx] if idx else x  # (x[()] of a 0-d array is a scalar)
    _ext._check_host_bytes(name, min(distinct.size * x.itemsize, 2**63 - 1),
                           f"a native-byte-order copy of {name} ({x.dtype} "
                           f"{list(distinct.shape)})", "pass a smaller array")
    swapped = distinct.astype(x.dtype.newbyteorder("="))
    return swapped if swapped.shape == x.shape else np.broadcast_to(swapped, x.shape)


def _rows_copied(x: Any) -> bool:
    """Whether _rows(x) copies x: its last dimension is not contiguous or a
    stride is negative."""
    if isinstance(x, np.ndarray):
        return bool(x.ndim) and ((x.strides[-1] != x.itemsize and x.shape[-1] > 1)
                                 or any(s < 0 for s in x.strides))
    if _is_torch(x):
        return bool(x.dim()) and x.stride(-1) != 1 and x.shape[-1] > 1
    return False


def _rows(x: Any) -> Any:
    """Zero copy when the last dimension is contiguous and no stride is
    negative (the extension reads neither), else a contiguous copy."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x) if _rows_copied(x) else x
    if _is_torch(x):
        if x.requires_grad:
            x = x.detach()
        if _rows_copied(x):
            return x.contiguous()
    return x


def _check_host_memory(x: Any, name: str, outputs: Tuple[Tuple[str, int], ...] = (),
                       to_f32: bool = False) -> None:
    """Before a host array argument `x` [T, ...] is copied (_rows; or
    converted to float32, `to_f32`) and the call's outputs
    (`outputs`: (what, bytes) each) are allocated: MemoryError naming `name`
    and the bytes when together they are more than the machine's memory and
    swap, as the CPU fused experts check their workspace. A broadcast view
    (numpy.broadcast_to, stride 0) holds one row whatever its T: its copy or
    the outputs failed in NumPy first, naming no argument."""
    if _on_cuda(x) or not x.ndim:
        return
    shape = tuple(int(d) for d in x.shape)
    parts = list(outputs)
    itemsize, copy = (4 if to_f32 else 0), f"{name} converted to float32 {list(shape)}"
    if not to_f32 and _rows_copied(x):
        itemsize = x.element_size() if _is_torch(x) else getattr(x, "itemsize", 0)
        copy = f"a contiguous copy of {name}, {_dtype_name(x)} {list(shape)}"
    if itemsize:
        n = 1
        for d in shape:
            n *= d
        parts.insert(0, (copy, n * itemsize))
    need = sum(b for _, b in parts)
    if parts and need > 0:
        _ext._check_host_bytes(name, min(need, 2**63 - 1),
                               f"{shape[0]} tokens ({', '.join(w for w, _ in parts)})")


def _contiguous_copies(x: Any) -> bool:
    """Whether _contiguous(x) copies x: a NumPy array or torch tensor (any
    device) that is not contiguous (a broadcast or strided view)."""
    if isinstance(x, np.ndarray):
        return not x.flags.c_contiguous
    if _is_torch(x):
        return not x.is_contiguous()
    return False


def _contiguous(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        # Not np.ascontiguousarray on a contiguous array: it makes a 0-d one
        # 1-d, and the shape errors then named [1] for a () given (a trial).
        return np.ascontiguousarray(x) if _contiguous_copies(x) else x
    if _is_torch(x):
        return (x.detach() if x.requires_grad else x).contiguous()
    return x


def _beyond_f32(name: str, wide: Any, narrow: Any, lib: Any) -> None:
    """ValueError naming the first element that is finite in `wide` (float64)
    but not in its float32 conversion `narrow` (numpy or torch, host memory)."""
    bad = lib.isinf(narrow) & lib.isfinite(wide)
    if bool(bad.any()):
        idx = tuple(int(i) for i in (np.argwhere(bad)[0] if lib is np else bad.nonzero()[0]))
        raise ValueError(f"{name}: element {list(idx)} is {float(wide[idx])!r}, beyond the "
                         f"float32 range the routers compute in")


def _f32_logits(x: Any, name: str) -> Any:
    """Router logits: any floating dtype, converted to float32. A float64 value
    beyond float32's range raises ValueError (it would become inf and route as
    a tie) in host memory; CUDA tensors are converted as they are (checking
    them would synchronise the stream)."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            # float16 / 32 / 64 and bfloat16 (longdouble too is refused: a value
            # past float64's range named itself inf)
            if not ((x.dtype.kind == "f" and x.dtype.itemsize <= 8)
                    or x.dtype.name == "bfloat16"):
                raise TypeError(f"{name}: expected {_LOGITS}, got {x.dtype}")
            _check_host_memory(x, name, to_f32=True)
            wide = x
            with np.errstate(over="ignore"):
                x = x.astype(np.float32)
            if wide.dtype.itemsize > 4:
                _beyond_f32(name, wide, x, np)
        else:
            _check_host_memory(x, name)
        return _rows(x)
    if _is_torch(x):
        if x.dtype != _torch.float32:
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name}: expected {_LOGITS}, got {x.dtype}")
            _check_host_memory(x, name, to_f32=True)
            wide = x
            x = x.float()
            if wide.dtype == _torch.float64 and not wide.is_cuda:
                _beyond_f32(name, wide.detach(), x.detach(), _torch)
        else:
            _check_host_memory(x, name)
        return _rows(x)
    return x


def _router_bias(x: Any, cuda: bool) -> Any:
    """e_score_correction_bias, as the routers read it: float32. On the CPU a
    bias is float32 or bfloat16 (converted exactly), as the expert biases are;
    another dtype (float64 included: rounding it could change which experts
    are picked) raises TypeError. On CUDA any floating dtype is converted, as
    the CUDA backend converts the expert biases."""
    name = "e_score_correction_bias"
    x = _as_array(x, name, _FLOAT)
    if not cuda:
        dt = _dtype_name(x)
        if dt not in ("float32", "bfloat16"):
            raise TypeError(f"{name}: expected dtype float32 or bfloat16 on the CPU, got {dt}")
    return _contiguous(_f32_logits(x, name))


_TORCH_WIDE_UNSIGNED: Tuple[Any, ...] = tuple(
    getattr(_torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(_torch, n)
) if _torch is not None else ()


def _i32(x: Any, name: str) -> Any:
    """topk_ids / token_ids: int32 (other integer dtypes are converted)."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            if x.dtype.kind not in "iu":
                raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
            if x.size and (int(x.min()) < -2**31 or int(x.max()) >= 2**31):
                raise ValueError(f"{name}: values must fit int32, got range "
                                 f"[{int(x.min())}, {int(x.max())}] ({x.dtype})")
            x = x.astype(np.int32)
        return _rows(x)
    if _is_torch(x):
        if x.dtype != _torch.int32:
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == _torch.bool:
                raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
            # torch's uint16 / uint32 / uint64 have no min / max: read them as int64
            # (a uint64 value from 2^63 on then reads negative).
            y = x
            if x.dtype in _TORCH_WIDE_UNSIGNED:
                y = x.to(_torch.int64)
                if y.numel() and int(y.min()) < 0:
                    raise ValueError(f"{name}: values must fit int32, got values >= 2^63 "
                                     f"({x.dtype})")
            if y.numel() and (int(y.min()) < -2**31 or int(y.max()) >= 2**31):
                raise ValueError(f"{name}: values must fit int32, got range "
                                 f"[{int(y.min())}, {int(y.max())}] ({x.dtype})")
            x = x.to(_torch.int32)
        return _rows(x)
    return x


def _weight_dtype(weight_dtype: Any) -> Optional[str]:
    """weight_dtype: "bf16" or None, spelt as the other dtype options are (the
    extension's one rule: "bfloat16" is refused as it is for dtype and
    compute_dtype)."""
    if weight_dtype is None:
        return None
    _str(weight_dtype, "weight_dtype", "'bf16' or None")
    return _ext.parse_dtype_option(weight_dtype, "weight_dtype", ["bf16"])


def _weight_copy_bytes(x: Any) -> int:
    """Bytes of the contiguous copy _contiguous makes of a host weight that is
    not contiguous (a broadcast or strided view); 0 when none is made."""
    if _on_cuda(x) or not getattr(x, "ndim", 0) or not _contiguous_copies(x):
        return 0
    n = x.itemsize if isinstance(x, np.ndarray) else x.element_size()
    for d in x.shape:
        n *= int(d)
    return n


def _check_weight_copies(weights: Tuple[Tuple[Any, str], ...]) -> None:
    """Before the weights' contiguous copies: MemoryError naming the first
    weight copied and the bytes of all the copies when together they cannot
    fit in the machine's memory and swap (NumPy's own error, at the one that
    failed, named no argument)."""
    copies = [(x, name, _weight_copy_bytes(x)) for x, name in weights]
    copies = [c for c in copies if c[2] > 0]
    if copies:
        what = " and ".join(f"a contiguous copy of {name}, {_dtype_name(x)} "
                            f"{[int(d) for d in x.shape]}" for x, name, _ in copies)
        _ext._check_host_bytes(copies[0][1], min(sum(c[2] for c in copies), 2**63 - 1),
                               what + ",", "pass the weights contiguous (a broadcast or strided "
                               "view is copied first)")


def _copied_before_checks(x: Any, bias: bool) -> bool:
    """Whether _fused_experts_impl copies weight or bias `x` before the
    extension checks it: a NumPy / torch view that is not contiguous (a
    broadcast or strided view), or a bias that is not float32 (converted)."""
    return (bias and _dtype_name(x) != "float32") or _contiguous_copies(x)


def _refuse_disagreeing_copies(x: Any, w13: Any, w2: Any, tw: Any, ids: Any) -> None:
    """ValueError, before any copy, when hidden_states [T, H], w13 [E, 2I, H]
    and w2 [E, H, I] disagree (or topk_weights and topk_ids, [T, k] both) and
    one of them would be copied (a non-contiguous view, ids to convert): the
    extension names the disagreement only after the copies (a broadcast w2 or
    hidden_states of a wrong size was copied whole, ~3 GB; session 28's trial).
    Each shape is given; which one is wrong is for the caller to see."""
    def copied(t: Any, ids_like: bool = False) -> bool:  # (_rows' copies are among these)
        return _contiguous_copies(t) or (ids_like and _dtype_name(t) != "int32")

    if _ndim_ok(x, 2) and _ndim_ok(w13, 3) and _ndim_ok(w2, 3):
        (E13, I2, H13), (E2, H2, I) = (tuple(int(d) for d in w.shape) for w in (w13, w2))
        H = int(x.shape[1])
        if ((E13, I2, H13, H2) != (E2, 2 * I, H, H)
                and any(copied(t) for t in (x, w13, w2))):
            raise ValueError(
                f"hidden_states [T, H], w13 [E, 2I, H] and w2 [E, H, I] disagree: got "
                f"hidden_states {[int(d) for d in x.shape]}, w13 {[E13, I2, H13]}, w2 "
                f"{[E2, H2, I]}; checked before the copy a non-contiguous view would need")
    # (topk_weights / topk_ids are copied only with T rows: others go uncopied
    # to the extension, which names them.)
    T = int(x.shape[0]) if _ndim_ok(x, 2) else -1
    if (_ndim_ok(tw, 2) and _ndim_ok(ids, 2) and tuple(tw.shape) != tuple(ids.shape)
            and ((int(tw.shape[0]) == T and copied(tw))
                 or (int(ids.shape[0]) == T and copied(ids, True)))):
        raise ValueError(
            f"topk_weights and topk_ids: expected the same [T, k], got topk_weights "
            f"{[int(d) for d in tw.shape]} and topk_ids {[int(d) for d in ids.shape]}; checked "
            f"before the copy a non-contiguous view would need")


def _refuse_misshapen_copies(x: Any, w13: Any, w2: Any, w13_bias: Any, w2_bias: Any) -> None:
    """ValueError naming a weight or bias of another shape than hidden_states
    [T, H] and w2 [E, H, I] imply, where it would be copied before the
    extension's own shape check (a broadcast w13 or w13_bias of the wrong shape
    was copied whole, 3-15 GB, before its error; session 27's trial). Shapes
    that cannot be read here (w2 not 3-d) are left to the extension."""
    if not (_ndim_ok(x, 2) and _ndim_ok(w2, 3)):
        return
    H = int(x.shape[1])
    E, I = int(w2.shape[0]), int(w2.shape[2])
    expected = (("w2", w2, False, (E, H, I), "[E, H, I]"),
                ("w13", w13, False, (E, 2 * I, H), "[E, 2I, H]"),
                ("w13_bias", w13_bias, True, (E, 2 * I), "[E, 2I]"),
                ("w2_bias", w2_bias, True, (E, H), "[E, H]"))
    for name, t, bias, shape, layout in expected:
        if t is None or not hasattr(t, "shape") or not _copied_before_checks(t, bias):
            continue
        got = tuple(int(d) for d in t.shape)
        if got != shape:
            raise ValueError(
                f"{name}: expected {layout} = {list(shape)} (H from hidden_states, E and I "
                f"from w2 {[int(d) for d in w2.shape]}), got {_dtype_name(t)} {list(got)}; "
                f"checked before the copy a non-contiguous view would need")


def _weight(x: Any, name: str, weight_dtype: Optional[str]) -> Tuple[Any, bool]:
    """Expert weights: (array, uint16-is-bf16 flag) of _as_array's result `x`
    (its copy checked by _check_weight_copies); weight_dtype checked by
    _weight_dtype."""
    x = _contiguous(x)
    if isinstance(x, np.ndarray) or _is_cupy(x):
        if x.dtype.kind == "V" and x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            return x.view(np.uint16), True
        if weight_dtype is not None:
            if x.dtype != np.uint16:
                raise TypeError(
                    f'{name}: weight_dtype="bf16" expects uint16 bf16 bit patterns, got {x.dtype}'
                )
            return x, True
    return x, False


def _cpu_bias(x: Any, name: str, weight_dtype: Optional[str]) -> Any:
    """An expert bias on the CPU: float32 or bfloat16 (torch.bfloat16,
    ml_dtypes.bfloat16, or uint16 bit patterns with weight_dtype="bf16"),
    whatever the weights' type; converted to float32 (exact; biases are tiny),
    contiguous. Another dtype raises TypeError naming `name` and the dtype
    given."""
    x = _as_array(x, name, "dtype float32 or bfloat16")
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            x = x.astype(np.float32)
        elif x.dtype == np.uint16 and weight_dtype is not None:  # bf16 bit patterns
            x = (x.astype(np.uint32) << 16).view(np.float32)
        elif x.dtype == np.uint16:
            raise TypeError(f'{name}: expected dtype float32 or bfloat16, got uint16 (pass '
                            f'weight_dtype="bf16" for bfloat16 bit patterns)')
        elif x.dtype != np.float32:
            raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {x.dtype}")
    elif _is_torch(x):
        if x.dtype == _torch.bfloat16:
            x = x.float()
        elif x.dtype != _torch.float32:
            raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {x.dtype}")
    return _contiguous(x)


_NP_DTYPES = {"f32": np.float32, "i32": np.int32, "u8": np.uint8}
_TORCH_DTYPES: dict = {}
if _torch is not None:
    _TORCH_DTYPES = {"f32": _torch.float32, "i32": _torch.int32, "u8": _torch.uint8,
                     "bf16": _torch.bfloat16}


def _empty_like_framework(ref: Any, shape: Tuple[int, ...], dtype: str) -> Any:
    """An uninitialised array of the framework and device of `ref`. dtype:
    "f32", "i32", "u8", or "same" (ref's dtype)."""
    if _is_torch(ref):
        return _torch.empty(shape, dtype=ref.dtype if dtype == "same" else _TORCH_DTYPES[dtype],
                            device=ref.device)
    if _is_cupy(ref):
        import cupy

        with ref.device:
            return cupy.empty(shape, dtype=ref.dtype if dtype == "same" else _NP_DTYPES[dtype])
    if dtype == "same":
        return np.empty(shape, dtype=ref.dtype)
    return np.empty(shape, dtype=_NP_DTYPES[dtype])


def _on_cuda(x: Any) -> bool:
    if _is_torch(x):
        return x.is_cuda
    if _is_cupy(x):
        return True
    if hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray):
        return x.__dlpack_device__()[0] == 2  # kDLCUDA
    return False


def _f32(x: Any) -> Any:
    """Biases on CUDA: float32 (what the kernels read), contiguous."""
    if _is_torch(x) and x.dtype != _torch.float32:
        x = x.float()
    elif isinstance(x, np.ndarray) or _is_cupy(x):
        if x.dtype != np.float32:
            x = x.astype(np.float32)
    return _contiguous(x)


def _use_torch_ops(*xs: Any) -> bool:
    return _torch_ops is not None and any(_is_torch(x) for x in xs)


def _torch_traces_or_has_a_mode() -> bool:
    """Whether torch.compile, export or torch.jit.trace traces, or a torch
    function or dispatch mode is active (AttributeError on a torch without
    these checks)."""
    t = _torch
    return bool(t.compiler.is_compiling() or t.jit.is_tracing()
                or t._C._is_torch_function_mode_enabled()
                or t._C._len_torch_dispatch_stack() > 0)


def _needs_op(*xs: Any) -> bool:
    """For a call with torch tensors: whether it must go through its
    ``torch.ops.fusedmoe`` op rather than straight to the implementation the op
    runs (the op's dispatch costs tens of µs a call): while torch.compile,
    export or torch.jit.trace traces (a trace without the op recorded only the
    output's allocation), or any torch function / dispatch mode is active; for tensor
    subclasses (FakeTensor, ...; nn.Parameter excepted), meta tensors (the
    fake implementation names a device mix) and functorch's wrapped tensors;
    and when autograd records (an input requires grad with grad mode
    on: the op's formula refuses a backward)."""
    t = _torch
    try:
        if _torch_traces_or_has_a_mode():
            return True
        grad = t.is_grad_enabled()
        for x in xs:
            if not _is_torch(x):
                continue
            if type(x) is not t.Tensor and type(x) is not t.nn.Parameter:
                return True
            if (x.is_meta or (grad and x.requires_grad)
                    or t._C._functorch.is_functorch_wrapped_tensor(x)):
                return True
    except AttributeError:  # a torch without these: the op always
        return True
    return False


# ---- functional ops ---------------------------------------------------------------

_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "swiglu_oai")


def _plain_cuda_device(exact: Tuple[Any, ...], params: Any = ()) -> Optional[int]:
    """For the fast paths: the current CUDA device's index when every tensor of
    `exact` is an exact torch.Tensor and every one of `params` one or an
    nn.Parameter, all on that device, contiguous, without lazy negation or
    conjugation, not functorch-wrapped, with no grad to record, and no tracing,
    torch function or dispatch mode is active; else None (also on a torch
    without these checks)."""
    t = _torch
    try:
        if _torch_traces_or_has_a_mode():
            return None
        x = exact[0]
        if type(x) is not t.Tensor or not x.is_cuda:
            return None
        dev = x.get_device()
        if dev != t.cuda.current_device():
            return None
        grad = t.is_grad_enabled()
        wrapped = t._C._functorch.is_functorch_wrapped_tensor
        for a in (*exact, *params):
            if type(a) is not t.Tensor and (type(a) is not t.nn.Parameter
                                            or any(a is e for e in exact)):
                return None
            if (not a.is_cuda or a.get_device() != dev or not a.is_contiguous() or a.is_neg()
                    or a.is_conj() or wrapped(a) or (a.requires_grad and grad)):
                return None
    except AttributeError:  # a torch without these: the general path
        return None
    return dev


def _fused_experts_fast(x, w13, w2, tw, ids, activation, w13_bias, w2_bias, apply, compute_dtype,
                        swiglu_alpha, swiglu_limit, w13_layout):
    """fused_experts for the plain CUDA call, in a few µs of Python instead of
    the general path's tens (argument checks for every array library): every
    array an exact torch.Tensor (nn.Parameter for weights and biases) on the
    current CUDA device, contiguous, hidden_states in the weights' dtype (bf16
    or f16), topk_weights f32 and topk_ids i32 [T, k] with 1 <= k <= E, f32
    biases, consistent shapes, valid options; no tracing, torch function or
    dispatch mode, functorch transform or grad to record. Returns None for any
    other call: the general path then runs, with its error messages."""
    t = _torch
    if not (type(activation) is str and activation in _ACTIVATIONS
            and type(w13_layout) is str and w13_layout in ("standard", "interleaved128")
            and type(apply) is bool and type(swiglu_alpha) in (float, int)
            and type(swiglu_limit) in (float, int)):
        return None
    params = [w13, w2] + [b for b in (w13_bias, w2_bias) if b is not None]
    dev = _plain_cuda_device((x, tw, ids), params)
    if dev is None:
        return None
    dt = w13.dtype
    if dt not in (t.bfloat16, t.float16) or x.dtype != dt or w2.dtype != dt:
        return None
    if tw.dtype != t.float32 or ids.dtype != t.int32:
        return None
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or tw.dim() != 2 or ids.dim() != 2:
        return None
    T, H = x.shape
    E, I2, H13 = w13.shape
    k = tw.shape[1]
    I = I2 // 2
    if (T < 1 or H < 1 or I < 1 or I2 != 2 * I or H13 != H or tuple(w2.shape) != (E, H, I)
            or tuple(tw.shape) != (T, k) or tuple(ids.shape) != (T, k) or not 1 <= k <= E
            or (apply and k != 1) or (w13_layout == "interleaved128" and I % _W13_BLOCK)):
        return None
    for b, shape in ((w13_bias, (E, I2)), (w2_bias, (E, H))):
        if b is not None and (b.dtype != t.float32 or tuple(b.shape) != shape):
            return None
    half = "f16" if dt == t.float16 else "bf16"
    if compute_dtype is not None and compute_dtype != half:
        return None
    # Parameters that require grad, with grad mode off: DLPack exports no such tensor.
    w13, w2 = (w.detach() if w.requires_grad else w for w in (w13, w2))
    w13_bias, w2_bias = (b.detach() if b is not None and b.requires_grad else b
                         for b in (w13_bias, w2_bias))
    out = t.empty((T, H), dtype=dt, device=x.device)
    ws = t.empty((_ext.cuda_fused_experts_workspace_bytes(T, H, I, E, k, apply, w13_layout),),
                 dtype=t.uint8, device=x.device)
    dl = _to_dlpack
    stream = (_raw_stream(dev) if _raw_stream is not None
              else t.cuda.current_stream(x.device).cuda_stream)
    _ext.fused_experts(
        dl(x), dl(w13), dl(w2), dl(tw), dl(ids), dl(out), activation,
        None if w13_bias is None else dl(w13_bias), None if w2_bias is None else dl(w2_bias),
        apply, half, False, float(swiglu_alpha), float(swiglu_limit), dl(ws),
        stream, w13_layout=w13_layout,
    )
    return out


def fused_experts(
    hidden_states: Any,
    w13: Any,
    w2: Any,
    topk_weights: Any,
    topk_ids: Any,
    activation: str = "silu",
    w13_bias: Any = None,
    w2_bias: Any = None,
    apply_router_weight_on_input: bool = False,
    compute_dtype: Optional[str] = None,
    *,
    weight_dtype: Optional[str] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    w13_layout: str = "standard",
) -> Any:
    """Routed experts: ``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``
    with ``expert_e(x) = w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e]``.

    hidden_states f32 [T, H]; w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and
    w2 [E, H, I], f32 or bf16; topk_weights f32 [T, k]; topk_ids int32 [T, k]
    in [-1, E) (-1: no expert). activation, in any case: "silu" (also "swiglu",
    "silu_glu", "swish": SiLU-gated), "gelu" (also "gelu_glu", "geglu"),
    "gelu_pytorch_tanh" (also "gelu_tanh", "gelu_new", "gelu_fast",
    "gelu_tanh_glu") or "swiglu_oai" (gpt-oss's clamped SwiGLU, with
    swiglu_alpha/limit; also "swigluoai", "swiglu_oai_clamped").
    apply_router_weight_on_input: scale the expert input instead of its output
    (Llama-4). compute_dtype: "f32" or "bf16" (default: "f32" on the CPU,
    the weights' type on CUDA). Returns [T, H] in hidden_states' dtype. vLLM's
    ``fused_experts`` layout and names.

    On CUDA (torch CUDA tensors or CuPy arrays, all on the current device):
    w13/w2 both bf16 or both float16, hidden_states f32, bf16 or float16
    (converted to the weights' type), biases converted to f32, compute_dtype
    the weights' type ("bf16" / "f16"), apply_router_weight_on_input with top_k = 1
    only; a workspace of ``cuda_fused_experts_workspace_bytes(...)`` bytes is
    allocated with the caller's framework on each call; the work runs on the
    current stream. topk_ids outside [0, E) add nothing there (they are not
    reported: that would need a synchronisation), where the CPU raises ValueError.

    w13_layout: "standard" (the rows as above, HF's order) or "interleaved128"
    (CUDA only, I a multiple of 128): w13's rows as ``interleave_w13(w13)``
    leaves them, which lets the sm90 path apply the activation in the w13
    GEMM's epilogue instead of a separate pass (same result within rounding);
    w13_bias stays in the standard order. The CPU refuses "interleaved128"
    (ValueError naming w13_layout): its kernels read the standard order.
    """
    if _torch is not None and weight_dtype is None:
        out = _fused_experts_fast(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                                  w13_bias, w2_bias, apply_router_weight_on_input, compute_dtype,
                                  swiglu_alpha, swiglu_limit, w13_layout)
        if out is not None:
            return out
    activation = _str(activation, "activation",
                      "'silu', 'gelu', 'gelu_pytorch_tanh', 'swiglu_oai' or an alias of one")
    w13_layout = _str(w13_layout, "w13_layout", "'standard' or 'interleaved128'")
    if compute_dtype is not None:
        compute_dtype = _str(compute_dtype, "compute_dtype", "'f32', 'bf16', 'f16' or None")
    for name, v in (("hidden_states", hidden_states), ("w13", w13), ("w2", w2),
                    ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        _check_array(v, name)
    _same_library(hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights,
                  topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    if _use_torch_ops(hidden_states, w13):
        if weight_dtype is not None:
            raise ValueError("weight_dtype: only for NumPy uint16 weights, not torch tensors")
        if _needs_op(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias):
            return _torch.ops.fusedmoe.fused_experts(
                hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                apply_router_weight_on_input, compute_dtype, swiglu_alpha, swiglu_limit,
                w13_layout,
            )
    return _fused_experts_impl(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
        apply_router_weight_on_input, compute_dtype, weight_dtype, swiglu_alpha, swiglu_limit,
        w13_layout,
    )


def _fused_experts_impl(
    hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
    apply_router_weight_on_input, compute_dtype, weight_dtype, swiglu_alpha, swiglu_limit,
    w13_layout="standard",
):
    x = _as_array(hidden_states, "hidden_states", _HIDDEN_CPU)
    _ndim(x, "hidden_states", 2, "[T, H]")
    cuda = _on_cuda(x)
    _hidden_dtype(x, cuda)
    T, H = int(x.shape[0]), int(x.shape[1])
    _check_host_memory(x, "hidden_states", ((f"the output f32 [{T}, {H}]", T * H * 4),))
    if compute_dtype is None:
        # CUDA computes in the weights' half type (bf16 or f16).
        # float16 weights of any array library (torch, CuPy: dtype names differ)
        f16 = str(getattr(w13, "dtype", "")) in ("float16", "torch.float16")
        compute_dtype = ("f16" if f16 else "bf16") if cuda else "f32"
    weight_dtype = _weight_dtype(weight_dtype)
    # The options first: a bad one is named before any array is copied (the
    # focused trial of session 28: after the weights' copies, 4.3 GB there).
    _ext.check_experts_options(activation, _float(swiglu_alpha, "swiglu_alpha"),
                               _float(swiglu_limit, "swiglu_limit"), compute_dtype, w13_layout)
    kinds = "dtype float32 or bfloat16 (CUDA: bfloat16 or float16)"
    w13, w2 = _as_array(w13, "w13", kinds), _as_array(w2, "w2", kinds)
    if w13_bias is not None:
        w13_bias = _as_array(w13_bias, "w13_bias", _FLOAT if cuda else "dtype float32 or bfloat16")
    if w2_bias is not None:
        w2_bias = _as_array(w2_bias, "w2_bias", _FLOAT if cuda else "dtype float32 or bfloat16")
    tw = _as_array(topk_weights, "topk_weights", "dtype float32")
    if isinstance(tw, np.ndarray) and tw.dtype != np.float32:
        raise TypeError(f"topk_weights: expected dtype float32, got {tw.dtype}")
    ids = _as_array(topk_ids, "topk_ids", _INT)
    _refuse_misshapen_copies(x, w13, w2, w13_bias, w2_bias)
    _refuse_disagreeing_copies(x, w13, w2, tw, ids)
    x = _rows(x)
    _check_weight_copies(((w13, "w13"), (w2, "w2")))
    w13, bf16_13 = _weight(w13, "w13", weight_dtype)
    w2, bf16_2 = _weight(w2, "w2", weight_dtype)
    if w13_bias is not None:
        w13_bias = (_f32(w13_bias) if cuda else _cpu_bias(w13_bias, "w13_bias", weight_dtype))
    if w2_bias is not None:
        w2_bias = _f32(w2_bias) if cuda else _cpu_bias(w2_bias, "w2_bias", weight_dtype)
    for name, w, layout in (("w13", w13, "[E, 2I, H]"), ("w2", w2, "[E, H, I]")):
        if _ndim_ok(w, 3) and w.shape[0] == 0:
            raise ValueError(f"{name}: 0 experts (shape {tuple(w.shape)}); expected {layout} "
                             f"with E >= 1")
    if _ndim_ok(w13, 3) and w13.shape[1] == 0:
        raise ValueError(f"w13: the intermediate size is 0 (shape {tuple(w13.shape)}); expected "
                         f"[E, 2I, H] with I >= 1")
    if _ndim_ok(w2, 3) and w2.shape[2] == 0:
        raise ValueError(f"w2: the intermediate size is 0 (shape {tuple(w2.shape)}); expected "
                         f"[E, H, I] with I >= 1")
    if x.shape[1] == 0:
        raise ValueError(f"hidden_states: the hidden size is 0 (shape {tuple(x.shape)}); "
                         f"expected [T, H] with H >= 1")
    T, H = x.shape[0], x.shape[1]
    # Rows other than T's: the extension names the shape, before any copy or
    # conversion (a broadcast [1e9, k] was copied whole first; session 27's trial).
    if _ndim_ok(tw, 2) and int(tw.shape[0]) == T:
        tw = _rows(tw)
    if _ndim_ok(ids, 2) and int(ids.shape[0]) == T:
        ids = _i32(ids, "topk_ids")
    elif _dtype_name(ids) in _WIDE_INTEGERS:
        # The extension checks the dtype first, and would name int64 as the fault
        # where the shape is (session 28's focused trial).
        shape = ", ".join(str(int(d)) for d in ids.shape)
        raise ValueError(f"topk_ids: expected [{T}, k] (int32; other integer dtypes are "
                         f"converted), got {_dtype_name(ids)} [{shape}]")
    if not cuda:
        out = _empty_like_framework(x, (T, H), "f32")
        _ext.fused_experts(
            _dl(x), _dl(w13), _dl(w2), _dl(tw), _dl(ids), _dl(out), activation, _dl(w13_bias),
            _dl(w2_bias), _bool(apply_router_weight_on_input, "apply_router_weight_on_input"), compute_dtype, bf16_13 or bf16_2,
            _float(swiglu_alpha, "swiglu_alpha"), _float(swiglu_limit, "swiglu_limit"),
            w13_layout=w13_layout,
        )
        return out
    # CUDA: output in the hidden states' dtype, workspace from the caller's
    # framework (its caching allocator; the graph's pool under CUDA-graph capture).
    out = _empty_like_framework(x, (T, H), "same")
    # E and I from w2, as the extension takes them (a misshapen w13 is named there).
    if _ndim_ok(w2, 3) and _ndim_ok(tw, 2) and min(w2.shape[0], w2.shape[2], tw.shape[1]) > 0:
        ws_bytes = _ext.cuda_fused_experts_workspace_bytes(
            T, max(H, 1), w2.shape[2], w2.shape[0], tw.shape[1],
            _bool(apply_router_weight_on_input, "apply_router_weight_on_input"), w13_layout)
    else:
        ws_bytes = 0  # the extension reports the bad shape
    ws = _empty_like_framework(x, (ws_bytes,), "u8")
    _ext.fused_experts(
        _dl(x), _dl(w13), _dl(w2), _dl(tw), _dl(ids), _dl(out), activation, _dl(w13_bias),
        _dl(w2_bias), _bool(apply_router_weight_on_input, "apply_router_weight_on_input"), compute_dtype, bf16_13 or bf16_2,
        _float(swiglu_alpha, "swiglu_alpha"), _float(swiglu_limit, "swiglu_limit"), _dl(ws), _stream(x),
        w13_layout=w13_layout,
    )
    return out


_W13_BLOCK = 128  # cuda::kW13Block: intermediate rows per block of the interleaved128 layout


def interleave_w13(w13: Any) -> Any:
    """A new copy of ``w13`` [E, 2I, H] (HF's order: gate rows 0..I-1, then up
    rows I..2I-1) with each expert's rows in the "interleaved128" order that
    ``fused_experts(..., w13_layout="interleaved128")`` reads on CUDA: for
    each block b of 128 intermediate rows, gate rows b*128..b*128+127, then
    the matching up rows I+b*128..I+b*128+127. Same array library, dtype and
    device as ``w13`` (NumPy, torch CPU/CUDA, CuPy), contiguous; the input is
    not changed. A load-time step: convert the weights once, not per call.
    I must be a positive multiple of 128 (ValueError naming w13 otherwise)."""
    _check_array(w13, "w13")
    # torch: also under FUSEDMOE_NO_TORCH, where a tensor passed in means torch is imported
    torch_mod = _torch if _torch is not None else sys.modules.get("torch")
    torch_in = torch_mod is not None and isinstance(w13, torch_mod.Tensor)
    if not (isinstance(w13, np.ndarray) or torch_in or _is_cupy(w13)):
        t = type(w13)
        raise TypeError(f"w13: expected a NumPy array, torch tensor or CuPy array, got "
                        f"{t.__module__}.{t.__name__}")
    shape = tuple(int(n) for n in w13.shape)
    if len(shape) != 3:
        raise ValueError(f"w13: expected a 3-d array [E, 2I, H], got shape {shape}")
    E, I2, H = shape
    if I2 % 2:
        raise ValueError(f"w13: expected [E, 2I, H] with an even middle size 2I (I gate rows, "
                         f"then I up rows), got shape {shape}")
    inter = I2 // 2
    if inter == 0 or inter % _W13_BLOCK:
        raise ValueError(f"w13: expected [E, 2I, H] with I a positive multiple of {_W13_BLOCK} "
                         f"(the interleaved128 layout's block), got I = {inter} (shape {shape})")
    # CuPy: the copies on w13's device, whichever is current (torch keeps a tensor's own)
    with w13.device if _is_cupy(w13) else contextlib.nullcontext():
        # [E, (gate|up), block, 128, H] -> [E, block, (gate|up), 128, H], copied to a new,
        # contiguous array (also where no row moves: I = 128)
        blocks = w13.reshape(E, 2, inter // _W13_BLOCK, _W13_BLOCK, H)
        if torch_in:
            out = blocks.transpose(1, 2).clone(memory_format=torch_mod.contiguous_format)
        else:  # NumPy / CuPy: copy() is C-ordered
            out = blocks.transpose(0, 2, 1, 3, 4).copy()
        return out.reshape(E, I2, H)


def _ndim_ok(x: Any, ndim: int) -> bool:
    return getattr(x, "ndim", None) == ndim


def _route(logits: Any, config: dict, e_score_correction_bias: Any = None, token_ids: Any = None,
           hash_table: Any = None, logits_name: str = "router_logits",
           names: Optional[Mapping[str, str]] = None,
           config_keys: Tuple[str, ...] = ()) -> Tuple[Any, Any]:
    """Routes `logits` with the config dict `config`. `names`: the caller's
    argument for each config key it filled from one (fused_topk's "topk" for
    "top_k", ...); errors about those keys name the argument. `config_keys`:
    the keys of the caller's own config dict, named "config.<key>" (as the
    extension names them where it reads the dict, also where the config is
    validated). Errors about the logits name `logits_name`."""
    names = {**(names or {}), "router_logits": logits_name}
    names.update((key, f"config.{key}") for key in config_keys if key not in names)
    _ndim(logits, logits_name, 2, "[T, E]")
    if logits.shape[1] == 0:
        raise ValueError(f"{logits_name}: 0 experts (shape {tuple(logits.shape)}); expected "
                         f"one column per expert")
    k, k_name = config["top_k"], names.get("top_k", "top_k")
    # Before the outputs are allocated: a bad top_k would otherwise surface as
    # the array library's allocation error, naming nothing.
    if not isinstance(k, (int, np.integer)) or isinstance(k, (bool, np.bool_)):
        raise TypeError(f"{k_name}: expected an int, got {type(k).__name__} {k!r}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"{k_name}: expected 1 <= {k_name} <= {logits.shape[1]} (router logit "
                         f"columns), got {k}")
    T = logits.shape[0]
    _check_host_memory(logits, logits_name,
                       ((f"topk_ids and topk_weights [{T}, {k}]", T * k * 8),))
    ids = _empty_like_framework(logits, (T, k), "i32")
    weights = _empty_like_framework(logits, (T, k), "f32")
    if e_score_correction_bias is not None:
        e_score_correction_bias = _router_bias(e_score_correction_bias, _on_cuda(logits))
    if token_ids is not None:
        token_ids = _i32(_as_array(token_ids, "token_ids", _INT), "token_ids")
    if hash_table is not None:
        hash_table = _contiguous(_i32(_as_array(hash_table, "hash_table", _INT), "hash_table"))
    try:
        _ext.select_experts(_dl(logits), _dl(ids), _dl(weights), config,
                            _dl(e_score_correction_bias), _dl(token_ids), _dl(hash_table),
                            _stream(logits))
    except (ValueError, TypeError) as e:
        # The extension names a config field "config.<key>: ..." (reading the
        # dict) or "<key>: ..." (validating the config).
        head, sep, rest = str(e).partition(": ")
        if (head == "e_score_correction_bias" and e_score_correction_bias is None
                and rest.endswith("got none")):
            # The extension names the C++ field (has_e_score_correction_bias).
            shape = rest[rest.find("["):rest.find("]") + 1] or "[E]"
            raise ValueError(
                f"e_score_correction_bias: expected float32 or bfloat16 {shape} (the config's "
                f"'e_score_correction_bias' is True), got none: pass the bias array "
                f"(e_score_correction_bias=...), or config=layer (a MoELayer) to route with "
                f"the layer's own bias") from None
        arg = names.get(head[len("config."):] if head.startswith("config.") else head)
        if head == "e_score_correction_bias":
            # Unprefixed, the extension means the bias array (an argument),
            # not the config's flag of the same name.
            arg = head
        if not sep or arg is None:
            raise
        raise type(e)(f"{arg}: {rest}") from None
    return weights, ids


# The config keys fused_topk / grouped_topk fill from their arguments.
# num_experts: the logits' columns (an error about it names the argument).
_TOPK_NAMES = {"top_k": "topk", "scoring_func": "scoring_func", "renormalize": "renormalize",
               "num_experts": "gating_output's columns (the expert count)"}
_GROUPED_TOPK_NAMES = {**_TOPK_NAMES, "num_expert_group": "num_expert_group",
                       "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
                       "group_score": "group_score"}


def fused_topk(
    hidden_states: Any,
    gating_output: Any,
    topk: int,
    renormalize: bool,
    scoring_func: str = "softmax",
) -> Tuple[Any, Any]:
    """vLLM's ``fused_topk``: scores = scoring_func(gating_output [T, E]), the
    ``topk`` best per token (ids in descending score order, ties to the lower
    id), weights renormalized to sum 1 if ``renormalize``. ``hidden_states``
    (may be None) is not read: its shape and dtype are checked as in
    ``fused_experts`` (a 2-d array, f32 on the CPU, f32/bf16/float16 on CUDA,
    one row per token of gating_output), not its values. scoring_func:
    "softmax", "sigmoid" or "sqrtsoftplus". Returns (topk_weights f32 [T, k],
    topk_ids int32 [T, k]), on gating_output's device."""
    topk = _int(topk, "topk")
    renormalize = _bool(renormalize, "renormalize")  # before the op, whose schema takes 1
    _check_array(gating_output, "gating_output")
    _same_library(hidden_states=hidden_states, gating_output=gating_output)
    if hidden_states is not None:
        _check_hidden_states(hidden_states, gating_output)
    if _use_torch_ops(gating_output) and _needs_op(gating_output):
        return _torch.ops.fusedmoe.fused_topk(gating_output, topk, renormalize, scoring_func)
    return _fused_topk_impl(hidden_states, gating_output, topk, renormalize, scoring_func)


def _check_hidden_states(hidden_states: Any, gating_output: Any) -> None:
    """fused_topk's hidden_states, which it does not read: a 2-d array of the
    hidden states' dtype (f32 on the CPU; f32, bf16 or float16 on CUDA) with
    one row per token of gating_output."""
    x = _as_array(hidden_states, "hidden_states", _HIDDEN_CPU)
    _ndim(x, "hidden_states", 2, "[T, H]")
    _hidden_dtype(x, _on_cuda(x))
    if getattr(gating_output, "ndim", 0) == 2 and x.shape[0] != gating_output.shape[0]:
        raise ValueError(f"hidden_states: expected {gating_output.shape[0]} tokens (rows of "
                         f"gating_output), got shape {tuple(x.shape)}")


def _hidden_dtype(x: Any, cuda: bool) -> None:
    """Hidden states: float32 on the CPU; float32, bfloat16 or float16 on CUDA
    (TypeError naming hidden_states, the expected dtypes and the one given)."""
    if _is_torch(x):  # dtype objects, not names: torch.compile traces this
        ok = x.dtype == _torch.float32 or (cuda and x.dtype in (_torch.bfloat16, _torch.float16))
    else:  # NumPy, CuPy, other DLPack arrays (torch's too under FUSEDMOE_NO_TORCH)
        name = _dtype_name(x)
        ok = name == "float32" or (cuda and name in ("bfloat16", "float16"))
    if not ok:
        raise TypeError(f"hidden_states: expected dtype "
                        f"{'float32, bfloat16 or float16 (CUDA)' if cuda else 'float32'}, "
                        f"got {_dtype_name(x)}")


def _fused_topk_impl(hidden_states, gating_output, topk, renormalize, scoring_func):
    logits = _f32_logits(_as_array(gating_output, "gating_output", _LOGITS), "gating_output")
    _ndim(logits, "gating_output", 2, "[T, E]")
    config = {
        "num_experts": int(logits.shape[1]), "top_k": _int(topk, "topk"), "hidden_size": 1,
        "intermediate_size": 1, "routing_method": "topk", "scoring_func": scoring_func,
        "renormalize": _bool(renormalize, "renormalize"),
    }
    return _route(logits, config, logits_name="gating_output", names=_TOPK_NAMES)


def grouped_topk(
    gating_output: Any,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias: Any = None,
    routed_scaling_factor: float = 1.0,
    *,
    group_score: Optional[str] = None,
) -> Tuple[Any, Any]:
    """DeepSeek-V2/V3 grouped top-k (vLLM's ``grouped_topk``): experts in
    ``num_expert_group`` groups; the ``topk_group`` best groups are kept (group
    score "max" of the scores, or "sum_top2" of the two largest biased scores;
    default: "sum_top2" when ``e_score_correction_bias`` [E] is given, else
    "max", as vLLM); ``topk`` experts by score + bias among the kept groups;
    weights = unbiased scores, renormalized if set, times
    ``routed_scaling_factor``. Returns (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
    topk = _int(topk, "topk")
    num_expert_group = _int(num_expert_group, "num_expert_group")
    topk_group = _int(topk_group, "topk_group")
    renormalize = _bool(renormalize, "renormalize")
    _check_array(gating_output, "gating_output")
    _same_library(gating_output=gating_output, e_score_correction_bias=e_score_correction_bias)
    if _use_torch_ops(gating_output) and _needs_op(gating_output, e_score_correction_bias):
        return _torch.ops.fusedmoe.grouped_topk(
            gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
            e_score_correction_bias, routed_scaling_factor, group_score)
    return _grouped_topk_impl(gating_output, topk, renormalize, num_expert_group, topk_group,
                              scoring_func, e_score_correction_bias, routed_scaling_factor,
                              group_score)


def _grouped_topk_impl(gating_output, topk, renormalize, num_expert_group, topk_group,
                       scoring_func, e_score_correction_bias, routed_scaling_factor, group_score):
    logits = _f32_logits(_as_array(gating_output, "gating_output", _LOGITS), "gating_output")
    _ndim(logits, "gating_output", 2, "[T, E]")
    has_bias = e_score_correction_bias is not None
    config = {
        "num_experts": int(logits.shape[1]), "top_k": _int(topk, "topk"), "hidden_size": 1,
        "intermediate_size": 1, "routing_method": "grouped_topk", "scoring_func": scoring_func,
        "renormalize": _bool(renormalize, "renormalize"),
        "num_expert_group": _int(num_expert_group, "num_expert_group"),
        "topk_group": _int(topk_group, "topk_group"), "e_score_correction_bias": has_bias,
        "routed_scaling_factor": _float(routed_scaling_factor, "routed_scaling_factor"),
        "group_score": group_score or ("sum_top2" if has_bias else "max"),
    }
    return _route(logits, config, e_score_correction_bias, logits_name="gating_output",
                  names=_GROUPED_TOPK_NAMES)


def select_experts(
    router_logits: Any,
    top_k: Optional[int] = None,
    *,
    config: Any = None,
    e_score_correction_bias: Any = None,
    token_ids: Any = None,
    hash_table: Any = None,
    **fields: Any,
) -> Tuple[Any, Any]:
    """Any router of the library, chosen by a configuration: ``config`` (a dict
    with the keys of ``MoELayer.config`` / ``inspect()``, or a MoELayer) updated
    by keyword ``fields`` (routing_method "topk" | "topk_softmax" |
    "grouped_topk" | "llama4" | "hash" | "simulated", scoring_func,
    renormalize, num_expert_group, topk_group, group_score,
    routed_scaling_factor, num_zero_experts, ...). ``num_experts`` defaults to
    the logits' columns minus num_zero_experts. router_logits: [T, E + Z].
    With a MoELayer as ``config`` the layer's router parameters are used too
    (``e_score_correction_bias``, ``hash_table``: these arguments are then
    None), so the result is the layer's own routing of these logits; ``top_k``
    is then None or the layer's top_k, and keyword ``fields`` equal to the
    layer's (another value, or a bias or hash table given: ValueError;
    ``config=layer.config`` routes with changes: a ``top_k`` argument replaces
    a config dict's). Hash routing: routing_method="hash",
    hash_vocab_size=V, ``hash_table`` int32 [V, k] and ``token_ids`` int32 [T]
    (on CPU arrays a token id outside [0, V) raises ValueError; on CUDA tensors
    the values stay on the device: such a token is routed to no expert, ids -1
    and weights 0, as NaN logits there are not reported either; a MoELayer call
    reports it through ``check_errors()``).
    routing_method "grouped_topk" without group_score scores groups as
    ``grouped_topk`` does: the sum of the top 2 with e_score_correction_bias,
    else the max. Returns (topk_weights f32 [T, k], topk_ids int32 [T, k]; id
    -1 = zero expert)."""
    _check_array(router_logits, "router_logits")
    # torch logits take torch tensors everywhere, as the other functions do (a
    # NumPy token_ids / hash_table / bias beside them was accepted; trial).
    _same_library(router_logits=router_logits, e_score_correction_bias=e_score_correction_bias,
                  token_ids=token_ids, hash_table=hash_table)
    if isinstance(config, MoELayer):
        # The layer's routing: a top_k of another value would silently route
        # with that k instead (the layer's own k is what its experts expect).
        if top_k is not None and _int(top_k, "top_k") != config.top_k:
            raise ValueError(f"top_k: expected the layer's top_k = {config.top_k} (config is a "
                             f"MoELayer: its own routing), got {_int(top_k, 'top_k')}")
        # Nor another router parameter: a bias or hash table given with the
        # layer was silently routed with instead of the layer's own.
        for name, given in (("e_score_correction_bias", e_score_correction_bias),
                            ("hash_table", hash_table)):
            if given is not None:
                shape = getattr(given, "shape", None)
                what = type(given).__name__ + (f" {list(shape)}" if shape is not None else "")
                raise ValueError(f"{name}: expected None, the layer's own (config is a MoELayer: "
                                 f"its own routing; config=layer.config takes another {name}), "
                                 f"got {what}")
        params = config._impl.router_params()
        if params["e_score_correction_bias"] is not None:
            e_score_correction_bias = _like(router_logits, params["e_score_correction_bias"])
        if params["hash_table"] is not None:
            hash_table = _like(router_logits, params["hash_table"])
        config = config.config
        # Likewise a keyword field that differs from the layer's (e.g.
        # renormalize=False): not the layer's routing any more.
        for key, value in fields.items():
            if key in config and not _same_field(value, config[key]):
                raise ValueError(f"{key}: expected the layer's {key} = {config[key]!r} (config is "
                                 f"a MoELayer: its own routing; config=layer.config takes "
                                 f"changes), got {value!r}")
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, a MoELayer or None, got "
                        f"{type(config).__name__} {config!r}")
    # A keyword that is no config field is named as the argument, before it is
    # merged into the config (it read "config: unknown field" with no config given,
    # or the JSON encoder's TypeError for an array value; session 29's trials).
    known = _ext.config_fields()
    for key in fields:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            shown = key if key.isprintable() and "\\" not in key else repr(key)
            raise ValueError(f"{shown}: unknown keyword argument, not a config field"
                             f"{f' (did you mean {close[0]}?)' if close else ''} (the fields: "
                             f"{', '.join(known)})")
    cfg = dict(config or {})
    config_keys = tuple(str(key) for key in cfg)
    cfg.update(fields)
    # Errors about a key given as a keyword name it as such, not as config.<key>.
    names = {key: key for key in fields}
    if top_k is not None:
        # A config's own top_k is replaced (config=layer.config takes changes), but
        # still checked: a wrong type there is an error either way.
        if "top_k" in cfg and "top_k" not in fields:
            _int(cfg["top_k"], "config.top_k")
        cfg["top_k"] = _int(top_k, "top_k")
        names["top_k"] = "top_k"
    if "top_k" not in cfg:
        raise ValueError("top_k: required (as an argument or in config)")
    logits = _f32_logits(_as_array(router_logits, "router_logits", _LOGITS), "router_logits")
    _ndim(logits, "router_logits", 2, "[T, E + num_zero_experts]")
    if "num_experts" not in cfg:  # the logits' columns minus the zero experts
        zero = cfg.get("num_zero_experts", 0)
        zero_name = names.get("num_zero_experts", "config.num_zero_experts")
        if not isinstance(zero, (int, np.integer)) or isinstance(zero, (bool, np.bool_)):
            raise TypeError(f"{zero_name}: expected int, got {type(zero).__name__} {zero!r}")
        cols = int(logits.shape[1])
        if 0 < zero and cols - zero < 1:
            raise ValueError(f"{zero_name}: expected < {cols} (router_logits' columns: "
                             f"num_experts + num_zero_experts, with num_experts >= 1), got "
                             f"{int(zero)}")
        cfg["num_experts"] = cols - int(zero)
    cfg.setdefault("hidden_size", 1)
    cfg.setdefault("intermediate_size", 1)
    method = cfg.get("routing_method", "topk")
    if e_score_correction_bias is not None:
        # Only the topk and grouped_topk routers read a bias: named here as the
        # argument, not as the configuration's internal flag.
        # (An unknown method is left to the extension, which names it and the
        # methods it knows: the bias is not what is wrong then; session 29's trial.)
        if method in ("topk_softmax", "llama4", "hash", "simulated"):
            raise ValueError(f"e_score_correction_bias: only used by routing_method 'topk' and "
                             f"'grouped_topk', got routing_method {method!r}")
        cfg.setdefault("e_score_correction_bias", True)
    if method == "grouped_topk" and "group_score" not in cfg:
        # grouped_topk's (and vLLM's) default: the top-2 sum with a bias, else the max.
        biased = e_score_correction_bias is not None or cfg.get("e_score_correction_bias") is True
        cfg["group_score"] = "sum_top2" if biased else "max"
    if "num_experts" not in config_keys:  # taken from the logits' columns above
        names.setdefault("num_experts", "num_experts (router_logits' columns less "
                                        "num_zero_experts)")
    return _route(logits, cfg, e_score_correction_bias, token_ids, hash_table, names=names,
                  config_keys=config_keys)


def _same_field(a: Any, b: Any) -> bool:
    """Whether a keyword field's value equals the configuration's (bool and
    numbers by value, NaN equal to NaN)."""
    try:
        if a == b:
            return True
        return isinstance(a, float) and isinstance(b, float) and a != a and b != b
    except Exception:  # e.g. an array: compared elsewhere, not equal here
        return False


def _like(ref: Any, a: np.ndarray) -> Any:
    """NumPy array `a` in the array library and on the device of `ref`."""
    if _is_torch(ref):
        return _torch.from_numpy(a).to(ref.device)
    if _is_cupy(ref):
        import cupy

        with ref.device:
            return cupy.asarray(a)
    return a


def inspect(path: "os.PathLike[str] | str") -> dict:
    """Describes a HF model directory (or config.json): model type, MoE layers,
    each layer's config and weight bytes — the content of
    ``fusedmoe inspect PATH --json``. A ``.safetensors`` path lists its tensors.
    A model with no MoE layer (nothing fusedmoe can run) raises ValueError.
    A layer whose tensors cannot be loaded (missing, wrong shape, cut short)
    does not raise: it is described, with ``weights_ok`` False and the error in
    ``weights_error`` (where ``fusedmoe inspect`` exits with status 1), so that
    one call reports every layer's problem; check ``weights_ok`` before loading."""
    return _ext.inspect(_path(path, "path"))


# ---- MoELayer ---------------------------------------------------------------------

_layer_ids = itertools.count(1)
# The torch ops' layer ids name this process too: a torch.export program saved
# here and loaded in another process finds no layer of its ids there (an error)
# instead of whichever layer that process numbered the same (a wrong answer).
_process_tag = uuid.uuid4().hex[:16]
_layers: "weakref.WeakValueDictionary[str, MoELayer]" = weakref.WeakValueDictionary()


class CudaWorkspace:
    """One workspace shared by CUDA layers: pass it as ``workspace=`` to
    ``MoELayer.from_pretrained`` for every MoE layer of a model, and their
    scratch takes one block as large as the largest layer's, instead of one
    block each (DeepSeek-V3 at the default max_num_tokens 8192: ~2.9 GB a
    layer).

    The layers sharing one must be called one at a time in stream order (the
    same CUDA stream, or streams ordered by events), as a model's layers are;
    calls in flight at once on unordered streams would overwrite each other's
    scratch. A layer built later that needs more gets a new, larger block; the
    layers built before keep the older one while they live (so CUDA graphs
    captured with them stay valid). Build the largest layer first, or call
    ``reserve``, to hold one block.

    >>> ws = fusedmoe.CudaWorkspace()
    >>> layers = [fusedmoe.MoELayer.from_pretrained(d, layer=i, backend="cuda", workspace=ws)
    ...           for i in moe_layer_ids]
    """

    def __init__(self) -> None:
        self._impl = _ext.CudaWorkspace()  # raises in a build without the CUDA backend

    def __reduce__(self):
        raise TypeError(
            "CudaWorkspace cannot be pickled or copied: it holds device memory in the extension. "
            "Share the object (the layers given it share its memory), or make another with "
            "fusedmoe.CudaWorkspace()")

    @property
    def nbytes(self) -> int:
        """Bytes of the current block (0 before the first layer)."""
        return self._impl.nbytes

    @property
    def device(self) -> int:
        """The CUDA device of the memory (-1 before the first layer)."""
        return self._impl.device

    def reserve(self, nbytes: int) -> None:
        """Makes the current block at least ``nbytes`` large, on the current CUDA device."""
        self._impl.reserve(_int_in(nbytes, "nbytes", 0, _I64_MAX))

    def __repr__(self) -> str:
        return f"CudaWorkspace(nbytes={self.nbytes}, device={self.device})"


class ExpertParallelGroup:
    """GPU expert parallelism: the ranks (processes, one GPU each) among which
    CUDA layers given it as ``ep_group`` spread their experts. One NCCL
    communicator, made once and shared by those layers.

    ``ExpertParallelGroup(group=None)``: over the ranks of a torch.distributed
    process group (default: the world), each on its current CUDA device —
    collective: every rank of the group calls it. ``from_unique_id``: over ranks
    that hand one rank's ``nccl_unique_id()`` bytes to the others themselves.

    >>> torch.distributed.init_process_group("nccl")      # e.g. under torchrun
    >>> torch.cuda.set_device(local_rank)
    >>> ep = fusedmoe.ExpertParallelGroup()
    >>> layer = fusedmoe.MoELayer.from_pretrained(path, backend="cuda", ep_group=ep)
    >>> out = layer(my_tokens)   # collective; each rank its own tokens (0 too)

    Rank r holds the experts [r * E // P, (r + 1) * E // P) (P ranks); a forward
    dispatches each token once to every rank holding one of its experts and
    combines the results back (stores into the other GPUs' memory where every
    rank maps the others', else NCCL all-to-all; FUSEDMOE_EP_TRANSPORT), with
    the output of one GPU on all the ranks' tokens (bit for bit over NCCL, to
    f32 rounding over peer memory). Every rank must build its layers in the
    same order with the same ``max_num_tokens``, and call each layer's forward
    the same number of times (with up to ``max_num_tokens`` tokens); a rank
    that stops makes the others raise within FUSEDMOE_COMM_TIMEOUT_S (default
    60) seconds."""

    def __init__(self, group: Any = None):
        t = _torch
        if t is None or not t.distributed.is_available():
            raise ImportError("ExpertParallelGroup: torch.distributed is needed (or use "
                              "ExpertParallelGroup.from_unique_id)")
        dist = t.distributed
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelGroup: torch.distributed is not initialized "
                               "(torch.distributed.init_process_group first)")
        if not t.cuda.is_available():
            raise ValueError("ExpertParallelGroup: no CUDA device is visible")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        uid = [nccl_unique_id() if rank == 0 else None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(uid, src=src, group=group)
        self._impl = _ext.EpGroup(uid[0], rank, size, t.cuda.current_device())

    @classmethod
    def from_unique_id(cls, unique_id: bytes, rank: int, size: int,
                       device: Optional[int] = None) -> "ExpertParallelGroup":
        """Rank ``rank`` of ``size`` on CUDA device ``device`` (default: the current
        one), joined by the bytes of one rank's ``nccl_unique_id()`` — collective."""
        if not isinstance(unique_id, bytes):
            raise TypeError(f"unique_id: expected the bytes of fusedmoe.nccl_unique_id(), "
                            f"got {type(unique_id).__name__}")
        if len(unique_id) != 128:  # NCCL_UNIQUE_ID_BYTES; checked here in builds without NCCL too
            raise ValueError(f"unique_id: expected the 128 bytes of nccl_unique_id(), got "
                             f"{len(unique_id)}")
        size = _int_in(size, "size", 1, 2**31 - 1)
        rank = _int_in(rank, "rank", 0, size - 1, f" (size {size})")
        if device is None:
            if not cuda_built or _ext.cuda_device_count() == 0:
                raise ValueError("ExpertParallelGroup: no CUDA device is visible")
            device = _torch.cuda.current_device() if _torch is not None else 0
        g = cls.__new__(cls)
        g._impl = _ext.EpGroup(unique_id, rank, size, _int_in(device, "device", 0, 2**31 - 1))
        return g

    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def size(self) -> int:
        """P: ranks"""
        return self._impl.size

    @property
    def device(self) -> int:
        """This rank's CUDA device index"""
        return self._impl.device

    def __repr__(self) -> str:
        return f"ExpertParallelGroup(rank={self.rank}, size={self.size}, device=cuda:{self.device})"


def nccl_unique_id() -> bytes:
    """The bytes of a fresh NCCL unique id, for
    ``ExpertParallelGroup.from_unique_id`` on every rank."""
    return _ext.nccl_unique_id()


class MoELayer:
    """One MoE layer (router, routed experts, shared experts) of a HF model.

    >>> layer = fusedmoe.MoELayer.from_pretrained("models/tiny-deepseek-v3", layer=1)
    >>> out = layer(np.random.randn(4, layer.hidden_size).astype(np.float32))
    """

    def __init__(self, impl: "_ext.MoELayer | None" = None):
        # Layers come from MoELayer.from_pretrained (which wraps the loaded one).
        if impl is None:
            raise TypeError("MoELayer() takes no model: build a layer with "
                            "fusedmoe.MoELayer.from_pretrained(model_dir, layer=...)")
        if not isinstance(impl, _ext.MoELayer):
            raise TypeError("MoELayer: expected a layer loaded by the extension; build one with "
                            "fusedmoe.MoELayer.from_pretrained(model_dir, layer=...), got "
                            f"{type(impl).__name__} {impl!r}")
        self._impl = impl
        # The torch ops' layer_id: a string attribute, a constant to
        # torch.compile (an int one changing between calls became a SymInt):
        # "<n>@<process tag>", unique to this layer of this process.
        self._op_id = f"{next(_layer_ids)}@{_process_tag}"
        _layers[self._op_id] = self
        # The fast path's facts (_forward_fast): the CUDA device index (-1 on
        # the CPU), H and the most tokens a call takes.
        dev = impl.device
        self._cuda_index = int(dev.partition(":")[2] or 0) if dev.startswith("cuda") else -1
        self._fast_h = impl.hidden_size
        self._fast_max_t = impl.max_num_tokens

    def __reduce__(self):
        raise TypeError(
            "MoELayer cannot be pickled or copied: it holds its loaded weights (in host or GPU "
            "memory) in the extension. Load it again with MoELayer.from_pretrained(...); to "
            "copy a module that holds one, share the layer: copy.deepcopy(module, "
            "memo={id(layer): layer})")

    @classmethod
    def from_pretrained(
        cls,
        model_dir: "os.PathLike[str] | str",
        layer: Optional[int] = None,
        backend: str = "cpu",
        dtype: Optional[str] = None,
        threads: Optional[int] = None,
        max_num_tokens: Optional[int] = None,
        *,
        check_finite: bool = True,
        workspace: Optional[CudaWorkspace] = None,
        ep_group: Optional[ExpertParallelGroup] = None,
    ) -> "MoELayer":
        """Loads MoE layer ``layer`` (default: the first MoE layer) of the HF
        checkpoint in ``model_dir`` (config.json + model.safetensors, sharded or
        not; weights memory-mapped, bf16 stays bf16).

        ``backend``: "cpu", or "cuda": the weights are uploaded (experts as
        bf16, or f16 with ``dtype="f16"``) to the current CUDA device and a
        workspace for ``max_num_tokens`` tokens (default 8192) is allocated
        once; the layer then takes and returns CUDA tensors (torch or CuPy;
        f32, bf16 or float16) on that device and runs on the caller's current
        stream (CUDA-graph capturable). ``dtype``: compute dtype "f32" or
        "bf16" on the CPU (default "f32"); "bf16" or "f16" on CUDA (default:
        "f16" for a float16 checkpoint, else "bf16"). ``threads`` (CPU): a
        private pool of that many threads (1..1024); 0 or None: the global pool (all cores unless set_num_threads changed
        it), as ``fusedmoe run --threads 0``. ``check_finite``: every weight read
        is checked for NaN / Inf (and values beyond f32 once converted), a
        corrupt checkpoint raising OSError naming the tensor and the element;
        False skips the check (a call whose tokens reach such a weight then
        raises ValueError naming the first non-finite output). ``workspace``
        (CUDA): a ``CudaWorkspace`` whose memory this layer's scratch shares
        with the other layers given it, instead of its own. ``ep_group`` (CUDA):
        an ``ExpertParallelGroup``: this rank holds its share of the experts and
        a call is collective over the group (see ExpertParallelGroup); the
        current device must be the group's."""
        model_dir = _path(model_dir, "model_dir")
        _str(backend, "backend", "'cpu' or 'cuda'")
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend: expected 'cpu' or 'cuda', got {backend!r}")
        # the value is checked by the extension: exactly "f32", "bf16" or "f16"
        if dtype is not None and not isinstance(dtype, str):
            raise TypeError(f"dtype: expected 'f32', 'bf16' or 'f16' (f16: CUDA only) or None, "
                            f"got {type(dtype).__name__} {dtype!r}")
        if dtype is None:  # CUDA: f16 for an f16 checkpoint, else bf16
            dtype = "auto" if backend == "cuda" else "f32"
        if layer is not None:
            layer = _int_in(layer, "layer", 0, _I64_MAX, " (a layer index of the model)")
        if threads is not None:
            threads = _num_threads(threads, "threads")
        mnt = 0 if max_num_tokens is None else _int_in(max_num_tokens, "max_num_tokens", 0,
                                                       _I64_MAX, " (0: the default 8192)")
        if workspace is not None and not isinstance(workspace, CudaWorkspace):
            raise TypeError(f"workspace: expected a fusedmoe.CudaWorkspace or None, got "
                            f"{type(workspace).__name__}")
        if ep_group is not None and not isinstance(ep_group, ExpertParallelGroup):
            raise TypeError(f"ep_group: expected a fusedmoe.ExpertParallelGroup or None, got "
                            f"{type(ep_group).__name__}")
        return cls(_ext.MoELayer.from_pretrained(model_dir, layer, dtype, threads, backend, mnt,
                                                 _bool(check_finite, "check_finite"),
                                                 None if workspace is None else workspace._impl,
                                                 None if ep_group is None else ep_group._impl))

    # -- properties
    @property
    def config(self) -> dict:
        """The layer's MoEConfig as a dict (keys as in ``inspect()``)."""
        return self._impl.config

    @property
    def num_experts(self) -> int:
        """E: routed experts"""
        return self._impl.num_experts

    @property
    def top_k(self) -> int:
        """k: experts per token"""
        return self._impl.top_k

    @property
    def hidden_size(self) -> int:
        """H"""
        return self._impl.hidden_size

    @property
    def num_router_logits(self) -> int:
        """E + num_zero_experts: columns of router_logits"""
        return self._impl.num_router_logits

    @property
    def compute_dtype(self) -> str:
        """The compute dtype: "f32" or "bf16"."""
        return self._impl.compute_dtype

    @property
    def weights_dtype(self) -> str:
        """The expert weights' dtype in memory: "f32" or "bf16"."""
        return self._impl.weights_dtype

    @property
    def weights_nbytes(self) -> int:
        """bytes of the layer's weights"""
        return self._impl.weights_nbytes

    @property
    def layer(self) -> int:
        """layer index in the model"""
        return self._impl.layer

    @property
    def threads(self) -> int:
        """threads that run this layer"""
        return self._impl.threads

    @property
    def backend(self) -> str:
        """'cpu' or 'cuda'."""
        return "cpu" if self._impl.device == "cpu" else "cuda"

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N': where the weights live and the inputs must be."""
        return self._impl.device

    @property
    def max_num_tokens(self) -> int:
        """CUDA: the most tokens one call takes (0 on the CPU: no limit)"""
        return self._impl.max_num_tokens

    @property
    def workspace_nbytes(self) -> int:
        """CUDA: bytes of the scratch one call uses, the layer's own or its
        share of a ``CudaWorkspace`` (0 on the CPU)."""
        return self._impl.workspace_nbytes

    def __repr__(self) -> str:
        c = self.config
        return (f"MoELayer(source={self._impl.source!r}, layer={self.layer}, "
                f"num_experts={c['num_experts']}, top_k={c['top_k']}, "
                f"hidden_size={c['hidden_size']}, intermediate_size={c['intermediate_size']}, "
                f"weights={self.weights_dtype}, compute_dtype={self.compute_dtype!r}, "
                f"device={self.device!r})")

    # -- forward
    def __call__(self, hidden_states: Any, router_logits: Any = None, *, token_ids: Any = None,
                 return_routing: bool = False) -> Any:
        """hidden_states f32 [T, H] -> output f32 [T, H] (CUDA layers: f32 or
        bf16 CUDA tensors, the output in the input's dtype). ``router_logits``
        f32 [T, E + Z]: skip the gate GEMM and route these. ``token_ids``
        int32 [T]: hash routing only. ``return_routing``: return
        (output, topk_ids, topk_weights, router_logits) instead (a bool: a str
        such as "no" is a TypeError, not truthy)."""
        if (router_logits is None and token_ids is None and return_routing is False
                and self._cuda_index >= 0 and _torch is not None):
            out = self._forward_fast(hidden_states)
            if out is not None:
                return out
        if _bool(return_routing, "return_routing"):
            return self.forward_with_routing(hidden_states, router_logits, token_ids=token_ids)
        _check_array(hidden_states, "hidden_states")
        _same_library(hidden_states=hidden_states, router_logits=router_logits,
                      token_ids=token_ids)
        if (token_ids is None and _use_torch_ops(hidden_states)
                and _needs_op(hidden_states, router_logits)):
            return _torch.ops.fusedmoe.moe_layer(hidden_states, self._op_id, router_logits)
        return self._forward(hidden_states, router_logits, token_ids, False)

    forward = __call__

    def forward_with_routing(self, hidden_states: Any, router_logits: Any = None, *,
                             token_ids: Any = None) -> Tuple[Any, Any, Any, Any]:
        """Returns (output f32 [T, H], topk_ids int32 [T, k], topk_weights f32
        [T, k], router_logits f32 [T, E + Z])."""
        _check_array(hidden_states, "hidden_states")
        _same_library(hidden_states=hidden_states, router_logits=router_logits,
                      token_ids=token_ids)
        if (token_ids is None and _use_torch_ops(hidden_states)
                and _needs_op(hidden_states, router_logits)):
            return _torch.ops.fusedmoe.moe_layer_with_routing(hidden_states, self._op_id,
                                                              router_logits)
        return self._forward(hidden_states, router_logits, token_ids, True)

    def check_errors(self) -> None:
        """CUDA layers: waits for the current stream, then raises ValueError
        naming the first token whose router logits held a NaN, or (hash
        routing) whose token id was outside [0, hash_vocab_size), in a call
        since the last check (the kernels record it on the device and route
        such a token to no expert; reporting needs this synchronisation, so
        calls do not raise for it). CPU layers raise
        in the call itself; this is a no-op for them."""
        stream = 0
        if self.backend == "cuda" and _torch is not None and _torch.cuda.is_available():
            stream = _torch.cuda.current_stream().cuda_stream
        self._impl.check_errors(stream)

    def _forward_fast(self, x):
        """A CUDA layer's plain call, in a few µs of Python instead of the
        general path's ~20 (checks for every array library): an exact
        torch.Tensor [T, H] on the layer's device, the current one, contiguous,
        f32 / bf16 / f16, 1 <= T <= max_num_tokens; no tracing, torch function
        or dispatch mode, functorch transform or grad to record. None for any
        other call: the general path then runs, with its messages."""
        t = _torch
        dev = _plain_cuda_device((x,))
        if dev is None or dev != self._cuda_index or x.dim() != 2:
            return None
        T, H = x.shape
        if (H != self._fast_h or not 1 <= T <= self._fast_max_t
                or x.dtype not in (t.float32, t.bfloat16, t.float16)):
            return None
        out = t.empty((T, H), dtype=x.dtype, device=x.device)
        stream = (_raw_stream(dev) if _raw_stream is not None
                  else t.cuda.current_stream(x.device).cuda_stream)
        self._impl.forward(_to_dlpack(x), _to_dlpack(out), None, None, None, None, None, stream)
        return out

    def _forward(self, hidden_states, router_logits, token_ids, routing):
        x = _as_array(hidden_states, "hidden_states", _HIDDEN_CPU)
        _ndim(x, "hidden_states", 2, f"[T, {self.hidden_size}]")
        _hidden_dtype(x, self.backend == "cuda")
        T, H, E, k = int(x.shape[0]), self.hidden_size, self.num_router_logits, self.top_k
        outputs = ((f"the output f32 [{T}, {H}]", T * H * 4),)
        if routing:
            outputs += ((f"router_logits [{T}, {E}], topk_ids and topk_weights [{T}, {k}]",
                         T * (E + 2 * k) * 4),)
        _check_host_memory(x, "hidden_states", outputs)
        x = _rows(x)
        if router_logits is not None:
            router_logits = _f32_logits(_as_array(router_logits, "router_logits", _LOGITS),
                                        "router_logits")
        if token_ids is not None:
            token_ids = _i32(_as_array(token_ids, "token_ids", _INT), "token_ids")
        cuda = _on_cuda(x)
        out = _empty_like_framework(x, (T, self.hidden_size), "same" if cuda else "f32")
        stream = _stream(x) if cuda else 0
        if not routing:
            self._impl.forward(_dl(x), _dl(out), _dl(router_logits), None, None, None,
                               _dl(token_ids), stream)
            return out
        logits = _empty_like_framework(x, (T, self.num_router_logits), "f32")
        ids = _empty_like_framework(x, (T, self.top_k), "i32")
        weights = _empty_like_framework(x, (T, self.top_k), "f32")
        self._impl.forward(_dl(x), _dl(out), _dl(router_logits), _dl(logits), _dl(ids),
                           _dl(weights), _dl(token_ids), stream)
        return out, ids, weights, logits


def __dir__() -> list:
    """The public API (``__all__``) and module dunders; the helper imports
    (np, os, typing names, ...) stay out of ``dir(fusedmoe)``."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})


def _layer_by_id(layer_id: str) -> MoELayer:
    """The live layer of id `layer_id` (MoELayer._op_id, as the torch ops pass it)."""
    layer = _layers.get(str(layer_id))
    if layer is None:
        elsewhere = str(layer_id).rpartition("@")[2] != _process_tag
        raise ValueError(
            f"layer_id: no live fusedmoe.MoELayer with id {layer_id!r}"
            + (" (a layer of another process: a torch.export program that calls fusedmoe "
               "layers runs only in the process that exported it, while those layers live; "
               "export again after loading the layers)" if elsewhere else
               " (the layer was deleted)"))
    return layer


# Registers torch.ops.fusedmoe.* (a plain `from . import` would find the
# None below as the package attribute and not import the submodule).
_torch_ops: Any = None
if _torch is not None:
    _torch_ops = importlib.import_module("._torch_ops", __name__)
