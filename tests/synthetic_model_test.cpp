// The synthetic model: deterministic weights, and the invariances the testbed's outputs_match
// relies on (batch, chunking, prewrite, TP, KV-cached decode == recompute).
#include "backends/model/synthetic_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "backends/attention/attention_backend.h"
#include "backends/attention/hybrid_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/kv/state_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "tests/status_matchers.h"

namespace pdsim::model {
namespace {

ModelConfig test_config() {
    ModelConfig c = *resolve_model("tiny");
    c.num_layers = 2;
    c.vocab = 256;
    return c;
}

// Full and sliding layers alternating over 3 layers with a window of 8 tokens, far shorter than
// the test sequences: layer 1 attends to its last 8 positions, and layer 2 (full) reads what it
// wrote.
ModelConfig hybrid_test_config() {
    ModelConfig c = test_config();
    c.name = "hybrid-test";
    c.num_layers = 3;
    c.layer_kinds = {LayerKind::kFullAttention, LayerKind::kSlidingWindow};
    c.sliding_window = 8;
    return c;
}

// Every layer kind: full, recurrent (4 state heads of 16, conv 4), sliding (window 8).
ModelConfig recurrent_test_config() {
    ModelConfig c = test_config();
    c.name = "recurrent-test";
    c.num_layers = 3;
    c.layer_kinds = {LayerKind::kFullAttention, LayerKind::kRecurrent, LayerKind::kSlidingWindow};
    c.sliding_window = 8;
    c.state_heads = 4;
    c.state_head_dim = 16;
    c.conv_kernel = 4;
    return c;
}

// ModelInvariance's parameter: "<backend>" (tiny), "<backend>/hybrid" (hybrid_test_config()) or
// "<backend>/recurrent" (recurrent_test_config()).
std::string backend_of(const std::string& param) {
    return param.substr(0, param.find('/'));
}
ModelConfig config_of(const std::string& param) {
    if (param.find("/recurrent") != std::string::npos) return recurrent_test_config();
    return param.find("/hybrid") != std::string::npos ? hybrid_test_config() : test_config();
}

// One rank: a stream, a backend, a pool and the model.
struct Rank {
    runtime::CpuStream stream{"compute"};
    std::unique_ptr<attn::AttentionBackend> backend;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::unique_ptr<kv::StatePool> states;  // models with recurrent layers
    std::unique_ptr<SyntheticModel> model;

