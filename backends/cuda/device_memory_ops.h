// Stream-ordered operations on device memory for code that may not include the CUDA headers (the
// testbed's GPU rank, sim/testbed/gpu_rank.h, plants its `late-write` fault with it). Plain C++;
// defined in device_memory_ops.cpp, built into pdsim_backends with CUDA only.
//
// Thread-safety: as the stream's enqueue (backends/runtime/stream.h): work enqueued from one thread
// runs in that thread's order. Blocking: never waits for the device.
#pragma once

#include <cstddef>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::runtime::cuda {

// Enqueues, on `stream` (a CudaStream), a fill of `bytes` bytes at `dst` (device memory of the
// stream's device) with `byte`: a cudaMemsetAsync, after everything enqueued before it and before
// everything enqueued after (captured into a graph while the stream captures). bytes == 0
// enqueues nothing. kInvalidArgument: not a CUDA stream, a null `dst` with bytes > 0, or `byte`
// outside [0, 255]; kUnavailable with the CUDA error (file:line) when the enqueue fails (a bad
// address surfaces on the stream, at its next synchronize).
[[nodiscard]] Status enqueue_device_fill(Stream& stream, void* dst, int byte, size_t bytes);

}  // namespace pdsim::runtime::cuda
