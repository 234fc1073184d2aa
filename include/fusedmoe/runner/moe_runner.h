// fusedmoe: MoERunner — one MoE layer forward, router to output.
//
// forward(hidden_states [T, H]):
//   router_logits = hidden_states . gate_weight^T (+ gate_bias)   unless given
//   topk_ids, topk_weights = router(router_logits)                (routing/)
//   routed = modular kernel(hidden_states, topk_ids, topk_weights) (kernels/)
//   shared = shared_expert(hidden_states)  [* sigmoid(hidden . shared_expert_gate)]
//   output = routed + shared
// routed_scaling_factor is applied once, in the router, to topk_weights (as HF
// DeepseekV3 does). Llama-4 scales the expert input (apply_router_weight_on_input).
// The order of operations per architecture follows the HF modeling files.
//
// Parallel layouts (config.parallel, RunnerOptions.communicator): each rank
// brings its own tokens (EP / DP groups; TP ranks of a group bring the same
// ones) and computes the routed experts with DistributedExperts; the shared
// expert runs once per token (on the token's rank; TP ranks each compute their
// slice of it); routed + shared are summed over the TP group by one
// all-reduce; expert biases are added once (w2_bias on tp_rank 0 only).
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/experts/expert_weights.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/distributed_experts.h"
#include "fusedmoe/routing/router.h"

namespace fusedmoe {

namespace cuda {
class CudaMoELayer;
class CudaGraphLayer;
class CudaEpMoELayer;
class SharedWorkspace;  // kernels/cuda.h
}  // namespace cuda

struct MoELayerWeights {
  Tensor gate_weight;                           // f32/bf16 [E + num_zero_experts, H] (router)
  std::optional<Tensor> gate_bias;              // f32/bf16 [E + num_zero_experts]
  RouterParams router_params;                   // e_score_correction_bias, hash_table
  ExpertWeights experts;                        // routed experts, E of them
  std::optional<ExpertWeights> shared_experts;  // E = 1, I = shared_intermediate_size
  std::optional<Tensor> shared_expert_gate;     // f32/bf16 [1, H] (Qwen2-MoE)

