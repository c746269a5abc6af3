// What one testbed rank builds to run forwards, in one place for the testbed server
// (Server::setup in sim/testbed/server.cpp, Server::execute in server_forward.cpp) and
// `pdsim calibrate`, which times the same forwards on the same objects (sim/cli/calibrate_cmd.cpp):
//   build_rank_parts: the rank's compute stream (a new CpuStream, or the GPU rank's CUDA stream
//     passed in), its MHA KV pool (this rank's KV heads; fp32 in host memory for CPU ranks, bf16
//     on the stream's GPU for GPU ranks), the state pool of a model with recurrent layers, and,
//     when asked, the prefill side's StepCounter and the ordering validators;
//   build_pd_backend: the attention backend (`backend`, `threads` kernel threads; for a model with
//     recurrent layers inside an attn::HybridBackend with the CPU recurrent mixer) wrapped in the
//     testbed's PdAttentionBackend, for the prefill side (records into the StepCounter, ordering
//     checksums from the activations on CPU ranks or from the pool's pages on GPU ranks) or not;
//   build_step_batch: the model batch of one forward from its requests' positions, tokens and
//     page tables, and the segments that tell the backend which tokens are whose.
// Ownership: the caller owns what is returned; a RankParts' stream must outlive everything that
// enqueues on it (its members are declared in reverse destruction order; keep that order when
// moving them into other members). A borrowed stream (RankBuildOptions::stream) is the lender's
// and must outlive the parts. Thread-safety: the functions are reentrant; the objects they
// return have their own contracts (backends/runtime/stream.h, sim/testbed/pd_backend.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "backends/kv/kv_pool.h"
#include "backends/model/model.h"
#include "backends/model/model_config.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/stream.h"
#include "common/status.h"
#include "sim/testbed/options.h"
#include "sim/testbed/pd_backend.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::testbed {

struct RankBuildOptions {
    const model::ModelConfig* model = nullptr;  // required; outlives the call
    int tp_size = 1;
    int tp_rank = 0;
    int threads = 1;              // attention kernel threads
    std::string backend = "cpu";  // attn::create_attention_backend's name
    int page_size = 16;           // KV page size (tokens)
    int num_pages = 2;            // KV pool pages
    // Pages of the sliding layers' own pool (models with cache groups and sliding layers; see
    // RankParts::window_pool), including the null page 0.
    int window_pages = 2;
    // State pool slots (models with recurrent layers), including the null slot 0: one per request
    // that holds a state at a time.
    int state_slots = 2;
    std::string stream_name = "cpu";
    // The stream's bound on waits (CpuStream's wait_timeout).
    std::chrono::milliseconds stream_timeout = runtime::kDefaultWaitTimeout;
    // The new CpuStream's synchronize() runs the tasks it waits for itself (CpuStreamOptions::
    // caller_runs): no thread hand-off per forward.
    bool stream_caller_runs = false;
    // A stream to compute on instead of a new CpuStream (borrowed: the GPU rank's CUDA stream);
    // the pool goes on its device. stream_name and stream_timeout are then unused.
    runtime::Stream* stream = nullptr;
    kv::KVDtype kv_dtype = kv::KVDtype::kF32;  // the pool's (and the backend's) KV dtype
    bool step_counter = false;                 // build the prefill side's StepCounter
    bool validator = false;                    // build an ordering validator
    int validator_rank = 0;                    // the rank the validator reports violations as
};

// Declaration order is the reverse of destruction: the stream outlives everything that enqueues
// on it.
struct RankParts {
    std::unique_ptr<runtime::Stream> owned_stream;  // null when the stream is borrowed
    runtime::Stream* stream = nullptr;              // owned_stream, or RankBuildOptions::stream
    // The KV pool. A model with cache groups (has_cache_groups) has one pool per group, each
    // numbering the model's layers and holding its own (kv::KVPool "Held layers"): `pool` holds the
    // full-attention layers, `window_pool` the sliding layers (null without any; its pages are
    // the requests' rings, window.h), `states` the recurrent layers' states.
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::unique_ptr<kv::MHATokenToKVPool> window_pool;
    std::unique_ptr<kv::StatePool> states;                   // null without recurrent layers
    std::unique_ptr<pd::StepCounter> counter;                // null unless step_counter
    std::unique_ptr<transfer::OrderingValidator> validator;  // null unless validator
    // The states' validator (null unless validator and states): the state transfer engine's
    // layers are the recurrent layers, numbered apart from the KV layers.
    std::unique_ptr<transfer::OrderingValidator> state_validator;
    // The window engine's (null unless validator and sliding layers): its layers are the sliding
    // layers, its tokens the sent window's.
    std::unique_ptr<transfer::OrderingValidator> window_validator;
};

