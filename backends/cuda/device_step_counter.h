// The CUDA implementation of pd::StepCounter (contract: backends/pd/step_counter.h), registered
// for CUDA streams by backends/builtin.cpp. Plain C++: no CUDA headers, so any translation unit
// may include it.
//
// Per counter (cache, aux):
//  - the raw counter, a uint64 in device memory, and its mirror in pinned, mapped host memory
//    (cudaHostAlloc(cudaHostAllocMapped); the kernel writes it through
//    cudaHostGetDevicePointer's pointer). The seed is copied onto the device synchronously at
//    construction (independently of the compute stream, which may be busy).
//  - record: a <<<1, 1>>> kernel (device_step_counter.cu) on the compute stream: atomically
//    counter += 1 (system-scope release), then a system-scope release store of the new value to
//    the mirror. It reads and increments, never writes a constant, so a captured record counts
//    again on every replay.
//  - host queries and waits: acquire loads of the mirror; a wait spins (yielding) for 200 us,
//    then sleeps 20 us between polls, up to its deadline.
//  - a ring of kEventRingCapacity events: after each eager record (exact bookkeeping, see
//    pd::GateInputs) the event of slot raw % capacity is recorded, for GatePath::kEvent. A gate
//    on an eager record older than the last kEventRingCapacity ones (evicted) takes kValueWait.
//  - kValueWait: cuStreamWaitValue64(other, &counter, target_raw, CU_STREAM_WAIT_VALUE_GEQ),
//    found with cudaGetDriverEntryPointByVersion (no link-time libcuda dependency). It needs
//    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS (GEQ needs no more: the NOR attribute is
//    not used); without it such a gate is kUnavailable, and the event path and host waits work.
//
// Thread-safety: as pd::StepCounterImpl (the StepCounter serializes record and gates; queries and
// waits read only the mirror). Calls that touch the device make the stream's device current on
// the calling thread, as CudaStream's calls do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backends/pd/step_counter.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::pd::cuda {

// Eager records per counter whose event is kept for GatePath::kEvent.
inline constexpr size_t kEventRingCapacity = 256;

// The CUDA implementation for `stream` (a CudaStream), seeded with `initial_raw`.
// kInvalidArgument: not a CUDA stream; kUnavailable: a CUDA call failed (the message names it).
[[nodiscard]] StatusOr<std::unique_ptr<StepCounterImpl>> make_device_step_counter_impl(
    runtime::Stream& stream, uint64_t initial_raw);

// OK when GatePath::kValueWait can run on CUDA device `device` (the driver exports
// cuStreamWaitValue64 and the device supports 64-bit stream memory operations); otherwise
// kUnavailable saying which is missing.
[[nodiscard]] Status device_value_wait_support(int device);

}  // namespace pdsim::pd::cuda
