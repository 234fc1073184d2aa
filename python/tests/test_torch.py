"""PyTorch interop (skipped when torch is not installed): torch CPU tensors in
and out, torch.ops.fusedmoe.* custom ops (opcheck), torch.compile(fullgraph=True)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedmoe  # noqa: E402
from conftest import HF, ref_fused_experts, ref_fused_topk, ref_grouped_topk, rel_l2  # noqa: E402


@pytest.fixture
def trng(rng):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    return g


def _case(g, T=5, E=6, H=64, I=40, k=2):
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    logits = torch.randn(T, E, generator=g)
    tw, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return x, w13, w2, tw.contiguous(), ids.to(torch.int32)


def test_ops_registered():
    for name in ["fused_experts", "fused_topk", "grouped_topk", "moe_layer",
                 "moe_layer_with_routing"]:
        assert hasattr(torch.ops.fusedmoe, name)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_fused_experts_torch(trng, wdtype):
    x, w13, w2, tw, ids = _case(trng)
    w13, w2 = w13.to(wdtype), w2.to(wdtype)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids.to(torch.int64))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == x.shape
    ref = ref_fused_experts(x.numpy(), w13.float().numpy(), w2.float().numpy(), tw.numpy(),
                            ids.numpy())
    assert rel_l2(out.numpy(), ref) <= 1e-5
    # the NumPy path gives the same bits
    if wdtype == torch.float32:
        np.testing.assert_array_equal(
            fusedmoe.fused_experts(x.numpy(), w13.numpy(), w2.numpy(), tw.numpy(), ids.numpy()),
            out.numpy())


def test_fused_experts_fast_path_is_cuda_only(trng):
    """_fused_experts_fast (the plain CUDA call) declines host tensors and
    NumPy arrays: they take the general path (test_cuda.py covers CUDA)."""
    x, w13, w2, tw, ids = _case(trng)
    bf = [a.to(torch.bfloat16) for a in (x, w13, w2)]
    for args in ((*bf, tw, ids), (x.numpy(), w13.numpy(), w2.numpy(), tw.numpy(), ids.numpy())):
        assert fusedmoe._fused_experts_fast(*args, "silu", None, None, False, None, 1.702, 7.0,
                                            "standard") is None


def test_fused_experts_mixed_weight_dtypes_is_a_type_error(trng):
    x, w13, w2, tw, ids = _case(trng)
    with pytest.raises(TypeError, match=r"w2: expected the dtype of w13 \(bf16\), got f32"):
        fusedmoe.fused_experts(x, w13.to(torch.bfloat16), w2, tw, ids)


def test_routing_torch(trng):
    logits = torch.randn(9, 16, generator=trng)
    w, ids = fusedmoe.fused_topk(None, logits.to(torch.bfloat16), 4, True, "sigmoid")
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    rw, rids = ref_fused_topk(logits.to(torch.bfloat16).float().numpy(), 4, True, "sigmoid")
    np.testing.assert_array_equal(ids.numpy(), rids)
    assert rel_l2(w.numpy(), rw) <= 1e-6
    bias = torch.randn(16, generator=trng)
    w, ids = fusedmoe.grouped_topk(logits, 4, True, 4, 2, "sigmoid", bias, 2.5)
    rw, rids = ref_grouped_topk(logits.numpy(), 4, True, 4, 2, "sigmoid", bias.numpy(), 2.5)
    np.testing.assert_array_equal(ids.numpy(), rids)
    assert rel_l2(w.numpy(), rw) <= 1e-6


def test_layer_torch_matches_numpy(trng):
    layer = fusedmoe.MoELayer.from_pretrained(HF / "qwen2_moe", layer=1)
    x = torch.randn(7, layer.hidden_size, generator=trng, requires_grad=True)
    out = layer(x).detach()  # inference only: no autograd formula is registered
    assert isinstance(out, torch.Tensor) and out.shape == (7, layer.hidden_size)
    np.testing.assert_array_equal(out.numpy(), layer(x.detach().numpy()))
    out2, ids, w, logits = layer(x, return_routing=True)
    np.testing.assert_array_equal(out2.detach().numpy(), out.numpy())
    assert ids.dtype == torch.int32 and logits.shape == (7, layer.num_router_logits)


def test_opcheck(trng):
    x, w13, w2, tw, ids = _case(trng)
    torch.library.opcheck(torch.ops.fusedmoe.fused_experts.default, (x, w13, w2, tw, ids))
    logits = torch.randn(5, 8, generator=trng)
    torch.library.opcheck(torch.ops.fusedmoe.fused_topk.default, (logits, 2, True))
    torch.library.opcheck(torch.ops.fusedmoe.grouped_topk.default, (logits, 2, True, 4, 2))
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    xs = torch.randn(3, layer.hidden_size, generator=trng)
    torch.library.opcheck(torch.ops.fusedmoe.moe_layer.default, (xs, layer._op_id, None))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(trng, backend):
    x, w13, w2, tw, ids = _case(trng, T=4, E=8, k=2)
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=1)

    def f(hidden, gating):
        weights, topk_ids = fusedmoe.fused_topk(hidden, gating, 2, True)
        routed = fusedmoe.fused_experts(hidden, w13, w2, weights, topk_ids)
        return routed * 2.0 + 1.0

    def g(hidden):
        return layer(hidden) - hidden

    torch._dynamo.reset()
    gating = torch.randn(4, 8, generator=trng)
    cf = torch.compile(f, fullgraph=True, backend=backend)
    np.testing.assert_allclose(cf(x, gating).numpy(), f(x, gating).numpy(), rtol=0, atol=0)
    xl = torch.randn(6, layer.hidden_size, generator=trng)
    cg = torch.compile(g, fullgraph=True, backend=backend)
    np.testing.assert_allclose(cg(xl).numpy(), g(xl).numpy(), rtol=0, atol=0)


def test_torch_compile_one_function_over_several_layers(trng):
    """A compiled function taking the layer as an argument, called with one
    layer after another: the op's layer id was an int, which torch.compile
    made a SymInt at the second layer, and the fake implementation failed
    ("unhashable type: non-nested SymInt", trial). Now a string: one graph a
    layer, each the layer's own output."""
    layers = [fusedmoe.MoELayer.from_pretrained(HF / "qwen2_moe", layer=i) for i in (0, 1)]
    layers.append(fusedmoe.MoELayer.from_pretrained(HF / "qwen2_moe", layer=0))

    def f(hidden, moe):
        return moe(hidden) * 2.0

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, layers[0].hidden_size, generator=trng)
    for moe in layers:
        np.testing.assert_array_equal(cf(x, moe).numpy(), f(x, moe).numpy())


