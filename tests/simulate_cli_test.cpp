// `pdsim simulate` and `pdsim bench simulate` as processes: a small run writes the report (the
// testbed's keys, both modes), the per-request CSV and the timeline; bad input exits 2 naming the
// flag or file.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/speed_probe.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::test {
namespace {

using json = nlohmann::json;

const std::string kDgx =
    std::string(PDSIM_SOURCE_DIR) + "/topology/examples/dgx-h100-2node-1p1d-tp8.yaml";
const std::string kCpu = std::string(PDSIM_SOURCE_DIR) + "/topology/examples/cpu-1p1d.yaml";

// 40 Mooncake-format requests, 100 ms apart, sharing a first prefix block.
std::string write_trace(const TempDir& dir) {
    const std::string path = dir.str("trace.jsonl");
    std::ofstream f(path);
    for (int i = 0; i < 40; ++i) {
        const int in = 600 + 97 * i;
        f << "{\"timestamp\": " << i * 100 << ", \"input_length\": " << in
          << ", \"output_length\": " << 5 + i % 7 << ", \"hash_ids\": [0";
        for (int b = 1; b < (in + 511) / 512; ++b) f << ", " << 1000 * i + b;
        f << "]}\n";
    }
    return path;
}

void expect_report_keys(const json& r) {
    for (const char* k : {"schema_version", "mode", "topology", "model", "requests_submitted",
                          "requests_completed", "requests_failed", "ttft_ms", "tpot_ms", "e2e_ms",
                          "goodput_rps", "slo_attainment", "transfer", "ordering", "wall_s"}) {
        EXPECT_TRUE(r.contains(k)) << k;
    }
    for (const char* k : {"ttft_ms", "tpot_ms", "e2e_ms"}) {
        for (const char* p : {"mean", "p50", "p90", "p99"}) EXPECT_TRUE(r[k].contains(p)) << k << p;
    }
    for (const char* k : {"bytes", "gbps", "layer_latency_us", "exposed_fraction"}) {
        EXPECT_TRUE(r["transfer"].contains(k)) << k;
    }
    for (const char* k : {"events", "wall_s", "requests_per_wall_s", "cost_model"}) {
        EXPECT_TRUE(r["simulator"].contains(k)) << k;
    }
}

TEST(SimulateCli, SmallRunWritesReportCsvAndTimeline) {
    TempDir dir("simulate");
    const std::string trace = write_trace(dir);
    CmdResult r = run_pdsim(
        {"simulate", "--topology", kDgx, "--trace", trace, "--mode", "both", "--slo-ttft-ms",
         "2000", "--slo-tpot-ms", "50", "--report", dir.str("report.json"), "--requests",
         dir.str("requests.csv"), "--timeline", dir.str("timeline.json"), "--progress"},
        120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("TTFT ms"));
    const json rep = json::parse(slurp(dir.path() / "report.json"));
    expect_report_keys(rep);
    EXPECT_EQ(rep["mode"], "disagg");
    EXPECT_EQ(rep["model"], "llama3-70b");
    EXPECT_EQ(rep["requests_submitted"], 40);
    EXPECT_EQ(rep["requests_completed"], 40);
    EXPECT_GT(rep["transfer"]["bytes"].get<double>(), 0);
    EXPECT_THAT(rep["simulator"]["cost_model"].get<std::string>(), HasSubstr("roofline"));
    ASSERT_TRUE(rep.contains("colocated"));
    expect_report_keys(rep["colocated"]);
    EXPECT_EQ(rep["colocated"]["mode"], "colocated");
    EXPECT_EQ(rep["colocated"]["requests_completed"], 40);

    std::istringstream csv(slurp(dir.path() / "requests.csv"));
    std::string line;
    std::vector<std::string> lines;
    while (std::getline(csv, line)) lines.push_back(line);
    ASSERT_EQ(lines.size(), 41u);
    EXPECT_EQ(lines[0].rfind("id,arrival_ms,ttft_ms,tpot_ms,e2e_ms", 0), 0u) << lines[0];

    const json tl = json::parse(slurp(dir.path() / "timeline.json"));
    ASSERT_TRUE(tl.contains("traceEvents"));
    int forwards = 0;
    for (const auto& e : tl["traceEvents"]) forwards += e.value("cat", "") == "forward";
    EXPECT_GT(forwards, 0);
}

// A single colocated instance (the usual baseline) simulates by default (--mode auto picks what
// the topology describes); disagg on it is refused, naming the topology and the way out.
TEST(SimulateCli, SingleColocatedInstanceSimulatesByDefault) {
    TempDir dir("simulate_1c");
    const std::string trace = write_trace(dir);
    const std::string one = std::string(PDSIM_SOURCE_DIR) + "/topology/examples/gpu-1c.yaml";
    CmdResult r = run_pdsim(
        {"simulate", "--topology", one, "--trace", trace, "--report", dir.str("r.json")}, 120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    const json rep = json::parse(slurp(dir.path() / "r.json"));
    expect_report_keys(rep);
    EXPECT_EQ(rep["mode"], "colocated");
    EXPECT_EQ(rep["requests_completed"], 40);
    EXPECT_FALSE(rep.contains("colocated")) << "one mode ran";
    EXPECT_EQ(rep["transfer"]["bytes"].get<double>(), 0.0);

    CmdResult d = run_pdsim({"simulate", "--topology", one, "--trace", trace, "--mode", "disagg"});
    EXPECT_EQ(d.rc, 2) << d.describe();
    EXPECT_THAT(d.err, HasSubstr("gpu-1c.yaml"));
    EXPECT_THAT(d.err, HasSubstr("run the colocated mode"));
    // auto on a prefill/decode topology is disagg.
    CmdResult pd = run_pdsim(
        {"simulate", "--topology", kDgx, "--trace", trace, "--report", dir.str("pd.json")}, 120);
    ASSERT_EQ(pd.rc, 0) << pd.describe();
    EXPECT_EQ(json::parse(slurp(dir.path() / "pd.json"))["mode"], "disagg");
}

// CSV rows as id -> "arrival_ms,input_len,output_len" (the columns a replay must reproduce).
std::map<std::string, std::string> request_columns(const std::string& csv_text) {
    std::map<std::string, std::string> rows;
    std::istringstream in(csv_text);
    std::string line;
    std::getline(in, line);  // header: id,arrival_ms,ttft_ms,tpot_ms,e2e_ms,input_len,output_len
    while (std::getline(in, line)) {
        std::vector<std::string> cells;
        std::istringstream cut(line);
        for (std::string c; std::getline(cut, c, ',');) cells.push_back(c);
        if (cells.size() < 7) continue;
        rows[cells[0]] = cells[1] + "," + cells[5] + "," + cells[6];
    }
    return rows;
}

// `pdsim simulate --like` of a testbed report replays exactly the testbed's requests (ids,
// lengths, arrival times) with its topology, model, mode and scheduling; bad reports and flags
// that contradict the replay exit 2 naming the file or flag.
TEST(SimulateCli, LikeReplaysTheTestbedsRequestSet) {
    TempDir dir("simulate_like");
    std::ofstream(dir.str("cost.json")) << R"({"schema_version": 1, "model": "tiny",
      "fits": [{"tp": 1, "threads": 1,
        "extend": {"const_s": 0.001, "per_token_s": 2e-5, "per_attn_pair_s": 3e-9,
                   "per_request_s": 4e-4},
        "decode": {"const_s": 5e-4, "per_request_s": 1e-5, "per_kv_token_s": 2e-8}}],
      "transports": {"local": {"gbps": 2.5, "latency_us": 30}}})";
    CmdResult tb = run_pdsim({"testbed",
                              "--topology",
                              kCpu,
                              "--trace",
                              std::string(PDSIM_SOURCE_DIR) + "/data/traces/azure_llm_code.csv",
                              "--sample",
                              "9",
                              "--seed",
                              "5",
                              "--time-scale",
                              "0.002",  // the sample's arrivals span 48 min: 6 s here
                              "--max-input-len",
                              "300",
                              "--max-output-len",
                              "5",
                              "--chunk-size",
                              "256",
                              "--mode",
                              "disagg",
                              "--quiet",
                              "--report",
                              dir.str("tb.json"),
                              "--requests",
                              dir.str("tb.csv")},
                             120);
    ASSERT_EQ(tb.rc, 0) << tb.describe();
    CmdResult sim =
        run_pdsim({"simulate", "--like", dir.str("tb.json"), "--cost-model", dir.str("cost.json"),
                   "--quiet", "--report", dir.str("sim.json"), "--requests", dir.str("sim.csv")},
                  120);
    ASSERT_EQ(sim.rc, 0) << sim.describe();
    const auto want = request_columns(slurp(dir.path() / "tb.csv"));
    const auto got = request_columns(slurp(dir.path() / "sim.csv"));
    ASSERT_EQ(want.size(), 9u);
    EXPECT_EQ(got, want);
    const json tb_rep = json::parse(slurp(dir.path() / "tb.json"));
    const json rep = json::parse(slurp(dir.path() / "sim.json"));
    EXPECT_EQ(rep["mode"], "disagg");
    EXPECT_FALSE(rep.contains("colocated"));
    EXPECT_EQ(rep["model"], tb_rep["model"]);
    EXPECT_EQ(rep["config"]["like"], dir.str("tb.json"));
    // The testbed's rules: no prefix cache, full reservation, its decode ranks' KV-token bound.
    EXPECT_EQ(rep["config"]["prefix_cache"], false);
    EXPECT_EQ(rep["config"]["kv_admission"], "full");
    const json& decode_rank = tb_rep["ranks"][1];
    ASSERT_EQ(decode_rank["role"], "decode");
    EXPECT_EQ(rep["config"]["max_decode_kv_tokens"],
              2048 * decode_rank["stats"]["threads"].get<int64_t>());
    EXPECT_EQ(rep["config"]["chunk_size"], 256);
    // Explicit flags win over the report's (here --mode both: two runs).
    CmdResult both =
        run_pdsim({"simulate", "--like", dir.str("tb.json"), "--cost-model", dir.str("cost.json"),
                   "--mode", "both", "--quiet", "--report", dir.str("both.json")},
                  120);
    ASSERT_EQ(both.rc, 0) << both.describe();
    EXPECT_TRUE(json::parse(slurp(dir.path() / "both.json")).contains("colocated"));

