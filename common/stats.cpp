#include "common/stats.h"

#include <algorithm>

namespace pdsim::stats {

double median_sorted(std::span<const double> sorted) {
    const size_t n = sorted.size();
    if (n == 0) return 0;
    return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

double median(std::vector<double> samples) {
    std::sort(samples.begin(), samples.end());
    return median_sorted(samples);
}

BestAndMedian best_and_median(std::vector<double> samples) {
    if (samples.empty()) return {};
    std::sort(samples.begin(), samples.end());
    return {.best = samples.front(), .median = median_sorted(samples)};
}

double quantile_sorted(std::span<const double> sorted, double q) {
    if (sorted.empty()) return 0;
    const double position = std::clamp(q, 0.0, 1.0) * static_cast<double>(sorted.size() - 1);
    const auto lower = static_cast<size_t>(position);
    const size_t upper = std::min(lower + 1, sorted.size() - 1);
    return sorted[lower] +
           (sorted[upper] - sorted[lower]) * (position - static_cast<double>(lower));
}

double quantile(std::vector<double> samples, double q) {
    std::sort(samples.begin(), samples.end());
    return quantile_sorted(samples, q);
}

double percentile(std::vector<double> samples, double p) {
    return quantile(std::move(samples), p / 100);
}

}  // namespace pdsim::stats
