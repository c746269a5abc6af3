// Host logic of the CUDA attention backend (see cuda_attention_plan.h).
#include "backends/cuda/cuda_attention_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>

namespace pdsim::attn::cuda {

namespace {

constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

// The smallest power of two >= max(x, floor).
int64_t round_up_pow2(int64_t x, int64_t floor) {
    int64_t p = 1;
    const int64_t want = std::max(x, floor);
    while (p < want) p *= 2;
    return p;
}

std::string shape_text(const runtime::ConstTensorView& v) {
    std::string out = "[";
    for (int d = 0; d < v.rank; ++d) out += fmt::format("{}{}", d ? ", " : "", v.size(d));
    return out + "]";
}

}  // namespace

StagedBatch stage_batch(const ForwardBatch& b) {
    StagedBatch s;
    s.mode = b.mode;
    s.bs = b.bs;
    s.page_table_stride = b.bs > 0 ? b.page_table_stride : 0;
    const size_t bs = static_cast<size_t>(b.bs);
    s.seq_lens.assign(b.seq_lens.begin(), b.seq_lens.begin() + static_cast<ptrdiff_t>(bs));
    if (b.extend_lens.empty()) {
        s.q_lens.assign(bs, 1);
    } else {
        s.q_lens.assign(b.extend_lens.begin(), b.extend_lens.begin() + static_cast<ptrdiff_t>(bs));
    }
    s.page_table.assign(b.page_table.begin(),
                        b.page_table.begin() +
                            static_cast<ptrdiff_t>(bs * static_cast<size_t>(s.page_table_stride)));
    for (int32_t q : s.q_lens) s.num_tokens += q;
    return s;
}

BatchSplit split_batch(const StagedBatch& b) {
    BatchSplit split;
    if (b.bs == 0) return split;
    auto whole = [&](AttentionKind kind) { return SubBatch{kind, 0, b.bs, 0, b.num_tokens}; };
    if (is_decode(b.mode)) {
        split.decode = whole(AttentionKind::kDecode);
        return split;
    }
    if (b.mode != ForwardMode::kMixed) {
        split.extend = whole(AttentionKind::kExtend);
        return split;
    }
    auto single = [&](int i) { return b.q_lens[static_cast<size_t>(i)] == 1; };
    int trailing = 0;
    while (trailing < b.bs && single(b.bs - 1 - trailing)) ++trailing;
    if (trailing == b.bs) {
        split.decode = whole(AttentionKind::kDecode);
        return split;
    }
    int leading = 0;
    if (trailing == 0) {
        while (leading < b.bs && single(leading)) ++leading;
    }
    // Decode requests [d0, d0 + nd); the extend requests are the rest, on the other side.
    const int nd = trailing > 0 ? trailing : leading;
    const int d0 = trailing > 0 ? b.bs - trailing : 0;
    if (nd == 0) {
        split.extend = whole(AttentionKind::kExtend);
        return split;
    }
    const int e0 = trailing > 0 ? 0 : nd;
    const int ne = b.bs - nd;
    int64_t extend_rows = 0;
    for (int i = e0; i < e0 + ne; ++i) extend_rows += b.q_lens[static_cast<size_t>(i)];
    const int64_t extend_row_begin = trailing > 0 ? 0 : nd;  // decode rows: one per request
    split.extend = SubBatch{AttentionKind::kExtend, e0, ne, extend_row_begin, extend_rows};
    split.decode = SubBatch{AttentionKind::kDecode, d0, nd, trailing > 0 ? extend_rows : 0, nd};
    return split;
}

PagedBatch to_paged_batch(const StagedBatch& b, const SubBatch& sub) {
    const auto first = static_cast<size_t>(sub.first);
    const auto count = static_cast<size_t>(sub.count);
    const auto stride = static_cast<size_t>(b.page_table_stride);
    PagedBatch p;
    p.seq_lens = std::span<const int32_t>(b.seq_lens).subspan(first, count);
    if (sub.kind == AttentionKind::kExtend) {
        p.q_lens = std::span<const int32_t>(b.q_lens).subspan(first, count);
    }
    p.page_table = std::span<const int32_t>(b.page_table).subspan(first * stride, count * stride);
    p.page_table_stride = b.page_table_stride;
    return p;
}

Status check_batch_against_pool(const StagedBatch& b, const PoolGeometry& pool) {
    if (pool.page_size < 1 || pool.num_pages < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pool: page_size {} and num_pages {} must be >= 1", pool.page_size,
                           pool.num_pages);
    }
    const auto stride = static_cast<size_t>(b.page_table_stride);
    for (int i = 0; i < b.bs; ++i) {
        const int32_t seq = b.seq_lens[static_cast<size_t>(i)];
        const int64_t pages = ceil_div(seq, pool.page_size);
        if (pages > b.page_table_stride) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch: request {} has seq_len {} = {} pages of {}, more than "
                               "page_table_stride {}",
                               i, seq, pages, pool.page_size, b.page_table_stride);
        }
        for (int64_t p = 0; p < pages; ++p) {
            const size_t at = static_cast<size_t>(i) * stride + static_cast<size_t>(p);
            const int32_t page = b.page_table[at];
            if (page < 0 || page >= pool.num_pages) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "batch: page_table[{}] = {} (page {} of request {}) is outside "
                                   "the pool's pages [0, {})",
                                   at, page, p, i, pool.num_pages);
            }
        }
    }
    return ok_status();
}

