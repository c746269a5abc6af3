// `pdsim calibrate`: measures, on this machine and with the testbed's own code, what the calibrated
// cost model (sim/cost/calibrated.h) needs, fits it, and writes the cost file
// (docs/cost-models.md).
//
// Compute. For each requested TP size and thread count, a worker process (this binary again,
// `calibrate --worker TP:THREADS`, so that the process-wide projection ThreadPool gets the size a
// testbed rank has: PDSIM_NUM_THREADS = threads, as mpirun'd testbed ranks set it) builds what a
// testbed rank builds (Server::setup): the synthetic model, a CpuStream, an fp32 MHA pool of
// --page-size pages, the attention backend (--backend) with `threads` kernel threads wrapped in
// the testbed's PdAttentionBackend (extend: with the prefill side's StepCounter and ordering
// checksums; decode: without, as on a decode rank). TP > 1: the TP ranks are threads of the worker
// sharing a LocalTpGroup (how `pdsim testbed` runs without mpirun), each with its own model,
// stream, pool and backend, running every forward together; rank 0 is timed. A forward is timed
// like the testbed's Server::execute: enqueue the model's forward, synchronize the stream, with
// the testbed's --stream-sync (caller by default: the rank's thread runs the forward; with worker
// the stream's thread does, and each forward pays two thread wake-ups, about 0.1-0.2 ms on the
// 2-core VM, which a grid fitted that way adds to every testbed forward).
// Grid: extend forwards over (requests, new tokens, cached tokens) and decode forwards over
// (batch, KV tokens per request) inside the testbed's limits (2048 tokens per extend forward,
// kMaxDecodeKvTokensPerThread x threads KV tokens per decode batch). One warm-up round, then
// --repeats rounds over the whole grid (round-robin, so a burst of background load spreads over
// all points); each point's time is its median.
//
// Serve probe (calibrate.h, calibrate_probe.cpp; --serve-probe, on by default). Each fit is then
// scaled by how much slower its forwards ran in a short bound `pdsim testbed` under mpirun than
// the grid predicts: what a testbed rank really runs, not a worker's back-to-back forwards. With
// --topology T the probe runs T itself (its layout's contention, and the wait for a shared core:
// the cost file's core_wait).
//
// Transports. local and tcp: two endpoints in this process, one message at a time, time from
// post_send to the receive's completion. mpi: only under `mpirun -np 2` (ping-pong, half the round
// trip); otherwise skipped with a note. Messages are KV-sized (page runs of one layer's K buffer);
// latency and bandwidth come from a fit of time = latency + bytes / bandwidth.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "backends/model/model_config.h"
#include "sim/cli/calibrate.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/timeline_fit.h"
#include "topology/loader.h"
#include "topology/model_shape.h"
#include "topology/topology.h"

extern char** environ;

namespace pdsim::cli {

namespace calibration {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

}  // namespace

int cores() {
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int default_threads(int tp) {
    return std::max(1, cores() / (2 * tp));
}

int repeats_of(const CalibrateOptions& o) {
    return o.repeats > 0 ? o.repeats : (o.quick ? 3 : 7);
}

namespace {

StatusOr<std::vector<std::string>> parse_transports(const std::string& text) {
    std::vector<std::string> out;
    if (text == "none") return out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item.empty()) continue;
        if (item != "local" && item != "tcp" && item != "mpi") {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--transport: unknown transport '{}' (local, tcp, mpi, or "
                                      "none)",
                                      item));
        }
        if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
    }
    return out;
}

// ---- parent: spawns the workers, fits, measures transports, writes the file ----

