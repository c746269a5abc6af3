// pdsim search: the placement search of sim/des/search.h on a GPU budget, a model and a workload
// (a trace or a synthetic one), printed as a ranked table and optionally written as JSON.
// --topology F stands for --gpu and --gpus (the file's GPU type and GPU count) and, without
// --model, for the model; its instances are not used (the search builds its own).
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "backends/model/model_config.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "sim/cli/sim_flags.h"
#include "sim/des/search.h"
#include "sim/des/setup.h"
#include "topology/loader.h"

namespace pdsim::cli {

namespace {

using json = nlohmann::json;

// Flag bounds (shown in --help; docs/inputs.md).
constexpr int64_t kMaxGpus = 65536;                // --gpus, --min-gpus
constexpr int64_t kMaxCandidates = 1'000'000;      // --max-candidates, --top
constexpr double kMinRate = 1e-6, kMaxRate = 1e6;  // --rate, requests/s
// --cv: gamma shape 1/cv^2; at cv 10 it is 0.01 (std::gamma_distribution never returns at 0).
constexpr double kMaxCv = 10;

struct SearchFlags {
    std::string topology, gpu, model;
    // A trace, its caps, first N or sample, time scale; or (no trace) the synthetic workload
    // of the flags below, seeded by req.seed.
    des::RequestSource req;
    int gpus = 0, layers = 0, min_gpus = 1;
    int64_t synthetic = 0;
    double rate = 1.0, cv = 0;  // cv > 0: gamma arrivals
    std::string input_len = "lognormal:8192:0.5", output_len = "lognormal:256:0.5";
    double slo_ttft_ms = 0, slo_tpot_ms = 0, attainment = 0.9;
    std::string modes = "disagg,colocated", tp;
    int64_t max_candidates = 2000, top = 15;
    SchedulingFlags sched;
    std::string json_path;
    bool quiet = false;
};

Status check_flags(const SearchFlags& f) {
    if (f.topology.empty() && f.gpus == 0)
        return invalid_argument_error("--gpus: required (or --topology F)");
    if (f.gpus < 0) return invalid_argument_error(fmt::format("--gpus {}: must be >= 1", f.gpus));
    if (f.req.trace.empty() == (f.synthetic == 0)) {
        return invalid_argument_error("--trace F or --synthetic N: exactly one is required");
    }
    if (f.synthetic < 0)
        return invalid_argument_error(fmt::format("--synthetic {}: must be >= 1", f.synthetic));
    if (f.synthetic > 0 && (f.req.max_requests != 0 || f.req.sample != 0)) {
        return invalid_argument_error(
            "--max-requests / --sample: for --trace (--synthetic N sets the count)");
    }
    if (!(f.rate > 0)) return invalid_argument_error(fmt::format("--rate {}: must be > 0", f.rate));
    if (!(f.cv >= 0 && f.cv <= kMaxCv)) {
        return invalid_argument_error(fmt::format("--cv {}: must be in [0, {}]", f.cv, kMaxCv));
    }
    if (!(f.slo_ttft_ms > 0))
        return invalid_argument_error(fmt::format("--slo-ttft-ms {}: must be > 0", f.slo_ttft_ms));
    if (!(f.slo_tpot_ms > 0))
        return invalid_argument_error(fmt::format("--slo-tpot-ms {}: must be > 0", f.slo_tpot_ms));
    if (!(f.attainment > 0 && f.attainment <= 1)) {
        return invalid_argument_error(
            fmt::format("--attainment {}: must be in (0, 1]", f.attainment));
    }
    if (f.max_candidates < 1) {
        return invalid_argument_error(
            fmt::format("--max-candidates {}: must be >= 1", f.max_candidates));
    }
    if (f.top < 0) return invalid_argument_error(fmt::format("--top {}: must be >= 0", f.top));
    return check_scheduling_flags(f.sched);
}

StatusOr<des::SearchSpace> make_space(const SearchFlags& f,
                                      std::optional<topo::ModelShape>* model_from_topology) {
    des::SearchSpace s;
    s.gpu = f.gpu;
    s.gpus = f.gpus;
    if (!f.topology.empty()) {
        PDSIM_ASSIGN_OR_RETURN(topo::Topology t, topo::load_topology(f.topology));
        std::string type;
        int count = 0;
        for (const auto& node : t.nodes) {
            for (const auto& dev : node.devices) {
                if (dev.is_cpu()) continue;
                if (!type.empty() && dev.type != type) {
                    return invalid_argument_error(
                        fmt::format("--topology {}: mixed GPU types ({} and {}); pass --gpu "
                                    "and --gpus",
                                    f.topology, type, dev.type));
                }
                type = dev.type;
                ++count;
            }
        }
        if (count == 0) {
            return invalid_argument_error(
                fmt::format("--topology {}: no GPU devices (the search simulates GPUs with "
                            "roofline costs); pass --gpu and --gpus",
                            f.topology));
        }
        if (s.gpu.empty()) s.gpu = type;
        if (s.gpus == 0) s.gpus = count;
        *model_from_topology = t.model;
    }
    if (s.gpu.empty()) s.gpu = "H100";
    PDSIM_RETURN_IF_ERROR(des::nvlink_domain(s.gpu).status());
    s.disagg = s.colocated = false;
    std::stringstream ss(f.modes);
    std::string m;
    while (std::getline(ss, m, ',')) {
        if (m == "disagg") {
            s.disagg = true;
        } else if (m == "colocated") {
            s.colocated = true;
        } else {
            return invalid_argument_error(
                fmt::format("--modes {}: expected disagg, colocated or both, "
                            "comma-separated",
                            f.modes));
        }
    }
    if (!s.disagg && !s.colocated)
        return invalid_argument_error(fmt::format("--modes '{}': no mode", f.modes));
    if (!f.tp.empty()) {
        PDSIM_ASSIGN_OR_RETURN(s.tp_sizes, parse_int_list("--tp", f.tp));
    }
    s.max_candidates = f.max_candidates;
    s.min_gpus = f.min_gpus;
    return s;
}

std::string pct(const metrics::Percentiles& p, const char* fmt_one) {
    return fmt::format(fmt::runtime(std::string(fmt_one) + "/" + fmt_one), p.p50, p.p90);
}

json row_json(int64_t rank, const des::CandidateResult& r) {
    auto pj = [](const metrics::Percentiles& p) {
        return json{{"mean", p.mean}, {"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}};
    };
    json j = {{"rank", rank},
              {"layout", r.layout.name()},
              {"mode", des::sim_mode_name(r.layout.mode)},
              {"prefill", r.layout.prefill},
              {"prefill_tp", r.layout.prefill_tp},
              {"decode", r.layout.decode},
              {"decode_tp", r.layout.decode_tp},
              {"gpus", r.layout.gpus()},
              {"ran", r.ran}};
    if (!r.ran) {
        j["error"] = r.error;
        return j;
    }
    j["meets_target"] = r.meets;
    j["goodput_rps"] = r.goodput_rps;
    j["goodput_per_gpu"] = r.goodput_per_gpu;
    j["slo_attainment"] = r.slo_attainment;
    j["throughput_tokens_s"] = r.throughput_tokens_s;
    j["ttft_ms"] = pj(r.ttft_ms);
    j["tpot_ms"] = pj(r.tpot_ms);
    j["requests_completed"] = r.requests_completed;
    j["requests_failed"] = r.requests_failed;
    j["preemptions"] = r.preemptions;
    j["sim_s"] = r.sim_s;
    j["wall_s"] = r.wall_s;
    return j;
}

std::string table_row(const std::string& rank, const des::CandidateResult& r) {
    if (!r.ran) {
        return fmt::format("  {:>4}  {:<22} {:>4}  not run: {}\n", rank, r.layout.name(),
                           r.layout.gpus(), r.error);
    }
    return fmt::format("  {:>4}  {:<22} {:>4} {:>9.3f} {:>9.4f} {:>7.3f}{} {:>17} {:>13}\n", rank,
                       r.layout.name(), r.layout.gpus(), r.goodput_rps, r.goodput_per_gpu,
                       r.slo_attainment, r.meets ? " " : "*", pct(r.ttft_ms, "{:.0f}"),
                       pct(r.tpot_ms, "{:.1f}"));
}

// The requests to search on: the trace of --trace, or the synthetic workload of the flags.
StatusOr<std::vector<workload::Request>> search_requests(const SearchFlags& f,
                                                         des::RequestSource* src) {
    *src = f.req;
    if (src->trace.empty()) {
        workload::SyntheticOptions& so = src->synthetic;
        so.num_requests = f.synthetic;
        so.rate_rps = f.rate;
        so.gamma = f.cv > 0;
        so.cv = f.cv > 0 ? f.cv : 1.0;
        so.seed = src->seed;
        StatusOr<workload::LengthDist> in = workload::parse_length_dist(f.input_len);
        if (!in.ok())
            return invalid_argument_error(fmt::format("--input-len: {}", in.status().message()));
        StatusOr<workload::LengthDist> out = workload::parse_length_dist(f.output_len);
        if (!out.ok())
            return invalid_argument_error(fmt::format("--output-len: {}", out.status().message()));
        so.input = *in;
        so.output = *out;
    }
    return des::load_requests(*src);
}

// Progress on stderr: on a terminal one line rewritten in place; in a log one line per tenth.
void print_progress(bool tty, const des::SearchProgress& p) {
    const des::CandidateResult& r = *p.result;
    const std::string what = r.ran
                                 ? fmt::format("attainment {:.3f}, goodput {:.3f} req/s ({:.2f} s)",
                                               r.slo_attainment, r.goodput_rps, r.wall_s)
                                 : std::string("not run");
    const bool last = p.index == p.total;
    if (tty) {
        std::fprintf(stderr, "\r\033[K[pdsim search] %lld/%lld %s: %s%s",
                     static_cast<long long>(p.index), static_cast<long long>(p.total),
                     r.layout.name().c_str(), what.c_str(), last ? "\n" : "");
    } else if (last || p.index % std::max<int64_t>(1, p.total / 10) == 0) {
        std::fprintf(stderr, "[pdsim search] %lld/%lld candidates simulated\n",
                     static_cast<long long>(p.index), static_cast<long long>(p.total));
    }
    std::fflush(stderr);
}

des::SearchOptions search_options(const SearchFlags& f, const des::SearchSpace& space,
                                  const model::ModelConfig& model) {
    des::SearchOptions o;
    o.space = space;
    o.base.model = model;
    apply_scheduling_flags(f.sched, &o.base);
    o.base.slo.ttft_ms = f.slo_ttft_ms;
    o.base.slo.tpot_ms = f.slo_tpot_ms;
    o.kv = kv_capacity_options(f.sched);
    o.attainment_target = f.attainment;
    const bool tty = isatty(fileno(stderr)) != 0;
    if (!f.quiet) o.on_candidate = [tty](const des::SearchProgress& p) { print_progress(tty, p); };
    return o;
}

// What one search printed and wrote is about.
struct SearchRun {
    const SearchFlags& flags;
    const des::SearchSpace& space;
    const model::ModelConfig& model;
    const std::string& workload_label;
    const workload::TraceStats& stats;
    const des::SearchResult& result;
    int64_t meeting = 0;  // candidates meeting the attainment target
};

json search_json(const SearchRun& run) {
    const SearchFlags& f = run.flags;
    const workload::TraceStats& ts = run.stats;
    const des::SearchResult& res = run.result;
    json rows = json::array();
    for (size_t i = 0; i < res.ranked.size(); ++i) {
        rows.push_back(row_json(static_cast<int64_t>(i) + 1, res.ranked[i]));
    }
    return {
        {"schema_version", 1},
        {"gpu", run.space.gpu},
        {"gpus", run.space.gpus},
        {"model", run.model.name},
        {"workload", run.workload_label},
        {"requests", ts.requests},
        {"mean_input", ts.mean_input},
        {"mean_output", ts.mean_output},
        {"offered_rps", ts.duration_s > 0 ? (ts.requests - 1) / ts.duration_s : 0.0},
        {"slo",
         {{"ttft_ms", f.slo_ttft_ms}, {"tpot_ms", f.slo_tpot_ms}, {"attainment", f.attainment}}},
        {"tp_sizes", res.tp_sizes},
        {"notes", res.notes},
        {"candidates", res.candidates},
        {"meeting_target", run.meeting},
        {"wall_s", res.wall_s},
        {"rows", rows}};
}

// The best of each mode, even when it ranks below --top: the disagg-vs-colocated answer.
std::string best_of_each_mode(const des::SearchResult& res) {
    std::string s;
    for (des::SimMode m : {des::SimMode::kDisagg, des::SimMode::kColocated}) {
        for (size_t i = 0; i < res.ranked.size(); ++i) {
            const des::CandidateResult& r = res.ranked[i];
            if (!r.ran || r.layout.mode != m) continue;
            s += fmt::format(
                "  best {}: rank {}, {}, {} GPUs, goodput {:.3f} req/s ({:.4f} per GPU), "
                "attainment {:.3f}, TTFT p50/p90 {:.0f}/{:.0f} ms, TPOT p50/p90 {:.1f}/{:.1f} ms\n",
                des::sim_mode_name(m), i + 1, r.layout.name(), r.layout.gpus(), r.goodput_rps,
                r.goodput_per_gpu, r.slo_attainment, r.ttft_ms.p50, r.ttft_ms.p90, r.tpot_ms.p50,
                r.tpot_ms.p90);
            break;
        }
    }
    return s;
}

std::string search_report(const SearchRun& run) {
    const SearchFlags& f = run.flags;
    const workload::TraceStats& ts = run.stats;
    const des::SearchResult& res = run.result;
    std::string s = fmt::format(
        "pdsim search: {} on {} x {}, {}\n"
        "  {} requests, mean input {:.0f}, mean output {:.0f}, offered {:.3f} req/s over {:.1f} "
        "s\n"
        "  SLO: TTFT <= {:g} ms and TPOT <= {:g} ms, attainment >= {:g}; TP sizes {{{}}}; {} "
        "candidates, {} meet the target ({:.1f} s)\n",
        run.model.name, run.space.gpus, run.space.gpu, run.workload_label, ts.requests,
        ts.mean_input, ts.mean_output,
        ts.duration_s > 0 ? static_cast<double>(ts.requests - 1) / ts.duration_s : 0, ts.duration_s,
        f.slo_ttft_ms, f.slo_tpot_ms, f.attainment, fmt::join(res.tp_sizes, ","), res.candidates,
        run.meeting, res.wall_s);
    for (const auto& n : res.notes) s += "  note: " + n + "\n";
    s += fmt::format("  {:>4}  {:<22} {:>4} {:>9} {:>9} {:>8} {:>17} {:>13}\n", "rank", "layout",
                     "GPUs", "goodput", "gput/GPU", "attain", "TTFT p50/p90 ms", "TPOT p50/p90");
    const size_t shown = std::min(res.ranked.size(), static_cast<size_t>(f.top));
    for (size_t i = 0; i < shown; ++i) {
        s += table_row(std::to_string(i + 1), res.ranked[i]);
    }
    if (shown < res.ranked.size()) {
        s +=
            fmt::format("  ... {} more{}\n", res.ranked.size() - shown,
                        f.json_path.empty() ? " (--top N or --json F shows them)" : " (in --json)");
    }
    s += best_of_each_mode(res);
    s += "  goodput: requests meeting both SLOs per second of makespan; * = below the attainment "
         "target\n";
    if (run.meeting == 0) s += "  no candidate meets the attainment target at this load\n";
    if (!f.json_path.empty()) s += fmt::format("  wrote {}\n", f.json_path);
    return s;
}

Status run_search_cmd(const SearchFlags& f) {
    PDSIM_RETURN_IF_ERROR(check_flags(f));
    std::optional<topo::ModelShape> topo_model;
    PDSIM_ASSIGN_OR_RETURN(des::SearchSpace space, make_space(f, &topo_model));
    if (f.model.empty() && !topo_model)
        return invalid_argument_error("--model: required (the topology names no model)");
    model::ModelConfig model;
    if (!f.model.empty()) {
        PDSIM_ASSIGN_OR_RETURN(model, des::load_model(f.model, f.layers));
    } else {
        // The topology's model section, whole (its overrides of a built-in included).
        auto m = model::model_from_shape(*topo_model, f.layers);
        if (!m.ok()) {
            return invalid_argument_error(fmt::format("--topology {}: model: {}; pass --model",
                                                      f.topology, m.status().message()));
        }
        model = *std::move(m);
    }
    des::RequestSource src;
    PDSIM_ASSIGN_OR_RETURN(std::vector<workload::Request> requests, search_requests(f, &src));
    const workload::TraceStats ts = workload::summarize(requests);
    PDSIM_ASSIGN_OR_RETURN(des::SearchResult res,
                           des::run_search(search_options(f, space, model), requests));
    const std::string workload_label = des::describe_requests(src);
    SearchRun run{f, space, model, workload_label, ts, res};
    for (const auto& r : res.ranked) run.meeting += r.meets ? 1 : 0;
    if (!f.json_path.empty()) {
        PDSIM_RETURN_IF_ERROR(write_json_file("--json", f.json_path, search_json(run)));
    }
    const std::string s = search_report(run);
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    return {};
}

// The GPU budget, the model and the layouts searched.
void add_space_flags(CLI::App* sub, SearchFlags* f) {
    sub->add_option("--gpu", f->gpu,
                    "GPU type: A100, H100, H200, B200 (DGX nodes of 8) or GB200 "
                    "(NVL72 racks) (default: the topology's, else H100)")
        ->check(non_empty());
    sub->add_option("--gpus", f->gpus, "GPU budget N (default: the topology's GPU count)")
        ->check(int_in(1, kMaxGpus));
    sub->add_option("--topology", f->topology,
                    "take --gpu and --gpus (and the model, without --model) from this topology "
                    "file; its instances are not used")
        ->check(non_empty());
    sub->add_option("--model", f->model, "built-in model name or model YAML/JSON file")
        ->check(non_empty());
    sub->add_option("--layers", f->layers, "override the model's number of layers")
        ->check(int_in(1, kMaxLayers));
}

// The requests: a trace, or a synthetic workload.
void add_request_flags(CLI::App* sub, SearchFlags* f) {
    sub->add_option("--trace", f->req.trace, "trace file: Mooncake .jsonl or Azure .csv")
        ->check(non_empty());
    sub->add_option("--trace-format", f->req.trace_format, "auto|mooncake|azure")
        ->check(CLI::IsMember({"auto", "mooncake", "azure"}))
        ->capture_default_str();
    sub->add_option("--synthetic", f->synthetic, "N synthetic requests instead of a trace")
        ->check(int_in(1, kMaxSyntheticRequests));
    sub->add_option("--rate", f->rate, "synthetic: mean arrival rate, requests/s")
        ->check(real_in(kMinRate, kMaxRate))
        ->capture_default_str();
    sub->add_option("--cv", f->cv,
                    "synthetic: gamma inter-arrivals with this coefficient of variation (0: "
                    "Poisson)")
        ->check(real_in(0, kMaxCv))
        ->capture_default_str();
    sub->add_option("--input-len", f->input_len,
                    "synthetic prompt lengths: fixed:N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--output-len", f->output_len, "synthetic output lengths (as --input-len)")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--seed", f->req.seed, "seed for --synthetic and --sample")
        ->capture_default_str();
    sub->add_option("--max-requests", f->req.max_requests, "trace: the first N requests")
        ->check(int_in(1, kMaxRequestCount));
    sub->add_option("--sample", f->req.sample, "trace: a uniform random sample of N requests")
        ->check(int_in(1, kMaxRequestCount));
    sub->add_option("--max-input-len", f->req.max_input_len, "cap prompt lengths (0: none)")
        ->check(int_in(0, kMaxLengthCap));
    sub->add_option("--max-output-len", f->req.max_output_len, "cap output lengths (0: none)")
        ->check(int_in(0, kMaxLengthCap));
    sub->add_option("--time-scale", f->req.time_scale,
                    "multiply arrival times by X (0.5: twice the request rate)")
        ->check(real_in(0, kMaxTimeScale, /*lo_open=*/true))
        ->capture_default_str();
}

}  // namespace

void add_search_command(CLI::App& app, CommandSet& commands) {
    auto f = std::make_shared<SearchFlags>();
    CLI::App* sub = app.add_subcommand(
        "search",
        "Placement search: every disaggregated (P prefill x TP + D decode x TP) and colocated\n"
        "(C instances x TP) split of a GPU budget, each simulated (roofline costs) on the same\n"
        "requests, ranked by goodput per GPU among those meeting the SLO attainment target.\n"
        "Exit 0 with a table (also when nothing meets the target); 2 on bad input.");
    add_space_flags(sub, f.get());
    add_request_flags(sub, f.get());
    sub->add_option("--slo-ttft-ms", f->slo_ttft_ms, "TTFT SLO, ms")
        ->required()
        ->check(real_in(0, kMaxSloMs, /*lo_open=*/true));
    sub->add_option("--slo-tpot-ms", f->slo_tpot_ms, "TPOT SLO, ms")
        ->required()
        ->check(real_in(0, kMaxSloMs, /*lo_open=*/true));
    sub->add_option("--attainment", f->attainment, "target share of requests meeting both SLOs")
        ->check(real_in(0, 1, /*lo_open=*/true))
        ->capture_default_str();
    sub->add_option("--modes", f->modes, "disagg, colocated or both, comma-separated")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--tp", f->tp, "only these TP sizes, comma-separated (default: all that fit)")
        ->check(non_empty());
    sub->add_option("--min-gpus", f->min_gpus,
                    "only layouts using at least this many GPUs (--gpus: the whole budget)")
        ->check(int_in(1, kMaxGpus))
        ->capture_default_str();
    sub->add_option("--max-candidates", f->max_candidates,
                    "refuse to run more candidates than this")
        ->check(int_in(1, kMaxCandidates))
        ->capture_default_str();
    sub->add_option("--top", f->top, "rows of the table (--json has all)")
        ->check(int_in(0, kMaxCandidates))
        ->capture_default_str();
    sub->add_option("--json", f->json_path, "write every row as JSON here")->check(output_file());
    add_scheduling_flags(sub, f->sched);
    sub->add_flag("--quiet", f->quiet, "no progress line");
    commands.add(sub, [f] { return run_search_cmd(*f); });
}

}  // namespace pdsim::cli
