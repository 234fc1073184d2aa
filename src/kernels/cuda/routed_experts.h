// fusedmoe internal: the routed-expert pipeline, one piece of code behind
// CudaMoELayer::forward, CudaMoELayer::experts (expert parallelism) and the
// functional cuda::fused_experts (kernels/cuda.h):
//   a few slots (pick_decode_experts): decode_experts, two weight-streaming
//     kernels from topk_ids (no align), y by slot; otherwise
//   align (group slots by expert) -> either
//     mma.sync / GEMV: w13 grouped GEMM + activation -> w2 grouped GEMM
//       (x topk_weights, scattered by slot into y f32 [T*k, H]), or
//     sm_90a wgmma + TMA (sm90_experts, many rows per expert): permute ->
//       w13 GEMM -> activation -> w2 GEMM into expert-sorted y rows,
//       weighted and biased by finalize through slot_row.
// The caller converts the input to the weights' half type (bf16 or f16)
// before and runs finalize after, with
// the FinalizeArgs routed_experts() returns (plus output / shared expert).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "fusedmoe/kernels/cuda.h"

struct CUevent_st;  // cudaEvent_t is CUevent_st*

namespace fusedmoe::cuda {

// The largest block_m of any GEMM tile: scratch sized for it fits every tile.
inline constexpr int kMaxBlockM = 128;

// Scratch of routed_experts, carved from one device allocation.
struct RoutedScratch {
  int32_t* counts = nullptr;         // [E]
  int32_t* cursor = nullptr;         // [E]
  int32_t* chunk_counts = nullptr;   // [align_chunk_counts_size(T*k, E)]
  int32_t* gemm_counters = nullptr;  // [2]: the mma.sync GEMMs' work counters (zeroed by align)
  int64_t* offsets = nullptr;        // [E + 1]
  int32_t* sorted_slot = nullptr;    // [max_padded_rows(T*k, E, kMaxBlockM)]
  uint16_t* inter = nullptr;         // bf16 / f16 [padded rows, I]
  float* y = nullptr;                // f32 [T*k, H]: by slot (mma) or by sorted row (sm90)
  // Only when carved with sm90 = true (else null / 0): the sm90_experts path.
  int32_t* slot_row = nullptr;  // [T*k]: slot -> sorted row
  void* sm90_ws = nullptr;      // sm90_experts_workspace_bytes(T*k, E, I)
  size_t sm90_ws_bytes = 0;
};
// Bytes of the scratch for up to num_tokens tokens (a multiple of 256). With
// sm90, room for the sm90_experts path too (needs sm90_experts_available()).
// sm90_glu_epilogue: the caller keeps w13 in W13Layout::kInterleaved128 and the
// sm90 w13 GEMM applies the activation in its epilogue
// (pick_sm90_glu_epilogue at set-up): no room for the w13 output rows (h13).
size_t routed_scratch_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                            int64_t inter, bool sm90, bool sm90_glu_epilogue = false);
// Carves the scratch out of `base` (256-byte aligned, routed_scratch_bytes long).
RoutedScratch carve_routed_scratch(void* base, int64_t num_tokens, int64_t top_k,
                                   int64_t num_experts, int64_t hidden, int64_t inter, bool sm90,
                                   bool sm90_glu_epilogue = false);
// sm90_experts_workspace_bytes, without the h13 rows where glu_epilogue (the
// activation in the w13 GEMM's epilogue: they are never written).
size_t sm90_experts_workspace_bytes_for(int64_t num_slots, int64_t num_experts, int64_t inter,
                                        bool glu_epilogue);

// Expected rows per touched expert for T tokens routed uniformly to k of E
// experts: T * k / (E * (1 - (1 - k/E)^T)), rounded.
int64_t routed_rows_per_expert(int64_t num_tokens, int64_t top_k, int64_t num_experts);
// The CUTLASS configuration of one sm90_experts GEMM (bf16; f16 always takes
// 128 x 256 cooperative).
enum class Sm90Tile {
  kM128N256,  // 128 x 256 x 64 cooperative (both consumer warpgroups on one tile)
  kM64N256    // 64 x 256 x 64 pingpong (each consumer warpgroup on its own tile)
};
// The tile for a GEMM of N output columns with about rows_per_expert
// rows for each of num_experts experts (tuning data in gemm_configs.cpp):
// 64 x 256 pingpong, but 128 x 256 cooperative where the experts' row counts
// straddle a multiple of 64 and their extra 64-row tiles would spill into a
// second wave of SMs that 128-row tiles avoid.
// FUSEDMOE_CUDA_SM90_TILE=m64 or =m128 forces one (bf16).
Sm90Tile pick_sm90_tile(DType dtype, int64_t rows_per_expert, int64_t num_experts, int64_t n);
// The bf16 rule of pick_sm90_tile on a device of `sms` multiprocessors (host
// only, no environment: the tests check it without a device).
Sm90Tile sm90_tile_for(int64_t rows_per_expert, int64_t num_experts, int64_t n, int64_t sms);
// Whether the sm90 path runs its two GEMMs contiguously (Sm90ExpertsArgs::block_m
// = 64: align pads each expert's rows to 64, one TMA descriptor per operand;
// sm90_cutlass_contig_gemm.cuh) rather than as CUTLASS ptr-array grouped GEMMs:
// bf16, both GEMMs in 64 x 256 tiles (pick_sm90_tile), and the scratch holds
// the padded rows (sm90_contig_fits); by default only for few experts (E <= 16)
// of at most 256 expected rows, where it measured faster. Tuning data in gemm_configs.cpp.
// FUSEDMOE_CUDA_SM90_CONTIG=on|off forces it (on: where it fits); other values throw.
bool pick_sm90_contig(DType dtype, int64_t rows_per_expert, int64_t num_slots, int64_t num_experts,
                      int64_t hidden, int64_t inter);
