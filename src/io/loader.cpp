// fusedmoe: gathering one MoE layer's weights from a HF checkpoint into the
// canonical layout (experts/expert_weights.h): w13 [E, 2I, H] (gate rows, then
// up rows), w2 [E, H, I], biases [E, 2I] / [E, H].
//
// Checkpoint layouts handled (tensor names relative to ModelInfo::moe_prefix):
//   per expert (Mixtral):        experts.N.w1 / w3 / w2.weight  [I, H] [I, H] [H, I]
//   per expert (Qwen/OLMoE/DS):  experts.N.gate_proj / up_proj / down_proj.weight
//   fused canonical (transformers 5 in-memory names): experts.gate_up_proj [E, 2I, H],
//                                experts.down_proj [E, H, I]
//   gpt-oss:  experts.gate_up_proj [E, H, 2I] (gate = even columns, up = odd),
//             experts.gate_up_proj_bias [E, 2I] (same interleave),
//             experts.down_proj [E, I, H], experts.down_proj_bias [E, H]  (HF GptOssExperts)
//   Llama-4:  experts.gate_up_proj [E, H, 2I] (gate = first I columns, up = last I),
//             experts.down_proj [E, I, H]                                 (HF Llama4TextExperts)
//   DeepSeek FP8 (per-expert F8_E4M3 weights with weight_scale_inv [ceil(out/128),
//             ceil(in/128)]): dequantized to f32 (value * scale of its 128x128 block).
//   gpt-oss MXFP4 (quant_method "mxfp4"): experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16]
//             and _scales U8 [E, 2I, H/32] (rows interleaved gate / up), down_proj_blocks
//             [E, H, I/32, 16] and _scales [E, H, I/32]: dequantized to bf16 as HF
//             transformers' convert_moe_packed_tensors does (see mxfp4_row).
// f32 and bf16 weights keep their dtype; f16 and f64 are converted to f32; a
// layer's routed experts in mixed dtypes load together as f32 (common_dtype).
#include "fusedmoe/io/loader.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/parallel/expert_map.h"

namespace fusedmoe {

namespace {

std::string shape_str(std::initializer_list<int64_t> s) {
  std::string out = "[";
  size_t i = 0;
  for (int64_t d : s) out += (i++ ? ", " : "") + std::to_string(d);
  return out + "]";
}

bool same_shape(const TensorView& t, std::initializer_list<int64_t> s) {
  if (t.ndim() != static_cast<int>(s.size())) return false;
  int i = 0;
  for (int64_t d : s)
    if (t.size(i++) != d) return false;
  return true;
}

// One tensor source: a plain weight, or an FP8 weight with its block scales.
struct Source {
  std::string name;
  Tensor t;
  std::optional<Tensor> scale_inv;  // f32 [ceil(rows/128), ceil(cols/128)] for FP8
  // FP8 values times their block scale may leave the f32 range: checked as
  // row_to_f32 dequantizes the rows (LoadOptions::check_finite). An f64
  // tensor's range is checked when it is fetched (Reader::get).
  bool check_range = false;
  std::string file;  // the checkpoint it is read from, as errors name it (printable)
};

class Reader {
 public:
  // quant_method: ModelInfo::quant_method ("" for a config.json without a
  // quantization_config: FP8 weights are then refused).
  Reader(const Checkpoint& ckpt, std::string prefix, bool check_finite, std::string quant_method)
      : ckpt_(ckpt),
        prefix_(std::move(prefix)),
        check_finite_(check_finite),
        quant_method_(std::move(quant_method)) {}

  bool has(const std::string& rel) const { return ckpt_.contains(prefix_ + rel); }

  // Fetches prefix+rel, a U8 tensor of `shape` (MXFP4 blocks or scales).
  // Throws Error(kIo) naming the tensor otherwise.
  Tensor get_u8(const std::string& rel, std::initializer_list<int64_t> shape) const {
    const std::string name = prefix_ + rel;
    if (!ckpt_.contains(name))
      FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": missing tensor '", name, "' (expected u8 ",
                     shape_str(shape), ")");
    // Told from the header first: a dtype fusedmoe does not read (F8_E8M0
    // scales, say, whose values HF's converter would take for the bytes) is
    // named as the file spells it.
    const SafetensorsFile::Info in = ckpt_.info(name);
    if (in.dtype != DType::kU8 ||
        !std::equal(in.shape.begin(), in.shape.end(), shape.begin(), shape.end())) {
      std::string got = in.dtype ? dtype_name(*in.dtype) : in.dtype_name;
      for (size_t d = 0; d < in.shape.size(); ++d)
        got += (d ? ", " : " [") + std::to_string(in.shape[d]);
      FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", name, "': expected u8 ",
                     shape_str(shape), ", got ", got, in.shape.empty() ? " []" : "]");
    }
    return ckpt_.get(name);
  }
  std::string full(const std::string& rel) const { return prefix_ + rel; }

