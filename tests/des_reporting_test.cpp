// Reporting (sim/des/reporting.h): the transfer figures and summary, the timeline's sampling and
// the report's keys, against values worked out by hand.
#include <gtest/gtest.h>

#include <vector>

#include "common/check.h"
#include "sim/des/reporting.h"
#include "tests/test_topologies.h"

namespace pdsim::des {
namespace {

using pdsim::test::cpu_1p1d_topology;

TEST(KvTransferFigures, LayerwiseAndNot) {
    // Flow from 4 s, forward [3, 8), done at 10, route latency 0.5, 4 layers.
    const KvTransferFigures lw = kv_transfer_figures(10, 4, 3, 8, 0.5, 4, true);
    EXPECT_DOUBLE_EQ(lw.exposed_s, 2);
    EXPECT_DOUBLE_EQ(lw.transfer_s, 6);
    // tail 10 - 0.5 - 8 = 1.5; 0.5 + 1.5 x 5 / 8
    EXPECT_DOUBLE_EQ(lw.layer_latency_s, 1.4375);
    // Without layerwise a layer also waits for the rest of the forward: + 5 x 3 / 8.
    const KvTransferFigures whole = kv_transfer_figures(10, 4, 3, 8, 0.5, 4, false);
    EXPECT_DOUBLE_EQ(whole.layer_latency_s, 1.4375 + 1.875);
    // Done before the forward ended (cannot be exposed), and no flow at all.
    const KvTransferFigures early = kv_transfer_figures(7, -1, 3, 8, 0.5, 4, true);
    EXPECT_EQ(early.exposed_s, 0);
    EXPECT_EQ(early.transfer_s, 0);
    EXPECT_DOUBLE_EQ(early.layer_latency_s, 0.5);
}

TEST(TransferSummary, BusyTimeIsTheUnionOfActiveFlows) {
    TransferSummary s;
    s.flow_started(0);
    s.flow_started(1);
    s.flow_done(2);
    s.flow_done(3);  // [0, 3)
    s.flow_started(5);
    s.flow_done(6);  // [5, 6): busy 4 s
    s.add_request(6e9,
                  KvTransferFigures{.exposed_s = 1, .transfer_s = 4, .layer_latency_s = 0.001});
    s.add_request(2e9,
                  KvTransferFigures{.exposed_s = 0, .transfer_s = 4, .layer_latency_s = 0.003});
    metrics::TransferSummary out;
    s.fill(&out);
    EXPECT_EQ(out.bytes, 8000000000);
    EXPECT_DOUBLE_EQ(out.gbps, 2);
    EXPECT_DOUBLE_EQ(out.exposed_fraction, 1.0 / 8);
    EXPECT_DOUBLE_EQ(out.layer_latency_us.p50, 2000);
    EXPECT_DOUBLE_EQ(out.layer_latency_us.p99, 2980);
}

SimConfig config_with(metrics::Timeline* timeline) {
    SimConfig c;
    c.topology = cpu_1p1d_topology();
    c.topology_label = "label";
    c.model = *model::resolve_model("tiny");
    c.timeline = timeline;
    c.timeline_pid_base = 10;
    c.timeline_sample = 2;
    c.timeline_max_forwards = 2;
    return c;
}

metrics::RequestRecord record(int64_t id, bool ok) {
    metrics::RequestRecord r;
    r.id = id;
    r.arrival_ms = 1;
    r.first_token_ms = 3;
    r.finish_ms = 9;
    r.input_len = 10;
    r.output_len = 4;
    r.generated = ok ? 4 : 0;
    r.ok = ok;
    if (!ok) r.error = "too long";
    return r;
}

TEST(SimTimeline, SamplesRequestsAndCapsForwards) {
    metrics::Timeline timeline;
    const SimConfig c = config_with(&timeline);
    SimTimeline tl(c);
    ASSERT_TRUE(tl.enabled());
    const InstanceRole roles[] = {InstanceRole::kPrefill, InstanceRole::kDecode};
    tl.name_tracks(c.topology, c.mode, roles);
    const size_t named = timeline.size();
    tl.request(0, record(5, true));   // sampled: two slices
    tl.request(1, record(6, true));   // not sampled
    tl.request(2, record(7, false));  // sampled: an instant
    EXPECT_EQ(timeline.size(), named + 3);
    for (int i = 0; i < 5; ++i) tl.forward(1, false, i, 0.5, 3, 0);
    EXPECT_EQ(timeline.size(), named + 5);                       // timeline_max_forwards = 2
    tl.transfer(3, 0, record(8, true), 1, KvTransferFigures{});  // not sampled
    tl.transfer(4, 0, record(9, true), 1, KvTransferFigures{});
    EXPECT_EQ(timeline.size(), named + 6);
    int on_requests_pid = 0, kv = 0;
    for (const auto& e : timeline.events()) {
        if (e.value("ph", "") == "M") continue;
        if (e.value("pid", -1) == 12) ++on_requests_pid;  // base + 2 instances
        if (e.value("name", "") == "kv r9") {
            ++kv;
            EXPECT_EQ(e.value("pid", -1), 10);
            EXPECT_EQ(e.value("tid", -1), 1);
        }
    }
    EXPECT_EQ(on_requests_pid, 3);
    EXPECT_EQ(kv, 1);
}

TEST(SimTimeline, WithoutATimelineNothingIsWritten) {
    const SimConfig c = config_with(nullptr);
    SimTimeline tl(c);
    EXPECT_FALSE(tl.enabled());
    tl.request(0, record(1, true));
    tl.forward(0, true, 0, 1, 1, 1);
}

TEST(BuildReport, KeysFromTheRunsFigures) {
    const SimConfig c = config_with(nullptr);
    std::vector<metrics::RequestRecord> records = {record(1, true), record(2, false)};
    records[0].finish_ms = 2500;
    SimStats stats;
    stats.events = 40;
    stats.wall_s = 2;
    stats.preemptions = 3;
    TransferSummary transfer;
    const InstanceSummary instances[] = {
        {"p0", "model a", 100, 1, 2}, {"d0", "model b", 200, 0, 0}, {"d1", "model a", 300, 0, 0}};
    const double contended[] = {8.0};
    const metrics::Report rep =
        build_report(c, records, stats, transfer, instances, contended, true);
    EXPECT_EQ(rep.mode, "disagg");
    EXPECT_EQ(rep.topology, "label");
    EXPECT_EQ(rep.model, "tiny");
    EXPECT_EQ(rep.requests_submitted, 2);
    EXPECT_EQ(rep.requests_completed, 1);
    EXPECT_EQ(rep.requests_failed, 1);
    EXPECT_DOUBLE_EQ(rep.wall_s, 2.5);
    const auto& sim = rep.extra.at("simulator");
    EXPECT_EQ(sim.at("cost_model"), "model a; model b");
    EXPECT_EQ(sim.at("events"), 40);
    EXPECT_EQ(sim.at("preemptions"), 3);
    EXPECT_DOUBLE_EQ(sim.at("requests_per_wall_s").get<double>(), 1.0);
    EXPECT_DOUBLE_EQ(sim.at("events_per_wall_s").get<double>(), 20.0);
    ASSERT_EQ(sim.at("instances").size(), 3u);
    EXPECT_EQ(sim.at("instances")[0].at("instance"), "p0");
    EXPECT_EQ(sim.at("instances")[0].at("cached_blocks"), 2);
    EXPECT_EQ(sim.at("instances")[2].at("kv_pages"), 300);
    const auto& config = rep.extra.at("config");
    EXPECT_EQ(config.at("cost_noise"), true);
    EXPECT_EQ(config.at("kv_admission"), "prompt");
    EXPECT_EQ(config.at("contended_node_cores"), nlohmann::json::array({8.0}));
    EXPECT_EQ(config.at("page_size"), 16);
}

}  // namespace
}  // namespace pdsim::des