StatusOr<json> spawn_worker(const CalibrateOptions& o, int tp, int threads,
                            const std::string& tmp) {
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    const std::pair<const char*, std::string> flags[] = {
        {"--model", o.model},
        {"--backend", o.backend},
        {"--page-size", std::to_string(o.page_size)},
        {"--repeats", std::to_string(repeats_of(o))},
        {"--stream-sync", o.stream_sync},
        {"--bind", o.bind},
        {"--worker", fmt::format("{}:{}", tp, threads)},
        {"--out", tmp}};
    std::vector<std::string> args = {exe, "calibrate"};
    for (const auto& [flag, value] : flags) {
        args.emplace_back(flag);
        args.push_back(value);
    }
    if (o.quick) args.push_back("--quick");
    // A testbed rank under mpirun gets PDSIM_NUM_THREADS = its thread count (testbed.cpp), its own
    // projection pool. TP ranks here are threads of one process sharing the process-wide pool:
    // with 1 thread each the pool is the calling thread (exactly what each rank has); with more,
    // the ranks' projections take turns on a pool of threads x tp (about the same throughput).
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
        if (std::string_view(*e).rfind("PDSIM_NUM_THREADS=", 0) != 0) env.emplace_back(*e);
    }
    env.push_back(fmt::format("PDSIM_NUM_THREADS={}", threads == 1 ? 1 : threads * tp));
    StatusOr<ChildExit> ex = run_child(args, &env, "", std::chrono::seconds(0));
    if (!ex.ok()) {
        return PDSIM_ERROR(StatusCode::kInternal, "cannot start a calibrate worker: {}",
                           ex.status().message());
    }
    if (ex->code != 0) {
        return Status(ex->code == 2 ? StatusCode::kInvalidArgument : StatusCode::kInternal,
                      fmt::format("calibrate worker for tp {} threads {} failed (exit {})", tp,
                                  threads, ex->code));
    }
    std::ifstream in(tmp);
    json j;
    try {
        in >> j;
    } catch (const json::exception& e) {
        return PDSIM_ERROR(StatusCode::kInternal, "calibrate worker output {}: {}", tmp, e.what());
    }
    return j;
}

StatusOr<json> fit_points(const json& worker) {
    std::vector<std::vector<double>> ex, dx;
    std::vector<double> ey, dy;
    for (const auto& p : worker.at("points")) {
        if (p.at("kind") == "extend") {
            std::vector<cost::ExtendItem> items(
                p.at("requests").get<size_t>(),
                {p.at("new_tokens").get<int64_t>(), p.at("cached_tokens").get<int64_t>()});
            const auto f = cost::extend_features(items);
            ex.emplace_back(f.begin(), f.end());
            ey.push_back(p.at("s").get<double>());
        } else {
            const auto f = cost::decode_features(p.at("batch").get<int64_t>(),
                                                 p.at("kv_tokens").get<int64_t>());
            dx.emplace_back(f.begin(), f.end());
            dy.push_back(p.at("s").get<double>());
        }
    }
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit e, cost::fit_nonnegative(ex, ey));
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit d, cost::fit_nonnegative(dx, dy));
    json fit = {{"tp", worker.at("tp")},
                {"threads", worker.at("threads")},
                {"extend", cost::fit_to_json(cost::kExtendKeys, e, ey.size())},
                {"decode", cost::fit_to_json(cost::kDecodeKeys, d, dy.size())},
                {"points", worker.at("points")}};
    if (worker.contains("wake")) {
        const std::vector<double> medians =
            worker["wake"].at("median_s").get<std::vector<double>>();
        if (std::optional<cost::WakeFit> w = cost::fit_wake(medians)) {
            fit["wake"] = {{"min_idle_s", w->wake.min_idle_s},
                           {"lost_s", w->wake.lost_s},
                           {"tau_s", w->wake.tau_s},
                           {"warm_forward_s", w->warm_forward_s},
                           {"measured", worker["wake"]}};
        }
    }
    return fit;
}

std::string cpu_model_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const size_t c = line.find(':');
            if (c != std::string::npos) {
                size_t b = line.find_first_not_of(' ', c + 1);
                return b == std::string::npos ? "" : line.substr(b);
            }
        }
    }
    return "unknown";
}

std::string iso_now() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

// ---- --from-timeline: the testbed's own forwards (the fit: sim/cost/timeline_fit.h) ----