  size_t nbytes() const;
  // Throws Error(kInvalidArgument) naming the tensor when a shape or dtype does
  // not match `config`, or a tensor the config needs is missing.
  void validate(const MoEConfig& config) const;
};

struct RunnerOptions {
  // kF32 or kBF16 (CPU); kBF16 or kF16 (CUDA: the half type the expert weights
  // are kept in on the device — f32 / bf16 weights converted, an f16 checkpoint,
  // which the loader reads as exact f32, kept in f16 with kF16 — and that the
  // expert inputs are rounded to; f32 accumulation either way; a weight beyond
  // the f16 range is an error with kF16).
  DType compute_dtype = DType::kF32;
  ThreadPool* pool = nullptr;  // nullptr: ThreadPool::global()
  // Backend: CPU (default) or CUDA (builds with FUSEDMOE_WITH_CUDA; compute_dtype
  // kBF16 or kF16). With CUDA the weights are uploaded to the current device at
  // construction, a workspace for max_num_tokens tokens is allocated once, and
  // forward() takes device tensors (hidden_states/output f32, bf16 or f16: other
  // activation types are converted to the weights' type; an f16 output value
  // beyond 65504 becomes +-inf, rounded to nearest as torch's .half()), enqueues
  // on cuda_stream (a cudaStream_t; nullptr: the legacy default stream) and
  // returns without synchronising or allocating (CUDA-graph capturable).
  Device device{};
  int64_t max_num_tokens = 0;  // CUDA: the largest T forward() accepts (0: 8192)
  void* cuda_stream = nullptr;
  // CUDA: capture sizes for graph replay (e.g. 1, 2, 4, 8, 16, 32, 64; each
  // <= max_num_tokens; empty: off). A forward of 0 < T <= the largest size
  // replays the CUDA graph of the smallest size S >= T, captured on its first
  // use: inputs are copied into static buffers of S rows, rows T..S-1 are
  // padding routed to no expert (not counted), and T rows are copied back.
  // Larger T run eagerly. Such a forward is not itself capturable. Under GPU
  // expert parallelism (below) the peer transport only (kInvalidArgument over
  // nccl): each rank replays the graphs of its own T (ranks may pick
  // different sizes; a rank with T = 0 or above the largest size runs
  // eagerly), max_num_tokens per rank; cuda_ep_stats() reports a replay as
  // a forward (its rows, bytes and kernel times, which the graph records).
  std::vector<int64_t> cuda_graph_sizes;
  // CUDA backend with a communicator over device memory (make_nccl_communicator,
  // one GPU per rank, the current device): expert parallelism on GPUs,
  // ep_size = communicator size (1 included), tp_size = dp_size = 1; each
  // rank's forward() takes its own tokens (T <= max_num_tokens, may be 0) and
  // is collective. Route on the device, dispatch each token once per
  // destination rank, local experts, combine. Two transports
  // (FUSEDMOE_EP_TRANSPORT, see EpTransport):
  //  - nccl: combine in slot order, bit-identical to one GPU on all ranks'
  //    tokens given the same router_logits (with each rank's own gate GEMM:
  //    within ~1e-7 relative, as the device gate GEMM's summation order
  //    depends on T). It synchronises cuda_stream at each exchange (the counts
  //    go to the host), so it is not graph-capturable. Its local experts run on
  //    the mma.sync kernels at every T: bit-identical to one GPU run with
  //    FUSEDMOE_CUDA_EXPERTS=mma; where one GPU picks the sm_90a wgmma path
  //    (many rows per expert), the two agree to bf16 rounding.
  //  - peer (one host, one GPU per rank): kernels store into the other GPUs'
  //    memory, no host synchronisation (capturable); each rank sums its slots
  //    of a token before sending one row back, so within f32 rounding of one
  //    GPU; the local experts take the kernels one GPU would (sm_90a included).
  // The workspace holds ep_size * max_num_tokens received rows.
  // Parallel layouts (config.parallel sizes > 1; CPU backend): the communicator
  // over all ranks of the layout (parallel/communicator.h ParallelGroups; its
  // rank must match config.parallel's ranks; required when a parallel size is
  // above 1: nullptr is a one-rank world, refused then). The weights
  // may be the whole layer (the runner keeps this rank's share) or only this
  // rank's share, as load_moe_layer with LoadOptions.parallel reads it.
  std::shared_ptr<Communicator> communicator;
  // Expert parallelism's dispatch payload. CPU (ep_size > 1, dp_size 1): see
  // DispatchDType. CUDA: auto (or bf16 with bf16 compute) sends the experts'
  // half type; fp8 (peer transport only) e4m3 with 1 x 128 group scales,
  // dequantised by the receiver (about half the bytes; 3e-2 to 4e-2 relative
  // L2 from a float64 reference on the HF fixtures, vs 4e-3 for bf16).
  DispatchDType dispatch_dtype = DispatchDType::kAuto;
  // CUDA expert parallelism, peer transport only: the combine rows, f32 or
  // bf16 (half the bytes; each rank's partial sum of a token rounded to bf16
  // once). Elsewhere f32 only.
  DType combine_dtype = DType::kF32;
  // CUDA: the workspace's scratch from this SharedWorkspace (kernels/cuda.h),
  // shared with the other layers given the same one, instead of an allocation
  // of this layer's own; their forward() calls must then run one at a time in
  // stream order (a model's layers do). nullptr: the layer's own. Under GPU
  // expert parallelism (peer transport) the layers given one with the same
  // communicator, hidden size, top_k, max_num_tokens and payloads also share
  // the peer window (cuda_ep_window_bytes()).
  std::shared_ptr<cuda::SharedWorkspace> cuda_workspace;
};

// Optional caller buffers that receive the router's results.
struct ForwardOutputs {
  TensorView router_logits;  // f32 [T, E + Z]
  TensorView topk_ids;       // i32 [T, k]
  TensorView topk_weights;   // f32 [T, k]
};

// One runner serves one call at a time (it owns one workspace, its CUDA
// graphs and, on the CPU, uses one thread pool): forward(),
// compute_router_logits() and check_errors() called while another of them
// runs in another thread throw Error(kInvalidArgument) saying so, before
// touching anything (serialise the calls, or use a runner per thread). A
// process forked while a call ran may use the runner in the child. These
// calls on a runner that was moved from throw Error(kInvalidArgument) too.
class MoERunner {
 public:
  // Validates config and weights (Error(kInvalidArgument) naming what is wrong).
  MoERunner(MoEConfig config, MoELayerWeights weights, RunnerOptions options = {});
  ~MoERunner();
  MoERunner(MoERunner&&) noexcept;