    // Where the ranks ran: the testbed's ranks were threads of one unbound process here, so the
    // replay leaves them unbound; a report whose ranks were each bound to one core (as mpirun
    // --bind-to core leaves them) is replayed with that binding; --cpu-binding wins.
    const json& rank_stats = tb_rep["ranks"][0]["stats"];
    ASSERT_TRUE(rank_stats["cpus"].is_array());
    EXPECT_FALSE(rank_stats["cpus"].empty());
    EXPECT_GE(rank_stats["online_cpus"].get<int>(), 1);
    EXPECT_EQ(rep["config"]["rank_core"], json::array());
    json bound = tb_rep;
    bound["ranks"][0]["stats"]["cpus"] = {3};
    bound["ranks"][1]["stats"]["cpus"] = {1};
    bound["ranks"][0]["stats"]["online_cpus"] = 4;
    bound["ranks"][1]["stats"]["online_cpus"] = 4;
    std::ofstream(dir.str("bound.json")) << bound.dump();
    for (const auto& [flags, want_cores] : std::vector<std::pair<std::vector<std::string>, json>>{
             {{}, json{3, 1}},
             {{"--cpu-binding", "none"}, json::array()},
             {{"--cpu-binding", "core"}, json{0, 1}},  // 4 cores: ranks 0, 1 on cores 0, 1
             {{"--cpu-binding", "core", "--cpu-cores", "1"}, json{0, 0}},
             {{"--cpu-binding", "2,2"}, json{2, 2}}}) {
        std::vector<std::string> args = {
            "simulate", "--like",   dir.str("bound.json"),    "--cost-model", dir.str("cost.json"),
            "--quiet",  "--report", dir.str("bound_sim.json")};
        args.insert(args.end(), flags.begin(), flags.end());
        CmdResult bound_sim = run_pdsim(args, 120);
        ASSERT_EQ(bound_sim.rc, 0) << bound_sim.describe();
        EXPECT_EQ(json::parse(slurp(dir.path() / "bound_sim.json"))["config"]["rank_core"],
                  want_cores)
            << testing::PrintToString(flags);
    }
    CmdResult too_few = run_pdsim({"simulate", "--like", dir.str("bound.json"), "--cost-model",
                                   dir.str("cost.json"), "--cpu-binding", "0,1,0"});
    EXPECT_EQ(too_few.rc, 2) << too_few.describe();
    EXPECT_THAT(too_few.err, HasSubstr("--cpu-binding 0,1,0: 3 core ids for the topology's 2"));

