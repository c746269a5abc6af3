// Host logic of the GPU synthetic model (backends/cuda/cuda_synthetic_model_plan.h), no GPU
// needed: config and option checks, the weight-memory estimate against ModelConfig::num_params,
// the input and workspace layouts, batch checks, input packing, decode graph buckets and padding,
// and the KV digest on a CPU pool.
#include "backends/cuda/cuda_synthetic_model_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "tests/status_matchers.h"

namespace pdsim::model::cuda {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig tiny2() {
    ModelConfig c = *resolve_model("tiny");
    c.num_layers = 2;
    return c;
}

void expect_error(const Status& st, StatusCode code, const std::string& text) {
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr(text));
}

TEST(CudaModelConfig, AcceptsTinyAndLlama8bShapes) {
    EXPECT_OK(check_cuda_model_config(tiny2(), 1, {}));
    ModelConfig l8 = *resolve_model("llama3-8b");
    l8.num_layers = 2;
    EXPECT_OK(check_cuda_model_config(l8, 1, {}));
}

// TP: any size that splits the heads and the intermediate size; the sliced reduction (always on
// for TP > 1) also needs the intermediate size to split into num_kv_heads 16-byte slices.
TEST(CudaModelConfig, TakesTpSplitsAndTheSlicedReduction) {
    EXPECT_OK(check_cuda_model_config(tiny2(), 2, {}));
    EXPECT_OK(check_cuda_model_config(tiny2(), 4, {}));  // tiny: 4 KV heads
    expect_error(check_cuda_model_config(tiny2(), 3, {}), StatusCode::kInvalidArgument,
                 "model tiny: tp 3: 3 does not divide num_kv_heads 4");
    expect_error(check_cuda_model_config(tiny2(), 8, {}), StatusCode::kInvalidArgument,
                 "model tiny: tp 8");
    expect_error(check_cuda_model_config(tiny2(), 0, {}), StatusCode::kInvalidArgument,
                 "tp 0 must be >= 1");
    ModelConfig c = tiny2();
    c.intermediate = 520;  // 520 / 4 slices = 130: not a 16-byte row
    EXPECT_OK(check_cuda_model_config(c, 1, {}));
    CudaModelOptions sliced;
    sliced.sliced_reduction = true;
    expect_error(check_cuda_model_config(c, 1, sliced), StatusCode::kInvalidArgument,
                 "intermediate / num_kv_heads (a reduction slice) 130");
    c.intermediate = 528;  // 264 per TP 2 rank, but 132 per slice
    EXPECT_OK(check_cuda_model_config(c, 1, {}));
    expect_error(check_cuda_model_config(c, 2, {}), StatusCode::kInvalidArgument,
                 "intermediate / num_kv_heads (a reduction slice) 132");
    c.intermediate = 516;  // does not split over 4 slices (nor into 8-element rows)
    expect_error(check_cuda_model_config(c, 2, {}), StatusCode::kInvalidArgument,
                 "intermediate / tp 258");
    ModelConfig l8 = *resolve_model("llama3-8b");
    l8.num_layers = 2;
    EXPECT_OK(check_cuda_model_config(l8, 8, {}));
    EXPECT_FALSE(uses_sliced_reduction(1, {}));
    EXPECT_TRUE(uses_sliced_reduction(1, sliced));
    EXPECT_TRUE(uses_sliced_reduction(2, {}));
}

TEST(CudaModelConfig, RejectsWhatItDoesNotBuild) {
    expect_error(check_cuda_model_config(*resolve_model("deepseek-v3"), 1, {}),
                 StatusCode::kUnimplemented, "MLA");
    expect_error(check_cuda_model_config(*resolve_model("hybrid-tiny"), 1, {}),
                 StatusCode::kUnimplemented, "sliding-window");
}

TEST(CudaModelConfig, RejectsShapesTheKernelsCannotPack) {
    ModelConfig c = tiny2();
    c.vocab = 500;
    expect_error(check_cuda_model_config(c, 1, {}), StatusCode::kInvalidArgument, "vocab 500");
    c = tiny2();
    c.intermediate = 516;
    expect_error(check_cuda_model_config(c, 1, {}), StatusCode::kInvalidArgument,
                 "intermediate 516");
    c = tiny2();
    c.num_layers = 0;
    expect_error(check_cuda_model_config(c, 1, {}), StatusCode::kInvalidArgument, "num_layers");
}

