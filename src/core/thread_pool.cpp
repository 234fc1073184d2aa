#include "fusedmoe/core/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "fusedmoe/core/error.h"

namespace fusedmoe {

namespace {
// Set while a thread runs a parallel_for task: nested calls then run inline.
thread_local bool t_in_parallel_region = false;

// num_threads <= 0: every CPU this process may run on.
int resolve_threads(int num_threads) {
  return num_threads > 0 ? num_threads : usable_cpus();
}
}  // namespace

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// How long a worker waiting for the next job, and the caller waiting for the
// workers to finish one, poll (yielding the CPU each time) before they sleep on
// a condition variable. A forward runs several jobs back to back; each sleep and
// futex wake-up cost tens of microseconds on a VM (2-core development machine,
// tiny layer, T = 1: 269 us a call on 2 threads against 21 us on one;
// bench/results/2026-12-01-session22.md), the polls a few. The yield keeps an
// oversubscribed machine (MPI ranks on fewer cores) from losing CPU to them.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

// Polls `ready` (yielding between tries) until it holds or kSpinBeforeSleep
// passes; whether it held.
template <class Ready>
bool spin_until(Ready&& ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 15) == 15 && std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
}

// One job at a time: the caller publishes (fn, chunks); the workers and the
// caller claim chunk indices from `ticket`, which holds the job's number beside
// the next index, so a claim succeeds only for the job it was made for; the
// caller waits for the job's chunks to be done, not for the workers: a worker
// the OS has not run yet (a busy machine) has claimed nothing and holds no one
// up (before, each job waited for every worker to wake and check in: 30-1600x
// slower calls with two other busy processes on a 2-core machine; trial of
// session 34). A worker that wakes late finds its job over and waits for the
// next. The job's fields are atomics: a late worker may read the next job's
// values, but then its claim fails (they are stored after the old job is closed).
struct ThreadPool::Impl {
  int num_threads = 1;
  bool spawned = false;  // workers started (false in a forked child until the next job)
  std::vector<std::thread> workers;
  std::mutex mu;
  std::condition_variable cv_work;
  std::condition_variable cv_done;
  std::mutex job_mu;  // serialises parallel_for calls from different threads
  // Incremented (under mu) when a job is published, after its fields.
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> stop{false};

  // The current job: (its number's low 32 bits << 32) | the next chunk to
  // claim, or kClosed in the low half while the caller changes the fields.
  static constexpr uint64_t kClosed = 0xffffffffu;
  std::atomic<uint64_t> ticket{kClosed};
  std::atomic<const std::function<void(int64_t, int64_t, int)>*> fn{nullptr};
  std::atomic<int64_t> n{0}, chunk{1}, num_chunks{0};
  std::atomic<int64_t> done_chunks{0};
  std::exception_ptr error;  // under mu

  static uint64_t ticket_of(uint64_t job, uint64_t index) {
    return ((job & kClosed) << 32) | index;
  }

  // The next chunk of job `job`, or -1 when it has none left (or is over).
  int64_t claim(uint64_t job) {
    uint64_t t = ticket.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t index = t & kClosed;
      if ((t >> 32) != (job & kClosed) || index == kClosed ||
          static_cast<int64_t>(index) >= num_chunks.load(std::memory_order_acquire))
        return -1;
      if (ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        return static_cast<int64_t>(index);
    }
  }

  void run_chunks(uint64_t job, int thread_index) {
    t_in_parallel_region = true;
    for (int64_t c; (c = claim(job)) >= 0;) {
      // Claimed: the job cannot end before this chunk is done, its fields stay.
      const int64_t size = chunk.load(std::memory_order_relaxed);
      const int64_t b = c * size, e = std::min(n.load(std::memory_order_relaxed), b + size);
      try {
        (*fn.load(std::memory_order_relaxed))(b, e, thread_index);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!error) error = std::current_exception();
      }
      if (done_chunks.fetch_add(1, std::memory_order_acq_rel) + 1 ==
          num_chunks.load(std::memory_order_relaxed)) {
        std::lock_guard<std::mutex> lk(mu);  // the caller checks under mu: no lost wake-up
        cv_done.notify_one();
      }
    }
    t_in_parallel_region = false;
  }

  void worker_loop(int thread_index) {
    uint64_t seen = 0;
    for (;;) {
      const auto job = [&] { return stop.load() || generation.load() != seen; };
      if (!spin_until(job)) {
        std::unique_lock<std::mutex> lk(mu);
        cv_work.wait(lk, job);
      }
      if (stop.load()) return;
      seen = generation.load();  // the newest job; any before it are over
      run_chunks(seen, thread_index);
    }
  }
};

namespace {
// Guards the global pools (global(), set_global_num_threads); taken before
// registry_mu() where both are.
std::mutex g_pool_mu;

// fork(): the child has only the forking thread, so a pool's workers (and any
// lock they held) are gone there. Every live pool is registered; in the child
// each gets a fresh, unlocked state whose workers start with its next job, and
// the old state is leaked (its std::thread handles name threads that do not
// exist in the child: neither joinable nor destructible). The registry's mutex
// is held across fork() so the child's copy of the registry is consistent.
std::mutex& registry_mu() {
  static std::mutex* mu = new std::mutex;  // never destroyed: used by atfork handlers
  return *mu;
}
std::set<ThreadPool*>& registry() {
  static auto* pools = new std::set<ThreadPool*>;
  return *pools;
}
}  // namespace

