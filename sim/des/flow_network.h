// Flows over links with max-min fair sharing: the simulator's model of KV transfer (and any
// other bulk traffic) over a topology.
//
// A link has a capacity in bytes per second (one direction: a duplex cable is two links). A flow
// carries a number of bytes over a path of links; at every instant each active flow gets the
// max-min fair rate given every link's capacity and every flow's own rate cap (progressive
// filling: raise all unfrozen flows' rates together; freeze the flows of a link when it is full,
// and a flow when it reaches its cap). Rates change only when a flow starts, finishes, gets more
// bytes or has its cap changed; between those instants every flow moves at a constant rate, so
// the network schedules one event per change (the earliest completion) on the EventLoop.
//
// A flow's `on_done` runs `latency_s` after its last byte left (the path's propagation and
// per-message latency). A flow with zero bytes completes after its latency alone.
//
// Rate caps model a flow whose bytes are released gradually (a layerwise KV transfer cannot go
// faster than prefill writes the layers): cap = bytes released per second; set_rate_cap(f, 0)
// removes the cap. add_bytes() appends bytes to an active flow (the next chunk's KV).
//
// Thread-safety: none; driven by the EventLoop's thread. Ownership: the network keeps a reference
// to the loop, which must outlive it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/des/event_loop.h"

namespace pdsim::des {

class FlowNetwork {
public:
    using LinkId = int32_t;
    using FlowId = int64_t;  // never 0

    explicit FlowNetwork(EventLoop& loop);
    FlowNetwork(const FlowNetwork&) = delete;
    FlowNetwork& operator=(const FlowNetwork&) = delete;

    // Precondition: bytes_per_s > 0 and finite.
    LinkId add_link(double bytes_per_s, std::string name = {});
    [[nodiscard]] size_t num_links() const;
    [[nodiscard]] const std::string& link_name(LinkId link) const;
    [[nodiscard]] double link_capacity(LinkId link) const;

    // Starts a flow now. `path` may be empty (then only the cap limits it; with no cap either, it
    // completes after `latency_s`). Preconditions: bytes >= 0, latency_s >= 0, rate_cap >= 0
    // (0: uncapped), all finite; every link id valid and no link twice in `path`. `on_done` (may
    // be empty) runs on the loop, never inside this call even when latency_s is 0; the flow is
    // gone by then. A flow counts as finished once remaining <= 1e-9 * max(1, its total bytes);
    // flows finishing at the same instant schedule their on_done in start order.
    FlowId start_flow(std::span<const LinkId> path, double bytes, double latency_s,
                      std::function<void()> on_done, double rate_cap = 0);
    // Adds bytes to a flow that has not completed; false when the flow is unknown or done (a flow
    // whose last byte leaves at exactly now() is done, even if its completion event has not run).
    // Precondition: bytes >= 0 and finite.
    bool add_bytes(FlowId flow, double bytes);
    // Changes a flow's cap (0 removes it); false when unknown or done (as for add_bytes).
    // Precondition: rate_cap >= 0 and finite.
    bool set_rate_cap(FlowId flow, double rate_cap);

    // Current state of an active flow (0 when unknown or done); remaining_bytes is projected to
    // now().
    [[nodiscard]] double rate(FlowId flow) const;
    [[nodiscard]] double remaining_bytes(FlowId flow) const;
    [[nodiscard]] size_t active_flows() const;

    // Totals since construction up to now(), for reports: bytes carried by each link, and the
    // time-integral of its utilisation (busy seconds; a link at half capacity for 2 s counts 1 s).
    [[nodiscard]] double link_bytes(LinkId link) const;
    [[nodiscard]] double link_busy_s(LinkId link) const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;

public:
    ~FlowNetwork();
};

}  // namespace pdsim::des
