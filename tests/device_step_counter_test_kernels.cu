// Test kernels for device_step_counter_test.cpp (contracts: device_step_counter_test_kernels.h).
#include <cuda/atomic>

#include "tests/device_step_counter_test_kernels.h"

namespace pdsim::pd::test_kernels {

namespace {

__device__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_then_fill_kernel(const uint32_t* release, uint32_t* dst, size_t n,
                                      uint32_t value, uint64_t timeout_ns) {
    __shared__ uint32_t fill;
    if (threadIdx.x == 0) {
        // A system-scope acquire load: every poll observes the host's latest store (a plain or
        // volatile load carries no such guarantee for host memory).
        ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> flag(
            *const_cast<uint32_t*>(release));
        const uint64_t start = global_timer_ns();
        fill = value;
        while (flag.load(::cuda::memory_order_acquire) == 0) {
            if (global_timer_ns() - start > timeout_ns) {
                fill = ~value;
                break;
            }
            __nanosleep(1000);
        }
    }
    __syncthreads();
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = fill;
}

__global__ void busy_wait_kernel(uint64_t nanoseconds) {
    const uint64_t start = global_timer_ns();
    while (global_timer_ns() - start < nanoseconds) {
    }
}

}  // namespace

cudaError_t launch_spin_then_fill(cudaStream_t stream, const uint32_t* release, uint32_t* dst,
                                  size_t n, uint32_t value, uint64_t timeout_ns) {
    spin_then_fill_kernel<<<1, 1024, 0, stream>>>(release, dst, n, value, timeout_ns);
    return cudaGetLastError();
}

cudaError_t launch_busy_wait(cudaStream_t stream, uint64_t nanoseconds) {
    busy_wait_kernel<<<1, 1, 0, stream>>>(nanoseconds);
    return cudaGetLastError();
}

}  // namespace pdsim::pd::test_kernels
