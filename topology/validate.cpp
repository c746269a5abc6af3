#include "topology/validate.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "topology/doc.h"

namespace pdsim::topo {

namespace {

constexpr int kMaxRanks = 1 << 20;

std::string join(std::string_view path, std::string_view key) {
    return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

class Checker {
public:
    explicit Checker(const SourceInfo& src) : src_(src) {}

    [[nodiscard]] Status bad(std::string_view path, std::string_view what) const {
        return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", src_.where(path), what));
    }

    // "line 12" or the path of where something was first defined.
    [[nodiscard]] std::string at(std::string_view path) const {
        const int line = src_.line_of(path);
        return line > 0 ? fmt::format("{}, line {}", path, line) : std::string(path);
    }

    Status positive(std::string_view path, double v) const {
        if (!(v > 0) || !std::isfinite(v))
            return bad(path, fmt::format("must be positive, got {}", v));
        return ok_status();
    }
    Status non_negative(std::string_view path, double v) const {
        if (!(v >= 0) || !std::isfinite(v)) {
            return bad(path, fmt::format("must be >= 0, got {}", v));
        }
        return ok_status();
    }
    Status identifier(std::string_view path, std::string_view id) const {
        if (id.empty()) return bad(path, "must not be empty");
        if (id.size() > 256) return bad(path, "is longer than 256 characters");
        for (char c : id) {
            const auto u = static_cast<unsigned char>(c);
            if (u <= 0x20 || u == 0x7f) {
                return bad(path, fmt::format("{} contains whitespace or control characters",
                                             detail::quoted_for_message(id)));
            }
        }
        return ok_status();
    }

private:
    const SourceInfo& src_;
};

// "0-13", "4", "0,2,4-7": every core < cpus when cpus > 0.
std::string check_cores(std::string_view cores, int cpus) {
    if (cores.empty()) return "must not be empty";
    size_t pos = 0;
    while (pos <= cores.size()) {
        const size_t comma = std::min(cores.find(',', pos), cores.size());
        const std::string_view part = cores.substr(pos, comma - pos);
        const size_t dash = part.find('-');
        auto num = [](std::string_view s, long* out) {
            const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
            return ec == std::errc() && end == s.data() + s.size() && !s.empty() && *out >= 0 &&
                   *out < (1 << 20);
        };
        long lo = 0, hi = 0;
        const bool ok = dash == std::string_view::npos
                            ? num(part, &lo) && num(part, &hi)
                            : num(part.substr(0, dash), &lo) && num(part.substr(dash + 1), &hi);
        if (!ok || lo > hi) {
            return fmt::format("{} is not a core list like \"0-13\" or \"0,2,4-7\"",
                               detail::quoted_for_message(cores));
        }
        if (cpus > 0 && hi >= cpus) {
            return fmt::format("core {} is beyond the node's {} cpus", hi, cpus);
        }
        pos = comma + 1;
    }
    return {};
}

enum class EndpointKind { kNode, kDevice, kNic, kSwitch, kInstance };

std::string_view kind_name(EndpointKind k) {
    switch (k) {
        case EndpointKind::kNode:
            return "a node";
        case EndpointKind::kDevice:
            return "a device";
        case EndpointKind::kNic:
            return "a NIC";
        case EndpointKind::kSwitch:
            return "a switch";
        case EndpointKind::kInstance:
            return "an instance";
    }
    return "?";
}

struct IdInfo {
    EndpointKind kind;
    std::string path;  // path of the element that defines it ("nodes[0].devices[1]")
    LinkType type = LinkType::kNvlink;  // NICs and switches
};

std::string format_ranks(const std::vector<int>& r) {
    std::string out = "[";
    for (size_t i = 0; i < r.size(); ++i) out += (i ? ", " : "") + std::to_string(r[i]);
    return out + "]";
}

}  // namespace

Status validate_model(const ModelShape& m, const SourceInfo& source, std::string_view path) {
    Checker c(source);
    if (m.name.empty()) return c.bad(join(path, "name"), "must not be empty");
    struct F {
        std::string_view key;
        int v;
    };
    for (const F& f : {F{"num_layers", m.num_layers}, F{"num_q_heads", m.num_q_heads},
                       F{"num_kv_heads", m.num_kv_heads}, F{"head_dim", m.head_dim}}) {
        if (f.v <= 0) return c.bad(join(path, f.key), fmt::format("must be positive, got {}", f.v));
    }
    if (m.hidden < 0) {
        return c.bad(join(path, "hidden"), fmt::format("must be >= 0, got {}", m.hidden));
    }
    if (m.attention == AttentionKind::kMla) {
        if (m.num_kv_heads != 1) {
            return c.bad(
                join(path, "num_kv_heads"),
                fmt::format("must be 1 for MLA (one latent buffer), got {}", m.num_kv_heads));
        }
        if (m.kv_lora_rank <= 0) {
            return c.bad(join(path, "kv_lora_rank"),
                         fmt::format("must be positive for MLA, got {}", m.kv_lora_rank));
        }
        if (m.rope_dim < 0) {
            return c.bad(join(path, "rope_dim"), fmt::format("must be >= 0, got {}", m.rope_dim));
        }
    } else if (m.num_q_heads % m.num_kv_heads != 0) {
        return c.bad(
            join(path, "num_q_heads"),
            fmt::format("{} is not a multiple of num_kv_heads {}", m.num_q_heads, m.num_kv_heads));
    }
    return ok_status();
}

Status validate(const Topology& t, const ModelShape* model_override) {
    const SourceInfo& src = t.source;
    Checker c(src);

    // ---- model ----
    if (t.model) PDSIM_RETURN_IF_ERROR(validate_model(*t.model, src, "model"));
    if (model_override != nullptr) {
        SourceInfo override_src;
        override_src.name = "--model " + model_override->name;
        PDSIM_RETURN_IF_ERROR(validate_model(*model_override, override_src, ""));
    }
    const ModelShape* model = model_override != nullptr ? model_override
                              : t.model                 ? &*t.model
                                                        : nullptr;

    // ---- ids: one namespace for nodes, devices, NICs, switches and instances ----
    std::unordered_map<std::string, IdInfo> ids;
    auto define = [&](const std::string& id, const std::string& path, EndpointKind kind,
                      LinkType type = LinkType::kNvlink) -> Status {
        PDSIM_RETURN_IF_ERROR(c.identifier(join(path, "id"), id));
        auto [it, inserted] = ids.emplace(id, IdInfo{kind, path, type});
        if (!inserted) {
            return c.bad(join(path, "id"),
                         fmt::format("duplicate id {} (already used by {})",
                                     detail::quoted_for_message(id), c.at(it->second.path)));
        }
        return ok_status();
    };

    // ---- nodes ----
    if (t.nodes.empty()) return c.bad("nodes", "at least one node is required");
    for (size_t i = 0; i < t.nodes.size(); ++i) {
        const Node& n = t.nodes[i];
        const std::string np = fmt::format("nodes[{}]", i);
        PDSIM_RETURN_IF_ERROR(define(n.id, np, EndpointKind::kNode));
        PDSIM_RETURN_IF_ERROR(c.identifier(join(np, "hostname"), n.hostname));
        if (n.cpus < 0) {
            return c.bad(join(np, "cpus"), fmt::format("must be >= 0, got {}", n.cpus));
        }
        if (n.devices.empty())
            return c.bad(join(np, "devices"), "a node needs at least one device");
        std::unordered_map<int, size_t> ordinals;
        for (size_t j = 0; j < n.devices.size(); ++j) {
            const Device& d = n.devices[j];
            const std::string dp = fmt::format("{}.devices[{}]", np, j);
            PDSIM_RETURN_IF_ERROR(define(d.id, dp, EndpointKind::kDevice));
            if (!d.is_cpu() && d.gpu() == nullptr) {
                return c.bad(join(dp, "type"),
                             fmt::format("unknown device type {} (expected cpu or a GPU: {})",
                                         detail::quoted_for_message(d.type), gpu_spec_names()));
            }
            if (d.index < -1) {
                return c.bad(join(dp, "index"), fmt::format("must be >= 0, got {}", d.index));
            }
            const int ordinal = d.index >= 0 ? d.index : static_cast<int>(j);
            if (auto [it, inserted] = ordinals.emplace(ordinal, j); !inserted) {
                return c.bad(join(dp, d.index >= 0 ? "index" : "id"),
                             fmt::format("device ordinal {} is already taken by {}.devices[{}]",
                                         ordinal, np, it->second));
            }
            if (!d.cores.empty()) {
                if (std::string e = check_cores(d.cores, n.cpus); !e.empty()) {
                    return c.bad(join(dp, "cores"), e);
                }
            }
        }
        for (size_t j = 0; j < n.nics.size(); ++j) {
            const Nic& nic = n.nics[j];
            const std::string p = fmt::format("{}.nics[{}]", np, j);
            PDSIM_RETURN_IF_ERROR(define(nic.id, p, EndpointKind::kNic, nic.type));
            if (nic.type != LinkType::kIb && nic.type != LinkType::kEthernet) {
                return c.bad(join(p, "type"), fmt::format("a NIC is ib or ethernet, not {}",
                                                          link_type_name(nic.type)));
            }
            PDSIM_RETURN_IF_ERROR(c.positive(join(p, "gbps"), nic.gbps));
        }
        for (size_t j = 0; j < n.switches.size(); ++j) {
            const Switch& s = n.switches[j];
            PDSIM_RETURN_IF_ERROR(
                define(s.id, fmt::format("{}.switches[{}]", np, j), EndpointKind::kSwitch, s.type));
        }
    }
    for (size_t j = 0; j < t.switches.size(); ++j) {
        const Switch& s = t.switches[j];
        PDSIM_RETURN_IF_ERROR(
            define(s.id, fmt::format("switches[{}]", j), EndpointKind::kSwitch, s.type));
    }

    // ---- links ----
    std::unordered_map<std::string, size_t> pairs;
    for (size_t k = 0; k < t.links.size(); ++k) {
        const Link& l = t.links[k];
        const std::string lp = fmt::format("links[{}]", k);
        const IdInfo* ends[2] = {nullptr, nullptr};
        const std::string* names[2] = {&l.a, &l.b};
        for (int e = 0; e < 2; ++e) {
            const std::string fp = join(lp, e == 0 ? "a" : "b");
            auto it = ids.find(*names[e]);
            if (it == ids.end()) {
                return c.bad(fp, fmt::format("unknown endpoint {} (expected the id of a device, "
                                             "NIC or switch)",
                                             detail::quoted_for_message(*names[e])));
            }
            if (it->second.kind == EndpointKind::kNode ||
                it->second.kind == EndpointKind::kInstance) {
                return c.bad(fp, fmt::format("{} is {}; links join devices, NICs and switches",
                                             detail::quoted_for_message(*names[e]),
                                             kind_name(it->second.kind)));
            }
            ends[e] = &it->second;
        }
        if (l.a == l.b)
            return c.bad(join(lp, "b"), fmt::format("a link cannot join {} to itself",
                                                    detail::quoted_for_message(l.a)));
        PDSIM_RETURN_IF_ERROR(c.positive(join(lp, "gbps"), l.gbps));
        PDSIM_RETURN_IF_ERROR(c.non_negative(join(lp, "latency_us"), l.latency_us));
        for (int e = 0; e < 2; ++e) {
            const IdInfo& end = *ends[e];
            const bool nic_attach = l.type == LinkType::kPcie &&
                                    ends[1 - e]->kind == EndpointKind::kNic;  // host side of a NIC
            if (end.kind == EndpointKind::kSwitch && l.type != end.type && !nic_attach) {
                return c.bad(
                    join(lp, "type"),
                    fmt::format("{} link cannot attach to {} switch {}", link_type_name(l.type),
                                link_type_name(end.type), detail::quoted_for_message(*names[e])));
            }
            if (end.kind == EndpointKind::kNic && l.type != end.type && l.type != LinkType::kPcie) {
                return c.bad(
                    join(lp, "type"),
                    fmt::format("{} link cannot attach to {} NIC {} (pcie or {} only)",
                                link_type_name(l.type), link_type_name(end.type),
                                detail::quoted_for_message(*names[e]), link_type_name(end.type)));
            }
        }
        const std::string key = l.a < l.b ? l.a + '\n' + l.b : l.b + '\n' + l.a;
        if (auto [it, inserted] = pairs.emplace(key, k); !inserted) {
            return c.bad(
                lp, fmt::format("duplicate link: links[{}] already joins {} and {}", it->second,
                                detail::quoted_for_message(l.a), detail::quoted_for_message(l.b)));
        }
    }

    // ---- instances ----
    if (t.instances.empty()) return c.bad("instances", "at least one instance is required");
    std::unordered_map<std::string, std::string> used;  // device id -> instance path
    int64_t total_ranks = 0;
    bool has_prefill = false, has_decode = false;
    int first_colocated = -1, first_pd = -1;  // instance indices; -1: none
    for (size_t m = 0; m < t.instances.size(); ++m) {
        const Instance& in = t.instances[m];
        const std::string ip = fmt::format("instances[{}]", m);
        PDSIM_RETURN_IF_ERROR(define(in.id, ip, EndpointKind::kInstance));
        has_prefill = has_prefill || in.role == Role::kPrefill;
        has_decode = has_decode || in.role == Role::kDecode;
        int& first_of_kind = in.role == Role::kColocated ? first_colocated : first_pd;
        if (first_of_kind < 0) first_of_kind = static_cast<int>(m);
        if (first_colocated >= 0 && first_pd >= 0) {
            const int other = in.role == Role::kColocated ? first_pd : first_colocated;
            return c.bad(
                join(ip, "role"),
                fmt::format("{} instance after {} instance instances[{}]: a topology is "
                            "disaggregated (prefill and decode instances) or colocated "
                            "(colocated instances only), not both",
                            role_name(in.role),
                            role_name(t.instances[static_cast<size_t>(other)].role), other));
        }
        if (in.tp < 1)
            return c.bad(join(ip, "tp"), fmt::format("must be at least 1, got {}", in.tp));
        if (in.tp > kMaxRanks) {
            return c.bad(join(ip, "tp"), fmt::format("{} is larger than {}", in.tp, kMaxRanks));
        }
        if (static_cast<int64_t>(in.devices.size()) != in.tp) {
            return c.bad(join(ip, "devices"),
                         fmt::format("lists {} device{} for tp {} (one device per TP rank)",
                                     in.devices.size(), in.devices.size() == 1 ? "" : "s", in.tp));
        }
        const Device* first = nullptr;
        std::unordered_set<std::string> mine;  // this instance's devices
        for (size_t d = 0; d < in.devices.size(); ++d) {
            const std::string dp = fmt::format("{}.devices[{}]", ip, d);
            const std::string& id = in.devices[d];
            auto it = ids.find(id);
            if (it == ids.end())
                return c.bad(dp, fmt::format("unknown device {}", detail::quoted_for_message(id)));
            if (it->second.kind != EndpointKind::kDevice) {
                return c.bad(dp,
                             fmt::format("{} is {}, not a device", detail::quoted_for_message(id),
                                         kind_name(it->second.kind)));
            }
            const Device* dev = t.find_device(id);
            if (!mine.insert(id).second && !dev->shared) {
                return c.bad(dp, fmt::format("device {} is listed twice (mark the device "
                                             "`shared: true` to run several TP ranks on it)",
                                             detail::quoted_for_message(id)));
            }
            if (auto [u, inserted] = used.emplace(id, ip); !inserted && !dev->shared) {
                return c.bad(dp, fmt::format("device {} is already used by {} (mark the device "
                                             "`shared: true` to run both instances on it)",
                                             detail::quoted_for_message(id), c.at(u->second)));
            }
            if (first == nullptr) {
                first = dev;
            } else if (dev->type != first->type) {
                return c.bad(dp, fmt::format("device {} ({}) differs from devices[0] {} ({}); an "
                                             "instance's devices are of one type",
                                             detail::quoted_for_message(id), dev->type,
                                             detail::quoted_for_message(first->id), first->type));
            }
        }
        if (model != nullptr) {
            if (std::string e = check_tp(*model, in.tp); !e.empty()) {
                return c.bad(join(ip, "tp"), fmt::format("{} (model {})", e, model->name));
            }
        }
        total_ranks += in.tp;
        if (total_ranks > kMaxRanks) {
            return c.bad(join(ip, "tp"), fmt::format("more than {} ranks in all", kMaxRanks));
        }
    }
    if (first_colocated < 0 && (!has_prefill || !has_decode)) {
        return c.bad("instances",
                     fmt::format("no {} instance (a topology needs at least one prefill and one "
                                 "decode instance, or colocated instances only)",
                                 has_prefill ? "decode" : "prefill"));
    }

    // ---- ranks ----
    const RankMap rm = t.rank_map();
    for (size_t m = 0; m < t.instances.size(); ++m) {
        const Instance& in = t.instances[m];
        if (in.ranks.empty()) continue;
        std::vector<int> expected(static_cast<size_t>(in.tp));
        for (int r = 0; r < in.tp; ++r)
            expected[static_cast<size_t>(r)] = rm.first_rank(static_cast<int>(m)) + r;
        if (in.ranks != expected) {
            return c.bad(fmt::format("instances[{}].ranks", m),
                         fmt::format("{} does not match the rank rule, which gives {} (prefill "
                                     "instances first, then decode, each in file order)",
                                     format_ranks(in.ranks), format_ranks(expected)));
        }
    }
    if (t.world_size && *t.world_size != total_ranks) {
        std::string parts;
        for (const Instance& in : t.instances) {
            if (!parts.empty()) parts += " + ";
            parts += fmt::format("{} {}", in.id, in.tp);
        }
        return c.bad("world_size",
                     fmt::format("{} does not match the {} ranks of the instances ({})",
                                 *t.world_size, total_ranks, parts));
    }

    // ---- reachability: TP groups internally, and every prefill -> decode rank pair ----
    const PathFinder paths(t);
    auto reach = [&](size_t m_from, size_t i, size_t m_to, size_t j) -> Status {
        const std::string& a = t.instances[m_from].devices[i];
        const std::string& b = t.instances[m_to].devices[j];
        if (!paths.reachable(a, b)) {
            return c.bad(fmt::format("instances[{}].devices[{}]", m_to, j),
                         fmt::format("no path from {} (instances[{}].devices[{}]) to {}; add links",
                                     detail::quoted_for_message(a), m_from, i,
                                     detail::quoted_for_message(b)));
        }
        return ok_status();
    };
    for (size_t m = 0; m < t.instances.size(); ++m) {
        for (size_t j = 1; j < t.instances[m].devices.size(); ++j) {
            PDSIM_RETURN_IF_ERROR(reach(m, 0, m, j));
        }
    }
    for (size_t p = 0; p < t.instances.size(); ++p) {
        if (t.instances[p].role != Role::kPrefill) continue;
        for (size_t d = 0; d < t.instances.size(); ++d) {
            if (t.instances[d].role != Role::kDecode) continue;
            for (auto [i, j] : tp_overlap_pairs(t.instances[p].tp, t.instances[d].tp)) {
                PDSIM_RETURN_IF_ERROR(reach(p, static_cast<size_t>(i), d, static_cast<size_t>(j)));
            }
        }
    }

    // ---- shaping ----
    if (t.shaping) {
        const ShapingSpec& s = *t.shaping;
        for (const Instance& in : t.instances) {
            for (const std::string& id : in.devices) {
                const Device* dev = t.find_device(id);
                if (dev != nullptr && !dev->is_cpu()) {
                    return c.bad("shaping",
                                 fmt::format("only a CPU topology is shaped, but device "
                                             "{} of {} is a {}",
                                             detail::quoted_for_message(id), in.id, dev->type));
                }
            }
        }
        PDSIM_RETURN_IF_ERROR(c.positive("shaping.gbps", s.gbps));
        PDSIM_RETURN_IF_ERROR(c.non_negative("shaping.latency_us", s.latency_us));
        if (!s.gpu.empty() && gpu_spec(s.gpu) == nullptr) {
            return c.bad("shaping.gpu",
                         fmt::format("unknown GPU {} (expected one of: {})",
                                     detail::quoted_for_message(s.gpu), gpu_spec_names()));
        }
        if (s.time_scale < 0 || !std::isfinite(s.time_scale)) {
            return c.bad("shaping.time_scale",
                         fmt::format("must be positive or auto, got {}", s.time_scale));
        }
    }
    return ok_status();
}

}  // namespace pdsim::topo
