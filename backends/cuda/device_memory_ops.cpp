// Stream-ordered device memory operations behind a plain C++ header (see device_memory_ops.h).
#include "backends/cuda/device_memory_ops.h"

#include <cuda_runtime.h>

#include "backends/cuda/cuda_stream.h"
#include "common/cuda_check.h"

namespace pdsim::runtime::cuda {

Status enqueue_device_fill(Stream& stream, void* dst, int byte, size_t bytes) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t native, native_stream(stream));
    if (byte < 0 || byte > 255) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "device fill: byte {} outside [0, 255]",
                           byte);
    }
    if (bytes == 0) return {};
    if (dst == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "device fill: null destination of {} bytes", bytes);
    }
    ScopedDevice device(stream.device().index);
    PDSIM_RETURN_IF_ERROR(device.status());
    CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, native));
    return {};
}

}  // namespace pdsim::runtime::cuda
