// fusedmoe CUDA benchmark (run_cuda_bench; bench_cuda_moe and `fusedmoe bench
// --backend cuda` call it): routed experts (align -> w13 GEMM + SiLU-GLU ->
// w2 GEMM x topk_weights -> finalize) on layer shapes of Mixtral-8x7B,
// Qwen3-30B-A3B and DeepSeek-V3, bf16 weights and activations, uniform routing
// (or the routing simulator's zipf / all-to-one: CudaBenchOptions::routing).
//
// Inputs are counter-based (value = f(seed, index), see hash_uniform below) so
// that bench/cuda/torch_baseline.py regenerates the very same weights in
// PyTorch; routings (topk ids / weights) and hidden states are written to
// --dump-dir with a manifest, together with our output for routing 0, so the
// PyTorch baselines run on the same inputs and check our result.
//
// Timing: each routing's forward is captured in a CUDA graph; replays cycle
// through --routings different routings (so the touched experts' weights come
// from HBM, not L2), each replay timed with CUDA events; the median is
// reported. Floor = max(bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s), bytes = distinct
// experts touched (averaged over the routings) x expert bytes + activations.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/cuda/cuda_bench.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/kernels/cuda.h"
#include "fusedmoe/routing/router.h"
#include "kernels/cuda/routed_experts.h"

namespace fusedmoe::bench {

#define CK(expr)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

namespace {

// Counter-based uniform in [-scale/2, scale/2): lowbias32 mixing of the 64-bit
// index and a seed; every step is exact in f32 so PyTorch reproduces it.
__host__ __device__ inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
__host__ __device__ inline float hash_uniform(uint32_t seed, uint64_t i, float scale) {
  uint32_t x = mix32(static_cast<uint32_t>(i) ^ seed);
  x = mix32(x ^ static_cast<uint32_t>(i >> 32) * 0x9e3779b9u);
  return (static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f) * scale;
}

__global__ void fill_hash_bf16(uint16_t* p, uint64_t n, uint32_t seed, float scale) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const __nv_bfloat16 b = __float2bfloat16_rn(hash_uniform(seed, i, scale));
    p[i] = __bfloat16_as_ushort(b);
  }
}

struct Shape {
  const char* name;
  int64_t E, k, H, I;
};
const Shape kShapes[] = {
    {"mixtral", 8, 2, 4096, 14336},
    {"qwen3", 128, 8, 2048, 768},
    {"deepseek", 256, 8, 7168, 2048},
};

constexpr uint32_t kSeedW13 = 11, kSeedW2 = 12, kSeedX = 13;

// Each --dump-dir file is written in full or not at all; a failure throws
// Error(kIo) naming the file and the OS reason.
void write_file(const std::string& path, const void* data, size_t bytes) {
  AtomicFile f(path);
  f.write(data, bytes);
  f.commit();
}

}  // namespace

