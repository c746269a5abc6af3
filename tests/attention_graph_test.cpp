// Graph (CUDA-graph style) metadata on the CPU stream, for `cpu` and `cpu_ref`:
//  - capture: init_cuda_graph_state(max_bs, seq_lens_buf, extras) aliases the caller's seq_lens;
//    begin_capture; init_forward_metadata_capture_cuda_graph; forward per layer; end_capture;
//  - replay: the caller updates seq_lens_buf (stream idle), init_forward_metadata_replay_cuda_graph
//    (batch), graph->launch, synchronize; the output and pool must equal an eager cpu_ref run of
//    that batch, for batch A and then for a smaller batch B with other lengths and page tables;
//  - a negative control: skipping the replay metadata update (stale metadata) gives an output
//    that differs from B's oracle, so the comparison above can fail;
//  - eager init_forward_metadata for batch 2 while batch 1's forward is still queued (a gate task
//    holds the stream) must not change what batch 1 computes (metadata is stream-ordered);
//  - a replay of more new tokens than the captured views hold fails at run time, naming the view.
// Metric: |got - ref| <= tol * max(1, |ref|), tol 1e-5 (fp32 KV) / 1e-2 (bf16 KV).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "backends/pd/step_counter.h"
#include "tests/attention_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::test {
namespace {

using namespace std::chrono_literals;

constexpr int kLayers = 2;
constexpr int kMaxBs = 6;
constexpr int kMaxPagesPerSeq = 24;  // page_size 16: up to 384 tokens
constexpr int kMaxTokens = 64;       // static q/k/v/out rows
constexpr int kPoolPages = 160;

double tolerance(kv::KVDtype d) {
    return d == kv::KVDtype::kF32 ? 1e-5 : 1e-2;
}

Shape base_shape(kv::KVDtype dtype) {
    Shape s;
    s.num_q_heads = 8;
    s.num_kv_heads = 2;
    s.head_dim = 64;
    s.page_size = 16;
    s.dtype = dtype;
    s.num_layers = kLayers;
    return s;
}

Shape layer_shape(const Shape& base, int l) {
    Shape s = base;
    s.layer_id = l;
    return s;
}

// One batch per layer: the same layout (lengths, page table), different q/k/v.
std::vector<Batch> layered(const Shape& base, ForwardMode mode, const std::vector<Req>& reqs,
                           uint64_t seed) {
    std::vector<Batch> out;
    for (int l = 0; l < kLayers; ++l) {
        out.push_back(
            make_batch(layer_shape(base, l), mode, reqs, seed, 2, kPoolPages, 0, seed * 100 + l));
    }
    return out;
}

void init_layers(kv::MHATokenToKVPool& pool, const Shape& base, const std::vector<Batch>& bs,
                 bool with_new) {
    for (int l = 0; l < kLayers; ++l)
        init_pool(pool, layer_shape(base, l), bs[static_cast<size_t>(l)], with_new, l == 0);
}

// The oracle: eager cpu_ref over every layer, on its own pool.
struct Oracle {
    std::vector<std::vector<float>> out;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
};

Oracle eager_oracle(const Shape& base, const std::vector<Batch>& bs, bool save_kv) {
    Oracle o;
    o.pool = make_pool(base, kPoolPages);
    init_layers(*o.pool, base, bs, !save_kv);
    Runner r("cpu_ref", base);
    EXPECT_OK(r.create_status());
    EXPECT_OK(r.backend().init_forward_metadata(bs[0].forward_batch()));
    std::vector<float> decoy(bs[0].k.size(), kNaN);
    o.out.resize(kLayers);
    for (int l = 0; l < kLayers; ++l) {
        const Batch& b = bs[static_cast<size_t>(l)];
        o.out[static_cast<size_t>(l)].assign(static_cast<size_t>(b.num_tokens) * base.q_width(),
                                             kNaN);
        EXPECT_TRUE(forward_host(r.backend(), b.q.data(), save_kv ? b.k.data() : decoy.data(),
                                 save_kv ? b.v.data() : decoy.data(), layer_shape(base, l).layer(),
                                 b.locs.data(), b.num_tokens, *o.pool, b.mode, b.bs,
                                 o.out[static_cast<size_t>(l)].data(), save_kv)
                        .ok());
    }
    Status st = r.wait();
    EXPECT_OK(st);
    return o;
}

// The graph fixture: static buffers (what a CUDA graph's captured kernels point at), the aliased
// seq_lens buffer, one pool, one backend on one stream.
class GraphHarness {
public:
    GraphHarness(const std::string& backend, const Shape& base, ForwardMode mode, bool save_kv)
        : base_(base), mode_(mode), save_kv_(save_kv), runner_(backend, base) {
        pool_ = make_pool(base, kPoolPages);
        seq_lens_buf_.assign(kMaxBs, 1);
        for (int l = 0; l < kLayers; ++l) {
            q_[l].assign(static_cast<size_t>(kMaxTokens) * base.q_width(), kNaN);
            k_[l].assign(static_cast<size_t>(kMaxTokens) * base.kv_width(), kNaN);
            v_[l].assign(static_cast<size_t>(kMaxTokens) * base.kv_width(), kNaN);
            out_[l].assign(static_cast<size_t>(kMaxTokens) * base.q_width(), kNaN);
        }
        locs_.assign(kMaxTokens, 0);
    }

