// Inputs of a simulator run that more than one command needs: the model (a name or a file, with an
// optional layer override) and the requests (a trace file or a synthetic workload), normalised the
// way `pdsim testbed` and `pdsim simulate` replay them: lengths at least 1, arrivals relative to
// the first request, then multiplied by the time scale.
//
// Errors that bad input causes are kInvalidArgument (or kNotFound for a missing file) naming the
// flag or the file: "--model foo: ...", "trace.jsonl:17: ...", "--time-scale 0: must be > 0".
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"
#include "sim/workload/workload.h"

namespace pdsim::des {

// A built-in model or a model file (model::resolve_model), `layers` > 0 overriding num_layers,
// validated. Errors name `flag` ("--model").
[[nodiscard]] StatusOr<model::ModelConfig> load_model(const std::string& name_or_path,
                                                      int layers = 0,
                                                      const std::string& flag = "--model");

struct RequestSource {
    // A trace file (Mooncake .jsonl or Azure .csv) ...
    std::string trace;
    std::string trace_format = "auto";  // auto|mooncake|azure
    int32_t max_input_len = 0;          // caps (0: none)
    int32_t max_output_len = 0;
    int64_t max_requests = 0;  // the first N (0: all) ...
    int64_t sample = 0;        // ... or a uniform sample of N, order kept
    uint64_t seed = 1;         // for `sample` and the synthetic workload
    // ... or, when `trace` is empty, a synthetic workload (workload::make_synthetic).
    workload::SyntheticOptions synthetic;
    double time_scale = 1.0;  // arrival times are multiplied by this (> 0)
};

// The requests, sorted by arrival, normalised as above. kInvalidArgument for an empty result.
[[nodiscard]] StatusOr<std::vector<workload::Request>> load_requests(const RequestSource& source);

// "mooncake_conversation.jsonl (first 2000)", "synthetic 500 (poisson 2 req/s, input
// lognormal:8192:0.5, output fixed:256)": for reports.
[[nodiscard]] std::string describe_requests(const RequestSource& source);

// Lengths at least 1, arrivals relative to the first request, times `time_scale`.
void normalize_requests(std::vector<workload::Request>* requests, double time_scale);

}  // namespace pdsim::des
