"""The CUDA backend from Python (torch CUDA tensors, CuPy arrays): HF fixtures
through MoELayer(backend="cuda") against transformers' float64 output, the
functional ops against float64 NumPy references, device/dtype errors, the
caller's stream, torch.compile(fullgraph=True) and CUDA-graph capture/replay.
Skipped (with the reason shown) without torch, a CUDA device, or a fusedmoe
built with the CUDA backend."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedmoe  # noqa: E402
from conftest import (ARCHS, HF, bf16_to_f32, read_safetensors, ref_fused_experts,  # noqa: E402
                      ref_fused_topk, ref_grouped_topk, rel_l2, write_safetensors)
from test_hf_fixtures import CASES  # noqa: E402


pytestmark = pytest.mark.usefixtures("need_cuda")


@pytest.fixture
def g(rng):
    return torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))


def _bf16_exact(x: torch.Tensor) -> np.ndarray:
    """The float64 values of a bf16 tensor (what the kernels read)."""
    return x.float().cpu().numpy().astype(np.float64)


def _case(g, T=5, E=8, H=64, I=48, k=2, hidden_dtype=torch.float32, bias=False):
    x = torch.randn(T, H, generator=g, device="cuda").to(hidden_dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g, device="cuda")
    tw, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    b13 = torch.randn(E, 2 * I, generator=g, device="cuda") * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g, device="cuda") * 0.1 if bias else None
    return x, w13, w2, tw.contiguous(), ids.to(torch.int32), b13, b2


def _ref(x, w13, w2, tw, ids, b13=None, b2=None, activation="silu", on_input=False):
    return ref_fused_experts(
        x.float().cpu().numpy(), _bf16_exact(w13), _bf16_exact(w2), tw.cpu().numpy(),
        ids.cpu().numpy(), activation,
        None if b13 is None else b13.cpu().numpy().astype(np.float64),
        None if b2 is None else b2.cpu().numpy().astype(np.float64), on_input)


# ---- HF fixtures through MoELayer(backend="cuda") ---------------------------------

_layers: dict = {}


def _cuda_layer(arch, layer):
    key = (arch, layer)
    if key not in _layers:
        _layers[key] = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, backend="cuda",
                                                         max_num_tokens=128)
    return _layers[key]


@pytest.mark.parametrize("arch,layer,T", CASES)
def test_hf_fixture_cuda_layer_matches_transformers_f64(arch, layer, T):
    ref = read_safetensors(HF / arch / "reference.safetensors")
    p = f"layers.{layer}.T{T}."
    moe = _cuda_layer(arch, layer)
    assert moe.backend == "cuda" and moe.device == "cuda:0" and moe.compute_dtype == "bf16"
    want = ref[p + "output_f64"]
    x = torch.from_numpy(ref[p + "input"]).cuda()
    # HF's router logits (no routing flips from the bf16/f32 gate GEMM), then our own gate
    out = moe(x, router_logits=torch.from_numpy(ref[p + "router_logits"]).cuda())
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == x.shape
    err = rel_l2(out.cpu().numpy(), want)
    assert err <= 1e-2, f"{arch} layer {layer} T={T}: relative L2 error {err:.3g} (HF logits)"
    out2, ids, w, logits = moe(x, return_routing=True)
    assert ids.is_cuda and ids.dtype == torch.int32 and ids.shape == (T, moe.top_k)
    assert rel_l2(logits.cpu().numpy(), ref[p + "router_logits"]) <= 1e-5
    err = rel_l2(out2.cpu().numpy(), want)
    assert err <= 1e-2, f"{arch} layer {layer} T={T}: relative L2 error {err:.3g} (own gate)"
    # bf16 hidden states in, bf16 out
    xb = x.to(torch.bfloat16)
    ob = moe(xb, router_logits=torch.from_numpy(ref[p + "router_logits"]).cuda())
    assert ob.dtype == torch.bfloat16
    assert rel_l2(ob.float().cpu().numpy(), want) <= 2e-2  # the input itself is rounded to bf16


def test_layers_sharing_a_cuda_workspace_match_their_own():
    """Every fixture layer of every architecture through one CudaWorkspace,
    called in turn on one stream: the outputs of layers with workspaces of
    their own, bit for bit; the workspace is one block of the largest layer's
    scratch when that layer is built first."""
    built = [(arch, layer, fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer,
                                                             backend="cuda", max_num_tokens=128))
             for arch, layer in sorted({(a, l) for a, l, _ in CASES})]
    built.sort(key=lambda b: -b[2].workspace_nbytes)  # the largest first: one block
    ws = fusedmoe.CudaWorkspace()
    assert ws.nbytes == 0 and ws.device == -1 and "CudaWorkspace" in repr(ws)
    shared = [fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, backend="cuda",
                                                max_num_tokens=128, workspace=ws)
              for arch, layer, _ in built]
    assert ws.device == 0
    assert ws.nbytes == -(-built[0][2].workspace_nbytes // 256) * 256
    assert [s.workspace_nbytes for s in shared] == [b[2].workspace_nbytes for b in built]
    for rep in range(2):
        for (arch, layer, own), sh in zip(built, shared):
            ref = read_safetensors(HF / arch / "reference.safetensors")
            T = 64 if rep == 0 else 7
            x = torch.from_numpy(ref[f"layers.{layer}.T64.input"][:T]).cuda()
            a, b = sh(x), own(x)
            assert torch.equal(a, b), f"{arch} layer {layer} T={T}: shared workspace differs"


def test_cuda_workspace_reserve_and_errors():
    ws = fusedmoe.CudaWorkspace()
    ws.reserve(1 << 20)
    assert ws.nbytes == 1 << 20 and ws.device == 0
    ws.reserve(1000)  # smaller: unchanged
    assert ws.nbytes == 1 << 20
    with pytest.raises(ValueError, match="nbytes"):
        ws.reserve(-1)
    with pytest.raises(TypeError, match="workspace: expected a fusedmoe.CudaWorkspace"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cuda", workspace=1)
    with pytest.raises(ValueError, match="workspace: a CudaWorkspace serves CUDA layers only"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cpu", workspace=ws)


def test_every_fixture_runs_on_cuda():
    assert len({a for a, _, _ in CASES}) == len(ARCHS) == 7


# ---- functional ops ----------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_cuda_matches_f64_reference(g, T, activation, hidden_dtype):
    bias = activation == "swiglu_oai"
    x, w13, w2, tw, ids, b13, b2 = _case(g, T=T, E=8, H=64, I=48, k=2, hidden_dtype=hidden_dtype,
                                         bias=bias)
    if T > 3:
        ids[2, 1] = -1  # a slot with no expert
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids, activation, b13, b2)
    assert out.is_cuda and out.dtype == hidden_dtype and out.shape == x.shape
    err = rel_l2(out.float().cpu().numpy(), _ref(x, w13, w2, tw, ids, b13, b2, activation))
    assert err <= 1e-2, err
    # int64 ids and a non-contiguous (row-strided) input take the same path
    xs = torch.empty(T, 2 * x.shape[1], device="cuda", dtype=hidden_dtype)[:, :x.shape[1]]
    xs.copy_(x)
    out2 = fusedmoe.fused_experts(xs, w13, w2, tw, ids.long(), activation, b13, b2)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


@pytest.mark.parametrize("T,E,k", [(7, 8, 2), (300, 16, 8)])  # 300: the sm90 path on an H200
@pytest.mark.parametrize("hidden_dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_fused_experts_cuda_float16_weights(g, T, E, k, hidden_dtype):
    x, w13, w2, tw, ids, b13, b2 = _case(g, T=T, E=E, H=64, I=48, k=k, hidden_dtype=hidden_dtype,
                                         bias=True)
    w13h, w2h = w13.to(torch.float16), w2.to(torch.float16)  # bf16 values: exact in f16
    out = fusedmoe.fused_experts(x, w13h, w2h, tw, ids, "silu", b13, b2)
    assert out.is_cuda and out.dtype == hidden_dtype and out.shape == x.shape
    xr = x.half() if hidden_dtype != torch.float16 else x  # the expert input is rounded to f16
    err = rel_l2(out.float().cpu().numpy(), _ref(xr, w13h, w2h, tw, ids, b13, b2))
    assert err <= 1e-2, err
    # bf16 weights with f16 activations: converted to bf16
    if hidden_dtype == torch.float16:
        outb = fusedmoe.fused_experts(x, w13, w2, tw, ids, "silu", b13, b2)
        assert outb.dtype == torch.float16
        assert rel_l2(outb.float().cpu().numpy(), _ref(x, w13, w2, tw, ids, b13, b2)) <= 1e-2
    with pytest.raises(TypeError, match="w2"):
        fusedmoe.fused_experts(x, w13h, w2, tw, ids)  # mixed weight dtypes
    with pytest.raises(ValueError, match="compute_dtype"):
        fusedmoe.fused_experts(x, w13h, w2h, tw, ids, compute_dtype="bf16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 40, 600])
def test_fused_experts_fast_path_matches_the_general_path(g, dtype, T):
    """The plain CUDA call (_fused_experts_fast: a few µs of Python) gives the
    general path's bits; any other call falls back to the general path."""
    x, w13, w2, tw, ids, b13, b2 = _case(g, T=T, E=8, H=256, I=256, k=2, hidden_dtype=dtype,
                                         bias=True)
    w13, w2 = w13.to(dtype), w2.to(dtype)
    ids[0, 1] = -1

    def fast(x, w13, w2, tw, ids, act="silu", b13=None, b2=None, on_input=False, cd=None,
             layout="standard"):
        return fusedmoe._fused_experts_fast(x, w13, w2, tw, ids, act, b13, b2, on_input, cd,
                                            1.702, 7.0, layout)

    def general(x, w13, w2, tw, ids, act="silu", b13=None, b2=None, on_input=False,
                layout="standard"):
        return fusedmoe._fused_experts_impl(x, w13, w2, tw, ids, act, b13, b2, on_input, None,
                                            None, 1.702, 7.0, layout)

    w13i = fusedmoe.interleave_w13(w13)
    for args, layout in (((x, w13, w2, tw, ids), "standard"),
                         ((x, w13, w2, tw, ids, "swiglu_oai", b13, b2), "standard"),
                         ((x, w13i, w2, tw, ids, "gelu", b13, b2), "interleaved128")):
        out = fast(*args, layout=layout)
        assert out is not None and out.dtype == dtype and out.shape == x.shape
        want = general(*args, layout=layout)
        assert torch.equal(out, want) and not want.isnan().any()
        assert torch.equal(fusedmoe.fused_experts(*args, w13_layout=layout), want)
        assert torch.equal(torch.ops.fusedmoe.fused_experts(*args, w13_layout=layout), want)
    # nn.Parameter weights that require grad, with grad off: the fast path (detached)
    p13, p2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    with torch.no_grad():
        assert fast(x, p13, p2, tw, ids) is not None
        assert torch.equal(fusedmoe.fused_experts(x, p13, p2, tw, ids),
                           general(x, w13, w2, tw, ids))
    assert fast(x, p13, p2, tw, ids) is None  # grad on: the op (its autograd refuses a backward)
    # top_k = 1 with the weight on the input (Llama-4)
    tw1, ids1 = tw[:, :1].contiguous(), ids[:, :1].contiguous()
    assert torch.equal(fast(x, w13, w2, tw1, ids1, on_input=True),
                       general(x, w13, w2, tw1, ids1, on_input=True))
    # Not plain: None, and fused_experts takes the general path (its result or its error).
    xs = torch.empty(T, 2 * x.shape[1], device="cuda", dtype=dtype)[:, :x.shape[1]]
    xs.copy_(x)
    xc = torch.empty(T, 2 * x.shape[1], device="cuda", dtype=dtype)[:, ::2]  # column-strided
    xc.copy_(x)
    for a, kw in (((x.float(), w13, w2, tw, ids), {}), ((xc, w13, w2, tw, ids), {}),
                  ((x, w13, w2, tw, ids.long()), {}), ((x, w13, w2, tw.double(), ids), {}),
                  ((x, w13.float(), w2, tw, ids), {}), ((x.cpu(), w13, w2, tw, ids), {}),
                  ((x, w13, w2, tw, ids, "relu"), {}), ((x, w13, w2, tw, ids), {"cd": "f32"}),
                  ((x, w13, w2, tw, ids), {"on_input": True}),
                  ((x, w13, w2, tw, ids), {"layout": "interleaved"})):
        assert fast(*a, **kw) is None
    for xn in (xs, xc):  # one row is contiguous whatever its stride: xs is plain at T = 1
        torch.testing.assert_close(fusedmoe.fused_experts(xn, w13, w2, tw, ids.long()),
                                   general(x, w13, w2, tw, ids), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="apply_router_weight_on_input"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="activation"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, "relu")


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_layer_fast_path_matches_the_general_path(g, arch):
    """A CUDA layer's plain call (MoELayer._forward_fast: a few µs of Python)
    gives the general path's bits; any other call falls back to the general
    path, with its result or its error."""
    moe = _cuda_layer(arch, 1)
    H = moe.hidden_size
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for T in (1, 7, 128):
            x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
            out = moe._forward_fast(x)
            assert out is not None and out.dtype == dtype and out.shape == (T, H)
            want = moe._forward(x, None, None, False)
            assert torch.equal(out, want) and not want.isnan().any()
            assert torch.equal(moe(x), want)
    x = torch.randn(5, H, generator=g, device="cuda")
    want = moe._forward(x, None, None, False)
    xs = torch.empty(5, 2 * H, device="cuda")[:, :H]  # strided rows
    xs.copy_(x)
    xr = x.clone().requires_grad_()
    for xn in (xs, x.cpu(), x.double(), x[:, :H - 1], x[:0], x.unsqueeze(0),
               torch.randn(129, H, device="cuda"), torch.nn.Parameter(x)):
        assert moe._forward_fast(xn) is None
    assert moe._forward_fast(xr) is None  # grad to record: the op
    with torch.no_grad():
        assert torch.equal(moe._forward_fast(xr), want)
    assert torch.equal(moe(xs), want)  # the general path takes strided rows
    with pytest.raises(ValueError, match="hidden_states"):
        moe(x.cpu())
    with pytest.raises(ValueError, match="128"):
        moe(torch.randn(129, H, device="cuda"))
    assert moe(x[:0]).shape == (0, H)
    # Options other than hidden_states: the general path.
    out, ids, weights, logits = moe(x, return_routing=True)
    assert torch.equal(out, want)
    assert torch.equal(moe(x, logits), want)