TEST(CudaModelConfig, RejectsBadOptions) {
    CudaModelOptions o;
    o.max_bs = 65;
    o.max_tokens = 64;
    expect_error(check_cuda_model_config(tiny2(), 1, o), StatusCode::kInvalidArgument,
                 "options.max_bs 65");
    o = {};
    o.max_positions = 0;
    expect_error(check_cuda_model_config(tiny2(), 1, o), StatusCode::kInvalidArgument,
                 "options.max_positions");
    o = {};
    o.staging_slots = 0;
    expect_error(check_cuda_model_config(tiny2(), 1, o), StatusCode::kInvalidArgument,
                 "options.staging_slots");
    o = {};
    o.device = -1;
    expect_error(check_cuda_model_config(tiny2(), 1, o), StatusCode::kInvalidArgument,
                 "options.device");
}

TEST(WeightMemory, MatchesTheParameterCountInBf16PlusFp32Norms) {
    for (const char* name : {"tiny", "llama3-8b", "llama3-70b"}) {
        const ModelConfig c = *resolve_model(name);
        const WeightMemory m = estimate_weight_memory(c);
        // num_params counts projections and embeddings (bf16 here); the norms are extra (fp32).
        const int64_t norms = (2LL * c.num_layers + 1) * c.hidden * 4;
        EXPECT_EQ(m.total, 2 * c.num_params() + norms) << name;
        EXPECT_EQ(m.per_layer, m.qkv + m.o_proj + m.gate_up + m.down + m.norms) << name;
    }
    const WeightMemory l8 = estimate_weight_memory(*resolve_model("llama3-8b"));
    EXPECT_EQ(l8.qkv, (4096 + 2 * 1024) * 4096 * 2);
    EXPECT_EQ(l8.gate_up, 2LL * 14336 * 4096 * 2);
    EXPECT_EQ(l8.embedding, 128256LL * 4096 * 2);
    // A TP rank holds 1 / tp of every projection and all of the embeddings and norms.
    const WeightMemory l8tp4 = estimate_weight_memory(*resolve_model("llama3-8b"), 4);
    EXPECT_EQ(l8tp4.qkv * 4, l8.qkv);
    EXPECT_EQ(l8tp4.o_proj * 4, l8.o_proj);
    EXPECT_EQ(l8tp4.gate_up * 4, l8.gate_up);
    EXPECT_EQ(l8tp4.down * 4, l8.down);
    EXPECT_EQ(l8tp4.norms, l8.norms);
    EXPECT_EQ(l8tp4.embedding, l8.embedding);
    EXPECT_EQ(l8tp4.lm_head, l8.lm_head);
    EXPECT_EQ(l8tp4.total, l8.total - 3 * (l8.qkv + l8.o_proj + l8.gate_up + l8.down) / 4 * 32);
}

TEST(InputLayout, RegionsAreAlignedAndDisjoint) {
    const InputLayout l = input_layout(13, 5);
    EXPECT_EQ(l.tokens, 0);
    EXPECT_EQ(l.out_cache_loc, 16);  // 13 rounded up to 16-byte (4-element) boundaries
    EXPECT_EQ(l.seq_lens, 32);
    EXPECT_EQ(l.qo_indptr, 40);
    EXPECT_EQ(l.total, 48);  // 40 + 6 rounded up
    for (int64_t off : {l.tokens, l.out_cache_loc, l.seq_lens, l.qo_indptr, l.total}) {
        EXPECT_EQ(off % 4, 0);
    }
}

// A rank's sizes: T tokens, B requests, hidden H, its q and KV columns, intermediate I, vocab V.
struct RankSizes {
    size_t T, B, H, q, kv, I, V;
};

// The buffers every forward uses, (offset, bytes) in layout order.
std::vector<std::pair<size_t, size_t>> forward_regions(const WorkspaceLayout& w,
                                                       const RankSizes& n) {
    return {{w.hidden, n.T * n.H * 2},
            {w.normed, n.T * n.H * 2},
            {w.qkv, n.T * (n.q + 2 * n.kv) * 2},
            {w.q, n.T * n.q * 2},
            {w.k, n.T * n.kv * 2},
            {w.v, n.T * n.kv * 2},
            {w.attn, n.T * n.q * 2},
            {w.gate_up, n.T * 2 * n.I * 2},
            {w.act, n.T * n.I * 2},
            {w.positions, n.T * 4},
            {w.last, n.B * n.H * 2},
            {w.last_normed, n.B * n.H * 2},
            {w.logits, n.B * n.V * 4},
            {w.sampled, n.B * 4},
            {w.inputs,
             static_cast<size_t>(input_layout(static_cast<int>(n.T), static_cast<int>(n.B)).total) *
                 4}};
}

