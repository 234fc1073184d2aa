// fusedmoe benchmark helpers: see bench_common.h.
#include "cli/bench_common.h"

#include <cblas.h>
#include <immintrin.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "fusedmoe/core/error.h"
#include "fusedmoe/routing/router.h"
#include "kernels/cpu/gemm_amx.h"

namespace fusedmoe::bench {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Runs fn(thread_index) on `threads` threads started together; returns wall seconds.
template <typename F>
double run_on_threads(int threads, F&& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      fn(t);
    });
  while (ready.load() != threads - 1) {
  }
  const auto t0 = clock_type::now();
  go.store(true, std::memory_order_release);
  fn(0);
  for (auto& th : pool) th.join();
  return seconds_since(t0);
}

constexpr int kChains = 12;  // independent FMA chains: > latency x ports on current cores

#if defined(__AVX512F__)
constexpr int kLanes = 16;
// (not _mm512_reduce_add_ps: GCC 12's version warns about an uninitialised temporary)
float hsum512(__m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0;
  for (float x : t) s += x;
  return s;
}
float fma_kernel(int64_t iters, float seed) {
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(seed + 0.01f * j);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  __m512 s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return hsum512(s);
}
// Sums n floats reading kStreams interleaved sequential streams (more memory
// parallelism than one stream; measured ~25 % more bandwidth than one).
constexpr size_t kStreams = 8;
float sum_kernel(const float* p, size_t n) {
  __m512 acc[kStreams];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const size_t per = n / kStreams / 64 * 64;
  for (size_t i = 0; i < per; i += 64)
    for (size_t s = 0; s < kStreams; ++s) {
      const float* q = p + s * per + i;
      const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(q), _mm512_load_ps(q + 16)),
                                     _mm512_add_ps(_mm512_load_ps(q + 32), _mm512_load_ps(q + 48)));
      acc[s] = _mm512_add_ps(acc[s], v);
    }
  for (size_t s = 1; s < kStreams; ++s) acc[0] = _mm512_add_ps(acc[0], acc[s]);
  float sum = hsum512(acc[0]);
  for (size_t i = per * kStreams; i < n; ++i) sum += p[i];
  return sum;
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
float hsum256(__m256 v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
float fma_kernel(int64_t iters, float seed) {
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(seed + 0.01f * j);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  __m256 s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm256_add_ps(s, acc[j]);
  return hsum256(s);
}
constexpr size_t kStreams = 8;  // see the AVX-512 version
float sum_kernel(const float* p, size_t n) {
  __m256 acc[kStreams];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const size_t per = n / kStreams / 32 * 32;
  for (size_t i = 0; i < per; i += 32)
    for (size_t s = 0; s < kStreams; ++s) {
      const float* q = p + s * per + i;
      const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(q), _mm256_load_ps(q + 8)),
                                     _mm256_add_ps(_mm256_load_ps(q + 16), _mm256_load_ps(q + 24)));
      acc[s] = _mm256_add_ps(acc[s], v);
    }
  for (size_t s = 1; s < kStreams; ++s) acc[0] = _mm256_add_ps(acc[0], acc[s]);
  float sum = hsum256(acc[0]);
  for (size_t i = per * kStreams; i < n; ++i) sum += p[i];
  return sum;
}
#else
constexpr int kLanes = 1;
float fma_kernel(int64_t iters, float seed) {
  float acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = seed + 0.01f * j;
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = std::fma(acc[j], 0.999999f, 1e-6f);
  float s = 0;
  for (float a : acc) s += a;
  return s;
}
float sum_kernel(const float* p, size_t n) {
  float a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  float s = 0;
  for (float v : a) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif

volatile float g_sink = 0;

// SplitMix64: a fast, well-mixed generator for synthetic weights.
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
};

// Fills `t` (f32 or bf16, contiguous) with uniform(-scale, scale), in parallel.
void fill_uniform(Tensor& t, float scale, uint64_t seed) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t n = t.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  ThreadPool::global().parallel_for(chunks, [&](int64_t b, int64_t e, int) {
    std::vector<float> buf(kChunk);
    for (int64_t c = b; c < e; ++c) {
      SplitMix64 rng{seed ^ (0x632be59bd9b4e019ull * static_cast<uint64_t>(c + 1))};
      const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
      for (int64_t i = 0; i < len; ++i) buf[i] = (2.0f * rng.uniform() - 1.0f) * scale;
      if (t.dtype() == DType::kF32)
        std::memcpy(t.data_as<float>() + begin, buf.data(), len * sizeof(float));
      else
        convert_from_f32(buf.data(), static_cast<char*>(t.data()) + begin * dtype_size(t.dtype()),
                         t.dtype(), static_cast<size_t>(len));
    }
  });
}

}  // namespace

