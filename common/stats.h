// Order statistics of samples: the median and percentiles that pdsim's commands report (bench
// figures, calibrate's per-point times, run levels, noise quantiles).
//
// Definitions (one for the whole tree):
//   median: the middle value of an odd count; the mean of the two middle values of an even count.
//   quantile(q), q in [0, 1]: linear interpolation between the closest ranks of the sorted
//     samples (position q * (n - 1); numpy's default "linear" method); percentile(p) is
//     quantile(p / 100).
// Empty input: every function returns 0 (a figure of no samples; callers that must tell "no
// samples" apart check the size themselves).
// Preconditions: q in [0, 1] and p in [0, 100] (clamped otherwise); no NaN among the samples (the
// order of a NaN is undefined).
// Thread-safety: pure functions; the vector overloads sort their own copy.
#pragma once

#include <span>
#include <vector>

namespace pdsim::stats {

// The median of `samples` (any order).
[[nodiscard]] double median(std::vector<double> samples);
// The median of samples sorted ascending.
[[nodiscard]] double median_sorted(std::span<const double> sorted);

// The q-quantile of `samples` (any order).
[[nodiscard]] double quantile(std::vector<double> samples, double q);
// The q-quantile of samples sorted ascending.
[[nodiscard]] double quantile_sorted(std::span<const double> sorted, double q);

// The p-th percentile (p in [0, 100]) of `samples` (any order).
[[nodiscard]] double percentile(std::vector<double> samples, double p);

// A benchmark figure: the best (smallest) and the median of its timed runs, in their unit.
struct BestAndMedian {
    double best = 0;
    double median = 0;
};
[[nodiscard]] BestAndMedian best_and_median(std::vector<double> samples);

}  // namespace pdsim::stats