    Rank(const ModelConfig& cfg, const std::string& backend_name, TpComm* tp = nullptr,
         int page_size = 16) {
        const int tp_size = tp ? tp->size() : 1;
        model = std::move(SyntheticModel::create(cfg, tp, 1024).value());
        attn::AttentionConfig ac;
        ac.num_q_heads = cfg.num_q_heads / tp_size;
        ac.num_kv_heads = cfg.num_kv_heads / tp_size;
        ac.head_dim = cfg.head_dim;
        ac.stream = &stream;
        backend = std::move(attn::create_attention_backend(backend_name, ac).value());
        if (model->num_recurrent_layers() > 0) {
            backend = std::move(
                attn::HybridBackend::create(std::move(backend), attn::make_cpu_recurrent_mixer())
                    .value());
            states = std::move(kv::StatePool::create(model->state_pool_config(8)).value());
            EXPECT_OK(states->fill(0xFF));  // NaN: a request must start from a zero state
            EXPECT_OK(model->attach_state_pool(states.get()));
        }
        kv::MHAPoolConfig pc;
        pc.num_layers = cfg.num_layers;
        pc.num_pages = 128;
        pc.page_size = page_size;
        pc.num_kv_heads = cfg.num_kv_heads / tp_size;
        pc.head_dim = cfg.head_dim;
        pool = std::move(kv::MHATokenToKVPool::create(pc).value());
        EXPECT_OK(pool->fill(0));
    }
};

// A request laid out in the pool: pages and slots.
struct Seq {
    std::vector<int32_t> tokens;  // prompt + generated
    std::vector<int32_t> pages;
    int32_t state_slot = 1;  // in the state pool (models with recurrent layers)
};

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = std::uniform_int_distribution<int>(0, vocab - 1)(rng);
    return t;
}

// Builds the StepBatch for tokens [begin, end) of each sequence (extend), or the last token
// (decode).
StepBatch make_batch(const std::vector<Seq*>& seqs, const std::vector<std::pair<int, int>>& ranges,
                     attn::ForwardMode mode, int page_size, int stride) {
    StepBatch b;
    b.mode = mode;
    b.page_table_stride = stride;
    for (size_t i = 0; i < seqs.size(); ++i) {
        auto [begin, end] = ranges[i];
        for (int t = begin; t < end; ++t) {
            b.tokens.push_back(seqs[i]->tokens[static_cast<size_t>(t)]);
            b.out_cache_loc.push_back(
                seqs[i]->pages[static_cast<size_t>(t / page_size)] * page_size + t % page_size);
        }
        b.seq_lens.push_back(end);
        b.extend_lens.push_back(end - begin);
        b.state_slots.push_back(seqs[i]->state_slot);
        for (int p = 0; p < stride; ++p) {
            b.page_table.push_back(p < static_cast<int>(seqs[i]->pages.size())
                                       ? seqs[i]->pages[static_cast<size_t>(p)]
                                       : 0);
        }
    }
    return b;
}

std::vector<int32_t> run(Rank& r, const StepBatch& b, bool save = true) {
    std::vector<int32_t> next(b.seq_lens.size(), -1);
    EXPECT_OK(r.model->forward(b, *r.backend, *r.pool, next.data(), save));
    Status st = r.stream.synchronize();
    EXPECT_OK(st);
    return next;
}

// Bytes of layer `l`, buffer `b` for token slots of `seq` [0, n).
std::vector<uint8_t> kv_bytes(const kv::KVPool& pool, const Seq& s, int n, int l, int b) {
    std::vector<uint8_t> out;
    const size_t tb = pool.token_bytes(l, b);
    for (int t = 0; t < n; ++t) {
        const int64_t slot =
            static_cast<int64_t>(s.pages[static_cast<size_t>(t / pool.page_size())]) *
                pool.page_size() +
            t % pool.page_size();
        const auto* p =
            static_cast<const uint8_t*>(pool.data(l, b)) + static_cast<size_t>(slot) * tb;
        out.insert(out.end(), p, p + tb);
    }
    return out;
}

TEST(ModelConfig, NamedConfigsAndOverrides) {
    for (const auto& n : model_names()) {
        auto c = resolve_model(n);
        ASSERT_OK(c) << n;
        EXPECT_OK(validate_model(*c)) << n;
    }
    auto l70 = resolve_model("llama3-70b");
    EXPECT_EQ(l70->num_layers, 80);
    EXPECT_EQ(l70->num_kv_heads, 8);
    EXPECT_EQ(l70->kv_elems_per_token_per_layer(8), 2 * 1 * 128);
    EXPECT_EQ(check_tp(*l70, 3).code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(check_tp(*l70, 3).message(), HasSubstr("3 does not divide num_kv_heads 8"));
    EXPECT_OK(check_tp(*l70, 8));
    EXPECT_EQ(resolve_model("gpt-9").status().code(), StatusCode::kInvalidArgument);
    // ~70.6B parameters.
    EXPECT_NEAR(static_cast<double>(l70->num_params()) / 1e9, 70.6, 0.5);
}

// One model table (topology/model_shape.h): every built-in name resolves to exactly the topology
// layer's entry, the default ModelConfig is `tiny`, and one TP rule serves both layers.
TEST(ModelConfig, OneTableForTopologyAndBackends) {
    ASSERT_EQ(model_names().size(), topo::builtin_model_shapes().size());
    for (const topo::ModelShape& shape : topo::builtin_model_shapes()) {
        auto config = resolve_model(shape.name);
        ASSERT_THAT(config, IsOk()) << shape.name;
        EXPECT_TRUE(static_cast<const topo::ModelShape&>(*config) == shape) << shape.name;
        EXPECT_OK(validate_model(*config)) << shape.name;
        for (int tp : {0, 1, 2, 3, 4, 8, 16}) {
            const std::string topology_rule = topo::check_tp(shape, tp);
            EXPECT_THAT(check_tp(*config, tp),
                        topology_rule.empty()
                            ? IsOk()
                            : StatusIs(StatusCode::kInvalidArgument, ::testing::Eq(topology_rule)))
                << shape.name << " tp " << tp;
        }
    }
    const ModelConfig defaults;
    EXPECT_TRUE(static_cast<const topo::ModelShape&>(defaults) ==
                *topo::builtin_model_shape("tiny"));
    EXPECT_EQ(defaults.num_layers, 4);
    EXPECT_EQ(defaults.intermediate, 512);
    EXPECT_EQ(resolve_model("hybrid-tiny")->layer_kind(1), LayerKind::kSlidingWindow);
    EXPECT_EQ(resolve_model("deepseek-v3")->attention, AttentionKind::kMla);
}

TEST(SyntheticModel, WeightsAreDeterministicAndScaled) {
    EXPECT_EQ(SyntheticModel::weight_value(1, 2, 3, 1.f),
              SyntheticModel::weight_value(1, 2, 3, 1.f));
    EXPECT_NE(SyntheticModel::weight_value(1, 2, 3, 1.f),
              SyntheticModel::weight_value(2, 2, 3, 1.f));
    double sum = 0, sq = 0;
    for (uint64_t i = 0; i < 100000; ++i) {
        float w = SyntheticModel::weight_value(7, 1, i, 1.f);
        ASSERT_GE(w, -1.f);
        ASSERT_LT(w, 1.f);
        sum += w;
        sq += w * w;
    }
    EXPECT_NEAR(sum / 1e5, 0.0, 0.01);
    EXPECT_NEAR(sq / 1e5, 1.0 / 3, 0.01);  // uniform on [-1, 1)
}

TEST(SyntheticModel, RejectsBadBatchesAndHugeModels) {
    auto big = resolve_model("llama3-70b");
    auto st = SyntheticModel::create(*big, nullptr, 16);
    EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument, HasSubstr("GiB")));
    Rank r(test_config(), "cpu_ref");
    Seq s{random_tokens(5, 256, 1), {1}};
    s.tokens[2] = 9999;
    auto b = make_batch({&s}, {{0, 5}}, attn::ForwardMode::kExtend, 16, 1);
    std::vector<int32_t> next(1);
    EXPECT_EQ(r.model->forward(b, *r.backend, *r.pool, next.data()).code(),
              StatusCode::kInvalidArgument);
}

class ModelInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelInvariance, BatchChunkAndPrewriteInvariant) {
    const ModelConfig cfg = config_of(GetParam());
    const int ps = 16;
    Seq a{random_tokens(70, cfg.vocab, 11), {3, 9, 4, 20, 21}, 2};
    Seq b{random_tokens(33, cfg.vocab, 12), {7, 30, 31}, 5};
    // Reference: each request alone, in one forward.
    Rank solo(cfg, backend_of(GetParam()));
    auto na = run(solo, make_batch({&a}, {{0, 70}}, attn::ForwardMode::kExtend, ps, 8));
    auto nb = run(solo, make_batch({&b}, {{0, 33}}, attn::ForwardMode::kExtend, ps, 8));
    // Batched together.
    Rank batched(cfg, backend_of(GetParam()));
    auto nab =
        run(batched, make_batch({&a, &b}, {{0, 70}, {0, 33}}, attn::ForwardMode::kExtend, ps, 8));
    EXPECT_EQ(nab[0], na[0]);
    EXPECT_EQ(nab[1], nb[0]);
    // Chunked prefill (chunks of 29 tokens), with the prewrite path.
    Rank chunked(cfg, backend_of(GetParam()));
    std::vector<int32_t> nc;
    for (int begin = 0; begin < 70; begin += 29) {
        nc = run(chunked,
                 make_batch({&a}, {{begin, std::min(70, begin + 29)}}, attn::ForwardMode::kExtend,
                            ps, 8),
                 /*save=*/false);
    }
    EXPECT_EQ(nc[0], na[0]);
    for (int l = 0; l < cfg.num_layers; ++l) {
        for (int buf = 0; buf < 2; ++buf) {
            EXPECT_EQ(kv_bytes(*batched.pool, a, 70, l, buf), kv_bytes(*solo.pool, a, 70, l, buf))
                << l << "/" << buf;
            EXPECT_EQ(kv_bytes(*chunked.pool, a, 70, l, buf), kv_bytes(*solo.pool, a, 70, l, buf))
                << l << "/" << buf;
        }
    }
    if (solo.states != nullptr) {
        // The recurrent states after the prompt: the same bytes whether batched or chunked.
        for (int l = 0; l < solo.states->num_layers(); ++l) {
            for (int buf = 0; buf < 2; ++buf) {
                Seq slot_of_a{{}, {a.state_slot}};
                EXPECT_EQ(kv_bytes(*batched.states, slot_of_a, 1, l, buf),
                          kv_bytes(*solo.states, slot_of_a, 1, l, buf))
                    << "state " << l << "/" << buf;
                EXPECT_EQ(kv_bytes(*chunked.states, slot_of_a, 1, l, buf),
                          kv_bytes(*solo.states, slot_of_a, 1, l, buf))
                    << "state " << l << "/" << buf;
            }
        }
    }
}

TEST_P(ModelInvariance, CachedDecodeEqualsRecompute) {
    const ModelConfig cfg = config_of(GetParam());
    const int ps = 16;
    Seq s{random_tokens(20, cfg.vocab, 5), {2, 5, 6}};
    Rank r(cfg, backend_of(GetParam()));
    auto next = run(r, make_batch({&s}, {{0, 20}}, attn::ForwardMode::kExtend, ps, 3));
    for (int step = 0; step < 8; ++step) {
        s.tokens.push_back(next[0]);
        const int n = static_cast<int>(s.tokens.size());
        next = run(r, make_batch({&s}, {{n - 1, n}}, attn::ForwardMode::kDecode, ps, 3));
        // Recompute the whole sequence from scratch in a fresh rank: same next token.
        Rank fresh(cfg, backend_of(GetParam()));
        auto again = run(fresh, make_batch({&s}, {{0, n}}, attn::ForwardMode::kExtend, ps, 3));
        ASSERT_EQ(next[0], again[0]) << "step " << step;
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, ModelInvariance,
                         ::testing::Values("cpu_ref", "cpu", "cpu_ref/hybrid", "cpu/hybrid",
                                           "cpu_ref/recurrent", "cpu/recurrent"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                             std::string name = param_info.param;
                             std::replace(name.begin(), name.end(), '/', '_');
                             return name;
                         });

// The window is applied: the hybrid model's sliding layer (1) attends to 8 positions, so the KV
// that the full layer after it (2) writes differs from the same model with every layer full from
// position 8 on, and equals it before (where the window holds every earlier position). The cpu
// backend and the cpu_ref oracle agree on the hybrid model's next tokens.
TEST(SyntheticModel, SlidingWindowLayersAttendToTheirWindowOnly) {
    const ModelConfig hybrid = hybrid_test_config();
    ModelConfig dense = hybrid;
    dense.layer_kinds.clear();
    const int ps = 16;
    Seq a{random_tokens(40, hybrid.vocab, 31), {1, 2, 3}};
    Rank rh(hybrid, "cpu");
    Rank rd(dense, "cpu");
    Rank rref(hybrid, "cpu_ref");
    const auto batch = make_batch({&a}, {{0, 40}}, attn::ForwardMode::kExtend, ps, 3);
    const auto nh = run(rh, batch);
    run(rd, batch);
    EXPECT_EQ(run(rref, batch), nh);
    const size_t tb = rh.pool->token_bytes(2, 0);
    const auto kh = kv_bytes(*rh.pool, a, 40, 2, 0);
    const auto kd = kv_bytes(*rd.pool, a, 40, 2, 0);
    ASSERT_EQ(kh.size(), 40 * tb);
    // Positions 0..7: the window covers every earlier key; layer 2's K is the same.
    EXPECT_TRUE(
        std::equal(kh.begin(), kh.begin() + static_cast<std::ptrdiff_t>(8 * tb), kd.begin()));
    // Each later position's K differs (its layer-1 input left positions out).
    for (int t = 8; t < 40; ++t) {
        const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(t) * tb);
        EXPECT_FALSE(std::equal(kh.begin() + at, kh.begin() + at + static_cast<std::ptrdiff_t>(tb),
                                kd.begin() + at))
            << "position " << t;
    }
    // Layer 1 (the sliding layer) itself writes the same K in both: its input is layer 0's.
    EXPECT_EQ(kv_bytes(*rh.pool, a, 40, 1, 0), kv_bytes(*rd.pool, a, 40, 1, 0));
}

