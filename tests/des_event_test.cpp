#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "sim/des/event_loop.h"

namespace pdsim::des {
namespace {

TEST(EventLoop, RunsInTimeOrderAndTiesInInsertionOrder) {
    EventLoop loop;
    std::vector<int> order;
    loop.schedule(2.0, [&] { order.push_back(3); });
    loop.schedule(1.0, [&] { order.push_back(1); });
    loop.schedule(1.0, [&] { order.push_back(2); });  // same time: after the first one
    loop.schedule(0.0, [&] { order.push_back(0); });
    EXPECT_EQ(loop.pending(), 4u);
    EXPECT_EQ(loop.run(), 4u);
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
    EXPECT_DOUBLE_EQ(loop.now(), 2.0);
    EXPECT_EQ(loop.pending(), 0u);
}

TEST(EventLoop, CallbacksScheduleRelativeToTheirOwnTime) {
    EventLoop loop;
    std::vector<double> seen;
    loop.schedule(1.0, [&] {
        seen.push_back(loop.now());
        loop.schedule(0.5, [&] { seen.push_back(loop.now()); });
        loop.schedule(0.0, [&] { seen.push_back(loop.now()); });  // same time, runs next
    });
    loop.schedule(1.2, [&] { seen.push_back(loop.now()); });
    loop.run();
    EXPECT_EQ(seen, (std::vector<double>{1.0, 1.0, 1.2, 1.5}));
}

TEST(EventLoop, CancelSkipsTheEventOnce) {
    EventLoop loop;
    int ran = 0;
    auto a = loop.schedule(1.0, [&] { ran += 1; });
    auto b = loop.schedule(2.0, [&] { ran += 10; });
    EXPECT_TRUE(loop.cancel(a));
    EXPECT_FALSE(loop.cancel(a));  // already cancelled
    EXPECT_EQ(loop.pending(), 1u);
    loop.run();
    EXPECT_EQ(ran, 10);
    EXPECT_FALSE(loop.cancel(b));  // already ran
    EXPECT_FALSE(loop.cancel(0));
    // A slot freed by a cancelled or finished event is reused; a stale id must not cancel the new
    // event that took its slot.
    auto c = loop.schedule(1.0, [&] { ran += 100; });
    EXPECT_FALSE(loop.cancel(a));
    EXPECT_FALSE(loop.cancel(b));
    loop.run();
    EXPECT_EQ(ran, 110);
    EXPECT_FALSE(loop.cancel(c));
}

TEST(EventLoop, RunUntilStopsBeforeLaterEventsAndAdvancesTheClock) {
    EventLoop loop;
    int ran = 0;
    loop.schedule(1.0, [&] { ++ran; });
    loop.schedule(3.0, [&] { ++ran; });
    EXPECT_EQ(loop.run(2.0), 1u);
    EXPECT_DOUBLE_EQ(loop.now(), 2.0);
    EXPECT_EQ(loop.pending(), 1u);
    loop.schedule(0.5, [&] { ++ran; });  // at 2.5
    EXPECT_EQ(loop.run(), 2u);
    EXPECT_EQ(ran, 3);
    EXPECT_DOUBLE_EQ(loop.now(), 3.0);
}

TEST(EventLoop, RandomScheduleMatchesASortedOracle) {
    EventLoop loop;
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<int> t(0, 50);  // many ties
    struct Item {
        double t;
        int idx;
    };
    std::vector<Item> expected;
    std::vector<int> got;
    std::vector<EventLoop::EventId> ids;
    for (int i = 0; i < 2000; ++i) {
        const double when = t(rng) * 0.25;
        ids.push_back(loop.schedule_at(when, [&got, i] { got.push_back(i); }));
        expected.push_back({when, i});
    }
    std::vector<bool> cancelled(2000, false);
    for (int i = 0; i < 2000; i += 7) {
        EXPECT_TRUE(loop.cancel(ids[static_cast<size_t>(i)]));
        cancelled[static_cast<size_t>(i)] = true;
    }
    std::stable_sort(expected.begin(), expected.end(),
                     [](const Item& a, const Item& b) { return a.t < b.t; });
    std::vector<int> want;
    for (const Item& it : expected)
        if (!cancelled[static_cast<size_t>(it.idx)]) want.push_back(it.idx);
    loop.run();
    EXPECT_EQ(got, want);
}

TEST(EventLoopDeathTest, SchedulingInThePastAborts) {
    EventLoop loop;
    loop.schedule(1.0, [] {});
    loop.run();
    EXPECT_DEATH(loop.schedule_at(0.5, [] {}), "before|now");
    EXPECT_DEATH(loop.schedule(-1.0, [] {}), "delta");
}

}  // namespace
}  // namespace pdsim::des
