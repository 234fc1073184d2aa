// fusedmoe internal: CUDA-graph replay of a layer forward (CudaMoELayer or CudaEpMoELayer) at fixed
// capture sizes.
//
// A forward of T tokens runs as the graph captured for the smallest capture
// size S >= T (captured on first use, then replayed): the caller's rows are
// copied into static buffers of S rows, the graph runs with the device scalar
// num_valid_tokens = T (rows T..S-1 are padding: routed to no expert, never
// counted, and their results are not copied back), and the first T rows of
// the results are copied to the caller's buffers. One graph per (S, input and
// output dtypes, which optional inputs/outputs are given). Replay saves the
// launch overhead of the ~10 kernels of a forward (decode-size T).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_moe_layer.h"

namespace fusedmoe::cuda {

class CudaGraphLayer {
 public:
  // CudaMoELayer::forward's arguments; num_valid_tokens: a device i32 scalar.
  using Forward = std::function<void(const TensorView& hidden_states, const TensorView& output,
                                     const TensorView* router_logits, const TensorView* token_ids,
                                     const ForwardOutputs* outputs, Stream stream,
                                     const int32_t* num_valid_tokens)>;
  // The graphs capture `forward` for a layer of `config` taking at most
  // max_num_tokens tokens a call. capture_sizes: positive, at most
  // max_num_tokens (sorted and de-duplicated here); throws
  // Error(kInvalidArgument) otherwise.
  CudaGraphLayer(const MoEConfig& config, int64_t max_num_tokens, Forward forward,
                 std::vector<int64_t> capture_sizes);
  ~CudaGraphLayer();
  CudaGraphLayer(const CudaGraphLayer&) = delete;
  CudaGraphLayer& operator=(const CudaGraphLayer&) = delete;

  int64_t max_capture_size() const { return sizes_.back(); }
  const std::vector<int64_t>& capture_sizes() const { return sizes_; }
  // The capture size a forward of `num_tokens` tokens replays (<= max_capture_size()).
  int64_t capture_size_for(int64_t num_tokens) const;
  // Number of graphs captured so far.
  size_t num_graphs() const { return graphs_.size(); }

  // Same contract as CudaMoELayer::forward, for 0 < T <= max_capture_size().
  // Not capturable itself (it may capture); enqueued on `stream`, no host sync.
  void forward(const TensorView& hidden_states, const TensorView& output,
               const TensorView* router_logits, const TensorView* token_ids,
               const ForwardOutputs* outputs, Stream stream);

 private:
  struct Buffers;
  // (S, hidden dtype, output dtype, flags: logits in, token ids, want logits/ids/weights)
  using Key = std::tuple<int64_t, int, int, int>;
  Forward forward_;
  std::vector<int64_t> sizes_;
  std::unique_ptr<Buffers> buf_;
  std::map<Key, void*> graphs_;  // cudaGraphExec_t
};

}  // namespace fusedmoe::cuda
