#include "transfer/engine/transfer_plan.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace pdsim::transfer {

int source_tp_rank(const KvLayoutSummary& src, int dst_tp_rank, int head) {
    if (src.kind == KvKind::kMLA) return dst_tp_rank % src.tp_size;
    const int H = src.total_kv_heads;
    const int P = src.tp_size;
    if (P <= H) return head / (H / P);
    const int r = P / H;  // replicas of each head
    return head * r + dst_tp_rank % r;
}

std::optional<Fragment> make_fragment(const KvLayoutSummary& src, const KvLayoutSummary& dst) {
    Fragment f;
    f.src_tp_rank = src.tp_rank;
    f.dst_tp_rank = dst.tp_rank;
    if (src.kind == KvKind::kMLA) {
        if (source_tp_rank(src, dst.tp_rank, 0) != src.tp_rank) return std::nullopt;
        f.head_begin = 0;
        f.head_count = 1;
    } else {
        int lo = -1;
        int hi = -1;
        for (int h = dst.head_begin; h < dst.head_begin + dst.local_heads; ++h) {
            if (source_tp_rank(src, dst.tp_rank, h) != src.tp_rank) continue;
            if (lo < 0) lo = h;
            // The convention makes a source's heads contiguous within a decode rank's slice.
            PDSIM_CHECK_MSG(hi < 0 || hi == h, "non-contiguous fragment heads");
            hi = h + 1;
        }
        if (lo < 0) return std::nullopt;
        PDSIM_CHECK(lo >= src.head_begin && hi <= src.head_begin + src.local_heads);
        f.head_begin = lo;
        f.head_count = hi - lo;
    }
    for (int b = 0; b < src.buffer_count; ++b) {
        const auto i = static_cast<size_t>(b);
        const size_t hb = src.head_bytes[i];
        f.src_offset[i] = static_cast<size_t>(f.head_begin - src.head_begin) * hb;
        f.dst_offset[i] = static_cast<size_t>(f.head_begin - dst.head_begin) * hb;
        f.bytes[i] = static_cast<size_t>(f.head_count) * hb;
        f.src_contiguous[i] = f.bytes[i] == src.token_bytes(b);
        f.dst_contiguous[i] = f.bytes[i] == dst.token_bytes(b);
    }
    return f;
}

std::vector<TokenRun> make_runs(std::span<const int32_t> src_pages, int src_page_size,
                                int64_t src_first_page, std::span<const int32_t> dst_pages,
                                int dst_page_size, int64_t t0, int64_t t1, int64_t max_tokens) {
    auto src_slot = [&](int64_t t) {
        const int64_t idx = t / src_page_size - src_first_page;
        return static_cast<int64_t>(src_pages[static_cast<size_t>(idx)]) * src_page_size +
               t % src_page_size;
    };
    auto dst_slot = [&](int64_t t) { return token_slot(dst_pages, dst_page_size, t); };
    std::vector<TokenRun> runs;
    max_tokens = std::max<int64_t>(max_tokens, 1);
    int64_t t = t0;
    while (t < t1) {
        TokenRun run;
        run.token_begin = t;
        run.src_slot = src_slot(t);
        run.dst_slot = dst_slot(t);
        // Extend page-segment by page-segment: within a page both sides are consecutive, so only
        // page boundaries (of either side) can break a run.
        int64_t end = t;
        while (end < t1 && end - t < max_tokens) {
            if (end > t && (src_slot(end) != run.src_slot + (end - t) ||
                            dst_slot(end) != run.dst_slot + (end - t))) {
                break;
            }
            const int64_t src_seg = src_page_size - end % src_page_size;
            const int64_t dst_seg = dst_page_size - end % dst_page_size;
            end += std::min({src_seg, dst_seg, t1 - end, max_tokens - (end - t)});
        }
        run.count = end - t;
        runs.push_back(run);
        t = end;
    }
    return runs;
}

int64_t max_run_tokens(const Fragment& frag, int buffer_count, size_t max_message_bytes) {
    size_t widest = 1;
    for (int b = 0; b < buffer_count; ++b) {
        widest = std::max(widest, frag.bytes[static_cast<size_t>(b)]);
    }
    return std::max<int64_t>(1, static_cast<int64_t>(max_message_bytes / widest));
}

void gather_run(const KvLayout& src, const Fragment& frag, int layer, int buf, const TokenRun& run,
                std::byte* dst) {
    const auto i = static_cast<size_t>(buf);
    const size_t n = frag.bytes[i];
    for (int64_t k = 0; k < run.count; ++k) {
        std::memcpy(dst + static_cast<size_t>(k) * n,
                    src.slot_addr(layer, buf, run.src_slot + k) + frag.src_offset[i], n);
    }
}

void scatter_run(const KvLayout& dst, const Fragment& frag, int layer, int buf, const TokenRun& run,
                 const std::byte* src) {
    const auto i = static_cast<size_t>(buf);
    const size_t n = frag.bytes[i];
    for (int64_t k = 0; k < run.count; ++k) {
        std::memcpy(dst.slot_addr(layer, buf, run.dst_slot + k) + frag.dst_offset[i],
                    src + static_cast<size_t>(k) * n, n);
    }
}

}  // namespace pdsim::transfer
