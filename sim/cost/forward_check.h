// The per-forward check of a cost model against a testbed run (`pdsim calibrate --check`,
// docs/cost-models.md): every forward an instance leader timed in a `pdsim testbed --timeline`
// run, beside what the cost model predicts for the same batch, grouped by what a forward is
// (kind, TP, threads, batch size) and by whether another instance computed at the same time. It
// answers "which forwards does the simulator get wrong, and by how much", the question behind a
// simulated TTFT that is short of the testbed's.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"
#include "sim/cost/cost_model.h"
#include "sim/cost/timeline_fit.h"

namespace pdsim::cost {

// One group of forwards. ratio = measured / predicted per forward; its percentiles are over the
// group's forwards (a ratio above 1: the testbed was slower than the model).
struct ForwardCheckRow {
    bool decode = false;
    int tp = 1;
    int threads = 1;
    bool overlapped = false;  // another instance's forward overlapped these (contention)
    std::string bucket;       // "new tokens 256-1023" (extend), "batch 4-7" (decode)
    size_t count = 0;
    double measured_ms_p50 = 0;
    double predicted_ms_p50 = 0;
    double ratio_p10 = 0, ratio_p50 = 0, ratio_p90 = 0;
    double measured_ms_sum = 0, predicted_ms_sum = 0;  // the group's share of the run's time
    // Median of measured time / the rank thread's CPU time over the forward (TimelineForward::
    // thread_cpu_us), of the forwards that carry it; 0 when none does. Above 1: the forward
    // waited for its core (another thread or rank held it).
    double wall_over_cpu_p50 = 0;
};

// Leader forwards of positive duration only (a TP follower times the same forward again).
// Batches group as extend by new tokens of the forward (1-63, 64-255, 256-1023, 1024+) and decode
// by requests (1, 2-3, 4-7, 8-15, 16+). `model` is the model the run served (the cost file's fits
// are per model). Rows are sorted by kind, tp, threads, overlapped, then bucket order, plus one
// "all" row per (kind, tp, threads, overlapped). kInvalidArgument when the cost file has no fit for
// a (tp, threads) the forwards ran with (naming it), or when there is no leader forward at all.
[[nodiscard]] StatusOr<std::vector<ForwardCheckRow>> check_forwards(
    std::span<const TimelineForward> forwards, const CostFile& cost,
    const model::ModelConfig& model);

// Each instance's decode warm-up, as a mask over `forwards` (sorted by begin): of the leader
// forward that follows a gap of at least min_idle_s since the instance's previous forward ended
// (or is its first) and the warmup - 1 after it, the decode ones are true (their slowdown is the
// cost file's `wake`, which the simulator adds on its own). Extends, tens of ms each, and the
// other ranks' forwards (which only tell overlaps) are false.
[[nodiscard]] std::vector<bool> decode_warmup(std::span<const TimelineForward> forwards,
                                              double min_idle_s, int warmup);

// The rows as a markdown table (one line each).
[[nodiscard]] std::string forward_check_table(std::span<const ForwardCheckRow> rows);

// Time between an instance's consecutive forwards: from one leader forward's end to the next
// one's begin. The simulator starts an instance's next forward the moment its last one ends (no
// time between them), so a testbed run's gaps are what it leaves out: the rank's main loop
// scheduling the step, and on a core shared with other ranks the wait for the core. Gaps of
// kIdleGapS or more are the instance waiting for work and are not counted.
inline constexpr double kIdleGapS = 0.005;

struct ForwardGapRow {
    int instance = 0;
    bool decode = false;            // the kind of most of the instance's forwards
    bool others_computing = false;  // another instance's forward was in flight at the gap's middle
    size_t count = 0;               // gaps
    double gap_ms_mean = 0, gap_ms_p50 = 0, gap_ms_p90 = 0;
    double gap_ms_sum = 0;
    double forward_ms_sum = 0;  // the instance's forwards (every row of the instance: all of them)
};

// Rows sorted by instance, then others_computing (no before yes); an instance with no counted
// gap has no row. `forwards` sorted by begin, as read_timeline_forwards returns them.
[[nodiscard]] std::vector<ForwardGapRow> forward_gaps(std::span<const TimelineForward> forwards);

// The rows as a markdown table (one line each).
[[nodiscard]] std::string forward_gap_table(std::span<const ForwardGapRow> rows);

}  // namespace pdsim::cost
