#include "sim/des/reporting.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace pdsim::des {

const char* instance_role_name(InstanceRole role) {
    switch (role) {
        case InstanceRole::kPrefill:
            return "prefill";
        case InstanceRole::kDecode:
            return "decode";
        case InstanceRole::kColocated:
            return "colocated";
    }
    return "?";
}

KvTransferFigures kv_transfer_figures(double now_s, double first_flow_s,
                                      double last_forward_start_s, double last_forward_end_s,
                                      double route_latency_s, int num_layers, bool layerwise) {
    const double layers = num_layers;
    const double latency = route_latency_s;
    KvTransferFigures f;
    f.exposed_s = std::max(0.0, now_s - last_forward_end_s);
    f.transfer_s = now_s - (first_flow_s < 0 ? now_s : first_flow_s);
    const double tail = std::max(0.0, now_s - latency - last_forward_end_s);
    f.layer_latency_s = latency + tail * (layers + 1) / (2 * layers);
    if (!layerwise) {
        f.layer_latency_s +=
            (last_forward_end_s - last_forward_start_s) * (layers - 1) / (2 * layers);
    }
    return f;
}

void TransferSummary::fill(metrics::TransferSummary* out) {
    out->bytes = static_cast<int64_t>(std::llround(bytes_));
    out->gbps = busy_s_ > 0 ? bytes_ / busy_s_ / 1e9 : 0;
    out->layer_latency_us = metrics::percentiles(std::move(layer_latency_us_));
    out->exposed_fraction = transfer_s_ > 0 ? exposed_s_ / transfer_s_ : 0;
}

SimTimeline::SimTimeline(const SimConfig& config)
    : timeline_(config.timeline),
      pid_base_(config.timeline_pid_base),
      requests_pid_(config.timeline_pid_base + static_cast<int>(config.topology.instances.size())),
      sample_(config.timeline_sample),
      max_forwards_(config.timeline_max_forwards) {}

void SimTimeline::name_tracks(const topo::Topology& topology, SimMode mode,
                              std::span<const InstanceRole> roles) {
    if (timeline_ == nullptr) return;
    for (size_t i = 0; i < roles.size(); ++i) {
        const topo::Instance& instance = topology.instances[i];
        const int pid = pid_base_ + static_cast<int>(i);
        timeline_->name_process(pid, fmt::format("{}: {} {} tp{}", sim_mode_name(mode), instance.id,
                                                 instance_role_name(roles[i]), instance.tp));
        timeline_->name_thread(pid, 0, "forwards");
        if (roles[i] == InstanceRole::kPrefill) timeline_->name_thread(pid, 1, "kv transfer");
    }
    timeline_->name_process(requests_pid_,
                            fmt::format("{}: requests (every {})", sim_mode_name(mode), sample_));
}

void SimTimeline::write_forward(int instance, bool extend, double start_s, double duration_s,
                                size_t batch_size, int64_t tokens) {
    if (forwards_++ >= max_forwards_) return;
    timeline_->add_slice(pid_base_ + instance, 0,
                         extend ? fmt::format("extend bs={} T={}", batch_size, tokens)
                                : fmt::format("decode bs={}", batch_size),
                         "forward", start_s * 1e6, duration_s * 1e6);
}

void SimTimeline::write_request(const metrics::RequestRecord& rec) {
    const int tid = static_cast<int>(rec.id % 16);
    const double arrival_us = rec.arrival_ms * 1000;
    if (rec.ok) {
        timeline_->add_slice(requests_pid_, tid, fmt::format("r{} to first token", rec.id),
                             "request", arrival_us, (rec.first_token_ms - rec.arrival_ms) * 1000,
                             {{"input_len", rec.input_len}});
        timeline_->add_slice(requests_pid_, tid, fmt::format("r{} decode", rec.id), "request",
                             rec.first_token_ms * 1000, (rec.finish_ms - rec.first_token_ms) * 1000,
                             {{"generated", rec.generated}});
    } else {
        timeline_->add_instant(requests_pid_, tid, fmt::format("r{} failed", rec.id), "request",
                               arrival_us);
    }
}

void SimTimeline::write_transfer(int prefill_instance, const metrics::RequestRecord& rec,
                                 double first_flow_s, const KvTransferFigures& figures) {
    timeline_->add_slice(pid_base_ + prefill_instance, 1, fmt::format("kv r{}", rec.id), "transfer",
                         first_flow_s * 1e6, figures.transfer_s * 1e6,
                         {{"bytes", rec.transfer_bytes}, {"exposed_ms", figures.exposed_s * 1000}});
}

