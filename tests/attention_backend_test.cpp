// The AttentionBackend base class: the PD record rule (RecordPdCacheStep) and its ordering against
// the KV write, on a test double (FakeRecordingBackend) and on the real `cpu` and `cpu_ref`
// backends; one record per layer per extend forward; the StepCounter stream check;
// init_backend_cuda_graph_state's extras filtering; and forward()'s argument checks: views of the
// wrong dtype, device or shape, and what a backend's declared capabilities exclude, are rejected
// with kInvalidArgument naming the argument before anything is enqueued or recorded.
//
// Expected rule (tokenspeed's record_pd_cache_step; docs/design.md "AttentionBackend"):
//   record = (record_kv_cache set ? *record_kv_cache : mode is neither decode nor idle)
//            && a StepCounter is registered;
//   save_kv_cache == false -> the record is enqueued BEFORE the attention work, else AFTER it.
#include "backends/attention/attention_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "tests/attention_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::test {
namespace {

using namespace std::chrono_literals;
using pd::StepCounter;
using ::testing::HasSubstr;

constexpr ForwardMode kAllModes[] = {ForwardMode::kExtend,       ForwardMode::kDecode,
                                     ForwardMode::kMixed,        ForwardMode::kIdle,
                                     ForwardMode::kTargetVerify, ForwardMode::kDraftExtend};

bool expect_record(ForwardMode mode, std::optional<bool> record_kv, bool registered) {
    const bool want = record_kv.has_value()
                          ? *record_kv
                          : (mode != ForwardMode::kDecode && mode != ForwardMode::kIdle);
    return want && registered;
}

std::string opt_name(std::optional<bool> o) {
    return !o.has_value() ? "unset" : (*o ? "true" : "false");
}

// A test double for the base-class rule. Its "attention work" is one stream task that logs the
// StepCounter's ready step at the moment it runs (the moment the backend's KV write would
// happen), then optionally blocks on `hold` so the host can look at the state while the write is
// in progress. It also reports which init_cuda_graph_state extras reached it.
class FakeRecordingBackend final : public AttentionBackend {
public:
    struct WriteLog {
        std::string path;  // "decode" or "extend": which forward_* ran
        bool save_kv_cache;
        int64_t ready_at_write;  // query_ready_cache_step() when the write task ran
        uint64_t published_at_write;
    };

    FakeRecordingBackend(const AttentionConfig& c,
                         std::set<std::string> accepted = {"max_pages_per_seq"})
        : AttentionBackend(c), accepted_(std::move(accepted)) {}
    // Queued write tasks point at this object: drain them first (an early test exit).
    ~FakeRecordingBackend() override { stream().synchronize(kSyncTimeout).ignore_error(); }

    [[nodiscard]] std::string name() const override { return "fake_recording"; }
    [[nodiscard]] BackendCapabilities capabilities() const override { return caps; }
    [[nodiscard]] std::set<std::string> accepted_graph_state_extras() const override {
        return accepted_;
    }
    [[nodiscard]] Status init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                               const GraphStateExtras& extras) override {
        ++graph_state_calls;
        received = extras;
        if (!graph_state_result.ok()) return graph_state_result;
        return AttentionBackend::init_cuda_graph_state(max_bs, seq_lens_buf, extras);
    }

    // Set before forward: the write task waits for it after logging.
    Gate* hold = nullptr;
    // Counter to read at write time (may differ from the registered one: none registered).
    StepCounter* observe = nullptr;

    [[nodiscard]] std::vector<WriteLog> log() const {
        std::lock_guard<std::mutex> lock(mu_);
        return log_;
    }

    int graph_state_calls = 0;
    GraphStateExtras received;
    Status graph_state_result;
    // What the fake declares it accepts (forward() enforces it).
    BackendCapabilities caps{{runtime::DType::kF32},
                             {runtime::DType::kF32, runtime::DType::kBF16},
                             {runtime::DeviceKind::kCpu}};

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override {
        return write("decode", args);
    }
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override {
        return write("extend", args);
    }

private:
    [[nodiscard]] Status write(const char* path, const ForwardArgs& args) {
        Gate* hold_gate = hold;
        StepCounter* c = observe;
        std::string p = path;
        bool save = args.save_kv_cache;
        PDSIM_RETURN_IF_ERROR(stream().enqueue([this, c, p, save] {
            std::lock_guard<std::mutex> lock(mu_);
            log_.push_back(
                {p, save, c ? c->query_ready_cache_step() : -1, c ? c->records_published() : 0});
            return Status();
        }));
        if (hold_gate != nullptr) PDSIM_RETURN_IF_ERROR(hold_gate->enqueue(stream()));
        return {};
    }

    std::set<std::string> accepted_;
    mutable std::mutex mu_;
    std::vector<WriteLog> log_;
};

// The fake never touches its pool; forward() still checks one (layers 0..3).
kv::KVPool& dummy_pool() {
    static std::unique_ptr<kv::MHATokenToKVPool> pool = [] {
        Shape s;
        s.num_q_heads = 4;
        s.num_kv_heads = 2;
        s.num_layers = 4;
        return make_pool(s, 2);
    }();
    return *pool;
}

// Well-formed host tensors of `tokens` tokens for layer l with 4 query and 2 KV heads of dim 64
// (the fake reads none).
struct FakeTensors {
    explicit FakeTensors(int tokens)
        : n(tokens),
          q(static_cast<size_t>(tokens) * 4 * 64),
          k(static_cast<size_t>(tokens) * 2 * 64),
          v(k.size()),
          out(q.size()),
          locs(static_cast<size_t>(tokens), 1) {}
    [[nodiscard]] Status forward(AttentionBackend& b, int layer, ForwardMode mode, int bs,
                                 bool save_kv = true,
                                 std::optional<bool> record_kv = std::nullopt) {
        return forward_host(
            b, q.data(), k.data(), v.data(),
            LayerSpec{.layer_id = layer, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64},
            locs.data(), n, dummy_pool(), mode, bs, out.data(), save_kv, record_kv);
    }
    int n;
    std::vector<float> q, k, v, out;
    std::vector<int32_t> locs;
};

