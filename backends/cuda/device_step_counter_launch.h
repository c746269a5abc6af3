// The record kernel of the CUDA StepCounter (device_step_counter.cu) and its launchers, for the
// host code in device_step_counter.cpp. Only the CUDA runtime's types: nvcc compiles the kernel
// without fmt or Status (fmt's headers do not survive nvcc's front end).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdsim::pd::cuda::detail {

// Enqueues one record on `stream`: *counter += 1 (system-scope release RMW), then a system-scope
// release store of the new value to *mirror (the device address of pinned mapped host memory).
// Returns the launch's error.
cudaError_t launch_record_step(cudaStream_t stream, uint64_t* counter, uint64_t* mirror);

// Loads the record kernel on the current device now, so that lazy module loading does not run at
// the first record (which may be inside a graph capture).
cudaError_t preload_record_step();

}  // namespace pdsim::pd::cuda::detail
