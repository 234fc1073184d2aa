// fusedmoe CUDA: DeviceBuffer and synchronize() (kernels/cuda.h).
#include <cuda_runtime_api.h>

#include <utility>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_check.h"

namespace fusedmoe::cuda {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) FUSEDMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(bytes_, o.bytes_);
  return *this;
}
void DeviceBuffer::upload(const void* host, size_t bytes) {
  FUSEDMOE_CHECK(bytes <= bytes_, "DeviceBuffer::upload: ", bytes, " bytes into a buffer of ",
                 bytes_);
  if (bytes) FUSEDMOE_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
}
void DeviceBuffer::download(void* host, size_t bytes) const {
  FUSEDMOE_CHECK(bytes <= bytes_, "DeviceBuffer::download: ", bytes, " bytes from a buffer of ",
                 bytes_);
  if (bytes) FUSEDMOE_CUDA_CHECK(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
}
void synchronize() {
  FUSEDMOE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace fusedmoe::cuda
