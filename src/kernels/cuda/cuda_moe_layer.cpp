// fusedmoe CUDA: CudaMoELayer — device weights, workspace, forward orchestration.
#include "kernels/cuda/cuda_moe_layer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fusedmoe/core/dtype.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/routed_experts.h"
#include "routing/simulated_routing.h"

namespace fusedmoe::cuda {
namespace {

// Owning device allocation.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) FUSEDMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceMemory() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceMemory(DeviceMemory&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Host tensor (f32, bf16 or f16) -> device, as `half` (kBF16 or kF16): a
// tensor of that type is copied, others converted in chunks (round to nearest
// even, via f32, which holds bf16 / f16 values exactly). A finite value beyond
// the f16 range (65504) is an error naming the tensor, not a silent inf.
DeviceMemory upload_half(const Tensor& t, DType half, const char* name) {
  const int64_t n = t.numel();
  DeviceMemory d(static_cast<size_t>(n) * 2);
  if (t.dtype() == half) {
    FUSEDMOE_CUDA_CHECK(cudaMemcpy(d.get(), t.data(), d.bytes(), cudaMemcpyHostToDevice));
    return d;
  }
  FUSEDMOE_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16 || t.dtype() == DType::kF16,
                 "upload: expected f32, bf16 or f16 weights, got ", t.view().str());
  auto load = [&](int64_t i) {
    switch (t.dtype()) {
      case DType::kBF16:
        return bf16_to_f32(t.data_as<const uint16_t>()[i]);
      case DType::kF16:
        return f16_to_f32(t.data_as<const uint16_t>()[i]);
      default:
        return t.data_as<const float>()[i];
    }
  };
  constexpr int64_t kChunk = int64_t{1} << 22;
  std::vector<uint16_t> buf(static_cast<size_t>(std::min(n, kChunk)));
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    for (int64_t j = 0; j < m; ++j) {
      const float v = load(i + j);
      if (half == DType::kF16 && std::isfinite(v) && std::abs(v) > 65504.0f)
        FUSEDMOE_THROW(kInvalidArgument, name, ": value ", v, " at element ", i + j,
                       " is beyond the f16 range (65504); run these experts in bf16 "
                       "(compute_dtype bf16)");
      buf[j] = half == DType::kF16 ? f32_to_f16(v) : f32_to_bf16(v);
    }
    FUSEDMOE_CUDA_CHECK(
        cudaMemcpy(d.as<uint16_t>() + i, buf.data(), m * 2, cudaMemcpyHostToDevice));
  }
  return d;
}

// Host tensor (f32/bf16/any floating) -> device f32.
DeviceMemory upload_f32(const Tensor& t) {
  const Tensor f = to_f32(t.view());
  DeviceMemory d(f.nbytes());
  FUSEDMOE_CUDA_CHECK(cudaMemcpy(d.get(), f.data(), f.nbytes(), cudaMemcpyHostToDevice));
  return d;
}

DeviceMemory upload_raw(const Tensor& t) {
  const Tensor c = Tensor::copy_of(t.view());
  DeviceMemory d(c.nbytes());
  FUSEDMOE_CUDA_CHECK(cudaMemcpy(d.get(), c.data(), c.nbytes(), cudaMemcpyHostToDevice));
  return d;
}

// The router gate on the device: bf16 when that loses nothing (a bf16
// checkpoint, or f32 values that are all bf16 numbers, e.g. a bf16 checkpoint
// loaded as f32), so that router_gemm can take the tensor cores for bf16
// activations; f32 otherwise (e.g. f32 HF fixtures). *dtype says which.
DeviceMemory upload_gate(const Tensor& gate, DType* dtype) {
  if (gate.dtype() == DType::kBF16) {
    *dtype = DType::kBF16;
    return upload_raw(gate);
  }
  const Tensor f = to_f32(gate.view());
  const float* v = f.data_as<const float>();
  const int64_t n = f.numel();
  bool exact = true;
  for (int64_t i = 0; i < n && exact; ++i) {
    const float r = round_to_bf16(v[i]);
    exact = std::memcmp(&r, &v[i], sizeof r) == 0;
  }
  *dtype = exact ? DType::kBF16 : DType::kF32;
  return exact ? upload_half(f, DType::kBF16, "gate_weight") : upload_f32(f);
}

