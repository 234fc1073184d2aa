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

std::shared_ptr<void> SharedWorkspace::acquire(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  int current = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&current));
  FUSEDMOE_CHECK(device_ < 0 || device_ == current,
                 "cuda_workspace: shared by the layers of one device; it holds memory of device ",
                 device_, ", this layer is on device ", current);
  bytes = (bytes + 255) / 256 * 256;
  if (!block_ || bytes > bytes_) {
    void* p = nullptr;
    const cudaError_t err = bytes > 0 ? cudaMalloc(&p, bytes) : cudaSuccess;
    if (err != cudaSuccess) {
      cudaGetLastError();  // a failed cudaMalloc also leaves its error for the next check
      if (err == cudaErrorMemoryAllocation)
        FUSEDMOE_THROW(kOutOfMemory, "CUDA workspace: out of device memory: ", bytes,
                       " bytes on device ", current);
      FUSEDMOE_THROW(kInternal, "CUDA workspace: cudaMalloc of ", bytes, " bytes on device ",
                     current, " failed: ", cudaGetErrorString(err));
    }
    // Older blocks live on in the layers that hold them.
    block_ = std::shared_ptr<void>(p, [](void* q) {
      if (q) cudaFree(q);
    });
    bytes_ = bytes;
    device_ = current;
  }
  return block_;
}

void SharedWorkspace::reserve(size_t bytes) {
  acquire(bytes);
}

std::shared_ptr<void> SharedWorkspace::attachment(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = attached_.find(key);
  return it == attached_.end() ? nullptr : it->second.lock();
}

void SharedWorkspace::attach(const std::string& key, std::shared_ptr<void> object) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = attached_.begin(); it != attached_.end();)  // drop the expired ones
    it = it->second.expired() ? attached_.erase(it) : std::next(it);
  attached_[key] = object;
}

size_t SharedWorkspace::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

int SharedWorkspace::device() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return device_;
}

}  // namespace fusedmoe::cuda
