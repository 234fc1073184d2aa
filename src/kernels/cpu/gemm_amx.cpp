// fusedmoe internal: bf16 GEMM kernels on Intel AMX (AMX-TILE, AMX-BF16; Sapphire
// Rapids and later). Compiled with those flags plus AVX-512 (root
// CMakeLists.txt, where the compiler knows AMX: FUSEDMOE_AMX); called only
// where amx_supported() (gemm.cpp) is true.
//
// Nothing here calls an inline function of another header (see gemm_impl.inc:
// a copy compiled with these flags could be picked by the linker for callers
// on CPUs without them).
#include "kernels/cpu/gemm_amx.h"

#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

// GCC 12 reports its own _mm512_undefined_* helpers as uninitialised (false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace fusedmoe::cpu {

namespace {

// Tile register use: 0-3 accumulators, 4-5 X (B operand), 6-7 W (A operand);
// every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that do not tell the compiler which
// memory they read: before one reads memory just written here, this keeps the
// stores in place.
inline void memory_barrier() {
  asm volatile("" ::: "memory");
}

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  memory_barrier();
  _tile_loadconfig(&c);
}

// bf16 of each lane (in its low 16 bits): round to nearest even, NaN kept a
// (quiet) NaN, as round_to_bf16; a bf16 value is unchanged.
inline __m512i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, nan);
}

// 16 consecutive pairs (32 floats from p, the first n of them valid, 0 <= n <= 32,
// the rest read as 0) as 16 u32 lanes: lane i = bf16(p[2i]) | bf16(p[2i+1]) << 16.
inline __m512i load_pairs(const float* p, int n) {
  __m512 v0, v1;  // floats 0-15, 16-31
  if (n >= 32) {
    v0 = _mm512_loadu_ps(p);
    v1 = _mm512_loadu_ps(p + 16);
  } else {
    const int n0 = n < 16 ? n : 16, n1 = n - n0;
    v0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1u), p);
    v1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1u), p + 16);
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i e = to_bf16(_mm512_permutex2var_ps(v0, even, v1));
  const __m512i o = to_bf16(_mm512_permutex2var_ps(v0, odd, v1));
  return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

// W rows [0, rows) (rows <= 32) x K at w (row stride ldw) as ceil(K / 32) pairs
// of 16-row tiles, zero-padded: wp[(kb * 2 + r / 16) * 512 + (r % 16) * 32 + k]
// (for blocks with a partial tile; measured slower than loading whole tiles in
// place, so only for those).
void pack_w(const uint16_t* w, int64_t ldw, int rows, int64_t K, uint16_t* wp) {
  const int64_t kb_count = (K + 31) / 32, k_main = K / 32 * 32;
  if (rows < 32 || k_main < K) std::memset(wp, 0, kb_count * 2 * 1024);
  // Row by row, in memory order (the block is one stream when ldw == K).
  for (int r = 0; r < rows; ++r) {
    const uint16_t* src = w + r * ldw;
    uint16_t* dst = wp + (r / 16) * 512 + (r % 16) * 32;
    int64_t kb = 0;
    for (; kb * 32 < k_main; ++kb) {
      _mm512_store_si512(dst + kb * 1024, _mm512_loadu_si512(src + kb * 32));
    }
    if (k_main < K) std::memcpy(dst + kb * 1024, src + k_main, (K - k_main) * 2);
  }
}

// C[m, n0 + n] = acc[n][m] (+ bias[n0 + n]) for m < mv, n < nv.
inline void store_ct(const float* acc, int mv, int nv, float* C, int64_t ldc, const void* bias,
                     bool bias_bf16, int64_t n0) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nv) - 1u);
  __m512 b = _mm512_setzero_ps();
  if (bias) {
    if (bias_bf16)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                                    mask, static_cast<const uint16_t*>(bias) + n0)),
                                                16));
    else
      b = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(bias) + n0);
  }
  const __m512i col =
      _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int m = 0; m < mv; ++m) {
    __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask,
                                        _mm512_add_epi32(col, _mm512_set1_epi32(m)), acc, 4);
    if (bias) v = _mm512_add_ps(v, b);
    _mm512_mask_storeu_ps(C + m * ldc + n0, mask, v);
  }
}

