// Host-side planning of the FlashInfer adapter (see flashinfer_plan.h).
#include "backends/cuda/flashinfer_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace pdsim::attn::cuda {

namespace {

constexpr size_t kAlign = 16;

size_t align_up(size_t x) {
    return (x + kAlign - 1) / kAlign * kAlign;
}

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

Status invalid(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
}

std::string_view dtype_text(runtime::DType dtype) {
    switch (dtype) {
        case runtime::DType::kF32:
            return "fp32";
        case runtime::DType::kBF16:
            return "bf16";
        case runtime::DType::kF16:
            return "fp16";
        case runtime::DType::kFP8E4M3:
            return "fp8_e4m3";
        case runtime::DType::kI32:
            return "int32";
        case runtime::DType::kI64:
            return "int64";
    }
    return "?";
}

// Appends `count` int32 slots (or bytes) to a layout being built; returns the array's offset.
class LayoutBuilder {
public:
    size_t add(int64_t count, size_t elem_bytes) {
        const size_t offset = end_;
        end_ = align_up(end_ + static_cast<size_t>(count) * elem_bytes);
        return offset;
    }
    [[nodiscard]] size_t end() const { return end_; }

private:
    size_t end_ = 0;
};

void put_i32(std::span<std::byte> staging, size_t offset, int64_t index, int32_t value) {
    std::memcpy(staging.data() + offset + static_cast<size_t>(index) * sizeof(int32_t), &value,
                sizeof(value));
}

void put_u8(std::span<std::byte> staging, size_t offset, int64_t index, uint8_t value) {
    staging[offset + static_cast<size_t>(index)] = static_cast<std::byte>(value);
}

}  // namespace

std::string_view attention_kind_name(AttentionKind kind) {
    return kind == AttentionKind::kDecode ? "decode" : "extend";
}

Status check_shape(const AttentionShape& shape, AttentionKind kind) {
    if (shape.num_qo_heads < 1) {
        return invalid(fmt::format("shape.num_qo_heads: {} must be >= 1", shape.num_qo_heads));
    }
    if (shape.num_kv_heads < 1) {
        return invalid(fmt::format("shape.num_kv_heads: {} must be >= 1", shape.num_kv_heads));
    }
    if (shape.num_qo_heads % shape.num_kv_heads != 0) {
        return invalid(fmt::format("shape.num_qo_heads: {} is not a multiple of num_kv_heads {}",
                                   shape.num_qo_heads, shape.num_kv_heads));
    }
    if (shape.head_dim < 1) {
        return invalid(fmt::format("shape.head_dim: {} must be >= 1", shape.head_dim));
    }
    if (shape.page_size < 1) {
        return invalid(fmt::format("shape.page_size: {} must be >= 1", shape.page_size));
    }
    if (shape.dtype != runtime::DType::kBF16) {
        return Status(StatusCode::kUnimplemented,
                      fmt::format("shape.dtype: {} is not supported by the FlashInfer adapter "
                                  "(bf16 only; FlashInfer has no fp32 KV kernels)",
                                  dtype_text(shape.dtype)));
    }
    if (shape.rope_dim < 0) {
        return invalid(fmt::format("shape.rope_dim: {} must be >= 0", shape.rope_dim));
    }
    if (shape.is_mla()) {
        if (kind != AttentionKind::kDecode) {
            return Status(StatusCode::kUnimplemented,
                          "shape: MLA extend is not wrapped (FlashInfer's FA2 MLA prefill kernel, "
                          "attention/mla.cuh, is not instantiated; MLA decode is)");
        }
        if (shape.num_kv_heads != 1 || shape.head_dim != kMlaKvLoraRank ||
            shape.rope_dim != kMlaRopeDim) {
            return Status(StatusCode::kUnimplemented,
                          fmt::format("shape: MLA with {} latent heads, kv_lora_rank {} and "
                                      "rope_dim {} is not built (1, {} and {})",
                                      shape.num_kv_heads, shape.head_dim, shape.rope_dim,
                                      kMlaKvLoraRank, kMlaRopeDim));
        }
        return ok_status();
    }
    if (std::find(kHeadDims.begin(), kHeadDims.end(), shape.head_dim) == kHeadDims.end()) {
        return Status(
            StatusCode::kUnimplemented,
            fmt::format("shape.head_dim: {} is not built (head dims 64 and 128)", shape.head_dim));
    }
    if (kind == AttentionKind::kDecode &&
        std::find(kDecodeGroupSizes.begin(), kDecodeGroupSizes.end(), shape.group_size()) ==
            kDecodeGroupSizes.end()) {
        return Status(StatusCode::kUnimplemented,
                      fmt::format("shape: decode GQA group size {} ({} / {} heads) is not one of "
                                  "FlashInfer's decode group sizes 1, 2, 3, 4, 6, 8, 16",
                                  shape.group_size(), shape.num_qo_heads, shape.num_kv_heads));
    }
    return ok_status();
}

