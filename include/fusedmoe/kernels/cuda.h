// fusedmoe: the CUDA backend (NVIDIA Hopper, sm_90a) — host launchers.
//
// Three layers, dependencies one way (see ../shared/style.md):
//   device kernels (src/kernels/cuda/*.cu): raw pointers, sizes, a stream;
//   these launchers: validate arguments, pick tile configurations from the
//     tuning table (src/kernels/cuda/gemm_configs.cpp), launch;
//   MoERunner (runner/moe_runner.h) with RunnerOptions::device = CUDA on top.
// Every launcher is asynchronous on `stream`, performs no host synchronisation
// and no allocation, so a sequence of them can be captured in a CUDA graph.
// Pointers are device pointers unless stated. Sizes the host does not know
// (per-expert row counts) stay on the device.
//
// Defined only in builds with FUSEDMOE_WITH_CUDA (the macro is a public compile
// definition of the fusedmoe target): guard calls with #ifdef FUSEDMOE_WITH_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/experts/expert_weights.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace fusedmoe::cuda {

using Stream = CUstream_st*;

// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();

// Owning device memory on the current device (cudaMalloc / cudaFree), for
// front ends that hold no CUDA headers. Throws Error(kInternal) on CUDA errors.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host, size_t bytes);    // synchronous, bytes <= bytes()
  void download(void* host, size_t bytes) const;  // synchronous, bytes <= bytes()

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};
// Waits for all work on the current device; throws Error(kInternal) if any failed.
void synchronize();

// One workspace for several CUDA MoE layers (RunnerOptions::cuda_workspace):
// a model's MoE layers run one after another, so one scratch area as large as
// the largest layer's serves them all, instead of one each (DeepSeek-V3 at
// max_num_tokens 8192: ~2.9 GB a layer, 58 MoE layers). The idea of vLLM's
// workspace shared by the modular kernels of all layers.
// Contract: layers sharing one run their forward() calls one at a time in
// stream order (one stream, or streams ordered by events; CUDA graphs of them
// replayed in order included); two forwards in flight at once on unordered
// streams would overwrite each other's scratch. A layer keeps nothing in it
// from one forward to the next.
// Memory: a layer asks for its bytes at construction (acquire). The current
// block serves it if large enough; else a new block of the larger size becomes
// the current one, for this and later layers, while the layers built before keep
// the older block (their pointers, also those captured in CUDA graphs, stay
// valid) until the last of them is destroyed. Build the largest layer first (or
// call reserve) to hold one block. Thread-safe.
// GPU expert parallelism (peer transport): the layers sharing one with the
// same communicator, hidden size, top_k, max_num_tokens and payloads also
// share one peer window (the epoch in it orders their forwards as one
// layer's): one window a model instead of one a layer.
class SharedWorkspace {
 public:
  SharedWorkspace() = default;
  SharedWorkspace(const SharedWorkspace&) = delete;
  SharedWorkspace& operator=(const SharedWorkspace&) = delete;
  // A block of at least `bytes` (256-byte aligned) on the current device, shared
  // with every other holder of the same block. Throws Error(kInvalidArgument)
  // when the workspace's memory is on another device than the current one,
  // Error(kOutOfMemory) naming the bytes when the device has not that much free
  // (Error(kInternal) for other CUDA errors).
  std::shared_ptr<void> acquire(size_t bytes);
  // Makes the current block at least `bytes` large (as acquire, without holding it).
  void reserve(size_t bytes);
  size_t bytes() const;  // of the current block (0 before the first acquire / reserve)
  int device() const;    // of the memory; -1 before the first acquire / reserve

  // For the layers: other objects that layers sharing this workspace share,
  // by key (GPU expert parallelism's peer windows), held weakly: attachment()
  // is null once no layer holds the object attached under `key`.
  std::shared_ptr<void> attachment(const std::string& key) const;
  void attach(const std::string& key, std::shared_ptr<void> object);

 private:
  std::map<std::string, std::weak_ptr<void>> attached_;
  mutable std::mutex mutex_;
  std::shared_ptr<void> block_;
  size_t bytes_ = 0;
  int device_ = -1;
};

