// SyntheticModel: a small but real transformer that drives the attention backends the way an LLM
// engine does, so the testbed's prefill and decode ranks do real work on real KV.
//
// Per layer: RMSNorm -> QKV projection -> RoPE -> KV write + attention (through an
// AttentionBackend, inside its PD record rule) -> O projection -> residual -> RMSNorm -> MLP
// (SiLU-gated) -> residual. A recurrent layer (LayerKind::kRecurrent) replaces the attention part:
// RMSNorm -> q|k|v and decay-gate projections -> the recurrent mixer (AttentionBackend::
// forward_recurrent, inside the same record rule; its state in the attached kv::StatePool) ->
// O projection -> residual, then the same MLP. Then a final RMSNorm, the LM head on each request's
// last token and greedy sampling. Weights come from ModelConfig::seed through a counter-based
// generator, so every rank (any TP size) builds bit-identical weights without communication.
//
// Invariance (why the testbed can demand disaggregated tokens == colocated tokens):
//  - batch-invariant: projections run on a kernel where every output element is one FMA chain over
//    k in order, whatever rows it is batched with (OpenBLAS sgemm is not row-position invariant);
//  - TP-invariant: the reductions of tensor parallelism (O projection, MLP down projection) are
//    split into num_kv_heads canonical slices whose partial sums are gathered (TpComm::allgather)
//    and added in slice order, so a TP-2 rank computes bit-identical hidden states to a TP-1 rank.
//
// Execution: forward() only enqueues work on the compute stream (the one the backend uses); the
// sampled tokens are written, in stream order, to the caller's `next_tokens` array. Buffers are the
// model's workspace, reused across forwards in stream order. One host thread drives a model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/kv/state_pool.h"
#include "backends/model/model.h"
#include "backends/model/model_config.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::model {

// The TP group's gather: every rank contributes `count` floats and receives all ranks'
// contributions, rank-major, in `out` (tp_size * count floats). The CPU model calls it inside a
// stream task, the GPU model (backends/cuda/cuda_synthetic_model.h) on its forward's thread; one
// thread per rank at a time. Every rank of the group must call it the same number of times with
// the same count. Blocks until every rank's contribution is in (bounded by the implementation's
// timeout); after an error the group is not usable again (its rounds can no longer be matched).
class TpComm {
public:
    virtual ~TpComm() = default;
    [[nodiscard]] virtual int size() const = 0;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual Status allgather(const float* mine, size_t count, float* out) = 0;
};

// StepBatch (one forward) is declared in backends/model/model.h.

// Observes layer boundaries on the stream (timelines); called from the stream's thread.
using LayerHook = std::function<void(int layer, bool begin)>;

class SyntheticModel : public Model {
public:
    // `tp` may be null for TP 1. `max_tokens` bounds T per forward.
    [[nodiscard]] static StatusOr<std::unique_ptr<SyntheticModel>> create(const ModelConfig& config,
                                                                          TpComm* tp,
                                                                          int max_tokens);
    SyntheticModel(const SyntheticModel&) = delete;
    SyntheticModel& operator=(const SyntheticModel&) = delete;

    [[nodiscard]] const ModelConfig& config() const override { return cfg_; }
    [[nodiscard]] int tp_size() const override { return tp_size_; }
    [[nodiscard]] int local_q_heads() const override { return hq_; }
    [[nodiscard]] int local_kv_heads() const override { return hkv_; }
    [[nodiscard]] size_t weight_bytes() const override;
    // The attention layer spec of `layer` on this rank.
    [[nodiscard]] attn::LayerSpec layer_spec(int layer) const override;

    // Enqueues the forward of `batch` on backend.stream(): metadata, every layer, sampling.
    // next_tokens[i] (i < bs) receives request i's greedy next token when the stream gets there.
    // `save_kv_cache=false` prewrites each layer's KV before the attention call (the fused-RoPE
    // prewrite path), exercising the backend's record-before rule.
    [[nodiscard]] Status forward(const StepBatch& batch, attn::AttentionBackend& backend,
                                 kv::KVPool& pool, int32_t* next_tokens,
                                 bool save_kv_cache = true) override;

