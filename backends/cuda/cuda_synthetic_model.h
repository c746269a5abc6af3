// CudaSyntheticModel: the GPU counterpart of the CPU SyntheticModel (backends/model/
// synthetic_model.h): the same ModelConfig, the same seeded weights (generated on the device,
// rounded to bf16), the same per-layer structure and the same forward contract (model::Model,
// backends/model/model.h), computing what a real engine computes:
//
//   embedding -> per layer: RMSNorm -> fused QKV GEMM -> RoPE (NeoX) -> KV write + attention
//   (through an AttentionBackend, inside its PD record rule) -> O GEMM -> residual -> RMSNorm ->
//   fused gate/up GEMM -> SiLU * up -> down GEMM -> residual; then each request's last token ->
//   final RMSNorm -> LM head GEMM (fp32 logits) -> greedy argmax (ties -> lowest id).
//
// Numerics: activations and weights are bf16 (norm weights fp32), every GEMM accumulates in fp32
// (backends/cuda/gemm.h BatchInvariantGemm on cuBLASLt), every kernel computes in fp32 and rounds
// its output to bf16 (backends/cuda/model_kernels.h). So it does not reproduce the CPU model's
// fp32 tokens bit for bit; it is checked against a host oracle that rounds where it rounds
// (tests/cuda_synthetic_model_test.cpp). MHA/GQA only (MLA and sliding windows: kUnimplemented,
// as the CPU model).
//
// Tensor parallelism. A rank of a TP group of tp_size (create()'s `tp`) holds 1 / tp_size of the
// heads and of the intermediate size (ModelDims' slices, the CPU model's). Its forward is the
// TP-invariant one (CudaModelOptions::sliced_reduction, always on for tp_size > 1): every
// projection runs as one GEMM per canonical slice (the CPU model's: one per KV head, each with its
// q heads and 1 / num_kv_heads of the intermediate size), so every GEMM has the same shape,
// strides and pinned cuBLASLt algorithm on every TP size; the O and down projections' slice
// outputs are fp32 partials, which the TP group exchanges and every rank sums in slice order
// (slice_reduce_residual). Two exchanges, both an all-gather of the partials in rank order, so
// both give the same bits:
//   - on the device (create()'s `device_tp`, model::DeviceTpComm: NCCL's all-gather on the
//     forward's stream): no host round trip, the forward never waits; the group's ranks need a
//     GPU each. A break of the device group (a peer gone: its watchdog aborts the gather) fails
//     the forward it happened in (the host task that copies the tokens out reports it on the
//     stream, so no token computed from an aborted gather is delivered) and refuses every later
//     one;
//   - on the host (TpComm::allgather, when `device_tp` is null): the partials go to pinned
//     memory, the stream is synchronized, the gather runs on the calling thread, the peers'
//     partials come back from the host (a rank's own device to device). It runs wherever the host
//     TpComm does, several ranks on one GPU included.
// So a TP 2 rank computes the bits a sliced TP 1 rank computes, and a disaggregated run of TP 2
// prefill and TP 1 decode can be compared token for token with a colocated one, as on the CPU. The
// sliced TP 1 forward differs from the default TP 1 forward (one GEMM per projection) by rounding
// only. What it costs: more, smaller GEMMs and copies on any TP size; on tp_size > 1 no decode CUDA
// graphs (capture_decode_graphs refuses: a graph cannot hold the host exchange, and the device one
// would have to be captured, warmed up and replayed in step on every rank of the group: not built)
// and, with the host exchange, two host round trips per layer (forward() synchronizes the stream
// twice per layer and blocks in the gather until every rank of the group gets there, bounded by the
// TpComm's timeout).
//
// Batch invariance: a request's hidden states, KV and tokens do not depend on the rest of its
// batch. Every kernel computes a row from that row alone with a reduction order fixed by the row
// length; the GEMMs pin one cuBLASLt algorithm without split-K per shape; the "cuda" attention
// backend never splits KV. What is NOT invariant: a token computed as a decode row differs (within
// rounding) from the same token computed as an extend row (different attention kernels), and a
// chunked prefill may differ from a single prefill in its later layers (the attention tiles
// differ); compare such runs with request_kv_digest / read_request_kv
// (backends/cuda/cuda_synthetic_model_plan.h) and a tolerance instead.
//
// Execution. forward() validates on the host (check_step_batch) and enqueues everything on
// backend.stream(), which must be a CUDA stream on options.device: the batch's inputs go through a
// pinned staging slot (PinnedStagingRing) and cudaMemcpyAsync into fixed device buffers; the
// backend's metadata through its init_forward_metadata; then every kernel and GEMM. There is no
// host round trip except the last step: the sampled tokens are copied (cudaMemcpyAsync) into
// pinned memory and then, by one host task in stream order, into the caller's next_tokens (a
// request whose logits are not finite fails the stream with kDataLoss there, as the CPU model).
// next_tokens is valid once forward_done() has been reached (it is recorded after that host task
// on every forward) or once the stream has synchronized. The workspace is reused by every
// forward in stream order, so forwards may be enqueued back to back.
//
// Decode CUDA graphs. capture_decode_graphs(backend, pool) captures one graph per batch-size
// bucket (default 1, 2, 4, ... up to options.max_bs), each covering the whole decode forward
// (embedding, all layers, final norm, LM head, argmax; not the host copy of the tokens, which
// stays outside). Each bucket is warmed up once outside the capture on the backend's graph
// metadata (as engines do: it loads kernels and checks every GEMM's row count), then captured.
// Afterwards a decode forward with save_kv_cache and bs <= the largest bucket, on the same backend
// and pool, replays the smallest bucket >= bs: the batch is padded to the bucket (padding
// requests: token 0, slot 0 of the null page 0, seq_len 1, a page-table row of zeros; their tokens
// are ignored), its inputs are copied into the graph's fixed device buffers (the same buffers the
// eager path uses: tokens, out_cache_loc, seq_lens, qo_indptr; positions are computed from them
// inside the graph), the backend's init_forward_metadata_replay_cuda_graph refreshes its graph
// metadata (seq_lens and page table) for the padded batch, and the graph is launched. The
// backend's graph state aliases the model's device seq_lens buffer (int32 device memory, max_bs
// entries, refreshed in stream order before every replay; the "cuda" backend plans from the
// batch and does not read it). set_skip_graph_metadata_refresh(true) is the testbed's
// `stale-graph-metadata` fault: replays skip the backend's refresh (the model's own inputs are
// still refreshed), so attention reads the previous batch's metadata.
//
// Layer timelines: the GPU model has no host callbacks on its forward path, so it does not take
// the CPU model's LayerHook; GPU timelines come from device events: set_layer_timing(true) records
// timing events around every layer of eager forwards (and around a whole graph replay), read back
// by last_forward_timing().
//
// Ownership: the model owns its weights, workspace, GEMM plans, pinned memory and events; it
// borrows the backend, pool and stream per call. The destructor waits (bounded) for the model's
// last forward to finish on its stream before freeing anything; the caller must not destroy the
// stream first. Captured graphs reference the model's buffers and the backend's graph state: keep
// both alive while graphs exist.
// Thread-safety: not thread-safe; one host thread drives a model (the rank's scheduler thread).
// Blocking: create() and capture_decode_graphs() synchronize; forward() does not (it may wait for
// a pinned staging slot when options.staging_slots forwards are still in flight); the read-back
// helpers synchronize.
// Errors: a bad config, option, batch or argument is kInvalidArgument naming it (nothing
// enqueued); unsupported shapes kUnimplemented; no GPU kUnavailable ("no device"); a forward on a
// stream that is capturing kFailedPrecondition; a CUDA failure kUnavailable with the CUDA error;
// cuBLASLt kInternal / kFailedPrecondition (gemm.h); the backend's errors as it returns them. A
// forward that fails after part of it was enqueued still records forward_done() (the destructor
// waits for it); the stream state is then the caller's to judge (synchronize() reports errors).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_synthetic_model_plan.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/device_tp_comm.h"
#include "backends/model/model.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/device.h"
#include "backends/runtime/stream.h"
#include "common/bf16.h"
#include "common/status.h"

