// fusedmoe._ext: the nanobind extension under the `fusedmoe` Python package.
//
// Low-level entry points: every array argument is a DLPack-capable array
// (NumPy, PyTorch, ...) imported through nb::ndarray without a copy; outputs
// are allocated by the Python layer (python/fusedmoe/__init__.py) in the
// caller's framework and written here. Python-facing names follow the C++ API.
//
// Errors: fusedmoe::Error is translated by code — kInvalidArgument ->
// ValueError, kIo -> OSError, kUnsupported -> NotImplementedError, kInternal ->
// RuntimeError; an unsupported dtype -> TypeError.
//
// Devices: CPU arrays run on the CPU backend; CUDA arrays (builds with
// FUSEDMOE_WITH_CUDA) on the CUDA backend, zero copy, enqueued on the stream the
// Python layer passes (the caller's current stream) with no synchronisation
// and no allocation (outputs and workspace come from the caller's framework),
// so calls can be captured in a CUDA graph. All arrays of a call must be on one
// device, and a CUDA device must be the current one (ValueError otherwise).
// Without the CUDA backend a CUDA array raises NotImplementedError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/experts/expert_weights.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/inspect.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/routing/router.h"
#include "fusedmoe/runner/moe_runner.h"

#ifdef FUSEDMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "fusedmoe/kernels/cuda.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace fusedmoe::python {
namespace {

using InArray = nb::ndarray<nb::ro>;  // read-only inputs (any framework, dtype, device)
using OutArray = nb::ndarray<>;       // outputs, written in place
using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

// ---- arrays ---------------------------------------------------------------------

const char* device_name(int32_t device_type) {
  switch (device_type) {
    case nb::device::cpu::value:
      return "cpu";
    case nb::device::cuda::value:
      return "cuda";
    case nb::device::cuda_host::value:
      return "cuda_host";
    case nb::device::cuda_managed::value:
      return "cuda_managed";
    case nb::device::rocm::value:
      return "rocm";
    default:
      return "non-CPU";
  }
}

// The one place that decides which devices a call can run on: the CPU (pinned
// host memory too) and, in builds with the CUDA backend, CUDA devices.
Device check_device(int32_t device_type, int32_t device_id, const char* name) {
  if (device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value)
    return Device{};
#ifdef FUSEDMOE_WITH_CUDA
  if (device_type == nb::device::cuda::value) return Device{DeviceType::kCUDA, device_id};
  FUSEDMOE_THROW(kUnsupported, name, ": got a ", device_name(device_type), ":", device_id,
                 " array; fusedmoe runs on the CPU and on CUDA devices");
#else
  FUSEDMOE_THROW(kUnsupported, name, ": got a ", device_name(device_type), ":", device_id,
                 " array, but this build of fusedmoe has no CUDA backend (it was built "
                 "without the CUDA toolkit, or with FUSEDMOE_CUDA=OFF); pass a CPU array "
                 "(tensor.cpu()) or rebuild with nvcc present");
#endif
}

std::string device_str(Device d) {
  return d.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

// One device for all arrays of a call (the first defined one's), which for a
// CUDA device must be the current device. Null entries (absent optional
// arguments) are skipped. Throws Error(kInvalidArgument) naming the argument.
struct NamedView {
  const TensorView* view;
  const char* name;
};
Device common_device(std::initializer_list<NamedView> args) {
  const NamedView* ref = nullptr;
  for (const NamedView& a : args) {
    if (!a.view) continue;
    if (!ref) {
      ref = &a;
      continue;
    }
    FUSEDMOE_CHECK(a.view->device() == ref->view->device(), a.name, ": expected an array on ",
                   device_str(ref->view->device()), " (the device of ", ref->name, "), got one on ",
                   device_str(a.view->device()));
  }
  if (!ref) return Device{};
  const Device d = ref->view->device();
#ifdef FUSEDMOE_WITH_CUDA
  if (d.type == DeviceType::kCUDA) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) {
      cudaGetLastError();
      FUSEDMOE_THROW(kInternal, "cudaGetDevice failed (no usable CUDA driver?)");
    }
    FUSEDMOE_CHECK(current == d.index, ref->name, ": on ", device_str(d),
                   ", but the current CUDA device is cuda:", current,
                   "; make it current first (torch.cuda.set_device(", d.index,
                   ") or `with torch.cuda.device(", d.index, "):`, cupy.cuda.Device(", d.index,
                   ").use())");
  }
#endif
  return d;
}

const TensorView* opt(const std::optional<TensorView>& v) {
  return v ? &*v : nullptr;
}

std::string dlpack_dtype_str(nb::dlpack::dtype dt) {
  const char* code = "?";
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int:
      code = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      code = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      code = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      code = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      code = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      code = "bool";
      break;
    default:
      break;
  }
  return std::string(code) + std::to_string(dt.bits);
}

// DLPack dtype -> DType. uint16 is bf16 bit patterns when `u16_is_bf16`
// (NumPy has no bfloat16). Returns nullopt for anything else.
std::optional<DType> to_dtype(nb::dlpack::dtype dt, bool u16_is_bf16) {
  if (dt.lanes != 1) return std::nullopt;
  using C = nb::dlpack::dtype_code;
  switch (static_cast<C>(dt.code)) {
    case C::Float:
      if (dt.bits == 64) return DType::kF64;
      if (dt.bits == 32) return DType::kF32;
      if (dt.bits == 16) return DType::kF16;
      break;
    case C::Bfloat:
      if (dt.bits == 16) return DType::kBF16;
      break;
    case C::Int:
      if (dt.bits == 64) return DType::kI64;
      if (dt.bits == 32) return DType::kI32;
      if (dt.bits == 16) return DType::kI16;
      if (dt.bits == 8) return DType::kI8;
      break;
    case C::UInt:
      if (dt.bits == 8) return DType::kU8;
      if (dt.bits == 16 && u16_is_bf16) return DType::kBF16;
      break;
    case C::Bool:
      return DType::kBool;
    default:
      break;
  }
  return std::nullopt;
}

template <typename Array>
TensorView view_of(const Array& a, const char* name, bool u16_is_bf16 = false) {
  const Device device = check_device(a.device_type(), a.device_id(), name);
  const auto dtype = to_dtype(a.dtype(), u16_is_bf16);
  if (!dtype)
    throw nb::type_error(
        (std::string(name) + ": unsupported dtype " + dlpack_dtype_str(a.dtype()) +
         (a.dtype().code == uint8_t(nb::dlpack::dtype_code::UInt) && a.dtype().bits == 16 &&
                  name[0] == 'w'  // the expert weights and biases take weight_dtype
              ? " (pass weight_dtype=\"bf16\" for bfloat16 bit patterns)"
              : ""))
            .c_str());
  FUSEDMOE_CHECK(a.ndim() <= static_cast<size_t>(kMaxDims), name, ": expected at most ", kMaxDims,
                 " dimensions, got ", a.ndim());
  int64_t shape[kMaxDims], strides[kMaxDims];
  for (size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = static_cast<int64_t>(a.shape(d));
    strides[d] = static_cast<int64_t>(a.stride(d));
  }
  if (a.size() == 0) {  // empty: exporters report arbitrary (often 0) strides
    int64_t s = 1;
    for (size_t d = a.ndim(); d-- > 0;) {
      strides[d] = s;
      s *= std::max<int64_t>(shape[d], 1);
    }
  }
  return TensorView(const_cast<void*>(static_cast<const void*>(a.data())), *dtype,
                    std::span<const int64_t>(shape, a.ndim()),
                    std::span<const int64_t>(strides, a.ndim()), device);
}

// A non-owning Tensor (the Python caller keeps the array alive for the call).
Tensor borrow(const TensorView& v) {
  return Tensor(v, nullptr);
}

void check_dtype(const TensorView& v, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (v.dtype() == d) return;
  std::string expected;
  for (DType d : allowed) expected += std::string(expected.empty() ? "" : " or ") + dtype_name(d);
  throw nb::type_error(
      (std::string(name) + ": expected dtype " + expected + ", got " + v.str()).c_str());
}

