// A small persistent thread pool: the caller plus (size - 1) parked workers.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specmlx {

class ThreadPool {
 public:
  // The process-wide pool, sized from SPECMLX_THREADS or the CPUs this process may use.
  static ThreadPool& instance();

  ~ThreadPool();
  int size() const {
    return size_;
  }
  void resize(int n);

  // Runs fn(0) .. fn(n_tasks - 1), task i on thread i (task 0 on the caller); returns
  // when all are done. n_tasks is clamped to size(). fn must not throw.
  void run(int n_tasks, const std::function<void(int)>& fn);

 private:
  explicit ThreadPool(int n);
  void start(int n);
  void stop();
  void worker(int index, uint64_t seen);

  std::mutex run_mutex_;  // one run (or resize) at a time: MLX may evaluate on several streams
  std::vector<std::thread> workers_;
  int size_{1};
  const std::function<void(int)>* job_{nullptr};
  int n_tasks_{0};
  bool stopping_{false};
  // Workers sleep on generation_ (futex-backed atomic wait) and the caller on pending_:
  // no mutex on the hot path, and a bump of generation_ wakes everyone.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
};

int default_thread_count();

} // namespace specmlx
