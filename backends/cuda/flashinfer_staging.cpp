// PinnedStagingRing (see flashinfer_staging.h). Plain C++: the CUDA calls are behind PinnedMemory.
#include "backends/cuda/flashinfer_staging.h"

#include <fmt/format.h>

namespace pdsim::attn::cuda {

PinnedStagingRing::PinnedStagingRing(std::unique_ptr<PinnedMemory> memory, size_t slot_bytes)
    : memory_(std::move(memory)), slot_bytes_(slot_bytes) {}

StatusOr<std::unique_ptr<PinnedStagingRing>> PinnedStagingRing::create(
    std::unique_ptr<PinnedMemory> memory, int slots, size_t slot_bytes) {
    if (memory == nullptr) return Status(StatusCode::kInvalidArgument, "memory: null");
    if (slots < 1) {
        return Status(StatusCode::kInvalidArgument, fmt::format("slots: {} must be >= 1", slots));
    }
    if (slot_bytes < 1) return Status(StatusCode::kInvalidArgument, "slot_bytes: must be >= 1");
    std::unique_ptr<PinnedStagingRing> ring(new PinnedStagingRing(std::move(memory), slot_bytes));
    ring->slots_.reserve(static_cast<size_t>(slots));
    for (int i = 0; i < slots; ++i) {
        Entry e;
        auto data = ring->memory_->allocate_pinned(slot_bytes);
        if (!data.ok()) return data.status().with_context(fmt::format("staging slot {}", i));
        e.data = *data;
        auto event = ring->memory_->create_event();
        if (!event.ok()) {
            ring->memory_->free_pinned(e.data);
            return event.status().with_context(fmt::format("staging slot {} event", i));
        }
        e.event = *event;
        ring->slots_.push_back(e);
    }
    return ring;
}

PinnedStagingRing::~PinnedStagingRing() {
    for (Entry& e : slots_) {
        if (e.state == State::kInFlight) {
            // Best effort: a copy that never completes leaves nothing better to do than free.
            memory_->wait_event(e.event, runtime::kDefaultWaitTimeout).ignore_error();
        }
        memory_->destroy_event(e.event);
        memory_->free_pinned(e.data);
    }
}

StatusOr<PinnedStagingRing::Slot> PinnedStagingRing::acquire(std::chrono::milliseconds timeout) {
    const int n = slots();
    for (int step = 0; step < n; ++step) {
        const int index = (next_ + step) % n;
        Entry& e = slots_[static_cast<size_t>(index)];
        if (e.state == State::kBroken) continue;
        if (e.state == State::kAcquired) {
            return Status(StatusCode::kFailedPrecondition,
                          fmt::format("staging slot {} is still acquired: commit or abandon it "
                                      "before acquiring the next",
                                      index));
        }
        if (e.state == State::kInFlight) {
            PDSIM_ASSIGN_OR_RETURN(bool done, memory_->query_event(e.event));
            if (!done) {
                Status waited = memory_->wait_event(e.event, timeout);
                if (waited.code() == StatusCode::kDeadlineExceeded) {
                    return Status(StatusCode::kDeadlineExceeded,
                                  fmt::format("all {} pinned staging slots are in flight: the "
                                              "oldest metadata copy (slot {}) has not completed "
                                              "after {} ms (is the stream stalled?)",
                                              n, index, timeout.count()));
                }
                PDSIM_RETURN_IF_ERROR(waited);
            }
        }
        e.state = State::kAcquired;
        next_ = (index + 1) % n;
        return Slot{index, std::span<std::byte>(static_cast<std::byte*>(e.data), slot_bytes_)};
    }
    return Status(StatusCode::kFailedPrecondition,
                  "no usable staging slot: recording the event of every slot failed");
}

Status PinnedStagingRing::commit(int index, void* stream) {
    if (index < 0 || index >= slots() ||
        slots_[static_cast<size_t>(index)].state != State::kAcquired) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("commit: staging slot {} is not acquired", index));
    }
    Entry& e = slots_[static_cast<size_t>(index)];
    Status recorded = memory_->record_event(e.event, stream);
    if (!recorded.ok()) {
        e.state = State::kBroken;
        return recorded.with_context(fmt::format("staging slot {}: recording its event", index));
    }
    e.state = State::kInFlight;
    return ok_status();
}

void PinnedStagingRing::abandon(int index) {
    if (index < 0 || index >= slots()) return;
    Entry& e = slots_[static_cast<size_t>(index)];
    if (e.state == State::kAcquired) e.state = State::kFree;
}

int PinnedStagingRing::in_flight() const {
    int n = 0;
    for (const Entry& e : slots_) n += e.state == State::kInFlight ? 1 : 0;
    return n;
}

}  // namespace pdsim::attn::cuda
