#include "transfer/engine/arrival_words.h"

#include <atomic>
#include <utility>

#include "common/logging.h"

namespace pdsim::transfer {

StatusOr<std::unique_ptr<ArrivalWords>> ArrivalWords::create(Transport& data,
                                                             runtime::Device device, int slots,
                                                             int layers) {
    if (slots < 1 || layers < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "arrival words: {} slots x {} layers (both must be >= 1)", slots,
                           layers);
    }
    if (!data.capabilities().write_signals) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "arrival words: data transport '{}' has no write signals", data.name());
    }
    const size_t bytes =
        static_cast<size_t>(slots) * static_cast<size_t>(layers) * sizeof(uint64_t);
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceBuffer memory,
                           runtime::DeviceBuffer::allocate(device, bytes));
    PDSIM_RETURN_IF_ERROR(memory.fill(0));
    StatusOr<MemoryRegion> region = data.register_memory(memory.data(), bytes);
    if (!region.ok()) {
        return region.status().with_context(fmt::format(
            "registering {} arrival words ({} bytes) with data transport '{}'",
            static_cast<size_t>(slots) * static_cast<size_t>(layers), bytes, data.name()));
    }
    return std::unique_ptr<ArrivalWords>(
        new ArrivalWords(data, std::move(memory), std::move(region).value(), slots, layers));
}

ArrivalWords::ArrivalWords(Transport& data, runtime::DeviceBuffer memory, MemoryRegion region,
                           int slots, int layers)
    : data_(data),
      memory_(std::move(memory)),
      region_(std::move(region)),
      slots_(slots),
      layers_(layers),
      host_memory_(memory_.device().kind == runtime::DeviceKind::kCpu) {
    MutexLock lock(mu_);
    bases_.assign(static_cast<size_t>(slots), std::vector<uint64_t>(static_cast<size_t>(layers)));
    // Handed out from the back: slot 0 first.
    for (int32_t s = slots - 1; s >= 0; --s) free_.push_back(s);
}

ArrivalWords::~ArrivalWords() = default;

const uint64_t* ArrivalWords::word(int slot, int layer) const {
    return memory_.as<const uint64_t>() + static_cast<size_t>(slot) * static_cast<size_t>(layers_) +
           static_cast<size_t>(layer);
}

StatusOr<ArrivalWords::Slot> ArrivalWords::take() {
    for (;;) {
        int32_t stale = -1;
        {
            MutexLock lock(mu_);
            if (!free_.empty()) {
                Slot s;
                s.index = free_.back();
                free_.pop_back();
                s.base = bases_[static_cast<size_t>(s.index)];
                return s;
            }
            if (unread_.empty()) {
                return PDSIM_ERROR(StatusCode::kResourceExhausted,
                                   "all {} arrival slots are in use ({} quarantined after "
                                   "failures)",
                                   slots_, quarantined_);
            }
            stale = unread_.back();
            unread_.pop_back();
        }
        // Read outside the lock; the slot belongs to no one meanwhile.
        StatusOr<std::vector<uint64_t>> now = read(stale);
        if (!now.ok()) {
            PDSIM_LOG_WARN("arrival words: reading slot {} failed, quarantined: {}", stale,
                           now.status().to_string());
            quarantine(stale);
            continue;
        }
        give_back(stale, std::move(now).value());
    }
}

void ArrivalWords::give_back(int32_t slot, std::vector<uint64_t> words) {
    MutexLock lock(mu_);
    bases_[static_cast<size_t>(slot)] = std::move(words);
    free_.push_back(slot);
}

void ArrivalWords::give_back_unread(int32_t slot) {
    MutexLock lock(mu_);
    unread_.push_back(slot);
}

void ArrivalWords::quarantine(int32_t slot) {
    (void)slot;  // simply never returned to free_
    MutexLock lock(mu_);
    ++quarantined_;
}

uint64_t ArrivalWords::quarantined() const {
    MutexLock lock(mu_);
    return quarantined_;
}

StatusOr<std::vector<uint64_t>> ArrivalWords::read(int32_t slot) const {
    std::vector<uint64_t> out(static_cast<size_t>(layers_));
    if (host_memory_) {
        // Host memory: the signals' adds are atomic (release); load them as such.
        for (int l = 0; l < layers_; ++l) {
            out[static_cast<size_t>(l)] =
                std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(word(slot, l)))
                    .load(std::memory_order_acquire);
        }
        return out;
    }
    const size_t offset =
        static_cast<size_t>(slot) * static_cast<size_t>(layers_) * sizeof(uint64_t);
    PDSIM_RETURN_IF_ERROR(memory_.copy_to_host(out.data(), out.size() * sizeof(uint64_t), offset));
    return out;
}

void ArrivalWords::deregister() {
    {
        MutexLock lock(mu_);
        if (!registered_) return;
        registered_ = false;
    }
    if (Status st = data_.deregister_memory(region_.id); !st.ok()) {
        PDSIM_LOG_WARN("arrival words: deregistering from '{}': {}", data_.name(), st.to_string());
    }
}

}  // namespace pdsim::transfer
