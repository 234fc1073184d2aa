"""What a first-time user runs into: array layouts that must be copied, routing
with a layer's own router parameters, argument checks with a clear message
naming the argument, mixed array libraries, autograd (inference only), and a
clean ``dir(fusedmoe)``. Torch tests are skipped when torch is not installed."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fusedmoe
from conftest import HF, REPO, experts_case

TINY_DSV3 = REPO / "models" / "tiny-deepseek-v3"


def _torch():
    torch = pytest.importorskip("torch")
    if fusedmoe._torch is None:
        pytest.skip("fusedmoe was imported without torch (FUSEDMOE_NO_TORCH)")
    return torch


@pytest.fixture(scope="module")
def mixtral():
    return fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)


@pytest.fixture
def case(rng):
    return experts_case(rng, I=8, w2_scale=3)


# ---- 1. autograd: inference only -------------------------------------------------------


def test_backward_raises_inference_only(mixtral):
    torch = _torch()
    H = mixtral.hidden_size
    x = torch.randn(4, H, requires_grad=True)
    g = torch.randn(4, 8, requires_grad=True)
    w13 = torch.randn(4, 16, H, requires_grad=True)
    w2 = torch.randn(4, H, 8)
    tw, ids = torch.full((4, 2), 0.5), torch.zeros(4, 2, dtype=torch.int32)
    calls = {
        "moe_layer": lambda: mixtral(x),
        "moe_layer_with_routing": lambda: mixtral(x, return_routing=True)[0],
        "fused_experts": lambda: fusedmoe.fused_experts(x, w13, w2, tw, ids),
        "fused_topk": lambda: fusedmoe.fused_topk(None, g, 2, True)[0],
        "grouped_topk": lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2)[0],
    }
    for name, call in calls.items():
        out = call()
        with pytest.raises(RuntimeError, match=f"fusedmoe.{name}: .*inference-only.*no backward"):
            out.sum().backward()
    with torch.no_grad():
        assert not mixtral(x).requires_grad


# ---- 2. negative strides are copied ----------------------------------------------------


def test_negative_strides_are_copied(mixtral, case, rng):
    H = mixtral.hidden_size
    x = rng.standard_normal((8, H)).astype(np.float32)
    np.testing.assert_array_equal(mixtral(x[::-1]), mixtral(x[::-1].copy()))
    np.testing.assert_array_equal(mixtral(x[:, ::-1]), mixtral(x[:, ::-1].copy()))
    logits = rng.standard_normal((8, mixtral.num_router_logits)).astype(np.float32)
    np.testing.assert_array_equal(mixtral(x, router_logits=logits[::-1]),
                                  mixtral(x, router_logits=logits[::-1].copy()))
    c = case
    ref = fusedmoe.fused_experts(c["x"][::-1].copy(), c["w13"][::-1].copy(), c["w2"][::-1].copy(),
                                 c["tw"][::-1].copy(), c["ids"][::-1].copy())
    np.testing.assert_array_equal(
        fusedmoe.fused_experts(c["x"][::-1], c["w13"][::-1], c["w2"][::-1], c["tw"][::-1],
                               c["ids"][::-1]), ref)
    w, ids = fusedmoe.fused_topk(x[::-1], logits[::-1], 2, True)
    w_ref, ids_ref = fusedmoe.fused_topk(None, logits[::-1].copy(), 2, True)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_array_equal(w, w_ref)
    bias = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_array_equal(
        fusedmoe.grouped_topk(logits, 2, True, 4, 2, "sigmoid", bias[::-1])[1],
        fusedmoe.grouped_topk(logits, 2, True, 4, 2, "sigmoid", bias[::-1].copy())[1])


# ---- 3. select_experts with a MoELayer routes as the layer -----------------------------


@pytest.mark.parametrize("model_dir,layer", [(TINY_DSV3, 1), (HF / "deepseek_v3", 1)])
def test_select_experts_with_layer_routes_as_the_layer(model_dir, layer, rng):
    moe = fusedmoe.MoELayer.from_pretrained(model_dir, layer=layer)
    assert moe.config["e_score_correction_bias"]
    x = rng.standard_normal((9, moe.hidden_size)).astype(np.float32)
    _, ids, weights, logits = moe.forward_with_routing(x)
    w2, ids2 = fusedmoe.select_experts(logits, moe.top_k, config=moe)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(w2, weights)
    w3, ids3 = fusedmoe.select_experts(logits, config=moe)  # top_k from the layer
    np.testing.assert_array_equal(ids3, ids)
    np.testing.assert_array_equal(w3, weights)


def test_select_experts_with_layer_refuses_another_top_k(rng):
    """config=layer is the layer's routing: a top_k other than the layer's was
    silently used instead (k columns the layer's experts never see)."""
    moe = fusedmoe.MoELayer.from_pretrained(TINY_DSV3, layer=1)
    logits = rng.standard_normal((3, moe.num_experts)).astype(np.float32)
    k = moe.top_k
    for bad in (k + 1, k - 1):
        with pytest.raises(ValueError, match=rf"^top_k: expected the layer's top_k = {k} "
                                             rf".*got {bad}$"):
            fusedmoe.select_experts(logits, bad, config=moe)
        with pytest.raises(ValueError, match=rf"^top_k: expected the layer's top_k = {k}"):
            fusedmoe.select_experts(logits, top_k=bad, config=moe)
    with pytest.raises(TypeError, match="^top_k"):
        fusedmoe.select_experts(logits, float(k), config=moe)
    # A keyword field other than the layer's: not its routing (use config=layer.config).
    with pytest.raises(ValueError, match="^renormalize: expected the layer's renormalize = "):
        fusedmoe.select_experts(logits, config=moe, renormalize=not moe.config["renormalize"])
    assert fusedmoe.select_experts(logits, config=moe,
                                   renormalize=moe.config["renormalize"])[1].shape == (3, k)
    # A bias given with the layer was silently used instead of the layer's own.
    with pytest.raises(ValueError, match=r"^e_score_correction_bias: expected None, the layer's "
                                         r"own \(config is a MoELayer.*got ndarray \[" +
                                         str(moe.num_experts) + r"\]$"):
        fusedmoe.select_experts(logits, config=moe,
                                e_score_correction_bias=np.zeros(moe.num_experts, np.float32))
    with pytest.raises(ValueError, match=r"^hash_table: expected None, the layer's own"):
        fusedmoe.select_experts(logits, config=moe, hash_table=np.zeros((4, k), np.int32))
    bias = np.zeros(moe.num_experts, np.float32)
    assert fusedmoe.select_experts(logits, config=moe.config, e_score_correction_bias=bias,
                                   renormalize=not moe.config["renormalize"])[1].shape == (3, k)
    # The layer's own k, or a dict config with any k, still route.
    assert fusedmoe.select_experts(logits, k, config=moe)[1].shape == (3, k)
    bias = np.zeros(moe.num_experts, np.float32)
    assert fusedmoe.select_experts(logits, k + 1, config=moe.config,
                                   e_score_correction_bias=bias)[1].shape == (3, k + 1)


def test_select_experts_config_top_k_is_checked_when_replaced(rng):
    """A top_k argument replaces a config dict's (config=layer.config takes
    changes), but the config's value is still type-checked (a str passed)."""
    g = rng.standard_normal((4, 10)).astype(np.float32)
    with pytest.raises(TypeError, match=r"^config.top_k: expected an int, got str"):
        fusedmoe.select_experts(g, 2, config={"top_k": "2"})
    assert fusedmoe.select_experts(g, 2, config={"top_k": 3})[1].shape == (4, 2)


def test_select_experts_hash_routing_as_the_readme_says(rng):
    """Hash routing with the fields the README names: the table's rows by token."""
    g = rng.standard_normal((4, 10)).astype(np.float32)
    table = np.stack([rng.permutation(10)[:2] for _ in range(20)]).astype(np.int32)
    tok = np.array([1, 5, 7, 19], np.int32)
    w, ids = fusedmoe.select_experts(g, 2, token_ids=tok, hash_table=table,
                                     routing_method="hash", hash_vocab_size=20)
    assert ids.tolist() == table[tok].tolist()
    assert np.all(np.isfinite(w))
    # A 0-d token_ids is named by its shape (it was reported as "got none").
    with pytest.raises(ValueError, match=r"^token_ids: expected i32 \[4\], got i32 \[\]$"):
        fusedmoe.select_experts(g, 2, token_ids=np.array(3, np.int32), hash_table=table,
                                routing_method="hash", hash_vocab_size=20)


def test_select_experts_with_layer_torch(rng):
    torch = _torch()
    moe = fusedmoe.MoELayer.from_pretrained(TINY_DSV3, layer=1)
    x = torch.from_numpy(rng.standard_normal((6, moe.hidden_size)).astype(np.float32))
    _, ids, weights, logits = moe.forward_with_routing(x)
    w2, ids2 = fusedmoe.select_experts(logits, config=moe)
    assert isinstance(ids2, torch.Tensor)
    assert torch.equal(ids2, ids) and torch.equal(w2, weights)


# ---- 4. mixed array libraries ----------------------------------------------------------


def test_return_routing_takes_a_bool(mixtral):
    x = np.random.default_rng(0).standard_normal((2, mixtral.hidden_size)).astype(np.float32)
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match="return_routing: expected a bool"):
            mixtral(x, return_routing=bad)
    assert len(mixtral(x, return_routing=np.bool_(True))) == 4
    assert mixtral(x, return_routing=False).shape == (2, mixtral.hidden_size)


