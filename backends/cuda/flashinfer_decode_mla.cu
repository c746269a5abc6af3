// FlashInfer's paged MLA decode kernel behind detail::launch_paged_decode_mla
// (flashinfer_kernels.h): kv_lora_rank 512, rope 64, bf16.
//
// The kernel (attention/decode.cuh, BatchDecodeWithPagedKVCacheKernelMLA; CUDA cores, no CUTLASS)
// runs one CTA per (work item = request, 16 query heads) over the request's whole latent KV
// (partition_kv = false without tmp buffers): logits = sm_scale * (q_nope . ckv + q_pe . kpe), the
// output is the softmax-weighted ckv (the absorbed form; the caller applies W_UV). It applies no
// RoPE (its frequency table is unused). pdsim's MLA pool keeps ckv and kpe in one buffer per
// token, so the two views share it: kpe starts kMlaKvLoraRank elements into each token, both with
// the token stride 512 + 64.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <exception>
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>
#include <string>

#include "backends/cuda/flashinfer_kernels.h"

namespace pdsim::attn::cuda::detail {

std::string launch_paged_decode_mla(const PagedKernelArgs& a, void* stream) {
    constexpr uint32_t kCkv = 512, kKpe = 64;
    using DType = nv_bfloat16;
    using Params = ::flashinfer::BatchDecodeParamsMLA<DType, DType, DType, int32_t>;
    using Variant = ::flashinfer::DefaultAttention<false, false, false, false>;

    auto* cache = static_cast<DType*>(const_cast<void*>(a.k_cache));
    const int64_t strides[2] = {static_cast<int64_t>(a.page_size) * (kCkv + kKpe), kCkv + kKpe};
    Params p;
    p.q_nope = static_cast<DType*>(const_cast<void*>(a.q));
    p.q_pe = static_cast<DType*>(const_cast<void*>(a.q_pe));
    p.o = static_cast<DType*>(a.o);
    p.lse = nullptr;
    p.sm_scale = a.sm_scale;
    p.q_rope_offset = nullptr;
    p.paged_kv = ::flashinfer::paged_kv_mla_t<DType, int32_t>(
        a.page_size, kCkv, kKpe, a.kv_batch_size, cache, strides, cache + kCkv, strides,
        a.kv_indices, a.kv_indptr, a.kv_last_page_len);
    p.padded_batch_size = a.padded_work;
    p.num_qo_heads = a.num_qo_heads;
    p.window_left = -1;
    p.logits_soft_cap = 0.f;
    p.rope_rcp_scale = 1.f;
    p.rope_rcp_theta = 1.f;
    p.request_indices = a.request_indices;
    p.kv_tile_indices = a.kv_tile_indices;
    p.o_indptr = a.o_indptr;
    p.kv_chunk_size_ptr = a.kv_chunk_size;
    p.block_valid_mask = a.block_valid_mask;
    p.partition_kv = false;
    try {
        const cudaError_t rc =
            ::flashinfer::BatchDecodeWithPagedKVCacheDispatchedMLA<kCkv, kKpe, Variant, Params>(
                p, /*tmp_v=*/nullptr, /*tmp_s=*/nullptr, /*enable_pdl=*/false,
                static_cast<cudaStream_t>(stream));
        if (rc != cudaSuccess) {
            return std::string("cuda: ") + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc);
        }
    } catch (const std::exception& e) {
        return std::string("flashinfer: ") + e.what();
    }
    return {};
}

}  // namespace pdsim::attn::cuda::detail