// ---- routing ----------------------------------------------------------------
// router_logits f32 [T, E + Z] (row stride logits_ld >= E + Z) -> topk_ids i32
// [T, k], topk_weights f32 [T, k] (contiguous rows). The same selection and
// weights as the CPU routers of routing/router.h (kTopK with any scoring_func,
// renormalize and optional selection bias [E + Z]; kTopKSoftmax; kGroupedTopK
// with bias [E]; kLlama4; kHash with hash_table i32 [vocab, k] and token_ids i32
// [T]), one warp per token, scores in double. Zero experts become id -1.
// NaN logits: a NaN is never selected while a non-NaN column remains, ids stay
// in range, and with RouteArgs::nan_token the first such token is recorded on
// the device (reporting it needs a host sync: CudaMoELayer::check_errors).
// kHash: a token id outside [0, config.hash_vocab_size) reads no table row; the
// token is routed nowhere (ids -1, weights 0) and, with RouteArgs::bad_token,
// the first such token is recorded the same way.
// kSimulated (benchmarks) ignores the logits: one thread per token runs the CPU
// simulator's draw (routing/simulated_router.cpp), so ids equal the CPU's for
// the same simulation_seed; kZipf needs zipf_pmf / zipf_cdf.
// Throws Error(kUnsupported) for more than 1024 logit columns or top_k > 32.
struct RouteArgs {
  const float* router_logits = nullptr;
  int64_t logits_ld = 0;
  const float* bias = nullptr;          // e_score_correction_bias (f32) or null
  const int32_t* hash_table = nullptr;  // kHash
  const int32_t* token_ids = nullptr;   // kHash
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  // Optional (device scalars): rows t >= *num_valid_tokens are padding (CUDA-graph
  // replay at a capture size): ids -1, weights 0, never read. nan_token: the
  // kernel lowers it to the first token with a NaN logit (atomicMin); the caller
  // initialises it (e.g. INT32_MAX) and reads it after the stream synchronises.
  const int32_t* num_valid_tokens = nullptr;
  int32_t* nan_token = nullptr;
  int32_t* bad_token = nullptr;  // kHash: as nan_token, for token ids outside the table
  // kSimulated + kZipf: device f64 [E + Z] tables pmf[c] = (c + 1)^-zipf_s and
  // their prefix sums, computed on the host (routing::simulated::zipf_tables in
  // src/routing/simulated_routing.h) so that the draws match the CPU's.
  const double* zipf_pmf = nullptr;
  const double* zipf_cdf = nullptr;
};
void route(const MoEConfig& config, const RouteArgs& args, int64_t num_tokens, Stream stream);

// ---- align / permute -----------------------------------------------------------
// Groups the T*k routed slots by expert, each expert's rows padded to block_m:
//   expert_offsets i64 [E + 1]: padded rows of expert e are [off[e], off[e+1]),
//                               every off[e] a multiple of block_m;
//   sorted_slot    i32 [max_padded_rows]: slot t*k+j of each padded row, -1 for
//                               padding (only [0, off[E]) is written);
//   slot_row       i32 [T*k], optional: the row of each routed slot
//                               (sorted_slot[slot_row[s]] == s; slots with no
//                               expert are not written);
//   expert_counts, expert_cursor i32 [E]: scratch;
//   chunk_counts   i32 [align_chunk_counts_size(T*k, E)], optional scratch: with it,
//                               many slots (E <= 1024) take two kernels that place
//                               each expert's rows in ascending slot order.
// Slots with id -1 (or any id outside [0, E)) are skipped. Otherwise the rows
// of one expert appear in no particular order (atomics); results downstream do
// not depend on it. vLLM's moe_align_block_size, without its host sync.
// Throws Error(kInvalidArgument) for num_experts or block_m <= 0, num_slots < 0
// or num_slots + E * block_m >= 2^31, null pointers, or FUSEDMOE_CUDA_ALIGN
// other than fused / chunks / grid (which force a kernel where it applies).
int64_t max_padded_rows(int64_t num_slots, int64_t num_experts, int block_m);
// Elements of AlignArgs::chunk_counts for num_slots slots and num_experts experts
// (0 beyond 1024 experts, where the chunks do not apply).
int64_t align_chunk_counts_size(int64_t num_slots, int64_t num_experts);
struct AlignArgs {
  const int32_t* topk_ids = nullptr;  // [T, k] contiguous
  int64_t num_slots = 0;              // T * k
  int64_t num_experts = 0;
  int block_m = 16;
  int64_t* expert_offsets = nullptr;
  int32_t* sorted_slot = nullptr;
  int32_t* slot_row = nullptr;       // optional [T * k]
  int32_t* expert_counts = nullptr;  // scratch [E]
  int32_t* expert_cursor = nullptr;  // scratch [E]
  int32_t* chunk_counts = nullptr;   // optional scratch [align_chunk_counts_size(T * k, E)]
  // Optional: num_zero_words (<= kAlignMaxZeroWords) int32 set to 0 by align's
  // kernels, in stream order before the next kernel (the grouped GEMMs' work
  // counters: no memset launch of their own).
  int32_t* zero_words = nullptr;
  int num_zero_words = 0;
};
inline constexpr int kAlignMaxZeroWords = 32;
void align(const AlignArgs& args, Stream stream);

