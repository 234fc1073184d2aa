// fusedmoe CUDA tests: device buffers, skipping without a device; random layers
// come from tests/support/random_layer.h.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "fusedmoe/kernels/cuda.h"
#include "fusedmoe/runner/moe_runner.h"
#include "random_layer.h"
#include "test_util.h"

// Every CUDA test starts with this: no device (or no driver) -> skipped.
#define FUSEDMOE_REQUIRE_CUDA()                                                           \
  do {                                                                                    \
    if (::fusedmoe::cuda::device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(expr)

namespace fusedmoe::test {

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    FUSEDMOE_THROW(kInternal, what, ": ", cudaGetErrorName(e), " ", cudaGetErrorString(e));
}

// Owning device tensor (contiguous unless a row stride is given).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::vector<int64_t> shape, int64_t row_stride = -1)
      : dtype_(dtype), shape_(std::move(shape)) {
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape_.size(); ++i) rows *= shape_[i];
    const int64_t cols = shape_.empty() ? 1 : shape_.back();
    ld_ = row_stride >= 0 ? row_stride : cols;
    bytes_ = static_cast<size_t>(std::max<int64_t>(rows * ld_, 1)) * dtype_size(dtype);
    void* p = nullptr;
    cuda_ok(cudaGetDevice(&device_), "cudaGetDevice");  // the allocation's device
    cuda_ok(cudaMalloc(&p, bytes_), "cudaMalloc");
    ptr_ = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }
  // Upload of a contiguous host tensor (same dtype), optionally with a row stride.
  static DeviceTensor from_host(const TensorView& h, int64_t row_stride = -1) {
    std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
    DeviceTensor d(h.dtype(), shape, row_stride);
    const int64_t cols = shape.empty() ? 1 : shape.back();
    const int64_t rows = cols == 0 ? 0 : h.numel() / cols;
    const size_t es = dtype_size(h.dtype());
    if (rows > 0)
      cuda_ok(cudaMemcpy2D(d.data(), d.ld_ * es, h.data(), cols * es, cols * es, rows,
                           cudaMemcpyHostToDevice),
              "upload");
    return d;
  }
  TensorView view() const {
    std::vector<int64_t> strides(shape_.size(), 1);
    if (!shape_.empty()) {
      int64_t s = ld_;
      for (int i = static_cast<int>(shape_.size()) - 2; i >= 0; --i) {
        strides[i] = s;
        s *= shape_[i];
      }
    }
    return TensorView(ptr_.get(), dtype_, shape_, strides, Device{DeviceType::kCUDA, device_});
  }
  operator TensorView() const { return view(); }  // NOLINT
  void* data() const { return ptr_.get(); }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(ptr_.get());
  }
  // Contiguous host copy.
  Tensor to_host() const {
    Tensor h = Tensor::empty(dtype_, std::span<const int64_t>(shape_.data(), shape_.size()));
    const int64_t cols = shape_.empty() ? 1 : shape_.back();
    const int64_t rows = cols == 0 ? 0 : h.numel() / cols;
    const size_t es = dtype_size(dtype_);
    if (rows > 0)
      cuda_ok(cudaMemcpy2D(h.data(), cols * es, data(), ld_ * es, cols * es, rows,
                           cudaMemcpyDeviceToHost),
              "download");
    return h;
  }
  // Every byte 0xff: NaN for f32 / bf16, -1 for integers.
  // NaN bits everywhere; synchronous, so work on any stream afterwards sees it
  // (cudaMemset on the legacy stream does not order non-blocking streams).
  void poison() const {
    cuda_ok(cudaMemset(data(), 0xff, bytes_), "poison");
    cuda_ok(cudaDeviceSynchronize(), "poison");
  }
  int64_t ld() const { return ld_; }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  int64_t ld_ = 0;
  size_t bytes_ = 0;
  int device_ = 0;  // CUDA device of the allocation
  std::shared_ptr<void> ptr_;
};

// An ExpertWeights on the device: w13, w2 as stored, the biases (when it has
// them) as f32; empty tensors otherwise.
struct DeviceExperts {
  DeviceTensor w13, w2, b13, b2;
  explicit DeviceExperts(const ExpertWeights& w)
      : w13(DeviceTensor::from_host(w.w13)), w2(DeviceTensor::from_host(w.w2)) {
    if (w.w13_bias) b13 = DeviceTensor::from_host(to_f32(*w.w13_bias));
    if (w.w2_bias) b2 = DeviceTensor::from_host(to_f32(*w.w2_bias));
  }
};

// cuda::FusedExpertsArgs over device tensors: hidden states x [T, H] and
// output out [T, H] (dtypes and row strides from the tensors), w13 [E, 2I, H]
// and w2 [E, H, I] (weight_dtype: w13's), f32 biases (empty tensor: none),
// topk_ids / topk_weights [T, k].
inline cuda::FusedExpertsArgs fused_experts_args(const DeviceTensor& x, const DeviceTensor& w13,
                                                 const DeviceTensor& w2, const DeviceTensor& b13,
                                                 const DeviceTensor& b2, const DeviceTensor& ids,
                                                 const DeviceTensor& tw, const DeviceTensor& out,
                                                 const ActivationParams& act, bool on_input) {
  const TensorView xv = x.view(), wv = w13.view();
  cuda::FusedExpertsArgs a;
  a.hidden_states = x.data();
  a.hidden_dtype = xv.dtype();
  a.ldx = x.ld();
  a.num_tokens = xv.size(0);
  a.hidden_size = xv.size(1);
  a.intermediate_size = wv.size(1) / 2;
  a.num_experts = wv.size(0);
  a.top_k = ids.view().size(1);
  a.weight_dtype = wv.dtype();
  a.w13 = w13.data_as<const uint16_t>();
  a.w2 = w2.data_as<const uint16_t>();
  a.w13_bias = b13.data_as<const float>();
  a.w2_bias = b2.data_as<const float>();
  a.topk_ids = ids.data_as<const int32_t>();
  a.topk_weights = tw.data_as<const float>();
  a.activation = act;
  a.apply_router_weight_on_input = on_input;
  a.output = out.data();
  a.output_dtype = out.view().dtype();
  a.ldo = out.ld();
  return a;
}

}  // namespace fusedmoe::test
