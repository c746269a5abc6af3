// The FlashInfer adapter's host-side planning (backends/cuda/flashinfer_plan.h) and its pinned
// staging ring (backends/cuda/flashinfer_staging.h), driven by an in-process fake of the CUDA
// primitives (FakePinnedMemory). No GPU, no CUDA: runs in every build.
#include "backends/cuda/flashinfer_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backends/cuda/flashinfer_staging.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::cuda {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// ---------------------------------------------------------------------------------------------
// Page table -> CSR

PagedBatch make_batch(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& q_lens,
                      const std::vector<int32_t>& table, int stride) {
    PagedBatch b;
    b.seq_lens = seq_lens;
    b.q_lens = q_lens;
    b.page_table = table;
    b.page_table_stride = stride;
    return b;
}

TEST(PagedKvCsr, HandCheckedPartialFullAndEmptyRequests) {
    // page_size 4. Request 0: 5 tokens = a full page and a page holding 1; request 1: empty;
    // request 2: 8 tokens = exactly two full pages. Unused table entries hold -1.
    const std::vector<int32_t> seq{5, 0, 8}, q{2, 0, 3};
    const std::vector<int32_t> table{7, 3, -1, -1, -1, -1, 1, 2, -1};
    auto csr = build_paged_kv_csr(make_batch(seq, q, table, 3), 4, /*num_pages=*/10);
    ASSERT_OK(csr);
    EXPECT_THAT(csr->qo_indptr, ElementsAre(0, 2, 2, 5));
    EXPECT_THAT(csr->kv_indptr, ElementsAre(0, 2, 2, 4));
    EXPECT_THAT(csr->kv_indices, ElementsAre(7, 3, 1, 2));
    EXPECT_THAT(csr->kv_last_page_len, ElementsAre(1, 0, 4));
    EXPECT_EQ(csr->max_seq_len, 8);
    EXPECT_EQ(csr->bs(), 3);
    EXPECT_EQ(csr->num_tokens(), 5);
    EXPECT_EQ(csr->num_pages(), 4);
}

TEST(PagedKvCsr, ShuffledPagesKeepTheirTableOrder) {
    // 40 tokens over 10 pages of 4, in a shuffled order: the CSR lists them as the table does.
    std::vector<int32_t> table{31, 4, 17, 9, 22, 1, 40, 13, 28, 6};
    const std::vector<int32_t> seq{38};
    auto csr = build_paged_kv_csr(make_batch(seq, {}, table, 10), 4);
    ASSERT_OK(csr);
    EXPECT_THAT(csr->kv_indices, ElementsAreArray(table));
    EXPECT_THAT(csr->kv_indptr, ElementsAre(0, 10));
    EXPECT_THAT(csr->kv_last_page_len, ElementsAre(2));  // 38 = 9 * 4 + 2
    EXPECT_THAT(csr->qo_indptr, ElementsAre(0, 1));      // decode: one query each
}

TEST(PagedKvCsr, PageSizeOneMakesOnePagePerToken) {
    const std::vector<int32_t> seq{3, 1}, table{5, 9, 2, 8, 0, 0};
    auto csr = build_paged_kv_csr(make_batch(seq, {}, table, 3), 1);
    ASSERT_OK(csr);
    EXPECT_THAT(csr->kv_indptr, ElementsAre(0, 3, 4));
    EXPECT_THAT(csr->kv_indices, ElementsAre(5, 9, 2, 8));
    EXPECT_THAT(csr->kv_last_page_len, ElementsAre(1, 1));
}

TEST(PagedKvCsr, StrideLargerThanNeededIgnoresTheTail) {
    // Stride 6, but each request uses 1 or 2 pages; the tail holds out-of-range garbage that must
    // neither be read nor be rejected.
    const std::vector<int32_t> seq{16, 17}, q{16, 1};
    const std::vector<int32_t> table{3, 999, -5, 999, 999, 999, 4, 6, 999, -1, -1, -1};
    auto csr = build_paged_kv_csr(make_batch(seq, q, table, 6), 16, /*num_pages=*/8);
    ASSERT_OK(csr);
    EXPECT_THAT(csr->kv_indptr, ElementsAre(0, 1, 3));
    EXPECT_THAT(csr->kv_indices, ElementsAre(3, 4, 6));
    EXPECT_THAT(csr->kv_last_page_len, ElementsAre(16, 1));
    EXPECT_THAT(csr->qo_indptr, ElementsAre(0, 16, 17));
}

