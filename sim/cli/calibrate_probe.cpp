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
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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

// The speed probe's level in the testbed report at `path` (nullopt when it has none or cannot be
// read: the probe's factors do not depend on it).
std::optional<cost::SpeedLevel> read_speed_level(const std::string& path) {
    StatusOr<std::string> bytes = files::read_input_file(path, files::kMaxConfigFileBytes);
    if (!bytes.ok()) return std::nullopt;
    const json report = json::parse(*bytes, nullptr, /*allow_exceptions=*/false);
    return cost::report_speed_level(report);
}

}  // namespace

json speed_probe_of_fits(const json& fits) {
    std::vector<double> levels;
    for (const json& fit : fits) {
        if (!fit.contains("serve_probe")) continue;
        for (const json& v : fit["serve_probe"].value("speed_cpu_ms", json::array())) {
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
                                             const std::string& exe, int tp, int threads,
                                             const std::string& topology,
                                             const std::string& timeline, const std::string& report,
                                             int seed) {
    std::vector<std::string> a = {mpirun};
    if (::geteuid() == 0) a.push_back("--allow-run-as-root");
    for (const char* s : {"--oversubscribe", "-np"}) a.emplace_back(s);
    a.push_back(std::to_string(2 * tp));
    if (o.bind == "core") {
        for (const char* s : {"--map-by", "core", "--bind-to", "core:overload-allowed"}) {
            a.emplace_back(s);
        }
    }
    for (const char* s : {"--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"}) {
        a.emplace_back(s);
    }
    const std::vector<std::string> testbed = {exe,
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
                                              "disagg",
                                              "--max-requests",
                                              std::to_string(o.quick ? 24 : kServeProbeRequests),
                                              "--seed",
                                              std::to_string(seed),
                                              "--quiet",
                                              "--timeline",
                                              timeline,
                                              "--report",
                                              report};
    a.insert(a.end(), testbed.begin(), testbed.end());
    return a;
}

Status apply_serve_probe(const CalibrateOptions& o, const model::ModelConfig& m,
                         const json& cost_json, json* fits, json* notes) {
    const std::string mpirun = find_on_path("mpirun");
    if (mpirun.empty()) {
        notes->push_back("serve probe: skipped (no mpirun on PATH): the fits are the grid's alone");
        return {};
    }
    PDSIM_ASSIGN_OR_RETURN(cost::CostFile grid, cost::CostFile::from_json(cost_json, o.out));
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
    for (json& fit : *fits) {
        const int tp = fit.at("tp").get<int>();
        const int threads = fit.at("threads").get<int>();
        const std::string stem = fmt::format("tp{}-t{}", tp, threads);
        const std::string topology = (dir / (stem + ".yaml")).string();
        const std::string report = (dir / (stem + "-report.json")).string();
        const std::string log = (dir / (stem + ".log")).string();
        {
            std::ofstream out(topology);
            out << probe_topology(tp);
            if (!out) {
                return Status(StatusCode::kUnavailable,
                              fmt::format("serve probe: cannot write {}", topology));
            }
        }
        // kServeProbeRuns runs (--quick: 1), each compared with the grid on its own: the run's
        // level moves by several percent (the machine's slow periods), so the factor is the
        // median of the runs' medians.
        const int runs = o.quick ? 1 : kServeProbeRuns;
        std::vector<double> ratios[2];     // extend, decode: per run with enough forwards
        std::vector<double> speed_levels;  // per run: its ranks' speed probe (ms)
        // Forwards another instance overlapped (runs pooled), for the fit's interference: the
        // grid's prediction against the alone / shared split the contention model sees.
        struct Overlapped {
            bool decode = false;
            double alone_s = 0, shared_core_s = 0, grid_s = 0;
        };
        std::vector<Overlapped> overlapped;
        cost::InstanceSpec spec;
        spec.model = m;
        spec.tp = tp;
        spec.threads = threads;
        spec.device = "cpu";
        spec.kv_dtype_bytes = 4;
        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<cost::CostModel> grid_model,
                               cost::make_cost_model("calibrated", spec, &grid));
        size_t counts[2] = {0, 0};
        const auto t0 = Clock::now();
        for (int run = 0; run < runs; ++run) {
            const std::string timeline =
                (dir / fmt::format("{}-r{}-timeline.json", stem, run)).string();
            const auto args = serve_probe_command(o, mpirun, exe, tp, threads, topology, timeline,
                                                  report, run + 1);
            std::string shown;
            for (const auto& a : args) shown += (shown.empty() ? "" : " ") + a;
            std::fprintf(stderr, "calibrate: serve probe tp %d threads %d, run %d/%d: %s\n", tp,
                         threads, run + 1, runs, shown.c_str());
            if (Status st = run_logged(args, log); !st.ok()) {
                return Status(StatusCode::kUnavailable,
                              fmt::format("serve probe for tp {} threads {} (`{}`): {} "
                                          "(--serve-probe off skips it)",
                                          tp, threads, shown, st.message()));
            }
            PDSIM_ASSIGN_OR_RETURN(std::vector<cost::TimelineForward> all_forwards,
                                   cost::read_timeline_forwards(timeline, "serve probe"));
            const std::vector<bool> warmup =
                cost::decode_warmup(all_forwards, cost::kWakeMinIdleS, kServeProbeWarmupForwards);
            std::vector<cost::TimelineForward> forwards;
            for (size_t i = 0; i < all_forwards.size(); ++i) {
                if (!warmup[i]) forwards.push_back(all_forwards[i]);
            }
            for (const cost::OverlapSplit& split : cost::overlap_splits(all_forwards, cores())) {
                const cost::TimelineForward& f = all_forwards[split.index];
                if (warmup[split.index] || f.tp != tp || f.threads != threads) continue;
                const double grid_s = f.decode ? grid_model->decode_s(f.batch, f.kv_tokens)
                                               : grid_model->extend_s(f.items);
                overlapped.push_back({f.decode, split.alone_s, split.shared_core_s, grid_s});
            }
            PDSIM_ASSIGN_OR_RETURN(std::vector<cost::ForwardCheckRow> rows,
                                   cost::check_forwards(forwards, grid, m));
            if (std::optional<cost::SpeedLevel> level = read_speed_level(report);
                level && level->kernel == kSpeedProbeKernel) {
                speed_levels.push_back(level->cpu_ms_p50);
            }
            for (bool decode : {false, true}) {
                // The probe's prefill and decode instances both run with this fit's (tp, threads).
                const cost::ForwardCheckRow* row = all_row(rows, decode, tp, threads);
                if (row == nullptr) continue;
                counts[decode ? 1 : 0] += row->count;
                if (row->count >= kMinServeProbeForwards && row->predicted_ms_sum > 0) {
                    ratios[decode ? 1 : 0].push_back(row->measured_ms_sum / row->predicted_ms_sum);
                }
            }
        }
        json probe = {{"requests", o.quick ? 24 : kServeProbeRequests},
                      {"runs", runs},
                      {"wall_s", std::chrono::duration<double>(Clock::now() - t0).count()},
                      {"speed_cpu_ms", speed_levels}};
        for (bool decode : {false, true}) {
            const char* kind = decode ? "decode" : "extend";
            const std::vector<double>& per_run = ratios[decode ? 1 : 0];
            probe[fmt::format("{}_forwards", kind)] = counts[decode ? 1 : 0];
            probe[fmt::format("{}_run_factors", kind)] = per_run;
            if (per_run.empty()) {
                notes->push_back(fmt::format(
                    "serve probe tp {} threads {}: no run had {} {} forwards without another "
                    "instance computing: {} kept the grid's fit",
                    tp, threads, kMinServeProbeForwards, kind, kind));
                probe[fmt::format("{}_factor", kind)] = 1.0;
                continue;
            }
            const double factor = stats::median(per_run);
            if (!(factor >= kServeProbeFactorRange.first &&
                  factor <= kServeProbeFactorRange.second)) {
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
                     probe["decode_forwards"].get<size_t>(), probe["wall_s"].get<double>());
        std::fprintf(stderr,
                     "calibrate: serve probe tp %d threads %d: interference extend %+.1f%% (%zu "
                     "overlapped forwards), decode %+.1f%% (%zu)\n",
                     tp, threads, 100 * interference["extend"].get<double>(),
                     interference["overlapped_forwards"]["extend"].get<size_t>(),
                     100 * interference["decode"].get<double>(),
                     interference["overlapped_forwards"]["decode"].get<size_t>());
        fit["interference"] = std::move(interference);
        fit["serve_probe"] = std::move(probe);
    }
    return {};
}

}  // namespace pdsim::cli::calibration
