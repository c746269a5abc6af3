// Shared by kv_copy_plan_test (the host ops against gather_run / scatter_run /
// kv_checksums_add_run) and kv_memory_ops_cuda_test (the CUDA ops against the host ops): the
// matrix of layouts (TP 1->1, 2->1, 1->2, 2->3 with 6 heads, MLA; page sizes 1, 16 and 64 on
// either side; shuffled page tables), the pools of one TP rank, page tables and random bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "common/status.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer::testing {

struct KvOpsCase {
    std::string name;
    KvKind kind = KvKind::kMHA;
    int total_heads = 4;  // MHA
    int src_tp = 1;
    int dst_tp = 1;
    int src_page_size = 16;
    int dst_page_size = 16;
    int head_dim = 8;  // MHA: per head; MLA: kv_lora_rank
    int rope_dim = 0;  // MLA
    runtime::DType dtype = runtime::DType::kBF16;
    bool shuffled_pages = true;
    int num_layers = 3;
    int64_t num_tokens = 75;
    size_t max_message_bytes = 0;  // cuts runs (max_run_tokens); 0: no cut
};

// gtest prints a case by its name.
inline void PrintTo(const KvOpsCase& c, std::ostream* os) {
    *os << c.name;
}

inline std::vector<KvOpsCase> kv_ops_cases() {
    using runtime::DType;
    return {
        {.name = "Tp1To1Ps16", .total_heads = 4, .src_tp = 1, .dst_tp = 1},
        {.name = "Tp2To1Ps1To16",
         .total_heads = 4,
         .src_tp = 2,
         .dst_tp = 1,
         .src_page_size = 1,
         .dst_page_size = 16,
         .dtype = DType::kF32},
        {.name = "Tp1To2Ps16To64",
         .total_heads = 4,
         .src_tp = 1,
         .dst_tp = 2,
         .src_page_size = 16,
         .dst_page_size = 64,
         .head_dim = 16,
         .max_message_bytes = 300},
        // 12-byte heads: neither side's rows are 16-byte aligned (the byte path on a GPU).
        {.name = "Tp2To3Heads6Ps64To1",
         .total_heads = 6,
         .src_tp = 2,
         .dst_tp = 3,
         .src_page_size = 64,
         .dst_page_size = 1,
         .head_dim = 6},
        {.name = "Tp2To2Ps64To16",
         .total_heads = 8,
         .src_tp = 2,
         .dst_tp = 2,
         .src_page_size = 64,
         .dst_page_size = 16},
        {.name = "Tp1To1Ps1Sequential",
         .total_heads = 2,
         .src_tp = 1,
         .dst_tp = 1,
         .src_page_size = 1,
         .dst_page_size = 1,
         .head_dim = 4,
         .dtype = DType::kF32,
         .shuffled_pages = false},
        {.name = "MlaTp2To1Ps16To64",
         .kind = KvKind::kMLA,
         .total_heads = 1,
         .src_tp = 2,
         .dst_tp = 1,
         .src_page_size = 16,
         .dst_page_size = 64,
         .head_dim = 32,
         .rope_dim = 8},
        {.name = "MlaTp1To2Ps1To16",
         .kind = KvKind::kMLA,
         .total_heads = 1,
         .src_tp = 1,
         .dst_tp = 2,
         .src_page_size = 1,
         .dst_page_size = 16,
         .head_dim = 16,
         .rope_dim = 4,
         .dtype = DType::kF32},
    };
}

// Enough pages for the request twice over (so shuffled tables leave holes) plus the null page.
inline int pages_for(const KvOpsCase& c, int page_size) {
    return static_cast<int>((c.num_tokens + page_size - 1) / page_size) * 2 + 2;
}

struct RankPool {
    std::unique_ptr<kv::KVPool> pool;
    KvLayout layout;
};

