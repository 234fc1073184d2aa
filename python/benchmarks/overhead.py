"""Per-call overhead of the Python API at T = 1: fusedmoe.fused_experts from
NumPy and from PyTorch (eager, torch.ops.fusedmoe.fused_experts, and inside a
torch.compile(fullgraph=True) function) against the C++ kernel call timed in
C++ (fusedmoe._ext._time_fused_experts: ModularKernel::forward in a loop, no
Python). Medians over many calls after a warm-up; one thread by default so the
numbers are not thread-pool wake-up noise.

    python python/benchmarks/overhead.py [--threads 1] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

import fusedmoe
from fusedmoe import _ext

try:
    import torch
except ImportError:  # torch rows are skipped
    torch = None


def median_us(fn, repeat: int) -> float:
    for _ in range(max(repeat // 10, 10)):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def bench_shape(name, E, H, I, k, wdtype, repeat):
    rng = np.random.default_rng(0)
    T = 1
    x = rng.standard_normal((T, H), dtype=np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(np.float32)
    ids = rng.permutation(E)[:k].astype(np.int32).reshape(1, k)
    tw = np.full((T, k), 1.0 / k, dtype=np.float32)
    out = np.empty((T, H), dtype=np.float32)
    rows = []
    if wdtype == "bf16":
        bits = lambda a: ((a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) >> 16
                          ).astype(np.uint16)
        w13n, w2n = bits(w13), bits(w2)
    else:
        w13n, w2n = w13, w2

    if wdtype == "f32":
        cpp = 1e6 * statistics.median(
            _ext._time_fused_experts(x, w13, w2, tw, ids, out, max(repeat // 10, 10)) and
            _ext._time_fused_experts(x, w13, w2, tw, ids, out, repeat))
        rows.append(("C++ ModularKernel::forward (timed in C++)", cpp))
    kw = {"weight_dtype": "bf16"} if wdtype == "bf16" else {}
    rows.append(("fusedmoe._ext.fused_experts (raw binding, NumPy, preallocated out)",
                 median_us(lambda: _ext.fused_experts(x, w13n, w2n, tw, ids, out, "silu", None,
                                                      None, False, "f32", wdtype == "bf16",
                                                      1.702, 7.0), repeat)))
    rows.append(("fusedmoe.fused_experts (NumPy)",
                 median_us(lambda: fusedmoe.fused_experts(x, w13n, w2n, tw, ids, **kw), repeat)))
    if torch is not None:
        tdt = torch.float32 if wdtype == "f32" else torch.bfloat16
        tx, tw13, tw2 = torch.from_numpy(x), torch.from_numpy(w13).to(tdt), torch.from_numpy(w2).to(tdt)
        ttw, tids = torch.from_numpy(tw), torch.from_numpy(ids)
        rows.append(("fusedmoe.fused_experts (torch eager -> torch.ops)",
                     median_us(lambda: fusedmoe.fused_experts(tx, tw13, tw2, ttw, tids), repeat)))
        op = torch.ops.fusedmoe.fused_experts.default
        rows.append(("torch.ops.fusedmoe.fused_experts.default (torch)",
                     median_us(lambda: op(tx, tw13, tw2, ttw, tids), repeat)))
        f = torch.compile(lambda a, b, c, d, e: fusedmoe.fused_experts(a, b, c, d, e),
                          fullgraph=True, backend="inductor")
        with torch.inference_mode():
            rows.append(("torch.compile(fullgraph=True) function calling it",
                         median_us(lambda: f(tx, tw13, tw2, ttw, tids), repeat)))
    base = rows[0][1] if wdtype == "f32" else None
    return name, rows, base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    fusedmoe.set_num_threads(args.threads)
    if torch is not None:
        torch.set_num_threads(args.threads)
    print(f"fusedmoe {fusedmoe.__version__}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}, torch {torch.__version__ if torch else 'absent'}, "
          f"{args.threads} thread(s), T = 1, median of {args.repeat} calls")
    shapes = [("tiny E=8 k=2 H=128 I=48 f32", 8, 128, 48, 2, "f32"),
              ("qwen3-like E=16 k=8 H=2048 I=768 f32", 16, 2048, 768, 8, "f32"),
              ("qwen3-like E=16 k=8 H=2048 I=768 bf16 weights", 16, 2048, 768, 8, "bf16")]
    for name, E, H, I, k, wdtype in shapes:
        repeat = args.repeat if H < 1024 else max(args.repeat // 10, 50)
        name, rows, base = bench_shape(name, E, H, I, k, wdtype, repeat)
        print(f"\n{name}")
        print(f"| call | median µs/call | overhead vs C++ µs |")
        print(f"|---|---|---|")
        for label, us in rows:
            over = f"{us - base:+.1f}" if base is not None else "-"
            print(f"| {label} | {us:.1f} | {over} |")


if __name__ == "__main__":
    main()
