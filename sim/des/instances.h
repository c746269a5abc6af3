// The simulated instances' scheduling state and the decisions one instance makes on its own:
// admission (pages for a prompt, prefix-cache hits), building the next extend or decode batch,
// preemption when the decode pool runs out of pages, and retiring a finished forward's batch.
// The simulator (simulator.cpp) owns the clock, the transfers and the requests' lifecycles and
// calls these at the testbed's scheduling points; none of them schedules events.
//
// Requests in flight live in a RequestSlots table and are named by slot; an instance's queues
// hold slots. Page accounting: a request holds `compute_pages` (+ pinned prefix blocks) on the
// instance that computes its prompt and, disaggregated, `decode_pages` on its decode instance.
//
// Thread-safety: none (the simulator's thread). Costs: O(batch) per call, no allocation once the
// queues and scratch vectors have grown.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

#include "common/check.h"
#include "sim/cost/cost_model.h"
#include "sim/des/flow_network.h"
#include "sim/des/kv_cache.h"
#include "sim/des/reporting.h"
#include "sim/policy/batching.h"
#include "sim/policy/routing.h"
#include "sim/workload/workload.h"

namespace pdsim::des {

// A request in flight.
struct SimRequest {
    uint32_t trace_index = 0;               // position in the requests span (and the records)
    int32_t input_len = 0, output_len = 0;  // at least 1 each
    int32_t generated = 0;                  // output tokens sampled so far
    policy::Assignment placement;           // its prefill and decode instances
    int64_t target_tokens = 0;              // KV tokens the current extend work must reach
    int64_t computed_tokens = 0;            // KV tokens present on the computing instance
    int64_t pinned_blocks = 0;              // prefix blocks pinned on placement.prefill
    int64_t compute_pages = 0;              // pages on placement.prefill (colocated: all of them)
    int64_t unsent_hit_tokens = 0;          // prefix-hit tokens whose KV has not been sent (disagg)
    int64_t decode_pages = 0;               // pages on placement.decode (disaggregated)
    int32_t flows_in_flight = 0;
    double pending_bytes = 0;   // KV computed before the decode admission, not sent yet
    double transfer_bytes = 0;  // KV bytes sent so far
    double first_flow_s = -1, last_forward_start_s = -1, last_forward_end_s = -1;
    double first_token_s = -1;
    bool decode_admitted = false;  // the decode instance holds its pages
    bool prompt_computed = false;  // every extend chunk ran (disaggregated)
    bool kv_complete = false;
    bool prefill_released = false;  // the load balancer's prefill load was released
    bool needs_recompute = false;   // preempted: prompt + generated tokens to compute again
};

// Requests in flight by slot; slots are reused after release().
class RequestSlots {
public:
    // A fresh (default) request's slot.
    uint32_t acquire() {
        if (!free_.empty()) {
            const uint32_t slot = free_.back();
            free_.pop_back();
            slots_[slot] = SimRequest{};
            return slot;
        }
        slots_.emplace_back();
        return static_cast<uint32_t>(slots_.size() - 1);
    }
    void release(uint32_t slot) { free_.push_back(slot); }
    [[nodiscard]] SimRequest& operator[](uint32_t slot) { return slots_[slot]; }
    [[nodiscard]] const SimRequest& operator[](uint32_t slot) const { return slots_[slot]; }
    // Every slot ever used, and whether each is free now.
    [[nodiscard]] size_t size() const { return slots_.size(); }
    [[nodiscard]] std::vector<bool> free_mask() const {
        std::vector<bool> mask(slots_.size(), false);
        for (uint32_t slot : free_) mask[slot] = true;
        return mask;
    }

private:
    std::vector<SimRequest> slots_;
    std::vector<uint32_t> free_;
};

// One entry of an extend forward in flight.
struct ExtendEntry {
    uint32_t slot = 0;
    int64_t tokens = 0;         // computed by this forward
    bool flow_started = false;  // its flows started with the forward (layerwise, capped)
    double hit_bytes = 0;       // a prefix hit's KV to send when the forward ends (0: none / sent)
};

struct Instance {
    Instance(int i, InstanceRole r, const cost::CostModel* c, KvCache k)
        : index(i),
          role(r),
          cost(c),
          kv(std::move(k)),
          wake(c != nullptr ? c->wake() : cost::CostWake{}) {}

