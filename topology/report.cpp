#include "topology/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace pdsim::topo {

namespace {

std::string plural(size_t n, std::string_view word) {
    return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s");
}

std::string rank_range(int first, int count) {
    if (count <= 1) return std::to_string(first);
    return fmt::format("{}-{}", first, first + count - 1);
}

std::string fmt_gbps(double g) {
    if (std::isinf(g)) return "local";
    return fmt::format("{:.1f}", g);
}

// "8x H100, 2x cpu"
std::string device_types(const Topology& t) {
    std::map<std::string, int> counts;
    std::vector<std::string> order;
    for (const Node& n : t.nodes) {
        for (const Device& d : n.devices) {
            if (counts[d.type]++ == 0) order.push_back(d.type);
        }
    }
    std::string out;
    for (const std::string& type : order) {
        if (!out.empty()) out += ", ";
        out += fmt::format("{}x {}", counts[type], type);
    }
    return out;
}

std::string table(const std::vector<std::vector<std::string>>& rows, std::string_view indent) {
    std::vector<size_t> width;
    for (const auto& r : rows) {
        if (width.size() < r.size()) width.resize(r.size(), 0);
        for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
    }
    std::string out;
    for (const auto& r : rows) {
        std::string line(indent);
        for (size_t i = 0; i < r.size(); ++i) {
            line += r[i];
            if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
        }
        while (!line.empty() && line.back() == ' ') line.pop_back();
        out += line + "\n";
    }
    return out;
}

}  // namespace

std::string one_line_summary(const Topology& t) {
    int prefill = 0, decode = 0, colocated = 0;
    for (const Instance& in : t.instances) {
        ++(in.role == Role::kPrefill ? prefill : in.role == Role::kDecode ? decode : colocated);
    }
    const std::string roles = colocated > 0 && prefill + decode == 0
                                  ? fmt::format("{} colocated", colocated)
                                  : fmt::format("{} prefill, {} decode", prefill, decode);
    std::string s =
        fmt::format("{}: {}, {} ({}), {} ({}), {}", t.name, plural(t.nodes.size(), "node"),
                    plural(static_cast<size_t>(t.num_devices()), "device"), device_types(t),
                    plural(t.instances.size(), "instance"), roles,
                    plural(static_cast<size_t>(t.num_ranks()), "rank"));
    if (t.model) s += ", model " + t.model->name;
    return s;
}

