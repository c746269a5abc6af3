// CpuContention (sim/des/cpu_contention.h): which nodes contend, and the rate each forward gets,
// worked out by hand from the processor-sharing rule min(1, cores / threads) per thread.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/check.h"
#include "sim/cost/cost_model.h"
#include "sim/des/cpu_contention.h"
#include "topology/loader.h"

namespace pdsim::des {
namespace {

class FixedCost : public cost::CostModel {
public:
    explicit FixedCost(double interference) : interference_(interference) {}
    [[nodiscard]] std::string describe() const override { return "fixed"; }
    [[nodiscard]] double extend_s(std::span<const cost::ExtendItem>) const override { return 1; }
    [[nodiscard]] double decode_s(int64_t, int64_t) const override { return 1; }
    [[nodiscard]] double interference(bool decode) const override {
        return decode ? 2 * interference_ : interference_;
    }

private:
    double interference_;
};

// Instances a, b on node n0 and c on node n1 (reached over ethernet NICs), 8 cpus each.
topo::Topology three_instances() {
    const char* yaml = R"(name: three
model: tiny
nodes:
  - id: n0
    cpus: 8
    devices:
      - {id: n0.cpu0, type: cpu}
      - {id: n0.cpu1, type: cpu}
    nics:
      - {id: n0.nic0, type: ethernet, gbps: 10}
    switches:
      - {id: n0.shm, type: loopback}
  - id: n1
    cpus: 8
    devices:
      - {id: n1.cpu0, type: cpu}
    nics:
      - {id: n1.nic0, type: ethernet, gbps: 10}
switches:
  - {id: eth, type: ethernet}
links:
  - {a: n0.cpu0, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu1, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu0, b: n0.nic0, type: pcie, gbps: 10, latency_us: 1}
  - {a: n1.cpu0, b: n1.nic0, type: pcie, gbps: 10, latency_us: 1}
  - {a: n0.nic0, b: eth, type: ethernet, gbps: 10, latency_us: 1}
  - {a: n1.nic0, b: eth, type: ethernet, gbps: 10, latency_us: 1}
instances:
  - {id: a, role: prefill, tp: 1, devices: [n0.cpu0]}
  - {id: b, role: decode, tp: 1, devices: [n0.cpu1]}
  - {id: c, role: decode, tp: 1, devices: [n1.cpu0]}
)";
    StatusOr<topo::Topology> t = topo::parse_topology(yaml, "<test>", topo::Format::kYaml);
    PDSIM_CHECK_OK(t.status());
    return *t;
}

CpuContention plan(const topo::Topology& t, std::vector<int> cores, double interference,
                   double node_cpus) {
    static FixedCost quiet(0), noisy(0.5);
    const cost::CostModel* cm = interference > 0 ? &noisy : &quiet;
    std::vector<const cost::CostModel*> costs(t.instances.size(), cm);
    return CpuContention::plan(t, cores, costs, node_cpus);
}

TEST(CpuContention, NodesThatFitTheirThreadsDoNotContend) {
    const topo::Topology t = three_instances();
    const CpuContention c = plan(t, {4, 4, 8}, 0, 0);  // 8 threads on 8 cpus per node
    EXPECT_FALSE(c.contended(0));
    EXPECT_FALSE(c.contended(1));
    EXPECT_FALSE(c.contended(2));
    EXPECT_TRUE(c.nodes().empty());
}

TEST(CpuContention, AnOversubscribedNodeContends) {
    const topo::Topology t = three_instances();
    CpuContention c = plan(t, {6, 4, 8}, 0, 0);  // n0: 10 threads on 8 cpus
    ASSERT_EQ(c.nodes().size(), 1u);
    EXPECT_EQ(c.nodes()[0].cores, 8);
    EXPECT_TRUE(c.contended(0));
    EXPECT_TRUE(c.contended(1));
    EXPECT_FALSE(c.contended(2));
    EXPECT_EQ(c.forward(0).cores, 6);

    // Alone: every thread gets a core.
    c.start_forward(0, 2.0, false, 0.0);
    auto rates = c.share(0);
    ASSERT_EQ(rates.size(), 1u);
    EXPECT_EQ(rates[0].first, 6);
    EXPECT_EQ(rates[0].second, 0);
    EXPECT_EQ(c.forward(0).work_core_s, 12);  // 6 threads x 2 s
    // Together: 8 / 10 of a core per thread.
    c.start_forward(1, 1.0, true, 0.5);
    rates = c.share(0);
    ASSERT_EQ(rates.size(), 2u);
    EXPECT_DOUBLE_EQ(rates[0].first, 6 * 0.8);
    EXPECT_DOUBLE_EQ(rates[1].first, 4 * 0.8);
    EXPECT_EQ(c.end_forward(0), 0);
    rates = c.share(0);
    ASSERT_EQ(rates.size(), 1u);
    EXPECT_EQ(rates[0].second, 1);
    EXPECT_EQ(rates[0].first, 4);
}

TEST(CpuContention, NodeCpusOverrideTheTopology) {
    const topo::Topology t = three_instances();
    const CpuContention c = plan(t, {4, 4, 8}, 0, 4);  // 4 cpus everywhere: both nodes contend
    ASSERT_EQ(c.nodes().size(), 2u);
    EXPECT_EQ(c.nodes()[0].cores, 4);
    EXPECT_EQ(c.forward(2).node, 1);
}

TEST(CpuContention, InterferenceMakesASharedNodeContendAndSlowsItsForwards) {
    const topo::Topology t = three_instances();
    CpuContention c = plan(t, {2, 2, 2}, 0.5, 0);  // plenty of cores, but interference
    ASSERT_EQ(c.nodes().size(), 1u);               // n1 has one instance: nothing to interfere with
    EXPECT_FALSE(c.contended(2));
    c.start_forward(0, 1.0, false, 0.0);  // extend: interference 0.5
    c.start_forward(1, 1.0, true, 0.0);   // decode: interference 1.0
    const auto rates = c.share(0);
    ASSERT_EQ(rates.size(), 2u);
    EXPECT_DOUBLE_EQ(rates[0].first, 2 / 1.5);
    EXPECT_DOUBLE_EQ(rates[1].first, 2 / 2.0);
}

// The cpu-2p1d-tp2-to-tp1 layout on 2 cores: prefill p0 and p1 of TP 2, decode d of TP 1; with
// mpirun --map-by core --bind-to core its ranks 0..4 sit on cores 0, 1, 0, 1, 0.
topo::Topology two_prefills_one_decode() {
    const char* yaml = R"(name: p2d1
model: tiny
nodes:
  - id: n0
    cpus: 2
    devices:
      - {id: n0.cpu0, type: cpu}
      - {id: n0.cpu1, type: cpu}
      - {id: n0.cpu2, type: cpu}
      - {id: n0.cpu3, type: cpu}
      - {id: n0.cpu4, type: cpu}
    switches:
      - {id: n0.shm, type: loopback}
links:
  - {a: n0.cpu0, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu1, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu2, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu3, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu4, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
instances:
  - {id: p0, role: prefill, tp: 2, devices: [n0.cpu0, n0.cpu1]}
  - {id: p1, role: prefill, tp: 2, devices: [n0.cpu2, n0.cpu3]}
  - {id: d, role: decode, tp: 1, devices: [n0.cpu4]}
)";
    StatusOr<topo::Topology> t = topo::parse_topology(yaml, "<test>", topo::Format::kYaml);
    PDSIM_CHECK_OK(t.status());
    return *t;
}

// share()'s rate of `instance` (cores), or -1 when it has no forward in flight.
double rate_of(std::span<const std::pair<double, int>> rates, int instance) {
    for (const auto& [rate, i] : rates) {
        if (i == instance) return rate;
    }
    return -1;
}

TEST(CpuContention, BoundRanksShareTheirOwnCore) {
    const topo::Topology t = two_prefills_one_decode();
    static FixedCost quiet(0);
    const std::vector<const cost::CostModel*> costs(3, &quiet);
    const std::vector<int> cores = {2, 2, 1};
    const std::vector<int> rank_core = {0, 1, 0, 1, 0};
    CpuContention c = CpuContention::plan(t, cores, costs, 0, rank_core);
    ASSERT_EQ(c.nodes().size(), 1u);
    EXPECT_TRUE(c.nodes()[0].bound);
    using CoreThreads = std::vector<std::pair<int, double>>;
    EXPECT_EQ(c.forward(0).core_threads, (CoreThreads{{0, 1.0}, {1, 1.0}}));
    EXPECT_EQ(c.forward(2).core_threads, (CoreThreads{{0, 1.0}}));

    // The decode alone has core 0 to itself.
    c.start_forward(2, 1.0, true, 0.0);
    EXPECT_DOUBLE_EQ(rate_of(c.share(0), 2), 1.0);
    // Beside p0: core 0 halves between them; p0's rank on core 1 waits for its peer, so p0
    // computes on 2 x 1/2 cores. (Node-wide, 3 threads on 2 cores would give each 2/3.)
    c.start_forward(0, 1.0, false, 0.0);
    auto rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 0.5);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 1.0);
    // Beside both prefills: a third of core 0 each (node-wide: 2/5).
    c.start_forward(1, 1.0, false, 0.0);
    rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 1.0 / 3);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 2.0 / 3);
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 2.0 / 3);
    // The two prefills without the decode: half of each core per rank.
    c.end_forward(2);
    rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 1.0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 1.0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), -1);
}