TEST(PagedKvCsr, EmptyBatch) {
    auto csr = build_paged_kv_csr(make_batch({}, {}, {}, 0), 16);
    ASSERT_OK(csr);
    EXPECT_THAT(csr->kv_indptr, ElementsAre(0));
    EXPECT_THAT(csr->qo_indptr, ElementsAre(0));
    EXPECT_EQ(csr->bs(), 0);
}

TEST(PagedKvCsr, BadInputIsRejectedNamingTheArgument) {
    const std::vector<int32_t> table{1, 2, 3, 4};
    struct Case {
        std::vector<int32_t> seq, q;
        int stride;
        int page_size;
        int num_pages;
        std::string expect;
    };
    const std::vector<Case> cases = {
        {{4, 4}, {1}, 2, 4, 0, "batch.q_lens: 1 entries for 2 requests"},
        {{4}, {5}, 2, 4, 0, "batch.q_lens[0]: 5 queries for seq_len 4"},
        {{4}, {-1}, 2, 4, 0, "batch.q_lens[0]: -1"},
        {{-3}, {}, 2, 4, 0, "batch.seq_lens[0]: -3 must be >= 0"},
        {{9}, {}, 2, 4, 0, "batch.page_table_stride: 2 pages per request"},
        {{4, 4, 4}, {}, 2, 4, 0, "batch.page_table: 4 entries, 3 requests x stride 2 needs 6"},
        {{8}, {}, 2, 4, 2, "batch.page_table[1]: page 2 of request 0 is out of range [0, 2)"},
        {{4}, {}, 2, 0, 0, "page_size: 0 must be >= 1"},
        {{4}, {}, -1, 4, 0, "batch.page_table_stride: -1"},
    };
    for (const Case& c : cases) {
        auto csr =
            build_paged_kv_csr(make_batch(c.seq, c.q, table, c.stride), c.page_size, c.num_pages);
        ASSERT_FALSE(csr.ok()) << c.expect;
        EXPECT_EQ(csr.status().code(), StatusCode::kInvalidArgument) << c.expect;
        EXPECT_THAT(csr.status().message(), HasSubstr(c.expect));
    }
    const std::vector<int32_t> negative{-2};
    auto csr = build_paged_kv_csr(make_batch({3}, {}, negative, 1), 4);
    ASSERT_FALSE(csr.ok());
    EXPECT_THAT(csr.status().message(), HasSubstr("page -2 of request 0"));
}

// ---------------------------------------------------------------------------------------------
// Shapes, capacities, layouts

TEST(AttentionShapeCheck, AcceptsWhatIsBuiltAndRejectsTheRest) {
    AttentionShape s{32, 8, 128, 16, runtime::DType::kBF16};
    EXPECT_OK(check_shape(s, AttentionKind::kDecode));
    EXPECT_OK(check_shape(s, AttentionKind::kExtend));
    for (int g : kDecodeGroupSizes) {
        AttentionShape d{2 * g, 2, 64, 1, runtime::DType::kBF16};
        EXPECT_OK(check_shape(d, AttentionKind::kDecode)) << g;
    }

    AttentionShape g5{10, 2, 128, 16, runtime::DType::kBF16};  // group 5
    EXPECT_OK(check_shape(g5, AttentionKind::kExtend));
    Status st = check_shape(g5, AttentionKind::kDecode);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("group size 5"));

    AttentionShape f32 = s;
    f32.dtype = runtime::DType::kF32;
    st = check_shape(f32, AttentionKind::kExtend);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("fp32"));
    EXPECT_THAT(st.message(), HasSubstr("no fp32 KV kernels"));

    AttentionShape hd96 = s;
    hd96.head_dim = 96;
    st = check_shape(hd96, AttentionKind::kDecode);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("shape.head_dim: 96"));

    AttentionShape uneven{12, 8, 128, 16, runtime::DType::kBF16};
    st = check_shape(uneven, AttentionKind::kExtend);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("not a multiple of num_kv_heads 8"));

    AttentionShape no_pages = s;
    no_pages.page_size = 0;
    st = check_shape(no_pages, AttentionKind::kDecode);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("shape.page_size"));
}

