#include "sim/des/event_loop.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"

namespace pdsim::des {

EventLoop::EventId EventLoop::schedule(Time delta, Callback cb) {
    PDSIM_CHECK_MSG(delta >= 0 && std::isfinite(delta), "EventLoop::schedule: delta {}", delta);
    return schedule_at(now_ + delta, std::move(cb));
}

EventLoop::EventId EventLoop::schedule_at(Time t, Callback cb) {
    PDSIM_CHECK_MSG(t >= now_ && std::isfinite(t),
                    "EventLoop::schedule_at: time {} is before now {}", t, now_);
    uint32_t slot;
    if (!free_slots_.empty()) {
        slot = free_slots_.back();
        free_slots_.pop_back();
    } else {
        slot = static_cast<uint32_t>(slots_.size());
        slots_.emplace_back();
    }
    const uint64_t seq = next_seq_++;
    slots_[slot].seq = seq;
    slots_[slot].cb = std::move(cb);
    heap_.push_back(Entry{t, seq, slot});
    std::push_heap(heap_.begin(), heap_.end(), Later{});
    return (static_cast<uint64_t>(slot) << kSlotShift) | (seq & ((uint64_t{1} << kSlotShift) - 1));
}

bool EventLoop::cancel(EventId id) {
    const uint64_t slot = id >> kSlotShift;
    const uint64_t seq_low = id & ((uint64_t{1} << kSlotShift) - 1);
    if (id == 0 || slot >= slots_.size()) return false;
    Slot& s = slots_[slot];
    if (s.seq == 0 || (s.seq & ((uint64_t{1} << kSlotShift) - 1)) != seq_low) return false;
    s.seq = 0;
    s.cb = nullptr;  // release captures now
    ++cancelled_pending_;
    return true;
}

bool EventLoop::step() {
    while (!heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end(), Later{});
        const Entry e = heap_.back();
        heap_.pop_back();
        Slot& s = slots_[e.slot];
        if (s.seq != e.seq) {  // cancelled
            --cancelled_pending_;
            free_slots_.push_back(e.slot);
            continue;
        }
        Callback cb = std::move(s.cb);
        s.seq = 0;
        s.cb = nullptr;
        free_slots_.push_back(e.slot);
        now_ = e.t;
        ++events_run_;
        cb();
        return true;
    }
    return false;
}

uint64_t EventLoop::run(Time until) {
    const uint64_t before = events_run_;
    for (;;) {
        // Drop cancelled entries at the top so the time check below sees a live event.
        while (!heap_.empty() && slots_[heap_.front().slot].seq != heap_.front().seq) {
            std::pop_heap(heap_.begin(), heap_.end(), Later{});
            free_slots_.push_back(heap_.back().slot);
            heap_.pop_back();
            --cancelled_pending_;
        }
        if (heap_.empty()) break;
        if (heap_.front().t > until) {
            if (std::isfinite(until)) now_ = std::max(now_, until);
            break;
        }
        step();
    }
    return events_run_ - before;
}

}  // namespace pdsim::des