    void set_layer_hook(LayerHook hook) { hook_ = std::move(hook); }

    // Recurrent layers. The states live in a StatePool the caller owns, attached once before the
    // first forward (it must outlive the model's forwards); each forward's StepBatch::state_slots
    // gives every request's slot. state_pool_config(n) is this rank's pool shape for n slots
    // (including the null slot 0). A forward of a model with recurrent layers and no attached pool
    // or no slots is kFailedPrecondition / kInvalidArgument. attach_state_pool(nullptr) detaches.
    [[nodiscard]] kv::StatePoolConfig state_pool_config(int num_slots) const;
    [[nodiscard]] Status attach_state_pool(kv::StatePool* pool);
    [[nodiscard]] int num_recurrent_layers() const { return num_recurrent_; }

    // Sliding-window layers in their own cache group. With a window pool attached, every sliding
    // layer writes and reads its KV there, through StepBatch::window_out_cache_loc and
    // window_page_table (whose entries before a request's window may name any page: they are never
    // read), and the pool given to forward() need not hold the sliding layers. The pool must hold
    // every sliding layer (kv::KVPool::holds_layer, numbered as the model's layers) with this
    // rank's KV heads, and outlive the forwards that use it; a forward without the window fields
    // is kInvalidArgument. attach_window_pool(nullptr) detaches (sliding layers use the main pool
    // and page table again). kFailedPrecondition for a model without sliding layers.
    [[nodiscard]] Status attach_window_pool(kv::MHATokenToKVPool* pool);

    // Deterministic weight value (exposed for tests): element `index` of tensor `tensor`.
    [[nodiscard]] static float weight_value(uint64_t seed, uint64_t tensor, uint64_t index,
                                            float scale);

private:
    SyntheticModel(const ModelConfig& config, TpComm* tp, int max_tokens);
    [[nodiscard]] Status init_weights();
    // Stream-task helpers of forward().
    [[nodiscard]] Status reduce_into_h(int T);
    [[nodiscard]] Status enqueue_recurrent_layer(int l, int T, int bs,
                                                 const std::shared_ptr<const StepBatch>& staged,
                                                 attn::AttentionBackend& backend,
                                                 const std::function<Status(int)>& mlp);

    struct Layer {
        std::vector<float> norm1, norm2;  // [H]
        std::vector<float> wq, wk, wv;    // [H][local heads * D]
        std::vector<float> wo;            // [local q heads * D][H]
        std::vector<float> w_gate, w_up;  // [H][local I]
        std::vector<float> w_down;        // [local I][H]
        // Recurrent layers only (q|k|v per head; slices as for attention):
        std::vector<float> w_qkv;    // [H][local state heads * 3D]
        std::vector<float> w_decay;  // [H][local state heads]
        std::vector<float> conv;     // [local state heads][3D][conv_kernel]
        std::vector<float> w_out;    // [local state heads * D][H]
        int state_layer = -1;        // index among the recurrent layers
    };

    ModelConfig cfg_;
    TpComm* tp_;
    int tp_size_ = 1;
    int tp_rank_ = 0;
    int hq_ = 0, hkv_ = 0, inter_ = 0;  // local sizes
    int slices_ = 1;                    // canonical reduction slices (whole model)
    int hs_ = 0;                        // local state heads
    int num_recurrent_ = 0;
    kv::StatePool* state_pool_ = nullptr;
    kv::MHATokenToKVPool* window_pool_ = nullptr;
    int max_tokens_ = 0;
    std::vector<Layer> layers_;
    std::vector<float> embed_;          // [V][H]
    std::vector<float> final_norm_;     // [H]
    std::vector<float> lm_head_;        // [H][V]
    std::vector<float> rope_inv_freq_;  // [D/2]

    // Workspace (touched only by stream tasks).
    std::vector<float> h_, x_, q_, k_, v_, attn_, gate_, up_, partial_, gathered_;
    std::vector<float> qkv_, decay_, mixed_;  // recurrent layers: [T][hs][3D], [T][hs], [T][hs][D]
    LayerHook hook_;
};

}  // namespace pdsim::model