struct DeviceExperts {
  DeviceMemory w13, w2, w13_bias, w2_bias;
  int64_t num_experts = 0, inter = 0;
  void upload(const ExpertWeights& w, DType half, const char* w13_name, const char* w2_name) {
    num_experts = w.num_experts();
    inter = w.intermediate_size();
    w13 = upload_half(w.w13, half, w13_name);
    w2 = upload_half(w.w2, half, w2_name);
    if (w.w13_bias) w13_bias = upload_f32(*w.w13_bias);
    if (w.w2_bias) w2_bias = upload_f32(*w.w2_bias);
  }
  size_t bytes() const { return w13.bytes() + w2.bytes() + w13_bias.bytes() + w2_bias.bytes(); }
};

constexpr int32_t kNoNanToken = 0x7f7f7f7f;  // what cudaMemset(0x7f) writes

void check_device_view(const TensorView& t, const char* name, std::initializer_list<DType> dtypes) {
  FUSEDMOE_CHECK(t.device().type == DeviceType::kCUDA, name,
                 ": expected a CUDA tensor (CUDA backend), got a CPU tensor ", t.str());
  bool ok = false;
  for (DType d : dtypes) ok |= t.dtype() == d;
  FUSEDMOE_CHECK(ok, name, ": unsupported dtype ", t.str());
  FUSEDMOE_CHECK(t.rows_contiguous(), name, ": expected contiguous rows, got ", t.str());
}

}  // namespace

struct CudaMoELayer::Impl {
  MoEConfig cfg;
  int64_t max_tokens = 0;
  bool routed_sm90 = false;  // scratch carved for the sm90 routed path (forward may take it)
  W13Layout w13_layout = W13Layout::kStandard;  // of experts.w13 (shared: always standard)
  int device = 0;
  // weights
  DeviceMemory gate_w, gate_b, score_bias, hash_table, shared_gate;
  DeviceMemory zipf_pmf, zipf_cdf;  // kSimulated + kZipf: f64 [E + Z]
  DType gate_dtype = DType::kF32;
  DType dtype = DType::kBF16;  // of the expert weights, expert inputs and intermediates
  DeviceExperts experts, shared;
  // workspace: the scratch (a block of the SharedWorkspace given, or of the
  // layer's own) and the state kept between calls
  std::shared_ptr<void> ws;
  std::shared_ptr<SharedWorkspace> workspace;  // the one given, or a private one
  size_t ws_bytes = 0;
  DeviceMemory state;
  float* logits = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  uint16_t* xb = nullptr;
  uint16_t* xs = nullptr;
  void* routed_base = nullptr;
  RoutedScratch routed;  // carved from routed_base (with the sm90 path where available)
  uint16_t* inter_s = nullptr;
  float* shared_out = nullptr;
  int32_t* nan_token = nullptr;  // first token with a NaN router logit, else kNoNanToken
  int32_t* bad_token = nullptr;  // hash routing: first token id outside the table, else kNoNanToken
  // the shared expert on the sm90 path (many rows): its own workspace, as it
  // runs on the side stream beside the routed experts
  void* shared_sm90_ws = nullptr;
  size_t shared_sm90_ws_bytes = 0;
  // second stream for the shared expert
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  // ep_shared() took the sm90 path: experts()' sm90 GEMMs wait for it (forward()'s rule).
  bool shared_sm90_pending = false;

  // The shared expert of the T rows of xb into shared_out, on the side stream
  // after `stream`'s work so far (joined by the `join` event), on the path and
  // tiles forward() picks for tile_tokens tokens. Returns true when it took the
  // sm90 path (sm90_dense_expert).
  bool launch_shared(int64_t T, int64_t tile_tokens, cudaStream_t stream);

