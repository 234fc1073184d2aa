// fusedmoe: gated activations between the two expert GEMMs.
//
//   SiLU-GLU       silu(g) * u,  silu(g) = g * sigmoid(g)          (Shazeer 2020, "silu")
//   GELU-GLU       gelu(g) * u,  gelu(g) = g/2 (1 + erf(g / sqrt 2)) ("gelu")
//   GELU-tanh-GLU  g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u ("gelu_pytorch_tanh")
//   gpt-oss        g = min(g, limit), u = clamp(u, -limit, limit),
//                  (u + 1) * (g * sigmoid(alpha * g))              (HF GptOssExperts._apply_gate)
//
// sigmoid uses a branch-free exp (Cephes polynomial, ~1 ulp) that saturates to
// 0 / +Inf, so the loops vectorise and large |x| gives 0 or x, never NaN.
// GELU uses erfc and GELU-tanh x * sigmoid(2z) to avoid cancellation for x << 0.
#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fusedmoe/experts/expert_weights.h"

namespace fusedmoe {

namespace {

// e^x, branch-free so loops vectorise: Cephes expf polynomial (~1 ulp) on
// [-87.3, 88.3]; 0 below, +Inf above (so sigmoid reaches exactly 0 and 1).
[[gnu::always_inline]] inline float exp_f32(float x) {
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.3f ? 88.3f : xc;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 128): vectorises, unlike floorf.
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r + 1.0f) *
                  bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  const float big = x > 88.3f ? std::numeric_limits<float>::infinity() : y;
  return x < -87.3f ? 0.0f : big;
}

[[gnu::always_inline]] inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp_f32(-x));
}

// out[r, i] = fn(gate[r, i], up[r, i]), then optional bf16 rounding; simple
// restrict-qualified loops so that GCC vectorises them (also under -fPIC).
template <typename Fn>
[[gnu::always_inline]] inline void map_rows(const float* gate, const float* up, int64_t ldx,
                                            float* out, int64_t ldo, int64_t rows, int64_t n,
                                            bool round_bf16, Fn fn) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict g = gate + r * ldx;
    const float* __restrict u = up + r * ldx;
    float* __restrict o = out + r * ldo;
    for (int64_t i = 0; i < n; ++i) o[i] = fn(g[i], u[i]);
    if (round_bf16)
      for (int64_t i = 0; i < n; ++i) o[i] = round_to_bf16(o[i]);
  }
}

}  // namespace

namespace cpu {

// On x86-64 GCC also builds AVX2 and AVX-512 copies of this function and
// picks one at load time (target_clones: 8- or 16-wide loops instead of SSE2's
// 4; qwen3-cpu T = 1024: 266 -> 281 GFLOP/s). The operations are element-wise
// and contraction into FMA is off, so every copy gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=off")))
#endif
void activation_rows(const ActivationParams& p, const float* gate, const float* up, int64_t ldx,
                     float* out, int64_t ldo, int64_t rows, int64_t n, bool round_bf16) {
  switch (p.activation) {
    case Activation::kSiluGlu:
      map_rows(gate, up, ldx, out, ldo, rows, n, round_bf16,
               [](float g, float u) { return g * sigmoid(g) * u; });
      break;
    case Activation::kGeluGlu:
      // 1 + erf(x / sqrt 2) = erfc(-x / sqrt 2): no cancellation for x << 0.
      map_rows(gate, up, ldx, out, ldo, rows, n, round_bf16, [](float g, float u) {
        return 0.5f * g * std::erfc(g * -0.70710678118654752f) * u;
      });
      break;
    case Activation::kGeluTanhGlu:
      // x/2 (1 + tanh(z)) = x * sigmoid(2z): exact identity, no cancellation.
      map_rows(gate, up, ldx, out, ldo, rows, n, round_bf16, [](float g, float u) {
        const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return g * sigmoid(2.0f * z) * u;
      });
      break;
    case Activation::kSwigluOai: {
      const float limit = p.swiglu_limit, alpha = p.swiglu_alpha;
      map_rows(gate, up, ldx, out, ldo, rows, n, round_bf16, [=](float g, float u) {
        const float x = std::min(g, limit);
        const float y = std::clamp(u, -limit, limit);
        return (y + 1.0f) * (x * sigmoid(x * alpha));
      });
      break;
    }
  }
}

}  // namespace cpu

void apply_activation(const ActivationParams& p, const float* x, int64_t ldx, float* out,
                      int64_t ldo, int64_t rows, int64_t intermediate_size) {
  cpu::activation_rows(p, x, x + intermediate_size, ldx, out, ldo, rows, intermediate_size, false);
}

}  // namespace fusedmoe
