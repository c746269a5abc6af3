// `pdsim cost-check`: a cost file's forward times against the forwards a testbed run timed
// (sim/cost/forward_check.h), per kind, TP, threads and batch size, split by whether another
// instance computed at the same time. Parses flags, calls the library, prints.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "sim/cost/forward_check.h"

namespace pdsim::cli {

namespace {

struct CostCheckOptions {
    std::string timeline;
    std::string cost_model;
    std::string model = "tiny";
    std::string json_out;
    std::string gaps_json_out;
};

Status run_cost_check(const CostCheckOptions& o) {
    auto m = model::resolve_model(o.model);
    if (!m.ok()) return m.status().with_context("--model");
    auto cost = cost::CostFile::load(o.cost_model);
    if (!cost.ok()) return cost.status().with_context("--cost-model");
    std::vector<cost::TimelineForward> forwards;
    size_t files = 0;
    for (const std::string& path : split_paths(o.timeline)) {
        PDSIM_ASSIGN_OR_RETURN(std::vector<cost::TimelineForward> one,
                               cost::read_timeline_forwards(path, "--timeline"));
        // Overlap is within one run: offset each file's clock past the previous file's end.
        const double offset = forwards.empty() ? 0 : forwards.back().end_us + 1e9;
        for (cost::TimelineForward& f : one) {
            f.begin_us += offset;
            f.end_us += offset;
        }
        forwards.insert(forwards.end(), one.begin(), one.end());
        ++files;
    }
    if (files == 0) return Status(StatusCode::kInvalidArgument, "--timeline: empty list");
    auto rows = cost::check_forwards(forwards, *cost, *m);
    if (!rows.ok()) return rows.status().with_context("--timeline " + o.timeline);
    std::printf("pdsim cost-check: %s against %zu timeline file(s), model %s\n",
                o.cost_model.c_str(), files, m->name.c_str());
    std::printf("%s", cost::forward_check_table(*rows).c_str());
    std::printf(
        "measured / predicted > 1: the testbed's forward was slower than the cost model says. "
        "Rows with another instance computing include the contention the simulator adds on top "
        "(its CPU contention model and the cost file's interference).\n");
    // Gaps are within one run too: the offset clocks above keep files apart (a gap across files
    // is over kIdleGapS and not counted).
    const std::vector<cost::ForwardGapRow> gaps = cost::forward_gaps(forwards);
    std::printf(
        "\nTime between an instance's forwards (gaps under %.0f ms; the simulator has "
        "none):\n%s",
        cost::kIdleGapS * 1000, cost::forward_gap_table(gaps).c_str());
    if (!o.gaps_json_out.empty()) {
        nlohmann::json j = nlohmann::json::array();
        for (const cost::ForwardGapRow& r : gaps) {
            j.push_back({{"instance", r.instance},
                         {"kind", r.decode ? "decode" : "extend"},
                         {"others_computing", r.others_computing},
                         {"count", r.count},
                         {"gap_ms_mean", r.gap_ms_mean},
                         {"gap_ms_p50", r.gap_ms_p50},
                         {"gap_ms_p90", r.gap_ms_p90},
                         {"gap_ms_sum", r.gap_ms_sum},
                         {"forward_ms_sum", r.forward_ms_sum}});
        }
        PDSIM_RETURN_IF_ERROR(write_json_file("--gaps-json", o.gaps_json_out, j));
    }
    if (!o.json_out.empty()) {
        nlohmann::json j = nlohmann::json::array();
        for (const cost::ForwardCheckRow& r : *rows) {
            j.push_back({{"kind", r.decode ? "decode" : "extend"},
                         {"tp", r.tp},
                         {"threads", r.threads},
                         {"overlapped", r.overlapped},
                         {"bucket", r.bucket},
                         {"count", r.count},
                         {"measured_ms_p50", r.measured_ms_p50},
                         {"predicted_ms_p50", r.predicted_ms_p50},
                         {"ratio_p10", r.ratio_p10},
                         {"ratio_p50", r.ratio_p50},
                         {"ratio_p90", r.ratio_p90},
                         {"measured_ms_sum", r.measured_ms_sum},
                         {"predicted_ms_sum", r.predicted_ms_sum},
                         {"wall_over_cpu_p50", r.wall_over_cpu_p50}});
        }
        std::ofstream f(o.json_out);
        f << j.dump(2) << "\n";
        if (!f) return Status(StatusCode::kUnavailable, o.json_out + ": write failed");
    }
    return {};
}

}  // namespace

void add_cost_check_command(CLI::App& app, CommandSet& commands) {
    auto o = std::make_shared<CostCheckOptions>();
    CLI::App* a = app.add_subcommand(
        "cost-check",
        "Compare a cost file's forward times with the forwards a `pdsim testbed --timeline` run "
        "timed, batch by batch: per kind (extend, decode), TP, threads and batch size, and "
        "whether another instance computed at the same time, the measured and predicted "
        "medians and the measured / predicted ratio; then the time between each instance's "
        "forwards, which the simulator does not model. Shows which forwards a simulation gets "
        "wrong (docs/cost-models.md). Exit 2 on bad input.");
    a->add_option("--timeline", o->timeline,
                  "Comma-separated timelines of `pdsim testbed --timeline` runs")
        ->required()
        ->check(non_empty());
    a->add_option("--cost-model", o->cost_model, "Cost file of `pdsim calibrate`")
        ->required()
        ->check(non_empty());
    a->add_option("--model", o->model,
                  "The model the testbed ran (the cost file's fits are per "
                  "model)")
        ->check(non_empty())
        ->capture_default_str();
    a->add_option("--json", o->json_out, "Also write the rows as JSON here")->check(output_file());
    a->add_option("--gaps-json", o->gaps_json_out,
                  "Also write the time-between-forwards rows as JSON here")
        ->check(output_file());
    commands.add(a, [o] { return run_cost_check(*o); });
}

}  // namespace pdsim::cli
