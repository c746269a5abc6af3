// The discrete-event simulator (sim/des/simulator.h) with an in-test constant cost model: TTFT,
// TPOT and E2E of small runs worked out by hand, prefix-cache hits on a hand-made trace,
// conservation, determinism, preemption under a tiny KV pool; hybrid models' KV capacity, transfer
// bytes and admission by layer group (sim/des/kv_groups.h).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "sim/des/kv_groups.h"
#include "sim/des/simulator.h"
#include "tests/status_matchers.h"
#include "tests/test_topologies.h"

namespace pdsim::des {
namespace {

using pdsim::test::cpu_1p1d_topology;
using pdsim::test::example_topology;

// extend: e0 + e1 * new tokens; decode: d0 + d1 * batch. Records every call.
class FakeCostModel : public cost::CostModel {
public:
    FakeCostModel(double e0, double d0, double e1 = 0, double d1 = 0)
        : e0_(e0), e1_(e1), d0_(d0), d1_(d1) {}
    [[nodiscard]] std::string describe() const override { return "fake"; }
    [[nodiscard]] double extend_s(std::span<const cost::ExtendItem> batch) const override {
        extends.emplace_back(batch.begin(), batch.end());
        int64_t t = 0;
        for (const auto& b : batch) t += b.new_tokens;
        return e0_ + e1_ * static_cast<double>(t);
    }
    [[nodiscard]] double decode_s(int64_t batch_size, int64_t kv_tokens) const override {
        decodes.emplace_back(batch_size, kv_tokens);
        return d0_ + d1_ * static_cast<double>(batch_size);
    }
    [[nodiscard]] cost::CostWake wake() const override { return wake_; }
    mutable std::vector<std::vector<cost::ExtendItem>> extends;
    mutable std::vector<std::pair<int64_t, int64_t>> decodes;
    cost::CostWake wake_;  // none unless a test sets it

private:
    double e0_, e1_, d0_, d1_;
};

// Two CPU ranks behind a loopback switch (tests/test_topologies.h): a KV flow crosses two
// 10 GB/s links, 1 us each.

// tiny: 4 layers x 2 (K, V) x 4 KV heads x 64 dims, fp32 on CPU devices.
constexpr double kBytesPerToken = 4.0 * 2 * 4 * 64 * 4;
constexpr double kLatencyMs = 0.002;
constexpr double kEps = 1e-6;  // ms

SimConfig make_config(const topo::Topology& t, std::shared_ptr<const cost::CostModel> cost,
                      int64_t kv_pages = 100000, SimMode mode = SimMode::kDisagg) {
    SimConfig c;
    c.topology = t;
    c.topology_label = t.name;
    c.model = *model::resolve_model("tiny");
    c.mode = mode;
    for (size_t i = 0; i < t.instances.size(); ++i) {
        c.instances.push_back(
            InstanceSetup{.cost = cost, .kv_pages = kv_pages, .kv_dtype_bytes = 4});
    }
    return c;
}

workload::Request req(int64_t id, double arrival_ms, int32_t in, int32_t out,
                      std::vector<int64_t> hash = {}) {
    workload::Request r;
    r.id = id;
    r.arrival_ms = arrival_ms;
    r.input_len = in;
    r.output_len = out;
    r.hash_ids = std::move(hash);
    return r;
}

SimResult run(const SimConfig& c, const std::vector<workload::Request>& reqs) {
    StatusOr<SimResult> r = run_simulation(c, reqs);
    PDSIM_CHECK_OK(r.status());
    return std::move(*r);
}

TEST(Simulator, OneRequestDisaggregatedLayerwise) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    const SimConfig c = make_config(cpu_1p1d_topology(), cost);
    const SimResult r = run(c, {req(0, 0, 1000, 5)});
    ASSERT_EQ(r.report.requests_completed, 1);
    const metrics::RequestRecord& q = r.records[0];
    // Two extend forwards (512 + 488 tokens, chunk 512), 0.1 s each. Each chunk's flow is capped
    // at bytes / 0.1 s (far below 10 GB/s), so the last byte leaves at 0.2 s and lands 2 us later:
    // the decode instance is idle, so that is the first token. Then 4 decode steps of 10 ms.
    EXPECT_NEAR(q.ttft_ms(), 200 + kLatencyMs, kEps);
    EXPECT_NEAR(*q.tpot_ms(), 10, kEps);
    EXPECT_NEAR(q.e2e_ms(), 240 + kLatencyMs, kEps);
    EXPECT_EQ(q.generated, 5);
    EXPECT_EQ(q.transfer_bytes, static_cast<int64_t>(1000 * kBytesPerToken));
    EXPECT_NEAR(q.transfer_ms, 200 + kLatencyMs, kEps);
    EXPECT_NEAR(q.exposed_transfer_ms, kLatencyMs, kEps);
    ASSERT_EQ(cost->extends.size(), 2u);
    EXPECT_EQ(cost->extends[0].size(), 1u);
    EXPECT_EQ(cost->extends[0][0].new_tokens, 512);
    EXPECT_EQ(cost->extends[0][0].cached_tokens, 0);
    EXPECT_EQ(cost->extends[1][0].new_tokens, 488);
    EXPECT_EQ(cost->extends[1][0].cached_tokens, 512);
    // Context after each step: input + tokens so far (the one written this step included).
    EXPECT_EQ(cost->decodes, (std::vector<std::pair<int64_t, int64_t>>{
                                 {1, 1001}, {1, 1002}, {1, 1003}, {1, 1004}}));
    EXPECT_EQ(r.report.transfer.bytes, static_cast<int64_t>(1000 * kBytesPerToken));
    EXPECT_NEAR(r.report.transfer.exposed_fraction, kLatencyMs / (200 + kLatencyMs), 1e-9);
    EXPECT_EQ(r.report.mode, "disagg");
    EXPECT_EQ(r.stats.extend_forwards, 2);
    EXPECT_EQ(r.stats.decode_forwards, 4);
}

TEST(Simulator, OneRequestDisaggregatedLayerwiseOff) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    c.layerwise = false;
    const SimResult r = run(c, {req(0, 0, 1000, 5)});
    const metrics::RequestRecord& q = r.records[0];
    // The last chunk (488 tokens) starts uncapped at 0.2 s: 488 * 8192 B at 10 GB/s, + 2 us.
    const double tail_ms = 488 * kBytesPerToken / 10e9 * 1000 + kLatencyMs;
    EXPECT_NEAR(q.ttft_ms(), 200 + tail_ms, kEps);
    EXPECT_NEAR(q.exposed_transfer_ms, tail_ms, kEps);
    EXPECT_NEAR(q.e2e_ms(), 240 + tail_ms, kEps);
    // The first chunk went at 0.1 s, uncapped too.
    EXPECT_NEAR(q.transfer_ms, 100 + tail_ms, kEps);
}

