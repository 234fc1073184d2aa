// fusedmoe CUDA: routed experts for many rows per expert on Hopper tensor
// cores — permute the input into expert-contiguous rows, the w13 grouped GEMM
// (CUTLASS sm90, wgmma + TMA), the gated activation, the w2 grouped GEMM into
// f32 rows that finalize() weights and sums per token in slot order.
//
// TMA loads whole tiles, it cannot gather rows, so unlike the mma.sync kernels
// (which gather A rows with cp.async and fuse the activation and the weighted
// scatter into their epilogues) this path materialises the sorted input and
// the w13 output (bf16 or f16, the weights' type). At large T those extra passes cost a few percent
// of the GEMMs; the GEMMs run at wgmma speed. One dense expert over all rows (the shared expert,
// sm90_dense_expert) takes the same GEMM / activation / GEMM sequence on its input rows as they
// are: no permute.
#include <algorithm>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"  // act_glu
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/routed_experts.h"  // pick_sm90_tile
#ifdef FUSEDMOE_WITH_CUTLASS
#include "kernels/cuda/gemm/sm90_cutlass_instances.h"
#endif

namespace fusedmoe::cuda {
#ifdef FUSEDMOE_WITH_CUTLASS
namespace {

constexpr int kPermuteThreads = 128;

// xs[slot_row[t * top_k + j]] = x[t] for every routed slot of token t (ids in
// [0, E)); one block a token (grid-stride). Token-major, so each x row is read
// once even when x does not fit in L2 (DeepSeek-V3 at T = 4096: 58 MB), where
// a row-major copy read it top_k times from memory.
constexpr int kPermuteMaxK = 32;
__global__ void __launch_bounds__(kPermuteThreads)
    permute_tokens_kernel(const uint16_t* __restrict__ x, int64_t ldx,
                          const int32_t* __restrict__ ids, const int32_t* __restrict__ slot_row,
                          int64_t num_tokens, int num_experts, int top_k, int64_t hidden,
                          uint16_t* __restrict__ xs) {
  __shared__ int64_t row[kPermuteMaxK];  // -1: no expert
  pdl_wait();                            // slot_row from align; xs read by the kernels before
  pdl_launch_dependents();
  const int64_t vecs = hidden / 8;
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's rows are read
    if (threadIdx.x < top_k) {
      const int64_t s = t * top_k + threadIdx.x;
      const int32_t e = ids[s];
      row[threadIdx.x] = e >= 0 && e < num_experts ? slot_row[s] : -1;
    }
    __syncthreads();
    // Two 16-byte loads in flight a thread before its stores (H = 2048: the
    // whole row in one step of 128 threads).
    const uint4* src = reinterpret_cast<const uint4*>(x + t * ldx);
    for (int64_t v = threadIdx.x; v < vecs; v += 2 * blockDim.x) {
      const int64_t v2 = v + blockDim.x;
      const uint4 a = src[v];
      const uint4 b = v2 < vecs ? src[v2] : a;
      for (int j = 0; j < top_k; ++j) {
        if (row[j] < 0) continue;
        uint4* dst = reinterpret_cast<uint4*>(xs + row[j] * hidden);
        dst[v] = a;
        if (v2 < vecs) dst[v2] = b;
      }
    }
  }
}

// inter[r, i] = act(h[r, i] + b[e, i], h[r, I + i] + b[e, I + i]), 8 columns a
// thread, e = topk_ids[sorted_slot[r]]; -1 rows get zeros. With interleaved
// (w13 in W13Layout::kInterleaved128) h's gate / up columns are where w13_row
// puts the rows (8 columns stay in one block). Without sorted_slot
// (one dense expert): every row r < offsets[num_experts] is valid, e = 0.
// h and out: T (__nv_bfloat16 or __half) bits. Idx: uint32_t when rows * I / 8
// < 2^32 (a 64-bit division per vector made the kernel instruction-bound), else int64_t.
template <class T, class Idx>
__global__ void glu_rows_kernel(const uint16_t* __restrict__ h, const int32_t* __restrict__ ids,
                                const int32_t* __restrict__ sorted_slot,
                                const int64_t* __restrict__ offsets, int num_experts, int64_t inter,
                                int64_t max_rows, const float* __restrict__ bias,
                                ActivationParams act, bool interleaved,
                                uint16_t* __restrict__ out) {
  pdl_wait();  // h from the w13 GEMM; out read by the kernels before
  pdl_launch_dependents();
  const int64_t rows = offsets[num_experts] < max_rows ? offsets[num_experts] : max_rows;
  const Idx vecs = static_cast<Idx>(inter / 8);
  const Idx total = static_cast<Idx>(rows) * vecs;
  for (Idx idx = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<Idx>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / vecs, i = static_cast<int64_t>(idx % vecs) * 8;
    const int32_t slot = sorted_slot ? sorted_slot[r] : 0;
    uint4 res = make_uint4(0, 0, 0, 0);
    if (slot >= 0) {
      const uint4 g4 =
          *reinterpret_cast<const uint4*>(h + r * 2 * inter + w13_row(i, 0, inter, interleaved));
      const uint4 u4 =
          *reinterpret_cast<const uint4*>(h + r * 2 * inter + w13_row(i, 1, inter, interleaved));
      const uint16_t* g = reinterpret_cast<const uint16_t*>(&g4);
      const uint16_t* u = reinterpret_cast<const uint16_t*>(&u4);
      const int64_t e = sorted_slot ? ids[slot] : 0;
      const float* b = bias ? bias + e * 2 * inter : nullptr;
      uint16_t* o = reinterpret_cast<uint16_t*>(&res);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float gv = gemm::to_float<T>(g[j]), uv = gemm::to_float<T>(u[j]);
        if (b) {
          gv += b[i + j];
          uv += b[inter + i + j];
        }
        o[j] = gemm::from_float_bits<T>(
            gemm::act_glu(act.activation, gv, uv, act.swiglu_alpha, act.swiglu_limit));
      }
    }
    *reinterpret_cast<uint4*>(out + r * inter + i) = res;
  }
}

