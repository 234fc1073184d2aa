// fusedmoe: grow-only scratch memory (kernels/modular_kernel.h).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "fusedmoe/kernels/modular_kernel.h"

namespace fusedmoe {

namespace {

// "[4194304, 2048]"
std::string sizes_str(std::initializer_list<int64_t> shape) {
  std::string out = "[";
  for (const int64_t d : shape) out += (out.size() > 1 ? ", " : "") + std::to_string(d);
  return out + "]";
}

}  // namespace

size_t checked_bytes(const char* what, std::initializer_list<int64_t> shape, size_t elem_bytes) {
  int64_t n = static_cast<int64_t>(elem_bytes);
  bool overflow = false;
  for (const int64_t d : shape) overflow |= __builtin_mul_overflow(n, std::max<int64_t>(d, 0), &n);
  // A zero size anywhere makes the buffer empty, whatever the others.
  for (const int64_t d : shape)
    if (d <= 0) return 0;
  if (overflow)
    FUSEDMOE_THROW(kOutOfMemory, "out of memory: ", what, " = ", sizes_str(shape), " of ",
                   elem_bytes, "-byte elements would take 2^63 bytes or more");
  return static_cast<size_t>(n);
}

void* Workspace::get(int slot, const char* what, std::initializer_list<int64_t> shape,
                     size_t elem_bytes) {
  const size_t bytes = checked_bytes(what, shape, elem_bytes);
  try {
    return get(slot, bytes, nullptr);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfMemory) throw;
    FUSEDMOE_THROW(kOutOfMemory, e.what(), " for ", what, " = ", sizes_str(shape));
  }
}

void* Workspace::get(int slot, size_t bytes, const char* what) {
  FUSEDMOE_CHECK(slot >= 0, "Workspace::get: slot must be >= 0, got ", slot);
  if (static_cast<size_t>(slot) >= buffers_.size()) {
    buffers_.resize(slot + 1);
    sizes_.resize(slot + 1, 0);
  }
  if (sizes_[slot] < bytes || !buffers_[slot]) {
    // Round up to 4 KiB (at least 64 bytes) so that slowly growing batches do not reallocate often.
    const size_t size = bytes > std::numeric_limits<size_t>::max() - 4095
                            ? bytes
                            : std::max<size_t>(64, (bytes + 4095) / 4096 * 4096);
    buffers_[slot].reset();
    sizes_[slot] = 0;
    // aligned_alloc fails at once (nullptr) for a size beyond the address space
    // or the system's commit limit: nothing is touched.
    void* p = size % 64 == 0 ? std::aligned_alloc(64, size) : nullptr;
    if (!p)
      FUSEDMOE_THROW(kOutOfMemory, "out of memory: cannot allocate ", bytes_str(size),
                     " of workspace", what ? " for " : "", what ? what : "");
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
