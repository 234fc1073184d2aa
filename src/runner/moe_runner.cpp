// fusedmoe: MoERunner — gate GEMM, router, routed experts, shared expert.
//
// Order of operations per architecture (HF modeling files, transformers 5.x):
//   Mixtral / Qwen3-MoE / OLMoE / gpt-oss: output = routed
//   Qwen2-MoE:   output = routed + sigmoid(x . shared_expert_gate) * shared(x)
//   DeepSeek-V3: output = routed + shared(x)   (routed_scaling_factor is in topk_weights)
//   Llama-4:     output = shared(x) + routed(x * topk_weight)  (weight on the expert input)
// The gate is computed in f32 (DeepSeek-V3: F.linear(x.float(), weight.float()));
// bf16 gate weights are widened exactly.
#include "fusedmoe/runner/moe_runner.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fusedmoe/core/env.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/workspace_slots.h"
#ifdef FUSEDMOE_WITH_CUDA
#include "kernels/cuda/cuda_ep_moe_layer.h"
#include "kernels/cuda/cuda_graph_layer.h"
#include "kernels/cuda/cuda_moe_layer.h"
#else
namespace fusedmoe::cuda {
class CudaMoELayer {};  // no CUDA backend in this build
class CudaGraphLayer {};
class CudaEpMoELayer {};
}  // namespace fusedmoe::cuda
#endif

