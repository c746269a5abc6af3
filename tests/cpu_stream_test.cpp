#include "backends/runtime/cpu_stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::runtime {
namespace {

using namespace std::chrono_literals;
using ::testing::AllOf;

TEST(CpuStream, RunsInOrderAsynchronously) {
    CpuStream s("t");
    std::vector<int> order;
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                    order.push_back(0);
                }).ok());
    for (int i = 1; i < 100; ++i) ASSERT_OK(enqueue_void(s, [&order, i] { order.push_back(i); }));
    // enqueue returned while the first task is still blocked: asynchronous to the host.
    EXPECT_TRUE(order.empty());
    gate = true;
    ASSERT_OK(s.synchronize());
    ASSERT_EQ(order.size(), 100u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

TEST(CpuStream, ErrorIsStickyAndSkipsLaterWork) {
    CpuStream s("t");
    int ran = 0;
    ASSERT_OK(s.enqueue([] { return Status(StatusCode::kDataLoss, "boom"); }));
    ASSERT_OK(enqueue_void(s, [&] { ++ran; }));
    Status st = s.synchronize();
    EXPECT_THAT(st, StatusIs(StatusCode::kDataLoss, HasSubstr("boom")));
    EXPECT_EQ(ran, 0);
    EXPECT_EQ(s.error().code(), StatusCode::kDataLoss);
}

// A task that throws fails its stream as a failing task does (kInternal naming the stream and
// the exception) instead of ending the process from the stream's worker thread.
TEST(CpuStream, ThrowingTaskFailsTheStreamInsteadOfTheProcess) {
    CpuStream s("thrower");
    int ran = 0;
    ASSERT_OK(s.enqueue([]() -> Status { throw std::runtime_error("vector::at out of range"); }));
    ASSERT_OK(enqueue_void(s, [&] { ++ran; }));
    EXPECT_THAT(s.synchronize(),
                StatusIs(StatusCode::kInternal, AllOf(HasSubstr("a task on stream thrower threw"),
                                                      HasSubstr("vector::at out of range"))));
    EXPECT_EQ(ran, 0);

    CpuStream other("other");
    ASSERT_OK(other.enqueue([]() -> Status { throw 42; }));
    EXPECT_THAT(other.synchronize(),
                StatusIs(StatusCode::kInternal, HasSubstr("not a std::exception")));
}

// run_task itself, and a task replayed from a captured graph (which runs through it too).
TEST(CpuStream, RunTaskTurnsAnExceptionIntoAStatus) {
    EXPECT_OK(run_task([] { return Status(); }, "s"));
    EXPECT_THAT(run_task([] { return Status(StatusCode::kAborted, "no"); }, "s"),
                StatusIs(StatusCode::kAborted, HasSubstr("no")));
    EXPECT_THAT(run_task([]() -> Status { throw std::bad_alloc(); }, "s"),
                StatusIs(StatusCode::kInternal, HasSubstr("threw: std::bad_alloc")));
    CpuStream s("graph");
    ASSERT_OK(s.begin_capture());
    ASSERT_OK(s.enqueue([]() -> Status { throw std::logic_error("in a graph"); }));
    auto graph = s.end_capture();
    ASSERT_OK(graph.status());
    ASSERT_OK((*graph)->launch(s));
    EXPECT_THAT(s.synchronize(), StatusIs(StatusCode::kInternal, HasSubstr("in a graph")));
}

TEST(CpuStream, SynchronizeTimesOut) {
    CpuStream s("t");
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    Status st = s.synchronize(50ms);
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
    gate = true;
    EXPECT_OK(s.synchronize());
}

TEST(CpuStream, EventQueryAndHostSynchronize) {
    CpuStream s("t");
    auto ev = s.create_event();
    EXPECT_TRUE(ev->query());  // never recorded
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                }).ok());
    ASSERT_OK(s.record(*ev));
    EXPECT_FALSE(ev->query());
    EXPECT_EQ(ev->synchronize(20ms).code(), StatusCode::kDeadlineExceeded);
    gate = true;
    EXPECT_OK(ev->synchronize());
    EXPECT_TRUE(ev->query());
}