// A dtype option of the API (from_pretrained's dtype, fused_experts'
// compute_dtype and weight_dtype): exactly one of the names in `allowed` (of
// "f32", "bf16" and "f16", the names the README lists), the one rule for every
// option: aliases such as "float32" or "bfloat16" are refused by all alike, as
// is any other value, naming the option.
DType parse_dtype_option(const std::string& s, const std::string& name,
                         const std::vector<std::string>& allowed, const char* note = "") {
  std::string expected;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (s == allowed[i]) return parse_dtype(s);
    expected += std::string(i == 0                    ? ""
                            : i + 1 == allowed.size() ? " or "
                                                      : ", ") +
                "\"" + allowed[i] + "\"";
  }
  FUSEDMOE_THROW(kInvalidArgument, name, ": expected ", expected, note, ", got \"", printable(s),
                 "\"");
}

// A compute dtype: "f32", "bf16" or "f16".
DType parse_compute_dtype(const std::string& s, const char* name) {
  return parse_dtype_option(s, name, {"f32", "bf16", "f16"}, " (f16: CUDA only)");
}

// fused_experts' w13_layout: "standard" (HF's order: gate rows [0, I), then up
// rows [I, 2I)) or "interleaved128" (cuda::W13Layout::kInterleaved128, the
// order fusedmoe.interleave_w13 writes; CUDA only). Returns true for the latter.
bool parse_w13_layout(const std::string& s) {
  FUSEDMOE_CHECK(s == "standard" || s == "interleaved128",
                 "w13_layout: expected \"standard\" or \"interleaved128\", got \"", printable(s),
                 "\"");
  return s == "interleaved128";
}

// Arrays a router reads besides the logits, given although the configured
// router would ignore them: token_ids / hash_table belong to hash routing only.
void check_hash_inputs_used(const MoEConfig& c, bool has_token_ids, bool has_hash_table) {
  const bool hash = c.routing_method == RoutingMethod::kHash;
  FUSEDMOE_CHECK(hash || !has_token_ids, "token_ids: given, but the ", to_string(c.routing_method),
                 " router does not use them (hash routing only; they would be ignored)");
  FUSEDMOE_CHECK(hash || !has_hash_table, "hash_table: given, but the ",
                 to_string(c.routing_method),
                 " router does not use one (hash routing only; it would be ignored)");
}

// A NumPy copy of a host tensor: f32 for floating tensors (bf16 widened
// exactly), i32 for integer ones.
nb::object numpy_copy(const Tensor& t, const char* name) {
  FUSEDMOE_CHECK(t.view().device().is_cpu() && t.view().is_contiguous(), name,
                 ": expected a contiguous host tensor, got ", t.view().str());
  std::vector<size_t> shape(static_cast<size_t>(t.ndim()));
  for (int d = 0; d < t.ndim(); ++d) shape[static_cast<size_t>(d)] = static_cast<size_t>(t.size(d));
  const size_t n = static_cast<size_t>(t.numel());
  if (t.dtype() == DType::kI32 || t.dtype() == DType::kI64) {
    auto* data = new int32_t[std::max<size_t>(n, 1)];
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
    for (size_t i = 0; i < n; ++i)
      data[i] = t.dtype() == DType::kI32 ? t.data_as<const int32_t>()[i]
                                         : static_cast<int32_t>(t.data_as<const int64_t>()[i]);
    return nb::cast(nb::ndarray<nb::numpy, int32_t>(data, shape.size(), shape.data(), owner));
  }
  auto* data = new float[std::max<size_t>(n, 1)];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  convert_to_f32(t.data(), t.dtype(), data, n);
  return nb::cast(nb::ndarray<nb::numpy, float>(data, shape.size(), shape.data(), owner));
}

// ---- MoEConfig <-> dict ------------------------------------------------------------

// MoEConfig <-> dict through its JSON form (MoEConfig::to_json / from_json: the
// keys of `fusedmoe inspect --json`). from_json reads any subset of the keys;
// unknown keys, wrong value types and unknown enum names raise ValueError.
nb::dict config_to_dict(const MoEConfig& c) {
  return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(c.to_json()));
}

// Wrong Python types raise TypeError (the JSON type of each key's default value
// says what it takes); everything else is left to MoEConfig::from_json.
// The keys a config dict may have (MoEConfig's JSON fields, in their order).
std::vector<std::string> config_fields() {
  std::vector<std::string> keys;
  for (auto [k, v] : config_to_dict(MoEConfig{})) keys.push_back(nb::cast<std::string>(k));
  return keys;
}

MoEConfig config_from_dict(const nb::dict& given) {
  const nb::dict defaults = config_to_dict(MoEConfig{});
  // Keys first (a value of an unknown key never reaches json.dumps: an array there
  // raised the encoder's own TypeError, naming nothing; session 29's trial), and
  // NumPy scalars (np.True_, np.int64(4)) taken as the Python values they hold.
  nb::dict d;
  for (auto [k, v] : given) {
    if (!nb::isinstance<nb::str>(k))
      throw nb::type_error(("config: keys must be str, got " +
                            std::string(nb::type_name(k.type()).c_str()) + " " +
                            printable(nb::cast<std::string>(nb::repr(k))))
                               .c_str());
    if (!defaults.contains(k)) {  // MoEConfig::from_json's error, from the key alone
      nb::dict alone;
      alone[k] = nb::none();
      MoEConfig::from_json(nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(alone)),
                           "config");
    }
    const bool numpy_scalar =
        nb::hasattr(v, "item") && nb::hasattr(v, "ndim") &&
        nb::cast<std::string>(nb::str(v.type().attr("__module__"))) == "numpy" &&
        nb::cast<int>(v.attr("ndim")) == 0;
    d[k] = numpy_scalar ? v.attr("item")() : nb::object(v, nb::detail::borrow_t{});
  }
  for (auto [k, v] : d) {
    const nb::handle want = defaults[k];
    const bool is_bool = nb::isinstance<nb::bool_>(v);
    bool ok;
    const char* expected;
    if (nb::isinstance<nb::bool_>(want)) {
      ok = is_bool, expected = "bool";
    } else if (nb::isinstance<nb::int_>(want)) {
      ok = !is_bool && nb::isinstance<nb::int_>(v), expected = "int";
    } else if (nb::isinstance<nb::float_>(want)) {
      ok = !is_bool && (nb::isinstance<nb::float_>(v) || nb::isinstance<nb::int_>(v)),
      expected = "float";
    } else {
      ok = nb::isinstance<nb::str>(v), expected = "str";
    }
    if (ok && nb::isinstance<nb::float_>(v) && !std::isfinite(nb::cast<double>(v)))
      FUSEDMOE_THROW(kInvalidArgument, "config.", nb::cast<std::string>(k),
                     ": expected a finite number, got ", nb::cast<double>(v));
    if (!ok)
      throw nb::type_error(("config." + nb::cast<std::string>(k) + ": expected " + expected +
                            ", got " + nb::type_name(v.type()).c_str() + " " +
                            printable(nb::cast<std::string>(nb::repr(v))))
                               .c_str());
  }
  const auto text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(d));
  return MoEConfig::from_json(text, "config");
}

// Calls running without the GIL (ReleaseGil), and whether the interpreter is
// exiting (drain_calls_at_exit); both read and written with the GIL held.
int g_calls_without_gil = 0;
bool g_exiting = false;

// ---- fork() and the calls' mutexes -------------------------------------------------

