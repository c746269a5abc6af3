// PdAttentionBackend: the attention backend a testbed rank runs, wrapping a real one ("cpu",
// "cpu_ref" or "cuda" from the registry) to (1) take the compute stream's checksums for the
// ordering validator, (2) timestamp the StepCounter records for the timeline, and (3) inject the
// prefill side's ordering faults (--fault).
//
// Records. Without a fault, or with a fault that keeps the records right (late-write,
// stale-graph-metadata, free-before-transfer), and with activation checksums, the StepCounter is
// registered on the wrapped backend itself, so its own RecordPdCacheStep rule places the records
// (one per layer of an extend forward, after the backend's KV write). With page checksums (below)
// the wrapper records itself, right after the layer's checksum. The record-order faults take the
// records over:
//   record-before-write  the layer's step is recorded, then (after a race window that lets the
//                        sender read) the KV is written;
//   skip-record          the last layer of every extend forward records nothing;
//   double-record        layer 0 of every extend forward records twice (then a race window).
// The race window is a stream task that sleeps (on a CUDA stream a host function: it holds the
// stream, not the device's other streams, on which the sender's reads run).
//
// Checksums: the compute-side truth of the ordering validator, one of two sources
// (PdBackendOptions::checksums):
//   kActivations (CPU ranks)  before each extend layer's KV write, a stream task hashes the K and
//       V the model produced for the layer (the bytes the write is about to store, for every
//       request segment of the batch, keyed by token position) and records them as the expected
//       sums. Taking them from the model's output rather than from the pages means a write that
//       misses its slots (stale metadata) is caught too. The pool and the K/V activations must be
//       fp32 in host memory (a bf16 pool stores rounded bytes).
//   kPages (GPU ranks; any device)  right after each extend layer's KV write,
//       transfer::enqueue_layer_checksum on the rank's KvLayout hashes what the write stored in
//       each segment's pages (on a device layout through the engine's device KV memory ops, and a
//       host task that records the sums: a host round trip per layer), and then the wrapper
//       records the layer's step: write -> checksum -> record, in stream order, so that the sums
//       are recorded before the step that lets the sender read. (When the KV was written before
//       the forward, save_kv_cache = false: checksum -> record -> attention.)
//
// Faults on the data itself:
//   late-write            before the last layer's write, layer 0's K of every token of the
//                         batch is overwritten (after layer 0's step was recorded): from the host
//                         (kActivations: + 1.0 per element) or, with kPages, by
//                         PdBackendOptions::fill on the stream (a GPU rank's cudaMemsetAsync,
//                         GpuRank::enqueue_fill) of each segment's layer-0 K slots;
//   stale-graph-metadata  (CPU streams) the first extend batch is installed in graph metadata
//                         buffers (init_cuda_graph_state +
//                         init_forward_metadata_replay_cuda_graph); later extend forwards only
//                         refresh the aliased seq_lens buffer and replay without
//                         init_forward_metadata_replay_cuda_graph's in-place update. GPU ranks
//                         plant it in the decode CUDA graphs instead (GpuRank::
//                         set_stale_graph_metadata), not here.
//
// Graph state is the wrapped backend's: init_cuda_graph_state, the capture and replay metadata
// calls and accepted_graph_state_extras go to it (a model capturing decode graphs through the
// wrapper, e.g. the GPU model of a GPU rank, captures the wrapped backend's kernels on its graph
// metadata). The wrapper's own metadata stays eager; after a capture the wrapped backend returns
// to eager metadata at its next init_forward_metadata (every backend's does).
//
// Devices: create() refuses (kFailedPrecondition) on a stream of another device than the CPU what
// reads or writes KV in host memory: kActivations with a validator, late-write without kPages,
// and stale-graph-metadata. A GPU rank runs kPages, its faults through the StepCounter (records),
// the fill (late-write) and the GPU rank (stale graphs); on_record callbacks (host tasks) work on
// any stream, but a GPU rank leaves them unset (they would be a host round trip per layer).
//
// Thread-safety: like any backend, one host thread drives it. set_segments() must be called by
// that thread before each forward's layers are enqueued (the segments are captured by value).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/pd/step_counter.h"
#include "common/status.h"
#include "sim/testbed/options.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::testbed {

// Tokens [batch_offset, batch_offset + (t1 - t0)) of the forward are positions [t0, t1) of
// `request`, whose page table is `pages` (pages[t / page_size] holds position t).
struct BatchSegment {
    uint64_t request = 0;
    int64_t t0 = 0;
    int64_t t1 = 0;
    int64_t batch_offset = 0;
    std::vector<int32_t> pages;
    int32_t state_slot = 0;  // models with recurrent layers: the request's state pool slot
    bool last = false;       // the request's last prefill chunk (its state is final)
    int64_t input_len = 0;   // its prompt length (where a sliding layer's sent window starts)
};
using Segments = std::vector<BatchSegment>;

// Where the compute-side truth of the ordering checksums comes from (see the file comment).
enum class ChecksumSource { kActivations, kPages };

// Enqueues, on the compute stream, a fill of `bytes` bytes at `dst` with `byte` (a GPU rank's:
// GpuRank::enqueue_fill).
using StreamFill = std::function<Status(void* dst, int byte, size_t bytes)>;

