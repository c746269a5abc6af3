#include "sim/des/instances.h"

#include <algorithm>

#include "common/check.h"

namespace pdsim::des {

namespace {
constexpr int64_t kBlock = workload::kHashBlockTokens;

int64_t full_blocks(const SimRequest& r) {
    return r.input_len / kBlock;
}

std::span<const int64_t> hashes_of(const SimRequest& r, std::span<const workload::Request> trace) {
    return trace[r.trace_index].hash_ids;
}
}  // namespace

Admission admit_front(Instance& x, SimRequest& r, std::span<const int64_t> hashes,
                      const AdmissionOptions& options, int64_t* hit_tokens) {
    *hit_tokens = 0;
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
    if (x.kv.prefix_cache()) {
        // Whole blocks of the prompt only, and at least one token left to compute.
        const int64_t max_blocks = std::min<int64_t>(
            {full_blocks(r), (tokens - 1) / kBlock, static_cast<int64_t>(hashes.size())});
        hit_blocks = x.kv.match(hashes.first(static_cast<size_t>(max_blocks)));
        x.kv.pin(hashes, hit_blocks);
    }
    const int64_t held = options.reserve_output && x.role != InstanceRole::kPrefill
                             ? int64_t{r.input_len} + r.output_len
                             : tokens;
    const int64_t need = x.kv.pages_for(held - hit_blocks * kBlock);
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
    r.computed_tokens = hit_blocks * kBlock;
    if (x.role == InstanceRole::kPrefill) r.unsent_hit_tokens = hit_blocks * kBlock;
    *hit_tokens = hit_blocks * kBlock;
    x.extend_q.push_back(slot);
    return Admission::kCompute;
}

int64_t plan_extend(Instance& x, const RequestSlots& requests,
                    const policy::BatchingOptions& batching, std::vector<cost::ExtendItem>* items) {
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

size_t plan_decode(Instance& x, RequestSlots& requests, const policy::BatchingOptions& batching,
                   bool colocated, std::span<const workload::Request> trace, int64_t* preemptions) {
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
        const int64_t pinned_tokens = colocated ? r.pinned_blocks * kBlock : 0;
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

int64_t decode_kv_tokens(const Instance& x, const RequestSlots& requests, size_t n) {
    int64_t kv_tokens = 0;
    for (size_t j = 0; j < n; ++j) {
        const SimRequest& r = requests[x.running[j]];
        kv_tokens += int64_t{r.input_len} + r.generated;
    }
    return kv_tokens;
}

void preempt_newest(Instance& x, RequestSlots& requests, bool colocated,
                    std::span<const workload::Request> trace) {
    const uint32_t slot = x.running.back();
    x.running.pop_back();
    SimRequest& r = requests[slot];
    if (colocated) {
        x.kv.release(hashes_of(r, trace), r.pinned_blocks, full_blocks(r), r.compute_pages);
        r.compute_pages = 0;
        r.pinned_blocks = 0;
    } else {
        x.kv.free(r.decode_pages);
        r.decode_pages = 0;
    }
    r.needs_recompute = true;
    x.waiting.push_front(slot);
}

void retire_extend_batch(Instance& x, const RequestSlots& requests,
                         std::vector<uint32_t>* scratch) {
    scratch->clear();
    for (const ExtendEntry& e : x.extend_batch) {
        const SimRequest& r = requests[e.slot];
        if (r.computed_tokens + e.tokens < r.target_tokens) scratch->push_back(e.slot);
        x.extend_q.pop_front();
    }
    for (auto it = scratch->rbegin(); it != scratch->rend(); ++it) x.extend_q.push_front(*it);
}

void retire_decode_batch(Instance& x, RequestSlots& requests, std::vector<uint32_t>* finished) {
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