    // Flags that would change the request set; a file that is no testbed report; a report whose
    // model no longer resolves to what ran.
    CmdResult with_trace = run_pdsim({"simulate", "--like", dir.str("tb.json"), "--trace",
                                      dir.str("tb.csv"), "--cost-model", dir.str("cost.json")});
    EXPECT_EQ(with_trace.rc, 2) << with_trace.describe();
    EXPECT_THAT(with_trace.err, HasSubstr("--trace with --like"));
    std::ofstream(dir.str("other.json")) << R"({"requests": []})";
    CmdResult other = run_pdsim({"simulate", "--like", dir.str("other.json")});
    EXPECT_EQ(other.rc, 2) << other.describe();
    EXPECT_THAT(other.err, HasSubstr("other.json: not a pdsim testbed report"));
    json changed = tb_rep;
    changed["config"]["model"]["num_layers"] = 7;
    std::ofstream(dir.str("changed.json")) << changed.dump();
    CmdResult mismatch = run_pdsim(
        {"simulate", "--like", dir.str("changed.json"), "--cost-model", dir.str("cost.json")});
    EXPECT_EQ(mismatch.rc, 2) << mismatch.describe();
    EXPECT_THAT(mismatch.err, HasSubstr("but the testbed ran tiny with 7"));
    changed = tb_rep;
    changed["config"]["request_set"]["input_len"][2] = -4;
    std::ofstream(dir.str("bad_len.json")) << changed.dump();
    CmdResult bad_len = run_pdsim(
        {"simulate", "--like", dir.str("bad_len.json"), "--cost-model", dir.str("cost.json")});
    EXPECT_EQ(bad_len.rc, 2) << bad_len.describe();
    EXPECT_THAT(bad_len.err, HasSubstr("request 2"));
}

