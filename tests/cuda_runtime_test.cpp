// The CUDA runtime and CudaStream. Skips with the runtime's reason where there is no GPU (or when
// pdsim was built without CUDA); never passes silently there.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::runtime {
namespace {

using namespace std::chrono_literals;

DeviceRuntime* cuda_or_skip() {
    auto rt = device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) return nullptr;
    if ((*rt)->device_count() == 0) return nullptr;
    return *rt;
}

std::string skip_reason() {
    auto rt = device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->unavailable_reason();
}

TEST(CudaRuntime, ReportsNoDeviceClearly) {
    auto rt = device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) GTEST_SKIP() << "built without CUDA: " << rt.status().to_string();
    if ((*rt)->device_count() > 0) GTEST_SKIP() << "a GPU is present";
    EXPECT_THAT((*rt)->unavailable_reason(), HasSubstr("no device"));
    auto buf = DeviceBuffer::allocate({DeviceKind::kCuda, 0}, 64);
    EXPECT_EQ(buf.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE((*rt)->create_stream(0, "s").ok());
}

TEST(CudaRuntime, BufferRoundTrip) {
    DeviceRuntime* rt = cuda_or_skip();
    if (rt == nullptr) GTEST_SKIP() << skip_reason();
    auto buf = DeviceBuffer::allocate({DeviceKind::kCuda, 0}, 1 << 20);
    ASSERT_OK(buf);
    std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
    ASSERT_OK(buf->copy_from_host(src.data(), src.size()));
    ASSERT_OK(buf->copy_to_host(dst.data(), dst.size()));
    EXPECT_EQ(src, dst);
    ASSERT_OK(buf->fill(0x5A));
    ASSERT_OK(buf->copy_to_host(dst.data(), dst.size()));
    EXPECT_EQ(dst[12345], 0x5A);
}

TEST(CudaStream, HostTasksRunInOrderAndErrorsAreSticky) {
    DeviceRuntime* rt = cuda_or_skip();
    if (rt == nullptr) GTEST_SKIP() << skip_reason();
    auto s = rt->create_stream(0, "cuda-test");
    ASSERT_OK(s);
    std::vector<int> order;
    std::atomic<bool> gate{false};
    ASSERT_TRUE(enqueue_void(**s, [&] {
                    while (!gate.load()) std::this_thread::yield();
                    order.push_back(0);
                }).ok());
    for (int i = 1; i < 20; ++i) ASSERT_OK(enqueue_void(**s, [&order, i] { order.push_back(i); }));
    auto ev = (*s)->create_event();
    ASSERT_NE(ev, nullptr);
    ASSERT_OK((*s)->record(*ev));
    EXPECT_FALSE(ev->query());
    gate = true;
    ASSERT_OK(ev->synchronize(10s));
    ASSERT_EQ(order.size(), 20u);
    for (int i = 0; i < 20; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
    ASSERT_OK((*s)->enqueue([] { return Status(StatusCode::kDataLoss, "boom"); }));
    int ran = 0;
    ASSERT_OK(enqueue_void(**s, [&] { ++ran; }));
    EXPECT_EQ((*s)->synchronize(10s).code(), StatusCode::kDataLoss);
    EXPECT_EQ(ran, 0);
}

// A host task captured in a graph belongs to the graph: each launch runs it again (before, the
// task freed itself after its first run, and the second launch called freed memory).
TEST(CudaStream, CapturedHostTaskRunsOnEveryLaunch) {
    DeviceRuntime* rt = cuda_or_skip();
    if (rt == nullptr) GTEST_SKIP() << skip_reason();
    auto s = rt->create_stream(0, "cuda-capture");
    ASSERT_OK(s);
    std::atomic<int> runs{0};
    ASSERT_OK((*s)->begin_capture());
    ASSERT_OK(enqueue_void(**s, [&] { runs.fetch_add(1); }));
    auto graph = (*s)->end_capture();
    ASSERT_OK(graph.status());
    EXPECT_EQ(runs.load(), 0) << "a captured task must not run at capture";
    for (int i = 0; i < 3; ++i) ASSERT_OK((*graph)->launch(**s));
    ASSERT_OK((*s)->synchronize(10s));
    EXPECT_EQ(runs.load(), 3);
    // Freed with the graph once its launches are done; the stream goes on.
    graph->reset();
    ASSERT_OK(enqueue_void(**s, [&] { runs.fetch_add(10); }));
    ASSERT_OK((*s)->synchronize(10s));
    EXPECT_EQ(runs.load(), 13);
}

// A host task that throws fails the stream (kInternal naming it) instead of ending the process
// from the driver's callback thread.
TEST(CudaStream, ThrowingHostTaskFailsTheStream) {
    DeviceRuntime* rt = cuda_or_skip();
    if (rt == nullptr) GTEST_SKIP() << skip_reason();
    auto s = rt->create_stream(0, "cuda-thrower");
    ASSERT_OK(s);
    ASSERT_OK((*s)->enqueue([]() -> Status { throw std::runtime_error("from a host task"); }));
    int ran = 0;
    ASSERT_OK(enqueue_void(**s, [&] { ++ran; }));
    EXPECT_THAT((*s)->synchronize(10s),
                StatusIs(StatusCode::kInternal, ::testing::AllOf(HasSubstr("cuda-thrower"),
                                                                 HasSubstr("from a host task"))));
    EXPECT_EQ(ran, 0);
}

}  // namespace
}  // namespace pdsim::runtime
