#include "sim/metrics/report.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/text.h"

namespace pdsim::metrics {

Percentiles percentiles(std::vector<double> v) {
    Percentiles p;
    p.count = static_cast<int64_t>(v.size());
    if (v.empty()) return p;
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    p.mean = sum / static_cast<double>(v.size());
    auto at = [&](double q) {
        const double pos = q * static_cast<double>(v.size() - 1);
        const size_t lo = static_cast<size_t>(std::floor(pos));
        const size_t hi = std::min(lo + 1, v.size() - 1);
        return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
    };
    p.p50 = at(0.50);
    p.p90 = at(0.90);
    p.p99 = at(0.99);
    return p;
}

void summarize_requests(const std::vector<RequestRecord>& records, const Slo& slo, Report* r) {
    r->requests_submitted = static_cast<int64_t>(records.size());
    r->requests_completed = 0;
    r->requests_failed = 0;
    r->failures.clear();
    std::vector<double> ttft, tpot, e2e, queue, wait;
    double first_arrival = std::numeric_limits<double>::infinity(), last_finish = 0;
    int64_t attained = 0, tokens = 0;
    for (const auto& q : records) {
        first_arrival = std::min(first_arrival, q.arrival_ms);
        if (q.queue_ms >= 0) queue.push_back(q.queue_ms);
        if (const auto w = q.prefill_wait_ms()) wait.push_back(*w);
        if (!q.ok) {
            ++r->requests_failed;
            if (r->failures.size() < 20)
                r->failures.push_back(fmt::format("request {}: {}", q.id, q.error));
            continue;
        }
        ++r->requests_completed;
        tokens += q.generated;
        last_finish = std::max(last_finish, q.finish_ms);
        ttft.push_back(q.ttft_ms());
        e2e.push_back(q.e2e_ms());
        const auto tp = q.tpot_ms();
        if (tp) tpot.push_back(*tp);
        const bool ttft_ok = slo.ttft_ms <= 0 || q.ttft_ms() <= slo.ttft_ms;
        const bool tpot_ok = slo.tpot_ms <= 0 || !tp || *tp <= slo.tpot_ms;
        attained += (ttft_ok && tpot_ok) ? 1 : 0;
    }
    r->ttft_ms = percentiles(std::move(ttft));
    r->tpot_ms = percentiles(std::move(tpot));
    r->e2e_ms = percentiles(std::move(e2e));
    r->queue_ms = percentiles(std::move(queue));
    r->prefill_wait_ms = percentiles(std::move(wait));
    const double makespan_s =
        (r->requests_completed > 0) ? (last_finish - first_arrival) / 1000.0 : 0;
    r->goodput_rps = makespan_s > 0 ? static_cast<double>(attained) / makespan_s : 0;
    r->throughput_tokens_s = makespan_s > 0 ? static_cast<double>(tokens) / makespan_s : 0;
    r->slo_attainment =
        records.empty() ? 0 : static_cast<double>(attained) / static_cast<double>(records.size());
}

namespace {
nlohmann::json pj(const Percentiles& p) {
    return {{"mean", p.mean}, {"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}, {"count", p.count}};
}
}  // namespace

nlohmann::json to_json(const Report& r) {
    nlohmann::json j;
    j["schema_version"] = kReportSchemaVersion;
    j["mode"] = r.mode;
    j["topology"] = r.topology;
    j["model"] = r.model;
    j["requests_submitted"] = r.requests_submitted;
    j["requests_completed"] = r.requests_completed;
    j["requests_failed"] = r.requests_failed;
    j["requests_lost"] = r.requests_lost;
    j["ttft_ms"] = pj(r.ttft_ms);
    j["tpot_ms"] = pj(r.tpot_ms);
    j["e2e_ms"] = pj(r.e2e_ms);
    j["queue_ms"] = pj(r.queue_ms);
    j["prefill_wait_ms"] = pj(r.prefill_wait_ms);
    j["goodput_rps"] = r.goodput_rps;
    j["slo_attainment"] = r.slo_attainment;
    j["throughput_tokens_s"] = r.throughput_tokens_s;
    j["transfer"] = {{"bytes", r.transfer.bytes},
                     {"gbps", r.transfer.gbps},
                     {"layer_latency_us", pj(r.transfer.layer_latency_us)},
                     {"exposed_fraction", r.transfer.exposed_fraction}};
    j["ordering"] = {{"checked_layers", r.ordering.checked_layers},
                     {"violations", r.ordering.violations},
                     {"details", r.ordering.details}};
    if (r.outputs_match) j["outputs_match"] = *r.outputs_match;
    j["wall_s"] = r.wall_s;
    j["failures"] = r.failures;
    for (auto it = r.extra.begin(); it != r.extra.end(); ++it) j[it.key()] = it.value();
    if (r.colocated) j["colocated"] = to_json(*r.colocated);
    return j;
}

namespace {

// Writes `content` to `path` whole: into a temporary file beside it, renamed over it, so that no
// reader, nor a writer killed half-way, ever sees a cut file. A path that exists and is not a
// regular file (/dev/stdout, a pipe) is written in place.
Status write_whole(const std::string& path, const std::string& content, const char* what) {
    struct stat st {};
    const bool in_place = ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
    const std::string target =
        in_place ? path : fmt::format("{}.tmp-{}", path, static_cast<long>(::getpid()));
    {
        std::ofstream f(target, std::ios::binary);
        if (!f) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("{}: cannot open {} file for writing", path, what));
        }
        f << content;
        f.flush();
        if (!f) {
            f.close();
            if (!in_place) std::remove(target.c_str());
            return Status(StatusCode::kUnavailable, fmt::format("{}: write failed", path));
        }
    }
    if (!in_place && std::rename(target.c_str(), path.c_str()) != 0) {
        const std::string why = std::strerror(errno);
        std::remove(target.c_str());
        return Status(StatusCode::kUnavailable,
                      fmt::format("{}: cannot replace it with {}: {}", path, target, why));
    }
    return {};
}

}  // namespace

Status write_report(const std::string& path, const Report& report) {
    return write_whole(path, text::dump_json(to_json(report), 2) + "\n", "report");
}

std::string requests_csv_header() {
    return "id,arrival_ms,ttft_ms,tpot_ms,e2e_ms,input_len,output_len,generated,ok,"
           "prefill_instance,decode_instance,transfer_bytes,transfer_ms,queue_ms,prefill_wait_ms,"
           "error\n";
}

std::string requests_csv_row(const RequestRecord& q) {
    std::string err = text::sanitize_utf8(q.error);  // a CSV of valid UTF-8 whatever the text
    std::replace(err.begin(), err.end(), '"', '\'');
    const auto tp = q.tpot_ms();
    const auto wait = q.prefill_wait_ms();
    return fmt::format(
        "{},{:.3f},{},{},{},{},{},{},{},{},{},{},{:.3f},{},{},\"{}\"\n", q.id, q.arrival_ms,
        q.ok ? fmt::format("{:.3f}", q.ttft_ms()) : "", tp ? fmt::format("{:.3f}", *tp) : "",
        q.ok ? fmt::format("{:.3f}", q.e2e_ms()) : "", q.input_len, q.output_len, q.generated,
        q.ok ? 1 : 0, q.prefill_instance, q.decode_instance, q.transfer_bytes, q.transfer_ms,
        q.queue_ms >= 0 ? fmt::format("{:.3f}", q.queue_ms) : "",
        wait ? fmt::format("{:.3f}", *wait) : "", err);
}

Status write_requests_csv(const std::string& path, const std::vector<RequestRecord>& records) {
    std::string text = requests_csv_header();
    for (const auto& q : records) text += requests_csv_row(q);
    return write_whole(path, text, "requests");
}

std::string summary_table(const Report& r) {
    const Report* c = r.colocated.get();
    std::string out;
    auto row = [&](const std::string& name, const std::string& a, const std::string& b) {
        out += c ? fmt::format("  {:<26} {:>16} {:>16}\n", name, a, b)
                 : fmt::format("  {:<26} {:>16}\n", name, a);
    };
    auto f1 = [](double v) { return fmt::format("{:.2f}", v); };
    auto pct = [&](const Percentiles& p) {
        return fmt::format("{:.1f}/{:.1f}/{:.1f}", p.p50, p.p90, p.p99);
    };
    out += fmt::format("pdsim {} report: topology {}, model {}\n", r.mode, r.topology, r.model);
    row("", c ? r.mode : "", c ? c->mode : "");
    row("requests submitted", std::to_string(r.requests_submitted),
        c ? std::to_string(c->requests_submitted) : "");
    row("requests completed", std::to_string(r.requests_completed),
        c ? std::to_string(c->requests_completed) : "");
    row("requests failed", std::to_string(r.requests_failed),
        c ? std::to_string(c->requests_failed) : "");
    row("TTFT ms p50/p90/p99", pct(r.ttft_ms), c ? pct(c->ttft_ms) : "");
    row("TPOT ms p50/p90/p99", pct(r.tpot_ms), c ? pct(c->tpot_ms) : "");
    row("E2E ms p50/p90/p99", pct(r.e2e_ms), c ? pct(c->e2e_ms) : "");
    if (r.queue_ms.count > 0 || (c && c->queue_ms.count > 0)) {
        row("router queue ms p50/p90", fmt::format("{:.1f}/{:.1f}", r.queue_ms.p50, r.queue_ms.p90),
            c ? fmt::format("{:.1f}/{:.1f}", c->queue_ms.p50, c->queue_ms.p90) : "");
    }
    if (r.prefill_wait_ms.count > 0 || (c && c->prefill_wait_ms.count > 0)) {
        row("wait for prefill ms p50/p90",
            fmt::format("{:.1f}/{:.1f}", r.prefill_wait_ms.p50, r.prefill_wait_ms.p90),
            c ? fmt::format("{:.1f}/{:.1f}", c->prefill_wait_ms.p50, c->prefill_wait_ms.p90) : "");
    }
    row("goodput req/s", f1(r.goodput_rps), c ? f1(c->goodput_rps) : "");
    row("SLO attainment", f1(r.slo_attainment), c ? f1(c->slo_attainment) : "");
    row("transfer GB/s", fmt::format("{:.3f}", r.transfer.gbps), c ? "-" : "");
    row("transfer exposed fraction", fmt::format("{:.3f}", r.transfer.exposed_fraction),
        c ? "-" : "");
    row("ordering checked/violations",
        fmt::format("{}/{}", r.ordering.checked_layers, r.ordering.violations), c ? "-" : "");
    if (r.outputs_match) row("outputs match", *r.outputs_match ? "yes" : "NO", "");
    row("wall s", f1(r.wall_s), c ? f1(c->wall_s) : "");
    for (const auto& d : r.ordering.details) out += "  violation: " + d + "\n";
    for (const auto& f : r.failures) out += "  failed: " + f + "\n";
    return out;
}

}  // namespace pdsim::metrics