TEST(Simulator, TwoRequestsShareAnExtendForwardAndDecodeOnTheirOwnTimes) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    const SimConfig c = make_config(cpu_1p1d_topology(), cost);
    const SimResult r = run(c, {req(0, 0, 600, 3), req(1, 0, 400, 2)});
    ASSERT_EQ(r.report.requests_completed, 2);
    // Forward 1 [0, 0.1]: A 512 + B 400 (FCFS, chunk 512, budget 2048). Forward 2 [0.1, 0.2]:
    // A's last 88. B's KV lands at 0.1 s + 2 us; one decode step finishes it (out 2).
    const metrics::RequestRecord& a = r.records[0];
    const metrics::RequestRecord& b = r.records[1];
    EXPECT_NEAR(b.ttft_ms(), 100 + kLatencyMs, kEps);
    EXPECT_NEAR(*b.tpot_ms(), 10, kEps);
    EXPECT_NEAR(b.e2e_ms(), 110 + kLatencyMs, kEps);
    // A's KV lands at 0.2 s + 2 us, when the decode instance is idle again; two steps.
    EXPECT_NEAR(a.ttft_ms(), 200 + kLatencyMs, kEps);
    EXPECT_NEAR(*a.tpot_ms(), 10, kEps);
    EXPECT_NEAR(a.e2e_ms(), 220 + kLatencyMs, kEps);
    ASSERT_EQ(cost->extends.size(), 2u);
    ASSERT_EQ(cost->extends[0].size(), 2u);
    EXPECT_EQ(cost->extends[0][0].new_tokens, 512);
    EXPECT_EQ(cost->extends[0][1].new_tokens, 400);
    EXPECT_EQ(cost->extends[1][0].new_tokens, 88);
    EXPECT_EQ(cost->decodes,
              (std::vector<std::pair<int64_t, int64_t>>{{1, 401}, {1, 601}, {1, 602}}));
    EXPECT_EQ(r.report.ttft_ms.count, 2);
    EXPECT_NEAR(r.report.ttft_ms.p50, 150 + kLatencyMs, kEps);
}

