// fusedmoe: CPU Experts — per expert, w13 GEMM -> gated activation -> w2 GEMM.
//
// Work is split into (expert, block of rows, block of weight rows) items so
// that both decode (one row per expert: memory bound, parallel over weight
// rows) and prefill (many rows: compute bound) keep every thread busy. Items
// are claimed from an atomic counter; each writes its own part of the output,
// so the result does not depend on which thread ran what.
#include <algorithm>
#include <atomic>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/workspace_slots.h"

namespace fusedmoe::cpu {

namespace {

constexpr int64_t kRowBlock = 128;  // routed rows per work item
constexpr int64_t kW13Block = 32;   // intermediate columns per w13 item (2 x 32 w13 rows)
constexpr int64_t kW2Block = 64;    // hidden columns (w2 rows) per w2 item

struct WorkItem {
  int32_t expert;
  int32_t row0;  // first row within the expert
  int32_t rows;  // rows of the item (<= kRowBlock)
  int32_t col0;  // first column block start (intermediate or hidden index)
};

// Lists (expert, row block, column block) items over non-empty experts. An
// expert's rows, in units of `unit` rows (1, or the AMX path's 16-row tiles; the
// last unit may be partial), go into ceil(units / (kRowBlock / unit)) blocks of
// near-equal size, so that no block is a short remainder.
int64_t build_items(const int64_t* offsets, int64_t E, int64_t cols, int64_t col_block,
                    WorkItem* items, int64_t unit = 1) {
  const int64_t units_per_block = kRowBlock / unit;
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e], units = (rows + unit - 1) / unit;
    const int64_t blocks = (units + units_per_block - 1) / units_per_block;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = units * b / blocks * unit,
                    r1 = std::min(rows, units * (b + 1) / blocks * unit);
      for (int64_t c0 = 0; c0 < cols; c0 += col_block)
        items[n++] = {static_cast<int32_t>(e), static_cast<int32_t>(r0),
                      static_cast<int32_t>(r1 - r0), static_cast<int32_t>(c0)};
    }
  }
  return n;
}

// Runs fn(item, next_item, thread_index) for every item on the pool, items
// claimed dynamically, one ahead: next_item is the item this thread runs next
// (-1 if none), so fn can have its weights prefetched.
template <typename Fn>
void run_items(ThreadPool& pool, int64_t n, Fn&& fn) {
  std::atomic<int64_t> next{0};
  pool.parallel_for(
      std::min<int64_t>(n, pool.num_threads()),
      [&](int64_t, int64_t, int tid) {
        int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        while (i < n) {
          const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
          fn(i, j < n ? j : -1, tid);
          i = j;
        }
      },
      1);
}

#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
static_assert(kRowBlock % 16 == 0, "AMX row blocks are made of whole 16-row tiles");
static_assert(kW13Block % 32 == 0, "a w13 item's activations fill whole 32-wide AMX k blocks");