TEST(AttentionShapeCheck, MlaIsDecodeOnlyInItsOneShape) {
    const AttentionShape mla{128, 1, kMlaKvLoraRank, 64, runtime::DType::kBF16, kMlaRopeDim};
    EXPECT_TRUE(mla.is_mla());
    EXPECT_OK(check_shape(mla, AttentionKind::kDecode));  // any number of query heads
    Status st = check_shape(mla, AttentionKind::kExtend);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("MLA extend is not wrapped"));

    AttentionShape rope32 = mla;
    rope32.rope_dim = 32;
    st = check_shape(rope32, AttentionKind::kDecode);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("rope_dim 32"));
    AttentionShape two_latents = mla;
    two_latents.num_kv_heads = 2;
    st = check_shape(two_latents, AttentionKind::kDecode);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("MLA with 2 latent heads"));
    AttentionShape negative = mla;
    negative.rope_dim = -1;
    EXPECT_EQ(check_shape(negative, AttentionKind::kDecode).code(), StatusCode::kInvalidArgument);
    AttentionShape fp32 = mla;
    fp32.dtype = runtime::DType::kF32;
    EXPECT_EQ(check_shape(fp32, AttentionKind::kDecode).code(), StatusCode::kUnimplemented);
}

void expect_disjoint_and_aligned(const MetadataLayout& l) {
    struct Range {
        const char* name;
        size_t offset, bytes;
    };
    const size_t bs1 = static_cast<size_t>(l.max_bs) + 1;
    const size_t w = static_cast<size_t>(l.max_work);
    std::vector<Range> ranges = {
        {"qo_indptr", l.qo_indptr, 4 * bs1},
        {"kv_indptr", l.kv_indptr, 4 * bs1},
        {"kv_last_page_len", l.kv_last_page_len, 4 * static_cast<size_t>(l.max_bs)},
        {"request_indices", l.request_indices, 4 * w},
        {"qo_tile_indices", l.qo_tile_indices, 4 * w},
        {"kv_tile_indices", l.kv_tile_indices, 4 * w},
        {"kv_chunk_size", l.kv_chunk_size, 4},
        {"block_valid_mask", l.block_valid_mask, w},
        {"kv_indices", l.kv_indices, 4 * static_cast<size_t>(l.max_pages)},
    };
    if (l.kind == AttentionKind::kDecode) ranges.push_back({"o_indptr", l.o_indptr, 4 * bs1});
    for (const Range& r : ranges) {
        EXPECT_EQ(r.offset % 16, 0u) << r.name;
        EXPECT_LE(r.offset + r.bytes, l.total_bytes) << r.name;
        EXPECT_LE(r.offset + r.bytes, l.kv_indices + 4 * static_cast<size_t>(l.max_pages))
            << r.name << " must come before kv_indices ends (copies are prefixes)";
        for (const Range& o : ranges) {
            if (&o == &r) continue;
            const bool disjoint = r.offset + r.bytes <= o.offset || o.offset + o.bytes <= r.offset;
            EXPECT_TRUE(disjoint) << r.name << " overlaps " << o.name;
        }
    }
    for (const Range& r : ranges) {
        if (std::string(r.name) != "kv_indices") {
            EXPECT_LT(r.offset, l.kv_indices) << r.name;
        }
    }
}

TEST(MetadataLayoutTest, DecodeAndExtendArraysAreAlignedAndDisjoint) {
    auto decode = make_metadata_layout(AttentionKind::kDecode, {64, 0, 4096}, 4);
    ASSERT_OK(decode);
    EXPECT_EQ(decode->max_work, 64);
    EXPECT_EQ(decode->max_tokens, 64);
    expect_disjoint_and_aligned(*decode);

    auto extend = make_metadata_layout(AttentionKind::kExtend, {8, 1000, 512}, 4);
    ASSERT_OK(extend);
    // ceil(1000 * 4 / 128) + 8 - 1 = 32 + 7.
    EXPECT_EQ(extend->max_work, 39);
    EXPECT_EQ(extend->o_indptr, extend->qo_indptr);  // one output row per query row
    expect_disjoint_and_aligned(*extend);

    auto bad = make_metadata_layout(AttentionKind::kExtend, {8, 0, 512}, 4);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("capacity.max_tokens"));
    bad = make_metadata_layout(AttentionKind::kDecode, {0, 0, 512}, 4);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("capacity.max_bs"));
    bad = make_metadata_layout(AttentionKind::kDecode, {4, 0, 0}, 4);
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("capacity.max_pages"));
}

