// The per-rank serving loop of the testbed: one instance's scheduler (its TP rank 0, the leader)
// or one of its TP followers, for one phase (colocated or disaggregated).
//
// Roles (from the topology's rank map):
//   colocated phase: every instance (prefill or decode in the topology) serves whole requests:
//     chunked prefill, then continuous-batched decode, on its own ranks.
//   disaggregated phase: prefill instances run chunked prefill and hand every chunk to the
//     transfer engine's KvSender (layerwise: right after enqueueing the forward, the sender waits
//     for each layer's StepCounter step; --layerwise off: after the forward completed); decode
//     instances pre-allocate pages, submit the request to their KvReceiver (bootstrap), and once
//     every layer arrived (and the first token came with the last chunk) batch it continuously.
//
// Scheduling (leader; documented in docs/testbed.md):
//   admission FCFS; a request gets all its pages at admission (prefill: input; decode and
//   colocated: input + output), and waits at the head of the queue while the pool is short.
//   extend forward: requests in FCFS order, each contributing min(remaining, --chunk-size)
//   tokens, until --max-batch-tokens; decode forward: every running request in FCFS order up to
//   --max-decode-batch requests and kMaxDecodeKvTokensPerThread * attention threads KV tokens (the
//   cpu backend's split-KV chunking is batch-invariant only under that bound). A forward is either
//   extend or decode, never mixed (the kernels differ, and tokens must be bit-identical across
//   modes); a colocated instance with both kinds of work alternates them.
// TP: the leader decides each forward and sends the plan to its followers (mailbox, in order);
// every TP rank runs the same forward (the model's TpComm allgather keeps them in lockstep).
// Followers report their engine's per-request outcome to the leader.
//
// Requests report to the router (rank 0): "first" (first token available), "done" (generated
// tokens, or the failure), "pdone" (prefill side finished with a request). Every engine wait is
// bounded by --request-timeout-s; a broken compute stream fails the instance's requests.
//
// Devices: a CPU rank builds a CpuStream, an fp32 host KV pool and the `cpu`/`cpu_ref` backend per
// phase and times layers with the CPU model's layer hook; a GPU rank (RankContext::gpu) computes
// on the GpuRank's CUDA stream with a bf16 device pool and the `cuda` backend built per phase, and
// times layers with device events read after each forward (the compute track of the timeline).
// The scheduling is the same code for both, except that a GPU rank's decode batches have no KV
// token bound (the cuda backend never splits KV, so its batches stay invariant without it).
// Disaggregated GPU ranks (docs/testbed.md "GPU rank"): a prefill rank's StepCounter is the
// device counter on its CUDA stream (records are kernels); its ordering truth is the pages'
// checksum after each layer's write (PdAttentionBackend, ChecksumSource::kPages); the first token
// goes as on a CPU rank (a host task on the stream copies it, then record_aux); its records have
// no timeline callbacks (a host round trip each). Its KvSender / KvReceiver take the data
// transport (cuda_ipc) as EngineOptions::data_transport. Faults: as on CPU ranks, except that
// late-write is a stream fill (GpuRank::enqueue_fill) and stale-graph-metadata is planted in the
// decode ranks' graph replays (GpuRank::set_stale_graph_metadata).
//
// Thread-safety: run() runs on the rank's main thread; the engine's event hook and the model's
// layer hook run on engine / stream threads and only append to locked buffers.
#pragma once

#include <atomic>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "backends/model/model.h"
#include "backends/model/synthetic_model.h"
#include "common/status.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/gpu_rank.h"
#include "sim/testbed/options.h"
#include "sim/testbed/protocol.h"
#include "topology/topology.h"
#include "transfer/transport.h"

namespace pdsim::testbed {

enum class Phase { kColocated, kDisagg };
[[nodiscard]] std::string_view phase_name(Phase phase);

// Decode batches stay under this many KV tokens per attention thread (see above).
inline constexpr int64_t kMaxDecodeKvTokensPerThread = 2048;

// What a rank needs for every phase.
struct RankContext {
    int rank = 0;
    int world = 1;
    const ResolvedConfig* config = nullptr;
    topo::RankInfo info;
    std::vector<int> instance_ranks;  // world ranks of this rank's instance, by TP rank
    Mailbox* mbox = nullptr;
    model::TpComm* tp = nullptr;    // null for TP 1
    model::Model* model = nullptr;  // the rank's model (cpu_model's, or gpu's)
    // A CPU rank: its model (the layer hook feeds the timeline); null on a GPU rank.
    model::SyntheticModel* cpu_model = nullptr;
    // A GPU rank (--backend cuda): its stream and GPU model, for every phase; null on a CPU rank.
    GpuRank* gpu = nullptr;
    int threads = 1;  // attention kernel threads (CPU ranks)
    // The rank's progress count (forwards run, KV layers moved), which its heartbeat carries to
    // the router (router.h, "Deadlines"); bumped from the server's and the engine's threads.
    // Null: not counted.
    std::atomic<uint64_t>* progress = nullptr;
    void note_progress() const {
        if (progress != nullptr) progress->fetch_add(1, std::memory_order_relaxed);
    }
    [[nodiscard]] bool is_leader() const { return info.tp_rank == 0; }
    [[nodiscard]] int leader() const { return instance_ranks.front(); }
};

// The transports of a disaggregated phase (both null for colocated; not owned, they outlive the
// phase's server). `control` carries the engine's messages (and the KV when `data` is null);
// `data` carries the KV bytes (EngineOptions::data_transport: GPU ranks' cuda_ipc).
struct KvTransports {
    transfer::Transport* control = nullptr;
    transfer::Transport* data = nullptr;
};

namespace detail {
class Server;
}  // namespace detail

// This rank's part of one phase, in three steps, so that the ranks can agree that every one of
// them set up before any starts serving (testbed.cpp):
//   setup()   builds the phase's device objects (stream, KV pool, StepCounter, validator, the
//             attention backend; a GPU rank's decode graphs) and, disaggregated, the KvSender
//             (prefill) or KvReceiver (decode) over `kv`. Its error is the rank's set-up failure:
//             e.g. the transfer engine refusing the rank's KV layout or transports (the
//             message names the engine and what is missing).
//   run()     serves until the router ends the phase (only after a setup() that succeeded).
//   finish()  shuts the engines down (graceful) and returns what rank 0 needs for the report
//             (timeline events, engine events, ordering report, stats; times on this rank's
//             clock), with `error` (not OK) as the rank's error.
// Destroying it releases the phase's objects (the engines before the pool).
class PhaseServer {
public:
    PhaseServer(RankContext& ctx, Phase phase, KvTransports kv);
    ~PhaseServer();
    PhaseServer(const PhaseServer&) = delete;
    PhaseServer& operator=(const PhaseServer&) = delete;

    [[nodiscard]] Status setup();
    [[nodiscard]] Status run();
    [[nodiscard]] RankResult finish(const Status& error);

private:
    std::unique_ptr<detail::Server> server_;
};

}  // namespace pdsim::testbed