  // The routed experts of the M rows x (row stride ldx) with their ids / weights.
  RoutedExpertsArgs routed_args(const uint16_t* x, int64_t ldx, const int32_t* topk_ids,
                                const float* topk_weights, int64_t M) const {
    RoutedExpertsArgs r;
    r.dtype = dtype;
    r.x = x;
    r.ldx = ldx;
    r.topk_ids = topk_ids;
    r.topk_weights = topk_weights;
    r.num_tokens = M;
    r.top_k = cfg.top_k;
    r.num_experts = experts.num_experts;
    r.hidden = cfg.hidden_size;
    r.inter = cfg.intermediate_size;
    r.w13 = experts.w13.as<uint16_t>();
    r.w13_layout = w13_layout;
    r.w2 = experts.w2.as<uint16_t>();
    r.w13_bias = experts.w13_bias.as<float>();
    r.w2_bias = experts.w2_bias.as<float>();
    r.act = ActivationParams::from_config(cfg);
    r.apply_router_weight_on_input = cfg.apply_router_weight_on_input;
    r.allow_sm90 = routed_sm90;
    return r;
  }

  ~Impl() {
    if (fork) cudaEventDestroy(fork);
    if (join) cudaEventDestroy(join);
    if (side) cudaStreamDestroy(side);
  }
};

