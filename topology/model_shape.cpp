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
        // Every layer kind: full, sliding (W = 128), recurrent (4 state heads of 32, conv 4), full.
        hybrid.layer_kinds = {LayerKind::kFullAttention, LayerKind::kSlidingWindow,
                              LayerKind::kRecurrent, LayerKind::kFullAttention};
        hybrid.sliding_window = 128;
        hybrid.state_heads = 4;
        hybrid.state_head_dim = 32;
        hybrid.conv_kernel = 4;
        t.push_back(hybrid);
        // Gemma 3 27B's shape: five sliding-window layers (window 1024) to one full layer.
        t.push_back({.name = "gemma3-27b",
                     .num_layers = 62,
                     .num_q_heads = 32,
                     .num_kv_heads = 16,
                     .head_dim = 128,
                     .hidden = 5376,
                     .attention = AttentionKind::kMha,
                     .intermediate = 21504,
                     .vocab = 262144,
                     .rope_theta = 1000000.0,
                     .layer_kinds = {LayerKind::kSlidingWindow, LayerKind::kSlidingWindow,
                                     LayerKind::kSlidingWindow, LayerKind::kSlidingWindow,
                                     LayerKind::kSlidingWindow, LayerKind::kFullAttention},
                     .sliding_window = 1024});
        // Qwen3-Next 80B-A3B's shape: three gated-linear-attention layers to one full layer.
        // Simplified: 32 state heads of 128 for q, k and v alike (the model has 16 key heads),
        // and a dense MLP as wide as the active experts (10 routed + 1 shared of 512).
        t.push_back({.name = "qwen3-next-80b",
                     .num_layers = 48,
                     .num_q_heads = 16,
                     .num_kv_heads = 2,
                     .head_dim = 256,
                     .hidden = 2048,
                     .attention = AttentionKind::kMha,
                     .intermediate = 5632,
                     .vocab = 151936,
                     .rope_theta = 10000000.0,
                     .layer_kinds = {LayerKind::kRecurrent, LayerKind::kRecurrent,
                                     LayerKind::kRecurrent, LayerKind::kFullAttention},
                     .state_heads = 32,
                     .state_head_dim = 128,
                     .conv_kernel = 4});
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

std::string_view layer_kind_name(LayerKind kind) {
    switch (kind) {
        case LayerKind::kFullAttention:
            return "full";
        case LayerKind::kSlidingWindow:
            return "sliding";
        case LayerKind::kRecurrent:
            return "recurrent";
    }
    return "?";
}

bool parse_layer_kind(std::string_view text, LayerKind* kind) {
    for (LayerKind k :
         {LayerKind::kFullAttention, LayerKind::kSlidingWindow, LayerKind::kRecurrent}) {
        if (text == layer_kind_name(k)) {
            *kind = k;
            return true;
        }
    }
    return false;
}

int ModelShape::count_layers(LayerKind kind) const {
    int n = 0;
    for (int l = 0; l < num_layers; ++l) n += layer_kind(l) == kind ? 1 : 0;
    return n;
}

int64_t ModelShape::state_elems_per_request_layer(int tp) const {
    if (count_layers(LayerKind::kRecurrent) == 0) return 0;
    const int64_t heads = std::max(1, state_heads / std::max(1, tp));
    const int64_t d = state_head_dim;
    return heads * (d * d + int64_t{std::max(0, conv_kernel - 1)} * 3 * d);
}

int64_t ModelShape::state_bytes_per_request() const {
    return state_elems_per_request_layer(1) * count_layers(LayerKind::kRecurrent) *
           static_cast<int64_t>(sizeof(float));
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
    // A recurrent layer: q, k, v and a decay gate in, the output back, the conv filter.
    const int64_t sd = int64_t{state_heads} * state_head_dim;
    const int64_t recurrent =
        int64_t{hidden} * (3 * sd + state_heads) + sd * hidden + 3 * sd * std::max(0, conv_kernel);
    const int64_t rec_layers = count_layers(LayerKind::kRecurrent);
    return (num_layers - rec_layers) * attn + rec_layers * recurrent + num_layers * mlp +
           int64_t{2} * vocab * hidden;
}

std::string check_tp(const ModelShape& model, int tp) {
    if (tp <= 0) return fmt::format("{} is not a positive TP size", tp);
    if (model.attention == AttentionKind::kMha && model.num_kv_heads % tp != 0) {
        return fmt::format("{} does not divide num_kv_heads {}", tp, model.num_kv_heads);
    }
    if (model.num_q_heads > 0 && model.num_q_heads % tp != 0) {
        return fmt::format("{} does not divide num_q_heads {}", tp, model.num_q_heads);
    }
    if (model.count_layers(LayerKind::kRecurrent) > 0 && model.state_heads % tp != 0) {
        return fmt::format("{} does not divide state_heads {}", tp, model.state_heads);
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
