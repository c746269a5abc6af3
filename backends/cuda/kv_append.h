// kv_append: writes the K and V of n new tokens into one layer of a paged KV pool on the GPU
// (what a real engine's set_kv_buffer does before attention reads the cache). Plain C++ header;
// the checks are in kv_append.cpp, the kernel in kv_append.cu (both built with CUDA), which
// share only kv_append_launch.h.
//
// Layout (backends/kv/kv_pool.h, MHATokenToKVPool): per layer a K and a V buffer, each
// [num_pages * page_size][num_kv_heads][head_dim] in the pool dtype; token slot `loc`
// (= page * page_size + offset) starts at element loc * num_kv_heads * head_dim. Slot 0.. of
// page 0 is the null page: writes there are allowed (padding tokens go there) and harmless.
// Source rows: token i's K is [num_kv_heads][head_dim] contiguous elements starting at
// k + i * k_row_stride (likewise V with v_head_dim), in the source dtype.
//
// Conversion: bf16 -> bf16 and fp32 -> fp32 copy bits; fp32 -> bf16 rounds to nearest even
// (NaN stays NaN), as common/bf16.h; bf16 -> fp32 is exact.
//
// Contract: all pointers are device memory of the current device (out_cache_loc too: int32,
// [n]). Slots outside [0, num_slots) are skipped, not written (the kernel cannot report them);
// callers validate slots on the host (KVPool::check_loc) when they have them there. Two tokens
// with the same slot race (one of them wins). Asynchronous on `stream`; returns after enqueueing.
// Errors: kInvalidArgument naming the parameter (nothing enqueued); kUnavailable when the launch
// fails. Thread-safety: a pure launch; stream order applies.
#pragma once

#include <cstdint>

#include "backends/runtime/tensor.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

struct KvAppendParams {
    // Sources: n rows, token i at k + i * k_row_stride elements.
    const void* k = nullptr;
    const void* v = nullptr;
    runtime::DType src_dtype = runtime::DType::kBF16;  // kBF16 or kF32
    int64_t k_row_stride = 0;                          // elements; 0: num_kv_heads * head_dim
    int64_t v_row_stride = 0;                          // elements; 0: num_kv_heads * v_head_dim
    // Destination: one layer's pool buffers.
    void* k_cache = nullptr;
    void* v_cache = nullptr;
    runtime::DType cache_dtype = runtime::DType::kBF16;  // kBF16 or kF32
    int64_t num_slots = 0;                               // num_pages * page_size
    int num_kv_heads = 0;
    int head_dim = 0;
    int v_head_dim = 0;  // 0: head_dim
    // Which slots.
    const int32_t* out_cache_loc = nullptr;  // device, [n]
    int n = 0;                               // 0: nothing to do
};

// Validates `params` and enqueues the copy on `stream` (a cudaStream_t).
[[nodiscard]] Status kv_append(const KvAppendParams& params, void* stream);

}  // namespace pdsim::attn::cuda
