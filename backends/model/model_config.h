// Model shapes: the named configurations pdsim knows (tiny, llama3-8b, llama3-70b, deepseek-v3,
// hybrid-tiny) and YAML/JSON model files, with overrides that shrink a real shape for the CPU.
// A ModelConfig is what every rank needs to build the same synthetic model (weights come from
// `seed`) and what the topology validator checks TP sizes against.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "topology/model_shape.h"

namespace pdsim::model {

enum class AttentionKind { kMHA, kMLA };
enum class LayerKind { kFullAttention, kSlidingWindow };

struct ModelConfig {
    std::string name;
    int num_layers = 4;
    int hidden = 256;
    int num_q_heads = 8;
    int num_kv_heads = 4;       // MHA/GQA; MLA: 1 latent "head"
    int head_dim = 64;
    int intermediate = 512;
    int vocab = 512;
    double rope_theta = 10000.0;
    float rms_eps = 1e-5f;
    AttentionKind attention = AttentionKind::kMHA;
    int kv_lora_rank = 0;       // MLA only
    int rope_dim = 0;           // MLA only
    // Per-layer kind for hybrid models (empty: all full attention). A sliding-window layer attends
    // to the last `sliding_window` positions only.
    std::vector<LayerKind> layer_kinds;
    int sliding_window = 0;
    uint64_t seed = 1234;

    [[nodiscard]] LayerKind layer_kind(int layer) const {
        return layer_kinds.empty() ? LayerKind::kFullAttention
                                   : layer_kinds[static_cast<size_t>(layer) % layer_kinds.size()];
    }
    // Elements of KV one token occupies in one layer on one rank of a TP group of `tp`.
    [[nodiscard]] int64_t kv_elems_per_token_per_layer(int tp) const;
    // Bytes of KV per token (all layers) for `dtype_bytes` per element, whole model (tp = 1).
    [[nodiscard]] int64_t kv_bytes_per_token(int dtype_bytes) const;
    // Parameters (for roofline costs): attention + MLP + embeddings.
    [[nodiscard]] int64_t num_params() const;
};

// Names of the built-in configurations.
[[nodiscard]] std::vector<std::string> model_names();
// A built-in configuration by name, else a shipped model file by name (NAME.yaml in data/models or
// share/pdsim/models, common/data_dir.h), else a YAML/JSON file path (any field above;
// `base: NAME` starts from a built-in config). Unknown names/keys are kInvalidArgument naming the
// file, line and key.
[[nodiscard]] StatusOr<ModelConfig> resolve_model(const std::string& name_or_file);
// Checks internal consistency (heads divide, dims positive). The message names the field.
[[nodiscard]] Status validate_model(const ModelConfig& config);
// kInvalidArgument unless tp divides the KV heads (MHA) and the query heads.
[[nodiscard]] Status check_tp(const ModelConfig& config, int tp);
// The shape the topology validator checks (topology sits below backends, so it has its own type).
[[nodiscard]] topo::ModelShape to_model_shape(const ModelConfig& config);

}  // namespace pdsim::model
