#include "backends/cuda/cuda_pinned_memory.h"

#include <cuda_runtime.h>

#include <chrono>
#include <thread>

#include "common/cuda_check.h"
#include "common/device_health.h"

namespace pdsim::attn::cuda {

namespace {

class CudaPinnedMemory final : public PinnedMemory {
public:
    explicit CudaPinnedMemory(int device) : device_(device) {}

    [[nodiscard]] StatusOr<void*> allocate_pinned(size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(use_device());
        void* p = nullptr;
        CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
        return p;
    }
    void free_pinned(void* ptr) noexcept override {
        // cudaFreeHost waits for the device: on a hung one it would never return.
        if (device_ >= 0 && device_hung(device_)) return;
        cudaFreeHost(ptr);
    }
    [[nodiscard]] StatusOr<void*> create_event() override {
        PDSIM_RETURN_IF_ERROR(use_device());
        cudaEvent_t ev = nullptr;
        CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        return static_cast<void*>(ev);
    }
    void destroy_event(void* event) noexcept override {
        cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
    [[nodiscard]] Status record_event(void* event, void* stream) override {
        CUDA_CHECK(
            cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
        return {};
    }
    [[nodiscard]] StatusOr<bool> query_event(void* event) override {
        const cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event));
        if (rc == cudaSuccess) return true;
        if (rc == cudaErrorNotReady) return false;
        CUDA_CHECK(rc);
        return false;
    }
    [[nodiscard]] Status wait_event(void* event, std::chrono::milliseconds timeout) override {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            PDSIM_ASSIGN_OR_RETURN(bool done, query_event(event));
            if (done) return {};
            // A hung GPU will not get there: do not spend the timeout (a staging ring's
            // destructor waits once per slot in flight).
            if (std::chrono::steady_clock::now() >= deadline ||
                (device_ >= 0 && device_hung(device_))) {
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "CUDA event not reached after {} ms", timeout.count());
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }

private:
    Status use_device() const {
        if (device_ >= 0) CUDA_CHECK(cudaSetDevice(device_));
        return {};
    }

    int device_;
};

}  // namespace

std::unique_ptr<PinnedMemory> make_cuda_pinned_memory(int device) {
    return std::make_unique<CudaPinnedMemory>(device);
}

}  // namespace pdsim::attn::cuda
