// The host logic of the CUDA attention backend (backends/cuda/cuda_attention_plan.h), which needs
// no GPU: the batch checks it shares with the base class (same messages), the by-value copy, the
// split of mixed batches (decode run at either end, row ranges), the translation of sub-batches
// into the FlashInfer adapter's PagedBatch (checked against the adapter's own CSR builder and a
// CSR written here), the pool checks, the capacities and graph buckets, the forward-vs-batch
// checks, the config / layer / pool checks, and what create_attention_backend("cuda") says on a
// machine without a GPU (or a build without FlashInfer).
#include "backends/cuda/cuda_attention_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::cuda {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// A batch whose arrays the test owns.
struct HostBatch {
    ForwardMode mode = ForwardMode::kExtend;
    std::vector<int32_t> seq_lens, extend_lens, page_table;
    int stride = 4;
    int bs = -1;  // -1: seq_lens.size()

    [[nodiscard]] ForwardBatch view() const {
        ForwardBatch b;
        b.mode = mode;
        b.bs = bs >= 0 ? bs : static_cast<int>(seq_lens.size());
        b.seq_lens = seq_lens;
        b.extend_lens = extend_lens;
        b.page_table = page_table;
        b.page_table_stride = stride;
        return b;
    }
};

// Requests with these (seq_len, extend_len); request i's pages are 10 * (i + 1) + p, the table's
// unused tail -1 (never read).
HostBatch make(ForwardMode mode, const std::vector<std::pair<int, int>>& reqs, int page_size = 4,
               int stride = 0) {
    HostBatch b;
    b.mode = mode;
    int max_pages = 1;
    for (auto [s, q] : reqs) max_pages = std::max(max_pages, (s + page_size - 1) / page_size);
    b.stride = stride > 0 ? stride : max_pages;
    for (size_t i = 0; i < reqs.size(); ++i) {
        b.seq_lens.push_back(reqs[i].first);
        if (mode != ForwardMode::kDecode) b.extend_lens.push_back(reqs[i].second);
        const int pages = (reqs[i].first + page_size - 1) / page_size;
        for (int p = 0; p < b.stride; ++p) {
            b.page_table.push_back(p < pages ? static_cast<int32_t>(10 * (i + 1) + p) : -1);
        }
    }
    return b;
}

// ---- validate_forward_batch: the base class's checks and messages ------------------------------
TEST(ValidateForwardBatch, AcceptsWellFormedBatches) {
    EXPECT_TRUE(
        validate_forward_batch(make(ForwardMode::kExtend, {{5, 5}, {9, 2}}).view(), 0, 0).ok());
    EXPECT_TRUE(
        validate_forward_batch(make(ForwardMode::kDecode, {{5, 1}, {1, 1}}).view(), 0, 0).ok());
    EXPECT_TRUE(
        validate_forward_batch(HostBatch{ForwardMode::kIdle, {}, {}, {}, 0}.view(), 0, 0).ok());
    EXPECT_OK(validate_forward_batch(make(ForwardMode::kDecode, {{5, 1}}).view(), 1, 2));
}

