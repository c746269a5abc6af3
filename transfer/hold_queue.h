// HoldQueue: one thread that runs tasks at their due time, for transport decorators that deliver
// late (the fault decorator's delays, reorder holds and disconnect; the shaper's bandwidth and
// latency holds).
//
// Order: a task runs no earlier than its due time; tasks run one at a time, in due-time order.
// Tie rule: tasks with equal due times run in the order they were pushed (FIFO), so a user that
// pushes with non-decreasing due times (a per-peer delay, a token bucket) gets its push order.
// A task that is due while another one runs waits for it (a task should be short: it posts to a
// transport or completes a handle).
//
// Stop: stop() (and the destructor) wakes the thread, lets a running task finish, joins the
// thread and destroys the tasks still pending without running them; later pushes are refused.
// A user that must fail what it held keeps its own record of it (the tasks are opaque).
//
// Thread-safety: push() and pending() may be called from any thread, from a task included (a
// task may push more tasks). stop() may be called from any thread except the queue's own (from a
// task it would join itself); it is idempotent and may race with push().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"

namespace pdsim::transfer {

class HoldQueue {
public:
    using Clock = std::chrono::steady_clock;
    using Task = std::function<void()>;

    // Starts the thread, named `thread_name` (common/thread_info.h: 15 bytes are kept).
    explicit HoldQueue(std::string thread_name);
    ~HoldQueue();
    HoldQueue(const HoldQueue&) = delete;
    HoldQueue& operator=(const HoldQueue&) = delete;

    // Schedules `task` to run on the queue's thread at or after `due` (a due time in the past runs
    // as soon as the thread is free). Returns false, and destroys the task without running it,
    // once the queue has been stopped. Never blocks on a running task.
    bool push(Clock::time_point due, Task task) PDSIM_EXCLUDES(mu_);
    // push(now + delay_ms); a negative delay runs at once.
    bool push_after_ms(double delay_ms, Task task) PDSIM_EXCLUDES(mu_);

    // See "Stop" above.
    void stop() PDSIM_EXCLUDES(mu_);

    // Tasks pushed and not yet started (0 once stopped).
    [[nodiscard]] size_t pending() const PDSIM_EXCLUDES(mu_);

private:
    struct Entry {
        Clock::time_point due;
        uint64_t seq = 0;  // push order: the tie rule
        Task task;
    };
    // Heap order: the entry that runs first is at the top.
    static bool runs_later(const Entry& a, const Entry& b);

    void run() PDSIM_EXCLUDES(mu_);
    // Blocks until the earliest task is due (true) or the queue stops (false).
    bool wait_for_due_locked() PDSIM_REQUIRES(mu_);

    mutable Mutex mu_;
    std::condition_variable_any cv_;
    std::vector<Entry> heap_ PDSIM_GUARDED_BY(mu_);  // a min-heap under runs_later
    uint64_t next_seq_ PDSIM_GUARDED_BY(mu_) = 0;
    bool stopped_ PDSIM_GUARDED_BY(mu_) = false;
    std::thread thread_;  // started last, in the constructor body; joined by stop()
};

}  // namespace pdsim::transfer
