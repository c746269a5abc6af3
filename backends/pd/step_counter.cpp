#include "backends/pd/step_counter.h"

#include <fmt/chrono.h>

#include <condition_variable>
#include <map>
#include <utility>
#include <vector>

#include "common/logging.h"

namespace pdsim::pd {

// The optional implementations compiled in (backends/builtin.cpp knows which).
std::vector<std::pair<runtime::DeviceKind, StepCounterImplFactory>> builtin_step_counter_impls();

namespace {

using Clock = std::chrono::steady_clock;

size_t index_of(CounterId id) {
    return static_cast<size_t>(id);
}

// now + timeout, saturating (a timeout of nanoseconds::max() waits "forever", without overflow).
Clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
    const Clock::time_point now = Clock::now();
    if (timeout <= std::chrono::nanoseconds::zero()) return now;
    if (timeout >= Clock::time_point::max() - now) return Clock::time_point::max();
    return now + std::chrono::duration_cast<Clock::duration>(timeout);
}

// The one "not ready" wording of every wait (host waits and CPU gates).
std::string not_ready_text(CounterId id, int64_t target, std::chrono::nanoseconds timeout,
                           int64_t last_ready) {
    return fmt::format("{} step {} not ready after {}; last ready step {}", counter_name(id),
                       target, std::chrono::duration_cast<std::chrono::milliseconds>(timeout),
                       last_ready);
}

// ---- The CPU implementation ----

// Shared with queued stream tasks (records, gates on other streams), so neither outliving the
// counter (a graph replayed later, a gate whose stream is drained after the counter is gone) can
// touch freed memory.
struct CpuCounterState {
    // The "device" counters: touched only by record tasks, which run one at a time in stream
    // order on the counter's stream.
    std::array<uint64_t, kNumCounters> device{};
    std::array<std::atomic<uint64_t>, kNumCounters> mirror{};
    std::mutex mu;
    std::condition_variable cv;

    bool wait(size_t i, uint64_t target_raw, Clock::time_point deadline) {
        auto reached = [&] {
            return raw_reached(mirror[i].load(std::memory_order_acquire), target_raw);
        };
        if (reached()) return true;
        std::unique_lock<std::mutex> lock(mu);
        return cv.wait_until(lock, deadline, reached);
    }
};

class CpuStepCounterImpl final : public StepCounterImpl {
public:
    CpuStepCounterImpl(runtime::Stream& stream, uint64_t initial_raw) : stream_(stream) {
        for (size_t i = 0; i < kNumCounters; ++i) {
            state_->device[i] = initial_raw;
            state_->mirror[i].store(initial_raw, std::memory_order_release);
        }
    }

    [[nodiscard]] Status record(CounterId id, std::optional<uint64_t> /*eager_raw*/) override {
        return stream_.enqueue([st = state_, i = index_of(id)] {
            const uint64_t published = ++st->device[i];
            // Release: a thread that acquires this value also sees every write the stream
            // completed before this task (they happened-before it on the stream's worker).
            st->mirror[i].store(published, std::memory_order_release);
            // Under the lock: a waiter checks its predicate under it, so it cannot miss this.
            std::lock_guard<std::mutex> lock(st->mu);
            st->cv.notify_all();
            return Status();
        });
    }

    [[nodiscard]] uint64_t ready_raw(CounterId id) const override {
        return state_->mirror[index_of(id)].load(std::memory_order_acquire);
    }

    [[nodiscard]] bool wait_raw(CounterId id, uint64_t target_raw,
                                Clock::time_point deadline) const override {
        return state_->wait(index_of(id), target_raw, deadline);
    }

    // No events: on a CPU stream an already enqueued record is waited for by value as well.
    [[nodiscard]] size_t event_ring_capacity() const override { return 0; }

    [[nodiscard]] Status gate_on_event(runtime::Stream& other, CounterId id,
                                       uint64_t raw) override {
        return PDSIM_ERROR(StatusCode::kInternal,
                           "CPU StepCounter has no event ring (gate of {} on {} for raw {})",
                           counter_name(id), other.name(), raw);
    }

    [[nodiscard]] Status gate_on_value(runtime::Stream& other, CounterId id, uint64_t target_raw,
                                       std::chrono::nanoseconds host_timeout) override {
        return other.enqueue([st = state_, id, target_raw, host_timeout, name = other.name()] {
            const size_t i = index_of(id);
            // The timeout runs from when `other` reaches the gate, as a Stream::wait's does.
            if (st->wait(i, target_raw, deadline_after(host_timeout))) return Status();
            return PDSIM_ERROR(
                StatusCode::kDeadlineExceeded, "gate on stream {}: {}", name,
                not_ready_text(id, step_of_raw_target(target_raw), host_timeout,
                               wrap_raw(st->mirror[i].load(std::memory_order_acquire))));
        });
    }

private:
    runtime::Stream& stream_;
    std::shared_ptr<CpuCounterState> state_ = std::make_shared<CpuCounterState>();
};

StatusOr<std::unique_ptr<StepCounterImpl>> make_cpu_impl(runtime::Stream& stream,
                                                         uint64_t initial_raw) {
    return std::unique_ptr<StepCounterImpl>(
        std::make_unique<CpuStepCounterImpl>(stream, initial_raw));
}

}  // namespace