@pytest.mark.skipif(not torch.cuda.is_available() or fusedmoe.cuda_built,
                    reason="needs a CUDA device and a fusedmoe built without CUDA")
def test_cuda_tensors_raise_without_cuda_backend():
    x = torch.randn(2, 16, device="cuda")
    with pytest.raises(NotImplementedError, match="hidden_states"):
        fusedmoe.fused_experts(x, torch.randn(2, 8, 16, device="cuda"),
                               torch.randn(2, 16, 4, device="cuda"),
                               torch.ones(2, 1, device="cuda"),
                               torch.zeros(2, 1, dtype=torch.int32, device="cuda"))


def test_fused_experts_mixed_numpy_and_torch_is_a_type_error(trng):
    x, w13, w2, tw, ids = _case(trng)
    with pytest.raises(TypeError, match="hidden_states: expected a torch.Tensor"):
        fusedmoe.fused_experts(x.numpy(), w13, w2, tw, ids)
    with pytest.raises(TypeError, match="topk_ids: expected a torch.Tensor"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids.numpy())


def test_torch_imports_after_fusedmoe():
    """Either import order works: a CUDA build of the extension links the CUDA
    toolkit's libnccl.so.2, and loaded first it left torch's libtorch_cuda
    without the newer NCCL symbols it needs (ImportError on ``import torch``);
    fusedmoe now loads torch's NCCL wheel first where it is installed."""
    import subprocess
    import sys

    code = ("import fusedmoe\n"
            "import torch\n"
            "assert fusedmoe._torch is torch, fusedmoe._torch\n")
    env = {k: v for k, v in os.environ.items() if k != "FUSEDMOE_NO_TORCH"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_unsigned_torch_ids_are_converted_or_named(trng):
    """torch's uint16 / uint32 / uint64 topk_ids are converted as the other
    integer dtypes are; values beyond int32 are named. They raised torch's
    'min_all not implemented for UInt64', naming no argument (trial)."""
    x, w13, w2, tw, ids = _case(trng)
    want = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    for dt in (getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)):
        assert torch.equal(fusedmoe.fused_experts(x, w13, w2, tw, ids.to(dt)), want), dt
    if hasattr(torch, "uint64"):
        big = ids.to(torch.int64)
        big[0, 0] = 2**40
        with pytest.raises(ValueError, match=r"^topk_ids: values must fit int32, got range "
                                             r"\[\d+, 1099511627776\] \(torch.uint64\)$"):
            fusedmoe.fused_experts(x, w13, w2, tw, big.to(torch.uint64))
        big[0, 0] = -1  # 2^64 - 1 as uint64
        with pytest.raises(ValueError, match=r"^topk_ids: values must fit int32, got values "
                                             r">= 2\^63 \(torch.uint64\)$"):
            fusedmoe.fused_experts(x, w13, w2, tw, big.to(torch.uint64))


