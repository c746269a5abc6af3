// Test kernels for device_step_counter_test.cpp (device_step_counter_test_kernels.cu): a slow
// "KV write" the host releases, and a timed busy wait. CUDA runtime types only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pdsim::pd::test_kernels {

// One block: thread 0 polls *release (pinned mapped host memory, device address) until it is
// non-zero, then the block fills dst[0..n) with `value`. A backstop: after `timeout_ns` without a
// release it fills with ~value instead, so a test that never releases fails instead of hanging.
cudaError_t launch_spin_then_fill(cudaStream_t stream, const uint32_t* release, uint32_t* dst,
                                  size_t n, uint32_t value, uint64_t timeout_ns);

// One thread busy-waits `nanoseconds` on the GPU's global timer.
cudaError_t launch_busy_wait(cudaStream_t stream, uint64_t nanoseconds);

}  // namespace pdsim::pd::test_kernels