TEST(MetadataLayoutTest, ExtendTileBoundHoldsForRandomBatches) {
    std::mt19937 rng(7);
    for (int group : {1, 4, 8}) {
        for (int trial = 0; trial < 300; ++trial) {
            const PlanCapacity cap{1 + static_cast<int>(rng() % 16),
                                   1 + static_cast<int>(rng() % 3000), 1};
            std::vector<int> q(1 + rng() % static_cast<unsigned>(cap.max_bs), 0);
            int budget = cap.max_tokens;
            for (int& x : q) {
                x = budget > 0 ? static_cast<int>(rng() % static_cast<unsigned>(budget + 1)) : 0;
                budget -= x;
            }
            int64_t tiles = 0;
            for (int x : q) tiles += (static_cast<int64_t>(x) * group + 127) / 128;
            EXPECT_LE(tiles, extend_max_tiles(cap, group));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Plan metadata

std::vector<int32_t> read_i32(const std::vector<std::byte>& staging, size_t offset, int count) {
    std::vector<int32_t> out(static_cast<size_t>(count));
    std::memcpy(out.data(), staging.data() + offset, out.size() * sizeof(int32_t));
    return out;
}

std::vector<int> read_mask(const std::vector<std::byte>& staging, size_t offset, int count) {
    std::vector<int> out;
    for (int i = 0; i < count; ++i) out.push_back(static_cast<int>(staging[offset + i]));
    return out;
}

struct Planned {
    MetadataLayout layout;
    PlanInfo info;
    std::vector<std::byte> staging;
};

Planned plan_on_host(AttentionKind kind, const PlanCapacity& cap, int group, const PagedBatch& b,
                     int page_size, bool graph) {
    Planned p;
    auto layout = make_metadata_layout(kind, cap, group);
    EXPECT_OK(layout);
    p.layout = *layout;
    p.staging.assign(p.layout.total_bytes, std::byte{0xAB});  // poison
    auto csr = build_paged_kv_csr(b, page_size);
    EXPECT_OK(csr);
    auto info = write_plan_metadata(*csr, group, p.layout, graph, p.staging);
    EXPECT_OK(info);
    if (info.ok()) p.info = *info;
    return p;
}

TEST(PlanMetadata, DecodeEagerIsOneCtaPerRequest) {
    const std::vector<int32_t> seq{5, 1, 9}, table{3, 4, 0, 8, 0, 0, 1, 2, 6};
    Planned p = plan_on_host(AttentionKind::kDecode, {8, 0, 32}, 4, make_batch(seq, {}, table, 3),
                             4, /*graph=*/false);
    const PlanInfo& i = p.info;
    EXPECT_EQ(i.bs, 3);
    EXPECT_EQ(i.num_tokens, 3);
    EXPECT_EQ(i.num_work, 3);
    EXPECT_EQ(i.padded_work, 3);
    EXPECT_EQ(i.kv_batch_size, 3);
    EXPECT_EQ(i.num_pages, 6);
    EXPECT_EQ(i.max_seq_len, 9);
    EXPECT_EQ(i.bytes_used, p.layout.kv_indices + 6 * sizeof(int32_t));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_indptr, 4), ElementsAre(0, 2, 3, 6));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_last_page_len, 3), ElementsAre(1, 1, 1));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_indices, 6), ElementsAre(3, 4, 8, 1, 2, 6));
    EXPECT_THAT(read_i32(p.staging, p.layout.request_indices, 3), ElementsAre(0, 1, 2));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_tile_indices, 3), ElementsAre(0, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.o_indptr, 4), ElementsAre(0, 1, 2, 3));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_chunk_size, 1), ElementsAre(9));
}