void use_best_openblas_kernel(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr ||
      std::getenv("FUSEDMOE_OPENBLAS_REEXEC") != nullptr)
    return;
  __builtin_cpu_init();
  const char* target = nullptr;
  std::vector<std::string> good;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    target = "SkylakeX";
    good = {"skylakex", "cooperlake", "sapphirerapids"};
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    target = "Haswell";
    good = {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"};
  }
  if (target == nullptr) return;
  std::string core = openblas_get_corename();
  std::string lower = core;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (std::find(good.begin(), good.end(), lower) != good.end()) return;
  ::setenv("OPENBLAS_CORETYPE", target, 1);
  ::setenv("FUSEDMOE_OPENBLAS_REEXEC", core.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  // execv failed: carry on with the kernel OpenBLAS chose.
  ::unsetenv("OPENBLAS_CORETYPE");
}

std::string openblas_kernel_description() {
  std::string s = openblas_get_corename();
  if (const char* detected = std::getenv("FUSEDMOE_OPENBLAS_REEXEC"))
    s += std::string(" (OPENBLAS_CORETYPE set by fusedmoe: OpenBLAS itself picked ") + detected +
         " on this CPU)";
  else if (std::getenv("OPENBLAS_CORETYPE") != nullptr)
    s += " (OPENBLAS_CORETYPE from the environment)";
  return s;
}

const char* simd_isa() {
#if defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#else
  return "scalar";
#endif
}

size_t last_level_cache_bytes() {
  size_t best = 0;
  for (int i = 0; i < 16; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    if (!f) break;
    std::string v;
    f >> v;
    size_t n = 0, pos = 0;
    while (pos < v.size() && std::isdigit(static_cast<unsigned char>(v[pos])))
      n = n * 10 + static_cast<size_t>(v[pos++] - '0');
    const char unit = pos < v.size() ? v[pos] : ' ';
    n *= unit == 'K'   ? size_t{1} << 10
         : unit == 'M' ? size_t{1} << 20
         : unit == 'G' ? size_t{1} << 30
                       : 1;
    best = std::max(best, n);
  }
  return best;
}

// The best of 3 trials of kernel(iters, t) (t: the thread index; returns a
// value kept from the optimiser) on `threads` threads, in GFLOP/s, with iters
// calibrated on one thread to ~0.02 s, times `scale`.
template <typename Kernel>
double best_gflops(int threads, int64_t iters, int scale, double flops_per_iter, Kernel kernel) {
  threads = std::clamp(threads, 1, usable_cpus());
  for (;;) {
    const auto t0 = clock_type::now();
    g_sink = g_sink + kernel(iters, 0);
    if (seconds_since(t0) > 0.02 || iters > (int64_t{1} << 34)) break;
    iters *= 2;
  }
  iters *= scale;
  double best = 0;
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<float> out(threads);
    const double s = run_on_threads(threads, [&](int t) { out[t] = kernel(iters, t); });
    for (float v : out) g_sink = g_sink + v;
    best = std::max(best, flops_per_iter * static_cast<double>(iters) * threads / s * 1e-9);
  }
  return best;
}

double measure_peak_fma_gflops(int threads) {
  // ~0.15 s a trial on one thread.
  return best_gflops(threads, int64_t{1} << 20, 6, 2.0 * kLanes * kChains,
                     [](int64_t iters, int t) { return fma_kernel(iters, 1.0f + t); });
}

double measure_peak_amx_gflops(int threads) {
#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
  if (!cpu::amx_ready()) return 0.0;
  // 4 TDPBF16PS an iteration, 16 x 16 x 32 products each.
  return best_gflops(threads, int64_t{1} << 14, 3, 4.0 * 16 * 16 * 32 * 2,
                     [](int64_t iters, int) { return cpu::amx_peak_kernel(iters); });
#else
  (void)threads;
  return 0.0;
#endif
}

