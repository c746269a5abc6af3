// StepCounter: proves to a host thread that a layer's KV is fully written.
//
// Mirrors tokenspeed's StepCounter (lightseekorg/tokenspeed, python/tokenspeed/runtime/pd/utils.py;
// docs/design.md "StepCounter"):
//  - a device-side counter `d` and a host-visible mirror. record_cache() is stream-ordered: it is
//    enqueued on the compute stream, runs after everything enqueued before it, does
//    d = (d + 1) mod 2^62 and publishes d to the mirror with release semantics. So the host sees
//    step s only once every KV write enqueued before the s-th record has finished.
//  - query_ready_cache_step() reads the mirror with acquire semantics.
//  - current_step() / advance_step(n) are the host-side reservation counter: the prefill scheduler
//    reserves num_layers steps per extend forward (begin = current_step(); advance_step(L)) and
//    layer l of that forward is ready when is_step_ready(query_ready_cache_step(), begin + l).
//  - is_step_ready(ready, target) is strict and wrap-safe:
//      target != ready && (target + MAX - ready) % MAX > MAX / 2
//    i.e. "ready has moved past target", counted modulo MAX = 2^62.
//  - The aux counter (record_aux / query_ready_aux_step) follows the same rules for auxiliary
//    data (e.g. the first sampled token).
//
// Thread-safety: record_* enqueue on the stream and may be called from the thread that drives the
// stream. query_*, wait_until_* are safe from any thread. current_step/advance_step are intended
// for the one scheduler thread but are atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::pd {

class StepCounter {
public:
    static constexpr int64_t kCountMax = int64_t{1} << 62;

    static constexpr bool is_step_ready(int64_t current_step, int64_t target_step) {
        // (target - current) mod 2^62, computed in uint64: 2^64 is a multiple of 2^62, so the
        // unsigned wrap leaves the residue intact and nothing overflows for any int64 input.
        const uint64_t diff =
            (static_cast<uint64_t>(target_step) - static_cast<uint64_t>(current_step)) &
            static_cast<uint64_t>(kCountMax - 1);
        return target_step != current_step && diff > static_cast<uint64_t>(kCountMax / 2);
    }
    static constexpr int64_t wrap(int64_t step) {
        return ((step % kCountMax) + kCountMax) % kCountMax;
    }

    // `stream` is the compute stream the KV writes are enqueued on; it must outlive the counter.
    // `initial` seeds both counters and the reservation counter (tests use it near the wrap).
    explicit StepCounter(runtime::Stream& stream, int64_t initial = 0);
    // Waits (bounded by the stream's synchronize timeout) for queued records to finish: they
    // reference this object.
    ~StepCounter();
    StepCounter(const StepCounter&) = delete;
    StepCounter& operator=(const StepCounter&) = delete;

    [[nodiscard]] runtime::Stream& stream() const { return stream_; }

    // Stream-ordered increment of the device counter, published to the host mirror on completion.
    [[nodiscard]] Status record_cache();
    [[nodiscard]] Status record_aux();

    [[nodiscard]] int64_t query_ready_cache_step() const {
        return h_ready_cache_.load(std::memory_order_acquire);
    }
    [[nodiscard]] int64_t query_ready_aux_step() const {
        return h_ready_aux_.load(std::memory_order_acquire);
    }

    // Host reservation counters.
    [[nodiscard]] int64_t current_step() const { return cache_step_.load(std::memory_order_relaxed); }
    [[nodiscard]] int64_t current_aux_step() const { return aux_step_.load(std::memory_order_relaxed); }
    // Reserves `delta_cache` cache steps and `delta_aux` aux steps; returns the first reserved
    // cache step (the forward's `begin`).
    int64_t advance_step(int64_t delta_cache, int64_t delta_aux = 0);

    // Blocks until is_step_ready(query_ready_cache_step(), target); kDeadlineExceeded after
    // `timeout` (the message names the target and the last ready step). Does not sleep-poll: it
    // waits on a condition variable signalled by every record.
    [[nodiscard]] Status wait_until_ready(int64_t target, std::chrono::nanoseconds timeout) const;
    [[nodiscard]] Status wait_until_aux_ready(int64_t target, std::chrono::nanoseconds timeout) const;

    // Number of records published so far (both counters), for tests and stats.
    [[nodiscard]] uint64_t records_published() const {
        return published_.load(std::memory_order_acquire);
    }

private:
    [[nodiscard]] Status record(int64_t* device_counter, std::atomic<int64_t>* mirror);
    [[nodiscard]] Status wait_until(const std::atomic<int64_t>& mirror, int64_t target,
                                    std::chrono::nanoseconds timeout, const char* what) const;

    runtime::Stream& stream_;
    // "Device" counters: touched only by stream tasks, which run one at a time in stream order.
    int64_t d_ready_cache_;
    int64_t d_ready_aux_;
    std::atomic<int64_t> h_ready_cache_;
    std::atomic<int64_t> h_ready_aux_;
    std::atomic<int64_t> cache_step_;
    std::atomic<int64_t> aux_step_;
    std::atomic<uint64_t> published_{0};

    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
};

}  // namespace pdsim::pd