StatusOr<std::optional<cost::CostFile>> load_base(const CalibrateOptions& o,
                                                  const model::ModelConfig& m) {
    if (o.base.empty()) return std::optional<cost::CostFile>();
    auto b = cost::CostFile::load(o.base);
    if (!b.ok()) return b.status().with_context("--base");
    if (b->json().at("model").get<std::string>() != m.name) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--base {}: calibrated for model '{}', not '{}'", o.base,
                                  b->json().at("model").get<std::string>(), m.name));
    }
    return std::optional<cost::CostFile>(std::move(*b));
}

StatusOr<json> calibrate_from_timelines(const CalibrateOptions& o, const model::ModelConfig& m) {
    const std::vector<std::string> paths = split_paths(o.from_timeline);
    if (paths.empty()) return Status(StatusCode::kInvalidArgument, "--from-timeline: empty list");
    cost::TimelineFitOptions fo;
    fo.include_overlapped = o.include_overlapped;
    fo.node_cpus = o.node_cpus > 0 ? o.node_cpus : static_cast<double>(cores());
    fo.timelines_label = o.from_timeline;
    fo.base_path = o.base;
    cost::TimelineFitter fitter(fo);
    for (const std::string& p : paths) {
        PDSIM_ASSIGN_OR_RETURN(std::vector<cost::TimelineForward> forwards,
                               cost::read_timeline_forwards(p));
        PDSIM_RETURN_IF_ERROR(fitter.add_timeline(p, forwards).status());
    }
    PDSIM_ASSIGN_OR_RETURN(std::optional<cost::CostFile> base, load_base(o, m));
    return fitter.fit(base ? &*base : nullptr);
}

StatusOr<model::ModelConfig> calibrate_model(const CalibrateOptions& o) {
    auto resolved = model::resolve_model(o.model);
    if (!resolved.ok()) return resolved.status().with_context("--model");
    const model::ModelConfig& m = *resolved;
    if (m.attention != model::AttentionKind::kMha || !m.layer_kinds.empty()) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--model {}: the CPU testbed runs MHA/GQA full-attention models "
                                  "only (no MLA or sliding-window layers)",
                                  o.model));
    }
    return resolved;
}

// What the run measured or fitted, as the cost file stores it.
struct CalibrateParts {
    json fits = json::array();
    json transports = json::object();
    json notes = json::array();
    json source = {{"kind", "microbenchmark"}};
    json interference = json::object();
    json noise = json::object();
    json core_wait;  // null: none measured (calibrate.h, --topology)
    json step_wait;  // null: none measured (calibrate.h, --topology)
};

// The flags of a microbenchmark run, checked.
struct MicrobenchPlan {
    std::vector<int> tps;
    std::vector<int> threads;  // empty: default_threads(tp) per TP size
    std::vector<std::string> transports;
};

StatusOr<MicrobenchPlan> microbench_plan(const CalibrateOptions& o, const model::ModelConfig& m) {
    MicrobenchPlan plan;
    std::string tp_list = o.tp;
    if (!o.topology.empty()) {
        // Checked here (exit 2), before the grid's minutes.
        StatusOr<topo::Topology> t = topo::load_topology(o.topology);
        if (!t.ok()) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--topology {}: {}", o.topology, t.status().message()));
        }
        std::set<int> tps;
        bool prefill = false, decode = false;
        for (const topo::Instance& inst : t->instances) {
            // The probe runs the CPU testbed: a GPU topology's costs come from a GPU run's
            // timelines instead.
            for (const std::string& id : inst.devices) {
                const topo::Device* dev = t->find_device(id);
                if (dev != nullptr && !dev->is_cpu()) {
                    return Status(
                        StatusCode::kInvalidArgument,
                        fmt::format("--topology {}: instance {} runs on {} device {}; the serve "
                                    "probe runs CPU ranks only (for a GPU topology: pdsim testbed "
                                    "--backend cuda --timeline T.json, then calibrate "
                                    "--from-timeline T.json)",
                                    o.topology, inst.id, dev->type, id));
                }
            }
            tps.insert(inst.tp);
            prefill = prefill || inst.role == topo::Role::kPrefill;
            decode = decode || inst.role == topo::Role::kDecode;
        }
        if (!prefill || !decode) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--topology {}: the serve probe runs --mode disagg and needs "
                                      "prefill and decode instances",
                                      o.topology));
        }
        if (!o.serve_probe) {
            return Status(StatusCode::kInvalidArgument,
                          "--topology: runs the serve probe on the topology; not with "
                          "--serve-probe off");
        }
        if (!o.tp_given) tp_list = fmt::format("{}", fmt::join(tps, ","));
    }
    PDSIM_ASSIGN_OR_RETURN(plan.tps, parse_int_list("--tp", tp_list));
    for (int tp : plan.tps) {
        PDSIM_RETURN_IF_ERROR(
            model::check_tp(m, tp).with_context(fmt::format("--tp {}: model {}", tp, m.name)));
    }
    if (!o.threads.empty()) {
        PDSIM_ASSIGN_OR_RETURN(plan.threads, parse_int_list("--threads", o.threads));
    }
    PDSIM_ASSIGN_OR_RETURN(plan.transports, parse_transports(o.transport));
    return plan;
}