double measure_read_gbps(int threads, size_t bytes) {
  threads = std::clamp(threads, 1, usable_cpus());
  const size_t n = bytes / sizeof(float);
  Tensor buf = Tensor::empty(DType::kF32, {static_cast<int64_t>(n)});
  float* p = buf.data_as<float>();
  const size_t per = (n / threads) & ~size_t{63};
  auto slice = [&](int t, size_t& b, size_t& e) {
    b = per * t;
    e = t == threads - 1 ? n : b + per;
  };
  run_on_threads(threads, [&](int t) {  // first touch by the thread that reads it
    size_t b, e;
    slice(t, b, e);
    for (size_t i = b; i < e; ++i) p[i] = 1.0f;
  });
  double best = 0;
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<float> out(threads);
    const double s = run_on_threads(threads, [&](int t) {
      size_t b, e;
      slice(t, b, e);
      out[t] = sum_kernel(p + b, e - b);
    });
    for (float v : out) g_sink = g_sink + v;
    best = std::max(best, static_cast<double>(n * sizeof(float)) / s * 1e-9);
  }
  return best;
}

Ceilings measure_ceilings(int threads) {
  Ceilings c;
  c.threads = threads;
  c.measured_threads = std::clamp(threads, 1, usable_cpus());
  c.isa = simd_isa();
  c.peak_gflops = measure_peak_fma_gflops(threads);
  c.amx_gflops = measure_peak_amx_gflops(threads);
  c.read_gbps = measure_read_gbps(threads);
  return c;
}

std::vector<LayerShape> standard_shapes() {
  return {
      {"mixtral", "Mixtral-8x7B", 8, 2, 4096, 14336, ""},
      {"qwen3", "Qwen3-30B-A3B", 128, 8, 2048, 768, ""},
      {"deepseek", "DeepSeek-V3 routed", 256, 8, 7168, 2048, ""},
      {"qwen3-cpu", "Qwen3-30B-A3B-like CPU target", 64, 8, 2048, 768, ""},
  };
}

