#include "sim/testbed/testbed.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/cpu_stream.h"
#include "common/logging.h"
#include "common/mpi_check.h"
#include "common/thread_info.h"
#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/prompt.h"
#include "sim/testbed/protocol.h"
#include "sim/testbed/router.h"
#include "sim/testbed/server.h"
#include "sim/testbed/shaped_transport.h"
#include "topology/gpu_spec.h"
#include "topology/shaping.h"
#include "transfer/local/local_transport.h"
#include "transfer/transport.h"

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;
using std::chrono::milliseconds;

constexpr int kPidColocatedOffset = 100;

struct Launcher {
    int world = 1;
    int rank = 0;
    int local_size = 1;
    int local_rank = 0;
};

int env_int(const char* name, int dflt) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : dflt;
}

Launcher detect_launcher() {
    Launcher l;
    if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
        l.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
        l.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
        l.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", l.world);
        l.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    } else if (std::getenv("PMI_SIZE") != nullptr) {
        l.world = env_int("PMI_SIZE", 1);
        l.rank = env_int("PMI_RANK", 0);
        l.local_size = env_int("MPI_LOCALNRANKS", l.world);
        l.local_rank = env_int("MPI_LOCALRANKID", 0);
    }
    return l;
}

// Whether this process may run on fewer than all of the host's cores (mpirun bound it).
bool bound_to_some_cores(int host_cores) {
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
    return CPU_COUNT(&set) < host_cores;
#else
    (void)host_cores;
    return false;
#endif
}

// What every rank thread of this process shares.
struct Shared {
    const ResolvedConfig* cfg = nullptr;
    bool local = false;                              // ranks are threads
    int local_ranks = 1;                             // ranks on this host
    std::unique_ptr<LocalHub> hub;                   // local
    std::vector<std::unique_ptr<LocalTpGroup>> tp;   // local, per instance
    std::shared_ptr<transfer::LocalWorld> kv_world;  // local
    // KV transport shaping (decided by rank 0 at start; identical on every rank).
    std::mutex shape_mu;
    bool shape = false;
    topo::LinkShaping shaping;
    json shaping_info;
    bool error_printed = false;  // rank 0
};

struct PhaseData {
    Phase phase;
    RouterResult router;
    std::map<uint64_t, double> prefill_end_ms;  // disagg: end of the request's last prefill forward
    std::vector<std::optional<RankResult>> results;  // by rank (nullopt: none came)
    metrics::Report report;
};