// Spawns one worker per (tp, threads) and fits its points.
Status measure_compute(const CalibrateOptions& o, const model::ModelConfig& m,
                       const MicrobenchPlan& plan, CalibrateParts* parts) {
    const std::string tmp = (std::filesystem::temp_directory_path() /
                             fmt::format("pdsim-calibrate-{}.json", ::getpid()))
                                .string();
    for (int tp : plan.tps) {
        std::vector<int> ths =
            plan.threads.empty() ? std::vector<int>{default_threads(tp)} : plan.threads;
        for (int threads : ths) {
            std::fprintf(stderr, "calibrate: model %s tp %d threads %d: %zu points x %d rounds\n",
                         m.name.c_str(), tp, threads, grid_points(o.quick, threads), repeats_of(o));
            auto w = spawn_worker(o, tp, threads, tmp);
            std::error_code ec;
            std::filesystem::remove(tmp, ec);
            if (!w.ok()) return w.status();
            PDSIM_ASSIGN_OR_RETURN(json fit, fit_points(*w));
            parts->fits.push_back(std::move(fit));
        }
    }
    return {};
}

// The microbenchmarks: MPI (both ranks, under mpirun -np 2), the compute grid, the in-process
// transports. Returns false on a rank other than 0 of mpirun (it writes nothing).
StatusOr<bool> measure_microbenchmarks(const CalibrateOptions& o, const model::ModelConfig& m,
                                       const MicrobenchPlan& plan, CalibrateParts* parts) {
    const Launcher launcher = detect_launcher();
    const auto sizes = message_sizes(o, m);
    const bool want_mpi =
        std::find(plan.transports.begin(), plan.transports.end(), "mpi") != plan.transports.end();
    if (want_mpi && launcher.under_mpirun && launcher.world == 2) {
        PDSIM_ASSIGN_OR_RETURN(json mpi, measure_mpi(sizes, message_reps(o)));
        if (launcher.rank != 0) return false;  // rank 1 only took part in the MPI measurement
        parts->transports["mpi"] = mpi;
    } else if (want_mpi) {
        parts->notes.push_back(launcher.under_mpirun
                                   ? fmt::format("mpi: skipped (launched with {} ranks; measuring "
                                                 "it needs mpirun -np 2)",
                                                 launcher.world)
                                   : "mpi: skipped (not launched under mpirun -np 2)");
    }
    if (launcher.under_mpirun && launcher.rank != 0) return false;
    PDSIM_RETURN_IF_ERROR(measure_compute(o, m, plan, parts));
    for (const auto& name : plan.transports) {
        if (!measured_in_process(name)) continue;
        std::fprintf(stderr, "calibrate: transport %s\n", name.c_str());
        PDSIM_ASSIGN_OR_RETURN(json t, measure_in_process(name, sizes, message_reps(o)));
        parts->transports[name] = t;
    }
    return true;
}

