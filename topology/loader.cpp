// The schema walker: DocNode (doc.h) -> Topology, with the path and line of every field.
#include "topology/loader.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <sstream>

#include "common/data_dir.h"
#include "common/input_file.h"
#include "common/text.h"
#include "topology/doc.h"
#include "topology/validate.h"

namespace pdsim::topo {

namespace {

using detail::DocNode;
using Kind = DocNode::Kind;

std::string join(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

std::string index_path(const std::string& path, size_t i) {
    return fmt::format("{}[{}]", path, i);
}

class Walker {
public:
    explicit Walker(SourceInfo* src) : src_(src) {}

    [[nodiscard]] Status error(const std::string& path, int line, std::string_view what) const {
        const std::string shown = path.empty() ? "(document)" : path;
        if (line > 0) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("{}:{}: {}: {}", src_->name, line, shown, what));
        }
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}: {}: {}", src_->name, shown, what));
    }

    void note(const std::string& path, const DocNode& n) {
        if (n.line > 0) src_->lines.emplace(path, n.line);
    }

    // n must be a mapping whose keys are all in `keys`.
    Status expect_map(const DocNode& n, const std::string& path,
                      std::initializer_list<std::string_view> keys) {
        note(path, n);
        if (n.kind != Kind::kMap) {
            return error(path, n.line, fmt::format("expected a mapping, got {}", n.kind_name()));
        }
        for (const DocNode::Entry& e : n.entries) {
            bool known = false;
            for (std::string_view k : keys) known = known || k == e.key;
            const std::string kp = join(path, e.key);
            if (!known) {
                std::string expected;
                for (std::string_view k : keys) {
                    if (!expected.empty()) expected += ", ";
                    expected += k;
                }
                return error(kp, e.key_line > 0 ? e.key_line : n.line,
                             fmt::format("unknown key (expected one of: {})", expected));
            }
            note(kp, e.value);
        }
        return ok_status();
    }

    // The value of `key`, or nullptr when absent or null.
    static const DocNode* optional(const DocNode& map, std::string_view key) {
        const DocNode* v = map.get(key);
        return v != nullptr && v->kind != Kind::kNull ? v : nullptr;
    }

    Status required(const DocNode& map, const std::string& path, std::string_view key,
                    const DocNode** out) {
        *out = optional(map, key);
        if (*out == nullptr) {
            const DocNode* present = map.get(key);
            return error(
                join(path, key), present != nullptr ? present->line : map.line,
                present != nullptr ? "required field has no value" : "missing required field");
        }
        return ok_status();
    }

    Status string(const DocNode& n, const std::string& path, std::string* out) {
        if (n.kind != Kind::kScalar) {
            return error(path, n.line, fmt::format("expected a string, got {}", n.kind_name()));
        }
        *out = n.scalar;
        return ok_status();
    }

    // An unquoted true or false (YAML and JSON alike).
    Status boolean(const DocNode& n, const std::string& path, bool* out) {
        if (n.kind != Kind::kScalar || n.quoted || (n.scalar != "true" && n.scalar != "false")) {
            return error(path, n.line, fmt::format("expected true or false, got {}", describe(n)));
        }
        *out = n.scalar == "true";
        return ok_status();
    }