// ---- w13 row layout ------------------------------------------------------------
// kStandard: gate rows [0, I), then up rows [I, 2I) (HF's gate_up_proj order).
// kInterleaved128: blocks of 128 gate rows, each followed by the matching 128 up
//   rows (I % 128 == 0): gate row i at (i / 128) * 256 + i % 128, up row i 128
//   rows after it. One 256-column tile of the w13 GEMM then holds both halves of
//   128 intermediate columns, and the sm90 path applies the activation in the
//   GEMM's epilogue. The single-GPU CUDA layer (MoERunner, `fusedmoe run/bench
//   --backend cuda`) keeps its routed experts this way where that path exists
//   (interleave_w13, once at load); the shared expert and the expert-parallel
//   layer keep kStandard. Every routed-experts path reads either; biases stay in
//   the standard order [E, 2I] in both. Nothing records a buffer's layout: the
//   caller passes it (w13_layout fields).
enum class W13Layout : uint8_t { kStandard, kInterleaved128 };
inline constexpr int kW13Block = 128;
// Rewrites w13 (dtype [E, 2I, H], 2-byte elements, device memory) from
// kStandard into kInterleaved128 in place. A load-time call, not a forward one:
// it cudaMallocs a temporary of one expert, runs the copies on `stream` and
// synchronizes it before returning (not capturable in a graph). Not idempotent:
// a second call scrambles the rows. E >= 0, H > 0, I > 0 and I % 128 == 0;
// throws Error(kInvalidArgument) otherwise.
void interleave_w13(uint16_t* w13, int64_t num_experts, int64_t inter, int64_t hidden,
                    Stream stream);

// ---- grouped GEMM experts ------------------------------------------------------
// Tile configurations (the tuning table lives in gemm_configs.cpp).
enum class GemmTile : uint8_t { kM16N64, kM64N128, kM128N128, kM128N256, kM8Gemv };
inline constexpr int kNumGemmTiles = 5;
int gemm_tile_block_m(GemmTile tile);
const char* gemm_tile_name(GemmTile tile);  // "m16n64", ...
// The tile the heuristic picks for `rows_per_expert` expected rows per touched
// expert, `routed_rows` rows in all (T * k; dense: M), N and K.
GemmTile pick_gemm_tile(int64_t rows_per_expert, int64_t routed_rows, int64_t n, int64_t k);

