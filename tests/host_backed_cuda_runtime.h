// HostBackedCudaRuntime: a fake runtime::DeviceKind::kCuda runtime whose memory is host memory,
// so that tests without a GPU can build pools (and KV layouts) that claim to be on a CUDA device:
// to check that host-only paths refuse them, or to run code that only does address arithmetic
// on device memory (the transfer engine's one-sided writes) over a transport that copies host
// memory, or that runs stand-in device ops on streams of the fake device (HostBackedCudaStream).
// Installing it replaces the process's CUDA runtime (a test binary that installs it must not need a
// real GPU elsewhere).
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "common/status.h"

namespace pdsim::runtime::testing {

// A stream of the fake device: a CpuStream (one worker thread, CPU events) that reports the fake
// CUDA device, as a CudaStream of that device does. A graph captured on it cannot be launched
// (CPU graphs launch on CPU streams only).
class HostBackedCudaStream final : public Stream {
public:
    HostBackedCudaStream(int index, std::string name) : index_(index), inner_(std::move(name)) {}

    [[nodiscard]] Device device() const override { return {DeviceKind::kCuda, index_}; }
    [[nodiscard]] std::string name() const override { return inner_.name(); }
    [[nodiscard]] Status enqueue(Task task) override { return inner_.enqueue(std::move(task)); }
    [[nodiscard]] std::unique_ptr<Event> create_event() override { return inner_.create_event(); }
    [[nodiscard]] Status record(Event& event) override { return inner_.record(event); }
    [[nodiscard]] Status wait(Event& event) override { return inner_.wait(event); }
    [[nodiscard]] Status synchronize(
        std::chrono::milliseconds timeout = kDefaultWaitTimeout) override {
        return inner_.synchronize(timeout);
    }
    [[nodiscard]] Status error() const override { return inner_.error(); }
    [[nodiscard]] Status begin_capture() override { return inner_.begin_capture(); }
    [[nodiscard]] StatusOr<std::unique_ptr<Graph>> end_capture() override {
        return inner_.end_capture();
    }
    [[nodiscard]] bool is_capturing() const override { return inner_.is_capturing(); }

private:
    const int index_;
    CpuStream inner_;
};

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
    [[nodiscard]] StatusOr<std::unique_ptr<Stream>> create_stream(int index,
                                                                  std::string name) override {
        return std::unique_ptr<Stream>(
            std::make_unique<HostBackedCudaStream>(index, std::move(name)));
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
