// fusedmoe CUDA: CudaGraphLayer — capture once per capture size, replay with padding.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "fusedmoe/core/error.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_graph_layer.h"

namespace fusedmoe::cuda {
namespace {

__global__ void store_i32_kernel(int32_t* dst, int32_t value) {
  *dst = value;
}

// Copies `rows` rows of `bytes_per_row` between row-strided buffers on `stream`.
void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t bytes_per_row,
               int64_t rows, cudaStream_t stream) {
  if (rows == 0) return;
  FUSEDMOE_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, bytes_per_row,
                                        static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                        stream));
}

size_t row_pitch(const TensorView& t) {
  return static_cast<size_t>(t.stride(0)) * dtype_size(t.dtype());
}

}  // namespace

// Static buffers of max_capture_size rows: inputs, outputs, router results.
struct CudaGraphLayer::Buffers {
  int64_t rows = 0, hidden = 0, logits = 0, top_k = 0;
  void* mem = nullptr;
  char* hidden_in = nullptr;  // f32 or bf16 [rows, H]
  char* out = nullptr;        // f32 or bf16 [rows, H]
  float* logits_in = nullptr;
  int32_t* token_ids = nullptr;
  float* logits_out = nullptr;
  int32_t* ids_out = nullptr;
  float* weights_out = nullptr;
  int32_t* num_valid = nullptr;
  cudaStream_t capture = nullptr;
  ~Buffers() {
    if (capture) cudaStreamDestroy(capture);
    if (mem) cudaFree(mem);
  }
};

CudaGraphLayer::CudaGraphLayer(const MoEConfig& c, int64_t max_num_tokens, Forward forward,
                               std::vector<int64_t> capture_sizes)
    : forward_(std::move(forward)),
      sizes_(std::move(capture_sizes)),
      buf_(std::make_unique<Buffers>()) {
  FUSEDMOE_CHECK(!sizes_.empty(), "cuda_graph_sizes: expected at least one capture size");
  std::sort(sizes_.begin(), sizes_.end());
  sizes_.erase(std::unique(sizes_.begin(), sizes_.end()), sizes_.end());
  FUSEDMOE_CHECK(sizes_.front() > 0, "cuda_graph_sizes: expected positive sizes, got ",
                 sizes_.front());
  FUSEDMOE_CHECK(sizes_.back() <= max_num_tokens,
                 "cuda_graph_sizes: expected sizes <= max_num_tokens = ", max_num_tokens, ", got ",
                 sizes_.back());
  Buffers& b = *buf_;
  b.rows = sizes_.back();
  b.hidden = c.hidden_size;
  b.logits = c.num_router_logits();
  b.top_k = c.top_k;
  const size_t R = static_cast<size_t>(b.rows);
  const size_t parts[] = {R * b.hidden * 4, R * b.hidden * 4, R * b.logits * 4, R * 4,
                          R * b.logits * 4, R * b.top_k * 4,  R * b.top_k * 4,  4};
  size_t total = 0;
  for (size_t p : parts) total += (p + 255) / 256 * 256;
  FUSEDMOE_CUDA_CHECK(cudaMalloc(&b.mem, total));
  // Zeros: padding rows read finite values until real rows have passed through.
  FUSEDMOE_CUDA_CHECK(cudaMemset(b.mem, 0, total));
  char* p = static_cast<char*>(b.mem);
  char* carved[8];
  for (int i = 0; i < 8; ++i) {
    carved[i] = p;
    p += (parts[i] + 255) / 256 * 256;
  }
  b.hidden_in = carved[0];
  b.out = carved[1];
  b.logits_in = reinterpret_cast<float*>(carved[2]);
  b.token_ids = reinterpret_cast<int32_t*>(carved[3]);
  b.logits_out = reinterpret_cast<float*>(carved[4]);
  b.ids_out = reinterpret_cast<int32_t*>(carved[5]);
  b.weights_out = reinterpret_cast<float*>(carved[6]);
  b.num_valid = reinterpret_cast<int32_t*>(carved[7]);
  FUSEDMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&b.capture, cudaStreamNonBlocking));
  FUSEDMOE_CUDA_CHECK(cudaDeviceSynchronize());
}

CudaGraphLayer::~CudaGraphLayer() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

int64_t CudaGraphLayer::capture_size_for(int64_t num_tokens) const {
  FUSEDMOE_CHECK(num_tokens > 0 && num_tokens <= sizes_.back(),
                 "hidden_states: graph replay takes 1 to ", sizes_.back(),
                 " tokens (the largest capture size), got ", num_tokens);
  return *std::lower_bound(sizes_.begin(), sizes_.end(), num_tokens);
}

