// bench_cuda_layer: the whole MoE layer on the CUDA backend through the public
// MoERunner API — router GEMM + routing + routed experts + shared expert —
// for the Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 layer shapes
// (../shared/perf-targets.md), plus the routing kernel and the router GEMM alone.
//
// Per T: the forward captured in one CUDA graph (replayed; median of CUDA-event
// timed replays), the same forward launched eagerly (launch overhead = eager -
// graph), and the routed part alone (same layer without the shared expert,
// router logits given, so no gate GEMM) to check the target "full layer within
// 10 % of the routed experts plus the shared expert's own floor". Floor =
// max(bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s) with bytes = the distinct experts
// this routing touched x expert bytes + gate + shared expert + activations in
// and out (bf16), FLOPs = 2 T k 3 H I + 2 T 3 H I_shared + 2 T H E.
// Weights are bf16 with random values; the router is the real one (its gate
// weights are random, so routing is near uniform, not exactly uniform).
//
// Usage: bench_cuda_layer [--shapes mixtral,qwen3,deepseek] [--tokens 1,16,...] [--iters 30]
//                         [--routing-only]
// --routing-only: the routing kernel alone, no layer weights: the --tokens
// given (default 4096), for Qwen3 (softmax top-8 of 128), softmax top-8 of
// 256 and DeepSeek-V3 (grouped top-8 of 256 with bias).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/kernels/cuda.h"
#include "fusedmoe/runner/moe_runner.h"

namespace {

using namespace fusedmoe;

constexpr double kPeakBytesPerS = 4.8e12, kPeakFlops = 790e12;

#define CK(expr)                                                                           \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) FUSEDMOE_THROW(kInternal, #expr, ": ", cudaGetErrorString(e_)); \
  } while (0)

struct Shape {
  std::string name;
  MoEConfig config;
};

std::vector<Shape> all_shapes() {
  std::vector<Shape> v;
  MoEConfig m;
  m.num_experts = 8, m.top_k = 2, m.hidden_size = 4096, m.intermediate_size = 14336;
  m.renormalize = true;
  v.push_back({"mixtral", m});
  MoEConfig q;
  q.num_experts = 128, q.top_k = 8, q.hidden_size = 2048, q.intermediate_size = 768;
  q.renormalize = true;
  v.push_back({"qwen3", q});
  MoEConfig d;
  d.num_experts = 256, d.top_k = 8, d.hidden_size = 7168, d.intermediate_size = 2048;
  d.routing_method = RoutingMethod::kGroupedTopK;
  d.scoring_func = ScoringFunc::kSigmoid;
  d.num_expert_group = 8;
  d.topk_group = 4;
  d.group_score = GroupScore::kSumTop2;
  d.has_e_score_correction_bias = true;
  d.renormalize = true;
  d.routed_scaling_factor = 2.5f;
  d.shared_intermediate_size = 2048;
  v.push_back({"deepseek", d});
  return v;
}

// A bf16 tensor of random values: one random block of 1M values tiled over it
// (the values do not change the timing; generating 22 GB of distinct random
// numbers would dominate the run), filled by several threads.
Tensor random_bf16(std::initializer_list<int64_t> shape, float scale, uint64_t seed) {
  Tensor t = Tensor::empty(DType::kBF16, shape);
  constexpr size_t kBlock = size_t{1} << 20;
  std::vector<uint16_t> block(kBlock);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (auto& b : block) b = f32_to_bf16(u(rng));
  const size_t n = static_cast<size_t>(t.numel());
  auto* p = static_cast<uint16_t*>(t.data());
  const unsigned nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < nt; ++w)
    threads.emplace_back([&, w] {
      const size_t begin = n * w / nt, end = n * (w + 1) / nt;
      for (size_t i = begin; i < end;) {
        const size_t off = (i + seed) % kBlock, len = std::min(end - i, kBlock - off);
        std::memcpy(p + i, block.data() + off, len * 2);
        i += len;
      }
    });
  for (auto& th : threads) th.join();
  return t;
}

