// fusedmoe CUDA: finalize (sum each token's k weighted expert rows in slot
// order, add the shared expert), input conversion to bf16 / f16, the router GEMM
// (f32 accumulation: CUDA cores, or tensor cores for bf16 inputs at T > 32),
// and device queries.
#include <cuda_fp16.h>

#include <mutex>
#include <type_traits>
#include <vector>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm/gemv_common.cuh"  // unpack8
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/slot_sum.cuh"  // SortedRows, YVec, sum_slots

namespace fusedmoe::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

int num_sms() {
  static std::mutex mu;
  static std::vector<int> cache;
  int dev = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(cache.size()) <= dev) cache.resize(dev + 1, 0);
  if (cache[dev] == 0)
    FUSEDMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cache[dev], cudaDevAttrMultiProcessorCount, dev));
  return cache[dev];
}

namespace {

// One block per (token, chunk of 1024 columns: kCols = 4 f32 or 8 bf16 y values
// a thread, 16-byte loads): a decode-size T still spreads over many SMs. The
// kernel is latency-bound (ids -> y rows -> out), so every thread reads its
// token's ids and slot rows itself (broadcast loads, no block barrier before
// the y loads), loads up to 8 rows at once, and adds them in slot order,
// skipping empty slots, so the sum is the same on every run.
constexpr int kFinalizeCols = 1024;
template <typename Y>
__host__ __device__ constexpr int finalize_threads() {
  return kFinalizeCols / YVec<Y>::kCols;
}

template <typename Out, bool kRows, typename Y = float, int kU = 8>
__global__ void __launch_bounds__(finalize_threads<Y>(), 1024 / finalize_threads<Y>())
    finalize_kernel(const Y* __restrict__ y, const int32_t* __restrict__ ids, int top_k,
                    int num_experts, int64_t hidden, int64_t chunks,
                    const float* __restrict__ shared, const float* __restrict__ shared_gate,
                    const uint16_t* __restrict__ x, bool x_f16, int64_t ldx, Out* __restrict__ out,
                    int64_t ldo, const SortedRows rows) {
  constexpr int kCols = YVec<Y>::kCols;
  constexpr int kThreads = finalize_threads<Y>();
  __shared__ float red[kThreads / 32];
  __shared__ float gate_s;
  pdl_wait();  // y, ids, shared from the kernels before; out may be read by them
  pdl_launch_dependents();
  const int64_t t = blockIdx.x / chunks;
  const int64_t h = (blockIdx.x % chunks) * kFinalizeCols + threadIdx.x * kCols;
  float gate = 1.0f;
  if (shared != nullptr && shared_gate != nullptr) {
    float d = 0.0f;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x)
      d += (x_f16 ? __half2float(__ushort_as_half(x[t * ldx + c]))
                  : bf16_bits_to_float(x[t * ldx + c])) *
           shared_gate[c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = d;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) sum += red[w];
      gate_s = 1.0f / (1.0f + expf(-sum));
    }
    __syncthreads();
    gate = gate_s;
  }
  if (h >= hidden) return;
  // hidden % kCols == 0 (checked): 16-byte reads of y, float4 reads of bias and shared.
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
  sum_slots<kRows, Y, kU>(y, ids, top_k, num_experts, hidden, t * top_k, h, rows, acc);
  if (shared) {
#pragma unroll
    for (int c = 0; c < kCols; c += 4) {
      const float4 w = *reinterpret_cast<const float4*>(shared + t * hidden + h + c);
      acc[c] += gate * w.x;
      acc[c + 1] += gate * w.y;
      acc[c + 2] += gate * w.z;
      acc[c + 3] += gate * w.w;
    }
  }
  store_out_vec<kCols>(out + t * ldo + h, acc);
}

template <typename In>
__device__ __forceinline__ float load_in(const In* p);
template <>
__device__ __forceinline__ float load_in<float>(const float* p) {
  return *p;
}
template <>
__device__ __forceinline__ float load_in<uint16_t>(const uint16_t* p) {  // bf16
  return bf16_bits_to_float(*p);
}
template <>
__device__ __forceinline__ float load_in<__half>(const __half* p) {
  return __half2float(*p);
}

