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

}  // namespace pdsim::runtime::cuda