int run_cuda_bench(const CudaBenchOptions& o) {
  const std::string shapes_arg = o.shapes, dump_dir = o.dump_dir;
  const std::vector<int64_t> tokens = o.tokens;
  const int routings = o.routings, iters = o.iters;
  const bool sweep = o.sweep;
  if (tokens.empty() || routings < 1 || iters < 1) {
    std::fprintf(stderr, "cuda bench: need tokens, routings >= 1, iters >= 1\n");
    return 2;
  }
  // A benchmark asked to run that cannot run is an error (bench_cuda_moe exits
  // 1), as with `fusedmoe bench --backend cuda`.
  if (cuda::device_count() == 0) FUSEDMOE_THROW(kUnsupported, "no CUDA device found");
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device: %s, %d SMs, L2 %d MB; routing: %s\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, to_string(o.routing));
  std::string manifest = "{\"routings\": " + std::to_string(routings) + ", \"cases\": [\n";
  bool first_case = true;
  std::printf("| shape | T | tile | time us | TFLOP/s | GB/s | floor us | %% of floor |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  for (const Shape& s : kShapes) {
    if (shapes_arg.find(s.name) == std::string::npos) continue;
    const int64_t E = s.E, k = s.k, H = s.H, I = s.I;
    const int64_t Tmax = *std::max_element(tokens.begin(), tokens.end());
    // ---- weights and inputs (counter-based) ----
    uint16_t *w13, *w2, *x;
    CK(cudaMalloc(&w13, E * 2 * I * H * 2));
    CK(cudaMalloc(&w2, E * H * I * 2));
    CK(cudaMalloc(&x, Tmax * H * 2));
    fill_hash_bf16<<<4096, 256>>>(w13, E * 2 * I * H, kSeedW13, 2.0f / std::sqrt(float(H)));
    fill_hash_bf16<<<4096, 256>>>(w2, E * H * I, kSeedW2, 2.0f / std::sqrt(float(I)));
    fill_hash_bf16<<<4096, 256>>>(x, Tmax * H, kSeedX, 2.0f);
    CK(cudaGetLastError());
    const int64_t slots_max = Tmax * k;
    const int64_t padded_max = cuda::max_padded_rows(slots_max, E, 128);
    int32_t *ids, *sorted, *counts, *cursor, *chunk_counts, *gemm_counters;
    int64_t* offsets;
    float *wts, *y;
    uint16_t *inter, *out;
    CK(cudaMalloc(&ids, routings * slots_max * 4));
    CK(cudaMalloc(&wts, routings * slots_max * 4));
    CK(cudaMalloc(&sorted, padded_max * 4));
    CK(cudaMalloc(&counts, E * 4));
    CK(cudaMalloc(&cursor, E * 4));
    CK(cudaMalloc(&chunk_counts, cuda::align_chunk_counts_size(slots_max, E) * 4));
    CK(cudaMalloc(&gemm_counters, 2 * 4));  // the mma.sync GEMMs' work counters, as routed_experts
    CK(cudaMalloc(&offsets, (E + 1) * 8));
    CK(cudaMalloc(&inter, padded_max * I * 2));
    // y: f32 slot rows, or the contiguous sm90 GEMMs' bf16 rows padded to 64 an expert.
    CK(cudaMalloc(&y,
                  std::max(slots_max * H * 4, cuda::sm90_contig_max_rows(slots_max, E) * H * 2)));
    CK(cudaMalloc(&out, Tmax * H * 2));
    // The sm_90a wgmma + TMA path (sm90_experts), where this build and device have it.
    const bool have_sm90 = cuda::sm90_experts_available();
    int32_t* slot_row = nullptr;
    void* sm90_ws = nullptr;
    const size_t sm90_ws_bytes =
        have_sm90 ? cuda::sm90_experts_workspace_bytes(slots_max, E, I) : 0;
    if (have_sm90) {
      CK(cudaMalloc(&slot_row, slots_max * 4));
      CK(cudaMalloc(&sm90_ws, sm90_ws_bytes));
    }
    // w13 as the layer keeps it (the same weights, rows reordered: the PyTorch
    // baseline's standard-order copy computes the same products).
    const cuda::W13Layout w13_layout = cuda::pick_w13_layout(I);
    if (w13_layout == cuda::W13Layout::kInterleaved128) cuda::interleave_w13(w13, E, I, H, nullptr);

    for (int64_t T : tokens) {
      // ---- routings: k distinct experts per token, weights summing to 1 ----
      std::mt19937_64 rng(1000 + T);
      std::vector<int32_t> ids_h(routings * T * k);
      std::vector<float> w_h(routings * T * k);
      double touched = 0;
      for (int r = 0; r < routings; ++r) {
        std::set<int32_t> distinct;
        if (o.routing != SimulatedRouting::kUniform) {  // the simulator's ids, for all T
          MoEConfig sc;
          sc.num_experts = E;
          sc.top_k = k;
          sc.hidden_size = H;
          sc.intermediate_size = I;
          sc.routing_method = RoutingMethod::kSimulated;
          sc.simulated = o.routing;
          sc.simulation_seed = 1000 + static_cast<uint64_t>(T) * 131 + r;
          create_router(sc)->select_experts(
              TensorView(), TensorView(ids_h.data() + r * T * k, DType::kI32, {T, k}),
              TensorView(w_h.data() + r * T * k, DType::kF32, {T, k}));
        }
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int32_t> pick;
          if (o.routing != SimulatedRouting::kUniform)
            pick.assign(ids_h.begin() + (r * T + t) * k, ids_h.begin() + (r * T + t + 1) * k);
          while (static_cast<int64_t>(pick.size()) < k) {
            const int32_t e = static_cast<int32_t>(rng() % E);
            if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
          }
          float sum = 0;
          for (int64_t j = 0; j < k; ++j) {
            ids_h[(r * T + t) * k + j] = pick[j];
            distinct.insert(pick[j]);
            w_h[(r * T + t) * k + j] = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
            sum += w_h[(r * T + t) * k + j];
          }
          for (int64_t j = 0; j < k; ++j) w_h[(r * T + t) * k + j] /= sum;
        }
        touched += static_cast<double>(distinct.size()) / routings;
      }
      CK(cudaMemcpy(ids, ids_h.data(), ids_h.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(wts, w_h.data(), w_h.size() * 4, cudaMemcpyHostToDevice));

      const int64_t slots = T * k;
      const double exp_touched =
          static_cast<double>(E) * (1.0 - std::pow(1.0 - static_cast<double>(k) / E, T));
      const int64_t rows = static_cast<int64_t>(std::llround(slots / std::max(1.0, exp_touched)));
      const cuda::GemmTile picked = cuda::pick_gemm_tile(rows, slots, 2 * I, H);
      cuda::GemmTile tile = picked;
      const bool picked_sm90 = cuda::pick_sm90_experts(rows, slots, H, I);
      bool sm90 = picked_sm90;
      // The sm90 GEMMs' form (routed_experts' rule): contiguous over rows padded to 64.
      const bool contig = cuda::pick_sm90_contig(DType::kBF16, rows, slots, E, H, I);
      // The decode path (decode_experts: no align, two weight-streaming kernels)
      // where the layer takes it; FUSEDMOE_CUDA_DECODE=0 times the align + GEMV chain.
      const bool picked_decode = !picked_sm90 && cuda::pick_decode_experts(T, k, E, I);
      bool decode = picked_decode;
      auto enqueue = [&](int r) {
        cuda::FinalizeArgs f;  // output[t] = sum over t's slots of y (bf16 out)
        f.y = y;
        f.topk_ids = ids + r * slots;
        f.num_tokens = T;
        f.top_k = k;
        f.hidden = H;
        f.out = out;
        f.out_dtype = DType::kBF16;
        f.ldo = H;
        if (decode) {
          cuda::RoutedExpertsArgs d;
          d.x = x;
          d.topk_ids = ids + r * slots;
          d.topk_weights = wts + r * slots;
          d.num_tokens = T;
          d.top_k = k;
          d.num_experts = E;
          d.hidden = H;
          d.inter = I;
          d.w13 = w13;
          d.w13_layout = w13_layout;
          d.w2 = w2;
          d.out = out;  // T = 1: the sum is folded into the second kernel
          d.out_dtype = DType::kBF16;
          d.ldo = H;
          if (!cuda::decode_experts(d, inter, y, stream))
            cuda::finalize(f, stream);  // y rows by slot, already weighted
          return;
        }
        cuda::AlignArgs al;
        al.topk_ids = ids + r * slots;
        al.num_slots = slots;
        al.num_experts = E;
        al.block_m = sm90 ? (contig ? cuda::kSm90ContigBlockM : 1) : cuda::gemm_tile_block_m(tile);
        al.expert_offsets = offsets;
        al.sorted_slot = sorted;
        al.expert_counts = counts;
        al.expert_cursor = cursor;
        al.chunk_counts = chunk_counts;
        al.slot_row = sm90 ? slot_row : nullptr;
        if (!sm90) {
          al.zero_words = gemm_counters;
          al.num_zero_words = 2;
        }
        cuda::align(al, stream);
        if (sm90) {
          cuda::Sm90ExpertsArgs a;
          a.x = x;
          a.ldx = H;
          a.topk_ids = ids + r * slots;
          a.sorted_slot = sorted;
          a.expert_offsets = offsets;
          a.num_tokens = T;
          a.top_k = k;
          a.num_experts = E;
          a.hidden = H;
          a.inter = I;
          a.w13 = w13;
          a.w13_layout = w13_layout;
          a.w2 = w2;
          a.inter_rows = inter;
          a.y_rows = y;
          a.slot_row = slot_row;
          a.block_m = al.block_m;
          a.workspace = sm90_ws;
          a.workspace_bytes = sm90_ws_bytes;
          cuda::sm90_experts(a, stream);
          // y rows in expert order: finalize weights and sums them through slot_row
          f.y_dtype = DType::kBF16;  // sm90_experts' bf16 rows
          f.slot_row = slot_row;
          f.row_scale = wts + r * slots;
          cuda::finalize(f, stream);
          return;
        }
        cuda::GroupedGemmArgs g;
        g.epilogue = cuda::GemmEpilogue::kGlu;
        g.tile = tile;
        g.a = x;
        g.lda = H;
        g.gather = true;
        g.a_div = static_cast<int>(k);
        g.sorted_slot = sorted;
        g.expert_offsets = offsets;
        g.num_experts = E;
        g.m = slots;
        g.w = w13;
        g.w13_layout = w13_layout;
        g.n = 2 * I;
        g.k = H;
        g.out = inter;
        g.ldc = I;
        g.work_counter = gemm_counters;
        cuda::grouped_gemm(g, stream);
        cuda::GroupedGemmArgs g2 = g;
        g2.epilogue = cuda::GemmEpilogue::kScatter;
        g2.a = inter;
        g2.lda = I;
        g2.gather = false;
        g2.w = w2;
        g2.n = H;
        g2.k = I;
        g2.row_scale = wts + r * slots;
        g2.out = y;
        g2.ldc = H;
        g2.work_counter = gemm_counters + 1;
        cuda::grouped_gemm(g2, stream);
        cuda::finalize(f, stream);  // y rows by slot, already weighted
      };
      // Warm-up (sets kernel attributes outside capture), then one graph per routing.
      auto time_tile = [&](cuda::GemmTile t, bool use_sm90 = false, bool use_decode = false) {
        tile = t;
        sm90 = use_sm90;
        decode = use_decode;
        enqueue(0);
        CK(cudaStreamSynchronize(stream));
        std::vector<cudaGraphExec_t> execs(routings);
        for (int r = 0; r < routings; ++r) {
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          enqueue(r);
          CK(cudaStreamEndCapture(stream, &g));
          CK(cudaGraphInstantiate(&execs[r], g, 0));
          CK(cudaGraphDestroy(g));
        }
        for (int r = 0; r < routings; ++r) CK(cudaGraphLaunch(execs[r], stream));  // warm-up
        std::vector<cudaEvent_t> ev(2 * iters);
        for (auto& e : ev) CK(cudaEventCreate(&e));
        for (int i = 0; i < iters; ++i) {
          CK(cudaEventRecord(ev[2 * i], stream));
          CK(cudaGraphLaunch(execs[i % routings], stream));
          CK(cudaEventRecord(ev[2 * i + 1], stream));
        }
        CK(cudaStreamSynchronize(stream));
        std::vector<float> ms(iters);
        for (int i = 0; i < iters; ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
        for (auto& e : ev) CK(cudaEventDestroy(e));
        for (auto& e : execs) CK(cudaGraphExecDestroy(e));
        std::sort(ms.begin(), ms.end());
        return ms[iters / 2] * 1e3;
      };
      std::string sweep_text;
      if (sweep) {
        for (int ti = 0; ti < cuda::kNumGemmTiles; ++ti) {
          const auto t = static_cast<cuda::GemmTile>(ti);
          char b2[64];
          std::snprintf(b2, sizeof b2, " %s %.1f", cuda::gemm_tile_name(t), time_tile(t));
          sweep_text += b2;
        }
      }
      if ((sweep || o.sweep_sm90) && have_sm90) {
        char b2[64];
        if (!sweep) {
          std::snprintf(b2, sizeof b2, " mma:%s %.1f", cuda::gemm_tile_name(picked),
                        time_tile(picked));
          sweep_text += b2;
        }
        std::snprintf(b2, sizeof b2, " sm90 %.1f", time_tile(picked, true));
        sweep_text += b2;
      }
      if ((sweep || o.sweep_sm90) && picked_decode) {
        char b2[64];
        std::snprintf(b2, sizeof b2, " %s %.1f", cuda::gemm_tile_name(picked), time_tile(picked));
        sweep_text += b2;
      }
      const double us = time_tile(picked, picked_sm90, picked_decode);
      sm90 = picked_sm90;
      decode = picked_decode;
      if (!dump_dir.empty()) {
        const std::string base = dump_dir + "/" + s.name + "_T" + std::to_string(T);
        std::vector<uint16_t> out_h(T * H);
        enqueue(0);
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(out_h.data(), out, T * H * 2, cudaMemcpyDeviceToHost));
        write_file(base + "_ids.bin", ids_h.data(), ids_h.size() * 4);
        write_file(base + "_weights.bin", w_h.data(), w_h.size() * 4);
        write_file(base + "_out0.bin", out_h.data(), out_h.size() * 2);
      }
      const double flops = 2.0 * slots * 3.0 * H * I;
      const double bytes = touched * 3.0 * H * I * 2 + 2.0 * T * H * 2;
      const double floor_us = std::max(bytes / 4.8e12, flops / 790e12) * 1e6;
      const std::string tname_s = picked_sm90     ? (contig ? "sm90c" : "sm90")
                                  : picked_decode ? "decode"
                                                  : cuda::gemm_tile_name(picked);
      const char* tname = tname_s.c_str();
      std::printf("| %s | %lld | %s | %.1f | %.1f | %.0f | %.1f | %.0f%% |%s\n", s.name,
                  static_cast<long long>(T), tname, us, flops / us * 1e-6, bytes / us * 1e-3,
                  floor_us, 100.0 * floor_us / us, sweep_text.c_str());
      std::fflush(stdout);
      char buf[512];
      std::snprintf(buf, sizeof buf,
                    "%s{\"shape\": \"%s\", \"E\": %lld, \"k\": %lld, \"H\": %lld, \"I\": %lld, "
                    "\"T\": %lld, \"us\": %.3f, \"floor_us\": %.3f, \"touched\": %.2f, "
                    "\"tile\": \"%s\"}",
                    first_case ? "" : ",\n", s.name, (long long)E, (long long)k, (long long)H,
                    (long long)I, (long long)T, us, floor_us, touched, tname);
      manifest += buf;
      first_case = false;
    }
    for (void* p : {(void*)w13, (void*)w2, (void*)x, (void*)ids, (void*)wts, (void*)sorted,
                    (void*)counts, (void*)cursor, (void*)chunk_counts, (void*)offsets, (void*)inter,
                    (void*)y, (void*)out, (void*)slot_row, sm90_ws, (void*)gemm_counters})
      CK(cudaFree(p));
  }
  manifest += "\n], \"seeds\": {\"w13\": 11, \"w2\": 12, \"x\": 13}}\n";
  if (!dump_dir.empty()) write_file(dump_dir + "/manifest.json", manifest.data(), manifest.size());
  return 0;
}

}  // namespace fusedmoe::bench