// The testbed's CPU ranks sample the machine-speed probe; `simulate --like` with a cost file that
// carries the calibration's probe scales each instance's decode forwards by its ranks' ratio
// (--speed-scale auto) and leaves extends alone, and says why when it does not scale; --speed-scale
// off and a given factor (every forward) win; a bad value exits 2.
TEST(SimulateCli, LikeScalesForwardsByTheMachinesSpeed) {
    TempDir dir("simulate_speed");
    CmdResult tb = run_pdsim({"testbed",
                              "--topology",
                              kCpu,
                              "--trace",
                              std::string(PDSIM_SOURCE_DIR) + "/data/traces/azure_llm_code.csv",
                              "--max-requests",
                              "6",
                              "--time-scale",
                              "0.0005",
                              "--max-input-len",
                              "200",
                              "--max-output-len",
                              "8",
                              "--mode",
                              "disagg",
                              "--speed-probe-ms",
                              "20",
                              "--quiet",
                              "--report",
                              dir.str("tb.json")},
                             120);
    ASSERT_EQ(tb.rc, 0) << tb.describe();
    const json tb_rep = json::parse(slurp(dir.path() / "tb.json"));
    EXPECT_EQ(tb_rep["config"]["speed_probe_ms"], 20);
    std::vector<double> levels;
    for (const json& rank : tb_rep["ranks"]) {
        const json& probe = rank["stats"]["speed_probe"];
        EXPECT_EQ(probe["kernel"], std::string(kSpeedProbeKernel)) << rank.dump();
        EXPECT_EQ(probe["period_ms"], 20);
        ASSERT_GE(probe["samples"].get<int64_t>(), 1) << rank.dump();
        EXPECT_EQ(probe["cpu_ms"].size(), probe["samples"].get<size_t>());
        levels.push_back(probe["cpu_ms_p50"].get<double>());
        EXPECT_GT(levels.back(), 0.0);
    }
    ASSERT_EQ(levels.size(), 2u);
    const double level = (levels[0] + levels[1]) / 2;  // the median of two ranks

    json cost = json::parse(R"({"schema_version": 1, "model": "tiny",
      "fits": [{"tp": 1, "threads": 1,
        "extend": {"const_s": 0.001, "per_token_s": 2e-5, "per_attn_pair_s": 3e-9,
                   "per_request_s": 4e-4},
        "decode": {"const_s": 5e-3, "per_request_s": 1e-5, "per_kv_token_s": 2e-8}}],
      "transports": {"local": {"gbps": 2.5, "latency_us": 30}}})");
    std::ofstream(dir.str("plain.json")) << cost.dump();
    cost["speed_probe"] = {{"kernel", std::string(kSpeedProbeKernel)}, {"cpu_ms_p50", level / 2}};
    std::ofstream(dir.str("slow.json")) << cost.dump();  // the machine ran 2x slower than this
    cost["speed_probe"]["kernel"] = "another-kernel";
    std::ofstream(dir.str("other.json")) << cost.dump();

    auto simulate = [&](const std::string& cost_file, std::vector<std::string> flags) {
        std::vector<std::string> args = {"simulate", "--like",   dir.str("tb.json"), "--cost-model",
                                         cost_file,  "--report", dir.str("sim.json")};
        args.insert(args.end(), flags.begin(), flags.end());
        CmdResult r = run_pdsim(args, 120);
        EXPECT_EQ(r.rc, 0) << r.describe();
        return std::pair{r, json::parse(slurp(dir.path() / "sim.json"))};
    };
    const auto [plain_run, plain] = simulate(dir.str("plain.json"), {});
    EXPECT_EQ(plain["config"]["speed_scale"]["factor"], 1.0);
    EXPECT_THAT(plain["config"]["speed_scale"]["why"].get<std::string>(),
                HasSubstr("has no speed_probe"));
    EXPECT_THAT(plain_run.out, HasSubstr("machine speed: x1.000, not scaled"));
    EXPECT_EQ(plain["config"]["speed_scale"]["scales"], "none");

    const auto [slow_run, slow] = simulate(dir.str("slow.json"), {});
    EXPECT_DOUBLE_EQ(slow["config"]["speed_scale"]["factor"].get<double>(), 2.0);
    EXPECT_THAT(slow_run.out,
                HasSubstr("machine speed: x2.000 (decodes), the run's speed probe took"));
    EXPECT_EQ(slow["config"]["speed_scale"]["scales"], "decodes");
    // Each instance at its own ranks' pace: the decode instance's factor is its rank's probe over
    // the calibration's. TPOT is decode forwards (5 ms each here) and nothing of the transfer.
    const json& per_instance = slow["config"]["speed_scale"]["instances"];
    ASSERT_EQ(tb_rep["ranks"][1]["instance"], "decode0");
    const double decode_factor = levels[1] / (level / 2);
    EXPECT_DOUBLE_EQ(per_instance["decode0"].get<double>(), decode_factor);
    EXPECT_DOUBLE_EQ(per_instance["prefill0"].get<double>(), levels[0] / (level / 2));
    const double tpot_ratio =
        slow["tpot_ms"]["p50"].get<double>() / plain["tpot_ms"]["p50"].get<double>();
    EXPECT_NEAR(tpot_ratio, decode_factor, 0.05 * decode_factor);
    // Extends are not scaled: each instance's cost model says so, and TTFT (the prefill, the KV
    // transfer and the decode side's admission here) moves far less than the decodes.
    const std::string cost_models = slow["simulator"]["cost_model"].get<std::string>();
    EXPECT_THAT(cost_models, HasSubstr(fmt::format("extends x1.000, decodes x{:.3f}",
                                                   per_instance["prefill0"].get<double>())));
    EXPECT_THAT(cost_models,
                HasSubstr(fmt::format("extends x1.000, decodes x{:.3f}", decode_factor)));
    EXPECT_LT(slow["ttft_ms"]["p50"].get<double>(),
              (1 + (decode_factor - 1) / 2) * plain["ttft_ms"]["p50"].get<double>());

    const auto [off_run, off] = simulate(dir.str("slow.json"), {"--speed-scale", "off"});
    EXPECT_EQ(off["config"]["speed_scale"]["factor"], 1.0);
    EXPECT_DOUBLE_EQ(off["tpot_ms"]["p50"].get<double>(), plain["tpot_ms"]["p50"].get<double>());
    const auto [given_run, given] = simulate(dir.str("plain.json"), {"--speed-scale", "1.5"});
    EXPECT_EQ(given["config"]["speed_scale"]["factor"], 1.5);
    EXPECT_EQ(given["config"]["speed_scale"]["scales"], "all forwards");
    // A given factor scales every forward: extends too.
    EXPECT_GT(given["ttft_ms"]["p50"].get<double>(), 1.2 * plain["ttft_ms"]["p50"].get<double>());
    EXPECT_NEAR(given["tpot_ms"]["p50"].get<double>() / plain["tpot_ms"]["p50"].get<double>(), 1.5,
                0.075);
    const auto [other_run, other] = simulate(dir.str("other.json"), {});
    EXPECT_EQ(other["config"]["speed_scale"]["factor"], 1.0);
    EXPECT_THAT(other["config"]["speed_scale"]["why"].get<std::string>(),
                HasSubstr("probe kernels differ"));

    // A cost file calibrated otherwise than the run (its compute stream's sync, its probe's
    // topology) is said in the summary and the report's config.warnings, not refused.
    EXPECT_FALSE(plain["config"].contains("warnings")) << plain["config"].dump();
    cost.erase("speed_probe");
    cost["stream_sync"] = "worker";
    cost["topology"] = "cpu-2p1d-tp2-to-tp1";
    std::ofstream(dir.str("mismatched.json")) << cost.dump();
    const auto [mismatched_run, mismatched] = simulate(dir.str("mismatched.json"), {});
    ASSERT_TRUE(mismatched["config"]["warnings"].is_array()) << mismatched["config"].dump();
    EXPECT_EQ(mismatched["config"]["warnings"].size(), 2u);
    EXPECT_THAT(mismatched_run.out,
                HasSubstr("warning: " + dir.str("mismatched.json") +
                          " was calibrated with --stream-sync worker, the run used caller"));
    EXPECT_THAT(mismatched_run.out,
                HasSubstr("was calibrated on topology cpu-2p1d-tp2-to-tp1 (calibrate --topology), "
                          "the run is"));
    cost["stream_sync"] = "caller";
    cost["topology"] = "cpu-1p1d";  // the run's, by its shipped name
    std::ofstream(dir.str("matched.json")) << cost.dump();
    const auto [matched_run, matched] = simulate(dir.str("matched.json"), {});
    EXPECT_FALSE(matched["config"].contains("warnings")) << matched["config"].dump();

    for (const char* bad : {"0", "fast", "101", "-1"}) {
        CmdResult r = run_pdsim({"simulate", "--like", dir.str("tb.json"), "--cost-model",
                                 dir.str("slow.json"), "--speed-scale", bad});
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(std::string("--speed-scale ") + bad));
    }
}

