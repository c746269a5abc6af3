// CPU core contention in the simulator (SimConfig::cpu_contention): forwards of cpu instances on
// one node share its cores equally per compute thread, at most one core per thread. Every
// expectation below is worked out by hand from a constant cost model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/check.h"
#include "sim/des/simulator.h"
#include "tests/status_matchers.h"
#include "topology/loader.h"

namespace pdsim::des {
namespace {

// extend: e0 per forward; decode: d0 per forward.
class ConstCost : public cost::CostModel {
public:
    ConstCost(double e0, double d0) : e0_(e0), d0_(d0) {}
    [[nodiscard]] std::string describe() const override { return "const"; }
    [[nodiscard]] double extend_s(std::span<const cost::ExtendItem>) const override { return e0_; }
    [[nodiscard]] double decode_s(int64_t, int64_t) const override { return d0_; }

private:
    double e0_, d0_;
};

// Instance 0: tp `tp0`, instance 1: tp 1, all on one node of cpu devices behind a loopback
// switch (10 GB/s, 1 us per link: a flow's latency is 2 us).
std::string topology_yaml(int tp0) {
    std::string devs, links, inst0;
    for (int i = 0; i <= tp0; ++i) {
        devs += "      - {id: n0.cpu" + std::to_string(i) + ", type: cpu}\n";
        links += "  - {a: n0.cpu" + std::to_string(i) +
                 ", b: n0.shm, type: loopback, gbps: 10, latency_us: 1}\n";
    }
    for (int i = 0; i < tp0; ++i) inst0 += (i ? ", n0.cpu" : "n0.cpu") + std::to_string(i);
    return "name: contention\nmodel: tiny\nnodes:\n  - id: n0\n    devices:\n" + devs +
           "    switches:\n      - {id: n0.shm, type: loopback}\nlinks:\n" + links +
           "instances:\n  - {id: prefill0, role: prefill, tp: " + std::to_string(tp0) +
           ", devices: [" + inst0 + "]}\n  - {id: decode0, role: decode, tp: 1, devices: [n0.cpu" +
           std::to_string(tp0) + "]}\n";
}

constexpr double kLatencyMs = 0.002;
constexpr double kEps = 1e-6;  // ms

SimConfig make_config(int tp0, double node_cpus, SimMode mode, double extend_s, double decode_s) {
    StatusOr<topo::Topology> t =
        topo::parse_topology(topology_yaml(tp0), "<test>", topo::Format::kYaml);
    PDSIM_CHECK_OK(t.status());
    SimConfig c;
    c.topology = *t;
    c.topology_label = t->name;
    c.model = *model::resolve_model("tiny");
    c.mode = mode;
    c.node_cpus = node_cpus;
    auto cost = std::make_shared<ConstCost>(extend_s, decode_s);
    c.instances.push_back(
        InstanceSetup{.cost = cost, .kv_pages = 100000, .kv_dtype_bytes = 4, .cpu_cores = tp0});
    c.instances.push_back(
        InstanceSetup{.cost = cost, .kv_pages = 100000, .kv_dtype_bytes = 4, .cpu_cores = 1});
    return c;
}

workload::Request req(int64_t id, double arrival_ms, int32_t in, int32_t out) {
    workload::Request r;
    r.id = id;
    r.arrival_ms = arrival_ms;
    r.input_len = in;
    r.output_len = out;
    return r;
}

SimResult run(const SimConfig& c, const std::vector<workload::Request>& reqs) {
    StatusOr<SimResult> r = run_simulation(c, reqs);
    PDSIM_CHECK_OK(r.status());
    return std::move(*r);
}

std::vector<double> sorted_ttfts(const SimResult& r) {
    std::vector<double> v;
    for (const auto& q : r.records) v.push_back(q.ttft_ms());
    std::sort(v.begin(), v.end());
    return v;
}

// Colocated, one 100-token request per instance, output 1: TTFT is the extend forward's end.
TEST(CpuContention, TwoOneCoreForwardsOnOneCoreTakeTwiceAsLong) {
    const SimConfig c = make_config(1, 1, SimMode::kColocated, 0.1, 0.01);
    const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    // Both run the whole time at half a core: 0.1 core-seconds each at 0.5 cores.
    EXPECT_NEAR(r.records[0].ttft_ms(), 200, kEps);
    EXPECT_NEAR(r.records[1].ttft_ms(), 200, kEps);
    EXPECT_EQ(r.stats.contended_forwards, 2);
}

TEST(CpuContention, PartialOverlapSharesOnlyWhileBothRun) {
    const SimConfig c = make_config(1, 1, SimMode::kColocated, 0.1, 0.01);
    const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 50, 100, 1)});
    // Request 0 alone for 50 ms (half done), then both at half a core: request 0's last 50 ms of
    // work take 100 ms (ends at 150 ms) while request 1 does 50 ms of its work; request 1's last
    // 50 ms run alone: ends at 200 ms, TTFT 150 ms.
    EXPECT_NEAR(r.records[0].ttft_ms(), 150, kEps);
    EXPECT_NEAR(r.records[1].ttft_ms(), 150, kEps);
}

