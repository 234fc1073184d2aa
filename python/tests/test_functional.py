"""Functional ops against float64 NumPy references on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import fusedmoe
from conftest import (bf16_to_f32, f32_to_bf16, ref_fused_experts, ref_fused_topk,
                      ref_grouped_topk, ref_scores, rel_l2)


def _logits(rng, T, E, scale=2.0):
    return (scale * rng.standard_normal((T, E))).astype(np.float32)


# ---- routing ---------------------------------------------------------------------------

@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 16, 4), (33, 64, 8), (0, 8, 2)])
def test_fused_topk(rng, scoring_func, renormalize, T, E, k):
    logits = _logits(rng, T, E)
    hidden = rng.standard_normal((T, 16)).astype(np.float32)
    w, ids = fusedmoe.fused_topk(hidden, logits, k, renormalize, scoring_func)
    assert isinstance(w, np.ndarray) and w.dtype == np.float32 and w.shape == (T, k)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.shape == (T, k)
    rw, rids = ref_fused_topk(logits, k, renormalize, scoring_func)
    np.testing.assert_array_equal(ids, rids)
    if T:
        assert rel_l2(w, rw) <= 1e-6
    if renormalize and T:
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


def test_fused_topk_accepts_other_float_dtypes_and_strided_logits(rng):
    wide = _logits(rng, 6, 40)
    logits = wide[:, ::2]  # column stride 2: copied
    w, ids = fusedmoe.fused_topk(None, logits.astype(np.float64), 3, True)
    rw, rids = ref_fused_topk(logits, 3, True)
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, rw) <= 1e-6
    w2, ids2 = fusedmoe.fused_topk(None, wide[1:4, :20], 3, False)  # row stride > E: zero copy
    rw2, rids2 = ref_fused_topk(wide[1:4, :20], 3, False)
    np.testing.assert_array_equal(ids2, rids2)
    assert rel_l2(w2, rw2) <= 1e-6


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("T,E,k,groups,topk_group", [(5, 16, 4, 4, 2), (17, 64, 6, 8, 3),
                                                     (1, 32, 8, 8, 4)])
def test_grouped_topk(rng, with_bias, scoring_func, T, E, k, groups, topk_group):
    logits = _logits(rng, T, E)
    bias = (0.5 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
    scale = float(rng.uniform(0.5, 3.0))
    w, ids = fusedmoe.grouped_topk(logits, k, True, groups, topk_group, scoring_func, bias, scale)
    rw, rids = ref_grouped_topk(logits, k, True, groups, topk_group, scoring_func, bias, scale)
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, rw) <= 1e-6
    # explicit group score other than the default
    other = "max" if with_bias else "sum_top2"
    w, ids = fusedmoe.grouped_topk(logits, k, False, groups, topk_group, scoring_func, bias,
                                   group_score=other)
    rw, rids = ref_grouped_topk(logits, k, False, groups, topk_group, scoring_func, bias,
                                group_score=other)
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, rw) <= 1e-6


def test_select_experts_methods(rng):
    T, E, k = 9, 16, 4
    logits = _logits(rng, T, E)
    # plain top-k through a config dict
    w, ids = fusedmoe.select_experts(logits, k, scoring_func="sigmoid", renormalize=True,
                                     routed_scaling_factor=2.5)
    rw, rids = ref_fused_topk(logits, k, True, "sigmoid")
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, 2.5 * rw) <= 1e-6
    # gpt-oss: top-k of the logits, softmax over the k
    w, ids = fusedmoe.select_experts(logits, k, routing_method="topk_softmax")
    rids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, rids)
    sel = np.take_along_axis(logits.astype(np.float64), rids, axis=1)
    assert rel_l2(w, ref_scores(sel, "softmax")) <= 1e-6
    # llama4: top-1 logit, weight sigmoid(logit)
    w, ids = fusedmoe.select_experts(logits, 1, routing_method="llama4",
                                     apply_router_weight_on_input=True)
    np.testing.assert_array_equal(ids[:, 0], logits.argmax(axis=1))
    assert rel_l2(w[:, 0], 1 / (1 + np.exp(-logits.max(axis=1).astype(np.float64)))) <= 1e-6
    # grouped with a bias, from a full config
    bias = rng.standard_normal(E).astype(np.float32)
    cfg = {"routing_method": "grouped_topk", "scoring_func": "sigmoid", "num_expert_group": 4,
           "topk_group": 2, "group_score": "sum_top2", "renormalize": True, "top_k": k}
    w, ids = fusedmoe.select_experts(logits, config=cfg, e_score_correction_bias=bias)
    rw, rids = ref_grouped_topk(logits, k, True, 4, 2, "sigmoid", bias)
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, rw) <= 1e-6
    # grouped without group_score: grouped_topk's default (max without a bias,
    # the top-2 sum with one), as vLLM's grouped_topk scores groups
    for b in (None, bias):
        w, ids = fusedmoe.select_experts(logits, k, routing_method="grouped_topk",
                                         scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                                         renormalize=True, e_score_correction_bias=b)
        gw, gids = fusedmoe.grouped_topk(logits, k, True, 4, 2, "sigmoid", b)
        np.testing.assert_array_equal(ids, gids)
        np.testing.assert_array_equal(w, gw)
    # a bias for a router that reads none: named as the argument
    for method in ("llama4", "topk_softmax"):
        with pytest.raises(ValueError, match=r"^e_score_correction_bias: only used by "
                                             r"routing_method 'topk' and 'grouped_topk', got "
                                             rf"routing_method '{method}'"):
            fusedmoe.select_experts(logits, 1, routing_method=method, e_score_correction_bias=bias)


def test_select_experts_zero_experts_and_hash(rng):
    T, E, Z, k = 12, 8, 2, 3
    logits = _logits(rng, T, E + Z)
    w, ids = fusedmoe.select_experts(logits, k, num_zero_experts=Z)
    rw, rids = ref_fused_topk(logits, k, False)
    np.testing.assert_array_equal(ids, np.where(rids >= E, -1, rids))
    assert rel_l2(w, rw) <= 1e-6
    vocab = 50
    table = np.stack([rng.permutation(E)[:k] for _ in range(vocab)]).astype(np.int32)
    tokens = rng.integers(0, vocab, size=T).astype(np.int64)
    w, ids = fusedmoe.select_experts(logits[:, :E], k, routing_method="hash",
                                     hash_vocab_size=vocab, hash_table=table, token_ids=tokens)
    np.testing.assert_array_equal(ids, table[tokens])
    np.testing.assert_allclose(w, 1.0 / k, rtol=1e-7)


def test_select_experts_with_layer_config(rng):
    from conftest import HF
    layer = fusedmoe.MoELayer.from_pretrained(HF / "qwen3_moe", layer=0)
    logits = _logits(rng, 4, layer.num_experts)
    w, ids = fusedmoe.select_experts(logits, config=layer)
    rw, rids = ref_fused_topk(logits, layer.top_k, layer.config["renormalize"])
    np.testing.assert_array_equal(ids, rids)
    assert rel_l2(w, rw) <= 1e-6


# ---- experts ---------------------------------------------------------------------------

def _experts_case(rng, T, E, H, I, k, bias=False):
    x = rng.standard_normal((T, H)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32).reshape(T, k)
    tw = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    b13 = (0.1 * rng.standard_normal((E, 2 * I))).astype(np.float32) if bias else None
    b2 = (0.1 * rng.standard_normal((E, H))).astype(np.float32) if bias else None
    return x, w13, w2, tw, ids, b13, b2


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_pytorch_tanh", "swiglu_oai"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_fused_experts_f32(rng, activation, T):
    E, H, I, k = 6, 64, 40, 2
    bias = activation == "swiglu_oai"
    x, w13, w2, tw, ids, b13, b2 = _experts_case(rng, T, E, H, I, k, bias)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids, activation, b13, b2)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (T, H)
    ref = ref_fused_experts(x, w13, w2, tw, ids, activation, b13, b2)
    assert rel_l2(out, ref) <= 1e-5


def test_fused_experts_no_expert_slots_int64_ids_and_strided_input(rng):
    T, E, H, I, k = 9, 5, 32, 24, 3
    x, w13, w2, tw, ids, _, _ = _experts_case(rng, T, E, H, I, k)
    ids[::2, 1] = -1  # "no expert" slots contribute nothing
    ids[4, :] = -1  # a token with no expert gets 0
    big = rng.standard_normal((T, H + 7)).astype(np.float32)
    big[:, :H] = x
    out = fusedmoe.fused_experts(big[:, :H], w13, w2, tw, ids.astype(np.int64))
    ref = ref_fused_experts(x, w13, w2, tw, ids)
    assert rel_l2(out, ref) <= 1e-5
    assert np.all(out[4] == 0)
    # a non-contiguous weight (transposed copy) is made contiguous
    w2_t = np.ascontiguousarray(np.swapaxes(w2, 1, 2))
    out2 = fusedmoe.fused_experts(x, w13, np.swapaxes(w2_t, 1, 2), tw, ids)
    np.testing.assert_array_equal(out2, out)


def test_fused_experts_router_weight_on_input(rng):
    T, E, H, I = 6, 4, 32, 16
    x, w13, w2, tw, ids, _, _ = _experts_case(rng, T, E, H, I, 1)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids, apply_router_weight_on_input=True)
    ref = ref_fused_experts(x, w13, w2, tw, ids, apply_router_weight_on_input=True)
    assert rel_l2(out, ref) <= 1e-5


@pytest.mark.parametrize("compute_dtype", ["f32", "bf16"])
def test_fused_experts_bf16_weights_uint16(rng, compute_dtype):
    T, E, H, I, k = 11, 8, 64, 48, 2
    x, w13, w2, tw, ids, _, _ = _experts_case(rng, T, E, H, I, k)
    w13_b, w2_b = f32_to_bf16(w13), f32_to_bf16(w2)
    out = fusedmoe.fused_experts(x, w13_b, w2_b, tw, ids, compute_dtype=compute_dtype,
                                 weight_dtype="bf16")
    ref = ref_fused_experts(x, bf16_to_f32(w13_b), bf16_to_f32(w2_b), tw, ids)
    assert rel_l2(out, ref) <= (1e-5 if compute_dtype == "f32" else 1e-2)


def test_fused_experts_bf16_weights_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    T, E, H, I, k = 4, 4, 32, 16, 2
    x, w13, w2, tw, ids, _, _ = _experts_case(rng, T, E, H, I, k)
    w13_b, w2_b = w13.astype(ml_dtypes.bfloat16), w2.astype(ml_dtypes.bfloat16)
    out = fusedmoe.fused_experts(x, w13_b, w2_b, tw, ids)
    ref = ref_fused_experts(x, w13_b.astype(np.float32), w2_b.astype(np.float32), tw, ids)
    assert rel_l2(out, ref) <= 1e-5


def test_fused_experts_bias_dtype_independent_of_weight_dtype(rng):
    # README: biases f32 or bf16, whatever the weights' type (bf16 converted exactly).
    T, E, H, I, k = 5, 4, 32, 16, 2
    x, w13, w2, tw, ids, b13, b2 = _experts_case(rng, T, E, H, I, k, bias=True)
    b13_b, b2_b = f32_to_bf16(b13), f32_to_bf16(b2)  # uint16 bit patterns
    ref = ref_fused_experts(x, w13, w2, tw, ids, "silu", bf16_to_f32(b13_b), bf16_to_f32(b2_b))
    w13_b, w2_b = f32_to_bf16(w13), f32_to_bf16(w2)
    ref_b = ref_fused_experts(x, bf16_to_f32(w13_b), bf16_to_f32(w2_b), tw, ids, "silu", b13, b2)
    # uint16 weights with weight_dtype="bf16" and f32 biases
    out = fusedmoe.fused_experts(x, w13_b, w2_b, tw, ids, "silu", b13, b2, weight_dtype="bf16")
    assert rel_l2(out, ref_b) <= 1e-5
    # uint16 weights and biases, all bf16 bit patterns
    out = fusedmoe.fused_experts(x, w13_b, w2_b, tw, ids, "silu", b13_b, b2_b,
                                 weight_dtype="bf16")
    assert rel_l2(out, ref_fused_experts(x, bf16_to_f32(w13_b), bf16_to_f32(w2_b), tw, ids,
                                         "silu", bf16_to_f32(b13_b), bf16_to_f32(b2_b))) <= 1e-5
    ml_dtypes = pytest.importorskip("ml_dtypes")
    # f32 weights, ml_dtypes.bfloat16 biases: not mistaken for uint16
    b13_m = bf16_to_f32(b13_b).astype(ml_dtypes.bfloat16)
    b2_m = bf16_to_f32(b2_b).astype(ml_dtypes.bfloat16)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids, "silu", b13_m, b2_m)
    assert rel_l2(out, ref) <= 1e-5
    # bf16 (ml_dtypes) weights with f32 and bf16 biases
    w13_m, w2_m = w13.astype(ml_dtypes.bfloat16), w2.astype(ml_dtypes.bfloat16)
    out = fusedmoe.fused_experts(x, w13_m, w2_m, tw, ids, "silu", b13, b2)
    assert rel_l2(out, ref_b) <= 1e-5
    out = fusedmoe.fused_experts(x, w13_m, w2_m, tw, ids, "silu", b13_m, b2)
    assert out.shape == (T, H) and np.all(np.isfinite(out))
    # a float16 bias: named with the dtype given
    with pytest.raises(TypeError, match="^w13_bias: expected dtype float32 or bfloat16, got "
                                        "float16$"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, "silu", b13.astype(np.float16), b2)
    # a uint16 bias without weight_dtype: the type is uint16, and the hint is there
    with pytest.raises(TypeError, match='^w2_bias: expected dtype float32 or bfloat16, got '
                                        'uint16 \\(pass weight_dtype="bf16"'):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, "silu", b13, b2_b)


def test_layer_outputs_are_numpy_and_deterministic(rng):
    from conftest import HF
    layer = fusedmoe.MoELayer.from_pretrained(HF / "deepseek_v3", layer=1, threads=1)
    assert layer.threads == 1 and layer.backend == "cpu" and layer.weights_dtype == "bf16"
    x = rng.standard_normal((13, layer.hidden_size)).astype(np.float32)
    a = layer(x)
    b = layer(x[:7])
    np.testing.assert_array_equal(a[:7], b)  # batch invariant
    assert layer(x[:0]).shape == (0, layer.hidden_size)
    assert "deepseek_v3" in repr(layer)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="skipped: no os.fork here")
@pytest.mark.parametrize("threads", [None, 2])  # the global pool, a private one
def test_layer_calls_in_a_forked_child(threads, rng):
    """A layer used before fork() works in the child (multiprocessing's fork
    start method): its thread pool starts new workers there instead of waiting
    for the parent's, which the child does not have."""
    import os
    import signal
    import warnings

    from conftest import HF

    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0, threads=threads)
    x = rng.standard_normal((16, layer.hidden_size)).astype(np.float32)
    want = layer(x)
    with warnings.catch_warnings():  # Python 3.12: fork() of a multi-threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: 20 s, then SIGALRM
        signal.alarm(20)
        try:
            os._exit(0 if np.array_equal(layer(x), want) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung or died (signal {os.WTERMSIG(status)})"
    assert os.WEXITSTATUS(status) == 0, "the child's output differs from the parent's"


def test_sqrtsoftplus_infinite_logit_takes_the_limit(rng):
    """A +inf logit under a renormalized sqrtsoftplus: all the weight on it
    (two: half each), never NaN; not renormalized its weight is +inf."""
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    logits[0, 2] = np.inf
    logits[1, 4] = logits[1, 6] = np.inf
    w, ids = fusedmoe.fused_topk(None, logits, 2, True, scoring_func="sqrtsoftplus")
    np.testing.assert_array_equal(ids[0, 0], 2)
    np.testing.assert_array_equal(w[0], [1.0, 0.0])
    np.testing.assert_array_equal(np.sort(ids[1]), [4, 6])
    np.testing.assert_array_equal(w[1], [0.5, 0.5])
    assert np.isfinite(w).all()
    w, _ = fusedmoe.fused_topk(None, logits, 2, False, scoring_func="sqrtsoftplus")
    assert w[0, 0] == np.inf
