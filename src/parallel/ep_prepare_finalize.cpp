// fusedmoe: expert-parallel dispatch / combine (parallel/ep_prepare_finalize.h).
//
// Record sent per (token, destination rank), fixed size for one call:
//   payload: f32 [H] | bf16 [H] | fp8 u8 [H] + f32 scales [ceil(H / 128)],
//            padded to a multiple of 4 bytes
//   i32 [k]: local expert id on the destination for slot j, or -1
//   f32 [k]: topk_weights of the token
// Records to one rank are in the source's token order; the combine sends one
// f32 [H] row back per (received row, local slot), in (row, j) order, which is
// the order in which the source numbers them.
#include "fusedmoe/parallel/ep_prepare_finalize.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fusedmoe/core/env.h"  // env_choice

namespace fusedmoe {

namespace {

constexpr int64_t kFp8Group = 128;
constexpr float kFp8Max = 448.0f;

// Own scratch slots (the caller's Workspace is left to the CPU PrepareFinalize).
enum Slot : int {
  kSendBuf,
  kRecvBuf,
  kRecvHidden,
  kRecvIds,
  kRecvWeights,
  kCombineSend,
  kCombineRecv,
  kSrcSlotToRow,
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t payload_bytes(DispatchDType d, int64_t H) {
  int64_t b = 0;
  switch (d) {
    case DispatchDType::kBF16:
      b = 2 * H;
      break;
    case DispatchDType::kFP8:
      b = H + 4 * ((H + kFp8Group - 1) / kFp8Group);
      break;
    default:
      b = 4 * H;
      break;
  }
  return (b + 3) / 4 * 4;
}

}  // namespace

const char* to_string(DispatchDType d) {
  switch (d) {
    case DispatchDType::kAuto:
      return "auto";
    case DispatchDType::kF32:
      return "f32";
    case DispatchDType::kBF16:
      return "bf16";
    case DispatchDType::kFP8:
      return "fp8";
  }
  return "?";
}

DispatchDType parse_dispatch_dtype(const std::string& s) {
  if (s == "auto") return DispatchDType::kAuto;
  if (s == "f32" || s == "float32") return DispatchDType::kF32;
  if (s == "bf16" || s == "bfloat16") return DispatchDType::kBF16;
  if (s == "fp8" || s == "f8_e4m3fn" || s == "e4m3") return DispatchDType::kFP8;
  FUSEDMOE_THROW(kInvalidArgument, "dispatch dtype: expected auto, f32, bf16 or fp8, got \"",
                 printable(s), "\"");
}

EpTransport ep_transport_from_env() {
  // (env_choice: the message every FUSEDMOE_* switch gives, "got 'X'")
  switch (env_choice("FUSEDMOE_EP_TRANSPORT", {"auto", "nccl", "peer"})) {
    case 1:
      return EpTransport::kNccl;
    case 2:
      return EpTransport::kPeer;
    default:  // unset, empty or auto
      return EpTransport::kAuto;
  }
}

void quantize_fp8_groups(const float* x, int64_t rows, int64_t H, int64_t ldx, int64_t group,
                         uint8_t* q, float* scales) {
  const int64_t G = (H + group - 1) / group;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h0 = g * group, h1 = std::min(H, h0 + group);
      float amax = 0.0f;
      for (int64_t h = h0; h < h1; ++h) amax = std::max(amax, std::fabs(xr[h]));
      const float scale = amax > 0.0f && std::isfinite(amax) ? amax / kFp8Max : 1.0f;
      scales[r * G + g] = scale;
      for (int64_t h = h0; h < h1; ++h) q[r * H + h] = f32_to_f8e4m3fn(xr[h] / scale);
    }
  }
}

void dequantize_fp8_groups(const uint8_t* q, const float* scales, int64_t rows, int64_t H,
                           int64_t group, float* out, int64_t ldo) {
  const int64_t G = (H + group - 1) / group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      out[r * ldo + h] = f8e4m3fn_to_f32(q[r * H + h]) * scales[r * G + h / group];
}

// What prepare() learned and finalize() needs.
struct EpPrepareFinalize::State {
  int64_t T = 0, k = 0, H = 0;
  int64_t recv_rows = 0;                           // R
  std::vector<int64_t> send_rows, recv_rows_from;  // per rank
  std::vector<int64_t> combine_recv_rows;          // per rank: results expected back
  std::vector<int64_t> combine_send_rows;          // per rank: results to send back
  const int32_t* recv_ids = nullptr;               // i32 [R, k] local ids
  const int32_t* local_slot_to_row = nullptr;      // i32 [R * k] into expert_output
  int32_t* src_slot_to_row = nullptr;              // i32 [T * k] into the combine recv rows
  Workspace ws;
};