StatusOr<std::unique_ptr<transfer::Transport>> make_kv_transport(Shared& sh, Mailbox& mbox,
                                                                 int rank, std::string* tcp_dir) {
    const TestbedOptions& o = sh.cfg->options;
    transfer::TransportOptions to;
    to.rank = rank;
    to.world_size = mbox.size();
    to.local_world = sh.kv_world;
    to.connect_timeout = milliseconds(30'000);
    if (o.transport == "tcp") {
        const bool env = std::getenv("PDSIM_TCP_ENDPOINTS") != nullptr ||
                         std::getenv("PDSIM_TCP_BOOTSTRAP_DIR") != nullptr;
        if (!env) {
            // Rendezvous through a fresh directory (one host; set PDSIM_TCP_BOOTSTRAP_DIR to a
            // shared directory or PDSIM_TCP_ENDPOINTS across hosts) and a per-run session token.
            if (rank == 0) {
                std::string tmpl =
                    (std::filesystem::temp_directory_path() / "pdsim-tcp-XXXXXX").string();
                if (::mkdtemp(tmpl.data()) == nullptr) {
                    return PDSIM_ERROR(StatusCode::kUnavailable,
                                       "tcp: cannot create a bootstrap directory");
                }
                std::random_device rd;
                const std::string token = fmt::format(
                    "{:016x}{:016x}", (uint64_t{rd()} << 32) | rd(), (uint64_t{rd()} << 32) | rd());
                *tcp_dir = tmpl;
                for (int r = 1; r < mbox.size(); ++r) {
                    PDSIM_RETURN_IF_ERROR(
                        mbox.send(r, Channel::kCollect,
                                  encode_message(TcpBootstrapMsg{.dir = tmpl, .token = token})));
                }
                to.tcp.bootstrap_dir = tmpl;
                to.tcp.session_token = token;
            } else {
                PDSIM_ASSIGN_OR_RETURN(auto m,
                                       mbox.recv_kind(Channel::kCollect, TcpBootstrapMsg::kKind,
                                                      std::chrono::seconds(60)));
                if (!m)
                    return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                       "tcp: no bootstrap directory from rank 0");
                PDSIM_ASSIGN_OR_RETURN(TcpBootstrapMsg boot,
                                       decode_message<TcpBootstrapMsg>(m->body));
                to.tcp.bootstrap_dir = std::move(boot.dir);
                to.tcp.session_token = std::move(boot.token);
            }
        }
    }
    std::string name = o.transport;
    if (!o.transport_fault.empty() &&
        (o.transport_fault_rank < 0 || o.transport_fault_rank == rank)) {
        to.fault_inner = name;
        to.fault_spec = o.transport_fault;
        name = "fault";
    }
    auto t = transfer::create_transport(name, to);
    if (!t.ok()) {
        const Status& st = t.status();
        if (st.code() == StatusCode::kUnavailable && name != "tcp") {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--transport {}: {}", o.transport, st.message()));
        }
        return st.with_context(fmt::format("--transport {}", o.transport));
    }
    std::lock_guard<std::mutex> lock(sh.shape_mu);
    if (sh.shape) return make_shaped_transport(std::move(*t), sh.shaping);
    return t;
}

// ---- report assembly (rank 0) ----

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

void build_report(const ResolvedConfig& cfg, PhaseData& pd, const std::vector<double>& offsets,
                  double t_origin, metrics::Timeline* tl) {
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
                             {"prefill_start_ms", pd.router.prefill_start_ms[i]},
                             {"prefill_end_ms", pend},
                             {"ttft_ms", q.ok ? json(q.ttft_ms()) : json()},
                             {"tpot_ms", tpot ? json(*tpot) : json()},
                             {"e2e_ms", q.ok ? json(q.e2e_ms()) : json()},
                             {"transfer_ms", q.transfer_ms},
                             {"exposed_transfer_ms", q.exposed_transfer_ms},
                             {"token_ms", pd.router.token_ms[i]}});
    }
    rep.extra["lifecycle"] = std::move(lifecycle);
    if (pd.phase == Phase::kDisagg) {
        // First token on decode - end of the last prefill forward: the handoff the layerwise
        // transfer is meant to shrink (0 by definition when colocated).
        const metrics::Percentiles h = metrics::percentiles(std::move(handoff));
        rep.extra["handoff_ms"] = {
            {"mean", h.mean}, {"p50", h.p50}, {"p90", h.p90}, {"p99", h.p99}, {"count", h.count}};
    }
    if (tl != nullptr)
        add_timeline(cfg, pd, offsets, t_origin, tl != nullptr && cfg.options.mode == Mode::kBoth,
                     tl);
}

json config_json(const ResolvedConfig& cfg) {
    const TestbedOptions& o = cfg.options;
    const model::ModelConfig& m = cfg.model;
    return {{"command", "pdsim testbed " + describe(o)},
            {"topology", cfg.topology_label},
            {"ranks", cfg.topology.num_ranks()},
            {"model",
             {{"name", m.name},
              {"num_layers", m.num_layers},
              {"hidden", m.hidden},
              {"num_q_heads", m.num_q_heads},
              {"num_kv_heads", m.num_kv_heads},
              {"head_dim", m.head_dim},
              {"intermediate", m.intermediate},
              {"vocab", m.vocab}}},
            {"workload", cfg.workload_label},
            {"requests", cfg.requests.size()},
            {"trace_duration_s", cfg.trace_duration_ms / 1000},
            {"time_scale", o.time_scale},
            {"transport", o.transport},
            {"backend", o.backend},
            {"layerwise", o.layerwise},
            {"fault", fault_name(o.fault)},
            {"chunk_size", o.chunk_size},
            {"max_batch_tokens", o.max_batch_tokens},
            {"max_decode_batch", o.max_decode_batch},
            {"page_size", o.page_size},
            {"max_input_len", o.max_input_len},
            {"max_output_len", o.max_output_len},
            {"seed", o.seed},
            {"request_timeout_s", o.request_timeout_s}};
}

