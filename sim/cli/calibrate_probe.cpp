// The serve probe of `pdsim calibrate` (calibrate.h, "serve probe"): the grid times forwards back
// to back in a worker process; a testbed rank runs the same forwards between its scheduler, its
// transfer engine and its transport's progress threads, on the core mpirun bound it to. The probe
// runs a short `pdsim testbed` under mpirun, bound as docs/testbed.md says, compares its forwards
// with the grid's fit (sim/cost/forward_check.h) and scales each fit by what it measured.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/input_file.h"
#include "common/speed_probe.h"
#include "common/stats.h"
#include "sim/cli/calibrate.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/cost_model.h"
#include "sim/cost/forward_check.h"
#include "sim/cost/timeline_fit.h"
#include "topology/loader.h"
#include "topology/topology.h"

extern char** environ;

namespace pdsim::cli::calibration {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// A probe run that takes longer than this is stopped (the testbed's own timeouts end a stuck run
// well before it).
constexpr auto kProbeTimeout = std::chrono::seconds(300);

// `name` on PATH, or "" when it is not there.
std::string find_on_path(const std::string& name) {
    const char* path = std::getenv("PATH");
    if (path == nullptr) return {};
    std::stringstream ss(path);
    std::string dir;
    while (std::getline(ss, dir, ':')) {
        if (dir.empty()) continue;
        const fs::path p = fs::path(dir) / name;
        if (::access(p.c_str(), X_OK) == 0) return p.string();
    }
    return {};
}

// One prefill and one decode instance of `tp` ranks each, all on this node, no link shaping: the
// forwards are what the probe measures, not the transfer.
std::string probe_topology(int tp) {
    const int world = 2 * tp;
    std::string y = fmt::format(
        "# pdsim calibrate's serve probe: 1 prefill + 1 decode instance of TP {}\n"
        "name: \"calibrate-probe-tp{}\"\nmodel: tiny\nworld_size: {}\nnodes:\n  - id: node0\n"
        "    hostname: localhost\n    devices:\n",
        tp, tp, world);
    for (int r = 0; r < world; ++r) y += fmt::format("      - {{id: node0.cpu{}, type: cpu}}\n", r);
    y += "    switches:\n      - {id: node0.shm, type: loopback}\nlinks:\n";
    for (int r = 0; r < world; ++r) {
        y += fmt::format(
            "  - {{a: node0.cpu{}, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}}\n", r);
    }
    y += "instances:\n";
    for (int i = 0; i < 2; ++i) {
        y += fmt::format("  - id: {}0\n    role: {}\n    tp: {}\n    devices: [",
                         i ? "decode" : "prefill", i ? "decode" : "prefill", tp);
        for (int r = 0; r < tp; ++r) y += fmt::format("{}node0.cpu{}", r ? ", " : "", i * tp + r);
        y += "]\n";
    }
    return y;
}

// The last `n` lines of the file at `path`.
std::string tail_of(const std::string& path, size_t n) {
    std::ifstream in(path);
    std::vector<std::string> lines;
    std::string line;
    while (std::getline(in, line)) lines.push_back(line);
    std::string out;
    for (size_t i = lines.size() > n ? lines.size() - n : 0; i < lines.size(); ++i) {
        out += "\n  " + lines[i];
    }
    return out;
}

// Runs args with stdout and stderr to `log`; kUnavailable when it cannot start, exits non-zero or
// runs past kProbeTimeout (then stopped), with the log's tail.
Status run_logged(const std::vector<std::string>& args, const std::string& log) {
    StatusOr<ChildExit> ex = run_child(args, nullptr, log, kProbeTimeout);
    if (!ex.ok()) return Status(StatusCode::kUnavailable, ex.status().message());
    if (ex->timed_out) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("did not finish in {} s (stopped); {}:{}", kProbeTimeout.count(),
                                  log, tail_of(log, 8)));
    }
    if (ex->code != 0) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("exit {}; {}:{}", ex->code, log, tail_of(log, 8)));
    }
    return {};
}

// The "all" row of (kind, tp, threads) among forwards no other instance overlapped.
const cost::ForwardCheckRow* all_row(const std::vector<cost::ForwardCheckRow>& rows, bool decode,
                                     int tp, int threads) {
    for (const auto& r : rows) {
        if (r.decode == decode && r.tp == tp && r.threads == threads && !r.overlapped &&
            r.bucket == "all") {
            return &r;
        }
    }
    return nullptr;
}