  // Fetches prefix+rel and checks its shape. Throws Error(kIo) naming the tensor.
  Source get(const std::string& rel, std::initializer_list<int64_t> shape) const {
    const std::string name = prefix_ + rel;
    if (!ckpt_.contains(name))
      FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": missing tensor '", name, "' (expected ",
                     shape_str(shape), ")");
    Source s{name, ckpt_.get(name), std::nullopt, false, printable(ckpt_.path())};
    if (!same_shape(s.t, shape))
      FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", name, "': expected shape ",
                     shape_str(shape), ", got ", s.t.view().str());
    const DType d = s.t.dtype();
    if (d == DType::kF8E4M3FN || d == DType::kF8E5M2) {
      // Block-quantized weight (DeepSeek FP8 format): name.weight -> name.weight_scale_inv.
      const std::string sname = sname_of(name);
      if (s.t.ndim() != 2 || !ckpt_.contains(sname))
        FUSEDMOE_THROW(kUnsupported, printable(ckpt_.path()), ": tensor '", name, "' is ",
                       dtype_name(d), " without a block scale '", sname,
                       "'; such FP8 weights are not supported");
      // Every other FP8 config mismatch is refused (hf_config.cpp); a config
      // that declares no quantization would load the weights as if the
      // checkpoint were plain bf16 (`fusedmoe inspect` said so).
      if (quant_method_.empty())
        FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", name, "' is ", dtype_name(d),
                       " with a block scale '", sname,
                       "', but config.json has no quantization_config: expected "
                       "quantization_config {\"quant_method\": \"fp8\", ...} in config.json, or "
                       "a checkpoint without FP8 weights");
      Tensor sc = ckpt_.get(sname);
      const int64_t r = (s.t.size(0) + 127) / 128, c = (s.t.size(1) + 127) / 128;
      if (sc.dtype() != DType::kF32 || !same_shape(sc, {r, c}))
        FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", sname, "': expected f32 ",
                       shape_str({r, c}), " (one scale per 128x128 block), got ", sc.view().str());
      s.scale_inv = sc;
    } else if (!is_floating(d)) {
      FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", name,
                     "': expected a floating dtype, got ", dtype_name(d));
    }
    if (check_finite_) {
      if (s.scale_inv) require_valid_scales(*s.scale_inv, sname_of(name), name);
      require_finite(s.t.view(), name);
      if (d == DType::kF64) require_f32_range(s.t.view(), name);
      s.check_range = s.scale_inv.has_value();
    }
    return s;
  }

 private:
  static std::string sname_of(const std::string& name) { return name + "_scale_inv"; }

  // The flat index of the first element of a contiguous tensor that
  // `find(data, dtype, count)` reports (its index in the chunk given, or -1),
  // over chunks read in parallel; -1 when there is none.
  template <typename Find>
  static int64_t first_found(const TensorView& v, Find find) {
    const size_t n = static_cast<size_t>(v.numel());
    const size_t es = dtype_size(v.dtype());
    constexpr size_t kChunk = size_t{1} << 20;
    const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
    std::atomic<int64_t> first{std::numeric_limits<int64_t>::max()};
    ThreadPool::global().parallel_for(
        chunks,
        [&](int64_t b, int64_t e, int) {
          for (int64_t c = b; c < e; ++c) {
            const size_t begin = static_cast<size_t>(c) * kChunk;
            const size_t len = std::min(kChunk, n - begin);
            const int64_t i = find(static_cast<const char*>(v.data()) + begin * es, v.dtype(), len);
            if (i < 0) continue;
            int64_t idx = static_cast<int64_t>(begin) + i, cur = first.load();
            while (idx < cur && !first.compare_exchange_weak(cur, idx)) {
            }
            return;
          }
        },
        1);
    const int64_t idx = first.load();
    return idx == std::numeric_limits<int64_t>::max() ? -1 : idx;
  }
  // "2, 5": the indices of flat element `idx` of `v`.
  static std::string index_of(const TensorView& v, int64_t idx) {
    std::string where;
    for (int64_t dim = v.ndim() - 1; dim >= 0; --dim) {
      where = std::to_string(idx % v.size(dim)) + (where.empty() ? "" : ", ") + where;
      idx /= v.size(dim);
    }
    return where;
  }
  static constexpr const char* kCorrupt =
      " (a corrupt checkpoint; LoadOptions::check_finite = false skips this check)";

  // A NaN or Inf weight would give NaN outputs for every token routed there:
  // name it at load time (one parallel read of the tensor) instead.
  void require_finite(const TensorView& v, const std::string& name) const {
    const int64_t idx = first_found(v, find_non_finite);
    if (idx < 0) return;
    float value = 0.0f;
    convert_to_f32(
        static_cast<const char*>(v.data()) + static_cast<size_t>(idx) * dtype_size(v.dtype()),
        v.dtype(), &value, 1);
    FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", name,
                   "': expected finite values, got ", std::isnan(value) ? "NaN" : "Inf", " at [",
                   index_of(v, idx), "]", kCorrupt);
  }

  // A finite f64 value beyond the f32 range becomes Inf once loaded as f32:
  // named here for every f64 tensor (weights, packed experts, biases, router
  // tensors alike), whichever path converts it.
  void require_f32_range(const TensorView& v, const std::string& name) const {
    const int64_t idx = first_found(
        v, [](const char* p, DType, size_t n) -> int64_t { return find_beyond_f32(p, n); });
    if (idx < 0) return;
    double x;
    std::memcpy(&x, static_cast<const char*>(v.data()) + static_cast<size_t>(idx) * sizeof x,
                sizeof x);
    FUSEDMOE_THROW(
        kIo, printable(ckpt_.path()), ": tensor '", name, "': element [", index_of(v, idx),
        "] is beyond the f32 range once converted from f64 (its value ", x, ")", kCorrupt);
  }

  // FP8 block scales multiply their block's weights: a negative or non-finite
  // one is no scale (zero is, for an all-zero block). `sc` f32 [R, C].
  void require_valid_scales(const Tensor& sc, const std::string& sname,
                            const std::string& weight) const {
    const TensorView& v = sc.view();
    const int64_t idx = first_found(v, [](const char* p, DType, size_t n) -> int64_t {
      for (size_t i = 0; i < n; ++i) {
        float x;
        std::memcpy(&x, p + i * sizeof x, sizeof x);
        if (!(x >= 0.0f) || std::isinf(x)) return static_cast<int64_t>(i);
      }
      return -1;
    });
    if (idx < 0) return;
    float x;
    std::memcpy(&x, static_cast<const char*>(v.data()) + static_cast<size_t>(idx) * sizeof x,
                sizeof x);
    const int64_t r = idx / v.size(1), c = idx % v.size(1);
    FUSEDMOE_THROW(kIo, printable(ckpt_.path()), ": tensor '", sname,
                   "': expected finite scales >= 0, got ", x, " at [", r, ", ", c,
                   "] (the scale of the 128x128 block of rows ", r * 128, "-", r * 128 + 127,
                   ", columns ", c * 128, "-", c * 128 + 127, " of '", weight, "')", kCorrupt);
  }

  const Checkpoint& ckpt_;
  std::string prefix_;
  bool check_finite_;
  std::string quant_method_;
};

