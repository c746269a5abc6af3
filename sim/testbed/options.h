// Options of `pdsim testbed` and their resolution into a runnable configuration.
//
// TestbedOptions is what the command line says (every rank parses the same flags). resolve()
// turns it into a ResolvedConfig: the topology (loaded and validated against the model), the
// model configuration, and the requests to replay (trace or synthetic, capped and sampled). Every
// error that is the user's input (flag, file, line, field) is kInvalidArgument naming it, which
// the CLI turns into exit status 2.
//
// Built-in default (no options): topology cpu-1p1d.yaml from the shipped topologies (else an
// embedded copy), the topology's model (`tiny`), a sample of 16 requests of the shipped
// traces/mooncake_conversation.jsonl (see find_trace_dir), inputs capped to 1024 tokens and
// outputs to 32, --mode both, the `cpu` attention backend.
//
// GPU ranks (--backend cuda, docs/testbed.md "GPU rank"): resolve() also checks, before anything
// runs, that this build has CUDA (kInvalidArgument "--backend cuda: this pdsim was built without
// CUDA"), that --shaping is off (the shaping decorator throttles two-sided sends; GPU ranks' KV
// moves by one-sided cuda_ipc writes), that the model is one the GPU model runs on every
// instance's TP size and the cuda attention backend runs (kInvalidArgument naming --model and the
// instance), that --fault is one a device stream can carry (stale-graph-metadata: --decode-graphs
// on, --mode both, TP 1 decode instances), that this process sees a GPU (kUnavailable "--backend
// cuda: no device: ..."; exit 1, as cli::exit_code_for maps it), that each rank's topology GPU is
// one of them (and, without mpirun, that the ranks are on one node: every rank is a thread of this
// process), and that the KV pool, weights and workspace of the ranks on each GPU fit its free
// memory (kInvalidArgument naming --kv-pool-mb). It picks each rank's GPU (gpu_plan.h, choose_gpu)
// and sizes the GPU model (ResolvedConfig::gpu_model, gpus).
//
// The KV transports of the disaggregated phase: --transport is the control transport (two-sided,
// tag-matching: local without mpirun, mpi or tcp under it), which also carries the KV of CPU ranks;
// --data-transport (resolve_data_transport) is the transport the KV bytes take when not that one:
// `auto` is, for GPU ranks, cuda_ipc when every prefill and decode rank is on one topology node
// (one-sided writes into the decode rank's device pool; the engine's write plane) and nccl
// otherwise (ncclSend/ncclRecv matched in post order; the engine's ordered plane), and none for
// CPU ranks. Refused (kInvalidArgument naming the flag): a data transport that cannot reach the
// ranks' KV memory (cuda_ipc or nccl with CPU ranks; none with GPU ranks, whose control transport
// moves host memory only), one that offers neither one-sided writes nor two-sided operations
// matched in post order, cuda_ipc between a prefill and a decode rank of different topology nodes
// (CUDA IPC handles open only on the node that made them), and nccl between a prefill and a
// decode rank on one GPU (NCCL refuses two ranks of a communicator on one device).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_synthetic_model_plan.h"
#include "backends/model/model_config.h"
#include "backends/runtime/tensor.h"
#include "common/status.h"
#include "sim/testbed/gpu_plan.h"
#include "sim/workload/workload.h"
#include "topology/topology.h"

