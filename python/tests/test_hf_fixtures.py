"""HF transformers conformance through the Python API: every MoE layer of every
fixture in tests/data/hf, at T = 1, 5, 64, matches transformers' float64
output (f32 compute: relative L2 <= 1e-5, bf16: <= 1e-2), and the router's
logits and choices match transformers' (ids compared as sets per token)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fusedmoe
from conftest import ARCHS, HF, read_safetensors, rel_l2

TOL = {"f32": 1e-5, "bf16": 1e-2}


def _cases():
    cases = []
    for arch in ARCHS:
        keys = read_safetensors(HF / arch / "reference.safetensors").keys()
        for key in sorted(keys):
            m = re.fullmatch(r"layers\.(\d+)\.T(\d+)\.output_f64", key)
            if m:
                cases.append((arch, int(m.group(1)), int(m.group(2))))
    return cases


CASES = _cases()
_refs: dict = {}
_layers: dict = {}


def _ref(arch):
    if arch not in _refs:
        _refs[arch] = read_safetensors(HF / arch / "reference.safetensors")
    return _refs[arch]


def _layer(arch, layer, dtype):
    key = (arch, layer, dtype)
    if key not in _layers:
        _layers[key] = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, dtype=dtype)
    return _layers[key]


def test_every_fixture_is_covered():
    assert len(ARCHS) == 7, ARCHS
    assert len({a for a, _, _ in CASES}) == len(ARCHS)
    assert len(CASES) >= 7 * 2 * 3


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("arch,layer,T", CASES)
def test_output_matches_transformers_f64(arch, layer, T, dtype):
    ref = _ref(arch)
    prefix = f"layers.{layer}.T{T}."
    x = ref[prefix + "input"]
    assert x.dtype == np.float32 and x.shape[0] == T
    moe = _layer(arch, layer, dtype)
    out = moe(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == x.shape
    assert np.isfinite(out).all()
    err = rel_l2(out, ref[prefix + "output_f64"])
    assert err <= TOL[dtype], f"{arch} layer {layer} T={T} {dtype}: relative L2 error {err:.3g}"


@pytest.mark.parametrize("arch,layer,T", CASES)
def test_routing_matches_transformers(arch, layer, T):
    ref = _ref(arch)
    prefix = f"layers.{layer}.T{T}."
    moe = _layer(arch, layer, "f32")
    out, ids, weights, logits = moe.forward_with_routing(ref[prefix + "input"])
    k = moe.top_k
    assert ids.shape == (T, k) and ids.dtype == np.int32
    assert weights.shape == (T, k) and weights.dtype == np.float32
    assert logits.shape == (T, moe.num_router_logits) and logits.dtype == np.float32
    assert rel_l2(logits, ref[prefix + "router_logits"]) <= 1e-5
    if prefix + "topk_ids" in ref:
        ref_ids, ref_w = ref[prefix + "topk_ids"], ref[prefix + "topk_weights"]
        for t in range(T):
            assert set(ids[t].tolist()) == set(ref_ids[t].tolist()), f"token {t}"
            order = np.argsort(ids[t])
            ref_order = np.argsort(ref_ids[t])
            np.testing.assert_allclose(weights[t][order], ref_w[t][ref_order], rtol=1e-5,
                                       atol=1e-7)
    else:  # llama4: dense router_scores [T, E], the chosen expert's weight, 0 elsewhere
        scores = ref[prefix + "router_scores"]
        dense = np.zeros_like(scores)
        np.put_along_axis(dense, ids.astype(np.int64), weights, axis=1)
        np.testing.assert_allclose(dense, scores, rtol=1e-5, atol=1e-7)
    # Routing the same logits again (gate GEMM skipped) gives the same output.
    out2 = moe(ref[prefix + "input"], router_logits=logits)
    np.testing.assert_array_equal(out2, out)


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_matches_layer_config(arch):
    info = fusedmoe.inspect(HF / arch)
    assert info["model_type"].startswith(arch)  # llama4: "llama4_text"
    assert info["weights"] is True
    assert info["moe_layers"] == [l["layer"] for l in info["layers"]]
    for entry in info["layers"]:
        moe = _layer(arch, entry["layer"], "f32")
        assert entry["config"] == moe.config
        assert entry["bytes"] > 0 and entry["tensors"] > 0
    # the default layer is the first MoE layer
    assert fusedmoe.MoELayer.from_pretrained(HF / arch).layer == info["moe_layers"][0]


def test_inspect_safetensors_file():
    info = fusedmoe.inspect(HF / "mixtral" / "reference.safetensors")
    names = {t["name"]: t for t in info["tensors"]}
    assert names["layers.0.T5.input"]["dtype"] == "f32"
    assert names["layers.0.T5.input"]["shape"] == [5, 128]
    assert names["layers.0.T5.output_f64"]["dtype"] == "f64"
