// fusedmoe: tensors.
//
// TensorView is a non-owning, strided view (strides in elements, like
// PyTorch/DLPack). Tensor owns (or shares) its storage through a shared_ptr,
// which may be a heap buffer or a memory-mapped file region, and converts to
// a TensorView. Up to kMaxDims dimensions. Sizes and strides are int64.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/error.h"

namespace fusedmoe {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device&) const = default;
  bool is_cpu() const { return type == DeviceType::kCPU; }
};

inline constexpr int kMaxDims = 5;

class TensorView {
 public:
  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = {});
  TensorView(void* data, DType dtype, std::span<const int64_t> shape, Device device = {});
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, std::span<const int64_t> shape,
             std::span<const int64_t> strides, Device device = {});

  // True for a view with data, or a view with a shape and zero elements.
  bool defined() const { return data_ != nullptr || (ndim_ > 0 && numel() == 0); }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  int64_t size(int dim) const { return shape_[norm_dim(dim)]; }
  int64_t stride(int dim) const { return strides_[norm_dim(dim)]; }
  std::span<const int64_t> shape() const { return {shape_.data(), static_cast<size_t>(ndim_)}; }
  std::span<const int64_t> strides() const { return {strides_.data(), static_cast<size_t>(ndim_)}; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  // True when the last dimension has stride 1 (rows may be padded).
  bool rows_contiguous() const {
    return ndim_ == 0 || strides_[ndim_ - 1] == 1 || shape_[ndim_ - 1] <= 1;
  }

  // Sub-views (no copy).
  TensorView select(int dim, int64_t index) const;  // drops `dim`
  TensorView narrow(int dim, int64_t start, int64_t length) const;
  TensorView reshape(std::initializer_list<int64_t> shape) const;  // contiguous views only

  // "[5, 128]"
  std::string shape_str() const;
  // "f32 [5, 128]"
  std::string str() const;

 private:
  int norm_dim(int dim) const;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
  Device device_{};
};

// Owning tensor: a TensorView plus the storage keeping its memory alive.
class Tensor {
 public:
  Tensor() = default;
  Tensor(TensorView view, std::shared_ptr<void> storage)
      : view_(view), storage_(std::move(storage)) {}

  // Uninitialised contiguous host tensor, 64-byte aligned.
  static Tensor empty(DType dtype, std::span<const int64_t> shape);
  static Tensor empty(DType dtype, std::initializer_list<int64_t> shape) {
    return empty(dtype, std::span<const int64_t>(shape.begin(), shape.size()));
  }
  static Tensor zeros(DType dtype, std::initializer_list<int64_t> shape);
  // Contiguous copy of any host view (same dtype).
  static Tensor copy_of(const TensorView& src);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: implicit by design
  bool defined() const { return storage_ != nullptr || view_.data() != nullptr; }
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  DType dtype() const { return view_.dtype(); }
  int ndim() const { return view_.ndim(); }
  int64_t size(int dim) const { return view_.size(dim); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  std::span<const int64_t> shape() const { return view_.shape(); }
  std::string shape_str() const { return view_.shape_str(); }
  const std::shared_ptr<void>& storage() const { return storage_; }

 private:
  TensorView view_;
  std::shared_ptr<void> storage_;
};

// Converts any floating host view to a new contiguous f32 tensor.
Tensor to_f32(const TensorView& src);
// Converts a contiguous f32 view to a new contiguous tensor of `dtype`.
Tensor from_f32(const TensorView& src, DType dtype);

// ---- boundary checks -------------------------------------------------------
// check_tensor(t, "hidden_states", DType::kF32, {T, H}) throws
//   Error(kInvalidArgument): "hidden_states: expected f32 [5, 128], got bf16 [5, 64]".
// A negative expected size matches any size. Also checks the tensor is defined
// (unless it has zero elements), on the CPU unless `device` says otherwise,
// and that rows are contiguous when `rows_contiguous` is set.
void check_tensor(const TensorView& t, const char* name, DType dtype,
                  std::initializer_list<int64_t> expected_shape, bool rows_contiguous = true,
                  Device device = {});

// A 2-D host view with contiguous rows (any dtype; integers always pass):
// throws Error(kInvalidArgument) "hidden_states: expected finite values, got
// NaN at token 3, column 17" for its first NaN or Inf (`row_name` names rows).
void check_finite_rows(const TensorView& t, const char* name, const char* row_name = "token");

// A computed f32 [T, H] host output (MoERunner, the functional fused_experts):
// a finite input can still overflow f32 inside the experts (|x| ~ 1e30), and
// weights given by the caller may hold NaN / Inf, so its first NaN / Inf
// throws Error(kInvalidArgument) "output: non-finite value at token t, column
// h (the weights hold NaN or Inf, or the input or the weights overflow f32
// arithmetic)".
void require_finite_output(const TensorView& output);

}  // namespace fusedmoe