  // hidden_states f32 [T, H] (rows contiguous, row stride may be > H);
  // output f32 [T, H] (overwritten; must not alias hidden_states);
  // router_logits: optional f32 [T, E + Z] (then the gate GEMM is skipped);
  // token_ids: i32 [T], for hash routing only; outputs: optional router results.
  // output and the outputs given each overlap no other tensor of the call
  // (outputs->router_logits may be router_logits itself).
  // T = 0 is valid. Throws Error(kInvalidArgument) on any shape/dtype mismatch,
  // before writing the output; on the CPU also for NaN router logits or token
  // ids outside the hash table (before writing the output), and when the
  // output holds a NaN / Inf (a finite input overflowing f32 in the experts),
  // naming the token and column (the output is then written but invalid). On
  // CUDA, NaN logits and bad hash token ids are recorded on the device and
  // reported by check_errors() (forward cannot: no host sync).
  void forward(const TensorView& hidden_states, const TensorView& output,
               const TensorView* router_logits = nullptr, const TensorView* token_ids = nullptr,
               const ForwardOutputs* outputs = nullptr);
  // Convenience: allocates and returns the output (CPU backend only).
  Tensor forward(const TensorView& hidden_states, const TensorView* router_logits = nullptr);

  // CUDA backend: synchronises cuda_stream, then throws Error(kInvalidArgument)
  // naming the first token whose router logits held a NaN, or (hash routing)
  // whose token id was outside [0, hash_vocab_size), in a forward since the
  // last call (detected by the routing kernels, which route such a hash token
  // to no expert; reporting needs a host sync, so forward() cannot). No-op on
  // the CPU backend, where forward() itself throws for both.
  void check_errors();

  // router_logits f32 [T, E + Z] = hidden_states . gate_weight^T (+ gate_bias).
  void compute_router_logits(const TensorView& hidden_states, const TensorView& router_logits);

  // CUDA backend: the stream later forward() / compute_router_logits() calls
  // enqueue on (a cudaStream_t; nullptr: the legacy default stream), replacing
  // RunnerOptions::cuda_stream — for front ends that follow the caller's
  // current stream (PyTorch, CuPy). Not thread-safe against a running forward.
  void set_cuda_stream(void* stream) { options_.cuda_stream = stream; }

  const MoEConfig& config() const { return config_; }
  const MoELayerWeights& weights() const { return weights_; }
  const Router& router() const {
    FUSEDMOE_CHECK(router_ != nullptr,
                   "MoERunner::router: this runner was moved from (it holds "
                   "no layer)");
    return *router_;
  }
  // The routed experts over ranks when config.parallel is not all 1, else null
  // (expert map, groups, dispatch/combine statistics of the last forward).
  const DistributedExperts* distributed() const { return parallel_.get(); }
  // CUDA expert parallelism: rows, bytes and times of the last forward's
  // dispatch and combine on this rank; null on other paths.
  const EpStats* cuda_ep_stats() const;
  // GPU expert parallelism over the peer transport: bytes of the peer window
  // (records in, rows back) this layer allocated; 0 where it shares an
  // earlier layer's through cuda_workspace (same communicator, hidden size,
  // top_k, max_num_tokens and payloads), and on other paths.
  size_t cuda_ep_window_bytes() const;
  // CUDA graph replay (RunnerOptions::cuda_graph_sizes): the graphs captured
  // so far, one per capture size and call signature used; 0 without it.
  size_t num_cuda_graphs() const;
  // CUDA backend: bytes of the forward's scratch, the layer's own or its share
  // of RunnerOptions::cuda_workspace (0 on the CPU).
  size_t cuda_workspace_bytes() const;

 private:
  // compute_router_logits without taking the runner (forward's own use).
  void router_logits_into(const TensorView& hidden_states, const TensorView& router_logits);

  MoEConfig config_;
  MoELayerWeights weights_;
  RunnerOptions options_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<ModularKernel> kernel_;
  std::unique_ptr<Workspace> workspace_;
  std::unique_ptr<cuda::CudaMoELayer> cuda_;           // CUDA backend, else null
  std::unique_ptr<cuda::CudaGraphLayer> cuda_graphs_;  // cuda_graph_sizes given, else null
  std::unique_ptr<cuda::CudaEpMoELayer> cuda_ep_;      // CUDA + device communicator, else null
  std::unique_ptr<DistributedExperts> parallel_;       // parallel layouts, else null
  // The process id of the running call's caller, 0 when none (null once moved from).
  std::unique_ptr<std::atomic<long long>> busy_ = std::make_unique<std::atomic<long long>>(0);
};

}  // namespace fusedmoe
