// fusedmoe CUDA: the routed-expert pipeline (routed_experts.h) and the
// functional fused_experts over caller-owned workspace (kernels/cuda.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>

#include "fusedmoe/core/error.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/routed_experts.h"

namespace fusedmoe::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// Hands out consecutive 256-byte aligned pieces of one buffer (base may be null
// to only count).
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(size_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += aligned(sizeof(T) * count);
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

RoutedScratch carve(Carver& c, int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, bool sm90,
                    bool sm90_glu_epilogue) {
  const int64_t slots = T * k;
  const int64_t padded = max_padded_rows(slots, E, kMaxBlockM);
  RoutedScratch s;
  s.counts = c.take<int32_t>(E);
  s.cursor = c.take<int32_t>(E);
  s.chunk_counts = c.take<int32_t>(align_chunk_counts_size(slots, E));
  s.gemm_counters = c.take<int32_t>(2);
  s.offsets = c.take<int64_t>(E + 1);
  s.sorted_slot = c.take<int32_t>(padded);
  s.inter = c.take<uint16_t>(padded * I);
  // y: f32 [slots, H], or bf16 [sm90_contig_max_rows(slots, E), H] for the
  // contiguous sm90 GEMMs (pick_sm90_contig) where they may run.
  const int64_t contig_rows =
      sm90 && sm90_contig_fits(slots, E) ? sm90_contig_max_rows(slots, E) : 0;
  s.y = c.take<float>(std::max(slots * H, (contig_rows * H + 1) / 2));
  if (sm90) {
    s.slot_row = c.take<int32_t>(slots);
    s.sm90_ws_bytes = sm90_experts_workspace_bytes_for(slots, E, I, sm90_glu_epilogue);
    s.sm90_ws = c.take<char>(s.sm90_ws_bytes);
  }
  return s;
}

}  // namespace

size_t routed_scratch_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                            int64_t inter, bool sm90, bool sm90_glu_epilogue) {
  Carver c(nullptr);
  carve(c, num_tokens, top_k, num_experts, hidden, inter, sm90, sm90_glu_epilogue);
  return c.used();
}

RoutedScratch carve_routed_scratch(void* base, int64_t num_tokens, int64_t top_k,
                                   int64_t num_experts, int64_t hidden, int64_t inter, bool sm90,
                                   bool sm90_glu_epilogue) {
  Carver c(base);
  return carve(c, num_tokens, top_k, num_experts, hidden, inter, sm90, sm90_glu_epilogue);
}

int64_t routed_rows_per_expert(int64_t T, int64_t k, int64_t E) {
  const int64_t slots = T * k;
  const double touched =
      static_cast<double>(E) * (1.0 - std::pow(1.0 - static_cast<double>(k) / E, T));
  return static_cast<int64_t>(std::llround(slots / std::max(1.0, touched)));
}

GemmTile routed_gemm_tile(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I) {
  return pick_gemm_tile(routed_rows_per_expert(T, k, E), T * k, 2 * I, H);
}