StatusOr<PagedKvCsr> build_paged_kv_csr(const PagedBatch& batch, int page_size, int num_pages) {
    if (page_size < 1) return invalid(fmt::format("page_size: {} must be >= 1", page_size));
    const int bs = batch.bs();
    const bool decode = batch.q_lens.empty();
    if (!decode && static_cast<int64_t>(batch.q_lens.size()) != bs) {
        return invalid(fmt::format("batch.q_lens: {} entries for {} requests (seq_lens)",
                                   batch.q_lens.size(), bs));
    }
    if (batch.page_table_stride < 0) {
        return invalid(
            fmt::format("batch.page_table_stride: {} must be >= 0", batch.page_table_stride));
    }
    const int64_t table_needed = static_cast<int64_t>(bs) * batch.page_table_stride;
    if (static_cast<int64_t>(batch.page_table.size()) < table_needed) {
        return invalid(fmt::format("batch.page_table: {} entries, {} requests x stride {} needs {}",
                                   batch.page_table.size(), bs, batch.page_table_stride,
                                   table_needed));
    }

    PagedKvCsr csr;
    csr.qo_indptr.reserve(static_cast<size_t>(bs) + 1);
    csr.kv_indptr.reserve(static_cast<size_t>(bs) + 1);
    csr.kv_last_page_len.reserve(static_cast<size_t>(bs));
    csr.qo_indptr.push_back(0);
    csr.kv_indptr.push_back(0);
    int64_t total_q = 0;
    int64_t total_pages = 0;
    constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();
    for (int i = 0; i < bs; ++i) {
        const int32_t seq_len = batch.seq_lens[static_cast<size_t>(i)];
        const int32_t q_len = decode ? 1 : batch.q_lens[static_cast<size_t>(i)];
        if (seq_len < 0) {
            return invalid(fmt::format("batch.seq_lens[{}]: {} must be >= 0", i, seq_len));
        }
        if (q_len < 0 || q_len > seq_len) {
            return invalid(
                fmt::format("batch.{}[{}]: {} queries for seq_len {} (need 0 <= q_len "
                            "<= seq_len)",
                            decode ? "seq_lens" : "q_lens", i, q_len, seq_len));
        }
        const int64_t pages = ceil_div(seq_len, page_size);
        if (pages > batch.page_table_stride) {
            return invalid(
                fmt::format("batch.page_table_stride: {} pages per request, but "
                            "request {} has seq_len {} = {} pages of {}",
                            batch.page_table_stride, i, seq_len, pages, page_size));
        }
        const size_t row = static_cast<size_t>(i) * static_cast<size_t>(batch.page_table_stride);
        for (int64_t p = 0; p < pages; ++p) {
            const int32_t page = batch.page_table[row + static_cast<size_t>(p)];
            if (page < 0 || (num_pages > 0 && page >= num_pages)) {
                return invalid(
                    fmt::format("batch.page_table[{}]: page {} of request {} is out of "
                                "range [0, {})",
                                row + static_cast<size_t>(p), page, i,
                                num_pages > 0 ? fmt::format("{}", num_pages) : std::string("inf")));
            }
            csr.kv_indices.push_back(page);
        }
        total_q += q_len;
        total_pages += pages;
        if (total_q > kMaxI32 || total_pages > kMaxI32) {
            return invalid(fmt::format("batch: more than 2^31 queries or pages ({} / {})", total_q,
                                       total_pages));
        }
        csr.qo_indptr.push_back(static_cast<int32_t>(total_q));
        csr.kv_indptr.push_back(static_cast<int32_t>(total_pages));
        csr.kv_last_page_len.push_back(seq_len == 0 ? 0 : (seq_len - 1) % page_size + 1);
        csr.max_seq_len = std::max(csr.max_seq_len, seq_len);
    }
    return csr;
}

