// Internal to sim/cost and `pdsim calibrate`: the features and linear forms of the calibrated CPU
// cost model, the non-negative least-squares fit that produces them, and the cost file's keys, so
// that what calibrate fits and what the simulator evaluates cannot drift apart.
//
// Forms (seconds; docs/cost-models.md):
//   extend_s = const_s + per_token_s * tokens + per_attn_pair_s * attn_pairs
//              + per_request_s * requests
//     tokens = sum new_i; attn_pairs = sum new_i * (cached_i + (new_i + 1) / 2), the (query, key)
//     pairs of causal attention over the cached and the new tokens;
//   decode_s = const_s + per_request_s * batch + per_weight_pass_s * weight_passes(batch)
//              + per_kv_token_s * kv_tokens
//     weight_passes(b) = floor(b / 4) + b % 4: the testbed's projection kernel streams every
//     weight once per block of 4 rows and once per leftover row, so a decode batch of 3 reads the
//     weights 3 times and one of 4 once; at decode sizes that streaming is most of the forward.
//     per_weight_pass_s is optional in a cost file (0 when absent).
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/cost/cost_model.h"

namespace pdsim::cost {

inline constexpr int kCostSchemaVersion = 1;

// Coefficient keys in the cost file, in feature order.
inline constexpr std::array<const char*, 4> kExtendKeys = {"const_s", "per_token_s",
                                                           "per_attn_pair_s", "per_request_s"};
inline constexpr std::array<const char*, 4> kDecodeKeys = {"const_s", "per_request_s",
                                                           "per_weight_pass_s", "per_kv_token_s"};
inline constexpr std::array<bool, 4> kDecodeKeyRequired = {true, true, false, true};

[[nodiscard]] double attn_pairs(std::span<const ExtendItem> batch);
[[nodiscard]] std::array<double, 4> extend_features(std::span<const ExtendItem> batch);
[[nodiscard]] double weight_passes(int64_t rows);
[[nodiscard]] std::array<double, 4> decode_features(int64_t batch_size, int64_t kv_tokens);

struct LinearFit {
    std::vector<double> coef;  // one per feature, each >= 0
    double r2 = 0;             // 1 - SS_res / SS_tot on the raw times
    double max_rel_err = 0;    // max |predicted - measured| / measured
    double mean_rel_err = 0;
};

// What a fit estimates.
//   kRelative: minimizes sum_i ((x_i . coef - y_i) / y_i)^2 (relative error: microbenchmark points,
//     each a median of repeats, span three orders of magnitude and the simulator needs each within
//     a few percent);
//   kMean: the conditional mean, for many noisy single measurements of few shapes (a testbed
//     timeline's forwards, whose slow tail the simulator must keep: a request's TPOT is the mean
//     of its steps). Relative residuals are biased low on right-skewed noise, so this fits twice:
//     kRelative, then sum_i ((x_i . coef - y_i) / p_i)^2 with p_i the first fit's prediction
//     (noise proportional to the time, mean x_i . coef).
enum class FitTarget { kRelative, kMean };

// Minimizes the target's weighted squares subject to coef >= 0, exactly, by solving the
// unconstrained problem on every subset of the features and keeping the best non-negative one
// (fine for a handful of features). kInvalidArgument when there are fewer points than features or
// a time is not positive.
[[nodiscard]] StatusOr<LinearFit> fit_nonnegative(const std::vector<std::vector<double>>& x,
                                                  const std::vector<double>& y,
                                                  FitTarget target = FitTarget::kRelative);

// ---- wake-up (CostWake, cost_model.h) ----
// `pdsim calibrate`'s worker idles, then times decode forwards back to back; the first come out
// about 2x slower than the rest on the 2-core VM, as the testbed's decode forwards after an idle
// period do (docs/fidelity.md section 8). fit_wake turns the per-index medians into a CostWake:
// warm = the median of the last kWakeWarmTail; excess_k = median_k / warm - 1 over the leading
// forwards with excess above kWakeMinExcess, fitted as excess0 * q^k (least squares on the log);
// then tau_s = warm / ln(1/q) and lost_s = excess0 * warm / (1 - q), so that CostWake::extra_s
// of the k-th forward (starting k warm forwards after the wake) is excess0 * q^k * warm.
// min_idle_s is kWakeMinIdleS: in testbed timelines, decode forwards after gaps of 5-50 ms were
// as slow as after gaps over 50 ms, and those after gaps under 1 ms were not.
inline constexpr size_t kWakeWarmTail = 6;
inline constexpr double kWakeMinExcess = 0.02;
inline constexpr double kWakeMinIdleS = 0.005;

struct WakeFit {
    CostWake wake;
    double warm_forward_s = 0;  // the warm forwards' median
};
// nullopt when there are fewer than kWakeWarmTail + 2 medians, fewer than two leading forwards
// are measurably slow, or their excess does not decay.
[[nodiscard]] std::optional<WakeFit> fit_wake(std::span<const double> median_s);

// The calibrated model for `spec`, from `file` (see make_cost_model).
[[nodiscard]] StatusOr<std::unique_ptr<CostModel>> make_calibrated_model(const InstanceSpec& spec,
                                                                         const CostFile& file);

}  // namespace pdsim::cost
