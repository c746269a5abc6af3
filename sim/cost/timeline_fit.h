// The fit of `pdsim calibrate --from-timeline` (docs/cost-models.md): the calibrated cost model's
// coefficients, CPU interference and forward-time noise from the forwards that `pdsim testbed
// --timeline` recorded, as a library the command calls (and tests call without a subprocess).
//
// Data flow: read_timeline_forwards() parses one timeline file into typed TimelineForward
// records; TimelineFitter::add_timeline() takes one file's records (leaders only: a TP follower
// times the same forward again; forwards that overlap another instance's are set aside for the
// interference fit, as the simulator's CPU contention model adds that slowdown);
// TimelineFitter::fit() fits every (tp, threads, kind) and returns the cost file's parts.
//
// Thread-safety: read_timeline_forwards and fit_to_json are pure; a TimelineFitter is not
// thread-safe (one caller at a time).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/cost_model.h"

namespace pdsim::cost {

// A fit needs several distinct batches, not just as many points as features.
inline constexpr size_t kMinTimelinePoints = 8;
// The slow part of forward-time variation is measured over windows of this much testbed time.
inline constexpr double kNoiseWindowS = 0.05;
// The fast part's distribution is written as this many + 1 quantiles.
inline constexpr size_t kNoiseQuantiles = 32;

// One forward slice of a testbed timeline (a Chrome trace "X" event of category "forward" whose
// args carry instance, tp, tp_rank and threads). Times are the timeline's, in microseconds.
struct TimelineForward {
    double begin_us = 0;     // ts
    double end_us = 0;       // ts + dur
    double duration_us = 0;  // dur
    int instance = 0;
    int tp = 1;
    int tp_rank = 0;  // 0: the instance's leader, the only rank whose forwards are fitted
    int threads = 1;
    // "cpu" or "gpu" (a GPU rank's forward; timelines before GPU ranks say nothing: "cpu").
    std::string device = "cpu";
    double compute_threads = 0;  // tp x max(1, threads): the cores the instance computes on
    // The rank thread's CPU time over the forward (`thread_cpu_us`, CPU ranks of timelines since
    // the stream's caller first); -1 where the slice has none.
    double thread_cpu_us = -1;
    // The batch, read for leader forwards of positive duration only (the others are used only to
    // tell which forwards overlap):
    bool decode = false;            // the slice has kv_tokens
    int64_t batch = 0;              // decode: requests
    int64_t kv_tokens = 0;          // decode: KV tokens of the whole batch
    std::vector<ExtendItem> items;  // extend: (new, cached) tokens per request
};

// Parses the timeline file at `path` (a JSON array of events, or an object with a traceEvents
// array) into its forward slices, sorted by begin. Slices without the batch args (an older
// timeline's) are skipped. Errors are kInvalidArgument, "<flag> <path>: ...": cannot open, not
// JSON (with the parser's line and column), no traceEvents array, or a forward slice with a
// missing or mistyped field (naming the field, and the slice's ts where the batch is wrong).
// `flag` is the option the caller read the path from ("--from-timeline").
[[nodiscard]] StatusOr<std::vector<TimelineForward>> read_timeline_forwards(
    const std::string& path, const std::string& flag = "--from-timeline");

// The request slices of the timeline at `path` ("r<id> to first token", cat "request", from the
// request's arrival): request id -> arrival on the timeline's clock (us). Errors as
// read_timeline_forwards'; a timeline without request slices gives an empty map.
[[nodiscard]] StatusOr<std::map<int64_t, double>> read_timeline_arrivals(
    const std::string& path, const std::string& flag = "--from-timeline");

// For forwards sorted by begin (as read_timeline_forwards returns them): whether each overlaps a
// forward of another instance (any TP rank's), the forwards the simulator's CPU contention model
// slows down.
[[nodiscard]] std::vector<bool> overlapped_forwards(std::span<const TimelineForward> forwards);

// One fit as the cost file stores it (coefficients under `keys`, fit statistics, num_points);
// `source` (a --from-timeline fit's origin) when not empty.
[[nodiscard]] nlohmann::json fit_to_json(std::span<const char* const> keys, const LinearFit& fit,
                                         size_t num_points, const std::string& source = "");

// For each leader forward of `forwards` (sorted by begin) that another instance's leader forward
// overlapped: its index, the seconds no other instance computed during it (alone_s), and the
// core-seconds the simulator's node-wide contention model gives it over the rest (shared_core_s:
// min(1, node_cpus / compute threads running) per compute thread), so that with iso its time
// alone the model's interference x solves iso = alone_s + shared_core_s / (1 + x). With
// `rank_cores` (per timeline instance, the core each of its ranks is bound to), the bound model's
// share instead (cpu_contention.h): the forward runs at its slowest rank's thread share of that
// rank's core, 1 / (threads bound there that compute), as `pdsim simulate --cpu-binding` sees it.
struct OverlapSplit {
    size_t index = 0;
    double alone_s = 0;
    double shared_core_s = 0;
};
[[nodiscard]] std::vector<OverlapSplit> overlap_splits(
    std::span<const TimelineForward> forwards, double node_cpus,
    std::span<const std::vector<int>> rank_cores = {});

// Work reaching an idle instance while another instance's forward runs on its cores (the
// simulator's core wait, cost::CoreWait): a request of a testbed run, on the timeline's clock.
struct DispatchRequest {
    double arrival_us = 0;        // reached the router
    double prefill_start_us = 0;  // its first forward began
    int instance = 0;             // its prefill instance (the timeline's instance index)
};
// The dispatch waits (prefill start - arrival) of the requests that arrived with their instance
// idle (no forward of it in flight, no request of it waiting), split by whether a forward of
// another instance was then in flight on one of the instance's cores (`instance_cores[i]`: the
// cores instance i's ranks may run on; an instance beyond it shares nothing). Forwards of every TP
// rank count; `forwards` sorted by begin or not.
struct DispatchWaits {
    std::vector<double> core_busy_s;
    std::vector<double> idle_s;
};
[[nodiscard]] DispatchWaits dispatch_waits(std::span<const DispatchRequest> requests,
                                           std::span<const TimelineForward> forwards,
                                           std::span<const std::vector<int>> instance_cores);

// The decode's wait between its own forwards on a shared core (cost::StepWait): for every two
// consecutive decode forwards of an instance's leader less than kMaxStepGapUs apart (the next one
// waited only for the core, not for work), the gap from the first one's end to the next one's
// begin and the next one's duration, with the number of other instances that had a forward (any TP
// rank) in flight on one of its cores (`instance_cores`, as dispatch_waits') at that end.
// `forwards` sorted by begin or not. O(forwards x log forwards).
inline constexpr double kMaxStepGapUs = 20000;
struct StepGap {
    int competitors = 0;
    double gap_s = 0;
    double next_s = 0;  // the next forward's duration
};
[[nodiscard]] std::vector<StepGap> decode_step_gaps(
    std::span<const TimelineForward> forwards, std::span<const std::vector<int>> instance_cores);

// The step wait of `gaps` (decode_step_gaps of one or more runs) as the cost file's "step_wait"
// stores it: per number of competitors n from 1, while at least `min_gaps` gaps saw n:
//   chance       the share of gaps longer than kStepWaitSliceUs (a scheduler slice waited);
//   slice_ms     those gaps' mean;
//   wait_ms      what such a step adds over one that did not wait: the mean of gap + next
//                forward over the slices less the same mean over the other gaps at n (>= 0; the
//                slice's mean when every gap at n was one). A thread that waited a slice runs its
//                next forward faster (the kernel owes it the time), which the simulator's fair
//                core share already averages in, so the slice itself would count that time twice;
// with the count (gaps) and every gap's mean (mean_gap_ms); "idle" has the gaps with no
// competitor (count and mean, for the record: the simulator starts those at once). {"decode": []}
// when n = 1 has too few.
inline constexpr double kStepWaitSliceUs = 1000;
[[nodiscard]] nlohmann::json fit_step_wait(std::span<const StepGap> gaps, size_t min_gaps);

struct TimelineFitOptions {
    // Also fit forwards that overlap another instance's (default: set aside for interference).
    bool include_overlapped = false;
    // Cores of the machine the timelines ran on, for the contention model's core share (> 0).
    double node_cpus = 1;
    // In error messages and the source: the --from-timeline text and the --base path ("": none).
    std::string flag = "--from-timeline";
    std::string timelines_label;
    std::string base_path;
};

// What add_timeline took from one file (the cost file's source.files entry).
struct TimelineFileSummary {
    std::string path;
    size_t forwards = 0;            // leader forwards added to the fit
    size_t overlapped_skipped = 0;  // leader forwards left out as overlapping another instance's
};

class TimelineFitter {
public:
    explicit TimelineFitter(TimelineFitOptions options);