// One dense expert: expert_offsets {0, T} (the CUTLASS group arguments are
// built from device offsets; written here so that T stays a launch argument).
__global__ void dense_offsets_kernel(int64_t* offsets, int64_t rows) {
  pdl_wait();  // offsets read by the kernels before
  pdl_launch_dependents();
  offsets[0] = 0;
  offsets[1] = rows;
}

// The part shared by the routed experts and one dense expert, on rows of `a`
// that are already expert-contiguous (rows of expert e: [offsets[e],
// offsets[e+1]), at most max_rows): h13 = a . w13[e]^T (bf16, in the front of
// `workspace`), inter_rows = act(h13 + b13) (dtype), y_rows = inter_rows .
// w2[e]^T (unweighted, no w2 bias; bf16 when y_bf16 (dtype bf16 only), else
// f32). Tiles by pick_sm90_tile. sorted_slot / topk_ids: as in
// glu_rows_kernel (null sorted_slot: one dense expert).
struct GemmGluGemm {
  DType dtype;  // of a, w13, w2, h13 and inter_rows: kBF16 or kF16
  const uint16_t* a;
  int64_t max_rows;
  int64_t rows_per_expert;  // expected (pick_sm90_tile)
  const int64_t* offsets;
  int64_t num_experts;
  const int32_t* topk_ids;
  const int32_t* sorted_slot;
  int64_t hidden, inter;
  const uint16_t* w13;
  bool w13_interleaved;  // W13Layout::kInterleaved128: the activation in the w13 epilogue
  const float* w13_bias;
  const uint16_t* w2;
  ActivationParams act;
  uint16_t* inter_rows;
  void* y_rows;
  bool y_bf16;
  void* workspace;
  size_t workspace_bytes;
  // The contiguous GEMMs when set (offsets padded to kSm90ContigBlockM, bf16,
  // 64 x 256 tiles; Sm90ExpertsArgs::block_m = 64): the table of each 64-row
  // tile's expert; max_rows is then sm90_contig_max_rows(T*k, E).
  int32_t* tile_expert = nullptr;
  bool contig() const { return tile_expert != nullptr; }
};