// The dtype a source is stored as after loading: f32/bf16 kept, everything else f32.
DType target_dtype(const Source& s) {
  const DType d = s.t.dtype();
  return (d == DType::kF32 || d == DType::kBF16) ? d : DType::kF32;
}

// The dtype tensors that load together (a layer's routed experts, their
// biases) take: bf16 when each of them is kept as bf16, else f32 (a bf16
// one converted), as HF casts a checkpoint's tensors to one dtype.
template <class Sources>
DType common_dtype(const Sources& sources) {
  for (const Source* s : sources)
    if (target_dtype(*s) != DType::kBF16) return DType::kF32;
  return DType::kBF16;
}
DType common_dtype(std::initializer_list<const Source*> sources) {
  return common_dtype<std::initializer_list<const Source*>>(sources);
}

// Converts row `row` of a 2-D source to float, applying FP8 block scales.
void row_to_f32(const Source& s, int64_t row, float* out) {
  const TensorView& v = s.t.view();
  const int64_t cols = v.size(1);
  const char* p = static_cast<const char*>(v.data()) +
                  static_cast<size_t>(row * v.stride(0)) * dtype_size(v.dtype());
  convert_to_f32(p, v.dtype(), out, static_cast<size_t>(cols));
  const float* sc =
      s.scale_inv ? s.scale_inv->data_as<float>() + (row / 128) * s.scale_inv->size(1) : nullptr;
  if (sc)
    for (int64_t c = 0; c < cols; ++c) out[c] *= sc[c / 128];
  if (!s.check_range) return;
  for (int64_t c = 0; c < cols; ++c)
    if (!std::isfinite(out[c]))
      FUSEDMOE_THROW(kIo, s.file, ": tensor '", s.name, "': element [", row, ", ", c,
                     "] is beyond the f32 range once dequantized (times its block's "
                     "weight_scale_inv ",
                     sc[c / 128],
                     ") (a corrupt checkpoint; LoadOptions::check_finite = false skips this "
                     "check)");
}

// Copies a 2-D source [rows, cols] (contiguous) into dst rows (row stride = cols),
// converting to dst_dtype when needed.
void copy_rows(const Source& s, void* dst, DType dst_dtype) {
  const TensorView& v = s.t.view();
  const int64_t rows = v.ndim() == 1 ? 1 : v.size(0);
  const int64_t cols = v.ndim() == 1 ? v.size(0) : v.size(1);
  if (v.dtype() == dst_dtype && !s.scale_inv) {
    std::memcpy(dst, v.data(), v.nbytes());
    return;
  }
  // dst is f32 here.
  float* out = static_cast<float*>(dst);
  if (v.ndim() == 1) {
    convert_to_f32(v.data(), v.dtype(), out, static_cast<size_t>(cols));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) row_to_f32(s, r, out + r * cols);
}

