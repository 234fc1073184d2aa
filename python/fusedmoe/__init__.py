"""fusedmoe: the Mixture-of-Experts layer of HF models (router, expert GEMMs,
shared experts) on the CPU, from Python.

Arrays go in and out through DLPack: NumPy arrays and PyTorch CPU tensors are
read without a copy when their layout allows (rows contiguous for activations,
fully contiguous for weights; otherwise a contiguous copy is made). Outputs are
NumPy arrays for NumPy inputs and torch tensors (allocated by PyTorch) for
torch inputs. Device (CUDA) arrays raise NotImplementedError: this build has
a CPU backend only.

dtypes: hidden states and topk_weights are float32, topk_ids int32 (int64 is
converted); router logits of any floating dtype are converted to float32;
expert weights are float32 or bfloat16 — torch.bfloat16 tensors, ml_dtypes
``bfloat16`` NumPy arrays, or uint16 NumPy arrays holding bf16 bit patterns
with ``weight_dtype="bf16"``. ``compute_dtype="bf16"`` rounds the expert inputs
and the intermediate to bf16 (f32 accumulation).

Errors: a wrong shape or value raises ValueError and a wrong dtype TypeError,
both naming the argument; an unreadable file raises OSError; something this
build does not handle raises NotImplementedError.

When PyTorch is importable the ops are also registered as
``torch.ops.fusedmoe.*`` (see ``fusedmoe._torch_ops``), with fake
implementations so that ``torch.compile(fullgraph=True)`` traces them; the
functions below route torch tensors through those ops. Set the environment
variable ``FUSEDMOE_NO_TORCH=1`` to skip importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import weakref
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from . import _ext

__version__: str = _ext.__version__

__all__ = [
    "MoELayer",
    "fused_topk",
    "grouped_topk",
    "select_experts",
    "fused_experts",
    "inspect",
    "set_num_threads",
    "get_num_threads",
    "cuda_built",
    "__version__",
]

cuda_built: bool = _ext.cuda_built

# torch, when importable (never required).
_torch: Any = None
if not os.environ.get("FUSEDMOE_NO_TORCH") and importlib.util.find_spec("torch") is not None:
    try:
        import torch as _torch  # noqa: F401
    except Exception:  # a broken torch install must not break fusedmoe
        _torch = None


def set_num_threads(num_threads: int) -> None:
    """Threads of the global pool used by the functional ops and by layers
    created without ``threads`` (<= 0: all cores)."""
    _ext.set_num_threads(int(num_threads))


def get_num_threads() -> int:
    return _ext.get_num_threads()


# ---- array helpers ----------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _ndim(x: Any, name: str, ndim: int, what: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array {what}, got shape {tuple(x.shape)}")


def _as_array(x: Any, name: str) -> Any:
    """NumPy arrays and torch tensors pass through; DLPack objects too (the
    extension imports them); anything else goes through np.asarray."""
    if isinstance(x, np.ndarray) or _is_torch(x):
        return x
    if hasattr(x, "__dlpack__"):
        return x
    try:
        return np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from e


def _rows(x: Any) -> Any:
    """Zero copy when the last dimension is contiguous, else a contiguous copy."""
    if isinstance(x, np.ndarray):
        if x.ndim and x.strides[-1] != x.itemsize and x.shape[-1] > 1:
            return np.ascontiguousarray(x)
        return x
    if _is_torch(x):
        if x.requires_grad:
            x = x.detach()
        if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
            return x.contiguous()
    return x


def _contiguous(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if _is_torch(x):
        return (x.detach() if x.requires_grad else x).contiguous()
    return x


def _f32_logits(x: Any, name: str) -> Any:
    """Router logits: any floating dtype, converted to float32."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
                raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
            x = x.astype(np.float32)
        return _rows(x)
    if _is_torch(x):
        if x.dtype != _torch.float32:
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
            x = x.float()
        return _rows(x)
    return x