TEST(PlanMetadata, DecodeGraphPadsToMaxBsAndMasksThePadding) {
    const std::vector<int32_t> seq{5, 1, 9}, table{3, 4, 0, 8, 0, 0, 1, 2, 6};
    Planned p = plan_on_host(AttentionKind::kDecode, {6, 0, 32}, 4, make_batch(seq, {}, table, 3),
                             4, /*graph=*/true);
    const PlanInfo& i = p.info;
    EXPECT_TRUE(i.cuda_graph);
    EXPECT_EQ(i.num_work, 3);
    EXPECT_EQ(i.padded_work, 6);
    EXPECT_EQ(i.kv_batch_size, 6);
    // Padding requests: empty CSR rows (indptr repeats the total), last page length 0.
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_indptr, 7), ElementsAre(0, 2, 3, 6, 6, 6, 6));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_last_page_len, 6), ElementsAre(1, 1, 1, 0, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.request_indices, 6), ElementsAre(0, 1, 2, 3, 4, 5));
    EXPECT_THAT(read_mask(p.staging, p.layout.block_valid_mask, 6), ElementsAre(1, 1, 1, 0, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.o_indptr, 7), ElementsAre(0, 1, 2, 3, 3, 3, 3));
    // Everything the kernel reads lies in the copied prefix.
    EXPECT_LE(p.layout.block_valid_mask + 6, i.bytes_used);
}

TEST(PlanMetadata, ExtendCutsFixedTilesPerRequest) {
    // Group 4, tile 128 packed rows: q_lens 5, 0, 40 -> packed 20, 0, 160 -> tiles 1, 0, 2.
    const std::vector<int32_t> seq{12, 3, 40}, q{5, 0, 40};
    const std::vector<int32_t> table{1, 2, 0, 0, 3, 0, 0, 0, 4, 5, 6, 7};
    Planned p = plan_on_host(AttentionKind::kExtend, {4, 64, 16}, 4, make_batch(seq, q, table, 4),
                             16, /*graph=*/false);
    const PlanInfo& i = p.info;
    EXPECT_EQ(i.num_tokens, 45);
    EXPECT_EQ(i.num_work, 3);
    EXPECT_EQ(i.padded_work, 3);
    EXPECT_THAT(read_i32(p.staging, p.layout.qo_indptr, 4), ElementsAre(0, 5, 5, 45));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_indptr, 4), ElementsAre(0, 1, 2, 5));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_last_page_len, 3), ElementsAre(12, 3, 8));
    EXPECT_THAT(read_i32(p.staging, p.layout.request_indices, 3), ElementsAre(0, 2, 2));
    EXPECT_THAT(read_i32(p.staging, p.layout.qo_tile_indices, 3), ElementsAre(0, 0, 1));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_tile_indices, 3), ElementsAre(0, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_chunk_size, 1), ElementsAre(40));
}

TEST(PlanMetadata, ExtendTilesOfARequestDoNotDependOnTheBatch) {
    // The work items of request "r" (q_len 300, group 8) are the same whatever shares the batch.
    auto tiles_of = [](const std::vector<int32_t>& q_lens, int r) {
        std::vector<int32_t> seq = q_lens;
        const int max_pages_per = 64;
        std::vector<int32_t> table(q_lens.size() * max_pages_per, 1);
        Planned p = plan_on_host(AttentionKind::kExtend, {64, 20000, 64 * 64}, 8,
                                 make_batch(seq, q_lens, table, max_pages_per), 16, false);
        auto req = read_i32(p.staging, p.layout.request_indices, p.info.num_work);
        auto qt = read_i32(p.staging, p.layout.qo_tile_indices, p.info.num_work);
        std::vector<int32_t> mine;
        for (size_t w = 0; w < req.size(); ++w) {
            if (req[w] == r) mine.push_back(qt[w]);
        }
        return mine;
    };
    const auto alone = tiles_of({300}, 0);
    EXPECT_THAT(alone, ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                   18));  // ceil(300 * 8 / 128) = 19
    EXPECT_EQ(tiles_of({1, 7, 300, 900, 2}, 2), alone);
}