# T = 1: the decode kernels; 40 (10 rows an expert): the grouped GEMMs; 600 (150 rows an
# expert): the sm90 path on an H200, where the activation runs in the w13 GEMM's epilogue.
@pytest.mark.parametrize("T", [1, 40, 600])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_fused_experts_cuda_interleaved128_w13(g, T, activation):
    x, w13, w2, tw, ids, b13, b2 = _case(g, T=T, E=8, H=256, I=256, k=2, bias=True)
    w13i = fusedmoe.interleave_w13(w13)
    assert w13i.is_cuda and w13i.dtype == w13.dtype and w13i.shape == w13.shape
    assert torch.equal(w13i.cpu(), fusedmoe.interleave_w13(w13.cpu()))
    ref = _ref(x, w13, w2, tw, ids, b13, b2, activation)
    want = fusedmoe.fused_experts(x, w13, w2, tw, ids, activation, b13, b2)
    # the biases stay in the standard order
    got = fusedmoe.fused_experts(x, w13i, w2, tw, ids, activation, b13, b2,
                                 w13_layout="interleaved128")
    assert got.is_cuda and got.dtype == x.dtype and got.shape == x.shape
    err_std, err = (rel_l2(o.float().cpu().numpy(), ref) for o in (want, got))
    assert err_std <= 1e-2 and err <= 1e-2, (err_std, err)
    # the layout reaches the kernels: the interleaved rows read as standard ones are wrong
    wrong = fusedmoe.fused_experts(x, w13i, w2, tw, ids, activation, b13, b2)
    assert rel_l2(wrong.float().cpu().numpy(), ref) > 0.1
    # the torch op, and (once) a torch.compile(fullgraph=True) function calling fused_experts
    op = torch.ops.fusedmoe.fused_experts(x, w13i, w2, tw, ids, activation, b13, b2,
                                          w13_layout="interleaved128")
    torch.testing.assert_close(op, got, rtol=0, atol=0)
    if T == 40 and activation == "silu":
        torch._dynamo.reset()
        f = torch.compile(lambda *a: fusedmoe.fused_experts(*a, w13_layout="interleaved128"),
                          fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(f(x, w13i, w2, tw, ids, activation, b13, b2), got,
                                   rtol=0, atol=0)


def test_interleave_w13_cupy(g):
    cupy = pytest.importorskip("cupy")
    w13 = _case(g, T=1, E=2, H=16, I=256)[1]
    cw13 = cupy.from_dlpack(w13.view(torch.int16)).view(cupy.uint16)  # bf16 bit patterns
    got = fusedmoe.interleave_w13(cw13)
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.uint16 and got.shape == cw13.shape
    assert got.data.ptr != cw13.data.ptr and got.device.id == cw13.device.id
    want = fusedmoe.interleave_w13(w13).view(torch.int16).cpu().numpy().view(np.uint16)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_fused_experts_cuda_interleaved128_needs_i_multiple_of_128(g):
    x, w13, w2, tw, ids, _, _ = _case(g, T=4, E=4, H=64, I=48, k=2)
    with pytest.raises(ValueError, match=r'^w13_layout: "interleaved128" needs the intermediate '
                                         r'size I a multiple of 128, got I = 48'):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, w13_layout="interleaved128")
    with pytest.raises(ValueError, match='^w13_layout: expected "standard" or "interleaved128", '
                                         'got "interleaved"'):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, w13_layout="interleaved")
    with pytest.raises(ValueError, match=r"^w13: .*multiple of 128 .*got I = 48"):
        fusedmoe.interleave_w13(w13)


