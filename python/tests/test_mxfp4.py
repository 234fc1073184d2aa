"""gpt-oss MXFP4 experts (config.json quantization_config quant_method
"mxfp4", as gpt-oss ships them): the layer loads to the weights HF
transformers dequantizes them to. The reference is a NumPy port of
transformers' convert_moe_packed_tensors (integrations/mxfp4.py), its output
written as an unquantized gpt-oss checkpoint, whose loader path the HF
fixtures check against transformers' outputs; both layers must agree bit for
bit, and with a float64 forward of the same weights."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import fusedmoe
from conftest import (HF, bf16_to_f32, f32_to_bf16, ref_fused_experts, ref_fused_topk, rel_l2,
                      write_safetensors)

FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E, H, I, K = 8, 128, 64, 2
P = "model.layers.0.mlp."


def hf_convert_moe_packed_tensors(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' convert_moe_packed_tensors in NumPy: blocks u8 [..., G, 16]
    and scales u8 [..., G] -> [E, in, out] (the values exact in bf16 here)."""
    scales = scales.astype(np.int32) - 127
    assert blocks.shape[:-1] == scales.shape
    *prefix, G, B = blocks.shape
    rows = math.prod(prefix) * G
    blocks = blocks.reshape(rows, B)
    scales = scales.reshape(rows, 1)
    lut = np.array(FP4_VALUES, dtype=np.float32)
    out = np.empty((rows, B * 2), dtype=np.float32)
    out[:, 0::2] = lut[blocks & 0x0F]
    out[:, 1::2] = lut[blocks >> 4]
    out = np.ldexp(out, scales)
    out = out.reshape(*prefix, G, B * 2).reshape(*prefix, G * B * 2)
    return out.transpose(0, 2, 1)


def _config(quantized: bool, shape: dict) -> dict:
    cfg = json.loads((HF / "gpt_oss" / "config.json").read_text())
    cfg.update(shape)
    if quantized:  # as openai/gpt-oss-20b's config.json has it
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    return cfg


