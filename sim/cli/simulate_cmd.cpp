// pdsim simulate: the discrete-event simulator (sim/des/simulator.h) on a topology, a model and a
// trace, with the testbed's report, per-request CSV and timeline; and `pdsim bench simulate`, its
// speed on the whole Mooncake conversation trace against the 20,000 requests per second target.
// The trace flags mean what `pdsim testbed`'s flags of the same name mean (sim/testbed/options.h);
// only the defaults differ (no length caps, the trace's own time scale).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "backends/model/model_config.h"
#include "common/data_dir.h"
#include "common/input_file.h"
#include "common/logging.h"
#include "common/text.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "sim/cli/sim_flags.h"
#include "sim/des/cpu_contention.h"
#include "sim/des/setup.h"
#include "sim/des/simulator.h"
#include "topology/loader.h"
#include "topology/validate.h"

namespace pdsim::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kTargetRequestsPerWallS = 20000;
constexpr int64_t kTimelineRequests = 1000;  // --timeline-sample auto: about this many lifecycles

struct SimulateFlags {
    std::string like;  // a testbed report to replay (--like)
    std::string topology, model;
    des::RequestSource req;  // a trace (required), its caps, first N or sample, time scale
    std::string cost_model = "roofline";
    int layers = 0;
    std::string mode = "auto", layerwise = "on";
    SchedulingFlags sched;
    int64_t max_decode_kv_tokens = 0;
    std::string cpu_contention = "on";
    std::string cost_noise = "on";
    std::string speed_scale = "auto";  // auto | off | a factor (--speed-scale)
    std::string core_wait = "auto";    // auto | off | milliseconds (--core-wait)
    std::string step_wait = "off";     // auto | off (--step-wait)
    uint64_t noise_seed = 1;
    double cpu_cores = 0;
    std::string cpu_binding = "none";  // none | core | a core per rank, comma-separated
    int64_t kv_pool_mb = 512;
    double slo_ttft_ms = 0, slo_tpot_ms = 0;
    std::string report, timeline, requests;
    int64_t timeline_sample = 0;
    bool progress = false, quiet = false;
    bool model_default_tiny =
        false;  // --like: no model in the topology means tiny (as the testbed)
};

// What --like takes from a testbed report besides flags: its requests, exactly, and the model it
// ran (checked against what the flags resolve to now).
struct LikeRun {
    std::vector<workload::Request> requests;
    std::string label;
    json model;                             // config.model: name and dimensions
    std::optional<cost::SpeedLevel> speed;  // the ranks' speed probe (--speed-scale auto)
    std::map<std::string, cost::SpeedLevel> instance_speed;  // ... of each instance's ranks
    std::string stream_sync;                                 // config.stream_sync ("" not recorded)
    std::string topology;  // config.topology_file, else config.topology ("" not recorded)
};

// Everything a run needs, loaded and validated.
struct Prepared {
    topo::Topology topology;
    std::string topology_label;
    model::ModelConfig model;
    std::optional<cost::CostFile> cost_file;
    std::string cost_kind;
    std::vector<des::InstanceSetup> setups;
    double speed_factor = 1;  // forwards' times are multiplied by it (--speed-scale)
    // --speed-scale auto: each instance's own factor, from its ranks' probe (else speed_factor).
    std::vector<double> instance_speed_factor;
    // What speed_factor scales: nothing; decodes (--speed-scale auto: the probe is a decode's
    // weight stream, and extends did not follow it, docs/fidelity.md section 8.10); every forward
    // (a given factor).
    enum class SpeedScales { kNone, kDecodes, kAllForwards } speed_scales = SpeedScales::kNone;
    std::string speed_note;      // how speed_factor was chosen (summary and report)
    cost::CoreWait core_wait;    // --core-wait resolved
    std::string core_wait_note;  // where it came from (summary and report)
    cost::StepWait step_wait;    // --step-wait resolved
    std::string step_wait_note;  // where it came from (summary and report)
    // --like with a cost file calibrated otherwise than the run (stream_sync, the probe's
    // topology): said in the summary, the report's config.warnings and on stderr.
    std::vector<std::string> warnings;
    std::vector<int> rank_core;  // --cpu-binding resolved: empty, or a core per rank
    std::vector<workload::Request> requests;
    std::string workload_label;
    double load_s = 0;
};

// The name a topology goes by, whether given as a shipped name or a file: the file name's stem.
std::string topology_stem(const std::string& topology) {
    return std::filesystem::path(topology).stem().string();
}

// Where a cost file was calibrated otherwise than the testbed run --like replays: its compute
// stream's sync (calibrate --stream-sync against the run's --stream-sync: the forwards' time
// differs) and its serve probe's topology (calibrate --topology: the fits are scaled to that
// layout). A cost file that does not record one (--from-timeline) is not compared on it.
std::vector<std::string> calibration_mismatches(const LikeRun& like, const cost::CostFile& cost) {
    std::vector<std::string> out;
    const json& j = cost.json();
    const json sync = j.value("stream_sync", json());
    if (sync.is_string() && !like.stream_sync.empty() &&
        sync.get<std::string>() != like.stream_sync) {
        out.push_back(fmt::format(
            "{} was calibrated with --stream-sync {}, the run used {}: forward times differ "
            "(recalibrate with calibrate --stream-sync {})",
            cost.source(), sync.get<std::string>(), like.stream_sync, like.stream_sync));
    }
    const json topo = j.value("topology", json());
    if (topo.is_string() && !like.topology.empty() &&
        topology_stem(topo.get<std::string>()) != topology_stem(like.topology)) {
        out.push_back(fmt::format(
            "{} was calibrated on topology {} (calibrate --topology), the run is {}: its fits "
            "are scaled to the other layout (calibrate --topology {})",
            cost.source(), topo.get<std::string>(), like.topology, topology_stem(like.topology)));
    }
    return out;
}

StatusOr<bool> on_off(const std::string& flag, const std::string& v) {
    if (v == "on") return true;
    if (v == "off") return false;
    return invalid_argument_error(fmt::format("{} {}: expected on or off", flag, v));
}

// --speed-scale: 0 for auto, 1 for off, else the factor.
StatusOr<double> parse_speed_scale(const std::string& v) {
    if (v == "auto") return 0.0;
    if (v == "off") return 1.0;
    double x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size() || !(x > 0 && x <= 100)) {
        return invalid_argument_error(
            fmt::format("--speed-scale {}: expected auto, off, or a factor in (0, 100]", v));
    }
    return x;
}

// --core-wait: nullopt for auto, 0 for off, else the milliseconds.
StatusOr<std::optional<cost::CoreWait>> parse_core_wait(const std::string& v) {
    if (v == "auto") return std::optional<cost::CoreWait>();
    if (v == "off") return std::optional<cost::CoreWait>(cost::CoreWait{});
    double ms = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), ms);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size() || !(ms >= 0 && ms <= 1000)) {
        return invalid_argument_error(
            fmt::format("--core-wait {}: expected auto, off, or milliseconds in [0, 1000]", v));
    }
    return std::optional<cost::CoreWait>(cost::CoreWait{ms / 1e3});
}