TEST(ValidateForwardBatch, RejectsWhatTheBaseClassRejectsWithItsMessages) {
    struct Case {
        std::string what;
        HostBatch batch;
        int max_bs, max_pages;
        std::string message;
    };
    HostBatch idle = make(ForwardMode::kIdle, {{3, 1}});
    HostBatch short_seq = make(ForwardMode::kExtend, {{3, 1}, {4, 1}});
    short_seq.seq_lens.pop_back();
    short_seq.bs = 2;
    HostBatch short_ext = make(ForwardMode::kExtend, {{3, 1}, {4, 1}});
    short_ext.extend_lens.pop_back();
    HostBatch no_stride = make(ForwardMode::kExtend, {{3, 1}});
    no_stride.stride = 0;
    HostBatch short_table = make(ForwardMode::kExtend, {{3, 1}, {4, 1}});
    short_table.page_table.pop_back();
    HostBatch decode_two = make(ForwardMode::kMixed, {{3, 2}});
    decode_two.mode = ForwardMode::kDecode;
    const std::vector<Case> cases = {
        {"bs over the graph's max_bs", make(ForwardMode::kDecode, {{3, 1}, {4, 1}}), 1, 0,
         "batch: bs 2 > graph max_bs 1"},
        {"idle with requests", idle, 0, 0, "batch: idle mode with bs 1"},
        {"seq_lens too short", short_seq, 0, 0, "batch: seq_lens has 1 entries, bs 2"},
        {"extend_lens too short", short_ext, 0, 0, "batch: extend_lens has 1 entries, bs 2"},
        {"stride 0", no_stride, 0, 0, "batch: page_table_stride 0 < 1"},
        {"stride over max_pages_per_seq", make(ForwardMode::kExtend, {{30, 1}}), 0, 2,
         "batch: page_table_stride 8 > graph max_pages_per_seq 2"},
        {"page table too short", short_table, 0, 0, "batch: page_table has 1 entries, need 2 x 1"},
        {"decode with two new tokens", decode_two, 0, 0,
         "batch: decode request 0 has extend_len 2"},
        {"extend_len 0", make(ForwardMode::kExtend, {{3, 0}}), 0, 0,
         "batch: request 0 has extend_len 0 and seq_len 3"},
        {"extend_len over seq_len", make(ForwardMode::kExtend, {{3, 4}}), 0, 0,
         "batch: request 0 has extend_len 4 and seq_len 3 (need 1 <= extend_len <= seq_len)"},
    };
    for (const Case& c : cases) {
        Status st = validate_forward_batch(c.batch.view(), c.max_bs, c.max_pages);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.what;
        EXPECT_THAT(st.message(), HasSubstr(c.message)) << c.what;
    }
    ForwardBatch negative;
    negative.bs = -1;
    EXPECT_THAT(validate_forward_batch(negative, 0, 0).message(), HasSubstr("batch: bs -1 < 0"));
}

// ---- stage_batch ------------------------------------------------------------------------------
TEST(StageBatch, CopiesByValueAndCountsTokens) {
    HostBatch h = make(ForwardMode::kExtend, {{5, 5}, {9, 2}});
    h.seq_lens.push_back(77);  // entries past bs are not copied
    ForwardBatch view = h.view();
    view.bs = 2;
    StagedBatch s = stage_batch(view);
    h.seq_lens[0] = 1000;  // the caller's arrays may change afterwards
    EXPECT_EQ(s.mode, ForwardMode::kExtend);
    EXPECT_EQ(s.bs, 2);
    EXPECT_THAT(s.seq_lens, ElementsAre(5, 9));
    EXPECT_THAT(s.q_lens, ElementsAre(5, 2));
    EXPECT_EQ(s.num_tokens, 7);
    EXPECT_EQ(s.page_table.size(), 2u * static_cast<size_t>(h.stride));

    StagedBatch d = stage_batch(make(ForwardMode::kDecode, {{5, 1}, {9, 1}, {1, 1}}).view());
    EXPECT_THAT(d.q_lens, ElementsAre(1, 1, 1)) << "decode: one query each";
    EXPECT_EQ(d.num_tokens, 3);
    StagedBatch idle = stage_batch(HostBatch{ForwardMode::kIdle, {}, {}, {}, 3}.view());
    EXPECT_EQ(idle.bs, 0);
    EXPECT_EQ(idle.num_tokens, 0);
    EXPECT_TRUE(idle.page_table.empty());
}

// ---- split_batch ------------------------------------------------------------------------------
StagedBatch staged(ForwardMode mode, const std::vector<int>& q_lens) {
    std::vector<std::pair<int, int>> reqs;
    for (int q : q_lens) reqs.push_back({q + 3, q});
    return stage_batch(make(mode, reqs).view());
}

