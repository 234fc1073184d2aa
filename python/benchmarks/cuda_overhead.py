"""Per-call cost of the CUDA fused_experts at T = 1 from Python against the C++
call, and the CUDA-graph replayed time.

Rows (µs per call, median of --rounds rounds of --repeat back-to-back calls,
each round ended by one stream synchronisation and divided by the calls):
  C++ cuda::fused_experts      fusedmoe._ext._time_fused_experts_cuda: the C++
                               API in a loop, no Python (host enqueue time too)
  _ext.fused_experts           the raw binding, preallocated output/workspace
  torch.ops.fusedmoe...        the registered custom op (allocates output and
                               workspace with PyTorch's caching allocator)
  fusedmoe.fused_experts       the public function (routes to the op)
  torch.compile(fullgraph)     a compiled function calling fusedmoe.fused_experts
  CUDA graph replay            one captured torch.ops call, replayed
and for MoELayer(backend="cuda") (the HF fixtures' tiny layers, T = 1):
  _impl.forward                the raw binding, preallocated output
  MoELayer general path        MoELayer._forward (checks for every array library)
  MoELayer call                moe(x): the fast path for a plain torch CUDA tensor
  CUDA graph replay            one captured moe(x), replayed
When a row's time is above the C++ row, the host (Python) is the bottleneck:
the difference is the per-call overhead. The GPU time of the kernels alone is
about the graph-replay row.

    python python/benchmarks/cuda_overhead.py [--repeat 1000] [--rounds 7] [--passes 2] [--csv FILE]

--passes N measures every shape N times and reports the last pass (the first
warms PyTorch's allocator and dispatcher caches and the compiled functions).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fusedmoe
from fusedmoe import _ext

SHAPES = [  # name, E, k, H, I
    ("small", 8, 2, 128, 64),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
]


def per_call_us(fn, repeat: int, rounds: int):
    """(median µs per call incl. the GPU, median host µs per call before the sync)."""
    for _ in range(max(repeat // 10, 10)):
        fn()
    torch.cuda.synchronize()
    total, host = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        total.append((t2 - t0) / repeat)
        host.append((t1 - t0) / repeat)
    return 1e6 * statistics.median(total), 1e6 * statistics.median(host)


def bench(name, E, k, H, I, repeat, rounds, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 1
    x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    ids = torch.randperm(E, generator=g, device="cuda")[:k].to(torch.int32).reshape(1, k)
    tw = torch.full((T, k), 1.0 / k, device="cuda")
    out = torch.empty(T, H, device="cuda", dtype=dtype)
    ws = torch.empty(fusedmoe.cuda_fused_experts_workspace_bytes(T, H, I, E, k),
                     dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rows = []

    # C++ API in a loop (timed in C++)
    _ext._time_fused_experts_cuda(x, w13, w2, tw, ids, out, ws, max(repeat // 10, 10), stream)
    tot, enq = [], []
    for _ in range(rounds):
        a, b = _ext._time_fused_experts_cuda(x, w13, w2, tw, ids, out, ws, repeat, stream)
        tot.append(a / repeat)
        enq.append(b / repeat)
    cpp = 1e6 * statistics.median(tot)
    rows.append(("C++ cuda::fused_experts (loop in C++)", cpp, 1e6 * statistics.median(enq)))

    from torch.utils.dlpack import to_dlpack

    def raw():
        _ext.fused_experts(to_dlpack(x), to_dlpack(w13), to_dlpack(w2), to_dlpack(tw),
                           to_dlpack(ids), to_dlpack(out), "silu", None, None, False, "bf16",
                           False, 1.702, 7.0, to_dlpack(ws), stream)

    rows.append(("_ext.fused_experts (raw binding, preallocated)",
                 *per_call_us(raw, repeat, rounds)))
    op = torch.ops.fusedmoe.fused_experts.default
    rows.append(("torch.ops.fusedmoe.fused_experts",
                 *per_call_us(lambda: op(x, w13, w2, tw, ids), repeat, rounds)))
    rows.append(("fusedmoe.fused_experts",
                 *per_call_us(lambda: fusedmoe.fused_experts(x, w13, w2, tw, ids), repeat,
                              rounds)))

    def f(hidden, weights, topk_ids):
        return fusedmoe.fused_experts(hidden, w13, w2, weights, topk_ids)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    rows.append(("torch.compile(fullgraph=True) function",
                 *per_call_us(lambda: cf(x, tw, ids), repeat, rounds)))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(x, w13, w2, tw, ids)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(x, w13, w2, tw, ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, op(x, w13, w2, tw, ids), rtol=0, atol=0)
    rows.append(("CUDA graph replay (one captured op call)",
                 *per_call_us(graph.replay, repeat, rounds)))
    return rows, cpp


HF = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf"


def bench_layer(arch, repeat, rounds, dtype):
    moe = fusedmoe.MoELayer.from_pretrained(HF / arch, layer=1, backend="cuda", max_num_tokens=8)
    x = torch.randn(1, moe.hidden_size, device="cuda").to(dtype)
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    from torch.utils.dlpack import to_dlpack

    rows = [("_impl.forward (raw binding, preallocated)",
             *per_call_us(lambda: moe._impl.forward(to_dlpack(x), to_dlpack(out), None, None, None,
                                                    None, None, stream), repeat, rounds)),
            ("MoELayer general path (_forward)",
             *per_call_us(lambda: moe._forward(x, None, None, False), repeat, rounds)),
            ("MoELayer call moe(x)", *per_call_us(lambda: moe(x), repeat, rounds))]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, moe(x), rtol=0, atol=0)
    rows.append(("CUDA graph replay (one captured moe(x))",
                 *per_call_us(graph.replay, repeat, rounds)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    print(f"GPU: {dev}; torch {torch.__version__}; fusedmoe {fusedmoe.__version__}; "
          f"T = 1, bf16 weights and hidden states; {args.rounds} rounds x {args.repeat} calls")
    csv = ["shape,E,k,H,I,call,us_per_call,host_us_per_call,over_cpp_us"]
    for _ in range(args.passes - 1):  # warm-up passes, not reported
        for name, E, k, H, I in SHAPES:
            bench(name, E, k, H, I, args.repeat, args.rounds, torch.bfloat16)
    for name, E, k, H, I in SHAPES:
        rows, cpp = bench(name, E, k, H, I, args.repeat, args.rounds, torch.bfloat16)
        print(f"\n## {name}: E={E}, k={k}, H={H}, I={I}\n")
        print("| call | µs/call (incl. GPU) | host µs/call (enqueue) | over C++ µs |")
        print("|---|---|---|---|")
        for call, us, host in rows:
            print(f"| {call} | {us:.1f} | {host:.1f} | {us - cpp:+.1f} |")
            csv.append(f"{name},{E},{k},{H},{I},{call},{us:.2f},{host:.2f},{us - cpp:.2f}")
    for arch in ("qwen3_moe", "mixtral"):
        for dtype in (torch.bfloat16, torch.float32):
            for _ in range(args.passes - 1):  # warm-up passes, not reported
                bench_layer(arch, args.repeat, args.rounds, dtype)
            rows = bench_layer(arch, args.repeat, args.rounds, dtype)
            print(f"\n## MoELayer {arch} (HF fixture, layer 1), T = 1, {dtype}\n")
            print("| call | µs/call (incl. GPU) | host µs/call (enqueue) |")
            print("|---|---|---|")
            for call, us, host in rows:
                print(f"| {call} | {us:.1f} | {host:.1f} |")
                csv.append(f"layer-{arch},,,,,{call} {dtype},{us:.2f},{host:.2f},")
    if args.csv:
        with open(args.csv, "w") as fh:
            fh.write("\n".join(csv) + "\n")


if __name__ == "__main__":
    main()