// The contiguous GEMMs' tile height: align()'s block_m for them (Sm90ExpertsArgs::block_m).
constexpr int kSm90ContigBlockM = 64;
// Whether routed scratch for num_slots slots holds the contiguous GEMMs' padded rows:
// num_slots >= 32 E (then sm90_contig_max_rows(num_slots, E) <= 3 num_slots + 64).
bool sm90_contig_fits(int64_t num_slots, int64_t num_experts);
// The contiguous GEMMs' bound on their rows: max_padded_rows(num_slots, E,
// kSm90ContigBlockM) rounded up to a multiple of kSm90ContigBlockM (the rows
// of inter_rows and y_rows, and the GEMMs' problem M).
int64_t sm90_contig_max_rows(int64_t num_slots, int64_t num_experts);
// Whether an sm90 grouped GEMM in tiles block_m rows high may be launched with
// Programmatic Dependent Launch: only where (nearly) every expert has one m
// tile, i.e. rows_per_expert + 0.75 sqrt(rows_per_expert) <= block_m. With
// several m tiles an expert, the CTAs sharing a weight panel read it from L2
// only while they run in step, which an early launch (CTAs placed over the
// previous kernel's tail) breaks: 5-70 % slower, measured (gemm_configs.cpp).
bool sm90_gemm_pdl(int64_t rows_per_expert, int block_m);
// Whether an sm90 grouped GEMM in tiles block_m rows high loads with the L2
// hints (weights evict-first, activation rows evict-last; sm90_experts.cu):
// where at most about one expert is expected to need a second m tile (uniform
// routing: an expert's rows ~ normal, mean rows_per_expert, variance
// rows_per_expert (1 - 1 / E)), whose weights the hint would send to DRAM again.
bool sm90_l2_hints_pay(int64_t rows_per_expert, int64_t num_experts, int block_m);
// The m16n64 mma.sync tile's pipeline (both shapes stage 128 elements of K):
// 4 stages, 2 CTAs an SM (the deeper pipeline: long K), or 3 stages, 3 CTAs an
// SM (more warps: short K). For a GEMM of `rows` routed rows over num_experts
// experts (routed uniformly), n_tiles 64-column tiles and K = k, on `sms`
// multiprocessors (host only, no environment: the tests check it without a
// device). Tuning data in gemm_configs.cpp.
int m16n64_stages_for(int64_t rows, int64_t num_experts, int64_t n_tiles, int64_t k, int64_t sms);
// m16n64_stages_for on this device; FUSEDMOE_CUDA_M16_STAGES=3 or =4 forces one.
int pick_m16n64_stages(int64_t rows, int64_t num_experts, int64_t n_tiles, int64_t k);
// The rows per expert from which pick_sm90_experts takes the sm90 path, for
// routed_rows rows in all (the experts touched: routed_rows / rows_per_expert):
// one expert (dense) 12, up to 16 experts 11, more 13 (host only, no device: the
// tests check it anywhere). Tuning data in gemm_configs.cpp.
int64_t sm90_min_rows_per_expert(int64_t rows_per_expert, int64_t routed_rows);
// The GEMM tile for that many rows per expert (pick_gemm_tile).
GemmTile routed_gemm_tile(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                          int64_t inter);

// The decode path (decode_experts.cu): the routed experts of a few tokens
// (T * k <= 128 slots) as two weight-streaming kernels read straight from
// topk_ids (no align), for every dtype and tile of the mma path; writes y by
// slot exactly as that path does (weighted, biased; invalid ids' slots left
// unwritten).
inline constexpr int64_t kDecodeMaxSlots = 128;
// Whether decode_experts can run T tokens of k slots: T >= 1, k >= 1, T * k <= 128.
bool decode_experts_eligible(int64_t num_tokens, int64_t top_k);
// Whether the routed experts take the decode path (tuning): eligible, T * k <= 96,
// and T <= 4 or T * k <= 2 E (few slots per touched expert); for large experts
// (intermediate size `inter` >= 4096, Mixtral's 14336) only T <= 3.
// FUSEDMOE_CUDA_DECODE=0 in the environment turns it off (A/B timing).
bool pick_decode_experts(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t inter);
// The w13 layout a layer with intermediate size `inter` keeps: kInterleaved128
// where the sm90 path exists (sm90_experts_available()) and inter % 128 == 0,
// unless FUSEDMOE_CUDA_W13_LAYOUT=standard (A / B measurements; "interleaved"
// or unset: the default); else kStandard. Throws on other values of the variable.
W13Layout pick_w13_layout(int64_t inter);
// With w13 interleaved, whether the sm90 path applies the activation in the w13
// GEMM's epilogue (true) or in a separate pass over the GEMM's half-type output;
// FUSEDMOE_CUDA_SM90_GLU=epilogue|pass forces one (tuning data: gemm_configs.cpp).
bool pick_sm90_glu_epilogue(int64_t rows_per_expert, int64_t num_experts, int64_t hidden,
                            int64_t inter);