// --cpu-binding: "none" and "core" give an empty list; otherwise the comma-separated core ids.
StatusOr<std::vector<int>> parse_core_list(const std::string& binding) {
    std::vector<int> cores;
    if (binding == "none" || binding == "core") return cores;
    size_t start = 0;
    while (start <= binding.size()) {
        const size_t comma = std::min(binding.find(',', start), binding.size());
        const std::string item = binding.substr(start, comma - start);
        int core = -1;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), core);
        if (item.empty() || ec != std::errc() || end != item.data() + item.size() || core < 0 ||
            core > kMaxCoreId) {
            return invalid_argument_error(fmt::format(
                "--cpu-binding {}: '{}' is not a core id in [0, {}] (expected none, core, or one "
                "core id per rank, comma-separated)",
                binding, item, kMaxCoreId));
        }
        cores.push_back(core);
        start = comma + 1;
    }
    return cores;
}

Status check_flags(const SimulateFlags& f) {
    if (f.topology.empty())
        return invalid_argument_error("--topology: required (or --like REPORT.json)");
    if (f.req.trace.empty() && f.like.empty())
        return invalid_argument_error("--trace: required (or --like REPORT.json)");
    if (f.layers < 0)
        return invalid_argument_error(fmt::format("--layers {}: must be >= 1", f.layers));
    PDSIM_RETURN_IF_ERROR(check_scheduling_flags(f.sched));
    if (f.max_decode_kv_tokens < 0) {
        return invalid_argument_error(
            fmt::format("--max-decode-kv-tokens {}: must be >= 0", f.max_decode_kv_tokens));
    }
    if (f.kv_pool_mb < 1)
        return invalid_argument_error(fmt::format("--kv-pool-mb {}: must be >= 1", f.kv_pool_mb));
    const des::RequestSource& r = f.req;
    if (r.max_input_len < 0) {
        return invalid_argument_error(
            fmt::format("--max-input-len {}: must be >= 0", r.max_input_len));
    }
    if (r.max_output_len < 0) {
        return invalid_argument_error(
            fmt::format("--max-output-len {}: must be >= 0", r.max_output_len));
    }
    if (!(r.time_scale > 0) || !std::isfinite(r.time_scale)) {
        return invalid_argument_error(fmt::format("--time-scale {}: must be > 0", r.time_scale));
    }
    if (r.max_requests < 0 || r.sample < 0)
        return invalid_argument_error("--max-requests / --sample must be >= 0");
    if (f.slo_ttft_ms < 0 || f.slo_tpot_ms < 0) {
        return invalid_argument_error("--slo-ttft-ms / --slo-tpot-ms must be >= 0");
    }
    if (f.timeline_sample < 0) {
        return invalid_argument_error(
            fmt::format("--timeline-sample {}: must be >= 0", f.timeline_sample));
    }
    if (f.mode != "auto" && f.mode != "disagg" && f.mode != "colocated" && f.mode != "both") {
        return invalid_argument_error(
            fmt::format("--mode {}: expected auto, disagg, colocated or both", f.mode));
    }
    PDSIM_RETURN_IF_ERROR(on_off("--layerwise", f.layerwise).status());
    PDSIM_RETURN_IF_ERROR(on_off("--cpu-contention", f.cpu_contention).status());
    PDSIM_RETURN_IF_ERROR(on_off("--cost-noise", f.cost_noise).status());
    PDSIM_RETURN_IF_ERROR(parse_speed_scale(f.speed_scale).status());
    PDSIM_RETURN_IF_ERROR(parse_core_wait(f.core_wait).status());
    if (!(f.cpu_cores >= 0) || !std::isfinite(f.cpu_cores)) {
        return invalid_argument_error(fmt::format("--cpu-cores {}: must be >= 0", f.cpu_cores));
    }
    return parse_core_list(f.cpu_binding).status();
}

// The core each rank is bound to (SimConfig::rank_core): none, empty; core, as `mpirun --map-by
// core --bind-to core` places them (a node's ranks in rank order on its cores 0, 1, ..., C - 1,
// then round again); a list, as given, one per rank.
StatusOr<std::vector<int>> resolve_cpu_binding(const SimulateFlags& f, const topo::Topology& t) {
    PDSIM_ASSIGN_OR_RETURN(std::vector<int> cores, parse_core_list(f.cpu_binding));
    if (f.cpu_binding == "none") return cores;
    if (f.cpu_binding == "core") {
        const topo::RankMap map = t.rank_map();
        cores.assign(static_cast<size_t>(t.num_ranks()), 0);
        for (size_t n = 0; n < t.nodes.size(); ++n) {
            const int c =
                std::max(1, static_cast<int>(des::CpuContention::node_cores(t, n, f.cpu_cores)));
            int local = 0;
            for (int r : map.ranks_on_node(static_cast<int>(n))) {
                cores[static_cast<size_t>(r)] = local++ % c;
            }
        }
        return cores;
    }
    if (std::ssize(cores) != t.num_ranks()) {
        return invalid_argument_error(
            fmt::format("--cpu-binding {}: {} core ids for the topology's {} ranks", f.cpu_binding,
                        cores.size(), t.num_ranks()));
    }
    return cores;
}

// Model and topology as `pdsim testbed` resolves them (sim/testbed/options.cpp), minus its
// CPU-only checks.
Status load_model_and_topology(const SimulateFlags& f, Prepared* p) {
    if (f.topology.empty()) {
        return invalid_argument_error("--topology is required (or --like REPORT.json)");
    }
    topo::LoadOptions lo;
    topo::ModelShape shape;
    std::optional<model::ModelConfig> m;
    if (!f.model.empty()) {
        PDSIM_ASSIGN_OR_RETURN(m, des::load_model(f.model, f.layers));
        shape = model::to_model_shape(*m);
        lo.model = &shape;
    }
    PDSIM_ASSIGN_OR_RETURN(p->topology, topo::load_topology(f.topology, lo));
    p->topology_label = fs::path(f.topology).filename().string();
    if (!m && !p->topology.model && f.model_default_tiny) {
        PDSIM_ASSIGN_OR_RETURN(m, des::load_model("tiny", f.layers));
        shape = model::to_model_shape(*m);
        PDSIM_RETURN_IF_ERROR(topo::validate(p->topology, &shape));
    }
    if (!m) {
        if (!p->topology.model) {
            return invalid_argument_error(
                fmt::format("{}: no model in the topology; pass --model NAME|F", f.topology));
        }
        // The topology's model section, whole (its overrides of a built-in included).
        auto r = model::model_from_shape(*p->topology.model, f.layers);
        if (!r.ok()) {
            return invalid_argument_error(fmt::format("{}: model: {}; pass --model NAME|F",
                                                      f.topology, r.status().message()));
        }
        m = *std::move(r);
        shape = model::to_model_shape(*m);
        PDSIM_RETURN_IF_ERROR(topo::validate(p->topology, &shape));
    }
    p->model = *m;
    for (const auto& inst : p->topology.instances) {
        if (Status st = model::check_tp(p->model, inst.tp); !st.ok()) {
            return invalid_argument_error(
                fmt::format("{}: instance {}: tp {}", f.topology, inst.id, st.message()));
        }
    }
    return {};
}

