// StepCounter: proves that a layer's KV is fully written — to a host thread (query, wait) and to
// another stream (gate) — without the host in the device's path.
//
// Mirrors tokenspeed's StepCounter (lightseekorg/tokenspeed, python/tokenspeed/runtime/pd/utils.py;
// docs/design.md "StepCounter"):
//  - Two counters, cache and aux (auxiliary data, e.g. the first sampled token), each a device-side
//    value `d` and a host-visible mirror. record_cache()/record_aux() are stream-ordered: enqueued
//    on the compute stream, each runs after everything enqueued before it, increments `d` and
//    publishes it to the mirror with release semantics. So whoever sees step s also sees every KV
//    write enqueued before the record that published s.
//  - current_step() / advance_step(n) are the host-side reservation counter: the prefill scheduler
//    reserves num_layers steps per extend forward (begin = current_step(); advance_step(L)) and
//    layer l of that forward is ready when is_step_ready(query_ready_cache_step(), begin + l).
//
// Wrapped and raw steps (backends/pd/step_gate.h). Every step at this API is a residue modulo
// kCountMax = 2^62 and is_step_ready(ready, target) is strict and wrap-safe ("ready has moved past
// target", by less than 2^61). Underneath, `d` and its mirror hold a raw 64-bit value that grows
// by one per record and never wraps; query_* wrap it, wait_*/gate* turn the wrapped target into
// the raw value to wait for (raw_wait_target), so waits are exact across the 2^62 wrap.
//
// Two implementations, chosen by the compute stream's device kind from a registry (like the
// device runtimes; backends/builtin.cpp registers the optional ones, so this header and
// backends/pd/ stay free of CUDA headers):
//  - CPU streams (always built in): `d` is touched only by stream tasks; the mirror is a
//    std::atomic; waiters block on a condition variable signalled by every record.
//  - CUDA streams (backends/cuda/device_step_counter.h, when built with CUDA): a record is a
//    one-thread kernel that increments `d` in device memory and stores it to pinned, mapped host
//    memory with a system-scope release; host waiters poll the mirror (spin ~200 us, then 20 us
//    sleeps). The kernel reads and increments, so records captured into a CUDA graph count again
//    on every replay. No host round trip per record.
//  A stream of a kind with no implementation registered gives kUnavailable (never a fallback).
//
// Construction. create() returns the error; the constructor cannot fail loudly, so a counter whose
// implementation could not be made (a CUDA stream without the CUDA implementation, a CUDA error)
// holds that error in status() and returns it from every record_*, wait_* and gate*; its queries
// show the initial step. On CPU streams construction cannot fail. Both seed the raw counters, the
// mirrors and the reservation counters with wrap(initial) (tests seed near the wrap). On a CUDA
// stream the seed lands on the device before construction returns (a synchronous copy that does
// not involve the compute stream, which may be busy).
//
// The gate. gate(other, step) makes work enqueued on `other` after the call not start until
// is_step_ready(ready, step) would hold, i.e. until the record that moves the counter past `step`
// has completed, without the host. `other` must be on the counter's device (kind and index). Each
// call picks one mechanism (step_gate.h decide_gate; the path taken is returned):
//  - kReady: the step is ready already; nothing is enqueued.
//  - kEvent (CUDA): the record is enqueued (eagerly) and among the latest kEventRingCapacity (256)
//    eager records: cudaStreamWaitEvent on the event recorded right after that record kernel.
//  - kValueWait: otherwise (not enqueued yet, evicted from the ring, or any record of this counter
//    was ever captured into a graph: replays then run records the host does not see, so it no
//    longer knows which event follows which raw value; this is permanent for the counter). On
//    CUDA: cuStreamWaitValue64(GEQ) on the raw device counter, through the driver entry point;
//    kUnavailable when the driver or device lacks 64-bit stream memory operations. On CPU: a task
//    on `other` that waits on the mirror; after `host_timeout` (counted from when `other` reaches
//    it; default kDefaultWaitTimeout, a CpuStream's default wait timeout: the Stream interface does
//    not expose a stream's own) it fails `other` (sticky) with kDeadlineExceeded naming the
//    stream, the target and the last ready step.
//  - kStreamOrder: `other` is the counter's own stream and the record is enqueued on it already.
//  Refused: `other` is the counter's own stream and the record is not enqueued yet (the wait could
//  never end): kFailedPrecondition. `other` capturing a graph: kFailedPrecondition (the raw target
//  computed now would be baked into every replay). Another device: kInvalidArgument.
//  A device-side wait has no timeout: a gate on a record that never comes stalls `other` until
//  the host gives up on it (Stream::synchronize's timeout). cuStreamWaitValue64 orders work
//  invisibly to the CUDA scheduler: if `other` and the compute stream share a hardware queue
//  (more streams than CUDA_DEVICE_MAX_CONNECTIONS, default 8) and the record is enqueued behind
//  the wait in it, the device deadlocks. So the event path, which CUDA sees, is taken whenever
//  the record is already enqueued; gate ahead of the record only with few streams.
//
// Blocking: record_*, gate* and the queries never block on the device (record_* and gate* take a
// short host mutex). wait_until_* block up to their timeout. The destructor waits (bounded by the
// stream's synchronize timeout) for queued records, which reference the counter's memory; if they
// do not finish in time it leaks that memory rather than free it under them. Streams gated on the
// counter must have passed their gates (or be drained) before it is destroyed.
//
// Thread-safety: record_* enqueue on the stream and are called from the thread(s) that drive it;
// record_* and gate* are serialized by one mutex, so a gate sees a consistent view of which records
// are enqueued. query_*, wait_until_*, records_published and status are safe from any thread.
// current_step/advance_step are intended for the one scheduler thread but are atomic.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "backends/pd/step_gate.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::pd {

