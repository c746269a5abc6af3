#include "backends/model/model_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <vector>

#include "common/data_dir.h"
#include "common/input_file.h"
#include "common/text.h"
#include "common/yaml_documents.h"

namespace pdsim::model {

namespace {

// The built-in models, by name: topology's table (topology/model_shape.h).
std::map<std::string, ModelConfig> builtin_models() {
    std::map<std::string, ModelConfig> m;
    for (const topo::ModelShape& shape : topo::builtin_model_shapes()) m.emplace(shape.name, shape);
    return m;
}

Status field_error(const std::string& src, const YAML::Node& n, const std::string& key,
                   const std::string& what) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}:{}: {}: {}", src, n.Mark().line + 1, text::excerpt(key), what));
}

// Every key and string of the document must be valid UTF-8; nesting is at most 16 levels (a
// model file is one flat mapping plus the layer_kinds list).
Status check_utf8(const std::string& src, const YAML::Node& n, const std::string& key, int depth) {
    if (depth > 16) return field_error(src, n, key, "nested more than 16 levels deep");
    if (n.IsScalar()) {
        if (!text::is_valid_utf8(n.Scalar())) {
            return field_error(src, n, key,
                               fmt::format("'{}' is not valid UTF-8", text::excerpt(n.Scalar())));
        }
    } else if (n.IsSequence()) {
        for (const YAML::Node& item : n)
            PDSIM_RETURN_IF_ERROR(check_utf8(src, item, key, depth + 1));
    } else if (n.IsMap()) {
        for (auto kv : n) {
            const YAML::Node k = kv.first;
            if (k.IsScalar() && !text::is_valid_utf8(k.Scalar())) {
                return field_error(src, k, k.Scalar(), "key is not valid UTF-8");
            }
            const std::string name = k.IsScalar() ? k.Scalar() : key;
            PDSIM_RETURN_IF_ERROR(check_utf8(src, kv.second, name, depth + 1));
        }
    }
    return {};
}

// The one YAML (or JSON) document of the regular file at `path` (at most 16 MiB).
StatusOr<YAML::Node> load_model_document(const std::string& path) {
    PDSIM_ASSIGN_OR_RETURN(std::string bytes,
                           files::read_input_file(path, files::kMaxConfigFileBytes));
    YAML::Node root;
    try {
        root = YAML::Load(bytes);  // YAML is a superset of JSON
    } catch (const YAML::Exception& e) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}:{}: {}", path, e.mark.line + 1, text::excerpt(e.msg)));
    }
    if (const auto second = yaml::second_document_line(bytes)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}:{}: a second YAML document starts here; a model file holds "
                                  "one",
                                  path, *second));
    }
    if (!root.IsMap()) {
        return Status(StatusCode::kInvalidArgument, path + ":1: a model file is a mapping");
    }
    PDSIM_RETURN_IF_ERROR(check_utf8(path, root, "(document)", 0));
    return root;
}

// The model files shipped in data/models (or share/pdsim/models), as "a, b", or "none found".
std::string shipped_model_names() {
    auto dir = data::find_data_dir(data::DataKind::kModels);
    if (!dir.ok()) return "none found";
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(*dir, ec)) {
        if (e.path().extension() == ".yaml") names.push_back(e.path().stem().string());
    }
    std::sort(names.begin(), names.end());
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out.empty() ? "none found" : out;
}

}  // namespace

std::vector<std::string> model_names() {
    std::vector<std::string> out;
    for (auto& [k, v] : builtin_models()) out.push_back(k);
    return out;
}

ModelConfig::ModelConfig() : topo::ModelShape(*topo::builtin_model_shape("tiny")) {}

