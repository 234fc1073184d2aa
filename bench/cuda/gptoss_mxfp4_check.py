"""gpt-oss-20b's MoE shape (E 32, top-4, H = I = 2880) as a random MXFP4
checkpoint: the CUDA layer against the CPU layer (f32 compute) for the same
router logits at T = 1 .. 4096, and both against a float64 forward of a few
tokens through the NumPy port of HF's convert_moe_packed_tensors
(python/tests/test_mxfp4.py). Run from the repository root on a CUDA device
with the fusedmoe package and PyTorch: python3 bench/cuda/gptoss_mxfp4_check.py"""
import json, sys, time, numpy as np, torch, fusedmoe
sys.path.insert(0, "python/tests")
from conftest import write_safetensors, f32_to_bf16, bf16_to_f32
import test_mxfp4 as t
from pathlib import Path
E, H, I, K = 32, 2880, 2880, 4
rng = np.random.default_rng(7)
d = Path("/tmp/gptoss20b"); d.mkdir(exist_ok=True)
cfg = json.loads(Path("tests/data/hf/gpt_oss/config.json").read_text())
cfg.update(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
           num_hidden_layers=1, quantization_config={"quant_method": "mxfp4"})
(d / "config.json").write_text(json.dumps(cfg))
P = "model.layers.0.mlp."
ts = {P + "router.weight": f32_to_bf16(rng.standard_normal((E, H)) / 50),
      P + "router.bias": f32_to_bf16(rng.standard_normal(E) / 10),
      P + "experts.gate_up_proj_blocks": rng.integers(0, 256, (E, 2 * I, H // 32, 16), np.uint8),
      P + "experts.gate_up_proj_scales": rng.integers(118, 121, (E, 2 * I, H // 32), np.uint8),
      P + "experts.gate_up_proj_bias": f32_to_bf16(rng.standard_normal((E, 2 * I)) / 10),
      P + "experts.down_proj_blocks": rng.integers(0, 256, (E, H, I // 32, 16), np.uint8),
      P + "experts.down_proj_scales": rng.integers(118, 121, (E, H, I // 32), np.uint8),
      P + "experts.down_proj_bias": f32_to_bf16(rng.standard_normal((E, H)) / 10)}
write_safetensors(d / "model.safetensors", ts)
s = time.time(); cpu = fusedmoe.MoELayer.from_pretrained(d, layer=0); print(f"cpu load {time.time()-s:.1f} s")
s = time.time(); gpu = fusedmoe.MoELayer.from_pretrained(d, layer=0, backend="cuda", max_num_tokens=4096); print(f"cuda load {time.time()-s:.1f} s")
for T in (1, 3, 64, 1000, 4096):
    x = rng.standard_normal((T, H)).astype(np.float32)
    ref, ids_c, w_c, logits = cpu(x, return_routing=True)
    out = gpu(torch.from_numpy(x).cuda(), router_logits=torch.from_numpy(logits).cuda())
    o = out.float().cpu().numpy()
    err = np.linalg.norm(o - ref) / np.linalg.norm(ref)
    print(f"T={T}: CUDA vs CPU f32 relative L2 {err:.3e}, finite {np.isfinite(o).all()}")
    assert err <= 1e-2 and np.isfinite(o).all()
# float64 reference for 3 tokens from the HF-ported dequantization
gu = t.hf_convert_moe_packed_tensors(ts[P + "experts.gate_up_proj_blocks"], ts[P + "experts.gate_up_proj_scales"])
dn = t.hf_convert_moe_packed_tensors(ts[P + "experts.down_proj_blocks"], ts[P + "experts.down_proj_scales"])
from conftest import ref_fused_topk, ref_fused_experts
x = rng.standard_normal((3, H)).astype(np.float32)
logits = (x.astype(np.float64) @ bf16_to_f32(ts[P + "router.weight"]).T.astype(np.float64) + bf16_to_f32(ts[P + "router.bias"])).astype(np.float32)
tw, ids = ref_fused_topk(logits, K, renormalize=True)
w13 = np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)
gub = bf16_to_f32(ts[P + "experts.gate_up_proj_bias"])
b13 = np.concatenate([gub[:, 0::2], gub[:, 1::2]], axis=1)
r64 = ref_fused_experts(x, w13, dn.transpose(0, 2, 1), tw, ids, "swiglu_oai", b13, bf16_to_f32(ts[P + "experts.down_proj_bias"]))
o = gpu(torch.from_numpy(x).cuda(), router_logits=torch.from_numpy(logits).cuda()).float().cpu().numpy()
c = cpu(x, router_logits=logits)
print(f"float64 ref: CUDA {np.linalg.norm(o-r64)/np.linalg.norm(r64):.3e}, CPU f32 {np.linalg.norm(c-r64)/np.linalg.norm(r64):.3e}")