// The trace as `pdsim testbed` reads it: caps, first N or a sample, arrivals from the first
// request, lengths at least 1, times scaled.
Status load_requests(const SimulateFlags& f, Prepared* p) {
    const des::RequestSource& r = f.req;
    PDSIM_ASSIGN_OR_RETURN(p->requests, des::load_requests(r));
    p->workload_label = fs::path(r.trace).filename().string();
    if (r.sample > 0) p->workload_label += fmt::format(" (sample {}, seed {})", r.sample, r.seed);
    if (r.max_requests > 0) p->workload_label += fmt::format(" (first {})", r.max_requests);
    return {};
}

// The report's config.speed_scale.scales.
const char* speed_scales_name(Prepared::SpeedScales scales) {
    switch (scales) {
        case Prepared::SpeedScales::kDecodes:
            return "decodes";
        case Prepared::SpeedScales::kAllForwards:
            return "all forwards";
        case Prepared::SpeedScales::kNone:
            break;
    }
    return "none";
}

// How much slower (> 1) the machine ran the testbed run of --like than while calibrating the
// cost file, from their speed probes (common/speed_probe.h); scales each instance's decode
// forwards (auto) or every forward (a given factor).
Status choose_speed_factor(const SimulateFlags& f, const LikeRun* like, Prepared* p) {
    PDSIM_ASSIGN_OR_RETURN(const double given, parse_speed_scale(f.speed_scale));
    if (f.speed_scale == "off") {
        p->speed_note = "not scaled (--speed-scale off)";
    } else if (given > 0) {
        p->speed_factor = given;
        p->speed_scales = Prepared::SpeedScales::kAllForwards;
        p->speed_note = "as given (--speed-scale)";
    } else if (like == nullptr) {
        p->speed_note = "not scaled (--speed-scale auto needs --like)";
    } else if (!p->cost_file) {
        p->speed_note = "not scaled (the roofline cost model has no speed probe)";
    } else {
        const std::optional<cost::SpeedLevel> run = like->speed;
        const std::optional<cost::SpeedLevel> cal = p->cost_file->speed_probe();
        if (!run) {
            p->speed_note =
                "not scaled (the report has no speed probe: pdsim testbed "
                "--speed-probe-ms 0, GPU ranks, or an older pdsim)";
        } else if (!cal) {
            p->speed_note = fmt::format(
                "not scaled ({} has no speed_probe: calibrate without its serve probe, or an "
                "older pdsim)",
                f.cost_model);
        } else if (run->kernel != cal->kernel) {
            p->speed_note = fmt::format(
                "not scaled (probe kernels differ: {} in the report, {} "
                "in the cost file)",
                run->kernel, cal->kernel);
        } else {
            p->speed_factor = run->cpu_ms_p50 / cal->cpu_ms_p50;
            p->speed_scales = Prepared::SpeedScales::kDecodes;
            // Each instance at its own ranks' pace: one rank's core can run slower than another's
            // for a whole run (the host's other tenants).
            for (const topo::Instance& inst : p->topology.instances) {
                auto it = like->instance_speed.find(inst.id);
                p->instance_speed_factor.push_back(it != like->instance_speed.end() &&
                                                           it->second.kernel == cal->kernel
                                                       ? it->second.cpu_ms_p50 / cal->cpu_ms_p50
                                                       : p->speed_factor);
            }
            p->speed_note = fmt::format(
                "the run's speed probe took {:.3f} ms, the calibration's {:.3f} ms: each "
                "instance's decode forwards scaled by its own ranks' ratio ({:.3f}), extends not "
                "(--speed-scale off: none; a factor: every forward)",
                run->cpu_ms_p50, cal->cpu_ms_p50, fmt::join(p->instance_speed_factor, ", "));
        }
    }
    for (size_t i = 0; i < p->setups.size(); ++i) {
        const double factor =
            i < p->instance_speed_factor.size() ? p->instance_speed_factor[i] : p->speed_factor;
        if (factor == 1) continue;
        p->setups[i].cost = std::make_shared<cost::ScaledCostModel>(
            p->setups[i].cost, p->speed_scales == Prepared::SpeedScales::kDecodes ? 1.0 : factor,
            factor);
    }
    return {};
}

StatusOr<Prepared> prepare(const SimulateFlags& f, const LikeRun* like = nullptr) {
    PDSIM_RETURN_IF_ERROR(check_flags(f));
    if (like == nullptr && f.req.trace.empty()) {
        return invalid_argument_error("--trace is required (or --like REPORT.json)");
    }
    Prepared p;
    PDSIM_RETURN_IF_ERROR(load_model_and_topology(f, &p));
    if (like != nullptr) {
        // The model the flags resolve to now must be the one the testbed ran.
        for (const topo::ModelDimension& dim : topo::kModelDimensions) {
            const json& want = like->model[std::string(dim.key)];
            if (want.is_number_integer() && want.get<int64_t>() != p.model.*dim.field) {
                return invalid_argument_error(fmt::format(
                    "--like {}: the model resolves to {} with {} {}, but the testbed ran {} with "
                    "{} (did the model or topology file change? pass --model and --layers)",
                    f.like, p.model.name, dim.key, p.model.*dim.field,
                    like->model.value("name", "?"), want.get<int64_t>()));
            }
        }
    }
    if (f.cost_model == "roofline") {
        p.cost_kind = "roofline";
    } else {
        StatusOr<cost::CostFile> cf = cost::CostFile::load(f.cost_model);
        if (!cf.ok()) return cf.status().with_context("--cost-model");
        p.cost_file = std::move(*cf);
        p.cost_kind = "calibrated";
    }
    des::KvCapacityOptions kv = kv_capacity_options(f.sched);
    kv.kv_pool_mb = f.kv_pool_mb;
    StatusOr<std::vector<des::InstanceSetup>> setups = des::make_instance_setups(
        p.topology, p.model, p.cost_kind, p.cost_file ? &*p.cost_file : nullptr, kv);
    if (!setups.ok()) {
        return Status(setups.status().code(),
                      fmt::format("--cost-model {}: {}", f.cost_model, setups.status().message()));
    }
    p.setups = std::move(*setups);
    if (like != nullptr && p.cost_file) p.warnings = calibration_mismatches(*like, *p.cost_file);
    for (const std::string& w : p.warnings) PDSIM_LOG_WARN("{}", w);
    PDSIM_RETURN_IF_ERROR(choose_speed_factor(f, like, &p));
    PDSIM_ASSIGN_OR_RETURN(const std::optional<cost::CoreWait> given_wait,
                           parse_core_wait(f.core_wait));
    if (given_wait) {
        p.core_wait = *given_wait;
        p.core_wait_note =
            f.core_wait == "off" ? "none (--core-wait off)" : "as given (--core-wait)";
    } else if (const std::optional<cost::CoreWait> w =
                   p.cost_file ? p.cost_file->core_wait() : std::nullopt) {
        p.core_wait = *w;
        p.core_wait_note = fmt::format("from {} (core_wait)", p.cost_file->source());
    } else {
        p.core_wait_note = "none (the cost model has no core_wait)";
    }
    if (f.step_wait == "off") {
        p.step_wait_note = "none (--step-wait off)";
    } else if (const std::optional<cost::StepWait> w =
                   p.cost_file ? p.cost_file->step_wait() : std::nullopt) {
        p.step_wait = *w;
        p.step_wait_note = fmt::format("from {} (step_wait)", p.cost_file->source());
    } else {
        p.step_wait_note = "none (the cost model has no step_wait)";
    }
    PDSIM_ASSIGN_OR_RETURN(p.rank_core, resolve_cpu_binding(f, p.topology));
    const auto t0 = std::chrono::steady_clock::now();
    if (like != nullptr) {
        p.requests = like->requests;
        p.workload_label = like->label;
    } else {
        PDSIM_RETURN_IF_ERROR(load_requests(f, &p));
    }
    p.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return p;
}

