#!/usr/bin/env python3
"""PyTorch baselines beside bench_cuda_moe, on the same inputs.

Reads DIR/manifest.json and the routings bench_cuda_moe --dump-dir DIR wrote,
regenerates the same bf16 weights and hidden states from the counter-based hash
(hash_uniform in bench_cuda_moe.cu), and times, cycling through the same
routings with CUDA events (median):
  loop:        per-expert loop (index, two matmuls, SiLU-GLU, index_add)
  grouped_mm:  torch._grouped_mm over expert-sorted rows (sort included)
It checks our output for routing 0 against an f32-accumulated PyTorch
reference (relative L2) and prints one markdown table with ours beside both.

usage: torch_baseline.py DIR [--iters N]
"""
import json
import math
import sys

import torch

M32 = 0xFFFFFFFF


def mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    x = x ^ (x >> 16)
    return x


def hash_uniform(seed, start, n, scale, device):
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    x = mix32((i & M32) ^ seed)
    x = mix32(x ^ (((i >> 32) * 0x9E3779B9) & M32))
    v = (x >> 8).to(torch.float32) * (1.0 / 16777216.0) - 0.5
    return (v * scale).to(torch.bfloat16)


def f32_scale(num, h):
    return (torch.tensor(num, dtype=torch.float32) /
            torch.sqrt(torch.tensor(float(h), dtype=torch.float32))).item()


def make_weights(E, H, I, seeds, dev):
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev)
    s13, s2 = f32_scale(2.0, H), f32_scale(2.0, I)
    for e in range(E):
        w13[e] = hash_uniform(seeds["w13"], e * 2 * I * H, 2 * I * H, s13, dev).view(2 * I, H)
        w2[e] = hash_uniform(seeds["w2"], e * H * I, H * I, s2, dev).view(H, I)
    return w13, w2


def silu_glu(h, I):
    g, u = h[:, :I], h[:, I:]
    return torch.nn.functional.silu(g) * u


def moe_loop(x, ids, w, w13, w2, I):
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().squeeze(1)
        tok = slots // k
        h = x[tok] @ w13[e].t()
        a = silu_glu(h, I)
        y = (a @ w2[e].t()).float() * w.flatten()[slots, None]
        out.index_add_(0, tok, y)
    return out.to(torch.bfloat16)


def moe_grouped(x, ids, w, w13t, w2t, I, E):
    T, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    a = x[tok]
    h = torch._grouped_mm(a, w13t, offs=offs)
    act = silu_glu(h, I)
    y = torch._grouped_mm(act, w2t, offs=offs).float() * w.flatten()[order, None]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(torch.bfloat16)


def reference_f32(x, ids, w, w13, w2, I):
    """f32 math on the bf16 values, intermediate rounded to bf16 like ours."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().squeeze(1)
        tok = slots // k
        h = x[tok].float() @ w13[e].float().t()
        a = silu_glu(h, I).to(torch.bfloat16).float()
        y = (a @ w2[e].float().t()) * w.flatten()[slots, None]
        out.index_add_(0, tok, y)
    return out


def time_fn(fn, routings, iters):
    for r in routings:  # warm-up
        fn(*r)
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        r = routings[i % len(routings)]
        s.record()
        fn(*r)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    d = sys.argv[1]
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 20
    man = json.load(open(d + "/manifest.json"))
    R, seeds = man["routings"], man["seeds"]
    dev = torch.device("cuda")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| shape | T | ours us | floor us | % of floor | torch loop us | torch._grouped_mm us "
          "| vs grouped_mm | ours rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    by_shape = {}
    for c in man["cases"]:
        by_shape.setdefault(c["shape"], []).append(c)
    for shape, cases in by_shape.items():
        E, k, H, I = (cases[0][n] for n in ("E", "k", "H", "I"))
        w13, w2 = make_weights(E, H, I, seeds, dev)
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
        Tmax = max(c["T"] for c in cases)
        x_all = hash_uniform(seeds["x"], 0, Tmax * H, 2.0, dev).view(Tmax, H)
        for c in cases:
            T = c["T"]
            base = f"{d}/{shape}_T{T}"
            ids = torch.from_numpy(__import__("numpy").fromfile(base + "_ids.bin", dtype="int32"))
            wts = torch.from_numpy(__import__("numpy").fromfile(base + "_weights.bin",
                                                                dtype="float32"))
            ids = ids.view(R, T, k).to(dev).long()
            wts = wts.view(R, T, k).to(dev)
            x = x_all[:T]
            ours = torch.from_numpy(__import__("numpy").fromfile(base + "_out0.bin",
                                                                 dtype="int16")).view(T, H)
            ours = ours.view(torch.bfloat16).to(dev).float()
            ref = reference_f32(x, ids[0], wts[0], w13, w2, I)
            err = (torch.linalg.norm(ours - ref) / torch.linalg.norm(ref)).item()
            rs = [(x, ids[r], wts[r]) for r in range(R)]
            t_loop = time_fn(lambda a, b, c_: moe_loop(a, b, c_, w13, w2, I), rs, iters)
            try:
                t_gmm = time_fn(lambda a, b, c_: moe_grouped(a, b, c_, w13t, w2t, I, E), rs, iters)
                gerr = None
            except Exception as ex:  # layout or version limits of _grouped_mm
                t_gmm, gerr = float("nan"), str(ex).splitlines()[0][:80]
            sp = t_gmm / c["us"] if not math.isnan(t_gmm) else float("nan")
            print(f"| {shape} | {T} | {c['us']:.1f} | {c['floor_us']:.1f} | "
                  f"{100 * c['floor_us'] / c['us']:.0f}% | {t_loop:.1f} | {t_gmm:.1f} | "
                  f"{sp:.2f}x | {err:.2e} |" + (f" grouped_mm: {gerr}" if gerr else ""),
                  flush=True)
        del w13, w2, w13t, w2t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