LayerShape find_shape(const std::string& name) {
  std::string known;
  for (const auto& s : standard_shapes()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  FUSEDMOE_THROW(kInvalidArgument, "--shapes: expected one of ", known, ", got \"", name, "\"");
}

LayerShape cap_experts(const LayerShape& requested, int64_t max_experts) {
  LayerShape shape = requested;
  FUSEDMOE_CHECK(max_experts <= 0 || max_experts >= shape.k, "--max-experts: expected at least ",
                 shape.k, " (top_k of shape '", shape.name, "'), got ", max_experts);
  if (max_experts > 0 && shape.E > max_experts) {
    shape.E = max_experts;
    shape.note = "E capped " + std::to_string(requested.E) + " -> " + std::to_string(shape.E) +
                 " by --max-experts";
  }
  return shape;
}

size_t layer_bytes(const LayerShape& s, DType dtype, bool with_baseline) {
  size_t per = expert_bytes(s, dtype);
  if (with_baseline && dtype != DType::kF32) per += expert_bytes(s, DType::kF32);
  return per * static_cast<size_t>(s.E);
}

size_t token_bytes(const LayerShape& s, bool with_baseline) {
  const size_t H = static_cast<size_t>(s.H), I = static_cast<size_t>(s.I),
               k = static_cast<size_t>(s.k), f = sizeof(float);
  size_t b = batch_token_bytes(s) + k * routed_row_bytes(s.H, s.I);  // + the kernel's routed rows
  // The baseline: reference output, gathered input and output rows [H],
  // gate/up [2I], activation [I], and its slot list (i64).
  if (with_baseline) b += H * f + (2 * H + 3 * I) * f + k * 8;
  return b;
}

size_t batch_token_bytes(const LayerShape& s) {
  const size_t H = static_cast<size_t>(s.H), k = static_cast<size_t>(s.k), f = sizeof(float);
  // The batches: hidden states, topk ids (i32) and weights (f32); the output.
  return static_cast<size_t>(kBatchRotation) * (H * f + 2 * k * 4) + H * f;
}

size_t routed_row_bytes(int64_t H_, int64_t I_) {
  const size_t H = static_cast<size_t>(H_), I = static_cast<size_t>(I_), f = sizeof(float);
  // Permuted input and expert output [H] each, activation [I], source row and
  // slot maps (i32), and the work items (12 bytes for each 128 rows of each 32
  // activation / 64 output columns).
  const size_t items = 12 * std::max((I + 31) / 32, (H + 63) / 64) / 128 + 1;
  return 2 * H * f + I * f + 2 * 4 + items;
}

size_t rank_token_bytes(int64_t H_, int64_t I_local, int64_t k_, int64_t E_local, int groups) {
  const size_t H = static_cast<size_t>(H_), k = static_cast<size_t>(k_), f = sizeof(float);
  const size_t row = routed_row_bytes(H_, I_local);
  if (groups <= 1) return k * (row + 4);  // routed rows, local ids
  const size_t g = static_cast<size_t>(groups);
  const size_t m = static_cast<size_t>(std::min(k_, E_local));  // routed rows a received token
  const size_t record = H * f + 8 * k;                          // f32 payload, ids, weights
  // Received: the record, its hidden states, ids and weights, a row index;
  // its routed rows and the combine rows they send back.
  const size_t received = record + H * f + 8 * k + 8 + m * (row + H * f);
  // Sent: a record to each destination rank, the destination / row maps, the
  // slot-to-row map, and the combine rows that come back (one per slot).
  const size_t sent = std::min(k, g) * record + 12 * k + 4 + 4 * k + k * H * f;
  return g * received + sent;
}

int64_t most_tokens_within(size_t budget, size_t fixed, size_t per_token) {
  if (fixed >= budget) return 0;
  return static_cast<int64_t>(std::min<size_t>((budget - fixed) / std::max<size_t>(per_token, 1),
                                               static_cast<size_t>(INT64_MAX)));
}

LayerShape fit_to_memory(LayerShape s, DType dtype, bool with_baseline, size_t budget_bytes,
                         int64_t max_tokens) {
  const size_t need_weights = layer_bytes(s, dtype, with_baseline);
  const size_t per = need_weights / static_cast<size_t>(s.E);
  // Fewer experts than top_k cannot run: a layer that does not fit even then
  // is an error, not a run over the budget.
  const size_t least = per * static_cast<size_t>(s.k);
  if (least > budget_bytes) {
    char gib[96];
    std::snprintf(gib, sizeof gib, "%.2f GiB needed, budget %.2f GiB",
                  static_cast<double>(least) / (1 << 30),
                  static_cast<double>(budget_bytes) / (1 << 30));
    FUSEDMOE_THROW(kInvalidArgument, "--memory-fraction: shape '", s.name, "' needs ", least,
                   " bytes even at its fewest experts (E = top_k = ", s.k,
                   ", the least --max-experts takes), over the budget of ", budget_bytes,
                   " bytes (", gib, "); give a larger --memory-fraction");
  }
  // The tokens' buffers beside the weights at E = k: compared by division, so
  // that no count of tokens overflows.
  const size_t per_token = token_bytes(s, with_baseline);
  const int64_t most_tokens = most_tokens_within(budget_bytes, least, per_token);
  if (max_tokens > most_tokens) {
    char sizes[160];
    std::snprintf(sizes, sizeof sizes, "%.1f KiB a token", static_cast<double>(per_token) / 1024);
    char gib[96];
    std::snprintf(gib, sizeof gib, "%.2f GiB of weights at its fewest experts",
                  static_cast<double>(least) / (1 << 30));
    char budget[64];
    std::snprintf(budget, sizeof budget, "%.2f GiB", static_cast<double>(budget_bytes) / (1 << 30));
    FUSEDMOE_THROW(kInvalidArgument, "--tokens: expected at most ", most_tokens,
                   " for this machine's memory, got ", max_tokens, " (shape '", s.name, "' takes ",
                   sizes, " for its activations, intermediates and outputs",
                   with_baseline ? " and the baseline's" : "", ", beside ", gib,
                   " (E = top_k = ", s.k, "), within the --memory-fraction budget of ", budget,
                   "); give fewer --tokens or a larger --memory-fraction");
  }
  const size_t tokens = per_token * static_cast<size_t>(std::max<int64_t>(max_tokens, 0));
  const size_t need = need_weights + tokens;
  if (need <= budget_bytes) return s;
  int64_t e = static_cast<int64_t>((budget_bytes - tokens) / per);  // >= k (checked above)
  if (e >= 8) e = std::max(e - e % 8, s.k);
  char buf[256];
  if (tokens == 0)
    std::snprintf(
        buf, sizeof buf, "E scaled %lld -> %lld to fit memory (%.1f GiB needed, budget %.1f GiB)",
        static_cast<long long>(s.E), static_cast<long long>(e),
        static_cast<double>(need) / (1 << 30), static_cast<double>(budget_bytes) / (1 << 30));
  else
    std::snprintf(buf, sizeof buf,
                  "E scaled %lld -> %lld to fit memory (%.1f GiB needed: weights %.1f GiB, "
                  "buffers of T = %lld %.1f GiB; budget %.1f GiB)",
                  static_cast<long long>(s.E), static_cast<long long>(e),
                  static_cast<double>(need) / (1 << 30),
                  static_cast<double>(need_weights) / (1 << 30), static_cast<long long>(max_tokens),
                  static_cast<double>(tokens) / (1 << 30),
                  static_cast<double>(budget_bytes) / (1 << 30));
  s.E = e;
  s.note = s.note.empty() ? std::string(buf) : s.note + "; " + buf;
  return s;
}

namespace {
// The first number of a one-line file, or 0 (missing, "max", not a number).
size_t read_bytes_file(const std::string& path) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return 0;
  return static_cast<size_t>(std::strtoull(text.c_str(), nullptr, 10));
}
}  // namespace