des::SimConfig make_config(const Prepared& p, const SimulateFlags& f, des::SimMode mode) {
    des::SimConfig c;
    c.topology = p.topology;
    c.topology_label = p.topology_label;
    c.model = p.model;
    c.instances = p.setups;
    c.mode = mode;
    c.layerwise = f.layerwise == "on";
    apply_scheduling_flags(f.sched, &c);
    c.cpu_contention = f.cpu_contention == "on";
    c.cost_noise = f.cost_noise == "on";
    c.noise_seed = f.noise_seed;
    c.node_cpus = f.cpu_cores;
    c.rank_core = p.rank_core;
    c.core_wait_s = p.core_wait.dispatch_s;
    c.step_wait = p.step_wait;
    c.batching.max_decode_kv_tokens = f.max_decode_kv_tokens;
    c.slo.ttft_ms = f.slo_ttft_ms;
    c.slo.tpot_ms = f.slo_tpot_ms;
    return c;
}

// Rows as metrics::write_requests_csv writes them, streamed as requests finish.
class CsvStream {
public:
    Status open(const std::string& path) {
        path_ = path;
        f_.open(path);
        if (!f_)
            return invalid_argument_error(
                fmt::format("{}: cannot open requests file for writing", path));
        f_ << metrics::requests_csv_header();
        return {};
    }
    void row(const metrics::RequestRecord& q) { f_ << metrics::requests_csv_row(q); }
    Status close() {
        f_.close();
        if (!f_) return Status(StatusCode::kUnavailable, fmt::format("{}: write failed", path_));
        return {};
    }

private:
    std::string path_;
    std::ofstream f_;
};

void print_progress(const std::string& label, const des::SimProgress& s) {
    const bool done = s.finished >= s.total;
    std::fprintf(stderr,
                 "\r[pdsim simulate %s] %lld/%lld requests, simulated %.1f s, wall %.2f s%s",
                 label.c_str(), static_cast<long long>(s.finished), static_cast<long long>(s.total),
                 s.sim_s, s.wall_s, done ? "\n" : "");
    std::fflush(stderr);
}

// Simulates each mode of --mode in turn (disagg first); the first one streams its requests to
// `csv`, all of them write into `timeline` (when given).
StatusOr<std::vector<des::SimResult>> simulate_modes(const Prepared& p, const SimulateFlags& f,
                                                     CsvStream* csv, metrics::Timeline* timeline) {
    const int64_t n = static_cast<int64_t>(p.requests.size());
    const int64_t sample =
        f.timeline_sample > 0 ? f.timeline_sample : std::max<int64_t>(1, n / kTimelineRequests);
    // auto: what the topology describes (prefill and decode instances: disagg; colocated ones, such
    // as a single instance, the usual baseline: colocated).
    std::string mode = f.mode;
    if (mode == "auto") {
        const bool any_prefill =
            std::any_of(p.topology.instances.begin(), p.topology.instances.end(),
                        [](const topo::Instance& i) { return i.role == topo::Role::kPrefill; });
        mode = any_prefill ? "disagg" : "colocated";
    }
    std::vector<des::SimMode> modes;
    if (mode != "colocated") modes.push_back(des::SimMode::kDisagg);
    if (mode != "disagg") modes.push_back(des::SimMode::kColocated);
    std::vector<des::SimResult> results;
    for (size_t k = 0; k < modes.size(); ++k) {
        des::SimConfig c = make_config(p, f, modes[k]);
        c.timeline = timeline;
        c.timeline_pid_base = static_cast<int>(k) * 1000;
        c.timeline_sample = sample;
        if (csv != nullptr && k == 0)
            c.on_request_done = [csv](const metrics::RequestRecord& q) { csv->row(q); };
        if (f.progress) {
            const std::string label(des::sim_mode_name(modes[k]));
            c.on_progress = [label](const des::SimProgress& s) { print_progress(label, s); };
        }
        PDSIM_ASSIGN_OR_RETURN(des::SimResult r, des::run_simulation(c, p.requests));
        results.push_back(std::move(r));
    }
    return results;
}

// The report of the first mode, the second's (colocated) inside it, both annotated with the run.
metrics::Report simulate_report(const Prepared& p, const SimulateFlags& f,
                                const std::vector<des::SimResult>& results) {
    metrics::Report report = results.front().report;
    auto annotate = [&](metrics::Report& r) {
        r.extra["workload"] = p.workload_label;
        r.extra["config"]["cost_model"] = f.cost_model;
        r.extra["config"]["time_scale"] = f.req.time_scale;
        r.extra["config"]["max_input_len"] = f.req.max_input_len;
        r.extra["config"]["max_output_len"] = f.req.max_output_len;
        if (!f.like.empty()) r.extra["config"]["like"] = f.like;
        r.extra["config"]["speed_scale"] = {{"factor", p.speed_factor},
                                            {"scales", speed_scales_name(p.speed_scales)},
                                            {"why", p.speed_note}};
        r.extra["config"]["core_wait"] = {{"dispatch_ms", p.core_wait.dispatch_s * 1e3},
                                          {"why", p.core_wait_note}};
        json steps = json::array();
        for (const cost::StepWaitChance& w : p.step_wait.decode) {
            steps.push_back({{"chance", w.chance}, {"wait_ms", w.wait_s * 1e3}});
        }
        r.extra["config"]["step_wait"] = {{"decode", std::move(steps)}, {"why", p.step_wait_note}};
        if (!p.warnings.empty()) r.extra["config"]["warnings"] = p.warnings;
        if (!p.instance_speed_factor.empty()) {
            json per = json::object();
            for (size_t i = 0; i < p.instance_speed_factor.size(); ++i) {
                per[p.topology.instances[i].id] = p.instance_speed_factor[i];
            }
            r.extra["config"]["speed_scale"]["instances"] = std::move(per);
        }
        r.extra["simulator"]["trace_load_s"] = p.load_s;
    };
    annotate(report);
    if (results.size() > 1) {
        report.colocated = std::make_shared<metrics::Report>(results[1].report);
        annotate(*report.colocated);
    }
    return report;
}