// Seconds of one prefill layer of `tokens` tokens on this CPU (best of two forwards).
StatusOr<double> measure_cpu_layer_s(const ResolvedConfig& cfg, model::SyntheticModel& model,
                                     int threads, int tokens) {
    const model::ModelConfig& m = cfg.model;
    const int tp = model.tp_size();
    runtime::CpuStream stream("measure");
    attn::AttentionConfig ac;
    ac.num_q_heads = m.num_q_heads / tp;
    ac.num_kv_heads = m.num_kv_heads / tp;
    ac.head_dim = m.head_dim;
    ac.stream = &stream;
    ac.num_threads = threads;
    PDSIM_ASSIGN_OR_RETURN(auto backend, attn::create_attention_backend(cfg.options.backend, ac));
    const int ps = cfg.options.page_size;
    kv::MHAPoolConfig pc;
    pc.num_layers = m.num_layers;
    pc.page_size = ps;
    pc.num_kv_heads = ac.num_kv_heads;
    pc.head_dim = m.head_dim;
    pc.num_pages = (tokens + ps - 1) / ps + 1;
    PDSIM_ASSIGN_OR_RETURN(auto pool, kv::MHATokenToKVPool::create(pc));
    model::StepBatch b;
    b.tokens = make_prompt(0, tokens, {}, m.vocab, 7);
    for (int t = 0; t < tokens; ++t) b.out_cache_loc.push_back(ps + t);  // pages 1.. in order
    b.seq_lens = {tokens};
    b.extend_lens = {tokens};
    b.page_table_stride = pc.num_pages - 1;
    for (int p = 1; p < pc.num_pages; ++p) b.page_table.push_back(p);
    std::vector<int32_t> next(1);
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
        const double t0 = now_us();
        PDSIM_RETURN_IF_ERROR(model.forward(b, *backend, *pool, next.data()));
        PDSIM_RETURN_IF_ERROR(stream.synchronize());
        best = std::min(best, (now_us() - t0) / 1e6);
    }
    return best / m.num_layers;
}

// The same layer on `gpu` by the roofline (bf16 weights and KV).
double gpu_layer_s(const model::ModelConfig& m, const topo::GpuSpec& gpu, int tokens) {
    const double H = m.hidden, D = m.head_dim, HQ = m.num_q_heads, HKV = m.num_kv_heads,
                 I = m.intermediate;
    const double T = tokens;
    const double params = H * (HQ + 2 * HKV) * D + HQ * D * H + 3 * H * I;
    const double flops = 2 * T * params + 4 * HQ * D * T * (T + 1) / 2;
    const double bytes = 2 * params + 2 * T * 2 * HKV * D + 2 * 2 * T * H;
    return topo::roofline_time_s(gpu, flops, bytes);
}