// Every region 256-byte aligned, inside the workspace, and before the next one.
void expect_aligned_and_disjoint(const std::vector<std::pair<size_t, size_t>>& regions,
                                 size_t total_bytes) {
    for (size_t i = 0; i < regions.size(); ++i) {
        EXPECT_EQ(regions[i].first % 256, 0u) << "region " << i;
        const size_t end = regions[i].first + regions[i].second;
        EXPECT_LE(end, total_bytes) << "region " << i;
        if (i + 1 < regions.size()) {
            EXPECT_LE(end, regions[i + 1].first) << "region " << i;
        }
    }
}

TEST(Workspace, BuffersAreAlignedLargeEnoughAndDisjoint) {
    const ModelConfig c = tiny2();
    CudaModelOptions o;
    o.max_tokens = 100;
    o.max_bs = 10;
    const WorkspaceLayout w = plan_workspace(c, o);
    expect_aligned_and_disjoint(
        forward_regions(
            w, {.T = 100, .B = 10, .H = 256, .q = 8 * 64, .kv = 4 * 64, .I = 512, .V = 512}),
        w.total_bytes);
    EXPECT_EQ(w.input.total, input_layout(100, 10).total);
    // No sliced-reduction buffers on the default TP 1 forward.
    EXPECT_EQ(w.partials_bytes, 0u);
    EXPECT_EQ(w.gathered_bytes, 0u);
}

// TP 2 of tiny (4 canonical slices, 2 on this rank): this rank's heads and intermediate size, the
// slice-major GEMM input, the partials of its 2 slices and the gathered partials of all 4.
TEST(Workspace, TpRanksHoldTheirSlicesAndTheExchange) {
    const ModelConfig c = tiny2();
    CudaModelOptions o;
    o.max_tokens = 100;
    o.max_bs = 10;
    const WorkspaceLayout w = plan_workspace(c, o, 2);
    const RankSizes n{.T = 100, .B = 10, .H = 256, .q = 4 * 64, .kv = 2 * 64, .I = 256, .V = 512};
    EXPECT_EQ(w.partials_bytes, 2 * n.T * n.H * 4);
    EXPECT_EQ(w.gathered_bytes, 4 * n.T * n.H * 4);
    std::vector<std::pair<size_t, size_t>> regions = forward_regions(w, n);
    regions.push_back({w.slice_in, n.T * std::max(n.q, n.I) * 2});
    regions.push_back({w.partials, w.partials_bytes});
    regions.push_back({w.gathered, w.gathered_bytes});
    expect_aligned_and_disjoint(regions, w.total_bytes);
    // A sliced TP 1 rank: every slice's partials, nothing to gather.
    o.sliced_reduction = true;
    const WorkspaceLayout one = plan_workspace(c, o, 1);
    EXPECT_EQ(one.partials_bytes, 4 * n.T * n.H * 4);
    EXPECT_EQ(one.gathered_bytes, 0u);
    EXPECT_GT(one.total_bytes,
              plan_workspace(c, CudaModelOptions{.max_tokens = 100, .max_bs = 10}).total_bytes);
}

// Two requests: 3 new tokens of 5, and 2 new of 2, pages of 4.
StepBatch two_requests() {
    StepBatch b;
    b.mode = attn::ForwardMode::kExtend;
    b.tokens = {1, 2, 3, 4, 5};
    b.out_cache_loc = {10, 11, 12, 16, 17};
    b.seq_lens = {5, 2};
    b.extend_lens = {3, 2};
    b.page_table_stride = 2;
    b.page_table = {2, 3, 4, 0};
    return b;
}

TEST(StepBatchCheck, AcceptsAConsistentBatch) {
    EXPECT_OK(check_step_batch(two_requests(), tiny2(), {}, {8, 4}));
}

