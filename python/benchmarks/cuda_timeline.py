"""Kernel timeline of one fusedmoe.fused_experts call on CUDA (torch.profiler
trace): each kernel's start offset, duration and the gap before it (negative:
it started before the previous kernel ended, Programmatic Dependent Launch),
then the call's span and the sum of its kernels. Uniform random routing, bf16,
w13 interleaved (what bench_cuda_moe runs); the CUDA-event time of the eager
call is printed too.

    python python/benchmarks/cuda_timeline.py mixtral:64,1024 qwen3:1,4096 deepseek:16

Needs a CUDA device, torch and the fusedmoe package built with CUDA."""
import json, os, statistics, sys, tempfile
import torch, fusedmoe
dev = "cuda"
torch.manual_seed(0)
shapes = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768), "deepseek": (256, 8, 7168, 2048)}
todo = [a.split(":") for a in sys.argv[1:]]
def timeit(fn, iters=30):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1000)
    return statistics.median(ts)
cache = {}
for name, ts in todo:
    E, k, H, I = shapes[name]
    if name not in cache:
        cache.clear(); torch.cuda.empty_cache()
        w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
        cache[name] = (fusedmoe.interleave_w13(w13), w2); del w13
    w13i, w2 = cache[name]
    for T in map(int, ts.split(",")):
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        tw = torch.softmax(torch.randn(T, k, device=dev), -1)
        ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.to(torch.int32)
        f = lambda: fusedmoe.fused_experts(x, w13i, w2, tw, ids, w13_layout="interleaved128")
        us = timeit(f)
        from torch.profiler import profile, ProfilerActivity
        f(); torch.cuda.synchronize()
        marker = torch.empty(1, device=dev)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                marker.fill_(1.0); f()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            p.export_chrome_trace(trace)
            with open(trace) as f:
                ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
        ev.sort(key=lambda e: e["ts"])
        # last call: after the last fill kernel
        idx = max(i for i, e in enumerate(ev) if "fill" in e["name"].lower() or "FillFunctor" in e["name"])
        call = ev[idx + 1:]
        t0 = call[0]["ts"]; prev_end = None; tot = 0
        print(f"== {name} T={T}: event time {us:.1f} us; kernels:")
        for e in call:
            gap = 0 if prev_end is None else e["ts"] - prev_end
            tot += e["dur"]
            print(f"   +{e['ts'] - t0:8.1f}  dur {e['dur']:8.1f}  gap {gap:6.1f}  {e['name'][:110]}")
            prev_end = e["ts"] + e["dur"]
        print(f"   span {prev_end - t0:.1f} us, kernel sum {tot:.1f} us", flush=True)