namespace fusedmoe {

// ---- MoELayerWeights ----------------------------------------------------------

size_t MoELayerWeights::nbytes() const {
  size_t n = gate_weight.nbytes() + experts.nbytes();
  if (gate_bias) n += gate_bias->nbytes();
  if (router_params.e_score_correction_bias) n += router_params.e_score_correction_bias->nbytes();
  if (router_params.hash_table) n += router_params.hash_table->nbytes();
  if (shared_experts) n += shared_experts->nbytes();
  if (shared_expert_gate) n += shared_expert_gate->nbytes();
  return n;
}

namespace {

// f32 or bf16, given shape, contiguous.
void check_float_param(const Tensor& t, const char* name, std::initializer_list<int64_t> shape) {
  const TensorView& v = t.view();
  FUSEDMOE_CHECK(v.data() != nullptr || v.ndim() > 0, name, ": missing");
  FUSEDMOE_CHECK(v.dtype() == DType::kF32 || v.dtype() == DType::kBF16, name,
                 ": expected dtype f32 or bf16, got ", v.str());
  check_tensor(v, name, v.dtype(), shape);
  FUSEDMOE_CHECK(v.is_contiguous(), name, ": expected a contiguous tensor, got strides of ",
                 v.str());
}

// True when a and b share a byte. A 1-D view, or a 2-D one with unit stride
// in its last dimension, is taken row by row (rows at a stride, each a
// contiguous run of bytes), so views interleaved in one buffer (column blocks
// of the same rows) do not overlap; any other view by the span from its first
// to its last element.
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  struct Rows {
    intptr_t base;
    int64_t rows, stride, len;  // bytes: row r is [base + r * stride, + len)
  };
  auto rows_of = [](const TensorView& v) {
    const int64_t es = dtype_size(v.dtype());
    const auto base = reinterpret_cast<intptr_t>(v.data());
    if (v.ndim() == 1 && v.stride(0) >= 0) return Rows{base, v.size(0), v.stride(0) * es, es};
    if (v.ndim() == 2 && v.stride(1) == 1 && v.stride(0) >= 0)
      return Rows{base, v.size(0), v.stride(0) * es, v.size(1) * es};
    int64_t first = 0, last = 0;  // element offsets of the span
    for (int d = 0; d < v.ndim(); ++d) {
      const int64_t step = (v.size(d) - 1) * v.stride(d);
      (step < 0 ? first : last) += step;
    }
    return Rows{base + first * es, 1, 0, (last - first + 1) * es};
  };
  Rows x = rows_of(a), y = rows_of(b);
  // Row stride 0 (or one row): a single run of bytes.
  if (x.stride == 0) x.rows = 1;
  if (y.stride == 0) y.rows = 1;
  if (x.base + (x.rows - 1) * x.stride + x.len <= y.base ||
      y.base + (y.rows - 1) * y.stride + y.len <= x.base)
    return false;  // the spans are apart
  if (x.rows > y.rows) std::swap(x, y);
  // For each row of x, the rows j of y with y.base + j * y.stride < x1 and
  // y.base + j * y.stride + y.len > x0 (floor divisions; y.stride > 0 here
  // when y has more than one row).
  auto floor_div = [](int64_t n, int64_t d) { return n / d - (n % d != 0 && (n < 0) != (d < 0)); };
  for (int64_t i = 0; i < x.rows; ++i) {
    const int64_t x0 = x.base + i * x.stride - y.base, x1 = x0 + x.len;  // relative to y.base
    if (y.rows == 1) {
      if (x0 < y.len && x1 > 0) return true;
      continue;
    }
    const int64_t j_lo = std::max<int64_t>(0, floor_div(x0 - y.len, y.stride) + 1);
    const int64_t j_hi = std::min<int64_t>(y.rows - 1, floor_div(x1 - 1, y.stride));
    if (j_lo <= j_hi) return true;
  }
  return false;
}

// The tensors forward() writes (output and the routing outputs asked for) must
// each have memory of their own: one over another is overwritten by it (a routing
// output over `output` came back holding output values), one over an input
// changes it mid-call. Named before anything is written. outputs->router_logits
// may be the router_logits given (the same tensor: the copy is skipped).
void check_written_tensors_do_not_overlap(const TensorView& hidden_states, const TensorView& output,
                                          const TensorView* router_logits,
                                          const TensorView* token_ids,
                                          const ForwardOutputs* outputs) {
  std::vector<std::pair<const char*, const TensorView*>> written = {{"output", &output}};
  if (outputs)
    for (const auto& [name, v] : {std::pair{"outputs.router_logits", &outputs->router_logits},
                                  {"outputs.topk_ids", &outputs->topk_ids},
                                  {"outputs.topk_weights", &outputs->topk_weights}})
      if (v->data() != nullptr) written.push_back({name, v});
  std::vector<std::pair<const char*, const TensorView*>> given = {
      {"hidden_states", &hidden_states}};
  if (router_logits) given.push_back({"router_logits", router_logits});
  if (token_ids) given.push_back({"token_ids", token_ids});
  for (size_t i = 0; i < written.size(); ++i) {
    const auto& [name, v] = written[i];
    // Rows of one tensor over each other (a row stride below the row's length):
    // the rows would be written over each other.
    FUSEDMOE_CHECK(
        v->ndim() != 2 || v->size(0) <= 1 || v->size(1) == 0 || v->stride(0) >= v->size(1), name,
        ": its rows overlap (row stride ", v->stride(0), " for rows of ", v->size(1),
        " elements); each row forward writes needs memory of its own");
    for (size_t j = 0; j < i; ++j)
      FUSEDMOE_CHECK(!overlaps(*v, *written[j].second), name, ": must not overlap ",
                     written[j].first, " (each tensor forward writes needs memory of its own)");
    for (const auto& [input, u] : given) {
      const bool same_logits = outputs && v == &outputs->router_logits && u == router_logits &&
                               v->data() == u->data() && v->stride(0) == u->stride(0);
      FUSEDMOE_CHECK(same_logits || !overlaps(*v, *u), name, ": must not overlap ", input,
                     " (an input forward reads; only outputs.router_logits may be the "
                     "router_logits given)");
    }
  }
}

}  // namespace

