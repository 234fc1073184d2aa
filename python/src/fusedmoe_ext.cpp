// fusedmoe._ext: the nanobind extension under the `fusedmoe` Python package.
//
// Low-level entry points: every array argument is a DLPack-capable array
// (NumPy, PyTorch, ...) imported through nb::ndarray without a copy; outputs
// are allocated by the Python layer (python/fusedmoe/__init__.py) in the
// caller's framework and written here. Python-facing names follow the C++ API.
//
// Errors: fusedmoe::Error is translated by code — kInvalidArgument ->
// ValueError, kIo -> OSError, kUnsupported -> NotImplementedError, kInternal ->
// RuntimeError; an unsupported dtype -> TypeError. Device arrays (CUDA) raise
// NotImplementedError until the CUDA backend exists: see check_device().
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
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
#include "fusedmoe/routing/router.h"
#include "fusedmoe/runner/moe_runner.h"

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

// The one place that decides which devices a call can run on. The CUDA
// backend will accept kDLCUDA here (and route to it); today only the CPU.
Device check_device(int32_t device_type, int32_t device_id, const char* name) {
  if (device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value)
    return Device{};
  FUSEDMOE_THROW(kUnsupported, name, ": got a ", device_name(device_type), ":", device_id,
                 " array, but this build of fusedmoe runs on the CPU only (no CUDA backend ",
                 "yet); pass a CPU array (tensor.cpu())");
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
         (a.dtype().code == uint8_t(nb::dlpack::dtype_code::UInt) && a.dtype().bits == 16
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

DType parse_compute_dtype(const std::string& s, const char* name) {
  const DType d = parse_dtype(s);
  FUSEDMOE_CHECK(d == DType::kF32 || d == DType::kBF16, name,
                 ": expected \"f32\" or \"bf16\", got \"", s, "\"");
  return d;
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
MoEConfig config_from_dict(const nb::dict& d) {
  const nb::dict defaults = config_to_dict(MoEConfig{});
  for (auto [k, v] : d) {
    if (!defaults.contains(k)) continue;  // from_json reports the unknown key
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
                            ", got " + nb::type_name(v.type()).c_str())
                               .c_str());
  }
  const auto text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(d));
  return MoEConfig::from_json(text, "config");
}

// ---- functional ops ----------------------------------------------------------------

// One modular kernel and workspace for the functional fused_experts; calls are
// serialised (the workspace is reused across calls, grow-only).
struct FunctionalState {
  std::mutex mu;
  std::unique_ptr<ModularKernel> kernel = make_cpu_modular_kernel();
  Workspace ws;
};
FunctionalState& functional_state() {
  static FunctionalState* s = new FunctionalState();  // never destroyed: no exit-order issues
  return *s;
}

void fused_experts(const InArray& hidden_states, const InArray& w13, const InArray& w2,
                   const InArray& topk_weights, const InArray& topk_ids, const OutArray& output,
                   const std::string& activation, const OptIn& w13_bias, const OptIn& w2_bias,
                   bool apply_router_weight_on_input, const std::string& compute_dtype,
                   bool weights_u16_is_bf16, float swiglu_alpha, float swiglu_limit) {
  const TensorView x = view_of(hidden_states, "hidden_states");
  check_dtype(x, "hidden_states", {DType::kF32});
  ExpertWeights weights;
  weights.w13 = borrow(view_of(w13, "w13", weights_u16_is_bf16));
  weights.w2 = borrow(view_of(w2, "w2", weights_u16_is_bf16));
  check_dtype(weights.w13.view(), "w13", {DType::kF32, DType::kBF16});
  check_dtype(weights.w2.view(), "w2", {DType::kF32, DType::kBF16});
  if (w13_bias) weights.w13_bias = borrow(view_of(*w13_bias, "w13_bias", weights_u16_is_bf16));
  if (w2_bias) weights.w2_bias = borrow(view_of(*w2_bias, "w2_bias", weights_u16_is_bf16));
  FUSEDMOE_CHECK(w13_bias.has_value() == w2_bias.has_value(),
                 "w13_bias, w2_bias: give both biases or neither (got ",
                 w13_bias ? "w13_bias only" : "w2_bias only", ")");
  const TensorView tw = view_of(topk_weights, "topk_weights");
  check_dtype(tw, "topk_weights", {DType::kF32});
  const TensorView ti = view_of(topk_ids, "topk_ids");
  check_dtype(ti, "topk_ids", {DType::kI32});
  const TensorView out = view_of(output, "output");
  ExpertsParams params;
  params.activation.activation = parse_activation(activation);
  params.activation.swiglu_alpha = swiglu_alpha;
  params.activation.swiglu_limit = swiglu_limit;
  params.compute_dtype = parse_compute_dtype(compute_dtype, "compute_dtype");

  FunctionalState& s = functional_state();
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(s.mu);
  s.kernel->forward(x, ti, tw, weights, params, apply_router_weight_on_input, out, s.ws);
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
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& t : times) {
    const auto t0 = std::chrono::steady_clock::now();
    s.kernel->forward(x, ti, tw, weights, params, false, out, s.ws);
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return times;
}