def test_hf_fixture_cuda_layer_float16():
    arch, layer, T = next(c for c in CASES if c[0] == "mixtral")
    ref = read_safetensors(HF / arch / "reference.safetensors")
    moe = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, backend="cuda", dtype="f16",
                                            max_num_tokens=128)
    assert moe.compute_dtype == "f16"
    p = f"layers.{layer}.T{T}."
    x = torch.from_numpy(ref[p + "input"]).cuda()
    logits = torch.from_numpy(ref[p + "router_logits"]).cuda()
    out = moe(x.half(), router_logits=logits)
    assert out.dtype == torch.float16 and out.shape == x.shape
    assert rel_l2(out.float().cpu().numpy(), ref[p + "output_f64"]) <= 1e-2
    out32 = moe(x, router_logits=logits)
    assert out32.dtype == torch.float32
    assert rel_l2(out32.cpu().numpy(), ref[p + "output_f64"]) <= 1e-2


def test_float16_checkpoint_stays_float16_on_cuda(tmp_path):
    """A float16 checkpoint (the mixtral fixture's bf16 weights, exact in f16):
    MoELayer(backend="cuda") runs it in f16 by default."""
    arch, layer, T = next(c for c in CASES if c[0] == "mixtral")
    src = HF / arch
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = read_safetensors(src / "model.safetensors")
    raw = read_safetensors_raw_dtypes(src / "model.safetensors")
    write_safetensors(tmp_path / "model.safetensors",
                       {k: (bf16_to_f32(v).astype(np.float16) if raw[k] == "BF16" else v)
                        for k, v in w.items()})
    moe = fusedmoe.MoELayer.from_pretrained(tmp_path, layer=layer, backend="cuda",
                                            max_num_tokens=128)
    assert moe.compute_dtype == "f16"
    ref = read_safetensors(src / "reference.safetensors")
    p = f"layers.{layer}.T{T}."
    x = torch.from_numpy(ref[p + "input"]).cuda()
    out = moe(x, router_logits=torch.from_numpy(ref[p + "router_logits"]).cuda())
    assert rel_l2(out.cpu().numpy(), ref[p + "output_f64"]) <= 1e-2