    int index = 0;
    InstanceRole role = InstanceRole::kPrefill;
    const cost::CostModel* cost = nullptr;  // not owned
    KvCache kv;
    std::deque<uint32_t> waiting;   // admission queue (FCFS; preempted requests at the front)
    std::deque<uint32_t> extend_q;  // admitted, KV still to compute (FCFS)
    std::vector<uint32_t> running;  // decoding, in the order they joined
    std::vector<uint32_t> ready;    // KV complete while a forward ran: first token at its end
    bool busy = false, last_was_extend = false;
    bool kick_pending = false;              // a start of the next forward is scheduled for now
    bool forward_is_extend = false;         // the forward in flight
    std::vector<ExtendEntry> extend_batch;  // extend in flight: a prefix of extend_q
    size_t decode_batch_size = 0;           // decode in flight: running[0, decode_batch_size)
    std::vector<std::pair<FlowNetwork::FlowId, double>> capped_flows;  // layerwise, and bytes
    double forward_start_s = 0;
    // The cost model's slowdown after an idle period (cost::CostWake): when the instance's last
    // forward ended (or its step wait ends: a thread waiting for the core is not idle), and the
    // modelled forward time since its current warm-up began (at the first forward after
    // min_idle_s without one).
    cost::CostWake wake;
    double last_forward_end_s = -1e300;
    double warm_work_s = 0;
    int64_t forward_tokens = 0;  // timeline: the forward's tokens and batch size
    size_t forward_batch_size = 0;
};

// How instances admit requests.
struct AdmissionOptions {
    // Decode-side and colocated admission reserves prompt + output (SimConfig::reserve_output).
    bool reserve_output = false;
};

enum class Admission : uint8_t {
    kBlocked,     // not enough pages: the request stays at the front of the queue
    kDecodeSide,  // a disaggregated decode instance took the receiver's pages
    kCompute,     // pages for computing its KV (prompt, or a preempted request's recompute)
};
// Admits the front of x.waiting (request `r`; its prefix-cache block hashes are
// trace[r.trace_index].hash_ids) if its pages fit: pops it; kCompute also pins its prefix-cache
// hits, sets its target and computed tokens, queues it on x.extend_q and adds the prefix-hit
// tokens to *prefix_hit_tokens.
// Precondition: !x.waiting.empty() and r is the request in x.waiting.front()'s slot.
Admission admit_front(Instance& x, SimRequest& r, std::span<const workload::Request> trace,
                      const AdmissionOptions& options, int64_t* prefix_hit_tokens);

// Fills x.extend_batch (and `items`, the cost model's view) with the chunks of the next extend
// forward, FCFS from x.extend_q under `batching`; returns the forward's tokens.
// Precondition: x.extend_q has a request with KV left to compute.
int64_t plan_extend(Instance& x, const RequestSlots& requests,
                    const policy::BatchingOptions& batching, std::vector<cost::ExtendItem>* items);

// The next decode batch: the first running requests that policy::DecodePlanner takes, each given
// the pages for the token it writes; when the pool is short the newest running request is
// preempted (preempt_newest) until the pages fit, and the batch stops at a request that had to
// preempt itself. Returns the batch size (0: everything was preempted); *preemptions counts them.
size_t plan_decode(Instance& x, RequestSlots& requests, const policy::BatchingOptions& batching,
                   bool colocated, std::span<const workload::Request> trace, int64_t* preemptions);
// KV tokens the decode batch running[0, n) attends to.
[[nodiscard]] int64_t decode_kv_tokens(const Instance& x, const RequestSlots& requests, size_t n);

// The newest running request gives its pages back (colocated: into the prefix cache) and waits
// at the front of x.waiting for a recompute. Precondition: !x.running.empty().
void preempt_newest(Instance& x, RequestSlots& requests, bool colocated,
                    std::span<const workload::Request> trace);

// After an extend forward: drops the batch's entries from the front of x.extend_q, keeping (in
// order, at the front) those whose KV is still incomplete. Reads computed_tokens before the
// forward's tokens are added. `scratch` is working space.
void retire_extend_batch(Instance& x, const RequestSlots& requests, std::vector<uint32_t>* scratch);

// After a decode forward: each request of the batch generated a token; those that reached their
// output length leave x.running (into *finished, in batch order), the others keep their order.
void retire_decode_batch(Instance& x, RequestSlots& requests, std::vector<uint32_t>* finished);

// ---- The calls made per admission attempt and per forward, defined here so that the
// simulator's loop can inline them (the hot path) ----

namespace instances_detail {
inline constexpr int64_t kBlock = workload::kHashBlockTokens;
}  // namespace instances_detail

inline Admission admit_front(Instance& x, SimRequest& r, std::span<const workload::Request> trace,
                             const AdmissionOptions& options, int64_t* prefix_hit_tokens) {
    if (x.role == InstanceRole::kDecode && !r.needs_recompute) {
        const int64_t need =
            x.kv.pages_for(int64_t{r.input_len} + (options.reserve_output ? r.output_len : 0));
        if (!x.kv.alloc(need)) return Admission::kBlocked;
        x.waiting.pop_front();
        r.decode_pages = need;
        r.decode_admitted = true;
        return Admission::kDecodeSide;
    }
    // A new prompt (prefill / colocated) or a preempted request's recompute.
    const int64_t tokens =
        r.needs_recompute ? int64_t{r.input_len} + r.generated : int64_t{r.input_len};
    int64_t hit_blocks = 0;
    const std::span<const int64_t> hashes = trace[r.trace_index].hash_ids;
    if (x.kv.prefix_cache()) {
        // Whole blocks of the prompt only, and at least one token left to compute.
        const int64_t max_blocks = std::min<int64_t>({r.input_len / instances_detail::kBlock,
                                                      (tokens - 1) / instances_detail::kBlock,
                                                      static_cast<int64_t>(hashes.size())});
        hit_blocks = x.kv.match(hashes.first(static_cast<size_t>(max_blocks)));
        x.kv.pin(hashes, hit_blocks);
    }
    const int64_t held = options.reserve_output && x.role != InstanceRole::kPrefill
                             ? int64_t{r.input_len} + r.output_len
                             : tokens;
    const int64_t need = x.kv.pages_for(held - hit_blocks * instances_detail::kBlock);
    if (!x.kv.alloc(need)) {
        x.kv.unpin(hashes, hit_blocks);
        return Admission::kBlocked;
    }
    const uint32_t slot = x.waiting.front();
    x.waiting.pop_front();
    if (x.role == InstanceRole::kDecode) {
        r.decode_pages = need;
    } else {
        r.compute_pages = need;
        r.pinned_blocks = hit_blocks;
    }
    r.target_tokens = tokens;
    r.computed_tokens = hit_blocks * instances_detail::kBlock;
    if (x.role == InstanceRole::kPrefill)
        r.unsent_hit_tokens = hit_blocks * instances_detail::kBlock;
    *prefix_hit_tokens += hit_blocks * instances_detail::kBlock;
    x.extend_q.push_back(slot);
    return Admission::kCompute;
}

inline int64_t plan_extend(Instance& x, const RequestSlots& requests,
                           const policy::BatchingOptions& batching,
                           std::vector<cost::ExtendItem>* items) {
    policy::ExtendPlanner plan(batching);
    items->clear();
    x.extend_batch.clear();
    for (uint32_t slot : x.extend_q) {
        if (plan.full()) break;
        const SimRequest& r = requests[slot];
        const int64_t tokens = plan.take(r.target_tokens - r.computed_tokens);
        if (tokens == 0) continue;
        items->push_back(cost::ExtendItem{tokens, r.computed_tokens});
        x.extend_batch.push_back(ExtendEntry{slot, tokens, false, 0});
    }
    PDSIM_CHECK(!x.extend_batch.empty());
    return plan.tokens();
}

inline size_t plan_decode(Instance& x, RequestSlots& requests,
                          const policy::BatchingOptions& batching, bool colocated,
                          std::span<const workload::Request> trace, int64_t* preemptions) {
    policy::DecodePlanner plan(batching);
    size_t n = 0;
    for (uint32_t slot : x.running) {
        const SimRequest& r = requests[slot];
        if (!plan.take(int64_t{r.input_len} + r.generated)) break;
        ++n;
    }
    // Pages for the token each request writes in this step; preempt the newest when short.
    for (size_t j = 0; j < n; ++j) {
        const uint32_t slot = x.running[j];
        SimRequest& r = requests[slot];
        int64_t& held = colocated ? r.compute_pages : r.decode_pages;
        const int64_t pinned_tokens = colocated ? r.pinned_blocks * instances_detail::kBlock : 0;
        const int64_t need =
            x.kv.pages_for(int64_t{r.input_len} + r.generated - pinned_tokens) - held;
        if (need <= 0) continue;
        bool preempted_itself = false;
        while (!x.kv.alloc(need)) {
            preempted_itself = x.running.back() == slot;
            preempt_newest(x, requests, colocated, trace);
            ++*preemptions;
            n = std::min(n, x.running.size());
            if (preempted_itself) break;
        }
        if (preempted_itself) break;
        held += need;
    }
    return n;
}

inline int64_t decode_kv_tokens(const Instance& x, const RequestSlots& requests, size_t n) {
    int64_t kv_tokens = 0;
    for (size_t j = 0; j < n; ++j) {
        const SimRequest& r = requests[x.running[j]];
        kv_tokens += int64_t{r.input_len} + r.generated;
    }
    return kv_tokens;
}

inline void retire_extend_batch(Instance& x, const RequestSlots& requests,
                                std::vector<uint32_t>* scratch) {
    scratch->clear();
    for (const ExtendEntry& e : x.extend_batch) {
        const SimRequest& r = requests[e.slot];
        if (r.computed_tokens + e.tokens < r.target_tokens) scratch->push_back(e.slot);
        x.extend_q.pop_front();
    }
    for (auto it = scratch->rbegin(); it != scratch->rend(); ++it) x.extend_q.push_front(*it);
}

inline void retire_decode_batch(Instance& x, RequestSlots& requests,
                                std::vector<uint32_t>* finished) {
    const size_t n = x.decode_batch_size;
    finished->clear();
    size_t kept = 0;
    for (size_t j = 0; j < n; ++j) {
        const uint32_t slot = x.running[j];
        SimRequest& r = requests[slot];
        if (++r.generated >= r.output_len) {
            finished->push_back(slot);
        } else {
            x.running[kept++] = slot;
        }
    }
    if (kept < n) {
        // The requests behind the batch keep their order.
        x.running.erase(x.running.begin() + static_cast<std::ptrdiff_t>(kept),
                        x.running.begin() + static_cast<std::ptrdiff_t>(n));
    }
}

}  // namespace pdsim::des
