#include "topology/topology.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <tuple>

namespace pdsim::topo {

std::string_view link_type_name(LinkType type) {
    switch (type) {
        case LinkType::kNvlink:
            return "nvlink";
        case LinkType::kPcie:
            return "pcie";
        case LinkType::kIb:
            return "ib";
        case LinkType::kEthernet:
            return "ethernet";
        case LinkType::kLoopback:
            return "loopback";
    }
    return "?";
}

std::optional<LinkType> parse_link_type(std::string_view name) {
    for (LinkType t : {LinkType::kNvlink, LinkType::kPcie, LinkType::kIb, LinkType::kEthernet,
                       LinkType::kLoopback}) {
        if (link_type_name(t) == name) return t;
    }
    return std::nullopt;
}

std::string_view role_name(Role role) {
    switch (role) {
        case Role::kPrefill:
            return "prefill";
        case Role::kDecode:
            return "decode";
        case Role::kColocated:
            return "colocated";
    }
    return "?";
}

std::optional<Role> parse_role(std::string_view name) {
    for (Role r : {Role::kPrefill, Role::kDecode, Role::kColocated}) {
        if (role_name(r) == name) return r;
    }
    return std::nullopt;
}

// ---- SourceInfo ----

namespace {

// "a.b[2].c" -> "a.b[2]" -> "a.b" -> "a" -> "".
std::string_view parent_path(std::string_view path) {
    const size_t dot = path.find_last_of(".[");
    return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

}  // namespace

int SourceInfo::line_of(std::string_view path) const {
    for (std::string_view p = path;; p = parent_path(p)) {
        if (auto it = lines.find(std::string(p)); it != lines.end()) return it->second;
        if (p.empty()) return 0;
    }
}

std::string SourceInfo::where(std::string_view path) const {
    const int line = line_of(path);
    const std::string_view shown = path.empty() ? std::string_view("(document)") : path;
    if (line > 0) return fmt::format("{}:{}: {}", name, line, shown);
    return fmt::format("{}: {}", name, shown);
}

// ---- RankMap ----

RankMap::RankMap(std::vector<RankInfo> ranks, std::vector<int> first_rank)
    : ranks_(std::move(ranks)), first_rank_(std::move(first_rank)) {}

int RankMap::num_prefill_ranks() const {
    return static_cast<int>(std::count_if(
        ranks_.begin(), ranks_.end(), [](const RankInfo& r) { return r.role == Role::kPrefill; }));
}

std::vector<int> RankMap::ranks_on_node(int node) const {
    std::vector<int> out;
    for (const RankInfo& r : ranks_) {
        if (r.node == node) out.push_back(r.rank);
    }
    return out;
}

std::vector<std::pair<int, int>> tp_overlap_pairs(int tp_src, int tp_dst) {
    std::vector<std::pair<int, int>> out;
    if (tp_src <= 0 || tp_dst <= 0) return out;
    // Slice i of src covers [i * tp_dst, (i + 1) * tp_dst) in units of 1 / (tp_src * tp_dst).
    for (int i = 0; i < tp_src; ++i) {
        const int64_t lo = int64_t{i} * tp_dst, hi = lo + tp_dst;
        for (int j = 0; j < tp_dst; ++j) {
            const int64_t dlo = int64_t{j} * tp_src, dhi = dlo + tp_src;
            if (lo < dhi && dlo < hi) out.emplace_back(i, j);
        }
    }
    return out;
}

// ---- Topology ----

const Device* Topology::find_device(std::string_view id) const {
    for (const Node& n : nodes) {
        for (const Device& d : n.devices) {
            if (d.id == id) return &d;
        }
    }
    return nullptr;
}

int Topology::node_index_of(std::string_view id) const {
    for (size_t i = 0; i < nodes.size(); ++i) {
        const Node& n = nodes[i];
        auto has = [&](const auto& v) {
            return std::any_of(v.begin(), v.end(), [&](const auto& e) { return e.id == id; });
        };
        if (has(n.devices) || has(n.nics) || has(n.switches)) return static_cast<int>(i);
    }
    return -1;
}

int Topology::num_devices() const {
    int n = 0;
    for (const Node& node : nodes) n += static_cast<int>(node.devices.size());
    return n;
}

int Topology::num_ranks() const {
    int64_t n = 0;
    for (const Instance& in : instances) n += std::max(in.tp, 0);
    return static_cast<int>(std::min<int64_t>(n, std::numeric_limits<int>::max()));
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int find_root(std::vector<int>& parent, int x) {
    while (parent[static_cast<size_t>(x)] != x) {
        parent[static_cast<size_t>(x)] =
            parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
        x = parent[static_cast<size_t>(x)];
    }
    return x;
}

}  // namespace

// The endpoint graph: devices (which never forward), NICs (which cap paths at their port) and
// switches, joined by the links.
struct PathFinder::Graph {
    struct Endpoint {
        bool transit = false;  // NICs and switches forward; devices do not
        double cap = kInf;     // a NIC's port bandwidth
    };
    struct Edge {
        int link;
        int to;
        double cap;  // min(link, NIC ports at either end); <= 0 or NaN: unusable
    };
    std::unordered_map<std::string_view, int> index;
    std::vector<Endpoint> endpoints;
    std::vector<std::vector<Edge>> adj;
    // Reachability: the component of each transit endpoint (union-find over usable
    // transit-transit edges); per device the sorted components it touches.
    std::vector<int> component;
    std::vector<std::vector<int>> device_components;

