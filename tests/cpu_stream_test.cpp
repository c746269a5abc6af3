#include "backends/runtime/cpu_stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::runtime {
namespace {

using namespace std::chrono_literals;

TEST(CpuStream, RunsInOrderAsynchronously) {
    CpuStream s("t");
    std::vector<int> order;
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                    order.push_back(0);
                }).ok());
    for (int i = 1; i < 100; ++i)
        ASSERT_TRUE(enqueue_void(s, [&order, i] { order.push_back(i); }).ok());
    // enqueue returned while the first task is still blocked: asynchronous to the host.
    EXPECT_TRUE(order.empty());
    gate = true;
    ASSERT_TRUE(s.synchronize().ok());
    ASSERT_EQ(order.size(), 100u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

TEST(CpuStream, ErrorIsStickyAndSkipsLaterWork) {
    CpuStream s("t");
    int ran = 0;
    ASSERT_TRUE(s.enqueue([] { return Status(StatusCode::kDataLoss, "boom"); }).ok());
    ASSERT_TRUE(enqueue_void(s, [&] { ++ran; }).ok());
    Status st = s.synchronize();
    EXPECT_THAT(st, StatusIs(StatusCode::kDataLoss, HasSubstr("boom")));
    EXPECT_EQ(ran, 0);
    EXPECT_EQ(s.error().code(), StatusCode::kDataLoss);
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
    EXPECT_TRUE(s.synchronize().ok());
}

TEST(CpuStream, EventQueryAndHostSynchronize) {
    CpuStream s("t");
    auto ev = s.create_event();
    EXPECT_TRUE(ev->query());  // never recorded
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                }).ok());
    ASSERT_TRUE(s.record(*ev).ok());
    EXPECT_FALSE(ev->query());
    EXPECT_EQ(ev->synchronize(20ms).code(), StatusCode::kDeadlineExceeded);
    gate = true;
    EXPECT_TRUE(ev->synchronize().ok());
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
    ASSERT_TRUE(producer.record(*ev).ok());
    ASSERT_TRUE(consumer.wait(*ev).ok());
    int seen = -1;
    ASSERT_TRUE(enqueue_void(consumer, [&] { seen = value.load(); }).ok());
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(seen, -1);  // consumer is held back by the event
    gate = true;
    ASSERT_TRUE(consumer.synchronize().ok());
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
    ASSERT_TRUE(producer.record(*ev).ok());
    ASSERT_TRUE(consumer.wait(*ev).ok());
    Status st = consumer.synchronize();
    EXPECT_THAT(st, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("timed out")));
    gate = true;
    EXPECT_TRUE(producer.synchronize().ok());
}

TEST(CpuStream, GraphCaptureDefersAndReplaysReadingBuffersAtRunTime) {
    CpuStream s("t");
    int input = 1;
    std::vector<int> outputs;
    ASSERT_TRUE(s.begin_capture().ok());
    EXPECT_TRUE(s.is_capturing());
    ASSERT_TRUE(enqueue_void(s, [&] { outputs.push_back(input * 10); }).ok());
    auto ev = s.create_event();
    ASSERT_TRUE(s.record(*ev).ok());
    auto g = s.end_capture();
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE(s.synchronize().ok());
    EXPECT_TRUE(outputs.empty());  // captured, not run
    EXPECT_EQ((*g)->num_nodes(), 2u);
    ASSERT_TRUE((*g)->launch(s).ok());
    ASSERT_TRUE(ev->synchronize().ok());
    input = 2;  // in-place update between replays
    ASSERT_TRUE((*g)->launch(s).ok());
    ASSERT_TRUE(s.synchronize().ok());
    EXPECT_EQ(outputs, (std::vector<int>{10, 20}));
    EXPECT_EQ(s.begin_capture().code(), StatusCode::kOk);
    EXPECT_EQ(s.begin_capture().code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE(s.end_capture().ok());
    EXPECT_EQ(s.end_capture().status().code(), StatusCode::kFailedPrecondition);
}

TEST(CpuStream, ReplayedRecordIsNotVisibleBeforeItRuns) {
    CpuStream s("t");
    auto ev = s.create_event();
    std::atomic<bool> gate{false};
    ASSERT_TRUE(s.begin_capture().ok());
    ASSERT_TRUE(enqueue_void(s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                }).ok());
    ASSERT_TRUE(s.record(*ev).ok());
    auto g = s.end_capture();
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE((*g)->launch(s).ok());
    EXPECT_FALSE(ev->query());
    gate = true;
    EXPECT_TRUE(ev->synchronize().ok());
}

TEST(DeviceBuffer, CpuAllocateCopyFill) {
    auto b = DeviceBuffer::allocate({DeviceKind::kCpu, 0}, 1000);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
    std::vector<uint8_t> src(1000, 7), dst(1000, 0);
    ASSERT_TRUE(b->copy_from_host(src.data(), src.size()).ok());
    ASSERT_TRUE(b->copy_to_host(dst.data(), dst.size()).ok());
    EXPECT_EQ(src, dst);
    EXPECT_EQ(b->copy_from_host(src.data(), 10, 995).code(), StatusCode::kOutOfRange);
    ASSERT_TRUE(b->fill(0xAB).ok());
    EXPECT_EQ(b->as<uint8_t>()[999], 0xAB);
    DeviceBuffer moved = std::move(*b);
    EXPECT_TRUE(b->empty());
    EXPECT_EQ(moved.size(), 1000u);
}

TEST(DeviceRuntime, ParseDeviceAndRegistry) {
    EXPECT_EQ(parse_device("cpu")->kind, DeviceKind::kCpu);
    auto c = parse_device("cuda:1");
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->kind, DeviceKind::kCuda);
    EXPECT_EQ(c->index, 1);
    EXPECT_EQ(parse_device("tpu").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(parse_device("cuda:x").status().code(), StatusCode::kInvalidArgument);
    auto kinds = registered_device_kinds();
    EXPECT_NE(std::find(kinds.begin(), kinds.end(), "cpu"), kinds.end());
}

}  // namespace
}  // namespace pdsim::runtime
