"""gpt-oss-20b's MoE shape (E 32, top-4, H = I = 2880) as a random MXFP4
checkpoint (python/tests/test_mxfp4.py's writer): the CUDA layer against the
CPU layer (f32 compute) for the same router logits at T = 1 .. 4096, and both
against a float64 forward of a few tokens of the weights as HF's
convert_moe_packed_tensors dequantizes them. Run from the repository root on a
CUDA device with the fusedmoe package and PyTorch:
python3 bench/cuda/gptoss_mxfp4_check.py"""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fusedmoe

sys.path.insert(0, "python/tests")
import test_mxfp4  # noqa: E402

E, H, I, K = 32, 2880, 2880, 4
rng = np.random.default_rng(7)
tmp = Path(tempfile.mkdtemp())
q, _, w = test_mxfp4.write_checkpoints(tmp, rng, E=E, H=H, I=I, K=K, scales=(118, 121),
                                       bias_scale=10.0, router_scale=50.0)
s = time.time()
cpu = fusedmoe.MoELayer.from_pretrained(q, layer=0)
print(f"cpu load {time.time() - s:.1f} s")
s = time.time()
gpu = fusedmoe.MoELayer.from_pretrained(q, layer=0, backend="cuda", max_num_tokens=4096)
print(f"cuda load {time.time() - s:.1f} s")
for T in (1, 3, 64, 1000, 4096):
    x = rng.standard_normal((T, H)).astype(np.float32)
    ref, _, _, logits = cpu(x, return_routing=True)
    o = gpu(torch.from_numpy(x).cuda(), router_logits=torch.from_numpy(logits).cuda())
    o = o.float().cpu().numpy()
    err = np.linalg.norm(o - ref) / np.linalg.norm(ref)
    print(f"T={T}: CUDA vs CPU f32 relative L2 {err:.3e}, finite {np.isfinite(o).all()}")
    assert err <= 1e-2 and np.isfinite(o).all()
x = rng.standard_normal((3, H)).astype(np.float32)
logits = (x.astype(np.float64) @ w[test_mxfp4.P + "router.weight"].T.astype(np.float64)
          + w[test_mxfp4.P + "router.bias"]).astype(np.float32)
r64 = test_mxfp4.ref_forward(w, x, logits, K)
o = gpu(torch.from_numpy(x).cuda(), router_logits=torch.from_numpy(logits).cuda())
o = o.float().cpu().numpy()
c = cpu(x, router_logits=logits)
print(f"float64 ref: CUDA {np.linalg.norm(o - r64) / np.linalg.norm(r64):.3e}, "
      f"CPU f32 {np.linalg.norm(c - r64) / np.linalg.norm(r64):.3e}")