json cost_file_json(const CalibrateOptions& o, const model::ModelConfig& m,
                    const CalibrateParts& parts, double wall) {
    json out = {{"schema_version", cost::kCostSchemaVersion},
                {"machine", {{"cpu", cpu_model_name()}, {"cores", cores()}}},
                {"created", iso_now()},
                {"model", m.name},
                {"model_config", json::object()},
                {"backend", o.backend},
                {"kv_dtype", "fp32"},
                {"page_size", o.page_size},
                {"source", parts.source},
                {"grid", !o.from_timeline.empty() ? "testbed"
                         : o.quick                ? "quick"
                                                  : "default"},
                {"repeats", o.from_timeline.empty() ? json(repeats_of(o)) : json()},
                {"stream_sync", o.from_timeline.empty() ? json(o.stream_sync) : json()},
                {"bind", o.from_timeline.empty() ? json(o.bind) : json()},
                {"fits", parts.fits},
                {"transports", parts.transports},
                {"notes", parts.notes},
                {"wall_s", wall}};
    for (const topo::ModelDimension& dim : topo::kModelDimensions) {
        out["model_config"][std::string(dim.key)] = m.*dim.field;
    }
    if (!parts.interference.empty()) out["interference"] = parts.interference;
    if (!parts.noise.empty()) out["noise"] = parts.noise;
    if (json speed = speed_probe_of_fits(parts.fits); !speed.is_null()) {
        out["speed_probe"] = std::move(speed);
    }
    if (!parts.core_wait.is_null()) out["core_wait"] = parts.core_wait;
    if (!parts.step_wait.is_null()) out["step_wait"] = parts.step_wait;
    if (!o.topology.empty()) out["topology"] = o.topology;
    return out;
}

// The table of fits, one row per (tp, threads).
std::string fits_table(const json& fits) {
    std::string s = fmt::format(
        "  extend_s = const + per_token * tokens + per_pair * attn_pairs + per_req * "
        "requests\n  decode_s = const + per_req * batch + per_pass * weight_passes + "
        "per_kvtok * kv_tokens\n");
    s += fmt::format(
        "  {:>2} {:>7} | {:>6} {:>6} {:>6} {:>6} {:>6} {:>7} | {:>6} {:>6} {:>6} "
        "{:>6} {:>6} {:>7}\n",
        "tp", "threads", "ext ms", "us/tok", "ns/pr", "us/req", "R^2", "max err", "dec ms",
        "us/req", "us/pas", "ns/kvt", "R^2", "max err");
    // A part taken from --base may lack the fit statistics (nan) or optional keys (0).
    auto num = [](const json& j, const char* key) {
        const bool stat = std::strcmp(key, "r2") == 0 || std::strcmp(key, "max_rel_err") == 0;
        return j.contains(key) && j[key].is_number() ? j[key].get<double>()
                                                     : (stat ? std::nan("") : 0.0);
    };
    for (const auto& f : fits) {
        const json& e = f["extend"];
        const json& d = f["decode"];
        s += fmt::format(
            "  {:>2} {:>7} | {:>6.3f} {:>6.1f} {:>6.2f} {:>6.1f} {:>6.4f} {:>6.1f}% | {:>6.3f} "
            "{:>6.1f} {:>6.1f} {:>6.1f} {:>6.4f} {:>6.1f}%\n",
            f["tp"].get<int>(), f["threads"].get<int>(), num(e, "const_s") * 1e3,
            num(e, "per_token_s") * 1e6, num(e, "per_attn_pair_s") * 1e9,
            num(e, "per_request_s") * 1e6, num(e, "r2"), num(e, "max_rel_err") * 100,
            num(d, "const_s") * 1e3, num(d, "per_request_s") * 1e6,
            num(d, "per_weight_pass_s") * 1e6, num(d, "per_kv_token_s") * 1e9, num(d, "r2"),
            num(d, "max_rel_err") * 100);
    }
    return s;
}