// Rank 0 decides the KV link shaping (measuring time_scale when the topology says auto) and tells
// every rank.
Status decide_shaping(Shared& sh, RankContext& ctx) {
    const ResolvedConfig& cfg = *sh.cfg;
    if (!cfg.shape) return {};
    double ts = cfg.shape_time_scale;
    json info;
    if (ctx.rank == 0) {
        if (ts <= 0) {
            const int tokens = std::min(512, cfg.options.max_batch_tokens);
            PDSIM_ASSIGN_OR_RETURN(double cpu_s,
                                   measure_cpu_layer_s(cfg, *ctx.model, ctx.threads, tokens));
            const double gpu_s = gpu_layer_s(cfg.model, *topo::gpu_spec(cfg.shape_gpu), tokens);
            PDSIM_ASSIGN_OR_RETURN(ts, topo::time_scale_from(cpu_s, gpu_s));
            info = {{"measured_cpu_layer_ms", cpu_s * 1e3},
                    {"gpu_layer_ms", gpu_s * 1e3},
                    {"tokens", tokens},
                    {"gpu", cfg.shape_gpu}};
        }
        for (int r = 1; r < ctx.world; ++r) {
            PDSIM_RETURN_IF_ERROR(
                ctx.mbox->send(r, Channel::kCollect, encode_message(ShapeMsg{.time_scale = ts})));
        }
    } else {
        PDSIM_ASSIGN_OR_RETURN(auto m, ctx.mbox->recv_kind(Channel::kCollect, ShapeMsg::kKind,
                                                           std::chrono::seconds(300)));
        if (!m)
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded, "no shaping decision from rank 0");
        PDSIM_ASSIGN_OR_RETURN(ShapeMsg shape, decode_message<ShapeMsg>(m->body));
        ts = shape.time_scale;
    }
    std::lock_guard<std::mutex> lock(sh.shape_mu);
    sh.shape = true;
    sh.shaping = topo::shaping_for(cfg.shape_gbps, cfg.shape_latency_us, ts);
    if (ctx.rank == 0) {
        info["time_scale"] = ts;
        info["link_gbps"] = cfg.shape_gbps;
        info["link_latency_us"] = cfg.shape_latency_us;
        info["shaped_bytes_per_s"] = sh.shaping.bytes_per_s;
        info["shaped_latency_us"] = sh.shaping.latency_us;
        info["source"] = cfg.options.shaping;
        sh.shaping_info = info;
    }
    return {};
}

// ---- one rank ----

Status run_phases(Shared& sh, RankContext& ctx, const std::vector<double>& offsets,
                  std::vector<PhaseData>* phases) {
    const ResolvedConfig& cfg = *sh.cfg;
    const TestbedOptions& o = cfg.options;
    Mailbox& mbox = *ctx.mbox;
    std::vector<Phase> order;
    if (o.mode != Mode::kDisagg) order.push_back(Phase::kColocated);
    if (o.mode != Mode::kColocated) order.push_back(Phase::kDisagg);
    const auto collect_timeout =
        milliseconds(static_cast<int64_t>(o.request_timeout_s * 1000) + 60'000);
    for (Phase phase : order) {
        std::unique_ptr<transfer::Transport> kv;
        std::string tcp_dir;
        if (phase == Phase::kDisagg) {
            PDSIM_ASSIGN_OR_RETURN(kv, make_kv_transport(sh, mbox, ctx.rank, &tcp_dir));
        }
        PDSIM_RETURN_IF_ERROR(
            barrier(mbox, fmt::format("start-{}", phase_name(phase)), std::chrono::seconds(120)));
        PhaseData pd;
        pd.phase = phase;
        Status router_st;
        std::thread router;
        if (ctx.rank == 0) {
            router = std::thread([&] {
                set_thread_name("pdsim-router");
                RouterConfig rc;
                rc.phase = phase;
                rc.config = &cfg;
                rc.mbox = &mbox;
                rc.offsets = offsets;
                rc.progress = o.progress;
                rc.label = std::string(phase_name(phase));
                router_st = run_router(rc, &pd.router);
                if (!router_st.ok()) {
                    // Never leave the instances waiting for an end.
                    for (size_t i = 0; i < cfg.topology.instances.size(); ++i) {
                        mbox.send(cfg.topology.rank_map().first_rank(static_cast<int>(i)),
                                  Channel::kInstance, encode_message(EndMsg{}))
                            .ignore_error();
                    }
                }
            });
        }
        RankResult result;
        Status st = run_server(ctx, phase, kv.get(), &result);
        if (!st.ok())
            PDSIM_LOG_ERROR("rank {}: {} phase: {}", ctx.rank, phase_name(phase), st.to_string());
        if (ctx.rank != 0) {
            PDSIM_RETURN_IF_ERROR(mbox.send(0, Channel::kCollect, encode_message(result)));
        } else {
            router.join();
            PDSIM_RETURN_IF_ERROR(router_st.with_context("router"));
            pd.results.assign(static_cast<size_t>(ctx.world), std::nullopt);
            pd.results[0] = std::move(result);
            const auto deadline = std::chrono::steady_clock::now() + collect_timeout;
            for (int got = 1; got < ctx.world;) {
                const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
                    deadline - std::chrono::steady_clock::now());
                if (left.count() <= 0) break;
                PDSIM_ASSIGN_OR_RETURN(auto m,
                                       mbox.recv_kind(Channel::kCollect, RankResult::kKind, left));
                if (!m) break;
                PDSIM_ASSIGN_OR_RETURN(RankResult res, decode_message<RankResult>(m->body));
                if (res.phase != phase_name(phase)) continue;
                pd.results[static_cast<size_t>(m->src)] = std::move(res);
                ++got;
            }
        }
        PDSIM_RETURN_IF_ERROR(
            barrier(mbox, fmt::format("end-{}", phase_name(phase)), collect_timeout));
        if (kv) kv->close();
        kv.reset();
        if (!tcp_dir.empty()) {
            std::error_code ec;
            std::filesystem::remove_all(tcp_dir, ec);
        }
        if (ctx.rank == 0) phases->push_back(std::move(pd));
    }
    return {};
}