namespace pdsim::attn::cuda {
class PinnedStagingRing;
}  // namespace pdsim::attn::cuda

namespace pdsim::model::cuda {

class BatchInvariantGemm;

struct DecodeGraphOptions {
    // Batch sizes to capture, increasing, each in [1, options.max_bs]; empty:
    // default_decode_buckets(options.max_bs).
    std::vector<int> buckets;
    // The widest page table (pages per request) a replayed batch may have; 0: enough pages for
    // options.max_positions tokens.
    int max_pages_per_seq = 0;
};

// Device times of the latest forward with layer timing on, in milliseconds from its start.
struct ForwardTiming {
    bool graph = false;  // a graph replay: no per-layer times
    float total_ms = 0.f;
    std::vector<float> layer_begin_ms;  // [num_layers] (empty for a graph replay)
    std::vector<float> layer_end_ms;
};

class CudaSyntheticModel final : public Model {
public:
    // Checks the config (check_cuda_model_config with `tp`'s size; `tp` null for TP 1), generates
    // this rank's weights on options.device, plans the GEMMs and allocates the workspace, then
    // synchronizes. `tp` is borrowed: it must outlive the model, and its allgather is called from
    // the thread that calls forward(). `device_tp` (borrowed, outlives the model; null: the
    // exchange runs on the host through `tp`): the same group on the device, which then carries
    // every exchange (see "Tensor parallelism"); its size and rank must be `tp`'s
    // (kInvalidArgument otherwise, or when it is given without `tp`).
    [[nodiscard]] static StatusOr<std::unique_ptr<CudaSyntheticModel>> create(
        const ModelConfig& config, TpComm* tp, const CudaModelOptions& options = {},
        DeviceTpComm* device_tp = nullptr);
    ~CudaSyntheticModel() override;
    CudaSyntheticModel(const CudaSyntheticModel&) = delete;
    CudaSyntheticModel& operator=(const CudaSyntheticModel&) = delete;