TEST(PlanMetadata, ExtendGraphPadsToTheTileBound) {
    const std::vector<int32_t> seq{12, 40}, q{5, 40};
    const std::vector<int32_t> table{1, 0, 0, 4, 5, 6};
    Planned p = plan_on_host(AttentionKind::kExtend, {4, 64, 16}, 4, make_batch(seq, q, table, 3),
                             16, /*graph=*/true);
    const int max_work = p.layout.max_work;  // ceil(64 * 4 / 128) + 3 = 5
    EXPECT_EQ(max_work, 5);
    EXPECT_EQ(p.info.padded_work, 5);
    EXPECT_EQ(p.info.kv_batch_size, 4);
    EXPECT_THAT(read_mask(p.staging, p.layout.block_valid_mask, 5), ElementsAre(1, 1, 1, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.request_indices, 5), ElementsAre(0, 1, 1, 0, 0));
    EXPECT_THAT(read_i32(p.staging, p.layout.qo_indptr, 5), ElementsAre(0, 5, 45, 45, 45));
    EXPECT_THAT(read_i32(p.staging, p.layout.kv_indptr, 5), ElementsAre(0, 1, 4, 4, 4));
}

TEST(PlanMetadata, BatchesBeyondTheCapacityOrMalformedForDecodeAreRejected) {
    auto layout = make_metadata_layout(AttentionKind::kDecode, {2, 0, 3}, 1);
    ASSERT_OK(layout);
    std::vector<std::byte> staging(layout->total_bytes);
    auto run = [&](const std::vector<int32_t>& seq, const std::vector<int32_t>& q,
                   const std::vector<int32_t>& table, int stride) {
        auto csr = build_paged_kv_csr(make_batch(seq, q, table, stride), 4);
        EXPECT_OK(csr);
        return write_plan_metadata(*csr, 1, *layout, false, staging).status();
    };
    Status st = run({1, 1, 1}, {}, {1, 2, 3}, 1);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("3 requests exceed capacity.max_bs 2"));
    st = run({16}, {}, {1, 2, 3, 4}, 4);
    EXPECT_THAT(st.message(), HasSubstr("4 pages exceed capacity.max_pages 3"));
    st = run({4}, {2}, {1}, 1);
    EXPECT_THAT(st.message(), HasSubstr("decode request 0 has 2 queries"));

    auto ext = make_metadata_layout(AttentionKind::kExtend, {2, 10, 8}, 1);
    ASSERT_OK(ext);
    std::vector<std::byte> ext_staging(ext->total_bytes);
    const std::vector<int32_t> seq{8, 8}, q{8, 8}, table{1, 2};
    auto csr = build_paged_kv_csr(make_batch(seq, q, table, 1), 16);
    ASSERT_OK(csr);
    st = write_plan_metadata(*csr, 1, *ext, false, ext_staging).status();
    EXPECT_THAT(st.message(), HasSubstr("16 query tokens exceed capacity.max_tokens 10"));

    // A decode request without KV is caught by the CSR conversion (its one query has no token).
    auto empty = build_paged_kv_csr(make_batch({0}, {}, {1}, 1), 4);
    ASSERT_FALSE(empty.ok());
    EXPECT_THAT(empty.status().message(), HasSubstr("batch.seq_lens[0]: 1 queries for seq_len 0"));

    std::vector<std::byte> small(8);
    auto one = build_paged_kv_csr(make_batch({4}, {}, {1}, 1), 4);
    ASSERT_OK(one);
    st = write_plan_metadata(*one, 1, *layout, false, small).status();
    EXPECT_THAT(st.message(), HasSubstr("staging: 8 bytes"));
}

// ---------------------------------------------------------------------------------------------
// The pinned staging ring over FakePinnedMemory

// What the fake saw; outlives the fake (the ring owns and destroys it).
struct FakeLedger {
    int live_allocations = 0;
    int live_events = 0;
    int waits = 0;
    std::chrono::milliseconds last_timeout{-1};
};

// An in-process stand-in for cudaHostAlloc + cudaEvent: memory from the heap; an event is
// "complete" unless recorded and not yet completed by the test (complete()), or, with
// complete_on_wait, by a wait (as if the GPU caught up while the host waited).
class FakePinnedMemory final : public PinnedMemory {
public:
    explicit FakePinnedMemory(std::shared_ptr<FakeLedger> ledger) : ledger_(std::move(ledger)) {}
    ~FakePinnedMemory() override = default;