MoELayerWeights make_weights(const MoEConfig& c) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size;
  MoELayerWeights w;
  w.gate_weight = random_bf16({c.num_router_logits(), H}, 1.0f / std::sqrt(float(H)), 1);
  if (c.has_e_score_correction_bias) {
    Tensor b = Tensor::empty(DType::kF32, {E});
    std::mt19937_64 rng(7);
    for (int64_t e = 0; e < E; ++e) b.data_as<float>()[e] = 0.01f * float(rng() % 100) / 100.0f;
    w.router_params.e_score_correction_bias = b;
  }
  w.experts.w13 = random_bf16({E, 2 * I, H}, 2.0f / std::sqrt(float(H)), 2);
  w.experts.w2 = random_bf16({E, H, I}, 2.0f / std::sqrt(float(I)), 3);
  if (c.has_shared_expert()) {
    const int64_t S = c.shared_intermediate_size;
    ExpertWeights s;
    s.w13 = random_bf16({1, 2 * S, H}, 2.0f / std::sqrt(float(H)), 4);
    s.w2 = random_bf16({1, H, S}, 2.0f / std::sqrt(float(S)), 5);
    w.shared_experts = s;
  }
  return w;
}

// Device buffer freed at scope exit.
struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time (us) of `iters` calls of `fn` (after 3 warm-up calls), each timed
// with events on `s`.
template <typename Fn>
double time_eager(Fn&& fn, cudaStream_t s, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> ts;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, s));
    fn();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ts);
}

// The same for replays of a captured graph.
double time_graph(cudaGraphExec_t exec, cudaStream_t s, int iters) {
  return time_eager([&] { CK(cudaGraphLaunch(exec, s)); }, s, iters);
}

template <typename Fn>
cudaGraphExec_t capture(Fn&& fn, cudaStream_t s) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  fn();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&exec, g, 0));
  cudaGraphDestroy(g);
  return exec;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

void run_shape(const Shape& sh, const std::vector<int64_t>& tokens, int iters, cudaStream_t s) {
  const MoEConfig& c = sh.config;
  const int64_t E = c.num_experts, k = c.top_k, H = c.hidden_size, I = c.intermediate_size;
  const int64_t S = c.shared_intermediate_size, L = c.num_router_logits();
  const int64_t Tmax = *std::max_element(tokens.begin(), tokens.end());
  const MoELayerWeights w = make_weights(c);
  RunnerOptions o;
  o.compute_dtype = DType::kBF16;
  o.device = Device{DeviceType::kCUDA, 0};
  o.max_num_tokens = Tmax;
  o.cuda_stream = s;
  MoERunner full(c, w, o);
  // The routed part alone: no shared expert, router logits given.
  MoEConfig rc = c;
  rc.shared_intermediate_size = 0;
  MoELayerWeights rw = w;
  rw.shared_experts.reset();
  MoERunner routed(rc, rw, o);

  const Device dev{DeviceType::kCUDA, 0};
  Dev x(size_t(Tmax) * H * 2), out(size_t(Tmax) * H * 2), logits(size_t(Tmax) * L * 4),
      ids(size_t(Tmax) * k * 4), wts(size_t(Tmax) * k * 4);
  {
    const Tensor xh = random_bf16({Tmax, H}, 2.0f, 11);
    CK(cudaMemcpy(x.p, xh.data(), xh.nbytes(), cudaMemcpyHostToDevice));
  }
  const double expert_bytes = 3.0 * H * I * 2;
  for (int64_t T : tokens) {
    const TensorView xv(x.p, DType::kBF16, {T, H}, dev), ov(out.p, DType::kBF16, {T, H}, dev);
    const TensorView lv(logits.p, DType::kF32, {T, L}, dev);
    ForwardOutputs fo{lv, TensorView(ids.p, DType::kI32, {T, k}, dev),
                      TensorView(wts.p, DType::kF32, {T, k}, dev)};
    full.forward(xv, ov, nullptr, nullptr, &fo);  // also leaves the logits for `routed`
    CK(cudaStreamSynchronize(s));
    full.check_errors();
    std::vector<int32_t> idh(size_t(T * k));
    CK(cudaMemcpy(idh.data(), ids.p, idh.size() * 4, cudaMemcpyDeviceToHost));
    const std::set<int32_t> touched(idh.begin(), idh.end());
    const double distinct = static_cast<double>(touched.size() - touched.count(-1));

    cudaGraphExec_t g_full = capture([&] { full.forward(xv, ov); }, s);
    const double t_full = time_graph(g_full, s, iters);
    cudaGraphExecDestroy(g_full);
    const double t_eager = time_eager([&] { full.forward(xv, ov); }, s, iters);
    routed.forward(xv, ov, &lv);  // warm-up before the capture
    CK(cudaStreamSynchronize(s));
    cudaGraphExec_t g_routed = capture([&] { routed.forward(xv, ov, &lv); }, s);
    const double t_routed = time_graph(g_routed, s, iters);
    cudaGraphExecDestroy(g_routed);

    const double bytes =
        distinct * expert_bytes + double(L) * H * 2 + 3.0 * H * S * 2 + 2.0 * double(T) * H * 2;
    const double flops = 2.0 * T * k * 3 * H * I + 2.0 * T * 3 * H * S + 2.0 * T * H * E;
    const double floor_us = std::max(bytes / kPeakBytesPerS, flops / kPeakFlops) * 1e6;
    const double shared_floor_us =
        S ? std::max(3.0 * H * S * 2 / kPeakBytesPerS, 2.0 * T * 3 * H * S / kPeakFlops) * 1e6
          : 0.0;
    const double target_us = 1.1 * (t_routed + shared_floor_us);
    std::printf(
        "| %s | %lld | %.0f | %.1f | %.1f | %.1f | %.1f | %.0f | %.1f | %.0f%% | %.1f | %.1f | "
        "%s |\n",
        sh.name.c_str(), static_cast<long long>(T), distinct, t_full, t_eager, t_eager - t_full,
        flops / (t_full * 1e-6) / 1e12, bytes / (t_full * 1e-6) / 1e9, floor_us,
        100.0 * floor_us / t_full, t_routed, shared_floor_us,
        t_full <= target_us ? "met" : "missed");
    std::fflush(stdout);
  }
}