// The testbed report at `path`, parsed; a discarded value when it cannot be read or parsed (what
// the probe takes from it then is missing: the speed level, the ranks' CPUs, the lifecycle).
json read_report(const std::string& path) {
    StatusOr<std::string> bytes = files::read_input_file(path, files::kMaxConfigFileBytes);
    if (!bytes.ok()) return json(json::value_t::discarded);
    return json::parse(*bytes, nullptr, /*allow_exceptions=*/false);
}

// The calibrated cost model of the grid's (tp, threads) fit on CPU ranks with an fp32 pool.
StatusOr<std::unique_ptr<cost::CostModel>> cpu_grid_model(const model::ModelConfig& m,
                                                          const cost::CostFile& grid, int tp,
                                                          int threads) {
    cost::InstanceSpec spec;
    spec.model = m;
    spec.tp = tp;
    spec.threads = threads;
    spec.device = "cpu";
    spec.kv_dtype_bytes = 4;
    return cost::make_cost_model("calibrated", spec, &grid);
}

}  // namespace

json speed_probe_of_fits(const json& fits) {
    std::vector<double> levels;
    std::vector<json> seen;  // --topology: fits of one thread count share their runs
    for (const json& fit : fits) {
        if (!fit.contains("serve_probe")) continue;
        const json runs = fit["serve_probe"].value("speed_cpu_ms", json::array());
        if (fit["serve_probe"].contains("topology")) {
            if (std::find(seen.begin(), seen.end(), runs) != seen.end()) continue;
            seen.push_back(runs);
        }
        for (const json& v : runs) {
            if (v.is_number()) levels.push_back(v.get<double>());
        }
    }
    if (levels.empty()) return json();
    return {{"kernel", std::string(kSpeedProbeKernel)},
            {"cpu_ms_p50", stats::median(levels)},
            {"runs", levels.size()},
            {"source", "the serve probe's testbed ranks (median of the runs' medians)"}};
}

StatusOr<ChildExit> run_child(const std::vector<std::string>& args,
                              const std::vector<std::string>* env, const std::string& log,
                              std::chrono::seconds timeout) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (!log.empty()) {
        posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        posix_spawn_file_actions_adddup2(&fa, 1, 2);
        posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    }
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_copy;
    std::vector<char*> envp;
    if (env != nullptr) {
        env_copy = *env;
        for (auto& e : env_copy) envp.push_back(e.data());
        envp.push_back(nullptr);
    }
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, copy[0].c_str(), &fa, nullptr, argv.data(),
                               env != nullptr ? envp.data() : environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        return Status(StatusCode::kInternal,
                      fmt::format("cannot start {}: {}", copy[0], std::strerror(rc)));
    }
    ChildExit ex;
    int status = 0;
    if (timeout.count() <= 0) {
        while (::waitpid(pid, &status, 0) < 0) {
            if (errno != EINTR) return PDSIM_ERROR(StatusCode::kInternal, "waitpid failed");
        }
    } else {
        const auto deadline = Clock::now() + timeout;
        for (;;) {
            const pid_t w = ::waitpid(pid, &status, WNOHANG);
            if (w == pid) break;
            if (w < 0 && errno != EINTR) {
                return PDSIM_ERROR(StatusCode::kInternal, "waitpid failed");
            }
            if (Clock::now() > deadline) {
                ::kill(pid, SIGTERM);
                std::this_thread::sleep_for(std::chrono::seconds(3));
                ::kill(pid, SIGKILL);
                while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
                }
                ex.timed_out = true;
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }
    ex.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return ex;
}

