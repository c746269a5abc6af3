#include "sim/testbed/journal_format.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "common/text.h"

namespace pdsim::testbed::journal {

namespace {

using json = nlohmann::json;

constexpr int64_t kMaxSubmitted = int64_t{1} << 31;

// A field of the wrong type or out of range on one line: thrown inside parse(), caught there
// with the line's number.
struct LineError {
    std::string why;
};

// A number field: finite; `missing` when absent (nullopt: required).
double number(const json& j, const char* key, std::optional<double> missing) {
    if (!j.contains(key)) {
        if (!missing) throw LineError{fmt::format("no \"{}\"", key)};
        return *missing;
    }
    const json& v = j.at(key);
    if (!v.is_number()) throw LineError{fmt::format("{} is not a number", key)};
    const double d = v.get<double>();
    if (!std::isfinite(d)) throw LineError{fmt::format("{} is not finite", key)};
    return d;
}

// An integer field in [lo, hi]; `missing` when absent (nullopt: required).
int64_t integer(const json& j, const char* key, std::optional<int64_t> missing, int64_t lo,
                int64_t hi) {
    if (!j.contains(key)) {
        if (!missing) throw LineError{fmt::format("no \"{}\"", key)};
        return *missing;
    }
    const json& v = j.at(key);
    if (!v.is_number_integer()) throw LineError{fmt::format("{} is not an integer", key)};
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
        throw LineError{fmt::format("{} {} out of [{}, {}]", key, v.get<uint64_t>(), lo, hi)};
    }
    const int64_t n = v.get<int64_t>();
    if (n < lo || n > hi) throw LineError{fmt::format("{} {} out of [{}, {}]", key, n, lo, hi)};
    return n;
}

int int32(const json& j, const char* key, int missing) {
    return static_cast<int>(integer(j, key, missing, INT32_MIN, INT32_MAX));
}

std::string phase_of(const json& j) {
    std::string phase = j.at("phase").get<std::string>();
    if (phase != "disagg" && phase != "colocated") {
        throw LineError{fmt::format("phase \"{}\": expected disagg or colocated", phase)};
    }
    return phase;
}

Head read_head(const json& j) {
    if (!j.is_object() || j.value("journal", "") != "pdsim testbed") {
        throw LineError{
            "not a pdsim testbed journal (it starts with {\"journal\": \"pdsim "
            "testbed\", ...})"};
    }
    const json run = j.value("run", json());
    if (!run.is_object())
        throw LineError{
            "no \"run\" object (an older pdsim's journal: no report can be rebuilt from it)"};
    Head h;
    h.submitted = integer(j, "requests_submitted", std::nullopt, 0, kMaxSubmitted);
    h.mode = run.at("mode").get<std::string>();
    if (h.mode != "disagg" && h.mode != "colocated" && h.mode != "both") {
        throw LineError{fmt::format("run.mode \"{}\": expected disagg, colocated or both", h.mode)};
    }
    h.topology = run.at("topology").get<std::string>();
    h.model = run.at("model").get<std::string>();
    h.rank0_instance = run.value("rank0_instance", "");
    h.slo_ttft_ms = number(run, "slo_ttft_ms", std::nullopt);
    h.slo_tpot_ms = number(run, "slo_tpot_ms", std::nullopt);
    h.report_path = run.at("report_path").get<std::string>();
    if (h.report_path.empty()) throw LineError{"run.report_path is empty"};
    h.requests_path = run.value("requests_path", "");
    h.cwd = run.value("cwd", "");
    h.started_unix_s = number(run, "started_unix_s", std::nullopt);
    h.pid = integer(run, "pid", 0, 0, INT32_MAX);
    h.config = run.value("report_config", json::object());
    if (!h.config.is_object()) throw LineError{"run.report_config is not an object"};
    return h;
}

Record read_record(const json& j, int64_t submitted) {
    Record out;
    out.phase = phase_of(j);
    metrics::RequestRecord& r = out.record;
    r.id = integer(j, "id", std::nullopt, 0, INT64_MAX);
    if (r.id >= submitted) {
        throw LineError{fmt::format("id {} outside [0, {}) (requests_submitted)", r.id, submitted)};
    }
    r.ok = j.value("ok", false);
    r.error = j.value("error", "");
    r.arrival_ms = number(j, "arrival_ms", 0.0);
    r.first_token_ms = number(j, "first_token_ms", -1.0);
    r.finish_ms = number(j, "finish_ms", -1.0);
    r.input_len = int32(j, "input_len", 0);
    r.output_len = int32(j, "output_len", 0);
    r.generated = int32(j, "generated", 0);
    r.prefill_instance = int32(j, "prefill_instance", -1);
    r.decode_instance = int32(j, "decode_instance", -1);
    r.queue_ms = number(j, "queue_ms", -1.0);
    r.prefill_start_ms = number(j, "prefill_start_ms", -1.0);
    return out;
}

DeadRank read_dead_rank(const json& j) {
    DeadRank d;
    d.phase = phase_of(j);
    d.rank = static_cast<int>(integer(j, "dead_rank", std::nullopt, 0, INT32_MAX));
    d.instance = j.value("instance", "");
    d.detected_at_s = number(j, "detected_at_s", 0.0);
    d.silent_s = number(j, "silent_s", 0.0);
    return d;
}

}  // namespace

