#include "sim/des/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "common/check.h"
#include "common/thread_info.h"
#include "sim/des/cpu_contention.h"
#include "sim/des/event_loop.h"
#include "sim/des/flow_network.h"
#include "sim/des/forward_noise.h"
#include "sim/des/instances.h"
#include "sim/des/kv_cache.h"
#include "sim/des/reporting.h"
#include "sim/des/routes.h"
#include "sim/policy/routing.h"

namespace pdsim::des {

std::string_view sim_mode_name(SimMode mode) {
    return mode == SimMode::kColocated ? "colocated" : "disagg";
}

namespace {

using metrics::RequestRecord;
using FlowId = FlowNetwork::FlowId;

constexpr int64_t kBlock = workload::kHashBlockTokens;
constexpr int kProgressEvery = 8192;  // events between wall-clock checks

// The event loop and the wiring of the parts: arrivals and routing, the instances' forwards (their
// batches from instances.h, their times from the cost models, forward_noise.h, the cost model's
// warm-up after an idle period (cost::CostWake, with_wake) and cpu_contention.h), the KV transfers
// as flows over routes.h's lanes, and reporting.h's figures.
class Simulation {
public:
    Simulation(const SimConfig& c, std::span<const workload::Request> trace)
        : cfg_(c), trace_(trace), net_(loop_), timeline_(c) {}

    Status setup();
    void run();
    SimResult result();

private:
    // ---- requests ----
    std::span<const int64_t> hashes(const SimRequest& r) const {
        return trace_[r.trace_index].hash_ids;
    }
    int64_t full_blocks(const SimRequest& r) const { return r.input_len / kBlock; }
    Instance& inst(int i) { return insts_[static_cast<size_t>(i)]; }

    Status check_config() const;
    void on_arrivals();
    void arrive(uint32_t trace_index, std::vector<int>* touched);
    void fail(uint32_t trace_index, const policy::Assignment& placement, std::string why);
    void finish(uint32_t slot);
    void terminal(RequestRecord& rec);

    // ---- instances ----
    // Lets an idle instance start its next forward once everything else due at this instant has
    // run (the testbed's scheduler drains its messages and engine events before it batches), so
    // requests that become ready at the same time share a forward.
    // Where another instance's forward runs on x's cores, x's threads first wait for them:
    // SimConfig::core_wait_s later.
    void kick(Instance& x) {
        if (x.busy || x.kick_pending) return;
        start_after(
            x, cfg_.core_wait_s > 0 && contention_.core_busy_for(x.index) ? cfg_.core_wait_s : 0.0);
    }
    // x (not busy, no start pending) starts its next forward `delay_s` from now; kicks meanwhile
    // wait for that start.
    void start_after(Instance& x, double delay_s) {
        x.kick_pending = true;
        loop_.schedule(delay_s, [this, i = x.index] {
            Instance& y = inst(i);
            y.kick_pending = false;
            if (!y.busy) start_next(y);
        });
    }
    void start_next(Instance& x);
    void admit(Instance& x);
    void start_extend(Instance& x);
    void start_extend_flows(Instance& x, double duration_s);
    bool start_decode(Instance& x);
    [[nodiscard]] double with_wake(Instance& x, double dur);
    void on_forward_end(int i);
    // SimConfig::step_wait's draw for contended instance `i` whose decode forward just ended.
    [[nodiscard]] double step_wait_s(int i);
    void end_extend(Instance& x);
    void end_prefill_extend(Instance& x);
    void end_decode(Instance& x);
    void deliver(uint32_t slot);
    // Schedules the end of x's forward of isolated duration `dur` (under contention: adds it to
    // its node's running forwards and re-shares the cores).
    void schedule_forward_end(Instance& x, double dur);
    // Brings the node's forwards' work up to now, shares the cores and moves the end (and the
    // layerwise caps) of those whose rate changed; `fresh` was just added and has no end event.
    void reshare(int node, Instance* fresh);
    void set_caps(Instance& x);