// Joins threads on scope exit, so an early ASSERT return never leaves a joinable std::thread.
struct JoinAll {
    std::vector<std::thread>& threads;
    ~JoinAll() {
        for (auto& t : threads) {
            if (t.joinable()) t.join();
        }
    }
};

AttentionConfig config_on(runtime::Stream& s) {
    AttentionConfig c;
    c.num_q_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.stream = &s;
    return c;
}

// ---- the rule on the fake: every branch, and its timing against the write
// -------------------------
using RuleParam = std::tuple<ForwardMode, bool /*save_kv*/, std::optional<bool> /*record_kv*/,
                             bool /*registered*/>;

class RecordRule : public ::testing::TestWithParam<RuleParam> {};

TEST_P(RecordRule, FakeBackendRecordsAtTheRightTime) {
    const auto [mode, save_kv, record_kv, registered] = GetParam();
    const bool record = expect_record(mode, record_kv, registered);
    runtime::CpuStream stream("compute");
    // Start one step before the wrap: the record moves the counter across it.
    StepCounter counter(stream, StepCounter::kCountMax - 1);
    FakeRecordingBackend fake(config_on(stream));
    if (registered) fake.register_step_counter(&counter);
    fake.observe = &counter;
    const int64_t begin = counter.advance_step(1);

    Gate before;  // holds the stream until everything is enqueued
    Gate during;  // holds the stream right after the write task ran
    fake.hold = &during;
    ASSERT_OK(before.enqueue(stream));
    const int bs = mode == ForwardMode::kIdle ? 0 : 2;
    FakeTensors t(bs);
    ASSERT_OK(t.forward(fake, 0, mode, bs, save_kv, record_kv));
    // Nothing has run yet: forward only enqueued.
    EXPECT_EQ(counter.records_published(), 0u);
    EXPECT_TRUE(fake.log().empty());
    before.release();
    ASSERT_TRUE(during.wait_reached(30s)) << "the write task never ran";
    // The write task has run and is held: a record enqueued before it is visible, one after is not.
    const auto log = fake.log();
    ASSERT_EQ(log.size(), 1u);
    EXPECT_EQ(log[0].path, mode == ForwardMode::kDecode ? "decode" : "extend");
    EXPECT_EQ(log[0].save_kv_cache, save_kv);
    const bool record_before = record && !save_kv;
    EXPECT_EQ(log[0].published_at_write, record_before ? 1u : 0u);
    EXPECT_EQ(log[0].ready_at_write, record_before ? 0 : StepCounter::kCountMax - 1);
    EXPECT_EQ(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin), record_before);
    during.release();
    ASSERT_OK(stream.synchronize(60s));
    EXPECT_EQ(counter.records_published(), record ? 1u : 0u);
    EXPECT_EQ(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin), record);
    EXPECT_EQ(counter.query_ready_cache_step(), record ? 0 : StepCounter::kCountMax - 1);
}

std::string rule_name(const ::testing::TestParamInfo<RuleParam>& info) {
    const auto [mode, save_kv, record_kv, registered] = info.param;
    return std::string(forward_mode_name(mode)) + (save_kv ? "_save" : "_prewrite") + "_record_" +
           opt_name(record_kv) + (registered ? "_counter" : "_nocounter");
}

INSTANTIATE_TEST_SUITE_P(AllBranches, RecordRule,
                         ::testing::Combine(::testing::ValuesIn(kAllModes), ::testing::Bool(),
                                            ::testing::Values(std::optional<bool>(),
                                                              std::optional<bool>(true),
                                                              std::optional<bool>(false)),
                                            ::testing::Bool()),
                         rule_name);

// The guard on its own, as a composite backend uses it.
TEST(RecordPdCacheStep, WillRecordFollowsTheRule) {
    runtime::CpuStream stream("compute");
    StepCounter counter(stream);
    FakeRecordingBackend fake(config_on(stream));
    for (bool registered : {false, true}) {
        fake.register_step_counter(registered ? &counter : nullptr);
        for (ForwardMode mode : kAllModes) {
            for (std::optional<bool> rec :
                 {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
                for (bool save : {false, true}) {
                    AttentionBackend::RecordPdCacheStep g(fake, mode, save, rec);
                    EXPECT_EQ(g.will_record(), expect_record(mode, rec, registered))
                        << forward_mode_name(mode) << " record " << opt_name(rec) << " registered "
                        << registered;
                    const uint64_t before = counter.records_published();
                    ASSERT_OK(g.enter());
                    ASSERT_OK(stream.synchronize(10s));
                    EXPECT_EQ(counter.records_published() - before,
                              g.will_record() && !save ? 1u : 0u);
                    ASSERT_OK(g.exit());
                    ASSERT_OK(stream.synchronize(10s));
                    EXPECT_EQ(counter.records_published() - before, g.will_record() ? 1u : 0u);
                }
            }
        }
    }
}

// A composite (hybrid-style) layer: its children run with record_kv_cache = false, the composite
// records once per model layer around both.
TEST(RecordPdCacheStep, CompositeRecordsOncePerLayer) {
    runtime::CpuStream stream("compute");
    StepCounter counter(stream);
    FakeRecordingBackend full(config_on(stream)), other(config_on(stream));
    full.register_step_counter(&counter);
    other.register_step_counter(&counter);
    full.observe = other.observe = &counter;
    constexpr int kLayers = 3;
    const int64_t begin = counter.advance_step(kLayers);
    for (int l = 0; l < kLayers; ++l) {
        AttentionBackend::RecordPdCacheStep g(full, ForwardMode::kExtend, true, std::nullopt);
        ASSERT_OK(g.enter());
        for (auto* child : {&full, &other}) {
            FakeTensors t(1);
            ASSERT_OK(t.forward(*child, l, ForwardMode::kExtend, 1, true, false));
        }
        ASSERT_OK(g.exit());
    }
    ASSERT_OK(stream.synchronize(10s));
    EXPECT_EQ(counter.records_published(), static_cast<uint64_t>(kLayers));
    for (int l = 0; l < kLayers; ++l)
        EXPECT_TRUE(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin + l));
    EXPECT_FALSE(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin + kLayers));
    // Each layer's two child writes ran before that layer's record.
    const auto log = full.log();
    ASSERT_EQ(log.size(), static_cast<size_t>(kLayers));
    for (int l = 0; l < kLayers; ++l)
        EXPECT_EQ(log[static_cast<size_t>(l)].published_at_write, static_cast<uint64_t>(l));
}