// A cost file with TP 1 and TP 2 fits (cpu-2p1d-tp2-to-tp1 and cpu-1p1d) and a local transport.
json tp1_tp2_cost() {
    return json::parse(R"({"schema_version": 1, "model": "tiny",
      "fits": [{"tp": 1, "threads": 1,
        "extend": {"const_s": 0.001, "per_token_s": 2e-5, "per_attn_pair_s": 3e-9,
                   "per_request_s": 4e-4},
        "decode": {"const_s": 5e-3, "per_request_s": 1e-5, "per_kv_token_s": 2e-8}},
               {"tp": 2, "threads": 1,
        "extend": {"const_s": 0.001, "per_token_s": 1e-5, "per_attn_pair_s": 2e-9,
                   "per_request_s": 4e-4},
        "decode": {"const_s": 5e-3, "per_request_s": 1e-5, "per_kv_token_s": 2e-8}}],
      "transports": {"local": {"gbps": 2.5, "latency_us": 30}}})");
}

// `pdsim simulate` of `trace` with ranks bound to 2 cores; the run and its report (sim.json).
std::pair<CmdResult, json> simulate_on_two_cores(const TempDir& dir, const std::string& trace,
                                                 const std::string& topology,
                                                 const std::string& cost_file,
                                                 const std::string& time_scale,
                                                 const std::vector<std::string>& flags) {
    std::vector<std::string> args = {
        "simulate",     "--topology",   topology,      "--trace",  trace,
        "--cost-model", cost_file,      "--cpu-cores", "2",        "--cpu-binding",
        "core",         "--time-scale", time_scale,    "--report", dir.str("sim.json")};
    args.insert(args.end(), flags.begin(), flags.end());
    CmdResult r = run_pdsim(args, 120);
    EXPECT_EQ(r.rc, 0) << r.describe();
    return {r, json::parse(slurp(dir.path() / "sim.json"))};
}