// The wait before compute: B arrives at 50 ms while A's first chunk runs [0, 100 ms]; B's first
// chunk rides A's second forward at 100 ms: waited 50 ms. A waited nothing.
TEST(Simulator, PrefillWaitIsArrivalToTheFirstChunksForward) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    const SimConfig c = make_config(cpu_1p1d_topology(), cost);
    const SimResult r = run(c, {req(0, 0, 2000, 2), req(1, 50, 100, 2)});
    ASSERT_EQ(r.report.requests_completed, 2);
    ASSERT_TRUE(r.records[0].prefill_wait_ms().has_value());
    ASSERT_TRUE(r.records[1].prefill_wait_ms().has_value());
    EXPECT_NEAR(*r.records[0].prefill_wait_ms(), 0, kEps);
    EXPECT_NEAR(*r.records[1].prefill_wait_ms(), 50, kEps);
    ASSERT_EQ(cost->extends.size(), 4u);
    ASSERT_EQ(cost->extends[1].size(), 2u);
    EXPECT_EQ(cost->extends[1][1].new_tokens, 100);
    EXPECT_EQ(r.report.prefill_wait_ms.count, 2);
    EXPECT_NEAR(r.report.prefill_wait_ms.mean, 25, kEps);
}

TEST(Simulator, OneRequestColocated) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    const SimConfig c = make_config(cpu_1p1d_topology(), cost, 100000, SimMode::kColocated);
    const SimResult r = run(c, {req(0, 0, 1000, 5)});
    const metrics::RequestRecord& q = r.records[0];
    // The first token is sampled by the last chunk's forward: no transfer.
    EXPECT_NEAR(q.ttft_ms(), 200, kEps);
    EXPECT_NEAR(*q.tpot_ms(), 10, kEps);
    EXPECT_NEAR(q.e2e_ms(), 240, kEps);
    EXPECT_EQ(q.transfer_bytes, 0);
    EXPECT_EQ(r.report.mode, "colocated");
    EXPECT_EQ(q.prefill_instance, 0);
    EXPECT_EQ(q.decode_instance, 0);
}