// dst[c, r] = src[r, c] for a [rows, cols] row-major block of `esize`-byte
// elements; src row stride `lds` elements, column step `cstep`, first column
// `c0`; dst row stride `ldd`. Blocked for cache reuse.
template <typename T>
void transpose_block(const T* src, int64_t lds, int64_t c0, int64_t cstep, int64_t rows,
                     int64_t cols, T* dst, int64_t ldd) {
  constexpr int64_t B = 32;
  for (int64_t rb = 0; rb < rows; rb += B)
    for (int64_t cb = 0; cb < cols; cb += B) {
      const int64_t re = std::min(rows, rb + B), ce = std::min(cols, cb + B);
      for (int64_t c = cb; c < ce; ++c) {
        T* d = dst + c * ldd;
        const T* s = src + c0 + c * cstep;
        for (int64_t r = rb; r < re; ++r) d[r] = s[r * lds];
      }
    }
}

// From a packed source slice [rows = H, cols_total] (expert e of a 3-D tensor),
// writes dst [n, H] with dst[j, h] = src[h, c0 + j * cstep] for j < n.
void gather_transposed(const TensorView& src3, int64_t e, int64_t c0, int64_t cstep, int64_t n,
                       void* dst, DType dst_dtype) {
  const int64_t rows = src3.size(1), lds = src3.size(2);
  const size_t es = dtype_size(src3.dtype());
  const char* base =
      static_cast<const char*>(src3.data()) + static_cast<size_t>(e * rows * lds) * es;
  if (src3.dtype() == dst_dtype) {
    if (es == 2)
      transpose_block(reinterpret_cast<const uint16_t*>(base), lds, c0, cstep, rows, n,
                      static_cast<uint16_t*>(dst), rows);
    else
      transpose_block(reinterpret_cast<const uint32_t*>(base), lds, c0, cstep, rows, n,
                      static_cast<uint32_t*>(dst), rows);
    return;
  }
  // Converting path (f16/f64 -> f32): convert one source row at a time.
  std::vector<float> row(static_cast<size_t>(lds));
  float* out = static_cast<float*>(dst);
  for (int64_t h = 0; h < rows; ++h) {
    convert_to_f32(base + static_cast<size_t>(h * lds) * es, src3.dtype(), row.data(),
                   static_cast<size_t>(lds));
    for (int64_t j = 0; j < n; ++j) out[j * rows + h] = row[static_cast<size_t>(c0 + j * cstep)];
  }
}

// Same for a 2-D bias [E, cols]: dst[j] = src[e, c0 + j * cstep].
void gather_bias(const TensorView& src2, int64_t e, int64_t c0, int64_t cstep, int64_t n, void* dst,
                 DType dst_dtype) {
  const int64_t cols = src2.size(1);
  const size_t es = dtype_size(src2.dtype());
  const char* base = static_cast<const char*>(src2.data()) + static_cast<size_t>(e * cols) * es;
  if (src2.dtype() == dst_dtype) {
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(static_cast<char*>(dst) + j * es, base + static_cast<size_t>(c0 + j * cstep) * es,
                  es);
    return;
  }
  std::vector<float> row(static_cast<size_t>(cols));
  convert_to_f32(base, src2.dtype(), row.data(), static_cast<size_t>(cols));
  for (int64_t j = 0; j < n; ++j)
    static_cast<float*>(dst)[j] = row[static_cast<size_t>(c0 + j * cstep)];
}

// Keeps f32/bf16 tensors as they are (zero copy); converts others to f32.
Tensor as_f32_or_bf16(const Tensor& t) {
  if (t.dtype() == DType::kF32 || t.dtype() == DType::kBF16) return t;
  return to_f32(t.view());
}

// Progress on stderr when it is a terminal and loading has taken > 1 s.
class Progress {
 public:
  Progress(bool enabled, int64_t layer, int64_t total)
      : enabled_(enabled && ::isatty(2)), layer_(layer), total_(total), start_(Clock::now()) {}
  ~Progress() {
    if (drawn_)
      std::fprintf(stderr, "\rloading MoE layer %lld: %lld/%lld experts\n", (long long)layer_,
                   (long long)total_, (long long)total_);
  }
  void step() {
    const int64_t done = ++done_;
    if (!enabled_) return;
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (now - start_ < std::chrono::seconds(1) || now - last_ < std::chrono::milliseconds(100))
      return;
    last_ = now;
    drawn_ = true;
    std::fprintf(stderr, "\rloading MoE layer %lld: %lld/%lld experts", (long long)layer_,
                 (long long)done, (long long)total_);
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  int64_t layer_, total_;
  Clock::time_point start_, last_{};
  std::atomic<int64_t> done_{0};
  std::mutex mu_;
  bool drawn_ = false;
};

void parallel_over(int64_t n, const std::function<void(int64_t)>& fn) {
  ThreadPool::global().parallel_for(
      n,
      [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) fn(i);
      },
      1);
}