namespace {

nlohmann::json simulator_json(const SimStats& s, size_t num_requests,
                              std::span<const InstanceSummary> instances,
                              const KvGroupBytes& transfer_groups) {
    std::vector<std::string> costs;  // each description once, in instance order
    for (const InstanceSummary& x : instances) {
        if (std::find(costs.begin(), costs.end(), x.cost_description) == costs.end()) {
            costs.push_back(x.cost_description);
        }
    }
    std::string cost_desc;
    for (const auto& c : costs) cost_desc += (cost_desc.empty() ? "" : "; ") + c;
    nlohmann::json out = {
        {"events", s.events},
        {"wall_s", s.wall_s},
        {"cpu_s", s.cpu_s},
        {"requests_per_wall_s", s.wall_s > 0 ? static_cast<double>(num_requests) / s.wall_s : 0},
        {"events_per_wall_s", s.wall_s > 0 ? static_cast<double>(s.events) / s.wall_s : 0},
        {"sim_s", s.sim_s},
        {"cost_model", cost_desc},
        {"extend_forwards", s.extend_forwards},
        {"decode_forwards", s.decode_forwards},
        {"prefill_tokens", s.prefill_tokens},
        {"prefix_hit_tokens", s.prefix_hit_tokens},
        {"preemptions", s.preemptions},
        {"flows", s.flows},
        {"max_in_flight", s.max_in_flight},
        {"bundled_lanes", s.bundled_lanes},
        {"contended_forwards", s.contended_forwards},
        {"step_waits", s.step_waits},
        {"transfer_bytes_by_group",
         {{"full", std::llround(transfer_groups.full)},
          {"sliding", std::llround(transfer_groups.sliding)},
          {"state", std::llround(transfer_groups.state)}}},
    };
    nlohmann::json kv = nlohmann::json::array();
    for (const InstanceSummary& x : instances) {
        const KvFootprint& f = x.footprint;
        nlohmann::json fit = nlohmann::json::object();
        for (int64_t tokens : kKvFitLengths) {
            fit[std::to_string(tokens)] = x.kv_pages / std::max<int64_t>(1, f.pages_for(tokens));
        }
        kv.push_back({{"instance", x.id},
                      {"kv_pages", x.kv_pages},
                      {"kv_page_bytes", f.page_bytes},
                      {"kv_page_layers", f.page_layers},
                      {"kv_sliding_pages", f.sliding_layers * f.sliding_max_pages},
                      {"kv_state_pages", f.state_pages},
                      {"kv_requests_that_fit", std::move(fit)},
                      {"evicted_blocks", x.evicted_blocks},
                      {"cached_blocks", x.cached_blocks}});
    }
    out["instances"] = std::move(kv);
    return out;
}

nlohmann::json config_json(const SimConfig& config, const std::string& mode,
                           std::span<const double> contended_node_cores, bool cost_noise) {
    const policy::BatchingOptions& b = config.batching;
    nlohmann::json contended_cores = nlohmann::json::array();
    for (double cores : contended_node_cores) contended_cores.push_back(cores);
    return {{"mode", mode},
            {"layerwise", config.layerwise},
            {"prefix_cache", config.prefix_cache && all_full_attention(config.model)},
            {"kv_admission", config.reserve_output ? "full" : "prompt"},
            {"page_size", config.page_size},
            {"chunk_size", b.chunk_size},
            {"max_batch_tokens", b.max_batch_tokens},
            {"max_decode_batch", b.max_decode_batch},
            {"max_decode_kv_tokens", b.max_decode_kv_tokens},
            {"cpu_contention", config.cpu_contention},
            {"rank_core", config.rank_core},  // empty: ranks unbound
            {"cost_noise", cost_noise},
            {"noise_seed", config.noise_seed},
            {"contended_node_cores", contended_cores},
            {"slo_ttft_ms", config.slo.ttft_ms},
            {"slo_tpot_ms", config.slo.tpot_ms}};
}

}  // namespace

metrics::Report build_report(const SimConfig& config,
                             const std::vector<metrics::RequestRecord>& records,
                             const SimStats& stats, TransferSummary& transfer,
                             std::span<const InstanceSummary> instances,
                             std::span<const double> contended_node_cores, bool cost_noise) {
    metrics::Report rep;
    rep.mode = std::string(sim_mode_name(config.mode));
    rep.topology = config.topology_label;
    rep.model = config.model.name;
    metrics::summarize_requests(records, config.slo, &rep);
    transfer.fill(&rep.transfer);
    double last_finish = 0;
    for (const auto& r : records) last_finish = std::max(last_finish, r.finish_ms);
    rep.wall_s = last_finish / 1000.0;
    rep.extra["simulator"] = simulator_json(stats, records.size(), instances, transfer.groups());
    rep.extra["config"] = config_json(config, rep.mode, contended_node_cores, cost_noise);
    return rep;
}

}  // namespace pdsim::des
