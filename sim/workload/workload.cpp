#include "sim/workload/workload.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "common/data_dir.h"
#include "common/input_file.h"
#include "common/text.h"

namespace pdsim::workload {

namespace {

Status line_error(const std::string& source, int64_t line, const std::string& what) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{}:{}: {}", source, line, what));
}

// Sort by arrival, rebase to the first arrival, apply caps / skip / sample, renumber.
StatusOr<std::vector<Request>> finish(std::vector<Request> reqs, const LoadOptions& o,
                                      const std::string& source) {
    if (o.time_scale <= 0 || !std::isfinite(o.time_scale)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("time scale {} must be > 0", o.time_scale));
    }
    if (o.skip < 0 || o.max_requests < 0 || o.sample < 0 || o.max_input_len < 0 ||
        o.max_output_len < 0) {
        return Status(StatusCode::kInvalidArgument,
                      "skip / max requests / sample / caps must be >= 0");
    }
    if (reqs.empty())
        return Status(StatusCode::kInvalidArgument, source + ": no requests in trace");
    std::stable_sort(reqs.begin(), reqs.end(), [](const Request& a, const Request& b) {
        return a.arrival_ms < b.arrival_ms;
    });
    if (o.skip > 0)
        reqs.erase(reqs.begin(),
                   reqs.begin() + std::min<int64_t>(o.skip, static_cast<int64_t>(reqs.size())));
    if (o.sample > 0 && o.sample < static_cast<int64_t>(reqs.size())) {
        std::vector<size_t> idx(reqs.size());
        std::iota(idx.begin(), idx.end(), size_t{0});
        std::mt19937_64 rng(o.seed);
        std::shuffle(idx.begin(), idx.end(), rng);
        idx.resize(static_cast<size_t>(o.sample));
        std::sort(idx.begin(), idx.end());
        std::vector<Request> picked;
        picked.reserve(idx.size());
        for (size_t i : idx) picked.push_back(std::move(reqs[i]));
        reqs = std::move(picked);
    } else if (o.max_requests > 0 && o.max_requests < static_cast<int64_t>(reqs.size())) {
        reqs.resize(static_cast<size_t>(o.max_requests));
    }
    if (reqs.empty())
        return Status(StatusCode::kInvalidArgument, source + ": no requests left after --skip");
    const double base = reqs.front().arrival_ms;
    for (size_t i = 0; i < reqs.size(); ++i) {
        Request& r = reqs[i];
        r.id = static_cast<int64_t>(i);
        r.arrival_ms = (r.arrival_ms - base) * o.time_scale;
        if (o.max_input_len > 0 && r.input_len > o.max_input_len) {
            r.input_len = o.max_input_len;
            const size_t blocks =
                static_cast<size_t>((r.input_len + kHashBlockTokens - 1) / kHashBlockTokens);
            if (r.hash_ids.size() > blocks) r.hash_ids.resize(blocks);
        }
        if (o.max_output_len > 0 && r.output_len > o.max_output_len)
            r.output_len = o.max_output_len;
    }
    return reqs;
}

// A token length: a JSON integer (not 3.0, not 1e19) in [1, kMaxTraceTokens].
StatusOr<int32_t> json_length(const nlohmann::json& obj, const char* key, const std::string& source,
                              int64_t line) {
    auto it = obj.find(key);
    if (it == obj.end()) return line_error(source, line, fmt::format("missing field '{}'", key));
    if (!it->is_number_integer()) {  // true for signed and unsigned JSON integers
        return line_error(source, line,
                          fmt::format("{}: {} is not an integer", key, text::excerpt(it->dump())));
    }
    const bool too_large = it->is_number_unsigned()
                               ? it->get<uint64_t>() > static_cast<uint64_t>(kMaxTraceTokens)
                               : it->get<int64_t>() > kMaxTraceTokens;
    if (too_large || it->get<int64_t>() < 1) {
        return line_error(
            source, line,
            fmt::format("{}: {} must be >= 1 and <= {}", key, it->dump(), kMaxTraceTokens));
    }
    return static_cast<int32_t>(it->get<int64_t>());
}