struct PdBackendOptions {
    Fault fault = Fault::kNone;
    pd::StepCounter* counter = nullptr;                // prefill ranks (disaggregated)
    transfer::OrderingValidator* validator = nullptr;  // prefill ranks (disaggregated)
    int head_begin = 0;                                // global index of this rank's first KV head
    int num_layers = 1;
    int max_bs = 256;  // graph buffers (stale-graph-metadata)
    int max_pages_per_seq = 1024;
    std::chrono::microseconds race_window{3000};
    // Called on the stream thread right after a record (layer, time in now_us()).
    std::function<void(int layer, double t_us)> on_record;
    ChecksumSource checksums = ChecksumSource::kActivations;
    // kPages: the rank's KV in the pool this backend writes (KvLayout::from_mha_pool with the
    // rank's head slice); required with a validator or with late-write.
    std::optional<transfer::KvLayout> layout;
    // kPages with late-write: overwrites the KV on the stream (required then).
    StreamFill fill;
    // kPages with a validator on a device layout: the KV memory ops that take the checksums on
    // the compute stream (transfer::enqueue_layer_checksum). Null: create() makes them with
    // transfer::make_kv_memory_ops(layout->device()). Kept by the backend, which must outlive the
    // stream's work (the testbed synchronizes the stream before it destroys the backend).
    std::shared_ptr<transfer::KvMemoryOps> memory_ops;
    // Models with recurrent layers (the wrapped backend is an attn::HybridBackend): the state
    // pool's layout (state_layout() in rank_builder.h) and, on prefill ranks, the states'
    // validator. After a recurrent layer's update in a request's last prefill chunk the wrapper
    // hashes the request's state slot into state_validator (layer = the state layer), then
    // records the layer's step: update -> checksum -> record, as for KV pages.
    std::optional<transfer::KvLayout> state_layout;
    transfer::OrderingValidator* state_validator = nullptr;
    // The KV engine's layer of each model layer, when they differ (a hybrid model's KV engine
    // holds its full-attention layers only; -1 for other layers): the layer the activation
    // checksums are recorded under. Empty: the model layer.
    std::vector<int> engine_layer;
    // Sliding layers whose KV goes over the window engine (sim/testbed/window.h): per model layer
    // its window engine layer (-1: not one), the window engine's validator (prefill ranks) and the
    // page size that aligns the sent window. Their checksums cover the sent tokens only, numbered
    // from the window's start.
    std::vector<int> window_layer;
    transfer::OrderingValidator* window_validator = nullptr;
    int page_size = 16;
};

// The byte the late-write fault fills a slot with (kPages).
inline constexpr int kLateWriteByte = 0x5A;

class PdAttentionBackend final : public attn::AttentionBackend {
public:
    [[nodiscard]] static StatusOr<std::unique_ptr<PdAttentionBackend>> create(
        std::unique_ptr<attn::AttentionBackend> inner, PdBackendOptions options);
    ~PdAttentionBackend() override;

    [[nodiscard]] std::string name() const override { return inner_->name(); }
    [[nodiscard]] attn::BackendCapabilities capabilities() const override {
        return inner_->capabilities();
    }
    [[nodiscard]] bool support_kv_cache_prewrite(
        std::optional<attn::ForwardMode> mode) const override {
        return inner_->support_kv_cache_prewrite(mode);
    }
    [[nodiscard]] Status init_forward_metadata(const attn::ForwardBatch& batch) override;
    // The graph state of the wrapped backend (see the file comment).
    [[nodiscard]] Status init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                               const attn::GraphStateExtras& extras) override;
    [[nodiscard]] std::set<std::string> accepted_graph_state_extras() const override {
        return inner_->accepted_graph_state_extras();
    }
    [[nodiscard]] Status init_forward_metadata_capture_cuda_graph(int bs,
                                                                  attn::ForwardMode mode) override;
    [[nodiscard]] Status init_forward_metadata_replay_cuda_graph(
        const attn::ForwardBatch& batch) override;

    void set_segments(std::shared_ptr<const Segments> segments) { segments_ = std::move(segments); }
    [[nodiscard]] attn::AttentionBackend& inner() { return *inner_; }

protected:
    [[nodiscard]] Status forward_decode(const attn::ForwardArgs& args) override;
    [[nodiscard]] Status forward_extend(const attn::ForwardArgs& args) override;
    // Recurrent layers: the wrapped hybrid backend's update (never recording), the state
    // checksums, then this wrapper's record (skip-record and double-record as for attention
    // layers; the other record faults record after the update).
    [[nodiscard]] Status forward_recurrent_impl(const attn::RecurrentArgs& args) override;

private:
    PdAttentionBackend(std::unique_ptr<attn::AttentionBackend> inner, PdBackendOptions options);
    [[nodiscard]] bool owns_records() const;
    [[nodiscard]] Status record(int layer);
    [[nodiscard]] Status race_window();
    [[nodiscard]] Status enqueue_checksums(const attn::ForwardArgs& args);
    [[nodiscard]] Status enqueue_page_checksums(int layer);
    [[nodiscard]] Status enqueue_late_write(const attn::ForwardArgs& args);
    [[nodiscard]] Status enqueue_page_late_write();
    [[nodiscard]] Status call_inner(const attn::ForwardArgs& args);
    [[nodiscard]] Status forward_extend_pages(const attn::ForwardArgs& args);

    std::vector<int32_t> graph_seq_lens_;  // aliased by the inner backend's graph buffers
    PdBackendOptions opts_;
    std::unique_ptr<attn::AttentionBackend> inner_;
    std::shared_ptr<const Segments> segments_;
    bool graph_installed_ = false;
};

}  // namespace pdsim::testbed