TEST(StepBatchCheck, NamesTheBadField) {
    const ModelConfig c = tiny2();
    const PoolGeometry pool{8, 4};
    struct Case {
        const char* what;
        void (*edit)(StepBatch&, CudaModelOptions&);
        const char* expect;
    };
    const Case cases[] = {
        {"too many tokens", [](StepBatch&, CudaModelOptions& o) { o.max_tokens = 4; },
         "max_tokens 4"},
        {"too many requests", [](StepBatch&, CudaModelOptions& o) { o.max_bs = 1; }, "max_bs 1"},
        {"slots", [](StepBatch& b, CudaModelOptions&) { b.out_cache_loc.pop_back(); },
         "batch.out_cache_loc: 4 slots for 5 tokens"},
        {"extend_lens size", [](StepBatch& b, CudaModelOptions&) { b.extend_lens.pop_back(); },
         "batch.extend_lens: 1 entries"},
        {"extend > seq", [](StepBatch& b, CudaModelOptions&) { b.seq_lens[1] = 1; },
         "batch.extend_lens[1] 2 with seq_len 1"},
        {"sum",
         [](StepBatch& b, CudaModelOptions&) {
             b.extend_lens = {2, 2};
         },
         "sum to 4"},
        {"decode", [](StepBatch& b, CudaModelOptions&) { b.mode = attn::ForwardMode::kDecode; },
         "a decode batch has 1 token"},
        {"idle", [](StepBatch& b, CudaModelOptions&) { b.mode = attn::ForwardMode::kIdle; },
         "idle with 2 requests"},
        {"positions", [](StepBatch&, CudaModelOptions& o) { o.max_positions = 4; },
         "batch.seq_lens[0] 5 exceeds options.max_positions 4"},
        {"token", [](StepBatch& b, CudaModelOptions&) { b.tokens[2] = 512; },
         "batch.tokens[2]: token id 512"},
        {"slot range", [](StepBatch& b, CudaModelOptions&) { b.out_cache_loc[4] = 32; },
         "batch.out_cache_loc[4]: slot 32"},
        {"stride", [](StepBatch& b, CudaModelOptions&) { b.page_table_stride = 0; },
         "batch.page_table_stride 0"},
        {"narrow",
         [](StepBatch& b, CudaModelOptions&) {
             b.page_table_stride = 1;
             b.page_table = {2, 4};
         },
         "request 0 has seq_len 5, 2 pages"},
        {"short table", [](StepBatch& b, CudaModelOptions&) { b.page_table.pop_back(); },
         "batch.page_table: 3 entries"},
        {"page id", [](StepBatch& b, CudaModelOptions&) { b.page_table[1] = 8; },
         "batch.page_table[0][1]: page 8"},
    };
    for (const Case& k : cases) {
        StepBatch b = two_requests();
        CudaModelOptions o;
        k.edit(b, o);
        const Status st = check_step_batch(b, c, o, pool);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << k.what << ": " << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr(k.expect)) << k.what;
    }
}

TEST(StepBatchCheck, AnEmptyBatchIsValid) {
    StepBatch idle;
    idle.mode = attn::ForwardMode::kIdle;
    EXPECT_OK(check_step_batch(idle, tiny2(), {}, {8, 4}));
}

TEST(PackInputs, WritesEveryRegionAndThePrefixSum) {
    const StepBatch b = two_requests();
    const InputLayout l = input_layout(8, 4);
    std::vector<int32_t> slot(static_cast<size_t>(l.total), -7);
    pack_inputs(b, l, slot);
    auto region = [&](int64_t off, size_t n) {
        return std::vector<int32_t>(slot.begin() + off,
                                    slot.begin() + off + static_cast<int64_t>(n));
    };
    EXPECT_THAT(region(l.tokens, 5), ElementsAre(1, 2, 3, 4, 5));
    EXPECT_THAT(region(l.out_cache_loc, 5), ElementsAre(10, 11, 12, 16, 17));
    EXPECT_THAT(region(l.seq_lens, 2), ElementsAre(5, 2));
    EXPECT_THAT(region(l.qo_indptr, 3), ElementsAre(0, 3, 5));
    EXPECT_EQ(slot[static_cast<size_t>(l.tokens + 5)], -7);  // only the used prefix is written
}

TEST(DecodeBuckets, DefaultsArePowersOfTwoThenTheMaximum) {
    EXPECT_THAT(default_decode_buckets(64), ElementsAre(1, 2, 4, 8, 16, 32, 64));
    EXPECT_THAT(default_decode_buckets(48), ElementsAre(1, 2, 4, 8, 16, 32, 48));
    EXPECT_THAT(default_decode_buckets(1), ElementsAre(1));
    EXPECT_TRUE(default_decode_buckets(0).empty());
}