std::string summary_text(const Topology& t) {
    std::string out = fmt::format("topology  {}  ({})\n", t.name, t.source.name);
    if (!t.description.empty()) out += fmt::format("          {}\n", t.description);
    if (t.model) {
        const ModelShape& m = *t.model;
        out += fmt::format(
            "model     {}: {} layers, {} q heads, {} kv heads, head_dim {}{}\n", m.name,
            m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim,
            m.attention == AttentionKind::kMla
                ? fmt::format(", MLA (kv_lora_rank {}, rope {})", m.kv_lora_rank, m.rope_dim)
                : std::string());
    } else {
        out += "model     (none given: TP is not checked against heads)\n";
    }
    size_t nics = 0, switches = t.switches.size();
    for (const Node& n : t.nodes) {
        nics += n.nics.size();
        switches += n.switches.size();
    }
    out += fmt::format(
        "cluster   {}, {} ({}), {}, {}, {}\n", plural(t.nodes.size(), "node"),
        plural(static_cast<size_t>(t.num_devices()), "device"), device_types(t),
        plural(nics, "NIC"),
        (switches == 1 ? std::string("1 switch") : fmt::format("{} switches", switches)),
        plural(t.links.size(), "link"));
    const RankMap rm = t.rank_map();
    const int np = rm.num_prefill_ranks();
    bool colocated = !t.instances.empty();
    for (const Instance& in : t.instances) colocated = colocated && in.role == Role::kColocated;
    if (colocated) {
        out += fmt::format("ranks     {}: colocated {}\n", rm.world_size(),
                           rank_range(0, rm.world_size()));
    } else {
        out += fmt::format("ranks     {}: prefill {}, decode {}\n", rm.world_size(),
                           rank_range(0, np), rank_range(np, rm.world_size() - np));
    }

    // Instances in rank order.
    std::vector<size_t> order(t.instances.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return rm.first_rank(static_cast<int>(a)) < rm.first_rank(static_cast<int>(b));
    });
    std::vector<std::vector<std::string>> rows{{"id", "role", "tp", "ranks", "devices", "on"}};
    for (size_t i : order) {
        const Instance& in = t.instances[i];
        std::set<std::string> on;
        std::vector<std::string> on_order;
        for (const std::string& d : in.devices) {
            const int ni = t.node_index_of(d);
            const std::string nid = ni >= 0 ? t.nodes[static_cast<size_t>(ni)].id : "?";
            if (on.insert(nid).second) on_order.push_back(nid);
        }
        const Device* dev = in.devices.empty() ? nullptr : t.find_device(in.devices.front());
        std::string devs = in.devices.empty() ? "" : in.devices.front();
        if (in.devices.size() == 2) devs += ", " + in.devices.back();
        if (in.devices.size() > 2) devs += " .. " + in.devices.back();
        rows.push_back({in.id, std::string(role_name(in.role)), std::to_string(in.tp),
                        rank_range(rm.first_rank(static_cast<int>(i)), in.tp),
                        fmt::format("{} ({}x {})", devs, in.devices.size(), dev ? dev->type : "?"),
                        fmt::format("{}", fmt::join(on_order, ", "))});
    }
    out += colocated
               ? "\ninstances (rank order: file order)\n"
               : "\ninstances (rank order: prefill instances, then decode, each in file order)\n";
    out += table(rows, "  ");

    rows = {{"rank", "instance", "role", "tp_rank", "node", "host", "device", "type"}};
    for (const RankInfo& r : rm.ranks()) {
        const Node* n = r.node >= 0 ? &t.nodes[static_cast<size_t>(r.node)] : nullptr;
        const Device* d = t.find_device(r.device);
        rows.push_back({std::to_string(r.rank), t.instances[static_cast<size_t>(r.instance)].id,
                        std::string(role_name(r.role)), fmt::format("{}/{}", r.tp_rank, r.tp_size),
                        n ? n->id : "?", n ? n->hostname : "?", r.device, d ? d->type : "?"});
    }
    out += "\nranks\n" + table(rows, "  ");

    rows = {{"from", "to", "tp", "pairs", "GB/s", "latency_us", "path (worst pair)"}};
    const PathFinder paths(t);
    for (size_t p = 0; p < t.instances.size(); ++p) {
        const Instance& pi = t.instances[p];
        if (pi.role != Role::kPrefill) continue;
        for (size_t d = 0; d < t.instances.size(); ++d) {
            const Instance& di = t.instances[d];
            if (di.role != Role::kDecode) continue;
            const auto pairs = tp_overlap_pairs(pi.tp, di.tp);
            double worst_bw = std::numeric_limits<double>::infinity(), worst_lat = 0;
            std::string worst_path = "-";
            bool first = true;
            for (auto [i, j] : pairs) {
                if (static_cast<size_t>(i) >= pi.devices.size() ||
                    static_cast<size_t>(j) >= di.devices.size()) {
                    continue;
                }
                const PathInfo path = paths.path_info(pi.devices[static_cast<size_t>(i)],
                                                      di.devices[static_cast<size_t>(j)]);
                const double bw = path.found ? path.bottleneck_gbps : 0.0;
                if (first || bw < worst_bw || (bw == worst_bw && path.latency_us > worst_lat)) {
                    first = false;
                    worst_bw = bw;
                    worst_lat = path.latency_us;
                    std::vector<std::string_view> types;
                    for (const Link* l : path.links) types.push_back(link_type_name(l->type));
                    worst_path = path.found
                                     ? (types.empty() ? "same device"
                                                      : fmt::format("{}", fmt::join(types, " > ")))
                                     : "no path";
                }
            }
            rows.push_back({pi.id, di.id, fmt::format("{}->{}", pi.tp, di.tp),
                            std::to_string(pairs.size()), fmt_gbps(worst_bw),
                            fmt::format("{:.2f}", worst_lat), worst_path});
        }
    }
    if (colocated) {
        out += "\nprefill -> decode KV paths: none (colocated instances: no KV transfer)\n";
    } else {
        out +=
            "\nprefill -> decode KV paths (per instance pair: bottleneck of the worst TP rank "
            "pair)\n";
        out += table(rows, "  ");
    }

    if (t.shaping) {
        const ShapingSpec& s = *t.shaping;
        out += fmt::format("\nshaping   emulates {}: {} {} GB/s, {} us; time_scale {}{}\n",
                           s.emulate.empty() ? "a link" : s.emulate, link_type_name(s.type),
                           fmt_gbps(s.gbps), s.latency_us,
                           s.time_scale > 0 ? fmt::format("{}", s.time_scale) : "auto (measured)",
                           s.gpu.empty() ? "" : fmt::format(", CPU stands in for {}", s.gpu));
        if (s.time_scale > 0) {
            out += fmt::format("          CPU transport: {:.3f} GB/s, {:.1f} us per message\n",
                               s.gbps / s.time_scale, s.latency_us * s.time_scale);
        }
    }
    return out;
}

