#include "topology/model_shape.h"

#include <fmt/format.h>

#include <vector>

namespace pdsim::topo {

namespace {

const std::vector<ModelShape>& table() {
    static const std::vector<ModelShape> kTable = [] {
        std::vector<ModelShape> t;
        // The testbed's default model: small enough for two CPU ranks.
        t.push_back({"tiny", 4, 8, 4, 64, 256, AttentionKind::kMha, 0, 0});
        t.push_back({"hybrid-tiny", 4, 8, 4, 64, 256, AttentionKind::kMha, 0, 0});
        t.push_back({"llama3-8b", 32, 32, 8, 128, 4096, AttentionKind::kMha, 0, 0});
        t.push_back({"llama3-70b", 80, 64, 8, 128, 8192, AttentionKind::kMha, 0, 0});
        // head_dim: the value head dim (qk = 128 nope + 64 rope).
        t.push_back({"deepseek-v3", 61, 128, 1, 128, 7168, AttentionKind::kMla, 512, 64});
        return t;
    }();
    return kTable;
}

}  // namespace

int64_t ModelShape::kv_bytes_per_token_layer(int dtype_bytes) const {
    if (attention == AttentionKind::kMla) {
        return static_cast<int64_t>(kv_lora_rank + rope_dim) * dtype_bytes;
    }
    return int64_t{2} * num_kv_heads * head_dim * dtype_bytes;
}

std::string check_tp(const ModelShape& model, int tp) {
    if (tp <= 0) return fmt::format("{} is not a positive TP size", tp);
    if (model.attention == AttentionKind::kMha && model.num_kv_heads % tp != 0) {
        return fmt::format("{} does not divide num_kv_heads {}", tp, model.num_kv_heads);
    }
    if (model.num_q_heads > 0 && model.num_q_heads % tp != 0) {
        return fmt::format("{} does not divide num_q_heads {}", tp, model.num_q_heads);
    }
    return {};
}

const ModelShape* builtin_model_shape(std::string_view name) {
    for (const ModelShape& m : table()) {
        if (m.name == name) return &m;
    }
    return nullptr;
}

std::span<const ModelShape> builtin_model_shapes() {
    return table();
}

std::string builtin_model_names() {
    std::string out;
    for (const ModelShape& m : table()) {
        if (!out.empty()) out += ", ";
        out += m.name;
    }
    return out;
}

}  // namespace pdsim::topo
