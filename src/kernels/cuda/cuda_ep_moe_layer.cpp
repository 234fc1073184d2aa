// fusedmoe CUDA: CudaEpMoELayer — GPU expert-parallel dispatch / experts / combine.
#include "kernels/cuda/cuda_ep_moe_layer.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ep_dispatch.h"
#include "kernels/cuda/ep_peer.h"

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
  // false (and nothing held) where cudaMalloc fails.
  bool try_allocate(size_t bytes) {
    *this = DeviceArray();
    if (cudaMalloc(&ptr_, bytes) == cudaSuccess) return true;
    cudaGetLastError();
    ptr_ = nullptr;
    return false;
  }

 private:
  void* ptr_ = nullptr;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What a rank tells the others: the transport it asks for, and how to map its
// peer window.
struct PeerInfo {
  int32_t mode;      // EpTransport
  int32_t payloads;  // bits: 1 fp8 dispatch records, 2 bf16 combine rows, 4 f16 experts
  int32_t ok;        // 0: no window; 1: window and CUDA IPC handle; 2: window only
  int64_t capacity, hidden, top_k, bytes;  // the window's layout (the same on every rank)
  char host[64];
  uint64_t process;        // a random id of its process (equal: the same process)
  unsigned char uuid[16];  // of its device
  uint64_t ptr;            // the window in its process
  cudaIpcMemHandle_t handle;
};

// A random id of this process (pids repeat across containers of one host).
uint64_t process_id() {
  static const uint64_t id = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
           static_cast<uint64_t>(getpid());
  }();
  return id;
}

// Every rank's `bytes` bytes (host), through device memory (the EP communicator's buffers).
std::vector<unsigned char> gather_host(Communicator& comm, const void* mine, int64_t bytes) {
  const int P = comm.size();
  DeviceArray send(bytes), recv(bytes * P);
  FUSEDMOE_CUDA_CHECK(cudaMemcpy(send.as<void>(), mine, bytes, cudaMemcpyHostToDevice));
  std::vector<int64_t> counts(P, bytes), displs(P);
  for (int p = 0; p < P; ++p) displs[p] = bytes * p;
  comm.all_gather_v(send.as<void>(), bytes, recv.as<void>(), counts, displs);
  std::vector<unsigned char> out(bytes * P);
  FUSEDMOE_CUDA_CHECK(cudaMemcpy(out.data(), recv.as<void>(), bytes * P, cudaMemcpyDeviceToHost));
  return out;
}

// Every rank's reason (empty: none), in rank order (collective).
std::vector<std::string> gather_reasons(Communicator& comm, const std::string& why) {
  char mine[192] = {};
  std::strncpy(mine, why.c_str(), sizeof mine - 1);
  const std::vector<unsigned char> all = gather_host(comm, mine, sizeof mine);
  std::vector<std::string> out(comm.size());
  for (int p = 0; p < comm.size(); ++p)
    out[p] = std::string(
        reinterpret_cast<const char*>(all.data()) + sizeof mine * p,
        strnlen(reinterpret_cast<const char*>(all.data()) + sizeof mine * p, sizeof mine));
  return out;
}

// "rank p: reason" of the first rank with one, or "".
std::string first_reason(const std::vector<std::string>& reasons) {
  for (size_t p = 0; p < reasons.size(); ++p)
    if (!reasons[p].empty()) return "rank " + std::to_string(p) + ": " + reasons[p];
  return "";
}

}  // namespace

// The peer transport's window and what goes with it (ep_peer.h): this rank's
// window, the others' mapped, the epoch and the dispatch cursors, the fp8
// receive buffer. Layers given one SharedWorkspace (their forwards one at a
// time, in stream order) share it where their communicator and window layout
// are the same: the epoch then orders all their forwards as one layer's.
struct PeerWindows {
  std::shared_ptr<Communicator> comm;
  int device = 0;
  char* window = nullptr;         // this rank's (cudaMalloc)
  std::vector<void*> ipc_opened;  // other processes' windows (cudaIpcCloseMemHandle)
  DeviceArray peers;              // char* [P]
  DeviceArray sync;               // u64 epoch, u32 dispatch done, u32 combine done
  DeviceArray cursor;             // u32 [P]: the dispatch's rows taken on each destination
  DeviceArray x_recv;             // fp8 records: the received rows dequantised, half [P * Tmax, H]
  // Rank 0's process id and window address when it was set up: the same on
  // every rank that holds this set-up's windows.
  uint64_t generation[2] = {0, 0};
  bool exported = false;  // the others mapped it: release after a barrier