EpPrepareFinalize::EpPrepareFinalize(std::shared_ptr<Communicator> comm, ExpertMap map,
                                     DispatchDType dispatch_dtype, ThreadPool* pool)
    : comm_(std::move(comm)),
      map_(std::move(map)),
      dispatch_dtype_(dispatch_dtype),
      pool_(pool),
      local_(make_cpu_modular_kernel(pool)),
      state_(std::make_unique<State>()) {
  FUSEDMOE_CHECK(comm_ != nullptr, "EpPrepareFinalize: communicator is null");
  FUSEDMOE_CHECK(comm_->size() == map_.ep_size(), "EpPrepareFinalize: the EP group has ",
                 comm_->size(), " ranks but the expert map is for ep_size ", map_.ep_size());
}

EpPrepareFinalize::~EpPrepareFinalize() = default;

PrepareResult EpPrepareFinalize::prepare(const TensorView& hidden_states,
                                         const TensorView& topk_ids, const TensorView& topk_weights,
                                         int64_t num_experts, bool apply_router_weight_on_input,
                                         DType compute_dtype, Workspace& ws) {
  const auto t0 = std::chrono::steady_clock::now();
  FUSEDMOE_CHECK(num_experts == map_.num_experts(), "EpPrepareFinalize::prepare: num_experts ",
                 num_experts, " does not match the expert map's ", map_.num_experts());
  State& s = *state_;
  const int P = comm_->size(), me = comm_->rank();
  const int64_t T = hidden_states.size(0), H = hidden_states.size(1), k = topk_ids.size(1);
  s.T = T;
  s.k = k;
  s.H = H;
  const int64_t ldh = T > 0 ? hidden_states.stride(0) : H;
  const int64_t ld_ids = T > 0 ? topk_ids.stride(0) : k;
  const int64_t ld_w = T > 0 ? topk_weights.stride(0) : k;
  const int32_t* ids = topk_ids.data_as<const int32_t>();
  const float* wts = topk_weights.data_as<const float>();
  const float* x = hidden_states.data_as<const float>();

  DispatchDType dd = dispatch_dtype_;
  if (dd == DispatchDType::kAuto)
    dd = compute_dtype == DType::kBF16 && !apply_router_weight_on_input ? DispatchDType::kBF16
                                                                        : DispatchDType::kF32;
  const int64_t pay = payload_bytes(dd, H);
  const int64_t rec = pay + 8 * k;

  // ---- pass 1 (serial): destinations, rows per rank, combine numbering ----
  // dest[t * k + i] = i-th destination rank of token t (ascending), row[...] its
  // record index within that rank; ndest[t] destinations.
  s.send_rows.assign(P, 0);
  s.combine_recv_rows.assign(P, 0);
  std::vector<int32_t> dest(static_cast<size_t>(T * k)), ndest(static_cast<size_t>(T));
  std::vector<int64_t> row(static_cast<size_t>(T * k));
  auto* src_slot_to_row =
      static_cast<int32_t*>(s.ws.get(kSrcSlotToRow, std::max<int64_t>(T * k, 1) * sizeof(int32_t)));
  std::vector<int32_t> slot_rank(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    int32_t n = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * ld_ids + j];
      slot_rank[j] = id >= 0 ? map_.rank_of(id) : -1;
    }
    // Destinations in ascending rank order (k is small).
    for (int r = 0; r < P && n < k; ++r) {
      bool hit = false;
      for (int64_t j = 0; j < k && !hit; ++j) hit = slot_rank[j] == r;
      if (!hit) continue;
      dest[t * k + n] = r;
      row[t * k + n] = s.send_rows[r]++;
      ++n;
    }
    ndest[t] = n;
    // Combine rows come back per rank in (token, slot) order; number them per
    // rank now, make them global indices once all counts are known.
    for (int64_t j = 0; j < k; ++j)
      src_slot_to_row[t * k + j] =
          slot_rank[j] >= 0 ? static_cast<int32_t>(s.combine_recv_rows[slot_rank[j]]++) : -1;
  }
  std::vector<int64_t> combine_off(P + 1, 0);
  for (int r = 0; r < P; ++r) combine_off[r + 1] = combine_off[r] + s.combine_recv_rows[r];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * ld_ids + j];
      if (id >= 0)
        src_slot_to_row[t * k + j] += static_cast<int32_t>(combine_off[map_.rank_of(id)]);
    }
  s.src_slot_to_row = src_slot_to_row;

  // ---- pass 2 (parallel over tokens): pack records ----
  std::vector<int64_t> send_off(P + 1, 0);
  for (int r = 0; r < P; ++r) send_off[r + 1] = send_off[r] + s.send_rows[r];
  const int64_t total_send = send_off[P];
  auto* send = static_cast<char*>(s.ws.get(kSendBuf, std::max<int64_t>(total_send * rec, 1)));
  const std::vector<int32_t> g2l_rank = [&] {
    std::vector<int32_t> v(map_.num_experts());
    for (int64_t e = 0; e < map_.num_experts(); ++e) v[e] = static_cast<int32_t>(map_.local_id(e));
    return v;
  }();
  ThreadPool& pool = pool_ ? *pool_ : ThreadPool::global();
  pool.parallel_for(
      T,
      [&](int64_t b, int64_t e, int) {
        std::vector<uint8_t> q(dd == DispatchDType::kFP8 ? H : 0);
        std::vector<float> sc(dd == DispatchDType::kFP8 ? (H + kFp8Group - 1) / kFp8Group : 0);
        for (int64_t t = b; t < e; ++t) {
          const float* xr = x + t * ldh;
          if (dd == DispatchDType::kFP8)
            quantize_fp8_groups(xr, 1, H, H, kFp8Group, q.data(), sc.data());
          for (int32_t i = 0; i < ndest[t]; ++i) {
            const int r = dest[t * k + i];
            char* p = send + (send_off[r] + row[t * k + i]) * rec;
            if (i == 0) {
              switch (dd) {
                case DispatchDType::kBF16: {
                  auto* o = reinterpret_cast<uint16_t*>(p);
                  for (int64_t h = 0; h < H; ++h) o[h] = f32_to_bf16(xr[h]);
                  break;
                }
                case DispatchDType::kFP8:
                  std::memcpy(p, q.data(), H);
                  std::memcpy(p + H, sc.data(), sc.size() * sizeof(float));
                  break;
                default:
                  std::memcpy(p, xr, H * sizeof(float));
                  break;
              }
            } else {
              // Same payload as the first destination's record.
              std::memcpy(p, send + (send_off[dest[t * k]] + row[t * k]) * rec, pay);
            }
            auto* lid = reinterpret_cast<int32_t*>(p + pay);
            for (int64_t j = 0; j < k; ++j) {
              const int32_t id = ids[t * ld_ids + j];
              lid[j] = id >= 0 && map_.rank_of(id) == r ? g2l_rank[id] : -1;
            }
            std::memcpy(p + pay + 4 * k, wts + t * ld_w, k * sizeof(float));
          }
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1)));

  // ---- exchange counts, then records ----
  s.recv_rows_from.assign(P, 0);
  {
    std::vector<int64_t> c8(P, 8), d8(P);
    for (int r = 0; r < P; ++r) d8[r] = 8 * r;
    comm_->all_to_all_v(s.send_rows.data(), c8, d8, s.recv_rows_from.data(), c8, d8);
  }
  std::vector<int64_t> recv_off(P + 1, 0);
  for (int r = 0; r < P; ++r) recv_off[r + 1] = recv_off[r] + s.recv_rows_from[r];
  const int64_t R = recv_off[P];
  s.recv_rows = R;
  auto* recv = static_cast<char*>(s.ws.get(kRecvBuf, std::max<int64_t>(R * rec, 1)));
  {
    std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
    for (int r = 0; r < P; ++r) {
      sc[r] = s.send_rows[r] * rec;
      sd[r] = send_off[r] * rec;
      rc[r] = s.recv_rows_from[r] * rec;
      rd[r] = recv_off[r] * rec;
    }
    comm_->all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  stats_ = EpStats{};
  stats_.dispatch_rows_sent = total_send;
  stats_.dispatch_rows_received = R;
  stats_.dispatch_bytes_sent = (total_send - s.send_rows[me]) * rec;
  stats_.dispatch_bytes_received = (R - s.recv_rows_from[me]) * rec;

  // ---- unpack into hidden [R, H], local ids [R, k], weights [R, k] ----
  auto* rh = static_cast<float*>(s.ws.get(kRecvHidden, std::max<int64_t>(R * H, 1) * 4));
  auto* rids = static_cast<int32_t*>(s.ws.get(kRecvIds, std::max<int64_t>(R * k, 1) * 4));
  auto* rw = static_cast<float*>(s.ws.get(kRecvWeights, std::max<int64_t>(R * k, 1) * 4));
  pool.parallel_for(
      R,
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) {
          const char* p = recv + i * rec;
          float* o = rh + i * H;
          switch (dd) {
            case DispatchDType::kBF16: {
              const auto* in = reinterpret_cast<const uint16_t*>(p);
              for (int64_t h = 0; h < H; ++h) o[h] = bf16_to_f32(in[h]);
              break;
            }
            case DispatchDType::kFP8:
              dequantize_fp8_groups(reinterpret_cast<const uint8_t*>(p),
                                    reinterpret_cast<const float*>(p + H), 1, H, kFp8Group, o, H);
              break;
            default:
              std::memcpy(o, p, H * sizeof(float));
              break;
          }
          std::memcpy(rids + i * k, p + pay, k * 4);
          std::memcpy(rw + i * k, p + pay + 4 * k, k * 4);
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1)));
  s.recv_ids = rids;

  // Results to send back per source rank: its rows' local slots.
  s.combine_send_rows.assign(P, 0);
  for (int r = 0; r < P; ++r)
    for (int64_t i = recv_off[r]; i < recv_off[r + 1]; ++i)
      for (int64_t j = 0; j < k; ++j) s.combine_send_rows[r] += rids[i * k + j] >= 0;

  // ---- group the received rows by local expert (the CPU PrepareFinalize) ----
  const int64_t E_local = map_.num_local_experts(me);
  PrepareResult pr = local_->prepare_finalize().prepare(
      TensorView(rh, DType::kF32, {R, H}), TensorView(rids, DType::kI32, {R, k}),
      TensorView(rw, DType::kF32, {R, k}), E_local, apply_router_weight_on_input, compute_dtype,
      ws);
  s.local_slot_to_row = pr.slot_to_row.data_as<const int32_t>();
  stats_.dispatch_seconds = seconds_since(t0);
  return pr;
}

