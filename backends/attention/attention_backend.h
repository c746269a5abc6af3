// AttentionBackend: the base class of pdsim's attention backends, mirroring tokenspeed's
// (lightseekorg/tokenspeed, python/tokenspeed/runtime/layers/attention/backends/base.py), with the
// PD layerwise record rule. The contract is restated in docs/design.md "AttentionBackend".
//
// Execution model. A backend owns no thread: forward() validates on the host and enqueues its work
// (the KV write, then the attention kernel) on the compute stream given in AttentionConfig.
//
// Tensors. forward() takes typed, device-tagged views (backends/runtime/tensor.h), all contiguous
// and row-major, with one row per new token of the batch (num_tokens = sum of its extend lens):
//   q              [num_tokens][layer.num_q_heads][layer.head_dim]       activation dtype
//   k              [num_tokens][layer.num_kv_heads][layer.head_dim]      activation dtype
//   v              [num_tokens][layer.num_kv_heads][v_dim(layer)]        activation dtype
//   out            [num_tokens][layer.num_q_heads][v_dim(layer)]         activation dtype (written)
//   out_cache_loc  [num_tokens]                                          int32 KV slots
// q, k, v and out share one activation dtype; every view lives on the pool's device. k, v and
// out_cache_loc may be null views when save_kv_cache is false (the KV was pre-written); any view
// may be null when the forward has no tokens (bs 0, e.g. idle). A view does not own its memory:
// it must stay valid, and the inputs unchanged, until the enqueued work has run (until the stream
// is synchronized, or an event recorded after it has completed); out is written when it runs.
//
// Capabilities. Each backend declares, in capabilities(), the activation dtypes, KV (pool) dtypes
// and device kinds it accepts. forward() checks every call against that declaration, the layer
// spec and the batch before anything is enqueued (nothing is recorded or enqueued on a mismatch):
//   - the pool's device kind and dtype are declared ones; the layer's heads are positive, query
//     heads a multiple of KV heads, layer_id a layer of the pool; sliding_window >= 0, and > 0
//     only where the backend declares sliding-window attention;
//   - q's dtype is a declared activation dtype and k, v, out have the same one;
//   - every view is on the pool's device (kind and index), of the shape above, contiguous;
//   - eager metadata (init_forward_metadata): num_tokens is the batch's; graph metadata (capture
//     or replay): the views share one num_tokens, which must cover every batch replayed.
// A mismatch is kInvalidArgument naming the argument ("q: dtype bf16, expected fp32").
// create_attention_backend also rejects a config.kv_dtype the backend does not declare.
//
// Metadata. init_forward_metadata(batch) copies the batch description into the backend's eager
// metadata buffers *in stream order* (the copy is a stream task), so it may be called for the
// next batch while the previous one is still running. Graph mode mirrors CUDA graphs:
// init_cuda_graph_state(max_bs, seq_lens_buf) pre-allocates graph metadata buffers and aliases the
// caller's seq_lens buffer (never copies it, never writes it); forwards issued between
// begin_capture() and end_capture() after init_forward_metadata_capture_cuda_graph() read those
// buffers through pointers when they run; init_forward_metadata_replay_cuda_graph(batch) updates
// them in place (stream-ordered) before a replay, so a replay sees the current batch. The caller
// updates seq_lens_buf itself, in stream order (or with the stream idle).
//
// Cache groups. A batch may carry a second page table for the sliding-window layers
// (ForwardBatch::window_page_table): a hybrid model whose sliding layers keep their KV in their
// own pool, with its own pages (a sliding layer only ever reads a request's last W positions, so
// its group need not keep the rest; the testbed maps them onto a per-request ring of pages,
// sim/testbed/window.h). init_forward_metadata copies it into a second set of eager buffers,
// which forward() hands to the kernels of every layer with sliding_window > 0; entries before a
// row's window may name any page (the kernels never read keys before the window). Only backends
// that declare BackendCapabilities::flat_cache_groups accept one (kInvalidArgument otherwise).
// Graph metadata has no second table: a replay with one is kUnimplemented.
//
// Record rule (RecordPdCacheStep), applied by forward() around forward_decode/forward_extend:
//   record_kv_cache unset -> record iff mode is neither decode nor idle; set -> forced to its
//   value; no StepCounter registered -> no record; save_kv_cache == false (KV was pre-written, e.g.
//   fused RoPE prewrite) -> record BEFORE the attention work; otherwise record AFTER it (after the
//   backend's own KV write).
// Exactly one record per model layer per extend forward; composite backends record once per model
// layer themselves (they call their children with record_kv_cache = false).
//
// Recurrent layers (topo::LayerKind::kRecurrent). A model with recurrent layers runs them through
// forward_recurrent(), under the same record rule as forward() (save_kv_cache = true: the record
// comes after the layer's state update), so a hybrid model records exactly once per model layer
// whatever kind the layer is. Only backends that declare BackendCapabilities::recurrent_layers
// accept it (the composite HybridBackend, backends/attention/hybrid_backend.h); any other is
// kUnimplemented naming the backend.
//
// Thread-safety: one host thread drives a backend (as one scheduler thread drives a GPU).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/kv/state_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/stream.h"
#include "backends/runtime/tensor.h"
#include "common/status.h"