CudaMoELayer::CudaMoELayer(const MoEConfig& config, const MoELayerWeights& w,
                           int64_t max_num_tokens, DType expert_dtype, bool routed_sm90,
                           const std::shared_ptr<SharedWorkspace>& shared_workspace)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.cfg = config;
  const MoEConfig& c = s.cfg;
  FUSEDMOE_CHECK(max_num_tokens > 0, "max_num_tokens: expected > 0, got ", max_num_tokens);
  s.max_tokens = max_num_tokens;
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts, k = c.top_k;
  const int64_t L = c.num_router_logits();
  if (H % 8 != 0 || I % 8 != 0)
    FUSEDMOE_THROW(kUnsupported,
                   "CUDA backend: hidden_size and intermediate_size must be "
                   "multiples of 8, got H = ",
                   H, ", I = ", I);
  if (c.has_shared_expert() && c.shared_intermediate_size % 8 != 0)
    FUSEDMOE_THROW(kUnsupported,
                   "CUDA backend: shared_intermediate_size must be a multiple of 8, "
                   "got ",
                   c.shared_intermediate_size);
  if (k > 32) FUSEDMOE_THROW(kUnsupported, "CUDA backend: top_k at most 32, got ", k);
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&s.device));

  // ---- weights ----
  s.gate_w = upload_gate(w.gate_weight, &s.gate_dtype);
  if (w.gate_bias) s.gate_b = upload_f32(*w.gate_bias);
  if (c.has_e_score_correction_bias && w.router_params.e_score_correction_bias)
    s.score_bias = upload_f32(*w.router_params.e_score_correction_bias);
  if (w.router_params.hash_table) s.hash_table = upload_raw(*w.router_params.hash_table);
  if (c.routing_method == RoutingMethod::kSimulated && c.simulated == SimulatedRouting::kZipf) {
    std::vector<double> pmf, cdf;  // the host's tables, so the draws match the CPU simulator
    routing::simulated::zipf_tables(L, c.zipf_s, pmf, cdf);
    s.zipf_pmf = upload_raw(Tensor::copy_of(TensorView(pmf.data(), DType::kF64, {L})));
    s.zipf_cdf = upload_raw(Tensor::copy_of(TensorView(cdf.data(), DType::kF64, {L})));
  }
  FUSEDMOE_CHECK(expert_dtype == DType::kBF16 || expert_dtype == DType::kF16,
                 "compute_dtype: the CUDA backend runs the experts in bf16 or f16, got ",
                 dtype_name(expert_dtype));
  s.dtype = expert_dtype;
  s.experts.upload(w.experts, s.dtype, "experts.w13", "experts.w2");
  if (w.shared_experts)
    s.shared.upload(*w.shared_experts, s.dtype, "shared_experts.w13", "shared_experts.w2");
  if (w.shared_expert_gate) s.shared_gate = upload_f32(*w.shared_expert_gate);

  // ---- workspace (one allocation, carved) ----
  const int64_t Tm = max_num_tokens, slots = Tm * k;
  const bool sm90 = sm90_experts_available();
  s.routed_sm90 = sm90 && routed_sm90;
  // Where the sm90 path may run, its w13 GEMM applies the activation in its
  // epilogue when the experts' w13 rows are interleaved (kW13Block gate rows,
  // then the matching up rows); every other path reads that layout too.
  // FUSEDMOE_CUDA_W13_LAYOUT=standard keeps HF's order (the separate activation pass).
  if (s.routed_sm90 && pick_w13_layout(I) == W13Layout::kInterleaved128) {
    interleave_w13(s.experts.w13.as<uint16_t>(), s.experts.num_experts, I, H, nullptr);
    s.w13_layout = W13Layout::kInterleaved128;
  }
  // With the activation in the w13 epilogue, the sm90 scratch holds no w13
  // output rows (Mixtral-8x7B at max_num_tokens 4096: 470 MB less);
  // FUSEDMOE_CUDA_SM90_GLU=pass set after this is refused by sm90_experts'
  // workspace check (it names the switch).
  const bool glu_epilogue = s.w13_layout == W13Layout::kInterleaved128 &&
                            pick_sm90_glu_epilogue(routed_rows_per_expert(Tm, k, E), E, H, I);
  const int64_t Is = c.shared_intermediate_size;
  struct Part {
    void** ptr;
    size_t bytes;
  };
  std::vector<Part> parts = {
      {reinterpret_cast<void**>(&s.logits), sizeof(float) * Tm * L},
      {reinterpret_cast<void**>(&s.ids), sizeof(int32_t) * slots},
      {reinterpret_cast<void**>(&s.weights), sizeof(float) * slots},
      {reinterpret_cast<void**>(&s.xb), size_t{2} * Tm * H},
      {&s.routed_base, routed_scratch_bytes(Tm, k, E, H, I, s.routed_sm90, glu_epilogue)},
  };
  if (c.apply_router_weight_on_input)
    parts.push_back({reinterpret_cast<void**>(&s.xs), size_t{2} * Tm * H});
  if (c.has_shared_expert()) {
    parts.push_back({reinterpret_cast<void**>(&s.inter_s), size_t{2} * Tm * Is});
    parts.push_back({reinterpret_cast<void**>(&s.shared_out), sizeof(float) * Tm * H});
    if (sm90) {
      s.shared_sm90_ws_bytes = sm90_dense_expert_workspace_bytes(Tm, Is);
      parts.push_back({&s.shared_sm90_ws, s.shared_sm90_ws_bytes});
    }
  }
  size_t total = 0;
  for (const Part& p : parts) total += (p.bytes + 255) / 256 * 256;
  s.ws_bytes = total;
  s.workspace = shared_workspace ? shared_workspace : std::make_shared<SharedWorkspace>();
  s.ws = s.workspace->acquire(total);
  char* const base = static_cast<char*>(s.ws.get());
  size_t off = 0;
  for (const Part& p : parts) {
    *p.ptr = base + off;
    off += (p.bytes + 255) / 256 * 256;
  }
  s.state = DeviceMemory(2 * sizeof(int32_t));
  s.nan_token = s.state.as<int32_t>();
  s.bad_token = s.nan_token + 1;
  s.routed = carve_routed_scratch(s.routed_base, Tm, k, E, H, I, s.routed_sm90, glu_epilogue);
  FUSEDMOE_CUDA_CHECK(cudaMemset(s.nan_token, 0x7f, 2 * sizeof(int32_t)));
  FUSEDMOE_CUDA_CHECK(cudaDeviceSynchronize());
  if (c.has_shared_expert()) {
    FUSEDMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.side, cudaStreamNonBlocking));
    FUSEDMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
    FUSEDMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  }
}

CudaMoELayer::~CudaMoELayer() = default;

