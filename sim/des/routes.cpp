#include "sim/des/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace pdsim::des {

namespace {

// A lane as topology resources: link l direction d -> 2l + d; NIC k direction d -> 2L + 2k + d.
struct ResourceLane {
    std::vector<int> resources;
    double share = 0;
    double latency_s = 0;
};

// The topology's resources and their capacities (bytes per second; 0 until a lane crosses one).
class Resources {
public:
    explicit Resources(const topo::Topology& topology)
        : topology_(topology), num_links_(static_cast<int>(topology.links.size())) {
        for (const auto& node : topology.nodes) {
            for (const auto& nic : node.nics) {
                nics_.emplace(nic.id, std::pair{static_cast<int>(nics_.size()), nic.gbps});
            }
        }
        capacity_.assign(static_cast<size_t>(2 * num_links_) + 2 * nics_.size(), 0);
    }

    // The resources of the path `path` from device `from`, in path order.
    void add_path(const topo::PathInfo& path, const std::string& from, ResourceLane* lane) {
        std::string cur = from;
        for (const topo::Link* link : path.links) {
            const int link_index = static_cast<int>(link - topology_.links.data());
            const int dir = link->a == cur ? 0 : 1;
            const std::string& next = dir == 0 ? link->b : link->a;
            lane->resources.push_back(2 * link_index + dir);
            capacity_[static_cast<size_t>(2 * link_index + dir)] = link->gbps * 1e9;
            if (auto it = nics_.find(next); it != nics_.end() && it->second.second > 0) {
                // Into the NIC from its own node: transmit; from the fabric: receive.
                const int nic_dir =
                    topology_.node_index_of(cur) == topology_.node_index_of(next) ? 0 : 1;
                const int r = 2 * num_links_ + 2 * it->second.first + nic_dir;
                lane->resources.push_back(r);
                capacity_[static_cast<size_t>(r)] = it->second.second * 1e9;
            }
            cur = next;
        }
    }
    [[nodiscard]] const std::vector<double>& capacity() const { return capacity_; }

private:
    const topo::Topology& topology_;
    int num_links_;
    std::unordered_map<std::string, std::pair<int, double>> nics_;  // id -> (index, gbps)
    std::vector<double> capacity_;
};

// The resource lanes of every prefill -> decode pair, [p * n + d].
StatusOr<std::vector<std::vector<ResourceLane>>> resource_lanes(const topo::Topology& t,
                                                                const model::ModelConfig& model,
                                                                Resources& resources,
                                                                std::string_view label) {
    const size_t n = t.instances.size();
    topo::PathFinder finder(t);
    std::vector<std::vector<ResourceLane>> lanes(n * n);
    for (size_t p = 0; p < n; ++p) {
        const topo::Instance& prefill = t.instances[p];
        if (prefill.role != topo::Role::kPrefill) continue;
        for (size_t d = 0; d < n; ++d) {
            const topo::Instance& decode = t.instances[d];
            if (decode.role != topo::Role::kDecode) continue;
            for (const KvRankPair& pair : kv_rank_pairs(model, prefill.tp, decode.tp)) {
                const std::string& from = prefill.devices[static_cast<size_t>(pair.prefill_rank)];
                const std::string& to = decode.devices[static_cast<size_t>(pair.decode_rank)];
                const topo::PathInfo path = finder.path_info(from, to);
                if (!path.found) {
                    return Status(StatusCode::kInvalidArgument,
                                  fmt::format("{}: no path from {} ({}) to {} ({}) for the KV "
                                              "transfer",
                                              label, from, prefill.id, to, decode.id));
                }
                ResourceLane lane{{}, pair.share, path.latency_us * 1e-6};
                resources.add_path(path, from, &lane);
                lanes[p * n + d].push_back(std::move(lane));
            }
        }
    }
    return lanes;
}

// Whether every resource carries the same share of every chunk that crosses it; fills that share
// per resource (-1: crossed by none).
bool symmetric_shares(const std::vector<std::vector<ResourceLane>>& lanes,
                      std::vector<double>* resource_share) {
    bool consistent = true;
    for (const auto& route_lanes : lanes) {
        std::map<int, double> shares;
        for (const auto& lane : route_lanes) {
            for (int r : lane.resources) shares[r] += lane.share;
        }
        for (auto [r, share] : shares) {
            double& known = (*resource_share)[static_cast<size_t>(r)];
            if (known < 0) {
                known = share;
            } else if (std::abs(known - share) > 1e-9 * std::max(1.0, share)) {
                consistent = false;
            }
        }
    }
    return consistent;
}

// A flow unit: a whole route when bundled, else each lane.
struct FlowUnit {
    size_t route;
    Lane lane;
    std::vector<int> resources;
};

// Fills each route's share and latency and returns its flow units.
std::vector<FlowUnit> flow_units(const std::vector<std::vector<ResourceLane>>& lanes, bool bundle,
                                 std::vector<Route>* routes) {
    std::vector<FlowUnit> units;
    for (size_t k = 0; k < lanes.size(); ++k) {
        Route& route = (*routes)[k];
        route.total_share = 0;
        for (const auto& lane : lanes[k]) {
            route.total_share += lane.share;
            route.latency_s = std::max(route.latency_s, lane.latency_s);
        }
        if (lanes[k].empty()) continue;
        if (bundle) {
            std::set<int> all;
            for (const auto& lane : lanes[k]) {
                all.insert(lane.resources.begin(), lane.resources.end());
            }
            units.push_back(FlowUnit{k, Lane{{}, route.total_share, route.latency_s},
                                     std::vector<int>(all.begin(), all.end())});
        } else {
            for (const auto& lane : lanes[k]) {
                units.push_back(FlowUnit{k, Lane{{}, lane.share, lane.latency_s}, lane.resources});
            }
        }
    }
    return units;
}

// One FlowNetwork link per group of resources crossed by the same units; each unit's lane gets
// the links of its resources' groups (ascending ids) and joins its route.
void add_links(const std::vector<double>& capacity, const std::vector<double>& resource_share,
               bool bundle, std::vector<FlowUnit>& units, FlowNetwork& net,
               std::vector<Route>* routes) {
    std::vector<std::vector<int>> crossing(capacity.size());
    for (size_t u = 0; u < units.size(); ++u) {
        for (int r : units[u].resources) {
            crossing[static_cast<size_t>(r)].push_back(static_cast<int>(u));
        }
    }
    std::map<std::vector<int>, double> group_capacity;
    for (size_t r = 0; r < capacity.size(); ++r) {
        if (crossing[r].empty()) continue;
        const double cap = capacity[r] / (bundle ? resource_share[r] : 1.0);
        auto [it, fresh] = group_capacity.emplace(crossing[r], cap);
        if (!fresh) it->second = std::min(it->second, cap);
    }
    std::map<std::vector<int>, FlowNetwork::LinkId> group_link;
    for (const auto& [units_crossing, cap] : group_capacity) {
        group_link.emplace(units_crossing, net.add_link(cap));
    }
    for (FlowUnit& unit : units) {
        std::set<FlowNetwork::LinkId> path;
        for (int r : unit.resources) path.insert(group_link.at(crossing[static_cast<size_t>(r)]));
        unit.lane.path.assign(path.begin(), path.end());
        (*routes)[unit.route].lanes.push_back(std::move(unit.lane));
    }
}

}  // namespace

