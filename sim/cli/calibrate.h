// Internal to `pdsim calibrate` (sim/cli/calibrate_cmd.cpp, whose comment describes the
// measurements): its options and the two measuring parts it spawns or calls, the worker process's
// compute grid (calibrate_worker.cpp) and the KV transport ping-pongs (calibrate_transports.cpp).
// Thread-safety: the functions are called from the command's main thread, one at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"

namespace pdsim::cli::calibration {

struct CalibrateOptions {
    std::string backend = "cpu";
    std::string model;
    std::string tp = "1";
    bool tp_given = false;  // --tp was on the command line (else --topology's TP sizes)
    std::string threads;    // "": per TP size, max(1, cores / (2 tp))
    std::string transport = "local,tcp,mpi";
    bool quick = false;
    std::string out;
    int page_size = 16;
    int repeats = 0;            // 0: 7, --quick 3
    std::string worker;         // hidden: "TP:THREADS" (a worker process)
    std::string from_timeline;  // comma-separated testbed timelines: fit those forwards instead
    std::string base;           // a cost file for the (tp, kind) the timelines have no forwards of
    bool include_overlapped = false;
    double node_cpus = 0;  // --from-timeline: cores of the machine the timelines ran on (0: this)
    bool serve_probe = true;  // --serve-probe on|off (microbenchmark runs only)
    // --stream-sync caller|worker: how the grid's ranks (and the serve probe's testbed) wait for a
    // forward, as `pdsim testbed --stream-sync` (caller: the rank's thread runs the stream's work,
    // the testbed's default; worker: two thread hand-offs per forward).
    std::string stream_sync = "caller";
    // --bind core|none: bind each grid rank's thread to `threads` cores of its own, round-robin
    // over the cores calibrate may use (as `mpirun --map-by core --bind-to core` binds the
    // testbed's ranks, and the serve probe's), or leave them to the scheduler.
    std::string bind = "core";
    // --topology T: the serve probe runs T itself (its layout's core sharing, TP groups and
    // contention) instead of one prefill and one decode instance per fit, and measures the core
    // wait there (cost::CoreWait); --tp defaults to T's TP sizes.
    std::string topology;
};

// This machine's cores (at least 1).
[[nodiscard]] int cores();
// Compute threads per rank when --threads is not given: max(1, cores / (2 tp)).
[[nodiscard]] int default_threads(int tp);
// Timed rounds over the grid: --repeats, else 7 (--quick 3).
[[nodiscard]] int repeats_of(const CalibrateOptions& o);

// ---- the worker (calibrate_worker.cpp) ----

// Points of the grid a worker with `threads` compute threads times.
[[nodiscard]] size_t grid_points(bool quick, int threads);
// The worker process (`calibrate --worker TP:THREADS`): builds `tp` testbed ranks as threads,
// times the grid and writes {"tp", "threads", "points"} to o.out. Errors: a rank's build or
// forward (with the rank named), kInvalidArgument when o.out cannot be written.
[[nodiscard]] Status run_worker(const CalibrateOptions& o, const model::ModelConfig& m, int tp,
                                int threads);

// ---- transports (calibrate_transports.cpp) ----

// KV-sized messages: one layer's K buffer for runs of pages (fp32 pool, TP 1).
[[nodiscard]] std::vector<size_t> message_sizes(const CalibrateOptions& o,
                                                const model::ModelConfig& m);
// Timed messages per size.
[[nodiscard]] int message_reps(const CalibrateOptions& o);
// Whether `name` is measured by measure_in_process: every transport but those whose ranks come
// from a launcher (mpi, measured by measure_mpi). Unknown names: true (measuring them reports it).
[[nodiscard]] bool measured_in_process(const std::string& name);
// `name` (local or tcp) between two endpoints of this process: the link fit
// {"gbps", "latency_us", "r2", "max_rel_err", "points"}. Blocks for the whole measurement.
[[nodiscard]] StatusOr<nlohmann::json> measure_in_process(const std::string& name,
                                                          const std::vector<size_t>& sizes,
                                                          int reps);

// How this process was launched (mpirun's or PMI's environment).
struct Launcher {
    bool under_mpirun = false;
    int world = 1;
    int rank = 0;
};
[[nodiscard]] Launcher detect_launcher();
// Both ranks of `mpirun -np 2`: rank 0 ping-pongs each size with rank 1. Initializes and
// finalizes MPI. Returns the fit on rank 0, null on rank 1.
[[nodiscard]] StatusOr<nlohmann::json> measure_mpi(const std::vector<size_t>& sizes, int reps);

// ---- child processes (calibrate_probe.cpp) ----

struct ChildExit {
    int code = 0;            // the exit status, or 128 + the signal that ended it
    bool timed_out = false;  // stopped (SIGTERM, 3 s later SIGKILL) after the timeout
};
// Runs `args` (args[0] a path) with `env` ("NAME=value" each; nullptr: this process's
// environment) and waits for it: at most `timeout` when positive, else without limit. With a
// non-empty `log`, stdout and stderr go to that file and stdin comes from /dev/null; otherwise
// the child shares this process's. Errors (kInternal): it cannot be started (naming args[0] and
// why), or waitpid fails.
[[nodiscard]] StatusOr<ChildExit> run_child(const std::vector<std::string>& args,
                                            const std::vector<std::string>* env,
                                            const std::string& log, std::chrono::seconds timeout);

// ---- wake-up ----
// After the grid the worker idles 60 ms, then times 16 decode forwards (batch 1, 256 KV tokens)
// back to back, 12 times, and writes the per-index medians ({"wake": {"median_s": [...]}}); the
// parent fits them with cost::fit_wake (sim/cost/calibrated.h) into the fit's "wake".

// ---- the serve probe (calibrate_probe.cpp) ----
//
// The grid times forwards back to back in a worker process. A testbed rank runs the same forwards
// between its scheduler's steps, beside its transfer engine's and its transport's progress threads
// on the one core mpirun binds it to, and they take longer (measured 8% for extends and 14% for
// decodes on the 2-core VM; docs/fidelity.md section 8). The probe measures that on this machine:
// per fit (tp, threads), a short `pdsim testbed --mode disagg` of one prefill and one decode
// instance of that TP under mpirun, bound as docs/testbed.md says (--map-by core --bind-to core),
// replaying the first requests of the default (Mooncake) trace with --timeline; then, per kind,
// the measured over the predicted time in all of its leader forwards that no other instance
// overlapped (the simulator's contention model covers the others) scales that kind's coefficients.
// A sum, not a median of ratios: a request's TPOT is the mean of its steps, and single testbed
// forwards are skewed right (a batch-1 decode's mean is ~10% above its median), so the fit must
// give the mean forward. The decode forwards among the kServeProbeWarmupForwards forwards of an
// instance after each idle gap of cost::kWakeMinIdleS or more are left out
// (cost::decode_warmup): the fit's `wake` adds
// their slowdown (extends, tens of ms each, are kept: the probe's prefill idles before most).

// Requests the probe replays (--quick: 24), and its runs per fit (--quick: 1; the factor is the
// median of the runs' own medians).
inline constexpr int kServeProbeRequests = 48;
inline constexpr int kServeProbeRuns = 3;
// Fewer forwards of a kind than this: that kind keeps the grid's fit (with a note).
inline constexpr size_t kMinServeProbeForwards = 8;
inline constexpr int kServeProbeWarmupForwards = 8;
// A factor outside this range means the probe did not measure what it should: an error. (Wide:
// TP 2 decode forwards of mpirun'd processes measured 0.52x the grid's, whose TP ranks are
// threads of one process waking each other for every all-gather.)
inline constexpr std::pair<double, double> kServeProbeFactorRange = {0.2, 5.0};

// --topology T (calibrate.h's CalibrateOptions::topology): the probe runs T with
// kTopologyProbeRequests synthetic requests (--quick: 24) offered at kTopologyProbeLoad of the
// prefill capacity the grid predicts for T, so that requests also reach idle instances while
// others compute: the probe then measures the core wait, cost::CoreWait (cost::dispatch_waits:
// the mean wait of at least kMinCoreWaitEvents such requests; else none, with a note). The fits
// are scaled by T's forwards of their (tp, threads); a kind T does not run keeps the grid's fit.
inline constexpr int kTopologyProbeRequests = 64;
inline constexpr double kTopologyProbeLoad = 0.6;
inline constexpr double kSyntheticRate = 4.0;  // the testbed's --synthetic arrivals (req/s)
inline constexpr size_t kMinCoreWaitEvents = 8;

// What a probe run replays: `synthetic` requests at `time_scale` when > 0, else the first
// `max_requests` of the default trace (arriving together).
struct ProbeWorkload {
    int synthetic = 0;
    double time_scale = 1;
    int max_requests = kServeProbeRequests;
};
// Where a probe run writes (requests: the per-request CSV, "" for none).
struct ProbeOutputs {
    std::string timeline, report, requests;
};

// The probe's command line for one run: mpirun (with --allow-run-as-root as root) of `ranks`
// ranks, bound to cores, running `exe testbed --mode disagg` on `topology` with the calibration's
// model, backend, page size, stream sync, `threads` and the prompt seed, replaying `workload` and
// writing `out`.
[[nodiscard]] std::vector<std::string> serve_probe_command(const CalibrateOptions& o,
                                                           const std::string& mpirun,
                                                           const std::string& exe, int ranks,
                                                           int threads, const std::string& topology,
                                                           const ProbeWorkload& workload,
                                                           const ProbeOutputs& out, int seed);

// Runs the probe for every fit in `fits` (each {"tp", "threads", "extend", "decode", ...}),
// comparing with `cost_json` (the cost file of the grid's fits), and scales each fit's
// coefficients in place, recording {"extend_factor", "decode_factor", "*_run_factors",
// "*_forwards", "requests", "runs", "wall_s"} as fit["serve_probe"]. No mpirun on PATH: a note, the
// fits unchanged. Blocks for the probe runs (seconds each, at most 300 s). Errors (kUnavailable,
// with the command and the log's tail): a probe run failed or timed out, or measured a factor
// outside kServeProbeFactorRange; the fits probed before it stay scaled (with serve_probe), that
// one and the rest stay the grid's. `pdsim calibrate` then still writes the file, with a note,
// and exits 1.
// The cost file's `speed_probe` (cost::CostFile::speed_probe) from the fits' serve probe runs
// (serve_probe.speed_cpu_ms, the median speed probe of each run's testbed ranks): the median over
// every run; null when no run sampled it.
[[nodiscard]] nlohmann::json speed_probe_of_fits(const nlohmann::json& fits);
// With --topology, `core_wait` gets the cost file's "core_wait" ({"dispatch_ms", "events",
// "idle_dispatch_ms", "idle_events", "topology", "runs"}) when enough requests measured it, and
// `step_wait` its "step_wait" (cost::fit_step_wait of the runs' decode gaps, with "topology" and
// "runs") when at least kMinStepWaitGaps gaps saw one other instance computing on the decode's
// cores; else each stays null, with a note.
inline constexpr size_t kMinStepWaitGaps = 30;
[[nodiscard]] Status apply_serve_probe(const CalibrateOptions& o, const model::ModelConfig& m,
                                       const nlohmann::json& cost_json, nlohmann::json* fits,
                                       nlohmann::json* notes, nlohmann::json* core_wait,
                                       nlohmann::json* step_wait);

}  // namespace pdsim::cli::calibration