TEST(AttentionBackendBase, StepCounterOnAnotherStreamIsRejected) {
    runtime::CpuStream compute("compute"), other("other");
    StepCounter counter(other);
    FakeRecordingBackend fake(config_on(compute));
    fake.register_step_counter(&counter);
    fake.observe = &counter;
    FakeTensors t(1);
    Status st = t.forward(fake, 0, ForwardMode::kExtend, 1);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("other"));
    EXPECT_THAT(st.message(), HasSubstr("compute"));
    ASSERT_OK(compute.synchronize(10s));
    ASSERT_OK(other.synchronize(10s));
    EXPECT_EQ(counter.records_published(), 0u);
    EXPECT_TRUE(fake.log().empty()) << "no attention work may be enqueued after the error";

    // The same on a real backend.
    for (const char* name : {"cpu", "cpu_ref"}) {
        Shape s;
        s.num_q_heads = 4;
        s.num_kv_heads = 2;
        Runner r(name, s);
        ASSERT_OK(r.create_status());
        StepCounter c2(other);
        r.backend().register_step_counter(&c2);
        Batch b = make_batch(s, ForwardMode::kExtend, {{3, 2}}, 1);
        auto pool = make_pool(s, b.num_pages);
        ASSERT_TRUE(pool);
        init_pool(*pool, s, b, false);
        Status fs = r.launch(b, *pool, true);
        EXPECT_EQ(fs.code(), StatusCode::kFailedPrecondition) << name << ": " << fs.to_string();
        ASSERT_OK(r.wait());
        ASSERT_OK(other.synchronize(10s));
        EXPECT_EQ(c2.records_published(), 0u) << name;
    }
}

// ---- init_backend_cuda_graph_state passes only what the backend accepts -----------------------
TEST(InitBackendCudaGraphState, PassesOnlyAcceptedExtras) {
    runtime::CpuStream stream("compute");
    std::vector<int32_t> seq_lens(8, 1);
    GraphStateExtras all;
    all.max_pages_per_seq = 32;
    all.paged_cache_group_specs = std::vector<std::string>{"full", "swa"};
    struct Expect {
        std::set<std::string> accepted;
        bool pages, specs;
    };
    for (const Expect& e : {Expect{{}, false, false}, Expect{{"*"}, true, true},
                            Expect{{"max_pages_per_seq"}, true, false},
                            Expect{{"paged_cache_group_specs"}, false, true},
                            Expect{{"max_pages_per_seq", "paged_cache_group_specs"}, true, true},
                            Expect{{"something_else"}, false, false}}) {
        FakeRecordingBackend fake(config_on(stream), e.accepted);
        ASSERT_OK(init_backend_cuda_graph_state(fake, 8, seq_lens.data(), all));
        EXPECT_EQ(fake.graph_state_calls, 1);
        std::string acc;
        for (const auto& a : e.accepted) acc += a + " ";
        EXPECT_EQ(fake.received.max_pages_per_seq.has_value(), e.pages) << "accepted: " << acc;
        EXPECT_EQ(fake.received.paged_cache_group_specs.has_value(), e.specs)
            << "accepted: " << acc;
        if (e.pages) {
            EXPECT_EQ(fake.received.max_pages_per_seq.value_or(0), 32);
        }
        if (e.specs) {
            EXPECT_EQ(fake.received.paged_cache_group_specs->size(), 2u);
        }
        EXPECT_TRUE(fake.graph_state_initialized());
    }
}

TEST(InitBackendCudaGraphState, ErrorFromTheBackendPropagatesWithoutRetry) {
    runtime::CpuStream stream("compute");
    std::vector<int32_t> seq_lens(4, 1);
    GraphStateExtras all;
    all.max_pages_per_seq = 8;
    all.paged_cache_group_specs = std::vector<std::string>{"full"};
    for (std::set<std::string> accepted :
         {std::set<std::string>{"*"}, std::set<std::string>{"paged_cache_group_specs"}}) {
        FakeRecordingBackend fake(config_on(stream), accepted);
        fake.graph_state_result =
            Status(StatusCode::kInvalidArgument, "bad paged_cache_group_specs");
        Status st = init_backend_cuda_graph_state(fake, 4, seq_lens.data(), all);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(st.message(), "bad paged_cache_group_specs");
        EXPECT_EQ(fake.graph_state_calls, 1) << "must not retry without the extras";
        EXPECT_FALSE(fake.graph_state_initialized());
    }
}

