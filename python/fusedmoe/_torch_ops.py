"""PyTorch custom ops: ``torch.ops.fusedmoe.*``.

Registered with ``torch.library.custom_op`` (outputs allocated by PyTorch,
no input mutated) and a fake implementation each, so that a model calling
them compiles with ``torch.compile(fullgraph=True)``. One implementation
serves every device: CPU tensors run on the CPU backend, CUDA tensors on the
CUDA backend (on torch's current stream, outputs and workspace from PyTorch's
caching allocator, nothing synchronised), so the ops can be captured in a
``torch.cuda.CUDAGraph``. Imported by
``fusedmoe/__init__.py`` when torch is importable; the public functions of
``fusedmoe`` route torch tensors through these ops where it matters (tracing,
modes, tensor subclasses, autograd: ``fusedmoe._needs_op``) and otherwise call
the implementations the ops run directly (no dispatch cost).

Ops:
  fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                w13_bias, w2_bias, apply_router_weight_on_input, compute_dtype,
                swiglu_alpha, swiglu_limit, w13_layout) -> Tensor [T, H] (hidden_states' dtype)
  fused_topk(gating_output, topk, renormalize, scoring_func) -> (f32 [T, k], i32 [T, k])
  grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group,
               scoring_func, e_score_correction_bias, routed_scaling_factor,
               group_score) -> (f32 [T, k], i32 [T, k])
  moe_layer(hidden_states, layer_id, router_logits) -> [T, H] (hidden_states' dtype)
  moe_layer_with_routing(hidden_states, layer_id, router_logits)
      -> ([T, H], i32 [T, k], f32 [T, k], f32 [T, E + Z])
``layer_id`` is ``MoELayer._op_id``, "<n>@<process tag>" (a program exported here and
loaded in another process names no layer there: an error, not another layer's
output), a string, which torch.compile keeps a
constant (guarded: one graph a layer). As an int it became a SymInt once a
compiled function saw a second layer, and the fake implementation could not
look the layer up ("unhashable type: non-nested SymInt").

Inference only: the ops have no backward. Each registers an autograd formula
whose backward raises RuntimeError saying so (instead of torch's generic "no
autograd formula was registered"); outputs of inputs that require grad still
report ``requires_grad=True``, so call the ops under ``torch.no_grad()`` or
``torch.inference_mode()`` (or detach the inputs) when no backward is wanted.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

import fusedmoe as _fm

_LIB = "fusedmoe"


def _check_2d(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-d tensor, got shape {tuple(x.shape)}")


def _check_devices(ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    """Every tensor on ref's device. The fake implementations run for meta
    tensors too: a call mixing real (CPU / CUDA) and meta tensors dispatches
    here and would return an uninitialised output instead of failing."""
    for name, x in others.items():
        if x is not None and x.device.type != ref.device.type:
            raise ValueError(f"{name}: expected a tensor on {ref.device.type} (the device of "
                             f"{ref_name}), got one on {x.device.type}")


@torch.library.custom_op(f"{_LIB}::fused_experts", mutates_args=())
def fused_experts(
    hidden_states: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: str = "silu",
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    apply_router_weight_on_input: bool = False,
    compute_dtype: Optional[str] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    w13_layout: str = "standard",
) -> Tensor:
    out = _fm._fused_experts_fast(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
        apply_router_weight_on_input, compute_dtype, swiglu_alpha, swiglu_limit, w13_layout,
    )
    if out is not None:
        return out
    return _fm._fused_experts_impl(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
        apply_router_weight_on_input, compute_dtype, None, swiglu_alpha, swiglu_limit, w13_layout,
    )


@fused_experts.register_fake
def _(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None,
      w2_bias=None, apply_router_weight_on_input=False, compute_dtype=None,
      swiglu_alpha=1.702, swiglu_limit=7.0, w13_layout="standard"):
    _check_2d(hidden_states, "hidden_states")
    _check_devices("hidden_states", hidden_states, w13=w13, w2=w2, topk_weights=topk_weights,
                   topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    return hidden_states.new_empty(hidden_states.shape)


def _fake_routing(gating_output: Tensor, topk: int) -> Tuple[Tensor, Tensor]:
    _check_2d(gating_output, "gating_output")
    T = gating_output.shape[0]
    return (gating_output.new_empty((T, topk), dtype=torch.float32),
            gating_output.new_empty((T, topk), dtype=torch.int32))


@torch.library.custom_op(f"{_LIB}::fused_topk", mutates_args=())
def fused_topk(gating_output: Tensor, topk: int, renormalize: bool,
               scoring_func: str = "softmax") -> Tuple[Tensor, Tensor]:
    return _fm._fused_topk_impl(None, gating_output, topk, renormalize, scoring_func)


@fused_topk.register_fake
def _(gating_output, topk, renormalize, scoring_func="softmax"):
    return _fake_routing(gating_output, topk)


@torch.library.custom_op(f"{_LIB}::grouped_topk", mutates_args=())
def grouped_topk(
    gating_output: Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[Tensor] = None,
    routed_scaling_factor: float = 1.0,
    group_score: Optional[str] = None,
) -> Tuple[Tensor, Tensor]:
    return _fm._grouped_topk_impl(gating_output, topk, renormalize, num_expert_group,
                                  topk_group, scoring_func, e_score_correction_bias,
                                  routed_scaling_factor, group_score)


@grouped_topk.register_fake
def _(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func="softmax",
      e_score_correction_bias=None, routed_scaling_factor=1.0, group_score=None):
    _check_devices("gating_output", gating_output,
                   e_score_correction_bias=e_score_correction_bias)
    return _fake_routing(gating_output, topk)


@torch.library.custom_op(f"{_LIB}::moe_layer", mutates_args=())
def moe_layer(hidden_states: Tensor, layer_id: str,
              router_logits: Optional[Tensor] = None) -> Tensor:
    return _fm._layer_by_id(layer_id)._forward(hidden_states, router_logits, None, False)


@moe_layer.register_fake
def _(hidden_states, layer_id, router_logits=None):
    layer = _fm._layer_by_id(layer_id)
    _check_2d(hidden_states, "hidden_states")
    _check_devices("hidden_states", hidden_states, router_logits=router_logits)
    return hidden_states.new_empty((hidden_states.shape[0], layer.hidden_size))


@torch.library.custom_op(f"{_LIB}::moe_layer_with_routing", mutates_args=())
def moe_layer_with_routing(hidden_states: Tensor, layer_id: str,
                           router_logits: Optional[Tensor] = None
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    out, ids, weights, logits = _fm._layer_by_id(layer_id)._forward(
        hidden_states, router_logits, None, True)
    return out, ids, weights, logits


@moe_layer_with_routing.register_fake
def _(hidden_states, layer_id, router_logits=None):
    layer = _fm._layer_by_id(layer_id)
    _check_2d(hidden_states, "hidden_states")
    _check_devices("hidden_states", hidden_states, router_logits=router_logits)
    T = hidden_states.shape[0]
    return (hidden_states.new_empty((T, layer.hidden_size)),
            hidden_states.new_empty((T, layer.top_k), dtype=torch.int32),
            hidden_states.new_empty((T, layer.top_k), dtype=torch.float32),
            hidden_states.new_empty((T, layer.num_router_logits), dtype=torch.float32))


# ---- autograd: inference only -------------------------------------------------------


def _no_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"fusedmoe.{name}: the fusedmoe ops are inference-only and have no backward (no "
            f"gradient flows to their inputs); run them under torch.no_grad() or "
            f"torch.inference_mode(), or detach the inputs, and do not call .backward() through "
            f"their outputs")

    return backward


def _no_context(ctx, inputs, output) -> None:
    pass


for _name, _op in (("fused_experts", fused_experts), ("fused_topk", fused_topk),
                   ("grouped_topk", grouped_topk), ("moe_layer", moe_layer),
                   ("moe_layer_with_routing", moe_layer_with_routing)):
    _op.register_autograd(_no_backward(_name), setup_context=_no_context)
