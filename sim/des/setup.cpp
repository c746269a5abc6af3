#include "sim/des/setup.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

namespace pdsim::des {

namespace {

std::string dist_text(const workload::LengthDist& d) {
    switch (d.kind) {
        case workload::LengthDist::Kind::kFixed:
            return fmt::format("fixed:{:g}", d.a);
        case workload::LengthDist::Kind::kUniform:
            return fmt::format("uniform:{:g}:{:g}", d.a, d.b);
        case workload::LengthDist::Kind::kLognormal:
            return fmt::format("lognormal:{:g}:{:g}", d.a, d.b);
    }
    return "?";
}

}  // namespace

StatusOr<model::ModelConfig> load_model(const std::string& name_or_path, int layers,
                                        const std::string& flag) {
    if (layers < 0) return invalid_argument_error(fmt::format("--layers {}: must be >= 1", layers));
    StatusOr<model::ModelConfig> m = model::resolve_model(name_or_path);
    if (!m.ok())
        return invalid_argument_error(
            fmt::format("{} {}: {}", flag, name_or_path, m.status().message()));
    if (layers > 0) m->num_layers = layers;
    PDSIM_RETURN_IF_ERROR(model::validate_model(*m).with_context(flag));
    return *m;
}

void normalize_requests(std::vector<workload::Request>* requests, double time_scale) {
    if (requests->empty()) return;
    const double first = requests->front().arrival_ms;
    for (auto& r : *requests) {
        r.input_len = std::max(r.input_len, 1);
        r.output_len = std::max(r.output_len, 1);
        r.arrival_ms = (r.arrival_ms - first) * time_scale;
    }
}

StatusOr<std::vector<workload::Request>> load_requests(const RequestSource& s) {
    if (!(s.time_scale > 0) || !std::isfinite(s.time_scale)) {
        return invalid_argument_error(fmt::format("--time-scale {}: must be > 0", s.time_scale));
    }
    if (s.max_input_len < 0) {
        return invalid_argument_error(
            fmt::format("--max-input-len {}: must be >= 0", s.max_input_len));
    }
    if (s.max_output_len < 0) {
        return invalid_argument_error(
            fmt::format("--max-output-len {}: must be >= 0", s.max_output_len));
    }
    if (s.max_requests < 0 || s.sample < 0)
        return invalid_argument_error("--max-requests / --sample must be >= 0");
    std::vector<workload::Request> reqs;
    if (s.trace.empty()) {
        PDSIM_ASSIGN_OR_RETURN(reqs, workload::make_synthetic(s.synthetic));
        for (auto& r : reqs) {
            if (s.max_input_len > 0) r.input_len = std::min(r.input_len, s.max_input_len);
            if (s.max_output_len > 0) r.output_len = std::min(r.output_len, s.max_output_len);
        }
    } else {
        workload::LoadOptions wl;
        wl.max_input_len = s.max_input_len;
        wl.max_output_len = s.max_output_len;
        wl.max_requests = s.max_requests;
        wl.sample = s.sample;
        wl.seed = s.seed;
        wl.time_scale = 1.0;
        PDSIM_ASSIGN_OR_RETURN(workload::TraceFormat kind,
                               workload::parse_trace_format(s.trace_format));
        PDSIM_ASSIGN_OR_RETURN(reqs, workload::load_trace(s.trace, kind, wl));
        if (reqs.empty())
            return invalid_argument_error(fmt::format("{}: the trace has no requests", s.trace));
    }
    normalize_requests(&reqs, s.time_scale);
    return reqs;
}

std::string describe_requests(const RequestSource& s) {
    std::string out;
    if (s.trace.empty()) {
        const workload::SyntheticOptions& o = s.synthetic;
        out = fmt::format("synthetic {} ({} {:g} req/s, input {}, output {}, seed {})",
                          o.num_requests, o.gamma ? fmt::format("gamma cv {:g}", o.cv) : "poisson",
                          o.rate_rps, dist_text(o.input), dist_text(o.output), o.seed);
    } else {
        out = std::filesystem::path(s.trace).filename().string();
        if (s.sample > 0) out += fmt::format(" (sample {}, seed {})", s.sample, s.seed);
        if (s.max_requests > 0) out += fmt::format(" (first {})", s.max_requests);
    }
    if (s.max_input_len > 0) out += fmt::format(" (input <= {})", s.max_input_len);
    if (s.max_output_len > 0) out += fmt::format(" (output <= {})", s.max_output_len);
    if (s.time_scale != 1.0) out += fmt::format(" (time x{:g})", s.time_scale);
    return out;
}

}  // namespace pdsim::des
