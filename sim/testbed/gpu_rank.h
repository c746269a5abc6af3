// GpuRank: what a testbed rank holds on its GPU for the whole run (`--backend cuda`,
// docs/testbed.md "GPU rank"): its compute stream (a CudaStream on the rank's device) and the GPU
// synthetic model (backends/cuda/cuda_synthetic_model.h: bf16, any TP size) behind model::Model.
// Each phase's server builds its bf16 device KV pool and the "cuda" attention backend on this
// stream (rank_builder.h) and brackets its forwards with begin_phase() / end_phase(), which capture
// the decode CUDA graphs on that pool and backend and stop replaying them when they go.
//
// Layer timing comes from device events, not host callbacks: begin_phase() turns the model's
// layer timing on (one event before and after every layer of an eager forward, and around a
// graph replay), and last_forward_timing() reads the latest forward's, once the stream has been
// synchronized past it.
//
// Built in CUDA builds by gpu_rank_cuda.cpp; without CUDA, gpu_rank_stub.cpp's create() says
// "this pdsim was built without CUDA" (resolve() refuses --backend cuda before that).
//
// Ownership and lifetimes: the GpuRank owns the stream and the model, the stream declared first so
// that it outlives the model (whose destructor waits, bounded, for its last forward on it). The
// phase's pool and backend belong to the server; end_phase() must run before they are destroyed
// (the graphs captured on them hold their addresses). Errors raised on the stream (a CUDA fault,
// a non-finite logit) are sticky: the stream's synchronize() returns them, and the server fails
// its requests with that error. Every wait is bounded, teardown included: a model whose last
// forward or a stream whose work does not end in time marks its GPU hung
// (common/device_health.h), and the frees that would wait for it are skipped.
// Thread-safety: one host thread (the rank's) drives a GpuRank.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_synthetic_model.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/device_tp_comm.h"
#include "backends/model/model.h"
#include "backends/runtime/stream.h"
#include "common/status.h"
#include "sim/testbed/gpu_plan.h"

namespace pdsim::testbed {

struct GpuRankOptions {
    model::cuda::CudaModelOptions model;  // .device is the rank's GPU (GpuChoice::device)
    // The rank's TP group (borrowed; outlives the rank), null for TP 1. A TP > 1 rank decodes
    // without graphs (cuda_synthetic_model.h "Tensor parallelism").
    model::TpComm* tp = nullptr;
    // The same group on the device (--tp-exchange nccl; borrowed, outlives the rank), null: the
    // exchange runs on the host through `tp`.
    model::DeviceTpComm* device_tp = nullptr;
    std::string stream_name = "compute";
    bool decode_graphs = true;       // capture decode CUDA graphs in begin_phase()
    std::vector<int> graph_buckets;  // batch sizes to capture; empty: default_decode_buckets
    std::chrono::milliseconds sync_timeout = runtime::kDefaultWaitTimeout;  // end_phase's wait
};

using GpuForwardTiming = model::cuda::ForwardTiming;

// GPU ranks that are threads of one process (no mpirun) set up one at a time under this lock:
// GpuRank::create (the weights) and each phase's set-up (pool, backend, decode-graph capture,
// engine; Server::setup). A capture is thread-local, but another thread's cudaFree (which
// synchronizes the device) or first load of a kernel during it can invalidate it, and the rank
// would then decode eagerly (and `--fault stale-graph-metadata` would have no graph to plant in).
// Set-up waits on no other rank, so the order cannot deadlock. Under mpirun a process holds one
// rank and the lock costs nothing.
[[nodiscard]] inline std::mutex& gpu_setup_mutex() {
    static std::mutex mu;
    return mu;
}

class GpuRank {
public:
    // Creates the stream on options.model.device, then the model (weights generated on the
    // device; synchronizes). kUnavailable without a GPU ("no device") or in a build without CUDA;
    // the model's create() errors (kInvalidArgument / kUnimplemented for what it cannot run).
    [[nodiscard]] static StatusOr<std::unique_ptr<GpuRank>> create(const model::ModelConfig& config,
                                                                   const GpuRankOptions& options);
    virtual ~GpuRank() = default;
    GpuRank(const GpuRank&) = delete;
    GpuRank& operator=(const GpuRank&) = delete;

    [[nodiscard]] virtual runtime::Stream& stream() = 0;
    [[nodiscard]] virtual model::Model& model() = 0;
    [[nodiscard]] virtual const GpuInfo& info() const = 0;
    // Before the phase's first forward, with the phase's backend (on stream()) and pool: turns
    // layer timing on and, with decode_graphs, captures the decode graphs on them (synchronizes).
    // The phase's decode forwards then replay the smallest bucket that holds them (eagerly above
    // the largest). Graphs are used when available: a capture that fails is logged, and the phase
    // runs its decode forwards eagerly (decode_graphs_state() says why); begin_phase() then
    // returns OK unless the stream itself is broken (its error). kInvalidArgument when the
    // backend does not compute on stream().
    [[nodiscard]] virtual Status begin_phase(attn::AttentionBackend& backend, kv::KVPool& pool) = 0;
    // "on (buckets 1,2,4,...)", "off (--decode-graphs off)" or "off: capture failed: <why>".
    [[nodiscard]] virtual std::string decode_graphs_state() const = 0;
    // Before the phase's backend and pool are destroyed: waits for the stream (bounded by
    // options.sync_timeout; its error, if any, is the phase's to report) and stops replaying the
    // graphs captured on them (the next begin_phase() replaces them).
    virtual void end_phase() = 0;
    // Device times of the latest forward; call only after the stream was synchronized past it.
    // kFailedPrecondition before the first timed forward.
    [[nodiscard]] virtual StatusOr<GpuForwardTiming> last_forward_timing() const = 0;
    // Whether the latest forward replayed a decode graph, and which bucket (0: eager).
    [[nodiscard]] virtual int last_forward_bucket() const = 0;

    // Faults (--fault) a device stream carries:
    // Enqueues on stream() a fill of `bytes` bytes at `dst` (device memory of the rank's GPU, e.g.
    // KV slots of its pool) with `byte`: runtime::cuda::enqueue_device_fill, a cudaMemsetAsync in
    // stream order (the `late-write` fault's write after the record). Its errors.
    [[nodiscard]] virtual Status enqueue_fill(void* dst, int byte, size_t bytes) = 0;
    // The `stale-graph-metadata` fault: true makes the phase's decode graph replays skip the
    // backend's metadata refresh (CudaSyntheticModel::set_skip_graph_metadata_refresh), so they
    // attend with the metadata of the capture's padding batch; end_phase() turns it off.
    virtual void set_stale_graph_metadata(bool stale) = 0;

protected:
    GpuRank() = default;
};

}  // namespace pdsim::testbed
