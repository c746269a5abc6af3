// Request routing shared by the testbed's router and the simulator: least loaded, ties broken
// round-robin starting after the previous choice.
//
// Load (what "loaded" means, the testbed's rules, docs/testbed.md section 2):
//   colocated: per instance, outstanding tokens = assigned input not yet prefilled + output not
//     yet generated. A request adds input + output when assigned; its input leaves at its first
//     token (or when its prefill is done), its output when it is terminal.
//   disaggregated: per prefill instance, assigned input tokens not yet prefilled (added at
//     assignment, removed at the first token / prefill done); per decode instance, KV tokens
//     (input + output) of unfinished requests (removed when terminal).
// Loads are whole tokens; doubles hold them exactly (< 2^53).
//
// Thread-safety: pick_least_loaded is pure; a LoadBalancer is a plain value driven by one thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pdsim::policy {

// The candidate (an instance index) with the least `load[candidate]`; among equals the first one
// met when scanning `candidates` cyclically from the one after `*last` (from the start when
// `*last` is not a candidate). Sets `*last` to the choice. -1 when `candidates` is empty.
[[nodiscard]] int pick_least_loaded(std::span<const int> candidates, std::span<const double> load,
                                    int* last);

struct Assignment {
    int prefill = -1;  // instance index (colocated: the same as decode)
    int decode = -1;
};

// The load bookkeeping above over a fixed set of instances (indices into the topology's
// instances). Call assign() once per request in arrival order, then prefill_done() at most once and
// finished() exactly once (completed or failed) with the same lengths.
class LoadBalancer {
public:
    // colocated: every instance serves whole requests; else `is_prefill[i]` says the role.
    LoadBalancer(const std::vector<bool>& is_prefill, bool colocated);

    [[nodiscard]] Assignment assign(int64_t input_len, int64_t output_len);
    // The request's input is no longer outstanding (first token seen, or prefill side done).
    void prefill_done(const Assignment& a, int64_t input_len);
    // The request is terminal. Precondition: prefill_done was called, or is called here implicitly
    // when it was not (pass `prefill_released` = whether it was).
    void finished(const Assignment& a, int64_t input_len, int64_t output_len,
                  bool prefill_released);

    [[nodiscard]] double load_a(int instance) const {
        return load_a_[static_cast<size_t>(instance)];
    }
    [[nodiscard]] double load_b(int instance) const {
        return load_b_[static_cast<size_t>(instance)];
    }

private:
    bool colocated_;
    std::vector<int> prefill_, decode_, all_;
    std::vector<double> load_a_, load_b_;  // a: prefill / colocated; b: decode
    int last_a_ = -1, last_b_ = -1;
};

}  // namespace pdsim::policy