int64_t CudaMoELayer::max_num_tokens() const {
  return impl_->max_tokens;
}
const MoEConfig& CudaMoELayer::config() const {
  return impl_->cfg;
}
size_t CudaMoELayer::weight_bytes() const {
  const Impl& s = *impl_;
  return s.gate_w.bytes() + s.gate_b.bytes() + s.score_bias.bytes() + s.hash_table.bytes() +
         s.shared_gate.bytes() + s.experts.bytes() + s.shared.bytes();
}
DType CudaMoELayer::dtype() const {
  return impl_->dtype;
}
const std::shared_ptr<SharedWorkspace>& CudaMoELayer::shared_workspace() const {
  return impl_->workspace;
}

size_t CudaMoELayer::workspace_bytes() const {
  return impl_->ws_bytes;
}

void CudaMoELayer::check_errors(Stream stream) {
  Impl& s = *impl_;
  int32_t token[2] = {kNoNanToken, kNoNanToken};  // nan_token, bad_token
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpyAsync(token, s.nan_token, sizeof token, cudaMemcpyDeviceToHost, stream));
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (token[0] == kNoNanToken && token[1] == kNoNanToken) return;
  FUSEDMOE_CUDA_CHECK(cudaMemsetAsync(s.nan_token, 0x7f, sizeof token, stream));
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (token[1] != kNoNanToken)
    FUSEDMOE_THROW(kInvalidArgument,
                   "token_ids: expected values in [0, hash_vocab_size = ", s.cfg.hash_vocab_size,
                   "), got one outside at token ", token[1],
                   " (of a forward since the last check; that token was routed to no expert)");
  // The logits were given (router_logits) or computed from hidden_states and
  // gate_weight (a non-finite gate weight, or a product beyond f32): the
  // device does not record which, so the message names both.
  FUSEDMOE_THROW(kInvalidArgument,
                 "router logits (router_logits given, or computed from hidden_states and "
                 "gate_weight): expected finite values, got NaN at token ",
                 token[0], " (of a forward since the last check; its output is not meaningful)");
}

void CudaMoELayer::router_logits(const TensorView& hidden_states, const TensorView& logits,
                                 Stream stream) {
  const Impl& s = *impl_;
  check_device_view(hidden_states, "hidden_states", {DType::kF32, DType::kBF16, DType::kF16});
  check_device_view(logits, "router_logits", {DType::kF32});
  const int64_t T = hidden_states.size(0);
  router_gemm(hidden_states.data(), hidden_states.dtype(), hidden_states.stride(0), T,
              s.cfg.hidden_size, s.gate_w.get(), s.gate_dtype, s.cfg.num_router_logits(),
              s.gate_b.as<float>(), logits.data_as<float>(), logits.stride(0), stream);
}

// forward() = ep_route -> ep_shared -> the routed experts -> finalize: the
// same steps (and launches) as expert parallelism, with the routed experts of
// all E experts here instead of a dispatch / experts() / combine.
void CudaMoELayer::forward(const TensorView& hidden_states, const TensorView& output,
                           const TensorView* router_logits_in, const TensorView* token_ids,
                           const ForwardOutputs* outputs, Stream stream,
                           const int32_t* num_valid_tokens) {
  Impl& s = *impl_;
  const MoEConfig& c = s.cfg;
  check_device_view(hidden_states, "hidden_states", {DType::kF32, DType::kBF16, DType::kF16});
  check_device_view(output, "output", {DType::kF32, DType::kBF16, DType::kF16});
  ep_route(hidden_states, router_logits_in, token_ids, outputs, stream, num_valid_tokens);
  const int64_t T = hidden_states.size(0);
  if (T == 0) return;
  const bool shared_sm90 = c.has_shared_expert() && s.launch_shared(T, T, stream);
  RoutedExpertsArgs r = s.routed_args(expert_input(), c.hidden_size, s.ids, s.weights, T);
  // Both on the sm90 path (many rows): the CUTLASS GEMMs are persistent
  // kernels, one CTA per SM, and each fills the GPU alone. Run side by side
  // (the routed GEMM's CTAs then wait for SMs the shared expert holds), the
  // graph replay of DeepSeek-V3 at T = 4096 took 9374 us (eager 8721 us,
  // routed part alone 7666 us); with the routed experts waiting for the
  // shared expert (which still overlaps align on the side stream): 8628 us
  // graph, 8638 us eager (bench/results/2026-11-29-layer.md).
  if (shared_sm90) r.sm90_wait_event = s.join;
  if (!c.has_shared_expert()) {  // finalize would add only the routed rows
    r.out = output.data();
    r.out_dtype = output.dtype();
    r.ldo = output.stride(0);
  }
  const RoutedResult routed = routed_experts(r, s.routed, stream);
  if (!routed.output_written) finish(routed.finalize, output, stream);
}

