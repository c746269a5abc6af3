// DeviceRuntime: memory and streams of one device kind, chosen by kind from a registry, and
// DeviceBuffer, an owning, move-only allocation on a device.
//
// The CPU runtime is always registered. The CUDA runtime (backends/cuda/) is registered when pdsim
// is built with CUDA; with no GPU at run time, device_count() is 0 and every allocation fails with
// kUnavailable "no device", so GPU tests can skip with a reason.
// Thread-safety: runtimes are stateless or internally synchronized; call from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::runtime {

class DeviceRuntime {
public:
    virtual ~DeviceRuntime() = default;
    [[nodiscard]] virtual DeviceKind kind() const = 0;
    // Number of usable devices (0: "no device").
    [[nodiscard]] virtual int device_count() const = 0;
    // Why device_count() is 0, for skip messages; empty when devices exist.
    [[nodiscard]] virtual std::string unavailable_reason() const = 0;
    // Allocates `bytes` (>= 1) aligned to at least 256 bytes. Contents are unspecified.
    [[nodiscard]] virtual StatusOr<void*> allocate(size_t bytes, int index) = 0;
    virtual void deallocate(void* ptr, int index) noexcept = 0;
    // Synchronous copy between host memory and memory of this kind (either side may be host).
    [[nodiscard]] virtual Status copy(void* dst, const void* src, size_t bytes) = 0;
    [[nodiscard]] virtual Status fill(void* dst, int byte, size_t bytes) = 0;
    // As copy / fill, for memory of device `index`: a runtime with a current device per thread
    // (CUDA) makes `index` current first, so that a thread that never chose one (an engine's
    // control thread) neither creates a context on device 0 nor waits on device 0's legacy
    // stream. The defaults call copy / fill. DeviceBuffer's copies and fills use these.
    [[nodiscard]] virtual Status copy_on(int index, void* dst, const void* src, size_t bytes) {
        (void)index;
        return copy(dst, src, bytes);
    }
    [[nodiscard]] virtual Status fill_on(int index, void* dst, int byte, size_t bytes) {
        (void)index;
        return fill(dst, byte, bytes);
    }
    [[nodiscard]] virtual StatusOr<std::unique_ptr<Stream>> create_stream(int index,
                                                                          std::string name) = 0;
};

// Registers a runtime for its kind (replacing any earlier one). Called by the built-in
// registration; tests may register in-process fakes.
void register_device_runtime(std::unique_ptr<DeviceRuntime> runtime);
// The runtime of `kind`, or kUnavailable when pdsim was built without it.
[[nodiscard]] StatusOr<DeviceRuntime*> device_runtime(DeviceKind kind);
// Names of the registered kinds, e.g. {"cpu", "cuda"}.
[[nodiscard]] std::vector<std::string> registered_device_kinds();

// Parses "cpu", "cuda", "cuda:1".
[[nodiscard]] StatusOr<Device> parse_device(std::string_view text);

class DeviceBuffer {
public:
    DeviceBuffer() = default;
    ~DeviceBuffer();
    DeviceBuffer(DeviceBuffer&& other) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    [[nodiscard]] static StatusOr<DeviceBuffer> allocate(Device device, size_t bytes);

    [[nodiscard]] void* data() const { return ptr_; }
    template <typename T>
    [[nodiscard]] T* as() const {
        return static_cast<T*>(ptr_);
    }
    [[nodiscard]] size_t size() const { return bytes_; }
    [[nodiscard]] Device device() const { return device_; }
    [[nodiscard]] bool empty() const { return ptr_ == nullptr; }

    // Synchronous copies to and from host memory.
    [[nodiscard]] Status copy_from_host(const void* src, size_t bytes, size_t offset = 0);
    [[nodiscard]] Status copy_to_host(void* dst, size_t bytes, size_t offset = 0) const;
    [[nodiscard]] Status fill(int byte);

private:
    void reset() noexcept;

    Device device_{};
    DeviceRuntime* runtime_ = nullptr;
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

// The built-in CPU runtime (also registered by default).
std::unique_ptr<DeviceRuntime> make_cpu_runtime();

}  // namespace pdsim::runtime
