#include "thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

namespace specmlx {
namespace {

using Clock = std::chrono::steady_clock;

// How long a thread spins for the next task (or for its workers) before it parks. A parked
// worker on a VM's idle vCPU is slow to wake (the host halts the vCPU): slower than a whole
// matmul of a decode step, whose matmuls come well inside this window of each other.
// Much longer windows lose decode speed: the spinning worker takes a core from the Python
// thread and MLX's stream thread when both run, between passes.
constexpr auto kSpinWindow = std::chrono::microseconds(200);

// Spin until value != seen or the window passes; true if it changed. The spin yields the
// core every microsecond or so, to whichever other thread wants it.
template <typename T>
bool spin_until_changed(const std::atomic<T>& value, T seen) {
  const auto deadline = Clock::now() + kSpinWindow;
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (value.load(std::memory_order_acquire) != seen) {
        return true;
      }
      _mm_pause();
    }
    if (Clock::now() >= deadline) {
      return false;
    }
    sched_yield();
  }
}

} // namespace

int default_thread_count() {
  if (const char* env = std::getenv("SPECMLX_THREADS"); env && *env) {
    try {
      return std::max(1, std::stoi(env));
    } catch (const std::exception&) {
      // fall through to the CPU count: a bad setting must not break inference
    }
  }
  // Respect taskset / cgroup CPU masks, not just the machine's core count.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool(default_thread_count());
  return pool;
}

ThreadPool::ThreadPool(int n) {
  start(n);
}

ThreadPool::~ThreadPool() {
  stop();
}

void ThreadPool::start(int n) {
  size_ = std::max(1, n);
  stopping_ = false;
  // Workers start from the generation as of now, not as of when they first get scheduled:
  // a run() or stop() issued before a new thread reaches its wait would otherwise be missed.
  const uint64_t start_gen = generation_.load(std::memory_order_relaxed);
  for (int i = 1; i < size_; ++i) {
    workers_.emplace_back([this, i, start_gen] { worker(i, start_gen); });
  }
}

void ThreadPool::stop() {
  stopping_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
  workers_.clear();
}

void ThreadPool::resize(int n) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (std::max(1, n) == size_) {
    return;
  }
  stop();
  start(n);
}

void ThreadPool::worker(int index, uint64_t seen) {
  while (true) {
    if (!spin_until_changed(generation_, seen)) {
      generation_.wait(seen, std::memory_order_acquire);
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stopping_) {
      return;
    }
    if (index < n_tasks_) {
      (*job_)(index);
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      pending_.notify_one();
    }
  }
}

void ThreadPool::run(int n_tasks, const std::function<void(int)>& fn) {
  n_tasks = std::min(n_tasks, size_);
  if (n_tasks <= 1) {
    fn(0);
    return;
  }
  std::lock_guard<std::mutex> lock(run_mutex_);
  job_ = &fn;
  n_tasks_ = n_tasks;
  // Every worker checks in, busy or not, so a later run never races a late sleeper.
  pending_.store(size_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  fn(0);
  for (int left; (left = pending_.load(std::memory_order_acquire)) != 0;) {
    if (!spin_until_changed(pending_, left)) {
      pending_.wait(left, std::memory_order_acquire);
    }
  }
}

} // namespace specmlx
