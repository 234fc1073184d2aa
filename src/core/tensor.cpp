#include "fusedmoe/core/tensor.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace fusedmoe {

namespace {
void set_contiguous_strides(int ndim, const std::array<int64_t, kMaxDims>& shape,
                            std::array<int64_t, kMaxDims>& strides) {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
}
}  // namespace

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device)
    : TensorView(data, dtype, std::span<const int64_t>(shape.begin(), shape.size()), device) {}

TensorView::TensorView(void* data, DType dtype, std::span<const int64_t> shape, Device device)
    : data_(data), dtype_(dtype), device_(device) {
  FUSEDMOE_CHECK(shape.size() <= static_cast<size_t>(kMaxDims), "TensorView: at most ", kMaxDims,
                 " dimensions, got ", shape.size());
  ndim_ = static_cast<int>(shape.size());
  for (int d = 0; d < ndim_; ++d) {
    FUSEDMOE_CHECK(shape[d] >= 0, "TensorView: negative size ", shape[d], " in dimension ", d);
    shape_[d] = shape[d];
  }
  set_contiguous_strides(ndim_, shape_, strides_);
}

TensorView::TensorView(void* data, DType dtype, std::span<const int64_t> shape,
                       std::span<const int64_t> strides, Device device)
    : TensorView(data, dtype, shape, device) {
  FUSEDMOE_CHECK(strides.size() == shape.size(), "TensorView: ", shape.size(), " sizes but ",
                 strides.size(), " strides");
  for (int d = 0; d < ndim_; ++d) strides_[d] = strides[d];
}

int TensorView::norm_dim(int dim) const {
  const int d = dim < 0 ? dim + ndim_ : dim;
  FUSEDMOE_CHECK(d >= 0 && d < ndim_, "dimension ", dim, " out of range for a ", ndim_,
                 "-d tensor");
  return d;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != s) return false;
    s *= shape_[d];
  }
  return true;
}

TensorView TensorView::select(int dim, int64_t index) const {
  const int d = norm_dim(dim);
  FUSEDMOE_CHECK(index >= 0 && index < shape_[d], "select: index ", index,
                 " out of range for size ", shape_[d], " of dimension ", d);
  TensorView r = *this;
  r.data_ =
      static_cast<char*>(data_) + index * strides_[d] * static_cast<int64_t>(dtype_size(dtype_));
  for (int i = d; i + 1 < ndim_; ++i) {
    r.shape_[i] = shape_[i + 1];
    r.strides_[i] = strides_[i + 1];
  }
  r.ndim_ = ndim_ - 1;
  return r;
}

TensorView TensorView::narrow(int dim, int64_t start, int64_t length) const {
  const int d = norm_dim(dim);
  FUSEDMOE_CHECK(start >= 0 && length >= 0 && start + length <= shape_[d], "narrow: [", start, ", ",
                 start + length, ") out of range for size ", shape_[d], " of dimension ", d);
  TensorView r = *this;
  r.data_ =
      static_cast<char*>(data_) + start * strides_[d] * static_cast<int64_t>(dtype_size(dtype_));
  r.shape_[d] = length;
  return r;
}

TensorView TensorView::reshape(std::initializer_list<int64_t> shape) const {
  FUSEDMOE_CHECK(is_contiguous(), "reshape: view ", str(), " is not contiguous");
  TensorView r(data_, dtype_, std::span<const int64_t>(shape.begin(), shape.size()), device_);
  FUSEDMOE_CHECK(r.numel() == numel(), "reshape: ", shape_str(), " has ", numel(),
                 " elements, new shape ", r.shape_str(), " has ", r.numel());
  return r;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < ndim_; ++d) os << (d ? ", " : "") << shape_[d];
  os << ']';
  return os.str();
}

std::string TensorView::str() const {
  return std::string(dtype_name(dtype_)) + " " + shape_str();
}

Tensor Tensor::empty(DType dtype, std::span<const int64_t> shape) {
  TensorView probe(nullptr, dtype, shape);
  int64_t nbytes = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape)
    if (__builtin_mul_overflow(nbytes, d, &nbytes) || nbytes > (int64_t{1} << 62))
      FUSEDMOE_THROW(kOutOfMemory, "Tensor::empty: out of memory: ", probe.str(),
                     " is too large to allocate (2^62 bytes or more)");
  const size_t bytes = std::max<size_t>(64, (static_cast<size_t>(nbytes) + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr)
    FUSEDMOE_THROW(kOutOfMemory, "Tensor::empty: out of memory: cannot allocate ", bytes_str(bytes),
                   " for ", probe.str());
  std::shared_ptr<void> storage(p, [](void* q) { std::free(q); });
  return Tensor(TensorView(p, dtype, shape), std::move(storage));
}

Tensor Tensor::zeros(DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t = empty(dtype, shape);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

namespace {
// Calls fn(dst_offset_elements, src_pointer) for every element of a strided view in
// row-major order, one contiguous inner row at a time.
template <typename Fn>
void for_each_row(const TensorView& v, Fn&& fn) {
  const int nd = v.ndim();
  if (v.numel() == 0) return;
  if (nd == 0) {
    fn(0, static_cast<const char*>(v.data()), 1);
    return;
  }
  const int64_t inner = v.size(nd - 1);
  const int64_t rows = v.numel() / inner;
  const size_t es = dtype_size(v.dtype());
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * v.stride(d);
    fn(r * inner, static_cast<const char*>(v.data()) + off * static_cast<int64_t>(es), inner);
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < v.size(d)) break;
      idx[d] = 0;
    }
  }
}
}  // namespace

