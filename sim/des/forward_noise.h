// Forward-time variation of one simulated instance (SimConfig::cost_noise): the cost model's
// measured spread (cost::CostNoise) applied to each forward's modelled duration.
//
// Per kind of forward (extend, decode) a duration is multiplied by two factors:
//   slow  a log-normal factor of mean 1 and coefficient of variation slow_cv, redrawn at the first
//         forward that starts at or after the previous draw + slow_period_s (episodes of a slower
//         machine); 1 when slow_cv or slow_period_s is 0;
//   fast  per forward: linear interpolation of the measured fast_quantiles at a uniform draw when
//         there are at least two, else log-normal of mean 1 and CV fast_cv (1 when fast_cv is 0).
// Draws come from one generator per instance, seeded with noise_seed_for(seed, instance), so a
// run is reproducible and an instance's draws do not depend on the others'.
//
// Thread-safety: none (the simulator's thread). Cost: O(1) per forward, no allocation.
#pragma once

#include <cstdint>
#include <random>

#include "sim/cost/cost_model.h"

namespace pdsim::des {

// A log-normal draw of mean 1 and coefficient of variation `cv` (1 without a draw when cv <= 0).
[[nodiscard]] double lognormal_mean1(std::mt19937_64& rng, double cv);

// The generator seed of instance `instance` for SimConfig::noise_seed `seed`.
[[nodiscard]] constexpr uint64_t noise_seed_for(uint64_t seed, int instance) {
    return seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(instance);
}

class ForwardNoise {
public:
    // No variation: apply() returns its duration.
    ForwardNoise() = default;
    // The cost model's variation of extend and decode forwards; the generator is seeded only when
    // some variation is present.
    ForwardNoise(const cost::CostNoise& extend, const cost::CostNoise& decode, uint64_t seed);

    [[nodiscard]] bool any() const { return spec_[0].any() || spec_[1].any(); }
    // `duration_s` x the slow and fast factors of a forward of that kind starting at `now_s`
    // (simulated seconds, non-decreasing across calls). Draws only what that kind's spec varies.
    [[nodiscard]] double apply(bool decode, double now_s, double duration_s);

private:
    cost::CostNoise spec_[2];            // extend, decode
    double slow_factor_[2] = {1, 1};     // the current slow episode's factor
    double slow_until_s_[2] = {-1, -1};  // when it is redrawn
    std::mt19937_64 rng_;
};

}  // namespace pdsim::des