    // ---- model::Model ----
    [[nodiscard]] const ModelConfig& config() const override { return cfg_; }
    [[nodiscard]] int tp_size() const override { return tp_size_; }
    [[nodiscard]] int local_q_heads() const override { return hq_; }
    [[nodiscard]] int local_kv_heads() const override { return hkv_; }
    [[nodiscard]] bool sliced_reduction() const { return sliced_; }
    // How the TP group exchanges: "none" (TP 1), "host" or the device group's name ("nccl").
    [[nodiscard]] std::string tp_exchange() const;
    [[nodiscard]] size_t weight_bytes() const override;
    [[nodiscard]] attn::LayerSpec layer_spec(int layer) const override;
    // The forward of `batch` (see the file comment and model.h). The backend must compute on a
    // CUDA stream of options.device, with bf16 activations; `pool` must be on that device (for
    // save_kv_cache=false an MHATokenToKVPool of this model's KV heads and head_dim). Decode
    // batches replay a captured graph when they can (see the file comment). A batch of 0
    // requests enqueues nothing. On tp_size > 1 it blocks (see "Tensor parallelism"); every rank
    // of the group must forward the same batch shape (the testbed's TP ranks follow their
    // leader's schedule), and a failed exchange (a peer gone: the TpComm's error) fails the
    // forward and every later one (kFailedPrecondition naming the first failure). With the
    // device exchange it does not block, and a break of the device group found after the forward
    // was enqueued fails it on the stream (its host task: the break's error, next_tokens left
    // alone).
    [[nodiscard]] Status forward(const StepBatch& batch, attn::AttentionBackend& backend,
                                 kv::KVPool& pool, int32_t* next_tokens,
                                 bool save_kv_cache = true) override;

    [[nodiscard]] const CudaModelOptions& options() const { return options_; }
    [[nodiscard]] size_t workspace_bytes() const { return layout_.total_bytes; }
    // Recorded on the forward's stream after every forward's host copy of next_tokens (see the
    // file comment). Never recorded before the first forward (then it reads as reached).
    [[nodiscard]] runtime::Event& forward_done() const { return *forward_done_; }