std::string hostfile_text(const Topology& t) {
    const RankMap rm = t.rank_map();
    std::vector<std::string> hosts;
    std::map<std::string, int> slots;
    for (const RankInfo& r : rm.ranks()) {
        const std::string host = r.node >= 0 ? t.nodes[static_cast<size_t>(r.node)].hostname : "?";
        if (slots[host]++ == 0) hosts.push_back(host);
    }
    std::string out = fmt::format(
        "# OpenMPI hostfile for topology {} ({} ranks), written by `pdsim topology hostfile`\n",
        t.name, rm.world_size());
    for (const std::string& h : hosts) out += fmt::format("{} slots={}\n", h, slots[h]);
    return out;
}

std::string cores_for(const Topology& t, std::string_view device_id, int fallback_cpus) {
    const int ni = t.node_index_of(device_id);
    if (ni < 0) return "0";
    const Node& n = t.nodes[static_cast<size_t>(ni)];
    size_t pos = 0;
    for (size_t d = 0; d < n.devices.size(); ++d) {
        if (n.devices[d].id != device_id) continue;
        if (!n.devices[d].cores.empty()) return n.devices[d].cores;
        pos = d;
    }
    const int64_t cpus = n.cpus > 0 ? n.cpus : fallback_cpus;
    const int64_t count = static_cast<int64_t>(n.devices.size());
    const int64_t d = static_cast<int64_t>(pos);
    if (cpus <= 0) return std::to_string(d);
    if (count > cpus) return std::to_string(d % cpus);
    const int64_t lo = d * cpus / count, hi = (d + 1) * cpus / count - 1;
    return lo == hi ? std::to_string(lo) : fmt::format("{}-{}", lo, hi);
}

std::string rankfile_text(const Topology& t, int fallback_cpus) {
    const RankMap rm = t.rank_map();
    std::string out = fmt::format(
        "# OpenMPI rankfile for topology {}, written by `pdsim topology hostfile`.\n"
        "# Rank order: prefill instances, then decode instances (file order), TP ranks\n"
        "# consecutive. Use: mpirun -np {} --hostfile <hostfile> --rankfile <this file> ...\n",
        t.name, rm.world_size(), rm.world_size());
    for (const RankInfo& r : rm.ranks()) {
        const std::string host = r.node >= 0 ? t.nodes[static_cast<size_t>(r.node)].hostname : "?";
        out += fmt::format("rank {}={} slot={}\n", r.rank, host,
                           cores_for(t, r.device, fallback_cpus));
    }
    return out;
}

}  // namespace pdsim::topo
