#include "common/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "common/thread_info.h"

namespace pdsim {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
    if (num_threads <= 0)
        num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int i = 1; i < num_threads; ++i)
        workers_.emplace_back([this, i] {
            set_thread_name("pdsim-pool");
            worker_loop(i);
        });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
    static ThreadPool pool([] {
        if (const char* env = std::getenv("PDSIM_NUM_THREADS")) return std::atoi(env);
        return 0;
    }());
    return pool;
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t, int)>& fn,
                              size_t grain) {
    if (n == 0) return;
    grain = std::max<size_t>(grain, 1);
    const size_t threads = static_cast<size_t>(size());
    if (workers_.empty() || n <= grain) {
        fn(0, n, 0);
        return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);
    // ~4 chunks per thread balances uneven work (causal attention) without much overhead.
    size_t chunk = std::max(grain, (n + threads * 4 - 1) / (threads * 4));
    {
        std::lock_guard<std::mutex> lock(mu_);
        job_ = &fn;
        n_ = n;
        chunk_ = chunk;
        next_.store(0, std::memory_order_relaxed);
        pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
        // Release: workers that observe the new generation see job_, n_, chunk_.
        generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (;;) {
        size_t b = next_.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= n) break;
        fn(b, std::min(n, b + chunk), 0);
    }
    // Acquire pairs with the workers' release decrement: their writes are visible after this.
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
}

void ThreadPool::worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen = generation_.load(std::memory_order_acquire);
        for (int spin = 0; gen == seen && spin < 20000; ++spin) {
            cpu_relax();
            gen = generation_.load(std::memory_order_acquire);
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            gen = generation_.load(std::memory_order_acquire);
        }
        seen = gen;
        const std::function<void(size_t, size_t, int)>* job;
        size_t n, chunk;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) return;
            job = job_;
            n = n_;
            chunk = chunk_;
        }
        for (;;) {
            size_t b = next_.fetch_add(chunk, std::memory_order_relaxed);
            if (b >= n) break;
            (*job)(b, std::min(n, b + chunk), index);
        }
        pending_.fetch_sub(1, std::memory_order_release);
    }
}

}  // namespace pdsim