CgroupMemory cgroup_memory(const std::string& root) {
  CgroupMemory m;
  m.limit = read_bytes_file(root + "/memory.max");  // v2
  m.usage = read_bytes_file(root + "/memory.current");
  if (m.limit == 0) {  // v1
    m.limit = read_bytes_file(root + "/memory/memory.limit_in_bytes");
    m.usage = read_bytes_file(root + "/memory/memory.usage_in_bytes");
    if (m.limit >= (size_t{1} << 62)) m.limit = 0;  // "unlimited"
  }
  if (m.limit == 0) m.usage = 0;
  return m;
}

namespace {
size_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page)
                               : size_t{8} << 30;
}
}  // namespace

size_t physical_memory_bytes() {
  const CgroupMemory cg = cgroup_memory();
  const size_t machine = machine_memory_bytes();
  return cg.limit > 0 ? std::min(machine, cg.limit) : machine;
}

size_t available_memory_bytes() {
  // Under a limit: what the cgroup has left (never more than the limit itself).
  const CgroupMemory cg = cgroup_memory();
  const size_t machine = machine_memory_bytes();
  const size_t cap =
      cg.limit > 0 ? std::min(machine, cg.limit > cg.usage ? cg.limit - cg.usage : 0) : machine;
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1)
      return std::min<size_t>(cap, static_cast<size_t>(kib) * 1024);
  }
  return cap;
}

SyntheticLayer make_synthetic_layer(const LayerShape& shape, DType dtype, uint64_t seed,
                                    bool baseline_weights) {
  FUSEDMOE_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "dtype: expected f32 or bf16, got ",
                 dtype_name(dtype));
  SyntheticLayer l;
  l.shape = shape;
  l.dtype = dtype;
  const int64_t E = shape.E, H = shape.H, I = shape.I;
  l.weights.w13 = Tensor::empty(dtype, {E, 2 * I, H});
  l.weights.w2 = Tensor::empty(dtype, {E, H, I});
  fill_uniform(l.weights.w13, 1.0f / std::sqrt(static_cast<float>(H)), seed * 2 + 1);
  fill_uniform(l.weights.w2, 1.0f / std::sqrt(static_cast<float>(I)), seed * 2 + 2);
  if (baseline_weights) {
    if (dtype == DType::kF32) {
      l.w13_f32 = l.weights.w13;
      l.w2_f32 = l.weights.w2;
    } else {
      l.w13_f32 = to_f32(l.weights.w13);
      l.w2_f32 = to_f32(l.weights.w2);
    }
  }
  return l;
}

RoutedBatch make_routed_batch(const LayerShape& shape, int64_t T, SimulatedRouting routing,
                              uint64_t seed) {
  RoutedBatch b;
  b.hidden_states = Tensor::empty(DType::kF32, {T, shape.H});
  // Uniform with variance 1 (sqrt(3) * U(-1, 1)): N(0, 1)-like magnitudes, never zero.
  fill_uniform(b.hidden_states, std::sqrt(3.0f), seed ^ 0x5bd1e995ull);
  b.topk_ids = Tensor::empty(DType::kI32, {T, shape.k});
  b.topk_weights = Tensor::empty(DType::kF32, {T, shape.k});
  MoEConfig cfg;
  cfg.num_experts = shape.E;
  cfg.top_k = shape.k;
  cfg.hidden_size = shape.H;
  cfg.intermediate_size = shape.I;
  cfg.routing_method = RoutingMethod::kSimulated;
  cfg.simulated = routing;
  cfg.simulation_seed = seed;
  cfg.renormalize = true;
  const auto router = create_router(cfg);
  router->select_experts(TensorView(), b.topk_ids, b.topk_weights);
  std::vector<char> seen(static_cast<size_t>(shape.E), 0);
  const int32_t* ids = b.topk_ids.data_as<int32_t>();
  for (int64_t i = 0; i < T * shape.k; ++i)
    if (ids[i] >= 0 && ids[i] < shape.E) seen[ids[i]] = 1;
  b.distinct_experts = std::count(seen.begin(), seen.end(), 1);
  return b;
}