std::vector<std::string> serve_probe_command(const CalibrateOptions& o, const std::string& mpirun,
                                             const std::string& exe, int ranks, int threads,
                                             const std::string& topology,
                                             const ProbeWorkload& workload, const ProbeOutputs& out,
                                             int seed) {
    std::vector<std::string> a = {mpirun};
    if (::geteuid() == 0) a.push_back("--allow-run-as-root");
    for (const char* s : {"--oversubscribe", "-np"}) a.emplace_back(s);
    a.push_back(std::to_string(ranks));
    if (o.bind == "core") {
        for (const char* s : {"--map-by", "core", "--bind-to", "core:overload-allowed"}) {
            a.emplace_back(s);
        }
    }
    for (const char* s : {"--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"}) {
        a.emplace_back(s);
    }
    std::vector<std::string> testbed = {exe,
                                        "testbed",
                                        "--topology",
                                        topology,
                                        "--model",
                                        o.model,
                                        "--backend",
                                        o.backend,
                                        "--page-size",
                                        std::to_string(o.page_size),
                                        "--threads",
                                        std::to_string(threads),
                                        "--stream-sync",
                                        o.stream_sync,
                                        "--mode",
                                        "disagg"};
    if (workload.synthetic > 0) {
        for (const std::string& s :
             {std::string("--synthetic"), std::to_string(workload.synthetic),
              std::string("--time-scale"), fmt::format("{:.6g}", workload.time_scale)}) {
            testbed.push_back(s);
        }
    } else {
        testbed.emplace_back("--max-requests");
        testbed.push_back(std::to_string(workload.max_requests));
    }
    for (const std::string& s :
         {std::string("--seed"), std::to_string(seed), std::string("--quiet"),
          std::string("--timeline"), out.timeline, std::string("--report"), out.report}) {
        testbed.push_back(s);
    }
    if (!out.requests.empty()) {
        testbed.emplace_back("--requests");
        testbed.push_back(out.requests);
    }
    a.insert(a.end(), testbed.begin(), testbed.end());
    return a;
}