StatusOr<std::unique_ptr<StepCounterImpl>> make_cpu_step_counter_impl(runtime::Stream& stream,
                                                                      uint64_t initial_raw) {
    return make_cpu_impl(stream, initial_raw);
}

namespace {

// ---- The registry ----

struct ImplRegistry {
    std::mutex mu;
    std::map<runtime::DeviceKind, StepCounterImplFactory> factories;
};

// Built lazily with the built-in implementations already in, so a test's replacement made before
// the first counter is never overwritten by a later built-in registration.
ImplRegistry& impl_registry() {
    static ImplRegistry* registry = [] {
        auto* r = new ImplRegistry();
        r->factories[runtime::DeviceKind::kCpu] = &make_cpu_impl;
        for (auto& [kind, factory] : builtin_step_counter_impls())
            r->factories[kind] = std::move(factory);
        return r;
    }();
    return *registry;
}

StatusOr<std::unique_ptr<StepCounterImpl>> make_impl(runtime::Stream& stream,
                                                     uint64_t initial_raw) {
    StepCounterImplFactory factory;
    {
        ImplRegistry& r = impl_registry();
        std::lock_guard<std::mutex> lock(r.mu);
        auto it = r.factories.find(stream.device().kind);
        if (it != r.factories.end()) factory = it->second;
    }
    if (!factory) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "no StepCounter implementation for {} streams is built into this pdsim",
                           runtime::device_kind_name(stream.device().kind));
    }
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<StepCounterImpl> impl, factory(stream, initial_raw));
    if (impl == nullptr) {
        return PDSIM_ERROR(StatusCode::kInternal, "the {} StepCounter factory returned null",
                           runtime::device_kind_name(stream.device().kind));
    }
    return impl;
}

}  // namespace

std::string_view counter_name(CounterId id) {
    switch (id) {
        case CounterId::kCache:
            return "cache";
        case CounterId::kAux:
            return "aux";
    }
    return "unknown";
}

StepCounterImplFactory register_step_counter_impl(runtime::DeviceKind kind,
                                                  StepCounterImplFactory factory) {
    ImplRegistry& r = impl_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    StepCounterImplFactory previous;
    if (auto it = r.factories.find(kind); it != r.factories.end()) {
        previous = std::move(it->second);
        r.factories.erase(it);
    }
    if (factory) r.factories[kind] = std::move(factory);
    return previous;
}

// ---- StepCounter ----

StatusOr<std::unique_ptr<StepCounter>> StepCounter::create(runtime::Stream& stream,
                                                           int64_t initial) {
    auto counter = std::make_unique<StepCounter>(stream, initial);
    PDSIM_RETURN_IF_ERROR(counter->status());
    return counter;
}

StepCounter::StepCounter(runtime::Stream& stream, int64_t initial)
    : stream_(stream),
      initial_raw_(static_cast<uint64_t>(wrap_step(initial))),
      cache_step_(wrap_step(initial)),
      aux_step_(wrap_step(initial)) {
    for (Bookkeeping& b : books_) b.enqueued_raw = initial_raw_;
    StatusOr<std::unique_ptr<StepCounterImpl>> impl = make_impl(stream, initial_raw_);
    if (impl.ok()) {
        impl_ = std::move(*impl);
    } else {
        status_ =
            impl.status().with_context(fmt::format("StepCounter on stream {}", stream.name()));
    }
}

StepCounter::~StepCounter() {
    if (impl_ == nullptr) return;
    // Queued records reference the implementation's counters and mirrors.
    Status st = stream_.synchronize();
    if (st.code() == StatusCode::kDeadlineExceeded) {
        PDSIM_LOG_WARN(
            "StepCounter on stream {}: {}; leaking its counters, which queued records "
            "still reference",
            stream_.name(), st.message());
        static_cast<void>(impl_.release());
    }
}

Status StepCounter::record(CounterId id) {
    PDSIM_RETURN_IF_ERROR(status_);
    std::lock_guard<std::mutex> lock(mu_);
    Bookkeeping& b = books_[index_of(id)];
    // A captured record runs once per replay, unseen by the host: from now on the host cannot
    // tell which raw value an eager record publishes (GateInputs::exact).
    if (stream_.is_capturing()) b.exact = false;
    std::optional<uint64_t> eager_raw;
    if (b.exact) eager_raw = b.enqueued_raw + 1;
    Status st = impl_->record(id, eager_raw);
    if (!st.ok()) {
        b.exact = false;  // it may have been enqueued in part
        return st;
    }
    if (b.exact) b.enqueued_raw += 1;
    enqueued_cv_.notify_all();
    return {};
}

int64_t StepCounter::query_ready(CounterId id) const {
    return wrap_raw(impl_ != nullptr ? impl_->ready_raw(id) : initial_raw_);
}