// The warm-up after an idle period (cost::CostWake): the first request's forwards run back to
// back from an idle instance and pay lost * (exp(-t0 / tau) - exp(-t1 / tau)) each over their
// modelled span [t0, t1) since the wake; a request arriving after the instance idled again pays
// the same; one arriving while the instance is still warm pays only the tail.
TEST(Simulator, ForwardsAfterAnIdlePeriodPayTheWarmup) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    cost->wake_ = {.min_idle_s = 0.005, .lost_s = 0.02, .tau_s = 0.05};
    const SimConfig c = make_config(cpu_1p1d_topology(), cost, 100000, SimMode::kColocated);
    // Request 0 at 0 and request 1 at 10 s (long after request 0 ended): each wakes the instance.
    const SimResult r = run(c, {req(0, 0, 1000, 5), req(1, 10'000, 1000, 5)});
    auto lost_ms = [](double t0_ms, double t1_ms) {
        return 20 * (std::exp(-t0_ms / 50) - std::exp(-t1_ms / 50));
    };
    for (const metrics::RequestRecord& q : r.records) {
        // Two extends (100 ms each) then four decodes (10 ms each), back to back.
        EXPECT_NEAR(q.ttft_ms(), 200 + lost_ms(0, 200), kEps) << q.id;
        EXPECT_NEAR(*q.tpot_ms(), (40 + lost_ms(200, 240)) / 4, kEps) << q.id;
        EXPECT_NEAR(q.e2e_ms(), 240 + lost_ms(0, 240), kEps) << q.id;
    }
    // Without the warm-up: the plain times.
    cost->wake_ = {};
    const SimResult plain = run(c, {req(0, 0, 1000, 5)});
    EXPECT_NEAR(plain.records[0].e2e_ms(), 240, kEps);
}

TEST(Simulator, ColocatedAlternatesExtendAndDecodeAndBatchesDecodes) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    const SimConfig c = make_config(cpu_1p1d_topology(), cost, 100000, SimMode::kColocated);
    // A -> instance 0 (loads 0, 0), B -> instance 1 (round robin after 0). At 125 ms both first
    // tokens are out, so the loads are 10 (A's output) and 50 (B's): C -> instance 0, arriving
    // while A decodes [120, 130] ms.
    const SimResult r = run(c, {req(0, 0, 100, 10), req(1, 0, 200, 50), req(2, 125, 100, 2)});
    const auto& a = r.records[0];
    const auto& b = r.records[1];
    const auto& cc = r.records[2];
    EXPECT_EQ(a.decode_instance, 0);
    EXPECT_EQ(b.decode_instance, 1);
    EXPECT_EQ(cc.decode_instance, 0);
    // Instance 0: A extend [0, 100]; A decodes to 130 (tokens 2..4); C extend [130, 230] (C's
    // first token); one decode of {A, C} [230, 240] finishes C; A alone to 290 (tokens 6..10).
    EXPECT_NEAR(a.ttft_ms(), 100, kEps);
    EXPECT_NEAR(a.e2e_ms(), 290, kEps);
    EXPECT_NEAR(*a.tpot_ms(), 190.0 / 9, kEps);
    EXPECT_NEAR(cc.ttft_ms(), 105, kEps);
    EXPECT_NEAR(*cc.tpot_ms(), 10, kEps);
    EXPECT_NEAR(cc.e2e_ms(), 115, kEps);
    // Instance 1: B extend [0, 100], then 49 steps.
    EXPECT_NEAR(b.ttft_ms(), 100, kEps);
    EXPECT_NEAR(b.e2e_ms(), 590, kEps);
    bool batched = false;
    for (auto [bs, kv] : cost->decodes) batched |= bs == 2 && kv == (100 + 4) + (100 + 1);
    EXPECT_TRUE(batched) << "A (4 tokens) and C (1 token) should decode together";
}

TEST(Simulator, PrefixCacheHitsOnAHandMadeTrace) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    // Far apart, so each one's blocks are cached (KV transfer done) before the next arrives.
    const std::vector<workload::Request> reqs = {
        req(0, 0, 1536, 1, {1, 2, 3}),         // 3 full blocks, all computed
        req(1, 10000, 1636, 1, {1, 2, 3, 4}),  // hits 1, 2, 3: computes 100
        req(2, 20000, 1536, 1, {1, 9, 10}),    // hits 1: computes 1024
        req(3, 30000, 1024, 1, {1, 2}),        // both cached, but one token must be computed:
                                               // hits 1 only, computes 512
        req(4, 40000, 600, 1, {77, 78}),       // no hit
    };
    const SimResult r = run(c, reqs);
    ASSERT_EQ(r.report.requests_completed, 5);
    EXPECT_EQ(r.stats.prefix_hit_tokens, 1536 + 512 + 512);
    EXPECT_EQ(r.stats.prefill_tokens, 1536 + 100 + 1024 + 512 + 600);
    // Request 1: one forward of 100 new tokens over 1536 cached ones.
    EXPECT_NEAR(r.records[1].ttft_ms(), 100 + kLatencyMs, kEps);
    bool seen = false;
    for (const auto& call : cost->extends) {
        seen |= call.size() == 1 && call[0].new_tokens == 100 && call[0].cached_tokens == 1536;
    }
    EXPECT_TRUE(seen);
    EXPECT_NEAR(r.records[0].ttft_ms(), 300 + kLatencyMs, kEps);
    EXPECT_NEAR(r.records[2].ttft_ms(), 200 + kLatencyMs, kEps);
    EXPECT_NEAR(r.records[3].ttft_ms(), 100 + kLatencyMs, kEps);
    EXPECT_NEAR(r.records[4].ttft_ms(), 200 + kLatencyMs, kEps);
    // The decode instance needs the whole KV: the hit's too (sent uncapped with the first chunk).
    EXPECT_EQ(r.records[1].transfer_bytes, static_cast<int64_t>(1636 * kBytesPerToken));

    c.prefix_cache = false;
    const SimResult off = run(c, reqs);
    EXPECT_EQ(off.stats.prefix_hit_tokens, 0);
    EXPECT_NEAR(off.records[1].ttft_ms(), 400 + kLatencyMs, kEps);  // 512 x 3 + 100
}

