// The CUDA driver API without linking libcuda: entry points are looked up through the runtime
// (cudaGetDriverEntryPointByVersion), so a binary loads where the driver is found only at run time
// (the GPU check's bundle) and links on a build machine without one. Plain C++: no CUDA headers,
// so any translation unit of a CUDA build may include it (the definitions are compiled only there).
//
// Thread-safety: every function is safe to call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace pdsim::runtime::cuda {

// The driver function `symbol` ("cuStreamWaitValue64") at ABI version `version` (11070: the
// newest entry point compatible with CUDA 11.7's signature, which every driver that runs a CUDA 13
// build has), or kUnavailable naming the symbol and the query's result. The caller casts it to the
// PFN_<symbol>_v<N> type of <cudaTypedefs.h> that `version` selects.
[[nodiscard]] StatusOr<void*> driver_entry_point(const char* symbol, unsigned int version);

// The device allocation (one cudaMalloc) that holds `ptr`.
struct AllocationRange {
    void* base = nullptr;
    size_t bytes = 0;
};

// The allocation holding `ptr` (cuMemGetAddressRange), looked up with `device` made current on the
// calling thread (left current, as the CUDA calls of this project's streams leave it). Errors:
// kInvalidArgument when `ptr` is not in a device allocation of this process, kUnavailable when
// the driver lacks the call.
[[nodiscard]] StatusOr<AllocationRange> allocation_range(int device, const void* ptr);

// The driver's cuStreamWaitValue64 (cast it to PFN_cuStreamWaitValue64_v11070) where `device`
// can run 64-bit stream memory operations; kUnavailable naming why otherwise (the device
// attribute CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0, or the driver lacks a call).
// The caller has made `device` current.
[[nodiscard]] StatusOr<void*> stream_wait_value64_entry(int device);

// Makes `stream` (a cudaStream_t) wait, on the device, until the 64-bit word at `word` (device
// memory of `device`, or memory mapped into it) is >= `value`: cuStreamWaitValue64 with
// CU_STREAM_WAIT_VALUE_GEQ (a cyclic >=, exact for values less than 2^63 apart). Returns once
// the wait is enqueued; the host never waits. kUnavailable, naming why, where `device` cannot
// run 64-bit stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) or the
// driver lacks the call; the CUresult of a failed enqueue otherwise. The lookup is done once per
// device. Leaves `device` current on the calling thread.
[[nodiscard]] Status stream_wait_value64_geq(int device, void* stream, const void* word,
                                             uint64_t value);

}  // namespace pdsim::runtime::cuda