def write_checkpoints(tmp_path, rng, E=E, H=H, I=I, K=K, scales=(118, 124), bias_scale=4.0,
                      router_scale=4.0):
    """Writes an MXFP4 gpt-oss layer 0 of E experts, top-K, hidden size H and
    intermediate size I (random blocks, scales in [scales[0], scales[1]); the
    fixture's config otherwise) and the same weights unquantized, as HF
    dequantizes them; returns (MXFP4 checkpoint dir, unquantized dir, the
    unquantized tensors as f32)."""
    t = {
        P + "router.weight": f32_to_bf16(rng.standard_normal((E, H)) / router_scale),
        P + "router.bias": f32_to_bf16(rng.standard_normal(E) / router_scale),
        P + "experts.gate_up_proj_blocks": rng.integers(0, 256, (E, 2 * I, H // 32, 16), np.uint8),
        P + "experts.gate_up_proj_scales": rng.integers(*scales, (E, 2 * I, H // 32), np.uint8),
        P + "experts.gate_up_proj_bias": f32_to_bf16(rng.standard_normal((E, 2 * I)) / bias_scale),
        P + "experts.down_proj_blocks": rng.integers(0, 256, (E, H, I // 32, 16), np.uint8),
        P + "experts.down_proj_scales": rng.integers(*scales, (E, H, I // 32), np.uint8),
        P + "experts.down_proj_bias": f32_to_bf16(rng.standard_normal((E, H)) / bias_scale),
    }
    shape = {"hidden_size": H, "intermediate_size": I, "num_local_experts": E,
             "num_experts_per_tok": K}
    q, d = tmp_path / "mxfp4", tmp_path / "bf16"
    q.mkdir()
    d.mkdir()
    (q / "config.json").write_text(json.dumps(_config(True, shape)))
    (d / "config.json").write_text(json.dumps(_config(False, shape)))
    write_safetensors(q / "model.safetensors", t)
    gate_up = hf_convert_moe_packed_tensors(t[P + "experts.gate_up_proj_blocks"],
                                            t[P + "experts.gate_up_proj_scales"])  # [E, H, 2I]
    down = hf_convert_moe_packed_tensors(t[P + "experts.down_proj_blocks"],
                                         t[P + "experts.down_proj_scales"])  # [E, I, H]
    assert gate_up.shape == (E, H, 2 * I) and down.shape == (E, I, H)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(gate_up)), gate_up)  # exact in bf16
    dense = {k: v for k, v in t.items() if "_blocks" not in k and "_scales" not in k}
    dense[P + "experts.gate_up_proj"] = f32_to_bf16(gate_up)
    dense[P + "experts.down_proj"] = f32_to_bf16(down)
    write_safetensors(d / "model.safetensors", dense)
    f32 = {k: bf16_to_f32(v) if v.dtype == np.uint16 else v for k, v in dense.items()}
    return q, d, f32


def ref_forward(w: dict, x: np.ndarray, logits: np.ndarray, k: int = K) -> np.ndarray:
    """float64 gpt-oss MoE of the unquantized tensors `w` (write_checkpoints'
    third result): top-k over the logits, softmax over the k; w13's gate / up
    rows are gate_up's even / odd columns."""
    tw, ids = ref_fused_topk(logits, k, renormalize=True)
    gu, gub = w[P + "experts.gate_up_proj"], w[P + "experts.gate_up_proj_bias"]
    w13 = np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)
    b13 = np.concatenate([gub[:, 0::2], gub[:, 1::2]], axis=1)
    return ref_fused_experts(x, w13, w[P + "experts.down_proj"].transpose(0, 2, 1), tw, ids,
                             "swiglu_oai", b13, w[P + "experts.down_proj_bias"])


@pytest.fixture
def checkpoints(tmp_path, rng):
    return write_checkpoints(tmp_path, rng)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(checkpoints, rng, dtype):
    q, d, w = checkpoints
    mx = fusedmoe.MoELayer.from_pretrained(q, layer=0, dtype=dtype)
    dense = fusedmoe.MoELayer.from_pretrained(d, layer=0, dtype=dtype)
    assert mx.weights_dtype == "bf16" and mx.weights_nbytes == dense.weights_nbytes
    x = rng.standard_normal((7, H)).astype(np.float32)
    logits = (x.astype(np.float64) @ w[P + "router.weight"].T.astype(np.float64)
              + w[P + "router.bias"]).astype(np.float32)
    out = mx(x, router_logits=logits)
    assert np.array_equal(out, dense(x, router_logits=logits))
    assert rel_l2(out, ref_forward(w, x, logits)) <= (1e-5 if dtype == "f32" else 1e-2)


def test_mxfp4_blocks_without_quantization_config_are_refused(checkpoints):
    q, _, _ = checkpoints
    (q / "config.json").write_text(json.dumps(_config(False, {"intermediate_size": I})))
    with pytest.raises(OSError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks' holds "
                                      r"MXFP4 blocks, but config\.json has no quantization_config"):
        fusedmoe.MoELayer.from_pretrained(q, layer=0)


def test_mxfp4_experts_on_cuda_match_the_dequantized_checkpoint(checkpoints, rng, need_cuda):
    """The CUDA backend uploads the dequantized bf16 experts: the same outputs
    as the unquantized checkpoint's layer, bit for bit."""
    import torch

    q, d, _ = checkpoints
    mx = fusedmoe.MoELayer.from_pretrained(q, layer=0, backend="cuda", max_num_tokens=64)
    dense = fusedmoe.MoELayer.from_pretrained(d, layer=0, backend="cuda", max_num_tokens=64)
    x = torch.from_numpy(rng.standard_normal((33, H)).astype(np.float32)).cuda()
    out = mx(x)
    assert torch.equal(out, dense(x))
    assert torch.isfinite(out).all()