// bf16 weights with bf16 compute on a CPU with AMX (gemm_amx.h): X and the
// activations are packed into AMX tiles once per expert row tile (16 rows), so
// that every GEMM of the layer reads them in place. The same work items as
// below, with row blocks made of whole 16-row tiles.
void apply_amx(ThreadPool& tp, const float* X, int64_t ldx, int64_t H, int64_t E, int64_t I,
               const int64_t* offsets, const uint16_t* w13, const uint16_t* w2, const char* b13,
               DType b13t, const char* b2, DType b2t, const ActivationParams& activation, float* o,
               int64_t ldo, Workspace& ws) {
  constexpr int64_t kTileRows = 16, kBlockTiles = kRowBlock / kTileRows;
  const int64_t kb_h = (H + 31) / 32, kb_i = (I + 31) / 32;
  // First row tile of each expert.
  auto* tile0 = static_cast<int64_t*>(
      ws.get(kWsAmxTiles, "the experts' first AMX row tiles", {E + 1}, sizeof(int64_t)));
  tile0[0] = 0;
  for (int64_t e = 0; e < E; ++e)
    tile0[e + 1] = tile0[e] + (offsets[e + 1] - offsets[e] + kTileRows - 1) / kTileRows;
  const int64_t tiles = tile0[E];
  auto* xp = static_cast<uint16_t*>(
      ws.get(kWsAmxX, "the routed rows packed for AMX, bf16", {tiles, kb_h * kAmxBlock}, 2));
  auto* ap = static_cast<uint16_t*>(
      ws.get(kWsAmxAct, "the activations packed for AMX, bf16", {tiles, kb_i * kAmxBlock}, 2));
  // Work items: (expert, row block of whole tiles, column block).
  const int64_t max_items =
      (tiles / kBlockTiles + E + 1) *
      std::max((I + kW13Block - 1) / kW13Block, (H + kW2Block - 1) / kW2Block);
  auto* items = static_cast<WorkItem*>(
      ws.get(kWsWorkItems, "the GEMM work items", {max_items}, sizeof(WorkItem)));
  const int threads = tp.num_threads();
  const int64_t per_thread = kRowBlock * (2 * kW13Block + kW13Block);  // gate | up, then act
  auto* scratch = static_cast<float*>(
      ws.get(kWsThreadScratch, threads * per_thread * sizeof(float), "the threads' GEMM blocks"));

  // Phase 0: pack X, split over the row tiles (not the experts: one expert may
  // hold them all).
  tp.parallel_for(
      tiles,
      [&](int64_t t0, int64_t t1, int) {
        int64_t e = std::upper_bound(tile0, tile0 + E + 1, t0) - tile0 - 1;
        for (int64_t t = t0; t < t1; ++t) {
          while (tile0[e + 1] <= t) ++e;
          const int64_t r0 = (t - tile0[e]) * kTileRows;
          amx_pack_rows(X + (offsets[e] + r0) * ldx, ldx,
                        std::min(kTileRows, offsets[e + 1] - offsets[e] - r0), H,
                        xp + t * kb_h * kAmxBlock);
        }
      },
      4);

  // Phase 1: act = act_fn(X . w13[gate]^T, X . w13[up]^T), bf16, packed.
  const size_t b13sz = dtype_size(b13t), b2sz = dtype_size(b2t);
  int64_t n = build_items(offsets, E, I, kW13Block, items, kTileRows);
  run_items(tp, n, [&](int64_t i, int64_t, int tid) {
    const WorkItem it = items[i];
    const int64_t e = it.expert, rows = it.rows, i0 = it.col0;
    const int64_t nb = std::min(kW13Block, I - i0), t = tile0[e] + it.row0 / kTileRows;
    float* gu = scratch + tid * per_thread;     // [rows, 2 * kW13Block]: gate | up
    float* a = gu + kRowBlock * 2 * kW13Block;  // [rows, kW13Block]
    const uint16_t* wg = w13 + (e * 2 * I + i0) * H;
    const char* be = b13 ? b13 + e * 2 * I * b13sz : nullptr;
    const uint16_t* x = xp + t * kb_h * kAmxBlock;
    amx_gemm_packed(x, rows, nb, H, wg, H, be ? be + i0 * b13sz : nullptr, b13t == DType::kBF16, gu,
                    2 * kW13Block);
    amx_gemm_packed(x, rows, nb, H, wg + I * H, H, be ? be + (I + i0) * b13sz : nullptr,
                    b13t == DType::kBF16, gu + kW13Block, 2 * kW13Block);
    activation_rows(activation, gu, gu + kW13Block, 2 * kW13Block, a, kW13Block, rows, nb, true);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows)
      amx_pack_rows(a + r0 * kW13Block, kW13Block, std::min(kTileRows, rows - r0), nb,
                    ap + ((t + r0 / kTileRows) * kb_i + i0 / 32) * kAmxBlock);
  });

  // Phase 2: out[rows, h0:h1] = act[rows] . w2[h0:h1]^T (+ bias).
  n = build_items(offsets, E, H, kW2Block, items, kTileRows);
  run_items(tp, n, [&](int64_t i, int64_t, int) {
    const WorkItem it = items[i];
    const int64_t e = it.expert, h0 = it.col0, hb = std::min(kW2Block, H - h0);
    const int64_t t = tile0[e] + it.row0 / kTileRows;
    amx_gemm_packed(ap + t * kb_i * kAmxBlock, it.rows, hb, I, w2 + (e * H + h0) * I, I,
                    b2 ? b2 + (e * H + h0) * b2sz : nullptr, b2t == DType::kBF16,
                    o + (offsets[e] + it.row0) * ldo + h0, ldo);
  });
}
#endif

}  // namespace

