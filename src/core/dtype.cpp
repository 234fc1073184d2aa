#include "fusedmoe/core/dtype.h"

#include <cmath>
#include <cstring>
#include <string>

#include "fusedmoe/core/error.h"

namespace fusedmoe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
      return 2;
    case DType::kF8E4M3FN:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return "f64";
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3FN:
      return "f8_e4m3fn";
    case DType::kF8E5M2:
      return "f8_e5m2";
    case DType::kI64:
      return "i64";
    case DType::kI32:
      return "i32";
    case DType::kI16:
      return "i16";
    case DType::kI8:
      return "i8";
    case DType::kU8:
      return "u8";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  struct Alias {
    const char* name;
    DType dtype;
  };
  static const Alias kAliases[] = {
      {"f64", DType::kF64},
      {"float64", DType::kF64},
      {"double", DType::kF64},
      {"f32", DType::kF32},
      {"float32", DType::kF32},
      {"float", DType::kF32},
      {"fp32", DType::kF32},
      {"f16", DType::kF16},
      {"float16", DType::kF16},
      {"fp16", DType::kF16},
      {"half", DType::kF16},
      {"bf16", DType::kBF16},
      {"bfloat16", DType::kBF16},
      {"f8_e4m3fn", DType::kF8E4M3FN},
      {"float8_e4m3fn", DType::kF8E4M3FN},
      {"fp8", DType::kF8E4M3FN},
      {"e4m3", DType::kF8E4M3FN},
      {"f8_e5m2", DType::kF8E5M2},
      {"float8_e5m2", DType::kF8E5M2},
      {"e5m2", DType::kF8E5M2},
      {"i64", DType::kI64},
      {"int64", DType::kI64},
      {"i32", DType::kI32},
      {"int32", DType::kI32},
      {"i16", DType::kI16},
      {"int16", DType::kI16},
      {"i8", DType::kI8},
      {"int8", DType::kI8},
      {"u8", DType::kU8},
      {"uint8", DType::kU8},
      {"bool", DType::kBool},
  };
  for (const auto& a : kAliases)
    if (name == a.name) return a.dtype;
  FUSEDMOE_THROW(kInvalidArgument, "dtype: unknown name '", printable(name),
                 "' (expected one of f64, f32, f16, bf16, f8_e4m3fn, f8_e5m2, i64, i32, i16, i8, "
                 "u8, bool)");
}

bool is_floating(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3FN:
    case DType::kF8E5M2:
      return true;
    default:
      return false;
  }
}

