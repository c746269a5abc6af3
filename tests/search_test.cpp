// Placement search (sim/des/search.h) and `pdsim search`: the candidate list for small budgets
// against hand-written lists and hand counts; TP sizes left out for memory; the topologies the
// candidates are built on; the ranking rule on hand-made rows; whole searches on tiny synthetic
// workloads checked against independent simulations; the command's output and its bad input
// (exit 2).
#include "sim/des/search.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sim/des/setup.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "topology/builders.h"

namespace pdsim::des {
namespace {

using json = nlohmann::json;
using test::CmdResult;
using test::run_pdsim;
using test::TempDir;

std::vector<std::string> names(const std::vector<Layout>& v) {
    std::vector<std::string> out;
    for (const auto& l : v) out.push_back(l.name());
    return out;
}

model::ModelConfig model_named(const std::string& name) {
    StatusOr<model::ModelConfig> m = load_model(name);
    EXPECT_OK(m);
    return *m;
}

TEST(SearchEnumerate, BudgetOfFourWithTp1And2IsTheHandWrittenList) {
    SearchSpace space;
    space.gpus = 4;
    const std::vector<int> tps = {1, 2};
    StatusOr<std::vector<Layout>> got = enumerate_layouts(tps, space);
    ASSERT_OK(got);
    // clang-format off
    const std::vector<std::string> want = {
        // (tp_p, tp_d) = (1, 1): P + D <= 4
        "1P(tp1)+1D(tp1)", "1P(tp1)+2D(tp1)", "1P(tp1)+3D(tp1)", "2P(tp1)+1D(tp1)",
        "2P(tp1)+2D(tp1)", "3P(tp1)+1D(tp1)",
        // (1, 2): P + 2D <= 4
        "1P(tp1)+1D(tp2)", "2P(tp1)+1D(tp2)",
        // (2, 1): 2P + D <= 4
        "1P(tp2)+1D(tp1)", "1P(tp2)+2D(tp1)",
        // (2, 2)
        "1P(tp2)+1D(tp2)",
        // colocated
        "1x colocated tp1", "2x colocated tp1", "3x colocated tp1", "4x colocated tp1",
        "1x colocated tp2", "2x colocated tp2"};
    // clang-format on
    EXPECT_EQ(names(*got), want);
    EXPECT_EQ((*got)[7], disagg_layout(2, 1, 1, 2));
    EXPECT_EQ((*got)[7].gpus(), 4);
    EXPECT_EQ((*got)[16], colocated_layout(2, 2));
    EXPECT_EQ((*got)[16].gpus(), 4);

    space.colocated = false;
    got = enumerate_layouts(tps, space);
    ASSERT_OK(got);
    EXPECT_EQ(got->size(), 11u);
    space.colocated = true;
    space.disagg = false;
    got = enumerate_layouts(tps, space);
    ASSERT_OK(got);
    EXPECT_EQ(names(*got), std::vector<std::string>(want.begin() + 11, want.end()));
}

TEST(SearchEnumerate, SixteenGpusWithTp248CountsByHandAndCapsWithAMessage) {
    SearchSpace space;
    space.gpus = 16;
    const std::vector<int> tps = {2, 4, 8};
    StatusOr<std::vector<Layout>> got = enumerate_layouts(tps, space);
    ASSERT_OK(got);
    // Disagg: (2,2) P+D<=8: 28; (2,4),(4,2): 12 each; (2,8),(8,2): 4 each; (4,4): 6;
    // (4,8),(8,4): 2 each; (8,8): 1 -> 71. Colocated: 8 + 4 + 2 = 14.
    EXPECT_EQ(got->size(), 85u);
    for (const auto& l : *got) EXPECT_LE(l.gpus(), 16) << l.name();

    // Using all 16: (2,2) P+D=8: 7; (2,4),(4,2): 3 each; (2,8),(8,2): 1 each; (4,4): 3;
    // (4,8),(8,4): 1 each; (8,8): 1; colocated: 3.
    space.min_gpus = 16;
    got = enumerate_layouts(tps, space);
    ASSERT_OK(got);
    EXPECT_EQ(got->size(), 24u);
    for (const auto& l : *got) EXPECT_EQ(l.gpus(), 16) << l.name();
    space.min_gpus = 17;
    EXPECT_FALSE(enumerate_layouts(tps, space).ok());
    space.min_gpus = 1;

    space.max_candidates = 84;
    got = enumerate_layouts(tps, space);
    ASSERT_FALSE(got.ok());
    EXPECT_THAT(got, StatusIs(StatusCode::kInvalidArgument, HasSubstr("--max-candidates 84")));
    EXPECT_THAT(got.status().message(), HasSubstr("85 candidates"));
}

TEST(SearchTp, SeventyBOnH100LeavesOutTp1ForMemory) {
    SearchSpace space;
    space.gpu = "H100";
    space.gpus = 16;
    std::vector<std::string> notes;
    // 70.6e9 bf16 parameters = 131 GiB > 80 GiB x 0.9 at tp 1.
    StatusOr<std::vector<int>> tps =
        allowed_tp_sizes(model_named("llama3-70b"), space, KvCapacityOptions{}, &notes);
    ASSERT_OK(tps);
    EXPECT_EQ(*tps, (std::vector<int>{2, 4, 8}));
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_THAT(notes[0], HasSubstr("tp 1"));

    space.gpus = 4;  // the budget bounds TP too; 8b fits at tp 1
    tps = allowed_tp_sizes(model_named("llama3-8b"), space, KvCapacityOptions{});
    ASSERT_OK(tps);
    EXPECT_EQ(*tps, (std::vector<int>{1, 2, 4}));

    space.tp_sizes = {3};
    tps = allowed_tp_sizes(model_named("llama3-8b"), space, KvCapacityOptions{});
    ASSERT_FALSE(tps.ok());
    EXPECT_THAT(tps.status().message(), HasSubstr("--tp 3"));

    space.tp_sizes = {};
    space.gpu = "TPUv9";
    EXPECT_FALSE(allowed_tp_sizes(model_named("llama3-8b"), space, KvCapacityOptions{}).ok());
}

TEST(SearchTopology, CandidatesArePlacedOnTheBudgetsNodes) {
    StatusOr<topo::Topology> t = layout_topology("H100", 16, disagg_layout(3, 2, 1, 4));
    ASSERT_OK(t);
    ASSERT_EQ(t->instances.size(), 4u);
    EXPECT_EQ(t->instances[2].devices.back(), "n0.gpu5");
    // The tp-4 decode instance does not fit in n0's last 2 GPUs: it starts on n1.
    EXPECT_EQ(t->instances[3].role, topo::Role::kDecode);
    EXPECT_EQ(t->instances[3].devices.front(), "n1.gpu0");

    t = layout_topology("H100", 16, colocated_layout(2, 8));
    ASSERT_OK(t);
    ASSERT_EQ(t->instances.size(), 2u);
    EXPECT_EQ(t->num_ranks(), 16);
    EXPECT_EQ(t->instances[1].devices.front(), "n1.gpu0");

    // tp 3 packs 2 per node: five instances need 3 nodes, more than a budget of 16 has.
    t = layout_topology("H100", 16, colocated_layout(5, 3));
    ASSERT_FALSE(t.ok());
    EXPECT_THAT(t.status().message(), HasSubstr("5x colocated tp3"));
    EXPECT_FALSE(layout_topology("H100", 8, disagg_layout(1, 8, 1, 8)).ok());

    t = layout_topology("GB200", 72, disagg_layout(8, 8, 1, 8));
    ASSERT_OK(t);
    EXPECT_EQ(t->num_ranks(), 72);
}

CandidateResult row(Layout l, bool ran, double attainment, double goodput, double target = 0.9) {
    CandidateResult r;
    r.layout = l;
    r.ran = ran;
    r.slo_attainment = attainment;
    r.goodput_rps = goodput;
    r.goodput_per_gpu = goodput / l.gpus();
    r.meets = ran && attainment >= target;
    if (!ran) r.error = "x";
    return r;
}

TEST(SearchRank, MeetingFirstByGoodputPerGpuThenTheRestByAttainmentThenNotRun) {
    std::vector<CandidateResult> v = {
        row(colocated_layout(1, 8), true, 0.95, 4.0),     // 0.5 / GPU, meets
        row(disagg_layout(1, 8, 1, 8), false, 0, 0),      // not run
        row(disagg_layout(1, 4, 1, 4), true, 0.92, 4.8),  // 0.6 / GPU, meets
        row(colocated_layout(2, 8), true, 0.80, 12.0),    // 0.75 / GPU, below the target
        row(disagg_layout(3, 4, 1, 4), true, 0.91, 8.0),  // 0.5 / GPU, meets, more GPUs
        row(colocated_layout(1, 4), true, 0.85, 1.0),     // below, higher attainment
        row(colocated_layout(4, 4), true, 0.90, 8.0),     // exactly the target: meets, 0.5
    };
    rank_candidates(&v);
    std::vector<std::string> got;
    for (const auto& r : v) got.push_back(r.layout.name());
    EXPECT_EQ(got, (std::vector<std::string>{"1P(tp4)+1D(tp4)",   // 0.6
                                             "1x colocated tp8",  // 0.5, attainment 0.95
                                             "3P(tp4)+1D(tp4)",   // 0.5, 0.91
                                             "4x colocated tp4",  // 0.5, 0.90
                                             "1x colocated tp4",  // not meeting: 0.85 before 0.80
                                             "2x colocated tp8", "1P(tp8)+1D(tp8)"}));
}

// An independent run of one layout: the builder called directly, no search code.
metrics::Report simulate_directly(const Layout& l, const model::ModelConfig& m,
                                  const std::vector<workload::Request>& reqs, metrics::Slo slo) {
    topo::ClusterOptions o;
    o.prefill = l.prefill;
    o.prefill_tp = l.prefill_tp;
    o.decode = l.mode == SimMode::kDisagg ? l.decode : 1;
    o.decode_tp = l.mode == SimMode::kDisagg ? l.decode_tp : l.prefill_tp;
    StatusOr<topo::Topology> t = topo::make_dgx("H100", 1, o);
    EXPECT_OK(t);
    if (l.mode == SimMode::kColocated) t->instances.pop_back();
    SimConfig c;
    c.topology = *t;
    c.model = m;
    c.mode = l.mode;
    c.slo = slo;
    StatusOr<std::vector<InstanceSetup>> s = make_instance_setups(*t, m, "roofline", nullptr, {});
    EXPECT_OK(s);
    c.instances = *s;
    StatusOr<SimResult> r = run_simulation(c, reqs);
    EXPECT_OK(r);
    return r->report;
}

std::vector<workload::Request> tiny_workload(double rate) {
    RequestSource src;
    src.synthetic.num_requests = 24;
    src.synthetic.rate_rps = rate;
    src.synthetic.input = {workload::LengthDist::Kind::kFixed, 8192, 0};
    src.synthetic.output = {workload::LengthDist::Kind::kFixed, 64, 0};
    src.synthetic.seed = 7;
    StatusOr<std::vector<workload::Request>> r = load_requests(src);
    EXPECT_OK(r);
    return *r;
}

SearchResult search_two_gpus(const std::vector<workload::Request>& reqs, metrics::Slo slo) {
    SearchOptions o;
    o.space.gpu = "H100";
    o.space.gpus = 2;
    o.space.tp_sizes = {1};
    o.base.model = model_named("llama3-8b");
    o.base.slo = slo;
    int64_t calls = 0;
    o.on_candidate = [&](const SearchProgress& p) {
        ++calls;
        EXPECT_EQ(p.index, calls);
        EXPECT_EQ(p.total, 3);
    };
    StatusOr<SearchResult> r = run_search(o, reqs);
    EXPECT_OK(r);
    EXPECT_EQ(calls, 3);
    return *r;
}

void expect_rows_match_direct_runs(const SearchResult& res,
                                   const std::vector<workload::Request>& reqs, metrics::Slo slo) {
    const model::ModelConfig m = model_named("llama3-8b");
    for (const auto& r : res.ranked) {
        ASSERT_TRUE(r.ran) << r.layout.name() << ": " << r.error;
        const metrics::Report rep = simulate_directly(r.layout, m, reqs, slo);
        EXPECT_DOUBLE_EQ(r.goodput_rps, rep.goodput_rps) << r.layout.name();
        EXPECT_DOUBLE_EQ(r.slo_attainment, rep.slo_attainment) << r.layout.name();
        EXPECT_DOUBLE_EQ(r.tpot_ms.p90, rep.tpot_ms.p90) << r.layout.name();
        EXPECT_DOUBLE_EQ(r.goodput_per_gpu, rep.goodput_rps / r.layout.gpus());
    }
}

// 8k-token prompts every ~100 ms on llama3-8b, tp 1: a prefill takes ~0.3 s of roofline compute,
// so on a colocated instance decode forwards keep waiting behind 2048-token extend forwards
// (~70 ms each) while a 1P1D split decodes in ~6 ms steps. A 25 ms TPOT SLO separates them.
TEST(SearchRun, TightTpotRanksTheSplitFirst) {
    const auto reqs = tiny_workload(10);
    const metrics::Slo slo{10000, 25};
    const SearchResult res = search_two_gpus(reqs, slo);
    ASSERT_EQ(res.ranked.size(), 3u);
    EXPECT_EQ(res.ranked[0].layout, disagg_layout(1, 1, 1, 1));
    EXPECT_TRUE(res.ranked[0].meets);
    EXPECT_LT(res.ranked[0].tpot_ms.p90, 25);
    for (size_t i = 1; i < 3; ++i) {
        EXPECT_EQ(res.ranked[i].layout.mode, SimMode::kColocated);
        EXPECT_FALSE(res.ranked[i].meets);
        EXPECT_GT(res.ranked[i].tpot_ms.p90, 25);
    }
    EXPECT_GE(res.ranked[1].slo_attainment, res.ranked[2].slo_attainment);
    expect_rows_match_direct_runs(res, reqs, slo);
}

// Sparse arrivals (one every 2 s, each done in < 1 s) and loose SLOs: everything meets, goodput
// is about the arrival rate everywhere, so the one-GPU layout has twice the goodput per GPU.
TEST(SearchRun, LightLoadRanksTheFewestGpusFirst) {
    const auto reqs = tiny_workload(0.5);
    const metrics::Slo slo{5000, 200};
    const SearchResult res = search_two_gpus(reqs, slo);
    ASSERT_EQ(res.ranked.size(), 3u);
    for (const auto& r : res.ranked) EXPECT_TRUE(r.meets) << r.layout.name();
    EXPECT_EQ(res.ranked[0].layout, colocated_layout(1, 1));
    EXPECT_GT(res.ranked[0].goodput_per_gpu, 1.8 * res.ranked[1].goodput_per_gpu);
    expect_rows_match_direct_runs(res, reqs, slo);
}

// ---- the command ----

const std::vector<std::string> kSmall = {
    "search",     "--gpu",         "H100",     "--gpus", "2",  "--model",
    "llama3-8b",  "--synthetic",   "24",       "--rate", "10", "--input-len",
    "fixed:8192", "--output-len",  "fixed:64", "--seed", "7",  "--slo-ttft-ms",
    "10000",      "--slo-tpot-ms", "25"};

TEST(SearchCli, PrintsTheRankedTableAndWritesEveryRow) {
    TempDir dir("search");
    std::vector<std::string> args = kSmall;
    args.insert(args.end(), {"--tp", "1", "--json", dir.str("s.json")});
    CmdResult r = run_pdsim(args, 120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("rank"));
    EXPECT_THAT(r.out, HasSubstr("1P(tp1)+1D(tp1)"));
    EXPECT_THAT(r.out, HasSubstr("best colocated"));
    const json j = json::parse(test::slurp(dir.path() / "s.json"));
    ASSERT_EQ(j["rows"].size(), 3u);
    EXPECT_EQ(j["candidates"], 3);
    EXPECT_EQ(j["rows"][0]["layout"], "1P(tp1)+1D(tp1)");
    EXPECT_EQ(j["rows"][0]["rank"], 1);
    EXPECT_TRUE(j["rows"][0]["meets_target"].get<bool>());
    for (const char* k : {"goodput_rps", "goodput_per_gpu", "slo_attainment", "ttft_ms", "tpot_ms",
                          "gpus", "mode"}) {
        EXPECT_TRUE(j["rows"][0].contains(k)) << k;
    }
    EXPECT_EQ(j["meeting_target"], 1);
}

TEST(SearchCli, TopologyGivesTheGpuTypeCountAndModel) {
    TempDir dir("search_topo");
    CmdResult r = run_pdsim(
        {"search",
         "--topology",
         std::string(PDSIM_SOURCE_DIR) + "/topology/examples/dgx-h100-2node-1p1d-tp8.yaml",
         "--synthetic",
         "10",
         "--rate",
         "1",
         "--input-len",
         "fixed:1024",
         "--output-len",
         "fixed:8",
         "--slo-ttft-ms",
         "2000",
         "--slo-tpot-ms",
         "100",
         "--tp",
         "8",
         "--modes",
         "colocated",
         "--json",
         dir.str("s.json"),
         "--quiet"},
        120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    const json j = json::parse(test::slurp(dir.path() / "s.json"));
    EXPECT_EQ(j["gpu"], "H100");
    EXPECT_EQ(j["gpus"], 16);
    EXPECT_EQ(j["model"], "llama3-70b");
    ASSERT_EQ(j["rows"].size(), 2u);  // 1x and 2x colocated tp8
}

TEST(SearchCli, BadInputExits2NamingTheFlag) {
    struct Case {
        std::vector<std::string> extra;
        std::string needle;
    };
    const std::vector<Case> cases = {
        {{"--attainment", "1.5"}, "--attainment"},
        {{"--modes", "split"}, "--modes"},
        {{"--gpu", "TPUv9"}, "--gpu"},
        {{"--tp", "3"}, "--tp 3"},
        {{"--tp", "two"}, "--tp"},
        {{"--max-candidates", "2"}, "--max-candidates"},
        {{"--input-len", "normal:5"}, "--input-len"},
        {{"--max-requests", "5"}, "--max-requests"},
        {{"--min-gpus", "3"}, "--min-gpus"},
        {{"--bogus-flag"}, "bogus"},
    };
    for (const auto& c : cases) {
        std::vector<std::string> args = kSmall;
        args.insert(args.end(), c.extra.begin(), c.extra.end());
        CmdResult r = run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 2) << c.needle << "\n" << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.needle)) << r.describe();
    }
    CmdResult r = run_pdsim({"search", "--gpus", "2", "--model", "llama3-8b", "--slo-ttft-ms",
                             "1000", "--slo-tpot-ms", "50"},
                            60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--trace F or --synthetic N")) << r.describe();
}

}  // namespace
}  // namespace pdsim::des