enum class CounterId : uint8_t { kCache = 0, kAux = 1 };
inline constexpr size_t kNumCounters = 2;

// "cache" or "aux" (used in messages).
[[nodiscard]] std::string_view counter_name(CounterId id);

// The device half of a StepCounter: the raw counters, their host mirrors and any per-record
// events. The StepCounter owns the host bookkeeping, serializes record() and gate_on_*() under
// its mutex, and calls gate_on_*() only with what decide_gate chose. Implementations are made by
// the factory registered for their stream's device kind and live as long as their StepCounter.
class StepCounterImpl {
public:
    virtual ~StepCounterImpl() = default;

    // Enqueues, on the counter's stream, raw[id] += 1 and its release-store to the mirror.
    // `eager_raw` is the raw value this record will publish when the host knows it (an eager
    // record with exact bookkeeping); an implementation with an event ring then records that
    // value's slot event right after the record. nullopt while capturing and after a capture.
    [[nodiscard]] virtual Status record(CounterId id, std::optional<uint64_t> eager_raw) = 0;
    // The published raw value (acquire load of the mirror). Any thread.
    [[nodiscard]] virtual uint64_t ready_raw(CounterId id) const = 0;
    // Blocks until raw_reached(ready_raw(id), target_raw) or until `deadline`; returns whether it
    // was reached. Any thread.
    [[nodiscard]] virtual bool wait_raw(CounterId id, uint64_t target_raw,
                                        std::chrono::steady_clock::time_point deadline) const = 0;
    // How many of the latest eager records per counter keep an event (0: no event path).
    [[nodiscard]] virtual size_t event_ring_capacity() const = 0;
    // GatePath::kEvent: `other` waits for the event recorded after the eager record `raw`.
    [[nodiscard]] virtual Status gate_on_event(runtime::Stream& other, CounterId id,
                                               uint64_t raw) = 0;
    // GatePath::kValueWait: `other` waits until raw[id] reaches `target_raw`. A host-side wait
    // gives up after `host_timeout` (failing `other`); a device-side one never does.
    [[nodiscard]] virtual Status gate_on_value(runtime::Stream& other, CounterId id,
                                               uint64_t target_raw,
                                               std::chrono::nanoseconds host_timeout) = 0;
};

// Makes the implementation for `stream`, seeding both raw counters and mirrors with
// `initial_raw`. Errors: kInvalidArgument (wrong kind of stream), kUnavailable (device errors).
using StepCounterImplFactory = std::function<StatusOr<std::unique_ptr<StepCounterImpl>>(
    runtime::Stream& stream, uint64_t initial_raw)>;

// The CPU implementation's factory (it needs only Stream::enqueue), e.g. for a fake device whose
// streams run on host threads in tests (register it for that device kind).
[[nodiscard]] StatusOr<std::unique_ptr<StepCounterImpl>> make_cpu_step_counter_impl(
    runtime::Stream& stream, uint64_t initial_raw);

// Registers the implementation for streams of `kind` and returns the one it replaces (empty when
// none). An empty factory unregisters (StepCounters on such streams then get kUnavailable). The
// built-in ones (CPU, and CUDA when compiled in) are installed before the first registration or
// lookup; tests replace and restore them. Thread-safe.
StepCounterImplFactory register_step_counter_impl(runtime::DeviceKind kind,
                                                  StepCounterImplFactory factory);

class StepCounter {
public:
    static constexpr int64_t kCountMax = kStepCountMax;

    static constexpr bool is_step_ready(int64_t current_step, int64_t target_step) {
        return pd::is_step_ready(current_step, target_step);
    }
    static constexpr int64_t wrap(int64_t step) { return wrap_step(step); }

    // A counter on `stream` (which must outlive it), or the reason it cannot be made.
    [[nodiscard]] static StatusOr<std::unique_ptr<StepCounter>> create(runtime::Stream& stream,
                                                                       int64_t initial = 0);
    // `stream` is the compute stream the KV writes are enqueued on; it must outlive the counter.
    // `initial` seeds both counters and the reservation counter. Never fails on a CPU stream; on
    // another kind check status() (or use create()).
    explicit StepCounter(runtime::Stream& stream, int64_t initial = 0);
    ~StepCounter();
    StepCounter(const StepCounter&) = delete;
    StepCounter& operator=(const StepCounter&) = delete;

