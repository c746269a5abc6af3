// RawDeviceCopy over cudart (compiled only when pdsim is built with CUDA).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "common/cuda_check.h"
#include "sim/cli/raw_device_copy.h"

namespace pdsim::cli {

namespace {

class CudaRawDeviceCopy final : public RawDeviceCopy {
public:
    explicit CudaRawDeviceCopy(int device) : device_(device) {}
    ~CudaRawDeviceCopy() override {
        if (stream_ != nullptr) {
            cudaStreamSynchronize(stream_);
            cudaStreamDestroy(stream_);
        }
        for (cudaEvent_t e : events_) cudaEventDestroy(e);
    }

    Status init() {
        CUDA_CHECK(cudaSetDevice(device_));
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        return {};
    }

    StatusOr<double> run(void* dst, const void* src, size_t bytes, size_t messages,
                         int window) override {
        if (window < 1) return Status(StatusCode::kInvalidArgument, "raw device copy: window < 1");
        const auto w = static_cast<size_t>(window);
        CUDA_CHECK(cudaSetDevice(device_));
        while (events_.size() < w) {
            cudaEvent_t e = nullptr;
            CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            events_.push_back(e);
        }
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        auto* out = static_cast<uint8_t*>(dst);
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t k = 0; k < messages; ++k) {
            cudaEvent_t ev = events_[k % w];
            if (k >= w) CUDA_CHECK(cudaEventSynchronize(ev));
            CUDA_CHECK(cudaMemcpyAsync(out + (k % w) * bytes, src, bytes, cudaMemcpyDeviceToDevice,
                                       stream_));
            CUDA_CHECK(cudaEventRecord(ev, stream_));
        }
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }

private:
    const int device_;
    cudaStream_t stream_ = nullptr;
    std::vector<cudaEvent_t> events_;
};

}  // namespace

StatusOr<std::unique_ptr<RawDeviceCopy>> make_raw_device_copy(int device) {
    auto c = std::make_unique<CudaRawDeviceCopy>(device);
    PDSIM_RETURN_IF_ERROR(c->init());
    return std::unique_ptr<RawDeviceCopy>(std::move(c));
}

}  // namespace pdsim::cli