    Status integer(const DocNode& n, const std::string& path, int* out) {
        if (n.kind != Kind::kScalar || n.quoted) {
            return error(path, n.line, fmt::format("expected an integer, got {}", describe(n)));
        }
        std::string_view s = n.scalar;
        if (!s.empty() && s.front() == '+') s.remove_prefix(1);
        long long v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc::result_out_of_range ||
            (ec == std::errc() && end == s.data() + s.size() &&
             (v > std::numeric_limits<int>::max() || v < std::numeric_limits<int>::min()))) {
            return error(path, n.line, fmt::format("{} is out of range", text::excerpt(n.scalar)));
        }
        if (ec != std::errc() || end != s.data() + s.size() || s.empty()) {
            return error(path, n.line, fmt::format("expected an integer, got {}", describe(n)));
        }
        *out = static_cast<int>(v);
        return ok_status();
    }

    Status number(const DocNode& n, const std::string& path, double* out) {
        if (n.kind != Kind::kScalar || n.quoted) {
            return error(path, n.line, fmt::format("expected a number, got {}", describe(n)));
        }
        std::string_view s = n.scalar;
        if (!s.empty() && s.front() == '+') s.remove_prefix(1);
        double v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc::result_out_of_range && end == s.data() + s.size()) {
            return error(path, n.line, fmt::format("{} is out of range", text::excerpt(n.scalar)));
        }
        if (ec != std::errc() || end != s.data() + s.size() || s.empty()) {
            return error(path, n.line, fmt::format("expected a number, got {}", describe(n)));
        }
        if (!std::isfinite(v)) {
            return error(path, n.line,
                         fmt::format("{} is not a finite number", text::excerpt(n.scalar)));
        }
        *out = v;
        return ok_status();
    }

    Status list(const DocNode& n, const std::string& path) {
        if (n.kind != Kind::kSeq) {
            return error(path, n.line, fmt::format("expected a list, got {}", n.kind_name()));
        }
        return ok_status();
    }

    Status string_list(const DocNode& n, const std::string& path, std::vector<std::string>* out) {
        PDSIM_RETURN_IF_ERROR(list(n, path));
        for (size_t i = 0; i < n.items.size(); ++i) {
            const std::string ip = index_path(path, i);
            note(ip, n.items[i]);
            std::string s;
            PDSIM_RETURN_IF_ERROR(string(n.items[i], ip, &s));
            out->push_back(std::move(s));
        }
        return ok_status();
    }

    Status int_list(const DocNode& n, const std::string& path, std::vector<int>* out) {
        PDSIM_RETURN_IF_ERROR(list(n, path));
        for (size_t i = 0; i < n.items.size(); ++i) {
            const std::string ip = index_path(path, i);
            note(ip, n.items[i]);
            int v = 0;
            PDSIM_RETURN_IF_ERROR(integer(n.items[i], ip, &v));
            out->push_back(v);
        }
        return ok_status();
    }

    Status link_type(const DocNode& n, const std::string& path, LinkType* out) {
        std::string s;
        PDSIM_RETURN_IF_ERROR(string(n, path, &s));
        const auto t = parse_link_type(s);
        if (!t) {
            return error(path, n.line,
                         fmt::format("unknown link type {} (expected nvlink, pcie, ib, ethernet or "
                                     "loopback)",
                                     detail::quoted_for_message(s)));
        }
        *out = *t;
        return ok_status();
    }

    // ---- the schema ----

    // A built-in name, or a mapping with the fields of a model file (backends/model): `base`
    // (or a built-in `name`) starts from a built-in shape and the fields given override it;
    // without one the shape fields are required. The fields the synthetic model adds
    // (intermediate, vocab, rope_theta, rms_eps, seed, layer_kinds, sliding_window, state_heads,
    // state_head_dim, conv_kernel) are read
    // too: the testbed and the simulator run the model this section describes, whole.
    Status model(const DocNode& n, const std::string& path, ModelShape* out) {
        note(path, n);
        if (n.kind == Kind::kScalar) {
            const ModelShape* m = builtin_model_shape(n.scalar);
            if (m == nullptr) {
                return error(
                    path, n.line,
                    fmt::format("unknown model {} (built in: {}; or give a mapping with "
                                "num_layers, num_q_heads, num_kv_heads, head_dim)",
                                detail::quoted_for_message(n.scalar), builtin_model_names()));
            }
            *out = *m;
            return ok_status();
        }
        PDSIM_RETURN_IF_ERROR(expect_map(
            n, path,
            {"name",         "base",           "num_layers",  "hidden",         "num_q_heads",
             "num_kv_heads", "head_dim",       "attention",   "kv_lora_rank",   "rope_dim",
             "intermediate", "vocab",          "rope_theta",  "rms_eps",        "seed",
             "layer_kinds",  "sliding_window", "state_heads", "state_head_dim", "conv_kernel"}));
        const DocNode* v = nullptr;
        const ModelShape* base = nullptr;
        if ((v = optional(n, "base")) != nullptr) {
            std::string b;
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "base"), &b));
            base = builtin_model_shape(b);
            if (base == nullptr) {
                return error(join(path, "base"), v->line,
                             fmt::format("unknown model {} (built in: {})",
                                         detail::quoted_for_message(b), builtin_model_names()));
            }
        }
        std::string name;
        if ((v = optional(n, "name")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "name"), &name));
            if (base == nullptr) base = builtin_model_shape(name);
        } else if (base == nullptr) {
            return error(join(path, "name"), n.line, "missing required field (or give a base)");
        }
        if (base != nullptr) *out = *base;
        if (!name.empty() || optional(n, "name") != nullptr) out->name = name;
        if ((v = optional(n, "attention")) != nullptr) {
            std::string a;
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "attention"), &a));
            if (a == "mha" || a == "gqa") {
                out->attention = AttentionKind::kMha;
            } else if (a == "mla") {
                out->attention = AttentionKind::kMla;
                if (base == nullptr) out->num_kv_heads = 1;
            } else {
                return error(join(path, "attention"), v->line,
                             fmt::format("unknown attention {} (expected mha, gqa or mla)",
                                         detail::quoted_for_message(a)));
            }
        }
        const bool mla = out->attention == AttentionKind::kMla;
        struct IntField {
            std::string_view key;
            int* dst;
            bool required;
        };
        const IntField fields[] = {
            {"num_layers", &out->num_layers, base == nullptr},
            {"hidden", &out->hidden, false},
            {"num_q_heads", &out->num_q_heads, base == nullptr},
            {"num_kv_heads", &out->num_kv_heads, base == nullptr && !mla},
            {"head_dim", &out->head_dim, base == nullptr},
            {"kv_lora_rank", &out->kv_lora_rank, base == nullptr && mla},
            {"rope_dim", &out->rope_dim, false},
            {"intermediate", &out->intermediate, false},
            {"vocab", &out->vocab, false},
            {"sliding_window", &out->sliding_window, false},
            {"state_heads", &out->state_heads, false},
            {"state_head_dim", &out->state_head_dim, false},
            {"conv_kernel", &out->conv_kernel, false},
        };
        for (const IntField& f : fields) {
            if (f.required) PDSIM_RETURN_IF_ERROR(required(n, path, f.key, &v));
            if ((v = optional(n, f.key)) != nullptr) {
                PDSIM_RETURN_IF_ERROR(integer(*v, join(path, f.key), f.dst));
            }
        }
        if ((v = optional(n, "rope_theta")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(number(*v, join(path, "rope_theta"), &out->rope_theta));
        }
        if ((v = optional(n, "rms_eps")) != nullptr) {
            double eps = 0;
            PDSIM_RETURN_IF_ERROR(number(*v, join(path, "rms_eps"), &eps));
            out->rms_eps = static_cast<float>(eps);
        }
        if ((v = optional(n, "seed")) != nullptr) {
            int seed = 0;
            PDSIM_RETURN_IF_ERROR(integer(*v, join(path, "seed"), &seed));
            if (seed < 0) {
                return error(join(path, "seed"), v->line,
                             fmt::format("must be >= 0, got {}", seed));
            }
            out->seed = static_cast<uint64_t>(seed);
        }
        if ((v = optional(n, "layer_kinds")) != nullptr) {
            std::vector<std::string> kinds;
            PDSIM_RETURN_IF_ERROR(string_list(*v, join(path, "layer_kinds"), &kinds));
            out->layer_kinds.clear();
            for (size_t i = 0; i < kinds.size(); ++i) {
                LayerKind kind{};
                if (!parse_layer_kind(kinds[i], &kind)) {
                    return error(index_path(join(path, "layer_kinds"), i), v->items[i].line,
                                 fmt::format("expected full, sliding or recurrent, got {}",
                                             detail::quoted_for_message(kinds[i])));
                }
                out->layer_kinds.push_back(kind);
            }
        }
        return ok_status();
    }

    Status device(const DocNode& n, const std::string& path, Device* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, path, {"id", "type", "index", "cores", "shared"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "id", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "id"), &out->id));
        PDSIM_RETURN_IF_ERROR(required(n, path, "type", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "type"), &out->type));
        if ((v = optional(n, "index")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(integer(*v, join(path, "index"), &out->index));
            if (out->index < 0) {
                return error(join(path, "index"), v->line,
                             fmt::format("must be >= 0, got {}", out->index));
            }
        }
        if ((v = optional(n, "cores")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "cores"), &out->cores));
        }
        if ((v = optional(n, "shared")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(boolean(*v, join(path, "shared"), &out->shared));
        }
        return ok_status();
    }

    Status nic(const DocNode& n, const std::string& path, Nic* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, path, {"id", "type", "gbps"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "id", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "id"), &out->id));
        PDSIM_RETURN_IF_ERROR(required(n, path, "type", &v));
        PDSIM_RETURN_IF_ERROR(link_type(*v, join(path, "type"), &out->type));
        PDSIM_RETURN_IF_ERROR(required(n, path, "gbps", &v));
        return number(*v, join(path, "gbps"), &out->gbps);
    }

    Status switch_(const DocNode& n, const std::string& path, Switch* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, path, {"id", "type"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "id", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "id"), &out->id));
        PDSIM_RETURN_IF_ERROR(required(n, path, "type", &v));
        return link_type(*v, join(path, "type"), &out->type);
    }

    template <typename T, typename Fn>
    Status each(const DocNode& n, const std::string& path, std::vector<T>* out, Fn&& fn) {
        PDSIM_RETURN_IF_ERROR(list(n, path));
        for (size_t i = 0; i < n.items.size(); ++i) {
            T item;
            PDSIM_RETURN_IF_ERROR(fn(n.items[i], index_path(path, i), &item));
            out->push_back(std::move(item));
        }
        return ok_status();
    }

    Status node(const DocNode& n, const std::string& path, Node* out) {
        PDSIM_RETURN_IF_ERROR(
            expect_map(n, path, {"id", "hostname", "cpus", "devices", "nics", "switches"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "id", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "id"), &out->id));
        out->hostname = out->id;
        if ((v = optional(n, "hostname")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "hostname"), &out->hostname));
        }
        if ((v = optional(n, "cpus")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(integer(*v, join(path, "cpus"), &out->cpus));
        }
        PDSIM_RETURN_IF_ERROR(required(n, path, "devices", &v));
        PDSIM_RETURN_IF_ERROR(each(
            *v, join(path, "devices"), &out->devices,
            [&](const DocNode& d, const std::string& p, Device* o) { return device(d, p, o); }));
        if ((v = optional(n, "nics")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(
                each(*v, join(path, "nics"), &out->nics,
                     [&](const DocNode& d, const std::string& p, Nic* o) { return nic(d, p, o); }));
        }
        if ((v = optional(n, "switches")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(each(*v, join(path, "switches"), &out->switches,
                                       [&](const DocNode& d, const std::string& p, Switch* o) {
                                           return switch_(d, p, o);
                                       }));
        }
        return ok_status();
    }

    Status link(const DocNode& n, const std::string& path, Link* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, path, {"a", "b", "type", "gbps", "latency_us"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "a", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "a"), &out->a));
        PDSIM_RETURN_IF_ERROR(required(n, path, "b", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "b"), &out->b));
        PDSIM_RETURN_IF_ERROR(required(n, path, "type", &v));
        PDSIM_RETURN_IF_ERROR(link_type(*v, join(path, "type"), &out->type));
        PDSIM_RETURN_IF_ERROR(required(n, path, "gbps", &v));
        PDSIM_RETURN_IF_ERROR(number(*v, join(path, "gbps"), &out->gbps));
        PDSIM_RETURN_IF_ERROR(required(n, path, "latency_us", &v));
        return number(*v, join(path, "latency_us"), &out->latency_us);
    }

    Status instance(const DocNode& n, const std::string& path, Instance* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, path, {"id", "role", "tp", "devices", "ranks"}));
        const DocNode* v = nullptr;
        PDSIM_RETURN_IF_ERROR(required(n, path, "id", &v));
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "id"), &out->id));
        PDSIM_RETURN_IF_ERROR(required(n, path, "role", &v));
        std::string role;
        PDSIM_RETURN_IF_ERROR(string(*v, join(path, "role"), &role));
        const auto r = parse_role(role);
        if (!r) {
            return error(join(path, "role"), v->line,
                         fmt::format("unknown role {} (expected prefill, decode or colocated)",
                                     detail::quoted_for_message(role)));
        }
        out->role = *r;
        PDSIM_RETURN_IF_ERROR(required(n, path, "tp", &v));
        PDSIM_RETURN_IF_ERROR(integer(*v, join(path, "tp"), &out->tp));
        PDSIM_RETURN_IF_ERROR(required(n, path, "devices", &v));
        PDSIM_RETURN_IF_ERROR(string_list(*v, join(path, "devices"), &out->devices));
        if ((v = optional(n, "ranks")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(int_list(*v, join(path, "ranks"), &out->ranks));
        }
        return ok_status();
    }

    Status shaping(const DocNode& n, const std::string& path, ShapingSpec* out) {
        PDSIM_RETURN_IF_ERROR(
            expect_map(n, path, {"emulate", "type", "gbps", "latency_us", "gpu", "time_scale"}));
        const DocNode* v = nullptr;
        if ((v = optional(n, "emulate")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "emulate"), &out->emulate));
        }
        if ((v = optional(n, "type")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(link_type(*v, join(path, "type"), &out->type));
        }
        PDSIM_RETURN_IF_ERROR(required(n, path, "gbps", &v));
        PDSIM_RETURN_IF_ERROR(number(*v, join(path, "gbps"), &out->gbps));
        PDSIM_RETURN_IF_ERROR(required(n, path, "latency_us", &v));
        PDSIM_RETURN_IF_ERROR(number(*v, join(path, "latency_us"), &out->latency_us));
        if ((v = optional(n, "gpu")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, join(path, "gpu"), &out->gpu));
        }
        out->time_scale = 0;  // auto
        if ((v = optional(n, "time_scale")) != nullptr &&
            !(v->kind == Kind::kScalar && v->scalar == "auto")) {
            PDSIM_RETURN_IF_ERROR(number(*v, join(path, "time_scale"), &out->time_scale));
            if (out->time_scale <= 0) {
                return error(
                    join(path, "time_scale"), v->line,
                    fmt::format("{} must be positive (or auto)", text::excerpt(v->scalar)));
            }
        }
        return ok_status();
    }

    Status root(const DocNode& n, Topology* out) {
        PDSIM_RETURN_IF_ERROR(expect_map(n, "",
                                         {"name", "description", "model", "nodes", "switches",
                                          "links", "instances", "world_size", "shaping"}));
        const DocNode* v = nullptr;
        if ((v = optional(n, "name")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, "name", &out->name));
        }
        if ((v = optional(n, "description")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(string(*v, "description", &out->description));
        }
        if ((v = optional(n, "model")) != nullptr) {
            ModelShape m;
            PDSIM_RETURN_IF_ERROR(model(*v, "model", &m));
            out->model = std::move(m);
        }
        PDSIM_RETURN_IF_ERROR(required(n, "", "nodes", &v));
        PDSIM_RETURN_IF_ERROR(
            each(*v, "nodes", &out->nodes,
                 [&](const DocNode& d, const std::string& p, Node* o) { return node(d, p, o); }));
        if ((v = optional(n, "switches")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(each(*v, "switches", &out->switches,
                                       [&](const DocNode& d, const std::string& p, Switch* o) {
                                           return switch_(d, p, o);
                                       }));
        }
        if ((v = optional(n, "links")) != nullptr) {
            PDSIM_RETURN_IF_ERROR(each(
                *v, "links", &out->links,
                [&](const DocNode& d, const std::string& p, Link* o) { return link(d, p, o); }));
        }
        PDSIM_RETURN_IF_ERROR(required(n, "", "instances", &v));
        PDSIM_RETURN_IF_ERROR(each(*v, "instances", &out->instances,
                                   [&](const DocNode& d, const std::string& p, Instance* o) {
                                       return instance(d, p, o);
                                   }));
        if ((v = optional(n, "world_size")) != nullptr) {
            int w = 0;
            PDSIM_RETURN_IF_ERROR(integer(*v, "world_size", &w));
            out->world_size = w;
        }
        if ((v = optional(n, "shaping")) != nullptr) {
            ShapingSpec s;
            PDSIM_RETURN_IF_ERROR(shaping(*v, "shaping", &s));
            out->shaping = std::move(s);
        }
        return ok_status();
    }

private:
    static std::string describe(const DocNode& n) {
        if (n.kind == Kind::kScalar) {
            return n.quoted ? "the string " + detail::quoted_for_message(n.scalar)
                            : detail::quoted_for_message(n.scalar);
        }
        return std::string(n.kind_name());
    }

    SourceInfo* src_;
};

