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

#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

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
        : index(i), role(r), cost(c), kv(std::move(k)) {}

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
// Admits the front of x.waiting (request `r`, its trace block hashes `hashes`) if its pages fit:
// pops it; kCompute also pins its prefix-cache hits, sets its target and computed tokens and
// queues it on x.extend_q; *hit_tokens gets the prefix-hit tokens (0 otherwise).
// Precondition: !x.waiting.empty() and r is the request in x.waiting.front()'s slot.
Admission admit_front(Instance& x, SimRequest& r, std::span<const int64_t> hashes,
                      const AdmissionOptions& options, int64_t* hit_tokens);

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

}  // namespace pdsim::des