template <typename In, typename Out>
__global__ void to_half_kernel(const In* __restrict__ x, int64_t ldx, int64_t hidden,
                               const float* __restrict__ row_scale, int64_t scale_stride,
                               Out* __restrict__ xb) {
  pdl_wait();  // x (and row_scale) from the kernels before; xb read by them
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const float s = row_scale ? row_scale[t * scale_stride] : 1.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    const float v = load_in(x + t * ldx + h);
    store_out(xb + t * hidden + h, row_scale ? v * s : v);
  }
}

template <typename In>
void launch_to_half(const In* x, int64_t ldx, int64_t T, int64_t H, const float* row_scale,
                    int64_t scale_stride, DType out_dtype, void* out, Stream stream) {
  const unsigned grid = static_cast<unsigned>(T);
  const int threads = H >= 1024 ? 256 : 128;
  if (out_dtype == DType::kF16)
    launch_pdl(to_half_kernel<In, __half>, grid, threads, 0, stream, x, ldx, H, row_scale,
               scale_stride, static_cast<__half*>(out));
  else
    launch_pdl(to_half_kernel<In, uint16_t>, grid, threads, 0, stream, x, ldx, H, row_scale,
               scale_stride, static_cast<uint16_t*>(out));
}

// ---- router GEMM (f32 math) ----
// Tiled: 64 tokens x 64 logits per block, 256 threads, 4 x 4 outputs each.
constexpr int kRgTile = 64, kRgK = 16;

