#include "backends/runtime/device.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "backends/runtime/cpu_stream.h"

namespace pdsim::runtime {

namespace {

class CpuRuntime final : public DeviceRuntime {
public:
    [[nodiscard]] DeviceKind kind() const override { return DeviceKind::kCpu; }
    [[nodiscard]] int device_count() const override { return 1; }
    [[nodiscard]] std::string unavailable_reason() const override { return {}; }
    [[nodiscard]] StatusOr<void*> allocate(size_t bytes, int index) override {
        if (index != 0)
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "cpu device index {} (only 0)", index);
        if (bytes == 0) bytes = 1;
        constexpr size_t kAlign = 4096;  // page-aligned: SIMD-friendly, friendly to registration
        void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
        if (p == nullptr) {
            return PDSIM_ERROR(StatusCode::kResourceExhausted, "host allocation of {} bytes failed",
                               bytes);
        }
        return p;
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
        if (index != 0)
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "cpu device index {} (only 0)", index);
        return std::unique_ptr<Stream>(std::make_unique<CpuStream>(std::move(name)));
    }
};

struct Registry {
    std::mutex mu;
    std::map<DeviceKind, std::unique_ptr<DeviceRuntime>> runtimes;
};

Registry& registry() {
    static Registry* r = [] {
        auto* reg = new Registry();
        reg->runtimes[DeviceKind::kCpu] = make_cpu_runtime();
        return reg;
    }();
    return *r;
}

}  // namespace

void register_builtin_device_runtimes();  // backends/builtin.cpp

namespace {
void ensure_builtin_runtimes() {
    static std::once_flag once;
    std::call_once(once, [] { register_builtin_device_runtimes(); });
}
}  // namespace

std::unique_ptr<DeviceRuntime> make_cpu_runtime() {
    return std::make_unique<CpuRuntime>();
}

void register_device_runtime(std::unique_ptr<DeviceRuntime> runtime) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    DeviceKind k = runtime->kind();
    r.runtimes[k] = std::move(runtime);
}

StatusOr<DeviceRuntime*> device_runtime(DeviceKind kind) {
    ensure_builtin_runtimes();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.runtimes.find(kind);
    if (it == r.runtimes.end()) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "device kind '{}' is not built into this pdsim", device_kind_name(kind));
    }
    return it->second.get();
}

std::vector<std::string> registered_device_kinds() {
    ensure_builtin_runtimes();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::vector<std::string> out;
    for (auto& [k, v] : r.runtimes) out.emplace_back(device_kind_name(k));
    return out;
}

StatusOr<Device> parse_device(std::string_view text) {
    std::string_view kind = text;
    int index = 0;
    if (auto colon = text.find(':'); colon != std::string_view::npos) {
        kind = text.substr(0, colon);
        std::string idx(text.substr(colon + 1));
        char* end = nullptr;
        long v = std::strtol(idx.c_str(), &end, 10);
        if (idx.empty() || *end != '\0' || v < 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "bad device index in '{}'", text);
        }
        index = static_cast<int>(v);
    }
    if (kind == "cpu") return Device{DeviceKind::kCpu, index};
    if (kind == "cuda") return Device{DeviceKind::kCuda, index};
    return PDSIM_ERROR(StatusCode::kInvalidArgument,
                       "unknown device '{}' (expected cpu or cuda[:N])", text);
}

DeviceBuffer::~DeviceBuffer() {
    reset();
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_), runtime_(other.runtime_), ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
    other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
        reset();
        device_ = other.device_;
        runtime_ = other.runtime_;
        ptr_ = other.ptr_;
        bytes_ = other.bytes_;
        other.ptr_ = nullptr;
        other.bytes_ = 0;
    }
    return *this;
}

void DeviceBuffer::reset() noexcept {
    if (ptr_ != nullptr && runtime_ != nullptr) runtime_->deallocate(ptr_, device_.index);
    ptr_ = nullptr;
    bytes_ = 0;
}

StatusOr<DeviceBuffer> DeviceBuffer::allocate(Device device, size_t bytes) {
    PDSIM_ASSIGN_OR_RETURN(DeviceRuntime * rt, device_runtime(device.kind));
    PDSIM_ASSIGN_OR_RETURN(void* p, rt->allocate(bytes, device.index));
    DeviceBuffer b;
    b.device_ = device;
    b.runtime_ = rt;
    b.ptr_ = p;
    b.bytes_ = bytes;
    return b;
}

Status DeviceBuffer::copy_from_host(const void* src, size_t bytes, size_t offset) {
    if (offset + bytes > bytes_) {
        return PDSIM_ERROR(StatusCode::kOutOfRange, "copy of {} bytes at {} into a {}-byte buffer",
                           bytes, offset, bytes_);
    }
    return runtime_->copy_on(device_.index, static_cast<char*>(ptr_) + offset, src, bytes);
}

Status DeviceBuffer::copy_to_host(void* dst, size_t bytes, size_t offset) const {
    if (offset + bytes > bytes_) {
        return PDSIM_ERROR(StatusCode::kOutOfRange, "copy of {} bytes at {} from a {}-byte buffer",
                           bytes, offset, bytes_);
    }
    return runtime_->copy_on(device_.index, dst, static_cast<const char*>(ptr_) + offset, bytes);
}

Status DeviceBuffer::fill(int byte) {
    if (ptr_ == nullptr) return {};
    return runtime_->fill_on(device_.index, ptr_, byte, bytes_);
}

}  // namespace pdsim::runtime