// Sliding layers in their own cache group: a pool that holds the sliding layers only, where a
// request keeps a ring of R pages (logical page j in ring[j % R], as the testbed's window.h lays
// them out). Against the same model with one pool for every layer, through chunked prefill and
// decode long enough for the ring to wrap several times, the next tokens are equal at every step
// and the ring holds the window's KV bit for bit. The window pool starts NaN-poisoned, and the
// full layers' pool does not hold the sliding layers at all, so a sliding layer that read outside
// its ring or wrote through the main pool would show.
class SlidingRing : public ::testing::TestWithParam<std::string> {};

TEST_P(SlidingRing, SameTokensAsOnePoolForEveryLayer) {
    const ModelConfig cfg = config_of(GetParam());
    const int ps = 4, chunk = 6, prompt = 30, decode_steps = 12;
    const int window = cfg.sliding_window;
    // The ring the testbed would give a rank that extends by up to `chunk` (window.h's rule:
    // floor((chunk + W - 2) / ps) + 2 = 5 pages of 4 tokens, for 42 positions).
    const int ring_pages = (chunk + window - 2) / ps + 2;
    ASSERT_EQ(ring_pages, 5);
    Rank one(cfg, "cpu", nullptr, ps);
    Rank grouped(cfg, "cpu", nullptr, ps);
    std::vector<int> full_layers, sliding_layers;
    for (int l = 0; l < cfg.num_layers; ++l) {
        if (cfg.layer_kind(l) == LayerKind::kSlidingWindow) sliding_layers.push_back(l);
        if (cfg.layer_kind(l) == LayerKind::kFullAttention) full_layers.push_back(l);
    }
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_pages = 128;
    pc.page_size = ps;
    pc.num_kv_heads = cfg.num_kv_heads;
    pc.head_dim = cfg.head_dim;
    pc.layers = full_layers;
    grouped.pool = std::move(kv::MHATokenToKVPool::create(pc).value());
    pc.layers = sliding_layers;
    pc.num_pages = 16;
    auto window_pool = std::move(kv::MHATokenToKVPool::create(pc).value());
    ASSERT_OK(window_pool->fill(0xFF));  // NaN
    ASSERT_OK(grouped.model->attach_window_pool(window_pool.get()));

    Seq a{random_tokens(prompt, cfg.vocab, 77), {}};
    for (int p = 1; p <= (prompt + decode_steps + ps - 1) / ps; ++p) a.pages.push_back(p);
    const std::vector<int32_t> ring = {9, 3, 12, 5, 7};  // any distinct pages of the window pool
    ASSERT_EQ(static_cast<int>(ring.size()), ring_pages);
    const int stride = static_cast<int>(a.pages.size());
    // The window fields of a batch of `a` computing [begin, end).
    auto with_ring = [&](StepBatch b, int begin, int end) {
        b.window_page_table_stride = stride;
        for (int t = begin; t < end; ++t) {
            b.window_out_cache_loc.push_back(ring[static_cast<size_t>(t / ps) % ring.size()] * ps +
                                             t % ps);
        }
        for (int p = 0; p < stride; ++p) {
            b.window_page_table.push_back(ring[static_cast<size_t>(p) % ring.size()]);
        }
        return b;
    };
    int steps = 0;
    for (int begin = 0; begin < prompt; begin += chunk) {
        const int end = std::min(prompt, begin + chunk);
        const StepBatch b =
            make_batch({&a}, {{begin, end}}, attn::ForwardMode::kExtend, ps, stride);
        const auto expect = run(one, b);
        EXPECT_EQ(run(grouped, with_ring(b, begin, end)), expect) << "chunk at " << begin;
        if (end == prompt) a.tokens.push_back(expect[0]);
        ++steps;
    }
    for (int i = 0; i < decode_steps; ++i) {
        const int pos = static_cast<int>(a.tokens.size()) - 1;
        const StepBatch b =
            make_batch({&a}, {{pos, pos + 1}}, attn::ForwardMode::kDecode, ps, stride);
        const auto expect = run(one, b);
        EXPECT_EQ(run(grouped, with_ring(b, pos, pos + 1)), expect) << "decode at " << pos;
        a.tokens.push_back(expect[0]);
        ++steps;
    }
    ASSERT_EQ(steps, 17);
    // The ring holds the last window's KV of every sliding layer exactly as the single pool does.
    const int n = static_cast<int>(a.tokens.size()) - 1;  // positions written
    for (int l : sliding_layers) {
        for (int buf = 0; buf < 2; ++buf) {
            const size_t tb = window_pool->token_bytes(l, buf);
            for (int t = n - window; t < n; ++t) {
                const int32_t one_slot = a.pages[static_cast<size_t>(t / ps)] * ps + t % ps;
                const int32_t ring_slot =
                    ring[static_cast<size_t>(t / ps) % ring.size()] * ps + t % ps;
                EXPECT_EQ(
                    std::memcmp(
                        static_cast<const char*>(one.pool->data(l, buf)) + one_slot * tb,
                        static_cast<const char*>(window_pool->data(l, buf)) + ring_slot * tb, tb),
                    0)
                    << "layer " << l << " buf " << buf << " position " << t;
            }
        }
    }
    // The full layers' pool holds no sliding layer: a forward that put one there is refused.
    EXPECT_EQ(grouped.pool->data(sliding_layers.front(), 0), nullptr);
    ASSERT_OK(grouped.model->attach_window_pool(nullptr));
    std::vector<int32_t> next(1);
    EXPECT_THAT(grouped.model->forward(
                    make_batch({&a}, {{n, n + 1}}, attn::ForwardMode::kDecode, ps, stride),
                    *grouped.backend, *grouped.pool, next.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not held by the pool")));
}

INSTANTIATE_TEST_SUITE_P(Kinds, SlidingRing, ::testing::Values("cpu/hybrid", "cpu/recurrent"),
                         [](const auto& param_info) {
                             return param_info.param.substr(param_info.param.find('/') + 1);
                         });

// attach_window_pool's refusals and the batch it then needs.
TEST(SyntheticModel, WindowPoolRefusals) {
    ModelConfig dense = hybrid_test_config();
    dense.layer_kinds.clear();
    Rank d(dense, "cpu");
    EXPECT_THAT(d.model->attach_window_pool(d.pool.get()),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no sliding-window layers")));
    const ModelConfig cfg = hybrid_test_config();
    Rank h(cfg, "cpu");
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_pages = 8;
    pc.page_size = 16;
    pc.num_kv_heads = cfg.num_kv_heads;
    pc.head_dim = cfg.head_dim;
    pc.layers = {0, 2};  // the full layers: not the sliding layer 1
    auto wrong = std::move(kv::MHATokenToKVPool::create(pc).value());
    EXPECT_THAT(h.model->attach_window_pool(wrong.get()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("does not hold sliding layer 1")));
    pc.layers = {1};
    auto right = std::move(kv::MHATokenToKVPool::create(pc).value());
    ASSERT_OK(h.model->attach_window_pool(right.get()));
    Seq a{random_tokens(4, cfg.vocab, 5), {1}};
    std::vector<int32_t> next(1);
    EXPECT_THAT(h.model->forward(make_batch({&a}, {{0, 4}}, attn::ForwardMode::kExtend, 16, 1),
                                 *h.backend, *h.pool, next.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("window slots")));
}

// In-process TP group for the test: ranks are threads, allgather is a rendezvous.
class InProcessTpGroup {
public:
    explicit InProcessTpGroup(int n) : n_(n), slots_(static_cast<size_t>(n)) {}
    class Member final : public TpComm {
    public:
        Member(InProcessTpGroup* g, int r) : g_(g), r_(r) {}
        int size() const override { return g_->n_; }
        int rank() const override { return r_; }
        Status allgather(const float* mine, size_t count, float* out) override {
            return g_->gather(r_, mine, count, out);
        }

    private:
        InProcessTpGroup* g_;
        int r_;
    };

private:
    Status gather(int r, const float* mine, size_t count, float* out) {
        std::unique_lock<std::mutex> lock(mu_);
        const uint64_t gen = gen_;
        slots_[static_cast<size_t>(r)] = mine;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++gen_;
            readers_ = n_;
            cv_.notify_all();
        } else if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; })) {
            return Status(StatusCode::kDeadlineExceeded, "allgather timed out");
        }
        for (int k = 0; k < n_; ++k)
            std::memcpy(out + static_cast<size_t>(k) * count, slots_[static_cast<size_t>(k)],
                        count * 4);
        // Nobody may leave (and overwrite its input) before everyone has copied.
        if (--readers_ == 0) cv_.notify_all();
        cv_.wait_for(lock, std::chrono::seconds(60), [&] { return readers_ == 0; });
        return {};
    }
    int n_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<const float*> slots_;
    int arrived_ = 0, readers_ = 0;
    uint64_t gen_ = 0;
};

