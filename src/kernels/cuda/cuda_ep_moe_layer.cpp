// fusedmoe CUDA: CudaEpMoELayer — GPU expert-parallel dispatch / experts / combine.
#include "kernels/cuda/cuda_ep_moe_layer.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ep_dispatch.h"

namespace fusedmoe::cuda {

namespace {

class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t bytes) {
    if (bytes > 0) FUSEDMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceArray() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct CudaEpMoELayer::Impl {
  CudaMoELayer* layer = nullptr;
  MoEConfig cfg;
  std::shared_ptr<Communicator> comm;
  ExpertMap map;
  int64_t max_tokens = 0;  // per rank
  int P = 1, me = 0;
  int64_t rec = 0;
  DeviceArray rank_of, local_of;         // i32 [E]
  DeviceArray row_pos, slot_pos;         // i32 [Tmax * P], [Tmax * k]
  DeviceArray counts_send, counts_recv;  // i64 [P * 3]
  DeviceArray send, recv;                // records [Tmax * min(P, k)], [P * Tmax]
  DeviceArray ids_l, w_l, cpos;          // [P * Tmax * k]
  DeviceArray csend, crecv, y;           // f32 [P * Tmax * k, H], [Tmax * k, H], [Tmax * k, H]
  EpStats stats;
};

CudaEpMoELayer::CudaEpMoELayer(CudaMoELayer& layer, const MoEConfig& config,
                               std::shared_ptr<Communicator> comm, ExpertMap map,
                               int64_t max_tokens_per_rank)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  FUSEDMOE_CHECK(comm != nullptr, "CudaEpMoELayer: communicator is null");
  FUSEDMOE_CHECK(comm->device_buffers(),
                 "communicator: the CUDA EP path needs a communicator "
                 "over device memory (make_nccl_communicator), got backend ",
                 comm->backend());
  FUSEDMOE_CHECK(map.ep_size() == comm->size(), "ep_size: expected the communicator size ",
                 comm->size(), ", got ", map.ep_size());
  FUSEDMOE_CHECK(map.num_experts() == config.num_experts, "expert map: expected ",
                 config.num_experts, " experts, got ", map.num_experts());
  FUSEDMOE_CHECK(max_tokens_per_rank > 0, "max_tokens_per_rank: expected > 0, got ",
                 max_tokens_per_rank);
  s.layer = &layer;
  s.cfg = config;
  s.comm = std::move(comm);
  s.map = std::move(map);
  s.max_tokens = max_tokens_per_rank;
  s.P = s.comm->size();
  s.me = s.comm->rank();
  FUSEDMOE_CHECK(layer.max_num_tokens() >= s.P * max_tokens_per_rank,
                 "CudaEpMoELayer: the layer's max_num_tokens must be >= ep_size * "
                 "max_tokens_per_rank = ",
                 s.P * max_tokens_per_rank, ", got ", layer.max_num_tokens());
  const int64_t E = config.num_experts, k = config.top_k, H = config.hidden_size;
  const int64_t Tm = max_tokens_per_rank, P = s.P;
  s.rec = ep_record_bytes(H, k);
  std::vector<int32_t> rank_of(E), local_of(E);
  for (int64_t e = 0; e < E; ++e) {
    rank_of[e] = s.map.rank_of(e);
    local_of[e] = static_cast<int32_t>(s.map.local_id(e));
  }
  s.rank_of = DeviceArray(4 * E);
  s.local_of = DeviceArray(4 * E);
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpy(s.rank_of.as<void>(), rank_of.data(), 4 * E, cudaMemcpyHostToDevice));
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpy(s.local_of.as<void>(), local_of.data(), 4 * E, cudaMemcpyHostToDevice));
  s.row_pos = DeviceArray(4 * Tm * P);
  s.slot_pos = DeviceArray(4 * Tm * k);
  s.counts_send = DeviceArray(8 * 3 * P);
  s.counts_recv = DeviceArray(8 * 3 * P);
  s.send = DeviceArray(s.rec * Tm * std::min<int64_t>(P, k));
  s.recv = DeviceArray(s.rec * Tm * P);
  s.ids_l = DeviceArray(4 * Tm * P * k);
  s.w_l = DeviceArray(4 * Tm * P * k);
  s.cpos = DeviceArray(4 * Tm * P * k);
  s.csend = DeviceArray(4 * Tm * P * k * H);
  s.crecv = DeviceArray(4 * Tm * k * H);
  s.y = DeviceArray(4 * Tm * k * H);
}

CudaEpMoELayer::~CudaEpMoELayer() = default;

const EpStats& CudaEpMoELayer::stats() const {
  return impl_->stats;
}
const ExpertMap& CudaEpMoELayer::expert_map() const {
  return impl_->map;
}