TEST(InitBackendCudaGraphState, RealBackendsAcceptTheirExtras) {
    std::vector<int32_t> seq_lens(4, 1);
    GraphStateExtras all;
    all.max_pages_per_seq = 8;
    all.paged_cache_group_specs = std::vector<std::string>{"full"};
    for (const char* name : {"cpu", "cpu_ref"}) {
        Shape s;
        Runner r(name, s);
        ASSERT_OK(r.create_status());
        EXPECT_FALSE(r.backend().graph_state_initialized());
        EXPECT_OK(init_backend_cuda_graph_state(r.backend(), 4, seq_lens.data(), all)) << name;
        EXPECT_TRUE(r.backend().graph_state_initialized()) << name;
        EXPECT_FALSE(init_backend_cuda_graph_state(r.backend(), 0, seq_lens.data(), all).ok())
            << name << ": max_bs 0";
        EXPECT_FALSE(init_backend_cuda_graph_state(r.backend(), 4, nullptr, all).ok())
            << name << ": null seq_lens";
    }
}

// ---- the rule on the real backends ---------------------------------------------------------
// For every branch: the record count, and (save_kv = true) that a host thread woken by
// StepCounter::wait_until_ready already sees the new tokens' KV in the pool.
using RealParam = std::tuple<std::string, ForwardMode, bool, std::optional<bool>, bool>;

class RealBackendRecordRule : public ::testing::TestWithParam<RealParam> {};

// True when every new token of `b` is in `pool` (layer s.layer_id), as the pool stores it.
bool new_kv_in_pool(const kv::MHATokenToKVPool& pool, const Shape& s, const Batch& b) {
    const size_t kvw = s.kv_width();
    std::vector<float> got(kvw);
    for (size_t t = 0; t < b.locs.size(); ++t) {
        for (int buf = 0; buf < 2; ++buf) {
            pool.read_token(s.layer_id, buf, b.locs[t], got.data());
            const float* want = (buf == 0 ? b.k.data() : b.v.data()) + t * kvw;
            for (size_t e = 0; e < kvw; ++e) {
                const float w = s.dtype == kv::KVDtype::kBF16 ? round_bf16(want[e]) : want[e];
                if (!(got[e] == w)) return false;
            }
        }
    }
    return true;
}

TEST_P(RealBackendRecordRule, RecordsOnceAfterTheKvIsInThePool) {
    const auto [name, mode, save_kv, record_kv, registered] = GetParam();
    const bool record = expect_record(mode, record_kv, registered);
    Shape s;
    s.num_q_heads = 8;
    s.num_kv_heads = 2;
    s.page_size = 16;
    s.dtype = kv::KVDtype::kBF16;
    std::vector<Req> reqs;
    if (mode == ForwardMode::kDecode) reqs = {{40, 1}, {3, 1}};
    if (mode == ForwardMode::kExtend) reqs = {{40, 20}, {0, 17}};
    Batch b = make_batch(s, mode, reqs, 3);
    auto pool = make_pool(s, b.num_pages);
    ASSERT_TRUE(pool);
    init_pool(*pool, s, b, /*with_new=*/!save_kv);
    Runner r(name, s);
    ASSERT_OK(r.create_status());
    StepCounter counter(r.stream(), 1000);
    if (registered) r.backend().register_step_counter(&counter);
    const int64_t begin = counter.advance_step(1);

    Gate gate;
    ASSERT_OK(gate.enqueue(r.stream()));
    ASSERT_OK(r.launch(b, *pool, save_kv, record_kv));
    ASSERT_TRUE(gate.wait_reached());
    // The stream is held before the forward: nothing recorded, no KV written.
    EXPECT_FALSE(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin));
    if (save_kv && b.num_tokens > 0) {
        EXPECT_FALSE(new_kv_in_pool(*pool, s, b)) << "KV written before the stream ran";
    }

    std::atomic<int> observer_result{-1};  // -1 not woken, 0 woke without the KV, 1 woke with it
    std::thread observer;
    if (record) {
        observer = std::thread([&] {
            if (counter.wait_until_ready(begin, 30s).ok())
                observer_result = new_kv_in_pool(*pool, s, b) ? 1 : 0;
        });
    }
    gate.release();
    if (observer.joinable()) observer.join();
    Status st = r.wait();
    ASSERT_OK(st);
    EXPECT_EQ(counter.records_published(), record ? 1u : 0u);
    EXPECT_EQ(counter.query_ready_cache_step(), record ? 1001 : 1000);
    if (record) {
        EXPECT_EQ(observer_result.load(), 1)
            << "a host woken by the record must see the layer's KV";
    }
    EXPECT_TRUE(new_kv_in_pool(*pool, s, b));
    if (b.num_tokens > 0) {
        EXPECT_TRUE(outputs_close(r.out(), naive_attention(s, b), 1e-2, s, b));
    }
}

std::string real_name(const ::testing::TestParamInfo<RealParam>& info) {
    const auto [name, mode, save_kv, record_kv, registered] = info.param;
    return name + "_" + std::string(forward_mode_name(mode)) + (save_kv ? "_save" : "_prewrite") +
           "_record_" + opt_name(record_kv) + (registered ? "_counter" : "_nocounter");
}

INSTANTIATE_TEST_SUITE_P(
    AllBranches, RealBackendRecordRule,
    ::testing::Combine(::testing::Values("cpu", "cpu_ref"),
                       ::testing::Values(ForwardMode::kExtend, ForwardMode::kDecode,
                                         ForwardMode::kIdle),
                       ::testing::Bool(),
                       ::testing::Values(std::optional<bool>(), std::optional<bool>(true),
                                         std::optional<bool>(false)),
                       ::testing::Bool()),
    real_name);

// ---- one record per layer per extend forward ----------------------------------------------------
// L layers after begin = advance_step(L): a gate after each layer's forward holds the stream, and
// while it is held at layer l, exactly layers 0..l are ready, and their KV (and only theirs) is in
// the pool. A host thread per layer waits for its step and checks its layer's KV.
using PerLayerParam = std::tuple<std::string, bool /*save_kv*/, bool /*decode with record forced*/>;