  // Other processes may have mapped the window (CUDA IPC): freeing it before
  // they closed their mapping is undefined, so with `barrier` every rank
  // closes what it opened, then a barrier, then frees its own.
  void release(bool barrier);
  ~PeerWindows() { release(exported); }
};

void PeerWindows::release(bool barrier) {
  exported = false;
  if (!window && ipc_opened.empty() && !barrier) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaDeviceSynchronize();  // no kernel of ours still stores into a window
  for (void* q : ipc_opened) cudaIpcCloseMemHandle(q);
  ipc_opened.clear();
  if (barrier && comm) {
    try {
      comm->barrier();
    } catch (...) {  // a rank that is gone: nobody is left to use the window
    }
  }
  if (window) cudaFree(window);
  window = nullptr;
  cudaGetLastError();
  cudaSetDevice(prev);
}

struct CudaEpMoELayer::Impl {
  CudaMoELayer* layer = nullptr;
  MoEConfig cfg;
  std::shared_ptr<Communicator> comm;
  ExpertMap map;
  int64_t max_tokens = 0;  // per rank
  int P = 1, me = 0;
  int64_t rec = 0;
  bool fp8 = false, combine_bf16 = false;  // the peer transport's payloads
  DeviceArray rank_of, local_of;           // i32 [E]
  DeviceArray row_pos, slot_pos;           // i32 [Tmax * P], [Tmax * k] (slot_pos: nccl only)
  DeviceArray counts_send, counts_recv;    // i64 [P * 3]
  DeviceArray send, recv;                  // records [Tmax * min(P, k)], [P * Tmax]
  DeviceArray ids_l, w_l, cpos;            // [P * Tmax * k]
  DeviceArray csend, crecv, y;             // f32 [P * Tmax * k, H], [Tmax * k, H], [Tmax * k, H]
  EpStats stats;

  // ---- the peer transport (ep_peer.h) ----
  bool peer = false;
  int device = 0;
  PeerLayout layout;
  std::shared_ptr<PeerWindows> win;  // this layer's, or shared (see PeerWindows)
  bool own_window = false;           // set up by this layer (not another's reused)
  DeviceArray rows_seen;             // i64 [P]: rows each source sent in the last forward (stats)
  double timeout_s = 60;
  // start, dispatched, received, experts done, combined, combine waited
  cudaEvent_t ev[6] = {};
  bool stats_pending = false;

  // Collective, on every rank whatever it asks for: exchanges the modes asked
  // for and, unless a rank asked for nccl, maps every rank's window. False
  // (every rank agreeing) for nccl, or when some rank cannot map the others
  // (another host, two ranks on one GPU, no peer access, no CUDA IPC between
  // processes, no memory, more than 32 ranks); where a rank asked for peer,
  // that throws on every rank, as do mixed nccl / peer requests and ranks of
  // different window layouts. Reuses the windows of an earlier layer of the
  // same SharedWorkspace, communicator and layout where every rank has them.
  bool setup_peer(EpTransport want);
  void release_peer(bool exported);
  void forward_peer(const TensorView& output, int64_t T, Stream stream);
  void peer_stats();
  ~Impl() {  // the windows go with the last layer holding them (~PeerWindows)
    win.reset();
    release_peer(false);
  }
};

