"""Per-kernel times of fusedmoe.fused_experts (bf16 torch CUDA tensors, w13
interleaved128 where I % 128 == 0) for layer shapes chosen to separate what
the grouped GEMMs pay for many small experts from what they pay for work:
the sets of bench/results/2026-12-01-session20.md.

    python3 bench/cuda/group_cost.py --set groups|rows|memory|qwen3|deepseek [--routing exact|random]

`exact` routing gives every expert exactly T k / E rows (token t's j-th id is
(t k + j) mod E); `random` a uniform random top-k per token. Per-kernel times
come from torch.profiler (10 calls); with FUSEDMOE_CUDA_PDL=0 the kernels do
not overlap, so each time is the kernel's own. Needs the fusedmoe package
with its CUDA extension and PyTorch on a CUDA device."""
import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fusedmoe

SETS = {
    # Same FLOPs, weight bytes and 64 x 256 tile counts, experts wide or narrow.
    "groups": [(8, 2048, 6144, 8, 256), (64, 2048, 768, 8, 2048),
               (8, 2048, 6144, 8, 512), (64, 2048, 768, 8, 4096)],
    # The same rows in fewer experts (weight bytes differ).
    "rows": [(8, 2048, 768, 8, 2048), (64, 2048, 768, 8, 2048), (64, 2048, 768, 8, 16384),
             (128, 2048, 768, 8, 4096), (16, 2048, 768, 8, 4096),
             (256, 7168, 2048, 8, 4096), (32, 7168, 2048, 8, 4096)],
    "qwen3": [(128, 2048, 768, 8, t) for t in (256, 1024, 4096)],
    "deepseek": [(256, 7168, 2048, 8, t) for t in (64, 128, 256, 1024)],
    "mixtral": [(8, 4096, 14336, 2, t) for t in (1024, 4096)],
}


def ids_for(routing, T, k, E):
    if routing == "exact":
        t = torch.arange(T, device="cuda").view(T, 1) * k + torch.arange(k, device="cuda")
        return (t % E).to(torch.int32)
    return torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)


def case(E, H, I, k, T, routing):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    layout = "interleaved128" if I % 128 == 0 else "standard"
    if layout != "standard":
        w13 = fusedmoe.interleave_w13(w13)
    ids, tw = ids_for(routing, T, k, E), torch.rand(T, k, device="cuda")
    f = lambda: fusedmoe.fused_experts(x, w13, w2, tw, ids, w13_layout=layout)  # noqa: E731
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    rows = []
    for ev in p.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "self_device_time_total", 0)
        if t > 0:
            rows.append((t / 10, ev.key))
    rows.sort(reverse=True)
    flops = 2 * T * k * 3 * H * I
    med = times[len(times) // 2]
    print(f"== E={E} H={H} I={I} k={k} T={T} {routing}: median {med:.1f} us a call "
          f"({flops / med / 1e6:.0f} TFLOP/s)")
    for t, key in rows[:9]:
        kind = "w13" if "Glu" in key else ("gemm" if "emm" in key else "")
        print(f"   {t:9.1f} us {kind:4s} {key[:100]}")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(SETS), required=True)
    ap.add_argument("--routing", choices=["exact", "random"], default="exact")
    a = ap.parse_args()
    for E, H, I, k, T in SETS[a.set]:
        case(E, H, I, k, T, a.routing)


if __name__ == "__main__":
    main()