def read_safetensors_raw_dtypes(path) -> dict:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return {k: e["dtype"] for k, e in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}


def test_fused_experts_cuda_w13_shape_error_expects_what_w2_implies(g):
    """As on the CPU: a w13 that cannot be [E, 2I, H] is named with w2's sizes
    (it named w2, expecting [4, 32, 15] from w13's own 31 rows)."""
    x, w13, w2, tw, ids, _, _ = _case(g, T=3, E=4, H=32, I=16, k=2)
    with pytest.raises(ValueError, match=r"^w13: expected .*\[4, 32, 32\].*\[4, 31, 32\]"):
        fusedmoe.fused_experts(x, w13[:, :-1].contiguous(), w2, tw, ids)


def test_fused_experts_cuda_qwen3_shape_and_router_weight_on_input(g):
    x, w13, w2, tw, ids, _, _ = _case(g, T=3, E=128, H=2048, I=768, k=8)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    assert rel_l2(out.cpu().numpy(), _ref(x, w13, w2, tw, ids)) <= 1e-2
    x, w13, w2, tw, ids, _, _ = _case(g, T=6, E=4, H=32, I=16, k=1)
    out = fusedmoe.fused_experts(x, w13, w2, tw, ids, apply_router_weight_on_input=True)
    err = rel_l2(out.cpu().numpy(), _ref(x, w13, w2, tw, ids, on_input=True))
    assert err <= 1e-2, err