// MXFP4 (OCP Microscaling Formats v1.0): each byte holds two E2M1 values, the
// low nibble first; each group of 32 values shares an E8M0 scale byte s,
// worth 2^(s - 127). One row of `groups` groups -> bf16 out[groups * 32], as
// HF transformers' convert_moe_packed_tensors computes it (the E2M1 value,
// ldexp by s - 127, in bf16: exact but where it overflows). With
// `check_finite`, a scale of 255 (NaN in the format) or a value beyond the
// bf16 range is an error naming the tensor and the element; else such a
// value loads as +-Inf (and a zero as 0, where HF's bf16 ldexp gives NaN).
struct Mxfp4Table {  // v[s][n]: the bf16 bits of E2M1 nibble n times 2^(s - 127)
  uint16_t v[256][16];
  Mxfp4Table() {
    constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int s = 0; s < 256; ++s)
      for (int n = 0; n < 16; ++n) v[s][n] = f32_to_bf16(std::ldexp(kE2M1[n], s - 127));
  }
};
void mxfp4_row(const uint8_t* blocks, const uint8_t* scales, int64_t groups, uint16_t* out,
               bool check_finite, const std::string& file, const std::string& name, int64_t e,
               int64_t row) {
  static const Mxfp4Table table;
  for (int64_t g = 0; g < groups; ++g) {
    const int s = scales[g];
    const uint16_t* t = table.v[s];
    for (int j = 0; j < 16; ++j) {
      const uint8_t b = blocks[g * 16 + j];
      out[g * 32 + 2 * j] = t[b & 0x0F];
      out[g * 32 + 2 * j + 1] = t[b >> 4];
    }
    if (!check_finite) continue;
    if (s == 255)
      FUSEDMOE_THROW(kIo, file, ": tensor '", name, "_scales': element [", e, ", ", row, ", ", g,
                     "] is 255, which E8M0 reserves for NaN (a corrupt checkpoint; "
                     "LoadOptions::check_finite = false skips this check)");
    if (s < 253) continue;  // 6 x 2^(252 - 127) is within bf16: only larger scales overflow
    for (int i = 0; i < 32; ++i)
      if ((out[g * 32 + i] & 0x7F80) == 0x7F80)  // Inf or NaN
        FUSEDMOE_THROW(kIo, file, ": tensor '", name, "_blocks': element [", e, ", ", row, ", ", g,
                       ", ", i / 2, "] (", i % 2 ? "high" : "low",
                       " nibble) is beyond the bf16 range once scaled by its E8M0 scale ", s,
                       " (2^", s - 127,
                       ") (a corrupt checkpoint; LoadOptions::check_finite = false skips this "
                       "check)");
  }
}

// Per-expert layout: fetches all 3*E tensors first (checks, serial: Checkpoint
// is not thread-safe), then copies them in parallel.
ExpertWeights load_per_expert(const Reader& rd, const std::vector<int64_t>& experts, int64_t H,
                              int64_t I, const std::string& expert_fmt, const char* gate_n,
                              const char* up_n, const char* down_n, Progress* progress,
                              bool check_only) {
  const int64_t E = static_cast<int64_t>(experts.size());
  std::vector<Source> gate, up, down;
  gate.reserve(E);
  up.reserve(E);
  down.reserve(E);
  for (int64_t e : experts) {
    const std::string p = expert_fmt.empty() ? std::string() : expert_fmt + std::to_string(e) + ".";
    gate.push_back(rd.get(p + gate_n, {I, H}));
    up.push_back(rd.get(p + up_n, {I, H}));
    down.push_back(rd.get(p + down_n, {H, I}));
  }
  std::vector<const Source*> all;
  for (const auto* v : {&gate, &up, &down})
    for (const Source& src : *v) all.push_back(&src);
  const DType dt = common_dtype(all);
  ExpertWeights w;
  if (check_only) return w;
  w.w13 = Tensor::empty(dt, {E, 2 * I, H});
  w.w2 = Tensor::empty(dt, {E, H, I});
  const size_t es = dtype_size(dt);
  char* w13 = static_cast<char*>(w.w13.data());
  char* w2 = static_cast<char*>(w.w2.data());
  parallel_over(E, [&](int64_t e) {
    char* base = w13 + static_cast<size_t>(e * 2 * I * H) * es;
    copy_rows(gate[e], base, dt);
    copy_rows(up[e], base + static_cast<size_t>(I * H) * es, dt);
    copy_rows(down[e], w2 + static_cast<size_t>(e * H * I) * es, dt);
    if (progress) progress->step();
  });
  return w;
}

}  // namespace