// hash_ids: JSON integers in the int64 range, at most one per 512-token block of the input.
Status read_hash_ids(const nlohmann::json& h, int32_t input_len, const std::string& source,
                     int64_t line, std::vector<int64_t>* out) {
    if (!h.is_array()) {
        return line_error(source, line,
                          fmt::format("hash_ids: {} is not an array", text::excerpt(h.dump())));
    }
    out->reserve(h.size());
    for (size_t k = 0; k < h.size(); ++k) {
        const nlohmann::json& e = h[k];
        if (!e.is_number_integer()) {
            return line_error(
                source, line,
                fmt::format("hash_ids[{}]: {} is not an integer", k, text::excerpt(e.dump())));
        }
        if (e.is_number_unsigned() &&
            e.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            return line_error(
                source, line,
                fmt::format("hash_ids[{}]: {} is out of the int64 range", k, e.dump()));
        }
        out->push_back(e.get<int64_t>());
    }
    const size_t max_blocks = static_cast<size_t>((input_len - 1) / kHashBlockTokens + 1);
    if (h.size() > max_blocks) {
        return line_error(source, line,
                          fmt::format("hash_ids: {} blocks for input_length {} (at most {} blocks "
                                      "of {} tokens)",
                                      h.size(), input_len, max_blocks, kHashBlockTokens));
    }
    return ok_status();
}

}  // namespace

StatusOr<TraceFormat> parse_trace_format(std::string_view text) {
    if (text == "auto") return TraceFormat::kAuto;
    if (text == "mooncake") return TraceFormat::kMooncake;
    if (text == "azure") return TraceFormat::kAzure;
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("unknown trace format '{}' (auto|mooncake|azure)", text));
}

StatusOr<std::vector<Request>> parse_mooncake(std::istream& in, const std::string& source,
                                              const LoadOptions& o) {
    std::vector<Request> reqs;
    std::string line;
    int64_t lineno = 0;
    while (std::getline(in, line)) {
        ++lineno;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_discarded() || !j.is_object()) {
            return line_error(source, lineno,
                              fmt::format("not a JSON object: {}", text::excerpt(line)));
        }
        Request r;
        r.source_line = lineno;
        auto ts = j.find("timestamp");
        if (ts == j.end()) return line_error(source, lineno, "missing field 'timestamp'");
        if (!ts->is_number() || ts->get<double>() < 0 || !std::isfinite(ts->get<double>())) {
            return line_error(source, lineno,
                              fmt::format("timestamp: {} must be a finite number >= 0",
                                          text::excerpt(ts->dump())));
        }
        r.arrival_ms = ts->get<double>();
        PDSIM_ASSIGN_OR_RETURN(r.input_len, json_length(j, "input_length", source, lineno));
        PDSIM_ASSIGN_OR_RETURN(r.output_len, json_length(j, "output_length", source, lineno));
        if (auto h = j.find("hash_ids"); h != j.end()) {
            PDSIM_RETURN_IF_ERROR(read_hash_ids(*h, r.input_len, source, lineno, &r.hash_ids));
        }
        reqs.push_back(std::move(r));
    }
    return finish(std::move(reqs), o, source);
}