std::string simulate_summary(const Prepared& p, const SimulateFlags& f,
                             const metrics::Report& report,
                             const std::vector<des::SimResult>& results) {
    const int64_t n = static_cast<int64_t>(p.requests.size());
    std::string s = metrics::summary_table(report);
    s += fmt::format("  workload: {}, {} requests\n", p.workload_label, n);
    for (const auto& r : results) {
        const des::SimStats& st = r.stats;
        s += fmt::format(
            "  simulator ({}): {:.3f} s wall ({:.0f} requests/s, {} events), {:.1f} s "
            "simulated, {} preemptions, {} prefix-hit tokens\n",
            r.report.mode, st.wall_s, st.wall_s > 0 ? static_cast<double>(n) / st.wall_s : 0,
            st.events, st.sim_s, st.preemptions, st.prefix_hit_tokens);
    }
    s += fmt::format("  cost model: {}\n",
                     results.front().report.extra["simulator"]["cost_model"].get<std::string>());
    s += fmt::format("  machine speed: x{:.3f}{}, {}\n", p.speed_factor,
                     p.speed_scales == Prepared::SpeedScales::kDecodes ? " (decodes)" : "",
                     p.speed_note);
    s +=
        fmt::format("  core wait: {:.2f} ms, {}\n", p.core_wait.dispatch_s * 1e3, p.core_wait_note);
    std::string steps;
    for (size_t row = 0; row < p.step_wait.decode.size(); ++row) {
        steps +=
            fmt::format("{}{}: {:.0f}% x {:.2f} ms", row == 0 ? "" : ", ", row + 1,
                        100 * p.step_wait.decode[row].chance, p.step_wait.decode[row].wait_s * 1e3);
    }
    s += fmt::format("  step wait: {}, {}\n",
                     steps.empty() ? std::string("none") : "by competitors " + steps,
                     p.step_wait_note);
    for (const std::string& w : p.warnings) s += fmt::format("  warning: {}\n", w);
    for (const auto& [path, what] :
         {std::pair{f.report, "report"}, std::pair{f.timeline, "timeline"},
          std::pair{f.requests, "requests"}}) {
        if (!path.empty()) s += fmt::format("  wrote {} {}\n", what, path);
    }
    return s;
}

// ---- --like REPORT.json ----

constexpr uint64_t kMaxLikeReportBytes = uint64_t{1} << 30;

// `report`[key] as a T, or kInvalidArgument naming the file and the key.
template <typename T>
StatusOr<T> like_field(const std::string& file, const json& object, const std::string& path,
                       const char* key) {
    const auto it = object.find(key);
    if (it == object.end()) {
        return invalid_argument_error(fmt::format("--like {}: {}{} is missing", file, path, key));
    }
    try {
        return it->get<T>();
    } catch (const json::exception&) {
        return invalid_argument_error(
            fmt::format("--like {}: {}{}: {} is not what a testbed report holds there", file, path,
                        key, text::excerpt(it->dump())));
    }
}