RoutedResult routed_experts(const RoutedExpertsArgs& a, const RoutedScratch& s, Stream stream) {
  const int64_t T = a.num_tokens, k = a.top_k, E = a.num_experts, H = a.hidden, I = a.inter;
  const int64_t slots = T * k;
  const int64_t ldx = a.ldx > 0 ? a.ldx : H;
  const int64_t rows_per_expert = routed_rows_per_expert(T, k, E);
  // One tile for both GEMMs (one alignment serves both).
  const GemmTile tile = a.tile ? *a.tile : pick_gemm_tile(rows_per_expert, slots, 2 * I, H);
  const bool sm90 = a.allow_sm90 && pick_sm90_experts(rows_per_expert, slots, H, I);
  FUSEDMOE_CHECK(!sm90 || s.sm90_ws != nullptr,
                 "routed_experts: the sm90 path needs scratch carved with sm90 = true");
  const float* row_scale = a.apply_router_weight_on_input ? nullptr : a.topk_weights;
  FinalizeArgs f;
  f.y = s.y;
  f.topk_ids = a.topk_ids;
  f.num_tokens = T;
  f.top_k = k;
  f.hidden = H;
  f.num_experts = E;
  FUSEDMOE_CHECK(!a.decode.value_or(false) || decode_experts_eligible(T, k),
                 "routed_experts: the decode path takes T * k <= ", kDecodeMaxSlots,
                 ", got T = ", T, ", k = ", k);
  if (!sm90 && a.decode.value_or(pick_decode_experts(T, k, E, a.inter))) {
    const bool written = decode_experts(a, s.inter, s.y, stream);
    return {f, written};
  }
  AlignArgs al;
  al.topk_ids = a.topk_ids;
  al.num_slots = slots;
  al.num_experts = E;
  // TMA tiles need no padded rows, but the contiguous GEMMs take 64-row tiles
  // inside one expert.
  const bool contig = sm90 && pick_sm90_contig(a.dtype, rows_per_expert, slots, E, H, I);
  al.block_m = contig ? kSm90ContigBlockM : sm90 ? 1 : gemm_tile_block_m(tile);
  al.expert_offsets = s.offsets;
  al.sorted_slot = s.sorted_slot;
  al.expert_counts = s.counts;
  al.expert_cursor = s.cursor;
  al.chunk_counts = s.chunk_counts;
  al.slot_row = sm90 ? s.slot_row : nullptr;  // the sm90 path's permute and finalize read it
  if (!sm90) {  // the two grouped GEMMs below claim their work items from these
    al.zero_words = s.gemm_counters;
    al.num_zero_words = 2;
  }
  align(al, stream);

  if (sm90) {
    if (a.sm90_wait_event) FUSEDMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, a.sm90_wait_event, 0));
    Sm90ExpertsArgs x;
    x.dtype = a.dtype;
    x.x = a.x;
    x.ldx = ldx;
    x.topk_ids = a.topk_ids;
    x.sorted_slot = s.sorted_slot;
    x.expert_offsets = s.offsets;
    x.num_tokens = T;
    x.top_k = k;
    x.num_experts = E;
    x.hidden = H;
    x.inter = I;
    x.w13 = a.w13;
    x.w13_bias = a.w13_bias;
    x.w13_layout = a.w13_layout;
    x.w2 = a.w2;
    x.act = a.act;
    x.inter_rows = s.inter;
    x.y_rows = s.y;
    x.slot_row = s.slot_row;
    x.block_m = al.block_m;
    x.workspace = s.sm90_ws;
    x.workspace_bytes = s.sm90_ws_bytes;
    sm90_experts(x, stream);
    f.y_dtype = a.dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;  // sm90_experts' rows
    f.slot_row = s.slot_row;
    f.row_scale = row_scale;
    f.bias = a.w2_bias;
    return {f, false};
  }

  GroupedGemmArgs g;
  g.epilogue = GemmEpilogue::kGlu;
  g.tile = tile;
  g.dtype = a.dtype;
  g.a = a.x;
  g.lda = ldx;
  g.gather = true;
  g.a_div = static_cast<int>(k);
  g.sorted_slot = s.sorted_slot;
  g.expert_offsets = s.offsets;
  g.num_experts = E;
  g.m = slots;
  g.w = a.w13;
  g.n = 2 * I;
  g.k = H;
  g.bias = a.w13_bias;
  g.act = a.act;
  g.w13_layout = a.w13_layout;
  g.out = s.inter;
  g.ldc = I;
  g.work_counter = s.gemm_counters;
  grouped_gemm(g, stream);

  GroupedGemmArgs g2 = g;
  g2.epilogue = GemmEpilogue::kScatter;
  g2.a = s.inter;
  g2.lda = I;
  g2.gather = false;
  g2.w = a.w2;
  g2.n = H;
  g2.k = I;
  g2.bias = a.w2_bias;
  g2.row_scale = row_scale;
  g2.out = s.y;
  g2.ldc = H;
  g2.work_counter = s.gemm_counters + 1;
  grouped_gemm(g2, stream);
  return {f, false};
}

void interleave_w13(uint16_t* w13, int64_t num_experts, int64_t inter, int64_t hidden,
                    Stream stream) {
  FUSEDMOE_CHECK(w13 != nullptr, "interleave_w13: w13 is required");
  FUSEDMOE_CHECK(num_experts >= 0 && hidden > 0 && inter > 0 && inter % kW13Block == 0,
                 "interleave_w13: expected num_experts >= 0, hidden > 0 and inter a positive "
                 "multiple of ",
                 kW13Block, ", got E = ", num_experts, ", H = ", hidden, ", I = ", inter);
  if (num_experts == 0) return;
  const size_t row = static_cast<size_t>(hidden) * 2;  // bytes
  const size_t expert = row * 2 * inter;
  void* tmp = nullptr;
  FUSEDMOE_CUDA_CHECK(cudaMalloc(&tmp, expert));
  struct Free {
    void* p;
    ~Free() { cudaFree(p); }
  } free_tmp{tmp};
  for (int64_t e = 0; e < num_experts; ++e) {
    char* w = reinterpret_cast<char*>(w13) + static_cast<size_t>(e) * expert;
    FUSEDMOE_CUDA_CHECK(cudaMemcpyAsync(tmp, w, expert, cudaMemcpyDeviceToDevice, stream));
    // Gate rows [0, I) in blocks of kW13Block to rows 2 kW13Block b + [0, kW13Block),
    // up rows [I, 2I) to 2 kW13Block b + kW13Block + [0, kW13Block).
    for (int half = 0; half < 2; ++half)
      FUSEDMOE_CUDA_CHECK(cudaMemcpy2DAsync(
          w + half * kW13Block * row, 2 * kW13Block * row,
          static_cast<const char*>(tmp) + half * inter * row, kW13Block * row, kW13Block * row,
          static_cast<size_t>(inter / kW13Block), cudaMemcpyDeviceToDevice, stream));
  }
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // before tmp is freed
}