TEST(DecodeBuckets, ChecksAndChoice) {
    const std::vector<int> b = {1, 2, 4, 8, 16, 32, 64};
    EXPECT_OK(check_decode_buckets(b, 64));
    expect_error(check_decode_buckets(std::vector<int>{}, 64), StatusCode::kInvalidArgument,
                 "none given");
    expect_error(check_decode_buckets(std::vector<int>{1, 4, 4}, 64), StatusCode::kInvalidArgument,
                 "must increase: buckets[2] 4");
    expect_error(check_decode_buckets(std::vector<int>{0, 4}, 64), StatusCode::kInvalidArgument,
                 "buckets[0] 0 outside [1, max_bs 64]");
    expect_error(check_decode_buckets(std::vector<int>{8, 128}, 64), StatusCode::kInvalidArgument,
                 "buckets[1] 128");
    EXPECT_EQ(choose_bucket(b, 1), 1);
    EXPECT_EQ(choose_bucket(b, 3), 4);
    EXPECT_EQ(choose_bucket(b, 7), 8);
    EXPECT_EQ(choose_bucket(b, 33), 64);
    EXPECT_EQ(choose_bucket(b, 64), 64);
    EXPECT_EQ(choose_bucket(b, 65), std::nullopt);
}

TEST(DecodePadding, PadsToTheBucketWithNullPageRequests) {
    StepBatch d;
    d.mode = attn::ForwardMode::kDecode;
    d.tokens = {7, 9, 11};
    d.out_cache_loc = {21, 34, 40};
    d.seq_lens = {6, 3, 1};
    d.extend_lens = {1, 1, 1};
    d.page_table_stride = 2;
    d.page_table = {5, 6, 8, 0, 10, 0};
    auto p = pad_decode_batch(d, 4);
    ASSERT_OK(p);
    EXPECT_THAT(p->tokens, ElementsAre(7, 9, 11, 0));
    EXPECT_THAT(p->out_cache_loc, ElementsAre(21, 34, 40, 0));
    EXPECT_THAT(p->seq_lens, ElementsAre(6, 3, 1, 1));
    EXPECT_THAT(p->extend_lens, ElementsAre(1, 1, 1, 1));
    EXPECT_EQ(p->page_table_stride, 2);
    EXPECT_THAT(p->page_table, ElementsAre(5, 6, 8, 0, 10, 0, 0, 0));
    EXPECT_OK(check_step_batch(*p, tiny2(), {}, {16, 4}));

    auto same = pad_decode_batch(d, 3);
    ASSERT_OK(same);
    EXPECT_EQ(same->tokens, d.tokens);

    expect_error(pad_decode_batch(d, 2).status(), StatusCode::kInvalidArgument,
                 "3 requests do not fit bucket 2");
    StepBatch e = two_requests();
    expect_error(pad_decode_batch(e, 4).status(), StatusCode::kInvalidArgument, "not decode");

    const StepBatch pad = padding_decode_batch(3);
    EXPECT_THAT(pad.tokens, ElementsAre(0, 0, 0));
    EXPECT_THAT(pad.seq_lens, ElementsAre(1, 1, 1));
    EXPECT_THAT(pad.page_table, ElementsAre(0, 0, 0));
    EXPECT_EQ(pad.page_table_stride, 1);
    EXPECT_OK(check_step_batch(pad, tiny2(), {}, {2, 4}));
}

TEST(KvDigest, Fnv1aKnownValues) {
    auto bytes = [](const char* s) {
        return std::span<const std::byte>(reinterpret_cast<const std::byte*>(s), std::strlen(s));
    };
    EXPECT_EQ(fnv1a64(bytes("")), 0xcbf29ce484222325ULL);
    EXPECT_EQ(fnv1a64(bytes("a")), 0xaf63dc4c8601ec8cULL);
    EXPECT_EQ(fnv1a64(bytes("foobar")), 0x85944171f73967e8ULL);
    // Continuing a hash equals hashing the concatenation.
    EXPECT_EQ(fnv1a64(bytes("bar"), fnv1a64(bytes("foo"))), fnv1a64(bytes("foobar")));
}

// A CPU bf16 pool: 2 layers, pages of 4 tokens, 2 KV heads of 8 dims.
std::unique_ptr<kv::MHATokenToKVPool> cpu_pool() {
    kv::MHAPoolConfig pc;
    pc.num_layers = 2;
    pc.num_pages = 8;
    pc.page_size = 4;
    pc.num_kv_heads = 2;
    pc.head_dim = 8;
    pc.dtype = kv::KVDtype::kBF16;
    auto pool = kv::MHATokenToKVPool::create(pc);
    EXPECT_OK(pool);
    EXPECT_OK((*pool)->fill(0x5a));  // the pages' unused tails hold garbage
    return std::move(*pool);
}

