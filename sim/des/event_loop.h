// The discrete-event core of the simulator: a clock and a queue of callbacks.
//
//   EventLoop loop;
//   loop.schedule(0.5, [&] { ... loop.schedule(1.0, ...); });
//   loop.run();                       // until the queue is empty
//
// Time is simulated seconds (double), starting at 0. Events run in (time, insertion order):
// two events at the same time run in the order they were scheduled, so a run is deterministic.
// A callback may schedule and cancel events; it never runs re-entrantly.
// Thread-safety: none. One loop is driven by one thread (the simulator is single-threaded by
// design: determinism, and one core's speed is the figure of merit).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace pdsim::des {

using Time = double;  // simulated seconds
inline constexpr Time kForever = std::numeric_limits<Time>::infinity();

class EventLoop {
public:
    using Callback = std::function<void()>;
    using EventId = uint64_t;  // never 0

    EventLoop() = default;
    EventLoop(const EventLoop&) = delete;
    EventLoop& operator=(const EventLoop&) = delete;

    // Runs `cb` at now() + delta. Precondition: delta >= 0 and finite (PDSIM_CHECK aborts
    // otherwise).
    EventId schedule(Time delta, Callback cb);
    // Runs `cb` at absolute time `t`. Precondition: t >= now() and finite.
    EventId schedule_at(Time t, Callback cb);
    // Cancels a pending event; false when it already ran, was cancelled, or never existed. O(1).
    bool cancel(EventId id);

    [[nodiscard]] Time now() const { return now_; }
    // Pending events (cancelled ones excluded).
    [[nodiscard]] size_t pending() const { return heap_.size() - cancelled_pending_; }
    [[nodiscard]] uint64_t events_run() const { return events_run_; }

    // Runs events in order until none is left or the next one is later than `until`; the clock
    // then stays at the last event run (or advances to `until` when that is finite and the queue
    // still holds later events). Returns the number of events run.
    uint64_t run(Time until = kForever);
    // Runs the next event; false when the queue is empty.
    bool step();

private:
    struct Entry {
        Time t;
        uint64_t seq;   // insertion order (ties)
        uint32_t slot;  // index into slots_
    };
    struct Later {
        bool operator()(const Entry& a, const Entry& b) const {
            return a.t != b.t ? a.t > b.t : a.seq > b.seq;
        }
    };
    struct Slot {
        uint64_t seq = 0;  // 0: cancelled (its heap entry is skipped when popped)
        Callback cb;
    };
    static constexpr int kSlotShift = 40;  // EventId = slot << 40 | (seq mod 2^40)

    Time now_ = 0;
    uint64_t next_seq_ = 1;
    uint64_t events_run_ = 0;
    std::vector<Entry> heap_;
    std::vector<Slot> slots_;
    std::vector<uint32_t> free_slots_;
    size_t cancelled_pending_ = 0;
};

}  // namespace pdsim::des
