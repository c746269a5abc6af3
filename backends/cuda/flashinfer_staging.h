// PinnedStagingRing: page-locked host slots for plan metadata on its way to the device.
//
// A plan writes its metadata into a pinned host slot and enqueues one cudaMemcpyAsync from it on
// the compute stream (as FlashInfer's own plan does). The copy runs later, in stream order, so
// the slot must not be rewritten until the copy has run: the next batch may be planned while the
// previous one is still queued. The ring holds `slots` slots used round-robin; commit() records
// an event after the copy from a slot was enqueued, and acquire() hands a slot out again only
// once that event has completed, waiting for it (bounded by a timeout) when every slot is still
// in flight.
//
// The CUDA calls go through PinnedMemory (allocate pinned memory, create/record/query/wait an
// event), so unit tests drive the ring with an in-process fake; make_cuda_pinned_memory()
// (flashinfer_attention.h, CUDA builds) is the real one over cudaHostAlloc / cudaEvent.
//
// Thread-safety: not thread-safe; one host thread drives a ring (the thread that drives the
// stream). Ownership: the ring owns its PinnedMemory, its slots and their events.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

// The host-memory and event primitives the ring needs. `stream` is a native stream handle
// (cudaStream_t for the CUDA implementation); events are opaque handles. Implementations are
// used from one thread at a time.
class PinnedMemory {
public:
    virtual ~PinnedMemory() = default;
    // `bytes` (>= 1) of page-locked host memory; kResourceExhausted / kUnavailable on failure.
    [[nodiscard]] virtual StatusOr<void*> allocate_pinned(size_t bytes) = 0;
    virtual void free_pinned(void* ptr) noexcept = 0;
    [[nodiscard]] virtual StatusOr<void*> create_event() = 0;
    virtual void destroy_event(void* event) noexcept = 0;
    // Records `event` at the current end of `stream`.
    [[nodiscard]] virtual Status record_event(void* event, void* stream) = 0;
    // True when all work before the event's last record has completed (true if never recorded).
    [[nodiscard]] virtual StatusOr<bool> query_event(void* event) = 0;
    // Blocks until query_event() would be true; kDeadlineExceeded after `timeout`.
    [[nodiscard]] virtual Status wait_event(void* event, std::chrono::milliseconds timeout) = 0;
};

class PinnedStagingRing {
public:
    struct Slot {
        int index = -1;
        std::span<std::byte> data;  // slot_bytes() bytes of pinned memory
    };

    // `slots` (>= 1) slots of `slot_bytes` (>= 1) bytes each, allocated now.
    [[nodiscard]] static StatusOr<std::unique_ptr<PinnedStagingRing>> create(
        std::unique_ptr<PinnedMemory> memory, int slots, size_t slot_bytes);
    // Waits (bounded by kDefaultWaitTimeout per slot) for the copies still in flight, then frees
    // the slots: freeing pinned memory a queued copy still reads would corrupt it.
    ~PinnedStagingRing();
    PinnedStagingRing(const PinnedStagingRing&) = delete;
    PinnedStagingRing& operator=(const PinnedStagingRing&) = delete;

    // The next slot in round-robin order, free to write. If its previous copy is still in flight,
    // waits for that copy's event up to `timeout`: kDeadlineExceeded (saying that every slot is
    // in flight) when it has not completed by then; the slot stays in flight. kFailedPrecondition
    // when the next slot was acquired and neither committed nor abandoned, or when every slot is
    // unusable (a record failed).
    [[nodiscard]] StatusOr<Slot> acquire(std::chrono::milliseconds timeout);
    // Marks slot `index` (acquired) in flight: records its event on `stream`, after the copy from
    // it was enqueued there. kInvalidArgument for a slot that is not acquired. If the record
    // fails, the slot is never handed out again (its copy's completion cannot be known).
    [[nodiscard]] Status commit(int index, void* stream);
    // Returns an acquired slot unused (nothing was enqueued from it).
    void abandon(int index);

    [[nodiscard]] int slots() const { return static_cast<int>(slots_.size()); }
    [[nodiscard]] size_t slot_bytes() const { return slot_bytes_; }
    // Slots committed whose completion has not been observed yet (observed by acquire only).
    [[nodiscard]] int in_flight() const;

private:
    enum class State { kFree, kAcquired, kInFlight, kBroken };
    struct Entry {
        void* data = nullptr;
        void* event = nullptr;
        State state = State::kFree;
    };

    PinnedStagingRing(std::unique_ptr<PinnedMemory> memory, size_t slot_bytes);

    std::unique_ptr<PinnedMemory> memory_;
    size_t slot_bytes_ = 0;
    std::vector<Entry> slots_;
    int next_ = 0;
};

}  // namespace pdsim::attn::cuda