// Writes token t of a request (value base + t + layer / 10, per element) into `pages`.
void write_request(kv::MHATokenToKVPool& pool, const std::vector<int32_t>& pages, int n,
                   float base) {
    const int elems = 2 * 8;
    for (int l = 0; l < pool.num_layers(); ++l) {
        std::vector<int32_t> locs;
        std::vector<float> k, v;
        for (int t = 0; t < n; ++t) {
            locs.push_back(pages[static_cast<size_t>(t / 4)] * 4 + t % 4);
            for (int e = 0; e < elems; ++e) {
                k.push_back(base + static_cast<float>(t) + 0.1f * static_cast<float>(l) +
                            0.01f * static_cast<float>(e));
                v.push_back(-k.back());
            }
        }
        ASSERT_TRUE(pool.set_kv_buffer(l, runtime::host_view(locs.data(), {n}),
                                       runtime::host_view(k.data(), {n, 2, 8}),
                                       runtime::host_view(v.data(), {n, 2, 8}))
                        .ok());
    }
}

TEST(KvDigest, DependsOnTheTokensNotOnWhichPagesHoldThem) {
    auto a = cpu_pool();
    auto b = cpu_pool();
    const std::vector<int32_t> pages_a = {1, 2, 3}, pages_b = {6, 4, 7};
    write_request(*a, pages_a, 10, 1.f);
    write_request(*b, pages_b, 10, 1.f);
    auto da = request_kv_digest(*a, pages_a, 10);
    auto db = request_kv_digest(*b, pages_b, 10);
    ASSERT_OK(da);
    ASSERT_OK(db);
    ASSERT_EQ(da->size(), 2u);
    EXPECT_EQ(*da, *db);
    EXPECT_NE((*da)[0], (*da)[1]);

    // The bytes come back in token order: token 5 of layer 1's V, element 3.
    auto vb = read_request_kv(*a, 1, 1, pages_a, 10);
    ASSERT_OK(vb);
    ASSERT_EQ(vb->size(), 10u * 16 * 2);
    bf16_t bits = 0;
    std::memcpy(&bits, vb->data() + (5 * 16 + 3) * 2, 2);
    EXPECT_EQ(bits, float_to_bf16(-(1.f + 5.f + 0.1f + 0.03f)));

    // One changed token changes only its layers' digests.
    write_request(*b, pages_b, 10, 1.f);
    {
        std::vector<int32_t> loc = {pages_b[2] * 4 + 1};  // token 9
        std::vector<float> k(16, 42.f), v(16, 42.f);
        ASSERT_TRUE(b->set_kv_buffer(1, runtime::host_view(loc.data(), {1}),
                                     runtime::host_view(k.data(), {1, 2, 8}),
                                     runtime::host_view(v.data(), {1, 2, 8}))
                        .ok());
    }
    auto dc = request_kv_digest(*b, pages_b, 10);
    ASSERT_OK(dc);
    EXPECT_EQ((*dc)[0], (*da)[0]);
    EXPECT_NE((*dc)[1], (*da)[1]);
    // ... and a shorter request does not see token 9.
    EXPECT_EQ(*request_kv_digest(*b, pages_b, 9), *request_kv_digest(*a, pages_a, 9));
}

TEST(KvDigest, RejectsBadArguments) {
    auto pool = cpu_pool();
    const std::vector<int32_t> pages = {1, 2};
    expect_error(read_request_kv(*pool, 2, 0, pages, 4).status(), StatusCode::kInvalidArgument,
                 "layer 2");
    expect_error(read_request_kv(*pool, 0, 2, pages, 4).status(), StatusCode::kInvalidArgument,
                 "buf 2");
    expect_error(read_request_kv(*pool, 0, 0, pages, 9).status(), StatusCode::kInvalidArgument,
                 "seq_len 9 needs 3 pages of 4, 2 given");
    const std::vector<int32_t> bad = {1, 8};
    expect_error(request_kv_digest(*pool, bad, 5).status(), StatusCode::kInvalidArgument,
                 "pages[1] 8");
}

}  // namespace
}  // namespace pdsim::model::cuda
