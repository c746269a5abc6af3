#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "tests/status_matchers.h"

namespace pdsim::metrics {
namespace {

TEST(Percentiles, MatchNumpyLinearInterpolation) {
    // numpy.percentile([1..10], [50, 90, 99]) = 5.5, 9.1, 9.91
    std::vector<double> v{10, 1, 9, 2, 8, 3, 7, 4, 6, 5};
    Percentiles p = percentiles(v);
    EXPECT_DOUBLE_EQ(p.mean, 5.5);
    EXPECT_DOUBLE_EQ(p.p50, 5.5);
    EXPECT_NEAR(p.p90, 9.1, 1e-12);
    EXPECT_NEAR(p.p99, 9.91, 1e-12);
    EXPECT_EQ(p.count, 10);
    Percentiles one = percentiles({4.0});
    EXPECT_EQ(one.p99, 4.0);
    EXPECT_EQ(percentiles({}).count, 0);
}

std::vector<RequestRecord> sample_records() {
    std::vector<RequestRecord> r(4);
    // id, arrival, first token, finish, generated
    auto set = [](RequestRecord& q, int64_t id, double a, double f, double e, int g, bool ok) {
        q.id = id;
        q.arrival_ms = a;
        q.first_token_ms = f;
        q.finish_ms = e;
        q.generated = g;
        q.output_len = g;
        q.ok = ok;
    };
    set(r[0], 0, 0, 100, 1100, 11, true);      // ttft 100, tpot 100
    set(r[1], 1, 500, 800, 800, 1, true);      // ttft 300, single token
    set(r[2], 2, 1000, 1050, 2050, 21, true);  // ttft 50, tpot 50
    set(r[3], 3, 1500, -1, -1, 0, false);
    r[3].error = "transfer timed out";
    return r;
}

TEST(Summarize, CountsLatenciesSloAndGoodput) {
    Report rep;
    summarize_requests(sample_records(), Slo{.ttft_ms = 200, .tpot_ms = 80}, &rep);
    EXPECT_EQ(rep.requests_submitted, 4);
    EXPECT_EQ(rep.requests_completed, 3);
    EXPECT_EQ(rep.requests_failed, 1);
    EXPECT_EQ(rep.requests_completed + rep.requests_failed, rep.requests_submitted);
    EXPECT_DOUBLE_EQ(rep.ttft_ms.p50, 100);
    EXPECT_DOUBLE_EQ(rep.tpot_ms.mean, 75);  // (100 + 50) / 2; the single-token request has none
    EXPECT_EQ(rep.tpot_ms.count, 2);
    // Attained: r2 only (r0 tpot 100 > 80; r1 ttft 300 > 200).
    EXPECT_DOUBLE_EQ(rep.slo_attainment, 0.25);
    EXPECT_NEAR(rep.goodput_rps, 1 / 2.05, 1e-12);  // makespan 0 .. 2050 ms
    ASSERT_EQ(rep.failures.size(), 1u);
    EXPECT_THAT(rep.failures[0], HasSubstr("transfer timed out"));
}

// The wait before compute: arrival -> first prefill chunk, over the requests whose start is
// known (failed ones included: a request that waited and then timed out waited all the same).
TEST(Summarize, PrefillWaitIsArrivalToFirstChunkWhereKnown) {
    std::vector<RequestRecord> r = sample_records();
    r[0].prefill_start_ms = 40;    // waited 40
    r[1].prefill_start_ms = 760;   // waited 260
    r[3].prefill_start_ms = 1510;  // failed later; waited 10
    // r[2]'s start is unknown: left out, not counted as 0.
    EXPECT_FALSE(r[2].prefill_wait_ms().has_value());
    ASSERT_TRUE(r[1].prefill_wait_ms().has_value());
    EXPECT_DOUBLE_EQ(*r[1].prefill_wait_ms(), 260);
    Report rep;
    summarize_requests(r, Slo{}, &rep);
    EXPECT_EQ(rep.prefill_wait_ms.count, 3);
    EXPECT_DOUBLE_EQ(rep.prefill_wait_ms.p50, 40);
    EXPECT_DOUBLE_EQ(rep.prefill_wait_ms.mean, 310.0 / 3);
    EXPECT_DOUBLE_EQ(to_json(rep)["prefill_wait_ms"]["p50"].get<double>(), 40);
    EXPECT_THAT(summary_table(rep), HasSubstr("wait for prefill ms p50/p90"));
    Report none;
    summarize_requests(sample_records(), Slo{}, &none);
    EXPECT_EQ(none.prefill_wait_ms.count, 0);
    EXPECT_THAT(summary_table(none), ::testing::Not(HasSubstr("wait for prefill")));
}

TEST(ReportJson, HasTheDesignKeys) {
    Report rep;
    rep.mode = "disagg";
    summarize_requests(sample_records(), Slo{}, &rep);
    rep.outputs_match = true;
    rep.colocated = std::make_shared<Report>(rep);
    rep.colocated->mode = "colocated";
    auto j = to_json(rep);
    for (const char* k : {"schema_version", "mode", "topology", "model", "requests_submitted",
                          "requests_completed", "requests_failed", "ttft_ms", "tpot_ms", "e2e_ms",
                          "queue_ms", "prefill_wait_ms", "goodput_rps", "slo_attainment",
                          "transfer", "ordering", "outputs_match", "wall_s", "colocated"}) {
        EXPECT_TRUE(j.contains(k)) << k;
    }
    for (const char* k : {"mean", "p50", "p90", "p99"}) EXPECT_TRUE(j["ttft_ms"].contains(k)) << k;
    for (const char* k : {"bytes", "gbps", "layer_latency_us", "exposed_fraction"})
        EXPECT_TRUE(j["transfer"].contains(k)) << k;
    for (const char* k : {"checked_layers", "violations", "details"})
        EXPECT_TRUE(j["ordering"].contains(k)) << k;
    EXPECT_EQ(j["colocated"]["mode"], "colocated");
    EXPECT_FALSE(j["colocated"].contains("colocated"));
    EXPECT_THAT(summary_table(rep), HasSubstr("requests failed"));
}

TEST(RequestsCsv, OneLinePerRequest) {
    auto path = (std::filesystem::temp_directory_path() / "pdsim_requests.csv").string();
    std::vector<RequestRecord> records = sample_records();
    records[0].queue_ms = 5;
    records[0].prefill_start_ms = 40;
    ASSERT_OK(write_requests_csv(path, records));
    std::ifstream f(path);
    std::string line;
    int n = 0;
    std::getline(f, line);
    EXPECT_EQ(line.rfind("id,arrival_ms,ttft_ms", 0), 0u);
    EXPECT_THAT(line, HasSubstr(",queue_ms,prefill_wait_ms,error"));
    std::getline(f, line);
    EXPECT_THAT(line, HasSubstr(",5.000,40.000,\"\""));  // queue 5, waited 40, no error
    ++n;
    std::getline(f, line);
    EXPECT_THAT(line, HasSubstr(",,,\"\""));  // neither measured
    ++n;
    while (std::getline(f, line)) ++n;
    EXPECT_EQ(n, 4);
    EXPECT_EQ(write_requests_csv("/nonexistent/dir/x.csv", {}).code(),
              StatusCode::kInvalidArgument);
}

TEST(Timeline, WritesTraceEvents) {
    Timeline t;
    t.name_process(0, "rank 0 prefill");
    t.add_slice(0, 1, "layer 3", "compute", 10.0, 5.0, {{"request", 7}});
    t.add_instant(0, 1, "record", "record", 15.0);
    auto path = (std::filesystem::temp_directory_path() / "pdsim_timeline.json").string();
    ASSERT_OK(t.write(path));
    std::ifstream f(path);
    auto j = nlohmann::json::parse(f);
    ASSERT_EQ(j["traceEvents"].size(), 3u);
    EXPECT_EQ(j["traceEvents"][1]["ph"], "X");
    EXPECT_EQ(j["traceEvents"][1]["dur"], 5.0);
}

}  // namespace
}  // namespace pdsim::metrics
