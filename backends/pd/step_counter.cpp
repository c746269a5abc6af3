#include "backends/pd/step_counter.h"

#include <fmt/chrono.h>

namespace pdsim::pd {

StepCounter::StepCounter(runtime::Stream& stream, int64_t initial)
    : stream_(stream),
      d_ready_cache_(wrap(initial)),
      d_ready_aux_(wrap(initial)),
      h_ready_cache_(wrap(initial)),
      h_ready_aux_(wrap(initial)),
      cache_step_(wrap(initial)),
      aux_step_(wrap(initial)) {}

StepCounter::~StepCounter() { stream_.synchronize().ignore_error(); }

Status StepCounter::record(int64_t* device_counter, std::atomic<int64_t>* mirror) {
    return stream_.enqueue([this, device_counter, mirror] {
        *device_counter = (*device_counter + 1) % kCountMax;
        // Release: a host thread that acquires this value also sees every KV write the stream
        // completed before this task (they happened-before it on the stream's worker thread).
        mirror->store(*device_counter, std::memory_order_release);
        published_.fetch_add(1, std::memory_order_release);
        // Under the lock: a waiter checks its predicate under it, so it cannot miss this wake-up.
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
        return Status();
    });
}

Status StepCounter::record_cache() { return record(&d_ready_cache_, &h_ready_cache_); }
Status StepCounter::record_aux() { return record(&d_ready_aux_, &h_ready_aux_); }

int64_t StepCounter::advance_step(int64_t delta_cache, int64_t delta_aux) {
    int64_t begin = cache_step_.load(std::memory_order_relaxed);
    int64_t next;
    do {
        next = wrap(begin + delta_cache);
    } while (!cache_step_.compare_exchange_weak(begin, next, std::memory_order_relaxed));
    int64_t aux = aux_step_.load(std::memory_order_relaxed);
    while (!aux_step_.compare_exchange_weak(aux, wrap(aux + delta_aux), std::memory_order_relaxed)) {
    }
    return begin;
}

Status StepCounter::wait_until(const std::atomic<int64_t>& mirror, int64_t target,
                               std::chrono::nanoseconds timeout, const char* what) const {
    target = wrap(target);
    if (is_step_ready(mirror.load(std::memory_order_acquire), target)) return {};
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, timeout, [&] {
        return is_step_ready(mirror.load(std::memory_order_acquire), target);
    });
    if (!ok) {
        return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                           "{} step {} not ready after {}; last ready step {}", what, target,
                           std::chrono::duration_cast<std::chrono::milliseconds>(timeout),
                           mirror.load(std::memory_order_acquire));
    }
    return {};
}

Status StepCounter::wait_until_ready(int64_t target, std::chrono::nanoseconds timeout) const {
    return wait_until(h_ready_cache_, target, timeout, "cache");
}

Status StepCounter::wait_until_aux_ready(int64_t target, std::chrono::nanoseconds timeout) const {
    return wait_until(h_ready_aux_, target, timeout, "aux");
}

}  // namespace pdsim::pd
