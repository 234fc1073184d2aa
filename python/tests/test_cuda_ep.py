"""GPU expert parallelism from Python: ExpertParallelGroup and
MoELayer.from_pretrained(..., ep_group=...). One rank (any CUDA device): the
layer gives the single-GPU layer's output; two processes on two GPUs (skipped
with fewer): each rank's output for its own tokens is the single-GPU output on
all ranks' tokens, within f32 rounding (the peer transport sums a token's
slots per rank first) when every rank passes max_num_tokens tokens, within bf16
rounding otherwise (the local experts' tiles may differ). Skipped without torch, a CUDA device, or a fusedmoe
built with the CUDA backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedmoe  # noqa: E402
from conftest import HF, rel_l2  # noqa: E402


pytestmark = pytest.mark.usefixtures("need_cuda")


ARCHS = [("mixtral", 0), ("qwen2_moe", 1), ("deepseek_v3", 1), ("gpt_oss", 0)]


@pytest.mark.parametrize("arch,layer", ARCHS)
def test_one_rank_group_matches_one_gpu(arch, layer, rng):
    ep = fusedmoe.ExpertParallelGroup.from_unique_id(fusedmoe.nccl_unique_id(), 0, 1)
    assert (ep.rank, ep.size, ep.device) == (0, 1, torch.cuda.current_device())
    assert repr(ep) == f"ExpertParallelGroup(rank=0, size=1, device=cuda:{ep.device})"
    one = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, backend="cuda",
                                            max_num_tokens=64)
    moe = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=layer, backend="cuda",
                                            max_num_tokens=64, ep_group=ep)
    for T in (0, 1, 37, 64):
        x = torch.from_numpy(rng.standard_normal((T, moe.hidden_size)).astype(np.float32)).cuda()
        out = moe(x)
        assert out.shape == (T, moe.hidden_size) and bool(torch.isfinite(out).all())
        if T:  # max_num_tokens rows: one GPU's kernels (f32 rounding), else maybe other tiles
            err = rel_l2(out.cpu().numpy(), one(x).cpu().numpy())
            assert err <= (1e-6 if T == 64 else 1e-2), (T, err)


def test_group_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="unique_id: expected the 128 bytes"):
        fusedmoe.ExpertParallelGroup.from_unique_id(b"short", 0, 1)
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.1 \(size 2\), got 2"):
        fusedmoe.ExpertParallelGroup.from_unique_id(fusedmoe.nccl_unique_id(), 2, 2)
    with pytest.raises(TypeError, match="ep_group: expected a fusedmoe.ExpertParallelGroup"):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", backend="cuda", ep_group="world")
    ep = fusedmoe.ExpertParallelGroup.from_unique_id(fusedmoe.nccl_unique_id(), 0, 1)
    with pytest.raises(ValueError, match='ep_group: GPU expert parallelism needs backend="cuda"'):
        fusedmoe.MoELayer.from_pretrained(HF / "mixtral", ep_group=ep)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            fusedmoe.ExpertParallelGroup()


def test_torch_distributed_group_of_one(tmp_path, rng):
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        ep = fusedmoe.ExpertParallelGroup()
        assert (ep.rank, ep.size) == (0, 1)
        moe = fusedmoe.MoELayer.from_pretrained(HF / "qwen2_moe", layer=1, backend="cuda",
                                                max_num_tokens=16, ep_group=ep)
        one = fusedmoe.MoELayer.from_pretrained(HF / "qwen2_moe", layer=1, backend="cuda",
                                                max_num_tokens=16)
        x = torch.from_numpy(rng.standard_normal((16, moe.hidden_size)).astype(np.float32))
        x = x.cuda()
        assert rel_l2(moe(x).cpu().numpy(), one(x).cpu().numpy()) <= 1e-6
    finally:
        dist.destroy_process_group()


# One rank of the two-GPU test: rank `rank` of 2 on GPU `rank` over torch.distributed
# (gloo, file init), its tokens of each batch against one GPU on all of them.
_RANK = textwrap.dedent('''
    import sys
    import numpy as np
    import torch
    import fusedmoe
    rank, init, hf, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("gloo", init_method="file://" + init, rank=rank,
                                         world_size=2)
    ep = fusedmoe.ExpertParallelGroup()
    errs = []
    for arch, layer in (("mixtral", 0), ("qwen2_moe", 1), ("deepseek_v3", 1), ("gpt_oss", 0)):
        moe = fusedmoe.MoELayer.from_pretrained(hf + "/" + arch, layer=layer, backend="cuda",
                                                max_num_tokens=48, ep_group=ep)
        one = fusedmoe.MoELayer.from_pretrained(hf + "/" + arch, layer=layer, backend="cuda",
                                                max_num_tokens=96)
        # Tokens per rank: even, uneven, and none on one rank.
        for counts in ((48, 48), (5, 31), (0, 17)):
            g = np.random.default_rng(1000 + sum(counts))
            x = torch.from_numpy(g.standard_normal((sum(counts), moe.hidden_size))
                                 .astype(np.float32)).cuda()
            start = sum(counts[:rank])
            mine = x[start:start + counts[rank]].contiguous()
            got = moe(mine)
            want = one(x)[start:start + counts[rank]]
            if counts[rank]:
                d = (got - want).double()
                # Even counts: every rank runs max_num_tokens rows, as one GPU does (f32
                # rounding); else the tiles may differ (bf16 rounding).
                tol = 1e-6 if counts == (48, 48) else 1e-2
                errs.append(f"{float(d.norm() / want.double().norm()):.3e}/{tol:g}")
            assert bool(torch.isfinite(got).all()) and got.shape == mine.shape
    torch.cuda.synchronize()
    torch.distributed.destroy_process_group()
    open(out_path, "w").write(" ".join(errs))
''')


def test_two_processes_on_two_gpus_match_one_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"skipped: needs 2 CUDA devices, found {torch.cuda.device_count()}")
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, FUSEDMOE_COMM_TIMEOUT_S="60")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init"),
                               str(HF), str(tmp_path / f"err{r}")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outs[r][-3000:]}"
    for r in range(2):
        errs = [e.split("/") for e in (tmp_path / f"err{r}").read_text().split()]
        assert len(errs) >= 8 and all(float(e) <= float(tol) for e, tol in errs), (
            f"rank {r}: relative L2 vs one GPU / tolerance: {errs}")