bool ends_with_ci(std::string_view s, std::string_view suffix) {
    if (s.size() < suffix.size()) return false;
    for (size_t i = 0; i < suffix.size(); ++i) {
        const char c = s[s.size() - suffix.size() + i];
        if (std::tolower(static_cast<unsigned char>(c)) != suffix[i]) return false;
    }
    return true;
}

Format detect_format(std::string_view text, std::string_view source_name) {
    if (ends_with_ci(source_name, ".json")) return Format::kJson;
    if (ends_with_ci(source_name, ".yaml") || ends_with_ci(source_name, ".yml")) {
        return Format::kYaml;
    }
    for (char c : text) {
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n') continue;
        return c == '{' ? Format::kJson : Format::kYaml;
    }
    return Format::kYaml;
}

StatusOr<DocNode> read_doc(std::string_view text, std::string_view source_name, Format format) {
    if (text.size() > kMaxTopologyBytes) {
        return Status(StatusCode::kInvalidArgument, fmt::format("{}: file is larger than {} bytes",
                                                                source_name, kMaxTopologyBytes));
    }
    if (format == Format::kAuto) format = detect_format(text, source_name);
    return format == Format::kJson ? detail::read_json_doc(text, source_name)
                                   : detail::read_yaml_doc(text, source_name);
}

}  // namespace

