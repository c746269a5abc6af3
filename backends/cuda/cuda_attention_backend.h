// CudaAttentionBackend ("cuda"): pdsim's GPU attention backend, FlashInfer's paged kernels
// (backends/cuda/flashinfer_attention.h) behind the AttentionBackend interface
// (backends/attention/attention_backend.h), with the KV write of backends/cuda/kv_append.h.
// Registered by backends/builtin.cpp when pdsim is built with CUDA and FlashInfer; otherwise
// create_attention_backend("cuda") fails with kUnavailable saying why it was not built. Plain C++:
// no CUDA or FlashInfer headers.
//
// What it accepts (capabilities()): bf16 activations, a bf16 MHA pool in CUDA memory, on the
// compute stream's device. fp32 KV is refused by the base class ("pool: dtype fp32, backend 'cuda'
// accepts bf16"): FlashInfer has no fp32-KV kernels. Shapes: head_dim 64 or 128 (v_head_dim equal
// to it), any page size, GQA with a group size FlashInfer's decode kernel instantiates (1, 2, 3,
// 4, 6, 8, 16), every layer of the config's shape. MLA pools are refused with kUnimplemented:
// FlashInfer's MLA decode takes q_nope and q_pe as two contiguous arrays, which a single q view
// [tokens][heads][kv_lora_rank + rope_dim] is not, and no latent-KV write kernel is built.
//
// Streams. AttentionConfig::stream must be a CudaStream (kInvalidArgument otherwise; kUnavailable
// "no device" when there is no GPU). Everything is enqueued on it: the metadata copies of the
// plans (pinned ring -> device), the KV write, the attention kernels; the StepCounter's records
// (a device StepCounter on the same stream, base-class rule) are kernels too. No host round trip
// (no host function, no synchronize) on the hot path; synchronizing happens only when an eager
// adapter has to grow, and in init_cuda_graph_state (see below).
//
// A forward (forward_decode / forward_extend, inside the base class's record rule):
//   1. kv_append of the forward's rows into slots out_cache_loc of the layer (save_kv_cache);
//   2. the attention: decode requests through the decode plan (FlashInfer's batch decode kernel),
//      the others through the extend plan (its causal batch prefill kernel); a mixed batch is split
//      as backends/cuda/cuda_attention_plan.h says (decode requests at one end of the batch), so a
//      decode request computes the same bits in a mixed batch as in a pure decode batch.
// Outputs are batch-invariant: a request's rows do not depend on the other requests of the batch.
//
// Metadata (a deviation from the base class, which keeps host buffers and copies them with a
// stream task). The CUDA backend plans instead: init_forward_metadata validates the batch (the
// base class's checks and messages), copies it by value and, when it fits the pool of the latest
// forward, plans it at once: the CSR and work lists are written into a pinned slot and one
// cudaMemcpyAsync on the compute stream carries them to the adapters' device workspace. Otherwise
// (the very first batch, or a batch for another pool) its first forward plans it. The pool is
// known only from forward(): the page table is checked against it (pages per request within the
// stride, page ids below num_pages) when planning, so with save_kv_cache = false (record before
// the attention) a batch that does not fit the pool of its first forward fails after the record
// was enqueued; the CPU backends check the same at kernel time, later still. Plan once per
// batch, run per layer: init_forward_metadata may be called for the next batch while the previous
// one runs on the GPU, but only after every forward of the previous batch has been issued
// (FlashInfer's rule).
// Eager views are checked against the batch on the host (the base class cannot, since its eager
// buffers are not used): q and out hold the batch's num_tokens rows, mode and bs are the batch's.
// The base class's BatchView (ForwardArgs::meta) is not used.
//
// Eager adapters (one decode, one extend) grow on demand (capacities rounded up to powers of two);
// growing one synchronizes the compute stream once, since queued kernels still read the old one's
// workspace.
//
// CUDA graphs. init_cuda_graph_state(max_bs, seq_lens_buf, extras) checks its arguments,
// synchronizes the stream (the base class's rule) and fixes the sizes of the graph-mode adapters
// (made by the warm-up, below): max_bs requests and max_bs * max_pages_per_seq pages
// (extras.max_pages_per_seq, default 1024); query rows max_bs (decode) or as many as the static
// buffers of the first graph-mode extend forward hold (extend). Graph adapters launch a fixed shape
// (padding CTAs masked) from fixed metadata addresses, so a graph captured around forward() stays
// valid. seq_lens_buf is required but not read: the replay's metadata comes from the batch given to
// init_forward_metadata_replay_cuda_graph (whose seq_lens must be what the graph's batch has).
//   - init_forward_metadata_capture_cuda_graph(bs, mode) makes graph metadata active.
//   - Warm-up before capture (the rule engines follow): run the forwards once with graph
//     metadata active OUTSIDE the capture, on the pool and static buffers the graph will use.
//     That first graph-mode forward creates the graph adapter (cudaMalloc and a synchronous
//     memset, forbidden during capture; the pool fixes the page size) and loads the kernels
//     (lazy module loading must not happen inside a capture); a replay batch given before it
//     (init_forward_metadata_replay_cuda_graph) is planned by it, else its launch is all masked
//     (the workspace starts zeroed) and writes nothing but the KV. A captured forward whose
//     adapter does not exist yet is kFailedPrecondition.
//   - init_forward_metadata_replay_cuda_graph(batch): outside the capture, before each replay,
//     on the compute stream: plans `batch` into the graph adapter's workspace in place (stream
//     ordered). bs <= max_bs, page_table_stride <= max_pages_per_seq, extend tokens <= the
//     static buffers' rows. The caller replays a graph captured with at least the batch's rows,
//     and pads out_cache_loc past the batch's tokens with slots nobody reads (page 0, the null
//     page) or negative values (skipped): the captured KV write covers every static row. Rows of
//     out past the batch's tokens are not written. Skipping this refresh (the testbed's
//     stale-graph-metadata fault) replays the previous batch's metadata.
//   - Mixed batches are not captured (kUnimplemented): their split changes per batch.
//   - Calling init_cuda_graph_state again frees the graph adapters: graphs captured before are
//     invalid after it.
// An eager forward while the stream is capturing is kFailedPrecondition (eager plans have a
// batch-dependent launch shape).
//
// Errors (beyond the base class's): kInvalidArgument for a layer or pool that does not match the
// config, a forward that does not match its batch's rows, a batch that does not fit the pool or a
// graph's capacity; kFailedPrecondition for a forward without metadata, a mode/bs mismatch, a
// capture before warm-up, an eager forward during a capture, planning during a capture;
// kUnimplemented for MLA pools and mixed graphs; kUnavailable for CUDA failures;
// kDeadlineExceeded when no pinned staging slot frees up (flashinfer_staging.h).
//
// Ownership: the backend owns its adapters (device workspaces, pinned rings); the caller owns the
// stream, the pool and every view, which must stay valid until the enqueued work has run. The
// destructor synchronizes the stream before freeing the adapters (queued kernels read them).
// Thread-safety: one host thread drives the backend (as the base class says).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_attention_plan.h"
#include "backends/cuda/flashinfer_attention.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