    [[nodiscard]] StatusOr<void*> allocate_pinned(size_t bytes) override {
        ++ledger_->live_allocations;
        return static_cast<void*>(new std::byte[bytes]);
    }
    void free_pinned(void* ptr) noexcept override {
        --ledger_->live_allocations;
        delete[] static_cast<std::byte*>(ptr);
    }
    [[nodiscard]] StatusOr<void*> create_event() override {
        ++ledger_->live_events;
        auto* ev = new int(next_id_++);
        pending_[ev] = false;
        return static_cast<void*>(ev);
    }
    void destroy_event(void* event) noexcept override {
        --ledger_->live_events;
        pending_.erase(event);
        delete static_cast<int*>(event);
    }
    [[nodiscard]] Status record_event(void* event, void* stream) override {
        if (fail_record) return Status(StatusCode::kUnavailable, "fake: record failed");
        pending_[event] = true;
        last_stream = stream;
        record_order.push_back(event);
        ++records;
        return ok_status();
    }
    [[nodiscard]] StatusOr<bool> query_event(void* event) override { return !pending_[event]; }
    [[nodiscard]] Status wait_event(void* event, std::chrono::milliseconds timeout) override {
        ++ledger_->waits;
        ledger_->last_timeout = timeout;
        if (!pending_[event]) return ok_status();
        if (complete_on_wait) {
            pending_[event] = false;
            return ok_status();
        }
        return Status(StatusCode::kDeadlineExceeded, "fake: not reached");
    }

    // Completes the copy an event was recorded after (as the GPU would).
    void complete(void* event) { pending_[event] = false; }

    bool complete_on_wait = false;
    bool fail_record = false;
    void* last_stream = nullptr;
    int records = 0;
    std::vector<void*> record_order;  // events, in the order they were recorded

private:
    std::shared_ptr<FakeLedger> ledger_;
    std::map<void*, bool> pending_;  // event -> recorded and not completed
    int next_id_ = 0;
};

struct RingUnderTest {
    std::shared_ptr<FakeLedger> ledger = std::make_shared<FakeLedger>();
    FakePinnedMemory* fake = nullptr;
    std::unique_ptr<PinnedStagingRing> ring;

    explicit RingUnderTest(int slots, size_t bytes = 64) {
        auto memory = std::make_unique<FakePinnedMemory>(ledger);
        fake = memory.get();
        auto r = PinnedStagingRing::create(std::move(memory), slots, bytes);
        EXPECT_OK(r);
        ring = std::move(*r);
    }
};

void* const kStream = reinterpret_cast<void*>(0x5);

TEST(PinnedStagingRingTest, ReusesASlotOnlyAfterItsCopyCompleted) {
    RingUnderTest t(2);
    auto s0 = t.ring->acquire(0ms);
    ASSERT_OK(s0);
    EXPECT_EQ(s0->index, 0);
    EXPECT_EQ(s0->data.size(), 64u);
    ASSERT_OK(t.ring->commit(s0->index, kStream));
    EXPECT_EQ(t.fake->last_stream, kStream);
    auto s1 = t.ring->acquire(0ms);
    ASSERT_OK(s1);
    EXPECT_EQ(s1->index, 1);
    EXPECT_NE(s1->data.data(), s0->data.data());
    ASSERT_OK(t.ring->commit(s1->index, kStream));
    EXPECT_EQ(t.ring->in_flight(), 2);

    // Slot 0's copy has not run: not handed out.
    auto again = t.ring->acquire(0ms);
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(t.ring->in_flight(), 2);

    // Slot 0's copy completes (slot 1's has not): slot 0 comes back, without any wait.
    ASSERT_EQ(t.fake->record_order.size(), 2u);
    t.fake->complete(t.fake->record_order[0]);
    const int waits_before = t.ledger->waits;
    auto reused = t.ring->acquire(0ms);
    ASSERT_OK(reused);
    EXPECT_EQ(reused->index, 0);
    EXPECT_EQ(reused->data.data(), s0->data.data());
    EXPECT_EQ(t.ledger->waits, waits_before);
}

