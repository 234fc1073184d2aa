// fusedmoe: grow-only scratch memory (kernels/modular_kernel.h).
#include <cstdlib>
#include <new>

#include "fusedmoe/kernels/modular_kernel.h"

namespace fusedmoe {

void* Workspace::get(int slot, size_t bytes) {
  FUSEDMOE_CHECK(slot >= 0, "Workspace::get: slot must be >= 0, got ", slot);
  if (static_cast<size_t>(slot) >= buffers_.size()) {
    buffers_.resize(slot + 1);
    sizes_.resize(slot + 1, 0);
  }
  if (sizes_[slot] < bytes || !buffers_[slot]) {
    // Round up to 4 KiB (at least 64 bytes) so that slowly growing batches do not reallocate often.
    const size_t size = std::max<size_t>(64, (bytes + 4095) / 4096 * 4096);
    buffers_[slot].reset();
    void* p = std::aligned_alloc(64, size);
    if (!p) throw std::bad_alloc();
    buffers_[slot] = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    sizes_[slot] = size;
  }
  return buffers_[slot].get();
}

size_t Workspace::total_bytes() const {
  size_t n = 0;
  for (size_t s : sizes_) n += s;
  return n;
}

}  // namespace fusedmoe