    // ---- decode CUDA graphs ----
    // Captures the decode graphs for `backend` and `pool` (replacing any earlier ones): calls
    // init_backend_cuda_graph_state(backend, largest bucket, the model's device seq_lens,
    // {max_pages_per_seq}), then per bucket init_forward_metadata_capture_cuda_graph, one
    // replay-metadata refresh with the padding batch, a warm-up forward, and the captured forward;
    // finally backend.use_eager_metadata(). Writes KV only to slot 0 (the null page). Synchronizes
    // the stream. kInvalidArgument for bad options; kFailedPrecondition on tp_size > 1 (see
    // "Tensor parallelism": decode runs eagerly); whatever the backend or capture returns.
    [[nodiscard]] Status capture_decode_graphs(attn::AttentionBackend& backend, kv::KVPool& pool,
                                               const DecodeGraphOptions& options = {});
    [[nodiscard]] bool has_decode_graphs() const { return !graphs_.empty(); }
    [[nodiscard]] const std::vector<int>& decode_buckets() const { return graph_buckets_; }
    // false: decode forwards run eagerly (the graphs are kept). Default true.
    void set_decode_graphs_enabled(bool enabled) { graphs_enabled_ = enabled; }
    // The `stale-graph-metadata` fault: replays skip init_forward_metadata_replay_cuda_graph.
    void set_skip_graph_metadata_refresh(bool skip) { skip_graph_refresh_ = skip; }
    // The bucket the latest forward replayed, 0 when it ran eagerly.
    [[nodiscard]] int last_forward_bucket() const { return last_bucket_; }

    // ---- timing ----
    void set_layer_timing(bool enabled) { timing_enabled_ = enabled; }
    // The latest timed forward (one run while timing was on): waits for its events.
    // kFailedPrecondition when no forward was timed.
    [[nodiscard]] StatusOr<ForwardTiming> last_forward_timing() const;

    // ---- read-back for tests and debugging (synchronize `stream` first; these copy) ----
    // Fills the whole workspace (activations, logits, sampled tokens, staged inputs) with `byte`,
    // synchronously: poisons what the next forward must overwrite. The stream must be idle.
    [[nodiscard]] Status fill_workspace(int byte) { return workspace_.fill(byte); }
    // The first `rows` rows of the latest forward's fp32 logits [rows][vocab] (rows = its bs).
    [[nodiscard]] StatusOr<std::vector<float>> copy_last_logits(int rows) const;
    // The first `rows` rows of the latest forward's final-norm output [rows][hidden] (the LM
    // head's input, bf16 widened to float).
    [[nodiscard]] StatusOr<std::vector<float>> copy_last_final_hidden(int rows) const;

private:
    struct Weights;

    CudaSyntheticModel(const ModelConfig& config, const CudaModelOptions& options, TpComm* tp,
                       DeviceTpComm* device_tp);
    [[nodiscard]] Status init();
    [[nodiscard]] Status init_weights(runtime::Stream& stream);
    // The sliced forward's parts (enqueue_body): the QKV projection into q, k and v; the O or
    // down projection of `x` (slice-major in slice_in when `x` is null, else [rows][x_cols] with
    // slice s at column s * slice_cols) added to the residual stream.
    [[nodiscard]] Status enqueue_sliced_qkv(int layer, int rows, runtime::Stream& stream);
    [[nodiscard]] Status enqueue_sliced_reduction(const bf16_t* x, int64_t x_cols,
                                                  int64_t slice_cols, const bf16_t* weights,
                                                  BatchInvariantGemm& gemm, int rows,
                                                  runtime::Stream& stream);
    [[nodiscard]] Status check_call(attn::AttentionBackend& backend, const kv::KVPool& pool) const;
    [[nodiscard]] Status upload_inputs(const StepBatch& batch, runtime::Stream& stream);
    // The forward's device work on the fixed buffers: `rows` tokens of `requests` requests.
    [[nodiscard]] Status enqueue_body(int rows, int requests, attn::ForwardMode mode,
                                      attn::AttentionBackend& backend, kv::KVPool& pool,
                                      bool save_kv_cache, bool timed);
    [[nodiscard]] Status enqueue_output(runtime::Stream& stream, int requests,
                                        int32_t* next_tokens);
    [[nodiscard]] Status replay_decode(const StepBatch& batch, int bucket,
                                       attn::AttentionBackend& backend, int32_t* next_tokens);
    // tp_size > 1: the partials of `rows` rows to every rank and back (on the host: blocks; on
    // the device: enqueued); returns the gathered partials' device address. A failed gather breaks
    // the model for good (tp_broken_).
    [[nodiscard]] StatusOr<const float*> exchange_partials(int rows, runtime::Stream& stream);
    [[nodiscard]] Status record_timing(int index, runtime::Stream& stream);

