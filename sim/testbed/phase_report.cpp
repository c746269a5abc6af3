#include "sim/testbed/phase_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "sim/metrics/report.h"
#include "sim/testbed/router.h"
#include "sim/testbed/server.h"
#include "topology/model_shape.h"
#include "topology/topology.h"
#include "transfer/engine/engine_types.h"

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;

// Timeline process ids of the colocated phase, when both phases share one timeline.
constexpr int kPidColocatedOffset = 100;

struct Interval {
    double a, b;
};

double union_length(std::vector<Interval> v) {
    std::sort(v.begin(), v.end(), [](const Interval& x, const Interval& y) { return x.a < y.a; });
    double total = 0, cur_a = 0, cur_b = -1;
    bool open = false;
    for (const auto& x : v) {
        if (!open || x.a > cur_b) {
            if (open) total += cur_b - cur_a;
            cur_a = x.a;
            cur_b = x.b;
            open = true;
        } else {
            cur_b = std::max(cur_b, x.b);
        }
    }
    if (open) total += cur_b - cur_a;
    return total;
}

void add_timeline(const ResolvedConfig& cfg, PhaseData& pd, const std::vector<double>& offsets,
                  double t_origin, bool both, metrics::Timeline* tl) {
    const topo::RankMap map = cfg.topology.rank_map();
    const int pid_base = both && pd.phase == Phase::kColocated ? kPidColocatedOffset : 0;
    static const char* kTids[] = {"scheduler", "compute stream", "record", "send", "receive"};
    for (size_t r = 0; r < pd.results.size(); ++r) {
        if (!pd.results[r]) continue;
        const RankResult& res = *pd.results[r];
        const auto& info = map.at(static_cast<int>(r));
        const auto& inst = cfg.topology.instances[static_cast<size_t>(info.instance)];
        const int pid = pid_base + static_cast<int>(r);
        tl->name_process(
            pid,
            fmt::format("{}: rank {} {} tp{} ({})", phase_name(pd.phase), r, inst.id, info.tp_rank,
                        pd.phase == Phase::kColocated ? "colocated"
                                                      : std::string(topo::role_name(info.role))));
        for (int t = 0; t < 5; ++t) tl->name_thread(pid, t, kTids[t]);
        const double off = offsets[r] + t_origin;
        for (const TimelineRecord& e : res.timeline) {
            const double ts = e.ts_us - off;
            if (e.dur_us < 0) {
                tl->add_instant(pid, e.tid, e.name, e.category, ts);
            } else {
                tl->add_slice(pid, e.tid, e.name, e.category, ts, e.dur_us,
                              e.args.is_null() ? json::object() : e.args);
            }
        }
    }
    // Request lifecycles on rank 0's row of "requests".
    const int pid = pid_base + 99;
    tl->name_process(pid, fmt::format("{}: requests", phase_name(pd.phase)));
    const double base = pd.router.t_base_us - t_origin;
    for (const auto& rec : pd.router.records) {
        const int tid = static_cast<int>(rec.id % 16);
        const double arr = base + rec.arrival_ms * 1000;
        if (rec.first_token_ms >= 0) {
            tl->add_slice(pid, tid, fmt::format("r{} to first token", rec.id), "request", arr,
                          (rec.first_token_ms - rec.arrival_ms) * 1000,
                          {{"input_len", rec.input_len}});
            if (rec.finish_ms >= 0) {
                tl->add_slice(pid, tid, fmt::format("r{} decode", rec.id), "request",
                              base + rec.first_token_ms * 1000,
                              (rec.finish_ms - rec.first_token_ms) * 1000,
                              {{"generated", rec.generated}});
            }
        } else if (!rec.ok) {
            tl->add_instant(pid, tid, fmt::format("r{} failed", rec.id), "request", arr);
        }
    }
}

