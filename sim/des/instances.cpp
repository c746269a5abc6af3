#include "sim/des/instances.h"

#include <algorithm>

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

}  // namespace pdsim::des