void ThreadPool::register_fork_handlers() {
  static std::once_flag atfork;
  std::call_once(atfork, [] {
    pthread_atfork(
        [] {
          g_pool_mu.lock();
          registry_mu().lock();
        },
        [] {
          registry_mu().unlock();
          g_pool_mu.unlock();
        },
        [] {
          for (ThreadPool* p : registry()) p->after_fork_in_child();
          registry_mu().unlock();
          g_pool_mu.unlock();
        });
  });
}

void ThreadPool::after_fork_in_child() {
  const int n = impl_->num_threads;
  impl_.release();  // NOLINT(bugprone-unused-return-value): leaked on purpose, see above
  impl_ = std::make_unique<Impl>();
  impl_->num_threads = n;
}

void ThreadPool::start_workers() {
  Impl& s = *impl_;
  try {
    for (int i = 1; i < s.num_threads; ++i) s.workers.emplace_back([&s, i] { s.worker_loop(i); });
  } catch (const std::system_error& e) {
    // Join the workers already started before the throw.
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.stop.store(true);
    }
    s.cv_work.notify_all();
    for (auto& w : s.workers) w.join();
    s.workers.clear();
    s.stop.store(false);
    FUSEDMOE_THROW(kInternal, "num_threads: could not start ", s.num_threads, " threads (",
                   e.what(), ")");
  }
  s.spawned = true;
}

ThreadPool::ThreadPool(int num_threads) : impl_(std::make_unique<Impl>()) {
  num_threads = resolve_threads(num_threads);
  FUSEDMOE_CHECK(num_threads <= kMaxThreads, "num_threads: expected 1..", kMaxThreads,
                 " (or <= 0 for all cores), got ", num_threads);
  impl_->num_threads = num_threads;
  register_fork_handlers();
  start_workers();
  std::lock_guard<std::mutex> lk(registry_mu());
  registry().insert(this);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(registry_mu());
    registry().erase(this);
  }
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop.store(true);
  }
  impl_->cv_work.notify_all();
  for (auto& w : impl_->workers) w.join();
}

int ThreadPool::num_threads() const {
  return impl_->num_threads;
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int threads = impl_->num_threads;
  if (t_in_parallel_region || threads == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  std::lock_guard<std::mutex> job_lock(impl_->job_mu);
  Impl& s = *impl_;
  if (!s.spawned) start_workers();  // a forked child's first job
  // The previous job's chunks are all done. Close its ticket first: a late
  // claim for it fails from here on, whatever fields it reads below.
  const uint64_t job = s.generation.load() + 1;
  s.ticket.store(Impl::ticket_of(job, Impl::kClosed));
  // A few chunks per thread balance uneven work without much overhead.
  const int64_t target_chunks = static_cast<int64_t>(threads) * 4;
  const int64_t chunk = std::max(grain, (n + target_chunks - 1) / target_chunks);
  const int64_t num_chunks = (n + chunk - 1) / chunk;  // <= target_chunks
  s.fn.store(&fn, std::memory_order_release);
  s.n.store(n, std::memory_order_release);
  s.chunk.store(chunk, std::memory_order_release);
  s.num_chunks.store(num_chunks, std::memory_order_release);
  s.done_chunks.store(0, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.error = nullptr;
    s.ticket.store(Impl::ticket_of(job, 0), std::memory_order_release);
    s.generation.store(job);
  }
  s.cv_work.notify_all();
  s.run_chunks(job, 0);
  std::exception_ptr err;
  {
    const auto done = [&] { return s.done_chunks.load(std::memory_order_acquire) == num_chunks; };
    if (!spin_until(done)) {
      std::unique_lock<std::mutex> lk(s.mu);
      s.cv_done.wait(lk, done);
    }
    std::lock_guard<std::mutex> lk(s.mu);  // error: written under mu by a worker
    err = s.error;
  }
  if (err) std::rethrow_exception(err);
}

namespace {
// Every global pool stays until exit: a thread may still be inside a call on
// the pool it got from global() when another thread replaces it
// (set_global_num_threads), so a replaced pool is kept, idle, and reused when
// its size is asked for again — never destroyed while in use. (g_pool_mu
// guards them, above.)
std::map<int, std::unique_ptr<ThreadPool>>& g_pools() {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  return pools;
}
std::atomic<ThreadPool*> g_pool{nullptr};

// Under g_pool_mu: the pool of `num_threads` threads, made on first use.
ThreadPool* pool_of_size(int num_threads) {
  const int n = resolve_threads(num_threads);
  std::unique_ptr<ThreadPool>& slot = g_pools()[n];
  if (!slot) {
    try {
      slot = std::make_unique<ThreadPool>(n);
    } catch (...) {
      g_pools().erase(n);
      throw;
    }
  }
  return slot.get();
}
}  // namespace

ThreadPool& ThreadPool::global() {
  if (ThreadPool* p = g_pool.load(std::memory_order_acquire)) return *p;
  register_fork_handlers();  // before g_pool_mu is first taken
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool.load(std::memory_order_relaxed)) g_pool.store(pool_of_size(0));
  return *g_pool.load(std::memory_order_relaxed);
}

void ThreadPool::set_global_num_threads(int num_threads) {
  register_fork_handlers();
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_pool.store(pool_of_size(num_threads), std::memory_order_release);
}

}  // namespace fusedmoe