TEST(CpuStream, CrossStreamWaitOrdersWork) {
    CpuStream producer("p"), consumer("c");
    auto ev = producer.create_event();
    std::atomic<int> value{0};
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(producer, [&] {
                    while (!gate.load()) std::this_thread::yield();
                    value.store(42);
                }).ok());
    ASSERT_OK(producer.record(*ev));
    ASSERT_OK(consumer.wait(*ev));
    int seen = -1;
    ASSERT_OK(enqueue_void(consumer, [&] { seen = value.load(); }));
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(seen, -1);  // consumer is held back by the event
    gate = true;
    ASSERT_OK(consumer.synchronize());
    EXPECT_EQ(seen, 42);
}

TEST(CpuStream, StreamWaitTimesOutWithAMessage) {
    CpuStream producer("p");
    CpuStream consumer("c", 30ms);
    auto ev = producer.create_event();
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(producer, [&] {
                    while (!gate.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    ASSERT_OK(producer.record(*ev));
    ASSERT_OK(consumer.wait(*ev));
    Status st = consumer.synchronize();
    EXPECT_THAT(st, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("timed out")));
    gate = true;
    EXPECT_OK(producer.synchronize());
}

TEST(CpuStream, GraphCaptureDefersAndReplaysReadingBuffersAtRunTime) {
    CpuStream s("t");
    int input = 1;
    std::vector<int> outputs;
    ASSERT_OK(s.begin_capture());
    EXPECT_TRUE(s.is_capturing());
    ASSERT_OK(enqueue_void(s, [&] { outputs.push_back(input * 10); }));
    auto ev = s.create_event();
    ASSERT_OK(s.record(*ev));
    auto g = s.end_capture();
    ASSERT_OK(g);
    ASSERT_OK(s.synchronize());
    EXPECT_TRUE(outputs.empty());  // captured, not run
    EXPECT_EQ((*g)->num_nodes(), 2u);
    ASSERT_OK((*g)->launch(s));
    ASSERT_OK(ev->synchronize());
    input = 2;  // in-place update between replays
    ASSERT_OK((*g)->launch(s));
    ASSERT_OK(s.synchronize());
    EXPECT_EQ(outputs, (std::vector<int>{10, 20}));
    EXPECT_EQ(s.begin_capture().code(), StatusCode::kOk);
    EXPECT_EQ(s.begin_capture().code(), StatusCode::kFailedPrecondition);
    ASSERT_OK(s.end_capture());
    EXPECT_EQ(s.end_capture().status().code(), StatusCode::kFailedPrecondition);
}

TEST(CpuStream, ReplayedRecordIsNotVisibleBeforeItRuns) {
    CpuStream s("t");
    auto ev = s.create_event();
    std::atomic<bool> gate{false};
    ASSERT_OK(s.begin_capture());
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                }).ok());
    ASSERT_OK(s.record(*ev));
    auto g = s.end_capture();
    ASSERT_OK(g);
    ASSERT_OK((*g)->launch(s));
    EXPECT_FALSE(ev->query());
    gate = true;
    EXPECT_OK(ev->synchronize());
}

