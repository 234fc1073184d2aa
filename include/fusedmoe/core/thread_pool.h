// fusedmoe: a small fixed-size thread pool for CPU kernels.
//
// parallel_for splits [0, n) into contiguous chunks, one task per chunk, runs
// them on the pool's workers and the calling thread, and returns when all are
// done. An exception thrown by a task is rethrown in the caller (the first
// one; the remaining chunks still finish). Nested calls from inside a task run
// serially on that thread, so a kernel may call parallel_for unconditionally.
// fork()-safe: in a child process every pool starts new workers with its next
// job (the parent's are not there).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace fusedmoe {

// The CPUs this process may run on: its affinity mask's count (sched_getaffinity:
// what taskset, numactl, an MPI launcher's binding or a cgroup cpuset leave
// it), else std::thread::hardware_concurrency(); at least 1. The thread count
// of "all cores" (num_threads <= 0) everywhere.
int usable_cpus();

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 1024;
  // num_threads <= 0: usable_cpus(). Throws
  // Error(kInvalidArgument) above kMaxThreads, Error(kInternal) when the
  // system cannot start the threads.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;
  // fn(begin, end, thread_index): thread_index in [0, num_threads()), unique
  // among tasks running at the same time (use it to index per-thread scratch).
  // `grain`: minimum items per chunk.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                    int64_t grain = 1);

  // The process-wide pool used by kernels unless one is passed explicitly.
  static ThreadPool& global();
  // Makes the global pool one of `num_threads` threads (<= 0: all cores). Safe
  // while other threads run on the pool it replaces: that pool is kept (idle)
  // until exit, and reused when its size is asked for again. Throws as the
  // constructor does; the global pool is then unchanged.
  static void set_global_num_threads(int num_threads);

 private:
  struct Impl;
  void start_workers();
  void after_fork_in_child();
  // pthread_atfork handlers (once a process): the global pools' and the
  // registry's mutexes held across fork(), every pool made fresh in the child.
  static void register_fork_handlers();
  std::unique_ptr<Impl> impl_;
};

}  // namespace fusedmoe