// bf16 in, bf16 out: the instance of that tile.
void grouped_gemm_bf16out(Sm90Tile tile, const sm90::Sm90GemmArgs& g, Stream stream) {
  switch (tile) {
    case Sm90Tile::kM128N256:
      sm90::grouped_gemm_bf16out(g, stream);
      return;
    case Sm90Tile::kM64N256:
      sm90::grouped_gemm_bf16out_m64(g, stream);
      return;
  }
  FUSEDMOE_THROW(kInvalidArgument, "sm90 experts: unknown tile ", static_cast<int>(tile));
}

size_t h13_bytes(int64_t rows, int64_t inter) {
  return (static_cast<size_t>(rows) * 2 * inter * 2 + 255) / 256 * 256;
}

size_t tile_expert_bytes(int64_t slots, int64_t num_experts) {
  return (static_cast<size_t>(sm90_contig_max_rows(slots, num_experts) / kSm90ContigBlockM) * 4 +
          255) /
         256 * 256;
}

// The workspace of one grouped GEMM: the largest of the instances (bf16 and f16).
size_t gemm_workspace_bytes(int64_t num_experts) {
  size_t gemm = 0;
  for (const size_t b :
       {sm90::workspace_bytes_bf16out(num_experts), sm90::workspace_bytes_f32out(num_experts),
        sm90::workspace_bytes_bf16out_m64(num_experts),
        sm90::workspace_bytes_f16_f16out(num_experts),
        sm90::workspace_bytes_f16_f32out(num_experts),
        sm90::workspace_bytes_glu_bf16_m64(num_experts),
        sm90::workspace_bytes_glu_bf16_m128(num_experts),
        sm90::workspace_bytes_glu_f16_m128(num_experts), sm90::contig_workspace_bytes_bf16out_m64(),
        sm90::contig_workspace_bytes_glu_bf16_m64()})
    gemm = b > gemm ? b : gemm;
  return (gemm + 255) / 256 * 256;
}

void glu_pass(const GemmGluGemm& a, const uint16_t* h13, Stream stream);

// Whether the w13 GEMM applies the activation in its epilogue (no h13 rows).
bool glu_in_epilogue(const GemmGluGemm& a) {
  return a.w13_interleaved &&
         pick_sm90_glu_epilogue(a.rows_per_expert, a.num_experts, a.hidden, a.inter);
}

// The two GEMMs of gemm_glu_gemm, each with its own part of the workspace
// (h13 rows unless the activation is in the epilogue, then the w13 GEMM's
// arrays, then the w2 GEMM's), so that both GEMMs' group arrays can be written
// before the first of them runs.
struct GemmPair {
  sm90::Sm90GemmArgs w13, w2;
  bool epilogue;
  uint16_t* h13;
};

GemmPair gemm_pair(const GemmGluGemm& a) {
  const int64_t H = a.hidden, I = a.inter, E = a.num_experts, rows = a.max_rows;
  GemmPair p;
  p.epilogue = glu_in_epilogue(a);
  p.h13 = static_cast<uint16_t*>(a.workspace);  // unused with the epilogue
  const size_t h13b = p.epilogue ? 0 : h13_bytes(rows, I), gemm_b = gemm_workspace_bytes(E);
  FUSEDMOE_CHECK(a.workspace_bytes >= h13b + 2 * gemm_b, "sm90 experts: workspace of ",
                 h13b + 2 * gemm_b, " bytes needed, got ", a.workspace_bytes);
  sm90::Sm90GemmArgs& g = p.w13;
  g.a = a.a;
  g.w = a.w13;
  g.d = p.h13;
  g.ldd = 2 * I;
  g.expert_offsets = a.offsets;
  g.num_experts = E;
  g.n = 2 * I;
  g.k = H;
  g.workspace = static_cast<char*>(a.workspace) + h13b;
  g.workspace_bytes = gemm_b;
  g.tile_expert = a.tile_expert;
  g.max_rows = a.max_rows;
  if (p.epilogue) {
    // inter_rows = act(a . w13[e]^T + b13[e]) straight from the accumulators.
    g.d = a.inter_rows;
    g.ldd = I;
    g.glu_bias = a.w13_bias;
    g.glu_act = a.act;
  }
  sm90::Sm90GemmArgs& g2 = p.w2;
  g2 = g;
  g2.glu_bias = nullptr;
  g2.glu_act = {};
  g2.a = a.inter_rows;
  g2.w = a.w2;
  g2.d = a.y_rows;
  g2.ldd = H;
  g2.n = H;
  g2.k = I;
  g2.workspace = static_cast<char*>(a.workspace) + h13b + gemm_b;
  return p;
}