// The routing kernel alone at T tokens (100 launches in one graph).
void run_routing(const Shape& sh, int64_t T, cudaStream_t s) {
  const MoEConfig& c = sh.config;
  const int64_t L = c.num_router_logits(), k = c.top_k;
  std::vector<float> lh(size_t(T * L));
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (auto& v : lh) v = nd(rng);
  std::vector<float> bh(static_cast<size_t>(L));
  for (auto& v : bh) v = 0.01f * nd(rng);
  Dev logits(lh.size() * 4), bias(bh.size() * 4), ids(size_t(T * k) * 4), w(size_t(T * k) * 4);
  CK(cudaMemcpy(logits.p, lh.data(), lh.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bias.p, bh.data(), bh.size() * 4, cudaMemcpyHostToDevice));
  cuda::RouteArgs a;
  a.router_logits = static_cast<float*>(logits.p);
  a.logits_ld = L;
  a.bias = static_cast<float*>(bias.p);
  a.topk_ids = static_cast<int32_t*>(ids.p);
  a.topk_weights = static_cast<float*>(w.p);
  constexpr int kLaunches = 100;
  cudaGraphExec_t g = capture(
      [&] {
        for (int i = 0; i < kLaunches; ++i) cuda::route(c, a, T, s);
      },
      s);
  const double us = time_graph(g, s, 10) / kLaunches;
  cudaGraphExecDestroy(g);
  std::printf("| %s | %lld | %lld | %.2f |\n", sh.name.c_str(), static_cast<long long>(T),
              static_cast<long long>(c.num_experts), us);
}

