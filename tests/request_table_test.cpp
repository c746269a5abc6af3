// The engine's request table (transfer/engine/request_table.h): add / look up / release, the
// transitions (once), bounded waits, shutdown waking waiters, the watchdog's deadline test and
// the counts. The oracles are the clock (a wait lasts at least its timeout), the table's own
// contract (codes and messages) and what other threads did.
#include "transfer/engine/request_table.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"

namespace pdsim::transfer {
namespace {

using std::chrono::milliseconds;

struct TestReq : RequestLifecycle {
    int payload = 0;  // a side's own field: the table never touches it
};

using Table = RequestTable<TestReq>;

std::shared_ptr<TestReq> make_req(uint64_t id, milliseconds timeout = milliseconds(1000)) {
    auto r = std::make_shared<TestReq>();
    r->id = id;
    r->started = Clock::now();
    r->timeout = timeout;
    r->deadline.set(r->started + timeout);
    return r;
}

Status add(Table& table, const std::shared_ptr<TestReq>& r) {
    MutexLock lock(table.mu());
    PDSIM_RETURN_IF_ERROR(table.check_addable_locked(r->id));
    table.insert_locked(r);
    return {};
}

EngineStats counts(const Table& table) {
    MutexLock lock(table.mu());
    EngineStats stats;
    table.copy_counts_locked(stats);
    return stats;
}

TEST(RequestTable, AddFindAndDuplicate) {
    Table table({"sender", 3});
    auto r = make_req(7);
    r->payload = 42;
    ASSERT_OK(add(table, r));
    EXPECT_THAT(add(table, make_req(7)),
                StatusIs(StatusCode::kAlreadyExists, HasSubstr("request 7 is already known")));
    ASSERT_OK(add(table, make_req(8)));
    EXPECT_EQ(table.find(7), r);
    EXPECT_EQ(table.find(7)->payload, 42);
    EXPECT_EQ(table.find(9), nullptr);
    MutexLock lock(table.mu());
    EXPECT_THAT(table.get_locked(9),
                StatusIs(StatusCode::kNotFound, HasSubstr("request 9 is not known")));
    ASSERT_OK_AND_ASSIGN(auto got, table.get_locked(8));
    EXPECT_EQ(got->id, 8u);
    EXPECT_EQ(table.requests_locked().size(), 2u);
}

TEST(RequestTable, TransitionsHappenOnceAndAreCounted) {
    Table table({"receiver", 1});
    auto a = make_req(1);
    auto b = make_req(2);
    auto c = make_req(3);
    ASSERT_OK(add(table, a));
    ASSERT_OK(add(table, b));
    ASSERT_OK(add(table, c));
    {
        MutexLock lock(table.mu());
        EXPECT_TRUE(table.mark_succeeded_locked(*a));
        EXPECT_FALSE(table.mark_failed_locked(*a, "too late"));  // terminal: unchanged
        EXPECT_TRUE(table.mark_failed_locked(*b, "peer gone"));
        EXPECT_FALSE(table.mark_failed_locked(*b, "again"));
        EXPECT_FALSE(table.mark_succeeded_locked(*b));
    }
    EXPECT_EQ(a->state, RequestState::kSuccess);
    EXPECT_TRUE(a->reason.empty());
    EXPECT_GE(a->finished, a->started);
    EXPECT_EQ(b->state, RequestState::kFailed);
    EXPECT_EQ(b->reason, "peer gone");
    EXPECT_EQ(c->state, RequestState::kBootstrapping);
    const EngineStats stats = counts(table);
    EXPECT_EQ(stats.requests_submitted, 3u);
    EXPECT_EQ(stats.requests_completed, 1u);
    EXPECT_EQ(stats.requests_failed, 1u);
}

TEST(RequestTable, ReleaseOnlyTerminalRequests) {
    Table table({"sender", 0});
    auto r = make_req(5);
    ASSERT_OK(add(table, r));
    EXPECT_THAT(table.release(5), StatusIs(StatusCode::kFailedPrecondition,
                                           HasSubstr("request 5 is still Bootstrapping")));
    {
        MutexLock lock(table.mu());
        r->state = RequestState::kTransferring;  // the side's own transition
    }
    EXPECT_THAT(table.release(5), StatusIs(StatusCode::kFailedPrecondition,
                                           HasSubstr("request 5 is still Transferring")));
    EXPECT_EQ(table.find(5), r);
    {
        MutexLock lock(table.mu());
        ASSERT_TRUE(table.mark_succeeded_locked(*r));
    }
    ASSERT_OK(table.release(5));
    EXPECT_EQ(table.find(5), nullptr);
    EXPECT_THAT(table.release(5), StatusIs(StatusCode::kNotFound));
    ASSERT_OK(add(table, make_req(5)));  // the id is free again
    EXPECT_EQ(counts(table).requests_submitted, 2u);
}

TEST(RequestTable, WaitTimesOutWithDeadlineExceeded) {
    Table table({"sender", 0});
    auto r = make_req(11);
    ASSERT_OK(add(table, r));
    const milliseconds timeout(60);
    MutexLock lock(table.mu());
    const auto t0 = Clock::now();
    EXPECT_FALSE(table.wait_terminal_locked(*r, timeout));
    EXPECT_GE(Clock::now() - t0, timeout);
    EXPECT_THAT(Table::wait_timed_out(*r, timeout, "the bootstrap"),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("request 11 still Bootstrapping after 60 ms (awaiting the "
                                   "bootstrap)")));
    // A terminal request does not block at all.
    ASSERT_TRUE(table.mark_succeeded_locked(*r));
    EXPECT_TRUE(table.wait_terminal_locked(*r, std::chrono::hours(1)));
}

TEST(RequestTable, WaitWakesOnTransition) {
    Table table({"receiver", 2});
    auto r = make_req(12);
    ASSERT_OK(add(table, r));
    std::thread finisher([&] {
        std::this_thread::sleep_for(milliseconds(30));
        {
            MutexLock lock(table.mu());
            ASSERT_TRUE(table.mark_failed_locked(*r, "aborted by the peer"));
        }
        table.notify_waiters();
    });
    bool done;
    {
        MutexLock lock(table.mu());
        done = table.wait_terminal_locked(*r, std::chrono::seconds(30));
        EXPECT_EQ(r->reason, "aborted by the peer");
    }
    finisher.join();
    EXPECT_TRUE(done);
}

TEST(RequestTable, WaitForAnyPredicate) {
    Table table({"receiver", 2});
    auto r = make_req(13);
    ASSERT_OK(add(table, r));
    std::thread arrival([&] {
        std::this_thread::sleep_for(milliseconds(20));
        {
            MutexLock lock(table.mu());
            r->payload = 1;  // e.g. a layer arrived: not a transition
        }
        table.notify_waiters();
    });
    MutexLock lock(table.mu());
    EXPECT_TRUE(table.wait_for_locked(std::chrono::seconds(30), [&] { return r->payload == 1; }));
    EXPECT_EQ(r->state, RequestState::kBootstrapping);
    arrival.join();
}

TEST(RequestTable, ShutdownReturnsPendingOnceAndWakesWaiters) {
    Table table({"sender", 3});
    auto done = make_req(1);
    auto pending = make_req(2);
    ASSERT_OK(add(table, done));
    ASSERT_OK(add(table, pending));
    {
        MutexLock lock(table.mu());
        ASSERT_TRUE(table.mark_succeeded_locked(*done));
    }
    std::atomic<bool> woke{false};
    std::thread waiter([&] {
        MutexLock lock(table.mu());
        woke = table.wait_terminal_locked(*pending, std::chrono::seconds(30));
    });
    std::this_thread::sleep_for(milliseconds(20));
    auto active = table.begin_shutdown();
    ASSERT_TRUE(active.has_value());
    ASSERT_EQ(active->size(), 1u);
    EXPECT_EQ(active->front(), pending);
    EXPECT_FALSE(table.begin_shutdown().has_value());  // idempotent
    for (auto& r : *active) {
        MutexLock lock(table.mu());
        EXPECT_TRUE(table.mark_failed_locked(*r, "request 2: prefill rank 3 shut down"));
    }
    table.notify_waiters();
    waiter.join();
    EXPECT_TRUE(woke);
    EXPECT_EQ(pending->state, RequestState::kFailed);
    EXPECT_THAT(add(table, make_req(3)),
                StatusIs(StatusCode::kUnavailable, HasSubstr("sender rank 3 is shut down")));
    // Released requests stay releasable after shutdown.
    ASSERT_OK(table.release(1));
    ASSERT_OK(table.release(2));
}

TEST(RequestTable, ConcurrentWaiters) {
    Table table({"receiver", 0});
    constexpr int kRequests = 8;
    constexpr int kWaitersPerRequest = 3;
    std::vector<std::shared_ptr<TestReq>> reqs;
    for (int i = 0; i < kRequests; ++i) {
        reqs.push_back(make_req(static_cast<uint64_t>(100 + i)));
        ASSERT_OK(add(table, reqs.back()));
    }
    // Odd requests finish; even ones never do, so their waiters must time out (and not be woken
    // for good by the others' notifications).
    const milliseconds short_timeout(150);
    std::vector<std::thread> waiters;
    std::vector<int> result(kRequests * kWaitersPerRequest, -1);
    for (int i = 0; i < kRequests; ++i) {
        for (int w = 0; w < kWaitersPerRequest; ++w) {
            waiters.emplace_back([&, i, w] {
                const bool odd = i % 2 == 1;
                MutexLock lock(table.mu());
                const bool terminal = table.wait_terminal_locked(
                    *reqs[static_cast<size_t>(i)],
                    odd ? std::chrono::nanoseconds(std::chrono::seconds(30))
                        : std::chrono::nanoseconds(short_timeout));
                result[static_cast<size_t>(i * kWaitersPerRequest + w)] = terminal ? 1 : 0;
            });
        }
    }
    std::thread finisher([&] {
        for (int i = kRequests - 1; i >= 0; --i) {
            if (i % 2 == 0) continue;
            std::this_thread::sleep_for(milliseconds(5));
            {
                MutexLock lock(table.mu());
                ASSERT_TRUE(table.mark_succeeded_locked(*reqs[static_cast<size_t>(i)]));
            }
            table.notify_waiters();
        }
    });
    finisher.join();
    for (auto& t : waiters) t.join();
    for (int i = 0; i < kRequests; ++i) {
        for (int w = 0; w < kWaitersPerRequest; ++w) {
            EXPECT_EQ(result[static_cast<size_t>(i * kWaitersPerRequest + w)], i % 2)
                << "request " << i << " waiter " << w;
        }
    }
    EXPECT_EQ(counts(table).requests_completed, static_cast<uint64_t>(kRequests / 2));
}

TEST(RequestTable, DeadlineTest) {
    auto r = make_req(21, milliseconds(250));
    EXPECT_FALSE(Table::past_deadline(*r, r->started));
    EXPECT_FALSE(Table::past_deadline(*r, r->deadline.get() - milliseconds(1)));
    EXPECT_TRUE(Table::past_deadline(*r, r->deadline.get()));
    EXPECT_EQ(Table::timed_out_reason(*r, "the next chunk"),
              "request 21: no progress for 250 ms while awaiting the next chunk");
}

}  // namespace
}  // namespace pdsim::transfer