TEST(SplitBatch, DecodeAndExtendModesAreOneSubBatch) {
    BatchSplit d = split_batch(staged(ForwardMode::kDecode, {1, 1, 1}));
    ASSERT_TRUE(d.decode.has_value());
    EXPECT_FALSE(d.extend.has_value());
    EXPECT_EQ(
        *d.decode,
        (SubBatch{
            .kind = AttentionKind::kDecode, .first = 0, .count = 3, .row_begin = 0, .rows = 3}));
    for (ForwardMode m :
         {ForwardMode::kExtend, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
        BatchSplit e = split_batch(staged(m, {4, 1, 2}));  // an extend_len-1 request stays extend
        EXPECT_FALSE(e.decode.has_value()) << forward_mode_name(m);
        ASSERT_TRUE(e.extend.has_value()) << forward_mode_name(m);
        EXPECT_EQ(*e.extend, (SubBatch{.kind = AttentionKind::kExtend,
                                       .first = 0,
                                       .count = 3,
                                       .row_begin = 0,
                                       .rows = 7}));
    }
    BatchSplit empty =
        split_batch(stage_batch(HostBatch{ForwardMode::kIdle, {}, {}, {}, 1}.view()));
    EXPECT_FALSE(empty.decode.has_value());
    EXPECT_FALSE(empty.extend.has_value());
}

TEST(SplitBatch, MixedTakesTheTrailingDecodeRun) {
    // SGLang's layout: prefill chunks first (one of them a single token), running decodes after.
    BatchSplit s = split_batch(staged(ForwardMode::kMixed, {5, 1, 3, 1, 1}));
    ASSERT_TRUE(s.extend.has_value() && s.decode.has_value());
    EXPECT_EQ(
        *s.extend,
        (SubBatch{
            .kind = AttentionKind::kExtend, .first = 0, .count = 3, .row_begin = 0, .rows = 9}));
    EXPECT_EQ(
        *s.decode,
        (SubBatch{
            .kind = AttentionKind::kDecode, .first = 3, .count = 2, .row_begin = 9, .rows = 2}));
}

TEST(SplitBatch, MixedTakesTheLeadingDecodeRunWhenNoneTrails) {
    // vLLM's layout: decodes first.
    BatchSplit s = split_batch(staged(ForwardMode::kMixed, {1, 1, 1, 4, 1, 6}));
    ASSERT_TRUE(s.extend.has_value() && s.decode.has_value());
    EXPECT_EQ(
        *s.decode,
        (SubBatch{
            .kind = AttentionKind::kDecode, .first = 0, .count = 3, .row_begin = 0, .rows = 3}));
    EXPECT_EQ(
        *s.extend,
        (SubBatch{
            .kind = AttentionKind::kExtend, .first = 3, .count = 3, .row_begin = 3, .rows = 11}));
}

TEST(SplitBatch, MixedEdgeCases) {
    BatchSplit all_decode = split_batch(staged(ForwardMode::kMixed, {1, 1}));
    EXPECT_FALSE(all_decode.extend.has_value());
    ASSERT_TRUE(all_decode.decode.has_value());
    EXPECT_EQ(
        *all_decode.decode,
        (SubBatch{
            .kind = AttentionKind::kDecode, .first = 0, .count = 2, .row_begin = 0, .rows = 2}));
    BatchSplit no_decode = split_batch(staged(ForwardMode::kMixed, {2, 1, 3}));
    EXPECT_FALSE(no_decode.decode.has_value());
    ASSERT_TRUE(no_decode.extend.has_value());
    EXPECT_EQ(
        *no_decode.extend,
        (SubBatch{
            .kind = AttentionKind::kExtend, .first = 0, .count = 3, .row_begin = 0, .rows = 6}));
    // Both ends have single-token requests: the trailing run wins, the leading one is extend.
    BatchSplit both = split_batch(staged(ForwardMode::kMixed, {1, 4, 1}));
    ASSERT_TRUE(both.extend.has_value() && both.decode.has_value());
    EXPECT_EQ(
        *both.extend,
        (SubBatch{
            .kind = AttentionKind::kExtend, .first = 0, .count = 2, .row_begin = 0, .rows = 5}));
    EXPECT_EQ(
        *both.decode,
        (SubBatch{
            .kind = AttentionKind::kDecode, .first = 2, .count = 1, .row_begin = 5, .rows = 1}));
}

// Every row of a split batch belongs to exactly one sub-batch, and each sub-batch's rows are its
// requests' rows in batch order.
TEST(SplitBatch, SubBatchesPartitionRequestsAndRows) {
    const std::vector<std::vector<int>> layouts = {
        {1}, {3}, {1, 1, 2}, {2, 1, 1}, {1, 2, 1}, {1, 1, 1, 7, 7, 1, 2}, {9, 9, 1, 1, 1, 1}};
    for (const auto& q : layouts) {
        StagedBatch b = staged(ForwardMode::kMixed, q);
        BatchSplit s = split_batch(b);
        std::vector<int> owner(static_cast<size_t>(b.num_tokens), -1);
        std::vector<int64_t> row_of(q.size());
        int64_t r = 0;
        for (size_t i = 0; i < q.size(); ++i) {
            row_of[i] = r;
            r += q[i];
        }
        int covered = 0;
        for (const auto* sub : {&s.decode, &s.extend}) {
            if (!sub->has_value()) continue;
            const SubBatch& x = **sub;
            EXPECT_EQ(x.row_begin, row_of[static_cast<size_t>(x.first)]);
            int64_t rows = 0;
            for (int i = x.first; i < x.first + x.count; ++i) {
                if (x.kind == AttentionKind::kDecode) {
                    EXPECT_EQ(q[static_cast<size_t>(i)], 1);
                }
                rows += q[static_cast<size_t>(i)];
            }
            EXPECT_EQ(x.rows, rows);
            for (int64_t row = x.row_begin; row < x.row_begin + x.rows; ++row) {
                EXPECT_EQ(owner[static_cast<size_t>(row)], -1) << "row " << row << " twice";
                owner[static_cast<size_t>(row)] = static_cast<int>(x.kind);
            }
            covered += x.count;
        }
        EXPECT_EQ(covered, static_cast<int>(q.size()));
        for (int o : owner) EXPECT_NE(o, -1);
    }
}

// ---- to_paged_batch ---------------------------------------------------------------------------
// The CSR of requests [first, first + count), written independently of the adapter's builder.
struct Csr {
    std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, kv_indices, last_page_len;
};
Csr expected_csr(const HostBatch& h, int first, int count, int page_size, bool decode) {
    Csr c;
    for (int i = first; i < first + count; ++i) {
        const int s = h.seq_lens[static_cast<size_t>(i)];
        const int q = decode ? 1 : h.extend_lens[static_cast<size_t>(i)];
        const int pages = (s + page_size - 1) / page_size;
        for (int p = 0; p < pages; ++p) {
            c.kv_indices.push_back(h.page_table[static_cast<size_t>(i * h.stride + p)]);
        }
        c.qo_indptr.push_back(c.qo_indptr.back() + q);
        c.kv_indptr.push_back(c.kv_indptr.back() + pages);
        c.last_page_len.push_back(s - (pages - 1) * page_size);
    }
    return c;
}

TEST(ToPagedBatch, SubBatchesBecomeTheAdaptersCsr) {
    constexpr int kPage = 4;
    HostBatch h = make(ForwardMode::kMixed, {{13, 6}, {4, 4}, {9, 1}, {17, 1}, {1, 1}}, kPage);
    StagedBatch b = stage_batch(h.view());
    BatchSplit s = split_batch(b);
    ASSERT_TRUE(s.decode.has_value() && s.extend.has_value());
    for (const SubBatch& sub : {*s.extend, *s.decode}) {
        const bool decode = sub.kind == AttentionKind::kDecode;
        PagedBatch p = to_paged_batch(b, sub);
        EXPECT_EQ(p.bs(), sub.count);
        EXPECT_EQ(p.q_lens.empty(), decode);
        EXPECT_EQ(p.page_table_stride, h.stride);
        auto csr = build_paged_kv_csr(p, kPage, 100);
        ASSERT_OK(csr);
        const Csr want = expected_csr(h, sub.first, sub.count, kPage, decode);
        EXPECT_THAT(csr->qo_indptr, ElementsAreArray(want.qo_indptr));
        EXPECT_THAT(csr->kv_indptr, ElementsAreArray(want.kv_indptr));
        EXPECT_THAT(csr->kv_indices, ElementsAreArray(want.kv_indices));
        EXPECT_THAT(csr->kv_last_page_len, ElementsAreArray(want.last_page_len));
        EXPECT_EQ(csr->num_tokens(), sub.rows);
    }
}

// ---- check_batch_against_pool -----------------------------------------------------------------
TEST(CheckBatchAgainstPool, PagesMustFitTheStrideAndThePool) {
    HostBatch h = make(ForwardMode::kExtend, {{8, 2}, {5, 5}}, 4);  // pages 10, 11 | 20, 21
    EXPECT_OK(check_batch_against_pool(stage_batch(h.view()), {4, 22}));
    Status st = check_batch_against_pool(stage_batch(h.view()), {4, 21});
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(
        st.message(),
        HasSubstr("page_table[3] = 21 (page 1 of request 1) is outside the pool's pages [0, 21)"));
    // A smaller page size needs more pages than the stride holds.
    st = check_batch_against_pool(stage_batch(h.view()), {2, 1000});
    EXPECT_THAT(st.message(),
                HasSubstr("request 0 has seq_len 8 = 4 pages of 2, more than page_table_stride 2"));
    HostBatch neg = make(ForwardMode::kExtend, {{3, 1}}, 4);
    neg.page_table[0] = -3;
    EXPECT_THAT(check_batch_against_pool(stage_batch(neg.view()), {4, 100}).message(),
                HasSubstr("page_table[0] = -3"));
    // Entries past a request's pages are never looked at (-1 above).
    HostBatch wide = make(ForwardMode::kExtend, {{3, 1}}, 4, 6);
    EXPECT_OK(check_batch_against_pool(stage_batch(wide.view()), {4, 11}));
    EXPECT_THAT(check_batch_against_pool(stage_batch(wide.view()), {0, 11}).message(),
                HasSubstr("pool: page_size 0"));
}

// ---- capacities -------------------------------------------------------------------------------
TEST(Capacity, ForASubBatchAndGrowth) {
    HostBatch h = make(ForwardMode::kMixed, {{13, 6}, {4, 4}, {9, 1}, {17, 1}}, 4);
    StagedBatch b = stage_batch(h.view());
    BatchSplit s = split_batch(b);
    const PlanCapacity e = capacity_for(b, *s.extend, 4);
    EXPECT_EQ(e.max_bs, 2);
    EXPECT_EQ(e.max_tokens, 10);
    EXPECT_EQ(e.max_pages, 4 + 1);
    const PlanCapacity d = capacity_for(b, *s.decode, 4);
    EXPECT_EQ(d.max_bs, 2);
    EXPECT_EQ(d.max_tokens, 2);
    EXPECT_EQ(d.max_pages, 3 + 5);

    EXPECT_TRUE(covers({4, 10, 8}, {4, 10, 8}));
    EXPECT_FALSE(covers({4, 10, 8}, {5, 1, 1}));
    EXPECT_FALSE(covers({4, 10, 8}, {1, 11, 1}));
    EXPECT_FALSE(covers({4, 10, 8}, {1, 1, 9}));

    const PlanCapacity first = grown_capacity({}, {3, 300, 5}, 16);
    EXPECT_EQ(first.max_bs, kMinEagerCapacity.max_bs);
    EXPECT_EQ(first.max_tokens, 512);
    EXPECT_EQ(first.max_pages, kMinEagerCapacity.max_pages);
    const PlanCapacity grown = grown_capacity(first, {17, 10, 257}, 16);
    EXPECT_EQ(grown.max_bs, 32);
    EXPECT_EQ(grown.max_tokens, 512) << "never shrinks";
    EXPECT_EQ(grown.max_pages, 512);
    EXPECT_TRUE(covers(grown, {17, 10, 257}));
    EXPECT_TRUE(covers(grown, first));
    // max_pages * page_size stays below 2^31 (what FlashInfer indexes) when the need allows it.
    const PlanCapacity big = grown_capacity({}, {1, 1, (1 << 24) + 1}, 64);
    EXPECT_LE(static_cast<int64_t>(big.max_pages) * 64, int64_t{1} << 31);
    EXPECT_GE(big.max_pages, (1 << 24) + 1);
}

TEST(GraphCapacity, BucketsOfTheGraphAdapters) {
    auto d = graph_capacity(AttentionKind::kDecode, 64, 32, 0);
    ASSERT_OK(d);
    EXPECT_EQ(d->max_bs, 64);
    EXPECT_EQ(d->max_tokens, 64);
    EXPECT_EQ(d->max_pages, 64 * 32);
    auto e = graph_capacity(AttentionKind::kExtend, 8, 16, 1000);
    ASSERT_OK(e);
    EXPECT_EQ(e->max_tokens, 1000);
    EXPECT_EQ(e->max_pages, 128);
    EXPECT_THAT(graph_capacity(AttentionKind::kExtend, 8, 16, 0).status().message(),
                HasSubstr("0 query rows for the extend graph"));
    EXPECT_THAT(graph_capacity(AttentionKind::kDecode, 1 << 16, 1 << 16, 0).status().message(),
                HasSubstr("exceed 2^31"));
    EXPECT_EQ(graph_capacity(AttentionKind::kDecode, 0, 16, 0).status().code(),
              StatusCode::kInvalidArgument);
}

TEST(GraphKind, DecodeExtendKindsAndTheRest) {
    EXPECT_EQ(*graph_kind(ForwardMode::kDecode), AttentionKind::kDecode);
    for (ForwardMode m :
         {ForwardMode::kExtend, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
        EXPECT_EQ(*graph_kind(m), AttentionKind::kExtend) << forward_mode_name(m);
    }
    auto mixed = graph_kind(ForwardMode::kMixed);
    EXPECT_EQ(mixed.status().code(), StatusCode::kUnimplemented);
    EXPECT_THAT(mixed.status().message(), HasSubstr("mixed batches are not captured"));
    EXPECT_EQ(graph_kind(ForwardMode::kIdle).status().code(), StatusCode::kInvalidArgument);
}

// ---- check_forward_matches_batch ----------------------------------------------------------------
TEST(CheckForwardMatchesBatch, ModeBsAndRows) {
    StagedBatch b = stage_batch(make(ForwardMode::kExtend, {{5, 3}, {9, 2}}).view());
    std::vector<uint16_t> storage(5 * 8 * 64);
    auto rows = [&](int64_t n) {
        return runtime::make_view(storage.data(), runtime::DType::kBF16,
                                  {runtime::DeviceKind::kCuda, 0}, {n, 8, 64});
    };
    EXPECT_OK(check_forward_matches_batch(ForwardMode::kExtend, 2, rows(5), "q", b));
    Status st = check_forward_matches_batch(ForwardMode::kExtend, 2, rows(4), "q", b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("q: shape [4, 8, 64], expected [5, 8, 64]"));
    st = check_forward_matches_batch(ForwardMode::kDecode, 2, rows(5), "q", b);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), HasSubstr("forward mode decode but the metadata"));
    EXPECT_THAT(st.message(), HasSubstr("describes a extend batch"));
    st = check_forward_matches_batch(ForwardMode::kExtend, 3, rows(5), "q", b);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(),
                HasSubstr("forward bs 3 but the metadata (init_forward_metadata) has bs 2"));
    // idle matches an empty batch of any mode; null views have no rows.
    StagedBatch empty = stage_batch(HostBatch{ForwardMode::kDecode, {}, {}, {}, 1}.view());
    EXPECT_OK(check_forward_matches_batch(ForwardMode::kIdle, 0, {}, "q", empty));
    EXPECT_FALSE(check_forward_matches_batch(ForwardMode::kIdle, 0, {}, "q", b).ok());
}