struct RoutedExpertsArgs {
  DType dtype = DType::kBF16;         // of x, w13, w2 and the intermediate: kBF16 or kF16
  const uint16_t* x = nullptr;        // dtype [T, H] (already scaled when the weight is applied on
                                      // the input), row stride ldx
  int64_t ldx = 0;                    // 0: H; else >= H and a multiple of 8
  const int32_t* topk_ids = nullptr;  // i32 [T, k], ids in [-1, E)
  const float* topk_weights = nullptr;  // scales y unless apply_router_weight_on_input
  int64_t num_tokens = 0, top_k = 0, num_experts = 0, hidden = 0, inter = 0;
  const uint16_t* w13 = nullptr;
  W13Layout w13_layout = W13Layout::kStandard;  // every path reads either (I % 128 == 0 for
                                                // kInterleaved128)
  const uint16_t* w2 = nullptr;
  const float* w13_bias = nullptr;
  const float* w2_bias = nullptr;
  ActivationParams act;
  bool apply_router_weight_on_input = false;
  // The tile of both mma GEMMs; default routed_gemm_tile(T, k, E, H, I). Expert
  // parallelism passes the tile of the global batch (the same on every rank).
  std::optional<GemmTile> tile;
  // Whether the sm90 path may be taken (pick_sm90_experts for the rows per
  // expert of T tokens; the scratch must then be carved with sm90). GPU expert
  // parallelism's nccl transport passes false (it sends y by slot); the peer
  // transport's combine reads the sm90 path's expert-sorted rows too.
  bool allow_sm90 = true;
  // Whether to take the decode path; default pick_decode_experts(T, k, E) (and
  // never with the sm90 path). Expert parallelism passes the global batch's
  // choice (bit-identical to one GPU); true needs decode_experts_eligible(T, k).
  std::optional<bool> decode;
  // The layer's output, or null: f32, bf16 or f16 [T, H], row stride ldo.
  // Only for callers whose finalize would add nothing but the routed rows (no
  // shared expert): the decode path may then write it directly (decode_experts),
  // the tokens' slots summed in finalize()'s order (the same bits), and
  // routed_experts() returns output_written = true.
  void* out = nullptr;
  DType out_dtype = DType::kF32;
  int64_t ldo = 0;
  // On the sm90 path: `stream` waits for this event (a cudaEvent_t) after
  // align, before the GEMMs (the layer's shared expert on the sm90 path: its
  // persistent GEMMs and the routed ones each fill the GPU). Null: no wait.
  CUevent_st* sm90_wait_event = nullptr;
};
// Launches the routed experts of T > 0 tokens on `stream` and returns the
// arguments of finalize() for them: y, topk_ids, num_tokens, top_k, hidden,
// num_experts and, on the sm90 path, slot_row / row_scale / bias. On the mma
// path y holds rows by slot, weighted and biased (slots whose id is -1 are
// left unwritten). With output_written, args.out holds the result already
// and finalize must not run.
struct RoutedResult {
  FinalizeArgs finalize;
  bool output_written = false;
};
RoutedResult routed_experts(const RoutedExpertsArgs& args, const RoutedScratch& scratch,
                            Stream stream);

// The decode path's two kernels for `args` (x, ldx, topk_ids, topk_weights
// unless apply_router_weight_on_input, sizes, weights, biases, act, out; the
// tile and allow_* fields are not read), launched on `stream` with PDL:
//   inter_rows: dtype [T * k, I] (scratch), y: f32 [T * k, H],
//   y[s] = topk_weights[s] * (w2[e] . act(w13[e] . x[s / k] + b13[e]) + b2[e]),
//   e = topk_ids[s]; slots of ids outside [0, E) left unwritten.
// With args.out, where it pays (T = 1, or w2 of an expert <= 8 MiB), the second
// kernel sums each token's slots into out instead (finalize's arithmetic and
// order, the same bits; y untouched) and this returns true.
// Throws Error(kInvalidArgument) outside decode_experts_eligible's limits or
// for H, I, ldx not multiples of 8.
bool decode_experts(const RoutedExpertsArgs& args, uint16_t* inter_rows, float* y, Stream stream);

}  // namespace fusedmoe::cuda