def test_select_experts_with_torch_logits_takes_torch_arguments_only():
    """Torch router_logits: a NumPy token_ids, hash_table or bias is a TypeError
    naming it, as in the other functions (select_experts accepted them; trial)."""
    g = torch.zeros(2, 8)
    tab = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    tok = torch.tensor([1, 2], dtype=torch.int32)
    kw = dict(routing_method="hash", hash_vocab_size=4, num_experts=8)
    with pytest.raises(TypeError, match=r"^token_ids: expected a torch.Tensor like router_logits"):
        fusedmoe.select_experts(g, 2, token_ids=tok.numpy(), hash_table=tab, **kw)
    with pytest.raises(TypeError, match=r"^hash_table: expected a torch.Tensor like router_logits"):
        fusedmoe.select_experts(g, 2, token_ids=tok, hash_table=tab.numpy(), **kw)
    w, ids = fusedmoe.select_experts(g, 2, token_ids=tok, hash_table=tab, **kw)
    assert isinstance(ids, torch.Tensor) and ids.tolist() == [[0, 1], [0, 1]]
    with pytest.raises(TypeError, match=r"^e_score_correction_bias: expected a torch.Tensor"):
        fusedmoe.select_experts(g, 2, scoring_func="sigmoid",
                                e_score_correction_bias=np.zeros(8, np.float32))


# ---- tracing, exporting and copying (second trial, session 22) ---------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.trace is deprecated
def test_jit_trace_records_the_ops(trng):
    """torch.jit.trace of a layer call or fused_topk: the eager fast path skipped
    the op, so the trace held only the output's allocation (values ~1e31, ids like
    251847968). Traces now record torch.ops.fusedmoe.* and replay the eager bits."""
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    h = torch.randn(3, layer.hidden_size, generator=trng)
    g = torch.randn(3, layer.num_router_logits, generator=trng)
    with torch.no_grad():
        tr = torch.jit.trace(lambda a: layer(a), (h,), check_trace=False)
        tk = torch.jit.trace(lambda a: fusedmoe.fused_topk(None, a, 2, True), (g,),
                             check_trace=False)
    h2 = torch.randn(3, layer.hidden_size, generator=trng)  # not the traced input
    assert torch.equal(tr(h2), layer(h2))
    w, i = tk(g)
    w_eager, i_eager = fusedmoe.fused_topk(None, g, 2, True)
    assert torch.equal(i, i_eager) and torch.equal(w, w_eager)


