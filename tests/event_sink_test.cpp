// EventSink (transfer/engine/event_sink.h): events reach the hook until close(); close() waits
// for a hook call in progress on another thread and returns at once from inside the hook; no call
// starts after it. Runs under TSan (label tsan).
#include "transfer/engine/event_sink.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

namespace pdsim::transfer {
namespace {

using std::chrono::milliseconds;

TransferEvent event_for(uint64_t request) {
    TransferEvent e;
    e.kind = TransferEvent::Kind::kLayerSent;
    e.request = request;
    return e;
}

TEST(EventSink, WithoutAHookEmitAndCloseDoNothing) {
    EventSink sink(nullptr);
    EXPECT_FALSE(sink.has_hook());
    sink.emit(event_for(1));
    sink.close();
    sink.close();
}

TEST(EventSink, DeliversUntilClosedAndNothingAfter) {
    std::vector<uint64_t> seen;
    EventSink sink([&](const TransferEvent& e) { seen.push_back(e.request); });
    ASSERT_TRUE(sink.has_hook());
    sink.emit(event_for(1));
    sink.emit(event_for(2));
    sink.close();
    sink.emit(event_for(3));
    sink.close();  // idempotent
    sink.emit(event_for(4));
    EXPECT_EQ(seen, (std::vector<uint64_t>{1, 2}));
}

TEST(EventSink, CloseWaitsForACallInProgressOnAnotherThread) {
    std::promise<void> entered;
    std::promise<void> release;
    std::shared_future<void> released = release.get_future().share();
    std::atomic<bool> call_returned{false};
    EventSink sink([&](const TransferEvent&) {
        entered.set_value();
        released.wait();
        call_returned.store(true);
    });
    std::thread emitter([&] { sink.emit(event_for(1)); });
    entered.get_future().wait();
    auto closed = std::async(std::launch::async, [&] {
        sink.close();
        return call_returned.load();
    });
    // close() is still waiting for the hook call.
    EXPECT_EQ(closed.wait_for(milliseconds(100)), std::future_status::timeout);
    release.set_value();
    EXPECT_TRUE(closed.get()) << "close() returned before the hook call did";
    emitter.join();
}

TEST(EventSink, CloseFromInsideTheHookDoesNotWaitForItself) {
    int calls = 0;
    EventSink* self = nullptr;
    EventSink sink([&](const TransferEvent&) {
        ++calls;
        self->close();
    });
    self = &sink;
    auto done = std::async(std::launch::async, [&] {
        sink.emit(event_for(1));
        sink.emit(event_for(2));
    });
    ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready)
        << "close() inside the hook waited for its own call";
    EXPECT_EQ(calls, 1);
}

TEST(EventSink, NoCallStartsAfterCloseReturnsUnderConcurrentEmits) {
    std::atomic<bool> closed{false};
    std::atomic<int> after_close{0};
    std::atomic<int> calls{0};
    EventSink sink([&](const TransferEvent&) {
        if (closed.load()) after_close.fetch_add(1);
        calls.fetch_add(1);
    });
    std::atomic<bool> stop{false};
    std::vector<std::thread> emitters;
    for (int t = 0; t < 4; ++t) {
        emitters.emplace_back([&, t] {
            for (uint64_t i = 0; !stop.load(); ++i) sink.emit(event_for(i * 4 + t));
        });
    }
    while (calls.load() < 1000) std::this_thread::yield();
    sink.close();
    closed.store(true);
    std::this_thread::sleep_for(milliseconds(20));
    stop.store(true);
    for (auto& t : emitters) t.join();
    EXPECT_EQ(after_close.load(), 0);
}

}  // namespace
}  // namespace pdsim::transfer
