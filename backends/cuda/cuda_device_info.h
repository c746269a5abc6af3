// What a CUDA device is, for code that may not include the CUDA headers (the testbed's option
// checks and reports): its name, compute capability and memory. Plain C++; defined in
// cuda_device_info.cpp, built into pdsim_backends with CUDA only (callers in libraries built
// either way go through their own CUDA/non-CUDA split, e.g. sim/testbed/gpu_rank.h).
//
// Thread-safety: reentrant. Blocking: query_cuda_device() makes `index` the calling thread's
// current device for the call (restored after) and creates its primary context when there is
// none yet (tens to hundreds of milliseconds, and device memory for the context).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace pdsim::runtime::cuda {

struct CudaDeviceInfo {
    int index = 0;
    std::string name;  // cudaDeviceProp::name, e.g. "NVIDIA H200"
    int compute_major = 0;
    int compute_minor = 0;
    int64_t total_bytes = 0;  // cudaMemGetInfo
    int64_t free_bytes = 0;   // cudaMemGetInfo, at the time of the call
};

// The properties and memory of CUDA device `index`. kUnavailable "no device: ..." when the
// process sees no GPU; kInvalidArgument when index is outside [0, device count); kUnavailable
// with the CUDA error (file:line) when a CUDA call fails.
[[nodiscard]] StatusOr<CudaDeviceInfo> query_cuda_device(int index);

}  // namespace pdsim::runtime::cuda
