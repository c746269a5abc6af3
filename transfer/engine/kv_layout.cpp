#include "transfer/engine/kv_layout.h"

#include <fmt/format.h>

namespace pdsim::transfer {

std::string_view kv_kind_name(KvKind kind) {
    return kind == KvKind::kMHA ? "mha" : "mla";
}

StatusOr<HeadSlice> kv_head_slice(int total_kv_heads, int tp_size, int tp_rank) {
    if (total_kv_heads < 1 || tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "bad TP slice: {} kv heads, tp size {}, tp rank {}", total_kv_heads,
                           tp_size, tp_rank);
    }
    if (tp_size <= total_kv_heads) {
        if (total_kv_heads % tp_size != 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "tp size {} does not divide {} kv heads", tp_size, total_kv_heads);
        }
        const int per = total_kv_heads / tp_size;
        return HeadSlice{tp_rank * per, per};
    }
    if (tp_size % total_kv_heads != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} kv heads do not divide tp size {} (replicated heads)",
                           total_kv_heads, tp_size);
    }
    return HeadSlice{tp_rank / (tp_size / total_kv_heads), 1};
}

std::string KvLayoutSummary::to_string() const {
    return fmt::format(
        "{} layers={} buffers={} page_size={} dtype_bytes={} tp={}/{} heads=[{}, {}) of {} "
        "head_bytes=[{}, {}]",
        kv_kind_name(kind), num_layers, buffer_count, page_size, dtype_bytes, tp_rank, tp_size,
        head_begin, head_begin + local_heads, total_kv_heads, head_bytes[0], head_bytes[1]);
}

Status check_compatible(const KvLayoutSummary& a, const KvLayoutSummary& b) {
    auto mismatch = [&](std::string_view what, auto x, auto y) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "incompatible KV layouts: {} {} vs {} ({} | {})", what, x, y,
                           a.to_string(), b.to_string());
    };
    if (a.kind != b.kind) return mismatch("kind", kv_kind_name(a.kind), kv_kind_name(b.kind));
    if (a.num_layers != b.num_layers) return mismatch("num_layers", a.num_layers, b.num_layers);
    if (a.buffer_count != b.buffer_count) {
        return mismatch("buffer_count", a.buffer_count, b.buffer_count);
    }
    if (a.dtype_bytes != b.dtype_bytes)
        return mismatch("dtype_bytes", a.dtype_bytes, b.dtype_bytes);
    if (a.total_kv_heads != b.total_kv_heads) {
        return mismatch("total_kv_heads", a.total_kv_heads, b.total_kv_heads);
    }
    for (int i = 0; i < a.buffer_count; ++i) {
        if (a.head_bytes[static_cast<size_t>(i)] != b.head_bytes[static_cast<size_t>(i)]) {
            return mismatch(fmt::format("head_bytes[{}]", i), a.head_bytes[static_cast<size_t>(i)],
                            b.head_bytes[static_cast<size_t>(i)]);
        }
    }
    return {};
}

StatusOr<KvLayout> KvLayout::create(const KvLayoutSummary& s, int num_pages,
                                    std::vector<std::byte*> bases, runtime::Device device) {
    if (s.num_layers < 1 || s.buffer_count < 1 || s.buffer_count > kMaxKvBuffers ||
        s.page_size < 1 || s.dtype_bytes < 1 || num_pages < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "bad KV layout ({} pages): {}", num_pages,
                           s.to_string());
    }
    if (s.kind == KvKind::kMLA &&
        (s.buffer_count != 1 || s.total_kv_heads != 1 || s.local_heads != 1 || s.head_begin != 0)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "MLA layout must have one buffer and one replicated head: {}",
                           s.to_string());
    }
    if (s.kind == KvKind::kMHA) {
        PDSIM_ASSIGN_OR_RETURN(HeadSlice slice,
                               kv_head_slice(s.total_kv_heads, s.tp_size, s.tp_rank));
        if (slice.begin != s.head_begin || slice.count != s.local_heads) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "layout heads [{}, {}) are not TP rank {} of {}'s slice [{}, {}) "
                               "of {} heads",
                               s.head_begin, s.head_begin + s.local_heads, s.tp_rank, s.tp_size,
                               slice.begin, slice.begin + slice.count, s.total_kv_heads);
        }
    } else if (s.tp_rank < 0 || s.tp_rank >= s.tp_size) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "bad TP rank {} of {}", s.tp_rank,
                           s.tp_size);
    }
    for (int b = 0; b < s.buffer_count; ++b) {
        if (s.head_bytes[static_cast<size_t>(b)] == 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "head_bytes[{}] is 0", b);
        }
    }
    if (bases.size() != static_cast<size_t>(s.num_layers * s.buffer_count)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} base addresses for {} layers x {} "
                           "buffers",
                           bases.size(), s.num_layers, s.buffer_count);
    }
    for (std::byte* p : bases) {
        if (p == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "null buffer base");
    }
    KvLayout out;
    out.summary_ = s;
    out.num_pages_ = num_pages;
    out.bases_ = std::move(bases);
    out.device_ = device;
    return out;
}