Tensor Tensor::copy_of(const TensorView& src) {
  Tensor t = empty(src.dtype(), src.shape());
  const size_t es = dtype_size(src.dtype());
  const int64_t inner_stride = src.ndim() ? src.stride(src.ndim() - 1) : 1;
  char* dst = static_cast<char*>(t.data());
  for_each_row(src, [&](int64_t off, const char* p, int64_t n) {
    if (inner_stride == 1) {
      std::memcpy(dst + off * es, p, n * es);
    } else {
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(dst + (off + i) * es, p + i * inner_stride * es, es);
    }
  });
  return t;
}

Tensor to_f32(const TensorView& src) {
  FUSEDMOE_CHECK(src.dtype() != DType::kBool, "to_f32: cannot convert bool");
  Tensor c = src.is_contiguous() ? Tensor(src, nullptr) : Tensor::copy_of(src);
  Tensor out = Tensor::empty(DType::kF32, src.shape());
  convert_to_f32(c.data(), src.dtype(), out.data_as<float>(), static_cast<size_t>(src.numel()));
  return out;
}

Tensor from_f32(const TensorView& src, DType dtype) {
  FUSEDMOE_CHECK(src.dtype() == DType::kF32 && src.is_contiguous(),
                 "from_f32: expected a contiguous f32 tensor, got ", src.str());
  Tensor out = Tensor::empty(dtype, src.shape());
  convert_from_f32(src.data_as<float>(), out.data(), dtype, static_cast<size_t>(src.numel()));
  return out;
}

void check_tensor(const TensorView& t, const char* name, DType dtype,
                  std::initializer_list<int64_t> expected_shape, bool rows_contiguous,
                  Device device) {
  bool ok = t.dtype() == dtype && t.ndim() == static_cast<int>(expected_shape.size());
  if (ok) {
    int d = 0;
    for (int64_t e : expected_shape) {
      if (e >= 0 && t.size(d) != e) ok = false;
      ++d;
    }
  }
  if (!ok) {
    std::ostringstream exp;
    exp << dtype_name(dtype) << " [";
    int d = 0;
    for (int64_t e : expected_shape) {
      exp << (d++ ? ", " : "");
      if (e >= 0)
        exp << e;
      else
        exp << '*';
    }
    exp << ']';
    FUSEDMOE_THROW(kInvalidArgument, name, ": expected ", exp.str(), ", got ", t.str());
  }
  FUSEDMOE_CHECK(t.numel() == 0 || t.data() != nullptr, name, ": tensor ", t.str(),
                 " has no data (null pointer)");
  const auto device_str = [](const Device& d) {
    return d.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(d.index);
  };
  FUSEDMOE_CHECK(t.device() == device, name, ": expected a tensor on ", device_str(device),
                 ", got one on ", device_str(t.device()));
  if (rows_contiguous)
    FUSEDMOE_CHECK(t.rows_contiguous(), name, ": expected unit stride in the last dimension, got ",
                   t.ndim() ? t.stride(t.ndim() - 1) : 0);
  for (int d = 0; d < t.ndim(); ++d)
    FUSEDMOE_CHECK(t.stride(d) >= 0, name, ": negative stride ", t.stride(d), " in dimension ", d);
}

namespace {
// The first non-finite element of a 2-d view, row by row: false if none.
bool first_non_finite(const TensorView& t, int64_t& row, int64_t& col) {
  if (t.ndim() != 2 || t.numel() == 0) return false;
  const size_t es = dtype_size(t.dtype());
  for (int64_t r = 0; r < t.size(0); ++r) {
    const char* p = static_cast<const char*>(t.data()) + static_cast<size_t>(r * t.stride(0)) * es;
    const int64_t c = find_non_finite(p, t.dtype(), static_cast<size_t>(t.size(1)));
    if (c >= 0) {
      row = r;
      col = c;
      return true;
    }
  }
  return false;
}
}  // namespace

void check_finite_rows(const TensorView& t, const char* name, const char* row_name) {
  int64_t r = 0, c = 0;
  if (!first_non_finite(t, r, c)) return;
  const size_t es = dtype_size(t.dtype());
  float v = 0.0f;
  convert_to_f32(static_cast<const char*>(t.data()) + static_cast<size_t>(r * t.stride(0) + c) * es,
                 t.dtype(), &v, 1);
  FUSEDMOE_THROW(kInvalidArgument, name, ": expected finite values, got ",
                 std::isnan(v) ? "NaN" : "Inf", " at ", row_name, " ", r, ", column ", c);
}

void require_finite_output(const TensorView& output) {
  int64_t t = 0, h = 0;
  if (first_non_finite(output, t, h))
    FUSEDMOE_THROW(kInvalidArgument, "output: non-finite value at token ", t, ", column ", h,
                   " (the weights hold NaN or Inf, or the input or the weights overflow f32 "
                   "arithmetic, or with bf16 compute an input beyond bf16's largest value, "
                   "3.39e38, rounded to Inf)");
}

}  // namespace fusedmoe