void MoELayerWeights::validate(const MoEConfig& config) const {
  const int64_t E = config.num_experts, H = config.hidden_size;
  const int64_t L = config.num_router_logits();
  check_float_param(gate_weight, "gate_weight", {L, H});
  if (config.has_router_bias) {
    FUSEDMOE_CHECK(gate_bias.has_value(), "gate_bias: missing (expected f32/bf16 [", L,
                   "]; the config has a router bias)");
    check_float_param(*gate_bias, "gate_bias", {L});
  } else {
    FUSEDMOE_CHECK(!gate_bias.has_value(),
                   "gate_bias: given, but the config has no router bias (has_router_bias = false)");
  }
  // Under a parallel layout the experts may be this rank's share only.
  const ParallelConfig& pc = config.parallel;
  const bool full_experts =
      !pc.is_parallel() || (experts.w13.ndim() == 3 && experts.w13.size(0) == E &&
                            experts.w13.size(1) == 2 * config.intermediate_size);
  if (full_experts) {
    experts.validate(E, H, config.intermediate_size, config.has_expert_bias, "experts");
  } else {
    const int64_t E_local =
        ExpertMap(E, pc.ep_size, pc.expert_placement).num_local_experts(pc.ep_rank);
    const int64_t I_local = tp_slice(config.intermediate_size, pc.tp_size, pc.tp_rank).second;
    experts.validate(E_local, H, I_local, config.has_expert_bias,
                     "experts (neither the whole layer nor this rank's share)");
  }
  const int64_t S_local =
      config.has_shared_expert() && shared_experts && shared_experts->w2.ndim() == 3 &&
              shared_experts->w2.size(2) != config.shared_intermediate_size && pc.tp_size > 1
          ? tp_slice(config.shared_intermediate_size, pc.tp_size, pc.tp_rank).second
          : config.shared_intermediate_size;
  if (config.has_shared_expert()) {
    FUSEDMOE_CHECK(shared_experts.has_value(), "shared_experts: missing (expected w13 [1, ",
                   2 * config.shared_intermediate_size, ", ", H, "], w2 [1, ", H, ", ",
                   config.shared_intermediate_size,
                   "]; the config has shared_intermediate_size = ", config.shared_intermediate_size,
                   ")");
    shared_experts->validate(1, H, S_local, false, "shared_experts");
  } else {
    FUSEDMOE_CHECK(!shared_experts.has_value(),
                   "shared_experts: given, but the config has no shared expert "
                   "(shared_intermediate_size = 0)");
  }
  if (config.has_shared_expert_gate) {
    FUSEDMOE_CHECK(config.has_shared_expert(),
                   "shared_expert_gate: the config has a shared expert gate but no shared expert");
    FUSEDMOE_CHECK(shared_expert_gate.has_value(),
                   "shared_expert_gate: missing (expected f32/bf16 [1, ", H, "])");
    check_float_param(*shared_expert_gate, "shared_expert_gate", {1, H});
  } else {
    FUSEDMOE_CHECK(!shared_expert_gate.has_value(),
                   "shared_expert_gate: given, but the config has none (has_shared_expert_gate = "
                   "false)");
  }
}

// ---- MoERunner ----------------------------------------------------------------