TEST(SyntheticModel, TensorParallelIsBitIdenticalToTp1) {
    const ModelConfig cfg = test_config();  // 4 kv heads: TP 2 and 4 both allowed
    const int ps = 16;
    Seq a{random_tokens(40, cfg.vocab, 21), {1, 2, 3}};
    Seq b{random_tokens(9, cfg.vocab, 22), {4}};
    Rank tp1(cfg, "cpu");
    auto ref = run(tp1, make_batch({&a, &b}, {{0, 40}, {0, 9}}, attn::ForwardMode::kExtend, ps, 3));
    for (int tp : {2, 4}) {
        InProcessTpGroup group(tp);
        std::vector<std::unique_ptr<InProcessTpGroup::Member>> members;
        std::vector<std::unique_ptr<Rank>> ranks;
        for (int r = 0; r < tp; ++r) {
            members.push_back(std::make_unique<InProcessTpGroup::Member>(&group, r));
            ranks.push_back(std::make_unique<Rank>(cfg, "cpu", members.back().get()));
        }
        std::vector<std::vector<int32_t>> outs(static_cast<size_t>(tp));
        std::vector<std::thread> threads;
        for (int r = 0; r < tp; ++r) {
            threads.emplace_back([&, r] {
                outs[static_cast<size_t>(r)] =
                    run(*ranks[static_cast<size_t>(r)],
                        make_batch({&a, &b}, {{0, 40}, {0, 9}}, attn::ForwardMode::kExtend, ps, 3));
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < tp; ++r)
            EXPECT_EQ(outs[static_cast<size_t>(r)], ref) << "tp " << tp << " rank " << r;
        // Each rank's KV is exactly its head slice of the TP-1 KV.
        const int heads = cfg.num_kv_heads / tp;
        for (int r = 0; r < tp; ++r) {
            auto full = kv_bytes(*tp1.pool, a, 40, 1, 0);
            auto mine = kv_bytes(*ranks[static_cast<size_t>(r)]->pool, a, 40, 1, 0);
            const size_t head_bytes = static_cast<size_t>(cfg.head_dim) * 4;
            for (int t = 0; t < 40; ++t) {
                const size_t off_full =
                    (static_cast<size_t>(t) * cfg.num_kv_heads + static_cast<size_t>(r * heads)) *
                    head_bytes;
                const size_t off_mine = static_cast<size_t>(t) * heads * head_bytes;
                ASSERT_EQ(0, std::memcmp(&full[off_full], &mine[off_mine], heads * head_bytes))
                    << "tp " << tp << " t " << t;
            }
        }
    }
}

// A recurrent layer needs its state shape; the synthetic model needs its state heads to split into
// the canonical reduction slices. The built-in Qwen3-Next shape's state, worked by hand: 36 of its
// 48 layers are recurrent, each 32 heads x (128 x 128 + 3 taps x 384 channels) fp32 per request.
TEST(ModelConfig, RecurrentLayersNeedTheirStateShape) {
    ModelConfig c = recurrent_test_config();
    EXPECT_OK(validate_model(c));
    c.state_heads = 0;
    EXPECT_THAT(validate_model(c),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("state_heads: 0 must be >= 1")));
    c = recurrent_test_config();
    c.conv_kernel = 0;
    EXPECT_THAT(validate_model(c),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("conv_kernel")));
    c = recurrent_test_config();
    c.state_heads = 6;  // 4 slices
    EXPECT_THAT(SyntheticModel::create(c, nullptr, 16),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("multiple of num_kv_heads 4")));
    const ModelConfig qwen = *resolve_model("qwen3-next-80b");
    EXPECT_EQ(qwen.count_layers(LayerKind::kRecurrent), 36);
    EXPECT_EQ(qwen.state_bytes_per_request(), int64_t{36} * 32 * (128 * 128 + 3 * 384) * 4);
    const ModelConfig gemma = *resolve_model("gemma3-27b");
    EXPECT_EQ(gemma.count_layers(LayerKind::kSlidingWindow), 52);  // 62 layers, 5 of every 6
    EXPECT_EQ(gemma.state_bytes_per_request(), 0);
}