Status validate_model(const ModelConfig& c) {
    auto bad = [&](const char* field, const std::string& what) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("model {}: {}: {}", c.name, field, what));
    };
    if (c.num_layers < 1) return bad("num_layers", fmt::format("{} must be >= 1", c.num_layers));
    if (c.num_layers > kMaxModelLayers) {
        return bad("num_layers", fmt::format("{} must be <= {}", c.num_layers, kMaxModelLayers));
    }
    const std::pair<const char*, int> dims[] = {{"hidden", c.hidden},
                                                {"num_q_heads", c.num_q_heads},
                                                {"num_kv_heads", c.num_kv_heads},
                                                {"head_dim", c.head_dim},
                                                {"intermediate", c.intermediate},
                                                {"vocab", c.vocab},
                                                {"kv_lora_rank", c.kv_lora_rank},
                                                {"rope_dim", c.rope_dim},
                                                {"sliding_window", c.sliding_window},
                                                {"state_heads", c.state_heads},
                                                {"state_head_dim", c.state_head_dim},
                                                {"conv_kernel", c.conv_kernel}};
    for (const auto& [field, value] : dims) {
        if (value > kMaxModelDim) {
            return bad(field, fmt::format("{} must be <= {}", value, kMaxModelDim));
        }
    }
    if (c.hidden < 1) return bad("hidden", fmt::format("{} must be >= 1", c.hidden));
    if (c.num_q_heads < 1) return bad("num_q_heads", fmt::format("{} must be >= 1", c.num_q_heads));
    if (c.num_kv_heads < 1)
        return bad("num_kv_heads", fmt::format("{} must be >= 1", c.num_kv_heads));
    if (c.head_dim < 1) return bad("head_dim", fmt::format("{} must be >= 1", c.head_dim));
    if (c.intermediate < 1)
        return bad("intermediate", fmt::format("{} must be >= 1", c.intermediate));
    if (c.vocab < 2) return bad("vocab", fmt::format("{} must be >= 2", c.vocab));
    if (c.attention == AttentionKind::kMha && c.num_q_heads % c.num_kv_heads != 0) {
        return bad("num_q_heads", fmt::format("{} is not a multiple of num_kv_heads {}",
                                              c.num_q_heads, c.num_kv_heads));
    }
    if (c.attention == AttentionKind::kMla && (c.kv_lora_rank < 1 || c.rope_dim < 0)) {
        return bad("kv_lora_rank", "MLA needs kv_lora_rank >= 1 and rope_dim >= 0");
    }
    for (LayerKind k : c.layer_kinds) {
        if (k == LayerKind::kSlidingWindow && c.sliding_window < 1) {
            return bad("sliding_window", "a sliding-window layer needs sliding_window >= 1");
        }
        if (k == LayerKind::kRecurrent) {
            const std::pair<const char*, int> state[] = {{"state_heads", c.state_heads},
                                                         {"state_head_dim", c.state_head_dim},
                                                         {"conv_kernel", c.conv_kernel}};
            for (const auto& [field, value] : state) {
                if (value < 1) {
                    return bad(field, fmt::format("{} must be >= 1 for a recurrent layer", value));
                }
            }
        }
    }
    return {};
}

StatusOr<ModelConfig> model_from_shape(const topo::ModelShape& shape, int layers) {
    ModelConfig c(shape);
    if (layers > 0) c.num_layers = layers;
    PDSIM_RETURN_IF_ERROR(validate_model(c));
    return c;
}

Status check_tp(const ModelConfig& c, int tp) {
    if (std::string error = topo::check_tp(c, tp); !error.empty()) {
        return Status(StatusCode::kInvalidArgument, error);
    }
    return {};
}