// Transfer metrics from every rank's engine events (disaggregated phase).
void summarize_transfer(const ResolvedConfig& cfg, PhaseData& pd,
                        const std::vector<double>& offsets, double t_origin,
                        metrics::Timeline* tl) {
    using Kind = transfer::TransferEvent::Kind;
    constexpr Kind kReady = Kind::kLayerReady, kPosted = Kind::kLayerPosted,
                   kSent = Kind::kLayerSent, kArrived = Kind::kLayerArrived;
    const topo::RankMap map = cfg.topology.rank_map();
    struct Key {
        uint64_t req;
        int layer;
        bool operator<(const Key& o) const { return req != o.req ? req < o.req : layer < o.layer; }
    };
    std::map<uint64_t, double> prefill_end;
    std::map<uint64_t, uint32_t> last_chunk;
    std::map<Key, double> ready_last, arrival, layer_first_post;
    std::map<std::tuple<int, uint64_t, int, int, uint32_t>, double>
        posted;  // rank, req, layer, peer, chunk
    struct Span {
        uint64_t req;
        int layer;
        uint32_t chunk;
        double a, b;
        int rank, peer;
    };
    std::vector<Span> spans;
    std::map<Key, int> arrival_rank;
    int64_t bytes = 0;
    for (size_t r = 0; r < pd.results.size(); ++r) {
        if (!pd.results[r]) continue;
        const RankResult& res = *pd.results[r];
        const double off = offsets[r];
        for (const auto& [rid, t] : res.prefill_end_us) {
            const double tt = t - off;
            prefill_end[rid] = std::max(prefill_end.count(rid) ? prefill_end[rid] : tt, tt);
        }
        if (res.stats.contains("receiver"))
            bytes += res.stats["receiver"].value("bytes", int64_t{0});
        for (const EngineEventRecord& e : res.engine_events) {
            if (e.kind == kReady || e.kind == kPosted || e.kind == kSent) {
                last_chunk[e.request] = std::max(
                    last_chunk.count(e.request) ? last_chunk[e.request] : e.chunk, e.chunk);
            }
        }
    }
    for (size_t r = 0; r < pd.results.size(); ++r) {
        if (!pd.results[r]) continue;
        const double off = offsets[r];
        for (const EngineEventRecord& e : pd.results[r]->engine_events) {
            const Kind kind = e.kind;
            const uint64_t req = e.request;
            const int layer = e.layer;
            const int peer = e.peer;
            const uint32_t chunk = e.chunk;
            const double t = e.t_us - off;
            const Key k{req, layer};
            if (kind == kReady && chunk == last_chunk[req]) {
                ready_last[k] = std::max(ready_last.count(k) ? ready_last[k] : t, t);
            } else if (kind == kPosted) {
                layer_first_post[k] =
                    std::min(layer_first_post.count(k) ? layer_first_post[k] : t, t);
                posted[{static_cast<int>(r), req, layer, peer, chunk}] = t;
            } else if (kind == kSent) {
                auto it = posted.find({static_cast<int>(r), req, layer, peer, chunk});
                if (it != posted.end())
                    spans.push_back({req, layer, chunk, it->second, t, static_cast<int>(r), peer});
            } else if (kind == kArrived) {
                arrival[k] = std::max(arrival.count(k) ? arrival[k] : t, t);
                arrival_rank[k] = static_cast<int>(r);
            }
        }
    }
    std::vector<double> lat;
    std::map<int, std::vector<double>> lat_by_layer;
    for (auto& [k, t] : arrival) {
        auto it = ready_last.find(k);
        if (it != ready_last.end()) {
            lat.push_back(std::max(0.0, t - it->second));
            lat_by_layer[k.layer].push_back(lat.back());
        }
        auto p = layer_first_post.find(k);
        if (p != layer_first_post.end() && tl != nullptr) {
            tl->add_slice(arrival_rank[k], 4, fmt::format("recv r{} L{}", k.req, k.layer),
                          "receive", p->second - t_origin, t - p->second);
        }
    }
    // Per request: the time some of its KV was in flight (union of its layer sends, posted ->
    // completed, the last chunk's extended to the layer landing on decode), and the part of that
    // after its last prefill forward ended (exposed).
    std::map<uint64_t, std::vector<Interval>> by_req;
    std::vector<Interval> busy;
    for (auto& sp : spans) {
        double b = sp.b;
        if (sp.chunk == last_chunk[sp.req]) {
            auto it = arrival.find({sp.req, sp.layer});
            if (it != arrival.end()) b = std::max(b, it->second);
        }
        by_req[sp.req].push_back({sp.a, b});
        busy.push_back({sp.a, sp.b});
        if (tl != nullptr) {
            tl->add_slice(sp.rank, 3, fmt::format("send r{} L{} c{}", sp.req, sp.layer, sp.chunk),
                          "send", sp.a - t_origin, sp.b - sp.a, {{"to_rank", sp.peer}});
        }
    }
    for (auto& [id, t] : prefill_end) pd.prefill_end_ms[id] = (t - pd.router.t_base_us) / 1000.0;
    double transfer_sum = 0, exposed_sum = 0;
    for (auto& rec : pd.router.records) {
        const auto id = static_cast<uint64_t>(rec.id);
        auto it = by_req.find(id);
        if (it == by_req.end()) continue;
        const double total = union_length(it->second);
        double exposed = total;
        if (prefill_end.count(id)) {
            const double end = prefill_end[id];
            std::vector<Interval> after;
            for (const auto& iv : it->second) {
                if (iv.b > end) after.push_back({std::max(iv.a, end), iv.b});
            }
            exposed = union_length(after);
        }
        rec.transfer_ms = total / 1000;
        rec.exposed_transfer_ms = exposed / 1000;
        if (rec.ok) {
            transfer_sum += total;
            exposed_sum += exposed;
        }
    }
    metrics::TransferSummary& ts = pd.report.transfer;
    ts.bytes = bytes;
    const double busy_us = union_length(busy);
    ts.gbps = busy_us > 0 ? static_cast<double>(bytes) / 1e9 / (busy_us / 1e6) : 0;
    ts.layer_latency_us = metrics::percentiles(std::move(lat));
    ts.exposed_fraction = transfer_sum > 0 ? exposed_sum / transfer_sum : 0;
    json by_layer = json::array();
    for (auto& [layer, v] : lat_by_layer) {
        const metrics::Percentiles p = metrics::percentiles(v);
        by_layer.push_back({{"layer", layer},
                            {"mean", p.mean},
                            {"p50", p.p50},
                            {"p90", p.p90},
                            {"p99", p.p99},
                            {"count", p.count}});
    }
    pd.report.extra["layer_latency_us_by_layer"] = std::move(by_layer);
    pd.report.extra["transfer_detail"] = {{"busy_s", busy_us / 1e6},
                                          {"transfer_s", transfer_sum / 1e6},
                                          {"exposed_s", exposed_sum / 1e6}};
    (void)map;
}

}  // namespace