// ---- IEEE binary16 ----------------------------------------------------------
float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // Inf / NaN
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520 -> Inf
  if (abs < 0x38800000u) {
    // result is subnormal (or zero) in f16: value / 2^-24, rounded to nearest even
    const float scaled = bits_float(abs) * 16777216.0f;  // exact (power of two)
    const float r = std::nearbyint(scaled);              // default rounding: to nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // normal: re-bias exponent, round mantissa (13 dropped bits) to nearest even
  uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

// ---- OCP FP8 -----------------------------------------------------------------
namespace {

// Decodes an 8-bit float with `mbits` mantissa bits and exponent bias `bias`.
float decode_f8(uint8_t v, int mbits, int bias) {
  const bool neg = v & 0x80u;
  const int ebits = 7 - mbits;
  const int exp = (v >> mbits) & ((1 << ebits) - 1);
  const int mant = v & ((1 << mbits) - 1);
  float r;
  if (exp == 0)
    r = std::ldexp(static_cast<float>(mant), 1 - bias - mbits);
  else
    r = std::ldexp(static_cast<float>((1 << mbits) | mant), exp - bias - mbits);
  return neg ? -r : r;
}

// Encodes |f| (finite, non-negative) to the nearest (ties to even) value of a
// format with `mbits` mantissa bits, exponent bias `bias`, returning the code
// without sign; codes above `max_code` mean overflow (caller decides).
uint32_t encode_f8_magnitude(float a, int mbits, int bias) {
  // Smallest normal exponent is 1 - bias; below it the spacing is fixed at 2^(1-bias-mbits).
  if (a == 0.0f) return 0;
  int e;
  std::frexp(a, &e);             // a = m * 2^e, m in [0.5, 1)
  int exp_field = e - 1 + bias;  // biased exponent if normal
  if (exp_field < 1) exp_field = 0;
  const int scale_exp = (exp_field == 0 ? 1 - bias : exp_field - bias) - mbits;
  const float q = std::nearbyint(std::ldexp(a, -scale_exp));  // integer significand, ties even
  uint32_t sig = static_cast<uint32_t>(q);
  if (exp_field == 0) {
    // subnormal; may round up into the smallest normal (sig == 1 << mbits), which
    // the field layout encodes correctly as exponent 1, mantissa 0.
    return sig;
  }
  if (sig >= (2u << mbits)) {  // mantissa overflowed: next binade
    sig >>= 1;
    ++exp_field;
  }
  return (static_cast<uint32_t>(exp_field) << mbits) | (sig & ((1u << mbits) - 1));
}

}  // namespace

float f8e4m3fn_to_f32(uint8_t v) {
  if ((v & 0x7fu) == 0x7fu) return bits_float((v & 0x80u ? 0x80000000u : 0u) | 0x7fc00000u);
  return decode_f8(v, 3, 7);
}

uint8_t f32_to_f8e4m3fn(float f, bool saturate) {
  const uint8_t sign = (float_bits(f) >> 24) & 0x80u;
  if (std::isnan(f)) return sign | 0x7fu;
  const float a = std::fabs(f);
  // Largest finite: 0x7e = 448; 464 (the halfway point) rounds to even, i.e. 448.
  if (std::isinf(a)) return saturate ? (sign | 0x7eu) : (sign | 0x7fu);
  uint32_t code = encode_f8_magnitude(a, 3, 7);
  if (code > 0x7eu) code = saturate ? 0x7eu : 0x7fu;
  return sign | static_cast<uint8_t>(code);
}

float f8e5m2_to_f32(uint8_t v) {
  const uint32_t exp = (v >> 2) & 0x1fu;
  if (exp == 0x1f) {
    const uint32_t sign = (v & 0x80u) ? 0x80000000u : 0u;
    return bits_float(sign | ((v & 3u) ? 0x7fc00000u : 0x7f800000u));
  }
  return decode_f8(v, 2, 15);
}

uint8_t f32_to_f8e5m2(float f, bool saturate) {
  const uint8_t sign = (float_bits(f) >> 24) & 0x80u;
  if (std::isnan(f)) return sign | 0x7fu;
  const float a = std::fabs(f);
  // Largest finite: 0x7b = 57344; halfway to the next binade step is 61440.
  if (std::isinf(a)) return saturate ? (sign | 0x7bu) : (sign | 0x7cu);
  if (a >= 61440.0f) return saturate ? (sign | 0x7bu) : (sign | 0x7cu);
  uint32_t code = encode_f8_magnitude(a, 2, 15);
  if (code > 0x7bu) code = saturate ? 0x7bu : 0x7cu;
  return sign | static_cast<uint8_t>(code);
}

// ---- bulk conversions ----------------------------------------------------------
void convert_to_f32(const void* src, DType src_type, float* dst, size_t n) {
  switch (src_type) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::kF64: {
      const double* s = static_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kF8E4M3FN: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f8e4m3fn_to_f32(s[i]);
      return;
    }
    case DType::kF8E5M2: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f8e5m2_to_f32(s[i]);
      return;
    }
    case DType::kI64: {
      const int64_t* s = static_cast<const int64_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI32: {
      const int32_t* s = static_cast<const int32_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI16: {
      const int16_t* s = static_cast<const int16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI8: {
      const int8_t* s = static_cast<const int8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kU8: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kBool:
      break;
  }
  FUSEDMOE_THROW(kUnsupported, "convert_to_f32: cannot convert ", dtype_name(src_type), " to f32");
}

namespace {
template <typename U>
int64_t first_masked(const void* data, size_t n, U mask, U value) {
  const U* p = static_cast<const U*>(data);
  for (size_t i = 0; i < n; ++i)
    if ((p[i] & mask) == value) return static_cast<int64_t>(i);
  return -1;
}
}  // namespace

int64_t find_non_finite(const void* data, DType dtype, size_t n) {
  switch (dtype) {
    case DType::kF64:
      return first_masked<uint64_t>(data, n, 0x7ff0000000000000ull, 0x7ff0000000000000ull);
    case DType::kF32:
      return first_masked<uint32_t>(data, n, 0x7f800000u, 0x7f800000u);
    case DType::kBF16:
      return first_masked<uint16_t>(data, n, 0x7f80, 0x7f80);
    case DType::kF16:
      return first_masked<uint16_t>(data, n, 0x7c00, 0x7c00);
    case DType::kF8E4M3FN:
      return first_masked<uint8_t>(data, n, 0x7f, 0x7f);
    case DType::kF8E5M2:
      return first_masked<uint8_t>(data, n, 0x7c, 0x7c);
    case DType::kBool:
      FUSEDMOE_THROW(kUnsupported, "find_non_finite: bool tensors have no finiteness");
    default:
      return -1;
  }
}

int64_t find_beyond_f32(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  for (size_t i = 0; i < n; ++i) {
    double x;
    std::memcpy(&x, p + i * sizeof x, sizeof x);
    if (std::isfinite(x) && !std::isfinite(static_cast<float>(x))) return static_cast<int64_t>(i);
  }
  return -1;
}

void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n) {
  switch (dst_type) {
    case DType::kF32: {
      float* d = static_cast<float*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    case DType::kF64: {
      double* d = static_cast<double*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::kF8E4M3FN: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f8e4m3fn(src[i]);
      return;
    }
    case DType::kF8E5M2: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f8e5m2(src[i]);
      return;
    }
    default:
      break;
  }
  FUSEDMOE_THROW(kUnsupported, "convert_from_f32: cannot convert f32 to ", dtype_name(dst_type));
}

}  // namespace fusedmoe
