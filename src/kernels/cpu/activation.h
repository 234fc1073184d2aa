// fusedmoe internal: gated activations on f32 rows (used by the CPU experts).
#pragma once

#include <cstdint>

#include "fusedmoe/experts/expert_weights.h"

namespace fusedmoe::cpu {

// out[r, i] = act(gate[r, i], up[r, i]) for r < rows, i < n; gate and up have
// row stride ldx, out row stride ldo. round_bf16: round each result to bf16.
// Formulas and overflow behaviour: see apply_activation (expert_weights.h).
void activation_rows(const ActivationParams& p, const float* gate, const float* up, int64_t ldx,
                     float* out, int64_t ldo, int64_t rows, int64_t n, bool round_bf16);

}  // namespace fusedmoe::cpu