def test_negative_and_conjugate_views_are_resolved(trng):
    """A tensor with its lazy negation bit set (torch._neg_view) is contiguous
    and went to DLPack as is, which drops the bit: the result was x's, not -x's."""
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    x = torch.randn(3, layer.hidden_size, generator=trng)
    neg = torch._neg_view(x.clone())
    assert neg.is_neg() and neg.is_contiguous()
    assert torch.equal(layer(neg), layer(-x))
    c = _case(trng)
    assert torch.equal(fusedmoe.fused_experts(torch._neg_view(c[0].clone()), *c[1:]),
                       fusedmoe.fused_experts(-c[0], *c[1:]))


def test_layers_are_not_copied_but_can_be_shared():
    """copy.deepcopy / pickle of a layer: a TypeError that says why and how to
    share it (it was 'cannot pickle MoELayer object')."""
    import copy
    import pickle

    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    for f in (lambda: copy.deepcopy(layer), lambda: pickle.dumps(layer), lambda: copy.copy(layer)):
        with pytest.raises(TypeError, match=r"^MoELayer cannot be pickled or copied: .* "
                                             r"copy\.deepcopy\(module, memo=\{id\(layer\): "
                                             r"layer\}\)$"):
            f()
    m = torch.nn.Module()
    m.moe = layer
    assert copy.deepcopy(m, memo={id(layer): layer}).moe is layer


def test_a_layer_id_of_another_process_is_an_error(trng):
    """A torch.export program names its layers by MoELayer._op_id; loaded in
    another process it ran whichever layer had the same number there. The id now
    carries a process tag: another process's id is an error saying so."""
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    n, tag = layer._op_id.split("@")
    h = torch.randn(2, layer.hidden_size, generator=trng)
    assert torch.equal(torch.ops.fusedmoe.moe_layer(h, layer._op_id, None), layer(h))
    with pytest.raises(ValueError, match=r"^layer_id: no live fusedmoe.MoELayer with id "
                                         r"'\d+@0{16}' \(a layer of another process: a "
                                         r"torch.export program"):
        torch.ops.fusedmoe.moe_layer(h, f"{n}@{'0' * 16}", None)


def test_fx_symbolic_trace_is_named():
    """torch.fx.symbolic_trace passes Proxies, which have every attribute: the
    error was 'shape Proxy(getattr_1) is not a sequence of integers'."""
    layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)

    class Mod(torch.nn.Module):
        def forward(self, a):
            return layer(a)

    with pytest.raises(TypeError, match=r"^hidden_states: a torch.fx Proxy: "
                                        r"torch.fx.symbolic_trace cannot trace into"):
        torch.fx.symbolic_trace(Mod())


def test_compiled_topk_checks_as_eager(trng):
    """Under torch.compile: a bf16 hidden_states on the CPU raised Dynamo's
    internal error (np.dtype(torch.bfloat16) inside the wrapper), and
    renormalize=1 was accepted (the op's schema takes it); both now as eager."""
    g = torch.randn(3, 8, generator=trng)
    f = torch.compile(lambda a, l: fusedmoe.fused_topk(a, l, 2, True))
    with pytest.raises(TypeError, match=r"^hidden_states: expected dtype float32, got bfloat16$"):
        f(torch.randn(3, 4).bfloat16(), g)
    # fullgraph=True wraps it in Dynamo's own error, which names the TypeError
    # and its message (as TypeError('...') in torch 2.15, TypeError([ConstantVariable(str:
    # '...')]) in 2.11).
    with pytest.raises(Exception, match=r"(?s)TypeError.*'hidden_states: expected dtype float32, "
                                        r"got bfloat16'"):
        torch.compile(lambda a, l: fusedmoe.fused_topk(a, l, 2, True),
                      fullgraph=True)(torch.randn(3, 4).bfloat16(), g)
    with pytest.raises(TypeError, match=r"^renormalize: expected a bool"):
        torch.compile(lambda l: fusedmoe.fused_topk(None, l, 2, 1))(g)