std::vector<workload::Request> synthetic(int64_t n, uint64_t seed) {
    workload::SyntheticOptions so;
    so.num_requests = n;
    so.rate_rps = 20;
    so.input =
        workload::LengthDist{.kind = workload::LengthDist::Kind::kUniform, .a = 64, .b = 2048};
    so.output = workload::LengthDist{.kind = workload::LengthDist::Kind::kUniform, .a = 1, .b = 64};
    so.seed = seed;
    StatusOr<std::vector<workload::Request>> r = workload::make_synthetic(so);
    PDSIM_CHECK_OK(r.status());
    return *r;
}

TEST(Simulator, ConservationAndDeterminism) {
    auto cost = std::make_shared<FakeCostModel>(0.005, 0.002, 2e-5, 1e-4);
    SimConfig c = make_config(example_topology("cpu-2p1d-tp2-to-tp1.yaml"), cost, 2000);
    std::vector<workload::Request> reqs = synthetic(400, 7);
    // Too big for any pool of 2000 pages x 16 tokens: fails at once, and is counted.
    reqs.push_back(req(400, reqs.back().arrival_ms + 1, 40000, 8));
    const SimResult a = run(c, reqs);
    const SimResult b = run(c, reqs);
    EXPECT_EQ(a.report.requests_submitted, 401);
    EXPECT_EQ(a.report.requests_completed + a.report.requests_failed, 401);
    EXPECT_EQ(a.report.requests_failed, 1);
    EXPECT_FALSE(a.records[400].ok);
    EXPECT_THAT(a.records[400].error, HasSubstr("KV pages"));
    EXPECT_TRUE(a.stats.bundled_lanes);
    EXPECT_GT(a.stats.flows, 0);
    int used[3] = {0, 0, 0};
    for (const auto& q : a.records) {
        if (!q.ok) continue;
        ++used[q.prefill_instance];
        EXPECT_EQ(q.generated, q.output_len);
    }
    EXPECT_GT(used[0], 100);
    EXPECT_GT(used[1], 100);
    // Identical reports (the wall-clock figures aside) and identical request times.
    nlohmann::json ja = metrics::to_json(a.report), jb = metrics::to_json(b.report);
    for (auto* j : {&ja, &jb}) {
        for (const char* k : {"wall_s", "cpu_s", "requests_per_wall_s", "events_per_wall_s"}) {
            (*j)["simulator"].erase(k);
        }
    }
    EXPECT_EQ(ja.dump(), jb.dump());
    ASSERT_EQ(a.records.size(), b.records.size());
    for (size_t i = 0; i < a.records.size(); ++i) {
        EXPECT_EQ(a.records[i].first_token_ms, b.records[i].first_token_ms);
        EXPECT_EQ(a.records[i].finish_ms, b.records[i].finish_ms);
    }
    EXPECT_EQ(a.stats.events, b.stats.events);
}