MoERunner::MoERunner(MoEConfig config, MoELayerWeights weights, RunnerOptions options)
    : config_(std::move(config)), weights_(std::move(weights)), options_(options) {
  config_.validate();
  weights_.validate(config_);
  check_cuda_switches();  // on every backend: a bad FUSEDMOE_CUDA_* value is never ignored
  FUSEDMOE_CHECK(
      options_.compute_dtype == DType::kF32 || options_.compute_dtype == DType::kBF16 ||
          (options_.compute_dtype == DType::kF16 && options_.device.type == DeviceType::kCUDA),
      "compute_dtype: expected f32 or bf16 (f16: CUDA backend only), got ",
      dtype_name(options_.compute_dtype));
  FUSEDMOE_CHECK(options_.max_num_tokens >= 0,
                 "max_num_tokens: expected >= 0 (0: the default), got ", options_.max_num_tokens);
  FUSEDMOE_CHECK(options_.combine_dtype == DType::kF32 || options_.combine_dtype == DType::kBF16,
                 "combine_dtype: expected f32 or bf16, got ", dtype_name(options_.combine_dtype));
  FUSEDMOE_CHECK(!options_.cuda_workspace || options_.device.type == DeviceType::kCUDA,
                 "cuda_workspace: for the CUDA backend (RunnerOptions::device CUDA); given "
                 "with device cpu");
  // The CPU GEMM's environment settings (FUSEDMOE_CPU_ISA, FUSEDMOE_CPU_AMX):
  // a bad value is an error here, not at the first forward.
  cpu::gemm_isa();
  cpu::amx_in_use();
  router_ = create_router(config_, weights_.router_params);
  kernel_ = make_cpu_modular_kernel(options_.pool);
  workspace_ = std::make_unique<Workspace>();
  // CUDA backend + a communicator over device memory (NCCL): expert
  // parallelism on GPUs (CudaEpMoELayer), also at ep_size 1.
  const bool cuda_ep = options_.device.type == DeviceType::kCUDA && options_.communicator &&
                       options_.communicator->device_buffers();
  // bf16 combine rows: the GPU peer transport's (CudaEpMoELayer checks the transport).
  FUSEDMOE_CHECK(cuda_ep || options_.combine_dtype == DType::kF32,
                 "combine_dtype: bf16 is a payload of GPU expert parallelism (CUDA backend with "
                 "a communicator over device memory, peer transport); expected f32 here, got ",
                 dtype_name(options_.combine_dtype));
  if (cuda_ep) {
    const ParallelConfig& pc = config_.parallel;
    const Communicator& comm = *options_.communicator;
    FUSEDMOE_CHECK(pc.tp_size == 1 && pc.dp_size == 1,
                   "config.parallel: the CUDA backend spreads experts only (tp_size = dp_size = "
                   "1), got tp_size ",
                   pc.tp_size, ", dp_size ", pc.dp_size);
    FUSEDMOE_CHECK(pc.ep_size == comm.size() && pc.ep_rank == comm.rank(),
                   "config.parallel: ep_size ", pc.ep_size, " / ep_rank ", pc.ep_rank,
                   " do not match the communicator (size ", comm.size(), ", rank ", comm.rank(),
                   ")");
    const int64_t E = config_.num_experts;
    if (weights_.experts.num_experts() == E && pc.ep_size > 1) {
      const std::vector<int64_t> mine =
          ExpertMap(E, pc.ep_size, pc.expert_placement).local_experts(pc.ep_rank);
      weights_.experts = shard_expert_weights(weights_.experts, mine, 1, 0);
    }
  } else if (config_.parallel.is_parallel()) {
    const ParallelConfig& pc = config_.parallel;
    if (options_.device.type != DeviceType::kCPU)
      FUSEDMOE_THROW(kUnsupported,
                     "parallel layouts on the CUDA backend: expert parallelism only, with a "
                     "communicator over device memory (RunnerOptions::communicator = "
                     "make_nccl_communicator(...)); got ",
                     options_.communicator ? options_.communicator->backend() : "none");
    std::shared_ptr<Communicator> world =
        options_.communicator ? options_.communicator
                              : std::shared_ptr<Communicator>(make_single_rank_communicator());
    ParallelGroups groups = ParallelGroups::create(world, pc.ep_size, pc.tp_size, pc.dp_size);
    const ParallelConfig& g = groups.config;
    FUSEDMOE_CHECK(g.ep_rank == pc.ep_rank && g.tp_rank == pc.tp_rank && g.dp_rank == pc.dp_rank,
                   "config.parallel: ranks (ep ", pc.ep_rank, ", tp ", pc.tp_rank, ", dp ",
                   pc.dp_rank, ") do not match communicator rank ", world->rank(), " (ep ",
                   g.ep_rank, ", tp ", g.tp_rank, ", dp ", g.dp_rank,
                   "; see parallel_config_for_rank)");
    // Keep only this rank's share (a no-op for weights loaded with LoadOptions.parallel).
    const int64_t E = config_.num_experts, I = config_.intermediate_size;
    if (weights_.experts.num_experts() == E && weights_.experts.w13.size(1) == 2 * I &&
        (pc.ep_size > 1 || pc.tp_size > 1)) {
      const std::vector<int64_t> mine =
          ExpertMap(E, pc.ep_size, pc.expert_placement).local_experts(pc.ep_rank);
      weights_.experts = shard_expert_weights(weights_.experts, mine, pc.tp_size, pc.tp_rank);
    }
    if (weights_.shared_experts && pc.tp_size > 1 &&
        weights_.shared_experts->intermediate_size() == config_.shared_intermediate_size) {
      const std::vector<int64_t> zero{0};
      weights_.shared_experts =
          shard_expert_weights(*weights_.shared_experts, zero, pc.tp_size, pc.tp_rank);
    }
    DistributedOptions dopts;
    dopts.placement = pc.expert_placement;
    dopts.dispatch_dtype = options_.dispatch_dtype;
    dopts.pool = options_.pool;
    parallel_ =
        std::make_unique<DistributedExperts>(config_, std::move(groups), weights_.experts, dopts);
  }
  if (options_.device.type == DeviceType::kCUDA) {
#ifdef FUSEDMOE_WITH_CUDA
    FUSEDMOE_CHECK(
        options_.compute_dtype == DType::kBF16 || options_.compute_dtype == DType::kF16,
        "compute_dtype: the CUDA backend computes in bf16 or f16 (f32 accumulation); expected "
        "bf16 or f16, got ",
        dtype_name(options_.compute_dtype));
    FUSEDMOE_CHECK(cuda::device_count() > 0, "device: cuda:", options_.device.index,
                   ", but no CUDA device is visible");
    if (options_.max_num_tokens == 0) options_.max_num_tokens = 8192;
    if (cuda_ep) {
      // The local experts compute every rank's rows: ep_size * max_num_tokens.
      const int P = options_.communicator->size();
      // With the sm90 routed scratch unless nccl is asked for: the peer
      // transport's experts() takes the sm90 path for many rows per expert
      // (the nccl one stays on mma.sync).
      cuda_ = std::make_unique<cuda::CudaMoELayer>(
          config_, weights_, P * options_.max_num_tokens, options_.compute_dtype,
          /*routed_sm90=*/ep_transport_from_env() != EpTransport::kNccl, options_.cuda_workspace);
      cuda_ep_ = std::make_unique<cuda::CudaEpMoELayer>(
          *cuda_, config_, options_.communicator,
          ExpertMap(config_.num_experts, P, config_.parallel.expert_placement),
          options_.max_num_tokens, options_.dispatch_dtype, options_.combine_dtype);
    } else {
      FUSEDMOE_CHECK(options_.dispatch_dtype == DispatchDType::kAuto,
                     "dispatch_dtype: the payload of expert parallelism; expected auto without "
                     "it, got ",
                     to_string(options_.dispatch_dtype));
      cuda_ = std::make_unique<cuda::CudaMoELayer>(config_, weights_, options_.max_num_tokens,
                                                   options_.compute_dtype, /*routed_sm90=*/true,
                                                   options_.cuda_workspace);
    }
    if (!options_.cuda_graph_sizes.empty()) {
      // Under expert parallelism each rank replays its own graphs (the peer
      // transport's flags advance on the device); a rank with 0 tokens or more
      // than the largest size runs eagerly, in step with the others.
      FUSEDMOE_CHECK(!cuda_ep_ || cuda_ep_->capturable(),
                     "cuda_graph_sizes: graph replay under GPU expert parallelism needs the "
                     "peer transport (FUSEDMOE_EP_TRANSPORT=peer, or auto where every rank maps "
                     "every other's GPU memory); this layer runs over nccl, which synchronises "
                     "with the host");
      cuda::CudaEpMoELayer* ep = cuda_ep_.get();
      cuda::CudaMoELayer* one = cuda_.get();
      cuda_graphs_ = std::make_unique<cuda::CudaGraphLayer>(
          config_, options_.max_num_tokens,
          [ep, one](const TensorView& x, const TensorView& out, const TensorView* logits,
                    const TensorView* ids, const ForwardOutputs* outs, cuda::Stream st,
                    const int32_t* num_valid) {
            if (ep)
              ep->forward(x, out, logits, ids, outs, st, num_valid);
            else
              one->forward(x, out, logits, ids, outs, st, num_valid);
          },
          options_.cuda_graph_sizes);
    }
#else
    FUSEDMOE_THROW(kUnsupported,
                   "device: this build of fusedmoe has no CUDA backend "
                   "(configure with FUSEDMOE_ENABLE_CUDA=ON and nvcc)");
#endif
  }
}