// One grouped GEMM over experts, C[r] = A[r] . W[e]^T (bf16 or f16 in, as
// `dtype`, f32 accumulate; mma.sync m16n8k16 .bf16 / .f16):
//   A rows: gather ? a[(sorted_slot[r] / a_div) * lda] : a[r * lda] (dtype, K wide);
//           rows whose slot is -1 (padding) read as zeros, but kScatter's
//           own rows (no gather), whose padding rows are read as they are:
//           their products are never written (a holds expert_offsets[E] rows).
//   W:      dtype [E, N, K] (row-major, K contiguous); K % 8 == 0; a and w
//           16-byte aligned (cp.async and the TMA read 16-byte pieces).
//   rows of expert e: [expert_offsets[e], expert_offsets[e+1]) (multiples of
//           block_m of `tile`); with expert_offsets == null, one expert, rows [0, M).
// Epilogue kGlu (w13, N = 2I): out[r, i] = act(gate_i + b[i], up_i + b[I + i]), where
//   gate_i / up_i are C's columns i / I + i for w13_layout kStandard, and columns
//   (i / 128) * 256 + i % 128 and that + 128 for kInterleaved128 (b: standard order)
//   (dtype, rounded to nearest; f16 values beyond 65504 become +-inf) for i < I,
//   every row of a tile written (padding too), row stride ldc. N even, ldc even.
// Epilogue kScatter (w2, N = H): for rows with slot s != -1:
//   out_f32[s * ldc + n] = scale * (C[r, n] + b[n]), scale = row_scale[s] or 1.
//   Without expert_offsets (dense, shared expert): out_f32[r * ldc + n], r < M.
//   Any N >= 1 and ldc >= N (the dense router GEMM: E + Z logits, any row stride).
enum class GemmEpilogue : uint8_t { kGlu, kScatter };
struct GroupedGemmArgs {
  GemmEpilogue epilogue = GemmEpilogue::kGlu;
  GemmTile tile = GemmTile::kM64N128;
  DType dtype = DType::kBF16;   // of a, w and the kGlu output: kBF16 or kF16
  const uint16_t* a = nullptr;  // bf16 / f16 bits
  int64_t lda = 0;
  bool gather = false;
  int a_div = 1;  // top_k (routed); m8gemv also reads M / a_div as the token count, the most
                  // rows an expert gets from distinct ids per token (a speed hint only)
  const int32_t* sorted_slot = nullptr;
  const int64_t* expert_offsets = nullptr;
  int64_t num_experts = 1;
  int64_t m = 0;                // dense mode rows; routed mode: host upper bound of padded rows
  const uint16_t* w = nullptr;  // bf16 / f16 bits [E, N, K]
  int64_t n = 0, k = 0;
  const float* bias = nullptr;                  // f32 [E, N] or null
  ActivationParams act;                         // kGlu
  W13Layout w13_layout = W13Layout::kStandard;  // kGlu: the rows of w (the bias: standard)
  const float* row_scale = nullptr;             // kScatter: f32 per slot, or null
  void* out = nullptr;
  int64_t ldc = 0;
  // Optional device int32, 0 when the launch starts (align's zero_words, or a
  // memset): the CTAs then claim their work items one at a time from it
  // (atomicAdd) instead of taking every gridDim-th one, so a CTA that streams
  // faster takes more of them (mma.sync tiles with at least stages + 1 K steps
  // and fewer than 2^31 - grid work items; else, or null, the static order). One counter a launch:
  // two GEMMs that may overlap (PDL, two streams) need two. FUSEDMOE_CUDA_MMA_SCHEDULE=static
  // ignores it.
  int32_t* work_counter = nullptr;
};
void grouped_gemm(const GroupedGemmArgs& args, Stream stream);