    // Adds the leader forwards of one timeline (`forwards` sorted by begin, as
    // read_timeline_forwards returns them). kInvalidArgument naming `path` when none is usable.
    [[nodiscard]] StatusOr<TimelineFileSummary> add_timeline(
        const std::string& path, std::span<const TimelineForward> forwards);

    // Fits every (tp, threads) seen, both kinds: with two or more files each file's times are
    // first scaled to the median run's level. A kind without forwards is taken from `base`
    // (nullptr: none; a cost file of the same model) or is an error; fewer than
    // kMinTimelinePoints forwards is an error (kInvalidArgument naming the timelines, tp, threads
    // and kind). Returns {"fits", "interference", "noise", "source", "transports" (base's, else
    // {})}, as the cost file stores them.
    [[nodiscard]] StatusOr<nlohmann::json> fit(const CostFile* base) const;

    // Where a fitted point ran (for the noise fit's windows).
    struct Where {
        size_t file = 0;
        int instance = 0;
        double t = 0;  // start, seconds
    };
    // The fitted points of one (tp, threads): features, seconds and origin per kind.
    struct Group {
        std::vector<std::vector<double>> ex, dx;
        std::vector<double> ey, dy;
        std::vector<Where> ew, dw;
    };
    // A leader forward that overlapped other instances' forwards, reduced to what the
    // interference fit needs: with iso its fitted isolated time, the simulator's model says
    //   iso = alone_s + shared_core_s / (1 + interference)
    // where alone_s is the time no other instance computed and shared_core_s integrates, over
    // the rest, the share of a core per compute thread that the contention model gives
    // (min(1, node cpus / compute threads running)).
    struct OverlappedForward {
        size_t file = 0;
        std::pair<int, int> key;  // (tp, threads)
        bool decode = false;
        std::vector<double> features;
        double alone_s = 0, shared_core_s = 0;
    };

private:
    using Levels = std::map<std::pair<size_t, bool>, double>;  // (file, decode) -> relative level
    using Coefficients = std::map<std::pair<std::pair<int, int>, bool>, std::vector<double>>;

    Levels run_levels(std::map<std::pair<int, int>, Group>* groups, nlohmann::json* levels) const;
    StatusOr<nlohmann::json> fit_groups(const std::map<std::pair<int, int>, Group>& groups,
                                        const CostFile* base, Coefficients* coef) const;
    nlohmann::json fit_interference(const Coefficients& coef, const Levels& level) const;

    TimelineFitOptions options_;
    std::vector<TimelineFileSummary> files_;
    std::map<std::pair<int, int>, Group> groups_;
    std::set<std::string> devices_;  // of the leader forwards added ("cpu", "gpu")
    std::vector<OverlappedForward> overlapped_;
};

}  // namespace pdsim::cost
