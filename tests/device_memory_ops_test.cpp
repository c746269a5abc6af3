// runtime::cuda::enqueue_device_fill (backends/cuda/device_memory_ops.h), the stream-ordered fill
// the testbed's GPU ranks plant their late-write fault with: the bytes it writes, in stream order,
// and its refusals. Label cuda: the fills skip with the runtime's reason where there is no GPU; the
// refusal of a stream that is not a CUDA stream runs in any CUDA build.
#include "backends/cuda/device_memory_ops.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::runtime::cuda {
namespace {

using ::testing::HasSubstr;

TEST(DeviceFill, RefusesAStreamThatIsNotCuda) {
    CpuStream cpu("not-cuda");
    std::vector<uint8_t> host(16, 0);
    EXPECT_THAT(enqueue_device_fill(cpu, host.data(), 0x5A, host.size()),
                StatusIs(StatusCode::kInvalidArgument));
    ASSERT_OK(cpu.synchronize());
    EXPECT_EQ(host, std::vector<uint8_t>(16, 0));
}

TEST(DeviceFill, WritesItsBytesInStreamOrder) {
    auto rt = device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) GTEST_SKIP() << rt.status().to_string();
    if ((*rt)->device_count() == 0) GTEST_SKIP() << (*rt)->unavailable_reason();
    auto stream = (*rt)->create_stream(0, "fill");
    ASSERT_OK(stream);
    constexpr size_t kBytes = 4096;
    auto buf = DeviceBuffer::allocate({DeviceKind::kCuda, 0}, kBytes);
    ASSERT_OK(buf);
    ASSERT_OK(buf->fill(0x11));  // poison
    auto* base = buf->as<uint8_t>();
    // Two overlapping fills: the second lands after the first.
    ASSERT_OK(enqueue_device_fill(**stream, base + 100, 0x5A, 200));
    ASSERT_OK(enqueue_device_fill(**stream, base + 150, 0x33, 10));
    ASSERT_OK(enqueue_device_fill(**stream, base + 1000, 0x77, 0));  // nothing
    ASSERT_OK((*stream)->synchronize());
    std::vector<uint8_t> want(kBytes, 0x11);
    for (size_t i = 100; i < 300; ++i) want[i] = 0x5A;
    for (size_t i = 150; i < 160; ++i) want[i] = 0x33;
    std::vector<uint8_t> got(kBytes, 0);
    ASSERT_OK(buf->copy_to_host(got.data(), got.size()));
    EXPECT_EQ(got, want);
    EXPECT_THAT(enqueue_device_fill(**stream, base, 256, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("byte 256")));
    EXPECT_THAT(enqueue_device_fill(**stream, nullptr, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("null destination")));
}

}  // namespace
}  // namespace pdsim::runtime::cuda