// ---- config, layer and pool -------------------------------------------------------------------
AttentionConfig config(int hq, int hkv, int d, int dv = 0) {
    AttentionConfig c;
    c.num_q_heads = hq;
    c.num_kv_heads = hkv;
    c.head_dim = d;
    c.v_head_dim = dv;
    c.kv_dtype = runtime::DType::kBF16;
    return c;
}

TEST(CheckBackendConfig, ShapesTheKernelsBuild) {
    for (int d : {64, 128}) {
        for (int g : {1, 2, 3, 4, 6, 8, 16}) {
            EXPECT_OK(check_backend_config(config(2 * g, 2, d))) << "d " << d << " g " << g;
        }
    }
    Status st = check_backend_config(config(8, 8, 96));
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("head_dim: 96 is not built"));
    st = check_backend_config(config(10, 2, 64));
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("decode GQA group size 5"));
    st = check_backend_config(config(8, 8, 128, 64));
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("config.v_head_dim: 64 differs from head_dim 128"));
    st = check_backend_config(config(6, 4, 64));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(),
                HasSubstr("num_q_heads 6 must be a positive multiple of num_kv_heads 4"));
}

TEST(CheckLayer, TheLayerMustHaveTheConfigsShape) {
    const AttentionConfig c = config(8, 2, 64);
    EXPECT_OK(check_layer(LayerSpec{.layer_id = 3,
                                    .num_q_heads = 8,
                                    .num_kv_heads = 2,
                                    .head_dim = 64,
                                    .v_head_dim = 0,
                                    .scaling = 0.f},
                          c));
    EXPECT_OK(check_layer(LayerSpec{.layer_id = 3,
                                    .num_q_heads = 8,
                                    .num_kv_heads = 2,
                                    .head_dim = 64,
                                    .v_head_dim = 64,
                                    .scaling = 0.5f},
                          c));
    for (const LayerSpec& bad :
         {LayerSpec{.layer_id = 1, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64},
          LayerSpec{.layer_id = 1, .num_q_heads = 8, .num_kv_heads = 1, .head_dim = 64},
          LayerSpec{.layer_id = 1, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 128},
          LayerSpec{.layer_id = 1,
          .num_q_heads = 8,
          .num_kv_heads = 2,
          .head_dim = 64,
          .v_head_dim = 32}}) {
        Status st = check_layer(bad, c);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(st.message(), HasSubstr("the cuda backend was configured for 8, 2, 64/64"));
    }
}

