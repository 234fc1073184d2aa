// fusedmoe internal: CPU GEMM — instruction-set dispatch, the scalar kernel
// and the parallel driver (see gemm.h; the vector kernels are in
// gemm_avx512.cpp and gemm_avx2.cpp, their shared algorithm in gemm_impl.inc).
#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "fusedmoe/core/error.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/gemm_kernels.h"

#if defined(__linux__) && defined(FUSEDMOE_GEMM_X86)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fusedmoe::cpu {

// The definition of gemm.h's order, element by element: 16 lanes of std::fma
// over K padded with zeros to a multiple of 16, then the fixed tree.
void gemm_nt_scalar(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                    bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C,
                    int64_t ldc, const GemmPrefetch*) {
  const DType wt = w_bf16 ? DType::kBF16 : DType::kF32;
  const DType bt = bias_bf16 ? DType::kBF16 : DType::kF32;
  const int64_t k_pad = (K + 15) / 16 * 16;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s[16] = {};
      for (int64_t k = 0; k < k_pad; ++k) {
        const float a = k < K ? A[m * lda + k] : 0.0f;
        const float w = k < K ? load_as_f32(W, wt, n * ldw + k) : 0.0f;
        s[k % 16] = std::fma(a, w, s[k % 16]);
      }
      float h[8], q[4], p[2];
      for (int j = 0; j < 8; ++j) h[j] = s[j] + s[j + 8];
      for (int j = 0; j < 4; ++j) q[j] = h[j] + h[j + 4];
      for (int j = 0; j < 2; ++j) p[j] = q[j] + q[j + 2];
      float c = p[0] + p[1];
      if (bias) c += load_as_f32(bias, bt, n);
      C[m * ldc + n] = c;
    }
}

// ---------------------------------------------------------------- dispatch

namespace {

GemmKernel kernel_of(CpuIsa isa) {
  switch (isa) {
#ifdef FUSEDMOE_GEMM_X86
    case CpuIsa::kAvx512:
      return &gemm_nt_avx512;
    case CpuIsa::kAvx2:
      return &gemm_nt_avx2;
#endif
    default:
      return &gemm_nt_scalar;
  }
}

std::atomic<GemmKernel> g_kernel{nullptr};
std::atomic<int> g_isa{-1};
std::mutex g_init_mutex;

std::string supported_list() {
  std::string s;
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kScalar})
    if (cpu_isa_supported(isa)) s += std::string(s.empty() ? "" : ", ") + cpu_isa_name(isa);
  return s;
}

// FUSEDMOE_CPU_ISA, else the best the CPU supports.
CpuIsa isa_from_environment() {
  const char* env = std::getenv("FUSEDMOE_CPU_ISA");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best_cpu_isa();
  CpuIsa isa;
  if (std::strcmp(env, "avx512") == 0)
    isa = CpuIsa::kAvx512;
  else if (std::strcmp(env, "avx2") == 0)
    isa = CpuIsa::kAvx2;
  else if (std::strcmp(env, "scalar") == 0)
    isa = CpuIsa::kScalar;
  else
    FUSEDMOE_THROW(kInvalidArgument, "FUSEDMOE_CPU_ISA: expected one of auto, avx512, ",
                   "avx2, scalar, got '", printable(env), "'");
  if (!cpu_isa_supported(isa))
    FUSEDMOE_THROW(kUnsupported, "FUSEDMOE_CPU_ISA=", env, ": this CPU does not support ",
                   isa == CpuIsa::kAvx512 ? "AVX-512 (F, BW, VL, DQ)" : "AVX2 and FMA",
                   "; it supports ", supported_list());
  return isa;
}

GemmKernel current_kernel() {
  GemmKernel k = g_kernel.load(std::memory_order_acquire);
  if (k != nullptr) return k;
  std::lock_guard<std::mutex> lock(g_init_mutex);
  k = g_kernel.load(std::memory_order_acquire);
  if (k != nullptr) return k;
  const CpuIsa isa = isa_from_environment();  // may throw; the next call tries again
  g_isa.store(static_cast<int>(isa));
  k = kernel_of(isa);
  g_kernel.store(k, std::memory_order_release);
  return k;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
#ifdef FUSEDMOE_GEMM_X86
    case CpuIsa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
    default:
      return false;
  }
}

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2})
    if (cpu_isa_supported(isa)) return isa;
  return CpuIsa::kScalar;
}

CpuIsa gemm_isa() {
  current_kernel();
  return static_cast<CpuIsa>(g_isa.load());
}

void set_gemm_isa(CpuIsa isa) {
  if (!cpu_isa_supported(isa))
    FUSEDMOE_THROW(kUnsupported, "set_gemm_isa: this CPU does not support ", cpu_isa_name(isa),
                   "; it supports ", supported_list());
  std::lock_guard<std::mutex> lock(g_init_mutex);
  g_isa.store(static_cast<int>(isa));
  g_kernel.store(kernel_of(isa), std::memory_order_release);
}

