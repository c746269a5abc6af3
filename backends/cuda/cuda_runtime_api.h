// Entry points of the CUDA part of the backends library (compiled only when pdsim is built with
// CUDA). Plain C++: no CUDA headers, so any translation unit may include it.
#pragma once

#include <memory>
#include <string>

#include "backends/runtime/device.h"

namespace pdsim::runtime::cuda {

// The CUDA DeviceRuntime: cudaMalloc'd memory, CudaStream streams. With no GPU (or no driver) at
// run time, device_count() is 0 and unavailable_reason() says why.
std::unique_ptr<DeviceRuntime> make_cuda_runtime();

// A CudaStream on device `index` (see backends/runtime/stream.h for the contract). Tasks enqueued
// with enqueue() run as host functions (cudaLaunchHostFunc) in stream order; one enqueued while
// capturing belongs to the graph, runs on every launch of it and reports its failure into the
// error of the stream that captured it.
// Destroying one waits (bounded, 30 s) for its work; past that the device is marked hung
// (common/device_health.h) and the stream is destroyed without waiting. That is the trade made
// against blocking forever: work that resumes later runs on alone and may touch memory its owner
// has freed by then, and the mark holds for the rest of the process (later frees on that GPU
// leak).
StatusOr<std::unique_ptr<Stream>> make_cuda_stream(int index, std::string name);

}  // namespace pdsim::runtime::cuda