namespace {
// "2023-11-16 18:17:03.9799600" -> ms since the epoch (UTC; only differences matter).
bool parse_azure_time(std::string_view s, double* ms) {
    int Y, M, D, h, m;
    double sec;
    std::string buf(s);
    if (std::sscanf(buf.c_str(), "%d-%d-%d %d:%d:%lf", &Y, &M, &D, &h, &m, &sec) != 6) return false;
    // (sec as !(0 <= sec < 61): sscanf's %lf reads "nan" too. The year's range keeps Y - 1900
    // from overflowing.)
    if (Y < 1 || Y > 9999 || M < 1 || M > 12 || D < 1 || D > 31 || h < 0 || h > 23 || m < 0 ||
        m > 59 || !(sec >= 0 && sec < 61))
        return false;
    std::tm tm{};
    tm.tm_year = Y - 1900;
    tm.tm_mon = M - 1;
    tm.tm_mday = D;
    tm.tm_hour = h;
    tm.tm_min = m;
    tm.tm_sec = 0;
    const time_t t = timegm(&tm);
    *ms = static_cast<double>(t) * 1000.0 + sec * 1000.0;
    return true;
}

// A token length: decimal digits (surrounding spaces allowed) in [1, kMaxTraceTokens]; no sign,
// exponent, fraction or clamping.
bool parse_length(std::string_view s, int32_t* v) {
    while (!s.empty() && (s.back() == '\r' || s.back() == ' ')) s.remove_suffix(1);
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    if (s.empty() || s.front() < '0' || s.front() > '9') return false;
    int64_t n = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
    if (ec != std::errc() || p != s.data() + s.size() || n < 1 || n > kMaxTraceTokens) return false;
    *v = static_cast<int32_t>(n);
    return true;
}
}  // namespace

StatusOr<std::vector<Request>> parse_azure(std::istream& in, const std::string& source,
                                           const LoadOptions& o) {
    std::string line;
    if (!std::getline(in, line))
        return Status(StatusCode::kInvalidArgument, source + ": empty file");
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line != "TIMESTAMP,ContextTokens,GeneratedTokens") {
        return line_error(
            source, 1,
            fmt::format("expected header 'TIMESTAMP,ContextTokens,GeneratedTokens', got '{}'",
                        text::excerpt(line)));
    }
    std::vector<Request> reqs;
    int64_t lineno = 1;
    while (std::getline(in, line)) {
        ++lineno;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        std::vector<std::string_view> f;
        std::string_view sv(line);
        size_t pos = 0;
        while (true) {
            size_t c = sv.find(',', pos);
            f.push_back(
                sv.substr(pos, c == std::string_view::npos ? std::string_view::npos : c - pos));
            if (c == std::string_view::npos) break;
            pos = c + 1;
        }
        if (f.size() != 3)
            return line_error(source, lineno, fmt::format("expected 3 fields, got {}", f.size()));
        Request r;
        r.source_line = lineno;
        if (!parse_azure_time(f[0], &r.arrival_ms)) {
            return line_error(
                source, lineno,
                fmt::format("TIMESTAMP: '{}' is not 'YYYY-MM-DD HH:MM:SS.f'", text::excerpt(f[0])));
        }
        if (!parse_length(f[1], &r.input_len)) {
            return line_error(source, lineno,
                              fmt::format("ContextTokens: '{}' must be an integer from 1 to {}",
                                          text::excerpt(f[1]), kMaxTraceTokens));
        }
        if (!parse_length(f[2], &r.output_len)) {
            return line_error(source, lineno,
                              fmt::format("GeneratedTokens: '{}' must be an integer from 1 to {}",
                                          text::excerpt(f[2]), kMaxTraceTokens));
        }
        reqs.push_back(std::move(r));
    }
    return finish(std::move(reqs), o, source);
}

StatusOr<std::vector<Request>> load_trace(const std::string& path_or_name, TraceFormat format,
                                          const LoadOptions& o) {
    const std::string path = data::resolve_data_file(data::DataKind::kTraces, path_or_name);
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<files::InputFile> file,
                           files::InputFile::open(path, files::kMaxTraceFileBytes));
    std::istream& in = file->stream();
    if (format == TraceFormat::kAuto) {
        const std::string ext = std::filesystem::path(path).extension().string();
        if (ext == ".jsonl" || ext == ".json") {
            format = TraceFormat::kMooncake;
        } else if (ext == ".csv") {
            format = TraceFormat::kAzure;
        } else {
            const int first = in.peek();
            format = first == '{' ? TraceFormat::kMooncake : TraceFormat::kAzure;
        }
    }
    auto parsed =
        format == TraceFormat::kMooncake ? parse_mooncake(in, path, o) : parse_azure(in, path, o);
    PDSIM_RETURN_IF_ERROR(file->read_status());  // a read error or a file that grew past the cap
    return parsed;
}