// ---- functional fused_experts ----

namespace {

struct FunctionalWorkspace {
  uint16_t* xb = nullptr;  // bf16 / f16 [T, H] (the expert input, scaled for apply-on-input)
  RoutedScratch routed;
};

FunctionalWorkspace carve_functional(Carver& c, int64_t T, int64_t H, int64_t I, int64_t E,
                                     int64_t k, W13Layout w13_layout) {
  FunctionalWorkspace w;
  w.xb = c.take<uint16_t>(T * H);
  // w13 in HF's order: room for the w13 GEMM's rows before the activation
  // pass; interleaved: the activation in the GEMM's epilogue, no such rows.
  const bool glu_epilogue = w13_layout == W13Layout::kInterleaved128 && I % kW13Block == 0 &&
                            pick_sm90_glu_epilogue(routed_rows_per_expert(T, k, E), E, H, I);
  w.routed = carve(c, T, k, E, H, I, sm90_experts_available(), glu_epilogue);
  return w;
}

}  // namespace

size_t fused_experts_workspace_bytes(int64_t num_tokens, int64_t hidden_size,
                                     int64_t intermediate_size, int64_t num_experts, int64_t top_k,
                                     bool /*apply_router_weight_on_input: same bytes*/,
                                     W13Layout w13_layout) {
  FUSEDMOE_CHECK(
      num_tokens >= 0 && hidden_size > 0 && intermediate_size > 0 && num_experts > 0 && top_k > 0,
      "fused_experts_workspace_bytes: expected num_tokens >= 0 and positive sizes, got "
      "T = ",
      num_tokens, ", H = ", hidden_size, ", I = ", intermediate_size, ", E = ", num_experts,
      ", k = ", top_k);
  // Bounds that keep every byte count of the carve below 2^62 (the GPU takes at
  // most 2^31 - 1 routed slots anyway): no silent wrap-around for absurd sizes.
  constexpr int64_t kMaxDim = int64_t{1} << 24, kMaxExperts = int64_t{1} << 20;
  FUSEDMOE_CHECK(hidden_size <= kMaxDim && intermediate_size <= kMaxDim,
                 "fused_experts_workspace_bytes: hidden_size and intermediate_size must be at "
                 "most 2^24, got H = ",
                 hidden_size, ", I = ", intermediate_size);
  FUSEDMOE_CHECK(num_experts <= kMaxExperts,
                 "fused_experts_workspace_bytes: num_experts must be at most 2^20, got ",
                 num_experts);
  FUSEDMOE_CHECK(num_tokens <= INT32_MAX / top_k,
                 "fused_experts_workspace_bytes: num_tokens * top_k (routed slots) must be at "
                 "most 2^31 - 1, got T = ",
                 num_tokens, ", k = ", top_k);
  FUSEDMOE_CHECK(w13_layout == W13Layout::kStandard || intermediate_size % kW13Block == 0,
                 "w13_layout: kInterleaved128 needs intermediate_size a multiple of ", kW13Block,
                 ", got ", intermediate_size);
  Carver c(nullptr);
  carve_functional(c, num_tokens, hidden_size, intermediate_size, num_experts, top_k, w13_layout);
  return c.used();
}