// Reads a testbed report: its exact request set, and the flags it ran with into `f` (those not
// given on the command line: `given(flag)`).
StatusOr<LikeRun> load_like(SimulateFlags* f, const std::function<bool(const char*)>& given) {
    for (const char* flag : {"--trace", "--trace-format", "--max-requests", "--sample", "--seed",
                             "--time-scale", "--max-input-len", "--max-output-len"}) {
        if (given(flag)) {
            return invalid_argument_error(fmt::format(
                "{} with --like: --like replays the report's own requests (ids, lengths and "
                "arrival times, already scaled); drop {}",
                flag, flag));
        }
    }
    const std::string& file = f->like;
    PDSIM_ASSIGN_OR_RETURN(std::string text, files::read_input_file(file, kMaxLikeReportBytes));
    const json rep = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!rep.is_object() || !rep.contains("config") || !rep["config"].is_object()) {
        return invalid_argument_error(fmt::format(
            "--like {}: not a pdsim testbed report (a JSON object with a `config` section)", file));
    }
    const json& config = rep["config"];
    if (!config.contains("request_set")) {
        return invalid_argument_error(fmt::format(
            "--like {}: config.request_set is missing: the report of an older pdsim testbed, or "
            "not a testbed report (rerun the testbed to replay it)",
            file));
    }
    const json& set = config["request_set"];
    if (!set.is_object()) {
        return invalid_argument_error(
            fmt::format("--like {}: config.request_set is not an object", file));
    }
    LikeRun like;
    const std::string at = "config.request_set.";
    PDSIM_ASSIGN_OR_RETURN(auto ids, like_field<std::vector<int64_t>>(file, set, at, "id"));
    PDSIM_ASSIGN_OR_RETURN(auto arrivals,
                           like_field<std::vector<double>>(file, set, at, "arrival_ms"));
    PDSIM_ASSIGN_OR_RETURN(auto inputs,
                           like_field<std::vector<int64_t>>(file, set, at, "input_len"));
    PDSIM_ASSIGN_OR_RETURN(auto outputs,
                           like_field<std::vector<int64_t>>(file, set, at, "output_len"));
    std::vector<std::vector<int64_t>> hashes;
    if (set.contains("hash_ids")) {
        PDSIM_ASSIGN_OR_RETURN(
            hashes, like_field<std::vector<std::vector<int64_t>>>(file, set, at, "hash_ids"));
    }
    const size_t n = ids.size();
    if (n == 0 || arrivals.size() != n || inputs.size() != n || outputs.size() != n ||
        (!hashes.empty() && hashes.size() != n)) {
        return invalid_argument_error(fmt::format(
            "--like {}: config.request_set: {} ids, {} arrival_ms, {} input_len, {} output_len{}: "
            "expected as many of each, at least one",
            file, n, arrivals.size(), inputs.size(), outputs.size(),
            hashes.empty() ? "" : fmt::format(", {} hash_ids", hashes.size())));
    }
    like.requests.resize(n);
    for (size_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || !std::isfinite(arrivals[i]) || arrivals[i] < 0 || inputs[i] < 1 ||
            inputs[i] > kMaxLengthCap || outputs[i] < 1 || outputs[i] > kMaxLengthCap ||
            (i > 0 && arrivals[i] < arrivals[i - 1])) {
            return invalid_argument_error(fmt::format(
                "--like {}: config.request_set, request {} (id {}): arrival_ms {}, input_len {}, "
                "output_len {}: ids >= 0, arrivals finite and in order, lengths in [1, {}]",
                file, i, ids[i], arrivals[i], inputs[i], outputs[i], kMaxLengthCap));
        }
        workload::Request& q = like.requests[i];
        q.id = ids[i];
        q.arrival_ms = arrivals[i];
        q.input_len = static_cast<int32_t>(inputs[i]);
        q.output_len = static_cast<int32_t>(outputs[i]);
        if (!hashes.empty()) q.hash_ids = std::move(hashes[i]);
    }
    like.model = config.value("model", json::object());
    if (config.contains("stream_sync") && config["stream_sync"].is_string()) {
        like.stream_sync = config["stream_sync"].get<std::string>();
    }
    for (const char* key : {"topology_file", "topology"}) {
        if (like.topology.empty() && config.contains(key) && config[key].is_string()) {
            like.topology = config[key].get<std::string>();
        }
    }
    like.speed = cost::report_speed_level(rep);
    if (rep.contains("ranks") && rep["ranks"].is_array()) {
        for (const json& rank : rep["ranks"]) {
            const json id = rank.is_object() ? rank.value("instance", json()) : json();
            if (!id.is_string() || like.instance_speed.contains(id.get<std::string>())) continue;
            if (auto level = cost::report_speed_level(rep, id.get<std::string>())) {
                like.instance_speed.emplace(id.get<std::string>(), *level);
            }
        }
    }
    like.label = fmt::format("like {} ({} requests{})", fs::path(file).filename().string(), n,
                             config.contains("workload") && config["workload"].is_string()
                                 ? " of " + config["workload"].get<std::string>()
                                 : "");
    // The run's settings, unless the command line says otherwise.
    if (!given("--topology")) {
        PDSIM_ASSIGN_OR_RETURN(f->topology,
                               like_field<std::string>(file, config, "config.", "topology_file"));
        if (f->topology.empty()) {
            return invalid_argument_error(fmt::format(
                "--like {}: the testbed ran its embedded built-in topology (no file); pass "
                "--topology",
                file));
        }
    }
    if (!given("--model")) {
        PDSIM_ASSIGN_OR_RETURN(f->model,
                               like_field<std::string>(file, config, "config.", "model_source"));
        f->model_default_tiny = true;
    }
    if (!given("--layers")) {
        PDSIM_ASSIGN_OR_RETURN(f->layers, like_field<int>(file, config, "config.", "layers"));
    }
    const std::pair<const char*, int64_t*> sched[] = {
        {"chunk_size", &f->sched.chunk_size},
        {"max_batch_tokens", &f->sched.max_batch_tokens},
        {"max_decode_batch", &f->sched.max_decode_batch},
        {"kv_pool_mb", &f->kv_pool_mb}};
    for (const auto& [key, field] : sched) {
        const std::string flag = "--" + std::string(key);
        std::string dashed = flag;
        std::replace(dashed.begin(), dashed.end(), '_', '-');
        if (!given(dashed.c_str())) {
            PDSIM_ASSIGN_OR_RETURN(*field, like_field<int64_t>(file, config, "config.", key));
        }
    }
    if (!given("--page-size")) {
        PDSIM_ASSIGN_OR_RETURN(f->sched.page_size,
                               like_field<int>(file, config, "config.", "page_size"));
    }
    if (!given("--layerwise")) {
        PDSIM_ASSIGN_OR_RETURN(const bool layerwise,
                               like_field<bool>(file, config, "config.", "layerwise"));
        f->layerwise = layerwise ? "on" : "off";
    }
    // The testbed's rules where the simulator's defaults differ: no prefix cache, decode pages
    // for prompt + output reserved at admission, and its decode ranks' KV-token bound per decode
    // batch (the cpu backend's, 2048 x attention threads; 0 on GPU ranks), from the ranks' stats.
    if (!given("--prefix-cache")) f->sched.prefix_cache = "off";
    if (!given("--kv-admission")) f->sched.kv_admission = "full";
    if (!given("--max-decode-kv-tokens") && rep.contains("ranks") && rep["ranks"].is_array()) {
        int64_t cap = 0;
        for (const json& rank : rep["ranks"]) {
            if (!rank.is_object() || rank.value("role", "") == "prefill") continue;
            const json stats = rank.value("stats", json::object());
            if (stats.is_object() && stats.contains("decode_kv_cap") &&
                stats["decode_kv_cap"].is_number_integer()) {
                const int64_t rank_cap = stats["decode_kv_cap"].get<int64_t>();
                if (rank_cap < 0) {
                    return invalid_argument_error(fmt::format(
                        "--like {}: ranks[].stats.decode_kv_cap {}: must be >= 0", file, rank_cap));
                }
                cap = std::max(cap, rank_cap);
            }
        }
        f->max_decode_kv_tokens = cap;
    }
    // Where the testbed's ranks ran: the cores each was bound to and the cores its host had
    // (ranks[].stats.cpus and online_cpus), unless given.
    if (rep.contains("ranks") && rep["ranks"].is_array() && !rep["ranks"].empty()) {
        std::vector<int> bound;
        double online = 0;
        bool all_bound = true, same_online = true;
        for (const json& rank : rep["ranks"]) {
            const json stats = rank.is_object() ? rank.value("stats", json::object()) : json();
            const json cpus = stats.is_object() ? stats.value("cpus", json()) : json();
            if (cpus.is_array() && cpus.size() == 1 && cpus[0].is_number_integer() &&
                cpus[0].get<int64_t>() >= 0 && cpus[0].get<int64_t>() <= kMaxCoreId) {
                bound.push_back(cpus[0].get<int>());
            } else {
                all_bound = false;
            }
            const json cores = stats.is_object() ? stats.value("online_cpus", json()) : json();
            if (cores.is_number() && cores.get<double>() >= 1 && cores.get<double>() <= 4096 &&
                (online == 0 || online == cores.get<double>())) {
                online = cores.get<double>();
            } else {
                same_online = false;
            }
        }
        if (!given("--cpu-binding") && all_bound) {
            f->cpu_binding = fmt::format("{}", fmt::join(bound, ","));
        }
        if (!given("--cpu-cores") && same_online && online > 0) f->cpu_cores = online;
    }
    if (!given("--mode")) {
        PDSIM_ASSIGN_OR_RETURN(const std::string mode,
                               like_field<std::string>(file, rep, "", "mode"));
        f->mode = mode == "disagg" && rep.contains("colocated") ? "both" : mode;
    }
    return like;
}

Status run_simulate(const SimulateFlags& flags, const std::function<bool(const char*)>& given) {
    SimulateFlags f = flags;
    std::optional<LikeRun> like;
    if (!f.like.empty()) {
        PDSIM_ASSIGN_OR_RETURN(like, load_like(&f, given));
    }
    PDSIM_ASSIGN_OR_RETURN(Prepared p, prepare(f, like ? &*like : nullptr));
    // Outputs are opened before the run so a bad path fails fast.
    std::unique_ptr<CsvStream> csv;
    if (!f.requests.empty()) {
        csv = std::make_unique<CsvStream>();
        PDSIM_RETURN_IF_ERROR(csv->open(f.requests));
    }
    std::unique_ptr<metrics::Timeline> timeline;
    if (!f.timeline.empty()) timeline = std::make_unique<metrics::Timeline>();
    PDSIM_ASSIGN_OR_RETURN(std::vector<des::SimResult> results,
                           simulate_modes(p, f, csv.get(), timeline.get()));
    const metrics::Report report = simulate_report(p, f, results);
    if (csv) PDSIM_RETURN_IF_ERROR(csv->close());
    if (!f.report.empty()) PDSIM_RETURN_IF_ERROR(metrics::write_report(f.report, report));
    if (timeline) PDSIM_RETURN_IF_ERROR(timeline->write(f.timeline));
    if (!f.quiet) {
        const std::string s = simulate_summary(p, f, report, results);
        std::fputs(s.c_str(), stdout);
        std::fflush(stdout);
    }
    int64_t failed = 0;
    for (const auto& r : results) failed += r.report.requests_failed;
    if (failed > 0) {
        return Status(
            StatusCode::kResourceExhausted,
            fmt::format("simulate: {} failed requests (see the report's failures)", failed));
    }
    return {};
}