namespace {

// One probe run, read back.
struct ProbeRun {
    std::vector<cost::TimelineForward> forwards;  // every forward of the run's timeline
    std::vector<bool> warmup;                     // cost::decode_warmup of `forwards`
    std::vector<cost::ForwardCheckRow> rows;      // the forwards outside warm-up against the grid
    std::optional<double> speed_ms;               // the ranks' speed probe level
    std::string timeline, requests;               // the run's files (requests: "" if not asked)
    std::string report;                           // the report's path
    json lifecycle;                               // the report's lifecycle (null if none)
    // Per instance (the topology's order, as the timeline numbers them): the CPUs its ranks ran
    // on (from the report's ranks[].stats.cpus), and, where every rank was bound to one core,
    // the core of each rank (cost::overlap_splits' bound model; else empty).
    std::vector<std::vector<int>> instance_cpus;
    std::vector<std::vector<int>> rank_cores;
};

// instance_cpus and rank_cores of a run from its report (see ProbeRun); `instance_ids` in the
// topology's order. A report without ranks leaves both empty (the node-wide model then).
void read_rank_cpus(const json& report, const std::vector<std::string>& instance_ids,
                    ProbeRun* run) {
    if (!report.is_object() || !report.contains("ranks") || !report["ranks"].is_array()) return;
    std::vector<std::vector<int>> cpus(instance_ids.size()), cores(instance_ids.size());
    bool bound = true;
    for (const json& rank : report["ranks"]) {
        if (!rank.is_object()) continue;
        const std::string id = rank.value("instance", std::string());
        const auto it = std::find(instance_ids.begin(), instance_ids.end(), id);
        if (it == instance_ids.end()) continue;
        const size_t i = static_cast<size_t>(it - instance_ids.begin());
        const json stats = rank.value("stats", json::object());
        const json list = stats.is_object() ? stats.value("cpus", json::array()) : json::array();
        std::vector<int> mine;
        for (const json& c : list) {
            if (c.is_number_integer()) mine.push_back(c.get<int>());
        }
        cpus[i].insert(cpus[i].end(), mine.begin(), mine.end());
        if (mine.size() == 1) {
            cores[i].push_back(mine.front());
        } else {
            bound = false;
        }
    }
    run->instance_cpus = std::move(cpus);
    if (bound) run->rank_cores = std::move(cores);
}

// The probe's runs of one layout: `runs` testbed runs (seeds 1, 2, ...) of `topology` with `ranks`
// ranks and `threads` threads per rank, each compared with the grid.
struct ProbeSet {
    std::string label;  // "tp 1 threads 1", "topology cpu-2p1d threads 1"
    std::string topology;
    int ranks = 0;
    int threads = 1;
    ProbeWorkload workload;
    bool per_request = false;               // also write the per-request CSV
    std::vector<std::string> instance_ids;  // the topology's instances, in order
};

StatusOr<std::vector<ProbeRun>> run_probe_set(const CalibrateOptions& o, const ProbeSet& set,
                                              const std::string& mpirun, const std::string& exe,
                                              const fs::path& dir, const std::string& stem,
                                              const cost::CostFile& grid,
                                              const model::ModelConfig& m) {
    const int runs = o.quick ? 1 : kServeProbeRuns;
    const std::string log = (dir / (stem + ".log")).string();
    std::vector<ProbeRun> out;
    for (int run = 0; run < runs; ++run) {
        ProbeOutputs files;
        files.timeline = (dir / fmt::format("{}-r{}-timeline.json", stem, run)).string();
        files.report = (dir / fmt::format("{}-r{}-report.json", stem, run)).string();
        if (set.per_request) {
            files.requests = (dir / fmt::format("{}-r{}-requests.csv", stem, run)).string();
        }
        const auto args = serve_probe_command(o, mpirun, exe, set.ranks, set.threads, set.topology,
                                              set.workload, files, run + 1);
        std::string shown;
        for (const auto& a : args) shown += (shown.empty() ? "" : " ") + a;
        std::fprintf(stderr, "calibrate: serve probe %s, run %d/%d: %s\n", set.label.c_str(),
                     run + 1, runs, shown.c_str());
        if (Status st = run_logged(args, log); !st.ok()) {
            return Status(StatusCode::kUnavailable,
                          fmt::format("serve probe for {} (`{}`): {} (--serve-probe off skips it)",
                                      set.label, shown, st.message()));
        }
        ProbeRun r;
        r.timeline = files.timeline;
        r.report = files.report;
        r.requests = files.requests;
        PDSIM_ASSIGN_OR_RETURN(r.forwards,
                               cost::read_timeline_forwards(files.timeline, "serve probe"));
        r.warmup = cost::decode_warmup(r.forwards, cost::kWakeMinIdleS, kServeProbeWarmupForwards);
        std::vector<cost::TimelineForward> kept;
        for (size_t i = 0; i < r.forwards.size(); ++i) {
            if (!r.warmup[i]) kept.push_back(r.forwards[i]);
        }
        PDSIM_ASSIGN_OR_RETURN(r.rows, cost::check_forwards(kept, grid, m));
        const json report = read_report(files.report);
        read_rank_cpus(report, set.instance_ids, &r);
        if (report.is_object() && report.contains("lifecycle")) r.lifecycle = report["lifecycle"];
        if (std::optional<cost::SpeedLevel> level = cost::report_speed_level(report);
            level && level->kernel == kSpeedProbeKernel) {
            r.speed_ms = level->cpu_ms_p50;
        }
        out.push_back(std::move(r));
    }
    return out;
}

// Scales `fit` by what `runs` measured of its (tp, threads) forwards, and records
// fit["serve_probe"] and fit["interference"] (calibrate.h). kUnavailable for a factor outside
// kServeProbeFactorRange (the fit is then left as it was).
Status scale_fit(const CalibrateOptions& o, const model::ModelConfig& m, const cost::CostFile& grid,
                 const std::vector<ProbeRun>& runs, const std::string& label, int requests,
                 double wall_s, json& fit, json* notes) {
    const int tp = fit.at("tp").get<int>();
    const int threads = fit.at("threads").get<int>();
    std::vector<double> ratios[2];     // extend, decode: per run with enough forwards
    std::vector<double> speed_levels;  // per run: its ranks' speed probe (ms)
    // Forwards another instance overlapped (runs pooled), for the fit's interference: the
    // grid's prediction against the alone / shared split the contention model sees.
    struct Overlapped {
        bool decode = false;
        double alone_s = 0, shared_core_s = 0, grid_s = 0;
    };
    std::vector<Overlapped> overlapped;
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<cost::CostModel> grid_model,
                           cpu_grid_model(m, grid, tp, threads));
    size_t counts[2] = {0, 0};
    for (const ProbeRun& run : runs) {
        for (const cost::OverlapSplit& split :
             cost::overlap_splits(run.forwards, cores(), run.rank_cores)) {
            const cost::TimelineForward& f = run.forwards[split.index];
            if (run.warmup[split.index] || f.tp != tp || f.threads != threads) continue;
            const double grid_s = f.decode ? grid_model->decode_s(f.batch, f.kv_tokens)
                                           : grid_model->extend_s(f.items);
            overlapped.push_back({f.decode, split.alone_s, split.shared_core_s, grid_s});
        }
        if (run.speed_ms) speed_levels.push_back(*run.speed_ms);
        for (bool decode : {false, true}) {
            const cost::ForwardCheckRow* row = all_row(run.rows, decode, tp, threads);
            if (row == nullptr) continue;
            counts[decode ? 1 : 0] += row->count;
            if (row->count >= kMinServeProbeForwards && row->predicted_ms_sum > 0) {
                ratios[decode ? 1 : 0].push_back(row->measured_ms_sum / row->predicted_ms_sum);
            }
        }
    }
    json probe = {{"requests", requests},
                  {"runs", runs.size()},
                  {"wall_s", wall_s},
                  {"speed_cpu_ms", speed_levels}};
    if (!o.topology.empty()) probe["topology"] = o.topology;
    for (bool decode : {false, true}) {
        const char* kind = decode ? "decode" : "extend";
        const std::vector<double>& per_run = ratios[decode ? 1 : 0];
        probe[fmt::format("{}_forwards", kind)] = counts[decode ? 1 : 0];
        probe[fmt::format("{}_run_factors", kind)] = per_run;
        if (per_run.empty()) {
            notes->push_back(fmt::format(
                "serve probe {}: no run had {} {} forwards of tp {} threads {} without another "
                "instance computing: {} kept the grid's fit",
                label, kMinServeProbeForwards, kind, tp, threads, kind));
            probe[fmt::format("{}_factor", kind)] = 1.0;
            continue;
        }
        const double factor = stats::median(per_run);
        if (!(factor >= kServeProbeFactorRange.first && factor <= kServeProbeFactorRange.second)) {
            return Status(StatusCode::kUnavailable,
                          fmt::format("serve probe for tp {} threads {}: the testbed's {} "
                                      "forwards took {:.2f}x the grid's prediction, outside "
                                      "[{}, {}]: was the machine busy? (--serve-probe off "
                                      "skips it)",
                                      tp, threads, kind, factor, kServeProbeFactorRange.first,
                                      kServeProbeFactorRange.second));
        }
        probe[fmt::format("{}_factor", kind)] = factor;
    }
    // Interference (cost_model.h) in this layout, per kind: with iso the scaled grid's time
    // alone, iso = alone_s + shared_core_s / (1 + x) over the overlapped forwards, solved as a
    // ratio of sums (as calibrate --from-timeline does); none from fewer than
    // kMinServeProbeForwards, or when they ran faster than the core share alone predicts.
    json interference = json::object();
    json overlapped_counts = json::object();
    for (bool decode : {false, true}) {
        const char* kind = decode ? "decode" : "extend";
        const double factor = probe[fmt::format("{}_factor", kind)].get<double>();
        double num = 0, den = 0;
        size_t n = 0;
        for (const Overlapped& ov : overlapped) {
            if (ov.decode != decode) continue;
            num += ov.shared_core_s;
            den += ov.grid_s * factor - ov.alone_s;
            ++n;
        }
        interference[kind] =
            n >= kMinServeProbeForwards && den > 0 ? std::max(0.0, num / den - 1) : 0.0;
        overlapped_counts[kind] = n;
    }
    interference["node_cpus"] = cores();
    interference["overlapped_forwards"] = std::move(overlapped_counts);
    // Both kinds checked: only now is the fit scaled (a failed probe leaves it the grid's).
    for (bool decode : {false, true}) {
        const char* kind = decode ? "decode" : "extend";
        const double factor = probe[fmt::format("{}_factor", kind)].get<double>();
        const auto& keys = decode ? std::span<const char* const>(cost::kDecodeKeys)
                                  : std::span<const char* const>(cost::kExtendKeys);
        for (auto& [key, value] : fit.at(kind).items()) {
            const bool coefficient =
                std::any_of(keys.begin(), keys.end(), [&](const char* k) { return key == k; });
            if (coefficient && value.is_number()) value = value.get<double>() * factor;
        }
    }
    std::fprintf(stderr,
                 "calibrate: serve probe tp %d threads %d: testbed forwards / grid fit = "
                 "extend %.3f (%zu forwards), decode %.3f (%zu forwards); %.1f s\n",
                 tp, threads, probe["extend_factor"].get<double>(),
                 probe["extend_forwards"].get<size_t>(), probe["decode_factor"].get<double>(),
                 probe["decode_forwards"].get<size_t>(), wall_s);
    std::fprintf(stderr,
                 "calibrate: serve probe tp %d threads %d: interference extend %+.1f%% (%zu "
                 "overlapped forwards), decode %+.1f%% (%zu)\n",
                 tp, threads, 100 * interference["extend"].get<double>(),
                 interference["overlapped_forwards"]["extend"].get<size_t>(),
                 100 * interference["decode"].get<double>(),
                 interference["overlapped_forwards"]["decode"].get<size_t>());
    fit["interference"] = std::move(interference);
    fit["serve_probe"] = std::move(probe);
    return {};
}

