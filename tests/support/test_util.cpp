#include "test_util.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "fusedmoe/core/error.h"

namespace fusedmoe::test {

uint64_t fresh_seed() {
  if (const char* s = std::getenv("FUSEDMOE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Tensor random_f32(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float lo, float hi) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  std::uniform_real_distribution<float> d(lo, hi);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng);
  return t;
}

Tensor randn_f32(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float stddev) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  std::normal_distribution<float> d(0.0f, stddev);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng);
  return t;
}

Tensor to_bf16(const TensorView& f32) {
  Tensor c = Tensor::copy_of(f32);
  return from_f32(c, DType::kBF16);
}

Tensor to_f16(const TensorView& f32) {
  Tensor c = Tensor::copy_of(f32);
  return from_f32(c, DType::kF16);
}

std::vector<double> to_f64_vector(const TensorView& t) {
  Tensor c = Tensor::copy_of(t);
  std::vector<double> out(static_cast<size_t>(c.numel()));
  const size_t n = out.size();
  switch (c.dtype()) {
    case DType::kF64:
      std::memcpy(out.data(), c.data(), n * 8);
      break;
    case DType::kI64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(c.data_as<int64_t>()[i]);
      break;
    case DType::kI32:
      for (size_t i = 0; i < n; ++i) out[i] = c.data_as<int32_t>()[i];
      break;
    default: {
      std::vector<float> f(n);
      convert_to_f32(c.data(), c.dtype(), f.data(), n);
      for (size_t i = 0; i < n; ++i) out[i] = f[i];
    }
  }
  return out;
}

void poison(const TensorView& t) {
  const size_t es = dtype_size(t.dtype());
  // Walk all elements with their strides.
  const int nd = t.ndim();
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  for (int64_t i = 0; i < t.numel(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * t.stride(d);
    char* p = static_cast<char*>(t.data()) + off * static_cast<int64_t>(es);
    switch (t.dtype()) {
      case DType::kF32: {
        float v = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::kF64: {
        double v = std::numeric_limits<double>::quiet_NaN();
        std::memcpy(p, &v, 8);
        break;
      }
      case DType::kBF16:
      case DType::kF16: {
        uint16_t v = 0x7fc1;
        std::memcpy(p, &v, 2);
        break;
      }
      default:
        std::memset(p, 0x7f, es);
    }
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
  }
}

int64_t count_non_finite(const TensorView& t) {
  int64_t n = 0;
  for (double v : to_f64_vector(t))
    if (!std::isfinite(v)) ++n;
  return n;
}

double rel_l2(const TensorView& a, const TensorView& b) {
  const auto va = to_f64_vector(a), vb = to_f64_vector(b);
  if (va.size() != vb.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    const double d = va[i] - vb[i];
    num += d * d;
    den += vb[i] * vb[i];
  }
  if (!std::isfinite(num)) return std::numeric_limits<double>::infinity();
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

double max_abs_diff(const TensorView& a, const TensorView& b) {
  const auto va = to_f64_vector(a), vb = to_f64_vector(b);
  if (va.size() != vb.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    const double d = std::fabs(va[i] - vb[i]);
    if (!(d <= m)) m = d;  // NaN propagates as NaN -> m = NaN
  }
  return m;
}

[[noreturn]] void exit_with_env(const char* var, const char* value, int (*read)()) {
  ::setenv(var, value, 1);
  try {
    std::exit(read());
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(e.code() == ErrorCode::kUnsupported ? 20 : 21);
  }
}

}  // namespace fusedmoe::test