// The recurrent layers: their TP slices give the TP-1 tokens bit for bit, and each rank's states
// are its head slice of the TP-1 states.
TEST(SyntheticModel, RecurrentTensorParallelIsBitIdenticalToTp1) {
    const ModelConfig cfg = recurrent_test_config();  // 4 state heads: TP 2 and 4
    const int ps = 16;
    Seq a{random_tokens(40, cfg.vocab, 21), {1, 2, 3}, 3};
    Seq b{random_tokens(9, cfg.vocab, 22), {4}, 1};
    const auto batch = make_batch({&a, &b}, {{0, 40}, {0, 9}}, attn::ForwardMode::kExtend, ps, 3);
    Rank tp1(cfg, "cpu");
    const auto ref = run(tp1, batch);
    for (int tp : {2, 4}) {
        InProcessTpGroup group(tp);
        std::vector<std::unique_ptr<InProcessTpGroup::Member>> members;
        std::vector<std::unique_ptr<Rank>> ranks;
        for (int r = 0; r < tp; ++r) {
            members.push_back(std::make_unique<InProcessTpGroup::Member>(&group, r));
            ranks.push_back(std::make_unique<Rank>(cfg, "cpu", members.back().get()));
        }
        std::vector<std::vector<int32_t>> outs(static_cast<size_t>(tp));
        std::vector<std::thread> threads;
        for (int r = 0; r < tp; ++r) {
            threads.emplace_back([&, r] {
                outs[static_cast<size_t>(r)] = run(*ranks[static_cast<size_t>(r)], batch);
            });
        }
        for (auto& t : threads) t.join();
        const int heads = cfg.state_heads / tp;
        for (int r = 0; r < tp; ++r) {
            EXPECT_EQ(outs[static_cast<size_t>(r)], ref) << "tp " << tp << " rank " << r;
            const kv::StatePool& mine = *ranks[static_cast<size_t>(r)]->states;
            for (int buf = 0; buf < 2; ++buf) {
                const size_t head_bytes = mine.token_bytes(0, buf) / static_cast<size_t>(heads);
                const auto* full =
                    static_cast<const uint8_t*>(tp1.states->data(0, buf)) +
                    tp1.states->token_bytes(0, buf) * static_cast<size_t>(a.state_slot);
                const auto* part = static_cast<const uint8_t*>(mine.data(0, buf)) +
                                   mine.token_bytes(0, buf) * static_cast<size_t>(a.state_slot);
                EXPECT_EQ(0, std::memcmp(full + static_cast<size_t>(r * heads) * head_bytes, part,
                                         static_cast<size_t>(heads) * head_bytes))
                    << "tp " << tp << " rank " << r << " buffer " << buf;
            }
        }
    }
}