std::vector<KvRankPair> kv_rank_pairs(const model::ModelConfig& model, int tp_prefill,
                                      int tp_decode) {
    std::vector<KvRankPair> pairs;
    if (model.attention == model::AttentionKind::kMla) {
        for (int j = 0; j < tp_decode; ++j) pairs.push_back(KvRankPair{0, j, 1.0});
        return pairs;
    }
    const double heads = model.num_kv_heads;
    for (auto [i, j] : topo::tp_overlap_pairs(tp_prefill, tp_decode)) {
        const double lo = std::max(i * heads / tp_prefill, j * heads / tp_decode);
        const double hi = std::min((i + 1) * heads / tp_prefill, (j + 1) * heads / tp_decode);
        if (hi > lo) pairs.push_back(KvRankPair{i, j, (hi - lo) / heads});
    }
    return pairs;
}

StatusOr<RouteTable> RouteTable::build(const topo::Topology& topology,
                                       const model::ModelConfig& model, FlowNetwork& net,
                                       std::string_view label) {
    Resources resources(topology);
    PDSIM_ASSIGN_OR_RETURN(std::vector<std::vector<ResourceLane>> lanes,
                           resource_lanes(topology, model, resources, label));
    std::vector<double> resource_share(resources.capacity().size(), -1);
    RouteTable table;
    table.num_instances_ = topology.instances.size();
    table.bundled_ = symmetric_shares(lanes, &resource_share);
    table.routes_.assign(table.num_instances_ * table.num_instances_, Route{});
    std::vector<FlowUnit> units = flow_units(lanes, table.bundled_, &table.routes_);
    add_links(resources.capacity(), resource_share, table.bundled_, units, net, &table.routes_);
    return table;
}

}  // namespace pdsim::des
