// Internal to CudaKvMemoryOps (cuda_kv_memory_ops.h): the kernels' flat items, derived from the
// KvCopyOp / KvChecksumOp descriptors on the host (cuda_kv_memory_ops.cpp) and consumed from a
// device array by the kernels (kv_memory_kernels.cu). Plain C++ with no pdsim headers, so the
// .cu translation unit stays free of fmt (which nvcc's front end mishandles).
#pragma once

#include <cstdint>
#include <type_traits>

namespace pdsim::transfer::cuda::detail {

// `token_count` tokens: token k from src + k * src_stride to dst + k * dst_stride, `bytes` each.
struct CopyItem {
    const unsigned char* src = nullptr;  // device addresses
    unsigned char* dst = nullptr;
    int64_t src_stride = 0;
    int64_t dst_stride = 0;
    int64_t bytes = 0;
    int64_t token_count = 0;
    int64_t first_token = 0;  // running index of this item's first token within its launch
    int32_t vector16 = 0;     // 1: src, dst and both strides are 16-byte aligned
    int32_t reserved = 0;
};
static_assert(std::is_trivially_copyable_v<CopyItem> && sizeof(CopyItem) % 8 == 0);

// For token k and head h: sums[h] += kv_hash(first + k * slot_stride + h * head_bytes,
// head_bytes, token_begin + k).
struct ChecksumItem {
    const unsigned char* first = nullptr;  // head 0 of the first token (device address)
    uint64_t* sums = nullptr;              // the sum of head 0 (device memory)
    int64_t slot_stride = 0;
    int64_t head_bytes = 0;
    int64_t token_begin = 0;
    int64_t token_count = 0;
    int64_t first_work = 0;  // running index of this item's first (token, head) within its launch
    int32_t head_count = 0;
    int32_t reserved = 0;
};
static_assert(std::is_trivially_copyable_v<ChecksumItem> && sizeof(ChecksumItem) % 8 == 0);

// Each launcher enqueues one kernel on `stream` (a cudaStream_t) and returns its cudaError_t
// (0: ok): that launch's own (an error an earlier call left pending is cleared first). `items` is a
// device array of `item_count` (>= 1) items with running indices from 0.
int launch_kv_copy(const CopyItem* items, int64_t item_count, int64_t total_tokens, void* stream);
int launch_kv_checksums(const ChecksumItem* items, int64_t item_count, int64_t total_work,
                        void* stream);
// dst[i] += scratch[i] for i in [0, count): one thread per sum, no atomics (dst may be mapped
// host memory).
int launch_kv_fold_sums(uint64_t* dst, const uint64_t* scratch, int64_t count, void* stream);
// *word += add, once, by one thread with a system-scope atomic (the word may be another process's
// memory mapped over CUDA IPC, or another GPU's): the cuda_ipc transport's write signal
// (transfer/nccl/cuda_ipc_transport.cpp), which runs after the writes before it on its stream.
int launch_signal_add(uint64_t* word, uint64_t add, void* stream);

}  // namespace pdsim::transfer::cuda::detail