TEST(CpuContention, TwoCoreTp2AndOneCoreForwardOnTwoCores) {
    const SimConfig c = make_config(2, 2, SimMode::kColocated, 0.1, 0.01);
    const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    // 3 compute threads on 2 cores: 2/3 of a core each. The TP-2 forward (0.2 core-seconds) gets
    // 4/3 cores, the TP-1 one (0.1) 2/3: both end at 150 ms.
    const std::vector<double> t = sorted_ttfts(r);
    EXPECT_NEAR(t[0], 150, kEps);
    EXPECT_NEAR(t[1], 150, kEps);
    EXPECT_EQ(r.stats.contended_forwards, 2);
}

TEST(CpuContention, BoundRanksShareOnlyTheirOwnCore) {
    // The same forwards with the ranks bound to cores 0, 1, 0 (mpirun --bind-to core): core 0
    // halves between the TP-1 forward and the TP-2 forward's first rank, whose peer on core 1
    // keeps its pace. TP-2: 0.2 core-seconds at 2 x 1/2 cores; TP-1: 0.1 at 1/2: both end at
    // 200 ms, where the node-wide share above ends them at 150 ms.
    SimConfig c = make_config(2, 2, SimMode::kColocated, 0.1, 0.01);
    c.rank_core = {0, 1, 0};
    const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    const std::vector<double> t = sorted_ttfts(r);
    EXPECT_NEAR(t[0], 200, kEps);
    EXPECT_NEAR(t[1], 200, kEps);
    EXPECT_EQ(r.report.extra["config"]["rank_core"], (nlohmann::json{0, 1, 0}));
    // On cores of their own they do not contend at all.
    c.rank_core = {0, 1, 2};
    const std::vector<double> apart = sorted_ttfts(run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)}));
    EXPECT_NEAR(apart[0], 100, kEps);
    EXPECT_NEAR(apart[1], 100, kEps);
    // A core per rank or nothing.
    c.rank_core = {0, 1};
    EXPECT_THAT(run_simulation(c, std::vector<workload::Request>{req(0, 0, 100, 1)}).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("2 rank cores for 3 ranks")));
}