void add_common_flags(CLI::App* sub, SimulateFlags& f) {
    sub->add_option("--model", f.model,
                    "built-in model name or model YAML/JSON file (default: the "
                    "topology's model)")
        ->check(non_empty());
    sub->add_option("--layers", f.layers, "override the model's number of layers")
        ->check(int_in(1, kMaxLayers));
    sub->add_option("--trace-format", f.req.trace_format, "auto|mooncake|azure")
        ->check(CLI::IsMember({"auto", "mooncake", "azure"}))
        ->capture_default_str();
    sub->add_option("--cost-model", f.cost_model,
                    "roofline (from the GPU spec table) or a cost.json written by pdsim calibrate")
        ->check(non_empty())
        ->capture_default_str();
}

// ---- bench ----

struct BenchFlags {
    SimulateFlags sim;
    int reps = 1;
    std::string json_path;
};

Status run_bench(BenchFlags& b) {
    SimulateFlags f = b.sim;
    if (b.reps < 1) return invalid_argument_error(fmt::format("--reps {}: must be >= 1", b.reps));
    if (f.req.trace.empty()) {
        PDSIM_ASSIGN_OR_RETURN(f.req.trace, data::find_data_file(data::DataKind::kTraces,
                                                                 "mooncake_conversation.jsonl"));
    }
    if (f.topology.empty()) {
        PDSIM_ASSIGN_OR_RETURN(f.topology, data::find_data_file(data::DataKind::kTopologies,
                                                                "dgx-h100-2node-1p1d-tp8.yaml"));
    }
    PDSIM_ASSIGN_OR_RETURN(Prepared p, prepare(f));
    const des::SimConfig c = make_config(p, f, des::SimMode::kDisagg);
    const double n = static_cast<double>(p.requests.size());
    json runs = json::array();
    double best_wall = 0;
    des::SimResult best;
    for (int i = 0; i < b.reps; ++i) {
        PDSIM_ASSIGN_OR_RETURN(des::SimResult r, des::run_simulation(c, p.requests));
        const des::SimStats& s = r.stats;
        runs.push_back({{"wall_s", s.wall_s},
                        {"cpu_s", s.cpu_s},
                        {"requests_per_wall_s", n / s.wall_s},
                        {"events", s.events},
                        {"events_per_s", static_cast<double>(s.events) / s.wall_s}});
        std::printf(
            "  run %d: %.3f s wall (%.3f s CPU), %.0f requests/s, %llu events (%.2fM "
            "events/s)\n",
            i + 1, s.wall_s, s.cpu_s, n / s.wall_s, static_cast<unsigned long long>(s.events),
            static_cast<double>(s.events) / s.wall_s / 1e6);
        if (i == 0 || s.wall_s < best_wall) {
            best_wall = s.wall_s;
            best = std::move(r);
        }
    }
    const des::SimStats& s = best.stats;
    const double rps = n / s.wall_s;
    const double eps = static_cast<double>(s.events) / s.wall_s;
    const metrics::Report& rep = best.report;
    std::printf(
        "pdsim bench simulate: %lld requests of %s on %s, %s, %s cost model\n"
        "  %.0f simulated requests per wall second (best of %d), %.2fM events per second: %.2fx "
        "the %.0f target\n"
        "  (%.0f requests per CPU second: the wall figure is lower when other processes share "
        "the core)\n"
        "  (trace loading %.3f s, not counted; simulated %.0f s; %lld completed, %lld failed; TTFT "
        "p50 %.1f ms, TPOT p50 %.2f ms)\n",
        static_cast<long long>(n), p.workload_label.c_str(), p.topology_label.c_str(),
        p.model.name.c_str(), f.cost_model.c_str(), rps, b.reps, eps / 1e6,
        rps / kTargetRequestsPerWallS, kTargetRequestsPerWallS, n / s.cpu_s, p.load_s, s.sim_s,
        static_cast<long long>(rep.requests_completed), static_cast<long long>(rep.requests_failed),
        rep.ttft_ms.p50, rep.tpot_ms.p50);
    std::fflush(stdout);
    if (!b.json_path.empty()) {
        json j = {{"requests", static_cast<int64_t>(n)},
                  {"wall_s", s.wall_s},
                  {"cpu_s", s.cpu_s},
                  {"requests_per_wall_s", rps},
                  {"requests_per_cpu_s", n / s.cpu_s},
                  {"events", s.events},
                  {"events_per_s", eps},
                  {"target_requests_per_wall_s", kTargetRequestsPerWallS},
                  {"ratio", rps / kTargetRequestsPerWallS},
                  {"runs", runs},
                  {"trace", f.req.trace},
                  {"trace_load_s", p.load_s},
                  {"topology", f.topology},
                  {"model", p.model.name},
                  {"cost_model", rep.extra["simulator"]["cost_model"]},
                  {"sim_s", s.sim_s},
                  {"requests_completed", rep.requests_completed},
                  {"requests_failed", rep.requests_failed}};
        PDSIM_RETURN_IF_ERROR(write_json_file("--json", b.json_path, j));
    }
    return {};
}

}  // namespace