    // Captured or queued work points at the pool and the static buffers: drain before they go.
    ~GraphHarness() { runner_.stream().synchronize(kSyncTimeout).ignore_error(); }
    GraphHarness(const GraphHarness&) = delete;
    GraphHarness& operator=(const GraphHarness&) = delete;

    // Captures one forward per layer over the first `rows` rows of the static buffers.
    [[nodiscard]] Status capture(int capture_bs, int rows = kMaxTokens) {
        PDSIM_RETURN_IF_ERROR(runner_.create_status());
        GraphStateExtras extras;
        extras.max_pages_per_seq = kMaxPagesPerSeq;
        PDSIM_RETURN_IF_ERROR(
            init_backend_cuda_graph_state(backend(), kMaxBs, seq_lens_buf_.data(), extras));
        PDSIM_RETURN_IF_ERROR(runner_.stream().begin_capture());
        PDSIM_RETURN_IF_ERROR(
            backend().init_forward_metadata_capture_cuda_graph(capture_bs, mode_));
        for (int l = 0; l < kLayers; ++l) {
            // The static buffers (kMaxTokens rows): graph metadata decides how many rows each
            // replay uses.
            PDSIM_RETURN_IF_ERROR(forward_host(
                backend(), q_[l].data(), k_[l].data(), v_[l].data(), layer_shape(base_, l).layer(),
                locs_.data(), rows, *pool_, mode_, capture_bs, out_[l].data(), save_kv_));
        }
        PDSIM_ASSIGN_OR_RETURN(graph_, runner_.stream().end_capture());
        if (graph_->num_nodes() == 0)
            return Status(StatusCode::kInternal, "captured an empty graph");
        return {};
    }

    // Stream idle: the host stages batch `bs` into the static buffers and the aliased seq_lens.
    void stage(const std::vector<Batch>& bs) {
        ASSERT_OK(runner_.stream().synchronize(kSyncTimeout));
        ASSERT_LE(bs[0].bs, kMaxBs);
        ASSERT_LE(bs[0].num_tokens, kMaxTokens);
        ASSERT_LE(bs[0].stride, kMaxPagesPerSeq);
        init_layers(*pool_, base_, bs, !save_kv_);
        for (int l = 0; l < kLayers; ++l) {
            const Batch& b = bs[static_cast<size_t>(l)];
            std::fill(q_[l].begin(), q_[l].end(), kNaN);
            std::fill(k_[l].begin(), k_[l].end(), kNaN);
            std::fill(v_[l].begin(), v_[l].end(), kNaN);
            std::fill(out_[l].begin(), out_[l].end(), kNaN);
            std::copy(b.q.begin(), b.q.end(), q_[l].begin());
            if (save_kv_) {  // prewrite: the static k/v stay NaN decoys
                std::copy(b.k.begin(), b.k.end(), k_[l].begin());
                std::copy(b.v.begin(), b.v.end(), v_[l].begin());
            }
        }
        std::copy(bs[0].locs.begin(), bs[0].locs.end(), locs_.begin());
        std::copy(bs[0].seq_lens.begin(), bs[0].seq_lens.end(), seq_lens_buf_.begin());
    }