MoERunner::~MoERunner() = default;
MoERunner::MoERunner(MoERunner&&) noexcept = default;

namespace {
// Holds a runner for one call (moe_runner.h: one call at a time). The flag
// holds the caller's process id: a second caller of this process finds its
// own id there and throws; a child forked during a call (the flag set by a
// thread it does not have) finds its parent's and takes the runner over.
class OneCall {
 public:
  OneCall(std::atomic<long long>* busy, const char* what) : busy_(busy) {
    FUSEDMOE_CHECK(busy_ != nullptr, "MoERunner::", what,
                   ": this runner was moved from (it holds no layer)");
    const long long me = static_cast<long long>(getpid());
    long long held = 0;
    if (busy_->compare_exchange_strong(held, me)) return;
    FUSEDMOE_CHECK(held != me && busy_->compare_exchange_strong(held, me), "MoERunner::", what,
                   ": called while another call on this runner runs in another thread; a "
                   "runner serves one call at a time (one workspace): serialise the calls or "
                   "use one runner a thread");
  }
  ~OneCall() { busy_->store(0); }
  OneCall(const OneCall&) = delete;
  OneCall& operator=(const OneCall&) = delete;

 private:
  std::atomic<long long>* busy_;
};
}  // namespace

void MoERunner::check_errors() {
  const OneCall one(busy_.get(), "check_errors");
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_) cuda_->check_errors(static_cast<cuda::Stream>(options_.cuda_stream));
#endif
}