// ---- expert parallelism: forward() in three parts (CudaEpMoELayer) ----------------

const int32_t* CudaMoELayer::topk_ids() const {
  return impl_->ids;
}
const float* CudaMoELayer::topk_weights() const {
  return impl_->weights;
}
const uint16_t* CudaMoELayer::expert_input() const {
  return impl_->cfg.apply_router_weight_on_input ? impl_->xs : impl_->xb;
}

void CudaMoELayer::ep_route(const TensorView& hidden_states, const TensorView* router_logits_in,
                            const TensorView* token_ids, const ForwardOutputs* outputs,
                            Stream stream, const int32_t* num_valid_tokens) {
  Impl& s = *impl_;
  const MoEConfig& c = s.cfg;
  const int64_t H = c.hidden_size, k = c.top_k, L = c.num_router_logits();
  check_device_view(hidden_states, "hidden_states", {DType::kF32, DType::kBF16, DType::kF16});
  const int64_t T = hidden_states.size(0);
  FUSEDMOE_CHECK(T <= s.max_tokens, "hidden_states: at most max_num_tokens = ", s.max_tokens,
                 " tokens (RunnerOptions::max_num_tokens), got ", T);
  if (router_logits_in) check_device_view(*router_logits_in, "router_logits", {DType::kF32});
  if (token_ids) {
    FUSEDMOE_CHECK(
        token_ids->device().type == DeviceType::kCUDA && token_ids->is_contiguous() &&
            token_ids->dtype() == DType::kI32 && token_ids->ndim() == 1 && token_ids->size(0) == T,
        "token_ids: expected a contiguous CUDA i32 tensor [", T, "], got ", token_ids->str());
  }
  const bool want_logits = outputs && outputs->router_logits.data() != nullptr;
  const bool want_ids = outputs && outputs->topk_ids.data() != nullptr;
  const bool want_weights = outputs && outputs->topk_weights.data() != nullptr;
  if (want_logits)
    check_device_view(outputs->router_logits, "outputs.router_logits", {DType::kF32});
  if (want_ids) check_device_view(outputs->topk_ids, "outputs.topk_ids", {DType::kI32});
  if (want_weights) check_device_view(outputs->topk_weights, "outputs.topk_weights", {DType::kF32});
  FUSEDMOE_CHECK(c.routing_method != RoutingMethod::kHash || token_ids != nullptr,
                 "token_ids: required by hash routing");
  if (T == 0) return;

  // ---- router ----
  const float* logits = nullptr;
  int64_t ldl = L;
  // With bf16 experts the router GEMM also writes the bf16 expert inputs xb
  // (in its own kernel at decode sizes: one launch fewer); otherwise
  // to_half_rows below.
  bool have_xb = false;
  if (router_logits_in) {
    logits = router_logits_in->data_as<const float>();
    ldl = router_logits_in->stride(0);
  } else if ((c.routing_method != RoutingMethod::kHash &&
              c.routing_method != RoutingMethod::kSimulated) ||
             want_logits) {  // hash and simulated routing ignore the logits
    float* dst = want_logits ? outputs->router_logits.data_as<float>() : s.logits;
    ldl = want_logits ? outputs->router_logits.stride(0) : L;
    have_xb = s.dtype == DType::kBF16;
    router_gemm(hidden_states.data(), hidden_states.dtype(), hidden_states.stride(0), T, H,
                s.gate_w.get(), s.gate_dtype, L, s.gate_b.as<float>(), dst, ldl, stream,
                have_xb ? s.xb : nullptr);
    logits = dst;
  }
  RouteArgs ra;
  ra.router_logits = logits;
  ra.logits_ld = ldl;
  ra.bias = s.score_bias.as<float>();
  ra.hash_table = s.hash_table.as<int32_t>();
  ra.token_ids = token_ids ? token_ids->data_as<const int32_t>() : nullptr;
  ra.topk_ids = s.ids;
  ra.topk_weights = s.weights;
  ra.num_valid_tokens = num_valid_tokens;
  ra.nan_token = s.nan_token;
  ra.bad_token = s.bad_token;
  ra.zipf_pmf = s.zipf_pmf.as<double>();
  ra.zipf_cdf = s.zipf_cdf.as<double>();
  route(c, ra, T, stream);
  if (want_logits && router_logits_in) {
    FUSEDMOE_CUDA_CHECK(cudaMemcpy2DAsync(outputs->router_logits.data(),
                                          outputs->router_logits.stride(0) * 4, logits, ldl * 4,
                                          L * 4, T, cudaMemcpyDeviceToDevice, stream));
  }
  if (want_ids)
    FUSEDMOE_CUDA_CHECK(cudaMemcpy2DAsync(outputs->topk_ids.data(), outputs->topk_ids.stride(0) * 4,
                                          s.ids, k * 4, k * 4, T, cudaMemcpyDeviceToDevice,
                                          stream));
  if (want_weights)
    FUSEDMOE_CUDA_CHECK(cudaMemcpy2DAsync(outputs->topk_weights.data(),
                                          outputs->topk_weights.stride(0) * 4, s.weights, k * 4,
                                          k * 4, T, cudaMemcpyDeviceToDevice, stream));

  // ---- expert inputs (bf16 / f16) ----
  if (!have_xb)
    to_half_rows(hidden_states.data(), hidden_states.dtype(), hidden_states.stride(0), T, H,
                 nullptr, 0, s.dtype, s.xb, stream);
  if (c.apply_router_weight_on_input)  // Llama-4 (k = 1): x * topk_weight, then bf16 / f16
    to_half_rows(hidden_states.data(), hidden_states.dtype(), hidden_states.stride(0), T, H,
                 s.weights, k, s.dtype, s.xs, stream);
}