// --topology's workload: kTopologyProbeRequests synthetic requests (the testbed's --synthetic:
// prompts uniform in 64-1024 tokens, Poisson arrivals at 4 req/s) at a time scale that offers
// kTopologyProbeLoad of the prefill capacity the grid predicts for the topology: each prefill
// instance serves 1 / (its mean prompt's prefill time, in chunks of 512) requests a second, and
// together they cannot use more than the node's cores. kInvalidArgument for a topology without
// prefill instances or with a TP the fits do not have.
StatusOr<ProbeWorkload> topology_probe_workload(const CalibrateOptions& o,
                                                const model::ModelConfig& m,
                                                const cost::CostFile& grid,
                                                const topo::Topology& topology, int threads) {
    constexpr int64_t kChunk = 512;
    double rate = 0, core_s = 0;
    int prefill = 0;
    for (const topo::Instance& inst : topology.instances) {
        if (inst.role != topo::Role::kPrefill) continue;
        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<cost::CostModel> model,
                               cpu_grid_model(m, grid, inst.tp, threads));
        double sum_s = 0;
        int n = 0;
        for (int64_t len = 64; len <= 1024; len += 32, ++n) {
            for (int64_t done = 0; done < len; done += kChunk) {
                const cost::ExtendItem item{std::min(kChunk, len - done), done};
                sum_s += model->extend_s(std::span(&item, 1));
            }
        }
        const double mean_s = sum_s / n;
        rate += 1 / mean_s;
        core_s += mean_s * inst.tp * threads;
        ++prefill;
    }
    if (prefill == 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--topology {}: no prefill instance", o.topology));
    }
    rate = std::min(rate, cores() / (core_s / prefill));
    ProbeWorkload w;
    w.synthetic = o.quick ? 24 : kTopologyProbeRequests;
    w.time_scale = kSyntheticRate / (kTopologyProbeLoad * rate);
    return w;
}