def test_layer_mixed_numpy_and_torch_is_a_type_error(mixtral):
    torch = _torch()
    x = torch.randn(2, mixtral.hidden_size)
    logits = np.zeros((2, mixtral.num_router_logits), np.float32)
    msg = "router_logits: expected a torch.Tensor like hidden_states"
    with pytest.raises(TypeError, match=msg):
        mixtral(x, router_logits=logits)
    with pytest.raises(TypeError, match=msg):
        mixtral(x, router_logits=logits, return_routing=True)
    with pytest.raises(TypeError, match=msg):
        mixtral.forward_with_routing(x, router_logits=logits)
    with pytest.raises(TypeError, match="token_ids: expected a torch.Tensor like hidden_states"):
        mixtral(x, token_ids=np.zeros(2, np.int32))
    g = torch.randn(2, 8)
    with pytest.raises(TypeError, match="e_score_correction_bias: expected a torch.Tensor"):
        fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid", np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="hidden_states: expected a torch.Tensor like gating_"):
        fusedmoe.fused_topk(x.numpy(), g, 2, True)
    # NumPy first and a torch tensor after: refused the same way (a NumPy result
    # came back where the first argument was NumPy; session 21's trial).
    gn = g.numpy()
    with pytest.raises(TypeError, match=r"^gating_output: expected a torch.Tensor like "
                                        r"e_score_correction_bias, got ndarray$"):
        fusedmoe.grouped_topk(gn, 2, True, 4, 2, "sigmoid", torch.zeros(8))
    with pytest.raises(TypeError, match=r"^router_logits: expected a torch.Tensor like "
                                        r"e_score_correction_bias"):
        fusedmoe.select_experts(gn, 2, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                                e_score_correction_bias=torch.zeros(8))
    with pytest.raises(TypeError, match=r"^hidden_states: expected a torch.Tensor like "
                                        r"router_logits"):
        mixtral(x.numpy(), router_logits=torch.zeros(2, mixtral.num_router_logits))
    xn, H = x.numpy(), mixtral.hidden_size
    w13, w2 = np.zeros((8, 4, H), np.float32), np.zeros((8, H, 2), np.float32)
    tw, ids = np.ones((2, 1), np.float32), np.zeros((2, 1), np.int32)
    with pytest.raises(TypeError, match=r"^hidden_states: expected a torch.Tensor like w2"):
        fusedmoe.fused_experts(xn, w13, torch.from_numpy(w2), tw, ids)
    with pytest.raises(TypeError, match=r"^hidden_states: expected a torch.Tensor like w13_bias"):
        fusedmoe.fused_experts(xn, w13, w2, tw, ids, w13_bias=torch.zeros(8, 4))


# ---- 5. from_pretrained / inspect argument types -------------------------------------


def test_from_pretrained_checks_arguments_in_python():
    for kw, name in [(dict(layer=2**70), "layer"), (dict(layer=-1), "layer"),
                     (dict(threads=2**40), "threads"), (dict(max_num_tokens=2**70),
                                                        "max_num_tokens")]:
        with pytest.raises(ValueError, match=f"^{name}: expected") as e:
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", **kw)
        assert "incompatible function arguments" not in str(e.value)
    with pytest.raises(TypeError, match="^model_dir: expected a path"):
        fusedmoe.MoELayer.from_pretrained(5)
    with pytest.raises(TypeError, match="^path: expected a path"):
        fusedmoe.inspect(None)
    # MoELayer(path) is not the constructor users call: a TypeError pointing at
    # from_pretrained, not an AttributeError at the first call (trial finding).
    with pytest.raises(TypeError, match=r"^MoELayer: .*MoELayer\.from_pretrained.*got str"):
        fusedmoe.MoELayer(str(HF / "mixtral"))
    # bytes paths work as os functions take them
    layer = fusedmoe.MoELayer.from_pretrained(bytes(HF / "mixtral"), layer=1)
    assert layer.layer == 1
    assert fusedmoe.inspect(bytes(HF / "mixtral")) == fusedmoe.inspect(HF / "mixtral")


def test_cuda_workspace_without_cuda_or_on_the_cpu_backend():
    """A CudaWorkspace is for CUDA layers: a build without the CUDA backend says
    so when one is made; a CPU layer given one, or a layer given something else,
    names the argument (on any machine, before a device is touched)."""
    if not fusedmoe.cuda_built:
        with pytest.raises(NotImplementedError, match="CudaWorkspace: this build of fusedmoe has no CUDA"):
            fusedmoe.CudaWorkspace()
        return
    ws = fusedmoe.CudaWorkspace()  # no memory until a layer or reserve()
    assert ws.nbytes == 0 and ws.device == -1
    # Not copied, as a layer is not (copy.copy made a second object over the
    # same memory while deepcopy and pickle refused; session 27's trial).
    import copy
    import pickle

    for f in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="^CudaWorkspace cannot be pickled or copied"):
            f(ws)
    with pytest.raises(ValueError, match="workspace: a CudaWorkspace serves CUDA layers only"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", workspace=ws)
    with pytest.raises(TypeError, match="workspace: expected a fusedmoe.CudaWorkspace or None"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", workspace="big")
    assert fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0).workspace_nbytes == 0


def test_str_arguments_are_checked_in_python(case):
    c = case
    for kw, name in [(dict(activation=5), "activation"), (dict(activation=None), "activation"),
                     (dict(compute_dtype=5), "compute_dtype")]:
        with pytest.raises(TypeError, match=f"^{name}: expected") as e:
            fusedmoe.fused_experts(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], **kw)
        assert "incompatible function arguments" not in str(e.value)
    with pytest.raises(TypeError, match="^backend: expected 'cpu' or 'cuda', got int"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend=5)
    # sizes are checked before the build is (a CPU-only build raises NotImplementedError)
    with pytest.raises(ValueError, match=r"^num_tokens: expected 0\.\.2\*\*63-1, got"):
        fusedmoe.cuda_fused_experts_workspace_bytes(2**70, 16, 8, 4, 2)
    with pytest.raises(TypeError, match="^top_k: expected an int"):
        fusedmoe.cuda_fused_experts_workspace_bytes(4, 16, 8, 4, 2.0)
    # top_k < 1 (and other sizes < 1) named with the range, in every build (a CPU-only
    # build raised NotImplementedError; a CUDA build the library's "positive sizes")
    for i, name in enumerate(["hidden_size", "intermediate_size", "num_experts", "top_k"]):
        for bad in (0, -1):
            args = [4, 16, 8, 4, 2]
            args[i + 1] = bad
            with pytest.raises(ValueError, match=rf"^{name}: expected 1\.\.2\*\*63-1, got {bad}$"):
                fusedmoe.cuda_fused_experts_workspace_bytes(*args)
    with pytest.raises(TypeError, match="^w13_layout: expected 'standard' or 'interleaved128'"):
        fusedmoe.cuda_fused_experts_workspace_bytes(4, 16, 8, 4, 2, w13_layout=1)
    if fusedmoe.cuda_built:
        with pytest.raises(ValueError, match='^w13_layout: expected "standard" or "interleaved128"'
                                             ', got "bogus"'):
            fusedmoe.cuda_fused_experts_workspace_bytes(4, 16, 8, 4, 2, w13_layout="bogus")
        # sizes whose byte counts would wrap around 64 bits are refused, naming them
        for args, msg in [((2**60, 7168, 2048, 256, 8), r"num_tokens \* top_k \(routed slots\)"),
                          ((2**50, 7168, 2048, 256, 8), r"num_tokens \* top_k \(routed slots\)"),
                          ((8192, 2**50, 2048, 256, 8), "hidden_size and intermediate_size"),
                          ((8192, 64, 32, 2**40, 8), "num_experts must be at most 2\\^20")]:
            with pytest.raises(ValueError, match=msg):
                fusedmoe.cuda_fused_experts_workspace_bytes(*args)
        with pytest.raises(ValueError, match='^w13_layout: "interleaved128" needs the '
                                             'intermediate size I a multiple of 128, got I = 32'):
            fusedmoe.cuda_fused_experts_workspace_bytes(5, 64, 32, 8, 2,
                                                        w13_layout="interleaved128")
        # top_k above num_experts is taken (as fused_experts on the CPU takes it): slots of
        # -1, e.g. select_experts(logits [T, 16], 6, num_zero_experts=12) -> E = 4, k = 6
        assert fusedmoe.cuda_fused_experts_workspace_bytes(4, 16, 8, 4, 6) > 0
        # interleaved: no rows of the w13 GEMM before the activation (with an sm_90 device)
        assert fusedmoe.cuda_fused_experts_workspace_bytes(
            4096, 256, 128, 8, 2, w13_layout="interleaved128") <= \
            fusedmoe.cuda_fused_experts_workspace_bytes(4096, 256, 128, 8, 2)


# ---- 6. dtype errors name the argument and list only its values ------------------------


def test_dtype_errors_list_valid_values_and_name_the_argument(case):
    with pytest.raises(ValueError, match='^dtype: expected "f32", "bf16" or "f16"') as e:
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype="f8")
    assert "f8_e4m3fn" not in str(e.value)
    with pytest.raises(ValueError, match='^dtype: "f16" runs on the CUDA backend only') as e:
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype="f16")
    assert "compute_dtype" not in str(e.value)
    # Exactly the names the README lists: aliases are refused, not silently taken.
    for alias in ("bfloat16", "float32", "fp32", "F32"):
        with pytest.raises(ValueError, match=f'^dtype: expected "f32", "bf16" or "f16" .*'
                                             f'got "{alias}"'):
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype=alias)
        with pytest.raises(ValueError, match='^compute_dtype: expected "f32", "bf16" or "f16"'):
            fusedmoe.fused_experts(case["x"], case["w13"], case["w2"], case["tw"], case["ids"],
                                   compute_dtype=alias)
    with pytest.raises(ValueError, match='^compute_dtype: expected "f32", "bf16" or "f16"') as e:
        fusedmoe.fused_experts(case["x"], case["w13"], case["w2"], case["tw"], case["ids"],
                               compute_dtype="f8")
    assert "f8_e4m3fn" not in str(e.value)
    assert fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype="bf16").compute_dtype == "bf16"