// A thread of the parent may hold one of the mutexes that serialise a layer's
// (or the functional ops') calls when another thread forks: the child has only
// the forking thread, so that mutex would stay locked there for ever (the next
// call in the child hung). Every such mutex is registered; the child re-creates
// them unlocked (what they guard, a workspace, is rewritten by the next call;
// the thread pools and MoERunner take themselves over in the child too). The
// registry's own mutex is held across fork() so the child's copy is whole.
std::mutex& call_mutexes_mu() {
  static auto* mu = new std::mutex;  // never destroyed: the atfork handlers use it
  return *mu;
}
std::set<std::mutex*>& call_mutexes() {
  static auto* set = new std::set<std::mutex*>;
  return *set;
}
void register_call_mutex(std::mutex* m) {
  static std::once_flag atfork;
  std::call_once(atfork, [] {
    pthread_atfork([] { call_mutexes_mu().lock(); }, [] { call_mutexes_mu().unlock(); },
                   [] {
                     for (std::mutex* m : call_mutexes()) new (m) std::mutex();
                     g_calls_without_gil = 0;  // the parent's other threads' calls
                     call_mutexes_mu().unlock();
                   });
  });
  std::lock_guard<std::mutex> lock(call_mutexes_mu());
  call_mutexes().insert(m);
}
void unregister_call_mutex(std::mutex* m) {
  std::lock_guard<std::mutex> lock(call_mutexes_mu());
  call_mutexes().erase(m);
}
// A registered std::mutex (BasicLockable: std::lock_guard<CallMutex>).
class CallMutex {
 public:
  CallMutex() { register_call_mutex(&mu_); }
  ~CallMutex() { unregister_call_mutex(&mu_); }
  CallMutex(const CallMutex&) = delete;
  CallMutex& operator=(const CallMutex&) = delete;
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// ---- the interpreter's exit and calls without the GIL ------------------------------

// A call releases the GIL while it runs (ReleaseGil). When the interpreter
// exits, CPython (before 3.14) ends a daemon thread that asks for the GIL back
// with pthread_exit; from inside a C++ call (a destructor: noexcept) that
// unwinding aborts the process ("terminate called without an active
// exception"). So at exit (an atexit function, drain_calls_at_exit, run while
// the interpreter still stands) the calls still running are waited for, and
// later calls keep the GIL for their whole run: no thread of ours asks for it
// back once the interpreter has begun to finalize.

// nb::gil_scoped_release that counts its call, or keeps the GIL once the
// interpreter is exiting.
class ReleaseGil {
 public:
  ReleaseGil() {
    if (g_exiting) return;
    ++g_calls_without_gil;
    state_ = PyEval_SaveThread();
  }
  ~ReleaseGil() {
    if (state_ == nullptr) return;
    PyEval_RestoreThread(state_);
    --g_calls_without_gil;
  }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

void drain_calls_at_exit() {
  g_exiting = true;
  // Daemon threads still running hold their objects (a layer, its arrays) to
  // the end: nanobind's report of them as leaks would blame the binding.
  if (nb::cast<int>(nb::module_::import_("threading").attr("active_count")()) > 1)
    nb::set_leak_warnings(false);
  while (g_calls_without_gil > 0) {
    nb::gil_scoped_release release;  // the running calls take the GIL back to return
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- functional ops ----------------------------------------------------------------

// One modular kernel and workspace for the functional fused_experts; calls are
// serialised (the workspace is reused across calls, grow-only).
struct FunctionalState {
  CallMutex mu;
  std::unique_ptr<ModularKernel> kernel = make_cpu_modular_kernel();
  Workspace ws;
};
FunctionalState& functional_state() {
  static FunctionalState* s = new FunctionalState();  // never destroyed: no exit-order issues
  return *s;
}

// w2 of another dtype than w13: a TypeError, as every wrong dtype (the kernels'
// own check, ExpertWeights::validate, is an Error(kInvalidArgument): a ValueError).
void check_w2_dtype_is_w13s(const ExpertWeights& w) {
  if (w.w2.dtype() != w.w13.dtype())
    throw nb::type_error(("w2: expected the dtype of w13 (" +
                          std::string(dtype_name(w.w13.dtype())) + "), got " + w.w2.view().str())
                             .c_str());
}

#ifdef FUSEDMOE_WITH_CUDA
// Validated arguments of the CUDA functional fused_experts (cuda::fused_experts)
// from device views; the caller checked that they share the current device.
cuda::FusedExpertsArgs cuda_fused_experts_args(const TensorView& x, const ExpertWeights& w,
                                               const TensorView& tw, const TensorView& ti,
                                               const TensorView& out, const ExpertsParams& params,
                                               bool apply_router_weight_on_input,
                                               bool w13_interleaved,
                                               const std::optional<TensorView>& ws) {
  const Device dev = x.device();
  check_dtype(x, "hidden_states", {DType::kF32, DType::kBF16, DType::kF16});
  for (const auto& [t, name] : {std::pair{&w.w13, "w13"}, std::pair{&w.w2, "w2"}})
    if (t->dtype() != DType::kBF16 && t->dtype() != DType::kF16)
      throw nb::type_error(
          (std::string(name) + ": the CUDA backend takes bf16 or f16 expert weights, got " +
           t->view().str() + "; convert them once (" + name + ".to(torch.bfloat16))")
              .c_str());
  check_w2_dtype_is_w13s(w);
  if (w.w13_bias) check_dtype(w.w13_bias->view(), "w13_bias", {DType::kF32});
  if (w.w2_bias) check_dtype(w.w2_bias->view(), "w2_bias", {DType::kF32});
  check_dtype(out, "output", {DType::kF32, DType::kBF16, DType::kF16});
  FUSEDMOE_CHECK(params.compute_dtype == w.w13.dtype(),
                 "compute_dtype: the CUDA backend computes in the expert weights' half type "
                 "(f32 accumulation); expected \"",
                 dtype_name(w.w13.dtype()), "\", got \"", dtype_name(params.compute_dtype), "\"");
  FUSEDMOE_CHECK(x.ndim() == 2, "hidden_states: expected [T, H], got ", x.str());
  // E and I from w2, as the CPU's fused_experts takes them: a w13 that cannot
  // be [E, 2I, H] is named with the shape w2 implies.
  const ExpertSizes sizes = expert_sizes_from_w2(w, "w13", "w2");
  const int64_t T = x.size(0), H = x.size(1), E = sizes.num_experts, I = sizes.intermediate_size;
  FUSEDMOE_CHECK(tw.ndim() == 2, "topk_weights: expected [T, k], got ", tw.str());
  const int64_t k = tw.size(1);
  FUSEDMOE_CHECK(k >= 1, "topk_weights: expected [T, k] with k >= 1 (top_k), got ", tw.str());
  check_topk_shapes_agree(ti, tw);
  FUSEDMOE_CHECK(!w13_interleaved || I % cuda::kW13Block == 0,
                 "w13_layout: \"interleaved128\" needs the intermediate size I a multiple of ",
                 cuda::kW13Block, ", got I = ", I, " (w2 ", w.w2.view().str(),
                 "); pass w13_layout=\"standard\" with w13 in HF's order");
  check_tensor(x, "hidden_states", x.dtype(), {T, H}, true, dev);
  check_tensor(w.w13, "w13", w.w13.dtype(), {E, 2 * I, H}, true, dev);
  check_tensor(w.w2, "w2", w.w13.dtype(), {E, H, I}, true, dev);
  FUSEDMOE_CHECK(w.w13.view().is_contiguous(), "w13: expected a contiguous tensor, got strides");
  FUSEDMOE_CHECK(w.w2.view().is_contiguous(), "w2: expected a contiguous tensor");
  if (w.w13_bias) {
    check_tensor(*w.w13_bias, "w13_bias", DType::kF32, {E, 2 * I}, true, dev);
    FUSEDMOE_CHECK(w.w13_bias->view().is_contiguous(), "w13_bias: expected a contiguous tensor");
  }
  if (w.w2_bias) {
    check_tensor(*w.w2_bias, "w2_bias", DType::kF32, {E, H}, true, dev);
    FUSEDMOE_CHECK(w.w2_bias->view().is_contiguous(), "w2_bias: expected a contiguous tensor");
  }
  check_tensor(tw, "topk_weights", DType::kF32, {T, k}, true, dev);
  check_tensor(ti, "topk_ids", DType::kI32, {T, k}, true, dev);
  FUSEDMOE_CHECK(tw.is_contiguous(), "topk_weights: expected a contiguous tensor");
  FUSEDMOE_CHECK(ti.is_contiguous(), "topk_ids: expected a contiguous tensor");
  check_tensor(out, "output", out.dtype(), {T, H}, true, dev);
  const size_t need = cuda::fused_experts_workspace_bytes(
      T, H, I, E, k, apply_router_weight_on_input,
      w13_interleaved ? cuda::W13Layout::kInterleaved128 : cuda::W13Layout::kStandard);
  FUSEDMOE_CHECK(ws.has_value(), "workspace: required on CUDA (a uint8 device tensor of ", need,
                 " bytes: fusedmoe.cuda_fused_experts_workspace_bytes)");
  check_tensor(*ws, "workspace", ws->dtype(), {-1}, true, dev);
  FUSEDMOE_CHECK(ws->nbytes() >= need, "workspace: expected at least ", need, " bytes, got ",
                 ws->nbytes());
  cuda::FusedExpertsArgs a;
  a.hidden_states = x.data();
  a.hidden_dtype = x.dtype();
  a.ldx = x.stride(0);
  a.num_tokens = T;
  a.hidden_size = H;
  a.intermediate_size = I;
  a.num_experts = E;
  a.top_k = k;
  a.weight_dtype = w.w13.dtype();
  a.w13 = w.w13.data_as<const uint16_t>();
  a.w13_layout = w13_interleaved ? cuda::W13Layout::kInterleaved128 : cuda::W13Layout::kStandard;
  a.w2 = w.w2.data_as<const uint16_t>();
  a.w13_bias = w.w13_bias ? w.w13_bias->data_as<const float>() : nullptr;
  a.w2_bias = w.w2_bias ? w.w2_bias->data_as<const float>() : nullptr;
  a.topk_ids = ti.data_as<const int32_t>();
  a.topk_weights = tw.data_as<const float>();
  a.activation = params.activation;
  a.apply_router_weight_on_input = apply_router_weight_on_input;
  a.output = out.data();
  a.output_dtype = out.dtype();
  a.ldo = out.stride(0);
  return a;
}
#endif

// fused_experts' options, parsed and checked (no array needed): the activation
// with its clamped-SwiGLU parameters, compute_dtype and w13_layout. The Python
// wrapper calls it (check_experts_options) before it copies any array, so a
// bad option is named without the copies of the weights first.
struct ExpertsOptions {
  ExpertsParams params;
  bool w13_interleaved = false;
};
ExpertsOptions experts_options(const std::string& activation, float swiglu_alpha,
                               float swiglu_limit, const std::string& compute_dtype,
                               const std::string& w13_layout) {
  ExpertsOptions o;
  o.params.activation.activation = parse_activation(activation);
  o.params.activation.swiglu_alpha = swiglu_alpha;
  o.params.activation.swiglu_limit = swiglu_limit;
  // On either device: swiglu_alpha / swiglu_limit other than their defaults
  // with another activation than swiglu_oai (which alone reads them) are refused.
  o.params.activation.validate();
  o.params.compute_dtype = parse_compute_dtype(compute_dtype, "compute_dtype");
  o.w13_interleaved = parse_w13_layout(w13_layout);
  return o;
}

void fused_experts(const InArray& hidden_states, const InArray& w13, const InArray& w2,
                   const InArray& topk_weights, const InArray& topk_ids, const OutArray& output,
                   const std::string& activation, const OptIn& w13_bias, const OptIn& w2_bias,
                   bool apply_router_weight_on_input, const std::string& compute_dtype,
                   bool weights_u16_is_bf16, float swiglu_alpha, float swiglu_limit,
                   const OptOut& workspace, uintptr_t stream, const std::string& w13_layout) {
  const TensorView x = view_of(hidden_states, "hidden_states");
  ExpertWeights weights;
  weights.w13 = borrow(view_of(w13, "w13", weights_u16_is_bf16));
  weights.w2 = borrow(view_of(w2, "w2", weights_u16_is_bf16));
  if (w13_bias) {
    weights.w13_bias = borrow(view_of(*w13_bias, "w13_bias", weights_u16_is_bf16));
    check_dtype(weights.w13_bias->view(), "w13_bias", {DType::kF32, DType::kBF16});
  }
  if (w2_bias) {
    weights.w2_bias = borrow(view_of(*w2_bias, "w2_bias", weights_u16_is_bf16));
    check_dtype(weights.w2_bias->view(), "w2_bias", {DType::kF32, DType::kBF16});
  }
  FUSEDMOE_CHECK(w13_bias.has_value() == w2_bias.has_value(),
                 "w13_bias, w2_bias: give both biases or neither (got ",
                 w13_bias ? "w13_bias only" : "w2_bias only", ")");
  const TensorView tw = view_of(topk_weights, "topk_weights");
  const TensorView ti = view_of(topk_ids, "topk_ids");
  const TensorView out = view_of(output, "output");
  std::optional<TensorView> ws;
  if (workspace) ws = view_of(*workspace, "workspace");
  const Device dev =
      common_device({{&x, "hidden_states"},
                     {&weights.w13.view(), "w13"},
                     {&weights.w2.view(), "w2"},
                     {weights.w13_bias ? &weights.w13_bias->view() : nullptr, "w13_bias"},
                     {weights.w2_bias ? &weights.w2_bias->view() : nullptr, "w2_bias"},
                     {&tw, "topk_weights"},
                     {&ti, "topk_ids"},
                     {&out, "output"},
                     {opt(ws), "workspace"}});
  const ExpertsOptions options =
      experts_options(activation, swiglu_alpha, swiglu_limit, compute_dtype, w13_layout);
  const ExpertsParams& params = options.params;
  const bool w13_interleaved = options.w13_interleaved;
  if (dev.type == DeviceType::kCUDA) {
#ifdef FUSEDMOE_WITH_CUDA
    const cuda::FusedExpertsArgs a = cuda_fused_experts_args(
        x, weights, tw, ti, out, params, apply_router_weight_on_input, w13_interleaved, ws);
    ReleaseGil release;
    cuda::fused_experts(a, ws->data(), ws->nbytes(), reinterpret_cast<cuda::Stream>(stream));
#endif
    return;
  }
  FUSEDMOE_CHECK(!w13_interleaved,
                 "w13_layout: \"interleaved128\" runs on the CUDA backend only (CUDA arrays); "
                 "the CPU kernels read w13 in HF's order: pass w13_layout=\"standard\" and w13 "
                 "as it was before interleave_w13");
  FUSEDMOE_CHECK(params.compute_dtype != DType::kF16,
                 "compute_dtype: \"f16\" runs on the CUDA backend only (CUDA tensors)");
  check_dtype(x, "hidden_states", {DType::kF32});
  check_dtype(weights.w13.view(), "w13", {DType::kF32, DType::kBF16});
  check_dtype(weights.w2.view(), "w2", {DType::kF32, DType::kBF16});
  check_w2_dtype_is_w13s(weights);
  check_dtype(tw, "topk_weights", {DType::kF32});
  check_dtype(ti, "topk_ids", {DType::kI32});
  // The weights' shapes as ModularKernel::forward takes them (E and I from w2,
  // H from w13, or from w2 where only w2 agrees with hidden_states), named as
  // the arguments are: the kernel names them experts.w13, experts.w2.
  const ExpertSizes sizes = expert_sizes_from_w2(weights, "w13", "w2");
  const int64_t E = sizes.num_experts, I = sizes.intermediate_size;
  int64_t H = weights.w13.size(2);
  if (weights.w2.size(1) != H && x.ndim() == 2 && weights.w2.size(1) == x.size(1))
    H = weights.w2.size(1);
  check_tensor(weights.w13.view(), "w13", weights.w13.dtype(), {E, 2 * I, H});
  check_tensor(weights.w2.view(), "w2", weights.w2.dtype(), {E, H, I});
  if (weights.w13_bias)
    check_tensor(weights.w13_bias->view(), "w13_bias", weights.w13_bias->dtype(), {E, 2 * I});
  if (weights.w2_bias)
    check_tensor(weights.w2_bias->view(), "w2_bias", weights.w2_bias->dtype(), {E, H});

  FunctionalState& s = functional_state();
  ReleaseGil release;
  std::lock_guard<CallMutex> lock(s.mu);
  s.kernel->forward(x, ti, tw, weights, params, apply_router_weight_on_input, out, s.ws);
  // As MoELayer: hidden states that overflow f32 inside the experts, or weights
  // holding NaN / Inf (not checked here: they are the caller's), raise
  // ValueError naming the first non-finite output, not NaN rows.
  require_finite_output(out);
}

// Benchmark hook: times `repeat` back-to-back C++ calls of the functional
// fused_experts kernel (ModularKernel::forward, no Python in the loop) on the
// given f32/bf16 arrays; returns each call's wall time in seconds.
std::vector<double> time_fused_experts(const InArray& hidden_states, const InArray& w13,
                                       const InArray& w2, const InArray& topk_weights,
                                       const InArray& topk_ids, const OutArray& output,
                                       int repeat) {
  ExpertWeights weights;
  weights.w13 = borrow(view_of(w13, "w13"));
  weights.w2 = borrow(view_of(w2, "w2"));
  const TensorView x = view_of(hidden_states, "hidden_states");
  const TensorView tw = view_of(topk_weights, "topk_weights");
  const TensorView ti = view_of(topk_ids, "topk_ids");
  const TensorView out = view_of(output, "output");
  ExpertsParams params;
  std::vector<double> times(static_cast<size_t>(std::max(repeat, 0)));
  FunctionalState& s = functional_state();
  ReleaseGil release;
  std::lock_guard<CallMutex> lock(s.mu);
  for (auto& t : times) {
    const auto t0 = std::chrono::steady_clock::now();
    s.kernel->forward(x, ti, tw, weights, params, false, out, s.ws);
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return times;
}

// Benchmark hook: `repeat` back-to-back cuda::fused_experts calls (silu, bf16
// weights, no Python in the loop) on `stream`, then one stream synchronisation.
// Returns (seconds from the first call to the end of the synchronisation,
// seconds spent enqueueing) for all calls together.
std::pair<double, double> time_fused_experts_cuda(const InArray& hidden_states, const InArray& w13,
                                                  const InArray& w2, const InArray& topk_weights,
                                                  const InArray& topk_ids, const OutArray& output,
                                                  const OutArray& workspace, int repeat,
                                                  uintptr_t stream) {
#ifndef FUSEDMOE_WITH_CUDA
  (void)hidden_states, (void)w13, (void)w2, (void)topk_weights, (void)topk_ids, (void)output,
      (void)workspace, (void)repeat, (void)stream;
  FUSEDMOE_THROW(kUnsupported, "this build of fusedmoe has no CUDA backend");
#else
  ExpertWeights weights;
  weights.w13 = borrow(view_of(w13, "w13"));
  weights.w2 = borrow(view_of(w2, "w2"));
  const TensorView x = view_of(hidden_states, "hidden_states");
  const TensorView tw = view_of(topk_weights, "topk_weights");
  const TensorView ti = view_of(topk_ids, "topk_ids");
  const TensorView out = view_of(output, "output");
  const std::optional<TensorView> ws = view_of(workspace, "workspace");
  const Device dev = common_device({{&x, "hidden_states"},
                                    {&weights.w13.view(), "w13"},
                                    {&weights.w2.view(), "w2"},
                                    {&tw, "topk_weights"},
                                    {&ti, "topk_ids"},
                                    {&out, "output"},
                                    {&*ws, "workspace"}});
  FUSEDMOE_CHECK(dev.type == DeviceType::kCUDA, "hidden_states: expected CUDA arrays");
  ExpertsParams params;
  params.compute_dtype = DType::kBF16;
  const cuda::FusedExpertsArgs a =
      cuda_fused_experts_args(x, weights, tw, ti, out, params, false, false, ws);
  const auto s = reinterpret_cast<cuda::Stream>(stream);
  ReleaseGil release;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < repeat; ++i) cuda::fused_experts(a, ws->data(), ws->nbytes(), s);
  const auto t1 = std::chrono::steady_clock::now();
  FUSEDMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream: synchronisation failed");
  const auto t2 = std::chrono::steady_clock::now();
  return {std::chrono::duration<double>(t2 - t0).count(),
          std::chrono::duration<double>(t1 - t0).count()};
#endif
}

// The same bindings in builds with and without the CUDA backend (one stub).
size_t cuda_workspace_bytes(int64_t num_tokens, int64_t hidden_size, int64_t intermediate_size,
                            int64_t num_experts, int64_t top_k, bool apply_router_weight_on_input,
                            const std::string& w13_layout) {
  const bool interleaved = parse_w13_layout(w13_layout);
#ifdef FUSEDMOE_WITH_CUDA
  // As fused_experts names it (the library's message spells the C++ enum).
  FUSEDMOE_CHECK(!interleaved || intermediate_size <= 0 || intermediate_size % cuda::kW13Block == 0,
                 "w13_layout: \"interleaved128\" needs the intermediate size I a multiple of ",
                 cuda::kW13Block, ", got I = ", intermediate_size,
                 "; pass w13_layout=\"standard\" with w13 in HF's order");
  return cuda::fused_experts_workspace_bytes(
      num_tokens, hidden_size, intermediate_size, num_experts, top_k, apply_router_weight_on_input,
      interleaved ? cuda::W13Layout::kInterleaved128 : cuda::W13Layout::kStandard);
#else
  (void)num_tokens, (void)hidden_size, (void)intermediate_size, (void)num_experts, (void)top_k,
      (void)apply_router_weight_on_input, (void)interleaved;
  FUSEDMOE_THROW(kUnsupported, "this build of fusedmoe has no CUDA backend");
#endif
}
int cuda_device_count() {
#ifdef FUSEDMOE_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

#ifdef FUSEDMOE_WITH_CUDA
// cuda::route on device views (the caller checked the device): the same
// arguments the CPU routers check in create_router, checked here on shapes only
// (values stay on the device).
void select_experts_cuda(const MoEConfig& c, const TensorView& logits, const TensorView& ids,
                         const TensorView& weights, const std::optional<TensorView>& bias,
                         const std::optional<TensorView>& tok,
                         const std::optional<TensorView>& table, uintptr_t stream) {
  c.validate();
  const Device dev = logits.device();
  const int64_t L = c.num_router_logits(), k = c.top_k;
  FUSEDMOE_CHECK(logits.ndim() == 2, "router_logits: expected [T, ", L, "], got ", logits.str());
  const int64_t T = logits.size(0);
  check_tensor(logits, "router_logits", DType::kF32, {T, L}, true, dev);
  check_tensor(ids, "topk_ids", DType::kI32, {T, k}, true, dev);
  check_tensor(weights, "topk_weights", DType::kF32, {T, k}, true, dev);
  FUSEDMOE_CHECK(ids.is_contiguous() && weights.is_contiguous(),
                 "topk_ids, topk_weights: expected contiguous outputs");
  const RoutingMethod m = c.routing_method;
  const bool grouped = m == RoutingMethod::kGroupedTopK || c.num_expert_group > 1;
  const bool uses_bias = m == RoutingMethod::kTopK || m == RoutingMethod::kGroupedTopK ||
                         (m == RoutingMethod::kTopKSoftmax && c.num_expert_group > 1);
  FUSEDMOE_CHECK(!bias || (uses_bias && c.has_e_score_correction_bias),
                 "e_score_correction_bias: given, but the ", to_string(m),
                 " router with this config does not use one (it would be ignored)");
  if (c.has_e_score_correction_bias && uses_bias) {
    const int64_t n = grouped ? c.num_experts : L;
    FUSEDMOE_CHECK(bias.has_value(), "e_score_correction_bias: expected f32 [", n,
                   "] (config e_score_correction_bias is true), got none");
    check_tensor(*bias, "e_score_correction_bias", DType::kF32, {n}, true, dev);
  }
  if (m == RoutingMethod::kHash) {
    FUSEDMOE_CHECK(table.has_value(), "hash_table: expected i32 [", c.hash_vocab_size, ", ", k,
                   "] for hash routing, got none");
    check_tensor(*table, "hash_table", DType::kI32, {c.hash_vocab_size, k}, true, dev);
    FUSEDMOE_CHECK(table->is_contiguous(), "hash_table: expected a contiguous tensor");
    FUSEDMOE_CHECK(tok.has_value(), "token_ids: required by hash routing");
    check_tensor(*tok, "token_ids", DType::kI32, {T}, true, dev);
  }
  cuda::RouteArgs ra;
  ra.router_logits = logits.data_as<const float>();
  ra.logits_ld = logits.stride(0);
  ra.bias = bias ? bias->data_as<const float>() : nullptr;
  ra.hash_table = table ? table->data_as<const int32_t>() : nullptr;
  ra.token_ids = tok ? tok->data_as<const int32_t>() : nullptr;
  ra.topk_ids = ids.data_as<int32_t>();
  ra.topk_weights = weights.data_as<float>();
  if (T == 0) return;
  ReleaseGil release;
  cuda::route(c, ra, T, reinterpret_cast<cuda::Stream>(stream));
}
#endif

// Routing with a MoEConfig given as a dict (see config_from_dict).
void select_experts(const InArray& router_logits, const OutArray& topk_ids,
                    const OutArray& topk_weights, const nb::dict& config,
                    const OptIn& e_score_correction_bias, const OptIn& token_ids,
                    const OptIn& hash_table, uintptr_t stream) {
  const MoEConfig c = config_from_dict(config);
  const TensorView logits = view_of(router_logits, "router_logits");
  const TensorView ids = view_of(topk_ids, "topk_ids");
  const TensorView weights = view_of(topk_weights, "topk_weights");
  std::optional<TensorView> bias, tok, table;
  if (e_score_correction_bias) bias = view_of(*e_score_correction_bias, "e_score_correction_bias");
  if (token_ids) tok = view_of(*token_ids, "token_ids");
  if (hash_table) table = view_of(*hash_table, "hash_table");
  const Device dev = common_device({{&logits, "router_logits"},
                                    {&ids, "topk_ids"},
                                    {&weights, "topk_weights"},
                                    {opt(bias), "e_score_correction_bias"},
                                    {opt(tok), "token_ids"},
                                    {opt(table), "hash_table"}});
  check_dtype(logits, "router_logits", {DType::kF32});
  check_hash_inputs_used(c, tok.has_value(), table.has_value());
  if (dev.type == DeviceType::kCUDA) {
#ifdef FUSEDMOE_WITH_CUDA
    select_experts_cuda(c, logits, ids, weights, bias, tok, table, stream);
#endif
    return;
  }
  RouterParams params;
  if (bias) params.e_score_correction_bias = borrow(*bias);
  if (table) params.hash_table = borrow(*table);
  const auto router = create_router(c, params);
  ReleaseGil release;
  router->select_experts(logits, ids, weights, tok ? &*tok : nullptr);
}

// ---- CudaWorkspace ------------------------------------------------------------------

// One workspace shared by CUDA layers (cuda::SharedWorkspace); in a build without
// the CUDA backend its constructor raises.
class PyCudaWorkspace {
 public:
  PyCudaWorkspace() {
#ifdef FUSEDMOE_WITH_CUDA
    ws_ = std::make_shared<cuda::SharedWorkspace>();
#else
    FUSEDMOE_THROW(kUnsupported,
                   "CudaWorkspace: this build of fusedmoe has no CUDA backend (built without the "
                   "CUDA toolkit, or with FUSEDMOE_CUDA=OFF)");
#endif
  }
#ifdef FUSEDMOE_WITH_CUDA
  const std::shared_ptr<cuda::SharedWorkspace>& get() const {
    return ws_;
  }
  size_t nbytes() const {
    return ws_->bytes();
  }
  int device() const {
    return ws_->device();
  }
  void reserve(int64_t nbytes) {
    FUSEDMOE_CHECK(nbytes >= 0, "nbytes: expected >= 0, got ", nbytes);
    FUSEDMOE_CHECK(cuda::device_count() > 0, "CudaWorkspace.reserve: no CUDA device is visible");
    ReleaseGil release;
    ws_->reserve(static_cast<size_t>(nbytes));
  }

 private:
  std::shared_ptr<cuda::SharedWorkspace> ws_;
#else
  size_t nbytes() const {
    return 0;
  }
  int device() const {
    return -1;
  }
  void reserve(int64_t) {}
#endif
};

// ---- expert parallelism -----------------------------------------------------------

// One rank of a GPU expert-parallel group: an NCCL communicator joined by the
// ncclUniqueId bytes one rank made (nccl_unique_id()) and handed to all
// (fusedmoe.ExpertParallelGroup does it over torch.distributed).
class PyEpGroup {
 public:
  PyEpGroup(const nb::bytes& unique_id, int rank, int size, int device) {
    const auto* p = static_cast<const uint8_t*>(unique_id.data());
    const std::vector<uint8_t> id(p, p + unique_id.size());
    ReleaseGil release;  // collective: waits for the other ranks
    comm_ = make_nccl_communicator(std::span<const uint8_t>(id), rank, size, device);
    device_ = device;
  }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  int device() const { return device_; }
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

 private:
  std::shared_ptr<Communicator> comm_;
  int device_ = 0;
};

// ---- MoELayer ----------------------------------------------------------------------

class PyMoELayer {
 public:
  // device: CPU, or CUDA (the current device; weights uploaded there and a
  // workspace for max_num_tokens tokens allocated once).
  PyMoELayer(MoEConfig config, MoELayerWeights weights, DType compute_dtype,
             std::optional<int> threads, std::string source, int64_t layer, Device device,
             int64_t max_num_tokens, const PyCudaWorkspace* workspace = nullptr,
             const PyEpGroup* ep_group = nullptr)
      : source_(std::move(source)), layer_(layer), device_(device) {
    if (threads) {
      // 0: the global pool (all cores unless set_num_threads changed it), as
      // `fusedmoe run --threads 0`; N > 0: a private pool of N threads.
      FUSEDMOE_CHECK(*threads >= 0 && *threads <= ThreadPool::kMaxThreads, "threads: expected 0..",
                     ThreadPool::kMaxThreads, " (0: all cores), got ", *threads);
      if (*threads > 0) pool_ = std::make_unique<ThreadPool>(*threads);
    }
    RunnerOptions options;
    options.compute_dtype = compute_dtype;
    options.pool = pool_.get();
    options.device = device;
    options.max_num_tokens = max_num_tokens;
#ifdef FUSEDMOE_WITH_CUDA
    if (workspace) options.cuda_workspace = workspace->get();
#endif
    if (ep_group) {
      config.parallel = parallel_config_for_rank(ep_group->rank(), ep_group->size(), 1, 1);
      options.communicator = ep_group->comm();
    }
    if (device.type == DeviceType::kCUDA) {
      ReleaseGil release;  // uploads the weights
      runner_ = std::make_unique<MoERunner>(std::move(config), std::move(weights), options);
    } else {
      runner_ = std::make_unique<MoERunner>(std::move(config), std::move(weights), options);
    }
    compute_dtype_ = compute_dtype;
    max_num_tokens_ =
        device.type == DeviceType::kCUDA ? (max_num_tokens > 0 ? max_num_tokens : 8192) : 0;
  }

  static PyMoELayer* from_pretrained(const std::string& model_dir, std::optional<int64_t> layer,
                                     const std::string& dtype, std::optional<int> threads,
                                     const std::string& backend, int64_t max_num_tokens,
                                     bool check_finite, const PyCudaWorkspace* workspace,
                                     const PyEpGroup* ep_group) {
    // "auto" (CUDA): f16 for an f16 checkpoint, else bf16 (decided below).
    const bool auto_dtype = dtype == "auto" && backend == "cuda";
    DType compute = auto_dtype ? DType::kBF16 : parse_compute_dtype(dtype, "dtype");
    Device device;
    if (backend == "cuda") {
#ifdef FUSEDMOE_WITH_CUDA
      FUSEDMOE_CHECK(cuda::device_count() > 0, "backend: \"cuda\", but no CUDA device is visible");
      int current = 0;
      FUSEDMOE_CHECK(cudaGetDevice(&current) == cudaSuccess, "backend: cudaGetDevice failed");
      device = Device{DeviceType::kCUDA, current};
      FUSEDMOE_CHECK(compute == DType::kBF16 || compute == DType::kF16,
                     "dtype: the CUDA backend computes in bf16 or f16 (f32 accumulation); "
                     "expected \"bf16\" or \"f16\", got \"",
                     dtype, "\"");
      FUSEDMOE_CHECK(max_num_tokens >= 0, "max_num_tokens: expected >= 0, got ", max_num_tokens);
      FUSEDMOE_CHECK(!ep_group || ep_group->device() == current,
                     "ep_group: its GPU is cuda:", ep_group ? ep_group->device() : 0,
                     ", but the current device is cuda:", current,
                     " (torch.cuda.set_device(the group's device) first)");
#else
      FUSEDMOE_THROW(kUnsupported,
                     "backend: \"cuda\", but this build of fusedmoe has no CUDA backend (built "
                     "without the CUDA toolkit, or with FUSEDMOE_CUDA=OFF)");
#endif
    } else {
      FUSEDMOE_CHECK(backend == "cpu", "backend: expected \"cpu\" or \"cuda\", got \"", backend,
                     "\"");
      FUSEDMOE_CHECK(compute != DType::kF16,
                     "dtype: \"f16\" runs on the CUDA backend only (backend=\"cuda\"); the CPU "
                     "backend computes in \"f32\" or \"bf16\"");
      FUSEDMOE_CHECK(workspace == nullptr,
                     "workspace: a CudaWorkspace serves CUDA layers only (backend=\"cuda\"), "
                     "got backend=\"cpu\"");
      FUSEDMOE_CHECK(ep_group == nullptr,
                     "ep_group: GPU expert parallelism needs backend=\"cuda\", got "
                     "backend=\"cpu\"");
    }
    MoEConfig config;
    MoELayerWeights weights;
    int64_t l = 0;
    {
      ReleaseGil release;
      const ModelInfo info = load_model_info(model_dir);
      require_moe_layer(info, "model_dir: " + printable(model_dir));
      l = layer ? *layer : info.moe_layers.front();
      config = info.layer_config(l);
      if (auto_dtype && info.dtype == DType::kF16) compute = DType::kF16;
      const Checkpoint checkpoint = Checkpoint::open(model_dir);
      LoadOptions options;
      options.progress = false;
      options.check_finite = check_finite;
      try {
        weights = load_moe_layer(checkpoint, info, l, options);
      } catch (const Error& e) {
        // The library's way past its value checks, as Python spells it.
        std::string what = e.what();
        const std::string cpp = "LoadOptions::check_finite = false";
        for (size_t at; (at = what.find(cpp)) != std::string::npos;)
          what.replace(at, cpp.size(), "MoELayer.from_pretrained(..., check_finite=False)");
        throw Error(e.code(), what);
      }
    }
    return new PyMoELayer(std::move(config), std::move(weights), compute, threads, model_dir, l,
                          device, max_num_tokens, workspace, ep_group);
  }

  // stream: the cudaStream_t (as an integer) CUDA layers enqueue on.
  void forward(const InArray& hidden_states, const OutArray& output, const OptIn& router_logits,
               const OptOut& out_router_logits, const OptOut& out_topk_ids,
               const OptOut& out_topk_weights, const OptIn& token_ids, uintptr_t stream) {
    const TensorView x = view_of(hidden_states, "hidden_states");
    const TensorView out = view_of(output, "output");
    std::optional<TensorView> logits, tok, o_logits, o_ids, o_weights;
    if (router_logits) logits = view_of(*router_logits, "router_logits");
    if (token_ids) tok = view_of(*token_ids, "token_ids");
    if (out_router_logits) o_logits = view_of(*out_router_logits, "router_logits");
    if (out_topk_ids) o_ids = view_of(*out_topk_ids, "topk_ids");
    if (out_topk_weights) o_weights = view_of(*out_topk_weights, "topk_weights");
    const Device dev = common_device({{&x, "hidden_states"},
                                      {&out, "output"},
                                      {opt(logits), "router_logits"},
                                      {opt(tok), "token_ids"},
                                      {opt(o_logits), "router_logits"},
                                      {opt(o_ids), "topk_ids"},
                                      {opt(o_weights), "topk_weights"}});
    if (dev != device_)
      FUSEDMOE_THROW(kInvalidArgument, "hidden_states: expected an array on ", device_str(device_),
                     " (this layer's backend), got one on ", device_str(dev));
    check_dtype(x, "hidden_states",
                dev.is_cpu()
                    ? std::initializer_list<DType>{DType::kF32}
                    : std::initializer_list<DType>{DType::kF32, DType::kBF16, DType::kF16});
    if (logits) check_dtype(*logits, "router_logits", {DType::kF32});
    check_hash_inputs_used(runner_->config(), tok.has_value(), false);
    if (max_num_tokens_ > 0 && x.ndim() == 2 && x.size(0) > max_num_tokens_)
      FUSEDMOE_THROW(kInvalidArgument, "hidden_states: at most max_num_tokens = ", max_num_tokens_,
                     " tokens for this CUDA layer (MoELayer.from_pretrained(..., "
                     "max_num_tokens=N)), got ",
                     x.size(0));
    ForwardOutputs outputs;
    if (o_logits) outputs.router_logits = *o_logits;
    if (o_ids) outputs.topk_ids = *o_ids;
    if (o_weights) outputs.topk_weights = *o_weights;
    const bool want = o_logits || o_ids || o_weights;
    ReleaseGil release;
    std::lock_guard<CallMutex> lock(mu_);
    if (device_.type == DeviceType::kCUDA)
      runner_->set_cuda_stream(reinterpret_cast<void*>(stream));
    runner_->forward(x, out, logits ? &*logits : nullptr, tok ? &*tok : nullptr,
                     want ? &outputs : nullptr);
  }

  // CUDA: waits for `stream`, then raises ValueError naming the first token whose
  // router logits held a NaN in a forward since the last check (MoERunner::
  // check_errors). CPU: nothing (forward raises there).
  void check_errors(uintptr_t stream) {
    ReleaseGil release;
    std::lock_guard<CallMutex> lock(mu_);
    if (device_.type != DeviceType::kCUDA) return;
    runner_->set_cuda_stream(reinterpret_cast<void*>(stream));
    runner_->check_errors();
  }

  nb::dict config() const {
    return config_to_dict(runner_->config());
  }
  // The router's parameters besides the config, as NumPy copies (None when the
  // layer has none): e_score_correction_bias f32 [n], hash_table i32 [V, k].
  nb::dict router_params() const {
    const RouterParams& p = runner_->weights().router_params;
    nb::dict d;
    d["e_score_correction_bias"] =
        p.e_score_correction_bias
            ? numpy_copy(*p.e_score_correction_bias, "e_score_correction_bias")
            : nb::none();
    d["hash_table"] = p.hash_table ? numpy_copy(*p.hash_table, "hash_table") : nb::none();
    return d;
  }
  const MoEConfig& raw_config() const {
    return runner_->config();
  }
  std::string compute_dtype() const {
    return dtype_name(compute_dtype_);
  }
  const std::string& source() const {
    return source_;
  }
  int64_t layer() const {
    return layer_;
  }
  size_t weights_nbytes() const {
    return runner_->weights().nbytes();
  }
  std::string weights_dtype() const {
    return dtype_name(runner_->weights().experts.dtype());
  }
  int threads() const {
    return pool_ ? pool_->num_threads() : ThreadPool::global().num_threads();
  }
  std::string device() const {
    return device_str(device_);
  }
  int64_t max_num_tokens() const {
    return max_num_tokens_;
  }
  size_t workspace_nbytes() const {
    return runner_->cuda_workspace_bytes();
  }

 private:
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<MoERunner> runner_;
  CallMutex mu_;  // the runner's workspace serves one call at a time
  DType compute_dtype_ = DType::kF32;
  std::string source_;
  int64_t layer_ = 0;
  Device device_{};
  int64_t max_num_tokens_ = 0;  // CUDA: the workspace's token capacity
};

// ---- inspect -------------------------------------------------------------------------

// Same content as `fusedmoe inspect PATH --json` (io/inspect.h).
nb::dict inspect(const std::string& path) {
  return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(inspect_json(path)));
}

}  // namespace
}  // namespace fusedmoe::python

NB_MODULE(_ext, m) {
  using namespace fusedmoe;
  using namespace fusedmoe::python;
  m.doc() = "fusedmoe C++ extension (low-level; use the `fusedmoe` package API)";
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(&drain_calls_at_exit));
#ifdef FUSEDMOE_VERSION
  m.attr("__version__") = FUSEDMOE_VERSION;
#endif
#ifdef FUSEDMOE_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    // A message may quote bytes that are not UTF-8 (a path, a damaged file's
    // contents): \xNN escapes for those, never a UnicodeDecodeError instead.
    auto set = [](PyObject* type, const char* what) {
      PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)),
                                           "backslashreplace");
      if (msg == nullptr) return;  // the decoding error stays set
      PyErr_SetObject(type, msg);
      Py_DECREF(msg);
    };
    try {
      std::rethrow_exception(p);
    } catch (const fusedmoe::Error& e) {
      switch (e.code()) {
        case ErrorCode::kInvalidArgument:
          set(PyExc_ValueError, e.what());
          break;
        case ErrorCode::kIo:
          set(PyExc_OSError, e.what());
          break;
        case ErrorCode::kUnsupported:
          set(PyExc_NotImplementedError, e.what());
          break;
        case ErrorCode::kOutOfMemory:  // the message names what and how many bytes
          set(PyExc_MemoryError, e.what());
          break;
        default:
          set(PyExc_RuntimeError, e.what());
          break;
      }
    }
  });

  m.def("fused_experts", &fused_experts, "hidden_states"_a, "w13"_a, "w2"_a, "topk_weights"_a,
        "topk_ids"_a, "output"_a, "activation"_a, "w13_bias"_a.none(), "w2_bias"_a.none(),
        "apply_router_weight_on_input"_a, "compute_dtype"_a, "weights_u16_is_bf16"_a,
        "swiglu_alpha"_a, "swiglu_limit"_a, "workspace"_a.none() = nb::none(), "stream"_a = 0,
        "w13_layout"_a = "standard",
        "Routed experts (prepare -> w13 GEMM -> activation -> w2 GEMM -> weighted sum) into "
        "`output` [T, H]. CUDA arrays: `workspace` uint8 of at least "
        "cuda_fused_experts_workspace_bytes(...) bytes, `stream` a cudaStream_t. `w13_layout`: "
        "\"standard\" (gate rows, then up rows) or, on CUDA only, \"interleaved128\" (the "
        "order interleave_w13 writes).");
  m.def("cuda_fused_experts_workspace_bytes", &cuda_workspace_bytes, "num_tokens"_a,
        "hidden_size"_a, "intermediate_size"_a, "num_experts"_a, "top_k"_a,
        "apply_router_weight_on_input"_a = false, "w13_layout"_a = "standard",
        "Device bytes of workspace the CUDA fused_experts needs for these sizes and w13 layout "
        "(\"standard\" or \"interleaved128\": fewer bytes).");
  m.def("_time_fused_experts_cuda", &time_fused_experts_cuda, "hidden_states"_a, "w13"_a, "w2"_a,
        "topk_weights"_a, "topk_ids"_a, "output"_a, "workspace"_a, "repeat"_a, "stream"_a,
        "Benchmark hook: (total seconds incl. one final stream sync, enqueue seconds) of "
        "`repeat` back-to-back C++ cuda::fused_experts calls.");
  m.def("cuda_device_count", &cuda_device_count,
        "Usable CUDA devices (0 without a driver or without the CUDA backend).");
  m.def("_time_fused_experts", &time_fused_experts, "hidden_states"_a, "w13"_a, "w2"_a,
        "topk_weights"_a, "topk_ids"_a, "output"_a, "repeat"_a,
        "Benchmark hook: per-call seconds of `repeat` C++ fused_experts calls (silu, f32 "
        "compute).");
  m.def("config_fields", &config_fields,
        "The keys a config dict may have (MoEConfig's JSON fields, in their order).");
  m.def("select_experts", &select_experts, "router_logits"_a, "topk_ids"_a, "topk_weights"_a,
        "config"_a, "e_score_correction_bias"_a.none(), "token_ids"_a.none(), "hash_table"_a.none(),
        "stream"_a = 0,
        "Routes router_logits f32 [T, E + Z] into topk_ids i32 [T, k] and topk_weights f32 "
        "[T, k] with the router a MoEConfig (given as a dict) selects.");
  m.def(
      "parse_dtype_option",
      [](const std::string& value, const std::string& name,
         const std::vector<std::string>& allowed) {
        return std::string(dtype_name(parse_dtype_option(value, name, allowed)));
      },
      "value"_a, "name"_a, "allowed"_a,
      "The dtype name `value` when it is one of `allowed` (the rule of every dtype option: "
      "exactly \"f32\", \"bf16\" or \"f16\", no aliases); ValueError naming `name` "
      "otherwise.");
  m.def(
      "check_experts_options",
      [](const std::string& activation, float swiglu_alpha, float swiglu_limit,
         const std::string& compute_dtype, const std::string& w13_layout) {
        experts_options(activation, swiglu_alpha, swiglu_limit, compute_dtype, w13_layout);
      },
      "activation"_a, "swiglu_alpha"_a, "swiglu_limit"_a, "compute_dtype"_a, "w13_layout"_a,
      "Raises ValueError, as fused_experts does, for a bad activation, swiglu_alpha / "
      "swiglu_limit, compute_dtype or w13_layout (before any array is read).");
  m.def(
      "validate_config", [](const nb::dict& d) { config_from_dict(d).validate(); }, "config"_a,
      "Raises ValueError when the configuration cannot work.");
  m.def(
      "normalize_config", [](const nb::dict& d) { return config_to_dict(config_from_dict(d)); },
      "config"_a, "The full config dict (defaults filled in) for a partial one.");
  m.def(
      "_check_host_bytes",
      [](const std::string& name, int64_t nbytes, const std::string& what,
         const std::string& advice) {
        const size_t memory = memory_and_swap_bytes();
        if (memory > 0 && nbytes > 0 && static_cast<uint64_t>(nbytes) > memory)
          FUSEDMOE_THROW(kOutOfMemory, name, ": ", what, " need ",
                         bytes_str(static_cast<unsigned long long>(nbytes)),
                         ", more than the machine's ", bytes_str(memory), " of memory and swap; ",
                         advice);
      },
      "name"_a, "nbytes"_a, "what"_a, "advice"_a = "pass fewer tokens a call",
      "MemoryError \"NAME: WHAT need N bytes, more than the machine's M of memory and swap; "
      "ADVICE\" when host buffers of `nbytes` cannot fit, as the CPU fused experts check their "
      "workspace (before the wrapper copies or allocates them).");
  m.def("inspect", &inspect, "path"_a,
        "Describes a model directory (or lists a .safetensors file): the content of "
        "`fusedmoe inspect PATH --json`.");
  m.attr("max_num_threads") = ThreadPool::kMaxThreads;
  m.def(
      "set_num_threads",
      [](int n) {
        FUSEDMOE_CHECK(n >= 0 && n <= ThreadPool::kMaxThreads, "num_threads: expected 0..",
                       ThreadPool::kMaxThreads, " (0: all cores), got ", n);
        ThreadPool::set_global_num_threads(n);
      },
      "num_threads"_a, "Sets the threads of the global pool (0: all cores).");
  m.def("get_num_threads", [] { return ThreadPool::global().num_threads(); });

  m.def(
      "nccl_unique_id",
      [] {
        const std::vector<uint8_t> id = nccl_unique_id();
        return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
      },
      "The bytes of a fresh ncclUniqueId, for EpGroup on every rank.");
  nb::class_<PyEpGroup>(m, "EpGroup")
      .def(nb::init<const nb::bytes&, int, int, int>(), "unique_id"_a, "rank"_a, "size"_a,
           "device"_a,
           "Rank `rank` of `size` on CUDA device `device`, joined by nccl_unique_id()'s bytes "
           "(collective: every rank constructs one, within FUSEDMOE_COMM_TIMEOUT_S).")
      .def_prop_ro("rank", &PyEpGroup::rank)
      .def_prop_ro("size", &PyEpGroup::size)
      .def_prop_ro("device", &PyEpGroup::device);

  nb::class_<PyCudaWorkspace>(m, "CudaWorkspace")
      .def(nb::init<>())
      .def("reserve", &PyCudaWorkspace::reserve, "nbytes"_a)
      .def_prop_ro("nbytes", &PyCudaWorkspace::nbytes)
      .def_prop_ro("device", &PyCudaWorkspace::device);

  nb::class_<PyMoELayer>(m, "MoELayer")
      .def_static("from_pretrained", &PyMoELayer::from_pretrained, "model_dir"_a,
                  "layer"_a.none() = nb::none(), "dtype"_a = "f32", "threads"_a.none() = nb::none(),
                  "backend"_a = "cpu", "max_num_tokens"_a = 0, "check_finite"_a = true,
                  "workspace"_a.none() = nb::none(), "ep_group"_a.none() = nb::none(),
                  nb::rv_policy::take_ownership)
      .def("forward", &PyMoELayer::forward, "hidden_states"_a, "output"_a, "router_logits"_a.none(),
           "out_router_logits"_a.none(), "out_topk_ids"_a.none(), "out_topk_weights"_a.none(),
           "token_ids"_a.none(), "stream"_a = 0)
      .def("check_errors", &PyMoELayer::check_errors, "stream"_a = 0)
      .def_prop_ro("config", &PyMoELayer::config)
      .def("router_params", &PyMoELayer::router_params,
           "The router's parameters besides the config (NumPy copies, None when absent): "
           "e_score_correction_bias f32, hash_table i32.")
      .def_prop_ro("num_experts", [](const PyMoELayer& l) { return l.raw_config().num_experts; })
      .def_prop_ro("num_router_logits",
                   [](const PyMoELayer& l) { return l.raw_config().num_router_logits(); })
      .def_prop_ro("top_k", [](const PyMoELayer& l) { return l.raw_config().top_k; })
      .def_prop_ro("hidden_size", [](const PyMoELayer& l) { return l.raw_config().hidden_size; })
      .def_prop_ro("compute_dtype", &PyMoELayer::compute_dtype)
      .def_prop_ro("weights_dtype", &PyMoELayer::weights_dtype)
      .def_prop_ro("weights_nbytes", &PyMoELayer::weights_nbytes)
      .def_prop_ro("source", &PyMoELayer::source)
      .def_prop_ro("layer", &PyMoELayer::layer)
      .def_prop_ro("threads", &PyMoELayer::threads)
      .def_prop_ro("device", &PyMoELayer::device)
      .def_prop_ro("max_num_tokens", &PyMoELayer::max_num_tokens)
      .def_prop_ro("workspace_nbytes", &PyMoELayer::workspace_nbytes);
}