// The launch policy of a GEMM in tiles block_m rows high: PDL where the tile
// holds every expert's rows (sm90_gemm_pdl); L2 hints on its TMA loads where
// (nearly) every expert has one m tile (sm90_l2_hints_pay): each weight byte
// is read once there, so the weights go evict-first and the activation rows,
// read again by every n tile of their expert, evict-last (measured beside the
// rule in gemm_configs.cpp; the weights' hint alone or the rows' alone gained
// less, the rows' hint with several m tiles an expert nothing: session 34).
void set_launch_policy(sm90::Sm90GemmArgs& g, const GemmGluGemm& a, int block_m) {
  g.pdl = sm90_gemm_pdl(a.rows_per_expert, block_m);
  if (!sm90_l2_hints_pay(a.rows_per_expert, a.num_experts, block_m)) return;
  g.cache_hint_w = sm90::kL2EvictFirst;
  g.cache_hint_a = sm90::kL2EvictLast;
}

// One grouped GEMM of the pair (w13: with the activation in the epilogue or
// not), in the instance its dtype and tile take, for phase g.phase; with PDL
// where that instance's tile height holds every expert's rows (sm90_gemm_pdl).
void gemm_w13(const GemmGluGemm& a, const GemmPair& p, sm90::Sm90GemmArgs g, Stream stream) {
  if (a.contig()) {  // the tile_expert table (kPrepare) serves both GEMMs
    set_launch_policy(g, a, kSm90ContigBlockM);
    if (p.epilogue)
      sm90::contig_gemm_glu_bf16_m64(g, stream);
    else
      sm90::contig_gemm_bf16out_m64(g, stream);
    return;
  }
  const bool f16 = a.dtype == DType::kF16;
  const bool m64 =
      !f16 && pick_sm90_tile(a.dtype, a.rows_per_expert, a.num_experts, g.n) == Sm90Tile::kM64N256;
  set_launch_policy(g, a, m64 ? 64 : 128);
  if (p.epilogue) {
    if (f16)
      sm90::grouped_gemm_glu_f16_m128(g, stream);
    else if (m64)
      sm90::grouped_gemm_glu_bf16_m64(g, stream);
    else
      sm90::grouped_gemm_glu_bf16_m128(g, stream);
  } else if (f16) {
    sm90::grouped_gemm_f16_f16out(g, stream);
  } else {
    grouped_gemm_bf16out(m64 ? Sm90Tile::kM64N256 : Sm90Tile::kM128N256, g, stream);
  }
}
void gemm_w2(const GemmGluGemm& a, sm90::Sm90GemmArgs g, Stream stream) {
  if (a.contig()) {
    if (g.phase == sm90::Sm90GemmArgs::Phase::kPrepare) return;  // gemm_w13's table
    set_launch_policy(g, a, kSm90ContigBlockM);
    sm90::contig_gemm_bf16out_m64(g, stream);
    return;
  }
  const bool bf16_out = a.dtype == DType::kBF16 && a.y_bf16;  // else 128 x 256 (f32 out)
  const Sm90Tile tile = pick_sm90_tile(a.dtype, a.rows_per_expert, a.num_experts, g.n);
  set_launch_policy(g, a, bf16_out && tile == Sm90Tile::kM64N256 ? 64 : 128);
  if (a.dtype == DType::kF16)
    sm90::grouped_gemm_f16_f32out(g, stream);
  else if (!a.y_bf16)
    sm90::grouped_gemm_f32out(g, stream);
  else
    grouped_gemm_bf16out(tile, g, stream);
}