// Caller runs (CpuStreamOptions::caller_runs). Which thread wins a task is the scheduler's choice,
// so the tests check what must hold whoever runs it -- order, one task at a time, every task once
// -- and that the caller does take tasks over many forwards (a worker that always won would mean
// synchronize still sleeps through every hand-off).
TEST(CpuStream, CallerRunsKeepsOrderAndOneTaskAtATime) {
    CpuStream s("caller", CpuStreamOptions{.caller_runs = true});
    const std::thread::id caller = std::this_thread::get_id();
    std::vector<int> order;
    std::atomic<int> running{0};
    std::atomic<int> overlaps{0};
    int on_caller = 0;
    constexpr int kForwards = 200;
    constexpr int kTasks = 8;
    for (int f = 0; f < kForwards; ++f) {
        for (int t = 0; t < kTasks; ++t) {
            ASSERT_OK(enqueue_void(s, [&, id = f * kTasks + t] {
                if (running.fetch_add(1) != 0) overlaps.fetch_add(1);
                order.push_back(id);
                on_caller += std::this_thread::get_id() == caller;
                running.fetch_sub(1);
            }));
        }
        ASSERT_OK(s.synchronize());
    }
    ASSERT_EQ(order.size(), static_cast<size_t>(kForwards * kTasks));
    for (size_t i = 0; i < order.size(); ++i) ASSERT_EQ(order[i], static_cast<int>(i));
    EXPECT_EQ(overlaps.load(), 0);
    EXPECT_GT(on_caller, 0) << "synchronize never ran a task itself";
}

TEST(CpuStream, WithoutCallerRunsEveryTaskRunsOnTheWorker) {
    CpuStream s("worker");
    const std::thread::id caller = std::this_thread::get_id();
    int on_caller = 0;
    for (int f = 0; f < 50; ++f) {
        ASSERT_OK(enqueue_void(s, [&] { on_caller += std::this_thread::get_id() == caller; }));
        ASSERT_OK(s.synchronize());
    }
    EXPECT_EQ(on_caller, 0);
}

TEST(CpuStream, CallerRunsLeavesStreamWaitsToTheWorker) {
    CpuStream producer("p");
    CpuStream consumer("c", CpuStreamOptions{.wait_timeout = 20s, .caller_runs = true});
    auto ev = producer.create_event();
    std::atomic<bool> gate{false};
    ASSERT_OK(enqueue_void(producer, [&] {
        while (!gate.load()) std::this_thread::sleep_for(1ms);
    }));
    ASSERT_OK(producer.record(*ev));
    ASSERT_OK(consumer.wait(*ev));
    const auto t0 = std::chrono::steady_clock::now();
    // Had this caller taken the stream-side wait, it would be stuck in it for up to 20 s.
    EXPECT_THAT(consumer.synchronize(100ms), StatusIs(StatusCode::kDeadlineExceeded));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
    gate = true;
    EXPECT_OK(consumer.synchronize());
    EXPECT_OK(producer.synchronize());
}

// Caller first (cpu_stream.h): an enqueue does not hand the task to the worker, so a caller that
// synchronizes right after enqueueing runs every task itself. With the old wake per task the
// worker, woken on another core, took some of them.
TEST(CpuStream, CallerRunsWithoutAWorkerWakePerTask) {
    CpuStream s("caller", CpuStreamOptions{.caller_runs = true, .caller_grace = 10s});
    const std::thread::id caller = std::this_thread::get_id();
    int tasks = 0, on_caller = 0;
    for (int f = 0; f < 200; ++f) {
        for (int t = 0; t < 8; ++t) {
            ASSERT_OK(enqueue_void(s, [&] {
                ++tasks;
                on_caller += std::this_thread::get_id() == caller;
            }));
        }
        ASSERT_OK(s.synchronize());
    }
    EXPECT_EQ(tasks, 1600);
    EXPECT_EQ(on_caller, tasks) << "the worker took tasks a synchronizing caller was there for";
}

