// fusedmoe: element types and scalar conversions.
//
// Conversions round to nearest, ties to even, and keep NaN and Inf where the
// target format has them. float8_e4m3fn has no Inf: by default a finite value
// beyond its range and +-Inf saturate to +-448 (the convention of CUDA's
// __NV_SATFINITE and of DeepSeek/vLLM quantizers, which clamp before casting);
// NaN stays NaN (0x7f / 0xff). float8_e5m2 keeps Inf, overflow rounds to Inf
// unless `saturate` is set. Formats: OCP 8-bit floating point spec (2023),
// IEEE 754 binary16, bfloat16 (Google Brain).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace fusedmoe {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3FN,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
};

// Bytes of one element.
size_t dtype_size(DType dtype);
// Lower-case name used in messages and on the command line: "f32", "bf16", "f8_e4m3fn", ...
const char* dtype_name(DType dtype);
// Parses dtype_name() spellings and common aliases ("float32", "bfloat16", "fp8").
// Throws Error(kInvalidArgument) naming the string when it is unknown.
DType parse_dtype(std::string_view name);
bool is_floating(DType dtype);

// ---- scalar conversions (bit patterns in uint16_t / uint8_t) ----
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// Rounds a float to the nearest bf16 value and back (what bf16 storage keeps).
inline float round_to_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

float f8e4m3fn_to_f32(uint8_t v);
uint8_t f32_to_f8e4m3fn(float f, bool saturate = true);
float f8e5m2_to_f32(uint8_t v);
uint8_t f32_to_f8e5m2(float f, bool saturate = false);

// Converts n elements of `src` (dtype src_type) to float. Supports every floating
// dtype and the integer dtypes. Throws for kBool.
void convert_to_f32(const void* src, DType src_type, float* dst, size_t n);
// Converts n floats to `dst_type` (floating dtypes only; f8 e4m3fn saturates).
void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n);

// Index of the first NaN or Inf among n elements of `data` (dtype `dtype`), or
// -1 when all are finite (always -1 for integer dtypes). Reads bit patterns
// (IEEE exponent all ones; e4m3fn's NaN codes 0x7f/0xff, which has no Inf).
// Throws Error(kUnsupported) for kBool.
int64_t find_non_finite(const void* data, DType dtype, size_t n);

// Index of the first of n f64 values at `data` that is finite but beyond the f32
// range (it would become Inf converted to f32), or -1 when there is none.
int64_t find_beyond_f32(const void* data, size_t n);

}  // namespace fusedmoe