// Writes both GEMMs' group arrays (needs only a.offsets): before the kernels
// that make the w13 GEMM's input, so that nothing runs between the GEMMs.
void gemm_glu_gemm_prepare(const GemmGluGemm& a, Stream stream) {
  FUSEDMOE_CHECK(a.dtype != DType::kF16 || !a.y_bf16, "sm90 experts: f16 writes f32 rows");
  GemmPair p = gemm_pair(a);
  p.w13.phase = p.w2.phase = sm90::Sm90GemmArgs::Phase::kPrepare;
  gemm_w13(a, p, p.w13, stream);
  gemm_w2(a, p.w2, stream);
}

// The GEMMs (and the activation pass where it is not in the epilogue) on the
// arrays gemm_glu_gemm_prepare wrote.
void gemm_glu_gemm(const GemmGluGemm& a, Stream stream) {
  GemmPair p = gemm_pair(a);
  p.w13.phase = p.w2.phase = sm90::Sm90GemmArgs::Phase::kLaunch;
  gemm_w13(a, p, p.w13, stream);
  if (!p.epilogue) glu_pass(a, p.h13, stream);
  gemm_w2(a, p.w2, stream);
}

// The gated activation as its own pass (w13 in W13Layout::kStandard): h13 -> inter_rows.
void glu_pass(const GemmGluGemm& a, const uint16_t* h13, Stream stream) {
  const int64_t I = a.inter, E = a.num_experts, rows = a.max_rows;
  const bool f16 = a.dtype == DType::kF16;
  const int64_t blocks = static_cast<int64_t>(num_sms()) * 16;
  const int64_t vecs = rows * (I / 8);
  const int64_t glu_blocks = std::min(ceil_div(vecs, 256), blocks);
  const bool idx32 = vecs + glu_blocks * 256 < (int64_t{1} << 32);
  auto glu_rows =
      f16 ? (idx32 ? glu_rows_kernel<__half, uint32_t> : glu_rows_kernel<__half, int64_t>)
          : (idx32 ? glu_rows_kernel<__nv_bfloat16, uint32_t>
                   : glu_rows_kernel<__nv_bfloat16, int64_t>);
  launch_pdl(glu_rows, static_cast<unsigned>(glu_blocks), 256, 0, stream, h13, a.topk_ids,
             a.sorted_slot, a.offsets, static_cast<int>(E), I, rows, a.w13_bias, a.act,
             a.w13_interleaved, a.inter_rows);
}

}  // namespace
#endif  // FUSEDMOE_WITH_CUTLASS

bool sm90_experts_available() {
#ifdef FUSEDMOE_WITH_CUTLASS
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9;
#else
  return false;
#endif
}

size_t sm90_experts_workspace_bytes(int64_t num_slots, int64_t num_experts, int64_t inter) {
  return sm90_experts_workspace_bytes_for(num_slots, num_experts, inter, false);
}

size_t sm90_experts_workspace_bytes_for(int64_t num_slots, int64_t num_experts, int64_t inter,
                                        bool glu_epilogue) {
#ifdef FUSEDMOE_WITH_CUTLASS
  // h13 rows (unless the activation is in the w13 epilogue; room for block_m
  // 64's padded rows), then the group arrays and CUTLASS workspace of each of
  // the two GEMMs (gemm_pair), then the contiguous GEMMs' tile_expert table.
  const size_t h13 =
      glu_epilogue ? 0 : h13_bytes(sm90_contig_max_rows(num_slots, num_experts), inter);
  return h13 + 2 * gemm_workspace_bytes(num_experts) + tile_expert_bytes(num_slots, num_experts);
#else
  (void)num_slots;
  (void)num_experts;
  (void)inter;
  (void)glu_epilogue;
  FUSEDMOE_THROW(kUnsupported,
                 "sm90_experts: this build has no CUTLASS (scripts/install-deps.sh installs the "
                 "headers; FUSEDMOE_CUTLASS_DIR points CMake at them)");
#endif
}

