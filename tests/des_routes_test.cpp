// Routes (sim/des/routes.h): the TP rank pairs of a KV transfer and the lanes, bundling and
// FlowNetwork links built from small topologies, all worked out by hand.
#include <gtest/gtest.h>

#include <string>

#include "common/check.h"
#include "sim/des/routes.h"
#include "tests/status_matchers.h"
#include "topology/loader.h"

namespace pdsim::des {
namespace {

topo::Topology parse(const std::string& yaml) {
    StatusOr<topo::Topology> t = topo::parse_topology(yaml, "<test>", topo::Format::kYaml);
    PDSIM_CHECK_OK(t.status());
    return *t;
}

// Cpu devices n0.cpu0..n0.cpu{count-1} behind one loopback switch (10 GB/s, 1 us per link).
std::string one_node(int count, const std::string& instances) {
    std::string yaml = "name: one\nmodel: tiny\nnodes:\n  - id: n0\n    devices:\n";
    for (int i = 0; i < count; ++i) {
        yaml += "      - {id: n0.cpu" + std::to_string(i) + ", type: cpu}\n";
    }
    yaml += "    switches:\n      - {id: n0.shm, type: loopback}\nlinks:\n";
    for (int i = 0; i < count; ++i) {
        yaml += "  - {a: n0.cpu" + std::to_string(i) +
                ", b: n0.shm, type: loopback, gbps: 10, latency_us: 1}\n";
    }
    return yaml + "instances:\n" + instances;
}

model::ModelConfig tiny() {
    return *model::resolve_model("tiny");
}  // 4 KV heads

TEST(KvRankPairs, HeadOverlapsOfMhaGroups) {
    const auto same = kv_rank_pairs(tiny(), 1, 1);
    ASSERT_EQ(same.size(), 1u);
    EXPECT_EQ(same[0].share, 1.0);

    const auto two_to_one = kv_rank_pairs(tiny(), 2, 1);
    ASSERT_EQ(two_to_one.size(), 2u);
    EXPECT_EQ(two_to_one[0].prefill_rank, 0);
    EXPECT_EQ(two_to_one[1].prefill_rank, 1);
    EXPECT_EQ(two_to_one[1].decode_rank, 0);
    EXPECT_DOUBLE_EQ(two_to_one[0].share, 0.5);
    EXPECT_DOUBLE_EQ(two_to_one[1].share, 0.5);

    // 4 heads, tp2 -> tp3: ranks hold [0,2) [2,4) -> [0,4/3) [4/3,8/3) [8/3,4).
    const auto two_to_three = kv_rank_pairs(tiny(), 2, 3);
    ASSERT_EQ(two_to_three.size(), 4u);
    const double expected[4][3] = {
        {0, 0, 1.0 / 3}, {0, 1, 1.0 / 6}, {1, 1, 1.0 / 6}, {1, 2, 1.0 / 3}};
    for (size_t k = 0; k < 4; ++k) {
        EXPECT_EQ(two_to_three[k].prefill_rank, expected[k][0]) << k;
        EXPECT_EQ(two_to_three[k].decode_rank, expected[k][1]) << k;
        EXPECT_NEAR(two_to_three[k].share, expected[k][2], 1e-12) << k;
    }
}

TEST(KvRankPairs, MlaSendsRankZerosLatentToEveryDecodeRank) {
    const model::ModelConfig ds = *model::resolve_model("deepseek-v3");
    const auto pairs = kv_rank_pairs(ds, 4, 3);
    ASSERT_EQ(pairs.size(), 3u);
    for (int j = 0; j < 3; ++j) {
        EXPECT_EQ(pairs[static_cast<size_t>(j)].prefill_rank, 0);
        EXPECT_EQ(pairs[static_cast<size_t>(j)].decode_rank, j);
        EXPECT_EQ(pairs[static_cast<size_t>(j)].share, 1.0);
    }
}

TEST(RouteTable, OnePairIsOneLaneOverOneGroupedLink) {
    EventLoop loop;
    FlowNetwork net(loop);
    const topo::Topology t =
        parse(one_node(2,
                       "  - {id: p, role: prefill, tp: 1, devices: [n0.cpu0]}\n"
                       "  - {id: d, role: decode, tp: 1, devices: [n0.cpu1]}\n"));
    StatusOr<RouteTable> table = RouteTable::build(t, tiny(), net, "one");
    ASSERT_OK(table);
    EXPECT_TRUE(table->bundled());
    const Route& r = table->route(0, 1);
    ASSERT_EQ(r.lanes.size(), 1u);
    EXPECT_EQ(r.total_share, 1.0);
    EXPECT_NEAR(r.latency_s, 2e-6, 1e-15);
    // Both links carry the same flows: one network link of their smaller capacity.
    ASSERT_EQ(net.num_links(), 1u);
    ASSERT_EQ(r.lanes[0].path.size(), 1u);
    EXPECT_EQ(net.link_capacity(r.lanes[0].path[0]), 10e9);
    EXPECT_TRUE(table->route(1, 0).lanes.empty());
    EXPECT_TRUE(table->route(0, 0).lanes.empty());
}

TEST(RouteTable, SymmetricTpLanesAreBundledWithCapacitiesPerShare) {
    EventLoop loop;
    FlowNetwork net(loop);
    const topo::Topology t =
        parse(one_node(3,
                       "  - {id: p, role: prefill, tp: 2, devices: [n0.cpu0, n0.cpu1]}\n"
                       "  - {id: d, role: decode, tp: 1, devices: [n0.cpu2]}\n"));
    StatusOr<RouteTable> table = RouteTable::build(t, tiny(), net, "one");
    ASSERT_OK(table);
    EXPECT_TRUE(table->bundled());
    const Route& r = table->route(0, 1);
    ASSERT_EQ(r.lanes.size(), 1u);  // both rank pairs as one flow
    EXPECT_DOUBLE_EQ(r.lanes[0].share, 1.0);
    // The prefill links carry half a chunk each (10 GB/s per half: 20 per chunk), the decode's
    // link all of it (10): the bundled flow's link is the smallest, 10 GB/s.
    ASSERT_EQ(net.num_links(), 1u);
    EXPECT_DOUBLE_EQ(net.link_capacity(r.lanes[0].path[0]), 10e9);
}

TEST(RouteTable, UnequalSharesOnACommonLinkKeepOneFlowPerLane) {
    // MLA: a tp1 -> tp2 route moves 2 latents over the link between the switches, a tp1 -> tp1
    // route one.
    const std::string yaml = R"(name: two
model: tiny
nodes:
  - id: n0
    devices:
      - {id: n0.cpu0, type: cpu}
      - {id: n0.cpu1, type: cpu}
      - {id: n0.cpu2, type: cpu}
      - {id: n0.cpu3, type: cpu}
    switches:
      - {id: n0.shm, type: loopback}
      - {id: n0.shm2, type: loopback}
links:
  - {a: n0.cpu0, b: n0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu1, b: n0.shm2, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu2, b: n0.shm2, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.cpu3, b: n0.shm2, type: loopback, gbps: 10, latency_us: 1}
  - {a: n0.shm, b: n0.shm2, type: loopback, gbps: 5, latency_us: 3}
instances:
  - {id: p, role: prefill, tp: 1, devices: [n0.cpu0]}
  - {id: d1, role: decode, tp: 1, devices: [n0.cpu1]}
  - {id: d2, role: decode, tp: 2, devices: [n0.cpu2, n0.cpu3]}
)";
    EventLoop loop;
    FlowNetwork net(loop);
    const topo::Topology t = parse(yaml);
    StatusOr<RouteTable> table =
        RouteTable::build(t, *model::resolve_model("deepseek-v3"), net, "two");
    ASSERT_OK(table);
    EXPECT_FALSE(table->bundled());
    const Route& to_d1 = table->route(0, 1);
    const Route& to_d2 = table->route(0, 2);
    ASSERT_EQ(to_d1.lanes.size(), 1u);
    ASSERT_EQ(to_d2.lanes.size(), 2u);
    EXPECT_EQ(to_d2.total_share, 2.0);
    EXPECT_EQ(to_d2.lanes[0].share, 1.0);
    EXPECT_NEAR(to_d2.latency_s, 5e-6, 1e-15);
    // Groups of resources by the lanes crossing them: {all three} (p's link and the link between
    // the switches: 5 GB/s), {d1's lane} (10), {each d2 lane} (10 each).
    EXPECT_EQ(net.num_links(), 4u);
    double shared_capacity = 0;
    for (const Lane& lane : to_d2.lanes) {
        ASSERT_EQ(lane.path.size(), 2u);
        for (FlowNetwork::LinkId link : lane.path) {
            if (link == to_d1.lanes[0].path[0] || link == to_d1.lanes[0].path[1]) {
                shared_capacity = net.link_capacity(link);
            }
        }
    }
    EXPECT_EQ(shared_capacity, 5e9);
}

}  // namespace
}  // namespace pdsim::des