    [[nodiscard]] Status replay(const std::vector<Batch>& bs, bool update_metadata = true) {
        if (update_metadata)
            PDSIM_RETURN_IF_ERROR(
                backend().init_forward_metadata_replay_cuda_graph(bs[0].forward_batch()));
        PDSIM_RETURN_IF_ERROR(graph_->launch(runner_.stream()));
        return runner_.stream().synchronize(kSyncTimeout);
    }

    // Output rows of the batch (the static buffer may be larger).
    [[nodiscard]] std::vector<float> out(int l, const Batch& b) const {
        return {out_[l].begin(),
                out_[l].begin() +
                    static_cast<ptrdiff_t>(static_cast<size_t>(b.num_tokens) * base_.q_width())};
    }

    AttentionBackend& backend() { return runner_.backend(); }
    Runner& runner() { return runner_; }
    kv::MHATokenToKVPool& pool() { return *pool_; }
    std::vector<int32_t>& seq_lens_buf() { return seq_lens_buf_; }
    runtime::Graph& graph() { return *graph_; }

private:
    Shape base_;
    ForwardMode mode_;
    bool save_kv_;
    Runner runner_;
    std::unique_ptr<kv::MHATokenToKVPool> pool_;
    std::vector<int32_t> seq_lens_buf_;
    std::vector<float> q_[kLayers], k_[kLayers], v_[kLayers], out_[kLayers];
    std::vector<int32_t> locs_;
    std::unique_ptr<runtime::Graph> graph_;
};

void expect_matches(GraphHarness& g, const Shape& base, const std::vector<Batch>& bs, bool save_kv,
                    const std::string& what) {
    Oracle o = eager_oracle(base, bs, save_kv);
    for (int l = 0; l < kLayers; ++l) {
        EXPECT_TRUE(outputs_close(g.out(l, bs[static_cast<size_t>(l)]),
                                  o.out[static_cast<size_t>(l)], tolerance(base.dtype), base,
                                  bs[static_cast<size_t>(l)]))
            << what << ", layer " << l << ": graph replay vs eager cpu_ref | " << bs[0].describe();
    }
    EXPECT_TRUE(pools_equal(g.pool(), *o.pool)) << what << ": pool after the replay";
}

std::vector<Req> reqs_for(ForwardMode mode, std::vector<Req> extend, std::vector<int> decode_lens) {
    if (mode != ForwardMode::kDecode) return extend;
    std::vector<Req> r;
    for (int l : decode_lens) r.push_back({l - 1, 1});
    return r;
}

using Param = std::tuple<std::string, ForwardMode, kv::KVDtype, bool>;

class GraphReplay : public ::testing::TestWithParam<Param> {};

TEST_P(GraphReplay, ReplaySeesTheCurrentBatch) {
    const auto [name, mode, dtype, save_kv] = GetParam();
    const Shape base = base_shape(dtype);
    GraphHarness g(name, base, mode, save_kv);
    ASSERT_OK(g.capture(kMaxBs));

    const auto a = layered(
        base, mode,
        reqs_for(mode, {{40, 9}, {0, 17}, {15, 1}, {16, 16}, {200, 3}}, {1, 16, 17, 300, 64, 2}),
        1);
    const auto b = layered(base, mode, reqs_for(mode, {{100, 20}, {31, 2}}, {33, 250, 5}), 2);
    ASSERT_GT(a[0].bs, b[0].bs);

    g.stage(a);
    const std::vector<int32_t> staged_seq_lens = g.seq_lens_buf();
    Status st = g.replay(a);
    ASSERT_OK(st);
    EXPECT_EQ(g.seq_lens_buf(), staged_seq_lens)
        << "the backend must not write the aliased seq_lens";
    expect_matches(g, base, a, save_kv, "batch A");

    g.stage(b);
    st = g.replay(b);
    ASSERT_OK(st);
    expect_matches(g, base, b, save_kv, "batch B (smaller, in place)");

    // And back to A: nothing of B's metadata may stick.
    g.stage(a);
    st = g.replay(a);
    ASSERT_OK(st);
    expect_matches(g, base, a, save_kv, "batch A again");
}

// Negative control: B' (same bs as A, other page tables and lengths) replayed without
// init_forward_metadata_replay_cuda_graph runs on A's page tables: its output must NOT match
// B's oracle. Then the proper replay of B' matches.
TEST_P(GraphReplay, StaleMetadataIsDetected) {
    const auto [name, mode, dtype, save_kv] = GetParam();
    const Shape base = base_shape(dtype);
    GraphHarness g(name, base, mode, save_kv);
    ASSERT_OK(g.capture(4));
    const auto a = layered(
        base, mode, reqs_for(mode, {{40, 9}, {0, 17}, {15, 1}, {16, 16}}, {20, 16, 17, 200}), 3);
    const auto b = layered(
        base, mode, reqs_for(mode, {{60, 10}, {20, 5}, {30, 2}, {16, 1}}, {90, 40, 7, 150}), 4);
    g.stage(a);
    ASSERT_OK(g.replay(a));
    expect_matches(g, base, a, save_kv, "batch A");

    g.stage(b);
    Status st = g.replay(b, /*update_metadata=*/false);
    Oracle ob = eager_oracle(base, b, save_kv);
    // Either the stale replay fails, or it computes something other than B.
    if (st.ok()) {
        EXPECT_FALSE(outputs_close(g.out(0, b[0]), ob.out[0], tolerance(dtype), base, b[0]))
            << "stale metadata produced B's answer: the graph tests could not catch a missing "
               "replay update";
    }
    // A fresh harness (the stale run may have poisoned the stream) with the update: matches.
    GraphHarness g2(name, base, mode, save_kv);
    ASSERT_OK(g2.capture(4));
    g2.stage(a);
    ASSERT_OK(g2.replay(a));
    g2.stage(b);
    st = g2.replay(b);
    ASSERT_OK(st);
    expect_matches(g2, base, b, save_kv, "batch B' with the replay update");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
    const auto [name, mode, dtype, save_kv] = info.param;
    return name + "_" + std::string(forward_mode_name(mode)) + "_" +
           std::string(kv::dtype_name(dtype)) + (save_kv ? "_save" : "_prewrite");
}

INSTANTIATE_TEST_SUITE_P(
    Backends, GraphReplay,
    ::testing::Combine(::testing::Values("cpu", "cpu_ref"),
                       ::testing::Values(ForwardMode::kDecode, ForwardMode::kExtend),
                       ::testing::Values(kv::KVDtype::kF32, kv::KVDtype::kBF16), ::testing::Bool()),
    param_name);

// Records are stream work too: a captured extend forward records once per layer per launch.
TEST(GraphRecords, EachLaunchRecordsOncePerLayer) {
    for (const char* name : {"cpu", "cpu_ref"}) {
        const Shape base = base_shape(kv::KVDtype::kF32);
        GraphHarness g(name, base, ForwardMode::kExtend, true);
        pd::StepCounter counter(g.runner().stream());
        g.backend().register_step_counter(&counter);
        ASSERT_OK(g.capture(3));
        EXPECT_EQ(counter.records_published(), 0u) << name << ": capture must not run the records";
        const auto a = layered(base, ForwardMode::kExtend, {{10, 5}, {0, 3}, {33, 1}}, 5);
        for (int launch = 0; launch < 3; ++launch) {
            const int64_t begin = counter.advance_step(kLayers);
            g.stage(a);
            ASSERT_OK(g.replay(a));
            EXPECT_EQ(counter.records_published(), static_cast<uint64_t>((launch + 1) * kLayers))
                << name;
            EXPECT_TRUE(pd::StepCounter::is_step_ready(counter.query_ready_cache_step(),
                                                       begin + kLayers - 1));
            EXPECT_FALSE(
                pd::StepCounter::is_step_ready(counter.query_ready_cache_step(), begin + kLayers));
        }
        expect_matches(g, base, a, true, std::string(name) + " recorded graph");
    }
}

TEST(GraphState, ReplayValidatesAgainstTheGraphBuffers) {
    for (const char* name : {"cpu", "cpu_ref"}) {
        const Shape base = base_shape(kv::KVDtype::kF32);
        GraphHarness g(name, base, ForwardMode::kDecode, true);
        // Before init_cuda_graph_state: capture and replay are errors.
        const auto a = layered(base, ForwardMode::kDecode, {{3, 1}}, 6);
        EXPECT_FALSE(
            g.backend().init_forward_metadata_capture_cuda_graph(1, ForwardMode::kDecode).ok())
            << name;
        EXPECT_FALSE(g.backend().init_forward_metadata_replay_cuda_graph(a[0].forward_batch()).ok())
            << name;
        ASSERT_OK(g.capture(kMaxBs));
        // bs over max_bs, page-table rows wider than max_pages_per_seq: rejected on the host.
        std::vector<Req> many(kMaxBs + 1, Req{.prefix = 3, .new_tokens = 1});
        const auto big = layered(base, ForwardMode::kDecode, many, 7);
        EXPECT_FALSE(
            g.backend().init_forward_metadata_replay_cuda_graph(big[0].forward_batch()).ok())
            << name;
        Batch wide =
            make_batch(base, ForwardMode::kDecode, {{3, 1}}, 8, 2, kPoolPages, kMaxPagesPerSeq + 1);
        EXPECT_FALSE(g.backend().init_forward_metadata_replay_cuda_graph(wide.forward_batch()).ok())
            << name;
        EXPECT_FALSE(g.backend()
                         .init_forward_metadata_capture_cuda_graph(kMaxBs + 1, ForwardMode::kDecode)
                         .ok());
        ASSERT_OK(g.runner().stream().synchronize(kSyncTimeout));
    }
}

// The views a graph captured are its static buffers: a replay whose batch has more new tokens
// than they hold fails when it runs, naming the view, instead of reading or writing past them.
TEST(GraphState, ReplayOfMoreTokensThanTheViewsHoldFails) {
    for (const char* name : {"cpu", "cpu_ref"}) {
        const Shape base = base_shape(kv::KVDtype::kF32);
        GraphHarness g(name, base, ForwardMode::kExtend, true);
        ASSERT_OK(g.capture(kMaxBs, /*rows=*/8)) << name;
        const auto a = layered(base, ForwardMode::kExtend, {{10, 5}, {0, 6}}, 13);  // 11 new tokens
        g.stage(a);
        Status st = g.replay(a);
        EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << name << ": " << st.to_string();
        EXPECT_THAT(st.message(),
                    ::testing::HasSubstr("q: 8 rows, but the metadata describes 11 new tokens"))
            << name;
    }
}

// ---- eager metadata is stream-ordered ----------------------------------------------------------
TEST(EagerMetadata, NextBatchInitDoesNotCorruptAQueuedForward) {
    for (const char* name : {"cpu", "cpu_ref"}) {
        for (bool save_kv : {true, false}) {
            SCOPED_TRACE(std::string(name) + (save_kv ? " save_kv" : " prewrite"));
            const Shape base = base_shape(kv::KVDtype::kF32);
            const auto b1 = layered(base, ForwardMode::kExtend, {{40, 9}, {0, 17}, {200, 3}}, 11);
            const auto b2 = layered(base, ForwardMode::kDecode, {{99, 1}, {5, 1}}, 12);
            auto pool1 = make_pool(base, kPoolPages), pool2 = make_pool(base, kPoolPages);
            ASSERT_TRUE(pool1 && pool2);
            init_layers(*pool1, base, b1, !save_kv);
            init_layers(*pool2, base, b2, !save_kv);
            Runner r(name, base);
            ASSERT_OK(r.create_status());
            std::vector<std::vector<float>> out1(kLayers), out2(kLayers);
            std::vector<float> decoy(256 * base.kv_width(), kNaN);

            Gate gate;
            ASSERT_OK(gate.enqueue(r.stream()));
            auto issue = [&](const std::vector<Batch>& bs, kv::MHATokenToKVPool& pool,
                             std::vector<std::vector<float>>& out) {
                // The host arrays handed to init_forward_metadata are scribbled over right after
                // the call: the backend must have taken its own copy.
                std::vector<int32_t> seq = bs[0].seq_lens, ext = bs[0].extend_lens,
                                     pt = bs[0].page_table;
                ForwardBatch fb = bs[0].forward_batch();
                fb.seq_lens = seq;
                if (!fb.extend_lens.empty()) fb.extend_lens = ext;
                fb.page_table = pt;
                ASSERT_OK(r.backend().init_forward_metadata(fb));
                std::fill(seq.begin(), seq.end(), 1 << 20);
                std::fill(ext.begin(), ext.end(), -7);
                std::fill(pt.begin(), pt.end(), -1);
                for (int l = 0; l < kLayers; ++l) {
                    const Batch& b = bs[static_cast<size_t>(l)];
                    out[static_cast<size_t>(l)].assign(
                        static_cast<size_t>(b.num_tokens) * base.q_width(), kNaN);
                    ASSERT_TRUE(forward_host(
                                    r.backend(), b.q.data(), save_kv ? b.k.data() : decoy.data(),
                                    save_kv ? b.v.data() : decoy.data(),
                                    layer_shape(base, l).layer(), b.locs.data(), b.num_tokens, pool,
                                    b.mode, b.bs, out[static_cast<size_t>(l)].data(), save_kv)
                                    .ok());
                }
            };
            issue(b1, *pool1, out1);
            issue(b2, *pool2, out2);  // while batch 1 is still queued behind the gate
            ASSERT_TRUE(gate.wait_reached());
            for (const auto& o : out1)
                EXPECT_TRUE(std::isnan(o[0])) << "nothing may run before the gate opens";
            gate.release();
            Status st = r.wait();
            ASSERT_OK(st);
            Oracle o1 = eager_oracle(base, b1, save_kv), o2 = eager_oracle(base, b2, save_kv);
            for (int l = 0; l < kLayers; ++l) {
                EXPECT_TRUE(outputs_close(out1[static_cast<size_t>(l)],
                                          o1.out[static_cast<size_t>(l)], 1e-5, base,
                                          b1[static_cast<size_t>(l)]))
                    << "batch 1 layer " << l;
                EXPECT_TRUE(outputs_close(out2[static_cast<size_t>(l)],
                                          o2.out[static_cast<size_t>(l)], 1e-5, base,
                                          b2[static_cast<size_t>(l)]))
                    << "batch 2 layer " << l;
            }
            EXPECT_TRUE(pools_equal(*pool1, *o1.pool));
            EXPECT_TRUE(pools_equal(*pool2, *o2.pool));
        }
    }
}

}  // namespace
}  // namespace pdsim::attn::test
