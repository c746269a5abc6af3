// Host-side planning for pdsim's FlashInfer attention adapter
// (backends/cuda/flashinfer_attention.h): the page-table -> CSR conversion, the layout of the
// device-side metadata, and the metadata itself, written into a host staging buffer that the
// adapter then copies to the device in one cudaMemcpyAsync. Pure C++ (no CUDA, no FlashInfer), so
// it is unit-tested everywhere (tests/flashinfer_plan_test.cpp); built even without CUDA.
//
// How pdsim describes a batch, and what FlashInfer wants. pdsim gives seq_lens[bs] (KV tokens of
// each request after this forward, the new ones included), q_lens[bs] (the new tokens: the
// request's queries are its last q_lens[i] tokens, attending causally) and page_table[bs * stride]
// (request i's KV token t is in page page_table[i * stride + t / page_size], slot
// t % page_size). FlashInfer's paged kernels take CSR: kv_indptr[bs + 1] (prefix sum of each
// request's page count ceil(seq_len / page_size)), kv_indices (those pages, request by request),
// kv_last_page_len[bs] (tokens in each request's last page: (seq_len - 1) % page_size + 1, or 0
// for an empty request) and qo_indptr[bs + 1] (prefix sum of q_lens).
//
// Work decomposition (what makes the adapter batch-invariant). Split-KV is never used: decode runs
// one CTA per (request, KV head) over the request's whole KV; extend runs one CTA per (query tile,
// KV head), tiles of kExtendCtaTileQ packed rows (row = query token x GQA group member), cut per
// request. So a request's reduction order depends only on its own lengths, never on the batch.
//
// Graph mode (CUDA graphs) keeps every array at a fixed offset sized for PlanCapacity, launches a
// fixed number of CTAs (max_bs for decode, extend_max_tiles() for extend) and masks the CTAs that
// have no work with block_valid_mask; CSR entries of the padding requests [bs, max_bs) are empty.
//
// Errors: kInvalidArgument naming the argument (or the capacity it exceeds); kUnimplemented for a
// well-formed shape that the adapter does not build (check_shape()).
// Thread-safety: pure functions of their arguments.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backends/runtime/tensor.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

// Packed query rows per extend CTA, fixed so that the tile (and with it the kernel's KV tile and
// reduction order) never depends on the batch. FlashInfer would choose 16/64/128 from the batch's
// average query length; 128 is its choice for prefill-sized queries.
inline constexpr int kExtendCtaTileQ = 128;
// GQA group sizes (num_qo_heads / num_kv_heads) of FlashInfer's decode kernel (it is templated on
// the group size). Extend takes any group size.
inline constexpr std::array<int, 7> kDecodeGroupSizes = {1, 2, 3, 4, 6, 8, 16};
// Head dims instantiated (QK and VO alike).
inline constexpr std::array<int, 2> kHeadDims = {64, 128};

enum class AttentionKind { kDecode, kExtend };

[[nodiscard]] std::string_view attention_kind_name(AttentionKind kind);  // "decode" | "extend"

// MLA (DeepSeek's latent attention, absorbed form): the one shape wrapped.
inline constexpr int kMlaKvLoraRank = 512;
inline constexpr int kMlaRopeDim = 64;

// The shape of one attention layer as the kernels see it. Q, K/V and O are all `dtype`.
//   MHA/GQA: rope_dim == 0; head_dim is the QK and VO head dim.
//   MLA:     rope_dim > 0 (decode only): one latent KV "head" per token, head_dim = kv_lora_rank
//            (the compressed KV, also the value) followed by rope_dim rope dims, as pdsim's
//            MLATokenToKVPool stores it; num_kv_heads = 1; the output has head_dim dims.
struct AttentionShape {
    int num_qo_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;   // QK and VO (MLA: kv_lora_rank)
    int page_size = 0;  // tokens per KV page (any value >= 1)
    runtime::DType dtype = runtime::DType::kBF16;
    int rope_dim = 0;  // MLA only

    [[nodiscard]] int group_size() const {
        return num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0;
    }
    [[nodiscard]] bool is_mla() const { return rope_dim > 0; }
};

// OK when the adapter can run `shape` for `kind`. kInvalidArgument: a non-positive field, or
// num_qo_heads not a multiple of num_kv_heads. kUnimplemented: dtype other than bf16 (FlashInfer
// has no fp32 KV kernels; fp16/fp8 are not instantiated), head_dim not in kHeadDims, (decode) a
// group size not in kDecodeGroupSizes, or an MLA shape other than decode with num_kv_heads 1,
// head_dim kMlaKvLoraRank and rope_dim kMlaRopeDim.
[[nodiscard]] Status check_shape(const AttentionShape& shape, AttentionKind kind);

// One batch as pdsim describes it (see the file comment). Host memory, read only during the call.
struct PagedBatch {
    std::span<const int32_t> seq_lens;    // [bs]
    std::span<const int32_t> q_lens;      // [bs]; empty means one query per request (decode)
    std::span<const int32_t> page_table;  // at least bs * page_table_stride entries
    int page_table_stride = 0;

    [[nodiscard]] int bs() const { return static_cast<int>(seq_lens.size()); }
};

