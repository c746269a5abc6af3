// common/stats.h: median and quantiles against an independent oracle (a sorted copy indexed by
// hand, and an exact rational interpolation), odd and even sizes, and the empty input.
#include "common/stats.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdsim::stats {
namespace {

// Deterministic shuffled samples: a permutation of 0 .. n-1 scaled, so every order statistic is
// known exactly (the k-th smallest is k * 0.5).
std::vector<double> shuffled(size_t n) {
    std::vector<double> v;
    uint64_t state = 12345;
    for (size_t i = 0; i < n; ++i) v.push_back(static_cast<double>(i) * 0.5);
    for (size_t i = n; i > 1; --i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        std::swap(v[i - 1], v[(state >> 33) % i]);
    }
    return v;
}

TEST(Stats, MedianOfOddCountIsTheMiddleValue) {
    EXPECT_EQ(median({3.0}), 3.0);
    EXPECT_EQ(median({5.0, 1.0, 4.0}), 4.0);
    for (size_t n : {1u, 3u, 7u, 101u}) {
        // The middle of 0, 0.5, ..., (n - 1) / 2.
        EXPECT_EQ(median(shuffled(n)), static_cast<double>(n / 2) * 0.5) << "n " << n;
    }
}

TEST(Stats, MedianOfEvenCountAveragesTheMiddlePair) {
    EXPECT_EQ(median({1.0, 2.0}), 1.5);
    EXPECT_EQ(median({10.0, 1.0, 4.0, 2.0}), 3.0);  // (2 + 4) / 2, not the upper 4
    for (size_t n : {2u, 4u, 8u, 100u}) {
        const double lower = static_cast<double>(n / 2 - 1) * 0.5;
        EXPECT_EQ(median(shuffled(n)), lower + 0.25) << "n " << n;
    }
}

TEST(Stats, EmptyInputGivesZero) {
    EXPECT_EQ(median({}), 0.0);
    EXPECT_EQ(median_sorted({}), 0.0);
    EXPECT_EQ(quantile({}, 0.5), 0.0);
    EXPECT_EQ(percentile({}, 99), 0.0);
}

TEST(Stats, MedianSortedAgreesWithMedian) {
    for (size_t n = 1; n < 20; ++n) {
        std::vector<double> v = shuffled(n);
        std::vector<double> sorted = v;
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(median_sorted(sorted), median(v)) << "n " << n;
    }
}

// Oracle: on 0, 0.5, ..., (n - 1) / 2 the linear quantile at q is q * (n - 1) * 0.5 exactly when
// q * (n - 1) is a multiple of 1/4 (all values below are dyadic, so no rounding).
TEST(Stats, QuantilesInterpolateBetweenClosestRanks) {
    for (size_t n : {1u, 2u, 5u, 9u, 33u}) {
        const std::vector<double> v = shuffled(n);
        std::vector<double> sorted = v;
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(quantile(v, 0), sorted.front()) << "n " << n;
        EXPECT_EQ(quantile(v, 1), sorted.back()) << "n " << n;
        for (double q : {0.25, 0.5, 0.75}) {
            const double want = q * static_cast<double>(n - 1) * 0.5;
            EXPECT_EQ(quantile(v, q), want) << "n " << n << " q " << q;
            EXPECT_EQ(percentile(v, q * 100), want) << "n " << n << " p " << q * 100;
        }
    }
}

TEST(Stats, PercentilesOfUnevenSamplesMatchASortedArray) {
    // 4 samples: position p / 100 * 3 between sorted[lo] and sorted[lo + 1].
    const std::vector<double> v = {40.0, 10.0, 30.0, 20.0};
    EXPECT_DOUBLE_EQ(percentile(v, 50), 25.0);
    EXPECT_DOUBLE_EQ(percentile(v, 90), 30.0 + 10.0 * 0.7);   // position 2.7
    EXPECT_DOUBLE_EQ(percentile(v, 99), 30.0 + 10.0 * 0.97);  // position 2.97
    EXPECT_DOUBLE_EQ(percentile(v, 10), 10.0 + 10.0 * 0.3);   // position 0.3
    // Out of range: clamped to the extremes.
    EXPECT_EQ(percentile(v, 150), 40.0);
    EXPECT_EQ(quantile(v, -1), 10.0);
}

TEST(Stats, TiesAndRepeatedValues) {
    EXPECT_EQ(median({2.0, 2.0, 2.0, 2.0}), 2.0);
    EXPECT_EQ(median({1.0, 2.0, 2.0, 9.0}), 2.0);
    EXPECT_EQ(quantile({7.0, 7.0, 7.0}, 0.3), 7.0);
}

}  // namespace
}  // namespace pdsim::stats