    explicit Graph(const Topology& t) {
        auto add = [&](std::string_view id, bool transit, double cap) {
            if (index.emplace(id, static_cast<int>(endpoints.size())).second) {
                endpoints.push_back({transit, cap});
            }
        };
        for (const Node& n : t.nodes) {
            for (const Device& d : n.devices) add(d.id, false, kInf);
            for (const Nic& nic : n.nics) add(nic.id, true, nic.gbps);
            for (const Switch& s : n.switches) add(s.id, true, kInf);
        }
        for (const Switch& s : t.switches) add(s.id, true, kInf);
        const size_t n = endpoints.size();
        adj.resize(n);
        std::vector<int> parent(n);
        for (size_t i = 0; i < n; ++i) parent[i] = static_cast<int>(i);
        for (size_t li = 0; li < t.links.size(); ++li) {
            const Link& l = t.links[li];
            const int a = find(l.a), b = find(l.b);
            if (a < 0 || b < 0 || a == b) continue;
            double cap = std::min({l.gbps, endpoints[static_cast<size_t>(a)].cap,
                                   endpoints[static_cast<size_t>(b)].cap});
            if (std::isnan(cap)) cap = 0;
            adj[static_cast<size_t>(a)].push_back({static_cast<int>(li), b, cap});
            adj[static_cast<size_t>(b)].push_back({static_cast<int>(li), a, cap});
            if (cap > 0 && endpoints[static_cast<size_t>(a)].transit &&
                endpoints[static_cast<size_t>(b)].transit) {
                parent[static_cast<size_t>(find_root(parent, a))] = find_root(parent, b);
            }
        }
        component.resize(n);
        for (size_t i = 0; i < n; ++i) component[i] = find_root(parent, static_cast<int>(i));
        device_components.resize(n);
        for (size_t i = 0; i < n; ++i) {
            if (endpoints[i].transit) continue;
            auto& comps = device_components[i];
            for (const Edge& e : adj[i]) {
                if (e.cap > 0 && endpoints[static_cast<size_t>(e.to)].transit) {
                    comps.push_back(component[static_cast<size_t>(e.to)]);
                }
            }
            std::sort(comps.begin(), comps.end());
            comps.erase(std::unique(comps.begin(), comps.end()), comps.end());
        }
    }