namespace {

std::vector<std::byte*> pool_bases(const kv::KVPool& pool, std::span<const int> layers = {}) {
    std::vector<std::byte*> bases;
    auto add = [&](int l) {
        for (int b = 0; b < pool.buffer_count(); ++b) {
            bases.push_back(static_cast<std::byte*>(pool.data(l, b)));
        }
    };
    if (layers.empty()) {
        for (int l = 0; l < pool.num_layers(); ++l) add(l);
    } else {
        for (int l : layers) add(l);
    }
    return bases;
}

}  // namespace

StatusOr<KvLayout> KvLayout::from_mha_pool(const kv::MHATokenToKVPool& pool, int tp_size,
                                           int tp_rank, int total_kv_heads,
                                           std::span<const int> layers) {
    for (int l : layers) {
        if (!pool.holds_layer(l)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "layer {} is not held by the pool ({} layers)", l,
                               pool.num_layers());
        }
    }
    PDSIM_ASSIGN_OR_RETURN(HeadSlice slice, kv_head_slice(total_kv_heads, tp_size, tp_rank));
    if (slice.count != pool.num_kv_heads()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pool holds {} kv heads but TP rank {} of {} with {} heads holds {}",
                           pool.num_kv_heads(), tp_rank, tp_size, total_kv_heads, slice.count);
    }
    KvLayoutSummary s;
    s.kind = KvKind::kMHA;
    s.num_layers = layers.empty() ? pool.num_layers() : static_cast<int32_t>(layers.size());
    s.buffer_count = pool.buffer_count();
    s.page_size = pool.page_size();
    s.dtype_bytes = static_cast<int32_t>(kv::dtype_size(pool.dtype()));
    s.tp_size = tp_size;
    s.tp_rank = tp_rank;
    s.total_kv_heads = total_kv_heads;
    s.head_begin = slice.begin;
    s.local_heads = slice.count;
    for (int b = 0; b < pool.buffer_count(); ++b) {
        // token_bytes is [local heads][dim]: one head is an equal share of it.
        s.head_bytes[static_cast<size_t>(b)] =
            pool.token_bytes(0, b) / static_cast<size_t>(slice.count);
    }
    return create(s, pool.num_pages(), pool_bases(pool, layers), pool.device());
}

StatusOr<KvLayout> KvLayout::from_mla_pool(const kv::MLATokenToKVPool& pool, int tp_size,
                                           int tp_rank) {
    KvLayoutSummary s;
    s.kind = KvKind::kMLA;
    s.num_layers = pool.num_layers();
    s.buffer_count = 1;
    s.page_size = pool.page_size();
    s.dtype_bytes = static_cast<int32_t>(kv::dtype_size(pool.dtype()));
    s.tp_size = tp_size;
    s.tp_rank = tp_rank;
    s.total_kv_heads = 1;
    s.head_begin = 0;
    s.local_heads = 1;
    s.head_bytes[0] = pool.token_bytes(0, 0);
    return create(s, pool.num_pages(), pool_bases(pool), pool.device());
}

Status KvLayout::check_pages(std::span<const int32_t> pages, int64_t num_tokens) const {
    if (num_tokens < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "negative token count {}", num_tokens);
    }
    const int64_t ps = summary_.page_size;
    const int64_t need = (num_tokens + ps - 1) / ps;
    if (static_cast<int64_t>(pages.size()) < need) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "page table of {} pages is too short for {} tokens (page size {})",
                           pages.size(), num_tokens, ps);
    }
    for (int64_t i = 0; i < need; ++i) {
        const int32_t p = pages[static_cast<size_t>(i)];
        if (p < 1 || p >= num_pages_) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "page table entry {} is page {} (valid: 1..{})", i, p,
                               num_pages_ - 1);
        }
    }
    return {};
}

}  // namespace pdsim::transfer