void fused_experts(const FusedExpertsArgs& a, void* workspace, size_t workspace_bytes,
                   Stream stream) {
  const int64_t T = a.num_tokens, H = a.hidden_size, I = a.intermediate_size, E = a.num_experts,
                k = a.top_k;
  // ---- validate ----
  const size_t need =
      fused_experts_workspace_bytes(T, H, I, E, k, a.apply_router_weight_on_input, a.w13_layout);
  if (H % 8 != 0 || I % 8 != 0)
    FUSEDMOE_THROW(kUnsupported,
                   "fused_experts (CUDA): hidden_size and intermediate_size must be multiples of "
                   "8, got H = ",
                   H, ", I = ", I);
  if (k > 32) FUSEDMOE_THROW(kUnsupported, "fused_experts (CUDA): top_k at most 32, got ", k);
  if (a.apply_router_weight_on_input && k != 1)
    FUSEDMOE_THROW(kUnsupported,
                   "apply_router_weight_on_input: the CUDA backend supports it with top_k = 1 "
                   "only (as vLLM), got top_k = ",
                   k);
  auto f32_or_half = [](DType d) {
    return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
  };
  FUSEDMOE_CHECK(f32_or_half(a.hidden_dtype),
                 "hidden_states: expected dtype f32, bf16 or f16, got ",
                 dtype_name(a.hidden_dtype));
  FUSEDMOE_CHECK(f32_or_half(a.output_dtype), "output: expected dtype f32, bf16 or f16, got ",
                 dtype_name(a.output_dtype));
  FUSEDMOE_CHECK(a.weight_dtype == DType::kBF16 || a.weight_dtype == DType::kF16,
                 "weight_dtype: expected bf16 or f16 (w13 and w2), got ",
                 dtype_name(a.weight_dtype));
  a.activation.validate();
  FUSEDMOE_CHECK(a.ldx >= H, "hidden_states: row stride must be >= H = ", H, ", got ", a.ldx);
  FUSEDMOE_CHECK(a.ldo >= H, "output: row stride must be >= H = ", H, ", got ", a.ldo);
  FUSEDMOE_CHECK(workspace_bytes >= need, "workspace: expected at least ", need,
                 " bytes (fused_experts_workspace_bytes), got ", workspace_bytes);
  FUSEDMOE_CHECK(reinterpret_cast<uintptr_t>(workspace) % kAlign == 0,
                 "workspace: expected a 256-byte aligned pointer");
  if (T == 0) return;
  FUSEDMOE_CHECK(
      a.hidden_states && a.w13 && a.w2 && a.topk_ids && a.topk_weights && a.output && workspace,
      "fused_experts (CUDA): hidden_states, w13, w2, topk_ids, topk_weights, output "
      "and workspace must be non-null");
  const char* x_end = static_cast<const char*>(a.hidden_states) +
                      ((T - 1) * a.ldx + H) * dtype_size(a.hidden_dtype);
  const char* o_end =
      static_cast<const char*>(a.output) + ((T - 1) * a.ldo + H) * dtype_size(a.output_dtype);
  FUSEDMOE_CHECK(x_end <= static_cast<const char*>(a.output) ||
                     o_end <= static_cast<const char*>(a.hidden_states),
                 "output: must not alias hidden_states");

  // ---- launch ----
  Carver c(workspace);
  const FunctionalWorkspace w = carve_functional(c, T, H, I, E, k, a.w13_layout);
  // Inputs already in the weights' type are read where they are (the kernels
  // take a row stride, a multiple of 8 elements: 16-byte rows); others are
  // converted (and scaled, Llama-4) into xb first.
  const bool read_in_place = a.hidden_dtype == a.weight_dtype && !a.apply_router_weight_on_input &&
                             H % 8 == 0 && a.ldx % 8 == 0 &&
                             reinterpret_cast<uintptr_t>(a.hidden_states) % 16 == 0;
  if (!read_in_place)
    to_half_rows(a.hidden_states, a.hidden_dtype, a.ldx, T, H,
                 a.apply_router_weight_on_input ? a.topk_weights : nullptr, k, a.weight_dtype, w.xb,
                 stream);
  RoutedExpertsArgs r;
  r.dtype = a.weight_dtype;
  r.x = read_in_place ? static_cast<const uint16_t*>(a.hidden_states) : w.xb;
  r.ldx = read_in_place ? a.ldx : H;
  r.topk_ids = a.topk_ids;
  r.topk_weights = a.topk_weights;
  r.num_tokens = T;
  r.top_k = k;
  r.num_experts = E;
  r.hidden = H;
  r.inter = I;
  r.w13 = a.w13;
  r.w13_layout = a.w13_layout;
  r.w2 = a.w2;
  r.w13_bias = a.w13_bias;
  r.w2_bias = a.w2_bias;
  r.act = a.activation;
  r.apply_router_weight_on_input = a.apply_router_weight_on_input;
  r.out = a.output;
  r.out_dtype = a.output_dtype;
  r.ldo = a.ldo;
  const RoutedResult routed = routed_experts(r, w.routed, stream);
  if (routed.output_written) return;
  FinalizeArgs f = routed.finalize;
  f.out = a.output;
  f.out_dtype = a.output_dtype;
  f.ldo = a.ldo;
  finalize(f, stream);
}

}  // namespace fusedmoe::cuda