TEST(Simulator, PreemptionUnderATinyKvPoolStillCompletesEveryRequest) {
    auto cost = std::make_shared<FakeCostModel>(0.01, 0.005);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    // Decode pool: 24 pages x 16 tokens. Each request needs 4 pages at admission and grows to
    // ceil((64 + 100) / 16) = 11, so at most two can finish side by side.
    c.instances[1].kv_pages = 24;
    std::vector<workload::Request> reqs;
    for (int i = 0; i < 8; ++i) reqs.push_back(req(i, 0, 64, 100));
    std::vector<int64_t> done_order;
    c.on_request_done = [&](const metrics::RequestRecord& q) { done_order.push_back(q.id); };
    const SimResult r = run(c, reqs);
    EXPECT_EQ(r.report.requests_completed, 8);
    EXPECT_EQ(r.report.requests_failed, 0);
    EXPECT_GT(r.stats.preemptions, 0);
    EXPECT_EQ(r.report.extra["simulator"]["preemptions"].get<int64_t>(), r.stats.preemptions);
    EXPECT_EQ(done_order.size(), 8u);
    for (const auto& q : r.records) EXPECT_EQ(q.generated, 100) << q.id;
    // The oldest request is never preempted (the newest goes first): it finishes first.
    EXPECT_EQ(done_order.front(), 0);
    // Recomputes ran on the decode instance (extend forwards there).
    EXPECT_GT(r.stats.prefill_tokens, 8 * 64);

    // The testbed's rule: prompt + output reserved at admission (11 pages each: two at a time),
    // so nothing is preempted and requests wait instead.
    c.reserve_output = true;
    c.on_request_done = nullptr;
    const SimResult rr = run(c, reqs);
    EXPECT_EQ(rr.report.requests_completed, 8);
    EXPECT_EQ(rr.stats.preemptions, 0);
    EXPECT_EQ(rr.stats.prefill_tokens, 8 * 64);
    // Two at a time: 99 steps of 5 ms per pair after the first token (10 ms prefill + 2 us).
    EXPECT_NEAR(rr.records[1].e2e_ms(), 10 + kLatencyMs + 99 * 5, kEps);

    // Colocated, with the prefix cache holding released blocks in the same pool.
    SimConfig cc = make_config(cpu_1p1d_topology(), cost, 24, SimMode::kColocated);
    for (auto& q : reqs) q.hash_ids = {q.id};
    const SimResult rc = run(cc, reqs);
    EXPECT_EQ(rc.report.requests_completed, 8);
    EXPECT_GT(rc.stats.preemptions, 0);
}

TEST(Simulator, RejectsMismatchedConfigAndUnsortedRequests) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    StatusOr<SimResult> r = run_simulation(c, std::vector{req(0, 10, 10, 1), req(1, 5, 10, 1)});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    c.instances.pop_back();
    r = run_simulation(c, std::vector{req(0, 0, 10, 1)});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(Simulator, KvCapacityFromTheDeviceAndTheModel) {
    const topo::Topology dgx = example_topology("dgx-h100-2node-1p1d-tp8.yaml");
    const model::ModelConfig m = *model::resolve_model("llama3-70b");
    KvCapacityOptions o;
    const StatusOr<int64_t> pages = kv_capacity_pages(dgx, m, 0, o);
    ASSERT_OK(pages);
    // Per rank: 80 GiB x 0.9 - 2 bytes x params / 8; a page: 16 tokens x 80 layers x 2 x 1 KV head
    // x 128 x 2 bytes.
    const double avail = 80.0 * (1 << 30) * 0.9 - 2.0 * static_cast<double>(m.num_params()) / 8;
    EXPECT_EQ(*pages, static_cast<int64_t>(avail / (16.0 * 80 * 2 * 128 * 2)));
    const topo::Topology cpu = cpu_1p1d_topology();
    const model::ModelConfig tiny = *model::resolve_model("tiny");
    // The testbed's pool: 512 MiB / (16 x 4 layers x 2 x 4 heads x 64 x 4 bytes).
    EXPECT_EQ(*kv_capacity_pages(cpu, tiny, 1, o), (512LL << 20) / (16 * 4 * 2 * 4 * 64 * 4));
    o.mem_fraction = 0.1;  // 8 GiB cannot hold 17.6 GiB of weights per rank
    EXPECT_EQ(kv_capacity_pages(dgx, m, 0, o).status().code(), StatusCode::kInvalidArgument);
}