    [[nodiscard]] int find(std::string_view id) const {
        auto it = index.find(id);
        return it == index.end() ? -1 : it->second;
    }
};

PathFinder::PathFinder(const Topology& topology)
    : topology_(&topology), graph_(std::make_unique<const Graph>(topology)) {}
PathFinder::~PathFinder() = default;
PathFinder::PathFinder(PathFinder&&) noexcept = default;
PathFinder& PathFinder::operator=(PathFinder&&) noexcept = default;

bool PathFinder::reachable(std::string_view a, std::string_view b) const {
    const Graph& g = *graph_;
    const int src = g.find(a), dst = g.find(b);
    if (src < 0 || dst < 0) return false;
    if (src == dst) return true;
    auto comps_of = [&](int u) -> std::vector<int> {
        if (g.endpoints[static_cast<size_t>(u)].transit)
            return {g.component[static_cast<size_t>(u)]};
        return g.device_components[static_cast<size_t>(u)];
    };
    // A direct usable link (device to device, or to a transit end).
    for (const auto& e : g.adj[static_cast<size_t>(src)]) {
        if (e.to == dst && e.cap > 0) return true;
    }
    const std::vector<int> ca = comps_of(src), cb = comps_of(dst);
    for (size_t i = 0, j = 0; i < ca.size() && j < cb.size();) {
        if (ca[i] == cb[j]) return true;
        (ca[i] < cb[j]) ? ++i : ++j;
    }
    return false;
}

PathInfo PathFinder::path_info(std::string_view a, std::string_view b) const {
    PathInfo out;
    const Graph& g = *graph_;
    const std::vector<Link>& links = topology_->links;
    const int src = g.find(a), dst = g.find(b);
    if (src < 0 || dst < 0) return out;
    if (src == dst) {
        out.found = true;
        out.bottleneck_gbps = kInf;
        return out;
    }
    const size_t n = g.endpoints.size();
    auto may_expand = [&](int u) {
        return u == src || g.endpoints[static_cast<size_t>(u)].transit;
    };

    // Phase 1: the widest path's bottleneck (max-min Dijkstra).
    std::vector<double> width(n, -1.0);
    width[static_cast<size_t>(src)] = kInf;
    std::priority_queue<std::pair<double, int>> pq;
    pq.emplace(kInf, src);
    while (!pq.empty()) {
        auto [w, u] = pq.top();
        pq.pop();
        if (w < width[static_cast<size_t>(u)]) continue;
        if (u == dst) break;
        if (!may_expand(u)) continue;
        for (const auto& e : g.adj[static_cast<size_t>(u)]) {
            const double nw = std::min(w, e.cap);
            if (nw > width[static_cast<size_t>(e.to)]) {
                width[static_cast<size_t>(e.to)] = nw;
                pq.emplace(nw, e.to);
            }
        }
    }
    const double widest = width[static_cast<size_t>(dst)];
    if (!(widest > 0)) return out;

    // Phase 2: least latency, then fewest hops, over edges at least that wide.
    using Key = std::tuple<double, int>;  // (latency, hops)
    std::vector<Key> dist(n, Key{kInf, std::numeric_limits<int>::max()});
    std::vector<int> via(n, -1), prev(n, -1);
    dist[static_cast<size_t>(src)] = Key{0.0, 0};
    using Item = std::pair<Key, int>;
    std::priority_queue<Item, std::vector<Item>, std::greater<>> q;
    q.emplace(Key{0.0, 0}, src);
    while (!q.empty()) {
        auto [k, u] = q.top();
        q.pop();
        if (k > dist[static_cast<size_t>(u)]) continue;
        if (u == dst) break;
        if (!may_expand(u)) continue;
        for (const auto& e : g.adj[static_cast<size_t>(u)]) {
            if (!(e.cap >= widest)) continue;
            const double lat = links[static_cast<size_t>(e.link)].latency_us;
            const Key nk{std::get<0>(k) + (lat > 0 ? lat : 0.0), std::get<1>(k) + 1};
            if (nk < dist[static_cast<size_t>(e.to)]) {
                dist[static_cast<size_t>(e.to)] = nk;
                via[static_cast<size_t>(e.to)] = e.link;
                prev[static_cast<size_t>(e.to)] = u;
                q.emplace(nk, e.to);
            }
        }
    }
    if (via[static_cast<size_t>(dst)] < 0) return out;
    for (int u = dst; u != src; u = prev[static_cast<size_t>(u)]) {
        out.links.push_back(&links[static_cast<size_t>(via[static_cast<size_t>(u)])]);
    }
    std::reverse(out.links.begin(), out.links.end());
    out.found = true;
    out.bottleneck_gbps = widest;
    out.latency_us = std::get<0>(dist[static_cast<size_t>(dst)]);
    return out;
}

PathInfo Topology::path_info(std::string_view a, std::string_view b) const {
    return PathFinder(*this).path_info(a, b);
}

std::vector<const Link*> Topology::path(std::string_view a, std::string_view b) const {
    return path_info(a, b).links;
}

double Topology::bottleneck_gbps(std::string_view a, std::string_view b) const {
    return path_info(a, b).bottleneck_gbps;
}

double Topology::path_latency_us(std::string_view a, std::string_view b) const {
    return path_info(a, b).latency_us;
}

RankMap Topology::rank_map() const {
    std::vector<RankInfo> ranks;
    std::vector<int> first(instances.size(), -1);
    for (Role role : {Role::kPrefill, Role::kDecode, Role::kColocated}) {
        for (size_t i = 0; i < instances.size(); ++i) {
            const Instance& in = instances[i];
            if (in.role != role) continue;
            first[i] = static_cast<int>(ranks.size());
            for (size_t t = 0; t < in.devices.size(); ++t) {
                RankInfo r;
                r.rank = static_cast<int>(ranks.size());
                r.instance = static_cast<int>(i);
                r.role = role;
                r.tp_rank = static_cast<int>(t);
                r.tp_size = in.tp;
                r.device = in.devices[t];
                r.node = node_index_of(r.device);
                if (r.node >= 0) {
                    const Node& node = nodes[static_cast<size_t>(r.node)];
                    for (size_t d = 0; d < node.devices.size(); ++d) {
                        if (node.devices[d].id == r.device) {
                            r.device_index = node.devices[d].index >= 0 ? node.devices[d].index
                                                                        : static_cast<int>(d);
                        }
                    }
                }
                ranks.push_back(std::move(r));
            }
        }
    }
    return RankMap(std::move(ranks), std::move(first));
}

}  // namespace pdsim::topo
