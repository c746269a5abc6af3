// HostBackedCudaRuntime: a fake runtime::DeviceKind::kCuda runtime whose memory is host memory,
// so that tests without a GPU can build pools (and KV layouts) that claim to be on a CUDA device:
// to check that host-only paths refuse them, or to run code that only does address arithmetic
// on device memory (the transfer engine's one-sided writes) over a transport that copies host
// memory. Installing it replaces the process's CUDA runtime (a test binary that installs it
// must not need a real GPU elsewhere).
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "common/status.h"

namespace pdsim::runtime::testing {

// Makes DeviceKind::kCuda allocate host memory in this process (no GPU needed), so tests
// can build pools that claim to be on a CUDA device and check that host paths reject them. The
// built-in runtimes are registered first, so the fake is never replaced. Idempotent.
class HostBackedCudaRuntime final : public DeviceRuntime {
public:
    [[nodiscard]] DeviceKind kind() const override { return DeviceKind::kCuda; }
    [[nodiscard]] int device_count() const override { return 1; }
    [[nodiscard]] std::string unavailable_reason() const override { return {}; }
    [[nodiscard]] StatusOr<void*> allocate(size_t bytes, int /*index*/) override {
        return make_cpu_runtime()->allocate(bytes, 0);
    }
    void deallocate(void* ptr, int /*index*/) noexcept override { std::free(ptr); }
    [[nodiscard]] Status copy(void* dst, const void* src, size_t bytes) override {
        if (bytes != 0) std::memcpy(dst, src, bytes);
        return {};
    }
    [[nodiscard]] Status fill(void* dst, int byte, size_t bytes) override {
        if (bytes != 0) std::memset(dst, byte, bytes);
        return {};
    }
    [[nodiscard]] StatusOr<std::unique_ptr<Stream>> create_stream(int /*index*/,
                                                                  std::string name) override {
        return std::unique_ptr<Stream>(std::make_unique<CpuStream>(std::move(name)));
    }
};

inline void install_host_backed_cuda_runtime() {
    static const bool installed = [] {
        (void)device_runtime(DeviceKind::kCpu);  // built-ins first
        register_device_runtime(std::make_unique<HostBackedCudaRuntime>());
        return true;
    }();
    (void)installed;
}

}  // namespace pdsim::runtime::testing
