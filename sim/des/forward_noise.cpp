#include "sim/des/forward_noise.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace pdsim::des {

double lognormal_mean1(std::mt19937_64& rng, double cv) {
    if (cv <= 0) return 1;
    const double sigma2 = std::log1p(cv * cv);
    std::normal_distribution<double> normal(-sigma2 / 2, std::sqrt(sigma2));
    return std::exp(normal(rng));
}

ForwardNoise::ForwardNoise(const cost::CostNoise& extend, const cost::CostNoise& decode,
                           uint64_t seed)
    : spec_{extend, decode} {
    if (any()) rng_.seed(seed);
}

double ForwardNoise::apply(bool decode, double now_s, double duration_s) {
    const int kind = decode ? 1 : 0;
    const cost::CostNoise& spec = spec_[kind];
    if (!spec.any()) return duration_s;
    if (spec.slow_cv > 0 && spec.slow_period_s > 0 && now_s >= slow_until_s_[kind]) {
        slow_factor_[kind] = lognormal_mean1(rng_, spec.slow_cv);
        slow_until_s_[kind] = now_s + spec.slow_period_s;
    }
    double fast;
    const std::vector<double>& quantiles = spec.fast_quantiles;
    if (quantiles.size() >= 2) {
        const double u = std::uniform_real_distribution<double>(0, 1)(rng_);
        const double pos = u * static_cast<double>(quantiles.size() - 1);
        const auto lower = std::min(static_cast<size_t>(pos), quantiles.size() - 2);
        const double frac = pos - static_cast<double>(lower);
        fast = quantiles[lower] * (1 - frac) + quantiles[lower + 1] * frac;
    } else {
        fast = lognormal_mean1(rng_, spec.fast_cv);
    }
    return duration_s * slow_factor_[kind] * fast;
}

}  // namespace pdsim::des