// SimConfig::core_wait_s: work that reaches an idle instance while another instance's forward runs
// on its cores starts that much later; with those cores idle, or on cores of its own, at once.
TEST(CpuContention, CoreWaitDelaysWorkReachingAnIdleInstanceOnABusyCore) {
    SimConfig c = make_config(1, 1, SimMode::kColocated, 0.1, 0.01);
    c.core_wait_s = 0.005;
    // Request 1 reaches instance 1 at 50 ms while instance 0's forward (0 to ...) runs on the one
    // core: it starts at 55 ms. Instance 0 alone for 50 ms (half its work), alone again from 50 to
    // 55 ms (55 ms: 0.055 of 0.1 done), then both at half a core: instance 0's last 0.045
    // core-seconds take 90 ms (ends at 145 ms), during which instance 1 does 0.045; instance 1's
    // last 0.055 run alone: it ends at 200 ms, TTFT 150 ms (without the wait: 150 and 150).
    const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 50, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    EXPECT_NEAR(r.records[0].ttft_ms(), 145, kEps);
    EXPECT_NEAR(r.records[1].ttft_ms(), 150, kEps);
    EXPECT_NEAR(r.records[1].prefill_start_ms - r.records[1].arrival_ms, 5, kEps);
    // Request 0 reached its instance with the core idle: no wait.
    EXPECT_NEAR(r.records[0].prefill_start_ms, 0, kEps);
    // After instance 0 finished, the core is idle again: no wait.
    const SimResult later = run(c, {req(0, 0, 100, 1), req(1, 300, 100, 1)});
    EXPECT_NEAR(later.records[1].prefill_start_ms, 300, kEps);
    EXPECT_NEAR(later.records[1].ttft_ms(), 100, kEps);
    // Bound to cores of their own (2 cores): nothing to wait for.
    SimConfig apart = make_config(1, 2, SimMode::kColocated, 0.1, 0.01);
    apart.core_wait_s = 0.005;
    apart.rank_core = {0, 1};
    const SimResult own = run(apart, {req(0, 0, 100, 1), req(1, 50, 100, 1)});
    EXPECT_NEAR(own.records[1].prefill_start_ms, 50, kEps);
    // Bound to one core: the wait applies.
    apart.rank_core = {0, 0};
    const SimResult shared = run(apart, {req(0, 0, 100, 1), req(1, 50, 100, 1)});
    EXPECT_NEAR(shared.records[1].prefill_start_ms, 55, kEps);
    apart.core_wait_s = -1;
    EXPECT_THAT(run_simulation(apart, std::vector<workload::Request>{req(0, 0, 100, 1)}).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("core wait -1 s")));
}

// SimConfig::step_wait: a decode forward that ends while another instance computes on its core is
// followed, with the table's chance, by the table's wait before the next one; never without a
// competitor or without more work.
TEST(CpuContention, StepWaitFollowsDecodeForwardsThatEndBesideAComputingInstance) {
    // One core, not bound: prefill (extend 1 s) and decode (10 ms a step) share it.
    SimConfig c = make_config(1, 1, SimMode::kDisagg, 1.0, 0.01);
    // Request 0's prefill runs alone (0 to 1000 ms); request 1 arrives as it ends, so its 1 s
    // prefill runs through all of request 0's 10 decode steps: each takes 20 ms at half the core.
    const std::vector<workload::Request> both = {req(0, 0, 100, 11), req(1, 1000, 100, 1)};
    const SimResult plain = run(c, both);
    ASSERT_EQ(plain.report.requests_completed, 2);
    ASSERT_TRUE(plain.records[0].tpot_ms().has_value());
    EXPECT_NEAR(*plain.records[0].tpot_ms(), 20, 0.01);  // + the KV transfer's few us / 10
    EXPECT_EQ(plain.stats.step_waits, 0);
    // Chance 1 of 5 ms: 9 waits (none after the last step: no more work), TPOT 24.5 ms.
    c.step_wait.decode = {{.chance = 1, .wait_s = 0.005}};
    const SimResult waited = run(c, both);
    EXPECT_EQ(waited.stats.step_waits, 9);
    EXPECT_NEAR(*waited.records[0].tpot_ms(), 24.5, 0.01);
    EXPECT_NEAR(waited.records[0].ttft_ms(), plain.records[0].ttft_ms(), kEps);
    // With no instance computing beside it: no wait, whatever the chance.
    const SimResult alone = run(c, {req(0, 0, 100, 11)});
    EXPECT_EQ(alone.stats.step_waits, 0);
    EXPECT_NEAR(*alone.records[0].tpot_ms(), 10, 0.01);
    // Chance 0: as without; a chance in between waits some of the 9 steps, the same ones each
    // run (seeded by noise_seed).
    c.step_wait.decode = {{.chance = 0, .wait_s = 0.005}};
    EXPECT_EQ(run(c, both).stats.step_waits, 0);
    c.step_wait.decode = {{.chance = 0.5, .wait_s = 0.005}};
    const SimResult half = run(c, both);
    EXPECT_GT(half.stats.step_waits, 0);
    EXPECT_LT(half.stats.step_waits, 9);
    EXPECT_NEAR(*half.records[0].tpot_ms(), 20 + 0.5 * static_cast<double>(half.stats.step_waits),
                0.01);
    EXPECT_EQ(run(c, both).stats.step_waits, half.stats.step_waits);
    // Ranks bound to cores of their own: no competitor, no wait.
    c.step_wait.decode = {{.chance = 1, .wait_s = 0.005}};
    SimConfig apart = c;
    apart.node_cpus = 2;
    apart.rank_core = {0, 1};
    EXPECT_EQ(run(apart, both).stats.step_waits, 0);
    c.step_wait.decode = {{.chance = 1.5, .wait_s = 0.005}};
    EXPECT_THAT(run_simulation(c, both).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("chance 1.5")));
}