def test_every_dtype_option_takes_the_same_spellings(case):
    """dtype, compute_dtype and weight_dtype follow one rule: the short names
    ("f32", "bf16", "f16") only. weight_dtype took "bfloat16", which the others
    refuse; now every option refuses each alias, naming itself and the value."""
    x, w13, w2, tw, ids = case["x"], case["w13"], case["w2"], case["tw"], case["ids"]
    bits13 = w13.view(np.uint32)[..., None].view(np.uint16)[..., 1].copy()  # bf16 bit patterns
    bits2 = w2.view(np.uint32)[..., None].view(np.uint16)[..., 1].copy()
    for alias in ("bfloat16", "float32", "float16", "BF16", "fp32", "half"):
        with pytest.raises(ValueError, match=f'^dtype: expected .* got "{alias}"$'):
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", dtype=alias)
        with pytest.raises(ValueError, match=f'^compute_dtype: expected .* got "{alias}"$'):
            fusedmoe.fused_experts(x, w13, w2, tw, ids, compute_dtype=alias)
        with pytest.raises(ValueError, match=f'^weight_dtype: expected "bf16", got "{alias}"$'):
            fusedmoe.fused_experts(x, bits13, bits2, tw, ids, weight_dtype=alias)
    # The short name works in each.
    ref = fusedmoe.fused_experts(x, bits13, bits2, tw, ids, weight_dtype="bf16")
    out = fusedmoe.fused_experts(x, bits13, bits2, tw, ids, weight_dtype="bf16",
                                 compute_dtype="bf16")
    assert ref.shape == out.shape == x.shape and np.isfinite(out).all()


# ---- 7. thread counts: the message says what is accepted --------------------------------


def test_thread_count_range_matches_its_message():
    n = fusedmoe.get_num_threads()
    for bad in (-1, 1025, 5000, 2**40):
        with pytest.raises(ValueError, match=r"^threads: expected 0\.\.1024 \(0: all cores\)"):
            fusedmoe.MoELayer.from_pretrained(HF / "mixtral", threads=bad)
        with pytest.raises(ValueError, match=r"^num_threads: expected 0\.\.1024 \(0: all cores\)"):
            fusedmoe.set_num_threads(bad)
    for bad in (-1, 2000):  # the extension's own check says the same
        with pytest.raises(ValueError, match=r"^num_threads: expected 0\.\.1024 \(0: all cores\)"):
            fusedmoe._ext.set_num_threads(bad)
    assert fusedmoe.get_num_threads() == n
    assert fusedmoe.MoELayer.from_pretrained(HF / "mixtral", threads=2).threads == 2


# ---- 8. fused_topk / fused_experts edge cases -----------------------------------------


