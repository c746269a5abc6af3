// FlashInfer's paged decode kernel behind detail::launch_paged_decode (flashinfer_kernels.h).
// Included only by flashinfer_decode_hd*.cu, which instantiate it for one head dim each; the only
// place (with flashinfer_extend_impl.cuh) that touches FlashInfer's params and launchers.
//
// The kernel (attention/decode.cuh, BatchDecodeWithPagedKVCacheKernel) runs one CTA per
// (work item = request, KV head); without a tmp buffer the launcher takes its non-partitioned
// path (partition_kv = false): each CTA reduces the request's whole KV, and
// request_indices/kv_tile_indices/o_indptr are the identity / zero lists of the plan. The
// launcher dispatches the GQA group size (1, 2, 3, 4, 6, 8, 16; others throw) and the compute
// capability's pipeline depth itself.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <exception>
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>
#include <string>

#include "backends/cuda/flashinfer_kernels.h"

namespace pdsim::attn::cuda::detail {

template <int kHeadDim>
std::string launch_paged_decode(const PagedKernelArgs& a, void* stream) {
    using DType = nv_bfloat16;
    using Params = ::flashinfer::BatchDecodeParams<DType, DType, DType, int32_t>;
    // No custom mask, no sliding window, no soft-cap, no ALiBi.
    using Variant = ::flashinfer::DefaultAttention<false, false, false, false>;

    Params p;
    p.q = static_cast<DType*>(const_cast<void*>(a.q));
    p.q_rope_offset = nullptr;
    p.paged_kv = ::flashinfer::paged_kv_t<DType, int32_t>(
        a.num_kv_heads, a.page_size, kHeadDim, a.kv_batch_size, ::flashinfer::QKVLayout::kNHD,
        static_cast<DType*>(const_cast<void*>(a.k_cache)),
        static_cast<DType*>(const_cast<void*>(a.v_cache)), a.kv_indices, a.kv_indptr,
        a.kv_last_page_len);
    p.o = static_cast<DType*>(a.o);
    p.lse = nullptr;
    p.maybe_alibi_slopes = nullptr;
    p.padded_batch_size = a.padded_work;
    p.num_qo_heads = a.num_qo_heads;
    p.q_stride_n = a.q_stride_token;
    p.q_stride_h = a.q_stride_head;
    p.window_left = -1;
    p.logits_soft_cap = 0.f;
    p.sm_scale = a.sm_scale;
    p.rope_rcp_scale = 1.f;
    p.rope_rcp_theta = 1.f;
    p.request_indices = a.request_indices;
    p.kv_tile_indices = a.kv_tile_indices;
    p.o_indptr = a.o_indptr;
    p.kv_chunk_size_ptr = a.kv_chunk_size;
    p.block_valid_mask = a.block_valid_mask;
    p.partition_kv = false;
    try {
        const cudaError_t rc = ::flashinfer::BatchDecodeWithPagedKVCacheDispatched<
            kHeadDim, ::flashinfer::PosEncodingMode::kNone, Variant, Params>(
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