TEST(PinnedStagingRingTest, AFullRingWaitsForTheOldestCopyThenTimesOut) {
    RingUnderTest t(3);
    for (int i = 0; i < 3; ++i) {
        auto s = t.ring->acquire(0ms);
        ASSERT_OK(s);
        ASSERT_OK(t.ring->commit(s->index, kStream));
    }
    auto full = t.ring->acquire(250ms);
    ASSERT_FALSE(full.ok());
    EXPECT_EQ(full.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_THAT(full.status().message(), HasSubstr("all 3 pinned staging slots are in flight"));
    EXPECT_THAT(full.status().message(), HasSubstr("slot 0"));
    EXPECT_THAT(full.status().message(), HasSubstr("after 250 ms"));
    EXPECT_EQ(t.ledger->waits, 1);
    EXPECT_EQ(t.ledger->last_timeout, 250ms);

    // The GPU catches up while the host waits: the oldest slot comes back, the others stay.
    t.fake->complete_on_wait = true;
    auto s = t.ring->acquire(250ms);
    ASSERT_OK(s);
    EXPECT_EQ(s->index, 0);
    EXPECT_EQ(t.ledger->waits, 2);
    EXPECT_EQ(t.ring->in_flight(), 2);
}

TEST(PinnedStagingRingTest, AcquiredSlotsMustBeCommittedOrAbandoned) {
    RingUnderTest t(1);
    auto s = t.ring->acquire(0ms);
    ASSERT_OK(s);
    auto twice = t.ring->acquire(0ms);
    ASSERT_FALSE(twice.ok());
    EXPECT_EQ(twice.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(twice.status().message(), HasSubstr("still acquired"));
    t.ring->abandon(s->index);
    EXPECT_OK(t.ring->acquire(0ms));

    Status st = t.ring->commit(3, kStream);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("slot 3 is not acquired"));
    RingUnderTest u(2);
    st = u.ring->commit(1, kStream);  // never acquired
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(u.fake->records, 0);
}

TEST(PinnedStagingRingTest, ASlotWhoseRecordFailedIsNeverReused) {
    RingUnderTest t(2);
    t.fake->fail_record = true;
    auto s = t.ring->acquire(0ms);
    ASSERT_OK(s);
    Status st = t.ring->commit(s->index, kStream);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    EXPECT_THAT(st.message(), HasSubstr("recording its event"));
    t.fake->fail_record = false;
    for (int i = 0; i < 3; ++i) {  // only slot 1 is handed out from now on
        auto next = t.ring->acquire(0ms);
        ASSERT_OK(next);
        EXPECT_EQ(next->index, 1);
        t.ring->abandon(next->index);
    }
    RingUnderTest one(1);
    one.fake->fail_record = true;
    auto only = one.ring->acquire(0ms);
    ASSERT_OK(only);
    EXPECT_FALSE(one.ring->commit(only->index, kStream).ok());
    auto none = one.ring->acquire(0ms);
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(none.status().message(), HasSubstr("no usable staging slot"));
}

TEST(PinnedStagingRingTest, DestructionWaitsForCopiesInFlightAndFreesEverything) {
    auto ledger = std::make_shared<FakeLedger>();
    {
        RingUnderTest t(3);
        ledger = t.ledger;
        EXPECT_EQ(ledger->live_allocations, 3);
        EXPECT_EQ(ledger->live_events, 3);
        auto s = t.ring->acquire(0ms);
        ASSERT_OK(s);
        ASSERT_OK(t.ring->commit(s->index, kStream));
        t.fake->complete_on_wait = true;
        ledger->waits = 0;
    }
    EXPECT_EQ(ledger->waits, 1);  // the one slot in flight
    EXPECT_EQ(ledger->live_allocations, 0);
    EXPECT_EQ(ledger->live_events, 0);
}

TEST(PinnedStagingRingTest, CreateRejectsBadArguments) {
    auto ledger = std::make_shared<FakeLedger>();
    auto r = PinnedStagingRing::create(std::make_unique<FakePinnedMemory>(ledger), 0, 64);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("slots: 0 must be >= 1"));
    r = PinnedStagingRing::create(std::make_unique<FakePinnedMemory>(ledger), 2, 0);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("slot_bytes"));
    r = PinnedStagingRing::create(nullptr, 2, 64);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(ledger->live_allocations, 0);
}

}  // namespace
}  // namespace pdsim::attn::cuda
