// KvCommStream (see kv_comm_stream.h).
#include "transfer/engine/kv_comm_stream.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "backends/runtime/device.h"

namespace pdsim::transfer {

StatusOr<std::unique_ptr<KvCommStream>> KvCommStream::create(std::string_view engine,
                                                             const KvLayout& layout,
                                                             const EngineOptions& options) {
    const runtime::Device device = layout.device();
    const std::string where =
        fmt::format("{}:{}", runtime::device_kind_name(device.kind), device.index);
    std::unique_ptr<KvMemoryOps> owned;
    KvMemoryOps* ops = options.kv_memory_ops_for_testing;
    if (ops == nullptr) {
        auto made = make_kv_memory_ops(device);
        if (!made.ok()) {
            return made.status().with_context(fmt::format(
                "the {}'s KV layout is in {} memory: its KV memory ops", engine, where));
        }
        owned = std::move(made).value();
        ops = owned.get();
    }
    if (ops->memory_kind() != device.kind) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "the {}'s KV memory ops ('{}') work on {} memory; its KV layout is in "
                           "{} memory",
                           engine, ops->name(), runtime::device_kind_name(ops->memory_kind()),
                           where);
    }
    const std::string name = fmt::format("{} comm", engine);
    auto make_stream = [&]() -> StatusOr<std::unique_ptr<runtime::Stream>> {
        if (options.comm_stream_factory_for_testing) {
            return options.comm_stream_factory_for_testing(device);
        }
        PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt, runtime::device_runtime(device.kind));
        return rt->create_stream(device.index, name);
    };
    StatusOr<std::unique_ptr<runtime::Stream>> stream = make_stream();
    if (!stream.ok()) {
        return stream.status().with_context(
            fmt::format("the {}'s comm stream on {}", engine, where));
    }
    if (*stream == nullptr || (*stream)->device().kind != device.kind ||
        ((*stream)->device().index != device.index && device.kind != runtime::DeviceKind::kCpu)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "the {}'s comm stream is not a stream of {} (the KV layout's memory)",
                           engine, where);
    }
    return std::unique_ptr<KvCommStream>(
        new KvCommStream(std::move(owned), ops, std::move(stream).value()));
}

KvCommStream::KvCommStream(std::unique_ptr<KvMemoryOps> owned_ops, KvMemoryOps* ops,
                           std::unique_ptr<runtime::Stream> stream)
    : owned_ops_(std::move(owned_ops)), ops_(ops), stream_(std::move(stream)) {}

KvCommStream::~KvCommStream() {
    stream_->synchronize(runtime::kDefaultWaitTimeout).ignore_error();
    stream_.reset();
    MutexLock lock(mu_);
    retired_.clear();
}

std::string KvCommStream::describe() const {
    return fmt::format("comm stream '{}'", stream_->name());
}

Status KvCommStream::wait(Clock::time_point deadline, Clock::duration slice,
                          const std::function<bool()>& stop) const {
    std::unique_ptr<runtime::Event> event = stream_->create_event();
    if (event == nullptr) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "{}: no event could be created", describe());
    }
    PDSIM_RETURN_IF_ERROR(stream_->record(*event).with_context(describe()));
    const auto floor = std::chrono::milliseconds(1);
    while (true) {
        PDSIM_RETURN_IF_ERROR(stream_->error());
        const Clock::time_point now = Clock::now();
        if (now >= deadline) {
            if (event->query()) return stream_->error();
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded, "{} did not finish the work in time",
                               describe());
        }
        if (stop && stop()) {
            return PDSIM_ERROR(StatusCode::kAborted, "{}: wait cancelled", describe());
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::min<Clock::duration>(deadline - now, slice));
        const Status waited = event->synchronize(std::max(left, floor));
        if (waited.ok()) return stream_->error();
        // A device error (sticky) comes back at once, every time: report it, not a timeout.
        if (waited.code() != StatusCode::kDeadlineExceeded) return waited.with_context(describe());
    }
}

void KvCommStream::retire(std::shared_ptr<void> keep, std::function<void()> on_passed) {
    Retired r;
    r.event = stream_->create_event();
    if (r.event != nullptr && !stream_->record(*r.event).ok()) r.event.reset();
    r.keep = std::move(keep);
    r.on_passed = std::move(on_passed);
    MutexLock lock(mu_);
    retired_.push_back(std::move(r));
}

std::vector<KvCommStream::Retired> KvCommStream::take_passed(bool all) {
    // After a failed op nothing behind it runs: everything retired is passed.
    const bool failed = !stream_->error().ok();
    std::vector<Retired> out;
    MutexLock lock(mu_);
    for (auto it = retired_.begin(); it != retired_.end();) {
        if (all || failed || (it->event != nullptr && it->event->query())) {
            out.push_back(std::move(*it));
            it = retired_.erase(it);
        } else {
            ++it;
        }
    }
    return out;
}

void KvCommStream::sweep() {
    {
        MutexLock lock(mu_);
        if (retired_.empty()) return;
    }
    for (Retired& r : take_passed(false)) {
        if (r.on_passed) r.on_passed();
    }
}

void KvCommStream::drain(std::chrono::milliseconds timeout) {
    const bool passed = stream_->synchronize(timeout).code() != StatusCode::kDeadlineExceeded;
    for (Retired& r : take_passed(passed)) {
        if (r.on_passed) r.on_passed();
    }
}

StatusOr<std::vector<uint64_t>> KvCommStream::checksums(const KvLayout& layout,
                                                        const KvChecksumPlan& plan,
                                                        Clock::time_point deadline,
                                                        Clock::duration slice,
                                                        const std::function<bool()>& stop) {
    PDSIM_ASSIGN_OR_RETURN(KvOpsMemory sums, ops_->allocate_sums(plan.sum_count));
    auto held = std::make_shared<KvOpsMemory>(std::move(sums));
    PDSIM_RETURN_IF_ERROR(
        ops_->enqueue_checksums(*stream_, layout, plan.ops, held->as<uint64_t>()));
    Status waited = wait(deadline, slice, stop);
    if (!waited.ok()) {
        retire(held, nullptr);
        return waited;
    }
    const uint64_t* p = held->as<uint64_t>();
    return std::vector<uint64_t>(p, p + plan.sum_count);
}

}  // namespace pdsim::transfer