void CpuExperts::apply(const PrepareResult& prepared, const ExpertWeights& weights,
                       const ExpertsParams& params, const TensorView& out, Workspace& ws) {
  const TensorView& X = prepared.permuted;
  const int64_t M = X.size(0);
  if (M == 0) return;
  const int64_t H = X.size(1), ldx = X.stride(0);
  const int64_t E = weights.num_experts(), I = weights.intermediate_size();
  const int64_t ldo = out.stride(0);
  const int64_t* offsets = prepared.expert_offsets.data_as<const int64_t>();
  const bool round_bf16 = params.compute_dtype == DType::kBF16;

  const DType wdt = weights.w13.dtype();
  const size_t wsz = dtype_size(wdt);
  const char* w13 = static_cast<const char*>(weights.w13.data());
  const char* w2 = static_cast<const char*>(weights.w2.data());
  const char* b13 = weights.w13_bias ? static_cast<const char*>(weights.w13_bias->data()) : nullptr;
  const char* b2 = weights.w2_bias ? static_cast<const char*>(weights.w2_bias->data()) : nullptr;
  const DType b13t = weights.w13_bias ? weights.w13_bias->dtype() : DType::kF32;
  const DType b2t = weights.w2_bias ? weights.w2_bias->dtype() : DType::kF32;
  const size_t b13sz = dtype_size(b13t), b2sz = dtype_size(b2t);

  ThreadPool& tp = pool();
#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
  if (wdt == DType::kBF16 && round_bf16 && amx_ready()) {
    apply_amx(tp, X.data_as<const float>(), ldx, H, E, I, offsets,
              static_cast<const uint16_t*>(weights.w13.data()),
              static_cast<const uint16_t*>(weights.w2.data()), b13, b13t, b2, b2t,
              params.activation, out.data_as<float>(), ldo, ws);
    return;
  }
#endif
  const int threads = tp.num_threads();
  // Per thread: a [kRowBlock, 2 * kW13Block] gate/up block (stays in L1/L2).
  const size_t per_thread = kRowBlock * 2 * kW13Block;
  auto* scratch = static_cast<float*>(
      ws.get(kWsThreadScratch, threads * per_thread * sizeof(float), "the threads' GEMM blocks"));
  auto* act = static_cast<float*>(
      ws.get(kWsIntermediate, "the intermediate activations, f32 [M, I]", {M, I}, 4));
  const int64_t max_items = (M / kRowBlock + E + 1) * std::max((I + kW13Block - 1) / kW13Block,
                                                               (H + kW2Block - 1) / kW2Block);
  auto* items = static_cast<WorkItem*>(
      ws.get(kWsWorkItems, "the GEMM work items", {max_items}, sizeof(WorkItem)));

  // Phase 1: act[rows, i0:i1] = act_fn(X . w13[gate rows i0:i1]^T, X . w13[up rows]^T).
  int64_t n = build_items(offsets, E, I, kW13Block, items);
  // Gate rows of item i (its up rows start I rows later).
  const auto gate_rows = [&](int64_t i) {
    return w13 + (items[i].expert * 2 * I + items[i].col0) * H * wsz;
  };
  run_items(tp, n, [&](int64_t i, int64_t next_i, int tid) {
    const WorkItem it = items[i];
    const int64_t e = it.expert, row = offsets[e] + it.row0;
    const int64_t rows = it.rows;
    const int64_t i0 = it.col0, nb = std::min(kW13Block, I - i0);
    float* gu = scratch + tid * per_thread;  // [rows, 2 * kW13Block]: gate | up
    const float* x = X.data_as<const float>() + row * ldx;
    const char* wg = gate_rows(i);
    const char* be = b13 ? b13 + e * 2 * I * b13sz : nullptr;
    const int64_t row_bytes = H * static_cast<int64_t>(wsz);
    const GemmPrefetch up_next{wg + I * row_bytes, nb, row_bytes, row_bytes};
    const GemmPrefetch item_next{next_i >= 0 ? gate_rows(next_i) : nullptr,
                                 next_i >= 0 ? std::min(kW13Block, I - items[next_i].col0) : 0,
                                 row_bytes, row_bytes};
    gemm_nt(rows, nb, H, x, ldx, wg, wdt, H, be ? be + i0 * b13sz : nullptr, b13t, gu,
            2 * kW13Block, &up_next);
    gemm_nt(rows, nb, H, x, ldx, wg + I * row_bytes, wdt, H, be ? be + (I + i0) * b13sz : nullptr,
            b13t, gu + kW13Block, 2 * kW13Block, next_i >= 0 ? &item_next : nullptr);
    activation_rows(params.activation, gu, gu + kW13Block, 2 * kW13Block, act + row * I + i0, I,
                    rows, nb, round_bf16);
  });

  // Phase 2: out[rows, h0:h1] = act[rows] . w2[h0:h1]^T (+ bias).
  n = build_items(offsets, E, H, kW2Block, items);
  float* o = out.data_as<float>();
  run_items(tp, n, [&](int64_t i, int64_t next_i, int) {
    const WorkItem it = items[i];
    const int64_t e = it.expert, row = offsets[e] + it.row0;
    const int64_t rows = it.rows;
    const int64_t h0 = it.col0, hb = std::min(kW2Block, H - h0);
    const char* we = w2 + (e * H + h0) * I * wsz;
    const char* be = b2 ? b2 + (e * H + h0) * b2sz : nullptr;
    const int64_t row_bytes = I * static_cast<int64_t>(wsz);
    GemmPrefetch pf;
    if (next_i >= 0)
      pf = {w2 + (items[next_i].expert * H + items[next_i].col0) * row_bytes,
            std::min(kW2Block, H - items[next_i].col0), row_bytes, row_bytes};
    gemm_nt(rows, hb, I, act + row * I, I, we, wdt, I, be, b2t, o + row * ldo + h0, ldo,
            next_i >= 0 ? &pf : nullptr);
  });
}

}  // namespace fusedmoe::cpu