// Routing with a MoEConfig given as a dict (see config_from_dict).
void select_experts(const InArray& router_logits, const OutArray& topk_ids,
                    const OutArray& topk_weights, const nb::dict& config,
                    const OptIn& e_score_correction_bias, const OptIn& token_ids,
                    const OptIn& hash_table) {
  const MoEConfig c = config_from_dict(config);
  RouterParams params;
  if (e_score_correction_bias)
    params.e_score_correction_bias =
        borrow(view_of(*e_score_correction_bias, "e_score_correction_bias"));
  if (hash_table) params.hash_table = borrow(view_of(*hash_table, "hash_table"));
  const auto router = create_router(c, params);
  const TensorView logits = view_of(router_logits, "router_logits");
  check_dtype(logits, "router_logits", {DType::kF32});
  const TensorView ids = view_of(topk_ids, "topk_ids");
  const TensorView weights = view_of(topk_weights, "topk_weights");
  std::optional<TensorView> tok;
  if (token_ids) tok = view_of(*token_ids, "token_ids");
  nb::gil_scoped_release release;
  router->select_experts(logits, ids, weights, tok ? &*tok : nullptr);
}

// ---- MoELayer ----------------------------------------------------------------------

class PyMoELayer {
 public:
  PyMoELayer(MoEConfig config, MoELayerWeights weights, DType compute_dtype,
             std::optional<int> threads, std::string source, int64_t layer)
      : source_(std::move(source)), layer_(layer) {
    if (threads) {
      FUSEDMOE_CHECK(*threads > 0, "threads: expected > 0, got ", *threads);
      pool_ = std::make_unique<ThreadPool>(*threads);
    }
    RunnerOptions options;
    options.compute_dtype = compute_dtype;
    options.pool = pool_.get();
    runner_ = std::make_unique<MoERunner>(std::move(config), std::move(weights), options);
    compute_dtype_ = compute_dtype;
  }

  static PyMoELayer* from_pretrained(const std::string& model_dir, std::optional<int64_t> layer,
                                     const std::string& dtype, std::optional<int> threads) {
    const DType compute = parse_compute_dtype(dtype, "dtype");
    MoEConfig config;
    MoELayerWeights weights;
    int64_t l = 0;
    {
      nb::gil_scoped_release release;
      const ModelInfo info = load_model_info(model_dir);
      FUSEDMOE_CHECK(!info.moe_layers.empty(), "model_dir: ", model_dir, " has no MoE layer");
      l = layer ? *layer : info.moe_layers.front();
      config = info.layer_config(l);
      const Checkpoint checkpoint = Checkpoint::open(model_dir);
      LoadOptions options;
      options.progress = false;
      weights = load_moe_layer(checkpoint, info, l, options);
    }
    return new PyMoELayer(std::move(config), std::move(weights), compute, threads, model_dir, l);
  }

  void forward(const InArray& hidden_states, const OutArray& output, const OptIn& router_logits,
               const OptOut& out_router_logits, const OptOut& out_topk_ids,
               const OptOut& out_topk_weights, const OptIn& token_ids) {
    const TensorView x = view_of(hidden_states, "hidden_states");
    check_dtype(x, "hidden_states", {DType::kF32});
    const TensorView out = view_of(output, "output");
    std::optional<TensorView> logits, tok;
    if (router_logits) {
      logits = view_of(*router_logits, "router_logits");
      check_dtype(*logits, "router_logits", {DType::kF32});
    }
    if (token_ids) tok = view_of(*token_ids, "token_ids");
    ForwardOutputs outputs;
    if (out_router_logits) outputs.router_logits = view_of(*out_router_logits, "router_logits");
    if (out_topk_ids) outputs.topk_ids = view_of(*out_topk_ids, "topk_ids");
    if (out_topk_weights) outputs.topk_weights = view_of(*out_topk_weights, "topk_weights");
    const bool want = out_router_logits || out_topk_ids || out_topk_weights;
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    runner_->forward(x, out, logits ? &*logits : nullptr, tok ? &*tok : nullptr,
                     want ? &outputs : nullptr);
  }