// The pool of TP rank `tp_rank` of the prefill (`source`) or decode side, on `device`.
inline StatusOr<RankPool> make_rank_pool(const KvOpsCase& c, bool source, int tp_rank,
                                         runtime::Device device = {}) {
    const int tp = source ? c.src_tp : c.dst_tp;
    const int page_size = source ? c.src_page_size : c.dst_page_size;
    RankPool out;
    if (c.kind == KvKind::kMHA) {
        PDSIM_ASSIGN_OR_RETURN(HeadSlice slice, kv_head_slice(c.total_heads, tp, tp_rank));
        PDSIM_ASSIGN_OR_RETURN(auto pool,
                               kv::MHATokenToKVPool::create({.num_layers = c.num_layers,
                                                             .num_pages = pages_for(c, page_size),
                                                             .page_size = page_size,
                                                             .num_kv_heads = slice.count,
                                                             .head_dim = c.head_dim,
                                                             .dtype = c.dtype,
                                                             .device = device}));
        PDSIM_ASSIGN_OR_RETURN(out.layout,
                               KvLayout::from_mha_pool(*pool, tp, tp_rank, c.total_heads));
        out.pool = std::move(pool);
    } else {
        PDSIM_ASSIGN_OR_RETURN(auto pool,
                               kv::MLATokenToKVPool::create({.num_layers = c.num_layers,
                                                             .num_pages = pages_for(c, page_size),
                                                             .page_size = page_size,
                                                             .kv_lora_rank = c.head_dim,
                                                             .rope_dim = c.rope_dim,
                                                             .dtype = c.dtype,
                                                             .device = device}));
        PDSIM_ASSIGN_OR_RETURN(out.layout, KvLayout::from_mla_pool(*pool, tp, tp_rank));
        out.pool = std::move(pool);
    }
    return out;
}

// A page table for `num_tokens`: distinct pages of [1, num_pages), in a seeded random order
// when `shuffled`, else 1, 2, 3, ...
inline std::vector<int32_t> make_page_table(int num_pages, int page_size, int64_t num_tokens,
                                            bool shuffled, uint64_t seed) {
    std::vector<int32_t> all(static_cast<size_t>(num_pages - 1));
    std::iota(all.begin(), all.end(), 1);
    if (shuffled) {
        std::mt19937_64 rng(seed);
        std::shuffle(all.begin(), all.end(), rng);
    }
    all.resize(static_cast<size_t>((num_tokens + page_size - 1) / page_size));
    return all;
}

// Bytes of buffer `buf` of every layer: num_pages * page_bytes.
inline size_t buffer_bytes(const KvLayout& layout, int buf) {
    return static_cast<size_t>(layout.num_pages()) * layout.page_bytes(buf);
}

// Every byte of every buffer of a host layout, from a seeded generator.
inline void fill_random(const KvLayout& layout, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            std::byte* p = layout.base(l, b);
            for (size_t i = 0; i < buffer_bytes(layout, b); ++i) {
                p[i] = static_cast<std::byte>(rng() >> 56);
            }
        }
    }
}

// Every buffer of a host layout, concatenated (for whole-pool comparisons).
inline std::vector<std::byte> host_bytes(const KvLayout& layout) {
    std::vector<std::byte> out;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            const std::byte* p = layout.base(l, b);
            out.insert(out.end(), p, p + buffer_bytes(layout, b));
        }
    }
    return out;
}

// Index of the first differing byte, or nullopt.
inline std::optional<size_t> first_difference(const std::vector<std::byte>& a,
                                              const std::vector<std::byte>& b) {
    if (a.size() != b.size()) return std::min(a.size(), b.size());
    auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin());
    if (ia == a.end()) return std::nullopt;
    return static_cast<size_t>(ia - a.begin());
}

// One prefill -> decode rank pair that exchanges a fragment, and one chunk's runs.
struct KvOpsPair {
    int src_rank = 0;
    int dst_rank = 0;
    Fragment frag;
};

inline std::vector<KvOpsPair> fragment_pairs(const KvOpsCase& c, const std::vector<RankPool>& src,
                                             const std::vector<RankPool>& dst) {
    std::vector<KvOpsPair> out;
    for (int s = 0; s < c.src_tp; ++s) {
        for (int d = 0; d < c.dst_tp; ++d) {
            std::optional<Fragment> f = make_fragment(src[static_cast<size_t>(s)].layout.summary(),
                                                      dst[static_cast<size_t>(d)].layout.summary());
            if (f) out.push_back({.src_rank = s, .dst_rank = d, .frag = *f});
        }
    }
    return out;
}

// The runs of chunk [t0, t1) between the two page tables, cut as the engine cuts them.
inline std::vector<TokenRun> chunk_runs(const KvOpsCase& c, const Fragment& frag, int buffer_count,
                                        const std::vector<int32_t>& src_pages,
                                        const std::vector<int32_t>& dst_pages, int64_t t0,
                                        int64_t t1) {
    const int64_t max_tokens = c.max_message_bytes == 0
                                   ? t1 - t0
                                   : max_run_tokens(frag, buffer_count, c.max_message_bytes);
    return make_runs(src_pages, c.src_page_size, 0, dst_pages, c.dst_page_size, t0, t1, max_tokens);
}

}  // namespace pdsim::transfer::testing