bool CudaEpMoELayer::Impl::setup_peer(EpTransport want) {
  const int64_t k = cfg.top_k, H = cfg.hidden_size;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&device));
  int sms = 1;
  FUSEDMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  layout = peer_layout(P, me, static_cast<int>(k), H, max_tokens, layer->dtype() == DType::kF16,
                       fp8, combine_bf16, sms);
  // Round 0 (every rank): the windows of an earlier layer, where every rank
  // holds the same set-up's for this communicator and layout.
  const std::shared_ptr<SharedWorkspace>& workspace = layer->shared_workspace();
  const std::string key =
      "ep_peer_windows " + std::to_string(reinterpret_cast<uintptr_t>(comm.get())) + " " +
      std::to_string(P) + " " + std::to_string(me) + " " + std::to_string(k) + " " +
      std::to_string(H) + " " + std::to_string(max_tokens) + " " + std::to_string(layout.x_f16) +
      std::to_string(fp8) + std::to_string(combine_bf16);
  {
    auto held = std::static_pointer_cast<PeerWindows>(workspace->attachment(key));
    struct Reuse {
      int32_t mode;
      uint64_t generation[2];
    } mine{static_cast<int32_t>(want), {0, 0}};
    if (held) std::memcpy(mine.generation, held->generation, sizeof mine.generation);
    const std::vector<unsigned char> all = gather_host(*comm, &mine, sizeof mine);
    bool reuse = true;
    for (int p = 0; p < P; ++p) {
      Reuse q;
      std::memcpy(&q, all.data() + sizeof q * p, sizeof q);
      reuse = reuse && q.mode != static_cast<int32_t>(EpTransport::kNccl) && q.generation[0] != 0 &&
              q.generation[0] == mine.generation[0] && q.generation[1] == mine.generation[1];
    }
    if (reuse) {  // every rank decides the same: the same gathered values
      win = std::move(held);
      rows_seen = DeviceArray(8 * P);
      for (cudaEvent_t& e : ev) FUSEDMOE_CUDA_CHECK(cudaEventCreate(&e));
      timeout_s = comm_timeout_seconds();
      peer = true;
      return true;
    }
  }
  win = std::make_shared<PeerWindows>();
  win->comm = comm;
  win->device = device;
  own_window = true;
  char*& window = win->window;
  std::string why;  // this rank's reason, when it cannot
  PeerInfo info{};
  info.mode = static_cast<int32_t>(want);
  info.payloads = (fp8 ? 1 : 0) | (combine_bf16 ? 2 : 0) | (layout.x_f16 ? 4 : 0);
  info.capacity = layout.capacity;
  info.hidden = H;
  info.top_k = k;
  info.bytes = static_cast<int64_t>(layout.bytes);
  gethostname(info.host, sizeof info.host - 1);
  info.process = process_id();
  cudaDeviceProp prop{};
  FUSEDMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::memcpy(info.uuid, &prop.uuid, 16);
  if (want == EpTransport::kNccl) {
    // no window
  } else if (P > kPeerMaxRanks) {
    why = "ep_size " + std::to_string(P) + " > " + std::to_string(kPeerMaxRanks);
  } else if (cudaMalloc(reinterpret_cast<void**>(&window), layout.bytes) != cudaSuccess) {
    cudaGetLastError();
    window = nullptr;
    why = "cudaMalloc of its " + std::to_string(layout.bytes) + "-byte window failed";
  } else {
    FUSEDMOE_CUDA_CHECK(cudaMemset(window, 0, layout.bytes));
    FUSEDMOE_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer can map it
    info.ptr = reinterpret_cast<uint64_t>(window);
    info.ok = 1;
    if (cudaIpcGetMemHandle(&info.handle, window) != cudaSuccess) {
      cudaGetLastError();
      info.ok = 2;  // same-process peers only
    }
    // Here, not after set-up: a rank that cannot must fail with all the others.
    const size_t xb = size_t{2} * P * max_tokens * H;
    if (fp8 && !win->x_recv.try_allocate(xb))
      why = "cudaMalloc of its " + std::to_string(xb) + "-byte fp8 receive buffer failed";
  }
  // Round 1 (every rank, whatever it asks for): modes, layouts, handles.
  const std::vector<unsigned char> all = gather_host(*comm, &info, sizeof info);
  std::vector<PeerInfo> infos(P);
  for (int p = 0; p < P; ++p) std::memcpy(&infos[p], all.data() + sizeof info * p, sizeof info);
  // Every rank sees the same infos, so takes the same decision (or throws the same error).
  int ask_nccl = -1, ask_peer = -1;
  for (int p = P - 1; p >= 0; --p) {
    if (infos[p].mode == static_cast<int32_t>(EpTransport::kNccl)) ask_nccl = p;
    if (infos[p].mode == static_cast<int32_t>(EpTransport::kPeer)) ask_peer = p;
  }
  if (ask_nccl >= 0 && ask_peer >= 0) {
    release_peer(false);
    FUSEDMOE_THROW(kInvalidArgument,
                   "FUSEDMOE_EP_TRANSPORT: every rank must ask for the same "
                   "transport; rank ",
                   ask_nccl, " asks for nccl, rank ", ask_peer, " for peer");
  }
  const auto payload_names = [](int32_t f) {
    return std::string("experts ") + (f & 4 ? "f16" : "bf16") + ", dispatch " +
           (f & 1 ? "fp8" : "auto") + ", combine " + (f & 2 ? "bf16" : "f32");
  };
  for (int p = 1; p < P; ++p)
    if (infos[p].payloads != infos[0].payloads) {
      release_peer(false);
      FUSEDMOE_THROW(kInvalidArgument,
                     "compute_dtype / dispatch_dtype / combine_dtype: every rank must use the "
                     "same; rank 0 has ",
                     payload_names(infos[0].payloads), ", rank ", p, " has ",
                     payload_names(infos[p].payloads));
    }
  if (ask_nccl >= 0) {
    release_peer(false);  // no peer mapped it: nothing exported is in use
    return false;
  }
  const bool required = ask_peer >= 0;
  for (int p = 1; p < P; ++p)
    if (infos[p].capacity != infos[0].capacity || infos[p].hidden != infos[0].hidden ||
        infos[p].top_k != infos[0].top_k || infos[p].bytes != infos[0].bytes) {
      release_peer(false);
      FUSEDMOE_THROW(kInvalidArgument,
                     "expert parallelism: every rank must use the same "
                     "max_num_tokens, hidden size and top_k; rank 0 has ",
                     infos[0].capacity, ", ", infos[0].hidden, ", ", infos[0].top_k, ", rank ", p,
                     " has ", infos[p].capacity, ", ", infos[p].hidden, ", ", infos[p].top_k);
    }
  // This rank's device index of every peer's GPU (by UUID), and the checks.
  std::vector<int> local_dev(P, -1);
  int ndev = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  for (int p = 0; p < P && why.empty(); ++p) {
    if (p == me) continue;
    const PeerInfo& q = infos[p];
    const std::string qn = "rank " + std::to_string(p);
    if (std::strncmp(q.host, info.host, sizeof info.host) != 0) {
      why = qn + " is on another host";
    } else if (q.ok == 0) {
      why = qn + " has no window";
    } else if (q.process != info.process && q.ok != 1) {
      why = qn + " has no CUDA IPC handle";
    } else {
      for (int d = 0; d < ndev; ++d) {
        cudaDeviceProp pd{};
        FUSEDMOE_CUDA_CHECK(cudaGetDeviceProperties(&pd, d));
        if (std::memcmp(&pd.uuid, q.uuid, 16) == 0) local_dev[p] = d;
      }
      int can = 0;
      if (std::memcmp(q.uuid, info.uuid, 16) == 0)
        why = qn + " shares this rank's GPU (cuda:" + std::to_string(device) + ")";
      else if (local_dev[p] < 0 && q.process == info.process)
        why = qn + "'s GPU is not visible to this process";
      // Another process's GPU hidden here (CUDA_VISIBLE_DEVICES per rank): CUDA
      // IPC still maps its window over peer access (as NCCL's P2P transport does
      // since CUDA 10.1); where it cannot, cudaIpcOpenMemHandle's error is the reason.
      else if (local_dev[p] >= 0 &&
               (cudaDeviceCanAccessPeer(&can, device, local_dev[p]) != cudaSuccess || !can))
        why = "cuda:" + std::to_string(device) + " has no peer access to " + qn + "'s GPU";
    }
  }
  // Both failure rounds end the same way on every rank: the reason of the
  // first rank that had one; with `peer` asked for, an error.
  const auto fail = [&](const std::vector<std::string>& reasons) {
    release_peer(true);
    FUSEDMOE_CHECK(!required, "FUSEDMOE_EP_TRANSPORT=peer (rank ", ask_peer,
                   "): the ranks cannot map each other's GPU memory (", first_reason(reasons),
                   "); expected one GPU per rank, all on one host with peer access");
    return false;
  };
  // Round 2: the reasons.
  if (const auto reasons = gather_reasons(*comm, why); !first_reason(reasons).empty())
    return fail(reasons);
  std::vector<char*> ptrs(P);
  for (int p = 0; p < P && why.empty(); ++p) {
    if (p == me) {
      ptrs[p] = window;
    } else if (infos[p].process == info.process) {
      ptrs[p] = reinterpret_cast<char*>(infos[p].ptr);
      const cudaError_t e = cudaDeviceEnablePeerAccess(local_dev[p], 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        why = std::string("cudaDeviceEnablePeerAccess: ") + cudaGetErrorString(e);
      cudaGetLastError();
    } else {
      void* q = nullptr;
      const cudaError_t e =
          cudaIpcOpenMemHandle(&q, infos[p].handle, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();
        why = "cudaIpcOpenMemHandle of rank " + std::to_string(p) +
              "'s window: " + cudaGetErrorString(e);
      } else {
        win->ipc_opened.push_back(q);
        ptrs[p] = static_cast<char*>(q);
      }
    }
  }
  // Round 3: whether every rank mapped every window.
  if (const auto reasons = gather_reasons(*comm, why); !first_reason(reasons).empty())
    return fail(reasons);
  win->peers = DeviceArray(sizeof(char*) * P);
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpy(win->peers.as<void>(), ptrs.data(), sizeof(char*) * P, cudaMemcpyHostToDevice));
  win->sync = DeviceArray(16);
  FUSEDMOE_CUDA_CHECK(cudaMemset(win->sync.as<void>(), 0, 16));
  win->cursor = DeviceArray(4 * P);
  FUSEDMOE_CUDA_CHECK(cudaMemset(win->cursor.as<void>(), 0, 4 * P));
  win->generation[0] = infos[0].process;
  win->generation[1] = infos[0].ptr;
  win->exported = true;
  workspace->attach(key, win);
  rows_seen = DeviceArray(8 * P);
  for (cudaEvent_t& e : ev) FUSEDMOE_CUDA_CHECK(cudaEventCreate(&e));
  timeout_s = comm_timeout_seconds();
  FUSEDMOE_CUDA_CHECK(cudaDeviceSynchronize());
  peer = true;
  return true;
}