  nb::dict config() const { return config_to_dict(runner_->config()); }
  const MoEConfig& raw_config() const { return runner_->config(); }
  std::string compute_dtype() const { return dtype_name(compute_dtype_); }
  const std::string& source() const { return source_; }
  int64_t layer() const { return layer_; }
  size_t weights_nbytes() const { return runner_->weights().nbytes(); }
  std::string weights_dtype() const { return dtype_name(runner_->weights().experts.dtype()); }
  int threads() const { return pool_ ? pool_->num_threads() : ThreadPool::global().num_threads(); }

 private:
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<MoERunner> runner_;
  std::mutex mu_;  // the runner's workspace serves one call at a time
  DType compute_dtype_ = DType::kF32;
  std::string source_;
  int64_t layer_ = 0;
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
#ifdef FUSEDMOE_VERSION
  m.attr("__version__") = FUSEDMOE_VERSION;
#endif
#ifdef FUSEDMOE_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fusedmoe::Error& e) {
      switch (e.code()) {
        case ErrorCode::kInvalidArgument:
          PyErr_SetString(PyExc_ValueError, e.what());
          break;
        case ErrorCode::kIo:
          PyErr_SetString(PyExc_OSError, e.what());
          break;
        case ErrorCode::kUnsupported:
          PyErr_SetString(PyExc_NotImplementedError, e.what());
          break;
        default:
          PyErr_SetString(PyExc_RuntimeError, e.what());
          break;
      }
    }
  });

  m.def("fused_experts", &fused_experts, "hidden_states"_a, "w13"_a, "w2"_a, "topk_weights"_a,
        "topk_ids"_a, "output"_a, "activation"_a, "w13_bias"_a.none(), "w2_bias"_a.none(),
        "apply_router_weight_on_input"_a, "compute_dtype"_a, "weights_u16_is_bf16"_a,
        "swiglu_alpha"_a, "swiglu_limit"_a,
        "Routed experts (prepare -> w13 GEMM -> activation -> w2 GEMM -> weighted sum) into "
        "`output` f32 [T, H].");
  m.def("_time_fused_experts", &time_fused_experts, "hidden_states"_a, "w13"_a, "w2"_a,
        "topk_weights"_a, "topk_ids"_a, "output"_a, "repeat"_a,
        "Benchmark hook: per-call seconds of `repeat` C++ fused_experts calls (silu, f32 "
        "compute).");
  m.def("select_experts", &select_experts, "router_logits"_a, "topk_ids"_a, "topk_weights"_a,
        "config"_a, "e_score_correction_bias"_a.none(), "token_ids"_a.none(), "hash_table"_a.none(),
        "Routes router_logits f32 [T, E + Z] into topk_ids i32 [T, k] and topk_weights f32 "
        "[T, k] with the router a MoEConfig (given as a dict) selects.");
  m.def(
      "validate_config", [](const nb::dict& d) { config_from_dict(d).validate(); }, "config"_a,
      "Raises ValueError when the configuration cannot work.");
  m.def(
      "normalize_config", [](const nb::dict& d) { return config_to_dict(config_from_dict(d)); },
      "config"_a, "The full config dict (defaults filled in) for a partial one.");
  m.def("inspect", &inspect, "path"_a,
        "Describes a model directory (or lists a .safetensors file): the content of "
        "`fusedmoe inspect PATH --json`.");
  m.def("set_num_threads", &ThreadPool::set_global_num_threads, "num_threads"_a,
        "Sets the threads of the global pool (<= 0: all cores).");
  m.def("get_num_threads", [] { return ThreadPool::global().num_threads(); });

  nb::class_<PyMoELayer>(m, "MoELayer")
      .def_static("from_pretrained", &PyMoELayer::from_pretrained, "model_dir"_a,
                  "layer"_a.none() = nb::none(), "dtype"_a = "f32", "threads"_a.none() = nb::none(),
                  nb::rv_policy::take_ownership)
      .def("forward", &PyMoELayer::forward, "hidden_states"_a, "output"_a, "router_logits"_a.none(),
           "out_router_logits"_a.none(), "out_topk_ids"_a.none(), "out_topk_weights"_a.none(),
           "token_ids"_a.none())
      .def_prop_ro("config", &PyMoELayer::config)
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
      .def_prop_ro("threads", &PyMoELayer::threads);
}
