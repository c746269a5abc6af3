#include "sim/des/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <deque>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/check.h"
#include "sim/des/event_loop.h"
#include "sim/des/flow_network.h"
#include "sim/des/kv_cache.h"
#include "sim/policy/routing.h"
#include "topology/gpu_spec.h"

namespace pdsim::des {

std::string_view sim_mode_name(SimMode mode) {
    return mode == SimMode::kColocated ? "colocated" : "disagg";
}

namespace {

Status bad(std::string msg) {
    return Status(StatusCode::kInvalidArgument, std::move(msg));
}

const topo::Device* instance_device(const topo::Topology& t, int instance) {
    const topo::Instance& inst = t.instances[static_cast<size_t>(instance)];
    return inst.devices.empty() ? nullptr : t.find_device(inst.devices.front());
}

}  // namespace

StatusOr<cost::InstanceSpec> instance_spec(const topo::Topology& topology,
                                           const model::ModelConfig& model, int instance) {
    if (instance < 0 || static_cast<size_t>(instance) >= topology.instances.size()) {
        return bad(fmt::format("{}: no instance {}", topology.source.name, instance));
    }
    const topo::Instance& inst = topology.instances[static_cast<size_t>(instance)];
    const topo::Device* dev = instance_device(topology, instance);
    if (dev == nullptr) {
        return bad(fmt::format("{}: instance {}: unknown device", topology.source.name, inst.id));
    }
    cost::InstanceSpec spec;
    spec.model = model;
    spec.tp = inst.tp;
    if (dev->is_cpu()) {
        spec.device = "cpu";
        spec.kv_dtype_bytes = 4;  // the CPU testbed's pools are fp32
    } else {
        const topo::GpuSpec* gpu = dev->gpu();
        if (gpu == nullptr) {
            return bad(fmt::format("{}: instance {}: device {} has unknown type {}",
                                   topology.source.name, inst.id, dev->id, dev->type));
        }
        spec.device = std::string(gpu->name);
        spec.kv_dtype_bytes = 2;
    }
    if (inst.tp > 1) {
        double gbps = std::numeric_limits<double>::infinity(), lat = 0;
        for (size_t i = 1; i < inst.devices.size(); ++i) {
            const topo::PathInfo p = topology.path_info(inst.devices[0], inst.devices[i]);
            if (!p.found) {
                return bad(fmt::format("{}: instance {}: no path between its devices {} and {}",
                                       topology.source.name, inst.id, inst.devices[0],
                                       inst.devices[i]));
            }
            gbps = std::min(gbps, p.bottleneck_gbps);
            lat = std::max(lat, p.latency_us);
        }
        spec.tp_link_gbps = gbps;
        spec.tp_link_latency_us = lat;
    }
    return spec;
}

StatusOr<int64_t> kv_capacity_pages(const topo::Topology& topology, const model::ModelConfig& model,
                                    int instance, const KvCapacityOptions& o) {
    PDSIM_ASSIGN_OR_RETURN(cost::InstanceSpec spec, instance_spec(topology, model, instance));
    const topo::Instance& inst = topology.instances[static_cast<size_t>(instance)];
    if (o.page_size < 1) return bad(fmt::format("page size {}: must be >= 1", o.page_size));
    const double page_bytes = static_cast<double>(o.page_size) *
                              static_cast<double>(model.kv_elems_per_token_per_layer(inst.tp)) *
                              model.num_layers * spec.kv_dtype_bytes;
    if (spec.device == "cpu") {
        return static_cast<int64_t>(
            std::floor(static_cast<double>(o.kv_pool_mb << 20) / page_bytes));
    }
    const topo::GpuSpec* gpu = topo::gpu_spec(spec.device);
    const double hbm = gpu->hbm_gib * double(1 << 30) * o.mem_fraction;
    const double weights = static_cast<double>(model.num_params()) * 2.0 / inst.tp;
    const double pages = std::floor((hbm - weights) / page_bytes);
    if (pages < 1) {
        return bad(
            fmt::format("{}: instance {}: {} weights ({:.1f} GiB per rank at tp {}) leave no "
                        "KV memory in {} x {} GiB x mem fraction {}",
                        topology.source.name, inst.id, model.name, weights / double(1 << 30),
                        inst.tp, gpu->name, gpu->hbm_gib, o.mem_fraction));
    }
    return static_cast<int64_t>(pages);
}

StatusOr<std::vector<InstanceSetup>> make_instance_setups(const topo::Topology& topology,
                                                          const model::ModelConfig& model,
                                                          const std::string& cost_kind,
                                                          const cost::CostFile* file,
                                                          const KvCapacityOptions& kv,
                                                          const cost::RooflineOptions& roofline) {
    std::vector<InstanceSetup> out;
    for (int i = 0; i < static_cast<int>(topology.instances.size()); ++i) {
        const std::string& id = topology.instances[static_cast<size_t>(i)].id;
        PDSIM_ASSIGN_OR_RETURN(cost::InstanceSpec spec, instance_spec(topology, model, i));
        StatusOr<std::unique_ptr<cost::CostModel>> cm =
            cost::make_cost_model(cost_kind, spec, file, roofline);
        if (!cm.ok()) return cm.status().with_context(fmt::format("instance {}", id));
        InstanceSetup s;
        s.cost = std::shared_ptr<const cost::CostModel>(std::move(*cm));
        PDSIM_ASSIGN_OR_RETURN(s.kv_pages, kv_capacity_pages(topology, model, i, kv));
        s.kv_dtype_bytes = spec.kv_dtype_bytes;
        if (spec.device == "cpu") {
            // The fit's thread count for this tp (calibrated fits are per (tp, threads)).
            int threads = 0;
            if (file != nullptr && file->json().contains("fits")) {
                for (const auto& f : file->json().at("fits")) {
                    if (f.value("tp", 0) != spec.tp) continue;
                    const int th = f.value("threads", 1);
                    threads = threads == 0 || threads == th ? th : -1;
                }
            }
            s.cpu_cores = spec.tp * std::max(1, threads);
        }
        out.push_back(std::move(s));
    }
    return out;
}

namespace {

using metrics::RequestRecord;
using LinkId = FlowNetwork::LinkId;
using FlowId = FlowNetwork::FlowId;

constexpr int64_t kBlock = workload::kHashBlockTokens;
constexpr int kProgressEvery = 8192;  // events between wall-clock checks

enum class Role : uint8_t { kPrefill, kDecode, kColocated };

// One flow path between a prefill and a decode instance: a pair of TP ranks, or (bundled) all of
// them as one flow over their links with capacities normalised by each link's share.
struct Lane {
    std::vector<LinkId> path;
    double share = 1;  // of the chunk's base KV bytes this lane carries
    double latency_s = 0;
};

struct Route {
    std::vector<Lane> lanes;
    double total_share = 1;  // bytes moved per base byte (1 for MHA; tp_decode for MLA)
    double latency_s = 0;    // the slowest lane's
};

struct Req {
    uint32_t index = 0;  // position in the requests span and in records_
    int32_t in = 0, out = 0, generated = 0;
    policy::Assignment asg;
    int64_t target = 0;      // KV tokens the current extend work must reach
    int64_t prefilled = 0;   // KV tokens present on the computing instance
    int64_t pinned = 0;      // prefix blocks pinned on asg.prefill
    int64_t own_pages = 0;   // pages on asg.prefill (the colocated instance's: all of them)
    int64_t hit_unsent = 0;  // prefix-hit tokens whose KV has not been sent yet (disaggregated)
    int64_t dec_pages = 0;   // pages on asg.decode (disaggregated)
    int32_t flows = 0;       // outstanding flows
    double pending_bytes = 0;
    double bytes = 0;
    double t_flow0 = -1, t_last_start = -1, t_fwd_end = -1, t_first = -1;
    bool d_admitted = false, chunks_done = false, kv_done = false, prefill_released = false;
    bool recompute = false;
};

struct Inst {
    struct Entry {
        uint32_t slot;
        int64_t n;
        bool flow;         // its flows started with the forward (layerwise, capped)
        double hit_bytes;  // a prefix hit's KV to send when the forward ends (0: none / sent)
    };
    int index = 0;
    Role role = Role::kPrefill;
    const cost::CostModel* cost = nullptr;
    KvCache kv;
    std::deque<uint32_t> waiting;   // admission queue (FCFS; preempted requests at the front)
    std::deque<uint32_t> extend_q;  // admitted, KV still to compute (FCFS)
    std::vector<uint32_t> running;  // decoding, in the order they joined
    std::vector<uint32_t> ready;    // KV complete while a forward ran: first token at its end
    bool busy = false, last_was_extend = false;
    bool kick_pending = false;                      // a start_next is scheduled for now
    bool extend = false;                            // the forward in flight
    std::vector<Entry> entries;                     // extend in flight
    size_t decode_n = 0;                            // decode in flight: running[0, decode_n)
    std::vector<std::pair<FlowId, double>> capped;  // layerwise flows of the forward, and bytes
    double t_start = 0;
    // CPU core contention (cpu_node >= 0): the forward in flight has `work` core-seconds left at
    // t_rate and progresses at `rate` cores (at most `cores`, its isolated rate).
    int cpu_node = -1;
    double cores = 0, work = 0, rate = 0, t_rate = 0, iso_s = 0;
    double interference[2] = {0, 0};  // extend, decode: the cost model's (cost::CostModel)
    // Forward-time variation (SimConfig::cost_noise): per kind (extend, decode), the spec, the
    // current slow factor and when it is redrawn.
    cost::CostNoise noise[2];
    double slow[2] = {1, 1}, slow_until[2] = {-1, -1};
    std::mt19937_64 rng;
    EventLoop::EventId end_ev = 0;
    bool slowed = false;
    int64_t tl_tokens = 0;  // timeline: the forward's tokens, written when it ends
    size_t tl_n = 0;
    Inst(int i, Role r, const cost::CostModel* c, KvCache k)
        : index(i), role(r), cost(c), kv(std::move(k)) {}
};

class Simulation {
public:
    Simulation(const SimConfig& c, std::span<const workload::Request> reqs)
        : cfg_(c), requests_(reqs), net_(loop_) {}