// Set-up failures, while the windows are this layer's alone (exported: after
// the others may have mapped the window, see PeerWindows::release).
void CudaEpMoELayer::Impl::release_peer(bool exported) {
  if (win) win->release(exported);
  win.reset();
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  for (cudaEvent_t& e : ev)
    if (e) cudaEventDestroy(e), e = nullptr;
  cudaGetLastError();
  cudaSetDevice(prev);
  peer = false;
}

CudaEpMoELayer::CudaEpMoELayer(CudaMoELayer& layer, const MoEConfig& config,
                               std::shared_ptr<Communicator> comm, ExpertMap map,
                               int64_t max_tokens_per_rank, DispatchDType dispatch_dtype,
                               DType combine_dtype)
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
  // The experts take their half type: the records carry it (auto), or fp8.
  const bool half_f16 = layer.dtype() == DType::kF16;
  FUSEDMOE_CHECK(dispatch_dtype == DispatchDType::kAuto || dispatch_dtype == DispatchDType::kFP8 ||
                     (dispatch_dtype == DispatchDType::kBF16 && !half_f16),
                 "dispatch_dtype: the GPU experts take ", half_f16 ? "f16" : "bf16",
                 " inputs; expected auto", half_f16 ? "" : ", bf16", " or fp8, got ",
                 to_string(dispatch_dtype));
  FUSEDMOE_CHECK(combine_dtype == DType::kF32 || combine_dtype == DType::kBF16,
                 "combine_dtype: expected f32 or bf16, got ", dtype_name(combine_dtype));
  s.fp8 = dispatch_dtype == DispatchDType::kFP8;
  s.combine_bf16 = combine_dtype == DType::kBF16;
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
  s.counts_send = DeviceArray(8 * 3 * P);
  s.ids_l = DeviceArray(4 * Tm * P * k);
  s.w_l = DeviceArray(4 * Tm * P * k);
  if (s.setup_peer(ep_transport_from_env())) return;
  // Every rank took the same decision on the same payloads (setup_peer).
  FUSEDMOE_CHECK(!s.fp8 && !s.combine_bf16,
                 "dispatch_dtype fp8 / combine_dtype bf16: payloads of the peer transport, but "
                 "these ranks use the nccl one (FUSEDMOE_EP_TRANSPORT=nccl, or the ranks cannot "
                 "map each other's GPU memory; FUSEDMOE_EP_TRANSPORT=peer says why); got "
                 "dispatch_dtype ",
                 to_string(dispatch_dtype), ", combine_dtype ", dtype_name(combine_dtype));
  // The nccl transport's buffers (slot_pos: its layout kernel's slot positions).
  s.slot_pos = DeviceArray(4 * Tm * k);
  s.counts_recv = DeviceArray(8 * 3 * P);
  s.send = DeviceArray(s.rec * Tm * std::min<int64_t>(P, k));
  s.recv = DeviceArray(s.rec * Tm * P);
  s.cpos = DeviceArray(4 * Tm * P * k);
  s.csend = DeviceArray(4 * Tm * P * k * H);
  s.crecv = DeviceArray(4 * Tm * k * H);
  s.y = DeviceArray(4 * Tm * k * H);
}