void CudaMoELayer::ep_shared(int64_t T, int64_t tile_tokens, Stream stream) {
  impl_->shared_sm90_pending = false;
  if (T == 0 || !impl_->cfg.has_shared_expert()) return;
  impl_->shared_sm90_pending = impl_->launch_shared(T, tile_tokens, stream);
}

bool CudaMoELayer::Impl::launch_shared(int64_t T, int64_t tile_tokens, cudaStream_t stream) {
  const MoEConfig& c = cfg;
  const int64_t H = c.hidden_size, Is = c.shared_intermediate_size;
  FUSEDMOE_CUDA_CHECK(cudaEventRecord(fork, stream));
  FUSEDMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
  // One expert over all T rows: T rows per expert, the routed experts' threshold.
  const bool sm90 = shared_sm90_ws != nullptr && pick_sm90_experts(tile_tokens, tile_tokens, H, Is);
  if (sm90) {
    Sm90DenseExpertArgs d;
    d.dtype = dtype;
    d.x = xb;
    d.num_tokens = T;
    d.hidden = H;
    d.inter = Is;
    d.w13 = shared.w13.as<uint16_t>();
    d.w2 = shared.w2.as<uint16_t>();
    d.act = ActivationParams::from_config(c);
    d.inter_rows = inter_s;
    d.out = shared_out;
    d.workspace = shared_sm90_ws;
    d.workspace_bytes = shared_sm90_ws_bytes;
    sm90_dense_expert(d, side);
  } else {
    GroupedGemmArgs g;
    g.epilogue = GemmEpilogue::kGlu;
    g.tile = pick_gemm_tile(tile_tokens, tile_tokens, 2 * Is, H);
    g.dtype = dtype;
    g.a = xb;
    g.lda = H;
    g.m = T;
    g.w = shared.w13.as<uint16_t>();
    g.n = 2 * Is;
    g.k = H;
    g.act = ActivationParams::from_config(c);
    g.out = inter_s;
    g.ldc = Is;
    grouped_gemm(g, side);
    GroupedGemmArgs g2;
    g2.epilogue = GemmEpilogue::kScatter;
    g2.tile = pick_gemm_tile(tile_tokens, tile_tokens, H, Is);
    g2.dtype = dtype;
    g2.a = inter_s;
    g2.lda = Is;
    g2.m = T;
    g2.w = shared.w2.as<uint16_t>();
    g2.n = H;
    g2.k = Is;
    g2.out = shared_out;
    g2.ldc = H;
    grouped_gemm(g2, side);
  }
  FUSEDMOE_CUDA_CHECK(cudaEventRecord(join, side));
  return sm90;
}