std::vector<RoutedBatch> make_routed_batches(const LayerShape& shape, int64_t T,
                                             SimulatedRouting routing, uint64_t seed, int count) {
  std::vector<RoutedBatch> batches;
  for (int i = 0; i < count; ++i)
    batches.push_back(
        make_routed_batch(shape, T, routing, seed * 1000003u + static_cast<uint64_t>(i)));
  return batches;
}

double mean_distinct_experts(const std::vector<RoutedBatch>& batches) {
  double sum = 0;
  for (const auto& b : batches) sum += static_cast<double>(b.distinct_experts);
  return batches.empty() ? 0.0 : sum / static_cast<double>(batches.size());
}

// ---- fusedmoe's kernel -------------------------------------------------------------

FusedMoECpu::FusedMoECpu(const SyntheticLayer& layer, DType compute_dtype, ThreadPool* pool)
    : layer_(layer), kernel_(make_cpu_modular_kernel(pool)) {
  params_.activation = ActivationParams{};  // SiLU-GLU
  params_.compute_dtype = compute_dtype;
}
FusedMoECpu::~FusedMoECpu() = default;

void FusedMoECpu::forward(const RoutedBatch& batch, const TensorView& output) {
  kernel_->forward(batch.hidden_states, batch.topk_ids, batch.topk_weights, layer_.weights, params_,
                   /*apply_router_weight_on_input=*/false, output, ws_);
}

// ---- the BLAS-per-expert baseline -----------------------------------------------------

BlasPerExpertBaseline::BlasPerExpertBaseline(const SyntheticLayer& layer, ThreadPool* pool)
    : layer_(layer), pool_(pool ? pool : &ThreadPool::global()) {
#ifdef FUSEDMOE_OPENBLAS
  // The pool's threads call sgemm at once, one OpenBLAS thread each (a threaded
  // OpenBLAS locks its buffers for concurrent callers; see CMakeLists.txt).
  openblas_set_num_threads(1);
#endif
  FUSEDMOE_CHECK(layer.w13_f32.defined() && layer.w2_f32.defined(),
                 "BlasPerExpertBaseline: the layer was made without baseline weights");
}

// C [M, N] = A [M, K] . B [N, K]^T, split over the threads along N.
void BlasPerExpertBaseline::gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, const float* B,
                                    float* C) {
  const int threads = pool_->num_threads();
  int64_t grain = (N + threads - 1) / threads;
  grain = (grain + 15) / 16 * 16;
  pool_->parallel_for(
      N,
      [&](int64_t b, int64_t e, int) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M),
                    static_cast<int>(e - b), static_cast<int>(K), 1.0f, A, static_cast<int>(K),
                    B + b * K, static_cast<int>(K), 0.0f, C + b, static_cast<int>(N));
      },
      grain);
}

