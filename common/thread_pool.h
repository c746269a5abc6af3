// ThreadPool: a fixed set of worker threads for data-parallel kernels.
//
// parallel_for(n, fn) runs fn(begin, end, worker) over a partition of [0, n) into chunks and
// returns when every chunk is done; the calling thread takes part as worker 0. Workers spin
// briefly before sleeping, so back-to-back kernels (one per layer) do not pay a futex wake-up each.
// Thread-safety: parallel_for may be called from one thread at a time per pool (a kernel stream
// owns its pool); concurrent callers are serialized by an internal mutex.
// fn must not throw.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pdsim {

class ThreadPool {
public:
    // num_threads <= 0: std::thread::hardware_concurrency(). Includes the caller.
    explicit ThreadPool(int num_threads = 0);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    [[nodiscard]] int size() const { return static_cast<int>(workers_.size()) + 1; }

    // Splits [0, n) into chunks of at least `grain` items; fn(begin, end, worker_index).
    void parallel_for(size_t n, const std::function<void(size_t, size_t, int)>& fn,
                      size_t grain = 1);

    // A process-wide pool sized to the machine (PDSIM_NUM_THREADS overrides).
    static ThreadPool& global();

private:
    void worker_loop(int index);

    std::vector<std::thread> workers_;
    std::mutex call_mu_;  // serializes parallel_for callers

    std::mutex mu_;
    std::condition_variable cv_;
    const std::function<void(size_t, size_t, int)>* job_ = nullptr;
    size_t n_ = 0;
    size_t chunk_ = 1;
    std::atomic<size_t> next_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    bool stop_ = false;
};

}  // namespace pdsim