// The same dimensions as gemma3-27b (or any model) with every layer full attention.
model::ModelConfig all_full(model::ModelConfig m) {
    m.name += "-dense";
    m.layer_kinds = {model::LayerKind::kFullAttention};
    return m;
}

TEST(Simulator, KvCapacityOfAHybridAgainstDenseOfTheSameDims) {
    // gemma3-27b on one H200 (141 GiB, mem fraction 0.9): weights 2 B x 28,416,933,888 params
    // (62 layers of 66,060,288 attention + 346,816,512 MLP weights, and 2 x 262,144 x 5,376
    // embeddings) leave 141 GiB x 0.9 - 56,833,867,776 B = 79,423,969,689.6 B for KV.
    const topo::Topology gpu = example_topology("gpu-2g-1p1d.yaml");
    const model::ModelConfig gemma = *model::resolve_model("gemma3-27b");
    ASSERT_EQ(gemma.num_params(), 28416933888);
    const double avail = 141.0 * (1 << 30) * 0.9 - 2.0 * 28416933888.0;
    KvCapacityOptions o;
    // Hybrid: a page is 16 tokens of one layer, 16 x 2 x 16 heads x 128 x 2 B = 131,072 B:
    // 605,956 pages. Dense: a page spans the 62 layers (8,126,464 B): 9,773 pages.
    const int64_t hybrid_pages = static_cast<int64_t>(avail / 131072);
    const int64_t dense_pages = static_cast<int64_t>(avail / (62 * 131072.0));
    EXPECT_EQ(hybrid_pages, 605956);
    EXPECT_EQ(dense_pages, 9773);
    EXPECT_EQ(*kv_capacity_pages(gpu, gemma, 1, o), hybrid_pages);
    EXPECT_EQ(*kv_capacity_pages(gpu, all_full(gemma), 1, o), dense_pages);
    // Requests of 4096 tokens on the decode instance: 10 full layers x 256 pages + 52 sliding
    // layers x min(256, ceil(1023/16) + 1 = 65) = 5,940 pages, so 102 of them; dense: 256 pages
    // each, 38.
    const KvFootprint h = kv_footprint(gemma, 1, 2, 16, 1024);
    EXPECT_EQ(h.pages_for(4096), 5940);
    EXPECT_EQ(hybrid_pages / h.pages_for(4096), 102);
    EXPECT_EQ(dense_pages / kv_footprint(all_full(gemma), 1, 2, 16, 1024).pages_for(4096), 38);
    // qwen3-next-80b: 12 full layers, 36 recurrent of 32 x (128^2 + 3 x 3 x 128) fp32 each
    // (2,244,608 B). Weights 2 B x 3,721,854,976 params leave 128,814,127,513.6 B; a page is
    // 16 x 2 x 2 x 256 x 2 = 32,768 B: 3,931,095 pages. A request's state is 36 x 2,244,608 B =
    // 2,466 pages, so 4096 tokens take 12 x 256 + 2,466 = 5,538 pages: 709 requests.
    const model::ModelConfig qwen = *model::resolve_model("qwen3-next-80b");
    ASSERT_EQ(qwen.num_params(), 3721854976);
    const int64_t qwen_pages =
        static_cast<int64_t>((141.0 * (1 << 30) * 0.9 - 2.0 * 3721854976.0) / 32768);
    EXPECT_EQ(qwen_pages, 3931095);
    EXPECT_EQ(*kv_capacity_pages(gpu, qwen, 1, o), qwen_pages);
    const KvFootprint q = kv_footprint(qwen, 1, 2, 16, 1);
    EXPECT_EQ(q.state_pages, 2466);
    EXPECT_EQ(qwen_pages / q.pages_for(4096), 709);
}

// tiny's dimensions with layers full, sliding (W = 128), recurrent (4 state heads of 32, conv
// 4), full.
model::ModelConfig hybrid_tiny_dims() {
    model::ModelConfig m = *model::resolve_model("tiny");
    m.name = "tiny-hybrid";
    m.layer_kinds = {model::LayerKind::kFullAttention, model::LayerKind::kSlidingWindow,
                     model::LayerKind::kRecurrent, model::LayerKind::kFullAttention};
    m.sliding_window = 128;
    m.state_heads = 4;
    m.state_head_dim = 32;
    m.conv_kernel = 4;
    return m;
}