namespace pdsim::attn {

enum class ForwardMode { kExtend, kDecode, kMixed, kIdle, kTargetVerify, kDraftExtend };

[[nodiscard]] constexpr bool is_decode(ForwardMode m) {
    return m == ForwardMode::kDecode;
}
[[nodiscard]] constexpr bool is_idle(ForwardMode m) {
    return m == ForwardMode::kIdle;
}
[[nodiscard]] std::string_view forward_mode_name(ForwardMode m);
[[nodiscard]] StatusOr<ForwardMode> parse_forward_mode(std::string_view text);

// Static shape of one attention layer (tokenspeed's PagedAttention layer object).
struct LayerSpec {
    int layer_id = 0;
    int num_q_heads = 1;
    int num_kv_heads = 1;
    int head_dim = 64;
    int v_head_dim = 0;   // 0: head_dim
    float scaling = 0.f;  // 0: 1/sqrt(head_dim)
    // Sliding-window attention (a Gemma / GPT-OSS sliding layer): W > 0 makes the query at
    // position p attend to the keys at positions [max(0, p - W + 1), p] only (the window counts
    // the query's own position); 0: every key up to p (full causal attention). Only backends
    // that declare BackendCapabilities::sliding_window accept W > 0.
    int sliding_window = 0;
};

// Static shape of one recurrent layer on this rank (topo::LayerKind::kRecurrent).
struct RecurrentSpec {
    int layer_id = 0;     // the model layer (whose StepCounter record this layer makes)
    int state_layer = 0;  // its index among the model's recurrent layers: the state pool's layer
    int num_heads = 1;    // state heads on this rank (after TP)
    int head_dim = 64;
    int conv_kernel = 4;  // >= 2
};

// One recurrent layer's forward, as forward_recurrent() hands it to the mixer (views checked, fp32,
// host memory, contiguous; rows as forward()'s: one per new token, requests in batch order):
//   qkv          [num_tokens][num_heads][3 * head_dim]  the projections before the convolution
//                                                      (per head: q channels, k, v)
//   gate         [num_tokens][num_heads]                decay logits (decay = sigmoid(gate))
//   conv_weight  [num_heads][3 * head_dim][conv_kernel] the depthwise causal filter (tap
//                                                      conv_kernel - 1 multiplies the newest input)
//   state_slots  int32 [bs]                            each request's slot in `pool`
//   out          [num_tokens][num_heads][head_dim]     written
// The batch's seq_lens / q_lens come from the active metadata (`meta`), as for attention: a
// request whose first new token is at position 0 starts from a zero state; any other continues
// the state in its slot.
class MetadataBuffers;
struct RecurrentArgs {
    runtime::ConstTensorView qkv;
    runtime::ConstTensorView gate;
    runtime::ConstTensorView conv_weight;
    runtime::ConstTensorView state_slots;
    RecurrentSpec layer;
    kv::StatePool* pool = nullptr;
    ForwardMode mode = ForwardMode::kExtend;
    int bs = 0;
    runtime::TensorView out;
    const MetadataBuffers* meta = nullptr;
};

struct AttentionConfig {
    int num_q_heads = 1;   // per rank (after TP)
    int num_kv_heads = 1;  // per rank
    int head_dim = 64;
    int v_head_dim = 0;  // 0: head_dim
    kv::KVDtype kv_dtype = kv::KVDtype::kF32;
    runtime::Stream* stream = nullptr;  // the compute stream; required, not owned
    int num_threads = 0;                // CPU backends: kernel threads (0 = all cores)
};

// One batch, as the scheduler describes it. Host memory; copied by init_forward_metadata.
// Request i has seq_lens[i] KV tokens after this forward, of which its last extend_lens[i] are new
// (its queries, attending causally). Its KV token t lives in page
// page_table[i * page_table_stride + t / page_size], slot t % page_size.
struct ForwardBatch {
    ForwardMode mode = ForwardMode::kExtend;
    int bs = 0;
    std::span<const int32_t> seq_lens;
    std::span<const int32_t> extend_lens;  // empty for decode: 1 each
    std::span<const int32_t> page_table;   // bs * page_table_stride entries
    int page_table_stride = 0;
    // The sliding-window layers' own cache group (a hybrid model whose sliding layers have their
    // own KV pool, see "Cache groups" in the file comment): their page table, laid out as
    // page_table. Empty: sliding layers use page_table like every other layer.
    std::span<const int32_t> window_page_table;
    int window_page_table_stride = 0;
};

// What a kernel reads when it runs: pointers into the backend's metadata buffers.
struct BatchView {
    ForwardMode mode;
    int bs;
    int num_tokens;             // q_start[bs]
    const int32_t* seq_lens;    // [bs]
    const int32_t* q_lens;      // [bs]
    const int32_t* q_start;     // [bs + 1], exclusive prefix sum of q_lens
    const int32_t* page_table;  // [bs][stride]
    int stride;
    bool graph;  // graph buffers: bs may be smaller than the captured bs
};

// Metadata buffers with stable addresses (eager or graph). seq_lens may alias an external buffer.
class MetadataBuffers {
public:
    MetadataBuffers() = default;
    MetadataBuffers(int max_bs, int max_pages_per_seq);
    // Stream side: copies `batch` (validated) into the buffers in place.
    void assign(ForwardMode mode, int bs, const int32_t* seq_lens, const int32_t* q_lens,
                const int32_t* page_table, int stride);
    void alias_seq_lens(const int32_t* external) { seq_lens_ext_ = external; }
    [[nodiscard]] BatchView view() const;
    [[nodiscard]] int max_bs() const { return max_bs_; }
    [[nodiscard]] int max_pages_per_seq() const { return max_pages_; }

private:
    int max_bs_ = 0;
    int max_pages_ = 0;
    ForwardMode mode_ = ForwardMode::kIdle;
    int bs_ = 0;
    int stride_ = 0;
    const int32_t* seq_lens_ext_ = nullptr;
    std::vector<int32_t> seq_lens_, q_lens_, q_start_, page_table_;
};

// Everything forward() hands to forward_decode / forward_extend: the views as the caller passed
// them (checked; shapes in the file comment), so a view's size(0) is the forward's num_tokens.
struct ForwardArgs {
    runtime::ConstTensorView q;  // [num_tokens][num_q_heads][head_dim]
    runtime::ConstTensorView k;  // [num_tokens][num_kv_heads][head_dim] (new tokens)
    runtime::ConstTensorView v;  // [num_tokens][num_kv_heads][v_head_dim]
    LayerSpec layer;
    runtime::ConstTensorView out_cache_loc;  // int32 [num_tokens] KV slots of the new tokens
    kv::KVPool* pool = nullptr;
    ForwardMode mode = ForwardMode::kExtend;
    int bs = 0;
    runtime::TensorView out;  // [num_tokens][num_q_heads][v_head_dim]
    bool save_kv_cache = true;
    const MetadataBuffers* meta = nullptr;  // the active buffers (eager or graph)
};

// What a backend accepts (AttentionBackend::capabilities()); forward() enforces it.
struct BackendCapabilities {
    std::vector<runtime::DType> activation_dtypes;  // q, k, v, out (one dtype per forward)
    std::vector<runtime::DType> kv_dtypes;          // the pool's dtype
    std::vector<runtime::DeviceKind> devices;       // where the pool and every view live
    bool sliding_window = false;                    // LayerSpec::sliding_window > 0 accepted
    bool recurrent_layers = false;                  // forward_recurrent() accepted
    // The sliding layers' own page table (ForwardBatch::window_page_table: flat per-group block
    // tables, "Cache groups" in the file comment) accepted; uses_flat_cache_groups() says so.
    bool flat_cache_groups = false;
};

// Extra arguments of init_cuda_graph_state; a backend declares which it accepts.
struct GraphStateExtras {
    std::optional<int> max_pages_per_seq;
    std::optional<std::vector<std::string>> paged_cache_group_specs;
};

class AttentionBackend {
public:
    explicit AttentionBackend(const AttentionConfig& config);
    virtual ~AttentionBackend() = default;
    AttentionBackend(const AttentionBackend&) = delete;
    AttentionBackend& operator=(const AttentionBackend&) = delete;