// The transfer engine's view of a state pool (kv::StatePool: one slot per "page", page size 1):
// layer r is the model's r-th recurrent layer, buffer 0 its recurrent state, buffer 1 its
// convolution state, heads the model's state heads sliced by TP as KV heads are
// (transfer::kv_head_slice).
[[nodiscard]] StatusOr<transfer::KvLayout> state_layout(const kv::StatePool& states,
                                                        const model::ModelConfig& model,
                                                        int tp_size, int tp_rank);
// The model layers of `kind`, in order (SenderOptions::layer_steps of that group's engine).
[[nodiscard]] std::vector<int> layers_of(const model::ModelConfig& model, model::LayerKind kind);
// Whether the model's layers are split into cache groups, each with its own transfer engine:
// full-attention layers (the KV engine), sliding-window layers (the window engine, sending only
// the window: window.h) and recurrent layers (the state engine).
[[nodiscard]] inline bool has_cache_groups(const model::ModelConfig& model) {
    return model.count_layers(model::LayerKind::kFullAttention) != model.num_layers;
}
// A transfer engine's view of some layers of a KV pool, in order (engine layer i is model
// layer layers[i]): every layer for a model without cache groups (KvLayout::from_mha_pool), else
// the full-attention layers (the KV engine, over the main pool) or the sliding layers (the window
// engine, over the window pool). kUnimplemented for a hybrid model without layers of `kind`;
// kInvalidArgument when `pool` does not hold them.
[[nodiscard]] StatusOr<transfer::KvLayout> kv_engine_layout(
    const kv::MHATokenToKVPool& pool, const model::ModelConfig& model, int tp_size, int tp_rank,
    model::LayerKind kind = model::LayerKind::kFullAttention);

// Builds (or takes) the stream, then the pools (num_kv_heads / tp_size heads of head_dim,
// kv_dtype, on the stream's device; per cache group, see RankParts), then the counter
// (pd::StepCounter::create: on a CUDA stream the device counter) and the validator. Errors: the
// pool's (kInvalidArgument for a bad shape, kResourceExhausted; kUnavailable for a device
// allocation that failed), the StepCounter's (kUnavailable for a device it has no implementation
// for, or a CUDA error).
[[nodiscard]] StatusOr<RankParts> build_rank_parts(const RankBuildOptions& options);

struct PdBackendSide {
    // The prefill side: the backend advances `parts.counter` and records ordering checksums into
    // `parts.validator` (both must have been built); otherwise it uses neither.
    bool prefill = false;
    Fault fault = Fault::kNone;
    int max_bs = 256;  // graph buffers: the most tokens (extend) or requests (decode) a forward has
    int max_pages_per_seq = 1024;
    std::function<void(int layer, double t_us)> on_record;  // see PdBackendOptions
    // The checksums' source; kPages: the layout is the pool's (parts.pool, this rank's heads).
    ChecksumSource checksums = ChecksumSource::kActivations;
    StreamFill fill;  // kPages with --fault late-write (see PdBackendOptions)
};

// The attention backend `options.backend` on `parts.stream` with this rank's heads (the KV head
// slice of transfer/engine/kv_layout.h), wrapped in a PdAttentionBackend. Errors: an unknown
// backend or a TP size the heads do not divide (kInvalidArgument), the layout's (kPages), the
// backend's and the wrapper's own (PdAttentionBackend::create).
[[nodiscard]] StatusOr<std::unique_ptr<PdAttentionBackend>> build_pd_backend(
    const RankBuildOptions& options, const RankParts& parts, PdBackendSide side);

// One request's part of a forward: positions [t0, t1) computed, their token ids (t1 - t0 of
// them), and the request's page table (pages[t / page_size] holds position t).
struct ForwardEntry {
    uint64_t request = 0;
    int64_t t0 = 0;
    int64_t t1 = 0;
    std::span<const int32_t> tokens;
    std::span<const int32_t> pages;
    int32_t state_slot = 0;  // its state pool slot (models with recurrent layers)
    bool last = false;       // its last prefill chunk
    int64_t input_len = 0;   // its prompt length
    // Its ring in the sliding layers' pool (window.h; models whose sliding layers have their own
    // pool); empty for every entry otherwise.
    std::span<const int32_t> window_ring;
};

// The batch of a forward of `entries` in order: every entry's new tokens and their KV slots,
// seq_len t1, extend_len t1 - t0, and its page table padded with page 0 to the longest one's;
// with window rings, the sliding layers' slots and page table too (logical page j of an entry
// in ring[j % R], window.h). `segments` (not null) gets each entry's (request, t0, t1, offset in
// the batch). kInternal when some entries have a ring and others not, or when a ring is too short
// for the pages its entry's forward touches (`window`: the sliding window W).
[[nodiscard]] StatusOr<model::StepBatch> build_step_batch(attn::ForwardMode mode,
                                                          std::span<const ForwardEntry> entries,
                                                          int page_size, Segments* segments,
                                                          int window = 0);

}  // namespace pdsim::testbed