// What a --from-timeline fit used: files, base, run levels, interference, noise.
std::string timeline_summary(const CalibrateOptions& o, const CalibrateParts& parts) {
    std::string s;
    for (const auto& f : parts.source["files"]) {
        s += fmt::format(
            "  from {} leader forwards of {} ({} overlapping another "
            "instance's left out)\n",
            f["forwards"].get<size_t>(), f["path"].get<std::string>(),
            f["overlapped_skipped"].get<size_t>());
    }
    if (!o.base.empty()) s += "  missing parts from " + o.base + "\n";
    for (const auto& l : parts.source.value("run_levels", json::array())) {
        auto pct = [](const json& v) {
            return v.is_number() ? fmt::format("{:+.1f}%", (v.get<double>() - 1) * 100)
                                 : std::string("-");
        };
        s += fmt::format("  run level of {} (vs the median run): extend {}, decode {}\n",
                         l["path"].get<std::string>(), pct(l["extend"]), pct(l["decode"]));
    }
    const json& interference = parts.interference;
    if (!interference.empty()) {
        s += fmt::format(
            "  interference (slower than their core share while another instance computes, "
            "{} cpus): extend +{:.1f}% ({} forwards), decode +{:.1f}% ({} forwards)\n",
            interference["node_cpus"].get<double>(), interference["extend"].get<double>() * 100,
            interference["overlapped_forwards"]["extend"].get<size_t>(),
            interference["decode"].get<double>() * 100,
            interference["overlapped_forwards"]["decode"].get<size_t>());
    }
    for (const auto& [kind, n] : parts.noise.items()) {
        s += fmt::format(
            "  {} noise: slow cv {:.1f}% (redrawn every {:.0f} ms), fast cv {:.1f}% "
            "({} forwards, {} windows)\n",
            kind, n["slow_cv"].get<double>() * 100, cost::kNoiseWindowS * 1e3,
            n["fast_cv"].get<double>() * 100, n["points"].get<size_t>(),
            n["windows"].get<size_t>());
    }
    return s;
}

std::string calibrate_summary(const CalibrateOptions& o, const model::ModelConfig& m,
                              const CalibrateParts& parts, double wall) {
    std::string s = fmt::format(
        "pdsim calibrate: model {}, backend {}, fp32 KV, page size {}; {} ({} cores); {:.1f} s\n",
        m.name, o.backend, o.page_size, cpu_model_name(), cores(), wall);
    s += fits_table(parts.fits);
    std::string ts;
    for (const auto& [name, t] : parts.transports.items()) {
        ts += fmt::format("{}{} {:.2f} GB/s + {:.1f} us", ts.empty() ? "" : "; ", name,
                          t["gbps"].get<double>(), t["latency_us"].get<double>());
    }
    for (const auto& n : parts.notes) ts += (ts.empty() ? "" : "; ") + n.get<std::string>();
    for (const auto& f : parts.fits) {
        if (!f.contains("serve_probe")) continue;
        const json& p = f["serve_probe"];
        s += fmt::format(
            "  serve probe tp {} threads {}: fits scaled by extend {:.3f} ({} testbed forwards), "
            "decode {:.3f} ({})\n",
            f["tp"].get<int>(), f["threads"].get<int>(), p["extend_factor"].get<double>(),
            p["extend_forwards"].get<size_t>(), p["decode_factor"].get<double>(),
            p["decode_forwards"].get<size_t>());
    }
    if (!parts.core_wait.is_null()) {
        s += fmt::format(
            "  core wait ({}): {:.2f} ms for work reaching an idle instance while another "
            "computed on its cores ({} requests)\n",
            parts.core_wait["topology"].get<std::string>(),
            parts.core_wait["dispatch_ms"].get<double>(), parts.core_wait["events"].get<size_t>());
    }
    if (!parts.step_wait.is_null()) {
        std::string rows;
        for (const json& row : parts.step_wait["decode"]) {
            rows +=
                fmt::format("{}{} computing: {:.0f}% of {} steps, slice {:.2f} ms, step +{:.2f} ms",
                            rows.empty() ? "" : "; ", row["competitors"].get<int>(),
                            100 * row["chance"].get<double>(), row["gaps"].get<size_t>(),
                            row["slice_ms"].get<double>(), row["wait_ms"].get<double>());
        }
        s += fmt::format("  step wait ({}): decode steps that waited a slice for the next: {}\n",
                         parts.step_wait["topology"].get<std::string>(), rows);
    }
    s += "  transports: " + (ts.empty() ? std::string("none") : ts) + "\n";
    if (!o.from_timeline.empty()) s += timeline_summary(o, parts);
    s += "  wrote " + o.out + "\n";
    return s;
}

