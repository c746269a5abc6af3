// backends/cuda/cuda_driver.h. <cuda.h> and <cudaTypedefs.h> give the types and the PFN
// signatures; no cu* function is called by name.
#include "backends/cuda/cuda_driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>

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

StatusOr<void*> stream_wait_value64_entry(int device) {
    PDSIM_ASSIGN_OR_RETURN(void* wait_value, driver_entry_point("cuStreamWaitValue64", 11070));
    PDSIM_ASSIGN_OR_RETURN(void* get_device, driver_entry_point("cuDeviceGet", 11070));
    PDSIM_ASSIGN_OR_RETURN(void* get_attribute, driver_entry_point("cuDeviceGetAttribute", 11070));
    CUdevice dev = 0;
    CUresult rc = reinterpret_cast<PFN_cuDeviceGet_v2000>(get_device)(&dev, device);
    if (rc != CUDA_SUCCESS) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "cuDeviceGet({}) failed: CUresult {}", device,
                           static_cast<int>(rc));
    }
    int supported = 0;
    rc = reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(get_attribute)(
        &supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
    if (rc != CUDA_SUCCESS) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS, device {}) "
                           "failed: CUresult {}",
                           device, static_cast<int>(rc));
    }
    if (supported == 0) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "CUDA device {} does not support 64-bit stream memory operations "
                           "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0): no stream "
                           "can wait on a 64-bit value there",
                           device);
    }
    return wait_value;
}

Status stream_wait_value64_geq(int device, void* stream, const void* word, uint64_t value) {
    static std::mutex mu;
    static std::map<int, StatusOr<PFN_cuStreamWaitValue64_v11070>> loaded;
    CUDA_CHECK(cudaSetDevice(device));
    PFN_cuStreamWaitValue64_v11070 wait = nullptr;
    {
        std::lock_guard<std::mutex> lock(mu);
        auto it = loaded.find(device);
        if (it == loaded.end()) {
            StatusOr<void*> entry = stream_wait_value64_entry(device);
            StatusOr<PFN_cuStreamWaitValue64_v11070> typed =
                entry.ok() ? StatusOr<PFN_cuStreamWaitValue64_v11070>(
                                 reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(*entry))
                           : StatusOr<PFN_cuStreamWaitValue64_v11070>(entry.status());
            it = loaded.emplace(device, std::move(typed)).first;
        }
        PDSIM_RETURN_IF_ERROR(it->second.status());
        wait = *it->second;
    }
    const CUresult rc = wait(static_cast<CUstream>(stream),
                             static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(word)),
                             static_cast<cuuint64_t>(value), CU_STREAM_WAIT_VALUE_GEQ);
    if (rc != CUDA_SUCCESS) {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "cuStreamWaitValue64(GEQ {}) on the word at {} failed: CUresult {}",
                           value, word, static_cast<int>(rc));
    }
    return {};
}

}  // namespace pdsim::runtime::cuda