def test_fused_topk_zero_experts_and_hidden_states_checks(rng):
    g = rng.standard_normal((3, 8)).astype(np.float32)
    h = rng.standard_normal((3, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^gating_output: 0 experts \(shape \(3, 0\)\)"):
        fusedmoe.fused_topk(h, g[:, :0], 1, True)
    with pytest.raises(ValueError, match=r"^router_logits: 0 experts"):
        fusedmoe.select_experts(g[:, :0], 1)
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got float64"):
        fusedmoe.fused_topk(h.astype(np.float64), g, 2, True)
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32"):
        fusedmoe.fused_topk(h.astype(np.float16), g, 2, True)
    with pytest.raises(ValueError, match="^hidden_states: expected a 2-d array"):
        fusedmoe.fused_topk(h[0], g, 2, True)
    with pytest.raises(ValueError, match="^hidden_states: expected 3 tokens"):
        fusedmoe.fused_topk(h[:2], g, 2, True)
    w, ids = fusedmoe.fused_topk(h, g, 2, True)
    w0, ids0 = fusedmoe.fused_topk(None, g, 2, True)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(w, w0)


def test_fused_topk_hidden_states_torch(rng):
    torch = _torch()
    g = torch.randn(3, 8)
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32"):
        fusedmoe.fused_topk(torch.zeros(3, 16, dtype=torch.float64), g, 2, True)
    with pytest.raises(ValueError, match="^hidden_states: expected 3 tokens"):
        fusedmoe.fused_topk(torch.zeros(2, 16), g, 2, True)


def test_fused_experts_zero_intermediate_size(case):
    c = case
    with pytest.raises(ValueError, match=r"^w13: the intermediate size is 0"):
        fusedmoe.fused_experts(c["x"], c["w13"][:, :0], c["w2"][:, :, :0], c["tw"], c["ids"])
    with pytest.raises(ValueError, match=r"^w2: the intermediate size is 0"):
        fusedmoe.fused_experts(c["x"], c["w13"], c["w2"][:, :, :0], c["tw"], c["ids"])
    with pytest.raises(ValueError, match=r"^hidden_states: the hidden size is 0"):
        fusedmoe.fused_experts(c["x"][:, :0], c["w13"][:, :, :0], c["w2"][:, :0], c["tw"],
                               c["ids"])
    # No experts: named as such (it read "topk_ids: expected values in [-1, 0)").
    with pytest.raises(ValueError, match=r"^w13: 0 experts \(shape \(0, 16, 16\)\); expected "
                                         r"\[E, 2I, H\] with E >= 1"):
        fusedmoe.fused_experts(c["x"], c["w13"][:0], c["w2"][:0], c["tw"], c["ids"])
    with pytest.raises(ValueError, match=r"^w2: 0 experts"):
        fusedmoe.fused_experts(c["x"], c["w13"], c["w2"][:0], c["tw"], c["ids"])


def test_swiglu_parameters_need_swiglu_oai(case):
    """swiglu_alpha / swiglu_limit are read by activation="swiglu_oai" alone: with
    another activation a value other than the default, which it would ignore, is a
    ValueError naming the parameter and the activation (they were accepted silently)."""
    c = case
    args = (c["x"], c["w13"], c["w2"], c["tw"], c["ids"])
    for activation in ("silu", "gelu", "gelu_pytorch_tanh"):
        with pytest.raises(ValueError, match=rf"^swiglu_alpha: a parameter of activation "
                                             rf"swiglu_oai only, expected the default 1\.702 "
                                             rf"with activation {activation}, got 1\.5$"):
            fusedmoe.fused_experts(*args, activation, swiglu_alpha=1.5)
        with pytest.raises(ValueError, match=rf"^swiglu_limit: a parameter of activation "
                                             rf"swiglu_oai only, expected the default 7 with "
                                             rf"activation {activation}, got 10$"):
            fusedmoe.fused_experts(*args, activation, swiglu_limit=10.0)
        # The defaults, given or not, change nothing.
        np.testing.assert_array_equal(
            fusedmoe.fused_experts(*args, activation, swiglu_alpha=1.702, swiglu_limit=7.0),
            fusedmoe.fused_experts(*args, activation))
    out = fusedmoe.fused_experts(*args, "swiglu_oai", swiglu_alpha=1.5, swiglu_limit=0.5)
    assert not np.array_equal(out, fusedmoe.fused_experts(*args, "swiglu_oai"))


# ---- 9. token_ids off hash routing; router_logits dtypes ---------------------------------


def test_token_ids_refused_off_hash_routing(mixtral, rng):
    x = rng.standard_normal((2, mixtral.hidden_size)).astype(np.float32)
    tok = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="^token_ids: given, but the topk router"):
        mixtral(x, token_ids=tok)
    with pytest.raises(ValueError, match="^token_ids: given, but the"):
        mixtral(x, token_ids=tok, return_routing=True)
    g = rng.standard_normal((2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="^token_ids: given, but the topk router"):
        fusedmoe.select_experts(g, 2, token_ids=tok)
    with pytest.raises(ValueError, match="^hash_table: given, but the topk router"):
        fusedmoe.select_experts(g, 2, hash_table=np.zeros((4, 2), np.int32))


def test_router_logits_of_any_float_dtype_are_converted(mixtral, rng):
    x = rng.standard_normal((3, mixtral.hidden_size)).astype(np.float32)
    logits = rng.standard_normal((3, mixtral.num_router_logits)).astype(np.float16)
    ref = mixtral(x, router_logits=logits.astype(np.float32))
    np.testing.assert_array_equal(mixtral(x, router_logits=logits), ref)
    np.testing.assert_array_equal(mixtral(x, router_logits=logits.astype(np.float64)), ref)
    with pytest.raises(TypeError, match="^router_logits: expected dtype float32, bfloat16, float16 or float64, got int32$"):
        mixtral(x, router_logits=logits.astype(np.int32))
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got float64"):
        mixtral(x.astype(np.float64))


def test_float8_router_logits_name_the_accepted_dtypes(mixtral):
    """ml_dtypes' float8 logits are refused naming the dtypes taken and the one
    given (they read "expected a floating dtype": float8 is one)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.zeros((2, mixtral.hidden_size), np.float32)
    g = np.zeros((2, mixtral.num_router_logits), ml_dtypes.float8_e4m3fn)
    want = "expected dtype float32, bfloat16, float16 or float64, got float8_e4m3fn$"
    with pytest.raises(TypeError, match="^router_logits: " + want):
        mixtral(x, router_logits=g)
    with pytest.raises(TypeError, match="^router_logits: " + want):
        fusedmoe.select_experts(g, 2)
    with pytest.raises(TypeError, match="^gating_output: " + want):
        fusedmoe.fused_topk(None, g, 2, True)
    with pytest.raises(TypeError, match="^gating_output: " + want):
        fusedmoe.grouped_topk(g, 2, True, 4, 2)


def _no_dlpack_arrays(shape):
    """NumPy arrays the extension cannot import (no DLPack form), by name."""
    out = {"object": np.zeros(shape, object), "void": np.zeros(shape, "V4"),
           "str": np.full(shape, "a"), "structured": np.zeros(shape, [("a", "<f4")]),
           "datetime": np.zeros(shape, "datetime64[s]")}
    try:
        import ml_dtypes
    except ImportError:
        return out
    out["float8_e4m3fn"] = np.zeros(shape, ml_dtypes.float8_e4m3fn)
    return out


def test_arrays_without_dlpack_form_are_named(mixtral, case):
    """Object, void, str, structured, datetime (and ml_dtypes) arrays: a TypeError
    naming the argument, the expected dtypes and the given one, never nanobind's
    'incompatible function arguments' signature dump."""
    x = np.zeros((2, mixtral.hidden_size), np.float32)
    c = case
    T, k = c["tw"].shape
    for dt, bad in _no_dlpack_arrays((2, mixtral.hidden_size)).items():
        for call in (lambda: mixtral(bad), lambda: mixtral(bad, return_routing=True),
                     lambda: mixtral.forward_with_routing(bad)):
            with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got ") as e:
                call()
            assert str(bad.dtype) in str(e.value), dt
    for dt, bad in _no_dlpack_arrays((T, c["x"].shape[1])).items():
        with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got "):
            fusedmoe.fused_experts(bad, c["w13"], c["w2"], c["tw"], c["ids"])
        with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got "):
            fusedmoe.fused_topk(bad, np.zeros((T, 4), np.float32), 2, True)
    for dt, bad in _no_dlpack_arrays((T, k)).items():
        with pytest.raises(TypeError, match="^topk_weights: expected dtype float32, got "):
            fusedmoe.fused_experts(c["x"], c["w13"], c["w2"], bad, c["ids"])
        with pytest.raises(TypeError, match=r"^topk_ids: expected an integer dtype \(int32\)"):
            fusedmoe.fused_experts(c["x"], c["w13"], c["w2"], c["tw"], bad)
        with pytest.raises(TypeError, match="^gating_output: expected dtype float32, bfloat16, float16 or float64, got "):
            fusedmoe.fused_topk(None, bad, 1, True)
        with pytest.raises(TypeError, match="^router_logits: expected dtype float32, bfloat16, float16 or float64, got "):
            fusedmoe.select_experts(bad, 1)
    for dt, bad in _no_dlpack_arrays(c["w13"].shape).items():
        with pytest.raises(TypeError, match="^w13: expected dtype float32 or bfloat16"):
            fusedmoe.fused_experts(c["x"], bad, c["w2"], c["tw"], c["ids"])
    bad = _no_dlpack_arrays((2, mixtral.num_router_logits))["object"]
    with pytest.raises(TypeError, match="^router_logits: expected dtype float32, bfloat16, float16 or float64, got object"):
        mixtral(x, router_logits=bad)


def test_bfloat16_hidden_states_and_topk_weights_are_named(mixtral, case):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    c = case
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got bfloat16"):
        mixtral(np.zeros((2, mixtral.hidden_size), bf16))
    with pytest.raises(TypeError, match="^hidden_states: expected dtype float32, got bfloat16"):
        fusedmoe.fused_experts(c["x"].astype(bf16), c["w13"], c["w2"], c["tw"], c["ids"])
    with pytest.raises(TypeError, match="^topk_weights: expected dtype float32, got bfloat16"):
        fusedmoe.fused_experts(c["x"], c["w13"], c["w2"], c["tw"].astype(bf16), c["ids"])


def test_fused_experts_overflow_raises_as_moe_layer(mixtral, case):
    """Finite hidden states that overflow f32 inside the experts: ValueError naming
    the first non-finite output, as MoELayer gives, not NaN rows."""
    c = case
    huge = np.full_like(c["x"], 3e38)
    with pytest.raises(ValueError, match="^output: non-finite value at token 0, column "):
        fusedmoe.fused_experts(huge, c["w13"], c["w2"], c["tw"], c["ids"])
    with pytest.raises(ValueError):
        mixtral(np.full((2, mixtral.hidden_size), 3e38, np.float32))


def test_fused_topk_reads_no_hidden_state_values(rng):
    """hidden_states is checked for shape and dtype only (README): it is not read,
    so a NaN there routes exactly as None does."""
    g = rng.standard_normal((3, 8)).astype(np.float32)
    h = np.full((3, 16), np.nan, np.float32)
    w, ids = fusedmoe.fused_topk(h, g, 2, True)
    w0, ids0 = fusedmoe.fused_topk(None, g, 2, True)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(w, w0)


# ---- 10. dir(fusedmoe) ---------------------------------------------------------------


def test_dir_lists_the_public_api_only():
    names = dir(fusedmoe)
    for leaked in ("Any", "Mapping", "Optional", "Tuple", "np", "os", "weakref", "itertools",
                   "importlib", "annotations"):
        assert leaked not in names, leaked
    public = [n for n in names if not n.startswith("_")]
    assert sorted(public) == sorted(n for n in fusedmoe.__all__ if not n.startswith("_"))
    assert "__version__" in names and "__all__" in names
    ns: dict = {}
    exec("from fusedmoe import *", ns)  # the star import follows __all__
    assert sorted(n for n in ns if n != "__builtins__") == sorted(fusedmoe.__all__)


# ---- meta tensors among real ones ------------------------------------------------------


def test_meta_tensors_among_real_ones_are_refused(mixtral, case):
    """A call mixing CPU and meta tensors dispatches to the ops' fake implementations,
    which returned an uninitialised CPU output; now a ValueError naming the argument."""
    torch = _torch()
    c = {k: torch.from_numpy(v) for k, v in case.items()}
    with pytest.raises(ValueError, match="w13: expected a tensor on cpu"):
        fusedmoe.fused_experts(c["x"], c["w13"].to("meta"), c["w2"].to("meta"),
                               c["tw"].to("meta"), c["ids"].to("meta"))
    with pytest.raises(ValueError, match="topk_ids: expected a tensor on cpu"):
        torch.ops.fusedmoe.fused_experts(c["x"], c["w13"], c["w2"], c["tw"], c["ids"].to("meta"))
    x = torch.randn(4, mixtral.hidden_size)
    logits = torch.randn(4, mixtral.num_router_logits, device="meta")
    with pytest.raises(ValueError, match="router_logits: expected a tensor on cpu"):
        mixtral(x, router_logits=logits)
    with pytest.raises(ValueError, match="router_logits: expected a tensor on cpu"):
        mixtral(x, router_logits=logits, return_routing=True)
    # All on meta: shape propagation, as torch.compile's tracing does.
    out = fusedmoe.fused_experts(*(c[k].to("meta") for k in ("x", "w13", "w2", "tw", "ids")))
    assert out.device.type == "meta" and tuple(out.shape) == tuple(case["x"].shape)


# ---- error messages quoting bytes that are not UTF-8 ------------------------------------


def test_error_message_with_non_utf8_bytes(tmp_path):
    """A damaged config.json quoted in the error (a Latin-1 byte), or a binary file given
    as the model, raised UnicodeDecodeError from the exception translation instead of
    the library's error (\\xNN escapes now)."""
    (tmp_path / "config.json").write_bytes(b'{"model_type": "mixtral", \xe9}')
    bin_file = tmp_path / "x.npy"
    bin_file.write_bytes(b"\x93NUMPY\x01\x00" + bytes(range(128, 256)))
    for path in (tmp_path, bin_file):
        with pytest.raises((ValueError, OSError)) as e:
            fusedmoe.MoELayer.from_pretrained(path)
        assert not isinstance(e.value, UnicodeError), repr(e.value)


def test_paths_in_library_errors_escape_control_characters(tmp_path):
    """A path quoted by the library's own errors (config.json, safetensors and model
    loading) showed its control characters raw, a newline breaking the message in
    two; they are written as \\xNN now, as the fusedmoe command writes them."""
    nl = tmp_path / "a\nb"
    shown = str(tmp_path) + "/a\\x0ab"

    def check(path, error, message, calls=(fusedmoe.MoELayer.from_pretrained, fusedmoe.inspect)):
        for call in calls:
            with pytest.raises(error) as e:
                call(path)
            text = str(e.value)
            assert message in text and "\n" not in text, (call.__name__, text)

    check(nl, OSError, shown + ": cannot open", [fusedmoe.MoELayer.from_pretrained])
    check(nl, OSError, shown + ": no such model directory or file", [fusedmoe.inspect])
    nl.mkdir()
    check(nl, OSError, shown + "/config.json: cannot open")
    (nl / "config.json").write_bytes((HF / "mixtral" / "config.json").read_bytes())
    (nl / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    for path in (nl, nl / "model.safetensors"):
        check(path, OSError, shown + "/model.safetensors: header length 16 runs past the end")
    (nl / "model.safetensors").write_bytes((HF / "mixtral" / "model.safetensors").read_bytes())
    (nl / "config.json").write_text((HF / "mixtral" / "config.json").read_text().replace(
        '"num_local_experts": 8', '"num_local_experts": 0'))
    check(nl, ValueError, shown + "/config.json (mixtral): field 'num_local_experts'")


# ---- 11. an empty path, arguments that are not arrays, the functional ops' names ------


def test_empty_path_is_a_value_error_naming_the_argument():
    """"" was opened as a path: OSError ": cannot open: No such file or directory"."""
    for empty in ("", b""):
        with pytest.raises(ValueError, match="^model_dir: expected a path, got an empty string$"):
            fusedmoe.MoELayer.from_pretrained(empty)
        with pytest.raises(ValueError, match="^path: expected a path, got an empty string$"):
            fusedmoe.inspect(empty)


def test_path_with_nul_or_not_utf8_is_a_value_error_naming_the_argument(tmp_path):
    """A NUL cut the path short in C++ ("models/tiny\\0x" opened "models/tiny": OSError
    naming another file); bytes that are not UTF-8 failed nanobind's conversion
    (TypeError "incompatible function arguments")."""
    model = str(HF / "mixtral")
    nul = "without NUL characters"
    utf8 = "that is valid UTF-8 (the library takes paths as UTF-8 text)"
    for path, what in [(model + "\0x", nul), (model.encode() + b"\0x", nul),
                       (bytes(tmp_path) + b"/\xff", utf8), (str(tmp_path) + "/\udcff", utf8)]:
        with pytest.raises(ValueError, match=f"^model_dir: expected a path {re.escape(what)}, got "):
            fusedmoe.MoELayer.from_pretrained(path)
        with pytest.raises(ValueError, match=f"^path: expected a path {re.escape(what)}, got "):
            fusedmoe.inspect(path)


def _array_arguments(layer, c):
    """(argument name, required, call(bad)) for each array argument of each public
    entry point, `bad` given in its place."""
    x = np.zeros((2, layer.hidden_size), np.float32)
    g = np.zeros((3, 8), np.float32)
    fe_names = ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")
    fe_args = [c[k] for k in ("x", "w13", "w2", "tw", "ids")]

    def fe(i):
        return lambda bad: fusedmoe.fused_experts(*fe_args[:i], bad, *fe_args[i + 1:])

    hash_kw = dict(routing_method="hash", hash_vocab_size=4, token_ids=np.zeros(3, np.int32))
    return [(n, True, fe(i)) for i, n in enumerate(fe_names)] + [
        ("w13_bias", False, lambda bad: fusedmoe.fused_experts(*fe_args, w13_bias=bad)),
        ("w2_bias", False, lambda bad: fusedmoe.fused_experts(*fe_args, w2_bias=bad)),
        ("hidden_states", True, lambda bad: layer(bad)),
        ("hidden_states", True, lambda bad: layer(bad, return_routing=True)),
        ("hidden_states", True, lambda bad: layer.forward_with_routing(bad)),
        ("router_logits", False, lambda bad: layer(x, bad)),
        ("token_ids", False, lambda bad: layer(x, token_ids=bad)),
        ("gating_output", True, lambda bad: fusedmoe.fused_topk(None, bad, 2, True)),
        ("hidden_states", False, lambda bad: fusedmoe.fused_topk(bad, g, 2, True)),
        ("gating_output", True, lambda bad: fusedmoe.grouped_topk(bad, 2, True, 4, 2)),
        ("e_score_correction_bias", False,
         lambda bad: fusedmoe.grouped_topk(g, 2, True, 4, 2, "sigmoid", bad)),
        ("router_logits", True, lambda bad: fusedmoe.select_experts(bad, 2)),
        ("router_logits", True, lambda bad: fusedmoe.select_experts(bad, config=layer)),
        ("token_ids", False, lambda bad: fusedmoe.select_experts(g, 2, token_ids=bad)),
        ("hash_table", False, lambda bad: fusedmoe.select_experts(g, 2, hash_table=bad,
                                                                  **hash_kw)),
    ]


def test_non_array_arguments_name_the_type_given(mixtral, case):
    """None, a list or a scalar for an array was named by the dtype NumPy gave it:
    layer(None) -> "hidden_states: expected dtype float32, got object", layer(x.tolist())
    -> "... got float64". (None for an optional array means "not given".)"""
    bads = [([[0.5]], "list"), ((0.5,), "tuple"), (0.5, "float"), (3, "int"),
            (np.float32(0.5), "numpy.float32"), ("x", "str")]
    for name, required, call in _array_arguments(mixtral, case):
        for bad, got in bads + ([(None, "None")] if required else []):
            with pytest.raises(TypeError) as e:
                call(bad)
            assert str(e.value) == f"{name}: expected a NumPy array or torch tensor, got {got}", \
                (name, bad, str(e.value))


def test_masked_arrays_are_refused(mixtral, case):
    """A numpy.ma.MaskedArray (an ndarray) was read through its data, its mask
    ignored: a masked hidden state computed as if it were there."""
    x = np.ma.masked_array(np.ones((2, mixtral.hidden_size), np.float32))
    x[0, 3] = np.ma.masked
    arguments = _array_arguments(mixtral, case) + [("w13", True, fusedmoe.interleave_w13)]
    for name, _, call in arguments:
        for bad in (x, np.ma.masked_array(case["w13"]), np.ma.masked_array(np.zeros((3, 8)))):
            with pytest.raises(TypeError) as e:
                call(bad)
            assert str(e.value) == (
                f"{name}: expected a NumPy array or torch tensor, got numpy.ma.MaskedArray "
                "(its mask would be ignored; pass its .filled(value), the masked elements set "
                "to value, or its .data)"), (name, str(e.value))
    assert np.array_equal(mixtral(x.filled(0.0)), mixtral(np.asarray(x.filled(0.0))))


def test_non_array_arguments_beside_torch_tensors():
    """With torch tensors the calls go to torch.ops, whose own message for None
    ("expected Tensor ... but got NoneType") named no argument of fusedmoe's."""
    torch = _torch()
    T, E, H, I, k = 3, 4, 16, 8, 2
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    tw, ids = torch.rand(T, k), torch.zeros(T, k, dtype=torch.int32)
    with pytest.raises(TypeError, match="^hidden_states: expected a NumPy array or torch "
                                        "tensor, got None$"):
        fusedmoe.fused_experts(None, w13, w2, tw, ids)
    with pytest.raises(TypeError, match="^topk_ids: expected a NumPy array or torch tensor, "
                                        "got None$"):
        fusedmoe.fused_experts(torch.randn(T, H), w13, w2, tw, None)
    with pytest.raises(TypeError, match="^gating_output: expected a NumPy array or torch "
                                        "tensor, got list$"):
        fusedmoe.fused_topk(torch.randn(T, H), [[0.5] * E] * T, k, True)


def _routing_name_cases(torch=None):
    """(exception, message start, call) for arguments fused_topk / grouped_topk put
    into the config they build: each was named "config.<key>" (they take no config)."""
    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 8)).astype(np.float32)
    if torch is not None:
        g = torch.from_numpy(g)
    return [
        (ValueError, "routed_scaling_factor: expected a finite number, got nan",
         lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2, routed_scaling_factor=float("nan"))),
        (ValueError, "routed_scaling_factor: expected a finite number, got inf",
         lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2, routed_scaling_factor=float("inf"))),
        (ValueError, 'scoring_func: expected one of softmax, sigmoid, sqrtsoftplus, got "foo"',
         lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2, scoring_func="foo")),
        (ValueError, 'group_score: expected one of max, sum_top2, got "foo"',
         lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2, group_score="foo")),
        (ValueError, "topk: expected <= topk_group * experts per group",
         lambda: fusedmoe.grouped_topk(g, 5, True, 4, 2)),
        (ValueError, 'scoring_func: expected one of softmax, sigmoid, sqrtsoftplus, got "foo"',
         lambda: fusedmoe.fused_topk(None, g, 2, True, "foo")),
        (ValueError, "topk: expected 1 <= topk <= 8",
         lambda: fusedmoe.fused_topk(None, g, 9, True)),
    ] + ([] if torch is not None else [  # torch.ops check the str type themselves
        (TypeError, "scoring_func: expected str, got int",
         lambda: fusedmoe.fused_topk(None, g, 2, True, 5)),
        (TypeError, "group_score: expected str, got int",
         lambda: fusedmoe.grouped_topk(g, 2, True, 4, 2, group_score=5)),
    ])