FinalizeArgs CudaMoELayer::experts(const uint16_t* x, int64_t ldx, const int32_t* topk_ids,
                                   const float* topk_weights, int64_t M, int64_t batch_tokens,
                                   bool allow_sm90, Stream stream) {
  Impl& s = *impl_;
  const int64_t H = s.cfg.hidden_size;
  FUSEDMOE_CHECK(M >= 0 && M <= s.max_tokens, "experts: num_rows: expected in [0, ", s.max_tokens,
                 "], got ", M);
  FUSEDMOE_CHECK(batch_tokens >= M, "experts: batch_tokens: expected >= num_rows = ", M, ", got ",
                 batch_tokens);
  FUSEDMOE_CHECK(ldx >= H && ldx % 8 == 0, "experts: ldx: expected >= ", H,
                 " and a multiple of 8, got ", ldx);
  const MoEConfig& c = s.cfg;
  if (M == 0) {
    FinalizeArgs f;
    f.y = s.routed.y;
    f.num_tokens = 0;
    f.top_k = c.top_k;
    f.hidden = H;
    return f;
  }
  RoutedExpertsArgs r = s.routed_args(x, ldx, topk_ids, topk_weights, M);
  r.tile = cuda::routed_gemm_tile(batch_tokens, c.top_k, c.num_experts, c.hidden_size,
                                  c.intermediate_size);
  r.allow_sm90 = allow_sm90 && s.routed_sm90 &&
                 pick_sm90_experts(routed_rows_per_expert(batch_tokens, c.top_k, c.num_experts),
                                   batch_tokens * c.top_k, c.hidden_size, c.intermediate_size);
  r.decode = pick_decode_experts(batch_tokens, c.top_k, c.num_experts, c.intermediate_size);
  if (r.allow_sm90 && s.shared_sm90_pending) r.sm90_wait_event = s.join;
  s.shared_sm90_pending = false;
  return routed_experts(r, s.routed, stream).finalize;
}

void CudaMoELayer::ep_finalize(const void* y, const TensorView& output, int64_t T, Stream stream,
                               const int32_t* rows, int64_t rows_per_token, DType y_dtype) {
  check_device_view(output, "output", {DType::kF32, DType::kBF16, DType::kF16});
  if (T == 0) return;
  FinalizeArgs f;
  f.y = y;
  f.y_dtype = y_dtype;
  f.topk_ids = rows ? rows : impl_->ids;  // finalize sums the rows whose id is >= 0
  f.num_tokens = T;
  f.top_k = rows ? rows_per_token : impl_->cfg.top_k;
  f.hidden = impl_->cfg.hidden_size;
  finish(f, output, stream);
}

void CudaMoELayer::finish(FinalizeArgs f, const TensorView& output, Stream stream) {
  Impl& s = *impl_;
  const bool has_shared = s.cfg.has_shared_expert();
  if (has_shared) FUSEDMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, s.join, 0));
  f.shared = has_shared ? s.shared_out : nullptr;
  f.shared_gate = s.shared_gate.as<float>();
  f.x = s.xb;
  f.x_dtype = s.dtype;
  f.ldx = s.cfg.hidden_size;
  f.out = output.data();
  f.out_dtype = output.dtype();
  f.ldo = output.stride(0);
  finalize(f, stream);
}

}  // namespace fusedmoe::cuda