void add_simulate_command(CLI::App& app, CommandSet& commands) {
    auto f = std::make_shared<SimulateFlags>();
    CLI::App* sub = app.add_subcommand(
        "simulate",
        "Discrete-event simulation of PD serving on a topology (any size, GPU or CPU): the\n"
        "testbed's routing and batching, forward times from a cost model, KV transfer as max-min\n"
        "fair flows over the topology's links. Writes the testbed's report keys. Exit 0 when "
        "every\n"
        "request completed; 2 on bad input; else 1.");
    sub->add_option("--topology", f->topology,
                    "topology file (YAML or JSON; required unless --like)")
        ->check(non_empty());
    sub->add_option("--trace", f->req.trace,
                    "trace file: Mooncake .jsonl or Azure .csv (required unless --like)")
        ->check(non_empty());
    sub->add_option("--like", f->like,
                    "replay a `pdsim testbed` report: its exact requests (ids, lengths, arrival "
                    "times), topology, model, mode, layerwise, scheduling and KV pool, unless a "
                    "flag here says otherwise; add --cost-model (e.g. from pdsim calibrate)")
        ->check(non_empty());
    add_common_flags(sub, *f);
    sub->add_option("--max-requests", f->req.max_requests, "simulate the first N requests")
        ->check(int_in(1, kMaxRequestCount));
    sub->add_option("--sample", f->req.sample, "a uniform random sample of N requests (order kept)")
        ->check(int_in(1, kMaxRequestCount));
    sub->add_option("--seed", f->req.seed, "seed for --sample")->capture_default_str();
    sub->add_option("--time-scale", f->req.time_scale, "multiply arrival times by X")
        ->check(real_in(0, kMaxTimeScale, /*lo_open=*/true))
        ->capture_default_str();
    sub->add_option("--max-input-len", f->req.max_input_len, "cap prompt lengths (0: none)")
        ->check(int_in(0, kMaxLengthCap))
        ->capture_default_str();
    sub->add_option("--max-output-len", f->req.max_output_len, "cap output lengths (0: none)")
        ->check(int_in(0, kMaxLengthCap))
        ->capture_default_str();
    sub->add_option("--mode", f->mode,
                    "auto|disagg|colocated|both (auto: disagg where the topology has prefill and "
                    "decode instances, colocated where its instances are colocated, e.g. one "
                    "instance serving whole requests)")
        ->check(CLI::IsMember({"auto", "disagg", "colocated", "both"}))
        ->capture_default_str();
    sub->add_option("--layerwise", f->layerwise,
                    "on: each chunk's KV streams while its forward computes; off: after it")
        ->capture_default_str();
    add_scheduling_flags(sub, f->sched);
    sub->add_option("--max-decode-kv-tokens", f->max_decode_kv_tokens,
                    "KV tokens per decode forward (0: no bound; the CPU testbed's is 2048 x "
                    "attention threads)")
        ->check(int_in(0, int64_t{1} << 30))
        ->capture_default_str();
    sub->add_option("--cpu-contention", f->cpu_contention,
                    "on|off: forwards of cpu instances on one node share its cores")
        ->capture_default_str();
    sub->add_option("--cost-noise", f->cost_noise,
                    "on|off: forward times vary as a calibrated cost file measured them on the "
                    "testbed (pdsim calibrate --from-timeline: slow and fast log-normal factors); "
                    "off: every forward takes the model's mean")
        ->capture_default_str();
    sub->add_option("--noise-seed", f->noise_seed, "seed of --cost-noise")->capture_default_str();
    sub->add_option("--speed-scale", f->speed_scale,
                    "auto: with --like and a calibrated cost file that both carry the machine-"
                    "speed probe (pdsim testbed --speed-probe-ms, pdsim calibrate's serve probe), "
                    "multiply each instance's decode forwards' time by its ranks' probe over the "
                    "calibration's, so that a machine that ran slower or faster than while "
                    "calibrating is simulated as it was (else 1); extends are not scaled (they did "
                    "not follow the probe: docs/fidelity.md 8.10); off: 1; or a factor in (0, 100] "
                    "for every forward")
        ->capture_default_str();
    sub->add_option("--core-wait", f->core_wait,
                    "auto: a calibrated cost file's core_wait (pdsim calibrate --topology measures "
                    "it where ranks of two instances share a core); off: none; or milliseconds. "
                    "Work that reaches an idle CPU instance while another instance's forward runs "
                    "on its cores starts that much later (its threads wait for the kernel to "
                    "schedule them)")
        ->capture_default_str();
    sub->add_option("--step-wait", f->step_wait,
                    "auto: a calibrated cost file's step_wait (pdsim calibrate --topology measures "
                    "it where a decode rank shares a core with other instances' ranks); off: none "
                    "(the default: with it, docs/fidelity.md section 8.8 over-predicted "
                    "cpu-2p1d-tp2-to-tp1's TPOT). A decode forward that ends while n other "
                    "instances compute on its cores is followed, with the measured chance for n, "
                    "by one scheduler slice's wait")
        ->check(CLI::IsMember({"auto", "off"}))
        ->capture_default_str();
    sub->add_option("--cpu-cores", f->cpu_cores,
                    "cores per node for --cpu-contention (0: the node's cpus, else this machine's)")
        ->check(real_in(0, 4096))
        ->capture_default_str();
    sub->add_option("--cpu-binding", f->cpu_binding,
                    "where the cpu ranks run, for --cpu-contention: none (anywhere on their node: "
                    "its cores are shared by every computing thread), core (bound as mpirun "
                    "--map-by core --bind-to core binds them: a node's ranks on cores 0, 1, ... in "
                    "turn; each core shared by the threads bound to it), or a core id per rank "
                    "(0,1,0,1,0). With --like: the cores the testbed's ranks were bound to, when "
                    "each was bound to one")
        ->capture_default_str();
    sub->add_option("--kv-pool-mb", f->kv_pool_mb, "cpu devices: KV pool per rank, MiB")
        ->check(int_in(1, kMaxKvPoolMb))
        ->capture_default_str();
    sub->add_option("--slo-ttft-ms", f->slo_ttft_ms, "TTFT SLO for goodput/attainment (0: none)")
        ->check(real_in(0, kMaxSloMs));
    sub->add_option("--slo-tpot-ms", f->slo_tpot_ms, "TPOT SLO for goodput/attainment (0: none)")
        ->check(real_in(0, kMaxSloMs));
    sub->add_option("--report", f->report, "write the report JSON here")->check(output_file());
    sub->add_option("--timeline", f->timeline, "write a Chrome/Perfetto trace-event timeline here")
        ->check(output_file());
    sub->add_option("--timeline-sample", f->timeline_sample,
                    "record every Nth request's lifecycle (0: about 1000 requests in all)")
        ->check(int_in(0, kMaxRequestCount));
    sub->add_option("--requests", f->requests,
                    "write the per-request CSV here (rows as requests "
                    "finish)")
        ->check(output_file());
    sub->add_flag("--progress", f->progress, "print a progress line on stderr");
    sub->add_flag("--quiet", f->quiet, "no summary table");
    commands.add(sub, [f, sub] {
        return run_simulate(*f, [sub](const char* flag) {
            const CLI::Option* option = sub->get_option_no_throw(flag);
            return option != nullptr && option->count() > 0;
        });
    });
}

void add_bench_simulate_command(CLI::App& bench, CommandSet& commands) {
    auto b = std::make_shared<BenchFlags>();
    CLI::App* sub = bench.add_subcommand(
        "simulate",
        "Simulator speed: the whole Mooncake conversation trace on dgx-h100-2node-1p1d-tp8 with\n"
        "llama3-70b and roofline costs (by default), in simulated requests per wall second "
        "against\n"
        "the 20,000 target (one core; trace loading not counted).");
    sub->add_option("--topology", b->sim.topology,
                    "topology file or shipped name (default: dgx-h100-2node-1p1d-tp8)")
        ->check(non_empty());
    sub->add_option("--trace", b->sim.req.trace,
                    "trace file (default: the shipped traces/mooncake_conversation.jsonl)")
        ->check(non_empty());
    add_common_flags(sub, b->sim);
    sub->add_option("--reps", b->reps, "runs; the fastest counts")
        ->check(int_in(1, 1000))
        ->capture_default_str();
    sub->add_option("--json", b->json_path, "write the figures as JSON here")->check(output_file());
    commands.add(sub, [b] { return run_bench(*b); });
}

}  // namespace pdsim::cli