// The core wait (cost::CoreWait) from the topology probe's runs: the requests that reached an
// idle prefill instance while another instance computed on its cores (cost::dispatch_waits),
// with each instance's cores from the report's ranks (stats.cpus).
StatusOr<json> measure_core_wait(const std::vector<const ProbeRun*>& runs) {
    std::vector<double> busy, idle;
    for (const ProbeRun* run_ptr : runs) {
        const ProbeRun& run = *run_ptr;
        if (!run.lifecycle.is_array() || run.instance_cpus.empty()) {
            return Status(StatusCode::kUnavailable,
                          fmt::format("serve probe: {} has no ranks or lifecycle", run.report));
        }
        // The per-request CSV names each request's prefill instance; the timeline's request
        // slices ("rID to first token", from arrival) put the report's clock on the timeline's.
        PDSIM_ASSIGN_OR_RETURN(std::string csv,
                               files::read_input_file(run.requests, files::kMaxConfigFileBytes));
        const auto split = [](const std::string& line) {
            std::vector<std::string> cells;
            std::stringstream in(line);
            for (std::string cell; std::getline(in, cell, ',');) cells.push_back(cell);
            return cells;
        };
        std::map<int64_t, int> instance_of;
        std::istringstream lines(csv);
        std::string line;
        std::getline(lines, line);  // the header (metrics::requests_csv_header)
        const std::vector<std::string> header = split(line);
        const auto column = std::find(header.begin(), header.end(), "prefill_instance");
        if (header.empty() || header[0] != "id" || column == header.end()) {
            return Status(StatusCode::kUnavailable,
                          fmt::format("serve probe: {} has no id and prefill_instance columns",
                                      run.requests));
        }
        const size_t at = static_cast<size_t>(column - header.begin());
        while (std::getline(lines, line)) {
            const std::vector<std::string> cells = split(line);
            int64_t id = 0;
            int instance = 0;
            if (cells.size() <= at ||
                std::from_chars(cells[0].data(), cells[0].data() + cells[0].size(), id).ec !=
                    std::errc() ||
                std::from_chars(cells[at].data(), cells[at].data() + cells[at].size(), instance)
                        .ec != std::errc()) {
                continue;
            }
            instance_of[id] = instance;
        }
        PDSIM_ASSIGN_OR_RETURN(const auto arrivals,
                               cost::read_timeline_arrivals(run.timeline, "serve probe"));
        std::vector<cost::DispatchRequest> requests;
        for (const json& r : run.lifecycle) {
            if (!r.value("ok", false)) continue;
            const int64_t id = r.value("id", int64_t{-1});
            const auto inst = instance_of.find(id);
            const auto arrival = arrivals.find(id);
            if (inst == instance_of.end() || arrival == arrivals.end()) continue;
            const double wait_us =
                (r.value("prefill_start_ms", 0.0) - r.value("arrival_ms", 0.0)) * 1e3;
            requests.push_back({.arrival_us = arrival->second,
                                .prefill_start_us = arrival->second + wait_us,
                                .instance = inst->second});
        }
        const cost::DispatchWaits w =
            cost::dispatch_waits(requests, run.forwards, run.instance_cpus);
        busy.insert(busy.end(), w.core_busy_s.begin(), w.core_busy_s.end());
        idle.insert(idle.end(), w.idle_s.begin(), w.idle_s.end());
    }
    const auto mean = [](const std::vector<double>& v) {
        double sum = 0;
        for (double x : v) sum += x;
        return sum / static_cast<double>(v.size());
    };
    json out = {{"events", busy.size()}, {"idle_events", idle.size()}};
    if (!idle.empty()) out["idle_dispatch_ms"] = mean(idle) * 1e3;
    if (busy.size() >= kMinCoreWaitEvents) out["dispatch_ms"] = mean(busy) * 1e3;
    return out;
}