def test_fused_experts_cuda_on_a_side_stream(g):
    x, w13, w2, tw, ids, _, _ = _case(g, T=16)
    want = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    s.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_routing_cuda_matches_reference(g):
    logits = torch.randn(9, 16, generator=g, device="cuda")
    w, ids = fusedmoe.fused_topk(None, logits, 4, True, "sigmoid")
    assert w.is_cuda and ids.is_cuda and ids.dtype == torch.int32
    rw, rids = ref_fused_topk(logits.cpu().numpy(), 4, True, "sigmoid")
    np.testing.assert_array_equal(ids.cpu().numpy(), rids)
    assert rel_l2(w.cpu().numpy(), rw) <= 1e-6
    bias = torch.randn(16, generator=g, device="cuda")
    w, ids = fusedmoe.grouped_topk(logits, 4, True, 4, 2, "sigmoid", bias, 2.5)
    rw, rids = ref_grouped_topk(logits.cpu().numpy(), 4, True, 4, 2, "sigmoid",
                                bias.cpu().numpy(), 2.5)
    np.testing.assert_array_equal(ids.cpu().numpy(), rids)
    assert rel_l2(w.cpu().numpy(), rw) <= 1e-6
    # the same as the CPU routers, any router of the library
    for fields in [dict(routing_method="topk_softmax", renormalize=False),
                   dict(routing_method="topk", scoring_func="sqrtsoftplus", renormalize=True)]:
        wc, ic = fusedmoe.select_experts(logits.cpu(), 3, **fields)
        wg, ig = fusedmoe.select_experts(logits, 3, **fields)
        np.testing.assert_array_equal(ig.cpu().numpy(), ic.numpy())
        assert rel_l2(wg.cpu().numpy(), wc.numpy()) <= 1e-6


