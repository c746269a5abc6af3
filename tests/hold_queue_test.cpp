// HoldQueue (transfer/hold_queue.h): due-time order, FIFO among equal due times, nothing runs
// early, stop with tasks pending (destroyed, not run), pushes after stop, tasks that push, and
// concurrent pushers (each pusher's tasks run in its push order, every task exactly once).
#include "transfer/hold_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using Clock = HoldQueue::Clock;

// Records what ran, in the order it ran.
class RunLog {
public:
    void add(int id) {
        std::lock_guard<std::mutex> lock(mu_);
        ids_.push_back(id);
    }
    [[nodiscard]] std::vector<int> ids() const {
        std::lock_guard<std::mutex> lock(mu_);
        return ids_;
    }
    // Waits until `n` tasks ran (false after 30 s).
    [[nodiscard]] bool wait_for(size_t n) const {
        const auto deadline = Clock::now() + 30s;
        while (Clock::now() < deadline) {
            if (ids().size() >= n) return true;
            std::this_thread::sleep_for(1ms);
        }
        return false;
    }

private:
    mutable std::mutex mu_;
    std::vector<int> ids_;
};

// Occupies the queue's thread until release(), so that every task pushed meanwhile is in the
// queue before the thread picks the next one: the order seen is the queue's order alone, not
// the machine's timing.
class Blocker {
public:
    explicit Blocker(HoldQueue& queue) {
        EXPECT_TRUE(queue.push(Clock::now(), [this] {
            started_.set_value();
            gate_.wait();
        }));
        started_.get_future().wait();
    }
    void release() { open_.set_value(); }

private:
    std::promise<void> started_;
    std::promise<void> open_;
    std::shared_future<void> gate_ = open_.get_future().share();
};