PlanCapacity capacity_for(const StagedBatch& b, const SubBatch& sub, int page_size) {
    int64_t pages = 0;
    for (int i = sub.first; i < sub.first + sub.count; ++i) {
        pages += ceil_div(b.seq_lens[static_cast<size_t>(i)], std::max(page_size, 1));
    }
    PlanCapacity c;
    c.max_bs = sub.count;
    c.max_tokens = static_cast<int>(std::min<int64_t>(sub.rows, kMaxI32));
    c.max_pages = static_cast<int>(std::min<int64_t>(pages, kMaxI32));
    return c;
}

bool covers(const PlanCapacity& have, const PlanCapacity& need) {
    return need.max_bs <= have.max_bs && need.max_tokens <= have.max_tokens &&
           need.max_pages <= have.max_pages;
}

PlanCapacity grown_capacity(const PlanCapacity& have, const PlanCapacity& need, int page_size) {
    auto grow = [](int h, int n, int floor) {
        const int64_t want = round_up_pow2(std::max(h, n), floor);
        return static_cast<int>(std::min<int64_t>(want, kMaxI32));
    };
    PlanCapacity c;
    c.max_bs = grow(have.max_bs, need.max_bs, kMinEagerCapacity.max_bs);
    c.max_tokens = grow(have.max_tokens, need.max_tokens, kMinEagerCapacity.max_tokens);
    c.max_pages = grow(have.max_pages, need.max_pages, kMinEagerCapacity.max_pages);
    // FlashInfer indexes a batch's KV tokens in 32 bits: keep the rounding below that bound.
    const int64_t page_limit = kMaxI32 / std::max(page_size, 1);
    if (c.max_pages > page_limit)
        c.max_pages = static_cast<int>(std::max<int64_t>(page_limit, need.max_pages));
    return c;
}

StatusOr<AttentionKind> graph_kind(ForwardMode mode) {
    switch (mode) {
        case ForwardMode::kDecode:
            return AttentionKind::kDecode;
        case ForwardMode::kExtend:
        case ForwardMode::kTargetVerify:
        case ForwardMode::kDraftExtend:
            return AttentionKind::kExtend;
        case ForwardMode::kMixed:
            return PDSIM_ERROR(StatusCode::kUnimplemented,
                               "cuda backend: mixed batches are not captured into graphs (their "
                               "decode/extend split, and with it the kernels' row offsets, changes "
                               "from batch to batch); run them eagerly");
        case ForwardMode::kIdle:
            break;
    }
    return PDSIM_ERROR(StatusCode::kInvalidArgument, "mode: {} has no attention to plan",
                       forward_mode_name(mode));
}

StatusOr<PlanCapacity> graph_capacity(AttentionKind kind, int max_bs, int max_pages_per_seq,
                                      int64_t extend_rows) {
    if (max_bs < 1 || max_pages_per_seq < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "graph state: max_bs {} and max_pages_per_seq {} must be >= 1", max_bs,
                           max_pages_per_seq);
    }
    const int64_t pages = static_cast<int64_t>(max_bs) * max_pages_per_seq;
    if (pages > kMaxI32) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "graph state: max_bs {} x max_pages_per_seq {} = {} page-table entries "
                           "exceed 2^31",
                           max_bs, max_pages_per_seq, pages);
    }
    PlanCapacity c;
    c.max_bs = max_bs;
    c.max_pages = static_cast<int>(pages);
    if (kind == AttentionKind::kDecode) {
        c.max_tokens = max_bs;
        return c;
    }
    if (extend_rows < 1 || extend_rows > kMaxI32) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "graph state: {} query rows for the extend graph (need 1 to 2^31 - 1)",
                           extend_rows);
    }
    c.max_tokens = static_cast<int>(extend_rows);
    return c;
}