void CudaGraphLayer::forward(const TensorView& hidden_states, const TensorView& output,
                             const TensorView* router_logits, const TensorView* token_ids,
                             const ForwardOutputs* outputs, Stream stream) {
  Buffers& b = *buf_;
  const int64_t T = hidden_states.size(0);
  const int64_t S = capture_size_for(T);
  FUSEDMOE_CHECK(hidden_states.rows_contiguous() && output.rows_contiguous(),
                 "hidden_states, output: expected contiguous rows");
  const bool want_logits = outputs && outputs->router_logits.data() != nullptr;
  const bool want_ids = outputs && outputs->topk_ids.data() != nullptr;
  const bool want_weights = outputs && outputs->topk_weights.data() != nullptr;
  const int flags = (router_logits ? 1 : 0) | (token_ids ? 2 : 0) | (want_logits ? 4 : 0) |
                    (want_ids ? 8 : 0) | (want_weights ? 16 : 0);
  const DType in_dt = hidden_states.dtype(), out_dt = output.dtype();
  const Device dev = hidden_states.device();
  const size_t H = static_cast<size_t>(b.hidden), L = static_cast<size_t>(b.logits),
               k = static_cast<size_t>(b.top_k);

  // Static views of S rows (what the graph reads and writes).
  TensorView s_in(b.hidden_in, in_dt, {S, b.hidden}, dev);
  TensorView s_out(b.out, out_dt, {S, b.hidden}, dev);
  TensorView s_logits(b.logits_in, DType::kF32, {S, b.logits}, dev);
  TensorView s_tokens(b.token_ids, DType::kI32, {S}, dev);
  ForwardOutputs s_outputs;
  if (want_logits)
    s_outputs.router_logits = TensorView(b.logits_out, DType::kF32, {S, b.logits}, dev);
  if (want_ids) s_outputs.topk_ids = TensorView(b.ids_out, DType::kI32, {S, b.top_k}, dev);
  if (want_weights)
    s_outputs.topk_weights = TensorView(b.weights_out, DType::kF32, {S, b.top_k}, dev);

  const Key key{S, static_cast<int>(in_dt), static_cast<int>(out_dt), flags};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // Capture on a private stream (thread-local mode: other threads' CUDA calls
    // are unaffected); nothing runs until the graph is launched below.
    cudaGraph_t graph = nullptr;
    FUSEDMOE_CUDA_CHECK(cudaStreamBeginCapture(b.capture, cudaStreamCaptureModeThreadLocal));
    try {
      forward_(s_in, s_out, router_logits ? &s_logits : nullptr, token_ids ? &s_tokens : nullptr,
               outputs ? &s_outputs : nullptr, b.capture, b.num_valid);
    } catch (...) {
      cudaStreamEndCapture(b.capture, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    FUSEDMOE_CUDA_CHECK(cudaStreamEndCapture(b.capture, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    FUSEDMOE_CUDA_CHECK(err);
    it = graphs_.emplace(key, exec).first;
  }

  // Inputs in, graph, results out: all on the caller's stream.
  copy_rows(b.hidden_in, H * dtype_size(in_dt), hidden_states.data(), row_pitch(hidden_states),
            H * dtype_size(in_dt), T, stream);
  if (router_logits)
    copy_rows(b.logits_in, L * 4, router_logits->data(), row_pitch(*router_logits), L * 4, T,
              stream);
  if (token_ids)
    FUSEDMOE_CUDA_CHECK(cudaMemcpyAsync(b.token_ids, token_ids->data(), static_cast<size_t>(T) * 4,
                                        cudaMemcpyDeviceToDevice, stream));
  store_i32_kernel<<<1, 1, 0, stream>>>(b.num_valid, static_cast<int32_t>(T));
  FUSEDMOE_CUDA_CHECK_LAUNCH();
  FUSEDMOE_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(it->second), stream));
  copy_rows(output.data(), row_pitch(output), b.out, H * dtype_size(out_dt), H * dtype_size(out_dt),
            T, stream);
  if (want_logits)
    copy_rows(outputs->router_logits.data(), row_pitch(outputs->router_logits), b.logits_out, L * 4,
              L * 4, T, stream);
  if (want_ids)
    copy_rows(outputs->topk_ids.data(), row_pitch(outputs->topk_ids), b.ids_out, k * 4, k * 4, T,
              stream);
  if (want_weights)
    copy_rows(outputs->topk_weights.data(), row_pitch(outputs->topk_weights), b.weights_out, k * 4,
              k * 4, T, stream);
}

}  // namespace fusedmoe::cuda
