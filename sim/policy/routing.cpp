#include "sim/policy/routing.h"

#include <limits>

#include "common/check.h"

namespace pdsim::policy {

int pick_least_loaded(std::span<const int> candidates, std::span<const double> load, int* last) {
    const size_t n = candidates.size();
    size_t start = 0;
    for (size_t i = 0; i < n; ++i) {
        if (candidates[i] == *last) start = i + 1;
    }
    int best = -1;
    double best_load = std::numeric_limits<double>::infinity();
    for (size_t k = 0; k < n; ++k) {
        const int c = candidates[(start + k) % n];
        if (load[static_cast<size_t>(c)] < best_load) {
            best_load = load[static_cast<size_t>(c)];
            best = c;
        }
    }
    *last = best;
    return best;
}

LoadBalancer::LoadBalancer(const std::vector<bool>& is_prefill, bool colocated)
    : colocated_(colocated), load_a_(is_prefill.size(), 0.0), load_b_(is_prefill.size(), 0.0) {
    for (size_t i = 0; i < is_prefill.size(); ++i) {
        all_.push_back(static_cast<int>(i));
        (is_prefill[i] ? prefill_ : decode_).push_back(static_cast<int>(i));
    }
    PDSIM_CHECK_MSG(colocated ? !all_.empty() : !prefill_.empty() && !decode_.empty(),
                    "LoadBalancer: no instance to route to");
}

Assignment LoadBalancer::assign(int64_t input_len, int64_t output_len) {
    Assignment a;
    if (colocated_) {
        a.prefill = a.decode = pick_least_loaded(all_, load_a_, &last_a_);
        load_a_[static_cast<size_t>(a.decode)] += static_cast<double>(input_len + output_len);
    } else {
        a.prefill = pick_least_loaded(prefill_, load_a_, &last_a_);
        a.decode = pick_least_loaded(decode_, load_b_, &last_b_);
        load_a_[static_cast<size_t>(a.prefill)] += static_cast<double>(input_len);
        load_b_[static_cast<size_t>(a.decode)] += static_cast<double>(input_len + output_len);
    }
    return a;
}

void LoadBalancer::prefill_done(const Assignment& a, int64_t input_len) {
    const int inst = colocated_ ? a.decode : a.prefill;
    load_a_[static_cast<size_t>(inst)] -= static_cast<double>(input_len);
}

void LoadBalancer::finished(const Assignment& a, int64_t input_len, int64_t output_len,
                            bool prefill_released) {
    if (!prefill_released) prefill_done(a, input_len);
    if (colocated_) {
        load_a_[static_cast<size_t>(a.decode)] -= static_cast<double>(output_len);
    } else {
        load_b_[static_cast<size_t>(a.decode)] -= static_cast<double>(input_len + output_len);
    }
}

}  // namespace pdsim::policy