Status check_capacity(const PlanCapacity& capacity, AttentionKind kind) {
    if (capacity.max_bs < 1) {
        return invalid(fmt::format("capacity.max_bs: {} must be >= 1", capacity.max_bs));
    }
    if (kind == AttentionKind::kExtend && capacity.max_tokens < 1) {
        return invalid(fmt::format("capacity.max_tokens: {} must be >= 1", capacity.max_tokens));
    }
    if (kind == AttentionKind::kDecode && capacity.max_tokens < 0) {
        return invalid(
            fmt::format("capacity.max_tokens: {} must be >= 0 (0: max_bs)", capacity.max_tokens));
    }
    if (capacity.max_pages < 1) {
        return invalid(fmt::format("capacity.max_pages: {} must be >= 1", capacity.max_pages));
    }
    return ok_status();
}

int64_t extend_max_tiles(const PlanCapacity& capacity, int group_size) {
    const int64_t packed = static_cast<int64_t>(capacity.max_tokens) * std::max(group_size, 1);
    return ceil_div(packed, kExtendCtaTileQ) + std::max(capacity.max_bs, 1) - 1;
}

StatusOr<MetadataLayout> make_metadata_layout(AttentionKind kind, const PlanCapacity& capacity,
                                              int group_size) {
    PDSIM_RETURN_IF_ERROR(check_capacity(capacity, kind));
    if (group_size < 1) return invalid(fmt::format("group_size: {} must be >= 1", group_size));
    MetadataLayout l;
    l.kind = kind;
    l.max_bs = capacity.max_bs;
    l.max_pages = capacity.max_pages;
    if (kind == AttentionKind::kDecode) {
        l.max_tokens = capacity.max_tokens > 0 ? std::min(capacity.max_tokens, capacity.max_bs)
                                               : capacity.max_bs;
        l.max_work = capacity.max_bs;
    } else {
        l.max_tokens = capacity.max_tokens;
        const int64_t tiles = extend_max_tiles(capacity, group_size);
        if (tiles > std::numeric_limits<int32_t>::max()) {
            return invalid(fmt::format("capacity.max_tokens: {} x group {} needs {} query tiles",
                                       capacity.max_tokens, group_size, tiles));
        }
        l.max_work = static_cast<int>(tiles);
    }
    const int64_t bs1 = static_cast<int64_t>(l.max_bs) + 1;
    LayoutBuilder b;
    l.qo_indptr = b.add(bs1, sizeof(int32_t));
    l.kv_indptr = b.add(bs1, sizeof(int32_t));
    l.kv_last_page_len = b.add(l.max_bs, sizeof(int32_t));
    l.request_indices = b.add(l.max_work, sizeof(int32_t));
    l.qo_tile_indices = b.add(l.max_work, sizeof(int32_t));
    l.kv_tile_indices = b.add(l.max_work, sizeof(int32_t));
    l.o_indptr = kind == AttentionKind::kDecode ? b.add(bs1, sizeof(int32_t)) : l.qo_indptr;
    l.kv_chunk_size = b.add(1, sizeof(int32_t));
    l.block_valid_mask = b.add(l.max_work, 1);
    l.kv_indices = b.add(l.max_pages, sizeof(int32_t));
    l.total_bytes = b.end();
    return l;
}