TEST(CpuContention, ATpInstanceKeepsThePaceOfItsSlowestRank) {
    // Ranks on cores 0, 1, 0, 1, 1: core 0 holds p0 and p1, core 1 holds p0, p1 and d.
    const topo::Topology t = two_prefills_one_decode();
    static FixedCost quiet(0);
    const std::vector<const cost::CostModel*> costs(3, &quiet);
    const std::vector<int> cores = {2, 2, 1};
    const std::vector<int> rank_core = {0, 1, 0, 1, 1};  // d moves to core 1
    CpuContention c = CpuContention::plan(t, cores, costs, 0, rank_core);
    ASSERT_EQ(c.nodes().size(), 1u);
    c.start_forward(0, 1.0, false, 0.0);
    c.start_forward(1, 1.0, false, 0.0);
    c.start_forward(2, 1.0, true, 0.0);
    // Core 1 fills first (1/3 per thread): every rank runs at 1/3, and core 0 keeps 1/3 idle, as
    // p0's and p1's ranks there wait for their peers on core 1.
    auto rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 2.0 / 3);
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 2.0 / 3);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 1.0 / 3);
    // Without p1: core 1 holds p0 and d at 1/2; core 0 has p0 alone but p0 keeps pace with its
    // rank on core 1.
    c.end_forward(1);
    rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 1.0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 0.5);
}