namespace {

// load_moe_layer, or with check_only its checks alone: every tensor fetched and
// its shape and dtype checked, nothing copied (the returned weights are empty).
MoELayerWeights load_or_check(const Checkpoint& checkpoint, const ModelInfo& info, int64_t layer,
                              const LoadOptions& options, bool check_only) {
  const MoEConfig& cfg = info.layer_config(layer);  // Error(kInvalidArgument) if not MoE
  const int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size;
  const std::string& mt = info.model_type;
  const std::string prefix = info.moe_prefix(layer);
  Reader rd(checkpoint, prefix, options.check_finite, info.quant_method);
  // This rank's experts (global ids, local order) and TP slice.
  const ParallelConfig& par = options.parallel;
  std::vector<int64_t> experts;
  if (par.ep_size > 1) {
    experts = ExpertMap(E, par.ep_size, par.expert_placement).local_experts(par.ep_rank);
  } else {
    experts.resize(E);
    for (int64_t e = 0; e < E; ++e) experts[e] = e;
  }
  const int64_t n = static_cast<int64_t>(experts.size());
  Progress progress(options.progress, layer, n);
  MoELayerWeights out;

  // ---- router ----
  const bool router_named = mt == "gpt_oss" || mt == "llama4" || mt == "llama4_text";
  const std::string router = router_named ? "router." : "gate.";
  const int64_t R = cfg.num_router_logits();
  // Checked, then (unless check_only) kept as f32 or bf16 (a conversion reads the data).
  const auto keep = [&](const Source& src) {
    return check_only ? Tensor() : as_f32_or_bf16(src.t);
  };
  out.gate_weight = keep(rd.get(router + "weight", {R, H}));
  if (cfg.has_router_bias) out.gate_bias = keep(rd.get(router + "bias", {R}));
  if (cfg.has_e_score_correction_bias)
    out.router_params.e_score_correction_bias = keep(rd.get("gate.e_score_correction_bias", {E}));

  // ---- routed experts ----
  if (mt == "gpt_oss" || mt == "llama4" || mt == "llama4_text") {
    // gpt-oss's MXFP4 experts (see mxfp4_row), or packed f32 / bf16 ones.
    // Told by the tensors, each projection apart, as HF's loader converts
    // each `_blocks` / `_scales` pair it finds: a quant_method "mxfp4" config
    // over plain bf16 experts (a re-upload) loads them as they are.
    const bool gu_mx = mt == "gpt_oss" && rd.has("experts.gate_up_proj_blocks");
    const bool dn_mx = mt == "gpt_oss" && rd.has("experts.down_proj_blocks");
    std::optional<Source> gu, dn;
    Tensor gu_blocks, gu_scales, dn_blocks, dn_scales;
    if (gu_mx || dn_mx) {
      const std::string blocks = gu_mx ? "experts.gate_up_proj" : "experts.down_proj";
      if (info.quant_method != "mxfp4")
        FUSEDMOE_THROW(
            kIo, printable(checkpoint.path()), ": tensor '", rd.full(blocks + "_blocks"),
            "' holds MXFP4 blocks, but ",
            info.quant_method.empty()
                ? std::string("config.json has no quantization_config")
                : "config.json's quantization_config.quant_method is '" + info.quant_method + "'",
            ": expected quantization_config {\"quant_method\": \"mxfp4\"} in "
            "config.json, or a checkpoint without MXFP4 experts");
      FUSEDMOE_CHECK((!gu_mx || H % 32 == 0) && (!dn_mx || I % 32 == 0),
                     "MXFP4 experts: hidden_size and intermediate_size must be multiples of 32 "
                     "(the format's group), got ",
                     H, " and ", I);
      // Both forms of one projection: which one HF keeps depends on its load order.
      for (const auto& [mx, name] :
           {std::pair{gu_mx, "experts.gate_up_proj"}, std::pair{dn_mx, "experts.down_proj"}})
        if (mx && rd.has(name))
          FUSEDMOE_THROW(kIo, printable(checkpoint.path()), ": the checkpoint holds both '",
                         rd.full(name), "' and its MXFP4 blocks '", rd.full(name), "_blocks'",
                         ": expected one of them");
    }
    if (gu_mx) {
      gu_blocks = rd.get_u8("experts.gate_up_proj_blocks", {E, 2 * I, H / 32, 16});
      gu_scales = rd.get_u8("experts.gate_up_proj_scales", {E, 2 * I, H / 32});
    } else {
      gu = rd.get("experts.gate_up_proj", {E, H, 2 * I});
    }
    if (dn_mx) {
      dn_blocks = rd.get_u8("experts.down_proj_blocks", {E, H, I / 32, 16});
      dn_scales = rd.get_u8("experts.down_proj_scales", {E, H, I / 32});
    } else {
      dn = rd.get("experts.down_proj", {E, I, H});
    }
    // MXFP4 dequantizes to bf16, as HF transformers does: a plain partner must load as bf16 too.
    const DType dt = gu && dn ? common_dtype({&*gu, &*dn})
                     : gu     ? target_dtype(*gu)
                     : dn     ? target_dtype(*dn)
                              : DType::kBF16;
    for (const std::optional<Source>* plain : {&gu, &dn}) {
      if (!*plain) continue;
      if ((gu_mx || dn_mx) && target_dtype(**plain) != DType::kBF16)
        FUSEDMOE_THROW(kIo, printable(checkpoint.path()), ": tensor '", (*plain)->name, "': dtype ",
                       dtype_name((*plain)->t.dtype()),
                       " beside MXFP4 experts, which load as bf16: expected bf16");
      if ((*plain)->scale_inv)
        FUSEDMOE_THROW(kUnsupported, printable(checkpoint.path()), ": tensor '", (*plain)->name,
                       "': packed FP8 experts are not supported");
    }
    std::optional<Source> gub, dnb;
    if (cfg.has_expert_bias) {
      gub = rd.get("experts.gate_up_proj_bias", {E, 2 * I});
      dnb = rd.get("experts.down_proj_bias", {E, H});
    }
    if (check_only) return out;
    const bool interleaved = mt == "gpt_oss";
    ExpertWeights& w = out.experts;
    w.w13 = Tensor::empty(dt, {n, 2 * I, H});
    w.w2 = Tensor::empty(dt, {n, H, I});
    const DType bdt = gub ? common_dtype({&*gub, &*dnb}) : dt;
    if (gub) {
      w.w13_bias = Tensor::empty(bdt, {n, 2 * I});
      const Tensor b2 = bdt == target_dtype(*dnb) ? as_f32_or_bf16(dnb->t) : to_f32(dnb->t.view());
      if (n == E) {
        w.w2_bias = b2;
      } else {
        w.w2_bias = Tensor::empty(b2.dtype(), {n, H});
        const size_t b2s = dtype_size(b2.dtype());
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(static_cast<char*>(w.w2_bias->data()) + i * H * b2s,
                      static_cast<const char*>(b2.data()) + experts[i] * H * b2s, H * b2s);
      }
    }
    const size_t es = dtype_size(dt), bes = dtype_size(bdt);
    parallel_over(n, [&](int64_t i) {
      const int64_t e = experts[i];
      char* d13 = static_cast<char*>(w.w13.data()) + static_cast<size_t>(i * 2 * I * H) * es;
      // gpt-oss: gate = columns 0, 2, 4, ...; up = 1, 3, 5, ... Llama-4: gate = [0, I), up = [I,
      // 2I).
      const int64_t gate_c0 = 0, up_c0 = interleaved ? 1 : I, step = interleaved ? 2 : 1;
      char* d2 = static_cast<char*>(w.w2.data()) + static_cast<size_t>(i * H * I) * es;
      // MXFP4 blocks are [out, in] per expert, as w13 / w2 rows: gate_up row
      // 2j is gate row j, row 2j + 1 up row j.
      const auto row = [&](const Tensor& blocks, const Tensor& scales, const char* name, int64_t r,
                           int64_t in, void* dst) {
        const int64_t groups = in / 32, rows = blocks.size(1);
        mxfp4_row(blocks.data_as<uint8_t>() + (e * rows + r) * groups * 16,
                  scales.data_as<uint8_t>() + (e * rows + r) * groups, groups,
                  static_cast<uint16_t*>(dst), options.check_finite, printable(checkpoint.path()),
                  rd.full(name), e, r);
      };
      if (gu_mx) {
        for (int64_t j = 0; j < I; ++j) {
          row(gu_blocks, gu_scales, "experts.gate_up_proj", 2 * j, H, d13 + j * H * es);
          row(gu_blocks, gu_scales, "experts.gate_up_proj", 2 * j + 1, H, d13 + (I + j) * H * es);
        }
      } else {
        gather_transposed(gu->t.view(), e, gate_c0, step, I, d13, dt);
        gather_transposed(gu->t.view(), e, up_c0, step, I, d13 + static_cast<size_t>(I * H) * es,
                          dt);
      }
      if (dn_mx) {
        for (int64_t h = 0; h < H; ++h)
          row(dn_blocks, dn_scales, "experts.down_proj", h, I, d2 + h * I * es);
      } else {
        gather_transposed(dn->t.view(), e, 0, 1, H, d2, dt);  // down_proj [E, I, H] -> w2 [E, H, I]
      }
      if (gub) {
        char* b = static_cast<char*>(w.w13_bias->data()) + static_cast<size_t>(i * 2 * I) * bes;
        gather_bias(gub->t.view(), e, gate_c0, step, I, b, bdt);
        gather_bias(gub->t.view(), e, up_c0, step, I, b + static_cast<size_t>(I) * bes, bdt);
      }
      progress.step();
    });
  } else if (!rd.has(mt == "mixtral" ? "experts.0.w1.weight" : "experts.0.gate_proj.weight") &&
             rd.has("experts.gate_up_proj")) {
    // Fused canonical layout (transformers 5 in-memory names): zero copy when f32/bf16.
    const Source gu = rd.get("experts.gate_up_proj", {E, 2 * I, H});
    const Source dn = rd.get("experts.down_proj", {E, H, I});
    if (gu.scale_inv || dn.scale_inv)
      FUSEDMOE_THROW(kUnsupported, printable(checkpoint.path()), ": tensor '", gu.name,
                     "': packed FP8 experts are not supported");
    if (check_only) return out;
    // Zero copy when both load as one dtype; else both as f32.
    const DType dt = common_dtype({&gu, &dn});
    out.experts.w13 = dt == target_dtype(gu) ? as_f32_or_bf16(gu.t) : to_f32(gu.t.view());
    out.experts.w2 = dt == target_dtype(dn) ? as_f32_or_bf16(dn.t) : to_f32(dn.t.view());
    if (n != E) out.experts = shard_expert_weights(out.experts, experts, 1, 0);  // views
  } else if (mt == "mixtral") {
    out.experts = load_per_expert(rd, experts, H, I, "experts.", "w1.weight", "w3.weight",
                                  "w2.weight", &progress, check_only);
  } else {
    out.experts = load_per_expert(rd, experts, H, I, "experts.", "gate_proj.weight",
                                  "up_proj.weight", "down_proj.weight", &progress, check_only);
  }
  // Per-expert tensors past the config's expert count (e.g. experts.8.* with 8
  // experts): the config gives too few, and running with them left out would be
  // silently wrong (as a shared expert the config leaves out, below).
  for (const std::string& t : {"experts." + std::to_string(E) + ".gate_proj.weight",
                              "experts." + std::to_string(E) + ".w1.weight"})
    if (rd.has(t))
      FUSEDMOE_THROW(kIo, printable(checkpoint.path()), ": tensor '", rd.full(t), "' is expert ", E,
                     ", but config.json gives ", E, " routed experts (0 to ", E - 1,
                     "): expected the checkpoint's expert count in config.json");
  if (par.tp_size > 1 && !check_only) {
    std::vector<int64_t> all(n);
    for (int64_t i = 0; i < n; ++i) all[i] = i;
    out.experts = shard_expert_weights(out.experts, all, par.tp_size, par.tp_rank);
  }

  // ---- shared expert ----
  if (cfg.has_shared_expert()) {
    const int64_t S = cfg.shared_intermediate_size;
    const char* sp =
        (mt == "deepseek_v2" || mt == "deepseek_v3") ? "shared_experts." : "shared_expert.";
    const std::string p = sp;
    out.shared_experts = load_per_expert(rd, {0}, H, S, "", (p + "gate_proj.weight").c_str(),
                                         (p + "up_proj.weight").c_str(),
                                         (p + "down_proj.weight").c_str(), nullptr, check_only);
    if (par.tp_size > 1 && !check_only) {
      const std::vector<int64_t> one{0};
      out.shared_experts = shard_expert_weights(*out.shared_experts, one, par.tp_size, par.tp_rank);
    }
    if (cfg.has_shared_expert_gate)
      out.shared_expert_gate = keep(rd.get("shared_expert_gate.weight", {1, H}));
  } else {
    // A shared expert in the checkpoint that the config leaves out (e.g.
    // shared_expert_intermediate_size 0): running without it would be silently
    // wrong (transformers refuses such a checkpoint: its weights do not fit).
    const bool deepseek = mt == "deepseek_v2" || mt == "deepseek_v3";
    for (const std::string t : {"shared_expert.gate_proj.weight", "shared_experts.gate_proj.weight",
                                "shared_expert_gate.weight"})
      if (rd.has(t))
        FUSEDMOE_THROW(kIo, printable(checkpoint.path()), ": tensor '", rd.full(t),
                       "' belongs to a shared expert, but config.json gives none (",
                       deepseek ? "n_shared_experts 0, null or absent"
                                : "shared_expert_intermediate_size 0 or absent",
                       "): expected the shared expert's size in config.json, or a "
                       "checkpoint without it");
  }
  return out;
}

}  // namespace

MoELayerWeights load_moe_layer(const Checkpoint& checkpoint, const ModelInfo& info, int64_t layer,
                               const LoadOptions& options) {
  return load_or_check(checkpoint, info, layer, options, false);
}

void check_moe_layer(const Checkpoint& checkpoint, const ModelInfo& info, int64_t layer) {
  LoadOptions options;
  options.progress = false;
  options.check_finite = false;
  load_or_check(checkpoint, info, layer, options, true);
}

}  // namespace fusedmoe