def _i32(x: Any, name: str) -> Any:
    """topk_ids / token_ids: int32 (other integer dtypes are converted)."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            if x.dtype.kind not in "iu":
                raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
            x = x.astype(np.int32)
        return _rows(x)
    if _is_torch(x):
        if x.dtype != _torch.int32:
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == _torch.bool:
                raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
            x = x.to(_torch.int32)
        return _rows(x)
    return x


def _weight(x: Any, name: str, weight_dtype: Optional[str]) -> Tuple[Any, bool]:
    """Expert weights: (array, uint16-is-bf16 flag)."""
    x = _contiguous(_as_array(x, name))
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "V" and x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            return x.view(np.uint16), True
        if weight_dtype is not None:
            if weight_dtype not in ("bf16", "bfloat16"):
                raise ValueError(f'weight_dtype: expected "bf16" or None, got {weight_dtype!r}')
            if x.dtype != np.uint16:
                raise TypeError(
                    f'{name}: weight_dtype="bf16" expects uint16 bf16 bit patterns, got {x.dtype}'
                )
            return x, True
    return x, False


_NP_DTYPES = {"f32": np.float32, "i32": np.int32}


def _empty_like_framework(ref: Any, shape: Tuple[int, ...], dtype: str) -> Any:
    if _is_torch(ref):
        return ref.new_empty(shape, dtype=_torch.float32 if dtype == "f32" else _torch.int32)
    return np.empty(shape, dtype=_NP_DTYPES[dtype])


def _check_backend(backend: str) -> None:
    if backend == "cpu":
        return
    if backend == "cuda":
        raise NotImplementedError(
            "backend='cuda': this build of fusedmoe has no CUDA backend yet; use backend='cpu'"
        )
    raise ValueError(f"backend: expected 'cpu' or 'cuda', got {backend!r}")


def _use_torch_ops(*xs: Any) -> bool:
    return _torch_ops is not None and any(_is_torch(x) for x in xs)


# ---- functional ops ---------------------------------------------------------------


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
    compute_dtype: str = "f32",
    *,
    weight_dtype: Optional[str] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> Any:
    """Routed experts: ``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``
    with ``expert_e(x) = w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e]``.

    hidden_states f32 [T, H]; w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and
    w2 [E, H, I], f32 or bf16; topk_weights f32 [T, k]; topk_ids int32 [T, k]
    in [-1, E) (-1: no expert). activation: "silu", "gelu",
    "gelu_pytorch_tanh" or "swiglu_oai" (gpt-oss, with swiglu_alpha/limit).
    apply_router_weight_on_input: scale the expert input instead of its output
    (Llama-4). Returns f32 [T, H]. vLLM's ``fused_experts`` layout and names.
    """
    if _use_torch_ops(hidden_states, w13):
        if weight_dtype is not None:
            raise ValueError("weight_dtype: only for NumPy uint16 weights, not torch tensors")
        return _torch.ops.fusedmoe.fused_experts(
            hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
            apply_router_weight_on_input, compute_dtype, swiglu_alpha, swiglu_limit,
        )
    return _fused_experts_impl(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
        apply_router_weight_on_input, compute_dtype, weight_dtype, swiglu_alpha, swiglu_limit,
    )


def _fused_experts_impl(
    hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
    apply_router_weight_on_input, compute_dtype, weight_dtype, swiglu_alpha, swiglu_limit,
):
    x = _rows(_as_array(hidden_states, "hidden_states"))
    _ndim(x, "hidden_states", 2, "[T, H]")
    w13, bf16_13 = _weight(w13, "w13", weight_dtype)
    w2, bf16_2 = _weight(w2, "w2", weight_dtype)
    if w13_bias is not None:
        w13_bias, _ = _weight(w13_bias, "w13_bias", weight_dtype)
    if w2_bias is not None:
        w2_bias, _ = _weight(w2_bias, "w2_bias", weight_dtype)
    tw = _rows(_as_array(topk_weights, "topk_weights"))
    ids = _i32(_as_array(topk_ids, "topk_ids"), "topk_ids")
    out = _empty_like_framework(x, (x.shape[0], x.shape[1]), "f32")
    _ext.fused_experts(
        x, w13, w2, tw, ids, out, activation, w13_bias, w2_bias,
        bool(apply_router_weight_on_input), compute_dtype, bf16_13 or bf16_2,
        float(swiglu_alpha), float(swiglu_limit),
    )
    return out


def _route(logits: Any, config: dict, e_score_correction_bias: Any = None, token_ids: Any = None,
           hash_table: Any = None) -> Tuple[Any, Any]:
    _ndim(logits, "router_logits", 2, "[T, E]")
    k = config["top_k"]
    T = logits.shape[0]
    ids = _empty_like_framework(logits, (T, k), "i32")
    weights = _empty_like_framework(logits, (T, k), "f32")
    if e_score_correction_bias is not None:
        e_score_correction_bias = _f32_logits(
            _as_array(e_score_correction_bias, "e_score_correction_bias"),
            "e_score_correction_bias")
    if token_ids is not None:
        token_ids = _i32(_as_array(token_ids, "token_ids"), "token_ids")
    if hash_table is not None:
        hash_table = _contiguous(_i32(_as_array(hash_table, "hash_table"), "hash_table"))
    _ext.select_experts(logits, ids, weights, config, e_score_correction_bias, token_ids,
                        hash_table)
    return weights, ids


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
    is only checked for its token count (may be None). scoring_func:
    "softmax", "sigmoid" or "sqrtsoftplus". Returns (topk_weights f32 [T, k],
    topk_ids int32 [T, k])."""
    if _use_torch_ops(gating_output):
        return _torch.ops.fusedmoe.fused_topk(gating_output, topk, renormalize, scoring_func)
    return _fused_topk_impl(hidden_states, gating_output, topk, renormalize, scoring_func)