TEST(CpuContention, WhatABottleneckedInstanceLeavesOfACoreGoesToTheOthers) {
    // Ranks on cores 0, 1, 0, 0, 1: core 0 holds p0 and both of p1's ranks (1/3 each), core 1
    // holds p0 and d. p0 is held to 1/3 by core 0, and d takes the 2/3 of core 1 p0 leaves.
    const topo::Topology t = two_prefills_one_decode();
    static FixedCost quiet(0);
    const std::vector<const cost::CostModel*> costs(3, &quiet);
    const std::vector<int> cores = {2, 2, 1};
    const std::vector<int> rank_core = {0, 1, 0, 0, 1};
    CpuContention c = CpuContention::plan(t, cores, costs, 0, rank_core);
    c.start_forward(0, 1.0, false, 0.0);
    c.start_forward(1, 1.0, false, 0.0);
    c.start_forward(2, 1.0, true, 0.0);
    const auto rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 2.0 / 3);  // 2 threads x 1/3
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 2.0 / 3);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 2.0 / 3);  // 1 - 1/3 of core 1
}

TEST(CpuContention, BoundInterferenceSlowsOnlyForwardsThatShareACore) {
    const topo::Topology t = two_prefills_one_decode();
    static FixedCost noisy(0.5);  // extend +50%, decode +100%
    const std::vector<const cost::CostModel*> costs(3, &noisy);
    const std::vector<int> cores = {2, 2, 1};
    const std::vector<int> rank_core = {0, 1, 2, 3, 0};  // p1 on cores 2, 3; d beside p0's rank 0
    CpuContention c = CpuContention::plan(t, cores, costs, 0, rank_core);
    ASSERT_EQ(c.nodes().size(), 1u);
    c.start_forward(1, 1.0, false, 0.0);
    c.start_forward(2, 1.0, true, 0.0);
    auto rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 2.0);  // no core shared: no interference
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 1.0);
    c.start_forward(0, 1.0, false, 0.0);  // p0 joins d on core 0
    rates = c.share(0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 0), 2 * 0.5 / 1.5);
    EXPECT_DOUBLE_EQ(rate_of(rates, 2), 0.5 / 2.0);
    EXPECT_DOUBLE_EQ(rate_of(rates, 1), 2.0);  // still alone on its cores
}

TEST(CpuForward, AdvanceAndRetimeFollowTheWorkLeft) {
    CpuForward f;
    f.cores = 4;
    f.work_core_s = 4;  // 1 s alone
    EXPECT_DOUBLE_EQ(f.retime(4, 0.0), 1.0);
    EXPECT_FALSE(f.slowed);
    f.advance(0.5);
    EXPECT_DOUBLE_EQ(f.work_core_s, 2);
    EXPECT_DOUBLE_EQ(f.retime(2, 0.5), 1.0);  // half speed: 2 core-s at 2 cores
    EXPECT_TRUE(f.slowed);
    f.advance(5.0);
    EXPECT_EQ(f.work_core_s, 0);  // never below zero
}

}  // namespace
}  // namespace pdsim::des
