#include "common/device_health.h"

#include <array>
#include <atomic>
#include <cstddef>

#include "common/logging.h"

namespace pdsim {

namespace {

std::array<std::atomic<bool>, kMaxTrackedDevices> g_hung{};

}  // namespace

void mark_device_hung(int device, std::string_view why) {
    if (device < 0 || device >= kMaxTrackedDevices) return;
    if (!g_hung[static_cast<size_t>(device)].exchange(true, std::memory_order_acq_rel)) {
        PDSIM_LOG_WARN(
            "device {} is hung ({}): its memory is left to the process exit instead "
            "of freed, since a free would wait for the device",
            device, why);
    }
}

bool device_hung(int device) {
    return device >= 0 && device < kMaxTrackedDevices &&
           g_hung[static_cast<size_t>(device)].load(std::memory_order_acquire);
}

}  // namespace pdsim
