// ForwardNoise (sim/des/forward_noise.h): the factors each forward's duration gets, checked
// against the contract's formulas evaluated here on an identically seeded generator.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "sim/des/forward_noise.h"

namespace pdsim::des {
namespace {

TEST(ForwardNoise, WithoutVariationTheDurationIsUnchanged) {
    ForwardNoise none;
    EXPECT_FALSE(none.any());
    EXPECT_EQ(none.apply(false, 0.0, 0.25), 0.25);
    ForwardNoise empty(cost::CostNoise{}, cost::CostNoise{}, 7);
    EXPECT_FALSE(empty.any());
    EXPECT_EQ(empty.apply(true, 3.0, 1.5), 1.5);
}

TEST(ForwardNoise, FastQuantilesInterpolateAUniformDraw) {
    cost::CostNoise extend;
    extend.fast_quantiles = {0.5, 1.0, 3.0};
    ForwardNoise noise(extend, cost::CostNoise{}, 42);
    ASSERT_TRUE(noise.any());
    std::mt19937_64 oracle(42);
    for (int i = 0; i < 100; ++i) {
        const double u = std::uniform_real_distribution<double>(0, 1)(oracle);
        // Two segments: [0.5, 1] for u < 0.5, [1, 3] above.
        const double factor = u < 0.5 ? 0.5 + u * 2 * 0.5 : 1.0 + (u * 2 - 1) * 2.0;
        EXPECT_NEAR(noise.apply(false, i * 0.1, 2.0), 2.0 * factor, 1e-12) << i;
    }
    // Decode has no variation and draws nothing.
    EXPECT_EQ(noise.apply(true, 11.0, 2.0), 2.0);
}

TEST(ForwardNoise, EqualQuantilesGiveAConstantFactor) {
    cost::CostNoise decode;
    decode.fast_quantiles = {1.25, 1.25};
    ForwardNoise noise(cost::CostNoise{}, decode, 1);
    for (int i = 0; i < 10; ++i) EXPECT_DOUBLE_EQ(noise.apply(true, i, 0.4), 0.5);
    EXPECT_EQ(noise.apply(false, 10, 0.4), 0.4);
}

TEST(ForwardNoise, TheSlowFactorHoldsForItsPeriodThenIsRedrawn) {
    cost::CostNoise extend;
    extend.slow_cv = 0.5;
    extend.slow_period_s = 1.0;
    ForwardNoise noise(extend, cost::CostNoise{}, noise_seed_for(3, 1));
    std::mt19937_64 oracle(noise_seed_for(3, 1));
    const double first = lognormal_mean1(oracle, 0.5);
    EXPECT_DOUBLE_EQ(noise.apply(false, 0.0, 1.0), first);
    EXPECT_DOUBLE_EQ(noise.apply(false, 0.5, 2.0), 2 * first);
    EXPECT_DOUBLE_EQ(noise.apply(false, 0.999, 1.0), first);
    const double second = lognormal_mean1(oracle, 0.5);  // redrawn at 1.0 (0.0 + period)
    EXPECT_NE(first, second);
    EXPECT_DOUBLE_EQ(noise.apply(false, 1.0, 1.0), second);
    EXPECT_DOUBLE_EQ(noise.apply(false, 1.9, 1.0), second);
}

TEST(ForwardNoise, LognormalHasMeanOneAndTheRequestedSpread) {
    std::mt19937_64 rng(5);
    EXPECT_EQ(lognormal_mean1(rng, 0), 1.0);
    const int n = 200000;
    double sum = 0, sum2 = 0;
    for (int i = 0; i < n; ++i) {
        const double x = lognormal_mean1(rng, 0.3);
        ASSERT_GT(x, 0);
        sum += x;
        sum2 += x * x;
    }
    const double mean = sum / n;
    const double cv = std::sqrt(sum2 / n - mean * mean) / mean;
    EXPECT_NEAR(mean, 1.0, 0.005);
    EXPECT_NEAR(cv, 0.3, 0.01);
}

TEST(ForwardNoise, SeedsDifferPerInstance) {
    EXPECT_NE(noise_seed_for(1, 0), noise_seed_for(1, 1));
    EXPECT_NE(noise_seed_for(1, 0), noise_seed_for(2, 0));
    EXPECT_EQ(noise_seed_for(0, 5), 5u);
}

}  // namespace
}  // namespace pdsim::des