StatusOr<ModelConfig> resolve_model(const std::string& name_or_file) {
    auto models = builtin_models();
    if (auto it = models.find(name_or_file); it != models.end()) return it->second;
    // A shipped model file by name (data/models/NAME.yaml, common/data_dir.h), else a path.
    const std::string name_or_path = data::resolve_data_file(data::DataKind::kModels, name_or_file);
    if (!std::filesystem::exists(name_or_path)) {
        std::string known;
        for (auto& [k, v] : models) known += (known.empty() ? "" : ", ") + k;
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format(
                "unknown model '{}' (built-in: {}; a shipped model file: {}; or a YAML/JSON "
                "file)",
                name_or_path, known, shipped_model_names()));
    }
    PDSIM_ASSIGN_OR_RETURN(YAML::Node root, load_model_document(name_or_path));
    ModelConfig c;
    c.name = std::filesystem::path(name_or_path).stem().string();
    if (root["base"]) {
        std::string base = root["base"].as<std::string>("");
        auto it = models.find(base);
        if (it == models.end())
            return field_error(name_or_path, root["base"], "base",
                               "unknown model '" + text::excerpt(base) + "'");
        c = it->second;
    }
    for (auto kv : root) {
        const std::string key = kv.first.as<std::string>("");
        const YAML::Node& v = kv.second;
        auto get_int = [&](int* dst) -> Status {
            try {
                *dst = v.as<int>();
            } catch (const YAML::Exception&) {
                return field_error(name_or_path, v, key, "expected an integer");
            }
            return {};
        };
        try {
            if (key == "base") continue;
            if (key == "name")
                c.name = v.as<std::string>();
            else if (key == "num_layers")
                PDSIM_RETURN_IF_ERROR(get_int(&c.num_layers));
            else if (key == "hidden")
                PDSIM_RETURN_IF_ERROR(get_int(&c.hidden));
            else if (key == "num_q_heads")
                PDSIM_RETURN_IF_ERROR(get_int(&c.num_q_heads));
            else if (key == "num_kv_heads")
                PDSIM_RETURN_IF_ERROR(get_int(&c.num_kv_heads));
            else if (key == "head_dim")
                PDSIM_RETURN_IF_ERROR(get_int(&c.head_dim));
            else if (key == "intermediate")
                PDSIM_RETURN_IF_ERROR(get_int(&c.intermediate));
            else if (key == "vocab")
                PDSIM_RETURN_IF_ERROR(get_int(&c.vocab));
            else if (key == "kv_lora_rank")
                PDSIM_RETURN_IF_ERROR(get_int(&c.kv_lora_rank));
            else if (key == "rope_dim")
                PDSIM_RETURN_IF_ERROR(get_int(&c.rope_dim));
            else if (key == "sliding_window")
                PDSIM_RETURN_IF_ERROR(get_int(&c.sliding_window));
            else if (key == "state_heads")
                PDSIM_RETURN_IF_ERROR(get_int(&c.state_heads));
            else if (key == "state_head_dim")
                PDSIM_RETURN_IF_ERROR(get_int(&c.state_head_dim));
            else if (key == "conv_kernel")
                PDSIM_RETURN_IF_ERROR(get_int(&c.conv_kernel));
            else if (key == "rope_theta")
                c.rope_theta = v.as<double>();
            else if (key == "seed")
                c.seed = v.as<uint64_t>();
            else if (key == "attention") {
                std::string a = v.as<std::string>();
                if (a == "mha" || a == "gqa")
                    c.attention = AttentionKind::kMha;
                else if (a == "mla")
                    c.attention = AttentionKind::kMla;
                else
                    return field_error(name_or_path, v, key,
                                       "expected mha, gqa or mla, got '" + text::excerpt(a) + "'");
            } else if (key == "layer_kinds") {
                c.layer_kinds.clear();
                for (const auto& e : v) {
                    std::string k = e.as<std::string>();
                    LayerKind kind{};
                    if (!topo::parse_layer_kind(k, &kind)) {
                        return field_error(
                            name_or_path, e, key,
                            "expected full, sliding or recurrent, got '" + text::excerpt(k) + "'");
                    }
                    c.layer_kinds.push_back(kind);
                }
            } else {
                return field_error(name_or_path, kv.first, key, "unknown key");
            }
        } catch (const YAML::Exception& e) {
            return field_error(name_or_path, v, key, text::excerpt(e.msg));
        }
    }
    PDSIM_RETURN_IF_ERROR(validate_model(c).with_context(name_or_path));
    return c;
}

}  // namespace pdsim::model