class PerLayerRecords : public ::testing::TestWithParam<PerLayerParam> {};

std::string per_layer_name(const ::testing::TestParamInfo<PerLayerParam>& info) {
    return std::get<0>(info.param) + (std::get<1>(info.param) ? "_save" : "_prewrite") +
           (std::get<2>(info.param) ? "_decode_forced" : "_extend");
}

TEST_P(PerLayerRecords, LayerLIsReadyIffItsKvIsWritten) {
    const auto [name, save_kv, decode_forced] = GetParam();
    constexpr int kLayers = 4;
    const ForwardMode mode = decode_forced ? ForwardMode::kDecode : ForwardMode::kExtend;
    const std::optional<bool> record_kv = decode_forced ? std::optional<bool>(true) : std::nullopt;
    Shape base;
    base.num_q_heads = 4;
    base.num_kv_heads = 2;
    base.page_size = 16;
    base.num_layers = kLayers;
    std::vector<Req> reqs =
        decode_forced ? std::vector<Req>{{50, 1}, {9, 1}} : std::vector<Req>{{50, 30}, {0, 9}};
    std::vector<Shape> shapes;
    std::vector<Batch> batches;
    for (int l = 0; l < kLayers; ++l) {
        shapes.push_back(base);
        shapes.back().layer_id = l;
        batches.push_back(make_batch(shapes.back(), mode, reqs, 21, 2, 0, 0, 500 + l));
    }
    auto pool = make_pool(base, batches[0].num_pages);
    ASSERT_TRUE(pool);
    for (int l = 0; l < kLayers; ++l) init_pool(*pool, shapes[l], batches[l], !save_kv, l == 0);

    Runner r(name, base);
    ASSERT_OK(r.create_status());
    StepCounter counter(r.stream(), StepCounter::kCountMax - 2);  // crosses the wrap mid-forward
    r.backend().register_step_counter(&counter);
    const int64_t begin = counter.advance_step(kLayers);

    std::vector<std::unique_ptr<Gate>> gates;
    std::vector<std::vector<float>> outs(kLayers);
    Gate start;
    ASSERT_OK(start.enqueue(r.stream()));
    ASSERT_OK(r.backend().init_forward_metadata(batches[0].forward_batch()));
    std::vector<float> decoy(batches[0].k.size(), kNaN);
    for (int l = 0; l < kLayers; ++l) {
        const Batch& b = batches[l];
        outs[l].assign(static_cast<size_t>(b.num_tokens) * base.q_width(), kNaN);
        ASSERT_TRUE(forward_host(r.backend(), b.q.data(), save_kv ? b.k.data() : decoy.data(),
                                 save_kv ? b.v.data() : decoy.data(), shapes[l].layer(),
                                 b.locs.data(), b.num_tokens, *pool, mode, b.bs, outs[l].data(),
                                 save_kv, record_kv)
                        .ok());
        gates.push_back(std::make_unique<Gate>());
        ASSERT_OK(gates.back()->enqueue(r.stream()));
    }
    std::vector<std::atomic<int>> seen(kLayers);
    std::vector<std::thread> observers;
    JoinAll join_observers{observers};
    for (int l = 0; l < kLayers; ++l) {
        seen[l] = -1;
        observers.emplace_back([&, l] {
            if (counter.wait_until_ready(begin + l, 30s).ok())
                seen[l] = new_kv_in_pool(*pool, shapes[l], batches[l]);
        });
    }
    EXPECT_FALSE(StepCounter::is_step_ready(counter.query_ready_cache_step(), begin));
    start.release();
    for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(gates[l]->wait_reached()) << "layer " << l;
        const int64_t ready = counter.query_ready_cache_step();
        for (int m = 0; m < kLayers; ++m) {
            EXPECT_EQ(StepCounter::is_step_ready(ready, StepCounter::wrap(begin + m)), m <= l)
                << "held after layer " << l << ": layer " << m << " ready step " << ready;
            if (save_kv) {
                EXPECT_EQ(new_kv_in_pool(*pool, shapes[m], batches[m]), m <= l)
                    << "held after layer " << l << ": KV of layer " << m;
            }
        }
        EXPECT_EQ(counter.records_published(), static_cast<uint64_t>(l + 1));
        gates[l]->release();
    }
    for (auto& t : observers) t.join();
    ASSERT_OK(r.wait());
    EXPECT_EQ(counter.records_published(), static_cast<uint64_t>(kLayers));
    EXPECT_EQ(counter.query_ready_cache_step(), StepCounter::wrap(begin + kLayers));
    for (int l = 0; l < kLayers; ++l) {
        EXPECT_EQ(seen[l].load(), 1) << "observer of layer " << l;
        EXPECT_TRUE(outputs_close(outs[l], naive_attention(shapes[l], batches[l]), 1e-5, shapes[l],
                                  batches[l]))
            << "layer " << l;
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, PerLayerRecords,
                         ::testing::Combine(::testing::Values("cpu", "cpu_ref"), ::testing::Bool(),
                                            ::testing::Bool()),
                         per_layer_name);

// ---- forward() checks its arguments before anything is enqueued ---------------------------------
// Well-formed views of 2 tokens for layer 0 (4 query, 2 KV heads of dim 64) on the dummy pool,
// which a case edits.
struct ViewSet {
    std::vector<float> q = std::vector<float>(2 * 4 * 64), k = std::vector<float>(2 * 2 * 64),
                       v = std::vector<float>(2 * 2 * 64), out = std::vector<float>(2 * 4 * 64);
    std::vector<int32_t> locs = {1, 2};
    std::vector<int64_t> locs64 = {1, 2};
    runtime::ConstTensorView qv = rows_view(q.data(), 2, 4, 64), kv = rows_view(k.data(), 2, 2, 64),
                             vv = rows_view(v.data(), 2, 2, 64), lv = locs_view(locs.data(), 2);
    runtime::TensorView ov = rows_view(out.data(), 2, 4, 64);
    LayerSpec layer{0, 4, 2, 64};
    int bs = 2;
    bool save_kv = true;

