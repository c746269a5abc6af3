// The CUDA driver API without linking libcuda: entry points are looked up through the runtime
// (cudaGetDriverEntryPointByVersion), so a binary loads where the driver is found only at run time
// (the GPU check's bundle) and links on a build machine without one. Plain C++: no CUDA headers,
// so any translation unit of a CUDA build may include it (the definitions are compiled only there).
//
// Thread-safety: every function is safe to call from any thread.
#pragma once

#include <cstddef>

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

}  // namespace pdsim::runtime::cuda