namespace {

// Whether the record that makes `step` ready has been enqueued (or has run), given the counter's
// published raw value and the host's bookkeeping of eager records.
bool enqueued_locked(uint64_t ready_raw, uint64_t enqueued_raw, bool exact, int64_t step) {
    const uint64_t target_raw = raw_wait_target(step, ready_raw);
    if (raw_reached(ready_raw, target_raw)) return true;
    return exact && raw_reached(enqueued_raw, target_raw);
}

}  // namespace

bool StepCounter::is_enqueued(CounterId id, int64_t step) {
    if (impl_ == nullptr) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const Bookkeeping& b = books_[index_of(id)];
    return enqueued_locked(impl_->ready_raw(id), b.enqueued_raw, b.exact, step);
}

bool StepCounter::wait_until_enqueued(int64_t step, std::chrono::nanoseconds timeout) {
    if (impl_ == nullptr) return false;
    const Clock::time_point deadline = deadline_after(timeout);
    std::unique_lock<std::mutex> lock(mu_);
    const Bookkeeping& b = books_[index_of(CounterId::kCache)];
    for (;;) {
        if (enqueued_locked(impl_->ready_raw(CounterId::kCache), b.enqueued_raw, b.exact, step)) {
            return true;
        }
        const Clock::time_point now = Clock::now();
        if (now >= deadline) return false;
        // An inexact counter (after a capture) learns of a step only from the ready mirror,
        // which no notification covers: look again within 1 ms.
        const Clock::time_point wake =
            b.exact ? deadline : std::min(deadline, now + std::chrono::milliseconds(1));
        enqueued_cv_.wait_until(lock, wake);
    }
}

uint64_t StepCounter::records_published() const {
    if (impl_ == nullptr) return 0;
    return (impl_->ready_raw(CounterId::kCache) - initial_raw_) +
           (impl_->ready_raw(CounterId::kAux) - initial_raw_);
}

int64_t StepCounter::advance_step(int64_t delta_cache, int64_t delta_aux) {
    int64_t begin = cache_step_.load(std::memory_order_relaxed);
    int64_t next;
    do {
        next = wrap_step(begin + delta_cache);
    } while (!cache_step_.compare_exchange_weak(begin, next, std::memory_order_relaxed));
    int64_t aux = aux_step_.load(std::memory_order_relaxed);
    while (!aux_step_.compare_exchange_weak(aux, wrap_step(aux + delta_aux),
                                            std::memory_order_relaxed)) {
    }
    return begin;
}

Status StepCounter::wait_until(CounterId id, int64_t target,
                               std::chrono::nanoseconds timeout) const {
    PDSIM_RETURN_IF_ERROR(status_);
    const Clock::time_point deadline = deadline_after(timeout);
    const uint64_t target_raw = raw_wait_target(target, impl_->ready_raw(id));
    if (impl_->wait_raw(id, target_raw, deadline)) return {};
    return PDSIM_ERROR(
        StatusCode::kDeadlineExceeded, "{}",
        not_ready_text(id, wrap_step(target), timeout, wrap_raw(impl_->ready_raw(id))));
}

StatusOr<GatePath> StepCounter::gate_on(CounterId id, runtime::Stream& other, int64_t step,
                                        std::chrono::nanoseconds host_timeout) {
    PDSIM_RETURN_IF_ERROR(status_);
    const runtime::Device mine = stream_.device();
    const runtime::Device theirs = other.device();
    if (theirs != mine) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "gate: stream {} is on {}:{} but the StepCounter's stream {} is on {}:{}", other.name(),
            runtime::device_kind_name(theirs.kind), theirs.index, stream_.name(),
            runtime::device_kind_name(mine.kind), mine.index);
    }
    if (other.is_capturing()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "gate: stream {} is capturing a graph; a gate's raw target is computed "
                           "when it is enqueued and would be baked into every replay",
                           other.name());
    }
    std::lock_guard<std::mutex> lock(mu_);
    const Bookkeeping& b = books_[index_of(id)];
    GateInputs in;
    in.ready_raw = impl_->ready_raw(id);
    in.target_raw = raw_wait_target(step, in.ready_raw);
    in.enqueued_raw = b.enqueued_raw;
    in.ring_capacity = impl_->event_ring_capacity();
    in.exact = b.exact;
    in.same_stream = &other == &stream_;
    const GatePath path = decide_gate(in);
    switch (path) {
        case GatePath::kReady:
        case GatePath::kStreamOrder:
            break;
        case GatePath::kEvent:
            PDSIM_RETURN_IF_ERROR(impl_->gate_on_event(other, id, in.target_raw));
            break;
        case GatePath::kValueWait:
            PDSIM_RETURN_IF_ERROR(impl_->gate_on_value(other, id, in.target_raw, host_timeout));
            break;
        case GatePath::kWouldDeadlock:
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "gate: stream {} is the StepCounter's own stream and the record "
                               "that makes {} step {} ready is not enqueued on it yet: the wait "
                               "could never end",
                               other.name(), counter_name(id), wrap_step(step));
    }
    return path;
}

}  // namespace pdsim::pd
