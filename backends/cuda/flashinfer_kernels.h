// Internal to the FlashInfer adapter: the flat launch arguments that flashinfer_attention.cpp hands
// to the translation units that instantiate FlashInfer's kernels (flashinfer_decode_hd*.cu,
// flashinfer_extend_hd*.cu, one head dim each so they compile in parallel). Plain C++ with no
// pdsim or FlashInfer headers, to keep nvcc's front end on those TUs as small as possible.
//
// Every pointer is device memory on the current device; the metadata pointers point into the
// adapter's workspace (flashinfer_plan.h MetadataLayout). Derived values (strides, scale) are
// resolved by the caller. Each launcher returns an empty string on success, otherwise the CUDA
// error or the message of an exception FlashInfer raised (prefixed "cuda: " / "flashinfer: ").
#pragma once

#include <cstdint>
#include <string>

namespace pdsim::attn::cuda::detail {

// The extend CTA tile the kernels are instantiated with (== kExtendCtaTileQ of
// flashinfer_plan.h, checked where both are visible).
inline constexpr int kExtendKernelCtaTileQ = 128;

struct PagedKernelArgs {
    // Data.
    const void* q = nullptr;     // bf16 (MLA: q_nope)
    const void* q_pe = nullptr;  // MLA only: bf16 [rows][num_qo_heads][kMlaRopeDim], contiguous
    const void* k_cache = nullptr;
    const void* v_cache = nullptr;
    void* o = nullptr;
    int32_t q_stride_token = 0;  // elements
    int32_t q_stride_head = 0;
    float sm_scale = 0.f;
    // Shape.
    uint32_t num_qo_heads = 0;
    uint32_t num_kv_heads = 0;
    uint32_t page_size = 0;
    // CSR (kv_batch_size requests) and the work list (padded_work CTAs along x).
    uint32_t kv_batch_size = 0;
    uint32_t padded_work = 0;
    uint32_t num_tokens = 0;       // extend: query rows of the batch (or the capacity)
    int32_t* qo_indptr = nullptr;  // extend
    int32_t* kv_indptr = nullptr;
    int32_t* kv_indices = nullptr;
    int32_t* kv_last_page_len = nullptr;
    int32_t* request_indices = nullptr;
    int32_t* qo_tile_indices = nullptr;  // extend
    int32_t* kv_tile_indices = nullptr;
    int32_t* o_indptr = nullptr;
    int32_t* kv_chunk_size = nullptr;
    bool* block_valid_mask = nullptr;  // null: every CTA has work (eager mode)
};

// Decode (FlashInfer's CUDA-core batch decode kernel, no split-KV). kHeadDim: 64 or 128.
template <int kHeadDim>
std::string launch_paged_decode(const PagedKernelArgs& args, void* stream);

// MLA decode (FlashInfer's CUDA-core MLA decode kernel, kv_lora_rank 512 + rope 64, no split-KV):
// k_cache is the latent buffer [pages][page_size][512 + 64]; q (q_nope), q_pe and o contiguous.
std::string launch_paged_decode_mla(const PagedKernelArgs& args, void* stream);

// Causal extend (FlashInfer's FA2 batch prefill kernel, CTA_TILE_Q = kExtendCtaTileQ).
template <int kHeadDim>
std::string launch_paged_extend(const PagedKernelArgs& args, void* stream);

}  // namespace pdsim::attn::cuda::detail
