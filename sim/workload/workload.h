// Workloads: request traces read from real trace files, or generated.
//
// Formats:
//  - Mooncake JSONL (kvcache-ai/Mooncake FAST'25): one object per line with `timestamp` (ms since
//    start), `input_length`, `output_length`, `hash_ids` (prefix-block ids; a block is 512 tokens,
//    equal ids mean a reusable prefix).
//  - Azure LLM inference CSV (AzurePublicDataset 2023): header `TIMESTAMP,ContextTokens,
//    GeneratedTokens`, the timestamp wall-clock "YYYY-MM-DD HH:MM:SS.fffffff".
//  - Synthetic: Poisson or gamma arrivals at a rate, input/output lengths from a distribution.
//
// Every parse error is kInvalidArgument naming the file and line (`trace.jsonl:17: input_length:
// -3 must be >= 1 and <= 1073741823`), quoting at most 80 bytes of the bad input.
// Validation (docs/inputs.md): input and output lengths are integers in [1, kMaxTraceTokens]
// (JSON floats such as 3.0 or 1e19 are refused, not truncated; Azure numbers are plain decimal
// digits, never clamped); timestamps are finite and >= 0; hash_ids are JSON integers in the int64
// range, at most one per 512-token block of input_length. load_trace reads regular files only, at
// most 4 GiB (common/input_file.h). Requests come back sorted by arrival (stable), arrival times
// relative to the first request, ids 0..n-1 in that order. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim::workload {

inline constexpr int32_t kHashBlockTokens = 512;
// The largest input_length / output_length a trace may give: 2^30 - 1, so that input + output and
// the block arithmetic on them stay within int32 everywhere downstream.
inline constexpr int32_t kMaxTraceTokens = (int32_t{1} << 30) - 1;

struct Request {
    int64_t id = 0;
    double arrival_ms = 0.0;
    int32_t input_len = 0;
    int32_t output_len = 0;
    std::vector<int64_t> hash_ids;  // prefix blocks (Mooncake); empty otherwise
    int64_t source_line = 0;        // 1-based line in the trace file (0: synthetic)
};

enum class TraceFormat { kAuto, kMooncake, kAzure };

[[nodiscard]] StatusOr<TraceFormat> parse_trace_format(
    std::string_view text);  // auto|mooncake|azure

struct LoadOptions {
    double time_scale = 1.0;     // arrival_ms is multiplied by this (0.5 = twice as fast)
    int32_t max_input_len = 0;   // cap (0: none); hash_ids are trimmed to the capped length
    int32_t max_output_len = 0;  // cap (0: none)
    int64_t skip = 0;            // drop the first N requests (after sorting)
    int64_t max_requests = 0;    // keep the first N after skip (0: all) ...
    int64_t sample = 0;          // ... or a uniform random sample of N, order preserved (0: off)
    uint64_t seed = 1;           // for `sample`
};

// Reads a trace file; a bare name that is not a file here (`mooncake_conversation`,
// `azure_llm_code.csv`) is looked up among the shipped traces (common/data_dir.h). kAuto picks the
// format from the extension (.jsonl / .json -> Mooncake, .csv -> Azure) or, failing that, from the
// first line.
[[nodiscard]] StatusOr<std::vector<Request>> load_trace(const std::string& path_or_name,
                                                        TraceFormat format,
                                                        const LoadOptions& options);
[[nodiscard]] StatusOr<std::vector<Request>> parse_mooncake(std::istream& in,
                                                            const std::string& source,
                                                            const LoadOptions& options);
[[nodiscard]] StatusOr<std::vector<Request>> parse_azure(std::istream& in,
                                                         const std::string& source,
                                                         const LoadOptions& options);

struct LengthDist {
    enum class Kind { kFixed, kUniform, kLognormal } kind = Kind::kFixed;
    double a = 1024;  // fixed: value; uniform: min; lognormal: median
    double b = 0;     // uniform: max; lognormal: sigma (of the log)
    int32_t min = 1, max = 1 << 20;
};
// "fixed:1024", "uniform:128:4096", "lognormal:2048:0.8".
[[nodiscard]] StatusOr<LengthDist> parse_length_dist(std::string_view text);

struct SyntheticOptions {
    int64_t num_requests = 100;
    double rate_rps = 1.0;  // mean arrival rate
    bool gamma = false;     // gamma inter-arrivals (burstiness cv) instead of Poisson
    double cv = 1.0;        // coefficient of variation for gamma
    LengthDist input{LengthDist::Kind::kFixed, 1024, 0};
    LengthDist output{LengthDist::Kind::kFixed, 128, 0};
    uint64_t seed = 1;
};
[[nodiscard]] StatusOr<std::vector<Request>> make_synthetic(const SyntheticOptions& options);

struct TraceStats {
    int64_t requests = 0;
    double duration_s = 0;
    double mean_input = 0, mean_output = 0;
    int32_t max_input = 0, max_output = 0;
};
[[nodiscard]] TraceStats summarize(const std::vector<Request>& requests);

}  // namespace pdsim::workload