namespace pdsim::testbed {

enum class Mode { kDisagg, kColocated, kBoth };
[[nodiscard]] std::string_view mode_name(Mode mode);
[[nodiscard]] StatusOr<Mode> parse_mode(std::string_view text);

// Ordering bugs the testbed can inject on the prefill side (docs/design.md "Fault injection").
enum class Fault {
    kNone,
    kRecordBeforeWrite,   // the layer's step is recorded before its KV write
    kSkipRecord,          // one layer of every prefill forward records no step
    kDoubleRecord,        // one layer of every prefill forward records its step twice
    kStaleGraphMetadata,  // graph replay without the in-place metadata update
    kFreeBeforeTransfer,  // the request's pages are freed right after its last chunk is handed over
    kLateWrite,           // a layer's KV is overwritten after its step was recorded
    // Hybrid models (recurrent layers):
    kHybridDoubleRecord,  // the composite backend lets its attention child record as well
    kStateNotSent,        // the recurrent states are never transferred (decode uses its own)
    kStateTpMisslice,     // the prefill side's state layout reads every slot one head early
    kWindowFreeInFlight,  // the window frees its pages while their transfer is in flight
};
// The layer kind a fault needs in the model (the testbed refuses it otherwise): kRecurrent for the
// state faults and hybrid-double-record, kSlidingWindow for window-free-in-flight; nullopt: any.
[[nodiscard]] std::optional<topo::LayerKind> fault_needs_layers(Fault fault);
[[nodiscard]] std::string_view fault_name(Fault fault);
[[nodiscard]] StatusOr<Fault> parse_fault(std::string_view text);
[[nodiscard]] std::vector<std::string> fault_names();

// Bounds of the numeric options (resolve() enforces them; the CLI's flags check the same ones
// while parsing): caps on what one option makes a rank allocate, start or wait for.
struct TestbedLimits {
    static constexpr int64_t kMaxLayers = 1024;
    static constexpr int64_t kMaxSynthetic = 100'000;  // synthetic requests (each gets a prompt)
    static constexpr int64_t kMaxRequestCount = 100'000'000;  // --max-requests, --sample
    static constexpr int64_t kMaxLengthCap = 10'000'000;      // --max-input-len, --max-output-len
    static constexpr double kMaxTimeScale = 1e6;
    static constexpr int64_t kMaxBatchTokens = 65'536;  // --chunk-size, --max-batch-tokens
    static constexpr int64_t kMaxDecodeBatch = 4'096;
    static constexpr int64_t kMaxPageSize = 4'096;
    static constexpr int64_t kMaxKvPoolMb = 65'536;  // 64 GiB per rank
    static constexpr double kMaxSloMs = 1e9;
    static constexpr double kMaxRequestTimeoutS = 86'400;  // one day
    static constexpr double kMaxHeartbeatTimeoutS = 3'600;
    static constexpr int64_t kMaxInflightPerInstance = 1'000'000;
    static constexpr int64_t kMinSpeedProbeMs = 10;  // --speed-probe-ms: 0 (off) or 10 .. 60 s
    static constexpr int64_t kMaxSpeedProbeMs = 60'000;
    static constexpr int64_t kMaxThreads = 512;  // compute threads per rank
};

struct TestbedOptions {
    std::string topology;  // "": built-in cpu-1p1d
    std::string model;     // "": the topology's model, else tiny
    int layers = 0;        // > 0: override num_layers
    std::string trace;     // "": the default Mooncake trace (unless synthetic)
    std::string trace_format = "auto";
    int64_t synthetic = 0;     // > 0: this many synthetic requests instead of a trace
    int64_t max_requests = 0;  // first N (after sorting)
    int64_t sample = 0;        // uniform random sample of N (order kept)
    uint64_t seed = 1;
    double time_scale = 0;         // arrival time multiplier; 0: auto (see resolve())
    int32_t max_input_len = 1024;  // 0: no cap
    int32_t max_output_len = 32;   // 0: no cap
    std::string transport;         // "": mpi under mpirun, local in one process
    // The KV bytes' own transport (see the file comment): auto | none | cuda_ipc | nccl; resolve()
    // leaves none, cuda_ipc or nccl (none too when the mode has no disaggregated phase).
    std::string data_transport = "auto";
    std::string backend = "cpu";  // cpu | cpu_ref (CPU ranks) | cuda (GPU ranks)
    bool decode_graphs = true;    // --backend cuda: replay decode forwards as CUDA graphs
    // --backend cuda: how the ranks of a TP > 1 instance exchange their projection partials:
    // auto | host | nccl (resolve_tp_exchange; resolve() leaves none, host or nccl).
    std::string tp_exchange = "auto";
    // The KV sender posts a layer's transfer ahead of its StepCounter record, on a comm stream
    // gated on the record (transfer::SenderOptions::device_gate); in effect only where the data
    // transport is stream-ordered (cuda_ipc, nccl) and the ranks are GPU ranks. Off: the host
    // posts each layer once it sees the record (the gate's baseline).
    bool device_gate = true;
    Mode mode = Mode::kBoth;
    bool layerwise = true;
    // CPU ranks: a forward's synchronize runs the compute stream's queued work on the rank's own
    // thread instead of sleeping while the stream's worker runs it (runtime::CpuStreamOptions::
    // caller_runs; --stream-sync caller). Off (worker): two thread hand-offs per forward, which
    // cost milliseconds on a core shared with other ranks' compute (docs/testbed.md, section 1).
    bool stream_caller_runs = true;
    // CPU ranks: sample the machine-speed probe (common/speed_probe.h) every this many ms while
    // serving, on a thread of its own (ranks[].stats.speed_probe; `pdsim simulate --like` scales
    // the cost model by it against the cost file's probe). 0: off.
    int speed_probe_ms = 250;
    Fault fault = Fault::kNone;
    int chunk_size = 512;         // prefill tokens of one request per forward
    int max_batch_tokens = 2048;  // tokens per extend forward
    int max_decode_batch = 64;    // requests per decode forward
    int page_size = 16;
    int64_t kv_pool_mb = 512;  // KV pool per rank
    double slo_ttft_ms = 0;
    double slo_tpot_ms = 0;
    // A request fails after this long without progress (not after this long in all): its
    // clocks run only while it is dispatched and nothing of it moves (router.h, "Deadlines";
    // the engine's transfer::EngineOptions::request_timeout).
    double request_timeout_s = 30;
    // Router backpressure: at most this many requests in flight per instance (dispatched and
    // not yet past it: prefill done / finished); the rest wait in the router's queue in arrival
    // order. 0: auto (router.h, "Backpressure").
    int64_t max_inflight_per_instance = 0;
    // A rank silent this long (no heartbeat; they go once a second) is dead or hung: the router
    // fails the requests its instance holds and routes no more to it (router.h). 0: off.
    double heartbeat_timeout_s = 5;
    std::string report_path;
    std::string timeline_path;
    std::string requests_path;
    bool progress = false;
    bool quiet = false;  // no summary table
    int threads = 0;     // compute threads per rank (0: cores / ranks on the node)
    // KV transport shaping: "off", "topology" (the topology's `shaping` section; time_scale auto
    // is measured: a CPU prefill layer vs the roofline time of the same layer on shaping.gpu), or
    // "GBPS[:LATENCY_US]" (the CPU-side link directly, GB/s and us).
    std::string shaping = "off";
    std::string transport_fault;    // FaultTransport spec applied to the KV transport
    int transport_fault_rank = -1;  // ... on this rank only (-1: every rank)
    // --transport tcp: listen on this network interface's IPv4 address (each rank its own host's;
    // ranks on several hosts), not loopback. "": loopback (one host), or PDSIM_TCP_ENDPOINTS.
    std::string tcp_interface;
};

// Where the real traces live: data::find_data_dir(kTraces) (common/data_dir.h: $PDSIM_DATA_DIR,
// the source tree's data/traces, the install prefix's share/pdsim/traces). kNotFound (exit 2)
// listing where it looked; kInvalidArgument when $PDSIM_DATA_DIR is set but lacks traces/.
[[nodiscard]] StatusOr<std::string> find_trace_dir();
// The default topology file (cpu-1p1d.yaml among the shipped topologies, common/data_dir.h), or
// "" when not found (the embedded copy is used then).
[[nodiscard]] std::string find_default_topology();
// The embedded copy of topology/examples/cpu-1p1d.yaml.
[[nodiscard]] std::string_view embedded_default_topology();

// The GPU of a rank this process runs (--backend cuda).
struct RankGpu {
    int rank = 0;
    GpuChoice choice;
    GpuInfo info;  // name and memory as resolve() found them
};

struct ResolvedConfig {
    TestbedOptions options;  // with defaults filled in (transport, time_scale, ...)
    topo::Topology topology;
    std::string topology_label;  // file name (or "cpu-1p1d (built-in)")
    // What `pdsim simulate --like` reloads: the topology file's absolute path ("" for the
    // embedded built-in), and --model as given (a name, or a file's absolute path; "": the
    // topology's model, else tiny).
    std::string topology_file;
    std::string model_source;
    model::ModelConfig model;
    std::vector<workload::Request> requests;
    std::string workload_label;    // "mooncake_conversation.jsonl (sample 16)"
    double trace_duration_ms = 0;  // before scaling
    // Shaping: explicit ("GBPS[:LAT]") or from the topology; time_scale 0 = measure at start.
    bool shape = false;
    double shape_gbps = 0;  // emulated link (topology) or the CPU-side link (explicit)
    double shape_latency_us = 0;
    double shape_time_scale = 1;  // 1 for explicit; the topology's value; 0: auto
    std::string shape_gpu;
    // --backend cuda: the GPU model's sizes (its device set per rank from `gpus`), and the GPU of
    // every rank this process runs (every rank without mpirun; its own rank under mpirun), in
    // rank order. Empty for CPU backends.
    model::cuda::CudaModelOptions gpu_model;
    std::vector<RankGpu> gpus;
    [[nodiscard]] bool gpu_ranks() const { return options.backend == kCudaBackend; }
    // This process's entry for `rank`, or nullptr.
    [[nodiscard]] const RankGpu* gpu_of(int rank) const;
};

// Where resolve() runs.
struct ResolveEnv {
    int world_size = 1;  // the launcher's world size (1 without mpirun: every rank runs here)
    int rank = 0;        // under mpirun: this process's rank ...
    int local_rank = 0;  // ... and its index among the processes on this host (the GPU choice)
    int local_size = 1;  // ... among how many processes on this host (the GPU memory check)
    const GpuProbe* gpus = nullptr;  // --backend cuda: what this host has; nullptr: the system's
};

// Loads and validates everything. `world_size`: the launcher's world size (1 without mpirun).
// Every option is checked before anything runs, for every phase of --mode both: the ranges of
// TestbedLimits, the --transport-fault spec (transfer::parse_fault_spec; its rank within the
// topology's), and for a rendezvous transport (tcp) the PDSIM_TCP_ENDPOINTS list (host:port per
// rank). kInvalidArgument naming the option (or variable) and the bad part.
// The process model: world_size == topology ranks (one process per rank), or world_size == 1
// and every rank runs as a thread of this process (transport `local`).
[[nodiscard]] StatusOr<ResolvedConfig> resolve(const TestbedOptions& options,
                                               const ResolveEnv& env);
// resolve(options, {.world_size = world_size}): under mpirun, rank 0's view.
[[nodiscard]] StatusOr<ResolvedConfig> resolve(const TestbedOptions& options, int world_size);

// The values of --data-transport.
inline constexpr std::string_view kDataTransportAuto = "auto";
inline constexpr std::string_view kDataTransportNone = "none";
// Where resolve_data_transport decides.
struct DataTransportQuery {
    std::string_view requested = kDataTransportAuto;  // --data-transport: auto|none|cuda_ipc|nccl
    Mode mode = Mode::kBoth;
    bool gpu_ranks = false;    // --backend cuda
    std::string_view control;  // the resolved --transport (local, mpi, tcp)
    int world_size = 1;        // the launcher's (1: every rank a thread of this process)
    const topo::Topology* topology = nullptr;  // required
    std::string_view topology_label;           // its name in messages
};
// What --data-transport resolves to: "none" (the control transport carries the KV; also whenever
// the mode has no disaggregated phase) or the data transport's name. kInvalidArgument naming the
// flag for the refusals of the file comment, and for a transport whose ranks cannot be what the
// launcher makes them (processes under mpirun, threads without). Pure: it reads the transport
// registry's descriptors, never a transport.
[[nodiscard]] StatusOr<std::string> resolve_data_transport(const DataTransportQuery& query);

// The values of --tp-exchange.
inline constexpr std::string_view kTpExchangeAuto = "auto";
inline constexpr std::string_view kTpExchangeNone = "none";
inline constexpr std::string_view kTpExchangeHost = "host";
inline constexpr std::string_view kTpExchangeNccl = "nccl";
// Where resolve_tp_exchange decides.
struct TpExchangeQuery {
    std::string_view requested = kTpExchangeAuto;  // --tp-exchange: auto|host|nccl
    bool gpu_ranks = false;                        // --backend cuda
    bool nccl_built = false;                       // transfer::nccl_tp_comm_built()
    std::string_view data_transport;               // the resolved --data-transport
    const topo::Topology* topology = nullptr;      // required
    std::string_view topology_label;               // its name in messages
};
// What --tp-exchange resolves to: how the ranks of each TP > 1 instance exchange the GPU model's
// projection partials (backends/cuda/cuda_synthetic_model.h "Tensor parallelism"):
//   - "none": no instance has tp > 1 (nothing to exchange);
//   - "host": through the host (TpComm: MPI under mpirun, in-process without); always so for CPU
//     ranks, and what auto picks for GPU ranks when NCCL cannot serve every TP > 1 instance;
//   - "nccl": one NCCL communicator per TP > 1 instance, its all-gather on each rank's compute
//     stream (transfer/nccl/nccl_tp_comm.h). Auto picks it for GPU ranks when NCCL can serve
//     every TP > 1 instance: ranks on distinct topology GPUs (NCCL refuses two ranks of one
//     communicator on one GPU), no GPU shared by two TP > 1 instances and a data transport other
//     than nccl (NCCL forbids operations on two communicators of one GPU from two threads at
//     once), and a build with NCCL.
// kInvalidArgument naming the flag: an unknown value; nccl for CPU ranks, with no TP > 1
// instance, on a topology whose devices are not GPUs (which GPU a rank takes is then not known
// before it runs), or where NCCL cannot serve it as above (the message says why). Pure.
[[nodiscard]] StatusOr<std::string> resolve_tp_exchange(const TpExchangeQuery& query);

// A rank's KV pool: pages of page_size tokens of this rank's KV heads (num_kv_heads / tp) in
// `dtype`, every attention layer (a hybrid model's full and sliding layers; its full layers' pool
// has this many pages, its sliding layers' pool at most as many), K and V; --kv-pool-mb MiB of them
// plus the null page 0 (at least 2 pages, at most 2^24).
[[nodiscard]] int64_t kv_page_bytes(const model::ModelConfig& model, int tp, int page_size,
                                    runtime::DType dtype);
[[nodiscard]] int64_t kv_pool_pages(const model::ModelConfig& model, int tp, int page_size,
                                    int64_t kv_pool_mb, runtime::DType dtype);

// The CLI flag string of the options that matter for a report ("--mode both --layerwise on ...").
[[nodiscard]] std::string describe(const TestbedOptions& options);

}  // namespace pdsim::testbed