    [[nodiscard]] Status forward(AttentionBackend& b, kv::KVPool& pool = dummy_pool()) const {
        return b.forward(qv, kv, vv, layer, lv, pool, ForwardMode::kExtend, bs, ov, save_kv);
    }
};

struct ViewCase {
    std::string what;
    std::function<void(ViewSet&)> edit;
    std::string message;  // what the error must say
};

std::vector<ViewCase> view_cases() {
    using runtime::DeviceKind;
    using runtime::DType;
    return {
        {"q bf16, fake declares fp32", [](ViewSet& s) { s.qv.dtype = DType::kBF16; },
         "q: dtype bf16, backend 'fake_recording' accepts fp32"},
        {"k dtype differs from q", [](ViewSet& s) { s.kv.dtype = DType::kBF16; },
         "k: dtype bf16, expected fp32 (the dtype of q)"},
        {"out dtype differs from q", [](ViewSet& s) { s.ov.dtype = DType::kF16; },
         "out: dtype fp16, expected fp32 (the dtype of q)"},
        {"q with the KV head count", [](ViewSet& s) { s.qv = rows_view(s.q.data(), 4, 2, 64); },
         "q: shape [4, 2, 64], expected [*, 4, 64]"},
        {"q flattened to [tokens][heads * dim]",
         [](ViewSet& s) {
             s.qv = runtime::host_view(s.q.data(), {2, 4 * 64});
         },
         "q: shape [2, 256], expected [*, 4, 64]"},
        {"v head dim", [](ViewSet& s) { s.vv = rows_view(s.v.data(), 2, 2, 32); },
         "v: shape [2, 2, 32], expected [2, 2, 64]"},
        {"out has fewer rows than q", [](ViewSet& s) { s.ov = rows_view(s.out.data(), 1, 4, 64); },
         "out: shape [1, 4, 64], expected [2, 4, 64]"},
        {"k has fewer rows than q", [](ViewSet& s) { s.kv = rows_view(s.k.data(), 1, 2, 64); },
         "k: shape [1, 2, 64], expected [2, 2, 64]"},
        {"out_cache_loc int64",
         [](ViewSet& s) { s.lv = runtime::make_view(s.locs64.data(), DType::kI64, {}, {2}); },
         "out_cache_loc: dtype int64, expected int32"},
        {"out_cache_loc length", [](ViewSet& s) { s.lv = locs_view(s.locs.data(), 1); },
         "out_cache_loc: shape [1], expected [2]"},
        {"q strided", [](ViewSet& s) { s.qv.strides[1] = 128; }, "q: not contiguous"},
        {"k on a CUDA device",
         [](ViewSet& s) {
             s.kv.device = {DeviceKind::kCuda, 0};
         },
         "k: memory on cuda, expected cpu"},
        {"q on another device index", [](ViewSet& s) { s.qv.device.index = 1; },
         "q: memory on cpu:1, the pool is on cpu:0"},
        {"null q", [](ViewSet& s) { s.qv.data = nullptr; },
         "q: null data pointer (the forward has tokens)"},
        {"null out", [](ViewSet& s) { s.ov.data = nullptr; }, "out: null data pointer"},
        {"null k with save_kv_cache", [](ViewSet& s) { s.kv.data = nullptr; },
         "k: null data pointer (save_kv_cache is set and the forward has tokens)"},
        {"null out_cache_loc with save_kv_cache", [](ViewSet& s) { s.lv.data = nullptr; },
         "out_cache_loc: null data pointer"},
        {"layer not in the pool", [](ViewSet& s) { s.layer.layer_id = 4; },
         "layer: layer_id 4 out of range [0, 4) of the pool"},
        {"q heads not a multiple of kv heads", [](ViewSet& s) { s.layer.num_q_heads = 3; },
         "layer 0: num_q_heads 3 must be a positive multiple of num_kv_heads 2"},
        {"negative bs", [](ViewSet& s) { s.bs = -1; }, "bs: -1 < 0"},
    };
}

TEST(ForwardChecks, BadViewsAreRejectedBeforeAnythingIsEnqueued) {
    runtime::CpuStream stream("compute");
    StepCounter counter(stream);
    FakeRecordingBackend fake(config_on(stream));
    fake.register_step_counter(&counter);
    fake.observe = &counter;
    {
        ViewSet good;
        ASSERT_OK(good.forward(fake)) << "the unedited views must pass";
        ASSERT_OK(stream.synchronize(10s));
        ASSERT_EQ(fake.log().size(), 1u);
        ASSERT_EQ(counter.records_published(), 1u);
    }
    for (const ViewCase& c : view_cases()) {
        ViewSet s;
        c.edit(s);
        Status st = s.forward(fake);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.what << ": " << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr(c.message)) << c.what;
        ASSERT_OK(stream.synchronize(10s));
        EXPECT_EQ(fake.log().size(), 1u) << c.what << ": attention work was enqueued";
        EXPECT_EQ(counter.records_published(), 1u) << c.what << ": a record was enqueued";
    }
}