// One block: NT tiles of 16 W rows x MT tiles of 16 rows of X (packed, xp)
// over all K blocks. W's row r, k block kb is at w + r * ld + kb * kstep: W in
// place (ld = ldw, kstep = 32; then each row is prefetched ahead) or pack_w's
// copy (ld = 32, kstep = 1024).
template <int NT, int MT>
void block(const uint16_t* xp, int64_t kb_count, int mv0, int mv1, const uint16_t* w, int64_t ld,
           int64_t kstep, bool in_place, int nv0, int nv1, float* C, int64_t ldc, const void* bias,
           bool bias_bf16, int64_t n0) {
  alignas(64) float acc[16 * 16];
  _tile_zero(0);
  if (MT > 1) _tile_zero(1);
  if (NT > 1) _tile_zero(2);
  if (NT > 1 && MT > 1) _tile_zero(3);
  const int64_t x_stride = kb_count * 512;  // u16 per packed row tile
  memory_barrier();                         // the packed X and W written before
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* wk = w + kb * kstep;
    // Each W row is a stream of its own: 512 bytes ahead into L2.
    if (in_place)
      for (int r = 0; r < NT * 16; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wk + r * ld + 256), _MM_HINT_T1);
    _tile_loadd(4, xp + kb * 512, 64);
    if (MT > 1) _tile_loadd(5, xp + x_stride + kb * 512, 64);
    _tile_loadd(6, wk, ld * 2);
    _tile_dpbf16ps(0, 6, 4);
    if (MT > 1) _tile_dpbf16ps(1, 6, 5);
    if (NT > 1) {
      _tile_loadd(7, wk + 16 * ld, ld * 2);
      _tile_dpbf16ps(2, 7, 4);
      if (MT > 1) _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, acc, 64);
  memory_barrier();  // acc written by the tile stores
  store_ct(acc, mv0, nv0, C, ldc, bias, bias_bf16, n0);
  if (MT > 1) {
    _tile_stored(1, acc, 64);
    memory_barrier();
    store_ct(acc, mv1, nv0, C + 16 * ldc, ldc, bias, bias_bf16, n0);
  }
  if (NT > 1) {
    _tile_stored(2, acc, 64);
    memory_barrier();
    store_ct(acc, mv0, nv1, C, ldc, bias, bias_bf16, n0 + 16);
    if (MT > 1) {
      _tile_stored(3, acc, 64);
      memory_barrier();
      store_ct(acc, mv1, nv1, C + 16 * ldc, ldc, bias, bias_bf16, n0 + 16);
    }
  }
}

// The per-thread packed W block (32 rows x K), grown as needed, kept until the thread ends.
struct WScratch {
  uint16_t* p = nullptr;
  int64_t elems = 0;
  uint16_t* get(int64_t n) {
    if (n > elems) {
      std::free(p);
      p = static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(n) * 2));
      elems = p ? n : 0;
    }
    return p;
  }
  ~WScratch() { std::free(p); }
};
thread_local WScratch t_wp;

}  // namespace

void amx_pack_rows(const float* X, int64_t ldx, int64_t rows, int64_t K, uint16_t* dst) {
  const int64_t kb_count = (K + 31) / 32;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const int64_t k0 = kb * 32;
    const int n = static_cast<int>(K - k0 < 32 ? K - k0 : 32);
    // Row m's 16 pairs as 16 u32 lanes; the tile is their 16 x 16 transpose.
    alignas(64) uint32_t t[16][16];
    for (int64_t m = 0; m < 16; ++m) {
      const __m512i v = m < rows ? load_pairs(X + m * ldx + k0, n) : _mm512_setzero_si512();
      _mm512_store_si512(t[m], v);
    }
    uint32_t* out = reinterpret_cast<uint32_t*>(dst + kb * 512);  // [pair][m]
    for (int p = 0; p < 16; ++p) {
      const __m512i idx = _mm512_add_epi32(
          _mm512_set1_epi32(p),
          _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                      10, 11, 12, 13, 14, 15)));
      _mm512_storeu_si512(out + p * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                                                    static_cast<__mmask16>(0xffff),
                                                                    idx, &t[0][0], 4));
    }
  }
}

