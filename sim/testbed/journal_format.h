// The file format of the testbed's result journal (result_journal.h), `<report>.journal.jsonl`:
// one JSON object per line, appended and flushed as things happen.
//
//   line 1, the header   {"journal": "pdsim testbed", "requests_submitted": N, "config": "<flags>",
//                         "run": {Head's fields}}
//   a request finished   {"phase": "disagg"|"colocated", "id", "ok", "error", "arrival_ms",
//                         "first_token_ms", "finish_ms", "input_len", "output_len", "generated",
//                         "prefill_instance", "decode_instance", "queue_ms", "prefill_start_ms"}
//   a rank found dead    {"dead_rank": R, "phase", "instance", "detected_at_s", "silent_s"}
//   a signal's cause     {"stopping": "stopped by SIGTERM..."} (before the handler writes)
//   the report written   {"report_written": true}
//
// A process killed while it appends leaves its last line cut: parse() skips a line that is not a
// JSON object when it is the last one, or only {"report_written": true} lines follow it (a
// recovery appends that after the cut). Anything else malformed is an error naming its line.
//
// Pure functions of their arguments; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "sim/metrics/report.h"

namespace pdsim::testbed::journal {

// What a report written from the journal needs of the run's configuration.
struct Head {
    int64_t submitted = 0;
    std::string mode;  // disagg | colocated | both
    std::string topology;
    std::string model;
    std::string rank0_instance;
    double slo_ttft_ms = 0;
    double slo_tpot_ms = 0;
    std::string report_path;    // as given (not empty); relative to `cwd`
    std::string requests_path;  // as given ("" none)
    std::string cwd;            // the run's working directory
    nlohmann::json config;      // the report's "config" object
    double started_unix_s = 0;  // wall clock when the journal opened
    int64_t pid = 0;            // rank 0's process
};

struct Record {
    std::string phase;  // disagg | colocated
    metrics::RequestRecord record;
};

struct DeadRank {
    std::string phase;
    int rank = 0;
    std::string instance;
    double detected_at_s = 0;
    double silent_s = 0;
};

struct Contents {
    Head head;
    std::string flags;  // the header's "config": the run's flags, for a reader
    std::vector<Record> records;
    std::vector<DeadRank> dead_ranks;
    std::string stopping;  // the last signal cause; "" none
    bool report_written = false;
};

// The lines, as JSON objects (written with text::dump_json, one per line).
[[nodiscard]] nlohmann::json head_line(const Head& head, const std::string& flags);
[[nodiscard]] nlohmann::json record_line(const Record& record);
[[nodiscard]] nlohmann::json dead_rank_line(const DeadRank& dead);
[[nodiscard]] nlohmann::json stopping_line(const std::string& cause);
[[nodiscard]] nlohmann::json report_written_line();
// A whole journal of `contents` (the header, then records, dead ranks, the cause, the mark).
[[nodiscard]] std::string to_text(const Contents& contents);

// Parses a journal's text; `path` names it in errors. Errors: kInvalidArgument "path:line: why"
// (a header that is not a journal's or lacks a field, a line of the wrong shape, a number that is
// not finite, a request id outside [0, requests_submitted), a phase or mode not known).
[[nodiscard]] StatusOr<Contents> parse(std::string_view text, const std::string& path);

}  // namespace pdsim::testbed::journal