void build_phase_report(const ResolvedConfig& cfg, PhaseData& pd,
                        const std::vector<double>& offsets, double t_origin,
                        metrics::Timeline* tl) {
    metrics::Report& rep = pd.report;
    rep.mode = std::string(phase_name(pd.phase));
    rep.topology = cfg.topology_label;
    rep.model = cfg.model.name;
    if (pd.phase == Phase::kDisagg) summarize_transfer(cfg, pd, offsets, t_origin, tl);
    metrics::Slo slo{cfg.options.slo_ttft_ms, cfg.options.slo_tpot_ms};
    metrics::summarize_requests(pd.router.records, slo, &rep);
    rep.wall_s = pd.router.wall_s;
    json ranks = json::array();
    const topo::RankMap map = cfg.topology.rank_map();
    for (size_t r = 0; r < pd.results.size(); ++r) {
        const std::optional<RankResult>& res = pd.results[r];
        const auto& info = map.at(static_cast<int>(r));
        json j = {{"rank", r},
                  {"instance", cfg.topology.instances[static_cast<size_t>(info.instance)].id},
                  {"role", topo::role_name(info.role)},
                  {"tp_rank", info.tp_rank},
                  {"clock_offset_us", offsets[r]}};
        if (!res) {
            j["error"] = "no result from this rank";
            rep.ordering.details.push_back(
                fmt::format("rank {}: no result (its checks are missing)", r));
        } else {
            j["stats"] = res->stats;
            if (!res->error.empty()) j["error"] = res->error;
            rep.ordering.checked_layers += res->ordering.checked_layers;
            for (const std::string& v : res->ordering.violations) {
                ++rep.ordering.violations;
                if (rep.ordering.details.size() < 50) rep.ordering.details.push_back(v);
            }
        }
        ranks.push_back(std::move(j));
    }
    rep.extra["ranks"] = std::move(ranks);
    json lifecycle = json::array();
    std::vector<double> handoff;
    for (size_t i = 0; i < pd.router.records.size(); ++i) {
        const auto& q = pd.router.records[i];
        const auto tpot = q.tpot_ms();
        json pend;
        auto pe = pd.prefill_end_ms.find(i);
        if (pe != pd.prefill_end_ms.end()) {
            pend = pe->second;
            if (q.ok) handoff.push_back(q.first_token_ms - pe->second);
        }
        lifecycle.push_back({{"id", i},
                             {"ok", q.ok},
                             {"arrival_ms", q.arrival_ms},
                             {"prefill_start_ms", q.prefill_start_ms},
                             {"prefill_end_ms", pend},
                             {"ttft_ms", q.ok ? json(q.ttft_ms()) : json()},
                             {"tpot_ms", tpot ? json(*tpot) : json()},
                             {"e2e_ms", q.ok ? json(q.e2e_ms()) : json()},
                             {"transfer_ms", q.transfer_ms},
                             {"exposed_transfer_ms", q.exposed_transfer_ms},
                             {"token_ms", pd.router.token_ms[i]},
                             {"tokens", q.tokens}});
    }
    rep.extra["lifecycle"] = std::move(lifecycle);
    if (pd.phase == Phase::kDisagg) {
        // First token on decode - end of the last prefill forward: the handoff the layerwise
        // transfer is meant to shrink (0 by definition when colocated).
        const metrics::Percentiles h = metrics::percentiles(std::move(handoff));
        rep.extra["handoff_ms"] = {
            {"mean", h.mean}, {"p50", h.p50}, {"p90", h.p90}, {"p99", h.p99}, {"count", h.count}};
        // The KV-level parity check (kv_digest.h): requests whose decode-side KV (and recurrent
        // states) digest was compared with the prefill side's; a mismatch failed its request.
        rep.extra["kv_parity"] = {{"checked", pd.router.kv_digests_checked},
                                  {"mismatched", pd.router.kv_digest_mismatches}};
    }
    if (tl != nullptr)
        add_timeline(cfg, pd, offsets, t_origin, tl != nullptr && cfg.options.mode == Mode::kBoth,
                     tl);
}