struct PagedKvCsr {
    std::vector<int32_t> qo_indptr;         // [bs + 1]
    std::vector<int32_t> kv_indptr;         // [bs + 1]
    std::vector<int32_t> kv_indices;        // [kv_indptr[bs]]
    std::vector<int32_t> kv_last_page_len;  // [bs]
    int32_t max_seq_len = 0;

    [[nodiscard]] int bs() const { return static_cast<int>(kv_last_page_len.size()); }
    [[nodiscard]] int num_tokens() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
    [[nodiscard]] int num_pages() const { return kv_indptr.empty() ? 0 : kv_indptr.back(); }
};

// The CSR form of `batch`. Checks: page_size >= 1; q_lens empty or of size bs; 0 <= q_lens[i] <=
// seq_lens[i]; ceil(seq_lens[i] / page_size) <= page_table_stride; page_table holds bs * stride
// entries; every page id used is >= 0 and, when num_pages > 0, < num_pages (entries past a
// request's last page are not read). A request with seq_len 0 (and q_len 0) is empty: no pages,
// last page length 0.
[[nodiscard]] StatusOr<PagedKvCsr> build_paged_kv_csr(const PagedBatch& batch, int page_size,
                                                      int num_pages = 0);

// The most a plan must hold; fixed for the lifetime of an adapter (graph mode launches this
// shape).
struct PlanCapacity {
    int max_bs = 0;      // requests per batch, >= 1
    int max_tokens = 0;  // query rows per batch (decode: one per request, so max_bs suffices)
    int max_pages = 0;   // page-table entries per batch: sum of ceil(seq_len / page_size)
};

// kInvalidArgument unless every capacity is >= 1 (decode: max_tokens may be 0, meaning max_bs).
[[nodiscard]] Status check_capacity(const PlanCapacity& capacity, AttentionKind kind);

// Upper bound on the extend CTAs along x (query tiles) of any batch within `capacity`:
// sum_i ceil(q_i * g / T) <= ceil(sum_i q_i * g / T) + bs - 1.
[[nodiscard]] int64_t extend_max_tiles(const PlanCapacity& capacity, int group_size);

// Byte offsets of the metadata arrays in the device workspace (and in the staging buffer, which
// mirrors it). Every array is int32 except block_valid_mask (one byte per CTA); each starts on a
// 16-byte boundary. kv_indices comes last so a plan copies only the prefix it uses.
struct MetadataLayout {
    AttentionKind kind = AttentionKind::kDecode;
    int max_bs = 0;
    int max_tokens = 0;  // decode: max_bs
    int max_work = 0;    // CTAs along x: decode max_bs, extend extend_max_tiles()
    int max_pages = 0;
    size_t qo_indptr = 0;         // [max_bs + 1]; extend also uses it as o_indptr
    size_t kv_indptr = 0;         // [max_bs + 1]
    size_t kv_last_page_len = 0;  // [max_bs]
    size_t request_indices = 0;   // [max_work]
    size_t qo_tile_indices = 0;   // [max_work] (zero for decode)
    size_t kv_tile_indices = 0;   // [max_work] (always zero: no split-KV)
    size_t o_indptr = 0;          // decode: [max_bs + 1]; extend: == qo_indptr
    size_t kv_chunk_size = 0;     // [1]: the longest KV of the batch (unused without split-KV)
    size_t block_valid_mask = 0;  // [max_work] bytes
    size_t kv_indices = 0;        // [max_pages]
    size_t total_bytes = 0;
};

// The layout for `capacity` (validated with check_capacity()).
[[nodiscard]] StatusOr<MetadataLayout> make_metadata_layout(AttentionKind kind,
                                                            const PlanCapacity& capacity,
                                                            int group_size);

// What a run needs from its plan on the host.
struct PlanInfo {
    AttentionKind kind = AttentionKind::kDecode;
    bool cuda_graph = false;
    int bs = 0;
    int num_tokens = 0;     // query (and output) rows
    int num_work = 0;       // CTAs along x with work: decode bs, extend query tiles
    int padded_work = 0;    // CTAs along x launched: num_work, or layout.max_work in graph mode
    int kv_batch_size = 0;  // requests in the CSR the kernel sees: bs, or max_bs in graph mode
    int num_pages = 0;
    int32_t max_seq_len = 0;
    size_t bytes_used = 0;  // staging prefix to copy: up to the end of the used kv_indices
};

// Writes the metadata of `csr` (built for `kind`) into `staging` (host memory of at least
// layout.total_bytes) and returns the plan info. Eager mode fills only what the batch uses;
// graph mode (cuda_graph) also writes the padding: empty CSR entries up to max_bs and
// block_valid_mask = 1 for the first num_work CTAs, 0 for the rest. kInvalidArgument when the
// batch exceeds the layout's capacity (naming max_bs / max_tokens / max_pages) or, for decode,
// when a request has no KV (seq_len 0) or more than one query.
[[nodiscard]] StatusOr<PlanInfo> write_plan_metadata(const PagedKvCsr& csr, int group_size,
                                                     const MetadataLayout& layout, bool cuda_graph,
                                                     std::span<std::byte> staging);

}  // namespace pdsim::attn::cuda