TEST(ForwardChecks, NullViewsWhereTheForwardDoesNotNeedThem) {
    runtime::CpuStream stream("compute");
    FakeRecordingBackend fake(config_on(stream));
    ViewSet prewrite;  // KV pre-written: no k, v or slots needed
    prewrite.save_kv = false;
    prewrite.kv = {};
    prewrite.vv = {};
    prewrite.lv = {};
    EXPECT_OK(prewrite.forward(fake));
    ViewSet idle;  // no tokens: nothing needed
    idle.bs = 0;
    idle.qv = {};
    idle.kv = {};
    idle.vv = {};
    idle.ov = {};
    idle.lv = {};
    EXPECT_TRUE(fake.forward(idle.qv, idle.kv, idle.vv, idle.layer, idle.lv, dummy_pool(),
                             ForwardMode::kIdle, 0, idle.ov)
                    .ok());
    // Still checked when given: a malformed k is an error even though it will not be read.
    ViewSet bad = prewrite;
    bad.kv = rows_view(bad.k.data(), 2, 1, 64);
    EXPECT_THAT(bad.forward(fake).message(), HasSubstr("k: shape [2, 1, 64], expected [2, 2, 64]"));
    ASSERT_OK(stream.synchronize(10s));
    EXPECT_EQ(fake.log().size(), 2u);
}

// Eager metadata fixes num_tokens: views of another length are rejected on the real backends, and
// neither the pool nor out is touched, nothing is recorded.
TEST(ForwardChecks, EagerViewsMustHoldTheBatchsTokens) {
    for (const char* name : {"cpu", "cpu_ref"}) {
        SCOPED_TRACE(name);
        Shape s;
        s.num_q_heads = 8;
        s.num_kv_heads = 2;
        Batch b = make_batch(s, ForwardMode::kExtend, {{3, 2}, {0, 3}}, 9);  // 5 new tokens
        auto pool = make_pool(s, b.num_pages);
        auto want = make_pool(s, b.num_pages);
        ASSERT_TRUE(pool && want);
        init_pool(*pool, s, b, false);
        init_pool(*want, s, b, false);
        Runner r(name, s);
        ASSERT_OK(r.create_status());
        StepCounter counter(r.stream());
        r.backend().register_step_counter(&counter);
        ASSERT_OK(r.backend().init_forward_metadata(b.forward_batch()));
        std::vector<float> out(static_cast<size_t>(b.num_tokens) * s.q_width(), kNaN);
        Status st = forward_host(r.backend(), b.q.data(), b.k.data(), b.v.data(), s.layer(),
                                 b.locs.data(), b.num_tokens - 1, *pool, b.mode, b.bs, out.data());
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr("q: shape [4, 8, 64], expected [5, 8, 64]"));
        ASSERT_OK(r.wait());
        EXPECT_EQ(counter.records_published(), 0u);
        EXPECT_TRUE(pools_equal(*pool, *want)) << "a rejected forward wrote KV";
        for (float x : out) ASSERT_TRUE(std::isnan(x)) << "a rejected forward wrote out";
        // The right length runs.
        st = forward_host(r.backend(), b.q.data(), b.k.data(), b.v.data(), s.layer(), b.locs.data(),
                          b.num_tokens, *pool, b.mode, b.bs, out.data());
        ASSERT_OK(st);
        ASSERT_OK(r.wait());
        EXPECT_EQ(counter.records_published(), 1u);
        EXPECT_TRUE(outputs_close(out, naive_attention(s, b), 1e-5, s, b));
    }
}

// ---- capabilities: declared by the backend, enforced by the base class --------------------------
TEST(Capabilities, DeclaredDtypesAndDevicesAreEnforced) {
    using runtime::DeviceKind;
    using runtime::DType;
    runtime::CpuStream stream("compute");
    FakeRecordingBackend fake(config_on(stream));

    // Activations: bf16 only.
    fake.caps.activation_dtypes = {DType::kBF16};
    ViewSet fp32;
    EXPECT_THAT(fp32.forward(fake).message(),
                HasSubstr("q: dtype fp32, backend 'fake_recording' accepts bf16"));
    ViewSet bf16;
    for (auto* v : {&bf16.qv, &bf16.kv, &bf16.vv})
        v->dtype = DType::kBF16;  // (the fake reads nothing)
    bf16.ov.dtype = DType::kBF16;
    EXPECT_OK(bf16.forward(fake));

    // KV: bf16 only; the dummy pool is fp32.
    fake.caps = {{DType::kF32}, {DType::kBF16}, {DeviceKind::kCpu}};
    EXPECT_THAT(fp32.forward(fake).message(),
                HasSubstr("pool: dtype fp32, backend 'fake_recording' accepts bf16"));

    // Devices: CUDA only. A host pool is rejected; a (host-backed) CUDA pool with host views too;
    // with views on the pool's device it runs.
    fake.caps = {{DType::kF32}, {DType::kF32}, {DeviceKind::kCuda}};
    EXPECT_THAT(fp32.forward(fake).message(),
                HasSubstr("pool: memory on cpu, backend 'fake_recording' accepts cuda"));
    install_host_backed_cuda_runtime();
    kv::MHAPoolConfig pc;
    pc.num_layers = 1;
    pc.num_pages = 2;
    pc.num_kv_heads = 2;
    pc.head_dim = 64;
    pc.device = {DeviceKind::kCuda, 0};
    auto cuda_pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(cuda_pool);
    EXPECT_THAT(fp32.forward(fake, **cuda_pool).message(),
                HasSubstr("q: memory on cpu, expected cuda"));
    ViewSet on_cuda;
    for (auto* v : {&on_cuda.qv, &on_cuda.kv, &on_cuda.vv, &on_cuda.lv})
        v->device = (*cuda_pool)->device();
    on_cuda.ov.device = (*cuda_pool)->device();
    EXPECT_OK(on_cuda.forward(fake, **cuda_pool));
    on_cuda.lv.device.index = 1;
    EXPECT_THAT(on_cuda.forward(fake, **cuda_pool).message(),
                HasSubstr("out_cache_loc: memory on cuda:1, the pool is on cuda:0"));
    ASSERT_OK(stream.synchronize(10s));
    EXPECT_EQ(fake.log().size(), 2u) << "only the two accepted forwards enqueued work";
}