// The hybrid backend makes one record per model layer of an extend forward, whatever the layer's
// kind, and none for a decode forward; an attention-only backend refuses recurrent layers, and the
// model refuses to run them on one.
TEST(HybridBackend, OneRecordPerModelLayer) {
    const ModelConfig cfg = recurrent_test_config();
    Rank r(cfg, "cpu");
    auto counter = pd::StepCounter::create(r.stream);
    ASSERT_OK(counter.status());
    r.backend->register_step_counter(counter->get());
    Seq a{random_tokens(12, cfg.vocab, 7), {1}, 1};
    (*counter)->advance_step(cfg.num_layers);
    auto next = run(r, make_batch({&a}, {{0, 12}}, attn::ForwardMode::kExtend, 16, 1));
    EXPECT_EQ((*counter)->query_ready_cache_step(), cfg.num_layers);
    EXPECT_EQ((*counter)->records_published(), static_cast<uint64_t>(cfg.num_layers));
    a.tokens.push_back(next[0]);
    run(r, make_batch({&a}, {{12, 13}}, attn::ForwardMode::kDecode, 16, 1));
    EXPECT_EQ((*counter)->records_published(), static_cast<uint64_t>(cfg.num_layers));

    Rank plain(test_config(), "cpu");
    EXPECT_FALSE(plain.backend->capabilities().recurrent_layers);
    attn::RecurrentArgs args;
    args.layer.layer_id = 1;
    EXPECT_THAT(plain.backend->forward_recurrent(args),
                StatusIs(StatusCode::kUnimplemented, HasSubstr("attention only")));
    std::vector<int32_t> out(1);
    EXPECT_THAT(r.model->forward(make_batch({&a}, {{0, 13}}, attn::ForwardMode::kExtend, 16, 1),
                                 *plain.backend, *r.pool, out.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("HybridBackend")));
    // No state slots for a recurrent model: refused before anything runs.
    StepBatch no_slots = make_batch({&a}, {{0, 13}}, attn::ForwardMode::kExtend, 16, 1);
    no_slots.state_slots.clear();
    EXPECT_THAT(r.model->forward(no_slots, *r.backend, *r.pool, out.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("state slots")));
}