// ---- routed experts, many rows per expert: sm_90a grouped GEMM -------------------
// wgmma + TMA (CUTLASS 3.x ptr-array grouped GEMM, warp-specialized: bf16 in
// 64 x 256 pingpong or 128 x 256 cooperative tiles by pick_sm90_tile, f16 in
// 128 x 256 cooperative; f32 accumulation) over expert-contiguous rows.
// Needs align() with block_m = 1 (no padding rows) or 64 (Sm90ExpertsArgs::block_m) and its
// slot_row. x, the weights and the
// intermediates are of one half type, `dtype` (bf16 or f16; CUTLASS instances
// of each). In order, on `stream`:
//   1. xs[slot_row[s]] = x[s / top_k]  (dtype [T*k, H], kept in y_rows);
//   2. h13[r] = xs[r] . w13[e]^T           (dtype [T*k, 2I], in `workspace`);
//   3. inter_rows[r, i] = act(h13[r, i] + b[e, i], h13[r, I + i] + b[e, I + i])  (dtype);
//   4. y_rows[r] = inter_rows[r] . w2[e]^T ([T*k, H], unweighted, without w2 bias: bf16 for
//      dtype bf16 (half the bytes of the largest intermediate; one more bf16 rounding per term,
//      as vLLM's fused_moe), f32 for f16 (an f16 row could overflow where the weighted sum does
//      not));
// for rows r < expert_offsets[E], e the expert of row r. finalize() with
// slot_row, row_scale = topk_weights and bias = w2 bias then sums each token's
// rows in slot order. The per-expert problem shapes and pointers are written
// on the device from expert_offsets (no host sync; graph-capturable).
// x: dtype [T, H] rows (stride ldx); w13 dtype [E, 2I, H] (rows as w13_layout
// places them: steps 2-3 read gate / up column i where W13Layout puts rows i);
// w13_bias f32 [E, 2I] (standard order in either layout) or null; w2 dtype
// [E, H, I]. H % 8 == 0 and I % 8 == 0.
// With w13_layout kStandard, unlike grouped_gemm (activation on the f32
// accumulators), step 2 rounds the gate/up values to dtype before the
// activation: ~3e-3 relative apart from the mma.sync path in bf16, and with f16
// a gate/up value beyond 65504 becomes +-inf (NaN after SiLU) where the mma.sync
// path stays finite (as vLLM's fused_moe, which also stores the w13 output in
// the half type). With kInterleaved128 (I % 128 == 0) steps 2 and 3 are one
// GEMM whose epilogue activates the f32 accumulators (grouped_gemm's arithmetic,
// no h13 in memory).
// Throws Error(kInvalidArgument) on bad sizes or a short workspace,
// Error(kUnsupported) in builds without CUTLASS.
// sm90_experts_available(): built with CUTLASS and the current device is sm_90.
bool sm90_experts_available();
// Bytes of `workspace` for up to num_slots = T * k routed rows.
size_t sm90_experts_workspace_bytes(int64_t num_slots, int64_t num_experts, int64_t inter);
struct Sm90ExpertsArgs {
  DType dtype = DType::kBF16;   // of x, w13, w2, inter_rows: kBF16 or kF16
  const uint16_t* x = nullptr;  // bf16 / f16 bits
  int64_t ldx = 0;
  const int32_t* topk_ids = nullptr;        // i32 [T, k]
  const int32_t* sorted_slot = nullptr;     // from align(block_m)
  const int64_t* expert_offsets = nullptr;  // from align(block_m)
  // align()'s block_m: 1 (rows packed: CUTLASS's ptr-array grouped GEMMs, a TMA
  // descriptor update per expert change) or 64 (bf16 only; each expert's rows
  // padded to 64: one GEMM over all rows with one TMA descriptor per operand,
  // the expert of each 64-row tile from a table; the rows of inter_rows and
  // y_rows are then max_padded_rows(T * k, E, 64)). routed experts pick it by
  // pick_sm90_contig (FUSEDMOE_CUDA_SM90_CONTIG=on|off forces it where it fits).
  int block_m = 1;
  int64_t num_tokens = 0, top_k = 0, num_experts = 0, hidden = 0, inter = 0;
  const uint16_t* w13 = nullptr;
  // kInterleaved128: the activation runs in the w13 GEMM's epilogue (steps 2
  // and 3 in one: no h13, the f32 accumulators activated and rounded once, as
  // grouped_gemm's kGlu); kStandard: steps 2 and 3 as listed.
  W13Layout w13_layout = W13Layout::kStandard;
  const float* w13_bias = nullptr;
  const uint16_t* w2 = nullptr;
  ActivationParams act;
  uint16_t* inter_rows = nullptr;     // dtype [rows, I], rows = T * k (block_m 1) or
                                      // max_padded_rows(T * k, E, 64) (block_m 64)
  void* y_rows = nullptr;             // [rows, H]: bf16 (dtype bf16) or f32 (dtype f16), 16-byte
                                      // aligned, room for T * k * H f32 and rows * H bf16
  const int32_t* slot_row = nullptr;  // i32 [T * k]: from align(block_m)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
void sm90_experts(const Sm90ExpertsArgs& args, Stream stream);

// One dense expert over all T rows (the shared expert) on the same sm_90a path:
// no permute, A = x itself; in order on `stream`:
//   h13 = x . w13^T (dtype [T, 2I], in `workspace`),
//   inter_rows[t, i] = act(h13[t, i] + b[i], h13[t, I + i] + b[I + i]) (dtype),
//   out = inter_rows . w2^T (f32 [T, H], contiguous).
// x: dtype (bf16 or f16) [T, H] contiguous, 16-byte aligned; w13 dtype [2I, H]; w13_bias f32
// [2I] or null; w2 dtype [H, I]. H % 8 == 0 and I % 8 == 0. The arithmetic of
// sm90_experts (the gate/up values rounded to dtype before the activation), not
// quite grouped_gemm's dense kGlu + kScatter: the shared expert's output moves
// by ~3e-3 relative (bf16) where the layer switches path (pick_sm90_experts).
// Throws Error(kInvalidArgument) on bad sizes or a short workspace,
// Error(kUnsupported) in builds without CUTLASS.
size_t sm90_dense_expert_workspace_bytes(int64_t num_tokens, int64_t inter);
struct Sm90DenseExpertArgs {
  DType dtype = DType::kBF16;   // of x, w13, w2, inter_rows: kBF16 or kF16
  const uint16_t* x = nullptr;  // bf16 / f16 bits
  int64_t num_tokens = 0, hidden = 0, inter = 0;
  const uint16_t* w13 = nullptr;
  const float* w13_bias = nullptr;
  const uint16_t* w2 = nullptr;
  ActivationParams act;
  uint16_t* inter_rows = nullptr;  // dtype [T, I]
  float* out = nullptr;            // f32 [T, H]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
void sm90_dense_expert(const Sm90DenseExpertArgs& args, Stream stream);
// Whether the routed experts take sm90_experts() (true) or the mma.sync / GEMV
// grouped GEMMs (tuning data in gemm_configs.cpp). FUSEDMOE_CUDA_EXPERTS=sm90
// or =mma in the environment forces one (=sm90 where the sm_90a path is not
// available: Error(kUnsupported); another value: Error(kInvalidArgument)).
// The shared expert (one expert, T rows) takes sm90_dense_expert() when
// pick_sm90_experts(T, T, H, I_shared) says so (one expert: from 12 rows; routed
// experts: from 11 rows an expert with up to 16 experts touched, else from 13).
bool pick_sm90_experts(int64_t rows_per_expert, int64_t routed_rows, int64_t hidden, int64_t inter);

// ---- finalize ------------------------------------------------------------------
// out[t, h] = sum_{j < k, topk_ids[t, j] valid} y[(t*k + j) * H + h]   (slot order,
//             deterministic)  + shared_scale_t * shared[t * H + h]  (if shared)
// shared_scale_t = sigmoid(x_t . shared_gate) when shared_gate (f32 [H]) and
// x (bf16 or f16 as x_dtype, [T, H], row stride ldx) are given, else 1. y,
// shared: f32. out: f32, bf16 or f16 (out_dtype; rounded to nearest: an f16
// value beyond 65504 becomes +-inf, as torch's .half()), row stride ldo. An id
// is valid when >= 0 and, with num_experts > 0, < num_experts (align skips the
// others too). Expert-sorted y (sm90_experts): with slot_row (i32 [T * k]) the
// term of slot s is row_scale[s] * (y[slot_row[s] * H + h] + bias[topk_ids[s] *
// H + h]) (row_scale null: 1; bias f32 [E, H] or null: 0) — the kScatter
// epilogue's arithmetic, summed in the same slot order; y_dtype kBF16 there
// reads sm90_experts' bf16 rows (each value widened to f32 first).
struct FinalizeArgs {
  const void* y = nullptr;      // f32 [T * k, H], or bf16 by y_dtype
  DType y_dtype = DType::kF32;  // kF32 or kBF16 (hidden % 8 == 0): by slot, or with slot_row
  const int32_t* topk_ids = nullptr;
  int64_t num_tokens = 0, top_k = 0, hidden = 0;
  int64_t num_experts = 0;
  const float* shared = nullptr;
  const float* shared_gate = nullptr;
  const uint16_t* x = nullptr;
  DType x_dtype = DType::kBF16;
  int64_t ldx = 0;
  void* out = nullptr;
  DType out_dtype = DType::kF32;
  int64_t ldo = 0;
  const int32_t* slot_row = nullptr;
  const float* row_scale = nullptr;
  const float* bias = nullptr;
};
void finalize(const FinalizeArgs& args, Stream stream);

// ---- functional routed experts (vLLM's fused_experts) -------------------------
// output[t] = sum_{j < k, topk_ids[t, j] != -1} s_j * (w2[e] . act(w13[e] . x_j + w13_bias[e])
//             + w2_bias[e]),   e = topk_ids[t, j],
// with x_j = x[t], s_j = topk_weights[t, j]; or, apply_router_weight_on_input
// (Llama-4), x_j = topk_weights[t, j] * x[t] and s_j = 1. The expert input and
// the intermediate are rounded to the weights' half type (weight_dtype: bf16
// or f16; f16 hidden states with bf16 weights are converted to bf16, and bf16
// ones with f16 weights to f16), GEMMs accumulate in f32, the k rows of a
// token are summed in slot order (deterministic). The pipeline is the CUDA MoE
// layer's routed experts (the same code): to_half_rows (skipped where
// hidden_states are already weight_dtype, not scaled on the input, with H and
// ldx multiples of 8 and a 16-byte aligned pointer: read in place) -> for a few slots
// (T * k <= 96, and T <= 4 or T * k <= 2 E) two weight-streaming decode kernels
// straight from topk_ids (FUSEDMOE_CUDA_DECODE=0 turns them off), otherwise align -> either
// grouped_gemm (kGlu) -> grouped_gemm (kScatter), or, for many rows per expert
// on an sm_90 device (pick_sm90_experts, FUSEDMOE_CUDA_EXPERTS), sm90_experts
// -> finalize; so its output equals the layer's for the same inputs.
//   hidden_states f32, bf16 or f16 [T, H] (row stride ldx >= H);
//   w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up; or, with w13_layout
//     kInterleaved128, as interleave_w13 leaves them: the sm90 path then applies
//     the activation in the w13 GEMM's epilogue), w2 [E, H, I], contiguous,
//     both of weight_dtype;
//   w13_bias f32 [E, 2I] and w2_bias f32 [E, H], or null;
//   topk_ids i32 [T, k], topk_weights f32 [T, k], contiguous. Ids outside [0, E)
//     (-1: no expert) add nothing — they are not reported (that needs a host sync);
//   output f32, bf16 or f16 [T, H] (row stride ldo >= H), must not alias
//     hidden_states. An f16 output value beyond 65504 becomes +-inf (round to
//     nearest, as torch's .half()); so does an f16 intermediate (activation
//     output) value, which then makes the token's output inf or NaN.
// `workspace` is caller-owned device memory of at least
// fused_experts_workspace_bytes(...) bytes (256-byte aligned), so that nothing
// is allocated here: the call is asynchronous on `stream` and can be captured in
// a CUDA graph. Throws Error(kInvalidArgument) naming the field for sizes,
// strides, dtypes, null pointers or a workspace that is too small, and
// Error(kUnsupported) when H or I is not a multiple of 8, k > 32, or
// apply_router_weight_on_input with k != 1.
struct FusedExpertsArgs {
  const void* hidden_states = nullptr;
  DType hidden_dtype = DType::kF32;
  int64_t ldx = 0;
  int64_t num_tokens = 0, hidden_size = 0, intermediate_size = 0, num_experts = 0, top_k = 0;
  DType weight_dtype = DType::kBF16;            // of w13 and w2: kBF16 or kF16
  const uint16_t* w13 = nullptr;                // bf16 / f16 bits
  W13Layout w13_layout = W13Layout::kStandard;  // kInterleaved128: I % 128 == 0
  const uint16_t* w2 = nullptr;                 // bf16 / f16 bits
  const float* w13_bias = nullptr;              // standard order in either layout
  const float* w2_bias = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  ActivationParams activation;
  bool apply_router_weight_on_input = false;
  void* output = nullptr;
  DType output_dtype = DType::kF32;
  int64_t ldo = 0;
};
// Device bytes fused_experts needs as workspace for these sizes (grows with T;
// includes the sm90_experts scratch when sm90_experts_available()).
// w13_layout: the one the call passes (kInterleaved128 needs fewer bytes: no
// rows of the w13 GEMM before the activation, T * k * 2I halves). Throws
// Error(kInvalidArgument) for T < 0, other sizes < 1, H or I above 2^24, E above
// 2^20, T * k above 2^31 - 1 (no byte count wraps), or kInterleaved128 with I
// not a multiple of 128.
size_t fused_experts_workspace_bytes(int64_t num_tokens, int64_t hidden_size,
                                     int64_t intermediate_size, int64_t num_experts, int64_t top_k,
                                     bool apply_router_weight_on_input,
                                     W13Layout w13_layout = W13Layout::kStandard);
void fused_experts(const FusedExpertsArgs& args, void* workspace, size_t workspace_bytes,
                   Stream stream);

// ---- small helpers ---------------------------------------------------------------
// out[t, h] = half(x[t, h] * (row_scale ? row_scale[t * scale_stride] : 1)),
// x f32, bf16 or f16 (in_dtype) with row stride ldx; out contiguous [T, H] of
// out_dtype (kBF16 or kF16, rounded to nearest even). to_bf16_rows: out_dtype kBF16.
void to_half_rows(const void* x, DType in_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                  const float* row_scale, int64_t scale_stride, DType out_dtype, void* out,
                  Stream stream);
void to_bf16_rows(const void* x, DType in_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                  const float* row_scale, int64_t scale_stride, uint16_t* xb, Stream stream);
// router_logits f32 [T, L] (row stride ldl >= L) = x . gate_w^T + gate_b, in f32.
// x f32, bf16 or f16 (x_dtype, row stride ldx >= H), gate_w f32 or bf16 [L, H]
// contiguous (w_dtype), gate_b f32 [L] or null. Every product is formed from
// the inputs' exact values and summed in f32 (the order of the sums depends on
// the path, so results agree to f32 rounding, not bit for bit, across paths):
//   T <= 32: CUDA cores, one block per (logit, 8 tokens);
//   x and gate_w bf16 (16-byte aligned rows: H, ldx multiples of 8), T > 32:
//     tensor cores (the dense mma.sync GEMM of grouped_gemm, kScatter epilogue;
//     bf16 x bf16 products are exact in f32, accumulation in f32). This is
//     what vLLM and SGLang run for DeepSeek-V3's gate (bf16 inputs, f32
//     accumulation); HF transformers upcasts both to f32 first, which gives
//     the same products, so the logits differ from HF's in f32 rounding only;
//   otherwise: CUDA cores, 64 x 64 f32 tiles.
// x_bf16 (optional): also writes to_bf16_rows(x) there (bf16 [T, H], contiguous;
// the same values): at T <= 32 inside the router kernel (one launch fewer on
// the decode path), otherwise by a to_bf16_rows launch after it.
// Throws Error(kInvalidArgument) for other dtypes or strides.
void router_gemm(const void* x, DType x_dtype, int64_t ldx, int64_t num_tokens, int64_t hidden,
                 const void* gate_w, DType w_dtype, int64_t num_logits, const float* gate_b,
                 float* router_logits, int64_t ldl, Stream stream, uint16_t* x_bf16 = nullptr);

}  // namespace fusedmoe::cuda
