// fusedmoe internal: fixed-order CPU GEMM (see gemm.h).
//
// "NT" dot-product form: a tile of MR rows of A and NR rows of W keeps MR x NR
// 16-lane accumulators in registers over the whole K loop, then reduces each.
// W (f32 or bf16) is read row-contiguously, so no transposition/packing is
// needed; bf16 is widened by a 16-bit shift (exact) right after the load.
#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSEDMOE_GEMM_AVX512 1
#include <immintrin.h>
// GCC 12 reports its own _mm512_undefined_* helpers as uninitialised (false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fusedmoe::cpu {

namespace {

constexpr int kMR = 4;             // rows of A per tile
constexpr int kNR = 4;             // rows of W per tile (kMR > 1)
constexpr int kNR1 = 8;            // rows of W per tile when the tile has one row of A
constexpr int kLanes = 16;         // accumulation lanes (one zmm of f32)
constexpr int64_t kColBlock = 64;  // W rows per L2-resident column block

using TileFn = void (*)(int64_t K, const float* A, int64_t lda, const void* W, int64_t ldw,
                        float* C, int64_t ldc, const void* bias, DType bias_dtype);

#ifdef FUSEDMOE_GEMM_AVX512

template <bool kBF16>
inline __m512 load_w(const void* w, int64_t off) {
  if constexpr (kBF16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(w) + off);
  }
}

template <bool kBF16>
inline __m512 load_w_masked(const void* w, int64_t off, __mmask16 m) {
  if constexpr (kBF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(w) + off);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(w) + off);
  }
}

// Fixed reduction tree of the 16 lanes (the same for every element).
inline float reduce_lanes(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  const __m128 s = _mm_add_ss(p, _mm_movehdup_ps(p));
  return _mm_cvtss_f32(s);
}

template <int MR, int NR, bool kBF16>
void tile(int64_t K, const float* A, int64_t lda, const void* W, int64_t ldw, float* C, int64_t ldc,
          const void* bias, DType bias_dtype) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t k_main = K / kLanes * kLanes;
  for (int64_t k = 0; k < k_main; k += kLanes) {
    __m512 w[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) w[j] = load_w<kBF16>(W, j * ldw + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_loadu_ps(A + i * lda + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, w[j], acc[i][j]);
    }
  }
  if (k_main < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k_main)) - 1u);
    __m512 w[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) w[j] = load_w_masked<kBF16>(W, j * ldw + k_main, m);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_maskz_loadu_ps(m, A + i * lda + k_main);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, w[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float s = reduce_lanes(acc[i][j]);
      if (bias) s += load_as_f32(bias, bias_dtype, j);
      C[i * ldc + j] = s;
    }
}

#else  // portable fallback: the same order with 16 scalar lanes

template <int MR, int NR, bool kBF16>
void tile(int64_t K, const float* A, int64_t lda, const void* W, int64_t ldw, float* C, int64_t ldc,
          const void* bias, DType bias_dtype) {
  const DType wt = kBF16 ? DType::kBF16 : DType::kF32;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float lanes[kLanes] = {};
      for (int64_t k = 0; k < K; ++k)
        lanes[k % kLanes] += A[i * lda + k] * load_as_f32(W, wt, j * ldw + k);
      for (int w = kLanes / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      float s = lanes[0];
      if (bias) s += load_as_f32(bias, bias_dtype, j);
      C[i * ldc + j] = s;
    }
}

#endif

template <bool kBF16, int MR, size_t... NRs>
constexpr std::array<TileFn, sizeof...(NRs)> tile_row(std::index_sequence<NRs...>) {
  return {(NRs == 0 ? nullptr : &tile<MR, static_cast<int>(NRs == 0 ? 1 : NRs), kBF16>)...};
}

template <bool kBF16, size_t... MRs>
constexpr std::array<std::array<TileFn, kNR1 + 1>, sizeof...(MRs)> tile_table(
    std::index_sequence<MRs...>) {
  return {(MRs == 0 ? std::array<TileFn, kNR1 + 1>{}
                    : tile_row<kBF16, static_cast<int>(MRs == 0 ? 1 : MRs)>(
                          std::make_index_sequence<kNR1 + 1>{}))...};
}

// fns[mr][nr]: the tile of mr rows of A and nr rows of W (mr, nr >= 1).
template <bool kBF16>
struct TileTable {
  std::array<std::array<TileFn, kNR1 + 1>, kMR + 1> fns =
      tile_table<kBF16>(std::make_index_sequence<kMR + 1>{});
};
constexpr TileTable<false> kTilesF32;
constexpr TileTable<true> kTilesBF16;

// C = A . W^T for W rows already in memory of dtype `kBF16 ? bf16 : f32`.
template <bool kBF16>
void gemm_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
               int64_t ldw, const void* bias, DType bias_dtype, float* C, int64_t ldc) {
  const auto& fns = kBF16 ? kTilesBF16.fns : kTilesF32.fns;
  const size_t wsize = kBF16 ? 2 : 4;
  const size_t bsize = dtype_size(bias_dtype);
  // Column blocks of kColBlock W rows outer (they stay in L2 while every row
  // tile of A passes over them), row tiles inner.
  for (int64_t nb0 = 0; nb0 < N; nb0 += kColBlock) {
    const int64_t nb1 = std::min(N, nb0 + kColBlock);
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m0));
      const int nr_max = mr == 1 ? kNR1 : kNR;
      for (int64_t n0 = nb0; n0 < nb1; n0 += nr_max) {
        const int nr = static_cast<int>(std::min<int64_t>(nr_max, nb1 - n0));
        fns[mr][nr](K, A + m0 * lda, lda, static_cast<const char*>(W) + n0 * ldw * wsize, ldw,
                    C + m0 * ldc + n0, ldc,
                    bias ? static_cast<const char*>(bias) + n0 * bsize : nullptr, bias_dtype);
      }
    }
  }
}

}  // namespace

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
             DType w_dtype, int64_t ldw, const void* bias, DType bias_dtype, float* C,
             int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (w_dtype == DType::kBF16)
    gemm_rows<true>(M, N, K, A, lda, W, ldw, bias, bias_dtype, C, ldc);
  else
    gemm_rows<false>(M, N, K, A, lda, W, ldw, bias, bias_dtype, C, ldc);
}

void gemm_nt_parallel(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const float* A,
                      int64_t lda, const void* W, DType w_dtype, int64_t ldw, const void* bias,
                      DType bias_dtype, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  // Column blocks of kColBlock W rows (stay in L2 while row tiles pass over them).
  const int64_t mb = 64, nb = kColBlock;
  const int64_t m_blocks = (M + mb - 1) / mb, n_blocks = (N + nb - 1) / nb;
  const int64_t items = m_blocks * n_blocks;
  const size_t wsize = dtype_size(w_dtype), bsize = dtype_size(bias_dtype);
  std::atomic<int64_t> next{0};
  pool.parallel_for(
      std::min<int64_t>(items, pool.num_threads()),
      [&](int64_t, int64_t, int) {
        for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
          const int64_t m0 = it / n_blocks * mb, n0 = it % n_blocks * nb;
          gemm_nt(std::min(mb, M - m0), std::min(nb, N - n0), K, A + m0 * lda, lda,
                  static_cast<const char*>(W) + n0 * ldw * wsize, w_dtype, ldw,
                  bias ? static_cast<const char*>(bias) + n0 * bsize : nullptr, bias_dtype,
                  C + m0 * ldc + n0, ldc);
        }
      },
      1);
}

}  // namespace fusedmoe::cpu
