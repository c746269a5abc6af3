// common/device_health.h: which devices this process gave up waiting for.
#include "common/device_health.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace pdsim {
namespace {

// Marks stick for the process and only for the device marked; devices outside the tracked range
// are never hung. (Each test binary is its own process: device 7 is marked by nothing else here.)
TEST(DeviceHealth, AMarkedDeviceStaysHungAndOnlyIt) {
    EXPECT_FALSE(device_hung(7));
    EXPECT_FALSE(device_hung(8));
    mark_device_hung(7, "a test's stream");
    EXPECT_TRUE(device_hung(7));
    EXPECT_FALSE(device_hung(8));
    mark_device_hung(7, "again: logs nothing more");
    EXPECT_TRUE(device_hung(7));
    mark_device_hung(-1, "ignored");
    mark_device_hung(kMaxTrackedDevices, "ignored");
    EXPECT_FALSE(device_hung(-1));
    EXPECT_FALSE(device_hung(kMaxTrackedDevices));
}

// Concurrent marks and queries (run under TSan with the unit label).
TEST(DeviceHealth, ConcurrentMarksAndQueries) {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([t] {
            for (int i = 0; i < 1000; ++i) {
                mark_device_hung(20 + (i + t) % 4, "concurrent");
                (void)device_hung(20 + i % 8);
            }
        });
    }
    for (std::thread& th : threads) th.join();
    for (int d = 20; d < 24; ++d) EXPECT_TRUE(device_hung(d));
    for (int d = 24; d < 28; ++d) EXPECT_FALSE(device_hung(d));
}

}  // namespace
}  // namespace pdsim