def _fused_topk_impl(hidden_states, gating_output, topk, renormalize, scoring_func):
    logits = _f32_logits(_as_array(gating_output, "gating_output"), "gating_output")
    _ndim(logits, "gating_output", 2, "[T, E]")
    if hidden_states is not None and hidden_states.shape[0] != logits.shape[0]:
        raise ValueError(
            f"hidden_states: expected {logits.shape[0]} tokens (rows of gating_output), "
            f"got shape {tuple(hidden_states.shape)}")
    config = {
        "num_experts": int(logits.shape[1]), "top_k": int(topk), "hidden_size": 1,
        "intermediate_size": 1, "routing_method": "topk", "scoring_func": scoring_func,
        "renormalize": bool(renormalize),
    }
    return _route(logits, config)


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
    if _use_torch_ops(gating_output):
        return _torch.ops.fusedmoe.grouped_topk(
            gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
            e_score_correction_bias, routed_scaling_factor, group_score)
    return _grouped_topk_impl(gating_output, topk, renormalize, num_expert_group, topk_group,
                              scoring_func, e_score_correction_bias, routed_scaling_factor,
                              group_score)


def _grouped_topk_impl(gating_output, topk, renormalize, num_expert_group, topk_group,
                       scoring_func, e_score_correction_bias, routed_scaling_factor, group_score):
    logits = _f32_logits(_as_array(gating_output, "gating_output"), "gating_output")
    _ndim(logits, "gating_output", 2, "[T, E]")
    has_bias = e_score_correction_bias is not None
    config = {
        "num_experts": int(logits.shape[1]), "top_k": int(topk), "hidden_size": 1,
        "intermediate_size": 1, "routing_method": "grouped_topk", "scoring_func": scoring_func,
        "renormalize": bool(renormalize), "num_expert_group": int(num_expert_group),
        "topk_group": int(topk_group), "e_score_correction_bias": has_bias,
        "routed_scaling_factor": float(routed_scaling_factor),
        "group_score": group_score or ("sum_top2" if has_bias else "max"),
    }
    return _route(logits, config, e_score_correction_bias)


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
    Returns (topk_weights f32 [T, k], topk_ids int32 [T, k]; id -1 = zero expert)."""
    if isinstance(config, MoELayer):
        config = config.config
    cfg = dict(config or {})
    cfg.update(fields)
    if top_k is not None:
        cfg["top_k"] = int(top_k)
    if "top_k" not in cfg:
        raise ValueError("top_k: required (as an argument or in config)")
    logits = _f32_logits(_as_array(router_logits, "router_logits"), "router_logits")
    _ndim(logits, "router_logits", 2, "[T, E + num_zero_experts]")
    cfg.setdefault("num_experts", int(logits.shape[1]) - int(cfg.get("num_zero_experts", 0)))
    cfg.setdefault("hidden_size", 1)
    cfg.setdefault("intermediate_size", 1)
    if e_score_correction_bias is not None:
        cfg.setdefault("e_score_correction_bias", True)
    return _route(logits, cfg, e_score_correction_bias, token_ids, hash_table)


def inspect(path: "os.PathLike[str] | str") -> dict:
    """Describes a HF model directory (or config.json): model type, MoE layers,
    each layer's config and weight bytes — the content of
    ``fusedmoe inspect PATH --json``. A ``.safetensors`` path lists its tensors."""
    return _ext.inspect(os.fspath(path))


# ---- MoELayer ---------------------------------------------------------------------

_layer_ids = itertools.count(1)
_layers: "weakref.WeakValueDictionary[int, MoELayer]" = weakref.WeakValueDictionary()


class MoELayer:
    """One MoE layer (router, routed experts, shared experts) of a HF model.

    >>> layer = fusedmoe.MoELayer.from_pretrained("models/tiny-deepseek-v3", layer=1)
    >>> out = layer(np.random.randn(4, layer.hidden_size).astype(np.float32))
    """

    def __init__(self, impl: "_ext.MoELayer"):
        self._impl = impl
        self._id = next(_layer_ids)
        _layers[self._id] = self

    @classmethod
    def from_pretrained(
        cls,
        model_dir: "os.PathLike[str] | str",
        layer: Optional[int] = None,
        backend: str = "cpu",
        dtype: str = "f32",
        threads: Optional[int] = None,
    ) -> "MoELayer":
        """Loads MoE layer ``layer`` (default: the first MoE layer) of the HF
        checkpoint in ``model_dir`` (config.json + model.safetensors, sharded or
        not; weights memory-mapped, bf16 stays bf16). ``dtype``: compute dtype
        "f32" or "bf16". ``threads``: a private pool of that many threads
        (default: the global pool, see set_num_threads)."""
        _check_backend(backend)
        return cls(_ext.MoELayer.from_pretrained(os.fspath(model_dir), layer, dtype, threads))

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
        return "cpu"

    def __repr__(self) -> str:
        c = self.config
        return (f"MoELayer(source={self._impl.source!r}, layer={self.layer}, "
                f"num_experts={c['num_experts']}, top_k={c['top_k']}, "
                f"hidden_size={c['hidden_size']}, intermediate_size={c['intermediate_size']}, "
                f"weights={self.weights_dtype}, compute_dtype={self.compute_dtype!r})")

    # -- forward
    def __call__(self, hidden_states: Any, router_logits: Any = None, *, token_ids: Any = None,
                 return_routing: bool = False) -> Any:
        """hidden_states f32 [T, H] -> output f32 [T, H]. ``router_logits``
        f32 [T, E + Z]: skip the gate GEMM and route these. ``token_ids``
        int32 [T]: hash routing only. ``return_routing``: return
        (output, topk_ids, topk_weights, router_logits) instead."""
        if return_routing:
            return self.forward_with_routing(hidden_states, router_logits, token_ids=token_ids)
        if token_ids is None and _use_torch_ops(hidden_states):
            return _torch.ops.fusedmoe.moe_layer(hidden_states, self._id, router_logits)
        return self._forward(hidden_states, router_logits, token_ids, False)

    forward = __call__

    def forward_with_routing(self, hidden_states: Any, router_logits: Any = None, *,
                             token_ids: Any = None) -> Tuple[Any, Any, Any, Any]:
        """Returns (output f32 [T, H], topk_ids int32 [T, k], topk_weights f32
        [T, k], router_logits f32 [T, E + Z])."""
        if token_ids is None and _use_torch_ops(hidden_states):
            return _torch.ops.fusedmoe.moe_layer_with_routing(hidden_states, self._id,
                                                              router_logits)
        return self._forward(hidden_states, router_logits, token_ids, True)

    def _forward(self, hidden_states, router_logits, token_ids, routing):
        x = _rows(_as_array(hidden_states, "hidden_states"))
        _ndim(x, "hidden_states", 2, f"[T, {self.hidden_size}]")
        T = x.shape[0]
        if router_logits is not None:
            router_logits = _f32_logits(_as_array(router_logits, "router_logits"),
                                        "router_logits")
        if token_ids is not None:
            token_ids = _i32(_as_array(token_ids, "token_ids"), "token_ids")
        out = _empty_like_framework(x, (T, self.hidden_size), "f32")
        if not routing:
            self._impl.forward(x, out, router_logits, None, None, None, token_ids)
            return out
        logits = _empty_like_framework(x, (T, self.num_router_logits), "f32")
        ids = _empty_like_framework(x, (T, self.top_k), "i32")
        weights = _empty_like_framework(x, (T, self.top_k), "f32")
        self._impl.forward(x, out, router_logits, logits, ids, weights, token_ids)
        return out, ids, weights, logits


def _layer_by_id(layer_id: int) -> MoELayer:
    layer = _layers.get(layer_id)
    if layer is None:
        raise ValueError(f"layer_id: no live fusedmoe.MoELayer with id {layer_id}")
    return layer


# Registers torch.ops.fusedmoe.* (a plain `from . import` would find the
# None below as the package attribute and not import the submodule).
_torch_ops: Any = None
if _torch is not None:
    _torch_ops = importlib.import_module("._torch_ops", __name__)