    // OK, or why the implementation could not be made (then returned by every fallible call).
    [[nodiscard]] const Status& status() const { return status_; }
    [[nodiscard]] runtime::Stream& stream() const { return stream_; }

    // Stream-ordered increment of the counter, published to the host mirror on completion.
    [[nodiscard]] Status record_cache() { return record(CounterId::kCache); }
    [[nodiscard]] Status record_aux() { return record(CounterId::kAux); }

    // The last published step (wrapped), acquire: what it proves is visible to the caller.
    [[nodiscard]] int64_t query_ready_cache_step() const { return query_ready(CounterId::kCache); }
    [[nodiscard]] int64_t query_ready_aux_step() const { return query_ready(CounterId::kAux); }

    // Host reservation counters.
    [[nodiscard]] int64_t current_step() const {
        return cache_step_.load(std::memory_order_relaxed);
    }
    [[nodiscard]] int64_t current_aux_step() const {
        return aux_step_.load(std::memory_order_relaxed);
    }
    // Reserves `delta_cache` cache steps and `delta_aux` aux steps; returns the first reserved
    // cache step (the forward's `begin`).
    int64_t advance_step(int64_t delta_cache, int64_t delta_aux = 0);

    // Blocks until is_step_ready(query_ready_cache_step(), target); kDeadlineExceeded after
    // `timeout`, with a message naming the target and the last ready step. CPU: sleeps on a
    // condition variable signalled by every record; CUDA: polls the mirror.
    [[nodiscard]] Status wait_until_ready(int64_t target, std::chrono::nanoseconds timeout) const {
        return wait_until(CounterId::kCache, target, timeout);
    }
    [[nodiscard]] Status wait_until_aux_ready(int64_t target,
                                              std::chrono::nanoseconds timeout) const {
        return wait_until(CounterId::kAux, target, timeout);
    }

    // True when the record that makes cache step `step` ready has been enqueued on the compute
    // stream (it has not necessarily run): the step is ready already, or the host's bookkeeping
    // is exact (no record was ever captured into a graph or failed part-way) and an eager record
    // that publishes the step's raw target was enqueued. A consumer may then gate a stream on
    // the step (gate() takes the kEvent or kStreamOrder path, never a wait ahead of the record)
    // and enqueue the work that reads the layer before the layer is computed. False also for a
    // counter whose implementation could not be made. Takes the record/gate mutex; never blocks
    // on the device.
    [[nodiscard]] bool is_step_enqueued(int64_t step) {
        return is_enqueued(CounterId::kCache, step);
    }
    // Blocks until is_step_enqueued(step) or `timeout` (false then, no error: the caller decides
    // what a late record means). Woken by every eager record; once the bookkeeping is inexact
    // (after a capture) only the ready mirror can tell, and it looks at it every 1 ms.
    [[nodiscard]] bool wait_until_enqueued(int64_t step, std::chrono::nanoseconds timeout);

    // Work enqueued on `other` after this call does not start before cache step `step` is ready
    // (see the header comment for the mechanisms, the errors and `host_timeout`, which bounds
    // only a host-side wait on a CPU stream). Returns the mechanism used.
    [[nodiscard]] StatusOr<GatePath> gate(
        runtime::Stream& other, int64_t step,
        std::chrono::nanoseconds host_timeout = runtime::kDefaultWaitTimeout) {
        return gate_on(CounterId::kCache, other, step, host_timeout);
    }
    [[nodiscard]] StatusOr<GatePath> gate_aux(
        runtime::Stream& other, int64_t step,
        std::chrono::nanoseconds host_timeout = runtime::kDefaultWaitTimeout) {
        return gate_on(CounterId::kAux, other, step, host_timeout);
    }

    // Records that have completed so far (both counters, graph replays included): the raw
    // mirrors' distance from the seed, so it counts every publication exactly.
    [[nodiscard]] uint64_t records_published() const;

private:
    struct Bookkeeping {
        uint64_t enqueued_raw = 0;  // raw value the last eager record publishes (if exact)
        bool exact = true;          // see GateInputs::exact
    };

    [[nodiscard]] Status record(CounterId id);
    [[nodiscard]] int64_t query_ready(CounterId id) const;
    [[nodiscard]] bool is_enqueued(CounterId id, int64_t step);
    [[nodiscard]] Status wait_until(CounterId id, int64_t target,
                                    std::chrono::nanoseconds timeout) const;
    [[nodiscard]] StatusOr<GatePath> gate_on(CounterId id, runtime::Stream& other, int64_t step,
                                             std::chrono::nanoseconds host_timeout);

    runtime::Stream& stream_;
    const uint64_t initial_raw_;
    Status status_;
    std::unique_ptr<StepCounterImpl> impl_;          // null iff !status_.ok()
    std::mutex mu_;                                  // serializes record and gate
    std::condition_variable enqueued_cv_;            // under mu_: every eager record
    std::array<Bookkeeping, kNumCounters> books_{};  // under mu_
    std::atomic<int64_t> cache_step_;
    std::atomic<int64_t> aux_step_;
};

}  // namespace pdsim::pd
