// fusedmoe internal: AVX-512 (F, BW, VL, DQ) GEMM kernels. Compiled with those
// flags (root CMakeLists.txt); called only when the CPU has them (gemm.cpp).
// The 16 accumulation lanes of gemm.h's order are one zmm.
#include "kernels/cpu/gemm_kernels.h"

#ifdef FUSEDMOE_GEMM_X86

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

// GCC 12 reports its own _mm512_undefined_* helpers as uninitialised (false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace fusedmoe::cpu {
namespace {

struct V {
  __m512 v;
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V zero() { return {_mm512_setzero_ps()}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static V widen(__m256i h) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static V load_bf16(const uint16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_bf16_n(const uint16_t* p, int n) {
    return widen(_mm256_maskz_loadu_epi16(mask(n), p));
  }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
  // gemm.h's tree: h_j = s_j + s_j+8, q_j = h_j + h_j+4, p_j = q_j + q_j+2, p_0 + p_1.
  static float reduce(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
  }
  // The same tree for 16 outputs at once (each add pairs the same two values
  // as reduce does), transposing as it goes; 46 instructions per 16 outputs.
  static void reduce16(const float* s, float* out) {
    __m512 t[8];
    for (int p = 0; p < 8; ++p) {  // h of outputs 2p | 2p+1
      const __m512 a = _mm512_loadu_ps(s + 32 * p), b = _mm512_loadu_ps(s + 32 * p + 16);
      t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    __m512 u[4];
    for (int r = 0; r < 4; ++r)  // q of outputs 4r .. 4r+3, one per 128-bit quarter
      u[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
    __m512 w[2];
    for (int r = 0; r < 2; ++r)  // quarter k: p of outputs 8r + k (lanes 0-1), 8r + 4 + k (2-3)
      w[r] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * r], u[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(u[2 * r], u[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Lane 4k + m holds output 4m + k.
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, r));
  }
};

constexpr int kSmallMR = 4, kSmallNR = 4, kSmallNR1 = 8;
constexpr int kLargeMR = 6, kLargeNR = 4;
constexpr int64_t kLargeMinMBF16 = 24, kLargeMinMF32 = 24;

#include "kernels/cpu/gemm_impl.inc"

}  // namespace

void gemm_nt_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                    bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C,
                    int64_t ldc, const GemmPrefetch* next) {
  gemm_entry(M, N, K, A, lda, W, w_bf16, ldw, bias, bias_bf16, C, ldc, next);
}

}  // namespace fusedmoe::cpu

#endif  // FUSEDMOE_GEMM_X86
