// KV transfer routes of the disaggregated simulator: from the topology's links to FlowNetwork
// links, and from a prefill instance's TP ranks to a decode instance's.
//
// A chunk's KV goes from the prefill instance's TP ranks to the decode instance's over one lane
// per pair of ranks whose KV heads overlap (kv_rank_pairs): a lane is the topology path between
// the two devices, carrying `share` of the chunk's base KV bytes (its heads' fraction for MHA/GQA;
// for MLA every decode rank gets rank 0's whole latent, so shares add up to the decode TP size).
// Each direction of a topology link, and each NIC's transmit and receive side, is a resource.
//
// Bundling: when every resource carries the same share of every chunk that crosses it (symmetric
// lanes, e.g. tp8 -> tp8 on DGX pairs), a route's lanes move as one flow over the union of their
// resources with each capacity divided by that share (exact, and one flow per chunk instead of one
// per lane). Resources crossed by exactly the same flow units always carry the same load, so one
// FlowNetwork link with the smallest capacity of the group stands for all of them.
//
// Thread-safety: none; build once before the simulation. Ownership: RouteTable owns its routes;
// the FlowNetwork links they name belong to the network passed to build().
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"
#include "sim/des/flow_network.h"
#include "topology/topology.h"

namespace pdsim::des {

// One flow path between a prefill and a decode instance: a pair of TP ranks, or (bundled) all of
// them as one flow.
struct Lane {
    std::vector<FlowNetwork::LinkId> path;
    double share = 1;  // of the chunk's base KV bytes this lane carries
    double latency_s = 0;
};

struct Route {
    std::vector<Lane> lanes;  // empty: no route (not a prefill -> decode pair)
    double total_share = 1;   // bytes moved per base byte (1 for MHA; tp_decode for MLA)
    double latency_s = 0;     // the slowest lane's
};

// A pair of TP ranks that exchanges KV, and the share of the base KV bytes it carries.
struct KvRankPair {
    int prefill_rank = 0;
    int decode_rank = 0;
    double share = 0;
};

// The rank pairs of a KV transfer from a tp_prefill group to a tp_decode group of `model`:
// MLA: (0, j, 1) for every decode rank j; else every pair whose head slices overlap
// (topo::tp_overlap_pairs) with the overlap's fraction of the KV heads (shares sum to 1).
// Preconditions: tp_prefill, tp_decode >= 1.
[[nodiscard]] std::vector<KvRankPair> kv_rank_pairs(const model::ModelConfig& model, int tp_prefill,
                                                    int tp_decode);

class RouteTable {
public:
    RouteTable() = default;
    // Routes between every prefill and every decode instance of `topology` (roles from the
    // topology); adds their links to `net`. kInvalidArgument, naming `label`, when two ranks of
    // a pair have no path.
    [[nodiscard]] static StatusOr<RouteTable> build(const topo::Topology& topology,
                                                    const model::ModelConfig& model,
                                                    FlowNetwork& net, std::string_view label);

    // Precondition: both indices < the topology's instance count.
    [[nodiscard]] const Route& route(int prefill, int decode) const {
        return routes_[static_cast<size_t>(prefill) * num_instances_ + static_cast<size_t>(decode)];
    }
    // True when the lanes were bundled (one flow per route).
    [[nodiscard]] bool bundled() const { return bundled_; }

private:
    std::vector<Route> routes_;  // [prefill * num_instances_ + decode]
    size_t num_instances_ = 0;
    bool bundled_ = false;
};

}  // namespace pdsim::des