// The router GEMM alone at T tokens: bf16 x and bf16 gate (real checkpoints),
// f32 logits; 20 launches in one graph.
void run_router_gemm(const Shape& sh, int64_t T, cudaStream_t s) {
  const MoEConfig& c = sh.config;
  const int64_t L = c.num_router_logits(), H = c.hidden_size;
  const Tensor xh = random_bf16({T, H}, 2.0f, 13), wh = random_bf16({L, H}, 0.02f, 14);
  Dev x(xh.nbytes()), w(wh.nbytes()), out(size_t(T) * L * 4);
  CK(cudaMemcpy(x.p, xh.data(), xh.nbytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w.p, wh.data(), wh.nbytes(), cudaMemcpyHostToDevice));
  constexpr int kLaunches = 20;
  auto once = [&] {
    cuda::router_gemm(x.p, DType::kBF16, H, T, H, w.p, DType::kBF16, L, nullptr,
                      static_cast<float*>(out.p), L, s);
  };
  once();
  CK(cudaStreamSynchronize(s));
  cudaGraphExec_t g = capture(
      [&] {
        for (int i = 0; i < kLaunches; ++i) once();
      },
      s);
  const double us = time_graph(g, s, 10) / kLaunches;
  cudaGraphExecDestroy(g);
  std::printf("| %s | %lld | %lld | %lld | %.1f | %.0f |\n", sh.name.c_str(),
              static_cast<long long>(T), static_cast<long long>(L), static_cast<long long>(H), us,
              2.0 * T * L * H / (us * 1e-6) / 1e12);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string shapes = "mixtral,qwen3,deepseek", toks = "1,16,64,128,256,1024,4096";
    int iters = 30;
    bool routing_only = false, toks_given = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--routing-only")
        routing_only = true;
      else if (a == "--shapes" && i + 1 < argc)
        shapes = argv[++i];
      else if (a == "--tokens" && i + 1 < argc)
        toks = argv[++i], toks_given = true;
      else if (a == "--iters" && i + 1 < argc)
        iters = std::max(1, std::atoi(argv[++i]));
      else {
        std::fprintf(
            stderr,
            "usage: bench_cuda_layer [--shapes mixtral,qwen3,deepseek] [--tokens 1,16,...] "
            "[--iters 30] [--routing-only]\n");
        return 2;
      }
    }
    // A benchmark asked to run that cannot run is an error (exit 1), as with
    // `fusedmoe bench --backend cuda`.
    if (cuda::device_count() == 0) FUSEDMOE_THROW(kUnsupported, "no CUDA device found");
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("# device: %s, %d SMs\n\n", prop.name, prop.multiProcessorCount);
    const std::vector<int64_t> tokens = parse_list(toks);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (routing_only) {
      std::printf(
          "## Routing kernel alone (router logits given; 100 launches in one graph)\n\n"
          "| shape | T | E | us per launch |\n|---|---|---|---|\n");
      std::vector<Shape> rs;
      for (const Shape& sh : all_shapes())
        if (sh.name != "mixtral") rs.push_back(sh);
      Shape s256 = rs.front();  // Qwen3's softmax top-8 (renormalized) over 256 experts
      s256.name = "softmax-e256";
      s256.config.num_experts = 256;
      rs.insert(rs.begin() + 1, s256);
      for (const Shape& sh : rs)
        for (int64_t T : toks_given ? tokens : std::vector<int64_t>{4096}) run_routing(sh, T, s);
      cudaStreamDestroy(s);
      return 0;
    }
    std::printf(
        "## Full layer (router GEMM + routing + routed experts + shared expert), bf16 in/out\n\n"
        "| shape | T | experts touched | graph us | eager us | launch overhead us | TFLOP/s | "
        "GB/s | floor us | %% of floor | routed only us | shared floor us | full <= 1.1 x "
        "(routed + shared floor) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::set<std::string> want;
    {
      std::stringstream ss(shapes);
      std::string item;
      while (std::getline(ss, item, ',')) want.insert(item);
    }
    for (const Shape& sh : all_shapes())
      if (want.count(sh.name)) run_shape(sh, tokens, iters, s);
    std::printf(
        "\n## Routing kernel alone (router logits given; 100 launches in one graph)\n\n"
        "| shape | T | E | us per launch |\n|---|---|---|---|\n");
    for (const Shape& sh : all_shapes())
      if (sh.name != "mixtral") run_routing(sh, 4096, s);
    std::printf(
        "\n## Router GEMM alone (bf16 x, bf16 gate, f32 logits; 20 launches in one graph)\n\n"
        "| shape | T | logits | H | us per launch | TFLOP/s |\n|---|---|---|---|---|---|\n");
    for (const Shape& sh : all_shapes())
      if (want.count(sh.name))
        for (int64_t T : tokens) run_router_gemm(sh, T, s);
    cudaStreamDestroy(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_layer: error: %s\n", e.what());
    return 1;
  }
}