def test_routing_cuda_zero_experts_hash_and_layer_config(rng):
    T, E, Z, k = 12, 8, 2, 3
    logits = torch.from_numpy(rng.standard_normal((T, E + Z)).astype(np.float32)).cuda()
    w, ids = fusedmoe.select_experts(logits, k, num_zero_experts=Z)
    wc, ic = fusedmoe.select_experts(logits.cpu(), k, num_zero_experts=Z)
    np.testing.assert_array_equal(ids.cpu().numpy(), ic.numpy())
    assert rel_l2(w.cpu().numpy(), wc.numpy()) <= 1e-6
    vocab = 50
    table = np.stack([rng.permutation(E)[:k] for _ in range(vocab)]).astype(np.int32)
    tokens = rng.integers(0, vocab, size=T).astype(np.int64)
    w, ids = fusedmoe.select_experts(logits[:, :E], k, routing_method="hash",
                                     hash_vocab_size=vocab,
                                     hash_table=torch.from_numpy(table).cuda(),
                                     token_ids=torch.from_numpy(tokens).cuda())
    assert ids.is_cuda
    np.testing.assert_array_equal(ids.cpu().numpy(), table[tokens])
    np.testing.assert_allclose(w.cpu().numpy(), 1.0 / k, rtol=1e-7)
    moe = _cuda_layer("qwen3_moe", 0)
    lg = torch.from_numpy(rng.standard_normal((4, moe.num_experts)).astype(np.float32)).cuda()
    w, ids = fusedmoe.select_experts(lg, config=moe)
    rw, rids = ref_fused_topk(lg.cpu().numpy(), moe.top_k, moe.config["renormalize"])
    np.testing.assert_array_equal(ids.cpu().numpy(), rids)
    assert rel_l2(w.cpu().numpy(), rw) <= 1e-6


