// HybridBackend: the composite backend of a hybrid model (attention layers and recurrent-state
// layers, topo::LayerKind). It dispatches per layer kind -- forward() (full and sliding-window
// attention) to its attention child, forward_recurrent() to its recurrent mixer -- and owns the PD
// record: the base class applies the record rule once around each call, and the children are
// called with record_kv_cache = false and never see the StepCounter, so a model layer makes
// exactly one record whatever its kind and whatever the children do (tokenspeed's hybrid wrapper
// "counts once per model layer across full-attn + mamba children").
//
// Metadata: init_forward_metadata() fills this backend's eager buffers (which the mixer reads:
// seq_lens, q_lens, q_start) and the attention child's. Graph state (CUDA-graph style metadata)
// is not supported: init_cuda_graph_state is kUnimplemented.
//
// Capabilities: the attention child's, plus recurrent_layers.
//
// Thread-safety: one host thread drives it (as any backend).
#pragma once

#include <memory>
#include <string>

#include "backends/attention/attention_backend.h"
#include "common/status.h"

namespace pdsim::attn {

// A recurrent layer's kernel: enqueues the layer's work on `stream` (args checked by
// AttentionBackend::forward_recurrent; args.meta is the hybrid backend's eager metadata, valid
// when the work runs). Math (per request, per head, per new token in order; D = head_dim,
// K = conv_kernel):
//   c      = silu(depthwise causal conv of the q|k|v inputs over the last K inputs, the older K - 1
//            kept in the conv state), split into q, k, v (D each)
//   q^     = q / (|q| + 1e-6) / sqrt(D);  k^ = k / (|k| + 1e-6);  g = sigmoid(gate)
//   S      = g * S + k^ v^T              (S: the D x D recurrent state, [key][value])
//   out    = q^ . S                      (out[b] = sum_a q^[a] S[a][b])
// A request whose first new token is at position 0 starts from S = 0 and a zero conv state.
class RecurrentMixer {
public:
    virtual ~RecurrentMixer() = default;
    [[nodiscard]] virtual std::string name() const = 0;
    [[nodiscard]] virtual Status enqueue(const RecurrentArgs& args, runtime::Stream& stream) = 0;
};

// The CPU mixer: fp32, one FMA order per (request, head) whatever the batch, so its output is
// batch-invariant and chunking-invariant (a request's chunks give the same state as one extend);
// (request, head) pairs run in parallel on the global ThreadPool.
[[nodiscard]] std::unique_ptr<RecurrentMixer> make_cpu_recurrent_mixer();

class HybridBackend final : public AttentionBackend {
public:
    // kInvalidArgument for a null child or mixer, or a child on another stream than `config`'s
    // (the hybrid's config is the child's).
    [[nodiscard]] static StatusOr<std::unique_ptr<HybridBackend>> create(
        std::unique_ptr<AttentionBackend> attention, std::unique_ptr<RecurrentMixer> mixer);

    [[nodiscard]] std::string name() const override;
    [[nodiscard]] BackendCapabilities capabilities() const override;
    [[nodiscard]] bool support_kv_cache_prewrite(std::optional<ForwardMode> mode) const override {
        return attention_->support_kv_cache_prewrite(mode);
    }
    [[nodiscard]] Status init_forward_metadata(const ForwardBatch& batch) override;
    [[nodiscard]] Status init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                               const GraphStateExtras& extras) override;

    [[nodiscard]] AttentionBackend& attention() { return *attention_; }

    // A planted bug for the testbed's --fault hybrid-double-record: the composite that lets each
    // child record too. The attention child gets this backend's StepCounter and is called with
    // the default record rule, so an extend forward's attention layer records twice (the child's
    // record, then this backend's). Never on outside a fault run.
    void plant_child_records(bool on) { child_records_ = on; }

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override;
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override;
    [[nodiscard]] Status forward_recurrent_impl(const RecurrentArgs& args) override;

private:
    HybridBackend(std::unique_ptr<AttentionBackend> attention,
                  std::unique_ptr<RecurrentMixer> mixer);
    [[nodiscard]] Status call_attention(const ForwardArgs& args);

    std::unique_ptr<AttentionBackend> attention_;
    std::unique_ptr<RecurrentMixer> mixer_;
    bool child_records_ = false;
};

}  // namespace pdsim::attn
