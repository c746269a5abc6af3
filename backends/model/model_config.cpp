#include "backends/model/model_config.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include <yaml-cpp/yaml.h>

#include "common/data_dir.h"

namespace pdsim::model {

namespace {

std::map<std::string, ModelConfig> builtin_models() {
    std::map<std::string, ModelConfig> m;
    ModelConfig tiny;
    tiny.name = "tiny";
    m["tiny"] = tiny;

    ModelConfig l8;
    l8.name = "llama3-8b";
    l8.num_layers = 32;
    l8.hidden = 4096;
    l8.num_q_heads = 32;
    l8.num_kv_heads = 8;
    l8.head_dim = 128;
    l8.intermediate = 14336;
    l8.vocab = 128256;
    l8.rope_theta = 500000.0;
    m[l8.name] = l8;

    ModelConfig l70 = l8;
    l70.name = "llama3-70b";
    l70.num_layers = 80;
    l70.hidden = 8192;
    l70.num_q_heads = 64;
    l70.intermediate = 28672;
    m[l70.name] = l70;

    ModelConfig ds;
    ds.name = "deepseek-v3";
    ds.num_layers = 61;
    ds.hidden = 7168;
    ds.num_q_heads = 128;
    ds.num_kv_heads = 1;
    ds.head_dim = 128;  // v head dim; qk = 128 nope + 64 rope
    ds.intermediate = 18432;
    ds.vocab = 129280;
    ds.attention = AttentionKind::kMLA;
    ds.kv_lora_rank = 512;
    ds.rope_dim = 64;
    m[ds.name] = ds;

    ModelConfig hy = tiny;
    hy.name = "hybrid-tiny";
    hy.layer_kinds = {LayerKind::kFullAttention, LayerKind::kSlidingWindow};
    hy.sliding_window = 128;
    m[hy.name] = hy;
    return m;
}

Status field_error(const std::string& src, const YAML::Node& n, const std::string& key, const std::string& what) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}:{}: {}: {}", src, n.Mark().line + 1, key, what));
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

int64_t ModelConfig::kv_elems_per_token_per_layer(int tp) const {
    if (attention == AttentionKind::kMLA) return kv_lora_rank + rope_dim;  // replicated on every rank
    const int heads = std::max(1, num_kv_heads / std::max(1, tp));
    return 2LL * heads * head_dim;
}

int64_t ModelConfig::kv_bytes_per_token(int dtype_bytes) const {
    return kv_elems_per_token_per_layer(1) * num_layers * dtype_bytes;
}

int64_t ModelConfig::num_params() const {
    int64_t attn;
    if (attention == AttentionKind::kMLA) {
        attn = static_cast<int64_t>(hidden) * (kv_lora_rank + rope_dim) +
               static_cast<int64_t>(kv_lora_rank) * num_q_heads * (head_dim * 2) +
               static_cast<int64_t>(hidden) * num_q_heads * (head_dim + rope_dim) +
               static_cast<int64_t>(num_q_heads) * head_dim * hidden;
    } else {
        attn = static_cast<int64_t>(hidden) * (num_q_heads + 2 * num_kv_heads) * head_dim +
               static_cast<int64_t>(num_q_heads) * head_dim * hidden;
    }
    const int64_t mlp = 3LL * hidden * intermediate;
    return num_layers * (attn + mlp) + 2LL * vocab * hidden;
}

Status validate_model(const ModelConfig& c) {
    auto bad = [&](const char* field, const std::string& what) {
        return Status(StatusCode::kInvalidArgument, fmt::format("model {}: {}: {}", c.name, field, what));
    };
    if (c.num_layers < 1) return bad("num_layers", fmt::format("{} must be >= 1", c.num_layers));
    if (c.hidden < 1) return bad("hidden", fmt::format("{} must be >= 1", c.hidden));
    if (c.num_q_heads < 1) return bad("num_q_heads", fmt::format("{} must be >= 1", c.num_q_heads));
    if (c.num_kv_heads < 1) return bad("num_kv_heads", fmt::format("{} must be >= 1", c.num_kv_heads));
    if (c.head_dim < 1) return bad("head_dim", fmt::format("{} must be >= 1", c.head_dim));
    if (c.intermediate < 1) return bad("intermediate", fmt::format("{} must be >= 1", c.intermediate));
    if (c.vocab < 2) return bad("vocab", fmt::format("{} must be >= 2", c.vocab));
    if (c.attention == AttentionKind::kMHA && c.num_q_heads % c.num_kv_heads != 0) {
        return bad("num_q_heads", fmt::format("{} is not a multiple of num_kv_heads {}", c.num_q_heads, c.num_kv_heads));
    }
    if (c.attention == AttentionKind::kMLA && (c.kv_lora_rank < 1 || c.rope_dim < 0)) {
        return bad("kv_lora_rank", "MLA needs kv_lora_rank >= 1 and rope_dim >= 0");
    }
    for (LayerKind k : c.layer_kinds) {
        if (k == LayerKind::kSlidingWindow && c.sliding_window < 1) {
            return bad("sliding_window", "a sliding-window layer needs sliding_window >= 1");
        }
    }
    return {};
}

topo::ModelShape to_model_shape(const ModelConfig& c) {
    topo::ModelShape s;
    s.name = c.name;
    s.num_layers = c.num_layers;
    s.num_q_heads = c.num_q_heads;
    s.num_kv_heads = c.num_kv_heads;
    s.head_dim = c.head_dim;
    s.hidden = c.hidden;
    s.attention = c.attention == AttentionKind::kMLA ? topo::AttentionKind::kMla : topo::AttentionKind::kMha;
    s.kv_lora_rank = c.kv_lora_rank;
    s.rope_dim = c.rope_dim;
    return s;
}

Status check_tp(const ModelConfig& c, int tp) {
    if (tp < 1) return Status(StatusCode::kInvalidArgument, fmt::format("tp {} must be >= 1", tp));
    if (c.attention == AttentionKind::kMHA && c.num_kv_heads % tp != 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} does not divide num_kv_heads {}", tp, c.num_kv_heads));
    }
    if (c.num_q_heads % tp != 0) {
        return Status(StatusCode::kInvalidArgument, fmt::format("{} does not divide num_q_heads {}", tp, c.num_q_heads));
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
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("unknown model '{}' (built-in: {}; a shipped model file: {}; or a YAML/JSON "
                                  "file)",
                                  name_or_path, known, shipped_model_names()));
    }
    YAML::Node root;
    try {
        root = YAML::LoadFile(name_or_path);  // YAML is a superset of JSON
    } catch (const YAML::Exception& e) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}:{}: {}", name_or_path, e.mark.line + 1, e.msg));
    }
    if (!root.IsMap()) return Status(StatusCode::kInvalidArgument, name_or_path + ":1: a model file is a mapping");
    ModelConfig c;
    c.name = std::filesystem::path(name_or_path).stem().string();
    if (root["base"]) {
        std::string base = root["base"].as<std::string>("");
        auto it = models.find(base);
        if (it == models.end()) return field_error(name_or_path, root["base"], "base", "unknown model '" + base + "'");
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
            if (key == "name") c.name = v.as<std::string>();
            else if (key == "num_layers") PDSIM_RETURN_IF_ERROR(get_int(&c.num_layers));
            else if (key == "hidden") PDSIM_RETURN_IF_ERROR(get_int(&c.hidden));
            else if (key == "num_q_heads") PDSIM_RETURN_IF_ERROR(get_int(&c.num_q_heads));
            else if (key == "num_kv_heads") PDSIM_RETURN_IF_ERROR(get_int(&c.num_kv_heads));
            else if (key == "head_dim") PDSIM_RETURN_IF_ERROR(get_int(&c.head_dim));
            else if (key == "intermediate") PDSIM_RETURN_IF_ERROR(get_int(&c.intermediate));
            else if (key == "vocab") PDSIM_RETURN_IF_ERROR(get_int(&c.vocab));
            else if (key == "kv_lora_rank") PDSIM_RETURN_IF_ERROR(get_int(&c.kv_lora_rank));
            else if (key == "rope_dim") PDSIM_RETURN_IF_ERROR(get_int(&c.rope_dim));
            else if (key == "sliding_window") PDSIM_RETURN_IF_ERROR(get_int(&c.sliding_window));
            else if (key == "rope_theta") c.rope_theta = v.as<double>();
            else if (key == "seed") c.seed = v.as<uint64_t>();
            else if (key == "attention") {
                std::string a = v.as<std::string>();
                if (a == "mha" || a == "gqa") c.attention = AttentionKind::kMHA;
                else if (a == "mla") c.attention = AttentionKind::kMLA;
                else return field_error(name_or_path, v, key, "expected mha, gqa or mla, got '" + a + "'");
            } else if (key == "layer_kinds") {
                c.layer_kinds.clear();
                for (const auto& e : v) {
                    std::string k = e.as<std::string>();
                    if (k == "full") c.layer_kinds.push_back(LayerKind::kFullAttention);
                    else if (k == "sliding") c.layer_kinds.push_back(LayerKind::kSlidingWindow);
                    else return field_error(name_or_path, e, key, "expected full or sliding, got '" + k + "'");
                }
            } else {
                return field_error(name_or_path, kv.first, key, "unknown key");
            }
        } catch (const YAML::Exception& e) {
            return field_error(name_or_path, v, key, e.msg);
        }
    }
    PDSIM_RETURN_IF_ERROR(validate_model(c).with_context(name_or_path));
    return c;
}

}  // namespace pdsim::model