// The cpu mixer against a naive fp64 recurrence written from the math in hybrid_backend.h: a
// request starting at position 0 (its poisoned slot must be ignored) and one continuing a state
// set by hand, in one batch.
TEST(HybridBackend, CpuMixerMatchesNaiveRecurrence) {
    const int heads = 2, d = 8, taps = 3, channels = 3 * d;
    runtime::CpuStream stream("compute");
    attn::AttentionConfig ac;
    ac.num_q_heads = 2;
    ac.num_kv_heads = 2;
    ac.head_dim = 16;
    ac.stream = &stream;
    auto backend = attn::HybridBackend::create(
                       std::move(attn::create_attention_backend("cpu_ref", ac).value()),
                       attn::make_cpu_recurrent_mixer())
                       .value();
    auto pool = kv::StatePool::create({.num_layers = 1,
                                       .num_slots = 4,
                                       .num_heads = heads,
                                       .head_dim = d,
                                       .conv_kernel = taps})
                    .value();
    ASSERT_OK(pool->fill(0xFF));
    std::mt19937_64 rng(99);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    // Request 1 (slot 3) continues from position 5 with a known state.
    std::vector<float> init_state(static_cast<size_t>(heads) * d * d),
        init_conv(static_cast<size_t>(heads) * (taps - 1) * channels);
    for (float& x : init_state) x = u(rng);
    for (float& x : init_conv) x = u(rng);
    std::memcpy(pool->recurrent_state(0, 3, 0), init_state.data(), init_state.size() * 4);
    std::memcpy(pool->conv_state(0, 3, 0), init_conv.data(), init_conv.size() * 4);
    const std::vector<int32_t> seq_lens = {6, 8}, extend_lens = {6, 3}, slots = {2, 3};
    const int tokens = 9;
    std::vector<float> qkv(static_cast<size_t>(tokens) * heads * channels),
        gate(static_cast<size_t>(tokens) * heads),
        conv(static_cast<size_t>(heads) * channels * taps),
        out(static_cast<size_t>(tokens) * heads * d, std::numeric_limits<float>::quiet_NaN());
    for (float& x : qkv) x = u(rng);
    for (float& x : gate) x = 2.f * u(rng);
    for (float& x : conv) x = u(rng);
    const std::vector<int32_t> page_table = {1, 1};
    attn::ForwardBatch fb;
    fb.mode = attn::ForwardMode::kExtend;
    fb.bs = 2;
    fb.seq_lens = seq_lens;
    fb.extend_lens = extend_lens;
    fb.page_table = page_table;
    fb.page_table_stride = 1;
    ASSERT_OK(backend->init_forward_metadata(fb));
    attn::RecurrentArgs args;
    args.qkv = runtime::host_view(static_cast<const float*>(qkv.data()), {tokens, heads, channels});
    args.gate = runtime::host_view(static_cast<const float*>(gate.data()), {tokens, heads});
    args.conv_weight =
        runtime::host_view(static_cast<const float*>(conv.data()), {heads, channels, taps});
    args.state_slots = runtime::host_view(slots.data(), {2});
    args.layer = {
        .layer_id = 0, .state_layer = 0, .num_heads = heads, .head_dim = d, .conv_kernel = taps};
    args.pool = pool.get();
    args.bs = 2;
    args.out = runtime::host_view(out.data(), {tokens, heads, d});
    ASSERT_OK(backend->forward_recurrent(args));
    ASSERT_OK(stream.synchronize());

    for (int req = 0; req < 2; ++req) {
        const int first = req == 0 ? 0 : 6;
        for (int h = 0; h < heads; ++h) {
            std::vector<double> state(static_cast<size_t>(d) * d, 0.0);
            std::vector<double> window(static_cast<size_t>(taps - 1) * channels, 0.0);
            if (req == 1) {
                for (size_t i = 0; i < state.size(); ++i)
                    state[i] = init_state[static_cast<size_t>(h) * d * d + i];
                for (size_t i = 0; i < window.size(); ++i)
                    window[i] = init_conv[static_cast<size_t>(h) * window.size() + i];
            }
            for (int j = 0; j < extend_lens[static_cast<size_t>(req)]; ++j) {
                const int t = first + j;
                const float* x = &qkv[(static_cast<size_t>(t) * heads + h) * channels];
                std::vector<double> c(static_cast<size_t>(channels));
                for (int ch = 0; ch < channels; ++ch) {
                    const float* w = &conv[(static_cast<size_t>(h) * channels + ch) * taps];
                    double acc = w[taps - 1] * static_cast<double>(x[ch]);
                    for (int tap = 0; tap < taps - 1; ++tap)
                        acc += w[tap] * window[static_cast<size_t>(tap) * channels + ch];
                    c[static_cast<size_t>(ch)] = acc / (1.0 + std::exp(-acc));
                }
                for (int tap = 0; tap + 1 < taps - 1; ++tap)
                    for (int ch = 0; ch < channels; ++ch)
                        window[static_cast<size_t>(tap) * channels + ch] =
                            window[static_cast<size_t>(tap + 1) * channels + ch];
                for (int ch = 0; ch < channels; ++ch)
                    window[static_cast<size_t>(taps - 2) * channels + ch] = x[ch];
                double qn = 0, kn = 0;
                for (int i = 0; i < d; ++i) {
                    qn += c[static_cast<size_t>(i)] * c[static_cast<size_t>(i)];
                    kn += c[static_cast<size_t>(d + i)] * c[static_cast<size_t>(d + i)];
                }
                qn = 1.0 / (std::sqrt(qn) + 1e-6) / std::sqrt(static_cast<double>(d));
                kn = 1.0 / (std::sqrt(kn) + 1e-6);
                const double decay = 1.0 / (1.0 + std::exp(-static_cast<double>(
                                                      gate[static_cast<size_t>(t) * heads + h])));
                for (int a = 0; a < d; ++a)
                    for (int b = 0; b < d; ++b)
                        state[static_cast<size_t>(a) * d + b] =
                            decay * state[static_cast<size_t>(a) * d + b] +
                            c[static_cast<size_t>(d + a)] * kn * c[static_cast<size_t>(2 * d + b)];
                for (int b = 0; b < d; ++b) {
                    double o = 0;
                    for (int a = 0; a < d; ++a)
                        o += c[static_cast<size_t>(a)] * qn * state[static_cast<size_t>(a) * d + b];
                    const float got = out[(static_cast<size_t>(t) * heads + h) * d + b];
                    ASSERT_NEAR(got, o, 1e-4 + 1e-4 * std::abs(o))
                        << "request " << req << " head " << h << " token " << t << " dim " << b;
                }
            }
            // The state left in the slot is the naive one.
            const float* left = pool->recurrent_state(0, slots[static_cast<size_t>(req)], h);
            for (int i = 0; i < d * d; ++i)
                ASSERT_NEAR(left[i], state[static_cast<size_t>(i)], 1e-4) << "state " << i;
        }
    }
    // A slot outside the pool is refused before anything runs.
    const std::vector<int32_t> bad_slots = {2, 4};
    args.state_slots = runtime::host_view(bad_slots.data(), {2});
    EXPECT_THAT(backend->forward_recurrent(args),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("state_slots[1]")));
}

}  // namespace
}  // namespace pdsim::model
