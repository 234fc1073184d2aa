"""Where the large-T routed-experts time goes on CUDA: fusedmoe.fused_experts
with uniform random vs perfectly balanced routing (every expert exactly T*k/E rows),
per-kernel times from torch.profiler, and GEMM ceilings (dense torch.mm of the
same FLOPs, torch._grouped_mm on balanced groups). Both sm90 tiles (the
default pick and FUSEDMOE_CUDA_SM90_TILE=m128) on each routing.

    python python/benchmarks/cuda_balance.py [mixtral] [qwen3] [deepseek] [wide8] [narrow64] ...

Beside the three layer shapes (the default), pairs of shapes that separate
what the grouped GEMMs pay for many small experts from what they pay for
work (bench/results/2026-12-01-session20.md): wide8 / narrow64 have the same
FLOPs, weight bytes and 64 x 256 tile counts (8 experts of I = 6144 or 64 of
I = 768, 256 and 512 rows an expert), rows8 / rows64 / rows16 the same rows
in fewer experts. FUSEDMOE_CUDA_PDL=0 keeps the kernels from overlapping, so
each profiled time is the kernel's own.

Needs a CUDA device, torch and the fusedmoe package built with CUDA."""
import os, statistics, sys
import torch
import fusedmoe

dev = "cuda"
torch.manual_seed(0)


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    return statistics.median(ts)


def kernels(fn):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in p.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0) > 0:
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if t > 0:
                rows.append((t / 5, ev.key[:90]))
    rows.sort(reverse=True)
    return rows[:8]


shapes = [("mixtral", 8, 2, 4096, 14336, [1024, 4096]),
          ("qwen3", 128, 8, 2048, 768, [1024, 4096]),
          ("deepseek", 256, 8, 7168, 2048, [4096]),
          ("wide8", 8, 8, 2048, 6144, [256, 512]),
          ("narrow64", 64, 8, 2048, 768, [2048, 4096]),
          ("rows8", 8, 8, 2048, 768, [2048]),
          ("rows64", 64, 8, 2048, 768, [16384]),
          ("rows16", 16, 8, 2048, 768, [4096]),
          ("deepseek32", 32, 8, 7168, 2048, [4096])]
which = sys.argv[1:] or ["mixtral", "qwen3", "deepseek"]
for name, E, k, H, I, Ts in shapes:
    if name not in which:
        continue
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
    w13i = fusedmoe.interleave_w13(w13)
    for T in Ts:
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        tw = torch.softmax(torch.randn(T, k, device=dev), -1)
        rnd = torch.rand(T, E, device=dev).topk(k, dim=1).indices.to(torch.int32)
        bal = (torch.arange(T * k, device=dev, dtype=torch.int32) % E).reshape(T, k)
        flops = 2.0 * T * k * 3 * H * I
        for tile in ["", "m128"]:
            os.environ["FUSEDMOE_CUDA_SM90_TILE"] = tile
            for rname, ids in (("random", rnd), ("balanced", bal)):
                f = lambda: fusedmoe.fused_experts(x, w13i, w2, tw, ids, w13_layout="interleaved128")
                us = timeit(f)
                print(f"{name} T={T} tile={tile or 'default'} {rname}: {us:.1f} us, "
                      f"{flops / us / 1e6:.0f} TFLOP/s", flush=True)
                if tile == "":
                    for t, kname in kernels(f):
                        print(f"    {t:9.1f} us  {kname}")
        os.environ["FUSEDMOE_CUDA_SM90_TILE"] = ""
        M = T * k
        a = torch.randn(M, H, device=dev).to(torch.bfloat16)
        b13 = w13[0].t()  # [H, 2I]
        us13 = timeit(lambda: a @ b13)
        a2 = torch.randn(M, I, device=dev).to(torch.bfloat16)
        b2 = w2[0].t()
        us2 = timeit(lambda: a2 @ b2)
        print(f"  dense torch.mm M={M}: w13 {us13:.1f} us ({2*M*H*2*I/us13/1e6:.0f} TFLOP/s), "
              f"w2 {us2:.1f} us ({2*M*H*I/us2/1e6:.0f} TFLOP/s)")
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (M // E)
        try:
            g13 = timeit(lambda: torch._grouped_mm(a, w13.transpose(1, 2), offs=offs))
            g2 = timeit(lambda: torch._grouped_mm(a2, w2.transpose(1, 2), offs=offs))
            print(f"  torch._grouped_mm balanced: w13 {g13:.1f} us ({2*M*H*2*I/g13/1e6:.0f}), "
                  f"w2 {g2:.1f} us ({2*M*H*I/g2/1e6:.0f} TFLOP/s)")
        except Exception as ex:
            print("  grouped_mm failed:", ex)
    del w13, w2, w13i
    torch.cuda.empty_cache()