def test_functional_routers_name_their_own_arguments():
    for exc, start, call in _routing_name_cases():
        with pytest.raises(exc) as e:
            call()
        assert str(e.value).startswith(start), (start, str(e.value))


def test_functional_routers_name_their_own_arguments_torch():
    torch = _torch()
    for exc, start, call in _routing_name_cases(torch):
        with pytest.raises(exc) as e:
            call()
        assert str(e.value).startswith(start), (start, str(e.value))


def test_select_experts_names_keywords_and_config_keys():
    """A key given as a keyword is named as such; one of a config dict keeps config.<key>."""
    g = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match='^scoring_func: expected one of .*got "foo"$'):
        fusedmoe.select_experts(g, 2, scoring_func="foo")
    with pytest.raises(ValueError, match='^config.scoring_func: expected one of .*got "foo"$'):
        fusedmoe.select_experts(g, 2, config={"scoring_func": "foo"})
    # the keyword overrides the config's value, and is the one named
    with pytest.raises(ValueError, match="^routed_scaling_factor: expected a finite number"):
        fusedmoe.select_experts(g, 2, config={"routed_scaling_factor": 1.0},
                                routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="^config.routed_scaling_factor: expected a finite"):
        fusedmoe.select_experts(g, 2, config={"routed_scaling_factor": float("nan")})


def test_fused_experts_non_finite_weights_are_named(case):
    """NaN / Inf weights (fused_experts does not scan them) give a NaN output; the
    error said only "the input or the weights overflow f32 arithmetic"."""
    c = case
    for bad in (np.nan, np.inf):
        for name in ("w13", "w2"):
            w = c[name].copy()
            w[...] = bad
            args = {"w13": c["w13"], "w2": c["w2"]}
            args[name] = w
            with pytest.raises(ValueError, match=r"^output: non-finite value at token 0, column 0 "
                                                 r"\(the weights hold NaN or Inf, or the input or "
                                                 r"the weights overflow f32 arithmetic, or with "
                                                 r"bf16 compute an input beyond bf16's largest "
                                                 r"value, 3.39e38, rounded to Inf\)$"):
                fusedmoe.fused_experts(c["x"], args["w13"], args["w2"], c["tw"], c["ids"])