// A cost model that warms up after 4 ms without a forward (cost::CostWake).
class WakingCost : public ConstCost {
public:
    using ConstCost::ConstCost;
    [[nodiscard]] cost::CostWake wake() const override {
        return {.min_idle_s = 0.004, .lost_s = 0.01, .tau_s = 0.002};
    }
};

// A step wait is not idle time: the thread was waiting for the core, so a wait longer than the
// warm-up's min_idle_s does not make the next forward warm up again.
TEST(CpuContention, AStepWaitDoesNotStartAWarmUp) {
    SimConfig c = make_config(1, 1, SimMode::kDisagg, 1.0, 0.01);
    auto cost = std::make_shared<WakingCost>(1.0, 0.01);
    for (InstanceSetup& s : c.instances) s.cost = cost;
    const std::vector<workload::Request> both = {req(0, 0, 100, 11), req(1, 1000, 100, 1)};
    const SimResult plain = run(c, both);
    // The decode's first step warms up (the instance was idle since 0), the others do not.
    ASSERT_TRUE(plain.records[0].tpot_ms().has_value());
    EXPECT_GT(*plain.records[0].tpot_ms(), 20.5);
    // 9 waits of 5 ms, each longer than min_idle_s: TPOT grows by the waits alone.
    c.step_wait.decode = {{.chance = 1, .wait_s = 0.005}};
    const SimResult waited = run(c, both);
    EXPECT_EQ(waited.stats.step_waits, 9);
    EXPECT_NEAR(*waited.records[0].tpot_ms(), *plain.records[0].tpot_ms() + 4.5, 0.01);
}

TEST(CpuContention, SharesMoveWhenAForwardEnds) {
    // TP-2 extend of 0.1 s and a TP-1 extend of 0.05 s on 2 cores: 2/3 of a core per thread
    // until the TP-1 forward's 0.05 core-seconds are done at 75 ms; by then the TP-2 one did
    // 0.1 of its 0.2 core-seconds, the rest at 2 cores: ends at 125 ms.
    SimConfig c = make_config(2, 2, SimMode::kColocated, 0.1, 0.01);
    c.instances[1].cost = std::make_shared<ConstCost>(0.05, 0.01);
    const std::vector<double> v = sorted_ttfts(run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)}));
    EXPECT_NEAR(v[0], 75, kEps);
    EXPECT_NEAR(v[1], 125, kEps);
}

