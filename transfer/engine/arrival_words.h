// ArrivalWords: a decode rank's arrival words for the write plane (kv_receiver.h, "Arrival
// words"); private to the KvReceiver, which creates one when its data transport declares write
// signals (transport.h, post_signal).
//
// One 8-byte word per (slot, layer), in memory of the layout's device, registered with the data
// transport as one region (its descriptor travels in the Regions message). A request takes a
// slot at admission; every prefill rank that signals adds the bytes of each (chunk, layer) it
// wrote to word (slot, layer) behind those writes, so the word shows exactly how many of the
// layer's bytes have landed. Words are never reset: a slot remembers each word's value when it
// was handed out (the base), a request's target for layer l is base[l] + the layer's bytes, and
// a wait enqueued for an earlier request of the slot (a lower target) stays satisfied when the
// slot is reused -- the words only grow. A slot whose words may still grow (a source that can
// still signal, one given up as dead) is quarantined: never handed out again.
//
// Known limit: every source of a request adds to the same word. On a GPU, adds of two GPUs over
// PCIe without native P2P atomics (cudaDevP2PAttrNativeAtomicSupported 0) are a read and a write
// each and could lose one (the word then disagrees and the request fails, loudly). A GPU request
// has several sources when its prefill instance is TP > 1: safe where they share the decode
// rank's GPU (gpu-1p1d-tp2-to-tp1: device atomics) or have native P2P atomics (NVLink); TP > 1
// prefill on other GPUs across PCIe would need a word per (slot, layer, source).
//
// Thread-safety: every method may be called from any thread (the slot pool has its own leaf
// lock, never held across a copy). Blocking: create(), take() and read() may copy device memory
// synchronously (a cudaMemcpy for a GPU layout): call them without holding an engine lock;
// give_back(), give_back_unread() and quarantine() never block.
// Errors: create() returns the runtime's allocation error or the transport's registration error
// (with context); take() and read() the runtime's copy error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/runtime/device.h"
#include "common/mutex.h"
#include "common/status.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

class ArrivalWords {
public:
    // A slot as handed out: its index and its words' values then (one per layer).
    struct Slot {
        int32_t index = -1;
        std::vector<uint64_t> base;
    };

    // `slots` x `layers` words on `device`, zeroed and registered with `data` (which must
    // declare write_signals). Preconditions: slots >= 1, layers >= 1.
    [[nodiscard]] static StatusOr<std::unique_ptr<ArrivalWords>> create(Transport& data,
                                                                        runtime::Device device,
                                                                        int slots, int layers);
    ~ArrivalWords();
    ArrivalWords(const ArrivalWords&) = delete;
    ArrivalWords& operator=(const ArrivalWords&) = delete;

    [[nodiscard]] int slots() const { return slots_; }
    [[nodiscard]] int layers() const { return layers_; }
    // The registered region (its descriptor goes to the prefill ranks).
    [[nodiscard]] const MemoryRegion& region() const { return region_; }
    // The word of (slot, layer): memory of the layout's device. Preconditions: in range.
    [[nodiscard]] const uint64_t* word(int slot, int layer) const;

    // A free slot with its words' current values; kResourceExhausted naming how many are in use
    // and quarantined when none is free. Slots given back unread are read here (their values
    // become the base) when no read one is free; one whose read fails is quarantined.
    [[nodiscard]] StatusOr<Slot> take();
    // Returns a slot no prefill rank can signal any more, whose words the caller just read as
    // `words` (one per layer): the next holder's base.
    void give_back(int32_t slot, std::vector<uint64_t> words);
    // Returns a slot no prefill rank can signal any more without reading it (the caller holds a
    // lock): take() reads it before handing it out again.
    void give_back_unread(int32_t slot);
    // Never hands `slot` out again (a source given up as dead may still add to its words).
    void quarantine(int32_t slot);
    [[nodiscard]] uint64_t quarantined() const;
    // The words of `slot`, one per layer.
    [[nodiscard]] StatusOr<std::vector<uint64_t>> read(int32_t slot) const;

    // Deregisters the region from the data transport (idempotent); the memory stays until the
    // destructor (a write or signal in flight may still land in it until the transport closes).
    // The receiver calls it in a graceful shutdown, as for its KV regions; the destructor does
    // not (the transport may be closed or gone by then).
    void deregister();

private:
    ArrivalWords(Transport& data, runtime::DeviceBuffer memory, MemoryRegion region, int slots,
                 int layers);

    Transport& data_;
    runtime::DeviceBuffer memory_;
    MemoryRegion region_;
    const int slots_;
    const int layers_;
    const bool host_memory_;  // read with atomic loads (else a runtime copy)

    mutable Mutex mu_;
    std::vector<int32_t> free_ PDSIM_GUARDED_BY(mu_);                 // bases_ known
    std::vector<int32_t> unread_ PDSIM_GUARDED_BY(mu_);               // free, bases_ to be read
    std::vector<std::vector<uint64_t>> bases_ PDSIM_GUARDED_BY(mu_);  // [slot][layer]
    uint64_t quarantined_ PDSIM_GUARDED_BY(mu_) = 0;
    bool registered_ PDSIM_GUARDED_BY(mu_) = true;
};

}  // namespace pdsim::transfer
