// ModelShape: the few numbers of a model that constrain a topology (tensor parallelism must
// split the attention heads) and size its KV transfers. A small built-in table holds the
// models the testbed and the examples use; a topology file may also spell a shape out. Names,
// shapes and field names match backends/model/model_config.h (the synthetic model's
// ModelConfig), which the testbed converts to a ModelShape for validate(); the topology layer
// sits below backends and cannot include it.
//
// Thread-safety: the built-in table is immutable; every function here may be called from any
// thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace pdsim::topo {

enum class AttentionKind : uint8_t {
    kMha,  // multi-head / grouped-query attention: K and V per KV head
    kMla,  // multi-head latent attention: one latent buffer per token, replicated on TP ranks
};

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

    // KV bytes one token occupies in one layer, over all TP ranks (before any replication):
    // 2 * num_kv_heads * head_dim * dtype_bytes for MHA, (kv_lora_rank + rope_dim) *
    // dtype_bytes for MLA.
    [[nodiscard]] int64_t kv_bytes_per_token_layer(int dtype_bytes) const;

    friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

// The tensor-parallel rule (the same as model::check_tp, which the testbed's synthetic model
// needs): for MHA tp must divide num_kv_heads (no KV-head replication), and it must divide
// num_q_heads; MLA's latent buffer is replicated on every rank. Returns "" when tp is fine,
// else what is wrong ("3 does not divide num_kv_heads 8").
std::string check_tp(const ModelShape& model, int tp);

// tiny, hybrid-tiny, llama3-8b, llama3-70b, deepseek-v3; nullptr when unknown (case-sensitive).
const ModelShape* builtin_model_shape(std::string_view name);
std::span<const ModelShape> builtin_model_shapes();
// "tiny, hybrid-tiny, llama3-8b, ...": for error messages.
std::string builtin_model_names();

}  // namespace pdsim::topo