// Every request the run submitted, as columns (`pdsim simulate --like` replays exactly these):
// id, arrival_ms (scaled, from the phase start), input_len, output_len, and hash_ids (prefix
// blocks) when the trace has them.
json request_set_json(const std::vector<workload::Request>& requests) {
    json ids = json::array(), arrivals = json::array(), inputs = json::array(),
         outputs = json::array(), hashes = json::array();
    bool any_hash = false;
    for (const workload::Request& q : requests) {
        ids.push_back(q.id);
        arrivals.push_back(q.arrival_ms);
        inputs.push_back(q.input_len);
        outputs.push_back(q.output_len);
        hashes.push_back(q.hash_ids);
        any_hash |= !q.hash_ids.empty();
    }
    json set = {{"id", std::move(ids)},
                {"arrival_ms", std::move(arrivals)},
                {"input_len", std::move(inputs)},
                {"output_len", std::move(outputs)}};
    if (any_hash) set["hash_ids"] = std::move(hashes);
    return set;
}

json testbed_config_json(const ResolvedConfig& cfg) {
    const TestbedOptions& o = cfg.options;
    const model::ModelConfig& m = cfg.model;
    json model = {{"name", m.name}};
    for (const topo::ModelDimension& dim : topo::kModelDimensions) {
        model[std::string(dim.key)] = m.*dim.field;
    }
    json config = {{"command", "pdsim testbed " + describe(o)},
                   {"topology", cfg.topology_label},
                   {"ranks", cfg.topology.num_ranks()},
                   {"model", model},
                   {"workload", cfg.workload_label},
                   {"requests", cfg.requests.size()},
                   {"trace_duration_s", cfg.trace_duration_ms / 1000},
                   {"time_scale", o.time_scale},
                   {"transport", o.transport},
                   {"tcp_interface", o.tcp_interface},
                   {"data_transport", o.data_transport},
                   {"backend", o.backend},
                   {"layerwise", o.layerwise},
                   {"stream_sync", o.stream_caller_runs ? "caller" : "worker"},
                   {"speed_probe_ms", o.speed_probe_ms},
                   {"fault", fault_name(o.fault)},
                   {"chunk_size", o.chunk_size},
                   {"max_batch_tokens", o.max_batch_tokens},
                   {"max_decode_batch", o.max_decode_batch},
                   {"page_size", o.page_size},
                   {"max_input_len", o.max_input_len},
                   {"max_output_len", o.max_output_len},
                   {"seed", o.seed},
                   {"request_timeout_s", o.request_timeout_s},
                   {"max_inflight_per_instance", effective_max_inflight(cfg)},
                   {"kv_pool_mb", o.kv_pool_mb},
                   {"topology_file", cfg.topology_file},
                   {"model_source", cfg.model_source},
                   {"layers", o.layers},
                   {"request_set", request_set_json(cfg.requests)}};
    if (cfg.gpu_ranks()) {
        // The GPU of rank 0 (the process that writes the report; under mpirun it knows only its
        // own, and every rank's `device` is in its `ranks` entry) and how the model is sized.
        json gpu = json::object();
        if (const RankGpu* g = cfg.gpu_of(0)) {
            gpu = {{"name", g->info.name},
                   {"device", g->choice.device},
                   {"chosen_by", g->choice.how},
                   {"memory_mib", g->info.total_bytes >> 20}};
        }
        config["gpu"] = std::move(gpu);
        config["decode_graphs"] = o.decode_graphs;
        config["device_gate"] = o.device_gate;
        config["gpu_model"] = {{"max_tokens", cfg.gpu_model.max_tokens},
                               {"max_bs", cfg.gpu_model.max_bs},
                               {"max_positions", cfg.gpu_model.max_positions},
                               {"sliced_reduction", cfg.gpu_model.sliced_reduction},
                               {"tp_exchange", o.tp_exchange},
                               {"kv_dtype", "bf16"}};
    }
    return config;
}

}  // namespace pdsim::testbed