TEST(CheckPoolLayer, AnMhaBf16PoolOfTheConfigsShape) {
    const AttentionConfig c = config(8, 2, 64);
    std::vector<uint16_t> k(3 * 16 * 2 * 64), v(k.size());
    kv::KVLayerView lv;
    lv.dtype = runtime::DType::kBF16;
    lv.device = {runtime::DeviceKind::kCuda, 0};
    lv.num_pages = 3;
    lv.page_size = 16;
    lv.k = runtime::make_view(k.data(), runtime::DType::kBF16, lv.device, {3, 16, 2, 64});
    lv.v = runtime::make_view(v.data(), runtime::DType::kBF16, lv.device, {3, 16, 2, 64});
    EXPECT_OK(check_pool_layer(lv, c));
    kv::KVLayerView wrong_heads = lv;
    wrong_heads.v = runtime::make_view(v.data(), runtime::DType::kBF16, lv.device, {3, 16, 4, 32});
    EXPECT_THAT(check_pool_layer(wrong_heads, c).message(),
                HasSubstr("pool (V): shape [3, 16, 4, 32], expected [3, 16, 2, 64]"));
    kv::KVLayerView mla = lv;
    mla.v = {};
    Status st = check_pool_layer(mla, c);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
    EXPECT_THAT(st.message(), HasSubstr("an MLA pool"));
}

