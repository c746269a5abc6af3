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
#include "backends/kv/kv_pool.h"
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

// hybrid-tiny's layer pattern (full, sliding) over 3 layers with a window of 8 tokens, far
// shorter than the test sequences: layer 1 attends to its last 8 positions, and layer 2 (full)
// reads what it wrote.
ModelConfig hybrid_test_config() {
    ModelConfig c = test_config();
    c.name = "hybrid-test";
    c.num_layers = 3;
    c.layer_kinds = resolve_model("hybrid-tiny")->layer_kinds;
    c.sliding_window = 8;
    return c;
}

// ModelInvariance's parameter: "<backend>" (tiny) or "<backend>/hybrid" (hybrid_test_config()).
std::string backend_of(const std::string& param) {
    return param.substr(0, param.find('/'));
}
ModelConfig config_of(const std::string& param) {
    return param.find("/hybrid") != std::string::npos ? hybrid_test_config() : test_config();
}

// One rank: a stream, a backend, a pool and the model.
struct Rank {
    runtime::CpuStream stream{"compute"};
    std::unique_ptr<attn::AttentionBackend> backend;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
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
    Seq a{random_tokens(70, cfg.vocab, 11), {3, 9, 4, 20, 21}};
    Seq b{random_tokens(33, cfg.vocab, 12), {7, 30, 31}};
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
                         ::testing::Values("cpu_ref", "cpu", "cpu_ref/hybrid", "cpu/hybrid"),
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

}  // namespace
}  // namespace pdsim::model
