// Internal to kv_append: the kernel's flat arguments, derived from KvAppendParams by kv_append()
// (kv_append.cpp) and launched by launch_kv_append() (kv_append.cu). Plain C++ with no pdsim
// headers, so the .cu translation unit stays free of fmt (which nvcc's front end mishandles).
#pragma once

#include <cstdint>

namespace pdsim::attn::cuda::detail {

// [0] is K, [1] is V.
struct KvAppendLaunch {
    const void* src[2] = {nullptr, nullptr};
    void* dst[2] = {nullptr, nullptr};
    int64_t src_stride[2] = {0, 0};  // elements between source rows
    int64_t row_elems[2] = {0, 0};   // num_kv_heads * head_dim (K) / v_head_dim (V)
    const int32_t* out_cache_loc = nullptr;
    int64_t num_slots = 0;
    int n = 0;             // tokens, >= 1
    bool src_bf16 = true;  // else fp32
    bool dst_bf16 = true;  // else fp32
};

// Enqueues the kernel on `stream` (a cudaStream_t); returns the launch's cudaError_t (0: ok).
int launch_kv_append(const KvAppendLaunch& launch, void* stream);

}  // namespace pdsim::attn::cuda::detail