    [[nodiscard]] virtual std::string name() const = 0;
    // The dtypes and device kinds this backend accepts: declared by each backend (a wrapper
    // forwards its inner backend's), checked by forward() and create_attention_backend.
    [[nodiscard]] virtual BackendCapabilities capabilities() const = 0;
    [[nodiscard]] const AttentionConfig& config() const { return config_; }
    [[nodiscard]] runtime::Stream& stream() const { return *config_.stream; }

    // Flags (tokenspeed's class attributes).
    [[nodiscard]] virtual bool uses_paged_cache_groups() const { return false; }
    // The declared BackendCapabilities::flat_cache_groups.
    [[nodiscard]] virtual bool uses_flat_cache_groups() const {
        return capabilities().flat_cache_groups;
    }
    [[nodiscard]] virtual bool flat_spec_capable() const { return true; }
    [[nodiscard]] virtual bool uses_padded_decode_token_mask() const { return false; }
    [[nodiscard]] virtual bool support_kv_cache_prewrite(std::optional<ForwardMode> mode) const;
    // Identity for backends without flat cache groups.
    [[nodiscard]] virtual runtime::ConstTensorView select_out_cache_loc(
        const LayerSpec& layer, const runtime::ConstTensorView& out_cache_loc,
        std::optional<ForwardMode> mode) const;
    virtual Status configure_runtime(const std::map<std::string, std::string>& options);