// ---- the registry, here (no GPU, or no FlashInfer) --------------------------------------------
TEST(CudaBackendRegistry, SaysWhyItCannotBeMadeHere) {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    const bool gpu = rt.ok() && (*rt)->device_count() > 0;
    runtime::CpuStream stream("compute");
    AttentionConfig c = config(8, 2, 64);
    c.stream = &stream;
    auto made = create_attention_backend("cuda", c);
    ASSERT_FALSE(made.ok()) << "a CpuStream is never a cuda backend's compute stream";
#if defined(PDSIM_HAVE_FLASHINFER)
    if (gpu) {
        EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(made.status().message(), HasSubstr("not a CUDA stream"));
    } else {
        EXPECT_EQ(made.status().code(), StatusCode::kUnavailable);
        EXPECT_THAT(made.status().message(), HasSubstr("no device"));
    }
#else
    (void)gpu;
    EXPECT_EQ(made.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(made.status().message(), HasSubstr("attention backend 'cuda' was not built: "));
    EXPECT_THAT(made.status().message(),
                AnyOf(HasSubstr("FlashInfer not fetched: run scripts/bootstrap.sh"),
                      HasSubstr("built without CUDA"), HasSubstr("PDSIM_WITH_FLASHINFER=OFF")));
#endif
    const std::vector<std::string> names = attention_backend_names();
    EXPECT_NE(std::find(names.begin(), names.end(), "cuda"), names.end());
}

}  // namespace
}  // namespace pdsim::attn::cuda
