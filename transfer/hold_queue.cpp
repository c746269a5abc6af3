#include "transfer/hold_queue.h"

#include <algorithm>
#include <utility>

#include "common/thread_info.h"

namespace pdsim::transfer {

HoldQueue::HoldQueue(std::string thread_name) {
    thread_ = std::thread([this, name = std::move(thread_name)] {
        set_thread_name(name);
        run();
    });
}

HoldQueue::~HoldQueue() {
    stop();
}

bool HoldQueue::runs_later(const Entry& a, const Entry& b) {
    if (a.due != b.due) return a.due > b.due;
    return a.seq > b.seq;
}

bool HoldQueue::push(Clock::time_point due, Task task) {
    {
        MutexLock lock(mu_);
        if (stopped_) return false;  // `task` is destroyed on return, outside the lock
        heap_.push_back(Entry{due, next_seq_++, std::move(task)});
        std::push_heap(heap_.begin(), heap_.end(), runs_later);
    }
    cv_.notify_all();
    return true;
}

bool HoldQueue::push_after_ms(double delay_ms, Task task) {
    const auto delay = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double, std::milli>(delay_ms));
    return push(Clock::now() + delay, std::move(task));
}

void HoldQueue::stop() {
    std::vector<Entry> discarded;
    {
        MutexLock lock(mu_);
        if (stopped_) return;
        stopped_ = true;
        discarded.swap(heap_);
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // `discarded` is destroyed here: the tasks' captures are released without the lock held.
}

size_t HoldQueue::pending() const {
    MutexLock lock(mu_);
    return heap_.size();
}

bool HoldQueue::wait_for_due_locked() {
    while (!stopped_) {
        if (heap_.empty()) {
            cv_.wait(mu_);
            continue;
        }
        const Clock::time_point due = heap_.front().due;
        if (Clock::now() >= due) return true;
        cv_.wait_until(mu_, due);
    }
    return false;
}

void HoldQueue::run() {
    for (;;) {
        Task task;
        {
            MutexLock lock(mu_);
            if (!wait_for_due_locked()) return;
            std::pop_heap(heap_.begin(), heap_.end(), runs_later);
            task = std::move(heap_.back().task);
            heap_.pop_back();
        }
        task();
    }
}

}  // namespace pdsim::transfer
