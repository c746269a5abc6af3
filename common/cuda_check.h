// CUDA_CHECK / NCCL_CHECK: turn a failing CUDA runtime or NCCL call into a Status with the call,
// the library's error string and file:line, returned from the enclosing function.
// Include only from *.cu files or translation units compiled with the CUDA toolkit on the include
// path (backends/cuda/, transfer/nccl/).
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"

#define CUDA_CHECK(call)                                                                       \
    do {                                                                                       \
        cudaError_t pdsim_cuda_rc_ = (call);                                                   \
        if (pdsim_cuda_rc_ != cudaSuccess) [[unlikely]]                                        \
            return PDSIM_ERROR(::pdsim::StatusCode::kUnavailable, "{} failed: {} ({})", #call, \
                               cudaGetErrorString(pdsim_cuda_rc_),                             \
                               cudaGetErrorName(pdsim_cuda_rc_));                              \
    } while (0)