void sm90_experts(const Sm90ExpertsArgs& a, Stream stream) {
#ifdef FUSEDMOE_WITH_CUTLASS
  const int64_t H = a.hidden, I = a.inter, E = a.num_experts, slots = a.num_tokens * a.top_k;
  FUSEDMOE_CHECK(a.x && a.sorted_slot && a.expert_offsets && a.topk_ids && a.w13 && a.w2 &&
                     a.inter_rows && a.y_rows && a.slot_row && a.workspace,
                 "sm90_experts: x, sorted_slot, expert_offsets, topk_ids, w13, w2, inter_rows, "
                 "y_rows, slot_row and workspace are required");
  FUSEDMOE_CHECK(H > 0 && H % 8 == 0, "sm90_experts: hidden must be a positive multiple of 8, got ",
                 H);
  FUSEDMOE_CHECK(I > 0 && I % 8 == 0, "sm90_experts: inter must be a positive multiple of 8, got ",
                 I);
  FUSEDMOE_CHECK(a.ldx % 8 == 0 && a.ldx >= H, "sm90_experts: ldx must be a multiple of 8 >= ", H,
                 ", got ", a.ldx);
  FUSEDMOE_CHECK(E >= 1 && a.top_k >= 1 && a.top_k <= kPermuteMaxK,
                 "sm90_experts: num_experts must be >= 1 and top_k in [1, ", kPermuteMaxK,
                 "], got ", E, " and ", a.top_k);
  FUSEDMOE_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
                 "sm90_experts: dtype must be bf16 or f16, got ", dtype_name(a.dtype));
  FUSEDMOE_CHECK(slots <= INT32_MAX, "sm90_experts: at most 2^31 - 1 routed rows, got ", slots);
  const bool interleaved = a.w13_layout == W13Layout::kInterleaved128;
  FUSEDMOE_CHECK(!interleaved || I % kW13Block == 0,
                 "sm90_experts: w13_layout kInterleaved128 needs inter a multiple of ", kW13Block,
                 ", got ", I);
  FUSEDMOE_CHECK(a.block_m == 1 || (a.block_m == kSm90ContigBlockM && a.dtype == DType::kBF16),
                 "sm90_experts: block_m must be 1, or ", kSm90ContigBlockM,
                 " with dtype bf16, got ", a.block_m, " with ", dtype_name(a.dtype));
  const bool contig = a.block_m == kSm90ContigBlockM;
  // The permuted input (bf16 / f16 [rows, H]) lives in y_rows until w2 writes it.
  auto* xs = reinterpret_cast<uint16_t*>(a.y_rows);
  GemmGluGemm g{a.dtype,
                xs,
                slots,
                routed_rows_per_expert(a.num_tokens, a.top_k, E),
                a.expert_offsets,
                E,
                a.topk_ids,
                a.sorted_slot,
                H,
                I,
                a.w13,
                interleaved,
                a.w13_bias,
                a.w2,
                a.act,
                a.inter_rows,
                a.y_rows,
                a.dtype == DType::kBF16,
                a.workspace,
                a.workspace_bytes};
  const bool epilogue = glu_in_epilogue(g);
  const size_t need = sm90_experts_workspace_bytes_for(slots, E, I, epilogue);
  if (contig) {
    g.max_rows = sm90_contig_max_rows(slots, E);
    // The table at the end of the workspace (sm90_experts_workspace_bytes_for's layout).
    g.tile_expert = reinterpret_cast<int32_t*>(static_cast<char*>(a.workspace) + need -
                                               tile_expert_bytes(slots, E));
  }
  FUSEDMOE_CHECK(a.workspace_bytes >= need, "sm90_experts: workspace of ", need,
                 " bytes needed, got ", a.workspace_bytes,
                 interleaved && !epilogue
                     ? " (the activation runs as its own pass, FUSEDMOE_CUDA_SM90_GLU=pass: "
                       "room for the w13 output rows is needed)"
                     : "");
  if (slots == 0) return;

  gemm_glu_gemm_prepare(g, stream);
  const int64_t blocks = static_cast<int64_t>(num_sms()) * 16;
  const int64_t T = a.num_tokens;
  launch_pdl(permute_tokens_kernel, static_cast<unsigned>(T < blocks ? T : blocks), kPermuteThreads,
             0, stream, a.x, a.ldx, a.topk_ids, a.slot_row, T, static_cast<int>(E),
             static_cast<int>(a.top_k), H, xs);

  gemm_glu_gemm(g, stream);