class CudaAttentionBackend final : public AttentionBackend {
public:
    // kUnavailable "no device" without a GPU; kInvalidArgument when config.stream is not a
    // CudaStream; check_backend_config's errors for a shape the kernels do not build.
    [[nodiscard]] static StatusOr<std::unique_ptr<AttentionBackend>> create(
        const AttentionConfig& config);
    ~CudaAttentionBackend() override;

    [[nodiscard]] std::string name() const override { return "cuda"; }
    // bf16 activations, bf16 KV, CUDA memory.
    [[nodiscard]] BackendCapabilities capabilities() const override;
    [[nodiscard]] bool support_kv_cache_prewrite(
        std::optional<ForwardMode> /*mode*/) const override {
        return true;
    }

    [[nodiscard]] Status init_forward_metadata(const ForwardBatch& batch) override;
    [[nodiscard]] Status init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                               const GraphStateExtras& extras) override;
    [[nodiscard]] std::set<std::string> accepted_graph_state_extras() const override {
        return {"max_pages_per_seq"};
    }
    [[nodiscard]] Status init_forward_metadata_capture_cuda_graph(int bs,
                                                                  ForwardMode mode) override;
    [[nodiscard]] Status init_forward_metadata_replay_cuda_graph(
        const ForwardBatch& batch) override;

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override {
        return forward_any(args);
    }
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override {
        return forward_any(args);
    }

private:
    // One adapter and what its workspace holds (as of the latest plan enqueued).
    struct AdapterSlot {
        std::unique_ptr<FlashInferAttention> adapter;
        uint64_t planned_generation = 0;  // the batch generation planned (0: none)
        PoolGeometry planned_geometry;
    };
    struct GraphState {
        int max_bs = 0;
        int max_pages_per_seq = 0;
        std::optional<PoolGeometry> geometry;  // fixed by the first graph adapter
        AdapterSlot decode, extend;
        // Replay batches planned before their adapter existed (planned when it is created).
        std::optional<StagedBatch> pending_decode, pending_extend;
    };

    CudaAttentionBackend(const AttentionConfig& config, void* stream, int device);

    [[nodiscard]] Status forward_any(const ForwardArgs& args);
    [[nodiscard]] Status forward_eager(const ForwardArgs& args, const PoolGeometry& geometry,
                                       const kv::KVLayerView& layer_view);
    [[nodiscard]] Status forward_graph(const ForwardArgs& args, const PoolGeometry& geometry,
                                       const kv::KVLayerView& layer_view);
    // Plans the eager batch for `geometry` into the adapters that do not hold it yet.
    [[nodiscard]] Status plan_eager(const PoolGeometry& geometry);
    // Makes `slot` an eager adapter of `kind` for `page_size` that covers `need`.
    [[nodiscard]] Status ensure_eager_adapter(AdapterSlot& slot, AttentionKind kind, int page_size,
                                              const PlanCapacity& need);
    [[nodiscard]] StatusOr<std::unique_ptr<FlashInferAttention>> make_adapter(
        AttentionKind kind, int page_size, const PlanCapacity& capacity, bool cuda_graph) const;
    // Plans `batch` (whole, one kind) into graph slot `slot`.
    [[nodiscard]] Status plan_graph(AdapterSlot& slot, const StagedBatch& batch);
    [[nodiscard]] Status enqueue_kv_append(const ForwardArgs& args, const kv::KVLayerView& lv,
                                           int64_t rows) const;
    [[nodiscard]] Status run_sub_batch(const FlashInferAttention& adapter, const ForwardArgs& args,
                                       const kv::KVLayerView& lv, int64_t row_begin) const;
    [[nodiscard]] bool graph_metadata_active() const;

    void* stream_ = nullptr;  // cudaStream_t of config().stream
    int device_ = 0;
    // Eager metadata.
    std::optional<StagedBatch> eager_batch_;
    BatchSplit eager_split_;
    uint64_t eager_generation_ = 0;
    std::optional<PoolGeometry> eager_checked_geometry_;  // eager_batch_ checked against it
    AdapterSlot eager_decode_, eager_extend_;
    // The pool of the latest forward (plans made before a forward are checked against it).
    std::optional<PoolGeometry> last_geometry_;
    std::unique_ptr<GraphState> graph_;
};

}  // namespace pdsim::attn::cuda
