// FlashInfer's paged prefill kernel behind detail::launch_paged_extend (flashinfer_kernels.h).
// Included only by flashinfer_extend_hd*.cu, which instantiate it for one head dim each.
//
// The kernel (attention/prefill.cuh, BatchPrefillWithPagedKVCacheKernel, FA2) runs one CTA per
// (work item = query tile of kExtendKernelCtaTileQ packed rows, KV head), causal mask, no
// positional encoding, K and V with equal strides (SAME_KV_STRIDES). Without tmp buffers the
// launcher takes its non-partitioned path: each CTA reduces its rows over the request's whole KV
// from token 0, and writes its rows to o at o_indptr[request] (= qo_indptr: one output row per
// query row). The launcher picks the KV tile (NUM_MMA_KV 1/2/4/8) from the GPU's shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <exception>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/variants.cuh>
#include <string>

#include "backends/cuda/flashinfer_kernels.h"

namespace pdsim::attn::cuda::detail {

template <int kHeadDim>
std::string launch_paged_extend(const PagedKernelArgs& a, void* stream) {
    using DType = nv_bfloat16;
    using Params = ::flashinfer::BatchPrefillPagedParams<DType, DType, DType, int32_t>;
    using Variant = ::flashinfer::DefaultAttention<false, false, false, false>;

    Params p;
    p.q = static_cast<DType*>(const_cast<void*>(a.q));
    p.paged_kv = ::flashinfer::paged_kv_t<DType, int32_t>(
        a.num_kv_heads, a.page_size, kHeadDim, a.kv_batch_size, ::flashinfer::QKVLayout::kNHD,
        static_cast<DType*>(const_cast<void*>(a.k_cache)),
        static_cast<DType*>(const_cast<void*>(a.v_cache)), a.kv_indices, a.kv_indptr,
        a.kv_last_page_len);
    p.maybe_custom_mask = nullptr;
    p.q_indptr = a.qo_indptr;
    p.maybe_mask_indptr = nullptr;
    p.maybe_q_rope_offset = nullptr;
    p.o = static_cast<DType*>(a.o);
    p.lse = nullptr;
    p.maybe_alibi_slopes = nullptr;
    p.group_size = ::flashinfer::uint_fastdiv(a.num_qo_heads / a.num_kv_heads);
    p.num_qo_heads = a.num_qo_heads;
    p.q_stride_n = a.q_stride_token;
    p.q_stride_h = a.q_stride_head;
    p.window_left = -1;
    p.logits_soft_cap = 0.f;
    p.sm_scale = a.sm_scale;
    p.rope_rcp_scale = 1.f;
    p.rope_rcp_theta = 1.f;
    p.request_indices = a.request_indices;
    p.qo_tile_indices = a.qo_tile_indices;
    p.kv_tile_indices = a.kv_tile_indices;
    p.merge_indptr = nullptr;
    p.o_indptr = a.o_indptr;
    p.block_valid_mask = a.block_valid_mask;
    p.kv_chunk_size_ptr = a.kv_chunk_size;
    p.max_total_num_rows = a.num_tokens;
    p.total_num_rows = nullptr;
    p.padded_batch_size = a.padded_work;
    p.partition_kv = false;
    try {
        const cudaError_t rc = ::flashinfer::BatchPrefillWithPagedKVCacheDispatched<
            /*SAME_KV_STRIDES=*/true, kExtendKernelCtaTileQ, kHeadDim, kHeadDim,
            ::flashinfer::PosEncodingMode::kNone, /*USE_FP16_QK_REDUCTION=*/false,
            ::flashinfer::MaskMode::kCausal, /*USE_TOKEN_HEAD_SF=*/false, Variant, Params>(
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
