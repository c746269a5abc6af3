// ModelShape: pdsim's one description of a model, and the one table of built-in models (tiny,
// hybrid-tiny, llama3-8b, llama3-70b, deepseek-v3, and the hybrid shapes gemma3-27b and
// qwen3-next-80b) that topology, the backends and the simulator all read. Its first fields (layers,
// heads, dims, attention kind) constrain a topology (tensor parallelism must split the heads) and
// size its KV transfers; the rest (intermediate, vocab, RoPE, norms, layer kinds, seed) are what a
// rank needs to build the synthetic model (backends/model/model_config.h: model::ModelConfig is a
// ModelShape that defaults to `tiny`). A topology file may spell a shape out; fields it does not
// give stay 0 (unknown) here.
//
// Thread-safety: the built-in table is immutable; every function here may be called from any
// thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pdsim::topo {

enum class AttentionKind : uint8_t {
    kMha,  // multi-head / grouped-query attention: K and V per KV head
    kMla,  // multi-head latent attention: one latent buffer per token, replicated on TP ranks
};
// What a layer's token mixer is. Attention layers keep paged KV (one token slot per position);
// a recurrent layer keeps a fixed-size state per request instead (see ModelShape's state fields).
enum class LayerKind : uint8_t {
    kFullAttention,  // "full": causal attention over every earlier position
    kSlidingWindow,  // "sliding": attention over the last `sliding_window` positions
    kRecurrent,      // "recurrent": gated linear attention with a short causal convolution
};
// "full", "sliding", "recurrent".
std::string_view layer_kind_name(LayerKind kind);
// The inverse of layer_kind_name; false for any other text.
[[nodiscard]] bool parse_layer_kind(std::string_view text, LayerKind* kind);

struct ModelShape {
    std::string name;
    int num_layers = 0;
    int num_q_heads = 0;
    int num_kv_heads = 0;  // 1 for MLA (one latent "head")
    int head_dim = 0;      // per head (MLA: the value head dim; qk adds rope_dim)
    int hidden = 0;        // 0: unknown
    AttentionKind attention = AttentionKind::kMha;
    int kv_lora_rank = 0;  // MLA only
    int rope_dim = 0;      // MLA only
    // What the synthetic model needs besides the shape (0: not given).
    int intermediate = 0;  // MLP width
    int vocab = 0;
    double rope_theta = 10000.0;
    float rms_eps = 1e-5f;
    // Per-layer kind for hybrid models (empty: all full attention), repeating; a sliding-window
    // layer attends to the last `sliding_window` positions only.
    std::vector<LayerKind> layer_kinds;
    int sliding_window = 0;
    // Recurrent layers (LayerKind::kRecurrent; a Mamba / gated-delta-net style mixer, simplified):
    // `state_heads` heads of `state_head_dim` channels each for q, k and v. Per request and
    // recurrent layer the model keeps a recurrent state [state_heads][state_head_dim]
    // [state_head_dim] and a convolution state [state_heads][conv_kernel - 1][3 * state_head_dim]
    // (the last conv_kernel - 1 inputs of the q, k, v channels), both fp32; tensor parallelism
    // slices both over the heads. 0: not given (a model with recurrent layers must give all three).
    int state_heads = 0;
    int state_head_dim = 0;
    int conv_kernel = 0;
    uint64_t seed = 1234;  // the synthetic model's weights

    [[nodiscard]] LayerKind layer_kind(int layer) const {
        return layer_kinds.empty() ? LayerKind::kFullAttention
                                   : layer_kinds[static_cast<size_t>(layer) % layer_kinds.size()];
    }
    // KV bytes one token occupies in one layer, over all TP ranks (before any replication):
    // 2 * num_kv_heads * head_dim * dtype_bytes for MHA, (kv_lora_rank + rope_dim) *
    // dtype_bytes for MLA.
    [[nodiscard]] int64_t kv_bytes_per_token_layer(int dtype_bytes) const;
    // Elements of KV one token occupies in one layer on one rank of a TP group of `tp` (MLA: the
    // latent buffer, replicated on every rank).
    [[nodiscard]] int64_t kv_elems_per_token_per_layer(int tp) const;
    // Bytes of KV per token (all layers) for `dtype_bytes` per element, whole model (tp = 1).
    [[nodiscard]] int64_t kv_bytes_per_token(int dtype_bytes) const;
    // Parameters (for roofline costs): per layer its mixer (attention or recurrent) + MLP, and
    // the embeddings.
    [[nodiscard]] int64_t num_params() const;
    // How many of the num_layers layers are of `kind`.
    [[nodiscard]] int count_layers(LayerKind kind) const;
    // Elements (fp32) of one request's state in one recurrent layer on one rank of a TP group of
    // `tp`: (state_heads / tp) * (state_head_dim^2 + (conv_kernel - 1) * 3 * state_head_dim).
    // 0 when the model has no recurrent layers.
    [[nodiscard]] int64_t state_elems_per_request_layer(int tp) const;
    // Bytes of one request's state over all recurrent layers, whole model (tp = 1), fp32.
    [[nodiscard]] int64_t state_bytes_per_request() const;

    friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

// The integer dimensions that files and reports record for a model, with their keys: a cost
// file's `model_config` (written by pdsim calibrate, checked by the cost-file reader and the
// calibrated model) and the testbed report's `model`. The one list all of them walk.
struct ModelDimension {
    std::string_view key;
    int ModelShape::*field;
};
inline constexpr ModelDimension kModelDimensions[] = {
    {"num_layers", &ModelShape::num_layers},
    {"hidden", &ModelShape::hidden},
    {"num_q_heads", &ModelShape::num_q_heads},
    {"num_kv_heads", &ModelShape::num_kv_heads},
    {"head_dim", &ModelShape::head_dim},
    {"intermediate", &ModelShape::intermediate},
    {"vocab", &ModelShape::vocab},
};

// The tensor-parallel rule (model::check_tp is this, as a Status): for MHA tp must divide
// num_kv_heads (no KV-head replication), and it must divide num_q_heads (and state_heads when the
// model has recurrent layers); MLA's latent buffer is replicated on every rank. Returns "" when tp
// is fine, else what is wrong ("3 does not divide num_kv_heads 8").
std::string check_tp(const ModelShape& model, int tp);

// tiny, hybrid-tiny, llama3-8b, llama3-70b, deepseek-v3, gemma3-27b, qwen3-next-80b; nullptr
// when unknown (case-sensitive).
const ModelShape* builtin_model_shape(std::string_view name);
std::span<const ModelShape> builtin_model_shapes();
// "tiny, hybrid-tiny, llama3-8b, ...": for error messages.
std::string builtin_model_names();

}  // namespace pdsim::topo