void EpPrepareFinalize::finalize(const TensorView& expert_output, const PrepareResult&,
                                 const TensorView& topk_weights, bool apply_router_weight_on_input,
                                 const TensorView& output) {
  const auto t0 = std::chrono::steady_clock::now();
  State& s = *state_;
  const int P = comm_->size(), me = comm_->rank();
  const int64_t H = s.H, k = s.k, R = s.recv_rows, T = s.T;
  FUSEDMOE_CHECK(output.size(0) == T, "EpPrepareFinalize::finalize: output has ", output.size(0),
                 " rows, prepare had ", T, " tokens");
  const int64_t lde = expert_output.size(0) > 0 ? expert_output.stride(0) : H;
  const float* eo = expert_output.data_as<const float>();

  // ---- pack results in (received row, slot) order ----
  std::vector<int64_t> send_off(P + 1, 0), recv_off(P + 1, 0);
  for (int r = 0; r < P; ++r) {
    send_off[r + 1] = send_off[r] + s.combine_send_rows[r];
    recv_off[r + 1] = recv_off[r] + s.combine_recv_rows[r];
  }
  auto* send =
      static_cast<float*>(s.ws.get(kCombineSend, std::max<int64_t>(send_off[P] * H, 1) * 4));
  // Output row of each received row's first local slot (prefix over rows).
  std::vector<int64_t> first(static_cast<size_t>(R) + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    int64_t n = 0;
    for (int64_t j = 0; j < k; ++j) n += s.recv_ids[i * k + j] >= 0;
    first[i + 1] = first[i] + n;
  }
  ThreadPool& pool = pool_ ? *pool_ : ThreadPool::global();
  pool.parallel_for(
      R,
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) {
          int64_t o = first[i];
          for (int64_t j = 0; j < k; ++j) {
            if (s.recv_ids[i * k + j] < 0) continue;
            std::memcpy(send + o++ * H, eo + s.local_slot_to_row[i * k + j] * lde, H * 4);
          }
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1)));

  auto* recv =
      static_cast<float*>(s.ws.get(kCombineRecv, std::max<int64_t>(recv_off[P] * H, 1) * 4));
  {
    std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
    for (int r = 0; r < P; ++r) {
      sc[r] = s.combine_send_rows[r] * H * 4;
      sd[r] = send_off[r] * H * 4;
      rc[r] = s.combine_recv_rows[r] * H * 4;
      rd[r] = recv_off[r] * H * 4;
    }
    comm_->all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  stats_.combine_bytes_sent = (send_off[P] - s.combine_send_rows[me]) * H * 4;
  stats_.combine_bytes_received = (recv_off[P] - s.combine_recv_rows[me]) * H * 4;

  // ---- weighted sum in slot order: the CPU finalize over the returned rows ----
  PrepareResult src;
  src.slot_to_row = TensorView(s.src_slot_to_row, DType::kI32, {T * k});
  local_->prepare_finalize().finalize(TensorView(recv, DType::kF32, {recv_off[P], H}), src,
                                      topk_weights, apply_router_weight_on_input, output);
  stats_.combine_seconds = seconds_since(t0);
}

}  // namespace fusedmoe