StatusOr<LengthDist> parse_length_dist(std::string_view text) {
    auto bad = [&] {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("length distribution '{}': expected fixed:N, uniform:MIN:MAX or "
                                  "lognormal:MEDIAN:SIGMA",
                                  text));
    };
    std::vector<std::string> parts;
    size_t pos = 0;
    std::string s(text);
    while (true) {
        size_t c = s.find(':', pos);
        parts.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
        if (c == std::string::npos) break;
        pos = c + 1;
    }
    auto num = [](const std::string& p, double* out) {
        char* end = nullptr;
        *out = std::strtod(p.c_str(), &end);
        return !p.empty() && *end == '\0' && std::isfinite(*out);
    };
    LengthDist d;
    if (parts[0] == "fixed" && parts.size() == 2) {
        d.kind = LengthDist::Kind::kFixed;
        if (!num(parts[1], &d.a) || d.a < 1) return bad();
    } else if (parts[0] == "uniform" && parts.size() == 3) {
        d.kind = LengthDist::Kind::kUniform;
        if (!num(parts[1], &d.a) || !num(parts[2], &d.b) || d.a < 1 || d.b < d.a) return bad();
    } else if (parts[0] == "lognormal" && parts.size() == 3) {
        d.kind = LengthDist::Kind::kLognormal;
        if (!num(parts[1], &d.a) || !num(parts[2], &d.b) || d.a < 1 || d.b < 0) return bad();
    } else {
        return bad();
    }
    return d;
}

namespace {
int32_t draw(const LengthDist& d, std::mt19937_64& rng) {
    double v = d.a;
    if (d.kind == LengthDist::Kind::kUniform) {
        v = std::uniform_real_distribution<double>(d.a, d.b + 1.0)(rng);
    } else if (d.kind == LengthDist::Kind::kLognormal) {
        v = std::lognormal_distribution<double>(std::log(d.a), d.b)(rng);
    }
    return static_cast<int32_t>(std::clamp<double>(std::floor(v), d.min, d.max));
}
}  // namespace

StatusOr<std::vector<Request>> make_synthetic(const SyntheticOptions& o) {
    if (o.num_requests < 1)
        return Status(StatusCode::kInvalidArgument, "synthetic: number of requests must be >= 1");
    if (!(o.rate_rps > 0) || !std::isfinite(o.rate_rps)) {
        return Status(StatusCode::kInvalidArgument, "synthetic: rate must be > 0 requests/s");
    }
    if (o.gamma && !(o.cv > 0))
        return Status(StatusCode::kInvalidArgument, "synthetic: gamma cv must be > 0");
    std::mt19937_64 rng(o.seed);
    std::vector<Request> reqs(static_cast<size_t>(o.num_requests));
    double t = 0;
    const double mean_gap_ms = 1000.0 / o.rate_rps;
    // Gamma with shape k = 1/cv^2 and mean mean_gap has the requested coefficient of variation.
    const double k = o.gamma ? 1.0 / (o.cv * o.cv) : 1.0;
    std::gamma_distribution<double> gap(k, mean_gap_ms / k);
    for (size_t i = 0; i < reqs.size(); ++i) {
        if (i > 0) t += gap(rng);
        reqs[i].id = static_cast<int64_t>(i);
        reqs[i].arrival_ms = t;
        reqs[i].input_len = draw(o.input, rng);
        reqs[i].output_len = draw(o.output, rng);
    }
    return reqs;
}

TraceStats summarize(const std::vector<Request>& r) {
    TraceStats s;
    s.requests = static_cast<int64_t>(r.size());
    if (r.empty()) return s;
    double in = 0, out = 0;
    for (const auto& q : r) {
        in += q.input_len;
        out += q.output_len;
        s.max_input = std::max(s.max_input, q.input_len);
        s.max_output = std::max(s.max_output, q.output_len);
    }
    s.mean_input = in / static_cast<double>(r.size());
    s.mean_output = out / static_cast<double>(r.size());
    s.duration_s = (r.back().arrival_ms - r.front().arrival_ms) / 1000.0;
    return s;
}

}  // namespace pdsim::workload