// --core-wait: a calibrated cost file's core_wait (auto), none (off) or given milliseconds; work
// reaching an idle instance while another computes on its cores then starts later, so TTFT grows
// where ranks share cores (cpu-2p1d-tp2-to-tp1 bound to 2 cores) and not where they do not.
TEST(SimulateCli, CoreWaitComesFromTheCostFileOrTheFlag) {
    TempDir dir("simulate_core_wait");
    const std::string trace = write_trace(dir);
    json cost = tp1_tp2_cost();
    std::ofstream(dir.str("plain.json")) << cost.dump();
    cost["core_wait"] = {{"dispatch_ms", 20}, {"events", 30}};
    std::ofstream(dir.str("wait.json")) << cost.dump();
    const std::string two =
        std::string(PDSIM_SOURCE_DIR) + "/topology/examples/cpu-2p1d-tp2-to-tp1.yaml";
    auto simulate = [&](const std::string& topology, const std::string& cost_file,
                        const std::vector<std::string>& flags) {
        return simulate_on_two_cores(dir, trace, topology, cost_file, "1", flags);
    };
    const auto [plain_run, plain] = simulate(two, dir.str("plain.json"), {});
    EXPECT_EQ(plain["config"]["core_wait"]["dispatch_ms"], 0.0);
    EXPECT_THAT(plain_run.out, HasSubstr("core wait: 0.00 ms, none (the cost model has no"));
    const auto [wait_run, wait] = simulate(two, dir.str("wait.json"), {});
    EXPECT_EQ(wait["config"]["core_wait"]["dispatch_ms"], 20.0);
    EXPECT_THAT(wait_run.out, HasSubstr("core wait: 20.00 ms, from"));
    // Requests 100 ms apart: some reach an idle prefill instance while the other instance or the
    // decode instance computes on its cores, and wait the 20 ms there.
    EXPECT_GT(wait["prefill_wait_ms"]["mean"].get<double>(),
              plain["prefill_wait_ms"]["mean"].get<double>() + 1);
    EXPECT_GT(wait["ttft_ms"]["mean"].get<double>(), plain["ttft_ms"]["mean"].get<double>());
    const auto [off_run, off] = simulate(two, dir.str("wait.json"), {"--core-wait", "off"});
    EXPECT_DOUBLE_EQ(off["ttft_ms"]["mean"].get<double>(), plain["ttft_ms"]["mean"].get<double>());
    const auto [given_run, given] = simulate(two, dir.str("plain.json"), {"--core-wait", "20"});
    EXPECT_THAT(given["config"]["core_wait"]["why"].get<std::string>(), HasSubstr("as given"));
    EXPECT_DOUBLE_EQ(given["ttft_ms"]["mean"].get<double>(), wait["ttft_ms"]["mean"].get<double>());
    // cpu-1p1d bound to 2 cores: its ranks share none, nothing waits.
    const auto [apart_run, apart] = simulate(kCpu, dir.str("wait.json"), {});
    const auto [apart_plain_run, apart_plain] = simulate(kCpu, dir.str("plain.json"), {});
    EXPECT_DOUBLE_EQ(apart["ttft_ms"]["mean"].get<double>(),
                     apart_plain["ttft_ms"]["mean"].get<double>());
    for (const char* bad : {"-1", "soon", "1001", "5:1"}) {
        CmdResult r = run_pdsim({"simulate", "--topology", two, "--trace", trace, "--cost-model",
                                 dir.str("wait.json"), "--core-wait", bad});
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(std::string("--core-wait ") + bad));
    }
}

// --step-wait: a calibrated cost file's step_wait (auto) or none (off, the default); decode steps
// that end while another instance computes on the decode rank's core are followed by the wait, so
// TPOT grows where ranks share cores (cpu-2p1d-tp2-to-tp1 bound to 2 cores) and not where they do
// not (cpu-1p1d).
TEST(SimulateCli, StepWaitComesFromTheCostFileUnlessOff) {
    TempDir dir("simulate_step_wait");
    const std::string trace = write_trace(dir);
    json cost = tp1_tp2_cost();
    std::ofstream(dir.str("plain.json")) << cost.dump();
    cost["step_wait"] = {{"decode", {{{"competitors", 1}, {"chance", 1}, {"wait_ms", 4}}}}};
    std::ofstream(dir.str("steps.json")) << cost.dump();
    const std::string two =
        std::string(PDSIM_SOURCE_DIR) + "/topology/examples/cpu-2p1d-tp2-to-tp1.yaml";
    auto simulate = [&](const std::string& topology, const std::string& cost_file,
                        const std::vector<std::string>& flags) {
        // Requests 25 ms apart: decode steps run while the next prompts' prefills compute.
        return simulate_on_two_cores(dir, trace, topology, cost_file, "0.25", flags);
    };
    const auto tpot = [](const json& report) { return report["tpot_ms"]["mean"].get<double>(); };
    const auto [plain_run, plain] = simulate(two, dir.str("plain.json"), {"--step-wait", "auto"});
    EXPECT_THAT(plain_run.out, HasSubstr("step wait: none, none (the cost model has no"));
    EXPECT_EQ(plain["simulator"]["step_waits"], 0);
    // Off unless asked for.
    const auto [default_run, by_default] = simulate(two, dir.str("steps.json"), {});
    EXPECT_THAT(by_default["config"]["step_wait"]["why"].get<std::string>(),
                HasSubstr("--step-wait off"));
    EXPECT_DOUBLE_EQ(tpot(by_default), tpot(plain));
    const auto [steps_run, steps] = simulate(two, dir.str("steps.json"), {"--step-wait", "auto"});
    EXPECT_THAT(steps_run.out, HasSubstr("step wait: by competitors 1: 100% x 4.00 ms, from"));
    EXPECT_EQ(steps["config"]["step_wait"]["decode"][0]["wait_ms"], 4.0);
    EXPECT_GT(steps["simulator"]["step_waits"].get<int64_t>(), 10);
    EXPECT_GT(tpot(steps), tpot(plain) + 0.5);
    const auto [off_run, off] = simulate(two, dir.str("steps.json"), {"--step-wait", "off"});
    EXPECT_THAT(off["config"]["step_wait"]["why"].get<std::string>(), HasSubstr("--step-wait off"));
    EXPECT_DOUBLE_EQ(tpot(off), tpot(plain));
    // cpu-1p1d bound to 2 cores: the decode rank has a core of its own, nothing waits.
    const auto [apart_run, apart] = simulate(kCpu, dir.str("steps.json"), {"--step-wait", "auto"});
    const auto [apart_plain_run, apart_plain] = simulate(kCpu, dir.str("plain.json"), {});
    EXPECT_EQ(apart["simulator"]["step_waits"], 0);
    EXPECT_DOUBLE_EQ(tpot(apart), tpot(apart_plain));
    CmdResult bad = run_pdsim({"simulate", "--topology", two, "--trace", trace, "--cost-model",
                               dir.str("steps.json"), "--step-wait", "3"});
    EXPECT_EQ(bad.rc, 2) << bad.describe();
    EXPECT_THAT(bad.err, HasSubstr("--step-wait"));
}

