// Native handles of pdsim's CUDA runtime objects, for CUDA translation units (kernels, cuBLAS,
// FlashInfer adapters, NCCL) that enqueue work themselves. Needs the CUDA toolkit's headers.
//
// Thread-safety: the lookups are pure; what is enqueued on the handle follows the stream's rules
// (backends/runtime/stream.h).
#pragma once

#include <cuda_runtime.h>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::runtime::cuda {

// The cudaStream_t behind `stream`; kInvalidArgument (naming the stream) when `stream` is not a
// CudaStream. The handle stays owned by the Stream and is valid while it lives.
[[nodiscard]] StatusOr<cudaStream_t> native_stream(Stream& stream);
// The cudaEvent_t behind an event created by a CudaStream; kInvalidArgument otherwise.
[[nodiscard]] StatusOr<cudaEvent_t> native_event(Event& event);

// An event's handle and the device it was created on (CUDA has no query for the latter; a stream
// can wait on another device's event, but a transport that must refuse one needs to know).
struct NativeEvent {
    cudaEvent_t event = nullptr;
    int device = -1;
};
// As native_event, for a const Event (waiting on an event does not change it) and with its
// device; kInvalidArgument when `event` was not created by a CudaStream.
[[nodiscard]] StatusOr<NativeEvent> native_event_of(const Event& event);

// Makes `device` current for a scope (kernel launches, allocations and events go to the current
// device) and restores the caller's device afterwards. status() is kUnavailable with the CUDA
// error when the switch failed (nothing is restored then). Header-only: usable from any library.
class ScopedDevice {
public:
    explicit ScopedDevice(int device) {
        if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
        if (previous_ == device) return;
        const cudaError_t rc = cudaSetDevice(device);
        if (rc != cudaSuccess) {
            status_ = PDSIM_ERROR(StatusCode::kUnavailable, "cudaSetDevice({}) failed: {} ({})",
                                  device, cudaGetErrorString(rc), cudaGetErrorName(rc));
        } else {
            switched_ = previous_ >= 0;
        }
    }
    ~ScopedDevice() {
        if (switched_) cudaSetDevice(previous_);
    }
    ScopedDevice(const ScopedDevice&) = delete;
    ScopedDevice& operator=(const ScopedDevice&) = delete;
    [[nodiscard]] const Status& status() const { return status_; }

private:
    int previous_ = -1;
    bool switched_ = false;
    Status status_;
};

}  // namespace pdsim::runtime::cuda