    // Eager metadata for the next forward(s). Validates, then copies in stream order.
    [[nodiscard]] virtual Status init_forward_metadata(const ForwardBatch& batch);

    // Graph state: buffers for up to max_bs requests; aliases seq_lens_buf (must outlive the
    // backend, at least max_bs entries).
    [[nodiscard]] virtual Status init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                                       const GraphStateExtras& extras);
    // Which GraphStateExtras fields this backend's init_cuda_graph_state reads
    // ("max_pages_per_seq", "paged_cache_group_specs"); "*" accepts all.
    [[nodiscard]] virtual std::set<std::string> accepted_graph_state_extras() const;
    // Makes the graph buffers the active metadata for the forwards that follow (to be captured).
    [[nodiscard]] virtual Status init_forward_metadata_capture_cuda_graph(int bs, ForwardMode mode);
    // Updates the graph buffers in place (stream-ordered) for a replay of `batch` (bs <= max_bs).
    // batch.seq_lens must equal what the aliased seq_lens_buf will hold when the replay runs.
    [[nodiscard]] virtual Status init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch);
    // Back to eager metadata (after capturing).
    void use_eager_metadata() { active_ = &eager_; }
    [[nodiscard]] bool graph_state_initialized() const { return graph_ != nullptr; }

    void register_step_counter(pd::StepCounter* counter) { step_counter_ = counter; }
    [[nodiscard]] pd::StepCounter* step_counter() const { return step_counter_; }

    // Checks the call (see "Capabilities" in the file comment), then dispatches to
    // forward_decode / forward_extend inside the record rule. Errors: kFailedPrecondition without
    // a compute stream or with a StepCounter on another stream; kInvalidArgument for a bad view,
    // layer or pool (nothing enqueued); then whatever forward_decode / forward_extend return.
    [[nodiscard]] Status forward(const runtime::ConstTensorView& q,
                                 const runtime::ConstTensorView& k,
                                 const runtime::ConstTensorView& v, const LayerSpec& layer,
                                 const runtime::ConstTensorView& out_cache_loc, kv::KVPool& pool,
                                 ForwardMode mode, int bs, const runtime::TensorView& out,
                                 bool save_kv_cache = true,
                                 std::optional<bool> record_kv_cache = std::nullopt);

    // A recurrent layer (see "Recurrent layers" in the file comment): checks the call (the
    // capability, the views' shapes and dtypes against `layer`, the pool's heads / dims / layers,
    // every slot in [1, pool.num_pages())), then enqueues forward_recurrent_impl inside the record
    // rule with save_kv_cache = true. Errors: kUnimplemented on a backend without
    // recurrent_layers; kFailedPrecondition as forward(); kInvalidArgument naming the argument.
    [[nodiscard]] Status forward_recurrent(const RecurrentArgs& args,
                                           std::optional<bool> record_kv_cache = std::nullopt);

    // The record rule, reusable by composite backends that own the record.
    class RecordPdCacheStep {
    public:
        RecordPdCacheStep(AttentionBackend& backend, ForwardMode mode, bool save_kv_cache,
                          std::optional<bool> record_kv_cache);
        // Records before the body when the KV was pre-written.
        [[nodiscard]] Status enter();
        // Records after the body when the backend writes the KV itself.
        [[nodiscard]] Status exit();
        [[nodiscard]] bool will_record() const { return record_; }

    private:
        AttentionBackend& backend_;
        bool save_kv_cache_;
        bool record_;
    };

