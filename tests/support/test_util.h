// Test helpers shared by all tests: fresh random inputs, poisoning, error norms.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fusedmoe/core/tensor.h"

namespace fusedmoe::test {

// A fresh seed per call (std::random_device), unless FUSEDMOE_TEST_SEED is set
// in the environment (to replay a failure). Tests SCOPED_TRACE it.
uint64_t fresh_seed();

// Uniform [lo, hi) f32 tensor.
Tensor random_f32(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float lo = -1.0f,
                  float hi = 1.0f);
// Normal(0, stddev) f32 tensor.
Tensor randn_f32(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float stddev = 1.0f);
// Same values rounded to bf16 and stored as bf16.
Tensor to_bf16(const TensorView& f32);
// f32 -> f16 (round to nearest even; beyond 65504: inf).
Tensor to_f16(const TensorView& f32);
// Fills any floating tensor with NaN (integers with 0x7f7f7f7f-style garbage).
void poison(const TensorView& t);
// Number of NaN/Inf elements of an f32 tensor (any strides).
int64_t count_non_finite(const TensorView& f32);

// ||a - b|| / ||b|| over all elements; a is f32 (any strides), b f32 or f64.
double rel_l2(const TensorView& a, const TensorView& b);
// max |a - b| over all elements (f32/f64 either side).
double max_abs_diff(const TensorView& a, const TensorView& b);

// Reads every element of a floating or integer tensor (any strides) as double.
std::vector<double> to_f64_vector(const TensorView& t);

// For a death test of a setting read from the environment at its first use:
// sets `var` to `value`, then exits with read()'s result (0-19), or, after an
// Error, prints its message to stderr and exits with 20 (kUnsupported) or 21.
[[noreturn]] void exit_with_env(const char* var, const char* value, int (*read)());

}  // namespace fusedmoe::test