TEST(SimulateCli, BadInputExitsTwoNamingTheFlagOrFile) {
    TempDir dir("simulate_bad");
    const std::string trace = write_trace(dir);
    struct Case {
        std::vector<std::string> args;
        std::string needle;
    };
    const std::string bad_trace = dir.str("bad.jsonl");
    std::ofstream(bad_trace) << "{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 2}\n";
    const std::vector<Case> cases = {
        {{"simulate", "--topology", kDgx}, "--trace"},
        {{"simulate", "--topology", dir.str("nope.yaml"), "--trace", trace}, "nope.yaml"},
        {{"simulate", "--topology", kDgx, "--trace", dir.str("nope.jsonl")}, "nope.jsonl"},
        {{"simulate", "--topology", kDgx, "--trace", bad_trace}, "bad.jsonl:1"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--chunk-size", "0"}, "--chunk-size"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--mode", "sideways"}, "--mode"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--layerwise", "maybe"}, "--layerwise"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--cpu-binding", "0,x"},
         "--cpu-binding 0,x: 'x' is not a core id"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--cpu-binding", "0,,1"},
         "--cpu-binding 0,,1: '' is not a core id"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--time-scale", "0"}, "--time-scale"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--model", "gpt-9"}, "--model"},
        {{"simulate", "--topology", kDgx, "--trace", trace, "--cost-model", dir.str("c.json")},
         "c.json"},
        // The roofline needs GPUs; a CPU topology needs a calibrated cost file.
        {{"simulate", "--topology", kCpu, "--trace", trace}, "--cost-model"},
    };
    for (const auto& c : cases) {
        CmdResult r = run_pdsim(c.args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.needle)) << c.needle << "\n" << r.describe();
    }
}

// `kDgx` with its `model: llama3-70b` line replaced by `model_line`.
std::string dgx_with_model(const TempDir& dir, const std::string& tag,
                           const std::string& model_line) {
    std::string text = slurp(kDgx);
    const std::string from = "\nmodel: llama3-70b\n";
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos);
    if (at != std::string::npos) text.replace(at, from.size(), "\n" + model_line + "\n");
    const std::string path = dir.str(tag + ".yaml");
    std::ofstream(path) << text;
    return path;
}

// A topology's model section with overrides (`base` plus fields) is the model every command runs:
// `topology show`, `simulate` and `testbed` agree on it, and an absurd override is refused.
TEST(SimulateCli, TopologyModelOverrideIsTheModelEveryCommandRuns) {
    TempDir dir("simulate_model_override");
    const std::string trace = write_trace(dir);
    const std::string two = dgx_with_model(dir, "two", "model: {base: llama3-70b, num_layers: 2}");
    const std::string four =
        dgx_with_model(dir, "four", "model: {base: llama3-70b, num_layers: 4}");
    CmdResult show = run_pdsim({"topology", "show", two}, 60);
    ASSERT_EQ(show.rc, 0) << show.describe();
    EXPECT_THAT(show.out, HasSubstr("llama3-70b: 2 layers"));
    // The simulated KV bytes scale with the layers the topology gives, and equal those of
    // --model llama3-70b --layers 2 (the flags' way to the same model).
    auto bytes = [&](std::vector<std::string> args) {
        const std::string report = dir.str("r.json");
        args.insert(args.end(), {"--trace", trace, "--mode", "disagg", "--report", report});
        CmdResult r = run_pdsim(args, 120);
        EXPECT_EQ(r.rc, 0) << r.describe();
        const json rep = json::parse(slurp(report), nullptr, false);
        return rep.is_object() ? rep["transfer"]["bytes"].get<double>() : -1.0;
    };
    const double b2 = bytes({"simulate", "--topology", two});
    const double b4 = bytes({"simulate", "--topology", four});
    const double flags =
        bytes({"simulate", "--topology", kDgx, "--model", "llama3-70b", "--layers", "2"});
    const double b80 = bytes({"simulate", "--topology", kDgx});
    EXPECT_GT(b2, 0);
    EXPECT_DOUBLE_EQ(b4, 2 * b2);
    EXPECT_DOUBLE_EQ(flags, b2);
    EXPECT_DOUBLE_EQ(b80, 40 * b2);
    // The testbed runs the section's model too (tiny with 3 layers on the CPU topology).
    std::string cpu = slurp(kCpu);
    const size_t at = cpu.find("\nmodel: tiny\n");
    ASSERT_NE(at, std::string::npos);
    cpu.replace(at, 13, "\nmodel: {base: tiny, num_layers: 3}\n");
    std::ofstream(dir.str("cpu3.yaml")) << cpu;
    CmdResult tb = run_pdsim({"testbed", "--topology", dir.str("cpu3.yaml"), "--synthetic", "2",
                              "--mode", "colocated", "--quiet", "--report", dir.str("tb.json")},
                             120);
    ASSERT_EQ(tb.rc, 0) << tb.describe();
    const json tb_rep = json::parse(slurp(dir.path() / "tb.json"));
    EXPECT_EQ(tb_rep["config"]["model"]["num_layers"], 3);
    // An absurd override is refused by every command, naming the field.
    const std::string huge =
        dgx_with_model(dir, "huge", "model: {base: llama3-70b, num_layers: 100000000}");
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"simulate", "--topology", huge, "--trace", trace},
          std::vector<std::string>{"testbed", "--topology", huge, "--synthetic", "2"}}) {
        CmdResult r = run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("num_layers: 100000000 must be <= 4096")) << r.describe();
    }
}