void amx_gemm_packed(const uint16_t* xp, int64_t rows, int64_t N, int64_t K, const uint16_t* W,
                     int64_t ldw, const void* bias, bool bias_bf16, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  const int64_t kb_count = (K + 31) / 32, x_stride = kb_count * 512;
  const int64_t m_tiles = (rows + 15) / 16;
  // (K = 0: no k step; the blocks store 0 + bias.)
  const int64_t wp_elems = (kb_count > 0 ? kb_count : 1) * 1024;
  uint16_t* wp = t_wp.get(wp_elems);
  if (wp == nullptr) amx_out_of_memory(static_cast<size_t>(wp_elems) * 2);
  configure_tiles();
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int nv = static_cast<int>(N - n0 < 32 ? N - n0 : 32);
    const int nv0 = nv < 16 ? nv : 16, nv1 = nv - nv0;  // nv1 0: one n tile
    // Whole tiles are read in place; a block with a partial tile (N or K not
    // a multiple of 16 / 32) through a zero-padded copy.
    const bool in_place = nv % 16 == 0 && K % 32 == 0;
    const uint16_t* w = W + n0 * ldw;
    if (!in_place) {
      pack_w(w, ldw, nv, K, wp);
      w = wp;
    }
    const int64_t ld = in_place ? ldw : 32, kstep = in_place ? 32 : 1024;
    for (int64_t mt = 0; mt < m_tiles; mt += 2) {
      const int mv0 = static_cast<int>(rows - mt * 16 < 16 ? rows - mt * 16 : 16);
      const int mv1 = static_cast<int>(rows - mt * 16 - 16 < 16 ? rows - mt * 16 - 16 : 16);
      const uint16_t* x = xp + mt * x_stride;
      float* c = C + mt * 16 * ldc;
      if (nv1 > 0 && mv1 > 0)
        block<2, 2>(x, kb_count, mv0, mv1, w, ld, kstep, in_place, nv0, nv1, c, ldc, bias,
                    bias_bf16, n0);
      else if (nv1 > 0)
        block<2, 1>(x, kb_count, mv0, 0, w, ld, kstep, in_place, nv0, nv1, c, ldc, bias, bias_bf16,
                    n0);
      else if (mv1 > 0)
        block<1, 2>(x, kb_count, mv0, mv1, w, ld, kstep, in_place, nv0, 0, c, ldc, bias, bias_bf16,
                    n0);
      else
        block<1, 1>(x, kb_count, mv0, 0, w, ld, kstep, in_place, nv0, 0, c, ldc, bias, bias_bf16,
                    n0);
    }
  }
  _tile_release();
}

float amx_peak_kernel(int64_t iters) {
  configure_tiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  alignas(64) uint16_t one[512];
  for (uint16_t& v : one) v = 0x3f80;  // 1.0
  memory_barrier();
  _tile_loadd(4, one, 64);
  _tile_loadd(5, one, 64);
  _tile_loadd(6, one, 64);
  _tile_loadd(7, one, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    _tile_dpbf16ps(2, 7, 4);
    _tile_dpbf16ps(3, 7, 5);
  }
  alignas(64) float acc[256];
  _tile_stored(0, acc, 64);
  memory_barrier();
  _tile_release();
  return acc[0];
}

}  // namespace fusedmoe::cpu

#endif  // FUSEDMOE_GEMM_X86 && FUSEDMOE_AMX
