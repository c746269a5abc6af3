// The CUDA StepCounter's record kernel (contract: device_step_counter_launch.h; the host side is
// device_step_counter.cpp). Only the CUDA runtime and libcu++ are included here.
#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/atomic>

#include "backends/cuda/device_step_counter_launch.h"

namespace pdsim::pd::cuda::detail {

namespace {

// One record: counter += 1, then publish the new value to the host mirror.
//
// Ordering. Stream order makes every write of the kernels enqueued before this one happen-before
// this thread (kernel boundaries on a stream are synchronizing). The release RMW orders them
// before the new counter value, which device-side waiters (cuStreamWaitValue64 gates on other
// streams) compare against; the system-scope release store orders them, and the counter, before
// the mirror value for any host thread that acquire-loads it (StepCounter::query_*). We use
// cuda::atomic_ref (atom.add.release.sys / st.release.sys in PTX) rather than
// __threadfence_system() followed by a volatile store: the same order on this hardware, but
// stated in the CUDA memory model instead of by convention. The mirror is only stored, never
// RMW'd (host-memory atomics would need hostNativeAtomicSupported); an aligned 8-byte store
// reaches the host untorn, and pinned memory is cache-coherent with the CPU.
//
// Replays. It reads and increments, never writes a constant: a record captured into a CUDA graph
// counts again on every replay.
__global__ void record_step_kernel(uint64_t* counter, uint64_t* mirror) {
    ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> device_counter(*counter);
    const uint64_t published = device_counter.fetch_add(1, ::cuda::memory_order_release) + 1;
    ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> host_mirror(*mirror);
    host_mirror.store(published, ::cuda::memory_order_release);
}

}  // namespace

cudaError_t launch_record_step(cudaStream_t stream, uint64_t* counter, uint64_t* mirror) {
    void* args[] = {&counter, &mirror};
    // cudaLaunchKernel returns this launch's error (not a stale one, as cudaGetLastError could).
    return cudaLaunchKernel(reinterpret_cast<const void*>(&record_step_kernel), dim3(1), dim3(1),
                            args, 0, stream);
}

cudaError_t preload_record_step() {
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&record_step_kernel));
}

}  // namespace pdsim::pd::cuda::detail