CudaEpMoELayer::~CudaEpMoELayer() = default;

const EpStats& CudaEpMoELayer::stats() const {
  if (impl_->stats_pending) impl_->peer_stats();
  return impl_->stats;
}

void CudaEpMoELayer::replayed() {
  impl_->stats_pending = true;
}

// The peer transport's EpStats of the last forward, from its events and counts
// (waits for that forward to finish).
void CudaEpMoELayer::Impl::peer_stats() {
  stats_pending = false;
  EpStats st;
  st.transport = "peer";
  float ms = 0;
  FUSEDMOE_CUDA_CHECK(cudaEventSynchronize(ev[5]));
  const auto seconds = [&](int a, int b) {
    FUSEDMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[a], ev[b]));
    return ms * 1e-3;
  };
  st.dispatch_seconds = seconds(0, 1);
  st.combine_seconds = seconds(3, 4);
  st.wait_seconds = seconds(1, 2) + seconds(4, 5);
  const int64_t H = cfg.hidden_size;
  std::vector<int64_t> cs(3 * P), rows(P);
  FUSEDMOE_CUDA_CHECK(
      cudaMemcpy(cs.data(), counts_send.as<void>(), 24 * P, cudaMemcpyDeviceToHost));
  FUSEDMOE_CUDA_CHECK(cudaMemcpy(rows.data(), rows_seen.as<void>(), 8 * P, cudaMemcpyDeviceToHost));
  // Every dispatched row comes back as one f32 / bf16 row (its slots summed).
  for (int p = 0; p < P; ++p) {
    st.dispatch_rows_sent += cs[3 * p];
    st.dispatch_rows_received += rows[p];
    if (p == me) continue;
    st.dispatch_bytes_sent += cs[3 * p] * layout.rec;
    st.dispatch_bytes_received += rows[p] * layout.rec;
    st.combine_bytes_sent += rows[p] * H * (combine_bf16 ? 2 : 4);
    st.combine_bytes_received += cs[3 * p] * H * (combine_bf16 ? 2 : 4);
  }
  stats = st;
}
const ExpertMap& CudaEpMoELayer::expert_map() const {
  return impl_->map;
}

