// CUDA device properties behind a plain C++ header (see cuda_device_info.h).
#include "backends/cuda/cuda_device_info.h"

#include <cuda_runtime.h>

#include "backends/cuda/cuda_stream.h"
#include "common/cuda_check.h"

namespace pdsim::runtime::cuda {

StatusOr<CudaDeviceInfo> query_cuda_device(int index) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count == 0) {
        cudaGetLastError();  // clear the sticky "no device" of the runtime
        return PDSIM_ERROR(StatusCode::kUnavailable, "no device: {}",
                           rc != cudaSuccess ? cudaGetErrorString(rc) : "no CUDA GPU visible");
    }
    if (index < 0 || index >= count) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "cuda device {}: this process sees {}",
                           index, count);
    }
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    ScopedDevice device(index);
    PDSIM_RETURN_IF_ERROR(device.status());
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    CudaDeviceInfo info;
    info.index = index;
    info.name = prop.name;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    info.total_bytes = static_cast<int64_t>(total_bytes);
    info.free_bytes = static_cast<int64_t>(free_bytes);
    return info;
}

}  // namespace pdsim::runtime::cuda