#else
  (void)a;
  (void)stream;
  FUSEDMOE_THROW(kUnsupported,
                 "sm90_experts: this build has no CUTLASS (scripts/install-deps.sh installs the "
                 "headers; FUSEDMOE_CUTLASS_DIR points CMake at them)");
#endif
}

size_t sm90_dense_expert_workspace_bytes(int64_t num_tokens, int64_t inter) {
  // expert_offsets {0, T} (256 bytes), then sm90_experts' layout for one expert.
  return 256 + sm90_experts_workspace_bytes(num_tokens, 1, inter);
}

void sm90_dense_expert(const Sm90DenseExpertArgs& a, Stream stream) {
#ifdef FUSEDMOE_WITH_CUTLASS
  const int64_t H = a.hidden, I = a.inter, T = a.num_tokens;
  FUSEDMOE_CHECK(a.x && a.w13 && a.w2 && a.inter_rows && a.out && a.workspace,
                 "sm90_dense_expert: x, w13, w2, inter_rows, out and workspace are required");
  FUSEDMOE_CHECK(H > 0 && H % 8 == 0,
                 "sm90_dense_expert: hidden must be a positive multiple of 8, got ", H);
  FUSEDMOE_CHECK(I > 0 && I % 8 == 0,
                 "sm90_dense_expert: inter must be a positive multiple of 8, got ", I);
  FUSEDMOE_CHECK(T >= 0 && T <= INT32_MAX,
                 "sm90_dense_expert: num_tokens must be in [0, 2^31), got ", T);
  FUSEDMOE_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
                 "sm90_dense_expert: dtype must be bf16 or f16, got ", dtype_name(a.dtype));
  const size_t need = sm90_dense_expert_workspace_bytes(T, I);
  FUSEDMOE_CHECK(a.workspace_bytes >= need, "sm90_dense_expert: workspace of ", need,
                 " bytes needed, got ", a.workspace_bytes);
  if (T == 0) return;
  auto* offsets = static_cast<int64_t*>(a.workspace);
  launch_pdl(dense_offsets_kernel, 1, 1, 0, stream, offsets, T);
  const GemmGluGemm g{a.dtype,
                      a.x,
                      T,
                      T,
                      offsets,
                      1,
                      nullptr,
                      nullptr,
                      H,
                      I,
                      a.w13,
                      false,
                      a.w13_bias,
                      a.w2,
                      a.act,
                      a.inter_rows,
                      a.out,
                      false,
                      static_cast<char*>(a.workspace) + 256,
                      a.workspace_bytes - 256};
  gemm_glu_gemm_prepare(g, stream);
  gemm_glu_gemm(g, stream);
#else
  (void)a;
  (void)stream;
  FUSEDMOE_THROW(kUnsupported,
                 "sm90_dense_expert: this build has no CUTLASS (scripts/install-deps.sh installs "
                 "the headers; FUSEDMOE_CUTLASS_DIR points CMake at them)");
#endif
}

}  // namespace fusedmoe::cuda