    Status setup();
    void run();
    SimResult result();

private:
    // ---- requests ----
    uint32_t new_slot() {
        if (!free_slots_.empty()) {
            const uint32_t s = free_slots_.back();
            free_slots_.pop_back();
            reqs_[s] = Req{};
            return s;
        }
        reqs_.emplace_back();
        return static_cast<uint32_t>(reqs_.size() - 1);
    }
    std::span<const int64_t> hashes(const Req& r) const { return requests_[r.index].hash_ids; }
    int64_t full_blocks(const Req& r) const { return r.in / kBlock; }
    Inst& inst(int i) { return insts_[static_cast<size_t>(i)]; }

    void on_arrivals();
    void arrive(uint32_t index, std::vector<int>* touched);
    void fail(uint32_t index, const policy::Assignment& asg, std::string why);
    void finish(uint32_t slot);
    void terminal(RequestRecord& rec);

    // ---- instances ----
    // Lets an idle instance start its next forward once everything else due at this instant has
    // run (the testbed's scheduler drains its messages and engine events before it batches), so
    // requests that become ready at the same time share a forward.
    void kick(Inst& x) {
        if (x.busy || x.kick_pending) return;
        x.kick_pending = true;
        loop_.schedule(0, [this, i = x.index] {
            Inst& y = inst(i);
            y.kick_pending = false;
            if (!y.busy) start_next(y);
        });
    }
    // dur x the instance's slow and fast factors (cost::CostNoise) for a forward starting now.
    double with_noise(Inst& x, bool decode, double dur);
    void start_next(Inst& x);
    void admit(Inst& x);
    void start_extend(Inst& x);
    bool start_decode(Inst& x);
    void on_forward_end(int i);
    void end_extend(Inst& x);
    void end_decode(Inst& x);
    void preempt(Inst& x);
    void deliver(uint32_t slot);
    // Schedules the end of x's forward of isolated duration `dur` (under contention: adds it to
    // its node's running forwards and re-shares the cores).
    void schedule_forward_end(Inst& x, double dur);
    // Brings the node's forwards' work up to now, shares the cores equally among their compute
    // threads (at most one core each) and moves the end (and the layerwise caps) of those whose
    // rate changed; `fresh` was just added and has no end event yet.
    void reshare(int node, Inst* fresh);
    void set_caps(Inst& x);

    // ---- transfer ----
    Status build_routes();
    Status setup_cpu_nodes();
    const Route& route(const Req& r) const {
        return routes_[static_cast<size_t>(r.asg.prefill) * insts_.size() +
                       static_cast<size_t>(r.asg.decode)];
    }
    double chunk_bytes(const Req& r, int64_t tokens) const {
        return static_cast<double>(tokens) * bytes_per_token_[static_cast<size_t>(r.asg.prefill)] *
               route(r).total_share;
    }
    // One flow per lane carrying `bytes` for `members` (requests of one prefill -> decode pair);
    // rate capped at bytes / duration when duration > 0 (the caps are listed in capped_on).
    void start_flows(std::span<const uint32_t> members, double bytes, double duration,
                     Inst* capped_on);
    // Groups (slot, bytes) by decode instance: one start_flows per group.
    void start_batch_flows(std::vector<std::pair<uint32_t, double>>& items, double duration,
                           Inst* capped_on);
    void on_flow_done(uint32_t group);
    void maybe_kv_complete(uint32_t slot);

    void timeline_forward(const Inst& x, double start, double dur, size_t n, int64_t tokens);
    int pid(int i) const { return cfg_.timeline_pid_base + i; }