def test_cupy_arrays(g):
    cupy = pytest.importorskip("cupy")
    x, w13, w2, tw, ids, _, _ = _case(g, T=4)
    want = fusedmoe.fused_experts(x, w13, w2, tw, ids)
    cx, ctw, cids = (cupy.from_dlpack(t) for t in (x, tw, ids))
    cw13 = cupy.from_dlpack(w13.view(torch.int16)).view(cupy.uint16)  # bf16 bit patterns
    cw2 = cupy.from_dlpack(w2.view(torch.int16)).view(cupy.uint16)
    got = fusedmoe.fused_experts(cx, cw13, cw2, ctw, cids, weight_dtype="bf16")
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), want.cpu().numpy())


# ---- errors ------------------------------------------------------------------------


def test_cuda_errors_name_the_argument(g):
    x, w13, w2, tw, ids, _, _ = _case(g)
    with pytest.raises(ValueError, match="w2: expected an array on cuda:0 .*got one on cpu"):
        fusedmoe.fused_experts(x, w13, w2.cpu(), tw, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids.cpu())
    with pytest.raises(ValueError, match="w13: expected an array on cpu"):
        fusedmoe.fused_experts(x.cpu(), w13, w2.cpu(), tw.cpu(), ids.cpu())
    with pytest.raises(TypeError, match="w13: the CUDA backend takes bf16"):
        fusedmoe.fused_experts(x, w13.float(), w2, tw, ids)
    with pytest.raises(TypeError, match="hidden_states"):
        fusedmoe.fused_experts(x.double(), w13, w2, tw, ids)
    # E and I come from w2 (as on the CPU): a w2 of another I disagrees with w13
    disagree = r"w13 bf16 \[8, 96, 64\] and w2 bf16 \[8, 64, 40\] disagree"
    with pytest.raises(ValueError, match=disagree):
        fusedmoe.fused_experts(x, w13, w2[:, :, :-8].contiguous(), tw, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids[:, :1].contiguous())
    with pytest.raises(ValueError, match="compute_dtype"):
        fusedmoe.fused_experts(x, w13, w2, tw, ids, compute_dtype="f32")
    with pytest.raises(ValueError, match="e_score_correction_bias: expected an array on cuda:0"):
        fusedmoe.grouped_topk(torch.randn(3, 8, device="cuda"), 2, True, 4, 2, "sigmoid",
                              torch.randn(8), 1.0)
    moe = _cuda_layer("mixtral", 0)
    with pytest.raises(ValueError, match="hidden_states: expected an array on cuda:0"):
        moe(torch.randn(2, moe.hidden_size))
    with pytest.raises(ValueError, match="router_logits"):
        moe(torch.randn(2, moe.hidden_size, device="cuda"),
            router_logits=torch.randn(2, moe.num_router_logits))
    with pytest.raises(ValueError, match="max_num_tokens"):
        moe(torch.randn(129, moe.hidden_size, device="cuda"))
    with pytest.raises(ValueError, match="dtype"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cuda", dtype="f32")
    cpu_layer = fusedmoe.MoELayer.from_pretrained(HF / "mixtral", layer=0)
    with pytest.raises(ValueError, match="hidden_states: expected an array on cpu"):
        cpu_layer(torch.randn(2, cpu_layer.hidden_size, device="cuda"))


def test_nan_router_logits_reported_by_check_errors(g):
    moe = _cuda_layer("mixtral", 0)
    x = torch.randn(5, moe.hidden_size, generator=g, device="cuda")
    logits = torch.randn(5, moe.num_router_logits, generator=g, device="cuda")
    moe(x, router_logits=logits)
    moe.check_errors()  # nothing recorded
    logits[3, 1] = float("nan")
    moe(x, router_logits=logits)  # no host sync in the call: recorded on the device
    with pytest.raises(ValueError, match="NaN at token 3"):
        moe.check_errors()
    moe.check_errors()  # reported once


def test_not_the_current_device(g):
    if torch.cuda.device_count() < 2:
        pytest.skip("skipped: needs 2 CUDA devices")
    x, w13, w2, tw, ids, _, _ = _case(g)
    with pytest.raises(ValueError, match="current CUDA device"):
        fusedmoe.fused_experts(*(t.to("cuda:1") for t in (x, w13, w2, tw, ids)))


# ---- torch.compile and CUDA graphs -----------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_cuda(g, backend):
    x, w13, w2, _, _, _, _ = _case(g, T=4, E=8, k=2)
    moe = _cuda_layer("mixtral", 1)

    def f(hidden, gating):
        weights, topk_ids = fusedmoe.fused_topk(hidden, gating, 2, True)
        return fusedmoe.fused_experts(hidden, w13, w2, weights, topk_ids) * 2.0 + 1.0

    def h(hidden):
        return moe(hidden) - hidden

    torch._dynamo.reset()
    gating = torch.randn(4, 8, generator=g, device="cuda")
    cf = torch.compile(f, fullgraph=True, backend=backend)
    torch.testing.assert_close(cf(x, gating), f(x, gating), rtol=0, atol=0)
    xl = torch.randn(6, moe.hidden_size, generator=g, device="cuda")
    ch = torch.compile(h, fullgraph=True, backend=backend)
    torch.testing.assert_close(ch(xl), h(xl), rtol=0, atol=0)


def test_opcheck_cuda(g):
    x, w13, w2, tw, ids, _, _ = _case(g)
    torch.library.opcheck(torch.ops.fusedmoe.fused_experts.default, (x, w13, w2, tw, ids))
    logits = torch.randn(5, 8, generator=g, device="cuda")
    torch.library.opcheck(torch.ops.fusedmoe.fused_topk.default, (logits, 2, True))
    moe = _cuda_layer("mixtral", 0)
    xs = torch.randn(3, moe.hidden_size, generator=g, device="cuda")
    torch.library.opcheck(torch.ops.fusedmoe.moe_layer.default, (xs, moe._op_id, None))


def test_cuda_graph_capture_replay(g):
    T, E, k = 8, 8, 2
    x, w13, w2, _, _, _, _ = _case(g, T=T, E=E, k=k)
    moe = _cuda_layer("qwen2_moe", 1)  # shared expert with a gate: the side stream is captured
    static_x = torch.randn(T, x.shape[1], generator=g, device="cuda")
    static_gate = torch.randn(T, E, generator=g, device="cuda")
    static_h = torch.randn(T, moe.hidden_size, generator=g, device="cuda")

    def step():
        w, ids = fusedmoe.fused_topk(static_x, static_gate, k, True)
        return fusedmoe.fused_experts(static_x, w13, w2, w, ids), moe(static_h)

    s = torch.cuda.Stream()  # warm up on a side stream, as torch's docs do
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_layer_out = step()
    for _ in range(3):
        nx = torch.randn(T, x.shape[1], generator=g, device="cuda")
        ngate = torch.randn(T, E, generator=g, device="cuda")
        nh = torch.randn(T, moe.hidden_size, generator=g, device="cuda")
        static_x.copy_(nx)
        static_gate.copy_(ngate)
        static_h.copy_(nh)
        static_out.fill_(float("nan"))  # poison: the replay must overwrite it
        static_layer_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        w, ids = fusedmoe.fused_topk(nx, ngate, k, True)
        torch.testing.assert_close(static_out, fusedmoe.fused_experts(nx, w13, w2, w, ids),
                                   rtol=0, atol=0)
        torch.testing.assert_close(static_layer_out, moe(nh), rtol=0, atol=0)
        assert rel_l2(static_out.cpu().numpy(), _ref(nx, w13, w2, w, ids)) <= 1e-2