// ---------------------------------------------------------------- AMX

namespace {

// The CPU has AMX-TILE, AMX-BF16 and AVX-512 (cpuid only: no system call).
bool amx_cpu() {
#if defined(__linux__) && defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         cpu_isa_supported(CpuIsa::kAvx512);
#else
  return false;
#endif
}

// -1: from the environment at first use; 0 off; 1 on; 2 on, required (FUSEDMOE_CPU_AMX=1)
std::atomic<int> g_amx{-1};

}  // namespace

bool amx_supported() {
  static const bool ok = [] {
#if defined(__linux__) && defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
    if (!amx_cpu()) return false;
    // Linux enables the 8 KiB tile state per process, on request. (The request
    // raises the process's smallest accepted sigaltstack size.)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

bool amx_in_use() {
  int on = g_amx.load(std::memory_order_acquire);
  if (on < 0) {
    const char* env = std::getenv("FUSEDMOE_CPU_AMX");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) {
      on = amx_cpu() ? 1 : 0;
    } else if (std::strcmp(env, "0") == 0) {
      on = 0;
    } else if (std::strcmp(env, "1") == 0) {
      if (!amx_supported())
        FUSEDMOE_THROW(kUnsupported, "FUSEDMOE_CPU_AMX=1: this CPU or OS does not support AMX ",
                       "(AMX-TILE and AMX-BF16 with AVX-512, and the tile state granted by the "
                       "kernel)");
      on = 2;
    } else {
      FUSEDMOE_THROW(kInvalidArgument, "FUSEDMOE_CPU_AMX: expected 0, 1 or auto, got '",
                     printable(env), "'");
    }
    g_amx.store(on, std::memory_order_release);
  }
  const CpuIsa isa = gemm_isa();
  if (on == 2 && isa != CpuIsa::kAvx512)
    FUSEDMOE_THROW(kInvalidArgument, "FUSEDMOE_CPU_AMX=1: AMX runs with the avx512 GEMM, but ",
                   "FUSEDMOE_CPU_ISA (or set_gemm_isa) chose ", cpu_isa_name(isa));
  return on >= 1 && isa == CpuIsa::kAvx512;
}

bool amx_ready() {
  return amx_in_use() && amx_supported();
}

void amx_out_of_memory(size_t bytes) {
  FUSEDMOE_THROW(kOutOfMemory, "out of memory: cannot allocate ", bytes,
                 " bytes for a thread's AMX weight tiles");
}

void set_amx(bool on) {
  if (on && !amx_supported())
    FUSEDMOE_THROW(kUnsupported, "set_amx: this CPU or OS does not support AMX");
  g_amx.store(on ? 1 : 0, std::memory_order_release);
}

// ---------------------------------------------------------------- entry points

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
             DType w_dtype, int64_t ldw, const void* bias, DType bias_dtype, float* C, int64_t ldc,
             const GemmPrefetch* next) {
  if (M <= 0 || N <= 0) return;
  current_kernel()(M, N, K, A, lda, W, w_dtype == DType::kBF16, ldw, bias,
                   bias_dtype == DType::kBF16, C, ldc, next);
}

void gemm_nt_parallel(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const float* A,
                      int64_t lda, const void* W, DType w_dtype, int64_t ldw, const void* bias,
                      DType bias_dtype, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const GemmKernel kernel = current_kernel();
  // Column blocks of 64 W rows; row blocks of 128 (the large-M path's state block).
  const int64_t mb = 128, nb = 64;
  const int64_t m_blocks = (M + mb - 1) / mb, n_blocks = (N + nb - 1) / nb;
  const int64_t items = m_blocks * n_blocks;
  const size_t wsize = dtype_size(w_dtype), bsize = dtype_size(bias_dtype);
  const bool w_bf16 = w_dtype == DType::kBF16, bias_bf16 = bias_dtype == DType::kBF16;
  std::atomic<int64_t> next{0};
  pool.parallel_for(
      std::min<int64_t>(items, pool.num_threads()),
      [&](int64_t, int64_t, int) {
        for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
          const int64_t m0 = it / n_blocks * mb, n0 = it % n_blocks * nb;
          kernel(std::min(mb, M - m0), std::min(nb, N - n0), K, A + m0 * lda, lda,
                 static_cast<const char*>(W) + n0 * ldw * wsize, w_bf16, ldw,
                 bias ? static_cast<const char*>(bias) + n0 * bsize : nullptr, bias_bf16,
                 C + m0 * ldc + n0, ldc, nullptr);
        }
      },
      1);
}

}  // namespace fusedmoe::cpu