void MoERunner::compute_router_logits(const TensorView& hidden_states,
                                      const TensorView& router_logits) {
  const OneCall one(busy_.get(), "compute_router_logits");
  router_logits_into(hidden_states, router_logits);
}

void MoERunner::router_logits_into(const TensorView& hidden_states,
                                   const TensorView& router_logits) {
  const int64_t H = config_.hidden_size, L = config_.num_router_logits();
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_) {
    check_tensor(hidden_states, "hidden_states", hidden_states.dtype(), {-1, H}, true,
                 options_.device);
    const int64_t T = hidden_states.size(0);
    check_tensor(router_logits, "router_logits", DType::kF32, {T, L}, true, options_.device);
    if (T == 0) return;
    cuda_->router_logits(hidden_states, router_logits,
                         static_cast<cuda::Stream>(options_.cuda_stream));
    return;
  }
#endif
  check_tensor(hidden_states, "hidden_states", DType::kF32, {-1, H});
  const int64_t T = hidden_states.size(0);
  check_tensor(router_logits, "router_logits", DType::kF32, {T, L});
  if (T == 0) return;
  ThreadPool& pool = options_.pool ? *options_.pool : ThreadPool::global();
  cpu::gemm_nt_parallel(pool, T, L, H, hidden_states.data_as<const float>(),
                        hidden_states.stride(0), weights_.gate_weight.data(),
                        weights_.gate_weight.dtype(), H,
                        weights_.gate_bias ? weights_.gate_bias->data() : nullptr,
                        weights_.gate_bias ? weights_.gate_bias->dtype() : DType::kF32,
                        router_logits.data_as<float>(), router_logits.stride(0));
}

void MoERunner::forward(const TensorView& hidden_states, const TensorView& output,
                        const TensorView* router_logits, const TensorView* token_ids,
                        const ForwardOutputs* outputs) {
  const OneCall one(busy_.get(), "forward");
  const int64_t H = config_.hidden_size, L = config_.num_router_logits(), k = config_.top_k;
  FUSEDMOE_CHECK(token_ids == nullptr || config_.routing_method == RoutingMethod::kHash,
                 "token_ids: given, but the ", to_string(config_.routing_method),
                 " router does not use them (hash routing only; they would be ignored)");
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_) {
    // Same boundary checks on device tensors (f32, bf16 or f16 activations).
    const Device dev = options_.device;
    check_tensor(hidden_states, "hidden_states", hidden_states.dtype(), {-1, H}, true, dev);
    const int64_t T = hidden_states.size(0);
    check_tensor(output, "output", output.dtype(), {T, H}, true, dev);
    FUSEDMOE_CHECK(!overlaps(output, hidden_states),
                   "output: must not alias hidden_states (the shared expert reads hidden_states "
                   "after the routed output is written)");
    if (router_logits)
      check_tensor(*router_logits, "router_logits", DType::kF32, {T, L}, true, dev);
    if (token_ids) check_tensor(*token_ids, "token_ids", DType::kI32, {T}, true, dev);
    if (outputs && outputs->router_logits.data() != nullptr)
      check_tensor(outputs->router_logits, "outputs.router_logits", DType::kF32, {T, L}, true, dev);
    if (outputs && outputs->topk_ids.data() != nullptr)
      check_tensor(outputs->topk_ids, "outputs.topk_ids", DType::kI32, {T, k}, true, dev);
    if (outputs && outputs->topk_weights.data() != nullptr)
      check_tensor(outputs->topk_weights, "outputs.topk_weights", DType::kF32, {T, k}, true, dev);
    check_written_tensors_do_not_overlap(hidden_states, output, router_logits, token_ids, outputs);
    const auto stream = static_cast<cuda::Stream>(options_.cuda_stream);
    if (cuda_graphs_ && T > 0 && T <= cuda_graphs_->max_capture_size()) {
      cuda_graphs_->forward(hidden_states, output, router_logits, token_ids, outputs, stream);
      if (cuda_ep_) cuda_ep_->replayed();
    } else if (cuda_ep_)
      cuda_ep_->forward(hidden_states, output, router_logits, token_ids, outputs, stream);
    else
      cuda_->forward(hidden_states, output, router_logits, token_ids, outputs, stream);
    return;
  }