    template <typename T>
    [[nodiscard]] T* at(size_t offset) const {
        return reinterpret_cast<T*>(static_cast<char*>(workspace_.data()) + offset);
    }

    ModelConfig cfg_;
    CudaModelOptions options_;
    WorkspaceLayout layout_;
    WeightMemory weight_memory_;
    TpComm* tp_ = nullptr;               // null for TP 1
    DeviceTpComm* device_tp_ = nullptr;  // null: the exchange runs on the host
    int tp_size_ = 1, tp_rank_ = 0;
    bool sliced_ = false;
    int hq_ = 0, hkv_ = 0, inter_ = 0;  // this rank's q heads, KV heads and intermediate size
    int64_t q_cols_ = 0, kv_cols_ = 0, qkv_cols_ = 0;
    // The sliced forward: canonical slices (all, and this rank's), and each slice's columns.
    int slices_ = 0, local_slices_ = 0;
    int64_t qkv_slice_cols_ = 0, o_slice_cols_ = 0, gate_up_slice_cols_ = 0, down_slice_cols_ = 0;

    std::unique_ptr<Weights> weights_;
    runtime::DeviceBuffer rope_cos_sin_;
    runtime::DeviceBuffer workspace_;
    // One plan per projection shape (the slice shapes with the sliced reduction).
    std::unique_ptr<BatchInvariantGemm> qkv_gemm_, o_gemm_, gate_up_gemm_, down_gemm_, lm_gemm_;
    // tp_size > 1 with the host exchange: layout_.partials_bytes, cudaHostAlloc'd.
    float* pinned_partials_ = nullptr;
    float* pinned_gathered_ = nullptr;  // tp_size > 1: layout_.gathered_bytes
    // A TP exchange failed, or a TP forward failed part-way (it may have skipped an exchange its
    // peers made): the group's rounds are out of step and a peer (or a pending MPI collective) may
    // still read or write the pinned buffers above, so every later forward is refused (a later
    // gather would pair with a peer's stale one) and the destructor leaves those buffers to the
    // process exit. Empty while the model is usable.
    std::string tp_broken_;
    std::unique_ptr<attn::cuda::PinnedStagingRing> staging_;
    int32_t* pinned_tokens_ = nullptr;  // [max_bs], cudaHostAlloc'd
    std::unique_ptr<runtime::Event> forward_done_;
    bool forwarded_ = false;

    // Decode graphs, by bucket, for graph_backend_ / graph_pool_.
    std::map<int, std::unique_ptr<runtime::Graph>> graphs_;
    std::vector<int> graph_buckets_;  // the keys of graphs_, increasing
    int graph_max_pages_ = 0;         // the widest page table a replay takes
    attn::AttentionBackend* graph_backend_ = nullptr;
    kv::KVPool* graph_pool_ = nullptr;
    bool graphs_enabled_ = true;
    bool skip_graph_refresh_ = false;
    int last_bucket_ = 0;

    // Timing events (cudaEvent_t as void*): [0] forward begin, [1 + 2l] layer l begin,
    // [2 + 2l] layer l end, [last] forward end.
    bool timing_enabled_ = false;
    std::vector<void*> timing_events_;
    bool timed_forward_ = false;
    bool timed_graph_ = false;
};

}  // namespace pdsim::model::cuda