bool CudaEpMoELayer::capturable() const {
  return impl_->peer;
}

size_t CudaEpMoELayer::window_bytes() const {
  return impl_->peer && impl_->own_window ? impl_->layout.bytes : 0;
}

void CudaEpMoELayer::forward(const TensorView& hidden_states, const TensorView& output,
                             const TensorView* router_logits, const TensorView* token_ids,
                             const ForwardOutputs* outputs, Stream stream,
                             const int32_t* num_valid_tokens) {
  using Clock = std::chrono::steady_clock;
  Impl& s = *impl_;
  const int P = s.P, me = s.me;
  const int64_t T = hidden_states.size(0), k = s.cfg.top_k, H = s.cfg.hidden_size;
  FUSEDMOE_CHECK(T <= s.max_tokens, "hidden_states: at most max_num_tokens = ", s.max_tokens,
                 " tokens per rank (RunnerOptions::max_num_tokens), got ", T);
  CudaMoELayer& layer = *s.layer;
  if (!s.peer) {  // refused before anything is enqueued into the capture
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEDMOE_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture));
    if (capture != cudaStreamCaptureStatusNone)
      FUSEDMOE_THROW(kUnsupported,
                     "stream: expert parallelism over the nccl transport synchronises with the "
                     "host and cannot be captured in a CUDA graph; the peer transport can "
                     "(FUSEDMOE_EP_TRANSPORT)");
  }

  // The nccl transport sizes its exchanges from the routed rows on the host:
  // padding rows would have to be counted there too (graph replay needs peer).
  FUSEDMOE_CHECK(s.peer || num_valid_tokens == nullptr,
                 "num_valid_tokens: padded forwards (CUDA-graph replay) need the peer transport");

  // ---- 1. route ----
  layer.ep_route(hidden_states, router_logits, token_ids, outputs, stream, num_valid_tokens);
  if (s.peer) {
    s.forward_peer(output, T, stream);
    return;
  }
  EpStats st;
  st.transport = "nccl";

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
  const float* y_local = static_cast<const float*>(
      layer
          .experts(s.recv.as<uint16_t>(), s.rec / 2, s.ids_l.as<int32_t>(), s.w_l.as<float>(), M,
                   t_global, /*allow_sm90=*/false, stream)
          .y);  // by slot: ep_combine_pack sends slots

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