#endif
  // ---- boundary checks (nothing is written before they pass) ----
  check_tensor(hidden_states, "hidden_states", DType::kF32, {-1, H});
  const int64_t T = hidden_states.size(0);
  check_tensor(output, "output", DType::kF32, {T, H});
  FUSEDMOE_CHECK(!overlaps(output, hidden_states),
                 "output: must not alias hidden_states (the shared expert reads hidden_states "
                 "after the routed output is written)");
  if (router_logits) check_tensor(*router_logits, "router_logits", DType::kF32, {T, L});
  if (token_ids) check_tensor(*token_ids, "token_ids", DType::kI32, {T});
  // A NaN or Inf input would poison its token's output (and be reported as a
  // NaN router logit): name it here, where the caller put it.
  check_finite_rows(hidden_states, "hidden_states");
  const bool want_logits = outputs && outputs->router_logits.data() != nullptr;
  const bool want_ids = outputs && outputs->topk_ids.data() != nullptr;
  const bool want_weights = outputs && outputs->topk_weights.data() != nullptr;
  if (want_logits)
    check_tensor(outputs->router_logits, "outputs.router_logits", DType::kF32, {T, L});
  if (want_ids) check_tensor(outputs->topk_ids, "outputs.topk_ids", DType::kI32, {T, k});
  if (want_weights)
    check_tensor(outputs->topk_weights, "outputs.topk_weights", DType::kF32, {T, k});
  check_written_tensors_do_not_overlap(hidden_states, output, router_logits, token_ids, outputs);
  ExpertsParams params;
  params.activation = ActivationParams::from_config(config_);
  params.compute_dtype = options_.compute_dtype;
  if (T == 0) {
    if (parallel_) {
      // This rank has no tokens, but the EP / DP group's collectives still run.
      Workspace& ws = *workspace_;
      const TensorView no_ids(ws.get(cpu::kWsTopkIds, 64), DType::kI32, {0, k});
      const TensorView no_weights(ws.get(cpu::kWsTopkWeights, 64), DType::kF32, {0, k});
      parallel_->forward(hidden_states, no_ids, no_weights, params,
                         config_.apply_router_weight_on_input, output, ws);
    }
    return;
  }

  Workspace& ws = *workspace_;
  ThreadPool& pool = options_.pool ? *options_.pool : ThreadPool::global();

  // ---- router ----
  TensorView logits;
  if (router_logits) {
    logits = *router_logits;
  } else if (config_.routing_method == RoutingMethod::kSimulated && !want_logits) {
    logits = TensorView();  // the simulator ignores logits: skip the gate GEMM
  } else if (want_logits) {
    logits = outputs->router_logits;
    router_logits_into(hidden_states, logits);
  } else {
    logits =
        TensorView(ws.get(cpu::kWsRouterLogits, "the router logits, f32 [T, E + Z]", {T, L}, 4),
                   DType::kF32, {T, L});
    router_logits_into(hidden_states, logits);
  }
  const TensorView ids =
      want_ids ? outputs->topk_ids
               : TensorView(ws.get(cpu::kWsTopkIds, "the topk ids, i32 [T, k]", {T, k}, 4),
                            DType::kI32, {T, k});
  const TensorView weights =
      want_weights
          ? outputs->topk_weights
          : TensorView(ws.get(cpu::kWsTopkWeights, "the topk weights, f32 [T, k]", {T, k}, 4),
                       DType::kF32, {T, k});
  try {
    router_->select_experts(logits, ids, weights, token_ids, options_.pool);
  } catch (const Error& e) {
    // NaN in logits this call computed (hidden_states are checked finite
    // above): name where they came from, not an argument the caller did not
    // pass (a gate weight loaded with check_finite = false; trial).
    const std::string what = e.what(), prefix = "router_logits: ";
    if (router_logits || e.code() != ErrorCode::kInvalidArgument || what.rfind(prefix, 0) != 0)
      throw;
    FUSEDMOE_THROW(kInvalidArgument,
                   "the router logits computed from hidden_states and gate_weight (no "
                   "router_logits given): ",
                   what.substr(prefix.size()),
                   " (a non-finite gate_weight / gate_bias, e.g. loaded with check_finite "
                   "off, or a product beyond f32)");
  }
  if (router_logits && want_logits && router_logits->data() != outputs->router_logits.data()) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(outputs->router_logits.data_as<float>() + t * outputs->router_logits.stride(0),
                  router_logits->data_as<const float>() + t * router_logits->stride(0),
                  L * sizeof(float));
  }

  // ---- routed experts (over ranks under a parallel layout) ----
  if (parallel_)
    parallel_->forward(hidden_states, ids, weights, params, config_.apply_router_weight_on_input,
                       output, ws);
  else
    kernel_->forward(hidden_states, ids, weights, weights_.experts, params,
                     config_.apply_router_weight_on_input, output, ws);

  // ---- shared expert: the same Experts machinery with E = 1, every token routed to it ----
  if (!config_.has_shared_expert()) {
    if (parallel_) parallel_->reduce_tp(output);  // the one TP all-reduce (routed only)
    require_finite_output(output);
    return;
  }
  PrepareResult shared;
  if (options_.compute_dtype == DType::kBF16) {
    auto* x = static_cast<float*>(
        ws.get(cpu::kWsSharedInput, "the shared expert's input, f32 [T, H]", {T, H}, 4));
    const float* src = hidden_states.data_as<const float>();
    const int64_t ldh = hidden_states.stride(0);
    pool.parallel_for(T, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < H; ++h) x[t * H + h] = round_to_bf16(src[t * ldh + h]);
    });
    shared.permuted = TensorView(x, DType::kF32, {T, H});
  } else {
    shared.permuted = hidden_states;
  }
  auto* offsets = static_cast<int64_t*>(ws.get(cpu::kWsSharedOffsets, 2 * sizeof(int64_t)));
  offsets[0] = 0;
  offsets[1] = T;
  shared.expert_offsets = TensorView(offsets, DType::kI64, {2});
  auto* shared_out = static_cast<float*>(
      ws.get(cpu::kWsSharedOutput, "the shared expert's output, f32 [T, H]", {T, H}, 4));
  kernel_->experts().apply(shared, *weights_.shared_experts, params,
                           TensorView(shared_out, DType::kF32, {T, H}), ws);

  // Qwen2-MoE: shared *= sigmoid(hidden_states . shared_expert_gate[0]).
  float* gate = nullptr;
  if (config_.has_shared_expert_gate) {
    gate = static_cast<float*>(
        ws.get(cpu::kWsSharedGate, "the shared expert's gate, f32 [T]", {T}, 4));
    cpu::gemm_nt(T, 1, H, hidden_states.data_as<const float>(), hidden_states.stride(0),
                 weights_.shared_expert_gate->data(), weights_.shared_expert_gate->dtype(), H,
                 nullptr, DType::kF32, gate, 1);
    for (int64_t t = 0; t < T; ++t) gate[t] = 1.0f / (1.0f + std::exp(-gate[t]));
  }
  float* out = output.data_as<float>();
  const int64_t ldo = output.stride(0);
  pool.parallel_for(T, [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) {
      float* o = out + t * ldo;
      const float* s = shared_out + t * H;
      if (gate) {
        const float g = gate[t];
        for (int64_t h = 0; h < H; ++h) o[h] += g * s[h];
      } else {
        for (int64_t h = 0; h < H; ++h) o[h] += s[h];
      }
    }
  });
  // The one TP all-reduce, of routed + shared together.
  if (parallel_) parallel_->reduce_tp(output);
  require_finite_output(output);
}