protected:
    [[nodiscard]] virtual Status forward_decode(const ForwardArgs& args) = 0;
    [[nodiscard]] virtual Status forward_extend(const ForwardArgs& args) = 0;
    // The recurrent layer's work (args checked, meta set); only backends that declare
    // recurrent_layers are called. The default is kUnimplemented.
    [[nodiscard]] virtual Status forward_recurrent_impl(const RecurrentArgs& args);

    [[nodiscard]] const MetadataBuffers* active_metadata() const { return active_; }

private:
    [[nodiscard]] Status validate_forward(const ForwardArgs& args) const;
    // kFailedPrecondition without a compute stream or with a StepCounter on another stream
    // (forward() and forward_recurrent()).
    [[nodiscard]] Status check_streams() const;
    [[nodiscard]] Status enqueue_assign(MetadataBuffers* dst, const ForwardBatch& batch,
                                        bool keep_aliased_seq_lens);

    AttentionConfig config_;
    pd::StepCounter* step_counter_ = nullptr;
    MetadataBuffers eager_;
    // The sliding layers' page table (ForwardBatch::window_page_table) of the eager batch; used
    // while window_meta_ is set (the last init_forward_metadata had one).
    MetadataBuffers eager_window_;
    bool window_meta_ = false;
    std::unique_ptr<MetadataBuffers> graph_;
    const MetadataBuffers* active_ = &eager_;
    int captured_bs_ = 0;
    // Tokens of the batch last given to init_forward_metadata (what the eager buffers will hold
    // when the next forward runs); unset before the first.
    std::optional<int64_t> eager_num_tokens_;
};

// The batch checks of init_forward_metadata (max_bs = max_pages_per_seq = 0) and of the graph
// replay (the graph's limits), for backends that override those methods too: bs >= 0 (and <=
// max_bs when max_bs > 0), idle only with bs 0, seq_lens and extend_lens of at least bs entries,
// page_table_stride >= 1 (and <= max_pages_per_seq when that is > 0), bs * stride page-table
// entries, 1 <= extend_len <= seq_len, decode extend_len 1. kInvalidArgument naming the field.
[[nodiscard]] Status validate_forward_batch(const ForwardBatch& batch, int max_bs,
                                            int max_pages_per_seq);

// Calls backend.init_cuda_graph_state with only the extras it accepts.
[[nodiscard]] Status init_backend_cuda_graph_state(AttentionBackend& backend, int max_bs,
                                                   const int32_t* seq_lens_buf,
                                                   const GraphStateExtras& extras);

// ---- registry -------------------------------------------------------------------------------
using BackendFactory =
    std::function<StatusOr<std::unique_ptr<AttentionBackend>>(const AttentionConfig&)>;

void register_attention_backend(const std::string& name, BackendFactory factory);
[[nodiscard]] StatusOr<std::unique_ptr<AttentionBackend>> create_attention_backend(
    const std::string& name, const AttentionConfig& config);
[[nodiscard]] std::vector<std::string> attention_backend_names();

// Shape helpers.
[[nodiscard]] inline int v_dim(const LayerSpec& l) {
    return l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
}
[[nodiscard]] float layer_scaling(const LayerSpec& l);

// The first `n` rows (dim 0) of a contiguous view, e.g. the tokens a graph replay's batch uses of
// static buffers sized for the captured batch. Precondition: 0 <= n <= view.size(0), rank >= 1.
template <bool kConst>
[[nodiscard]] runtime::BasicTensorView<kConst> leading_rows(runtime::BasicTensorView<kConst> view,
                                                            int64_t n) {
    view.shape[0] = n;
    return view;
}

}  // namespace pdsim::attn
