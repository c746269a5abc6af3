// Metrics and the report JSON shared by the testbed and the simulator (docs/design.md "Report
// JSON").
//
// Top-level keys: schema_version, mode, topology, model, requests_submitted, requests_completed,
// requests_failed, ttft_ms, tpot_ms, e2e_ms, queue_ms, prefill_wait_ms ({mean, p50, p90, p99,
// count}), goodput_rps, slo_attainment,
// transfer {bytes, gbps, layer_latency_us {..}, exposed_fraction}, ordering {checked_layers,
// violations, details}, outputs_match (testbed --mode both), wall_s; with --mode both the
// top-level metrics are the disaggregated run's and `colocated` holds the same keys.
//
// Definitions (per request, times in ms from its arrival):
//   TTFT = first token time - arrival;  TPOT = (finish - first token) / (generated - 1), defined
//   for requests that generated >= 2 tokens;  E2E = finish - arrival.
//   A request attains the SLO when it completed, TTFT <= slo_ttft_ms and (TPOT <= slo_tpot_ms or
//   it generated a single token). slo_attainment = attained / submitted;
//   goodput_rps = attained / makespan (first arrival to last finish, seconds).
// Thread-safety: plain values and pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim::metrics {

inline constexpr int kReportSchemaVersion = 1;

struct Percentiles {
    double mean = 0, p50 = 0, p90 = 0, p99 = 0;
    int64_t count = 0;
};
// Linear-interpolated percentiles (numpy's default); all zero for an empty sample.
[[nodiscard]] Percentiles percentiles(std::vector<double> values);

struct RequestRecord {
    int64_t id = 0;
    double arrival_ms = 0;
    double first_token_ms = -1;  // absolute (same clock as arrival); -1: none
    double finish_ms = -1;       // absolute; -1: not finished
    int32_t input_len = 0;
    int32_t output_len = 0;  // requested
    int32_t generated = 0;   // tokens produced
    bool ok = false;
    std::string error;  // why it failed
    int prefill_instance = -1;
    int decode_instance = -1;
    int64_t transfer_bytes = 0;
    double transfer_ms = 0;          // first layer sent -> last layer landed
    double exposed_transfer_ms = 0;  // transfer time not hidden behind prefill compute
    std::vector<int32_t> tokens;     // generated token ids (testbed; for outputs_match)
    // Time it waited in the router's queue (arrival -> dispatched to its instances; testbed
    // backpressure, --max-inflight-per-instance); -1: not measured (or never dispatched).
    double queue_ms = -1;
    // Absolute time its first prefill chunk began (its first extend forward, on the prefill
    // instance or, colocated, on its one instance); -1: unknown (or never scheduled).
    double prefill_start_ms = -1;

    [[nodiscard]] double ttft_ms() const { return first_token_ms - arrival_ms; }
    // arrival -> first prefill chunk: the whole wait before compute (router queue + the
    // instance's waiting queue); nullopt where prefill_start_ms is unknown.
    [[nodiscard]] std::optional<double> prefill_wait_ms() const {
        if (prefill_start_ms < 0) return std::nullopt;
        return std::max(0.0, prefill_start_ms - arrival_ms);
    }
    [[nodiscard]] double e2e_ms() const { return finish_ms - arrival_ms; }
    [[nodiscard]] std::optional<double> tpot_ms() const {
        if (generated < 2 || finish_ms < 0 || first_token_ms < 0) return std::nullopt;
        return (finish_ms - first_token_ms) / (generated - 1);
    }
};

struct Slo {
    double ttft_ms = 0;  // 0: no bound
    double tpot_ms = 0;  // 0: no bound
};

struct TransferSummary {
    int64_t bytes = 0;
    double gbps = 0;               // bytes / total transfer time (GB/s, 1e9)
    Percentiles layer_latency_us;  // per layer: ready on the prefill side -> landed on decode
    double exposed_fraction = 0;   // share of transfer time not hidden behind prefill compute
};

struct OrderingSummary {
    int64_t checked_layers = 0;
    int64_t violations = 0;
    std::vector<std::string> details;  // one line per violation (capped)
};

struct Report {
    std::string mode;      // disagg | colocated | simulate
    std::string topology;  // name or path
    std::string model;
    int64_t requests_submitted = 0;
    int64_t requests_completed = 0;
    int64_t requests_failed = 0;
    // In flight when the run stopped early (the testbed's partial report, named in
    // extra["lost_requests"]); completed + failed + lost == submitted in every report.
    int64_t requests_lost = 0;
    Percentiles ttft_ms, tpot_ms, e2e_ms;
    // Router queueing delay over the requests it was measured for (RequestRecord::queue_ms >= 0,
    // completed or not); count 0 where none was.
    Percentiles queue_ms;
    // Wait before compute (RequestRecord::prefill_wait_ms) over the requests it is known for,
    // completed or not; the queueing delay of an overloaded run, wherever the request queued.
    Percentiles prefill_wait_ms;
    double goodput_rps = 0;
    double slo_attainment = 0;
    double throughput_tokens_s = 0;
    TransferSummary transfer;
    OrderingSummary ordering;
    std::optional<bool> outputs_match;
    double wall_s = 0;
    std::vector<std::string> failures;                // first few failure reasons
    nlohmann::json extra = nlohmann::json::object();  // producer-specific keys (config, ...)
    std::shared_ptr<Report> colocated;                // --mode both
};

// Fills the request-derived fields of `report` (counts, latencies, goodput, SLO attainment,
// failures) from `records`. Transfer/ordering fields are left as they are.
void summarize_requests(const std::vector<RequestRecord>& records, const Slo& slo, Report* report);

[[nodiscard]] nlohmann::json to_json(const Report& report);
// Both writers write the file whole: into a temporary file beside it, renamed over it (a reader, or
// a writer killed half-way, never leaves a cut file); a path that is not a regular file
// (/dev/stdout) is written in place. kInvalidArgument when it cannot be opened.
[[nodiscard]] Status write_report(const std::string& path, const Report& report);
// Per-request CSV: id, arrival_ms, ttft_ms, tpot_ms, e2e_ms, input_len, output_len, generated,
// ok, prefill_instance, decode_instance, transfer_bytes, transfer_ms, queue_ms, prefill_wait_ms
// (these two empty: not measured), error.
[[nodiscard]] Status write_requests_csv(const std::string& path,
                                        const std::vector<RequestRecord>& records);
// The same CSV's header line and one record's line (each ending in a newline), for a writer that
// streams rows as requests finish.
[[nodiscard]] std::string requests_csv_header();
[[nodiscard]] std::string requests_csv_row(const RequestRecord& record);
// A human summary table (both runs side by side with --mode both).
[[nodiscard]] std::string summary_table(const Report& report);

}  // namespace pdsim::metrics