// forward() after routing, over the peer transport: no host synchronisation.
// The local experts run on all P * capacity received rows (rows past a
// source's count have ids -1) with the GEMM tiles of a P * capacity-token
// batch, so the work and the bits depend on max_tokens_per_rank, not on T.
void CudaEpMoELayer::Impl::forward_peer(const TensorView& output, int64_t T, Stream stream) {
  const int64_t M = P * max_tokens;
  CudaMoELayer& l = *layer;
  char* const window = win->window;
  const DeviceArray &sync = win->sync, &cursor = win->cursor, &peers = win->peers,
                    &x_recv = win->x_recv;
  auto* epoch = sync.as<uint64_t>();
  auto* done = reinterpret_cast<unsigned*>(epoch + 1);
  const auto st = static_cast<cudaStream_t>(stream);
  // Captured into a CUDA graph (nothing here synchronises with the host): the
  // timing events become event-record nodes of the graph, recorded by each
  // replay (replayed() then marks the stats pending).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FUSEDMOE_CUDA_CHECK(cudaStreamIsCapturing(st, &capture));
  const bool timed = capture == cudaStreamCaptureStatusNone;
  const auto mark = [&](int i) {
    FUSEDMOE_CUDA_CHECK(timed ? cudaEventRecord(ev[i], st)
                              : cudaEventRecordWithFlags(ev[i], st, cudaEventRecordExternal));
  };
  mark(0);
  peer_dispatch(l.expert_input(), l.topk_ids(), l.topk_weights(), T, rank_of.as<int32_t>(),
                local_of.as<int32_t>(), row_pos.as<int32_t>(), counts_send.as<int64_t>(),
                cursor.as<unsigned>(), peers.as<char*>(), layout, epoch, done, stream);
  mark(1);
  l.ep_shared(T, M, stream);
  peer_receive(window, layout, epoch, timeout_s, ids_l.as<int32_t>(), w_l.as<float>(),
               rows_seen.as<int64_t>(), x_recv.as<uint16_t>(), stream);
  mark(2);
  // The sm90 path where forward() of M tokens takes it: expert-sorted rows,
  // weighted and biased by the combine.
  // Inputs: the records themselves (row stride rec / 2 elements), or the
  // dequantised fp8 records.
  const uint16_t* x =
      fp8 ? x_recv.as<uint16_t>() : reinterpret_cast<const uint16_t*>(window + layout.off_recv);
  const FinalizeArgs y_local = l.experts(x, fp8 ? cfg.hidden_size : layout.rec / 2,
                                         ids_l.as<int32_t>(), w_l.as<float>(), M, M,
                                         /*allow_sm90=*/true, stream);
  mark(3);
  peer_combine(y_local, ids_l.as<int32_t>(), window, peers.as<char*>(), layout, epoch, done + 1,
               stream);
  mark(4);
  peer_wait_combine(window, layout, epoch, timeout_s, stream);
  mark(5);
  l.ep_finalize(window + layout.off_y, output, T, stream, row_pos.as<int32_t>(), P,
                combine_bf16 ? DType::kBF16 : DType::kF32);
  stats_pending = timed;
}

}  // namespace fusedmoe::cuda