Status run_calibrate(const CalibrateOptions& o) {
    PDSIM_ASSIGN_OR_RETURN(const model::ModelConfig m, calibrate_model(o));
    if (!o.worker.empty()) {
        int tp = 0, threads = 0;
        if (std::sscanf(o.worker.c_str(), "%d:%d", &tp, &threads) != 2 || tp < 1 || threads < 1) {
            return Status(StatusCode::kInvalidArgument, "--worker: expected TP:THREADS");
        }
        return run_worker(o, m, tp, threads);
    }
    PDSIM_ASSIGN_OR_RETURN(MicrobenchPlan plan, microbench_plan(o, m));
    PDSIM_RETURN_IF_ERROR(check_writable("--out", o.out));
    const auto t_start = Clock::now();
    CalibrateParts parts;
    Status probe_status;
    if (!o.from_timeline.empty()) {
        PDSIM_ASSIGN_OR_RETURN(json part, calibrate_from_timelines(o, m));
        parts.fits = part["fits"];
        parts.transports = part["transports"];
        parts.source = part["source"];
        parts.interference = part["interference"];
        parts.noise = part["noise"];
    } else {
        PDSIM_ASSIGN_OR_RETURN(bool writes, measure_microbenchmarks(o, m, plan, &parts));
        if (!writes) return {};
        if (!o.serve_probe) {
            parts.notes.push_back("serve probe: off (--serve-probe off): the fits are the grid's");
        } else if (detect_launcher().under_mpirun) {
            parts.notes.push_back(
                "serve probe: skipped (calibrate itself runs under mpirun): the fits are the "
                "grid's");
        } else {
            const json grid = cost_file_json(o, m, parts, 0);
            probe_status = apply_serve_probe(o, m, grid, &parts.fits, &parts.notes,
                                             &parts.core_wait, &parts.step_wait);
            if (!probe_status.ok()) {
                // The grid's minutes are not thrown away: the file is written with the fits as
                // they stand (a fit the probe finished is scaled and says so in its
                // serve_probe), and the command still fails.
                parts.notes.push_back(
                    "serve probe failed, fits without serve_probe are the "
                    "grid's: " +
                    probe_status.message());
            }
        }
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t_start).count();
    const json out = cost_file_json(o, m, parts, wall);
    // What we write must load.
    PDSIM_RETURN_IF_ERROR(cost::CostFile::from_json(out, o.out).status().with_context("internal"));
    PDSIM_RETURN_IF_ERROR(write_json_file("--out", o.out, out));
    const std::string s = calibrate_summary(o, m, parts, wall);
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    return probe_status;
}

}  // namespace

}  // namespace calibration