TEST(HoldQueue, RunsInDueTimeOrder) {
    RunLog log;  // before the queue: destroyed after it
    HoldQueue queue("test-hold");
    Blocker blocker(queue);
    // Due times (ms from a common base) in a shuffled order; the oracle sorts them.
    std::vector<int> due_ms(12);
    std::iota(due_ms.begin(), due_ms.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(due_ms.begin(), due_ms.end(), rng);
    const auto base = Clock::now();
    for (int ms : due_ms) {
        ASSERT_TRUE(queue.push(base + std::chrono::milliseconds(ms), [&log, ms] { log.add(ms); }));
    }
    EXPECT_EQ(queue.pending(), due_ms.size());
    blocker.release();
    ASSERT_TRUE(log.wait_for(due_ms.size()));
    std::vector<int> expected = due_ms;
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(log.ids(), expected);
}

TEST(HoldQueue, EqualDueTimesRunInPushOrder) {
    RunLog log;  // before the queue: destroyed after it
    HoldQueue queue("test-hold");
    Blocker blocker(queue);
    const auto due = Clock::now() + 1ms;
    std::vector<int> pushed;
    for (int id = 0; id < 50; ++id) {
        // Interleave a later task, so the ties are not just the heap's insertion order.
        ASSERT_TRUE(queue.push(due + 5ms, [&log, id] { log.add(1000 + id); }));
        ASSERT_TRUE(queue.push(due, [&log, id] { log.add(id); }));
        pushed.push_back(id);
    }
    for (int id = 0; id < 50; ++id) pushed.push_back(1000 + id);
    blocker.release();
    ASSERT_TRUE(log.wait_for(pushed.size()));
    EXPECT_EQ(log.ids(), pushed);
}

TEST(HoldQueue, NothingRunsBeforeItsDueTime) {
    std::mutex mu;
    std::vector<std::pair<Clock::time_point, Clock::time_point>> due_and_ran;
    std::atomic<int> ran{0};
    HoldQueue queue("test-hold");
    const auto base = Clock::now();
    for (int i = 0; i < 10; ++i) {
        const auto due = base + std::chrono::milliseconds(5 * i);
        ASSERT_TRUE(queue.push(due, [&, due] {
            const auto now = Clock::now();
            std::lock_guard<std::mutex> lock(mu);
            due_and_ran.emplace_back(due, now);
            ran.fetch_add(1);
        }));
    }
    const auto deadline = Clock::now() + 30s;
    while (ran.load() < 10 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(due_and_ran.size(), 10u);
    for (const auto& [due, ran_at] : due_and_ran) EXPECT_GE(ran_at, due);
}

TEST(HoldQueue, PushAfterMsWaitsAboutThatLong) {
    std::promise<Clock::time_point> ran;
    HoldQueue queue("test-hold");
    const auto pushed = Clock::now();
    ASSERT_TRUE(queue.push_after_ms(20, [&ran] { ran.set_value(Clock::now()); }));
    const auto ran_at = ran.get_future().get();
    EXPECT_GE(ran_at - pushed, 20ms);
}

TEST(HoldQueue, StopDestroysPendingTasksWithoutRunningThem) {
    auto sentinel = std::make_shared<int>(0);
    std::atomic<int> ran{0};
    HoldQueue queue("test-hold");
    for (int i = 0; i < 5; ++i) {
        ASSERT_TRUE(queue.push(Clock::now() + 1h, [sentinel, &ran] { ran.fetch_add(1); }));
    }
    EXPECT_EQ(sentinel.use_count(), 6);  // the test's own + one per pending task
    EXPECT_EQ(queue.pending(), 5u);
    queue.stop();
    EXPECT_EQ(ran.load(), 0);
    EXPECT_EQ(sentinel.use_count(), 1);  // every pending task was destroyed
    EXPECT_EQ(queue.pending(), 0u);
    // Refused after stop: the task is destroyed, never run.
    EXPECT_FALSE(queue.push(Clock::now(), [sentinel, &ran] { ran.fetch_add(1); }));
    EXPECT_EQ(sentinel.use_count(), 1);
    queue.stop();  // idempotent
    EXPECT_EQ(ran.load(), 0);
}

TEST(HoldQueue, StopLetsTheRunningTaskFinish) {
    std::atomic<bool> finished{false};
    std::promise<void> started;
    HoldQueue queue("test-hold");
    ASSERT_TRUE(queue.push(Clock::now(), [&] {
        started.set_value();
        std::this_thread::sleep_for(50ms);
        finished.store(true);
    }));
    started.get_future().wait();
    queue.stop();
    EXPECT_TRUE(finished.load());
}

TEST(HoldQueue, DestructorStopsWithTasksPending) {
    auto sentinel = std::make_shared<int>(0);
    {
        HoldQueue queue("test-hold");
        ASSERT_TRUE(queue.push(Clock::now() + 1h, [sentinel] {}));
        EXPECT_EQ(sentinel.use_count(), 2);
    }
    EXPECT_EQ(sentinel.use_count(), 1);
}

TEST(HoldQueue, ATaskMayPushMoreTasks) {
    RunLog log;  // before the queue: destroyed after it
    HoldQueue queue("test-hold");
    std::function<void(int)> chain = [&](int step) {
        log.add(step);
        if (step < 5) {
            EXPECT_TRUE(queue.push(Clock::now(), [&chain, step] { chain(step + 1); }));
        }
    };
    ASSERT_TRUE(queue.push(Clock::now(), [&chain] { chain(0); }));
    ASSERT_TRUE(log.wait_for(6));
    EXPECT_EQ(log.ids(), (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(HoldQueue, ConcurrentPushersKeepTheirOwnOrder) {
    constexpr int kPushers = 4;
    constexpr int kPerPusher = 400;
    RunLog log;  // before the queue: destroyed after it
    HoldQueue queue("test-hold");
    {
        std::vector<std::thread> pushers;
        for (int p = 0; p < kPushers; ++p) {
            pushers.emplace_back([&, p] {
                // Non-decreasing due times per pusher (a per-peer delay): its order must hold.
                auto due = Clock::now();
                std::mt19937 rng(static_cast<unsigned>(p));
                for (int i = 0; i < kPerPusher; ++i) {
                    due += std::chrono::microseconds(rng() % 50);
                    const int id = p * kPerPusher + i;
                    EXPECT_TRUE(queue.push(due, [&log, id] { log.add(id); }));
                }
            });
        }
        for (auto& t : pushers) t.join();
    }
    ASSERT_TRUE(log.wait_for(kPushers * kPerPusher));
    const std::vector<int> ids = log.ids();
    ASSERT_EQ(ids.size(), static_cast<size_t>(kPushers * kPerPusher));
    std::vector<int> next(kPushers, 0);  // per pusher: the index expected next
    for (int id : ids) {
        const int p = id / kPerPusher;
        EXPECT_EQ(id % kPerPusher, next[static_cast<size_t>(p)]) << "pusher " << p;
        next[static_cast<size_t>(p)] = id % kPerPusher + 1;
    }
    for (int p = 0; p < kPushers; ++p) EXPECT_EQ(next[static_cast<size_t>(p)], kPerPusher);
}

}  // namespace
}  // namespace pdsim::transfer