Status check_forward_matches_batch(ForwardMode mode, int bs, const runtime::ConstTensorView& view,
                                   std::string_view name, const StagedBatch& b) {
    if (b.mode != mode && !(is_idle(mode) && b.bs == 0)) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "forward mode {} but the metadata (init_forward_metadata) describes a "
                           "{} batch",
                           forward_mode_name(mode), forward_mode_name(b.mode));
    }
    if (bs != b.bs) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "forward bs {} but the metadata (init_forward_metadata) has bs {}", bs,
                           b.bs);
    }
    const int64_t rows = view.empty() ? 0 : view.size(0);
    if (rows != b.num_tokens && !(view.empty() && b.num_tokens == 0)) {
        std::string want = fmt::format("[{}", b.num_tokens);
        for (int d = 1; d < view.rank; ++d) want += fmt::format(", {}", view.size(d));
        want += "]";
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{}: shape {}, expected {} (the batch of init_forward_metadata has {} "
                           "tokens)",
                           name, shape_text(view), want, b.num_tokens);
    }
    return ok_status();
}

Status check_backend_config(const AttentionConfig& c) {
    const int v_head_dim = c.v_head_dim > 0 ? c.v_head_dim : c.head_dim;
    if (c.num_q_heads < 1 || c.num_kv_heads < 1 || c.num_q_heads % c.num_kv_heads != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "config: num_q_heads {} must be a positive multiple of num_kv_heads {}",
                           c.num_q_heads, c.num_kv_heads);
    }
    if (v_head_dim != c.head_dim) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "config.v_head_dim: {} differs from head_dim {}; the FlashInfer kernels "
                           "are built with equal QK and VO head dims",
                           v_head_dim, c.head_dim);
    }
    AttentionShape shape;
    shape.num_qo_heads = c.num_q_heads;
    shape.num_kv_heads = c.num_kv_heads;
    shape.head_dim = c.head_dim;
    shape.page_size = 1;  // any; the pool's is checked per forward
    shape.dtype = runtime::DType::kBF16;
    for (AttentionKind kind : {AttentionKind::kDecode, AttentionKind::kExtend}) {
        Status st = check_shape(shape, kind);
        if (!st.ok())
            return st.with_context(
                fmt::format("cuda backend config ({})", attention_kind_name(kind)));
    }
    return ok_status();
}

Status check_layer(const LayerSpec& l, const AttentionConfig& c) {
    const int config_v = c.v_head_dim > 0 ? c.v_head_dim : c.head_dim;
    if (l.num_q_heads != c.num_q_heads || l.num_kv_heads != c.num_kv_heads ||
        l.head_dim != c.head_dim || v_dim(l) != config_v) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer {}: {} query heads, {} KV heads, head dims {}/{}; the cuda "
                           "backend was configured for {}, {}, {}/{}",
                           l.layer_id, l.num_q_heads, l.num_kv_heads, l.head_dim, v_dim(l),
                           c.num_q_heads, c.num_kv_heads, c.head_dim, config_v);
    }
    return ok_status();
}

Status check_pool_layer(const kv::KVLayerView& lv, const AttentionConfig& c) {
    if (lv.v.empty()) {
        return PDSIM_ERROR(
            StatusCode::kUnimplemented,
            "pool: an MLA pool (one latent buffer per layer) is not supported by the cuda "
            "backend: FlashInfer's MLA decode reads q_nope and q_pe as two contiguous arrays, "
            "while forward() passes one q [tokens][heads][kv_lora_rank + rope_dim], and the "
            "latent KV write is not built; use an MHA pool");
    }
    for (int buf = 0; buf < 2; ++buf) {
        PDSIM_RETURN_IF_ERROR(runtime::check_view(
            buf == 0 ? lv.k : lv.v, buf == 0 ? "pool (K)" : "pool (V)",
            {.dtypes = {runtime::DType::kBF16},
             .device = runtime::DeviceKind::kCuda,
             .shape = {lv.num_pages, lv.page_size, c.num_kv_heads, c.head_dim}}));
    }
    return ok_status();
}

}  // namespace pdsim::attn::cuda