void BlasPerExpertBaseline::forward(const RoutedBatch& batch, const TensorView& output) {
  const int64_t E = layer_.shape.E, H = layer_.shape.H, I = layer_.shape.I, k = layer_.shape.k;
  const int64_t T = batch.hidden_states.size(0);
  check_tensor(output, "output", DType::kF32, {T, H});
  const float* x = batch.hidden_states.data_as<float>();
  const int32_t* ids = batch.topk_ids.data_as<int32_t>();
  const float* w = batch.topk_weights.data_as<float>();
  float* out = output.data_as<float>();
  std::fill(out, out + T * H, 0.0f);

  // Slots of each expert (counting sort).
  count_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0) ++count_[ids[i] + 1];
  offset_ = count_;
  for (int64_t e = 0; e < E; ++e) offset_[e + 1] += offset_[e];
  slot_.resize(static_cast<size_t>(T * k));
  std::vector<int64_t> pos(offset_.begin(), offset_.end() - 1);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0) slot_[pos[ids[i]]++] = i;

  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) max_rows = std::max(max_rows, offset_[e + 1] - offset_[e]);
  xe_.resize(static_cast<size_t>(max_rows * H));
  h13_.resize(static_cast<size_t>(max_rows * 2 * I));
  a_.resize(static_cast<size_t>(max_rows * I));
  y_.resize(static_cast<size_t>(max_rows * H));

  const float* w13 = layer_.w13_f32.data_as<float>();
  const float* w2 = layer_.w2_f32.data_as<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offset_[e], n = offset_[e + 1] - begin;
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(&xe_[r * H], x + (slot_[begin + r] / k) * H, H * sizeof(float));
    gemm_nt(n, 2 * I, H, xe_.data(), w13 + e * 2 * I * H, h13_.data());
    apply_activation(act_, h13_.data(), 2 * I, a_.data(), I, n, I);
    gemm_nt(n, H, I, a_.data(), w2 + e * H * I, y_.data());
    for (int64_t r = 0; r < n; ++r) {
      const int64_t s = slot_[begin + r];
      float* o = out + (s / k) * H;
      const float ws = w[s];
      const float* y = &y_[r * H];
      for (int64_t h = 0; h < H; ++h) o[h] += ws * y[h];
    }
  }
}

// ---- measurement ---------------------------------------------------------------------------

Roofline layer_roofline(const LayerShape& s, int64_t T, double distinct_experts, DType weight_dtype,
                        const Ceilings& c) {
  Roofline r;
  r.flops = 2.0 * static_cast<double>(T) * s.k * 3.0 * s.H * s.I;
  r.bytes =
      static_cast<double>(distinct_experts) * static_cast<double>(expert_bytes(s, weight_dtype)) +
      2.0 * static_cast<double>(T) * s.H * 4.0;
  const double mem_s = c.read_gbps > 0 ? r.bytes / (c.read_gbps * 1e9) : 0.0;
  r.peak_gflops = c.peak_for(weight_dtype);
  const double flop_s = r.peak_gflops > 0 ? r.flops / (r.peak_gflops * 1e9) : 0.0;
  r.floor_s = std::max(mem_s, flop_s);
  r.memory_bound = mem_s >= flop_s;
  return r;
}

RooflineShare roofline_share(const Roofline& r, double seconds, const Ceilings& c) {
  RooflineShare share;
  if (!(seconds > 0)) return share;
  const double gbps = r.bytes / seconds * 1e-9, gflops = r.flops / seconds * 1e-9;
  share.raised = gbps > c.read_gbps || gflops > r.peak_gflops;
  const double bw = std::max(c.read_gbps, gbps), peak = std::max(r.peak_gflops, gflops);
  const double mem_s = bw > 0 ? r.bytes / (bw * 1e9) : 0.0;
  const double flop_s = peak > 0 ? r.flops / (peak * 1e9) : 0.0;
  share.frac = std::min(1.0, std::max(mem_s, flop_s) / seconds);  // 1 + rounding at most
  return share;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {
// Both norms in f64, each over its values divided by the largest magnitude
// (1 at most, so their squares neither overflow nor vanish): a reference of
// 1e200 or 1e-200 gets its true ratio, not inf / inf or x / 0.
template <typename B>
double scaled_rel_l2(const float* a, const B* b, size_t n) {
  double max_d = 0, max_b = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    if (!std::isfinite(d)) return std::isnan(d) ? d : std::numeric_limits<double>::infinity();
    max_d = std::max(max_d, std::fabs(d));
    max_b = std::max(max_b, std::fabs(static_cast<double>(b[i])));
  }
  if (max_b == 0) return max_d == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  if (max_d == 0) return 0.0;
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = (static_cast<double>(a[i]) - static_cast<double>(b[i])) / max_d;
    const double r = static_cast<double>(b[i]) / max_b;
    num += d * d;
    den += r * r;
  }
  return max_d / max_b * std::sqrt(num / den);
}
}  // namespace

double rel_l2(const float* a, const float* b, size_t n) {
  return scaled_rel_l2(a, b, n);
}
double rel_l2(const float* a, const double* b, size_t n) {
  return scaled_rel_l2(a, b, n);
}

size_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0)
      return static_cast<size_t>(std::stoull(line.substr(6))) * 1024;
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<size_t>(ru.ru_maxrss) * 1024;
}

bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  return static_cast<bool>(f.flush());
}

}  // namespace fusedmoe::bench
