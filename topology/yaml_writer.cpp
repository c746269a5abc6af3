// to_yaml(): a canonical YAML rendering that the loader reads back to an equal Topology.
#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <string>

#include "topology/loader.h"

namespace pdsim::topo {

namespace {

bool plain_safe(std::string_view s) {
    if (s.empty() || s.size() > 200) return false;
    for (std::string_view special :
         {"true", "false", "yes",   "no",  "on", "off", "null", "y",    "n",
          "auto", "True",  "False", "Yes", "No", "On",  "Off",  "Null", "NULL",
          "TRUE", "FALSE", "YES",   "NO",  "ON", "OFF", "Y",    "N"}) {
        if (s == special) return false;
    }
    const unsigned char c0 = static_cast<unsigned char>(s.front());
    if (!std::isalpha(c0) && c0 != '_') return false;  // numbers, '-', '.', '~' ... get quoted
    for (char c : s) {
        const unsigned char u = static_cast<unsigned char>(c);
        if (!(std::isalnum(u) || c == '_' || c == '-' || c == '.' || c == '/')) return false;
    }
    return true;
}

std::string str(std::string_view s) {
    if (plain_safe(s)) return std::string(s);
    std::string out = "\"";
    for (char c : s) {
        const unsigned char u = static_cast<unsigned char>(c);
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\t':
                out += "\\t";
                break;
            case '\r':
                out += "\\r";
                break;
            default:
                if (u < 0x20 || u == 0x7f) {
                    out += fmt::format("\\x{:02x}", u);
                } else {
                    out += c;
                }
        }
    }
    return out + "\"";
}

std::string num(double v) {
    return fmt::format("{}", v);
}

}  // namespace

std::string to_yaml(const Topology& t) {
    std::string o;
    if (!t.name.empty()) o += "name: " + str(t.name) + "\n";
    if (!t.description.empty()) o += "description: " + str(t.description) + "\n";
    if (t.model) {
        const ModelShape& m = *t.model;
        const ModelShape* builtin = builtin_model_shape(m.name);
        if (builtin != nullptr && *builtin == m) {
            o += "model: " + str(m.name) + "\n";
        } else {
            o += fmt::format(
                "model: {{name: {}, num_layers: {}, num_q_heads: {}, num_kv_heads: {}, "
                "head_dim: {}, hidden: {}, attention: {}",
                str(m.name), m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.hidden,
                m.attention == AttentionKind::kMla ? "mla" : "mha");
            o += fmt::format(", kv_lora_rank: {}, rope_dim: {}}}\n", m.kv_lora_rank, m.rope_dim);
        }
    }
    if (t.world_size) o += fmt::format("world_size: {}\n", *t.world_size);
    o += "nodes:\n";
    for (const Node& n : t.nodes) {
        o += "  - id: " + str(n.id) + "\n";
        o += "    hostname: " + str(n.hostname) + "\n";
        if (n.cpus != 0) o += fmt::format("    cpus: {}\n", n.cpus);
        o += "    devices:\n";
        for (const Device& d : n.devices) {
            o += "      - {id: " + str(d.id) + ", type: " + str(d.type);
            if (d.index >= 0) o += fmt::format(", index: {}", d.index);
            if (!d.cores.empty()) o += ", cores: " + str(d.cores);
            if (d.shared) o += ", shared: true";
            o += "}\n";
        }
        if (!n.nics.empty()) {
            o += "    nics:\n";
            for (const Nic& nic : n.nics) {
                o += fmt::format("      - {{id: {}, type: {}, gbps: {}}}\n", str(nic.id),
                                 link_type_name(nic.type), num(nic.gbps));
            }
        }
        if (!n.switches.empty()) {
            o += "    switches:\n";
            for (const Switch& s : n.switches) {
                o += fmt::format("      - {{id: {}, type: {}}}\n", str(s.id),
                                 link_type_name(s.type));
            }
        }
    }
    if (!t.switches.empty()) {
        o += "switches:\n";
        for (const Switch& s : t.switches) {
            o += fmt::format("  - {{id: {}, type: {}}}\n", str(s.id), link_type_name(s.type));
        }
    }
    if (!t.links.empty()) {
        o += "links:\n";
        for (const Link& l : t.links) {
            o += fmt::format("  - {{a: {}, b: {}, type: {}, gbps: {}, latency_us: {}}}\n", str(l.a),
                             str(l.b), link_type_name(l.type), num(l.gbps), num(l.latency_us));
        }
    }
    o += "instances:\n";
    for (const Instance& in : t.instances) {
        o += fmt::format("  - id: {}\n    role: {}\n    tp: {}\n    devices: [", str(in.id),
                         role_name(in.role), in.tp);
        for (size_t i = 0; i < in.devices.size(); ++i) o += (i ? ", " : "") + str(in.devices[i]);
        o += "]\n";
        if (!in.ranks.empty()) o += fmt::format("    ranks: [{}]\n", fmt::join(in.ranks, ", "));
    }
    if (t.shaping) {
        const ShapingSpec& s = *t.shaping;
        o += "shaping:\n";
        if (!s.emulate.empty()) o += "  emulate: " + str(s.emulate) + "\n";
        o += fmt::format("  type: {}\n  gbps: {}\n  latency_us: {}\n", link_type_name(s.type),
                         num(s.gbps), num(s.latency_us));
        if (!s.gpu.empty()) o += "  gpu: " + str(s.gpu) + "\n";
        o += "  time_scale: " + (s.time_scale > 0 ? num(s.time_scale) : std::string("auto")) + "\n";
    }
    return o;
}

}  // namespace pdsim::topo