void add_calibrate_command(CLI::App& app, CommandSet& commands) {
    auto o = std::make_shared<calibration::CalibrateOptions>();
    CLI::App* a = app.add_subcommand(
        "calibrate",
        "Measure this machine's CPU testbed forwards (the synthetic model on the testbed's\n"
        "backend, per TP size and thread count) and KV transports, fit the calibrated cost\n"
        "model and write the cost file for `pdsim simulate --cost-model` (docs/cost-models.md).");
    a->add_option("--backend", o->backend, "Attention backend the testbed runs: cpu | cpu_ref")
        ->check(CLI::IsMember({"cpu", "cpu_ref"}))
        ->capture_default_str();
    a->add_option("--model", o->model, "Built-in model name or a model file")
        ->required()
        ->check(non_empty());
    a->add_option_function<std::string>(
         "--tp",
         [o](const std::string& v) {
             o->tp = v;
             o->tp_given = true;
         },
         "Comma-separated TP sizes (ranks as threads of one process; default 1, with "
         "--topology its TP sizes)")
        ->check(non_empty());
    a->add_option("--topology", o->topology,
                  "Run the serve probe on this topology (a file or a shipped name, as pdsim "
                  "testbed --topology) instead of one prefill and one decode instance per TP: "
                  "each fit is scaled by the topology's own forwards and gets its interference "
                  "there, and the probe measures the core wait (work reaching an idle instance "
                  "while another computes on its cores) for pdsim simulate. For simulating that "
                  "topology; synthetic requests at 0.6 of its predicted prefill capacity")
        ->check(non_empty());
    a->add_option("--threads", o->threads,
                  "Comma-separated compute threads per rank (default per TP size: the testbed's "
                  "cores / ranks on the node for one prefill and one decode instance of that TP, "
                  "max(1, cores / (2 tp)))")
        ->check(non_empty());
    a->add_option("--transport", o->transport,
                  "Comma-separated KV transports to measure: local, tcp, mpi (mpi only under "
                  "mpirun -np 2), or none")
        ->check(non_empty())
        ->capture_default_str();
    a->add_flag("--quick", o->quick, "A small grid and fewer repeats (well under a minute)");
    a->add_option("--page-size", o->page_size, "KV page size (tokens), as the testbed's")
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    a->add_option("--repeats", o->repeats, "Timed rounds over the grid (default: 7, --quick 3)")
        ->check(int_in(1, 100));
    a->add_option("--out", o->out, "Cost file to write (JSON)")->required()->check(output_file());
    a->add_option("--from-timeline", o->from_timeline,
                  "Comma-separated timelines of `pdsim testbed --timeline` runs: fit the forwards "
                  "the testbed's instance leaders ran (keyed by their tp and threads) instead of "
                  "microbenchmarking; --tp, --threads, --transport, --repeats are not used")
        ->check(non_empty());
    a->add_flag("--include-overlapped", o->include_overlapped,
                "With --from-timeline: also fit forwards that overlap another instance's forward "
                "(by default left out: the simulator's CPU contention model adds that slowdown)");
    a->add_option(
         "--node-cpus", o->node_cpus,
         "With --from-timeline: cores of the machine the timelines were recorded on (default: "
         "this machine's), for the interference fit: how much slower than their share of "
         "the cores forwards ran while another instance computed")
        ->check(real_in(0, 4096, /*lo_open=*/true));
    a->add_option("--base", o->base,
                  "With --from-timeline: a cost file whose fits supply the (tp, threads, extend | "
                  "decode) the timelines have no forwards of, and whose transports are copied")
        ->check(non_empty());
    a->add_option_function<std::string>(
         "--serve-probe", [o](const std::string& v) { o->serve_probe = v == "on"; },
         "on|off: after the grid, run a short `pdsim testbed` per TP size under mpirun (ranks "
         "bound to cores, as docs/testbed.md says) and scale each fit by how much slower its "
         "forwards ran there than the grid predicts (default on; skipped with a note when mpirun "
         "is not on PATH or calibrate runs under mpirun)")
        ->check(CLI::IsMember({"on", "off"}));
    a->add_option("--stream-sync", o->stream_sync,
                  "How a rank waits for its forward, as `pdsim testbed --stream-sync`: caller (the "
                  "testbed's default: the rank's thread runs the stream's queued work) or worker "
                  "(two thread hand-offs per forward, which the fits then include); the grid and "
                  "the serve probe both run it")
        ->check(CLI::IsMember({"caller", "worker"}))
        ->capture_default_str();
    a->add_option("--bind", o->bind,
                  "core: bind each grid rank to cores of its own (threads each, round-robin over "
                  "the cores calibrate may use), as mpirun --map-by core --bind-to core binds the "
                  "testbed's ranks; an unbound rank that the scheduler moves between cores ran "
                  "small decodes 1.5-2x slower here. none: leave them unbound (and the serve "
                  "probe's testbed too)")
        ->check(CLI::IsMember({"core", "none"}))
        ->capture_default_str();
    a->add_option("--worker", o->worker, "internal: measure one TP:THREADS group")->group("");
    commands.add(a, [o] { return calibration::run_calibrate(*o); });
}

}  // namespace pdsim::cli