def test_float64_router_logits_beyond_float32_are_named(mixtral):
    """float64 logits are routed in float32: a finite value that overflows it
    would become inf and tie with the others (weights 0.5 / 0.5 for logits 1e300
    and 5e299); ValueError names the argument, the element and the value."""
    E = mixtral.num_experts
    rl = np.zeros((2, E))
    rl[1, :2] = [1e300, 5e299]
    x = np.ones((2, mixtral.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"router_logits: element \[1, 0\] is 1e\+300"):
        mixtral(x, router_logits=rl)
    with pytest.raises(ValueError, match=r"gating_output: element \[1, 0\]"):
        fusedmoe.fused_topk(None, rl, 2, True)
    with pytest.raises(ValueError, match=r"router_logits: element \[1, 0\]"):
        fusedmoe.select_experts(rl, config=mixtral)
    rl[1, :2] = [3e38, 1e2]  # within float32: routed as given
    w, ids = fusedmoe.fused_topk(None, rl, 2, True)
    assert ids[1, 0] == 0 and w[1, 0] == 1.0
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and fusedmoe._torch is not None:
        t = torch.zeros((2, E), dtype=torch.float64)
        t[0, 3] = -1e300
        with pytest.raises(ValueError, match=r"gating_output: element \[0, 3\] is -1e\+300"):
            fusedmoe.fused_topk(None, t, 2, True)


def test_weight_dtype_is_checked_for_every_weight_type(case):
    """weight_dtype is "bf16" or None whatever the weights' dtype: with
    ml_dtypes.bfloat16 weights it was not looked at (5, True, "f32" passed)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    x, tw, ids = case["x"], case["tw"], case["ids"]
    w13, w2 = case["w13"].astype(bf), case["w2"].astype(bf)
    for bad in (5, True):
        with pytest.raises(TypeError, match="^weight_dtype: expected 'bf16' or None, got"):
            fusedmoe.fused_experts(x, w13, w2, tw, ids, weight_dtype=bad)
    for bad in ("f32", "garbage", "bfloat16"):
        with pytest.raises(ValueError, match="^weight_dtype: expected"):
            fusedmoe.fused_experts(x, w13, w2, tw, ids, weight_dtype=bad)
    for ok in (None, "bf16"):
        out = fusedmoe.fused_experts(x, w13, w2, tw, ids, weight_dtype=ok)
        assert np.isfinite(out).all()


def test_zero_slots_per_token_is_refused(case):
    """topk_ids / topk_weights of k = 0 columns: refused as top_k = 0 is by the
    routers (it returned zeros)."""
    x, w13, w2 = case["x"], case["w13"], case["w2"]
    T = x.shape[0]
    with pytest.raises(ValueError, match=r"topk_ids: expected \[T, k\] with k >= 1"):
        fusedmoe.fused_experts(x, w13, w2, np.zeros((T, 0), np.float32),
                               np.zeros((T, 0), np.int32))


def test_sparse_torch_tensor_is_named():
    torch = _torch()
    if torch is None:
        pytest.skip("needs torch")
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    x = torch.ones((2, layer.hidden_size)).to_sparse()
    with pytest.raises(TypeError, match="hidden_states: expected a dense"):
        layer(x)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: nested tensors are a prototype
def test_nested_torch_tensors_are_named():
    """A nested tensor, strided (its rows differ in shape) or jagged (a tensor
    subclass the custom ops' dispatch raised NotImplementedError
    "fusedmoe.fused_topk.default" for), is refused naming the argument."""
    torch = _torch()
    if torch is None:
        pytest.skip("needs torch")
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    H = layer.hidden_size
    for layout in (torch.strided, torch.jagged):
        nt = torch.nested.nested_tensor([torch.ones(3, H), torch.ones(2, H)], layout=layout)
        with pytest.raises(TypeError, match=r"^hidden_states: expected a dense \(strided\) "
                                            r"tensor, got a nested tensor$"):
            layer(nt)
        with pytest.raises(TypeError, match=r"^gating_output: expected a dense .* nested"):
            fusedmoe.fused_topk(None, nt, 2, True)
        with pytest.raises(TypeError, match=r"^router_logits: expected a dense .* nested"):
            fusedmoe.select_experts(nt, 2)


def test_select_experts_config_bias_flag_without_array_names_the_dict_key(rng):
    """layer.config says e_score_correction_bias = True: the error named the C++
    field config.has_e_score_correction_bias, a key the dict does not have."""
    layer = fusedmoe.MoELayer.from_pretrained(TINY_DSV3)
    g = rng.standard_normal((3, layer.num_router_logits)).astype(np.float32)
    with pytest.raises(ValueError) as e:
        fusedmoe.select_experts(g, None, config=layer.config)
    msg = str(e.value)
    assert msg.startswith("e_score_correction_bias: expected float32 or bfloat16 [16] (the "
                          "config's 'e_score_correction_bias' is True), got none"), msg
    assert "has_e_score_correction_bias" not in msg
    assert "e_score_correction_bias=" in msg and "config=layer" in msg
    # what the message suggests works: the layer itself, or its bias array
    w, ids = fusedmoe.select_experts(g, None, config=layer)
    bias = layer._impl.router_params()["e_score_correction_bias"]
    w2, ids2 = fusedmoe.select_experts(g, None, config=layer.config, e_score_correction_bias=bias)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(w2, w)
    # a bias array of the wrong shape beside layer.config: the argument is named,
    # not the config's flag of the same name (trial finding)
    with pytest.raises(ValueError, match=r"^e_score_correction_bias: expected f32 \[16\], got f32 \[8\]"):
        fusedmoe.select_experts(g, None, config=layer.config,
                                e_score_correction_bias=np.zeros(8, np.float32))


def test_functional_routers_name_gating_output_for_nan_logits():
    g = np.array([[1.0, np.nan, 0.0, 2.0]], np.float32)
    for call in (lambda: fusedmoe.fused_topk(None, g, 2, True),
                 lambda: fusedmoe.grouped_topk(g, 2, True, 2, 1)):
        with pytest.raises(ValueError, match="^gating_output: expected no NaN, got NaN at token 0, "
                                             "expert 1"):
            call()
    with pytest.raises(ValueError, match="^router_logits: expected no NaN"):
        fusedmoe.select_experts(g, 2)


def test_select_experts_config_errors_name_config_keys_and_values():
    g = np.zeros((3, 16), np.float32)
    # num_experts is derived (16 columns - 20 zero experts): name the key given
    with pytest.raises(ValueError, match="^config.num_zero_experts: expected < 16 "
                                         "\\(router_logits' columns.*got 20$"):
        fusedmoe.select_experts(g, 2, config={"num_zero_experts": 20})
    with pytest.raises(ValueError, match="^num_zero_experts: expected < 16 .*got 16$"):
        fusedmoe.select_experts(g, 2, num_zero_experts=16)
    with pytest.raises(TypeError, match="^config.num_zero_experts: expected int, got str 'x'$"):
        fusedmoe.select_experts(g, 2, config={"num_zero_experts": "x"})
    # errors of the config's validation carry the config. prefix, as those of reading it do
    with pytest.raises(ValueError, match="^config.num_zero_experts: expected 0 to"):
        fusedmoe.select_experts(g, 2, config={"num_zero_experts": -1})
    with pytest.raises(ValueError, match="^config.hash_vocab_size: expected > 0"):
        fusedmoe.select_experts(g, 2, config={"routing_method": "hash", "hash_vocab_size": -1})
    with pytest.raises(ValueError, match="^config.zipf_s: expected a finite value > 0"):
        fusedmoe.select_experts(g, 2, config={"routing_method": "simulated", "simulated": "zipf",
                                              "zipf_s": -1.0})
    with pytest.raises(ValueError, match="^zipf_s: expected a finite value > 0"):
        fusedmoe.select_experts(g, 2, routing_method="simulated", simulated="zipf", zipf_s=-1.0)
    # a value of the wrong type is quoted
    with pytest.raises(TypeError, match="^config.routed_scaling_factor: expected float, got "
                                        "str 'x'$"):
        fusedmoe.select_experts(g, 2, config={"routed_scaling_factor": "x"})


def test_torch_calls_skip_the_op_dispatch_only_when_nothing_needs_it(monkeypatch):
    """Eager calls with no autograd to record run the op's implementation
    directly (the same bits); with an input requiring grad they go through the
    op (its output requires grad and refuses a backward)."""
    torch = _torch()
    g = torch.Generator().manual_seed(7)
    T, E, H, I, k = 5, 4, 16, 8, 2
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / 4
    w2 = torch.randn(E, H, I, generator=g) / 3
    logits = torch.randn(T, E, generator=g)
    tw, ids = fusedmoe.fused_topk(x, logits, k, True)
    op_tw, op_ids = torch.ops.fusedmoe.fused_topk(logits, k, True)
    assert torch.equal(tw, op_tw) and torch.equal(ids, op_ids)
    gtw, gids = fusedmoe.grouped_topk(logits, k, True, 2, 1)
    op_gtw, op_gids = torch.ops.fusedmoe.grouped_topk(logits, k, True, 2, 1)
    assert torch.equal(gtw, op_gtw) and torch.equal(gids, op_gids)

    calls = []
    real = torch.ops.fusedmoe.fused_experts

    class Spy:
        def __call__(self, *a, **kw):
            calls.append(1)
            return real(*a, **kw)

    monkeypatch.setattr(torch.ops.fusedmoe, "fused_experts", Spy())
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    assert not calls, "an eager call without autograd went through the op"
    assert torch.equal(out, real(x, w13, w2, tw, ids))
    xg = x.clone().requires_grad_()
    out_g = fusedmoe.fused_experts(xg, w13, w2, tw, ids)
    assert calls, "a call with an input requiring grad skipped the op"
    assert out_g.requires_grad and torch.equal(out_g.detach(), out)
    with pytest.raises(RuntimeError, match="inference-only"):
        out_g.sum().backward()
    with torch.no_grad():
        calls.clear()
        assert torch.equal(fusedmoe.fused_experts(xg, w13, w2, tw, ids), out)
        assert not calls


def test_expert_parallel_group_argument_errors():
    """ExpertParallelGroup / ep_group arguments are checked before any rank
    waits for the others."""
    try:
        uid = fusedmoe.nccl_unique_id()
    except NotImplementedError as e:  # a build without NCCL says so
        assert "no NCCL" in str(e)
        uid = bytes(128)
    else:
        assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(ValueError, match="unique_id: expected the 128 bytes of nccl_unique_id"):
        fusedmoe.ExpertParallelGroup.from_unique_id(b"x", 0, 1, device=0)
    with pytest.raises(TypeError, match="unique_id: expected the bytes"):
        fusedmoe.ExpertParallelGroup.from_unique_id(uid.hex(), 0, 1)
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.1 \(size 2\), got 3"):
        fusedmoe.ExpertParallelGroup.from_unique_id(uid, 3, 2)
    with pytest.raises(ValueError, match="size: expected 1"):
        fusedmoe.ExpertParallelGroup.from_unique_id(uid, 0, 0)
    with pytest.raises(TypeError, match="ep_group: expected a fusedmoe.ExpertParallelGroup"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", ep_group=1)
    if not fusedmoe.cuda_built or fusedmoe._ext.cuda_device_count() == 0:
        # A ValueError, as the other entry points without a CUDA device (README).
        with pytest.raises(ValueError, match="ExpertParallelGroup: no CUDA device is visible"):
            fusedmoe.ExpertParallelGroup.from_unique_id(uid, 0, 1)


def _small_experts_case(rng):
    """fused_experts' arguments for E = 4, H = 16, I = 8, T = 3, k = 2 (f32)."""
    E, H, I, T, k = 4, 16, 8, 3, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    w2 = rng.standard_normal((E, H, I)).astype(np.float32)
    tw = rng.random((T, k)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int32)
    return x, w13, w2, tw, ids


class _DLPackOnly:
    """Wraps an array behind the DLPack protocol alone (no shape, ndim, dtype)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_only_objects_are_imported_as_numpy(rng):
    """An object with the DLPack protocol alone (no shape, ndim): imported as a
    NumPy array, the same results as the arrays it wraps; one whose
    __dlpack__ fails raises TypeError naming the argument and the cause."""
    DL = _DLPackOnly

    class Broken:
        def __dlpack__(self, **kw):
            raise RuntimeError("no export")

        def __dlpack_device__(self):
            return (1, 0)

    x, w13, w2, tw, ids = _small_experts_case(rng)
    out = fusedmoe.fused_experts(DL(x), DL(w13), DL(w2), DL(tw), DL(ids))
    np.testing.assert_array_equal(out, fusedmoe.fused_experts(x, w13, w2, tw, ids))
    logits = rng.standard_normal((x.shape[0], w13.shape[0])).astype(np.float32)
    for a, b in zip(fusedmoe.fused_topk(None, DL(logits), 2, True),
                    fusedmoe.fused_topk(None, logits, 2, True)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"^gating_output: a DLPack object NumPy cannot import "
                                        r"\(RuntimeError: no export\)"):
        fusedmoe.fused_topk(None, Broken(), 2, True)


def test_dlpack_objects_with_partial_or_foreign_attributes(rng):
    """A DLPack object with shape but no ndim is imported as a NumPy array (it
    raised AttributeError inside the package); a dtype that is a NumPy scalar
    type or another library's name ("paddle.float32") is read by its name
    (np.float32 as dtype was refused as "expected float32, got <class
    'numpy.float32'>"); a wrong one is named plainly."""
    class DL(_DLPackOnly):
        def __init__(self, a, dtype=None, ndim=False):
            super().__init__(a)
            self.shape = a.shape
            if dtype is not None:
                self.dtype = dtype
            if ndim:
                self.ndim = a.ndim

    x, w13, w2, tw, ids = _small_experts_case(rng)
    want = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    for hx in (DL(x), DL(x, np.float32, True), DL(x, "paddle.float32", True)):
        np.testing.assert_array_equal(fusedmoe.fused_experts(hx, w13, w2, tw, ids), want)
    with pytest.raises(TypeError, match=r"^hidden_states: expected dtype float32, got float64$"):
        fusedmoe.fused_experts(DL(x.astype(np.float64), "paddle.float64", True), w13, w2, tw, ids)


def test_array_classes_and_negative_shapes_are_named(rng):
    """The class np.ndarray passed instead of an array (it has __dlpack__ too)
    raised "'getset_descriptor' object is not iterable"; a DLPack object whose
    shape has a negative dimension raised NumPy's "negative dimensions are not
    allowed" without the argument. Both name the argument now."""
    x, w13, w2, tw, ids = _small_experts_case(rng)
    with pytest.raises(TypeError, match=r"^hidden_states: expected a NumPy array or torch tensor, "
                                        r"got the class numpy\.ndarray \(not an array of it\)$"):
        fusedmoe.fused_experts(np.ndarray, w13, w2, tw, ids)
    with pytest.raises(TypeError, match=r"^gating_output: .* got the class numpy\.ndarray"):
        fusedmoe.fused_topk(None, np.ndarray, 2, True)

    class Negative(_DLPackOnly):
        def __init__(self, a):
            super().__init__(a)
            self.shape, self.ndim, self.dtype = (-1, a.shape[1]), 2, a.dtype

    with pytest.raises(ValueError, match=r"^gating_output: shape \(-1, 4\) has a negative "
                                         r"dimension$"):
        fusedmoe.fused_topk(None, Negative(np.ones((3, 4), np.float32)), 2, True)
    with pytest.raises(ValueError, match=r"^hidden_states: shape \(-1, \d+\) has a negative"):
        fusedmoe.fused_experts(Negative(x), w13, w2, tw, ids)


def test_big_endian_arrays_are_checked_before_their_copy():
    """Arrays of the other byte order (DLPack carries native order only) are
    swapped in their distinct elements: a broadcast view is not copied whole
    before its dtype and shape are checked (session 27's trial: NumPy's
    "Unable to allocate 954 GiB" instead of the TypeError), and the values
    are those of the native array."""
    layer = fusedmoe.MoELayer.from_pretrained(REPO / "models" / "tiny-deepseek-v3", layer=1)
    H = layer.hidden_size
    huge = (10**9, H)
    with pytest.raises(TypeError, match="hidden_states: expected dtype float32, got float64"):
        layer(np.broadcast_to(np.zeros(H, ">f8"), huge))
    with pytest.raises(MemoryError, match=r"^hidden_states: 1000000000 tokens"):
        layer(np.broadcast_to(np.zeros(H, ">f4"), huge))
    for dt in ("<f4", ">f4"):  # a 0-d array: the same error either way
        with pytest.raises(ValueError, match=r"^hidden_states: expected a 2-d array"):
            layer(np.array(1.0, dt))
    assert type(fusedmoe._native_byte_order(np.array(1.0, ">f4"), "x")) is np.ndarray
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, H)).astype(">f4")
    assert np.array_equal(layer(x), layer(x.astype("<f4")))
    xb = np.broadcast_to(rng.standard_normal(H).astype(">f4"), (3, H))
    assert np.array_equal(layer(xb), layer(np.ascontiguousarray(xb, dtype="<f4")))
    # functional: broadcast weights of the other byte order
    E, h = 1000, rng.standard_normal((3, 64)).astype(np.float32)
    ids, tw = np.array([[0, 1], [2, 3], [1, 0]], np.int32), np.full((3, 2), 0.5, np.float32)
    w13, w2 = rng.standard_normal((64, 64)), rng.standard_normal((64, 32))
    want = fusedmoe.fused_experts(h, np.broadcast_to(w13.astype("<f4"), (E, 64, 64)),
                                  np.broadcast_to(w2.astype("<f4"), (E, 64, 32)), tw, ids)
    got = fusedmoe.fused_experts(h, np.broadcast_to(w13.astype(">f4"), (E, 64, 64)),
                                 np.broadcast_to(w2.astype(">f4"), (E, 64, 32)), tw, ids)
    assert np.array_equal(got, want)