// Rank 0: builds the reports, writes the files, prints; returns the run's outcome.
Status finish(const ResolvedConfig& cfg, std::vector<PhaseData>& phases,
              const std::vector<double>& offsets, double t_origin, const json& shaping_info) {
    const TestbedOptions& o = cfg.options;
    metrics::Timeline tl;
    metrics::Timeline* tlp = o.timeline_path.empty() ? nullptr : &tl;
    for (auto& pd : phases) build_report(cfg, pd, offsets, t_origin, tlp);
    metrics::Report report;
    PhaseData* dis = nullptr;
    PhaseData* col = nullptr;
    for (auto& pd : phases) (pd.phase == Phase::kDisagg ? dis : col) = &pd;
    std::vector<metrics::RequestRecord> csv;
    if (dis != nullptr) {
        report = dis->report;
        csv = dis->router.records;
        if (col != nullptr) {
            report.colocated = std::make_shared<metrics::Report>(col->report);
            bool match = true;
            int mismatches = 0;
            for (size_t i = 0; i < dis->router.records.size(); ++i) {
                const auto& a = dis->router.records[i];
                const auto& b = col->router.records[i];
                if (!a.ok || !b.ok || a.tokens != b.tokens) {
                    match = false;
                    if (++mismatches <= 5) {
                        report.failures.push_back(
                            fmt::format("request {}: outputs differ (disagg {} tokens{}, colocated "
                                        "{} tokens{})",
                                        i, a.tokens.size(), a.ok ? "" : " failed", b.tokens.size(),
                                        b.ok ? "" : " failed"));
                    }
                }
            }
            report.outputs_match = match;
            report.extra["outputs_mismatched_requests"] = mismatches;
        }
    } else {
        report = col->report;
        csv = col->router.records;
    }
    report.extra["config"] = config_json(cfg);
    if (!shaping_info.is_null()) report.extra["config"]["shaping"] = shaping_info;
    if (o.mode == Mode::kBoth) report.mode = "disagg";
    if (!o.report_path.empty()) PDSIM_RETURN_IF_ERROR(metrics::write_report(o.report_path, report));
    if (!o.requests_path.empty())
        PDSIM_RETURN_IF_ERROR(metrics::write_requests_csv(o.requests_path, csv));
    if (tlp != nullptr) PDSIM_RETURN_IF_ERROR(tl.write(o.timeline_path));
    if (!o.quiet) {
        std::string s =
            fmt::format("pdsim testbed: {} ranks, {} requests of {} (time scale {:.4g}), {}\n",
                        cfg.topology.num_ranks(), cfg.requests.size(), cfg.workload_label,
                        o.time_scale, describe(o));
        s += metrics::summary_table(report);
        if (dis != nullptr) {
            s += fmt::format(
                "  transfer: {:.2f} MB, layer latency us p50/p90/p99 {:.0f}/{:.0f}/{:.0f}\n",
                static_cast<double>(report.transfer.bytes) / 1e6,
                report.transfer.layer_latency_us.p50, report.transfer.layer_latency_us.p90,
                report.transfer.layer_latency_us.p99);
            if (report.extra.contains("handoff_ms")) {
                const json& h = report.extra["handoff_ms"];
                s += fmt::format(
                    "  handoff (prefill end -> first token on decode) ms p50/p90/p99 "
                    "{:.1f}/{:.1f}/{:.1f}\n",
                    h.value("p50", 0.0), h.value("p90", 0.0), h.value("p99", 0.0));
            }
        }
        for (const auto& [path, what] :
             {std::pair{o.report_path, "report"}, std::pair{o.timeline_path, "timeline"},
              std::pair{o.requests_path, "requests"}}) {
            if (!path.empty()) s += fmt::format("  wrote {} {}\n", what, path);
        }
        std::fputs(s.c_str(), stdout);
        std::fflush(stdout);
    }
    // Outcome.
    int64_t failed = 0, violations = 0;
    for (auto& pd : phases) {
        failed += pd.report.requests_failed;
        violations += pd.report.ordering.violations;
    }
    std::vector<std::string> why;
    if (violations > 0) why.push_back(fmt::format("{} ordering violations", violations));
    if (failed > 0) why.push_back(fmt::format("{} failed requests", failed));
    if (report.outputs_match && !*report.outputs_match)
        why.push_back("disaggregated outputs differ from colocated");
    if (why.empty()) return {};
    std::string msg;
    for (const auto& w : why) msg += (msg.empty() ? "" : ", ") + w;
    return Status(
        StatusCode::kDataLoss,
        "testbed: " + msg + (o.report_path.empty() ? "" : " (see " + o.report_path + ")"));
}