TEST(Capabilities, CpuBackendsAcceptFp32AndBf16OnTheHost) {
    using runtime::DType;
    install_host_backed_cuda_runtime();
    for (const char* name : {"cpu", "cpu_ref"}) {
        SCOPED_TRACE(name);
        Shape s;
        s.num_q_heads = 4;
        s.num_kv_heads = 2;
        Runner r(name, s);
        ASSERT_OK(r.create_status());
        const BackendCapabilities caps = r.backend().capabilities();
        EXPECT_EQ(caps.activation_dtypes, (std::vector<DType>{DType::kF32, DType::kBF16}));
        EXPECT_EQ(caps.kv_dtypes, (std::vector<DType>{DType::kF32, DType::kBF16}));
        EXPECT_EQ(caps.devices, (std::vector<runtime::DeviceKind>{runtime::DeviceKind::kCpu}));

        // A pool on a CUDA device is rejected by the declaration, before the kernel-time checks.
        kv::MHAPoolConfig pc;
        pc.num_layers = 1;
        pc.num_pages = 2;
        pc.num_kv_heads = 2;
        pc.head_dim = 64;
        pc.device = {runtime::DeviceKind::kCuda, 0};
        auto cuda_pool = kv::MHATokenToKVPool::create(pc);
        ASSERT_OK(cuda_pool);
        ViewSet views;
        Status st = views.forward(r.backend(), **cuda_pool);
        EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument,
                                 HasSubstr(std::string("pool: memory on cuda, backend '") + name +
                                           "' accepts cpu")));
        ASSERT_OK(r.wait());

        // The registry rejects a KV dtype the backend does not declare.
        AttentionConfig c;
        c.num_q_heads = 4;
        c.num_kv_heads = 2;
        c.kv_dtype = DType::kF16;
        c.stream = &r.stream();
        auto made = create_attention_backend(name, c);
        EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(made.status().message(),
                    HasSubstr("config.kv_dtype fp16, it accepts fp32 or bf16"));
    }
}

// Cache groups: a batch's second page table (ForwardBatch::window_page_table) is what the
// kernels of a layer with sliding_window > 0 read; other layers read the main one, and a batch
// without it leaves sliding layers on the main one. A bad second table is refused naming it, and
// graph metadata has none.
class MetaProbeBackend final : public AttentionBackend {
public:
    explicit MetaProbeBackend(const AttentionConfig& c) : AttentionBackend(c) {}
    [[nodiscard]] std::string name() const override { return "meta_probe"; }
    [[nodiscard]] BackendCapabilities capabilities() const override {
        return {{runtime::DType::kF32},
                {runtime::DType::kF32},
                {runtime::DeviceKind::kCpu},
                true,
                false,
                true};
    }
    // (sliding_window, first page table entry) per forward, as the kernels saw them.
    std::vector<std::pair<int, int32_t>> seen;

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override { return probe(args); }
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override { return probe(args); }

private:
    [[nodiscard]] Status probe(const ForwardArgs& args) {
        return stream().enqueue([this, meta = args.meta, w = args.layer.sliding_window] {
            seen.emplace_back(w, meta->view().page_table[0]);
            return Status();
        });
    }
};

TEST(AttentionBackendBase, SlidingLayersReadTheirGroupsPageTable) {
    runtime::CpuStream stream("s");
    MetaProbeBackend b(config_on(stream));
    const std::vector<int32_t> seq = {3}, main_table = {5}, window_table = {9};
    ForwardBatch fb;
    fb.mode = ForwardMode::kDecode;
    fb.bs = 1;
    fb.seq_lens = seq;
    fb.page_table = main_table;
    fb.page_table_stride = 1;
    fb.window_page_table = window_table;
    fb.window_page_table_stride = 1;
    ASSERT_OK(b.init_forward_metadata(fb));
    FakeTensors t(1);
    auto forward = [&](int window) {
        return forward_host(b, t.q.data(), t.k.data(), t.v.data(),
                            LayerSpec{.layer_id = 0,
                                      .num_q_heads = 4,
                                      .num_kv_heads = 2,
                                      .head_dim = 64,
                                      .sliding_window = window},
                            t.locs.data(), 1, dummy_pool(), ForwardMode::kDecode, 1, t.out.data());
    };
    ASSERT_OK(forward(0));
    ASSERT_OK(forward(4));
    fb.window_page_table = {};
    ASSERT_OK(b.init_forward_metadata(fb));
    ASSERT_OK(forward(4));
    ASSERT_OK(stream.synchronize());
    EXPECT_EQ(b.seen, (std::vector<std::pair<int, int32_t>>{{0, 5}, {4, 9}, {4, 5}}));

    EXPECT_TRUE(b.uses_flat_cache_groups());
    // A backend that does not declare flat cache groups refuses the second table.
    FakeRecordingBackend plain(config_on(stream));
    EXPECT_FALSE(plain.uses_flat_cache_groups());
    fb.window_page_table = window_table;
    EXPECT_THAT(plain.init_forward_metadata(fb),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("does not declare flat cache")));
    fb.window_page_table_stride = 0;
    EXPECT_THAT(b.init_forward_metadata(fb),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("window_page_table")));
    fb.window_page_table_stride = 1;
    const std::vector<int32_t> seq_buf(4, 0);
    ASSERT_OK(b.init_cuda_graph_state(4, seq_buf.data(), {}));
    EXPECT_THAT(b.init_forward_metadata_replay_cuda_graph(fb),
                StatusIs(StatusCode::kUnimplemented, HasSubstr("sliding-window page table")));
}

}  // namespace
}  // namespace pdsim::attn::test