// Hybrid models on one H200 per instance (gpu-2g-1p1d, TP 1: qwen3-next-80b has 2 KV heads):
// every request completes in both modes, and the transfer moves each layer group's bytes
// (sim/des/kv_groups.h). write_trace's prompts are L_i = 600 + 97 i (i < 40): sum 99,660 tokens;
// sum min(L_i, 1024) = 600 + 697 + 794 + 891 + 988 + 35 x 1024 = 39,810.
TEST(SimulateCli, HybridModelsRunAndMoveBytesByGroup) {
    TempDir dir("simulate_hybrid");
    const std::string trace = write_trace(dir);
    const std::string topology =
        std::string(PDSIM_SOURCE_DIR) + "/topology/examples/gpu-2g-1p1d.yaml";
    struct Case {
        const char* model;
        int64_t full, sliding, state;  // transfer bytes by group
        int64_t fit_4096;              // decode0: requests of 4096 tokens that fit
    };
    // bf16 KV of one token in one layer: gemma3-27b 2 x 16 x 128 x 2 = 8,192 B, qwen3-next-80b
    // 2 x 2 x 256 x 2 = 2,048 B.
    //   gemma3-27b: 10 full layers x 8,192 x 99,660 = 8,164,147,200; 52 sliding layers x 8,192
    //     x 39,810 = 16,958,423,040; 605,956 pages / 5,940 per request (des_sim_test) = 102.
    //   qwen3-next-80b: 12 full layers x 2,048 x 99,660 = 2,449,244,160; the state, 36 layers x
    //     2,244,608 B per request, x 40 = 3,232,235,520; 3,931,095 pages / 5,538 = 709.
    for (const Case& c : {Case{"gemma3-27b", 8164147200, 16958423040, 0, 102},
                          Case{"qwen3-next-80b", 2449244160, 0, 3232235520, 709}}) {
        SCOPED_TRACE(c.model);
        const std::string report = dir.str(std::string(c.model) + ".json");
        CmdResult r = run_pdsim({"simulate", "--topology", topology, "--model", c.model, "--trace",
                                 trace, "--mode", "both", "--report", report},
                                120);
        ASSERT_EQ(r.rc, 0) << r.describe();
        const json rep = json::parse(slurp(report));
        EXPECT_EQ(rep["model"], c.model);
        EXPECT_EQ(rep["requests_completed"], 40);
        EXPECT_EQ(rep["colocated"]["requests_completed"], 40);
        const json& g = rep["simulator"]["transfer_bytes_by_group"];
        EXPECT_EQ(g["full"], c.full);
        EXPECT_EQ(g["sliding"], c.sliding);
        EXPECT_EQ(g["state"], c.state);
        EXPECT_EQ(rep["transfer"]["bytes"], c.full + c.sliding + c.state);
        EXPECT_EQ(rep["simulator"]["instances"][1]["kv_requests_that_fit"]["4096"], c.fit_4096);
        EXPECT_EQ(rep["simulator"]["instances"][1]["kv_page_layers"], 1);
        EXPECT_EQ(rep["config"]["prefix_cache"], false);  // shared blocks, but no prefix cache
        EXPECT_EQ(rep["simulator"]["prefix_hit_tokens"], 0);
    }
}

TEST(SimulateCli, BenchReportsRequestsPerWallSecond) {
    TempDir dir("bench_simulate");
    const std::string trace = write_trace(dir);
    CmdResult r = run_pdsim({"bench", "simulate", "--trace", trace, "--topology", kDgx, "--reps",
                             "2", "--json", dir.str("bench.json")},
                            120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("requests per wall second"));
    const json j = json::parse(slurp(dir.path() / "bench.json"));
    EXPECT_EQ(j["requests"], 40);
    EXPECT_GT(j["requests_per_wall_s"].get<double>(), 0);
    EXPECT_GT(j["events_per_s"].get<double>(), 0);
    EXPECT_EQ(j["target_requests_per_wall_s"], 20000);
    EXPECT_NEAR(j["ratio"].get<double>(), j["requests_per_wall_s"].get<double>() / 20000, 1e-9);
    EXPECT_EQ(j["runs"].size(), 2u);
}

}  // namespace
}  // namespace pdsim::test