StatusOr<PlanInfo> write_plan_metadata(const PagedKvCsr& csr, int group_size,
                                       const MetadataLayout& layout, bool cuda_graph,
                                       std::span<std::byte> staging) {
    const int bs = csr.bs();
    if (static_cast<int>(csr.qo_indptr.size()) != bs + 1 ||
        static_cast<int>(csr.kv_indptr.size()) != bs + 1 ||
        static_cast<int64_t>(csr.kv_indices.size()) != csr.num_pages()) {
        return invalid("csr: inconsistent array sizes (not built by build_paged_kv_csr?)");
    }
    if (group_size < 1) return invalid(fmt::format("group_size: {} must be >= 1", group_size));
    if (staging.size() < layout.total_bytes) {
        return invalid(fmt::format("staging: {} bytes, the layout needs {}", staging.size(),
                                   layout.total_bytes));
    }
    if (bs > layout.max_bs) {
        return invalid(
            fmt::format("batch: {} requests exceed capacity.max_bs {}", bs, layout.max_bs));
    }
    if (csr.num_tokens() > layout.max_tokens) {
        return invalid(fmt::format("batch: {} query tokens exceed capacity.max_tokens {}",
                                   csr.num_tokens(), layout.max_tokens));
    }
    if (csr.num_pages() > layout.max_pages) {
        return invalid(fmt::format("batch: {} pages exceed capacity.max_pages {}", csr.num_pages(),
                                   layout.max_pages));
    }
    const bool decode = layout.kind == AttentionKind::kDecode;
    if (decode) {
        for (int i = 0; i < bs; ++i) {
            const size_t u = static_cast<size_t>(i);
            if (csr.qo_indptr[u + 1] - csr.qo_indptr[u] != 1) {
                return invalid(fmt::format("batch: decode request {} has {} queries (need 1)", i,
                                           csr.qo_indptr[u + 1] - csr.qo_indptr[u]));
            }
            if (csr.kv_indptr[u + 1] == csr.kv_indptr[u]) {
                return invalid(
                    fmt::format("batch.seq_lens[{}]: a decode request needs at least "
                                "one KV token",
                                i));
            }
        }
    }

    PlanInfo info;
    info.kind = layout.kind;
    info.cuda_graph = cuda_graph;
    info.bs = bs;
    info.num_tokens = csr.num_tokens();
    info.num_pages = csr.num_pages();
    info.max_seq_len = csr.max_seq_len;
    info.kv_batch_size = cuda_graph ? layout.max_bs : bs;

    // CSR (padding requests, graph mode: empty entries after the last real one).
    const int csr_rows = cuda_graph ? layout.max_bs : bs;
    for (int i = 0; i <= csr_rows; ++i) {
        const size_t u = static_cast<size_t>(std::min(i, bs));
        put_i32(staging, layout.qo_indptr, i, csr.qo_indptr[u]);
        put_i32(staging, layout.kv_indptr, i, csr.kv_indptr[u]);
        if (i < csr_rows) {
            put_i32(staging, layout.kv_last_page_len, i,
                    i < bs ? csr.kv_last_page_len[static_cast<size_t>(i)] : 0);
        }
    }

    // Work items: decode one per request; extend the query tiles of each request in order.
    int64_t work = 0;
    if (decode) {
        const int rows = cuda_graph ? layout.max_bs : bs;
        for (int i = 0; i < rows; ++i) {
            put_i32(staging, layout.request_indices, i, i);
            put_i32(staging, layout.qo_tile_indices, i, 0);
            put_i32(staging, layout.kv_tile_indices, i, 0);
        }
        for (int i = 0; i <= rows; ++i) put_i32(staging, layout.o_indptr, i, std::min(i, bs));
        work = bs;
    } else {
        for (int i = 0; i < bs; ++i) {
            const size_t u = static_cast<size_t>(i);
            const int64_t packed =
                static_cast<int64_t>(csr.qo_indptr[u + 1] - csr.qo_indptr[u]) * group_size;
            const int64_t tiles = ceil_div(packed, kExtendCtaTileQ);
            if (work + tiles > layout.max_work) {
                return invalid(
                    fmt::format("batch: more than {} query tiles (capacity.max_tokens "
                                "{}, max_bs {})",
                                layout.max_work, layout.max_tokens, layout.max_bs));
            }
            for (int64_t t = 0; t < tiles; ++t, ++work) {
                put_i32(staging, layout.request_indices, work, i);
                put_i32(staging, layout.qo_tile_indices, work, static_cast<int32_t>(t));
                put_i32(staging, layout.kv_tile_indices, work, 0);
            }
        }
        if (cuda_graph) {
            for (int64_t w = work; w < layout.max_work; ++w) {
                put_i32(staging, layout.request_indices, w, 0);
                put_i32(staging, layout.qo_tile_indices, w, 0);
                put_i32(staging, layout.kv_tile_indices, w, 0);
            }
        }
    }
    info.num_work = static_cast<int>(work);
    info.padded_work = cuda_graph ? layout.max_work : info.num_work;
    for (int w = 0; w < info.padded_work; ++w) {
        put_u8(staging, layout.block_valid_mask, w, w < info.num_work ? 1 : 0);
    }
    put_i32(staging, layout.kv_chunk_size, 0, std::max<int32_t>(csr.max_seq_len, 1));
    for (size_t p = 0; p < csr.kv_indices.size(); ++p) {
        put_i32(staging, layout.kv_indices, static_cast<int64_t>(p), csr.kv_indices[p]);
    }
    info.bytes_used = layout.kv_indices + csr.kv_indices.size() * sizeof(int32_t);
    return info;
}

}  // namespace pdsim::attn::cuda