json head_line(const Head& h, const std::string& flags) {
    return {{"journal", "pdsim testbed"},
            {"requests_submitted", h.submitted},
            {"config", text::sanitize_utf8(flags)},
            {"run",
             {{"mode", h.mode},
              {"topology", text::sanitize_utf8(h.topology)},
              {"model", text::sanitize_utf8(h.model)},
              {"rank0_instance", text::sanitize_utf8(h.rank0_instance)},
              {"slo_ttft_ms", h.slo_ttft_ms},
              {"slo_tpot_ms", h.slo_tpot_ms},
              {"report_path", text::sanitize_utf8(h.report_path)},
              {"requests_path", text::sanitize_utf8(h.requests_path)},
              {"cwd", text::sanitize_utf8(h.cwd)},
              {"started_unix_s", h.started_unix_s},
              {"pid", h.pid},
              {"report_config", h.config}}}};
}

json record_line(const Record& rec) {
    const metrics::RequestRecord& r = rec.record;
    return {{"phase", rec.phase},
            {"id", r.id},
            {"ok", r.ok},
            {"error", text::sanitize_utf8(r.error)},
            {"arrival_ms", r.arrival_ms},
            {"first_token_ms", r.first_token_ms},
            {"finish_ms", r.finish_ms},
            {"input_len", r.input_len},
            {"output_len", r.output_len},
            {"generated", r.generated},
            {"prefill_instance", r.prefill_instance},
            {"decode_instance", r.decode_instance},
            {"queue_ms", r.queue_ms},
            {"prefill_start_ms", r.prefill_start_ms}};
}

json dead_rank_line(const DeadRank& d) {
    return {{"dead_rank", d.rank},
            {"phase", d.phase},
            {"instance", text::sanitize_utf8(d.instance)},
            {"detected_at_s", d.detected_at_s},
            {"silent_s", d.silent_s}};
}

json stopping_line(const std::string& cause) {
    return {{"stopping", text::sanitize_utf8(cause)}};
}

json report_written_line() {
    return {{"report_written", true}};
}

std::string to_text(const Contents& c) {
    std::string out = text::dump_json(head_line(c.head, c.flags)) + "\n";
    for (const Record& r : c.records) out += text::dump_json(record_line(r)) + "\n";
    for (const DeadRank& d : c.dead_ranks) out += text::dump_json(dead_rank_line(d)) + "\n";
    if (!c.stopping.empty()) out += text::dump_json(stopping_line(c.stopping)) + "\n";
    if (c.report_written) out += text::dump_json(report_written_line()) + "\n";
    return out;
}

StatusOr<Contents> parse(std::string_view text, const std::string& path) {
    std::vector<std::string_view> lines;
    for (size_t at = 0; at < text.size();) {
        const size_t end = text.find('\n', at);
        lines.push_back(text.substr(at, end == std::string_view::npos ? end : end - at));
        if (end == std::string_view::npos) break;
        at = end + 1;
    }
    if (lines.empty()) return invalid_argument_error(fmt::format("{}:1: empty journal", path));
    Contents c;
    size_t n = 0;
    try {
        for (; n < lines.size(); ++n) {
            const json j = json::parse(lines[n], nullptr, /*allow_exceptions=*/false);
            if (n == 0) {
                c.head = read_head(j);
                c.flags = j.value("config", "");
                continue;
            }
            if (!j.is_object()) {
                bool only_marks_follow = true;
                for (size_t k = n + 1; k < lines.size(); ++k) {
                    const json after = json::parse(lines[k], nullptr, false);
                    only_marks_follow =
                        only_marks_follow && after.is_object() && after.contains("report_written");
                }
                if (only_marks_follow) continue;  // the line a death cut
                throw LineError{"not a JSON object"};
            }
            if (j.contains("report_written")) {
                c.report_written = true;
            } else if (j.contains("stopping")) {
                c.stopping = j.at("stopping").get<std::string>();
            } else if (j.contains("dead_rank")) {
                c.dead_ranks.push_back(read_dead_rank(j));
            } else {
                c.records.push_back(read_record(j, c.head.submitted));
            }
        }
    } catch (const LineError& e) {
        return invalid_argument_error(fmt::format("{}:{}: {}", path, n + 1, e.why));
    } catch (const json::exception& e) {
        return invalid_argument_error(fmt::format(
            "{}:{}: a field is missing or of the wrong type: {}", path, n + 1, e.what()));
    }
    return c;
}

}  // namespace pdsim::testbed::journal