void CudaEpMoELayer::forward(const TensorView& hidden_states, const TensorView& output,
                             const TensorView* router_logits, const TensorView* token_ids,
                             const ForwardOutputs* outputs, Stream stream) {
  using Clock = std::chrono::steady_clock;
  Impl& s = *impl_;
  const int P = s.P, me = s.me;
  const int64_t T = hidden_states.size(0), k = s.cfg.top_k, H = s.cfg.hidden_size;
  FUSEDMOE_CHECK(T <= s.max_tokens, "hidden_states: at most max_num_tokens = ", s.max_tokens,
                 " tokens per rank (RunnerOptions::max_num_tokens), got ", T);
  CudaMoELayer& layer = *s.layer;
  EpStats st;

  // ---- 1. route ----
  layer.ep_route(hidden_states, router_logits, token_ids, outputs, stream);

  // ---- 2. layout + pack ----
  // Phase boundaries are host-synchronised (the exchanges need it anyway), so
  // the dispatch / combine times hold only their own work.
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto t0 = Clock::now();
  ep_layout(layer.topk_ids(), T, static_cast<int>(k), s.rank_of.as<int32_t>(), P,
            s.row_pos.as<int32_t>(), s.slot_pos.as<int32_t>(), s.counts_send.as<int64_t>(), stream);
  ep_pack(layer.expert_input(), layer.topk_ids(), layer.topk_weights(), T, static_cast<int>(k), H,
          s.rank_of.as<int32_t>(), s.local_of.as<int32_t>(), P, s.row_pos.as<int32_t>(),
          s.counts_send.as<int64_t>(), s.send.as<void>(), stream);
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the communicator does not wait for it

  // ---- 3. counts, then records ----
  std::vector<int64_t> c24(P, 24), d24(P);
  for (int p = 0; p < P; ++p) d24[p] = 24 * p;
  s.comm->all_to_all_v(s.counts_send.as<void>(), c24, d24, s.counts_recv.as<void>(), c24, d24);
  std::vector<int64_t> cs(3 * P), cr(3 * P);
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpyAsync(cs.data(), s.counts_send.as<void>(), 24 * P, cudaMemcpyDeviceToHost, stream));
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpyAsync(cr.data(), s.counts_recv.as<void>(), 24 * P, cudaMemcpyDeviceToHost, stream));
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
  int64_t M = 0, sent_rows = 0, t_global = 0;
  for (int p = 0; p < P; ++p) {
    FUSEDMOE_CHECK(cr[3 * p + 2] <= s.max_tokens && cr[3 * p] <= cr[3 * p + 2],
                   "all_to_all_v: rank ", p, " announced ", cr[3 * p], " rows of ", cr[3 * p + 2],
                   " tokens; expected at most max_num_tokens = ", s.max_tokens,
                   " (every rank must use the same max_num_tokens)");
    sd[p] = sent_rows * s.rec;
    sc[p] = cs[3 * p] * s.rec;
    sent_rows += cs[3 * p];
    rd[p] = M * s.rec;
    rc[p] = cr[3 * p] * s.rec;
    M += cr[3 * p];
    t_global += cr[3 * p + 2];
  }
  // The shared expert (side stream) overlaps the exchange and the experts.
  layer.ep_shared(T, t_global, stream);
  s.comm->all_to_all_v(s.send.as<void>(), sc, sd, s.recv.as<void>(), rc, rd);
  st.dispatch_rows_sent = sent_rows;
  st.dispatch_rows_received = M;
  for (int p = 0; p < P; ++p) {
    if (p == me) continue;
    st.dispatch_bytes_sent += sc[p];
    st.dispatch_bytes_received += rc[p];
  }
  st.dispatch_seconds = seconds_since(t0);

  // ---- 4. local experts on the received rows ----
  ep_unpack(s.recv.as<void>(), M, static_cast<int>(k), H, s.ids_l.as<int32_t>(), s.w_l.as<float>(),
            s.cpos.as<int32_t>(), stream);
  const float* y_local = layer.experts(s.recv.as<uint16_t>(), s.rec / 2, s.ids_l.as<int32_t>(),
                                       s.w_l.as<float>(), M, t_global, stream);

  // ---- 5. combine ----
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto t1 = Clock::now();
  ep_combine_pack(y_local, s.cpos.as<int32_t>(), M, static_cast<int>(k), H, s.csend.as<float>(),
                  stream);
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<int64_t> bc(P), bd(P), gc(P), gd(P);  // back: send, get: receive (bytes)
  int64_t off_b = 0, off_g = 0;
  for (int p = 0; p < P; ++p) {
    bd[p] = off_b;
    bc[p] = cr[3 * p + 1] * H * 4;
    off_b += bc[p];
    gd[p] = off_g;
    gc[p] = cs[3 * p + 1] * H * 4;
    off_g += gc[p];
  }
  s.comm->all_to_all_v(s.csend.as<void>(), bc, bd, s.crecv.as<void>(), gc, gd);
  for (int p = 0; p < P; ++p) {
    if (p == me) continue;
    st.combine_bytes_sent += bc[p];
    st.combine_bytes_received += gc[p];
  }
  ep_combine_unpack(s.crecv.as<float>(), layer.topk_ids(), s.slot_pos.as<int32_t>(),
                    s.rank_of.as<int32_t>(), s.counts_send.as<int64_t>(), P, T, static_cast<int>(k),
                    H, s.y.as<float>(), stream);
  FUSEDMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  st.combine_seconds = seconds_since(t1);
  layer.ep_finalize(s.y.as<float>(), output, T, stream);
  s.stats = st;
}

}  // namespace fusedmoe::cuda
