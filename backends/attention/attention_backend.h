// AttentionBackend: the base class of pdsim's attention backends, mirroring tokenspeed's
// (lightseekorg/tokenspeed, python/tokenspeed/runtime/layers/attention/backends/base.py), with the
// PD layerwise record rule. The contract is restated in docs/design.md "AttentionBackend".
//
// Execution model. A backend owns no thread: forward() validates on the host and enqueues its work
// (the KV write, then the attention kernel) on the compute stream given in AttentionConfig. q, k,
// v, out and out_cache_loc are host pointers that must stay valid until that work has run (until
// the stream is synchronized, or an event recorded after it has completed).
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
// Record rule (RecordPdCacheStep), applied by forward() around forward_decode/forward_extend:
//   record_kv_cache unset -> record iff mode is neither decode nor idle; set -> forced to its value;
//   no StepCounter registered -> no record;
//   save_kv_cache == false (KV was pre-written, e.g. fused RoPE prewrite) -> record BEFORE the
//   attention work; otherwise record AFTER it (after the backend's own KV write).
// Exactly one record per model layer per extend forward; composite backends record once per model
// layer themselves (they call their children with record_kv_cache = false).
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
#include "backends/pd/step_counter.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::attn {

enum class ForwardMode { kExtend, kDecode, kMixed, kIdle, kTargetVerify, kDraftExtend };

[[nodiscard]] constexpr bool is_decode(ForwardMode m) { return m == ForwardMode::kDecode; }
[[nodiscard]] constexpr bool is_idle(ForwardMode m) { return m == ForwardMode::kIdle; }
[[nodiscard]] std::string_view forward_mode_name(ForwardMode m);
[[nodiscard]] StatusOr<ForwardMode> parse_forward_mode(std::string_view text);

// Static shape of one attention layer (tokenspeed's PagedAttention layer object).
struct LayerSpec {
    int layer_id = 0;
    int num_q_heads = 1;
    int num_kv_heads = 1;
    int head_dim = 64;
    int v_head_dim = 0;    // 0: head_dim
    float scaling = 0.f;   // 0: 1/sqrt(head_dim)
};

struct AttentionConfig {
    int num_q_heads = 1;       // per rank (after TP)
    int num_kv_heads = 1;      // per rank
    int head_dim = 64;
    int v_head_dim = 0;        // 0: head_dim
    kv::KVDtype kv_dtype = kv::KVDtype::kF32;
    runtime::Stream* stream = nullptr;  // the compute stream; required, not owned
    int num_threads = 0;       // CPU backends: kernel threads (0 = all cores)
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
};

// What a kernel reads when it runs: pointers into the backend's metadata buffers.
struct BatchView {
    ForwardMode mode;
    int bs;
    int num_tokens;            // q_start[bs]
    const int32_t* seq_lens;   // [bs]
    const int32_t* q_lens;     // [bs]
    const int32_t* q_start;    // [bs + 1], exclusive prefix sum of q_lens
    const int32_t* page_table; // [bs][stride]
    int stride;
    bool graph;                // graph buffers: bs may be smaller than the captured bs
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

// Everything forward() hands to forward_decode / forward_extend.
struct ForwardArgs {
    const float* q = nullptr;              // [num_tokens][num_q_heads][head_dim]
    const float* k = nullptr;              // [num_tokens][num_kv_heads][head_dim] (new tokens)
    const float* v = nullptr;              // [num_tokens][num_kv_heads][v_head_dim]
    LayerSpec layer;
    const int32_t* out_cache_loc = nullptr;  // [num_tokens] KV slots of the new tokens
    kv::KVPool* pool = nullptr;
    ForwardMode mode = ForwardMode::kExtend;
    int bs = 0;
    float* out = nullptr;                  // [num_tokens][num_q_heads][v_head_dim]
    bool save_kv_cache = true;
    const MetadataBuffers* meta = nullptr; // the active buffers (eager or graph)
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
    [[nodiscard]] const AttentionConfig& config() const { return config_; }
    [[nodiscard]] runtime::Stream& stream() const { return *config_.stream; }

    // Flags (tokenspeed's class attributes).
    [[nodiscard]] virtual bool uses_paged_cache_groups() const { return false; }
    [[nodiscard]] virtual bool uses_flat_cache_groups() const { return false; }
    [[nodiscard]] virtual bool flat_spec_capable() const { return true; }
    [[nodiscard]] virtual bool uses_padded_decode_token_mask() const { return false; }
    [[nodiscard]] virtual bool support_kv_cache_prewrite(std::optional<ForwardMode> mode) const;
    // Identity for backends without flat cache groups.
    [[nodiscard]] virtual const int32_t* select_out_cache_loc(const LayerSpec& layer,
                                                              const int32_t* out_cache_loc,
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

    // Dispatches to forward_decode / forward_extend inside the record rule (see the file comment).
    [[nodiscard]] Status forward(const float* q, const float* k, const float* v,
                                 const LayerSpec& layer, const int32_t* out_cache_loc,
                                 kv::KVPool& pool, ForwardMode mode, int bs, float* out,
                                 bool save_kv_cache = true,
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

    [[nodiscard]] const MetadataBuffers* active_metadata() const { return active_; }

private:
    [[nodiscard]] Status validate_batch(const ForwardBatch& batch, int max_bs, int max_pages) const;
    [[nodiscard]] Status enqueue_assign(MetadataBuffers* dst, const ForwardBatch& batch,
                                        bool keep_aliased_seq_lens);

    AttentionConfig config_;
    pd::StepCounter* step_counter_ = nullptr;
    MetadataBuffers eager_;
    std::unique_ptr<MetadataBuffers> graph_;
    const MetadataBuffers* active_ = &eager_;
    int captured_bs_ = 0;
};

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
[[nodiscard]] inline int v_dim(const LayerSpec& l) { return l.v_head_dim > 0 ? l.v_head_dim : l.head_dim; }
[[nodiscard]] float layer_scaling(const LayerSpec& l);

}  // namespace pdsim::attn