    // ---- transfer ----
    const Route& route(const SimRequest& r) const {
        return routes_.route(r.placement.prefill, r.placement.decode);
    }
    // Bytes of r's prompt tokens [first, first + tokens) on its route (kv_groups.h): the KV
    // times the route's share (MLA: replicated), the recurrent state once (head-sliced).
    double chunk_bytes(const SimRequest& r, int64_t first, int64_t tokens) const {
        const KvGroupBytes b = transfer_bytes_[static_cast<size_t>(r.placement.prefill)].chunk(
            r.input_len, first, tokens);
        return (b.full + b.sliding) * route(r).total_share + b.state;
    }
    // One flow per lane carrying `bytes` for `members` (requests of one prefill -> decode pair);
    // rate capped at bytes / duration when duration > 0 (the caps are listed in capped_on).
    void start_flows(std::span<const uint32_t> members, double bytes, double duration,
                     Instance* capped_on);
    // Groups (slot, bytes) by decode instance: one start_flows per group.
    void start_batch_flows(std::vector<std::pair<uint32_t, double>>& items, double duration,
                           Instance* capped_on);
    void on_flow_done(uint32_t group);
    void maybe_kv_complete(uint32_t slot);
    void release_prefill(SimRequest& r);

    const SimConfig& cfg_;
    std::span<const workload::Request> trace_;
    EventLoop loop_;
    FlowNetwork net_;
    bool colocated_ = false;
    bool noisy_ = false;  // some instance draws forward-time variation
    AdmissionOptions admission_;
    std::vector<Instance> insts_;
    std::vector<ForwardNoise> noise_;        // per instance
    std::vector<std::mt19937_64> step_rng_;  // per instance (SimConfig::step_wait)
    CpuContention contention_;
    std::unique_ptr<policy::LoadBalancer> lb_;
    RouteTable routes_;
    std::vector<KvTransferBytes> transfer_bytes_;  // per instance (as the prefill side)
    RequestSlots reqs_;
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
    size_t next_arrival_ = 0;
    int64_t in_flight_ = 0;
    int64_t finished_ = 0;
    SimStats stats_;
    TransferSummary transfer_;
    SimTimeline timeline_;
};

// ------------------------------------------------------------------------------------------------
// Setup

Status Simulation::check_config() const {
    const size_t n = cfg_.topology.instances.size();
    if (cfg_.instances.size() != n) {
        return invalid_argument_error(fmt::format(
            "simulator: {} instance setups for {} topology instances", cfg_.instances.size(), n));
    }
    if (cfg_.page_size < 1)
        return invalid_argument_error(fmt::format("page size {}: must be >= 1", cfg_.page_size));
    const policy::BatchingOptions& b = cfg_.batching;
    if (b.chunk_size < 1 || b.max_batch_tokens < 1 || b.max_decode_batch < 1 ||
        b.max_decode_kv_tokens < 0) {
        return invalid_argument_error(
            "simulator: chunk size, max batch tokens and max decode batch must be >= 1");
    }
    if (!(cfg_.core_wait_s >= 0) || !std::isfinite(cfg_.core_wait_s)) {
        return invalid_argument_error(
            fmt::format("simulator: core wait {} s: must be finite and >= 0", cfg_.core_wait_s));
    }
    for (size_t row = 0; row < cfg_.step_wait.decode.size(); ++row) {
        const cost::StepWaitChance& w = cfg_.step_wait.decode[row];
        if (!(w.chance >= 0 && w.chance <= 1) || !(w.wait_s >= 0) || !std::isfinite(w.wait_s)) {
            return invalid_argument_error(fmt::format(
                "simulator: step wait with {} competitor(s): chance {} must be in [0, 1] and "
                "wait {} s finite and >= 0",
                row + 1, w.chance, w.wait_s));
        }
    }
    for (size_t i = 1; i < trace_.size(); ++i) {
        if (trace_[i].arrival_ms < trace_[i - 1].arrival_ms) {
            return invalid_argument_error(fmt::format(
                "simulator: requests are not sorted by arrival (request {} at "
                "{} ms after request {} at {} ms)",
                trace_[i].id, trace_[i].arrival_ms, trace_[i - 1].id, trace_[i - 1].arrival_ms));
        }
    }
    return {};
}

Status Simulation::setup() {
    PDSIM_RETURN_IF_ERROR(check_config());
    const topo::Topology& t = cfg_.topology;
    const size_t n = t.instances.size();
    colocated_ = cfg_.mode == SimMode::kColocated;
    admission_.reserve_output = cfg_.reserve_output;
    std::vector<bool> is_prefill;
    bool any_prefill = false, any_decode = false;
    insts_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const InstanceSetup& s = cfg_.instances[i];
        if (s.cost == nullptr || s.kv_pages < 0) {
            return invalid_argument_error(fmt::format(
                "simulator: instance {}: no cost model or negative KV pages", t.instances[i].id));
        }
        const bool p = t.instances[i].role == topo::Role::kPrefill;
        is_prefill.push_back(p);
        any_prefill |= p;
        any_decode |= t.instances[i].role == topo::Role::kDecode;
        const InstanceRole role = colocated_ ? InstanceRole::kColocated
                                             : (p ? InstanceRole::kPrefill : InstanceRole::kDecode);
        const bool cache = cfg_.prefix_cache && role != InstanceRole::kDecode;
        const model::ModelConfig& m = cfg_.model;
        // A sliding layer keeps the window on a decode instance, the window before a chunk and
        // the chunk where prompts are computed (kv_groups.h).
        const int64_t chunk = std::min(cfg_.batching.chunk_size, cfg_.batching.max_batch_tokens);
        const int64_t span = role == InstanceRole::kDecode
                                 ? std::max(1, m.sliding_window)
                                 : std::max<int64_t>(1, int64_t{m.sliding_window} - 1 + chunk);
        const KvFootprint footprint =
            kv_footprint(m, t.instances[i].tp, s.kv_dtype_bytes, cfg_.page_size, span);
        insts_.emplace_back(static_cast<int>(i), role, s.cost.get(),
                            KvCache(s.kv_pages, footprint, cache));
        transfer_bytes_.push_back(kv_transfer_bytes(m, s.kv_dtype_bytes));
    }
    if (n == 0 || (!colocated_ && (!any_prefill || !any_decode))) {
        return invalid_argument_error(
            fmt::format("{}: the disaggregated mode needs a prefill and a decode instance{}",
                        cfg_.topology_label,
                        n > 0 && !any_prefill && !any_decode
                            ? " (its instances are colocated: run the colocated mode)"
                            : ""));
    }
    std::vector<int> cpu_cores(n, 0);
    std::vector<const cost::CostModel*> costs;
    for (const Instance& x : insts_) costs.push_back(x.cost);
    if (cfg_.cpu_contention) {
        for (size_t i = 0; i < n; ++i) cpu_cores[i] = cfg_.instances[i].cpu_cores;
    }
    if (!cfg_.rank_core.empty()) {
        if (std::ssize(cfg_.rank_core) != t.num_ranks()) {
            return invalid_argument_error(fmt::format("{}: {} rank cores for {} ranks",
                                                      cfg_.topology_label, cfg_.rank_core.size(),
                                                      t.num_ranks()));
        }
        for (size_t r = 0; r < cfg_.rank_core.size(); ++r) {
            if (cfg_.rank_core[r] < 0) {
                return invalid_argument_error(fmt::format("{}: rank {} core {}: must be >= 0",
                                                          cfg_.topology_label, r,
                                                          cfg_.rank_core[r]));
            }
        }
    }
    contention_ = CpuContention::plan(t, cpu_cores, costs, cfg_.node_cpus, cfg_.rank_core);
    noise_.resize(n);
    if (cfg_.cost_noise) {
        for (const Instance& x : insts_) {
            ForwardNoise& nz = noise_[static_cast<size_t>(x.index)];
            nz = ForwardNoise(x.cost->noise(false), x.cost->noise(true),
                              noise_seed_for(cfg_.noise_seed, x.index));
            noisy_ |= nz.any();
        }
    }
    if (!cfg_.step_wait.decode.empty()) {
        constexpr uint64_t kStepWaitSalt = 0x5354455057414954ULL;  // "STEPWAIT"
        for (const Instance& x : insts_) {
            step_rng_.emplace_back(noise_seed_for(cfg_.noise_seed ^ kStepWaitSalt, x.index));
        }
    }
    lb_ = std::make_unique<policy::LoadBalancer>(is_prefill, colocated_);
    if (!colocated_) {
        PDSIM_ASSIGN_OR_RETURN(routes_,
                               RouteTable::build(t, cfg_.model, net_, cfg_.topology_label));
        stats_.bundled_lanes = routes_.bundled();
    }
    records_.resize(trace_.size());
    return {};
}

// ------------------------------------------------------------------------------------------------
// Arrivals and terminal requests

void Simulation::on_arrivals() {
    std::vector<int>& touched = touched_;
    touched.clear();
    const double now = loop_.now();
    while (next_arrival_ < trace_.size() && trace_[next_arrival_].arrival_ms / 1000.0 <= now) {
        arrive(static_cast<uint32_t>(next_arrival_++), &touched);
    }
    if (next_arrival_ < trace_.size()) {
        loop_.schedule_at(std::max(now, trace_[next_arrival_].arrival_ms / 1000.0),
                          [this] { on_arrivals(); });
    }
    for (int i : touched) kick(inst(i));
}

void Simulation::arrive(uint32_t trace_index, std::vector<int>* touched) {
    const workload::Request& q = trace_[trace_index];
    RequestRecord& rec = records_[trace_index];
    rec.id = q.id;
    rec.arrival_ms = q.arrival_ms;
    rec.input_len = q.input_len;
    rec.output_len = q.output_len;
    const int32_t input_len = std::max<int32_t>(q.input_len, 1);
    const int32_t output_len = std::max<int32_t>(q.output_len, 1);
    const policy::Assignment placement = lb_->assign(input_len, output_len);
    rec.prefill_instance = placement.prefill;
    rec.decode_instance = placement.decode;
    Instance& p = inst(placement.prefill);
    Instance& d = inst(placement.decode);
    const int64_t p_need = p.kv.pages_for(colocated_ ? int64_t{input_len} + output_len : input_len);
    const int64_t d_need = d.kv.pages_for(int64_t{input_len} + output_len);
    if (p_need > p.kv.capacity()) {
        return fail(trace_index, placement,
                    fmt::format("needs {} KV pages on instance {}, which has {}", p_need,
                                cfg_.topology.instances[static_cast<size_t>(placement.prefill)].id,
                                p.kv.capacity()));
    }
    if (!colocated_ && d_need > d.kv.capacity()) {
        return fail(trace_index, placement,
                    fmt::format("needs {} KV pages on instance {}, which has {}", d_need,
                                cfg_.topology.instances[static_cast<size_t>(placement.decode)].id,
                                d.kv.capacity()));
    }
    const uint32_t s = reqs_.acquire();
    SimRequest& r = reqs_[s];
    r.trace_index = trace_index;
    r.input_len = input_len;
    r.output_len = output_len;
    r.placement = placement;
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

void Simulation::fail(uint32_t trace_index, const policy::Assignment& placement, std::string why) {
    RequestRecord& rec = records_[trace_index];
    rec.ok = false;
    rec.error = std::move(why);
    lb_->finished(placement, std::max(rec.input_len, 1), std::max(rec.output_len, 1), false);
    terminal(rec);
}

void Simulation::terminal(RequestRecord& rec) {
    ++finished_;
    timeline_.request(static_cast<size_t>(&rec - records_.data()), rec);
    if (cfg_.on_request_done) cfg_.on_request_done(rec);
}

void Simulation::finish(uint32_t slot) {
    SimRequest& r = reqs_[slot];
    RequestRecord& rec = records_[r.trace_index];
    rec.first_token_ms = r.first_token_s * 1000;
    rec.finish_ms = loop_.now() * 1000;
    rec.generated = r.generated;
    rec.ok = true;
    lb_->finished(r.placement, r.input_len, r.output_len, r.prefill_released);
    Instance& d = inst(r.placement.decode);
    if (colocated_) {
        d.kv.release(hashes(r), r.pinned_blocks, full_blocks(r), r.compute_pages);
    } else {
        d.kv.free(r.decode_pages);
    }
    --in_flight_;
    reqs_.release(slot);
    terminal(rec);
}

// ------------------------------------------------------------------------------------------------
// Instances

void Simulation::start_next(Instance& x) {
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

void Simulation::admit(Instance& x) {
    while (!x.waiting.empty()) {
        const uint32_t s = x.waiting.front();
        SimRequest& r = reqs_[s];
        const Admission a = admit_front(x, r, trace_, admission_, &stats_.prefix_hit_tokens);
        if (a == Admission::kBlocked) return;
        if (a == Admission::kDecodeSide && r.pending_bytes > 0) {
            // KV computed before this admission: it goes now, uncapped.
            const double b = r.pending_bytes;
            r.pending_bytes = 0;
            start_flows(std::span(&s, 1), b, 0, nullptr);
        }
    }
}

void Simulation::start_extend(Instance& x) {
    const int64_t tokens = plan_extend(x, reqs_, cfg_.batching, &items_);
    double dur = x.cost->extend_s(items_);
    PDSIM_CHECK_MSG(dur >= 0 && std::isfinite(dur), "cost model: extend time {}", dur);
    if (noisy_) dur = noise_[static_cast<size_t>(x.index)].apply(false, loop_.now(), dur);
    dur = with_wake(x, dur);
    x.busy = true;
    x.forward_is_extend = true;
    x.forward_start_s = loop_.now();
    for (const ExtendEntry& e : x.extend_batch) {
        RequestRecord& rec = records_[reqs_[e.slot].trace_index];
        if (rec.prefill_start_ms < 0) rec.prefill_start_ms = loop_.now() * 1000;
    }
    ++stats_.extend_forwards;
    if (x.role == InstanceRole::kPrefill) start_extend_flows(x, dur);
    x.forward_batch_size = x.extend_batch.size();
    x.forward_tokens = tokens;
    schedule_forward_end(x, dur);
}

// The batch's chunks to one decode instance go as one flow: the sender sends layer by layer
// across the batch, so their last layers land together.
void Simulation::start_extend_flows(Instance& x, double duration_s) {
    const double now = loop_.now();
    flow_items_.clear();
    for (ExtendEntry& e : x.extend_batch) {
        SimRequest& r = reqs_[e.slot];
        r.last_forward_start_s = now;
        const double b = chunk_bytes(r, r.computed_tokens, e.tokens);
        r.transfer_bytes += b;
        if (cfg_.layerwise && r.decode_admitted) {
            flow_items_.emplace_back(e.slot, b);
            e.flow_started = true;
        }
        if (r.unsent_hit_tokens > 0) {
            // A prefix hit's KV is already written: it goes with the first chunk, uncapped.
            const double hit_bytes = chunk_bytes(r, 0, r.unsent_hit_tokens);
            r.unsent_hit_tokens = 0;
            r.transfer_bytes += hit_bytes;
            if (cfg_.layerwise && r.decode_admitted) {
                start_flows(std::span(&e.slot, 1), hit_bytes, 0, nullptr);
            } else {
                e.hit_bytes = hit_bytes;
            }
        }
    }
    start_batch_flows(flow_items_, duration_s, &x);
}

bool Simulation::start_decode(Instance& x) {
    const size_t n = plan_decode(x, reqs_, cfg_.batching, colocated_, trace_, &stats_.preemptions);
    if (n == 0) return false;
    const int64_t kv_tokens = decode_kv_tokens(x, reqs_, n);
    double dur = x.cost->decode_s(static_cast<int64_t>(n), kv_tokens);
    PDSIM_CHECK_MSG(dur >= 0 && std::isfinite(dur), "cost model: decode time {}", dur);
    if (noisy_) dur = noise_[static_cast<size_t>(x.index)].apply(true, loop_.now(), dur);
    dur = with_wake(x, dur);
    x.busy = true;
    x.forward_is_extend = false;
    x.decode_batch_size = n;
    x.forward_start_s = loop_.now();
    ++stats_.decode_forwards;
    x.forward_batch_size = n;
    x.forward_tokens = 0;
    schedule_forward_end(x, dur);
    return true;
}

// A forward of modelled duration `dur` starting now on `x`, with the warm-up that follows an idle
// period (cost::CostWake) added: a forward after min_idle_s without one begins a new warm-up, and
// the warm-up's clock is the modelled forward time since then (as calibrate measured it: forwards
// back to back).
double Simulation::with_wake(Instance& x, double dur) {
    if (!x.wake.any()) return dur;
    if (loop_.now() - x.last_forward_end_s >= x.wake.min_idle_s) x.warm_work_s = 0;
    const double extra = x.wake.extra_s(x.warm_work_s, dur);
    x.warm_work_s += dur;
    return dur + extra;
}

void Simulation::on_forward_end(int i) {
    Instance& x = inst(i);
    x.last_forward_end_s = loop_.now();
    if (contention_.contended(i)) {
        const int node = contention_.end_forward(i);
        if (contention_.forward(i).slowed) ++stats_.contended_forwards;
        // Its real duration is known only now.
        timeline_.forward(i, x.forward_is_extend, x.forward_start_s,
                          loop_.now() - x.forward_start_s, x.forward_batch_size, x.forward_tokens);
        reshare(node, nullptr);
    }
    x.busy = false;
    if (x.forward_is_extend) {
        end_extend(x);
    } else {
        end_decode(x);
    }
    for (uint32_t s : x.ready) deliver(s);
    x.ready.clear();
    const bool more_work = !x.running.empty() || !x.waiting.empty() || !x.extend_q.empty();
    const double wait_s = !x.forward_is_extend && more_work ? step_wait_s(i) : 0.0;
    if (wait_s > 0) {
        // Its thread waits out a scheduler slice: work that arrives meanwhile waits with it. It
        // was runnable, not idle: the wait does not start a warm-up (with_wake).
        ++stats_.step_waits;
        x.last_forward_end_s = loop_.now() + wait_s;
        start_after(x, wait_s);
        return;
    }
    // Straight on: what else is due at this instant and was scheduled earlier has run already.
    start_next(x);
}

double Simulation::step_wait_s(int i) {
    const std::vector<cost::StepWaitChance>& table = cfg_.step_wait.decode;
    if (table.empty()) return 0;
    const int n = contention_.competitors(i);
    if (n == 0) return 0;
    const cost::StepWaitChance& w = table[std::min(table.size(), static_cast<size_t>(n)) - 1];
    const double u =
        std::uniform_real_distribution<double>(0, 1)(step_rng_[static_cast<size_t>(i)]);
    return u < w.chance ? w.wait_s : 0.0;
}

void Simulation::end_extend(Instance& x) {
    // The forward's entries are the first entries of the queue: drop those it completed.
    retire_extend_batch(x, reqs_, &scratch_);
    // Uncap what the links held back; a flow that kept pace with its cap is done (or within
    // rounding of it) and needs no rate change.
    for (auto [f, bytes] : x.capped_flows) {
        if (net_.remaining_bytes(f) > 1e-9 * bytes) net_.set_rate_cap(f, 0);
    }
    x.capped_flows.clear();
    if (x.role == InstanceRole::kPrefill) return end_prefill_extend(x);
    const double now = loop_.now();
    for (const ExtendEntry& e : x.extend_batch) {
        SimRequest& r = reqs_[e.slot];
        r.computed_tokens += e.tokens;
        stats_.prefill_tokens += e.tokens;
        if (r.computed_tokens < r.target_tokens) continue;
        // Colocated prefill or a recompute: samples the next token.
        r.needs_recompute = false;
        ++r.generated;
        if (r.first_token_s < 0) {
            r.first_token_s = now;
            lb_->prefill_done(r.placement, r.input_len);
            r.prefill_released = true;
        }
        if (r.generated >= r.output_len) {
            finish(e.slot);
        } else {
            x.running.push_back(e.slot);
        }
    }
}

// A prefill instance's extend ended: the chunks' KV that did not stream with the forward goes now
// (or waits for the decode admission); completed prompts may have their whole KV.
void Simulation::end_prefill_extend(Instance& x) {
    const double now = loop_.now();
    flow_items_.clear();
    for (const ExtendEntry& e : x.extend_batch) {
        SimRequest& r = reqs_[e.slot];
        r.computed_tokens += e.tokens;
        stats_.prefill_tokens += e.tokens;
        if (!e.flow_started || e.hit_bytes > 0) {
            // computed_tokens already counts this chunk.
            const double b =
                (e.flow_started ? 0 : chunk_bytes(r, r.computed_tokens - e.tokens, e.tokens)) +
                e.hit_bytes;
            if (r.decode_admitted) {
                flow_items_.emplace_back(e.slot, b);
            } else {
                r.pending_bytes += b;
            }
        }
    }
    start_batch_flows(flow_items_, 0, nullptr);
    for (const ExtendEntry& e : x.extend_batch) {
        SimRequest& r = reqs_[e.slot];
        if (r.computed_tokens >= r.target_tokens) {
            r.prompt_computed = true;
            r.last_forward_end_s = now;
            maybe_kv_complete(e.slot);
        }
    }
}

void Simulation::end_decode(Instance& x) {
    retire_decode_batch(x, reqs_, &scratch_);
    for (uint32_t s : scratch_) finish(s);
}

// The decode instance has the whole KV and the first token: the request joins the batch.
void Simulation::deliver(uint32_t slot) {
    SimRequest& r = reqs_[slot];
    r.first_token_s = loop_.now();
    r.generated = 1;
    if (r.generated >= r.output_len) {
        finish(slot);
    } else {
        inst(r.placement.decode).running.push_back(slot);
    }
}

// ------------------------------------------------------------------------------------------------
// CPU core contention

void Simulation::schedule_forward_end(Instance& x, double dur) {
    if (!contention_.contended(x.index)) {
        timeline_.forward(x.index, x.forward_is_extend, loop_.now(), dur, x.forward_batch_size,
                          x.forward_tokens);
        loop_.schedule(dur, [this, i = x.index] { on_forward_end(i); });
        return;
    }
    contention_.start_forward(x.index, dur, !x.forward_is_extend, loop_.now());
    reshare(contention_.forward(x.index).node, &x);
}

void Simulation::reshare(int node, Instance* fresh) {
    const double now = loop_.now();
    for (const auto& [rate, i] : contention_.share(node)) {
        Instance& y = inst(i);
        CpuForward& f = contention_.forward(i);
        if (&y != fresh) {
            if (rate == f.rate_cores) continue;
            f.advance(now);
            loop_.cancel(f.end_event);
        }
        const double left_s = f.retime(rate, now);
        f.end_event = loop_.schedule(left_s, [this, i] { on_forward_end(i); });
        if (&y != fresh || rate < f.cores) set_caps(y);
    }
}

// A layerwise flow may not overtake its forward: its cap follows the forward's progress rate.
void Simulation::set_caps(Instance& x) {
    const CpuForward& f = contention_.forward(x.index);
    if (f.isolated_s <= 0) return;
    for (auto [flow, bytes] : x.capped_flows) {
        if (net_.remaining_bytes(flow) > 1e-9 * bytes) {
            net_.set_rate_cap(flow, bytes / f.isolated_s * (f.rate_cores / f.cores));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Transfer

void Simulation::start_batch_flows(std::vector<std::pair<uint32_t, double>>& items, double duration,
                                   Instance* capped_on) {
    std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
        return reqs_[a.first].placement.decode < reqs_[b.first].placement.decode;
    });
    for (size_t i = 0; i < items.size();) {
        const int d = reqs_[items[i].first].placement.decode;
        double bytes = 0;
        members_.clear();
        for (; i < items.size() && reqs_[items[i].first].placement.decode == d; ++i) {
            bytes += items[i].second;
            members_.push_back(items[i].first);
        }
        start_flows(members_, bytes, duration, capped_on);
    }
}

void Simulation::start_flows(std::span<const uint32_t> members, double bytes, double duration,
                             Instance* capped_on) {
    const Route& rt = route(reqs_[members.front()]);
    const double now = loop_.now();
    for (uint32_t s : members) {
        SimRequest& r = reqs_[s];
        if (r.first_flow_s < 0) r.first_flow_s = now;
        r.flows_in_flight += static_cast<int32_t>(rt.lanes.size());
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
        transfer_.flow_started(now);
        ++stats_.flows;
        const FlowId f = net_.start_flow(
            lane.path, b, lane.latency_s, [this, g] { on_flow_done(g); }, cap);
        if (capped_on != nullptr && cap > 0) capped_on->capped_flows.emplace_back(f, b);
    }
}

void Simulation::on_flow_done(uint32_t g) {
    transfer_.flow_done(loop_.now());
    const bool last = --groups_[g].lanes_left == 0;
    // By index: completing a request can start other flows (and grow groups_).
    for (size_t i = 0; i < groups_[g].members.size(); ++i) {
        const uint32_t s = groups_[g].members[i];
        --reqs_[s].flows_in_flight;
        maybe_kv_complete(s);
    }
    if (last) free_groups_.push_back(g);
}

void Simulation::maybe_kv_complete(uint32_t slot) {
    SimRequest& r = reqs_[slot];
    if (r.kv_complete || !r.prompt_computed || r.flows_in_flight > 0 || r.pending_bytes > 0 ||
        !r.decode_admitted) {
        return;
    }
    r.kv_complete = true;
    const KvTransferFigures figures = kv_transfer_figures(
        loop_.now(), r.first_flow_s, r.last_forward_start_s, r.last_forward_end_s,
        route(r).latency_s, cfg_.model.num_layers, cfg_.layerwise);
    transfer_.add_request(r.transfer_bytes, figures);
    const KvGroupBytes g =
        transfer_bytes_[static_cast<size_t>(r.placement.prefill)].request(r.input_len);
    transfer_.add_groups(g.full * route(r).total_share, g.sliding * route(r).total_share, g.state);
    RequestRecord& rec = records_[r.trace_index];
    rec.transfer_bytes = static_cast<int64_t>(std::llround(r.transfer_bytes));
    rec.transfer_ms = figures.transfer_s * 1000;
    rec.exposed_transfer_ms = figures.exposed_s * 1000;
    timeline_.transfer(r.trace_index, r.placement.prefill, rec, r.first_flow_s, figures);
    release_prefill(r);
    Instance& d = inst(r.placement.decode);
    if (d.busy) {
        d.ready.push_back(slot);
    } else {
        deliver(slot);
    }
    kick(inst(r.placement.prefill));
    kick(d);
}

// The prefill side is done with a request: its pages (into the prefix cache) and routing load.
void Simulation::release_prefill(SimRequest& r) {
    Instance& p = inst(r.placement.prefill);
    p.kv.release(hashes(r), r.pinned_blocks, full_blocks(r), r.compute_pages);
    r.compute_pages = 0;
    r.pinned_blocks = 0;
    lb_->prefill_done(r.placement, r.input_len);
    r.prefill_released = true;
}

// ------------------------------------------------------------------------------------------------
// Driver

double thread_cpu_s() {
    return this_thread_cpu_us() * 1e-6;
}

void Simulation::run() {
    const double cpu0 = thread_cpu_s();
    const auto t0 = std::chrono::steady_clock::now();
    auto wall = [&] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    std::vector<InstanceRole> roles;
    for (const Instance& x : insts_) roles.push_back(x.role);
    timeline_.name_tracks(cfg_.topology, cfg_.mode, roles);
    if (!trace_.empty()) {
        loop_.schedule_at(trace_.front().arrival_ms / 1000.0, [this] { on_arrivals(); });
    }
    double next_progress = cfg_.progress_interval_s;
    uint64_t k = 0;
    while (loop_.step()) {
        if (cfg_.on_progress && (++k % kProgressEvery) == 0 && wall() >= next_progress) {
            next_progress = wall() + cfg_.progress_interval_s;
            cfg_.on_progress(SimProgress{finished_, static_cast<int64_t>(trace_.size()),
                                         loop_.now(), wall(), loop_.events_run()});
        }
    }
    // Nothing is left to happen; anything unfinished is a scheduling bug, reported not hidden.
    const std::vector<bool> free = reqs_.free_mask();
    for (uint32_t s = 0; s < reqs_.size() && in_flight_ > 0; ++s) {
        if (free[s]) continue;
        RequestRecord& rec = records_[reqs_[s].trace_index];
        rec.ok = false;
        rec.error = "the simulation ended with the request unfinished (stalled)";
        terminal(rec);
    }
    stats_.events = loop_.events_run();
    stats_.sim_s = loop_.now();
    stats_.wall_s = wall();
    stats_.cpu_s = thread_cpu_s() - cpu0;
    if (cfg_.on_progress) {
        cfg_.on_progress(SimProgress{finished_, static_cast<int64_t>(trace_.size()), loop_.now(),
                                     stats_.wall_s, stats_.events});
    }
}

SimResult Simulation::result() {
    std::vector<InstanceSummary> instances;
    for (const Instance& x : insts_) {
        instances.push_back(InstanceSummary{
            cfg_.topology.instances[static_cast<size_t>(x.index)].id, x.cost->describe(),
            x.kv.capacity(), x.kv.evicted_blocks(), x.kv.cached_blocks(), x.kv.footprint()});
    }
    std::vector<double> contended_cores;
    for (const CpuContention::Node& node : contention_.nodes()) {
        contended_cores.push_back(node.cores);
    }
    SimResult res;
    res.report =
        build_report(cfg_, records_, stats_, transfer_, instances, contended_cores, noisy_);
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