// The step wait (cost::StepWait) from the topology probe's runs: the gaps between each run's
// consecutive decode forwards, by the other instances computing on the decode's cores.
json measure_step_wait(const std::vector<const ProbeRun*>& runs) {
    std::vector<cost::StepGap> gaps;
    for (const ProbeRun* run : runs) {
        const std::vector<cost::StepGap> g =
            cost::decode_step_gaps(run->forwards, run->instance_cpus);
        gaps.insert(gaps.end(), g.begin(), g.end());
    }
    return cost::fit_step_wait(gaps, kMinStepWaitGaps);
}

}  // namespace

Status apply_serve_probe(const CalibrateOptions& o, const model::ModelConfig& m,
                         const json& cost_json, json* fits, json* notes, json* core_wait,
                         json* step_wait) {
    const std::string mpirun = find_on_path("mpirun");
    if (mpirun.empty()) {
        notes->push_back("serve probe: skipped (no mpirun on PATH): the fits are the grid's alone");
        return {};
    }
    PDSIM_ASSIGN_OR_RETURN(cost::CostFile grid, cost::CostFile::from_json(cost_json, o.out));
    std::optional<topo::Topology> topology;
    if (!o.topology.empty()) {
        PDSIM_ASSIGN_OR_RETURN(topology, topo::load_topology(o.topology));
    }
    const std::string exe = fs::read_symlink("/proc/self/exe").string();
    const fs::path dir = fs::temp_directory_path() / fmt::format("pdsim-probe-{}", ::getpid());
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("serve probe: cannot create {}: {}", dir.string(), ec.message()));
    }
    struct Cleanup {
        fs::path dir;
        ~Cleanup() {
            std::error_code e;
            fs::remove_all(dir, e);
        }
    } cleanup{dir};
    // --topology: one set of runs per thread count, shared by the fits of that thread count.
    struct SharedRuns {
        std::vector<ProbeRun> runs;
        double wall_s = 0;
        int requests = 0;
    };
    std::map<int, SharedRuns> topology_runs;  // by threads
    for (json& fit : *fits) {
        const int tp = fit.at("tp").get<int>();
        const int threads = fit.at("threads").get<int>();
        ProbeSet set;
        set.threads = threads;
        if (topology) {
            auto it = topology_runs.find(threads);
            if (it == topology_runs.end()) {
                set.label = fmt::format("topology {} threads {}", o.topology, threads);
                set.topology = o.topology;
                set.ranks = topology->num_ranks();
                PDSIM_ASSIGN_OR_RETURN(set.workload,
                                       topology_probe_workload(o, m, grid, *topology, threads));
                set.per_request = true;
                for (const topo::Instance& inst : topology->instances) {
                    set.instance_ids.push_back(inst.id);
                }
                const auto t0 = Clock::now();
                PDSIM_ASSIGN_OR_RETURN(
                    std::vector<ProbeRun> runs,
                    run_probe_set(o, set, mpirun, exe, dir, fmt::format("topology-t{}", threads),
                                  grid, m));
                SharedRuns shared{
                    .runs = std::move(runs),
                    .wall_s = std::chrono::duration<double>(Clock::now() - t0).count(),
                    .requests = set.workload.synthetic};
                it = topology_runs.emplace(threads, std::move(shared)).first;
            }
            PDSIM_RETURN_IF_ERROR(scale_fit(o, m, grid, it->second.runs,
                                            fmt::format("topology {}", o.topology),
                                            it->second.requests, it->second.wall_s, fit, notes));
            continue;
        }
        const std::string stem = fmt::format("tp{}-t{}", tp, threads);
        set.label = fmt::format("tp {} threads {}", tp, threads);
        set.topology = (dir / (stem + ".yaml")).string();
        set.ranks = 2 * tp;
        set.workload.max_requests = o.quick ? 24 : kServeProbeRequests;
        set.instance_ids = {"prefill0", "decode0"};  // probe_topology's
        {
            std::ofstream out(set.topology);
            out << probe_topology(tp);
            if (!out) {
                return Status(StatusCode::kUnavailable,
                              fmt::format("serve probe: cannot write {}", set.topology));
            }
        }
        const auto t0 = Clock::now();
        PDSIM_ASSIGN_OR_RETURN(std::vector<ProbeRun> runs,
                               run_probe_set(o, set, mpirun, exe, dir, stem, grid, m));
        PDSIM_RETURN_IF_ERROR(scale_fit(o, m, grid, runs, set.label, set.workload.max_requests,
                                        std::chrono::duration<double>(Clock::now() - t0).count(),
                                        fit, notes));
    }
    if (topology) {
        std::vector<const ProbeRun*> all_runs;
        for (const auto& [threads, shared] : topology_runs) {
            for (const ProbeRun& run : shared.runs) all_runs.push_back(&run);
        }
        PDSIM_ASSIGN_OR_RETURN(json wait, measure_core_wait(all_runs));
        wait["topology"] = o.topology;
        wait["runs"] = all_runs.size();
        if (wait.contains("dispatch_ms")) {
            std::fprintf(stderr,
                         "calibrate: serve probe topology %s: work reaching an idle instance "
                         "while another computed on its cores waited %.2f ms (%zu requests; "
                         "%.2f ms with its cores idle)\n",
                         o.topology.c_str(), wait["dispatch_ms"].get<double>(),
                         wait["events"].get<size_t>(), wait.value("idle_dispatch_ms", 0.0));
            *core_wait = std::move(wait);
        } else {
            notes->push_back(fmt::format(
                "serve probe topology {}: {} requests reached an idle instance while another "
                "computed on its cores, fewer than {}: no core_wait",
                o.topology, wait["events"].get<size_t>(), kMinCoreWaitEvents));
        }
        json step = measure_step_wait(all_runs);
        step["topology"] = o.topology;
        step["runs"] = all_runs.size();
        if (!step["decode"].empty()) {
            for (const json& row : step["decode"]) {
                std::fprintf(stderr,
                             "calibrate: serve probe topology %s: with %d other instance(s) "
                             "computing on its cores, %.0f%% of %zu decode steps waited a slice "
                             "(%.2f ms) for the next, which made the step %.2f ms longer\n",
                             o.topology.c_str(), row["competitors"].get<int>(),
                             100 * row["chance"].get<double>(), row["gaps"].get<size_t>(),
                             row["slice_ms"].get<double>(), row["wait_ms"].get<double>());
            }
            *step_wait = std::move(step);
        } else {
            notes->push_back(fmt::format(
                "serve probe topology {}: fewer than {} decode steps ended while another instance "
                "computed on the decode's cores: no step_wait",
                o.topology, kMinStepWaitGaps));
        }
    }
    return {};
}

}  // namespace pdsim::cli::calibration