TEST(Simulator, HybridTransferBytesByGroup) {
    auto cost = std::make_shared<FakeCostModel>(0.1, 0.01);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    c.model = hybrid_tiny_dims();
    c.layerwise = false;
    const SimResult r = run(c, {req(0, 0, 1000, 5)});
    ASSERT_EQ(r.report.requests_completed, 1);
    // fp32 on cpu devices: one token of one layer is 2 x 4 x 64 x 4 = 2,048 B. A prompt of 1000:
    // full layers 1000 x 2 x 2,048 = 4,096,000 B; the sliding layer its last 128 tokens,
    // 262,144 B; the recurrent layer its state once, 4 x (32^2 + 3 x 3 x 32) x 4 = 20,992 B.
    const metrics::RequestRecord& q = r.records[0];
    EXPECT_EQ(q.transfer_bytes, 4096000 + 262144 + 20992);
    EXPECT_EQ(r.report.transfer.bytes, 4379136);
    const nlohmann::json& g = r.report.extra["simulator"]["transfer_bytes_by_group"];
    EXPECT_EQ(g["full"], 4096000);
    EXPECT_EQ(g["sliding"], 262144);
    EXPECT_EQ(g["state"], 20992);
    // Chunks 512 + 488, layerwise off: the first chunk's 512 x 4,096 B go at 0.1 s and land long
    // before 0.2 s; the last chunk carries 488 x 4,096 + 262,144 (its tokens hold the window
    // [872, 1000)) + 20,992 = 2,281,984 B from 0.2 s at 10 GB/s, + 2 us (dense tiny: 3,997,696 B).
    const double tail_ms = 2281984 / 10e9 * 1000 + kLatencyMs;
    EXPECT_NEAR(q.ttft_ms(), 200 + tail_ms, kEps);
    EXPECT_NEAR(q.exposed_transfer_ms, tail_ms, kEps);
}

TEST(Simulator, HybridAdmissionCountsPagesByGroup) {
    auto cost = std::make_shared<FakeCostModel>(0.01, 0.005);
    SimConfig c = make_config(cpu_1p1d_topology(), cost);
    c.model = hybrid_tiny_dims();
    c.reserve_output = true;
    // The decode instance's pages (fp32: 16 tokens of one layer, 32,768 B). A request of 64 + 100
    // tokens holds P = ceil(164/16) = 11 pages in each of the 2 full layers, min(11, ceil(127/16)
    // + 1 = 9) in the sliding one, and its state (20,992 B) in 1 page: 32 pages.
    c.instances[1].kv_pages = 64;  // two at a time
    std::vector<workload::Request> reqs;
    for (int i = 0; i < 3; ++i) reqs.push_back(req(i, 0, 64, 100));
    SimResult r = run(c, reqs);
    EXPECT_EQ(r.report.requests_completed, 3);
    EXPECT_NEAR(r.records[1].ttft_ms(), r.records[0].ttft_ms(), kEps);
    EXPECT_GT(r.records[2].ttft_ms(), r.records[0].e2e_ms());  // waited for pages
    EXPECT_EQ(r.report.extra["simulator"]["instances"][1]["kv_requests_that_fit"]["1024"], 0);
    c.instances[1].kv_pages = 63;  // one at a time
    r = run(c, reqs);
    EXPECT_EQ(r.report.requests_completed, 3);
    EXPECT_GT(r.records[1].ttft_ms(), r.records[0].e2e_ms());
    c.instances[1].kv_pages = 31;  // never
    r = run(c, reqs);
    EXPECT_EQ(r.report.requests_failed, 3);
    EXPECT_THAT(r.records[0].error, testing::HasSubstr("needs 32 KV pages on instance decode0"));
    // The prefix cache is off for a hybrid (its hits would need the window and the state).
    EXPECT_EQ(r.report.extra["config"]["prefix_cache"], false);
}

}  // namespace
}  // namespace pdsim::des