size_t MoERunner::cuda_ep_window_bytes() const {
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_ep_) return cuda_ep_->window_bytes();
#endif
  return 0;
}

size_t MoERunner::num_cuda_graphs() const {
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_graphs_) return cuda_graphs_->num_graphs();
#endif
  return 0;
}

const EpStats* MoERunner::cuda_ep_stats() const {
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_ep_) return &cuda_ep_->stats();
#endif
  return nullptr;
}

size_t MoERunner::cuda_workspace_bytes() const {
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda_) return cuda_->workspace_bytes();
#endif
  return 0;
}

Tensor MoERunner::forward(const TensorView& hidden_states, const TensorView* router_logits) {
  FUSEDMOE_CHECK(busy_ != nullptr,
                 "MoERunner::forward: this runner was moved from (it holds no "
                 "layer)");
  if (cuda_)
    FUSEDMOE_THROW(kUnsupported,
                   "MoERunner::forward: the allocating overload is CPU-only; pass a "
                   "device output tensor");
  check_tensor(hidden_states, "hidden_states", DType::kF32, {-1, config_.hidden_size});
  Tensor out = Tensor::empty(DType::kF32, {hidden_states.size(0), config_.hidden_size});
  forward(hidden_states, out.view(), router_logits);
  return out;
}

}  // namespace fusedmoe
