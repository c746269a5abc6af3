// backends/cuda/cuda_driver.h. <cuda.h> and <cudaTypedefs.h> give the types and the PFN
// signatures; no cu* function is called by name.
#include "backends/cuda/cuda_driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"

namespace pdsim::runtime::cuda {

StatusOr<void*> driver_entry_point(const char* symbol, unsigned int version) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "the CUDA driver does not export {} for version {} (query result {})",
                           symbol, version, static_cast<int>(found));
    }
    return fn;
}

StatusOr<AllocationRange> allocation_range(int device, const void* ptr) {
    PDSIM_ASSIGN_OR_RETURN(void* fn, driver_entry_point("cuMemGetAddressRange", 11070));
    CUDA_CHECK(cudaSetDevice(device));
    CUdeviceptr base = 0;
    size_t bytes = 0;
    const CUresult rc = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn)(
        &base, &bytes, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
    if (rc != CUDA_SUCCESS) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} is not in a device allocation of this process "
                           "(cuMemGetAddressRange: CUresult {})",
                           ptr, static_cast<int>(rc));
    }
    return AllocationRange{reinterpret_cast<void*>(static_cast<uintptr_t>(base)), bytes};
}

}  // namespace pdsim::runtime::cuda