// Work nobody synchronizes still runs: the worker takes it once it has waited a grace.
TEST(CpuStream, CallerRunsWorkerTakesWhatNobodySynchronizes) {
    constexpr auto kGrace = 20ms;
    CpuStream s("caller", CpuStreamOptions{.caller_runs = true, .caller_grace = kGrace});
    for (int round = 0; round < 3; ++round) {  // the worker parks between rounds
        std::atomic<bool> on_worker{false};
        auto ev = s.create_event();
        const auto queued = std::chrono::steady_clock::now();
        std::chrono::steady_clock::time_point ran;
        ASSERT_OK(enqueue_void(s, [&] {
            ran = std::chrono::steady_clock::now();
            on_worker = s.on_worker_thread();
        }));
        ASSERT_OK(s.record(*ev));
        ASSERT_OK(ev->synchronize(10s));  // the host waits on the event, not the stream
        EXPECT_TRUE(on_worker.load());
        EXPECT_GE(ran - queued, kGrace) << "the worker did not leave the task to a caller";
        std::this_thread::sleep_for(3 * kGrace);
    }
    // A caller that gives up leaves the rest to the worker.
    std::atomic<bool> gate{false};
    ASSERT_OK(enqueue_void(s, [&] {
        while (!gate.load()) std::this_thread::sleep_for(1ms);
    }));
    bool after = false;
    ASSERT_OK(enqueue_void(s, [&] { after = true; }));
    std::thread opener([&] {
        std::this_thread::sleep_for(100ms);
        gate = true;
    });
    // The caller runs the gated task itself and outlives its deadline inside it.
    EXPECT_THAT(s.synchronize(50ms), StatusIs(StatusCode::kDeadlineExceeded));
    opener.join();
    auto ev = s.create_event();
    ASSERT_OK(s.record(*ev));
    ASSERT_OK(ev->synchronize(10s));
    EXPECT_TRUE(after);
}

TEST(CpuStream, CallerRunsErrorsStayStickyAndSelfSynchronizeIsRefused) {
    CpuStream s("caller", CpuStreamOptions{.caller_runs = true});
    Status inner;
    for (int f = 0; f < 20; ++f) {
        ASSERT_OK(s.enqueue([&] {
            inner = s.synchronize(100ms);
            return Status();
        }));
        ASSERT_OK(s.synchronize());
        EXPECT_THAT(inner, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("own worker")));
    }
    ASSERT_OK(s.enqueue([] { return Status(StatusCode::kInternal, "boom"); }));
    bool ran_after = false;
    ASSERT_OK(enqueue_void(s, [&] { ran_after = true; }));
    EXPECT_THAT(s.synchronize(), StatusIs(StatusCode::kInternal, HasSubstr("boom")));
    EXPECT_FALSE(ran_after);
}

TEST(DeviceBuffer, CpuAllocateCopyFill) {
    auto b = DeviceBuffer::allocate({DeviceKind::kCpu, 0}, 1000);
    ASSERT_OK(b);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
    std::vector<uint8_t> src(1000, 7), dst(1000, 0);
    ASSERT_OK(b->copy_from_host(src.data(), src.size()));
    ASSERT_OK(b->copy_to_host(dst.data(), dst.size()));
    EXPECT_EQ(src, dst);
    EXPECT_EQ(b->copy_from_host(src.data(), 10, 995).code(), StatusCode::kOutOfRange);
    ASSERT_OK(b->fill(0xAB));
    EXPECT_EQ(b->as<uint8_t>()[999], 0xAB);
    DeviceBuffer moved = std::move(*b);
    EXPECT_TRUE(b->empty());
    EXPECT_EQ(moved.size(), 1000u);
}

TEST(DeviceRuntime, ParseDeviceAndRegistry) {
    EXPECT_EQ(parse_device("cpu")->kind, DeviceKind::kCpu);
    auto c = parse_device("cuda:1");
    ASSERT_OK(c);
    EXPECT_EQ(c->kind, DeviceKind::kCuda);
    EXPECT_EQ(c->index, 1);
    EXPECT_EQ(parse_device("tpu").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(parse_device("cuda:x").status().code(), StatusCode::kInvalidArgument);
    auto kinds = registered_device_kinds();
    EXPECT_NE(std::find(kinds.begin(), kinds.end(), "cpu"), kinds.end());
}

}  // namespace
}  // namespace pdsim::runtime
