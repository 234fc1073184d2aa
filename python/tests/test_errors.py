"""Bad inputs raise the right exception type, with a message naming the argument."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fusedmoe
from conftest import HF, REPO


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng()
    T, E, H, I, k = 3, 4, 16, 8, 2
    return dict(
        x=rng.standard_normal((T, H)).astype(np.float32),
        w13=rng.standard_normal((E, 2 * I, H)).astype(np.float32),
        w2=rng.standard_normal((E, H, I)).astype(np.float32),
        tw=np.full((T, k), 0.5, dtype=np.float32),
        ids=np.array([[0, 1], [2, 3], [1, 0]], dtype=np.int32),
    )


@pytest.fixture(scope="module")
def layer():
    return fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)


def _fe(case, **over):
    a = dict(case)
    a.update(over)
    return fusedmoe.fused_experts(a["x"], a["w13"], a["w2"], a["tw"], a["ids"],
                                  **{k: v for k, v in over.items()
                                     if k not in ("x", "w13", "w2", "tw", "ids")})


def test_fused_experts_dtype_errors(case):
    with pytest.raises(TypeError, match="hidden_states"):
        _fe(case, x=case["x"].astype(np.float64))
    with pytest.raises(TypeError, match="topk_weights"):
        _fe(case, tw=case["tw"].astype(np.float16))
    with pytest.raises(TypeError, match="topk_ids"):
        _fe(case, ids=case["ids"].astype(np.float32))
    with pytest.raises(TypeError, match="w13"):
        _fe(case, w13=case["w13"].astype(np.float64))
    with pytest.raises(TypeError, match='w13.*weight_dtype="bf16"'):
        _fe(case, w13=case["w13"].view(np.uint16)[..., ::2].copy())
    with pytest.raises(TypeError, match="w2"):
        _fe(case, w2=case["w2"].astype(np.float16))


def test_fused_experts_w13_w2_dtype_mismatch_is_a_type_error(case):
    """bf16 w13 with f32 w2 (torch tensors reach this; NumPy bf16 bit patterns
    take both weights as bf16, so the extension is called directly): TypeError
    naming w2, the expected dtype and the one given (it was a ValueError)."""
    from fusedmoe import _ext
    w13 = (case["w13"].view(np.uint32) >> 16).astype(np.uint16)  # bf16 bit patterns
    out = np.empty_like(case["x"])
    for a, b, want, got in ((w13, case["w2"], "bf16", "f32"),
                            (case["w13"], (case["w2"].view(np.uint32) >> 16).astype(np.uint16),
                             "f32", "bf16")):
        with pytest.raises(TypeError, match=rf"w2: expected the dtype of w13 \({want}\), "
                                            rf"got {got} \["):
            _ext.fused_experts(case["x"], a, b, case["tw"], case["ids"], out, "silu", None,
                               None, False, "f32", True, 1.702, 7.0)


def test_fused_experts_shape_and_value_errors(case):
    with pytest.raises(ValueError, match="hidden_states"):
        _fe(case, x=case["x"][:, :-1])
    with pytest.raises(ValueError, match="hidden_states"):
        _fe(case, x=case["x"][0])
    with pytest.raises(ValueError, match="w2"):
        _fe(case, w2=case["w2"][:, :, :-1].copy())
    with pytest.raises(ValueError, match="w13"):
        _fe(case, w13=case["w13"][0])
    with pytest.raises(ValueError, match="topk_weights"):
        _fe(case, tw=case["tw"][:, :1].copy())
    with pytest.raises(ValueError, match="topk_ids"):
        _fe(case, ids=case["ids"][:2].copy())
    with pytest.raises(ValueError, match="topk_ids"):
        _fe(case, ids=np.array([[0, 1], [2, 4], [1, 0]], dtype=np.int32))  # E = 4
    with pytest.raises(ValueError, match="activation"):
        _fe(case, activation="relu")
    with pytest.raises(ValueError, match="compute_dtype"):
        _fe(case, compute_dtype="f16")
    with pytest.raises(ValueError, match="w13_bias"):
        _fe(case, w13_bias=np.zeros((4, 16), np.float32))  # w2_bias missing
    with pytest.raises(ValueError, match="weight_dtype"):
        _fe(case, weight_dtype="fp8")


def test_topk_ids_and_weights_of_different_k_name_both(case):
    """topk_ids [3, 1] with topk_weights [3, 2]: the error blamed topk_weights
    ("expected f32 [3, 1]") though topk_ids may be the odd one; both are named."""
    with pytest.raises(ValueError, match=r"^topk_ids \[3, 1\] and topk_weights \[3, 2\] "
                                         r"disagree: expected the same \[T, top_k\]"):
        _fe(case, ids=case["ids"][:, :1].copy())
    with pytest.raises(ValueError, match=r"^topk_ids \[3, 2\] and topk_weights \[3, 1\] "
                                         r"disagree"):
        _fe(case, tw=case["tw"][:, :1].copy())


def test_w13_shape_error_expects_what_w2_implies(case):
    """A w13 that cannot be [E, 2I, H] (an odd middle size) is named with the
    shape w2 [E, H, I] implies: [4, 16, 16] (it said [4, 14, 16], from w13's
    own 15 rows). Where w13 and w2 disagree otherwise, both are named."""
    E, I2, H = case["w13"].shape
    with pytest.raises(ValueError, match=r"^w13: expected f32 \[4, 16, 16\], got f32 \[4, 15, 16\]"):
        _fe(case, w13=case["w13"][:, :-1].copy())
    with pytest.raises(ValueError, match=r"^w13 f32 \[4, 18, 16\] and w2 f32 \[4, 16, 8\] disagree"):
        _fe(case, w13=np.zeros((E, I2 + 2, H), np.float32))


def test_weight_shape_errors_name_the_arguments(case):
    """Shape mismatches of w13, w2 and their biases name the arguments as
    given, with the expected and actual shapes (they said experts.w13,
    experts.w2: the kernel's names)."""
    E, I2, H = case["w13"].shape
    I = I2 // 2
    with pytest.raises(ValueError, match=rf"^w13: expected f32 \[{E}, {I2}, {H}\], got f32 "
                                         rf"\[{E}, {I2}, {H // 2}\]"):
        _fe(case, w13=case["w13"][:, :, :H // 2].copy())
    with pytest.raises(ValueError, match=rf"^w2: expected f32 \[{E}, {H}, {I}\], got f32 "
                                         rf"\[{E}, {H // 2}, {I}\]"):
        _fe(case, w2=case["w2"][:, :H // 2].copy())
    with pytest.raises(ValueError, match=rf"^w13 f32 \[{E}, {I2}, {H}\] and w2 f32 "
                                         rf"\[{E - 1}, {H}, {I}\] disagree"):
        _fe(case, w2=case["w2"][:-1].copy())
    b13, b2 = np.zeros((E, I2), np.float32), np.zeros((E, H), np.float32)
    with pytest.raises(ValueError, match=rf"^w13_bias: expected f32 \[{E}, {I2}\], got f32 "
                                         rf"\[{E}, 3\]"):
        _fe(case, w13_bias=np.zeros((E, 3), np.float32), w2_bias=b2)
    with pytest.raises(ValueError, match=rf"^w2_bias: expected f32 \[{E}, {H}\], got f32 "
                                         rf"\[{E}, 3\]"):
        _fe(case, w13_bias=b13, w2_bias=np.zeros((E, 3), np.float32))


def test_router_weight_on_input_takes_top_1_only(case):
    """vLLM and HF apply the router weight to the expert input with one expert
    per token only; with k = 2 it was taken (each input scaled, the outputs
    summed unweighted)."""
    with pytest.raises(ValueError, match=r"^apply_router_weight_on_input: supported with top_k = 1 "
                                         r"only .*got top_k = 2"):
        _fe(case, apply_router_weight_on_input=True)
    out = _fe(case, tw=case["tw"][:, :1].copy(), ids=case["ids"][:, :1].copy(),
              apply_router_weight_on_input=True)
    assert out.shape == case["x"].shape


def test_routing_errors():
    logits = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="^topk: "):
        fusedmoe.fused_topk(None, logits, 9, True)
    with pytest.raises(ValueError, match="scoring_func"):
        fusedmoe.fused_topk(None, logits, 2, True, "relu")
    with pytest.raises(ValueError, match="hidden_states"):
        fusedmoe.fused_topk(np.zeros((3, 4), np.float32), logits, 2, True)
    with pytest.raises(ValueError, match="gating_output"):
        fusedmoe.fused_topk(None, logits[0], 2, True)
    with pytest.raises(TypeError, match="gating_output"):
        fusedmoe.fused_topk(None, logits.astype(np.int32), 2, True)
    bad = logits.copy()
    bad[2, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fusedmoe.fused_topk(None, bad, 2, True)
    with pytest.raises(ValueError, match="num_expert_group"):
        fusedmoe.grouped_topk(logits, 2, True, 3, 1)  # 8 % 3 != 0
    with pytest.raises(ValueError, match="topk_group"):
        fusedmoe.grouped_topk(logits, 2, True, 4, 5)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        fusedmoe.grouped_topk(logits, 2, True, 4, 2, "sigmoid", np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="routed_scaling_factor: expected a finite number"):
        fusedmoe.grouped_topk(logits, 2, True, 4, 2, routed_scaling_factor=float("nan"))
    # beyond f32: the value passed, not the inf it converts to
    with pytest.raises(ValueError, match=r"routed_scaling_factor: expected a number within the "
                                         r"f32 range \(\|x\| <= 3\.40282e\+38\), got 1e\+39, "
                                         r"beyond the f32 range"):
        fusedmoe.grouped_topk(logits, 2, True, 4, 2, routed_scaling_factor=1e39)
    with pytest.raises(ValueError, match=r"config\.routed_scaling_factor: .* got -1e\+39"):
        fusedmoe.select_experts(logits, config={"routing_method": "grouped_topk",
                                                "num_expert_group": 4, "topk_group": 2,
                                                "top_k": 2, "routed_scaling_factor": -1e39})
    # A keyword argument that is no config field is named as the argument, with
    # the fields listed (it read "config: unknown field", no config given).
    with pytest.raises(ValueError, match=r"^no_such_field: unknown keyword argument, not a "
                                         r"config field \(the fields: num_experts, top_k, .*renormalize"):
        fusedmoe.select_experts(logits, 2, no_such_field=1)
    with pytest.raises(ValueError, match=r'^config: unknown field "renormalise" \(the fields: '):
        fusedmoe.select_experts(logits, 2, config={"renormalise": True})
    # Whatever the value (an array, NaN) or the name (vLLM's topk, control
    # characters): named before the config is serialised (session 29's trial:
    # the JSON encoder's TypeError, "not valid JSON", or an unmatched name).
    for kw, shown in (({"hash_tabel": np.zeros((3, 2), np.int32)}, "hash_tabel"),
                      ({"foo": float("nan")}, "foo"), ({"renorm\nalize": True}, "'renorm\\nalize'"),
                      ({"topk": 2}, "topk")):
        with pytest.raises(ValueError) as e:
            fusedmoe.select_experts(logits, 2, **kw)
        assert str(e.value).startswith(f"{shown}: unknown keyword argument, not a config field"), e.value
    with pytest.raises(ValueError, match=r"^topk: .*\(did you mean top_k\?\)"):
        fusedmoe.select_experts(logits, topk=2)
    with pytest.raises(ValueError, match=r'^config: unknown field "hash_tabel"'):
        fusedmoe.select_experts(logits, 2, config={"hash_tabel": np.zeros(3)})
    with pytest.raises(TypeError, match=r"^config: keys must be str, got tuple"):
        fusedmoe.select_experts(logits, 2, config={(1, 2): 3})
    # NumPy scalars are the values they hold.
    a = fusedmoe.select_experts(logits, 2, renormalize=np.True_, routed_scaling_factor=np.float32(2.0))
    b = fusedmoe.select_experts(logits, 2, renormalize=True, routed_scaling_factor=2.0)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="routing_method"):
        fusedmoe.select_experts(logits, 2, routing_method="best")
    # ... with a bias too: the unknown method is named, not the bias.
    with pytest.raises(ValueError, match=r"routing_method: expected one of .*got \"best\""):
        fusedmoe.select_experts(logits, 2, routing_method="best",
                                e_score_correction_bias=np.zeros(logits.shape[1], np.float32))
    with pytest.raises(TypeError, match="renormalize"):
        fusedmoe.select_experts(logits, 2, renormalize="yes")
    # fused_topk / grouped_topk: a str flag is not truthy, a str / bool / None scale is not a number
    with pytest.raises(TypeError, match="renormalize: expected a bool"):
        fusedmoe.fused_topk(None, logits, 2, "no")
    for bad in ("2", True, None):
        with pytest.raises(TypeError, match="routed_scaling_factor: expected a float"):
            fusedmoe.grouped_topk(logits, 2, True, 4, 2, routed_scaling_factor=bad)
    with pytest.raises(ValueError, match="top_k"):
        fusedmoe.select_experts(logits)
    with pytest.raises(ValueError, match="hash_table"):
        fusedmoe.select_experts(logits, 2, routing_method="hash", hash_vocab_size=4)


def test_integer_arguments_reject_bool_and_float():
    logits = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="topk: expected an int, got bool"):
        fusedmoe.fused_topk(None, logits, True, True)
    with pytest.raises(TypeError, match="topk"):
        fusedmoe.fused_topk(None, logits, 2.0, True)
    with pytest.raises(TypeError, match="num_expert_group"):
        fusedmoe.grouped_topk(logits, 2, True, True, 1)
    with pytest.raises(TypeError, match="top_k"):
        fusedmoe.select_experts(logits, False)
    assert fusedmoe.fused_topk(None, logits, np.int64(2), True)[1].shape == (4, 2)


def test_big_endian_arrays_are_converted(case):
    logits = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    w, ids = fusedmoe.fused_topk(None, logits.astype(">f4"), 2, True)
    w_ref, ids_ref = fusedmoe.fused_topk(None, logits, 2, True)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_array_equal(w, w_ref)
    be = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in case.items()}
    np.testing.assert_array_equal(
        fusedmoe.fused_experts(be["x"], be["w13"], be["w2"], be["tw"], be["ids"]), _fe(case))


def test_layer_errors(layer):
    H = layer.hidden_size
    with pytest.raises(ValueError, match="hidden_states"):
        layer(np.zeros((2, H + 1), np.float32))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(np.zeros(H, np.float32))
    with pytest.raises(TypeError, match="hidden_states"):
        layer(np.zeros((2, H), np.float64))
    with pytest.raises(ValueError, match="router_logits"):
        layer(np.zeros((2, H), np.float32), router_logits=np.zeros((3, 8), np.float32))


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(OSError):
        fusedmoe.MoELayer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="layer"):
        fusedmoe.MoELayer.from_pretrained(HF / "deepseek_v3", layer=0)  # dense layer
    # Past the model's 3 layers: out of range, not "not an MoE layer".
    with pytest.raises(ValueError, match=r"layer 3: out of range, the model has 3 layers "
                       r"\(0\.\.2\); MoE layers: 1, 2"):
        fusedmoe.MoELayer.from_pretrained(HF / "deepseek_v3", layer=3)
    with pytest.raises(ValueError, match="dtype"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype="f8")
    with pytest.raises(ValueError, match="threads"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", threads=-1)
    with pytest.raises(TypeError, match="threads"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", threads=True)
    # threads=0: the global pool (all cores), as `fusedmoe run --threads 0`
    assert (fusedmoe.MoELayer.from_pretrained(HF / "mixtral", threads=0).threads
            == fusedmoe.get_num_threads())
    with pytest.raises(ValueError, match="num_threads"):
        fusedmoe.set_num_threads(-2)
    if not fusedmoe.cuda_built:
        with pytest.raises(NotImplementedError, match="CUDA backend"):
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cuda")
    elif fusedmoe._ext.cuda_device_count() == 0:
        with pytest.raises(ValueError, match="no CUDA device"):
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="tpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(OSError, match="config.json"):
        fusedmoe.MoELayer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(NotImplementedError, match="bert"):
        fusedmoe.inspect(tmp_path)
    with pytest.raises(OSError):
        fusedmoe.inspect(tmp_path / "nothing")
    # A model whose config.json makes no layer MoE: inspect says it cannot be run,
    # as from_pretrained refuses it (it described "moe_layers": []).
    dense = json.loads((HF / "deepseek_v3" / "config.json").read_text())
    dense["first_k_dense_replace"] = dense["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="has no MoE layer fusedmoe can run"):
        fusedmoe.inspect(tmp_path)
    with pytest.raises(ValueError, match="has no MoE layer"):
        fusedmoe.MoELayer.from_pretrained(tmp_path)


def test_non_finite_inputs_are_named(case):
    x = case["x"].copy()
    x[1, 5] = np.nan
    with pytest.raises(ValueError, match="hidden_states: expected finite values, got NaN at token 1, column 5"):
        _fe(case, x=x)
    tw = case["tw"].copy()
    tw[2, 1] = np.inf
    with pytest.raises(ValueError, match="topk_weights: expected finite values, got Inf at token 2"):
        _fe(case, tw=tw)


def test_topk_ids_outside_int32_are_refused(case):
    with pytest.raises(ValueError, match="topk_ids: values must fit int32"):
        _fe(case, ids=case["ids"].astype(np.int64) + 2**32)
    with pytest.raises(ValueError, match="topk_ids: values must fit int32"):
        _fe(case, ids=np.full(case["ids"].shape, 2**32 - 1, dtype=np.uint32))


def test_topk_is_checked_before_allocation():
    g = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    for bad in (-1, 0, 9, 2**40):
        with pytest.raises(ValueError, match="^topk: expected 1 <= topk <= 8"):
            fusedmoe.fused_topk(None, g, bad, True)


def test_from_pretrained_argument_types():
    with pytest.raises(TypeError, match="layer"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=True)
    with pytest.raises(TypeError, match="layer"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=1.0)
    with pytest.raises(TypeError, match="dtype"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0, dtype=np.float32)
    with pytest.raises(ValueError, match="max_num_tokens"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0, max_num_tokens=-5)


def test_bias_dtype_and_config_type_errors(case):
    E, I2 = case["w13"].shape[:2]
    H = case["w2"].shape[1]
    with pytest.raises(TypeError,
                       match="^w13_bias: expected dtype float32 or bfloat16, got float64$"):
        _fe(case, w13_bias=np.zeros((E, I2)), w2_bias=np.zeros((E, H), np.float32))
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got uint16") as e:
        _fe(case, x=case["x"].view(np.uint16)[:, ::2].copy())
    assert "weight_dtype" not in str(e.value)
    # e_score_correction_bias on the CPU: float32 or bfloat16 (README), not a
    # float64 rounded silently.
    g = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    for dt in (np.float64, np.float16):
        with pytest.raises(TypeError, match="^e_score_correction_bias: expected dtype float32 or "
                                            f"bfloat16 on the CPU, got {np.dtype(dt).name}$"):
            fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid", np.zeros(8, dt))
    bias = np.linspace(-1, 1, 8).astype(np.float32)
    fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid", bias)
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    if ml_dtypes is not None:  # bf16 is converted exactly
        _, ids16 = fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid",
                                         bias.astype(ml_dtypes.bfloat16))
        bias16 = bias.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(
            ids16, fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid", bias16)[1])
    with pytest.raises(TypeError, match="config: expected a dict"):
        fusedmoe.select_experts(np.zeros((3, 8), np.float32), 2, config=5)


def _mixtral_with_nan(folder, name: str, element: int) -> None:
    """The mixtral fixture copied into `folder` with bf16 tensor `name`'s flat
    element `element` set to NaN."""
    import json
    import shutil
    import struct

    for f in ("config.json", "model.safetensors"):
        shutil.copy(HF / "mixtral" / f, folder / f)
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8:8 + n])[name]
    assert entry["dtype"] == "BF16"
    at = 8 + n + entry["data_offsets"][0] + 2 * element
    raw[at:at + 2] = struct.pack("<H", 0x7FC0)  # bf16 NaN
    path.write_bytes(bytes(raw))


def test_from_pretrained_nan_weight_names_check_finite(tmp_path):
    """A NaN weight: the error named the C++ LoadOptions::check_finite; Python's
    from_pretrained takes check_finite=False and names it."""
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    _mixtral_with_nan(tmp_path, name, 3)  # element [0, 3]
    with pytest.raises(OSError) as e:
        fusedmoe.MoELayer.from_pretrained(tmp_path, layer=0)
    msg = str(e.value)
    assert name in msg and "NaN" in msg, msg
    assert "LoadOptions" not in msg, msg
    assert msg.endswith("MoELayer.from_pretrained(..., check_finite=False) skips this check)"), msg
    layer = fusedmoe.MoELayer.from_pretrained(tmp_path, layer=0, check_finite=False)
    assert layer.num_experts == 8
    with pytest.raises(TypeError, match="^check_finite: expected a bool, got int 0$"):
        fusedmoe.MoELayer.from_pretrained(tmp_path, layer=0, check_finite=0)


def test_nan_gate_weight_is_named_not_router_logits(tmp_path):
    """A NaN router (gate) weight loaded with check_finite=False: a call without
    router_logits named "router_logits" (an argument not given); the message
    now says the logits were computed from hidden_states and gate_weight."""
    _mixtral_with_nan(tmp_path, "model.layers.0.block_sparse_moe.gate.weight", 0)  # expert 0
    layer = fusedmoe.MoELayer.from_pretrained(tmp_path, layer=0, check_finite=False)
    x = np.ones((2, layer.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"^the router logits computed from hidden_states and "
                                         r"gate_weight \(no router_logits given\): expected no "
                                         r"NaN, got NaN at token 0, expert 0"):
        layer(x)
    # Logits given: still named as the argument.
    g = np.zeros((2, layer.num_router_logits), np.float32)
    g[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"^router_logits: expected no NaN, got NaN at token 1"):
        layer(x, g)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_fused_experts_out_of_memory_names_the_buffer_and_its_bytes():
    """Out of memory inside fused_experts (CPU) was a bare "MemoryError: std::bad_alloc";
    the MemoryError names what was allocated and how many bytes now. A child process
    caps its address space (RLIMIT_AS) at 128 MiB above what it uses, so the 256 MiB
    of routed rows fail to allocate at once, whatever the machine's memory and
    overcommit setting, and nothing is touched."""
    code = textwrap.dedent("""
        import resource, numpy as np, fusedmoe
        T, H, E, I, k = 1 << 15, 256, 8, 64, 8
        x = np.ones((T, H), np.float32)
        w13 = np.zeros((E, 2 * I, H), np.float32)
        w2 = np.zeros((E, H, I), np.float32)
        ids = np.tile(np.arange(k, dtype=np.int32), (T, 1))
        tw = np.full((T, k), 0.125, np.float32)
        fusedmoe.fused_experts(x[:4], w13, w2, tw[:4], ids[:4])  # the threads started
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (used + (128 << 20), hard))
        try:
            fusedmoe.fused_experts(x, w13, w2, tw, ids)
        except MemoryError as e:
            print(e)
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("out of memory: cannot allocate 268435456 bytes (256 MiB) of "
                                "workspace for the routed rows' hidden states, f32 [M, H] = "
                                "[262144, 256]"), r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo: Linux")
def test_fused_experts_beyond_the_machines_memory_fails_at_once():
    """Routed rows whose workspace is more than the machine's memory and swap
    together: a MemoryError naming hidden_states and the bytes, before anything is
    allocated (the buffers were allocated and filled one by one until the largest
    failed, seconds later, or the OOM killer ended the process). Twice the
    machine's memory of rows of 256 KiB (I = 2^16), from small inputs."""
    swap = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                swap = int(line.split()[1]) * 1024
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") + swap
    H, E, I, k = 1, 8, 1 << 16, 8
    T = 2 * memory // ((8 * H + 4 * I + 4) * k) + 1
    x = np.ones((T, H), np.float32)
    w13 = np.zeros((E, 2 * I, H), np.float32)
    w2 = np.zeros((E, H, I), np.float32)
    ids = np.tile(np.arange(k, dtype=np.int32), (T, 1))
    tw = np.full((T, k), 0.125, np.float32)
    with pytest.raises(MemoryError) as e:
        fusedmoe.fused_experts(x, w13, w2, tw, ids)
    assert str(e.value).startswith(
        f"hidden_states: {T} tokens routed to M = {T * k} expert rows (topk_ids [{T}, {k}]) "
        f"need "), str(e.value)
    assert (f" of workspace (f32 [M, H] twice and [M, I], H = {H}, I = {I}), with the "
            f"output's ") in str(e.value)
    assert " (f32 [T, H]) more than the machine's " in str(e.value)
    assert str(e.value).endswith(" of memory and swap; pass fewer tokens a call")


def _memory_and_swap():
    swap = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                swap = int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") + swap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo: Linux")
def test_broadcast_inputs_beyond_the_machines_memory_name_the_argument(case, layer):
    """A broadcast view (numpy.broadcast_to, stride 0) of T rows beyond the
    machine's memory holds one row: its contiguous copy, or the outputs the
    call allocates for its T rows, raised NumPy's MemoryError ("Unable to
    allocate ...", naming no argument) before any check. Now the bytes are
    checked first: a MemoryError naming the argument, as the CPU experts'
    own check names hidden_states. Nothing is allocated."""
    memory = _memory_and_swap()
    tail = " of memory and swap; pass fewer tokens a call"
    H = case["x"].shape[1]
    T = 2 * memory // (4 * H) + 1  # the output f32 [T, H] alone: twice the memory
    tw = np.broadcast_to(case["tw"][0], (T, case["tw"].shape[1]))
    ids = np.broadcast_to(case["ids"][0], (T, case["ids"].shape[1]))
    row = np.broadcast_to(case["x"][0], (T, H))  # strides (0, 4): no copy
    one = np.broadcast_to(np.float32(1), (T, H))  # strides (0, 0): a contiguous copy
    with pytest.raises(MemoryError, match=rf"^hidden_states: {T} tokens \(the output f32 "
                                          rf"\[{T}, {H}\]\) need {T * H * 4} bytes \("):
        fusedmoe.fused_experts(row, case["w13"], case["w2"], tw, ids)
    with pytest.raises(MemoryError, match=rf"^hidden_states: {T} tokens \(a contiguous copy of "
                                          rf"hidden_states, float32 \[{T}, {H}\], the output f32 "
                                          rf"\[{T}, {H}\]\) need {T * H * 8} bytes") as e:
        fusedmoe.fused_experts(one, case["w13"], case["w2"], tw, ids)
    assert str(e.value).endswith(tail), str(e.value)
    H = layer.hidden_size
    T = 2 * memory // (4 * H) + 1
    for routing in (False, True):
        with pytest.raises(MemoryError, match=rf"^hidden_states: {T} tokens \(the output f32 "
                                              rf"\[{T}, {H}\]") as e:
            layer(np.broadcast_to(np.ones(H, np.float32), (T, H)), return_routing=routing)
        assert str(e.value).endswith(tail), str(e.value)
    # Router logits: their float32 conversion, and the topk outputs.
    E = 8
    T = memory // (4 * E) + 1
    with pytest.raises(MemoryError, match=rf"^router_logits: {T} tokens \(router_logits converted "
                                          rf"to float32 \[{T}, {E}\]\) need {T * E * 4} bytes"):
        fusedmoe.select_experts(np.broadcast_to(np.zeros(E, np.float16), (T, E)), 2)
    T = memory // (8 * 2) + 1
    with pytest.raises(MemoryError, match=rf"^gating_output: {T} tokens \(topk_ids and "
                                          rf"topk_weights \[{T}, 2\]\) need {T * 16} bytes"):
        fusedmoe.fused_topk(None, np.broadcast_to(np.zeros(E, np.float32), (T, E)), 2, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo: Linux")
def test_broadcast_weights_beyond_the_machines_memory_name_the_argument():
    """A broadcast view of one expert's w13 or w2 for more experts than the
    machine's memory holds: its contiguous copy raised NumPy's MemoryError,
    naming no argument (session 19's trial). Now a MemoryError naming the
    weight and the bytes, before the copy. torch tensors the same way."""
    E = _memory_and_swap() // (64 * 128 * 4) + 1
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    one13 = rng.standard_normal((1, 128, 128)).astype(np.float32)
    one2 = rng.standard_normal((1, 128, 64)).astype(np.float32)
    ids = np.zeros((3, 1), np.int32)
    tw = np.ones((3, 1), np.float32)
    tail = (" of memory and swap; pass the weights contiguous (a broadcast or strided view is "
            "copied first)")
    w13, w2 = np.broadcast_to(one13, (E, 128, 128)), np.broadcast_to(one2, (E, 128, 64))
    # Beside a w2 of one expert, w13's E is wrong: named as such, before its copy.
    with pytest.raises(ValueError, match=re.escape(
            "w13: expected [E, 2I, H] = [1, 128, 128] (H from hidden_states, E and I from w2 "
            f"[1, 128, 64]), got float32 [{E}, 128, 128]")):
        fusedmoe.fused_experts(x, w13, np.ascontiguousarray(one2), tw, ids)
    # ... and beside a w13 of one expert, w2's (the three shapes given, before the copy).
    with pytest.raises(ValueError, match=re.escape(
            "hidden_states [T, H], w13 [E, 2I, H] and w2 [E, H, I] disagree: got hidden_states "
            f"[3, 128], w13 [1, 128, 128], w2 [{E}, 128, 64]")):
        fusedmoe.fused_experts(x, np.ascontiguousarray(one13), w2, tw, ids)
    # Two copies that fit one at a time but not together: named together.
    E2 = _memory_and_swap() // (128 * 128 * 4 + 128 * 64 * 4) + 1
    with pytest.raises(MemoryError) as e:
        fusedmoe.fused_experts(x, np.broadcast_to(one13, (E2, 128, 128)),
                               np.broadcast_to(one2, (E2, 128, 64)), tw, ids)
    assert str(e.value).startswith(
        f"w13: a contiguous copy of w13, float32 [{E2}, 128, 128] and a contiguous copy of w2, "
        f"float32 [{E2}, 128, 64], need "), str(e.value)
    assert str(e.value).endswith(tail), str(e.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo: Linux")
def test_expanded_torch_weights_beyond_the_machines_memory_name_the_argument():
    """The same with torch's expand (stride 0): MemoryError naming w13."""
    torch = pytest.importorskip("torch")
    E = _memory_and_swap() // (64 * 128 * 4) + 1
    x = torch.randn(3, 128)
    w13 = torch.randn(1, 128, 128).expand(E, 128, 128)
    w2 = torch.randn(1, 128, 64).expand(E, 128, 64)  # the same E: the shapes agree
    with pytest.raises(MemoryError) as e:
        fusedmoe.fused_experts(x, w13, w2, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32))
    assert str(e.value).startswith(f"w13: a contiguous copy of w13, float32 [{E}, 128, 128] "
                                   f"and a contiguous copy of w2, float32 [{E}, 128, 64], "
                                   f"need "), str(e.value)


@pytest.mark.parametrize("var,value,message", [
    ("FUSEDMOE_CPU_ISA", "bogus",
     "FUSEDMOE_CPU_ISA: expected one of auto, avx512, avx2, scalar, got 'bogus'"),
    ("FUSEDMOE_CPU_AMX", "yes", "FUSEDMOE_CPU_AMX: expected 0, 1 or auto, got 'yes'"),
    ("FUSEDMOE_CUDA_SM90_CONTIG", "maybe",
     "FUSEDMOE_CUDA_SM90_CONTIG: expected on or off, got 'maybe'"),
    ("FUSEDMOE_CUDA_PDL", "7", "FUSEDMOE_CUDA_PDL: expected 0 or 1, got '7'"),
])
def test_bad_cpu_gemm_environment_fails_when_the_layer_is_made(var, value, message):
    """A bad FUSEDMOE_CPU_ISA / FUSEDMOE_CPU_AMX raised only at the first call,
    after from_pretrained had succeeded (trial); now when the layer is made. The
    CUDA switches too, on the CPU backend (they passed unnoticed there)."""
    code = textwrap.dedent(f"""
        import fusedmoe
        try:
            fusedmoe.MoELayer.from_pretrained({str(REPO / "models" / "tiny-deepseek-v3")!r})
        except ValueError as e:
            print(e)
        """)
    env = dict(os.environ, **{var: value})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert message in r.stdout, r.stdout


@pytest.mark.parametrize("value", ["banana", "0", "1"])
def test_no_nccl_preload_environment_is_checked(value):
    """FUSEDMOE_NO_NCCL_PRELOAD took any non-empty value, 0 included, as 1 (trial)."""
    code = "import fusedmoe; print('imported')"
    env = dict(os.environ, FUSEDMOE_NO_NCCL_PRELOAD=value)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    if value == "banana":
        assert r.returncode != 0, r.stdout
        assert "FUSEDMOE_NO_NCCL_PRELOAD: expected 0 or 1, got 'banana'" in r.stderr, r.stderr
        return
    assert r.returncode == 0 and r.stdout.startswith("imported"), r.stderr


@pytest.mark.parametrize("value,expect", [("bogus", "FUSEDMOE_NO_TORCH: expected 0 or 1, got 'bogus'"),
                                          ("0", "imported"), ("1", "imported")])
def test_no_torch_environment_is_checked(value, expect):
    """FUSEDMOE_NO_TORCH took any non-empty value, 0 included, as 1 (trial)."""
    code = "import fusedmoe; print('imported', 'torch' in __import__('sys').modules)"
    env = dict(os.environ, FUSEDMOE_NO_TORCH=value)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    if value == "bogus":
        assert r.returncode != 0 and expect in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(expect), r.stdout
    if value == "1":
        assert r.stdout.strip().endswith("False"), r.stdout  # torch not imported


def test_moe_layer_is_built_by_from_pretrained():
    # A layer comes from from_pretrained; constructing one directly names it.
    with pytest.raises(TypeError, match=r"MoELayer\.from_pretrained\(model_dir, layer=\.\.\.\)"):
        fusedmoe.MoELayer()
    with pytest.raises(TypeError, match=r"from_pretrained.*got str 'mixtral'"):
        fusedmoe.MoELayer("mixtral")
