// The invariants of a parsed trace (sim/workload/workload.h), shared by the two trace targets,
// and the two option sets each input is parsed with.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "sim/workload/workload.h"

namespace pdsim::fuzz {

// The defaults, and options that exercise the caps, skip, first-N and sampling (picked from the
// input's size, so the bytes stay the trace).
inline std::vector<workload::LoadOptions> trace_option_sets(size_t size) {
    workload::LoadOptions other;
    other.time_scale = size % 3 == 0 ? 0.5 : 2.0;
    other.max_input_len = size % 5 == 0 ? 0 : 1000;
    other.max_output_len = size % 7 == 0 ? 0 : 3;
    other.skip = static_cast<int64_t>(size % 4);
    other.max_requests = 2;
    other.sample = size % 2 == 0 ? 3 : 0;
    other.seed = size;
    return {workload::LoadOptions{}, other};
}

// What workload.h promises of every trace it returns.
inline void check_trace(const std::vector<workload::Request>& reqs,
                        const workload::LoadOptions& o) {
    using workload::kHashBlockTokens;
    using workload::kMaxTraceTokens;
    PDSIM_FUZZ_CHECK(!reqs.empty(), "a parsed trace has a request");
    PDSIM_FUZZ_CHECK(reqs.front().arrival_ms == 0.0, "arrivals are relative to the first");
    for (size_t i = 0; i < reqs.size(); ++i) {
        const workload::Request& r = reqs[i];
        PDSIM_FUZZ_CHECK(r.id == static_cast<int64_t>(i), "ids are 0..n-1");
        PDSIM_FUZZ_CHECK(std::isfinite(r.arrival_ms) && r.arrival_ms >= 0,
                         "arrivals are finite and >= 0");
        PDSIM_FUZZ_CHECK(i == 0 || reqs[i - 1].arrival_ms <= r.arrival_ms, "sorted by arrival");
        PDSIM_FUZZ_CHECK(r.input_len >= 1 && r.input_len <= kMaxTraceTokens, "input_len range");
        PDSIM_FUZZ_CHECK(r.output_len >= 1 && r.output_len <= kMaxTraceTokens, "output_len range");
        PDSIM_FUZZ_CHECK(o.max_input_len == 0 || r.input_len <= o.max_input_len, "input cap");
        PDSIM_FUZZ_CHECK(o.max_output_len == 0 || r.output_len <= o.max_output_len, "output cap");
        const auto blocks = static_cast<size_t>((r.input_len - 1) / kHashBlockTokens + 1);
        PDSIM_FUZZ_CHECK(r.hash_ids.size() <= blocks, "at most one hash id per block");
        PDSIM_FUZZ_CHECK(r.source_line >= 1, "a line number");
    }
}

}  // namespace pdsim::fuzz
