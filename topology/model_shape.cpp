#include "topology/model_shape.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace pdsim::topo {

namespace {

ModelShape llama3(std::string name, int num_layers, int num_q_heads, int hidden, int intermediate) {
    return {.name = std::move(name),
            .num_layers = num_layers,
            .num_q_heads = num_q_heads,
            .num_kv_heads = 8,
            .head_dim = 128,
            .hidden = hidden,
            .attention = AttentionKind::kMha,
            .intermediate = intermediate,
            .vocab = 128256,
            .rope_theta = 500000.0};
}

const std::vector<ModelShape>& table() {
    static const std::vector<ModelShape> kTable = [] {
        std::vector<ModelShape> t;
        // The testbed's default model: small enough for two CPU ranks.
        const ModelShape tiny{.name = "tiny",
                              .num_layers = 4,
                              .num_q_heads = 8,
                              .num_kv_heads = 4,
                              .head_dim = 64,
                              .hidden = 256,
                              .intermediate = 512,
                              .vocab = 512};
        t.push_back(tiny);
        ModelShape hybrid = tiny;
        hybrid.name = "hybrid-tiny";
        hybrid.layer_kinds = {LayerKind::kFullAttention, LayerKind::kSlidingWindow};
        hybrid.sliding_window = 128;
        t.push_back(hybrid);
        t.push_back(llama3("llama3-8b", 32, 32, 4096, 14336));
        t.push_back(llama3("llama3-70b", 80, 64, 8192, 28672));
        // head_dim: the value head dim (qk = 128 nope + 64 rope).
        t.push_back({.name = "deepseek-v3",
                     .num_layers = 61,
                     .num_q_heads = 128,
                     .num_kv_heads = 1,
                     .head_dim = 128,
                     .hidden = 7168,
                     .attention = AttentionKind::kMla,
                     .kv_lora_rank = 512,
                     .rope_dim = 64,
                     .intermediate = 18432,
                     .vocab = 129280});
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

int64_t ModelShape::kv_elems_per_token_per_layer(int tp) const {
    if (attention == AttentionKind::kMla) return kv_lora_rank + rope_dim;  // replicated
    const int heads = std::max(1, num_kv_heads / std::max(1, tp));
    return int64_t{2} * heads * head_dim;
}

int64_t ModelShape::kv_bytes_per_token(int dtype_bytes) const {
    return kv_elems_per_token_per_layer(1) * num_layers * dtype_bytes;
}

int64_t ModelShape::num_params() const {
    int64_t attn;
    if (attention == AttentionKind::kMla) {
        attn = static_cast<int64_t>(hidden) * (kv_lora_rank + rope_dim) +
               static_cast<int64_t>(kv_lora_rank) * num_q_heads * (head_dim * 2) +
               static_cast<int64_t>(hidden) * num_q_heads * (head_dim + rope_dim) +
               static_cast<int64_t>(num_q_heads) * head_dim * hidden;
    } else {
        attn = static_cast<int64_t>(hidden) * (num_q_heads + 2 * num_kv_heads) * head_dim +
               static_cast<int64_t>(num_q_heads) * head_dim * hidden;
    }
    const int64_t mlp = int64_t{3} * hidden * intermediate;
    return num_layers * (attn + mlp) + int64_t{2} * vocab * hidden;
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
