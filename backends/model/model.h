// Model: what the testbed needs from a model, whichever device runs it. The CPU SyntheticModel
// (backends/model/synthetic_model.h) and the GPU CudaSyntheticModel
// (backends/cuda/cuda_synthetic_model.h) implement it with the same weights (from
// ModelConfig::seed) and the same forward contract, so a rank can hold either behind one pointer.
//
// forward() contract (both models):
//  - Validates `batch` on the host; a bad batch is kInvalidArgument naming the field, and nothing
//    is enqueued.
//  - Enqueues the whole forward (metadata, every layer, sampling) on backend.stream() and returns
//    without waiting for it. next_tokens[i] (i < batch's bs) receives request i's greedy next
//    token when the stream gets there: it is valid once the stream has synchronized (or, for a
//    model that exposes one, once its completion event has been reached). next_tokens must stay
//    valid until then.
//  - `save_kv_cache=false` prewrites each layer's KV before the attention call (the fused-RoPE
//    prewrite path), exercising the backend's record-before rule.
//  - Errors raised on the stream (e.g. kDataLoss for non-finite logits) poison the stream (sticky)
//    and are returned by its synchronize().
//
// Layer observation is model-specific: the CPU model calls a host LayerHook from its stream
// tasks; the GPU model has no host callbacks on its forward path and times layers with device
// events instead (CudaSyntheticModel::set_layer_timing).
//
// Thread-safety: one host thread drives a model (the rank's scheduler thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/model_config.h"
#include "common/status.h"

namespace pdsim::model {

// One forward: `bs` requests, each with extend_lens[i] new tokens (1 for decode) at positions
// seq_lens[i] - extend_lens[i] .. seq_lens[i] - 1.
struct StepBatch {
    attn::ForwardMode mode = attn::ForwardMode::kExtend;
    std::vector<int32_t> tokens;         // [T] token ids of the new tokens
    std::vector<int32_t> out_cache_loc;  // [T] KV slots of the new tokens
    std::vector<int32_t> seq_lens;       // [bs]
    std::vector<int32_t> extend_lens;    // [bs]
    std::vector<int32_t> page_table;     // [bs * page_table_stride]
    int page_table_stride = 0;
    // [bs] each request's slot in the state pool (models with recurrent layers; else empty).
    std::vector<int32_t> state_slots;
    // Models whose sliding-window layers keep their KV in their own pool (SyntheticModel::
    // attach_window_pool): those layers' KV slots of the new tokens [T] and page table
    // [bs * window_page_table_stride], indexed as out_cache_loc / page_table are. Else empty.
    std::vector<int32_t> window_out_cache_loc;
    std::vector<int32_t> window_page_table;
    int window_page_table_stride = 0;
};

class Model {
public:
    virtual ~Model() = default;

    [[nodiscard]] virtual const ModelConfig& config() const = 0;
    [[nodiscard]] virtual int tp_size() const = 0;
    [[nodiscard]] virtual int local_q_heads() const = 0;
    [[nodiscard]] virtual int local_kv_heads() const = 0;
    // Bytes of weights this rank holds (the CPU model: fp32; the GPU model: bf16 projections and
    // fp32 norms).
    [[nodiscard]] virtual size_t weight_bytes() const = 0;
    // The attention layer spec of `layer` on this rank.
    [[nodiscard]] virtual attn::LayerSpec layer_spec(int layer) const = 0;

    // See the file comment.
    [[nodiscard]] virtual Status forward(const StepBatch& batch, attn::AttentionBackend& backend,
                                         kv::KVPool& pool, int32_t* next_tokens,
                                         bool save_kv_cache = true) = 0;

protected:
    Model() = default;
};

}  // namespace pdsim::model