int exit_code_of(const Status& st) {
    if (st.ok()) return 0;
    return st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kNotFound ? 2 : 1;
}

constexpr std::string_view kOutcomePrefix = "outcome from rank 0: ";

Status status_for_code(int code, const std::string& msg) {
    if (code == 0) return {};
    return Status(code == 2 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss,
                  std::string(kOutcomePrefix) + msg);
}

Status run_rank_impl(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp);

Status run_rank(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp) {
    try {
        return run_rank_impl(sh, rank, std::move(mbox), tp);
    } catch (const std::exception& e) {
        // Rank 0 prints the run's outcome; another rank's own failure would otherwise go unseen.
        if (rank != 0) PDSIM_LOG_ERROR("rank {}: {}", rank, e.what());
        return PDSIM_ERROR(StatusCode::kInternal, "rank {}: {}", rank, e.what());
    }
}

Status run_rank_impl(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp) {
    const ResolvedConfig& cfg = *sh.cfg;
    const TestbedOptions& o = cfg.options;
    const topo::RankMap map = cfg.topology.rank_map();
    RankContext ctx;
    ctx.rank = rank;
    ctx.world = mbox->size();
    ctx.config = &cfg;
    ctx.info = map.at(rank);
    const auto& inst = cfg.topology.instances[static_cast<size_t>(ctx.info.instance)];
    for (int i = 0; i < inst.tp; ++i)
        ctx.instance_ranks.push_back(map.first_rank(ctx.info.instance) + i);
    ctx.mbox = mbox.get();
    ctx.tp = inst.tp > 1 ? tp : nullptr;
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ctx.threads = o.threads > 0 ? o.threads : std::max(1, hw / std::max(1, sh.local_ranks));
    const int max_tokens = std::max(o.max_batch_tokens, o.max_decode_batch);
    std::unique_ptr<model::SyntheticModel> model;
    std::vector<double> offsets(static_cast<size_t>(ctx.world), 0.0);
    const double t_origin = now_us();
    std::vector<PhaseData> phases;
    Status st = [&]() -> Status {
        PDSIM_ASSIGN_OR_RETURN(model, model::SyntheticModel::create(cfg.model, ctx.tp, max_tokens));
        ctx.model = model.get();
        PDSIM_RETURN_IF_ERROR(decide_shaping(sh, ctx));
        if (!sh.local) {
            PDSIM_ASSIGN_OR_RETURN(std::vector<double> off,
                                   estimate_offsets(*mbox, 8, milliseconds(60'000)));
            if (rank == 0) offsets = off;
        }
        return run_phases(sh, ctx, offsets, &phases);
    }();
    if (!st.ok() && rank != 0) PDSIM_LOG_ERROR("rank {}: {}", rank, st.to_string());
    // Rank 0 decides; everyone returns the same outcome.
    if (rank == 0) {
        if (st.ok()) st = finish(cfg, phases, offsets, t_origin, sh.shaping_info);
        const int code = exit_code_of(st);
        if (!st.ok()) {
            // Print before releasing the other ranks: once one exits non-zero, mpirun kills us.
            std::fprintf(stderr, "pdsim: error: %s\n", st.to_string().c_str());
            std::fflush(stderr);
            sh.error_printed = true;
        }
        for (int r = 1; r < ctx.world; ++r) {
            mbox->send(r, Channel::kCollect,
                       encode_message(ExitMsg{.code = code, .message = st.message()}))
                .ignore_error();
        }
        if (auto* m = dynamic_cast<MpiMailbox*>(mbox.get())) m->drain(milliseconds(5000));
        return st;
    }
    const auto wait = milliseconds(static_cast<int64_t>(o.request_timeout_s * 1000) * 2 + 120'000);
    auto m = mbox->recv_kind(Channel::kCollect, ExitMsg::kKind, wait);
    if (!m.ok()) return m.status();
    if (!m->has_value())
        return st.ok() ? Status(StatusCode::kDeadlineExceeded, "no outcome from rank 0") : st;
    PDSIM_ASSIGN_OR_RETURN(ExitMsg exit_msg, decode_message<ExitMsg>((*m)->body));
    return status_for_code(exit_msg.code, exit_msg.message);
}

// How long a TP collective may wait for its peers: the request timeout, plus slack.
milliseconds tp_timeout(const ResolvedConfig& cfg) {
    return milliseconds(static_cast<int64_t>(cfg.options.request_timeout_s * 1000) + 5000);
}

// One process per rank (launcher.world > 1). Every rank resolved the same options on its own;
// before any rank may exit they agree (one MPI_Allreduce) on whether all of them could read
// their input and whether mpirun's world fits the topology. When not, rank 0 prints the error,
// then all meet at a barrier and return it: once one rank exits non-zero mpirun kills the
// others, and a rank 0 still printing would lose its message.
Status run_mpi_ranks(const Launcher& launcher, StatusOr<ResolvedConfig> resolved, RunInfo* info) {
    const int local_ranks = std::max(1, launcher.local_size);
    if (resolved.ok()) {
        const ResolvedConfig& cfg = *resolved;
        // More ranks than cores on this host, free to run anywhere: the kernel places them
        // differently from run to run, and a TP rank that loses its core stalls its peers.
        const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        if (launcher.local_rank == 0 && local_ranks > hw && !bound_to_some_cores(hw)) {
            PDSIM_LOG_WARN(
                "{} ranks on this host's {} cores and they are not bound: timings will vary from "
                "run to run; add `--map-by core --bind-to core:overload-allowed` to mpirun "
                "(docs/testbed.md, 'More ranks than cores')",
                local_ranks, hw);
        }
        if (std::getenv("PDSIM_NUM_THREADS") == nullptr) {
            const int per =
                cfg.options.threads > 0 ? cfg.options.threads : std::max(1, hw / local_ranks);
            ::setenv("PDSIM_NUM_THREADS", std::to_string(per).c_str(), 1);
        }
    }
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    int provided = 0;
    if (!initialized)
        MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    else
        MPI_CHECK(MPI_Query_thread(&provided));
    int world = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    info->rank = rank;

    Status st = resolved.status();
    if (st.ok() && provided < MPI_THREAD_MULTIPLE) {
        st = Status(StatusCode::kUnavailable,
                    "MPI does not provide MPI_THREAD_MULTIPLE (the testbed's TP "
                    "allgather runs on the compute stream's thread)");
    } else if (st.ok() && world != resolved->topology.num_ranks()) {
        st = Status(StatusCode::kInvalidArgument,
                    fmt::format("mpirun -np {} but topology {} has {} ranks", world,
                                resolved->topology_label, resolved->topology.num_ranks()));
    }
    // The agreement: the lowest rank whose set-up failed (world if none).
    const int mine = st.ok() ? world : rank;
    int first_failed = world;
    MPI_Allreduce(&mine, &first_failed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first_failed < world) {
        // Rank 0's message stands for all when it failed too (the same options, read the same
        // way); else the ranks that failed print theirs.
        if (!st.ok() && rank != 0 && first_failed != 0)
            PDSIM_LOG_ERROR("rank {}: {}", rank, st.to_string());
        if (st.ok()) {
            // This rank read its input but another could not (a file missing on its host...).
            st =
                Status(StatusCode::kInvalidArgument,
                       fmt::format("rank {} could not set up (it logged its error)", first_failed));
        }
        if (rank == 0) {
            std::fprintf(stderr, "pdsim: error: %s\n", st.to_string().c_str());
            std::fflush(stderr);
            info->error_printed = true;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Finalize();
        return st;
    }

    ResolvedConfig& cfg = *resolved;
    Shared sh;
    sh.cfg = &cfg;
    sh.local = false;
    sh.local_ranks = local_ranks;
    {
        auto mbox = MpiMailbox::create();
        const topo::RankInfo ri = cfg.topology.rank_map().at(rank);
        auto tp = MpiTpComm::create(ri.instance, ri.tp_rank, tp_timeout(cfg));
        if (!mbox.ok()) {
            st = mbox.status();
        } else if (!tp.ok()) {
            st = tp.status();
        } else {
            st = run_rank(sh, rank, std::move(*mbox), tp->get());
        }
    }
    MPI_Finalize();
    info->error_printed = sh.error_printed;
    return st;
}

}  // namespace

Status run_testbed(const TestbedOptions& options, RunInfo* info) {
    const Launcher launcher = detect_launcher();
    info->rank = launcher.rank;
    if (launcher.rank != 0) spdlog::set_level(spdlog::level::warn);
    StatusOr<ResolvedConfig> resolved = resolve(options, launcher.world);
    if (launcher.world > 1) return run_mpi_ranks(launcher, std::move(resolved), info);

    // Every rank a thread of this process.
    PDSIM_RETURN_IF_ERROR(resolved.status());
    ResolvedConfig& cfg = *resolved;
    Shared sh;
    sh.cfg = &cfg;
    const int ranks = cfg.topology.num_ranks();
    sh.local = true;
    const topo::RankMap map = cfg.topology.rank_map();
    sh.local_ranks = ranks;
    sh.hub = std::make_unique<LocalHub>(ranks);
    for (const auto& inst : cfg.topology.instances) {
        sh.tp.push_back(std::make_unique<LocalTpGroup>(inst.tp, tp_timeout(cfg)));
    }
    sh.kv_world = transfer::make_local_world(ranks);
    std::vector<Status> st(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = ranks - 1; r >= 0; --r) {
        auto body = [&, r] {
            const auto& ri = map.at(r);
            st[static_cast<size_t>(r)] =
                run_rank(sh, r, sh.hub->mailbox(r),
                         sh.tp[static_cast<size_t>(ri.instance)]->member(ri.tp_rank));
        };
        if (r == 0) {
            body();
        } else {
            threads.emplace_back(body);
        }
    }
    for (auto& t : threads) t.join();
    info->error_printed = sh.error_printed;
    return st[0];
}

}  // namespace pdsim::testbed
