// fusedmoe internal: the routers' element-wise scores in double — sigmoid,
// sqrt(softplus), exp(x - row max) — one code for the CPU routers and the CUDA
// routing kernels, with the same bits on both.
//
// Why not std::exp / CUDA's exp: glibc's exp is correctly rounded, CUDA's is
// within 1 ulp, so the two can differ in the last bit. Selection compares
// these doubles; grouped top-k (DeepSeek-V3) compares sums of two of them,
// and logits a few f32 ulps apart give sums equal to the last double bit
// (s(a - u) + s(a + u) vs 2 s(a)), so one ulp decided which groups were kept
// and the GPU's ids differed from the CPU's (test_cuda_routing's near ties).
// Here every step is an IEEE operation with one rounding on both (explicit
// fma, add, divide, rint, ldexp; no product is left for a compiler to contract,
// also after inlining into a caller: FUSEDMOE_MUL).
//   exp: Cody-Waite reduction x = k ln2 + r (|r| <= ln2 / 2, ln2 in two parts,
//        fdlibm's constants), Taylor series of degree 13 by Horner (truncation
//        < 2^-56 relative), times 2^k: within ~1 ulp.
//   log1p(y), 0 <= y <= 1: 2 atanh(s), s = y / (2 + y) <= 1/3, odd series to
//        s^33 (truncation < 2^-55): within ~3 ulp (the rounded quotient s).
// Source: W. J. Cody and W. Waite, "Software Manual for the Elementary
// Functions" (1980); fdlibm e_exp.c / s_log1p.c for the reduction constants.
#pragma once

#include <cmath>

#include "core/host_device.h"

namespace fusedmoe::routing {

// FUSEDMOE_MUL: a product that a caller may add to (log1p's result in
// sqrt_softplus), kept a rounded product: nvcc would otherwise contract the
// inlined multiply and add into one fma, which the C++ compiler does not do.
#if defined(__CUDA_ARCH__)
#define FUSEDMOE_FMA ::fma
#define FUSEDMOE_RINT ::rint
#define FUSEDMOE_LDEXP ::ldexp
#define FUSEDMOE_MUL __dmul_rn
#else
#define FUSEDMOE_FMA std::fma
#define FUSEDMOE_RINT std::rint
#define FUSEDMOE_LDEXP std::ldexp
#define FUSEDMOE_MUL(a, b) ((a) * (b))
#endif

// e^x in double (NaN -> NaN, beyond the double range -> inf / 0).
FUSEDMOE_HOST_DEVICE inline double exp_d(double x) {
  if (x != x) return x + x;
  if (x > 709.782712893384) return HUGE_VAL;
  if (x < -745.1332191019412) return 0.0;
  const double k = FUSEDMOE_RINT(x * 1.4426950408889634074);
  double r = FUSEDMOE_FMA(-k, 6.93147180369123816490e-01, x);  // ln2 high part: exact
  r = FUSEDMOE_FMA(-k, 1.90821492927058770002e-10, r);         // ln2 low part
  // 1/n!, n = 13 .. 2
  constexpr double kInvFact[] = {
      1.6059043836821613e-10, 2.08767569878681e-09,   2.505210838544172e-08,  2.755731922398589e-07,
      2.7557319223985893e-06, 2.48015873015873e-05,   1.984126984126984e-04,  1.388888888888889e-03,
      8.333333333333333e-03,  4.1666666666666664e-02, 1.6666666666666666e-01, 0.5};
  double p = kInvFact[0];
  for (int i = 1; i < 12; ++i) p = FUSEDMOE_FMA(p, r, kInvFact[i]);
  p = FUSEDMOE_FMA(p, r, 1.0);
  p = FUSEDMOE_FMA(p, r, 1.0);
  return FUSEDMOE_LDEXP(p, static_cast<int>(k));
}

// log(1 + y) in double for 0 <= y <= 1.
FUSEDMOE_HOST_DEVICE inline double log1p_unit_d(double y) {
  // 1 / (2j + 1), j = 16 .. 0
  constexpr double kInvOdd[] = {1.0 / 33, 1.0 / 31, 1.0 / 29, 1.0 / 27, 1.0 / 25, 1.0 / 23,
                                1.0 / 21, 1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13, 1.0 / 11,
                                1.0 / 9,  1.0 / 7,  1.0 / 5,  1.0 / 3,  1.0};
  const double s = y / (2.0 + y);
  const double z = s * s;
  double q = kInvOdd[0];
  for (int j = 1; j < 17; ++j) q = FUSEDMOE_FMA(q, z, kInvOdd[j]);
  return FUSEDMOE_MUL(2.0 * s, q);  // 2.0 * s is exact
}

#undef FUSEDMOE_FMA
#undef FUSEDMOE_RINT
#undef FUSEDMOE_LDEXP
#undef FUSEDMOE_MUL

// 1 / (1 + e^-x).
FUSEDMOE_HOST_DEVICE inline double sigmoid(double x) {
  return 1.0 / (1.0 + exp_d(-x));
}
// sqrt(softplus(x)), softplus(x) = max(x, 0) + log(1 + e^-|x|) (no overflow).
FUSEDMOE_HOST_DEVICE inline double sqrt_softplus(double x) {
  const double ax = x < 0.0 ? -x : x;
  return std::sqrt((x > 0.0 ? x : 0.0) + log1p_unit_d(exp_d(-ax)));
}
// One of k weights renormalized by their sum (+ the guard eps). A +inf sum
// (sqrtsoftplus of a +inf logit) takes the limit, as rel_exp does for
// softmax: the `infinite` weights equal to +inf share 1 equally, the others
// get 0, so no inf / inf = NaN arises.
FUSEDMOE_HOST_DEVICE inline double renormalized(double w, double sum, double eps, double infinite) {
  if (sum == HUGE_VAL) return w == HUGE_VAL ? 1.0 / infinite : 0.0;
  return w / (sum + eps);
}
// exp(x - m) where m is the row maximum. If m is infinite (+inf present, or the
// whole row is -inf) the softmax limit is used: entries equal to m share the
// mass equally and all others get 0, so no NaN arises.
FUSEDMOE_HOST_DEVICE inline double rel_exp(double x, double m) {
  if (m == HUGE_VAL || m == -HUGE_VAL) return x == m ? 1.0 : 0.0;
  return exp_d(x - m);
}

}  // namespace fusedmoe::routing