TEST(CpuContention, NoSlowdownWhenCoresSuffice) {
    for (double cores : {3.0, 8.0}) {
        const SimConfig c = make_config(2, cores, SimMode::kColocated, 0.1, 0.01);
        const SimResult r = run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)});
        const std::vector<double> t = sorted_ttfts(r);
        EXPECT_NEAR(t[0], 100, kEps) << cores;
        EXPECT_NEAR(t[1], 100, kEps) << cores;
        EXPECT_EQ(r.stats.contended_forwards, 0);
    }
    // Off: as if the node had enough cores.
    SimConfig c = make_config(2, 2, SimMode::kColocated, 0.1, 0.01);
    c.cpu_contention = false;
    const std::vector<double> t = sorted_ttfts(run(c, {req(0, 0, 100, 1), req(1, 0, 100, 1)}));
    EXPECT_NEAR(t[1], 100, kEps);
}

// Disaggregated on one core: request 1's layerwise prefill overlaps request 0's decode steps.
TEST(CpuContention, DecodeAndLayerwisePrefillShareACore) {
    const SimConfig c = make_config(1, 1, SimMode::kDisagg, 0.1, 0.01);
    const SimResult r = run(c, {req(0, 0, 100, 3), req(1, 99, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    // Request 0: prefill alone [0, 100 ms], KV lands 2 us later (first token). Request 1 arrives
    // at 99 ms (the idle decode instance admits it at once) and its prefill starts at 100 ms,
    // alone for 2 us, then shares the core with request 0's two decode steps (10 ms of work each
    // at half a core: 20 ms each, to 140.002 ms): TPOT 20 ms. By then request 1's prefill did
    // 0.002 + 20 ms of its 100 ms; the rest alone: ends at 220 ms.
    EXPECT_NEAR(r.records[0].ttft_ms(), 100 + kLatencyMs, kEps);
    EXPECT_NEAR(*r.records[0].tpot_ms(), 20, kEps);
    // Its layerwise flow's cap follows the slowed forward: the last layer leaves at the
    // forward's end (220 ms) and lands 2 us later. A cap left at bytes / 100 ms would have
    // landed everything by 200.002 ms and exposed nothing.
    EXPECT_NEAR(r.records[1].ttft_ms(), 121 + kLatencyMs, kEps);
    EXPECT_NEAR(r.records[1].exposed_transfer_ms, kLatencyMs, kEps);
    EXPECT_NEAR(r.records[1].transfer_ms, 120 + kLatencyMs, kEps);
    EXPECT_EQ(r.stats.contended_forwards, 3);
}

// ---- interference (cost::CostModel::interference) ----

// ConstCost plus interference and noise.
class InterferingCost : public ConstCost {
public:
    InterferingCost(double e0, double d0, double extend_x, double decode_x,
                    cost::CostNoise decode_noise = {})
        : ConstCost(e0, d0), x_{extend_x, decode_x}, noise_(std::move(decode_noise)) {}
    [[nodiscard]] double interference(bool decode) const override { return x_[decode ? 1 : 0]; }
    [[nodiscard]] cost::CostNoise noise(bool decode) const override {
        return decode ? noise_ : cost::CostNoise{};
    }

private:
    double x_[2];
    cost::CostNoise noise_;
};

SimConfig interfering_config(double extend_x) {
    // Two TP-1 instances on 2 cores: never oversubscribed, so only interference slows them.
    SimConfig c = make_config(1, 2, SimMode::kColocated, 0.1, 0.01);
    auto cost = std::make_shared<InterferingCost>(0.1, 0.01, extend_x, 0.0);
    for (auto& i : c.instances) i.cost = cost;
    return c;
}

TEST(CpuInterference, OverlappingForwardsRunSlowerByTheFactor) {
    const SimResult r = run(interfering_config(0.5), {req(0, 0, 100, 1), req(1, 0, 100, 1)});
    ASSERT_EQ(r.report.requests_completed, 2);
    // A whole core each, but 1.5x slower while both run: 100 ms of work take 150 ms.
    const std::vector<double> t = sorted_ttfts(r);
    EXPECT_NEAR(t[0], 150, kEps);
    EXPECT_NEAR(t[1], 150, kEps);
    EXPECT_EQ(r.stats.contended_forwards, 2);
}

TEST(CpuInterference, OnlyWhileAnotherInstanceComputes) {
    // Request 0 alone for 50 ms (half done); then both at 1/1.5: request 0's last 50 ms of work
    // take 75 ms (ends at 125 ms), during which request 1 does 50 ms of its work; its rest runs
    // alone: ends at 175 ms, TTFT 125 ms.
    const SimResult r = run(interfering_config(0.5), {req(0, 0, 100, 1), req(1, 50, 100, 1)});
    EXPECT_NEAR(r.records[0].ttft_ms(), 125, kEps);
    EXPECT_NEAR(r.records[1].ttft_ms(), 125, kEps);
    // Alone, nothing changes; with contention off, neither.
    const SimResult alone = run(interfering_config(0.5), {req(0, 0, 100, 1)});
    EXPECT_NEAR(alone.records[0].ttft_ms(), 100, kEps);
    SimConfig off = interfering_config(0.5);
    off.cpu_contention = false;
    const std::vector<double> t = sorted_ttfts(run(off, {req(0, 0, 100, 1), req(1, 0, 100, 1)}));
    EXPECT_NEAR(t[1], 100, kEps);
}

// ---- noise (cost::CostNoise) ----

SimConfig noisy_config(cost::CostNoise decode_noise) {
    SimConfig c = make_config(1, 2, SimMode::kDisagg, 0.1, 0.01);
    auto cost = std::make_shared<InterferingCost>(0.1, 0.01, 0.0, 0.0, std::move(decode_noise));
    for (auto& i : c.instances) i.cost = cost;
    return c;
}

double one_tpot(const SimConfig& c) {
    // One request, 2001 tokens: TPOT is the mean of 2000 decode steps.
    const SimResult r = run(c, {req(0, 0, 100, 2001)});
    PDSIM_CHECK(r.report.requests_completed == 1);
    return *r.records[0].tpot_ms();
}

TEST(CostNoise, FastQuantilesKeepTheMeanAndVaryTheSteps) {
    // Uniform on [0.5, 1.5]: mean 1, sd 0.29; the mean of 2000 draws is within 3% (>10 sd).
    cost::CostNoise n;
    n.fast_quantiles = {0.5, 1.5};
    SimConfig c = noisy_config(n);
    const double a = one_tpot(c);
    EXPECT_NEAR(a, 10, 0.3);
    EXPECT_NE(a, 10) << "the steps must vary";
    EXPECT_EQ(one_tpot(c), a) << "a seed gives one run";
    c.noise_seed = 2;
    EXPECT_NE(one_tpot(c), a) << "another seed, another run";
    c.cost_noise = false;
    EXPECT_NEAR(one_tpot(c), 10, 1e-9);
}

TEST(CostNoise, SlowFactorHoldsForItsPeriod) {
    // Slow only, redrawn every 10 s of simulated time: all 2000 steps (20 s at most 2x) see at
    // most 3 factors, so the TPOT is far from 10 ms for most seeds, unlike fast noise.
    cost::CostNoise n;
    n.slow_cv = 0.5;
    n.slow_period_s = 10;
    SimConfig c = noisy_config(n);
    int far = 0;
    for (uint64_t seed = 1; seed <= 8; ++seed) {
        c.noise_seed = seed;
        far += std::abs(one_tpot(c) - 10) > 1 ? 1 : 0;
    }
    EXPECT_GE(far, 4);
}

}  // namespace
}  // namespace pdsim::des
