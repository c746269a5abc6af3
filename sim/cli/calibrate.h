// Internal to `pdsim calibrate` (sim/cli/calibrate_cmd.cpp, whose comment describes the
// measurements): its options and the two measuring parts it spawns or calls, the worker process's
// compute grid (calibrate_worker.cpp) and the KV transport ping-pongs (calibrate_transports.cpp).
// Thread-safety: the functions are called from the command's main thread, one at a time.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"

namespace pdsim::cli::calibration {

struct CalibrateOptions {
    std::string backend = "cpu";
    std::string model;
    std::string tp = "1";
    std::string threads;  // "": per TP size, max(1, cores / (2 tp))
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

}  // namespace pdsim::cli::calibration
