"""Shared helpers for the fusedmoe Python tests: fixture paths, an independent
safetensors reader (stdlib + NumPy), float64 references, a seeded RNG."""

from __future__ import annotations

import json
import math
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
HF = DATA / "hf"
ARCHS = sorted(p.name for p in HF.iterdir() if (p / "config.json").is_file()) if HF.is_dir() else []

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BF16": np.uint16}  # BF16: raw bit patterns


def read_safetensors(path: os.PathLike) -> dict:
    """name -> NumPy array (BF16 as uint16 bit patterns). Format: an 8-byte
    little-endian header length, a JSON header, the data section."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        dt = np.dtype(_ST_DTYPES[e["dtype"]])
        buf = raw[8 + n + begin:8 + n + end]
        out[name] = np.frombuffer(buf, dtype=dt).reshape(e["shape"]).copy()
    return out


def write_safetensors(path: os.PathLike, tensors: dict) -> None:
    """The reverse of read_safetensors: uint16 arrays are written as BF16 bit
    patterns; tensors in the order given, header padded to 8 bytes."""
    names = {np.dtype(t): n for n, t in _ST_DTYPES.items() if n != "BF16"}
    names[np.dtype(np.uint16)] = "BF16"
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even -> uint16 bit patterns (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


# ---- float64 references -----------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def ref_scores(logits: np.ndarray, scoring_func: str) -> np.ndarray:
    x = logits.astype(np.float64)
    if scoring_func == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if scoring_func == "sigmoid":
        return _sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, x))
    raise ValueError(scoring_func)


def _topk(values: np.ndarray, k: int) -> np.ndarray:
    # descending, ties to the lower index (stable sort of -values)
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def ref_fused_topk(logits, k, renormalize, scoring_func="softmax"):
    s = ref_scores(logits, scoring_func)
    ids = _topk(s, k)
    w = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return w, ids


def ref_grouped_topk(logits, k, renormalize, num_expert_group, topk_group, scoring_func="softmax",
                     bias=None, routed_scaling_factor=1.0, group_score=None):
    s = ref_scores(logits, scoring_func)
    T, E = s.shape
    choice = s + (0.0 if bias is None else bias.astype(np.float64)[None, :])
    g = choice.reshape(T, num_expert_group, E // num_expert_group)
    group_score = group_score or ("sum_top2" if bias is not None else "max")
    if group_score == "max":
        gs = g.max(axis=2)
    else:
        gs = np.sort(g, axis=2)[:, :, -2:].sum(axis=2)
    keep = _topk(gs, topk_group)
    mask = np.zeros((T, num_expert_group), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=1)
    masked = np.where(np.repeat(mask, E // num_expert_group, axis=1), choice, -np.inf)
    ids = _topk(masked, k)
    w = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return w * routed_scaling_factor, ids


def ref_activation(h: np.ndarray, activation: str, alpha=1.702, limit=7.0) -> np.ndarray:
    I = h.shape[-1] // 2
    gate, up = h[..., :I], h[..., I:]
    if activation == "silu":
        return gate * _sigmoid(gate) * up
    if activation == "gelu":
        erf = np.vectorize(math.erf)
        return 0.5 * gate * (1.0 + erf(gate / math.sqrt(2.0))) * up
    if activation == "gelu_pytorch_tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate**3))) * up
    if activation == "swiglu_oai":
        g = np.minimum(gate, limit)
        u = np.clip(up, -limit, limit)
        return (u + 1.0) * g * _sigmoid(alpha * g)
    raise ValueError(activation)


def ref_fused_experts(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None,
                      w2_bias=None, apply_router_weight_on_input=False):
    """All arrays float (weights already in f32/f64); float64 computation."""
    x = x.astype(np.float64)
    T, H = x.shape
    out = np.zeros((T, H))
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            w = float(topk_weights[t, j])
            xin = x[t] * w if apply_router_weight_on_input else x[t]
            h = w13[e].astype(np.float64) @ xin
            if w13_bias is not None:
                h = h + w13_bias[e]
            a = ref_activation(h, activation)
            y = w2[e].astype(np.float64) @ a
            if w2_bias is not None:
                y = y + w2_bias[e]
            out[t] += y if apply_router_weight_on_input else w * y
    return out


# ---- fixtures ------------------------------------------------------------------------

@pytest.fixture
def need_cuda():
    """Skips (with the reason shown) without torch's CUDA device or a fusedmoe
    built with the CUDA backend; the CUDA test modules use it for every test."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no CUDA device")
    import fusedmoe

    if not fusedmoe.cuda_built:
        pytest.skip("skipped: fusedmoe was built without the CUDA backend")


@pytest.fixture
def rng(request):
    """A fresh-seeded generator; the seed is printed when the test fails."""
    seed = random.SystemRandom().randrange(2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"seed = {seed}")
    return np.random.default_rng(seed)


def experts_case(rng, I: int, w2_scale: float, T: int = 5, E: int = 4, H: int = 16,
                 k: int = 2) -> dict:
    """Random fused_experts inputs: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (f32),
    topk_weights [T, k] and k distinct topk_ids per token."""
    return dict(
        x=rng.standard_normal((T, H)).astype(np.float32),
        w13=(rng.standard_normal((E, 2 * I, H)) / 4).astype(np.float32),
        w2=(rng.standard_normal((E, H, I)) / w2_scale).astype(np.float32),
        tw=rng.random((T, k)).astype(np.float32),
        ids=np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
    )