StatusOr<Topology> parse_topology(std::string_view text, std::string_view source_name,
                                  Format format, const LoadOptions& options) {
    PDSIM_ASSIGN_OR_RETURN(DocNode doc, read_doc(text, source_name, format));
    Topology t;
    t.source.name = std::string(source_name);
    Walker w(&t.source);
    if (doc.kind == Kind::kNull) {
        return w.error("", doc.line,
                       "empty document (expected a mapping with nodes and instances)");
    }
    PDSIM_RETURN_IF_ERROR(w.root(doc, &t));
    if (options.validate) PDSIM_RETURN_IF_ERROR(validate(t, options.model));
    return t;
}

StatusOr<Topology> load_topology(const std::string& path_or_name, const LoadOptions& options) {
    const std::string path = data::resolve_data_file(data::DataKind::kTopologies, path_or_name);
    PDSIM_ASSIGN_OR_RETURN(std::string text, files::read_input_file(path, kMaxTopologyBytes));
    LoadOptions parse_options = options;
    parse_options.validate = false;
    PDSIM_ASSIGN_OR_RETURN(Topology t, parse_topology(text, path, Format::kAuto, parse_options));
    if (t.name.empty()) t.name = std::filesystem::path(path).stem().string();
    if (options.validate) PDSIM_RETURN_IF_ERROR(validate(t, options.model));
    return t;
}

}  // namespace pdsim::topo