def test_longdouble_logits_are_refused_as_the_message_lists():
    """Router logits take float32, bfloat16, float16 or float64, as the
    TypeError says; a longdouble array is refused too (session 27's trial: it
    was taken, and a finite 1e4000 was named "inf, beyond the float32 range")."""
    for v in (np.longdouble("1e4000"), np.longdouble(1.0)):
        logits = np.array([[v] + [0] * 7], dtype=np.longdouble)
        if logits.dtype.itemsize <= 8:
            pytest.skip("skipped: longdouble is float64 on this platform")
        with pytest.raises(TypeError, match="^gating_output: expected dtype float32, bfloat16, "
                                            "float16 or float64, got float"):
            fusedmoe.fused_topk(None, logits, 2, True)
    layer = fusedmoe.MoELayer.from_pretrained(TINY_DSV3, layer=1)
    x = np.ones((1, layer.hidden_size), np.float32)
    with pytest.raises(TypeError, match="^router_logits: expected dtype float32"):
        layer(x, np.zeros((1, layer.num_router_logits), np.longdouble))


def _fresh_interpreter(body: str) -> tuple:
    """Runs `body` in a fresh interpreter after a preamble that makes a small
    fused_experts problem (x [1, 128], w13 [6, 64, 128], w2 [6, 128, 32], ids
    and tw [1, 2]); returns its stdout lines but the last, and its peak memory
    in MB (printed last)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import resource, numpy as np, fusedmoe
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 128)).astype(np.float32)
        w13 = rng.standard_normal((6, 64, 128)).astype(np.float32)
        w2 = rng.standard_normal((6, 128, 32)).astype(np.float32)
        ids, tw = np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32)
    """) + textwrap.dedent(body) + (
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.rstrip("\n").split("\n")
    return lines[:-1], int(lines[-1])


def test_routing_arrays_of_the_wrong_shape_are_refused_before_a_copy():
    """fused_experts' topk_weights / topk_ids whose rows are not T's: named by
    their shape or dtype before any copy or conversion (session 27's trial: a
    broadcast [1e9, 2] float64 topk_weights was copied whole, 15 GB, before its
    TypeError). Run in a fresh interpreter to read its peak memory."""
    lines, peak_mb = _fresh_interpreter("""
        big = (10**9, 2)
        for a, b in ((np.broadcast_to(np.zeros(1, ">f8"), big), ids),
                     (np.broadcast_to(np.zeros(1, "<f4"), big), ids),
                     (tw, np.broadcast_to(np.zeros(1, "<i8"), big)),
                     (tw, np.broadcast_to(np.zeros(1, ">i4"), big))):
            try:
                fusedmoe.fused_experts(x, w13, w2, a, b)
                print("taken")
            except (TypeError, ValueError) as e:
                print(type(e).__name__, str(e).split(",")[0])
    """)
    assert lines == ["TypeError topk_weights: expected dtype float32",
                     "ValueError topk_weights: expected f32 [1",
                     "ValueError topk_ids: expected [1",
                     "ValueError topk_ids: expected i32 [1"], lines
    assert peak_mb < 1000, f"peak memory {peak_mb} MB"


def test_topk_ids_of_another_integer_dtype_and_the_wrong_shape_name_the_shape():
    """An int64 (or other integer) topk_ids is converted, so one of the wrong
    rank or rows is refused for its shape, not its dtype (session 28's focused
    trial: "expected dtype i32, got i64 [3, 2, 1]")."""
    rng = np.random.default_rng(7)
    x, w13, w2, tw, _ = _small_experts_case(rng)
    T, k = tw.shape
    for ids, shape in ((np.zeros((T, k, 1), np.int64), f"[{T}, {k}, 1]"),
                       (np.zeros((T * k,), np.uint8), f"[{T * k}]"),
                       (np.zeros((T + 1, k), np.int16), f"[{T + 1}, {k}]")):
        with pytest.raises(ValueError) as e:
            fusedmoe.fused_experts(x, w13, w2, tw, ids)
        assert str(e.value) == (f"topk_ids: expected [{T}, k] (int32; other integer dtypes are "
                                f"converted), got {ids.dtype} {shape}"), str(e.value)


def test_weights_of_the_wrong_shape_are_refused_before_a_copy():
    """fused_experts' w13 / w2 / biases: a view that would be copied (not
    contiguous, or a bias to convert to float32) of another shape than
    hidden_states and w2 imply is named before the copy (session 27's trial: a
    broadcast w13 or w13_bias of the wrong shape was copied whole, 3-15 GB,
    before its error). Each view below is ~3 GB if copied; the fresh
    interpreter's peak memory shows none was."""
    lines, peak_mb = _fresh_interpreter("""
        one = np.ones(1, np.float32)
        cases = (
            dict(w13=np.broadcast_to(one, (6, 64, 125 * 10**5))),
            dict(w2=np.broadcast_to(one, (6, 125 * 10**5, 32))),
            dict(w13_bias=np.broadcast_to(one, (6, 125 * 10**6))),
            dict(w2_bias=np.broadcast_to(one, (125 * 10**6, 6))),
            dict(w13_bias=np.ones((6, 63), np.uint16), weight_dtype="bf16"),
        )
        for kw in cases:
            args = dict(w13=w13, w2=w2)
            args.update(kw)
            try:
                fusedmoe.fused_experts(x, args.pop("w13"), args.pop("w2"), tw, ids, **args)
                print("taken")
            except (TypeError, ValueError) as e:
                print(type(e).__name__, str(e).split(" (")[0])
        # The same views of the right shape are still taken (copied).
        out = fusedmoe.fused_experts(x, np.broadcast_to(w13[:1], w13.shape), w2, tw, ids,
                                     w13_bias=np.broadcast_to(one, (6, 64)),
                                     w2_bias=np.broadcast_to(one, (6, 128)))
        print("right shape", out.shape)
    """)
    assert lines == ["ValueError w13: expected [E, 2I, H] = [6, 64, 128]",
                     "ValueError w2: expected [E, H, I] = [6, 128, 32]",
                     "ValueError w13_bias: expected [E, 2I] = [6, 64]",
                     "ValueError w2_bias: expected [E, H] = [6, 128]",
                     "ValueError w13_bias: expected [E, 2I] = [6, 64]",
                     "right shape (1, 128)"], lines
    assert peak_mb < 1000, f"peak memory {peak_mb} MB"


def test_routers_name_the_logits_for_too_many_experts():
    """The routers' expert count comes from the logits' columns: beyond the
    limit its error names them, not a num_experts the call never had
    (session 28's trial)."""
    logits = np.zeros((2, 70000), np.float32)
    with pytest.raises(ValueError, match=r"^gating_output's columns \(the expert count\): "
                                         r"expected <= 65536"):
        fusedmoe.fused_topk(None, logits, 4, True)
    with pytest.raises(ValueError, match=r"^gating_output's columns \(the expert count\): "):
        fusedmoe.grouped_topk(logits, 4, True, 1, 1)
    with pytest.raises(ValueError, match=r"^num_experts \(router_logits' columns less "
                                         r"num_zero_experts\): expected <= 65536 .*got 70000"):
        fusedmoe.select_experts(logits, top_k=4)
    with pytest.raises(ValueError, match=r"^num_experts \(router_logits' columns less "
                                         r"num_zero_experts\): expected <= 65536 .*got 69996"):
        fusedmoe.select_experts(logits, top_k=4, num_zero_experts=4)
    # A config that gives num_experts itself is named as such.
    with pytest.raises(ValueError, match=r"^config\.num_experts: expected <= 65536"):
        fusedmoe.select_experts(logits, top_k=4, config={"num_experts": 70000})


def test_zero_d_weights_and_biases_are_named_with_their_shape():
    """A 0-d bias or weight is reported as shape [] (the contiguous copy made
    it [1] first; session 28's trial)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    w13 = rng.standard_normal((4, 16, 16)).astype(np.float32)
    w2 = rng.standard_normal((4, 16, 8)).astype(np.float32)
    tw, ids = np.full((2, 2), 0.5, np.float32), np.array([[0, 1], [2, 3]], np.int32)
    zero_d = np.array(0, np.float32)
    with pytest.raises(ValueError, match=re.escape("w2_bias: expected f32 [4, 16], got f32 []")):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, w13_bias=np.zeros((4, 16), np.float32),
                               w2_bias=zero_d)
    with pytest.raises(ValueError, match=re.escape("w13: expected a 3-d tensor [E, 2I, H], got "
                                                   "f32 []")):
        fusedmoe.fused_experts(x, zero_d, w2, tw, ids)


def test_disagreeing_shapes_are_refused_before_a_copy():
    """hidden_states, w13 and w2 that disagree (or topk_weights and topk_ids),
    one of them a view that would be copied: refused with every shape given,
    before the copy (session 28's trial: a broadcast w2 of a wrong E, or
    hidden_states of a wrong H, was copied whole, ~3 GB, before the extension's
    error). Each view below is ~3 GB if copied."""
    lines, peak_mb = _fresh_interpreter("""
        one = np.ones(1, np.float32)
        cases = (
            dict(w2=np.broadcast_to(one, (6 * 10**6, 128, 32))),       # E
            dict(w2=np.broadcast_to(one, (6, 128, 10**6))),            # I
            dict(x=np.broadcast_to(one, (1, 75 * 10**7))),             # H
            dict(tw=np.broadcast_to(one, (1, 75 * 10**7))),            # k
            dict(ids=np.broadcast_to(np.zeros(1, np.int64), (1, 3 * 10**8))),
        )
        for kw in cases:
            args = dict(x=x, w13=w13, w2=w2, tw=tw, ids=ids)
            args.update(kw)
            try:
                fusedmoe.fused_experts(args["x"], args["w13"], args["w2"], args["tw"], args["ids"])
                print("taken")
            except (TypeError, ValueError) as e:
                print(type(e).__name__, str(e).split(";")[0])
    """)
    head = "ValueError hidden_states [T, H], w13 [E, 2I, H] and w2 [E, H, I] disagree: got "
    assert lines == [
        head + "hidden_states [1, 128], w13 [6, 64, 128], w2 [6000000, 128, 32]",
        head + "hidden_states [1, 128], w13 [6, 64, 128], w2 [6, 128, 1000000]",
        head + "hidden_states [1, 750000000], w13 [6, 64, 128], w2 [6, 128, 32]",
        "ValueError topk_weights and topk_ids: expected the same [T, k], got topk_weights "
        "[1, 750000000] and topk_ids [1, 2]",
        "ValueError topk_weights and topk_ids: expected the same [T, k], got topk_weights "
        "[1, 2] and topk_ids [1, 300000000]"], lines
    assert peak_mb < 1000, f"peak memory {peak_mb} MB"


def test_bad_options_are_refused_before_the_weights_are_copied():
    """A bad activation, swiglu_alpha / swiglu_limit, compute_dtype or
    w13_layout is named before right-shaped views of the weights are copied
    (session 28's focused trial: after 4.3 GB of copies). The views below are
    ~3 GB if copied."""
    lines, peak_mb = _fresh_interpreter("""
        E = 2 * 10**5
        w13v = np.broadcast_to(np.float32(0.01), (E, 64, 128))
        w2v = np.broadcast_to(np.float32(0.01), (E, 128, 32))
        ids0 = np.zeros((1, 2), np.int32)
        for kw in (dict(activation="bogus"), dict(swiglu_alpha=2.0),
                   dict(compute_dtype="f64"), dict(w13_layout="interleaved")):
            try:
                fusedmoe.fused_experts(x, w13v, w2v, tw, ids0, **kw)
                print("taken")
            except (TypeError, ValueError) as e:
                print(type(e).__name__, str(e).split(":")[0])
    """)
    assert lines == ["ValueError activation", "ValueError swiglu_alpha",
                     "ValueError compute_dtype", "ValueError w13_layout"], lines
    assert peak_mb < 1000, f"peak memory {peak_mb} MB"