    const SimConfig& cfg_;
    std::span<const workload::Request> requests_;
    EventLoop loop_;
    FlowNetwork net_;
    bool colocated_ = false;
    bool noisy_ = false;  // some instance draws forward-time variation
    std::vector<Inst> insts_;
    std::unique_ptr<policy::LoadBalancer> lb_;
    std::vector<Route> routes_;            // [prefill * n + decode]
    std::vector<double> bytes_per_token_;  // per instance (as the prefill side): base KV bytes
    std::vector<Req> reqs_;
    std::vector<uint32_t> free_slots_;
    std::vector<RequestRecord> records_;
    std::vector<cost::ExtendItem> items_;
    std::vector<uint32_t> scratch_;
    std::vector<int> touched_;
    struct FlowGroup {
        std::vector<uint32_t> members;
        int32_t lanes_left = 0;
    };
    std::vector<FlowGroup> groups_;
    std::vector<uint32_t> free_groups_;
    std::vector<std::pair<uint32_t, double>> flow_items_;
    std::vector<uint32_t> members_;
    struct CpuNode {
        double cores = 1;
        std::vector<int> active;  // instances whose forward is in flight
    };
    std::vector<CpuNode> cpu_nodes_;
    std::vector<std::pair<double, int>> share_;  // reshare scratch: (cores, instance)
    size_t next_arrival_ = 0;
    int64_t in_flight_ = 0;
    int64_t finished_ = 0;
    SimStats stats_;
    // transfer summary
    double transfer_bytes_ = 0, sum_exposed_ = 0, sum_transfer_ = 0;
    int64_t active_flows_ = 0;
    double busy_start_ = 0, busy_total_ = 0;
    std::vector<double> layer_latency_us_;
    int64_t timeline_forwards_ = 0;
};

// ------------------------------------------------------------------------------------------------
// Setup

Status Simulation::setup() {
    const topo::Topology& t = cfg_.topology;
    const size_t n = t.instances.size();
    colocated_ = cfg_.mode == SimMode::kColocated;
    if (cfg_.instances.size() != n) {
        return bad(fmt::format("simulator: {} instance setups for {} topology instances",
                               cfg_.instances.size(), n));
    }
    if (cfg_.page_size < 1) return bad(fmt::format("page size {}: must be >= 1", cfg_.page_size));
    const policy::BatchingOptions& b = cfg_.batching;
    if (b.chunk_size < 1 || b.max_batch_tokens < 1 || b.max_decode_batch < 1 ||
        b.max_decode_kv_tokens < 0) {
        return bad("simulator: chunk size, max batch tokens and max decode batch must be >= 1");
    }
    for (size_t i = 1; i < requests_.size(); ++i) {
        if (requests_[i].arrival_ms < requests_[i - 1].arrival_ms) {
            return bad(
                fmt::format("simulator: requests are not sorted by arrival (request {} at "
                            "{} ms after request {} at {} ms)",
                            requests_[i].id, requests_[i].arrival_ms, requests_[i - 1].id,
                            requests_[i - 1].arrival_ms));
        }
    }
    std::vector<bool> is_prefill;
    bool any_p = false, any_d = false;
    insts_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const InstanceSetup& s = cfg_.instances[i];
        if (s.cost == nullptr || s.kv_pages < 0) {
            return bad(fmt::format("simulator: instance {}: no cost model or negative KV pages",
                                   t.instances[i].id));
        }
        const bool p = t.instances[i].role == topo::Role::kPrefill;
        is_prefill.push_back(p);
        any_p |= p;
        any_d |= !p;
        const Role role = colocated_ ? Role::kColocated : (p ? Role::kPrefill : Role::kDecode);
        const bool cache = cfg_.prefix_cache && role != Role::kDecode;
        insts_.emplace_back(static_cast<int>(i), role, s.cost.get(),
                            KvCache(s.kv_pages, cfg_.page_size, cache));
        const model::ModelConfig& m = cfg_.model;
        bytes_per_token_.push_back(static_cast<double>(m.kv_elems_per_token_per_layer(1)) *
                                   m.num_layers * s.kv_dtype_bytes);
    }
    if (n == 0 || (!colocated_ && (!any_p || !any_d))) {
        return bad(fmt::format("{}: the disaggregated mode needs a prefill and a decode instance",
                               cfg_.topology_label));
    }
    if (cfg_.cpu_contention) PDSIM_RETURN_IF_ERROR(setup_cpu_nodes());
    if (cfg_.cost_noise) {
        for (Inst& x : insts_) {
            x.noise[0] = x.cost->noise(false);
            x.noise[1] = x.cost->noise(true);
            if (x.noise[0].any() || x.noise[1].any()) {
                x.rng.seed(cfg_.noise_seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(x.index));
                noisy_ = true;
            }
        }
    }
    lb_ = std::make_unique<policy::LoadBalancer>(is_prefill, colocated_);
    if (!colocated_) PDSIM_RETURN_IF_ERROR(build_routes());
    records_.resize(requests_.size());
    return {};
}

// Lanes between every prefill and decode instance; one FlowNetwork link per direction of each
// topology link (and NIC) that a lane crosses.
Status Simulation::build_routes() {
    const topo::Topology& t = cfg_.topology;
    const size_t n = insts_.size();
    const model::ModelConfig& m = cfg_.model;
    topo::PathFinder finder(t);
    std::unordered_map<std::string, std::pair<int, double>> nics;  // id -> (index, gbps)
    for (const auto& node : t.nodes) {
        for (const auto& nic : node.nics) {
            nics.emplace(nic.id, std::pair{static_cast<int>(nics.size()), nic.gbps});
        }
    }
    // Resources: topology link l direction d -> 2l + d; NIC k direction d -> 2L + 2k + d.
    const int num_links = static_cast<int>(t.links.size());
    std::vector<double> capacity(static_cast<size_t>(2 * num_links + 2 * nics.size()), 0);
    struct RawLane {
        std::vector<int> res;
        double share;
        double latency_s;
    };
    std::vector<std::vector<RawLane>> raw(n * n);
    for (size_t p = 0; p < n; ++p) {
        if (insts_[p].role != Role::kPrefill) continue;
        const topo::Instance& ip = t.instances[p];
        for (size_t d = 0; d < n; ++d) {
            if (insts_[d].role != Role::kDecode) continue;
            const topo::Instance& id = t.instances[d];
            std::vector<std::tuple<int, int, double>> pairs;  // (src rank, dst rank, share)
            if (m.attention == model::AttentionKind::kMla) {
                for (int j = 0; j < id.tp; ++j) pairs.emplace_back(0, j, 1.0);
            } else {
                const double heads = m.num_kv_heads;
                for (auto [i, j] : topo::tp_overlap_pairs(ip.tp, id.tp)) {
                    const double lo = std::max(i * heads / ip.tp, j * heads / id.tp);
                    const double hi = std::min((i + 1) * heads / ip.tp, (j + 1) * heads / id.tp);
                    if (hi > lo) pairs.emplace_back(i, j, (hi - lo) / heads);
                }
            }
            for (auto [i, j, share] : pairs) {
                const std::string& a = ip.devices[static_cast<size_t>(i)];
                const std::string& b = id.devices[static_cast<size_t>(j)];
                const topo::PathInfo pi = finder.path_info(a, b);
                if (!pi.found) {
                    return bad(
                        fmt::format("{}: no path from {} ({}) to {} ({}) for the KV transfer",
                                    cfg_.topology_label, a, ip.id, b, id.id));
                }
                RawLane lane{{}, share, pi.latency_us * 1e-6};
                std::string cur = a;
                for (const topo::Link* l : pi.links) {
                    const int li = static_cast<int>(l - t.links.data());
                    const int dir = l->a == cur ? 0 : 1;
                    const std::string& next = dir == 0 ? l->b : l->a;
                    lane.res.push_back(2 * li + dir);
                    capacity[static_cast<size_t>(2 * li + dir)] = l->gbps * 1e9;
                    if (auto it = nics.find(next); it != nics.end() && it->second.second > 0) {
                        // Into the NIC from its own node: transmit; from the fabric: receive.
                        const int nd = t.node_index_of(cur) == t.node_index_of(next) ? 0 : 1;
                        const int r = 2 * num_links + 2 * it->second.first + nd;
                        lane.res.push_back(r);
                        capacity[static_cast<size_t>(r)] = it->second.second * 1e9;
                    }
                    cur = next;
                }
                raw[p * n + d].push_back(std::move(lane));
            }
        }
    }
    // Bundle when every resource carries the same share of every chunk that crosses it.
    std::vector<double> res_share(capacity.size(), -1);
    bool consistent = true;
    for (const auto& lanes : raw) {
        std::map<int, double> s;
        for (const auto& l : lanes) {
            for (int r : l.res) s[r] += l.share;
        }
        for (auto [r, v] : s) {
            double& g = res_share[static_cast<size_t>(r)];
            if (g < 0) {
                g = v;
            } else if (std::abs(g - v) > 1e-9 * std::max(1.0, v)) {
                consistent = false;
            }
        }
    }
    stats_.bundled_lanes = consistent;
    // Flow units: a whole route when bundled, else each lane. Resources crossed by exactly the
    // same units always carry the same load, so one FlowNetwork link with the smallest capacity
    // of the group stands for all of them (exact, and fewer links per flow make the max-min
    // filling cheaper: one per route on the DGX pairs).
    struct Unit {
        size_t route;
        Lane lane;
        std::vector<int> res;
    };
    std::vector<Unit> units;
    routes_.assign(n * n, Route{});
    for (size_t k = 0; k < raw.size(); ++k) {
        Route& route = routes_[k];
        route.total_share = 0;
        for (const auto& l : raw[k]) {
            route.total_share += l.share;
            route.latency_s = std::max(route.latency_s, l.latency_s);
        }
        if (raw[k].empty()) continue;
        if (consistent) {
            std::set<int> all;
            for (const auto& l : raw[k]) all.insert(l.res.begin(), l.res.end());
            units.push_back(Unit{k, Lane{{}, route.total_share, route.latency_s},
                                 std::vector<int>(all.begin(), all.end())});
        } else {
            for (const auto& l : raw[k]) {
                units.push_back(Unit{k, Lane{{}, l.share, l.latency_s}, l.res});
            }
        }
    }
    std::vector<std::vector<int>> crossing(capacity.size());
    for (size_t u = 0; u < units.size(); ++u) {
        for (int r : units[u].res) crossing[static_cast<size_t>(r)].push_back(static_cast<int>(u));
    }
    std::map<std::vector<int>, double> group_cap;
    for (size_t r = 0; r < capacity.size(); ++r) {
        if (crossing[r].empty()) continue;
        const double cap = capacity[r] / (consistent ? res_share[r] : 1.0);
        auto [it, fresh] = group_cap.emplace(crossing[r], cap);
        if (!fresh) it->second = std::min(it->second, cap);
    }
    std::map<std::vector<int>, LinkId> group_link;
    for (const auto& [sig, cap] : group_cap) group_link.emplace(sig, net_.add_link(cap));
    for (Unit& u : units) {
        std::set<LinkId> path;
        for (int r : u.res) path.insert(group_link.at(crossing[static_cast<size_t>(r)]));
        u.lane.path.assign(path.begin(), path.end());
        routes_[u.route].lanes.push_back(std::move(u.lane));
    }
    return {};
}

// ------------------------------------------------------------------------------------------------
// Arrivals and terminal requests

void Simulation::on_arrivals() {
    std::vector<int>& touched = touched_;
    touched.clear();
    const double now = loop_.now();
    while (next_arrival_ < requests_.size() &&
           requests_[next_arrival_].arrival_ms / 1000.0 <= now) {
        arrive(static_cast<uint32_t>(next_arrival_++), &touched);
    }
    if (next_arrival_ < requests_.size()) {
        loop_.schedule_at(std::max(now, requests_[next_arrival_].arrival_ms / 1000.0),
                          [this] { on_arrivals(); });
    }
    for (int i : touched) kick(inst(i));
}

void Simulation::arrive(uint32_t index, std::vector<int>* touched) {
    const workload::Request& q = requests_[index];
    RequestRecord& rec = records_[index];
    rec.id = q.id;
    rec.arrival_ms = q.arrival_ms;
    rec.input_len = q.input_len;
    rec.output_len = q.output_len;
    const int32_t in = std::max<int32_t>(q.input_len, 1);
    const int32_t out = std::max<int32_t>(q.output_len, 1);
    const policy::Assignment asg = lb_->assign(in, out);
    rec.prefill_instance = asg.prefill;
    rec.decode_instance = asg.decode;
    Inst& p = inst(asg.prefill);
    Inst& d = inst(asg.decode);
    const int64_t p_need = p.kv.pages_for(colocated_ ? int64_t{in} + out : in);
    const int64_t d_need = d.kv.pages_for(int64_t{in} + out);
    if (p_need > p.kv.capacity()) {
        return fail(index, asg,
                    fmt::format("needs {} KV pages on instance {}, which has {}", p_need,
                                cfg_.topology.instances[static_cast<size_t>(asg.prefill)].id,
                                p.kv.capacity()));
    }
    if (!colocated_ && d_need > d.kv.capacity()) {
        return fail(index, asg,
                    fmt::format("needs {} KV pages on instance {}, which has {}", d_need,
                                cfg_.topology.instances[static_cast<size_t>(asg.decode)].id,
                                d.kv.capacity()));
    }
    const uint32_t s = new_slot();
    Req& r = reqs_[s];
    r.index = index;
    r.in = in;
    r.out = out;
    r.asg = asg;
    ++in_flight_;
    stats_.max_in_flight = std::max(stats_.max_in_flight, in_flight_);
    // Decode first, as the testbed's router sends it: its admission (the receiver's pages) can be
    // in place before the prefill instance starts the first chunk.
    if (!colocated_) {
        d.waiting.push_back(s);
        touched->push_back(d.index);
    }
    p.waiting.push_back(s);
    touched->push_back(p.index);
}

void Simulation::fail(uint32_t index, const policy::Assignment& asg, std::string why) {
    RequestRecord& rec = records_[index];
    rec.ok = false;
    rec.error = std::move(why);
    lb_->finished(asg, std::max(rec.input_len, 1), std::max(rec.output_len, 1), false);
    terminal(rec);
}

void Simulation::terminal(RequestRecord& rec) {
    ++finished_;
    if (cfg_.timeline != nullptr && cfg_.timeline_sample > 0 &&
        static_cast<int64_t>(&rec - records_.data()) % cfg_.timeline_sample == 0) {
        const int p = pid(static_cast<int>(insts_.size()));
        const int tid = static_cast<int>(rec.id % 16);
        const double arr = rec.arrival_ms * 1000;
        if (rec.ok) {
            cfg_.timeline->add_slice(p, tid, fmt::format("r{} to first token", rec.id), "request",
                                     arr, (rec.first_token_ms - rec.arrival_ms) * 1000,
                                     {{"input_len", rec.input_len}});
            cfg_.timeline->add_slice(
                p, tid, fmt::format("r{} decode", rec.id), "request", rec.first_token_ms * 1000,
                (rec.finish_ms - rec.first_token_ms) * 1000, {{"generated", rec.generated}});
        } else {
            cfg_.timeline->add_instant(p, tid, fmt::format("r{} failed", rec.id), "request", arr);
        }
    }
    if (cfg_.on_request_done) cfg_.on_request_done(rec);
}

void Simulation::finish(uint32_t slot) {
    Req& r = reqs_[slot];
    const double now = loop_.now();
    RequestRecord& rec = records_[r.index];
    rec.first_token_ms = r.t_first * 1000;
    rec.finish_ms = now * 1000;
    rec.generated = r.generated;
    rec.ok = true;
    lb_->finished(r.asg, r.in, r.out, r.prefill_released);
    Inst& d = inst(r.asg.decode);
    if (colocated_) {
        d.kv.release(hashes(r), r.pinned, full_blocks(r), r.own_pages);
    } else {
        d.kv.free(r.dec_pages);
    }
    --in_flight_;
    free_slots_.push_back(slot);
    terminal(rec);
}

// ------------------------------------------------------------------------------------------------
// Instances

void Simulation::start_next(Inst& x) {
    for (int attempt = 0; attempt < 4 && !x.busy; ++attempt) {
        admit(x);
        const policy::ForwardKind kind =
            policy::choose_forward(!x.extend_q.empty(), !x.running.empty(), x.last_was_extend);
        if (kind == policy::ForwardKind::kNone) break;
        if (kind == policy::ForwardKind::kExtend) {
            start_extend(x);
            x.last_was_extend = true;
            break;
        }
        x.last_was_extend = false;
        if (start_decode(x)) break;
        // Every candidate was preempted: admit and try again.
    }
}

void Simulation::admit(Inst& x) {
    while (!x.waiting.empty()) {
        const uint32_t s = x.waiting.front();
        Req& r = reqs_[s];
        if (x.role == Role::kDecode && !r.recompute) {
            const int64_t need = x.kv.pages_for(int64_t{r.in} + (cfg_.reserve_output ? r.out : 0));
            if (!x.kv.alloc(need)) return;
            x.waiting.pop_front();
            r.dec_pages = need;
            r.d_admitted = true;
            if (r.pending_bytes > 0) {
                const double b = r.pending_bytes;
                r.pending_bytes = 0;
                start_flows(std::span(&s, 1), b, 0, nullptr);
            }
            continue;
        }
        // Compute admission: a new prompt (prefill / colocated) or a preempted request's recompute.
        const int64_t tokens = r.recompute ? int64_t{r.in} + r.generated : r.in;
        int64_t h = 0;
        const std::span<const int64_t> hs = hashes(r);
        if (x.kv.prefix_cache()) {
            // Whole blocks of the prompt only, and at least one token left to compute.
            const int64_t max_h = std::min<int64_t>(
                {full_blocks(r), (tokens - 1) / kBlock, static_cast<int64_t>(hs.size())});
            h = x.kv.match(hs.first(static_cast<size_t>(max_h)));
            x.kv.pin(hs, h);
        }
        const int64_t held =
            cfg_.reserve_output && x.role != Role::kPrefill ? int64_t{r.in} + r.out : tokens;
        const int64_t need = x.kv.pages_for(held - h * kBlock);
        if (!x.kv.alloc(need)) {
            x.kv.unpin(hs, h);
            return;
        }
        x.waiting.pop_front();
        if (x.role == Role::kDecode) {
            r.dec_pages = need;
        } else {
            r.own_pages = need;
            r.pinned = h;
        }
        r.target = tokens;
        r.prefilled = h * kBlock;
        if (x.role == Role::kPrefill) r.hit_unsent = h * kBlock;
        stats_.prefix_hit_tokens += h * kBlock;
        x.extend_q.push_back(s);
    }
}

void Simulation::start_extend(Inst& x) {
    policy::ExtendPlanner plan(cfg_.batching);
    items_.clear();
    x.entries.clear();
    for (uint32_t s : x.extend_q) {
        if (plan.full()) break;
        const Req& r = reqs_[s];
        const int64_t n = plan.take(r.target - r.prefilled);
        if (n == 0) continue;
        items_.push_back(cost::ExtendItem{n, r.prefilled});
        x.entries.push_back(Inst::Entry{s, n, false, 0});
    }
    PDSIM_CHECK(!x.entries.empty());
    double dur = x.cost->extend_s(items_);
    PDSIM_CHECK_MSG(dur >= 0 && std::isfinite(dur), "cost model: extend time {}", dur);
    if (noisy_) dur = with_noise(x, false, dur);
    const double now = loop_.now();
    x.busy = true;
    x.extend = true;
    x.t_start = now;
    ++stats_.extend_forwards;
    if (x.role == Role::kPrefill) {
        // The batch's chunks to one decode instance go as one flow: the sender sends layer by
        // layer across the batch, so their last layers land together.
        flow_items_.clear();
        for (Inst::Entry& e : x.entries) {
            Req& r = reqs_[e.slot];
            r.t_last_start = now;
            const double b = chunk_bytes(r, e.n);
            r.bytes += b;
            if (cfg_.layerwise && r.d_admitted) {
                flow_items_.emplace_back(e.slot, b);
                e.flow = true;
            }
            if (r.hit_unsent > 0) {
                // A prefix hit's KV is already written: it goes with the first chunk, uncapped.
                const double hb = chunk_bytes(r, r.hit_unsent);
                r.hit_unsent = 0;
                r.bytes += hb;
                if (cfg_.layerwise && r.d_admitted) {
                    start_flows(std::span(&e.slot, 1), hb, 0, nullptr);
                } else {
                    e.hit_bytes = hb;
                }
            }
        }
        start_batch_flows(flow_items_, dur, &x);
    }
    x.tl_n = x.entries.size();
    x.tl_tokens = plan.tokens();
    schedule_forward_end(x, dur);
}

bool Simulation::start_decode(Inst& x) {
    policy::DecodePlanner plan(cfg_.batching);
    size_t n = 0;
    for (uint32_t s : x.running) {
        const Req& r = reqs_[s];
        if (!plan.take(int64_t{r.in} + r.generated)) break;
        ++n;
    }
    // Pages for the token each request writes in this step; preempt the newest when short.
    for (size_t j = 0; j < n; ++j) {
        const uint32_t s = x.running[j];
        Req& r = reqs_[s];
        int64_t& held = colocated_ ? r.own_pages : r.dec_pages;
        const int64_t pinned_tokens = colocated_ ? r.pinned * kBlock : 0;
        const int64_t need = x.kv.pages_for(int64_t{r.in} + r.generated - pinned_tokens) - held;
        if (need <= 0) continue;
        bool self = false;
        while (!x.kv.alloc(need)) {
            self = x.running.back() == s;
            preempt(x);
            n = std::min(n, x.running.size());
            if (self) break;
        }
        if (self) break;
        held += need;
    }
    if (n == 0) return false;
    int64_t kv = 0;
    for (size_t j = 0; j < n; ++j) {
        const Req& r = reqs_[x.running[j]];
        kv += int64_t{r.in} + r.generated;
    }
    double dur = x.cost->decode_s(static_cast<int64_t>(n), kv);
    PDSIM_CHECK_MSG(dur >= 0 && std::isfinite(dur), "cost model: decode time {}", dur);
    if (noisy_) dur = with_noise(x, true, dur);
    x.busy = true;
    x.extend = false;
    x.decode_n = n;
    x.t_start = loop_.now();
    ++stats_.decode_forwards;
    x.tl_n = n;
    x.tl_tokens = 0;
    schedule_forward_end(x, dur);
    return true;
}

// The newest running request of `x` gives its pages back and waits for readmission (front of the
// queue), after which its prompt + generated tokens are recomputed.
void Simulation::preempt(Inst& x) {
    const uint32_t s = x.running.back();
    x.running.pop_back();
    Req& r = reqs_[s];
    ++stats_.preemptions;
    if (colocated_) {
        x.kv.release(hashes(r), r.pinned, full_blocks(r), r.own_pages);
        r.own_pages = 0;
        r.pinned = 0;
    } else {
        x.kv.free(r.dec_pages);
        r.dec_pages = 0;
    }
    r.recompute = true;
    x.waiting.push_front(s);
}

void Simulation::on_forward_end(int i) {
    Inst& x = inst(i);
    if (x.cpu_node >= 0) {
        std::vector<int>& act = cpu_nodes_[static_cast<size_t>(x.cpu_node)].active;
        act.erase(std::find(act.begin(), act.end(), i));
        if (x.slowed) ++stats_.contended_forwards;
        // Its real duration is known only now.
        if (cfg_.timeline != nullptr) {
            timeline_forward(x, x.t_start, loop_.now() - x.t_start, x.tl_n, x.tl_tokens);
        }
        reshare(x.cpu_node, nullptr);
    }
    x.busy = false;
    if (x.extend) {
        end_extend(x);
    } else {
        end_decode(x);
    }
    for (uint32_t s : x.ready) deliver(s);
    x.ready.clear();
    // Straight on: what else is due at this instant and was scheduled earlier has run already.
    start_next(x);
}

void Simulation::end_extend(Inst& x) {
    const double now = loop_.now();
    // The forward's entries are the first entries of the queue: drop those it completed.
    const size_t k = x.entries.size();
    scratch_.clear();
    for (size_t j = 0; j < k; ++j) {
        const Inst::Entry& e = x.entries[j];
        const Req& r = reqs_[e.slot];
        if (r.prefilled + e.n < r.target) scratch_.push_back(e.slot);
        x.extend_q.pop_front();
    }
    for (auto it = scratch_.rbegin(); it != scratch_.rend(); ++it) x.extend_q.push_front(*it);

    // Uncap what the links held back; a flow that kept pace with its cap is done (or within
    // rounding of it) and needs no rate change.
    for (auto [f, bytes] : x.capped) {
        if (net_.remaining_bytes(f) > 1e-9 * bytes) net_.set_rate_cap(f, 0);
    }
    x.capped.clear();
    if (x.role == Role::kPrefill) {
        flow_items_.clear();
        for (const Inst::Entry& e : x.entries) {
            Req& r = reqs_[e.slot];
            r.prefilled += e.n;
            stats_.prefill_tokens += e.n;
            if (!e.flow || e.hit_bytes > 0) {
                const double b = (e.flow ? 0 : chunk_bytes(r, e.n)) + e.hit_bytes;
                if (r.d_admitted) {
                    flow_items_.emplace_back(e.slot, b);
                } else {
                    r.pending_bytes += b;
                }
            }
        }
        start_batch_flows(flow_items_, 0, nullptr);
        for (const Inst::Entry& e : x.entries) {
            Req& r = reqs_[e.slot];
            if (r.prefilled >= r.target) {
                r.chunks_done = true;
                r.t_fwd_end = now;
                maybe_kv_complete(e.slot);
            }
        }
        return;
    }
    for (const Inst::Entry& e : x.entries) {
        Req& r = reqs_[e.slot];
        r.prefilled += e.n;
        stats_.prefill_tokens += e.n;
        const bool last = r.prefilled >= r.target;
        if (last) {
            // Colocated prefill or a recompute: samples the next token.
            r.recompute = false;
            ++r.generated;
            if (r.t_first < 0) {
                r.t_first = now;
                lb_->prefill_done(r.asg, r.in);
                r.prefill_released = true;
            }
            if (r.generated >= r.out) {
                finish(e.slot);
            } else {
                x.running.push_back(e.slot);
            }
        }
    }
}

void Simulation::end_decode(Inst& x) {
    const size_t n = x.decode_n;
    scratch_.clear();
    size_t w = 0;
    for (size_t j = 0; j < n; ++j) {
        const uint32_t s = x.running[j];
        Req& r = reqs_[s];
        if (++r.generated >= r.out) {
            scratch_.push_back(s);
        } else {
            x.running[w++] = s;
        }
    }
    if (w < n) {
        // The requests behind the batch keep their order.
        x.running.erase(x.running.begin() + static_cast<std::ptrdiff_t>(w),
                        x.running.begin() + static_cast<std::ptrdiff_t>(n));
    }
    for (uint32_t s : scratch_) finish(s);
}

// The decode instance has the whole KV and the first token: the request joins the batch.
void Simulation::deliver(uint32_t slot) {
    Req& r = reqs_[slot];
    r.t_first = loop_.now();
    r.generated = 1;
    if (r.generated >= r.out) {
        finish(slot);
    } else {
        inst(r.asg.decode).running.push_back(slot);
    }
}

// ------------------------------------------------------------------------------------------------
// Forward-time variation

namespace {
// Log-normal with mean 1 and coefficient of variation cv.
double lognormal_mean1(std::mt19937_64& rng, double cv) {
    if (cv <= 0) return 1;
    const double s2 = std::log1p(cv * cv);
    std::normal_distribution<double> n(-s2 / 2, std::sqrt(s2));
    return std::exp(n(rng));
}
}  // namespace

double Simulation::with_noise(Inst& x, bool decode, double dur) {
    const cost::CostNoise& nz = x.noise[decode ? 1 : 0];
    if (!nz.any()) return dur;
    const int k = decode ? 1 : 0;
    if (nz.slow_cv > 0 && nz.slow_period_s > 0 && loop_.now() >= x.slow_until[k]) {
        x.slow[k] = lognormal_mean1(x.rng, nz.slow_cv);
        x.slow_until[k] = loop_.now() + nz.slow_period_s;
    }
    double fast;
    if (nz.fast_quantiles.size() >= 2) {
        const double u = std::uniform_real_distribution<double>(0, 1)(x.rng);
        const double pos = u * static_cast<double>(nz.fast_quantiles.size() - 1);
        const auto i = std::min(static_cast<size_t>(pos), nz.fast_quantiles.size() - 2);
        const double f = pos - static_cast<double>(i);
        fast = nz.fast_quantiles[i] * (1 - f) + nz.fast_quantiles[i + 1] * f;
    } else {
        fast = lognormal_mean1(x.rng, nz.fast_cv);
    }
    return dur * x.slow[k] * fast;
}

// ------------------------------------------------------------------------------------------------
// CPU core contention

// Nodes whose CPU instances could together want more cores than the node has; the others never
// contend and keep the plain one-event-per-forward path.
Status Simulation::setup_cpu_nodes() {
    const topo::Topology& t = cfg_.topology;
    std::vector<double> demand(t.nodes.size(), 0);
    std::vector<int> count(t.nodes.size(), 0);
    std::vector<bool> interferes(t.nodes.size(), false);
    std::vector<int> node_of(insts_.size(), -1);
    for (size_t i = 0; i < insts_.size(); ++i) {
        const int k = cfg_.instances[i].cpu_cores;
        if (k <= 0 || t.instances[i].devices.empty()) continue;
        const int nd = t.node_index_of(t.instances[i].devices.front());
        if (nd < 0) continue;
        node_of[i] = nd;
        const auto n = static_cast<size_t>(nd);
        demand[n] += k;
        ++count[n];
        const cost::CostModel& cm = *cfg_.instances[i].cost;
        insts_[i].interference[0] = cm.interference(false);
        insts_[i].interference[1] = cm.interference(true);
        if (insts_[i].interference[0] > 0 || insts_[i].interference[1] > 0) interferes[n] = true;
    }
    std::vector<int> index(t.nodes.size(), -1);
    for (size_t i = 0; i < insts_.size(); ++i) {
        const int nd = node_of[i];
        if (nd < 0) continue;
        const size_t n = static_cast<size_t>(nd);
        double cores = cfg_.node_cpus > 0 ? cfg_.node_cpus : t.nodes[n].cpus;
        if (cores <= 0) cores = std::max(1u, std::thread::hardware_concurrency());
        // Neither oversubscribed nor slowed by each other's forwards: no contention to model.
        if (demand[n] <= cores && !(interferes[n] && count[n] > 1)) continue;
        if (index[n] < 0) {
            index[n] = static_cast<int>(cpu_nodes_.size());
            cpu_nodes_.push_back(CpuNode{cores, {}});
        }
        insts_[i].cpu_node = index[n];
        insts_[i].cores = cfg_.instances[i].cpu_cores;
    }
    return {};
}

void Simulation::schedule_forward_end(Inst& x, double dur) {
    if (x.cpu_node < 0) {
        if (cfg_.timeline != nullptr) timeline_forward(x, loop_.now(), dur, x.tl_n, x.tl_tokens);
        loop_.schedule(dur, [this, i = x.index] { on_forward_end(i); });
        return;
    }
    x.iso_s = dur;
    x.work = x.cores * dur;
    x.rate = 0;
    x.t_rate = loop_.now();
    x.slowed = false;
    cpu_nodes_[static_cast<size_t>(x.cpu_node)].active.push_back(x.index);
    reshare(x.cpu_node, &x);
}

void Simulation::reshare(int node, Inst* fresh) {
    const CpuNode& nd = cpu_nodes_[static_cast<size_t>(node)];
    const double now = loop_.now();
    // The kernel shares cores per runnable thread: every compute thread gets the same share, at
    // most one core, and a TP instance runs at its ranks' common pace.
    double threads = 0;
    for (int i : nd.active) threads += inst(i).cores;
    const double per_thread = std::min(1.0, nd.cores / threads);
    const bool shared = nd.active.size() > 1;
    share_.clear();
    for (int i : nd.active) {
        const Inst& y = inst(i);
        const double slow = shared ? 1 + y.interference[y.extend ? 0 : 1] : 1;
        share_.emplace_back(y.cores * per_thread / slow, i);
    }
    for (const auto& [r, i] : share_) {
        Inst& y = inst(i);
        if (&y != fresh) {
            if (r == y.rate) continue;
            y.work = std::max(0.0, y.work - y.rate * (now - y.t_rate));
            loop_.cancel(y.end_ev);
        }
        y.t_rate = now;
        y.rate = r;
        if (r < y.cores) y.slowed = true;
        y.end_ev = loop_.schedule(y.work / r, [this, i] { on_forward_end(i); });
        if (&y != fresh || r < y.cores) set_caps(y);
    }
}

// A layerwise flow may not overtake its forward: its cap follows the forward's progress rate.
void Simulation::set_caps(Inst& x) {
    if (x.iso_s <= 0) return;
    for (auto [f, bytes] : x.capped) {
        if (net_.remaining_bytes(f) > 1e-9 * bytes) {
            net_.set_rate_cap(f, bytes / x.iso_s * (x.rate / x.cores));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Transfer

void Simulation::start_batch_flows(std::vector<std::pair<uint32_t, double>>& items, double duration,
                                   Inst* capped_on) {
    std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
        return reqs_[a.first].asg.decode < reqs_[b.first].asg.decode;
    });
    for (size_t i = 0; i < items.size();) {
        const int d = reqs_[items[i].first].asg.decode;
        double bytes = 0;
        members_.clear();
        for (; i < items.size() && reqs_[items[i].first].asg.decode == d; ++i) {
            bytes += items[i].second;
            members_.push_back(items[i].first);
        }
        start_flows(members_, bytes, duration, capped_on);
    }
}

void Simulation::start_flows(std::span<const uint32_t> members, double bytes, double duration,
                             Inst* capped_on) {
    const Route& rt = route(reqs_[members.front()]);
    const double now = loop_.now();
    for (uint32_t s : members) {
        Req& r = reqs_[s];
        if (r.t_flow0 < 0) r.t_flow0 = now;
        r.flows += static_cast<int32_t>(rt.lanes.size());
    }
    if (rt.lanes.empty()) {
        for (uint32_t s : members) maybe_kv_complete(s);
        return;
    }
    uint32_t g;
    if (!free_groups_.empty()) {
        g = free_groups_.back();
        free_groups_.pop_back();
    } else {
        g = static_cast<uint32_t>(groups_.size());
        groups_.emplace_back();
    }
    groups_[g].members.assign(members.begin(), members.end());
    groups_[g].lanes_left = static_cast<int32_t>(rt.lanes.size());
    for (const Lane& lane : rt.lanes) {
        const double b = bytes * lane.share / rt.total_share;
        const double cap = duration > 0 ? b / duration : 0;
        if (active_flows_++ == 0) busy_start_ = now;
        ++stats_.flows;
        const FlowId f = net_.start_flow(
            lane.path, b, lane.latency_s, [this, g] { on_flow_done(g); }, cap);
        if (capped_on != nullptr && cap > 0) capped_on->capped.emplace_back(f, b);
    }
}

void Simulation::on_flow_done(uint32_t g) {
    if (--active_flows_ == 0) busy_total_ += loop_.now() - busy_start_;
    const bool last = --groups_[g].lanes_left == 0;
    // By index: completing a request can start other flows (and grow groups_).
    for (size_t i = 0; i < groups_[g].members.size(); ++i) {
        const uint32_t s = groups_[g].members[i];
        --reqs_[s].flows;
        maybe_kv_complete(s);
    }
    if (last) free_groups_.push_back(g);
}

void Simulation::maybe_kv_complete(uint32_t slot) {
    Req& r = reqs_[slot];
    if (r.kv_done || !r.chunks_done || r.flows > 0 || r.pending_bytes > 0 || !r.d_admitted) return;
    r.kv_done = true;
    const double now = loop_.now();
    // Transfer figures (docs/simulator.md): exposed = after the last forward; the per-layer
    // latency is the mean over layers of (landed - ready) with layers landing uniformly.
    const Route& rt = route(r);
    const double L = cfg_.model.num_layers;
    const double lat = rt.latency_s;
    const double exposed = std::max(0.0, now - r.t_fwd_end);
    const double transfer = now - (r.t_flow0 < 0 ? now : r.t_flow0);
    const double tail = std::max(0.0, now - lat - r.t_fwd_end);
    double layer = lat + tail * (L + 1) / (2 * L);
    if (!cfg_.layerwise) layer += (r.t_fwd_end - r.t_last_start) * (L - 1) / (2 * L);
    layer_latency_us_.push_back(layer * 1e6);
    transfer_bytes_ += r.bytes;
    sum_exposed_ += exposed;
    sum_transfer_ += transfer;
    RequestRecord& rec = records_[r.index];
    rec.transfer_bytes = static_cast<int64_t>(std::llround(r.bytes));
    rec.transfer_ms = transfer * 1000;
    rec.exposed_transfer_ms = exposed * 1000;
    if (cfg_.timeline != nullptr && cfg_.timeline_sample > 0 &&
        r.index % static_cast<uint64_t>(cfg_.timeline_sample) == 0) {
        cfg_.timeline->add_slice(pid(r.asg.prefill), 1, fmt::format("kv r{}", rec.id), "transfer",
                                 r.t_flow0 * 1e6, transfer * 1e6,
                                 {{"bytes", rec.transfer_bytes}, {"exposed_ms", exposed * 1000}});
    }
    // The prefill side is done with it: pages (into the prefix cache) and routing load.
    Inst& p = inst(r.asg.prefill);
    p.kv.release(hashes(r), r.pinned, full_blocks(r), r.own_pages);
    r.own_pages = 0;
    r.pinned = 0;
    lb_->prefill_done(r.asg, r.in);
    r.prefill_released = true;
    Inst& d = inst(r.asg.decode);
    if (d.busy) {
        d.ready.push_back(slot);
    } else {
        deliver(slot);
    }
    kick(p);
    kick(d);
}

void Simulation::timeline_forward(const Inst& x, double start, double dur, size_t n,
                                  int64_t tokens) {
    if (timeline_forwards_++ >= cfg_.timeline_max_forwards) return;
    cfg_.timeline->add_slice(
        pid(x.index), 0,
        x.extend ? fmt::format("extend bs={} T={}", n, tokens) : fmt::format("decode bs={}", n),
        "forward", start * 1e6, dur * 1e6);
}

// ------------------------------------------------------------------------------------------------
// Driver

double thread_cpu_s() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

void Simulation::run() {
    const double cpu0 = thread_cpu_s();
    const auto t0 = std::chrono::steady_clock::now();
    auto wall = [&] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (cfg_.timeline != nullptr) {
        const topo::Topology& t = cfg_.topology;
        for (const Inst& x : insts_) {
            const topo::Instance& ti = t.instances[static_cast<size_t>(x.index)];
            const char* role = x.role == Role::kPrefill  ? "prefill"
                               : x.role == Role::kDecode ? "decode"
                                                         : "colocated";
            cfg_.timeline->name_process(
                pid(x.index),
                fmt::format("{}: {} {} tp{}", sim_mode_name(cfg_.mode), ti.id, role, ti.tp));
            cfg_.timeline->name_thread(pid(x.index), 0, "forwards");
            if (x.role == Role::kPrefill)
                cfg_.timeline->name_thread(pid(x.index), 1, "kv transfer");
        }
        cfg_.timeline->name_process(
            pid(static_cast<int>(insts_.size())),
            fmt::format("{}: requests (every {})", sim_mode_name(cfg_.mode), cfg_.timeline_sample));
    }
    if (!requests_.empty()) {
        loop_.schedule_at(requests_.front().arrival_ms / 1000.0, [this] { on_arrivals(); });
    }
    double next_progress = cfg_.progress_interval_s;
    uint64_t k = 0;
    while (loop_.step()) {
        if (cfg_.on_progress && (++k % kProgressEvery) == 0 && wall() >= next_progress) {
            next_progress = wall() + cfg_.progress_interval_s;
            cfg_.on_progress(SimProgress{finished_, static_cast<int64_t>(requests_.size()),
                                         loop_.now(), wall(), loop_.events_run()});
        }
    }
    // Nothing is left to happen; anything unfinished is a scheduling bug, reported not hidden.
    std::vector<bool> free(reqs_.size(), false);
    for (uint32_t s : free_slots_) free[s] = true;
    for (size_t s = 0; s < reqs_.size() && in_flight_ > 0; ++s) {
        if (free[s]) continue;
        RequestRecord& rec = records_[reqs_[s].index];
        rec.ok = false;
        rec.error = "the simulation ended with the request unfinished (stalled)";
        terminal(rec);
    }
    stats_.events = loop_.events_run();
    stats_.sim_s = loop_.now();
    stats_.wall_s = wall();
    stats_.cpu_s = thread_cpu_s() - cpu0;
    if (cfg_.on_progress) {
        cfg_.on_progress(SimProgress{finished_, static_cast<int64_t>(requests_.size()), loop_.now(),
                                     stats_.wall_s, stats_.events});
    }
}

SimResult Simulation::result() {
    SimResult res;
    metrics::Report& rep = res.report;
    rep.mode = std::string(sim_mode_name(cfg_.mode));
    rep.topology = cfg_.topology_label;
    rep.model = cfg_.model.name;
    metrics::summarize_requests(records_, cfg_.slo, &rep);
    rep.transfer.bytes = static_cast<int64_t>(std::llround(transfer_bytes_));
    rep.transfer.gbps = busy_total_ > 0 ? transfer_bytes_ / busy_total_ / 1e9 : 0;
    rep.transfer.layer_latency_us = metrics::percentiles(std::move(layer_latency_us_));
    rep.transfer.exposed_fraction = sum_transfer_ > 0 ? sum_exposed_ / sum_transfer_ : 0;
    double last_finish = 0;
    for (const auto& r : records_) last_finish = std::max(last_finish, r.finish_ms);
    rep.wall_s = last_finish / 1000.0;
    std::vector<std::string> costs;
    for (const Inst& x : insts_) {
        std::string d = x.cost->describe();
        if (std::find(costs.begin(), costs.end(), d) == costs.end()) costs.push_back(std::move(d));
    }
    std::string cost_desc;
    for (const auto& c : costs) cost_desc += (cost_desc.empty() ? "" : "; ") + c;
    const SimStats& s = stats_;
    rep.extra["simulator"] = {
        {"events", s.events},
        {"wall_s", s.wall_s},
        {"cpu_s", s.cpu_s},
        {"requests_per_wall_s",
         s.wall_s > 0 ? static_cast<double>(requests_.size()) / s.wall_s : 0},
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
    };
    nlohmann::json kv = nlohmann::json::array();
    for (const Inst& x : insts_) {
        kv.push_back({{"instance", cfg_.topology.instances[static_cast<size_t>(x.index)].id},
                      {"kv_pages", x.kv.capacity()},
                      {"evicted_blocks", x.kv.evicted_blocks()},
                      {"cached_blocks", x.kv.cached_blocks()}});
    }
    rep.extra["simulator"]["instances"] = std::move(kv);
    const policy::BatchingOptions& b = cfg_.batching;
    nlohmann::json contended_cores = nlohmann::json::array();
    for (const CpuNode& nd : cpu_nodes_) contended_cores.push_back(nd.cores);
    rep.extra["config"] = {{"mode", rep.mode},
                           {"layerwise", cfg_.layerwise},
                           {"prefix_cache", cfg_.prefix_cache},
                           {"kv_admission", cfg_.reserve_output ? "full" : "prompt"},
                           {"page_size", cfg_.page_size},
                           {"chunk_size", b.chunk_size},
                           {"max_batch_tokens", b.max_batch_tokens},
                           {"max_decode_batch", b.max_decode_batch},
                           {"max_decode_kv_tokens", b.max_decode_kv_tokens},
                           {"cpu_contention", cfg_.cpu_contention},
                           {"cost_noise", noisy_},
                           {"noise_seed", cfg_.noise_seed},
                           {"contended_node_cores", contended_cores},
                           {"slo_ttft_ms", cfg_.slo.ttft_ms},
                           {"slo_tpot_ms", cfg_.slo.tpot_ms}};
    res.records = std::move(records_);
    res.stats = stats_;
    return res;
}

}  // namespace

StatusOr<SimResult> run_simulation(const SimConfig& config,
                                   std::span<const workload::Request> requests) {
    Simulation sim(config, requests);
    PDSIM_RETURN_IF_ERROR(sim.setup());
    sim.run();
    return sim.result();
}

}  // namespace pdsim::des