template <typename X, typename W>
__global__ void __launch_bounds__(256)
    router_gemm_tiled(const X* __restrict__ x, int64_t ldx, int64_t T, int64_t H,
                      const W* __restrict__ w, int64_t L, const float* __restrict__ b,
                      float* __restrict__ out, int64_t ldl) {
  __shared__ float xs[kRgK][kRgTile + 4];
  __shared__ float ws[kRgK][kRgTile + 4];
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kRgTile;
  const int64_t l0 = static_cast<int64_t>(blockIdx.x) * kRgTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < H; k0 += kRgK) {
    for (int i = threadIdx.x; i < kRgTile * kRgK; i += 256) {
      const int r = i / kRgK, kk = i % kRgK;
      const int64_t kg = k0 + kk;
      xs[kk][r] = (t0 + r < T && kg < H) ? load_in(x + (t0 + r) * ldx + kg) : 0.0f;
      ws[kk][r] = (l0 + r < L && kg < H) ? load_in(w + (l0 + r) * H + kg) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kRgK; ++kk) {
      float a[4], bb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bb[j] = ws[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], bb[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t t = t0 + ty * 4 + i, l = l0 + tx * 4 + j;
      if (t < T && l < L) out[t * ldl + l] = acc[i][j] + (b ? b[l] : 0.0f);
    }
}

constexpr int kRgSmallTokens = 8;
constexpr int kRgSmallThreads = 256;
// Few tokens (decode): one block per (logit, group of 8 tokens), its 256
// threads striding over H (loads unrolled 4 deep, so many are in flight: a
// warp per logit looping over all of H took ~50 us for Mixtral's 8 logits),
// then a fixed-order block reduction: the same logits on every run. With xb,
// the blocks of a token group also write its rows as bf16 (as to_bf16_kernel).
template <typename X, typename W>
__global__ void __launch_bounds__(kRgSmallThreads)
    router_gemm_small(const X* __restrict__ x, int64_t ldx, int64_t T, int64_t H,
                      const W* __restrict__ w, int64_t L, const float* __restrict__ b,
                      float* __restrict__ out, int64_t ldl, uint16_t* __restrict__ xb) {
  __shared__ float red[kRgSmallThreads / 32][kRgSmallTokens];
  pdl_wait();  // x from the kernels before; out read by them
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t l = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kRgSmallTokens;
  float acc[kRgSmallTokens] = {};
  const int nt = static_cast<int>(T - t0 < kRgSmallTokens ? T - t0 : kRgSmallTokens);
#pragma unroll 4
  for (int64_t h = threadIdx.x; h < H; h += kRgSmallThreads) {
    const float wv = load_in(w + l * H + h);
#pragma unroll
    for (int i = 0; i < kRgSmallTokens; ++i)
      if (i < nt) acc[i] = fmaf(load_in(x + (t0 + i) * ldx + h), wv, acc[i]);
  }
#pragma unroll
  for (int i = 0; i < kRgSmallTokens; ++i) {
    float v = acc[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[warp][i] = v;
  }
  __syncthreads();
  if (threadIdx.x < nt) {
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < kRgSmallThreads / 32; ++wi) v += red[wi][threadIdx.x];
    out[(t0 + threadIdx.x) * ldl + l] = v + (b ? b[l] : 0.0f);
  }
  if (xb != nullptr)
    for (int i = 0; i < nt; ++i)
      for (int64_t h = l * kRgSmallThreads + threadIdx.x; h < H; h += L * kRgSmallThreads)
        xb[(t0 + i) * H + h] = float_to_bf16_bits(load_in(x + (t0 + i) * ldx + h));
}

// bf16 x and bf16 gate weights, T > kRgTensorCoreMinTokens: the dense mma.sync
// GEMM of the experts (sm90_bf16_grouped_gemm.cuh: one expert, kScatter
// epilogue adds the bias and stores f32 with any N and row stride). Its bf16 x
// bf16 products are exact in f32 and accumulate in f32, as on the CUDA cores;
// only the order of the f32 sums differs. Tile (estimated from the data each
// work item reads, not swept): m64n128 once it gives ~3/4 of a wave of work
// items (DeepSeek-V3 T = 4096: 64 x 2), else m16n64 (more, smaller items: a
// few hundred tokens, or few logits as Mixtral's 8).
constexpr int64_t kRgTensorCoreMinTokens = 32;

GemmTile router_gemm_tile(int64_t T, int64_t L) {
  const int64_t big_items = ceil_div(T, int64_t{64}) * ceil_div(L, int64_t{128});
  return big_items * 4 >= int64_t{num_sms()} * 3 ? GemmTile::kM64N128 : GemmTile::kM16N64;
}

// xb: written by router_gemm_small only (T <= 32); the caller converts otherwise.
constexpr int64_t kRgSmallMaxTokens = 32;
template <typename X, typename W>
void launch_router_gemm(const X* x, int64_t ldx, int64_t T, int64_t H, const W* w, int64_t L,
                        const float* b, float* out, int64_t ldl, Stream stream, uint16_t* xb) {
  if (T <= kRgSmallMaxTokens) {
    dim3 grid(static_cast<unsigned>(L), static_cast<unsigned>(ceil_div(T, kRgSmallTokens)));
    launch_pdl(router_gemm_small<X, W>, grid, kRgSmallThreads, 0, stream, x, ldx, T, H, w, L, b,
               out, ldl, xb);
    return;
  } else {
    dim3 grid(static_cast<unsigned>(ceil_div(L, kRgTile)),
              static_cast<unsigned>(ceil_div(T, kRgTile)));
    router_gemm_tiled<X, W><<<grid, 256, 0, stream>>>(x, ldx, T, H, w, L, b, out, ldl);
  }
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void finalize(const FinalizeArgs& a, Stream stream) {
  if (a.num_tokens == 0) return;
  FUSEDMOE_CHECK(a.hidden % 4 == 0, "finalize: hidden size must be a multiple of 4, got ",
                 a.hidden);
  FUSEDMOE_CHECK(a.top_k >= 1 && a.top_k <= 32, "finalize: top_k must be in [1, 32], got ",
                 a.top_k);
  FUSEDMOE_CHECK(a.shared_gate == nullptr || a.x != nullptr,
                 "finalize: the shared expert gate needs x");
  FUSEDMOE_CHECK(a.slot_row != nullptr || (a.row_scale == nullptr && a.bias == nullptr),
                 "finalize: row_scale and bias apply only with slot_row (expert-sorted y)");
  FUSEDMOE_CHECK(
      a.out_dtype == DType::kF32 || a.out_dtype == DType::kBF16 || a.out_dtype == DType::kF16,
      "finalize: output dtype must be f32, bf16 or f16, got ", dtype_name(a.out_dtype));
  FUSEDMOE_CHECK(a.y_dtype == DType::kF32 || a.y_dtype == DType::kBF16,
                 "finalize: y dtype must be f32 or bf16, got ", dtype_name(a.y_dtype));
  FUSEDMOE_CHECK(a.x_dtype == DType::kBF16 || a.x_dtype == DType::kF16,
                 "finalize: x dtype must be bf16 or f16, got ", dtype_name(a.x_dtype));
  const int64_t cols = a.y_dtype == DType::kBF16 ? 8 : 4;  // per thread: YVec
  FUSEDMOE_CHECK(a.hidden % cols == 0, "finalize: hidden size must be a multiple of ", cols,
                 " with ", dtype_name(a.y_dtype), " y, got ", a.hidden);
  const int64_t chunks = ceil_div(a.hidden, int64_t{kFinalizeCols});
  FUSEDMOE_CHECK(a.num_tokens * chunks < (int64_t{1} << 31),
                 "finalize: too many tokens for one launch: ", a.num_tokens);
  const unsigned grid = static_cast<unsigned>(a.num_tokens * chunks);
  const SortedRows rows{a.slot_row, a.row_scale, a.bias};
  const int num_experts = static_cast<int>(a.num_experts);
  const bool x_f16 = a.x_dtype == DType::kF16;
  auto launch = [&](auto* out) {
    using Out = std::remove_pointer_t<decltype(out)>;
    auto go = [&](auto kernel, const auto* y) {
      using Y = std::remove_const_t<std::remove_pointer_t<decltype(y)>>;
      launch_pdl(kernel, grid, finalize_threads<Y>(), 0, stream, y, a.topk_ids,
                 static_cast<int>(a.top_k), num_experts, a.hidden, chunks, a.shared, a.shared_gate,
                 a.x, x_f16, a.ldx, out, a.ldo, rows);
    };
    // Rows in flight a thread: top_k rounded up to 1, 2, 4 or 8 (eight for every
    // k: at k = 2 a quarter of the threads with two loads each). The launch
    // bounds hold the kernel to 64 registers (8 bf16-rows blocks an SM: y rows
    // stay raw until added); at 95 registers, 5 blocks an SM, it read at 42-45 %
    // of DRAM bandwidth, at 64 at 78-85 % (ncu, H200, Qwen3 / DeepSeek-V3
    // T = 4096: 72.7 -> 39.5 us, 242 -> 128 us; bench/results/2026-11-30-session17.md).
    auto by_rows = [&](auto u) {
      constexpr int kU = decltype(u)::value;
      if (a.y_dtype == DType::kBF16 && a.slot_row)
        go(finalize_kernel<Out, true, uint16_t, kU>, static_cast<const uint16_t*>(a.y));
      else if (a.y_dtype == DType::kBF16)  // the peer transport's bf16 combine rows
        go(finalize_kernel<Out, false, uint16_t, kU>, static_cast<const uint16_t*>(a.y));
      else if (a.slot_row)
        go(finalize_kernel<Out, true, float, kU>, static_cast<const float*>(a.y));
      else
        go(finalize_kernel<Out, false, float, kU>, static_cast<const float*>(a.y));
    };
    if (a.top_k <= 1)
      by_rows(std::integral_constant<int, 1>{});
    else if (a.top_k <= 2)
      by_rows(std::integral_constant<int, 2>{});
    else if (a.top_k <= 4)
      by_rows(std::integral_constant<int, 4>{});
    else
      by_rows(std::integral_constant<int, 8>{});
  };
  if (a.out_dtype == DType::kF32)
    launch(static_cast<float*>(a.out));
  else if (a.out_dtype == DType::kF16)
    launch(static_cast<__half*>(a.out));
  else
    launch(static_cast<uint16_t*>(a.out));
}

void to_half_rows(const void* x, DType in_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                  const float* row_scale, int64_t scale_stride, DType out_dtype, void* out,
                  Stream stream) {
  if (num_tokens == 0) return;
  FUSEDMOE_CHECK(in_dtype == DType::kF32 || in_dtype == DType::kBF16 || in_dtype == DType::kF16,
                 "to_half_rows: input dtype must be f32, bf16 or f16, got ", dtype_name(in_dtype));
  FUSEDMOE_CHECK(out_dtype == DType::kBF16 || out_dtype == DType::kF16,
                 "to_half_rows: output dtype must be bf16 or f16, got ", dtype_name(out_dtype));
  if (in_dtype == DType::kF32)
    launch_to_half(static_cast<const float*>(x), ldx, num_tokens, hidden, row_scale, scale_stride,
                   out_dtype, out, stream);
  else if (in_dtype == DType::kF16)
    launch_to_half(static_cast<const __half*>(x), ldx, num_tokens, hidden, row_scale, scale_stride,
                   out_dtype, out, stream);
  else
    launch_to_half(static_cast<const uint16_t*>(x), ldx, num_tokens, hidden, row_scale,
                   scale_stride, out_dtype, out, stream);
}

void to_bf16_rows(const void* x, DType in_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                  const float* row_scale, int64_t scale_stride, uint16_t* xb, Stream stream) {
  to_half_rows(x, in_dtype, ldx, num_tokens, hidden, row_scale, scale_stride, DType::kBF16, xb,
               stream);
}

void router_gemm(const void* x, DType x_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                 const void* gate_w, DType w_dtype, int64_t num_logits, const float* gate_b,
                 float* router_logits, int64_t ldl, Stream stream, uint16_t* x_bf16) {
  if (num_tokens == 0) return;
  const bool xf = x_dtype == DType::kF32, wf = w_dtype == DType::kF32;
  const bool xh = x_dtype == DType::kF16;
  FUSEDMOE_CHECK(xf || xh || x_dtype == DType::kBF16, "router_gemm: x must be f32, bf16 or f16");
  FUSEDMOE_CHECK(wf || w_dtype == DType::kBF16, "router_gemm: gate weight must be f32 or bf16");
  FUSEDMOE_CHECK(ldx >= hidden, "router_gemm: ldx must be >= hidden = ", hidden, ", got ", ldx);
  FUSEDMOE_CHECK(num_logits >= 1 && ldl >= num_logits,
                 "router_gemm: ldl must be >= num_logits = ", num_logits, ", got ", ldl);
  // 16-byte aligned rows for cp.async: true for every contiguous bf16 [T, H]
  // with H % 8 == 0 (the CUDA layer checks H % 8); otherwise the CUDA-core path.
  const bool aligned16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(gate_w) % 16 == 0 && hidden % 8 == 0 &&
                         ldx % 8 == 0;
  if (!xf && !xh && !wf && num_tokens > kRgTensorCoreMinTokens && aligned16) {
    GroupedGemmArgs g;
    g.epilogue = GemmEpilogue::kScatter;
    g.tile = router_gemm_tile(num_tokens, num_logits);
    g.a = static_cast<const uint16_t*>(x);
    g.lda = ldx;
    g.m = num_tokens;
    g.w = static_cast<const uint16_t*>(gate_w);
    g.n = num_logits;
    g.k = hidden;
    g.bias = gate_b;
    g.out = router_logits;
    g.ldc = ldl;
    grouped_gemm(g, stream);
    if (x_bf16) to_bf16_rows(x, x_dtype, ldx, num_tokens, hidden, nullptr, 0, x_bf16, stream);
    return;
  }
  auto with_w = [&](const auto* xp) {
    if (wf)
      launch_router_gemm(xp, ldx, num_tokens, hidden, static_cast<const float*>(gate_w), num_logits,
                         gate_b, router_logits, ldl, stream, x_bf16);
    else
      launch_router_gemm(xp, ldx, num_tokens, hidden, static_cast<const uint16_t*>(gate_w),
                         num_logits, gate_b, router_logits, ldl, stream, x_bf16);
  };
  if (xf)
    with_w(static_cast<const float*>(x));
  else if (xh)
    with_w(static_cast<const __half*>(x));
  else
    with_w(static_cast<const uint16_t*>(x));
  if (x_bf16 && num_tokens > kRgSmallMaxTokens)
    to_bf16_rows(x, x_dtype, ldx, num_tokens, hidden, nullptr, 0, x_bf16, stream);
}

}  // namespace fusedmoe::cuda
