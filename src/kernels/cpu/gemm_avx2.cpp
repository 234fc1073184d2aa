// fusedmoe internal: AVX2 + FMA GEMM kernels. Compiled with those flags (root
// CMakeLists.txt); called only when the CPU has them (gemm.cpp). The 16
// accumulation lanes of gemm.h's order are two ymm (lanes 0-7 and 8-15), each
// FMA done on both halves, so the bits equal the AVX-512 and scalar paths'.
#include "kernels/cpu/gemm_kernels.h"

#ifdef FUSEDMOE_GEMM_X86

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace fusedmoe::cpu {
namespace {

struct V {
  __m256 lo, hi;
  static __m256i mask(int n) {  // lanes < n set, n in 0..8
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
  }
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V load_n(const float* p, int n) {
    if (n <= 8) return {_mm256_maskload_ps(p, mask(n)), _mm256_setzero_ps()};
    return {_mm256_loadu_ps(p), _mm256_maskload_ps(p + 8, mask(n - 8))};
  }
  static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load_bf16(const uint16_t* p) {
    return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static V load_bf16_n(const uint16_t* p, int n) {
    alignas(32) uint16_t t[16] = {};
    std::memcpy(t, p, static_cast<size_t>(n) * sizeof(uint16_t));
    return load_bf16(t);
  }
  static V fma(V a, V b, V c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static void store(float* p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  // gemm.h's tree: h_j = s_j + s_j+8, q_j = h_j + h_j+4, p_j = q_j + q_j+2, p_0 + p_1.
  static float reduce(V a) {
    const __m256 h = _mm256_add_ps(a.lo, a.hi);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
  }
  static void reduce16(const float* s, float* out) {
    for (int j = 0; j < 16; ++j) out[j] = reduce(load(s + 16 * j));
  }
};

// 16 ymm registers: tiles of 2 x 3 outputs are 12 ymm of accumulators.
constexpr int kSmallMR = 2, kSmallNR = 3, kSmallNR1 = 4;
constexpr int kLargeMR = 2, kLargeNR = 3;
constexpr int64_t kLargeMinMBF16 = 24, kLargeMinMF32 = 24;

#include "kernels/cpu/gemm_impl.inc"

}  // namespace

void gemm_nt_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                  bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C, int64_t ldc,
                  const GemmPrefetch* next) {
  gemm_entry(M, N, K, A, lda, W, w_bf16, ldw, bias, bias_bf16, C, ldc, next);
}

}  // namespace fusedmoe::cpu

#endif  // FUSEDMOE_GEMM_X86
