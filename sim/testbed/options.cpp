#include "sim/testbed/options.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include "backends/cuda/cuda_attention_plan.h"
#include "common/data_dir.h"
#include "common/net_interface.h"
#include "common/text.h"
#include "topology/gpu_spec.h"
#include "topology/loader.h"
#include "topology/validate.h"
#include "transfer/fault/fault_transport.h"
#include "transfer/nccl/nccl_tp_comm.h"
#include "transfer/tcp/tcp_transport.h"
#include "transfer/transport.h"

namespace pdsim::testbed {

namespace fs = std::filesystem;

namespace {

// Auto time scale: the replay is compressed so that the requests arrive about this many
// milliseconds of (capped) prefill work apart per prefill instance: kAutoMsPerInputToken per input
// token, a rough figure for the tiny model on one core, so the default run is short and the
// prefill ranks are busy but not swamped.
constexpr double kAutoMsPerInputToken = 0.6;

constexpr std::string_view kEmbeddedCpu1p1d = R"(# Embedded copy of topology/examples/cpu-1p1d.yaml
name: "cpu-1p1d"
description: "CPU testbed on this machine: one cpu device per MPI rank"
model: tiny
world_size: 2
nodes:
  - id: node0
    hostname: localhost
    devices:
      - {id: node0.cpu0, type: cpu}
      - {id: node0.cpu1, type: cpu}
    switches:
      - {id: node0.shm, type: loopback}
links:
  - {a: node0.cpu0, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: node0.cpu1, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
instances:
  - id: prefill0
    role: prefill
    tp: 1
    devices: [node0.cpu0]
  - id: decode0
    role: decode
    tp: 1
    devices: [node0.cpu1]
)";

using text::excerpt;  // at most 80 bytes of a user's text, on one line

Status check_int(std::string_view flag, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) {
        return invalid_argument_error(fmt::format("{} {}: must be in [{}, {}]", flag, v, lo, hi));
    }
    return {};
}

// NaN and infinities fail too; `lo_open`: lo itself fails.
Status check_real(std::string_view flag, double v, double lo, double hi, bool lo_open = false) {
    if (!std::isfinite(v) || v < lo || v > hi || (lo_open && v == lo)) {
        return invalid_argument_error(
            fmt::format("{} {}: must be in {}{:g}, {:g}]", flag, v, lo_open ? "(" : "[", lo, hi));
    }
    return {};
}

// The options' ranges (TestbedLimits); 0 stands for "not given" where the option has a default
// that is not a number (--layers, --synthetic, --max-requests, --sample, --time-scale, --threads).
Status check_ranges(const TestbedOptions& o) {
    using L = TestbedLimits;
    PDSIM_RETURN_IF_ERROR(check_int("--layers", o.layers, 0, L::kMaxLayers));
    PDSIM_RETURN_IF_ERROR(check_int("--synthetic", o.synthetic, 0, L::kMaxSynthetic));
    PDSIM_RETURN_IF_ERROR(check_int("--max-requests", o.max_requests, 0, L::kMaxRequestCount));
    PDSIM_RETURN_IF_ERROR(check_int("--sample", o.sample, 0, L::kMaxRequestCount));
    PDSIM_RETURN_IF_ERROR(check_int("--max-input-len", o.max_input_len, 0, L::kMaxLengthCap));
    PDSIM_RETURN_IF_ERROR(check_int("--max-output-len", o.max_output_len, 0, L::kMaxLengthCap));
    PDSIM_RETURN_IF_ERROR(check_real("--time-scale", o.time_scale, 0, L::kMaxTimeScale));
    PDSIM_RETURN_IF_ERROR(check_int("--chunk-size", o.chunk_size, 1, L::kMaxBatchTokens));
    PDSIM_RETURN_IF_ERROR(
        check_int("--max-batch-tokens", o.max_batch_tokens, 1, L::kMaxBatchTokens));
    PDSIM_RETURN_IF_ERROR(
        check_int("--max-decode-batch", o.max_decode_batch, 1, L::kMaxDecodeBatch));
    PDSIM_RETURN_IF_ERROR(check_int("--page-size", o.page_size, 1, L::kMaxPageSize));
    PDSIM_RETURN_IF_ERROR(check_int("--speed-probe-ms", o.speed_probe_ms, 0, L::kMaxSpeedProbeMs));
    if (o.speed_probe_ms > 0 && o.speed_probe_ms < L::kMinSpeedProbeMs) {
        return invalid_argument_error(
            fmt::format("--speed-probe-ms {}: at least {} (each sample costs about 1 ms of CPU), "
                        "or 0 for off",
                        o.speed_probe_ms, L::kMinSpeedProbeMs));
    }
    PDSIM_RETURN_IF_ERROR(check_int("--kv-pool-mb", o.kv_pool_mb, 1, L::kMaxKvPoolMb));
    PDSIM_RETURN_IF_ERROR(check_real("--slo-ttft-ms", o.slo_ttft_ms, 0, L::kMaxSloMs));
    PDSIM_RETURN_IF_ERROR(check_real("--slo-tpot-ms", o.slo_tpot_ms, 0, L::kMaxSloMs));
    PDSIM_RETURN_IF_ERROR(check_real("--request-timeout-s", o.request_timeout_s, 0,
                                     L::kMaxRequestTimeoutS, /*lo_open=*/true));
    PDSIM_RETURN_IF_ERROR(
        check_real("--heartbeat-timeout-s", o.heartbeat_timeout_s, 0, L::kMaxHeartbeatTimeoutS));
    if (o.heartbeat_timeout_s > 0 && o.heartbeat_timeout_s < 2) {
        return invalid_argument_error(fmt::format(
            "--heartbeat-timeout-s {}: at least 2 (heartbeats go once a second), or 0 for off",
            o.heartbeat_timeout_s));
    }
    PDSIM_RETURN_IF_ERROR(check_int("--max-inflight-per-instance", o.max_inflight_per_instance, 0,
                                    L::kMaxInflightPerInstance));
    PDSIM_RETURN_IF_ERROR(check_int("--threads", o.threads, 0, L::kMaxThreads));
    PDSIM_RETURN_IF_ERROR(
        check_int("--transport-fault-rank", o.transport_fault_rank, -1, int64_t{1} << 20));
    return {};
}

// PDSIM_TCP_ENDPOINTS, when set and the transport meets its peers through a rendezvous (tcp):
// one host:port per rank, each well formed, checked here rather than when the transport starts
// (after --mode both's colocated phase).
Status check_tcp_environment(const std::string& transport, int ranks) {
    StatusOr<transfer::TransportDescriptor> d = transfer::find_transport(transport);
    if (!d.ok() || d->caps.setup != transfer::TransportSetup::kRendezvous) return {};
    // PDSIM_SESSION_TOKEN, when set: a secret worth the name (a guessable token is no guard).
    if (const char* token = std::getenv("PDSIM_SESSION_TOKEN"); token != nullptr) {
        const size_t length = std::strlen(token);
        if (length < 16 || length > 256) {
            return invalid_argument_error(fmt::format(
                "PDSIM_SESSION_TOKEN: {} characters; a session token has 16 to 256 (e.g. "
                "`openssl rand -hex 16`)",
                length));
        }
    }
    const char* env = std::getenv("PDSIM_TCP_ENDPOINTS");
    if (env == nullptr || *env == '\0') return {};
    const std::string list(env);
    int count = 0;
    size_t start = 0;
    for (;;) {
        const size_t comma = list.find(',', start);
        const std::string item =
            list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (item.empty()) {
            // Skipped, as the transport does.
        } else if (!transfer::parse_host_port(item).ok()) {
            // (parse_host_port's own message starts with its source location.)
            return invalid_argument_error(
                fmt::format("PDSIM_TCP_ENDPOINTS {}: item {} '{}': expected host:port",
                            excerpt(list), count + 1, excerpt(item)));
        } else {
            ++count;
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    if (count != ranks) {
        return invalid_argument_error(
            fmt::format("PDSIM_TCP_ENDPOINTS {}: {} endpoints, but the topology has {} ranks",
                        excerpt(list), count, ranks));
    }
    return {};
}

// Whether the run's GPU ranks use the TP-invariant (sliced) reduction: when any instance is TP > 1,
// every rank does, so that TP 1 ranks compute the bits TP > 1 ranks do (outputs compared token
// for token with the colocated run; cuda_synthetic_model.h "Tensor parallelism").
bool gpu_sliced_reduction(const topo::Topology& topology) {
    return std::any_of(topology.instances.begin(), topology.instances.end(),
                       [](const topo::Instance& inst) { return inst.tp > 1; });
}

// --backend cuda, what needs the topology and the model: a model the GPU model runs on every
// instance's TP size, and the cuda attention backend on its heads.
Status check_gpu_model(const ResolvedConfig& rc) {
    const std::string name = rc.options.model.empty() ? rc.model.name : rc.options.model;
    model::cuda::CudaModelOptions sliced;
    sliced.sliced_reduction = gpu_sliced_reduction(rc.topology);
    for (const auto& inst : rc.topology.instances) {
        if (Status st = model::cuda::check_cuda_model_config(rc.model, inst.tp, sliced); !st.ok()) {
            return invalid_argument_error(
                fmt::format("--model {}: the GPU model cannot run it on {} instance {} (tp {}): {}",
                            name, rc.topology_label, inst.id, inst.tp, st.message()));
        }
        if (inst.tp > 1 && inst.role == topo::Role::kDecode &&
            rc.options.fault == Fault::kStaleGraphMetadata) {
            return invalid_argument_error(fmt::format(
                "--fault stale-graph-metadata: {}: decode instance {} has tp {}; GPU ranks plant "
                "it in the decode CUDA graphs, and a TP > 1 GPU rank decodes without graphs "
                "(backends/cuda/cuda_synthetic_model.h, \"Tensor parallelism\"): use tp: 1 "
                "decode instances",
                rc.topology_label, inst.id, inst.tp));
        }
    }
    attn::AttentionConfig ac;
    ac.num_q_heads = rc.model.num_q_heads;
    ac.num_kv_heads = rc.model.num_kv_heads;
    ac.head_dim = rc.model.head_dim;
    ac.kv_dtype = runtime::DType::kBF16;
    if (Status st = attn::cuda::check_backend_config(ac); !st.ok()) {
        return invalid_argument_error(fmt::format(
            "--model {}: the cuda attention backend cannot run it: {}", name, st.message()));
    }
    return {};
}

// --backend cuda, once the requests are known: sizes the GPU model, picks each rank's GPU (every
// rank without mpirun, else this process's) and checks that what the ranks on each GPU allocate
// fits its free memory.
Status plan_gpus(ResolvedConfig& rc, const ResolveEnv& env, const GpuProbe& probe) {
    const TestbedOptions& o = rc.options;
    int64_t max_sequence = 1;
    for (const auto& r : rc.requests) {
        max_sequence = std::max<int64_t>(max_sequence, int64_t{r.input_len} + r.output_len);
    }
    rc.gpu_model = gpu_model_options({.max_batch_tokens = o.max_batch_tokens,
                                      .max_decode_batch = o.max_decode_batch,
                                      .requests = static_cast<int64_t>(rc.requests.size()),
                                      .max_sequence = max_sequence},
                                     0);
    rc.gpu_model.sliced_reduction = gpu_sliced_reduction(rc.topology);
    std::set<int> tp_sizes;
    for (const auto& inst : rc.topology.instances) tp_sizes.insert(inst.tp);
    for (int tp : tp_sizes) {
        if (Status st = model::cuda::check_cuda_model_config(rc.model, tp, rc.gpu_model);
            !st.ok()) {
            return invalid_argument_error(fmt::format(
                "--backend cuda: the GPU model sized for this run ({} tokens, {} requests per "
                "forward, {} positions, tp {}): {}",
                rc.gpu_model.max_tokens, rc.gpu_model.max_bs, rc.gpu_model.max_positions, tp,
                st.message()));
        }
    }
    StatusOr<int> visible = probe.device_count();
    if (!visible.ok()) {
        // No GPU is not the user's input: kUnavailable (exit 1), with the runtime's reason.
        return Status(visible.status().code(), "--backend cuda: " + visible.status().message());
    }
    const topo::RankMap map = rc.topology.rank_map();
    std::vector<int> ranks;
    if (env.world_size <= 1) {
        for (int r = 0; r < map.world_size(); ++r) ranks.push_back(r);
    } else if (env.rank >= 0 && env.rank < map.world_size()) {
        ranks.push_back(env.rank);
    }
    if (env.world_size <= 1) {
        // Every rank is a thread of this process and computes on a GPU this process sees: the
        // topology's CUDA ordinals are per node, so its ranks must be on one node.
        for (int r : ranks) {
            const topo::RankInfo& a = map.at(r);
            const topo::RankInfo& b = map.at(ranks.front());
            if (a.node != b.node) {
                return invalid_argument_error(fmt::format(
                    "--backend cuda: {}: rank {} is on node {} and rank {} on node {}; without "
                    "mpirun every rank is a thread of this process, on this host's GPUs: run it "
                    "under mpirun with one process per rank on its node",
                    rc.topology_label, b.rank,
                    b.node >= 0 ? rc.topology.nodes[static_cast<size_t>(b.node)].id : "?", a.rank,
                    a.node >= 0 ? rc.topology.nodes[static_cast<size_t>(a.node)].id : "?"));
            }
        }
    }
    std::map<int, int> per_device;  // device -> ranks on it (this process's, and under mpirun
                                    // the other processes' ranks on the same topology GPU)
    for (int r : ranks) {
        const int local = env.world_size <= 1 ? r : env.local_rank;
        PDSIM_ASSIGN_OR_RETURN(GpuChoice choice, choose_gpu(rc.topology, map.at(r), local, *visible,
                                                            rc.topology_label));
        ++per_device[choice.device];
        if (env.world_size > 1 && choice.from_topology) {
            // Under mpirun every process checks before any allocates: the ranks of a `shared`
            // GPU (gpu-1p1d: prefill and decode) would each see it free and fit alone.
            const topo::RankInfo& me = map.at(r);
            for (const topo::RankInfo& other : map.ranks()) {
                if (other.rank != r && other.node == me.node && other.device == me.device) {
                    ++per_device[choice.device];
                }
            }
        } else if (env.world_size > 1 && *visible > 0) {
            // A GPU by local rank (local rank % visible GPUs): the other processes of this host
            // whose local rank picks the same GPU also check alone, before any allocates.
            for (int l = 0; l < env.local_size; ++l) {
                if (l != env.local_rank && l % *visible == env.local_rank % *visible) {
                    ++per_device[choice.device];
                }
            }
        }
        rc.gpus.push_back({.rank = r, .choice = std::move(choice), .info = {}});
    }
    const int64_t pool_bytes =
        kv_pool_pages(rc.model, 1, o.page_size, o.kv_pool_mb, runtime::DType::kBF16) *
        kv_page_bytes(rc.model, 1, o.page_size, runtime::DType::kBF16);
    // The most any rank needs (a TP 1 rank holds the most weights, a TP > 1 rank the TP
    // exchange's buffers): every rank on a GPU is checked against it.
    GpuMemoryNeed need;
    for (int tp : tp_sizes) {
        GpuMemoryNeed one = gpu_memory_need(rc.model, rc.gpu_model, pool_bytes, tp);
        if (tp > 1 && o.tp_exchange == kTpExchangeNccl) one.headroom_bytes += kNcclTpExchangeBytes;
        if (one.total() > need.total()) need = one;
    }
    std::map<int, GpuInfo> infos;
    for (const auto& [device, count] : per_device) {
        PDSIM_ASSIGN_OR_RETURN(GpuInfo info, probe.device_info(device));
        const auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
        if (need.total() * count > info.free_bytes) {
            return invalid_argument_error(fmt::format(
                "--kv-pool-mb {}: GPU {} ({}) has {:.0f} MiB free of {:.0f} MiB, and its {} "
                "rank{} need {:.0f} MiB{}: KV pool {:.0f} MiB + model weights {:.0f} MiB + "
                "workspace {:.0f} MiB + {:.0f} MiB for the attention and GEMM workspaces and the "
                "decode graphs{}; lower --kv-pool-mb (or --max-batch-tokens, or use a smaller "
                "--model)",
                o.kv_pool_mb, device, info.name, mib(info.free_bytes), mib(info.total_bytes), count,
                count == 1 ? "" : "s", mib(need.total() * count), count == 1 ? "" : " each",
                mib(need.kv_pool_bytes), mib(need.weight_bytes), mib(need.workspace_bytes),
                mib(need.headroom_bytes),
                o.tp_exchange == kTpExchangeNccl ? " (and NCCL's TP buffers)" : ""));
        }
        infos.emplace(device, std::move(info));
    }
    for (RankGpu& g : rc.gpus) g.info = infos.at(g.choice.device);
    return {};
}

// Every prefill rank and every decode rank on one topology node (any prefill instance may send to
// any decode instance); else kInvalidArgument naming the first pair that is not.
Status check_pd_ranks_on_one_node(const DataTransportQuery& q, std::string_view name) {
    const topo::Topology& t = *q.topology;
    const topo::RankMap map = t.rank_map();
    for (const topo::RankInfo& p : map.ranks()) {
        if (p.role != topo::Role::kPrefill) continue;
        for (const topo::RankInfo& d : map.ranks()) {
            if (d.role != topo::Role::kDecode || (p.node == d.node && p.node >= 0)) continue;
            auto node_name = [&](const topo::RankInfo& r) {
                return r.node >= 0 ? t.nodes[static_cast<size_t>(r.node)].id
                                   : std::string("no node");
            };
            return invalid_argument_error(fmt::format(
                "--data-transport {}: {}: prefill instance {} (rank {}, {}) and decode instance "
                "{} (rank {}, {}) are on different nodes, and {} connects only processes of "
                "one node (CUDA IPC handles open only there); put every prefill and decode "
                "instance on one node",
                name, q.topology_label, t.instances[static_cast<size_t>(p.instance)].id, p.rank,
                node_name(p), t.instances[static_cast<size_t>(d.instance)].id, d.rank, node_name(d),
                name));
        }
    }
    return {};
}

// No prefill rank on the GPU of a decode rank (two instances on one `shared` device), for a
// transport that declares one_rank_per_device (NCCL refuses two ranks of one communicator on one
// GPU); else kInvalidArgument naming the first such pair.
Status check_pd_ranks_on_distinct_gpus(const DataTransportQuery& q, std::string_view name) {
    const topo::Topology& t = *q.topology;
    const topo::RankMap map = t.rank_map();
    for (const topo::RankInfo& p : map.ranks()) {
        if (p.role != topo::Role::kPrefill || p.node < 0) continue;
        for (const topo::RankInfo& d : map.ranks()) {
            if (d.role != topo::Role::kDecode || d.node != p.node || d.device != p.device) continue;
            return invalid_argument_error(fmt::format(
                "--data-transport {}: {}: prefill instance {} (rank {}) and decode instance {} "
                "(rank {}) share GPU {}, and NCCL refuses two ranks of one communicator on one "
                "GPU; use --data-transport cuda_ipc (auto) or a topology with a GPU each",
                name, q.topology_label, t.instances[static_cast<size_t>(p.instance)].id, p.rank,
                t.instances[static_cast<size_t>(d.instance)].id, d.rank, p.device));
        }
    }
    return {};
}

}  // namespace

StatusOr<std::string> resolve_data_transport(const DataTransportQuery& q) {
    const bool disagg = q.mode != Mode::kColocated;
    const std::string none(kDataTransportNone);
    std::string name(q.requested);
    if (name == kDataTransportAuto) {
        if (!disagg || !q.gpu_ranks) return none;
        // cuda_ipc where every prefill and decode rank shares a node, nccl across nodes.
        name = check_pd_ranks_on_one_node(q, "cuda_ipc").ok() ? "cuda_ipc" : "nccl";
    }
    if (name == kDataTransportNone) {
        if (disagg && q.gpu_ranks) {
            StatusOr<transfer::TransportDescriptor> control = transfer::find_transport(q.control);
            if (control.ok() && !control->caps.device_memory) {
                return invalid_argument_error(fmt::format(
                    "--data-transport none: the KV would go over the control transport {}, which "
                    "moves host memory only, and GPU ranks' (--backend cuda) KV pools are device "
                    "memory; use --data-transport auto (cuda_ipc on one node, nccl across nodes)",
                    q.control));
            }
        }
        return none;
    }
    if (name != "cuda_ipc" && name != "nccl" && name != "local_writes") {
        return invalid_argument_error(
            fmt::format("--data-transport {}: expected auto, none, cuda_ipc, nccl or local_writes",
                        text::excerpt(name)));
    }
    StatusOr<transfer::TransportDescriptor> d = transfer::find_transport(name);
    if (!d.ok()) {
        return invalid_argument_error(
            fmt::format("--data-transport {}: {}", name, d.status().message()));
    }
    const transfer::StaticCapabilities& caps = d->caps;
    // The engine's planes for a separate data transport (transfer/engine/data_plane.h):
    // one-sided writes, or two-sided operations matched in post order (NCCL's; the ordered
    // plane). A two-sided tag-matching transport carries the KV as the control transport does.
    const bool ordered = caps.two_sided && !caps.tag_matching;
    if (!caps.one_sided_write && !ordered) {
        return invalid_argument_error(fmt::format(
            "--data-transport {}: it has neither one-sided writes (the engine's write plane) nor "
            "two-sided operations matched in post order (its ordered plane); a two-sided "
            "tag-matching transport carries the KV as the control transport "
            "(--data-transport none)",
            name));
    }
    if (q.gpu_ranks ? !caps.device_memory : !caps.host_memory) {
        return invalid_argument_error(fmt::format(
            "--data-transport {}: it moves {} memory only, and {} ranks' KV pools are {} memory; "
            "use --data-transport {}",
            name, caps.device_memory ? "GPU" : "host", q.gpu_ranks ? "GPU" : "CPU",
            q.gpu_ranks ? "device" : "host",
            q.gpu_ranks ? "cuda_ipc or nccl" : "none (the default) or local_writes"));
    }
    if (!disagg) return none;
    const int ranks = q.topology->num_ranks();
    if (q.world_size > 1 && !caps.spans_processes) {
        return invalid_argument_error(fmt::format(
            "--data-transport {}: its ranks are threads of one process; launch pdsim without "
            "mpirun",
            name));
    }
    if (q.world_size <= 1 && ranks > 1 && !caps.threads_of_one_process) {
        return invalid_argument_error(fmt::format(
            "--data-transport {}: it needs one process per rank; run pdsim under mpirun -np {}",
            name, ranks));
    }
    // Where its ranks may be, as it declares (transfer/transport.h StaticCapabilities).
    if (!caps.spans_nodes) PDSIM_RETURN_IF_ERROR(check_pd_ranks_on_one_node(q, name));
    if (caps.one_rank_per_device) {
        PDSIM_RETURN_IF_ERROR(check_pd_ranks_on_distinct_gpus(q, name));
    }
    return name;
}

namespace {

// Why NCCL cannot carry the TP exchange of `t` ("" when it can; see resolve_tp_exchange).
std::string why_no_nccl_tp_exchange(const TpExchangeQuery& q) {
    const topo::Topology& t = *q.topology;
    const topo::RankMap map = t.rank_map();
    // The first TP > 1 rank on each (node, GPU): a second one on it is a second member of one
    // communicator (same instance) or a second communicator (another instance).
    std::map<std::pair<int, std::string>, const topo::RankInfo*> holder;
    for (const topo::RankInfo& r : map.ranks()) {
        const topo::Instance& inst = t.instances[static_cast<size_t>(r.instance)];
        if (inst.tp <= 1) continue;
        const topo::Device* device = t.find_device(r.device);
        if (device == nullptr || device->is_cpu()) {
            return fmt::format(
                "{}: instance {} runs on {} devices, so which GPU each rank takes is not known "
                "before it runs; use a GPU topology",
                q.topology_label, inst.id, device == nullptr ? "unnamed" : "cpu");
        }
        const auto [it, first] = holder.emplace(std::make_pair(r.node, r.device), &r);
        if (first) continue;
        const topo::RankInfo& other = *it->second;
        if (other.instance == r.instance) {
            return fmt::format(
                "{}: instance {} has ranks {} and {} on GPU {}, and NCCL refuses two ranks of one "
                "communicator on one GPU",
                q.topology_label, inst.id, other.rank, r.rank, r.device);
        }
        return fmt::format(
            "{}: instances {} and {} (tp > 1 both) share GPU {}, and NCCL does not allow "
            "operations on two communicators of one GPU from two threads at once",
            q.topology_label, t.instances[static_cast<size_t>(other.instance)].id, inst.id,
            r.device);
    }
    if (q.data_transport == "nccl") {
        return "the KV goes over --data-transport nccl, whose communicators on the same GPUs are "
               "driven from another thread, and NCCL does not allow operations on two "
               "communicators of one GPU from two threads at once (a per-GPU issue lock is not "
               "built)";
    }
    if (!q.nccl_built) return "this pdsim was built without NCCL";
    return "";
}

}  // namespace

StatusOr<std::string> resolve_tp_exchange(const TpExchangeQuery& q) {
    const std::string requested(q.requested);
    if (q.requested != kTpExchangeAuto && q.requested != kTpExchangeHost &&
        q.requested != kTpExchangeNccl) {
        return invalid_argument_error(
            fmt::format("--tp-exchange {}: expected auto, host or nccl", text::excerpt(requested)));
    }
    const bool nccl = q.requested == kTpExchangeNccl;
    if (nccl && !q.gpu_ranks) {
        return invalid_argument_error(
            "--tp-exchange nccl: GPU ranks only (--backend cuda); CPU ranks exchange their TP "
            "partials on the host");
    }
    const auto& instances = q.topology->instances;
    if (std::none_of(instances.begin(), instances.end(),
                     [](const topo::Instance& inst) { return inst.tp > 1; })) {
        if (nccl) {
            return invalid_argument_error(fmt::format(
                "--tp-exchange nccl: no instance of {} has tp > 1 (nothing to exchange)",
                q.topology_label));
        }
        return std::string(kTpExchangeNone);
    }
    if (!q.gpu_ranks || q.requested == kTpExchangeHost) return std::string(kTpExchangeHost);
    const std::string why_not = why_no_nccl_tp_exchange(q);
    if (nccl && !why_not.empty()) {
        return invalid_argument_error(
            fmt::format("--tp-exchange nccl: {}; use --tp-exchange host (auto)", why_not));
    }
    return std::string(why_not.empty() ? kTpExchangeNccl : kTpExchangeHost);
}

const RankGpu* ResolvedConfig::gpu_of(int rank) const {
    for (const RankGpu& g : gpus) {
        if (g.rank == rank) return &g;
    }
    return nullptr;
}

int64_t kv_page_bytes(const model::ModelConfig& m, int tp, int page_size, runtime::DType dtype) {
    const int64_t hkv = m.num_kv_heads / std::max(1, tp);
    // A hybrid model's attention layers (full and sliding: each has a pool of this many pages,
    // rank_builder.h); its recurrent layers keep states, not KV pages.
    const int64_t layers = std::max(1, m.num_layers - m.count_layers(model::LayerKind::kRecurrent));
    return layers * 2 * hkv * m.head_dim * static_cast<int64_t>(runtime::dtype_size(dtype)) *
           page_size;
}

int64_t kv_pool_pages(const model::ModelConfig& m, int tp, int page_size, int64_t kv_pool_mb,
                      runtime::DType dtype) {
    const int64_t page_bytes = std::max<int64_t>(1, kv_page_bytes(m, tp, page_size, dtype));
    const int64_t pages = std::max<int64_t>(2, (kv_pool_mb << 20) / page_bytes + 1);
    return std::min<int64_t>(pages, int64_t{1} << 24);
}

std::string_view mode_name(Mode mode) {
    switch (mode) {
        case Mode::kDisagg:
            return "disagg";
        case Mode::kColocated:
            return "colocated";
        case Mode::kBoth:
            return "both";
    }
    return "?";
}

StatusOr<Mode> parse_mode(std::string_view text) {
    if (text == "disagg") return Mode::kDisagg;
    if (text == "colocated") return Mode::kColocated;
    if (text == "both") return Mode::kBoth;
    return invalid_argument_error(
        fmt::format("--mode {}: expected disagg, colocated or both", text));
}

std::string_view fault_name(Fault fault) {
    switch (fault) {
        case Fault::kNone:
            return "none";
        case Fault::kRecordBeforeWrite:
            return "record-before-write";
        case Fault::kSkipRecord:
            return "skip-record";
        case Fault::kDoubleRecord:
            return "double-record";
        case Fault::kStaleGraphMetadata:
            return "stale-graph-metadata";
        case Fault::kFreeBeforeTransfer:
            return "free-before-transfer";
        case Fault::kLateWrite:
            return "late-write";
        case Fault::kHybridDoubleRecord:
            return "hybrid-double-record";
        case Fault::kStateNotSent:
            return "state-not-sent";
        case Fault::kStateTpMisslice:
            return "state-tp-misslice";
        case Fault::kWindowFreeInFlight:
            return "window-free-in-flight";
    }
    return "?";
}

std::optional<topo::LayerKind> fault_needs_layers(Fault fault) {
    switch (fault) {
        case Fault::kHybridDoubleRecord:
        case Fault::kStateNotSent:
        case Fault::kStateTpMisslice:
            return topo::LayerKind::kRecurrent;
        case Fault::kWindowFreeInFlight:
            return topo::LayerKind::kSlidingWindow;
        default:
            return std::nullopt;
    }
}

std::vector<std::string> fault_names() {
    return {"none",
            "record-before-write",
            "skip-record",
            "double-record",
            "stale-graph-metadata",
            "free-before-transfer",
            "late-write",
            "hybrid-double-record",
            "state-not-sent",
            "state-tp-misslice"};
}

StatusOr<Fault> parse_fault(std::string_view text) {
    for (Fault f : {Fault::kNone, Fault::kRecordBeforeWrite, Fault::kSkipRecord,
                    Fault::kDoubleRecord, Fault::kStaleGraphMetadata, Fault::kFreeBeforeTransfer,
                    Fault::kLateWrite, Fault::kHybridDoubleRecord, Fault::kStateNotSent,
                    Fault::kStateTpMisslice, Fault::kWindowFreeInFlight}) {
        if (fault_name(f) == text) return f;
    }
    std::string known;
    for (const auto& n : fault_names()) known += (known.empty() ? "" : ", ") + n;
    return invalid_argument_error(
        fmt::format("--fault {}: unknown fault kind (known: {})", text, known));
}

StatusOr<std::string> find_trace_dir() {
    return data::find_data_dir(data::DataKind::kTraces);
}

std::string find_default_topology() {
    auto path = data::find_data_file(data::DataKind::kTopologies, "cpu-1p1d.yaml");
    return path.ok() ? *path : std::string();
}

std::string_view embedded_default_topology() {
    return kEmbeddedCpu1p1d;
}

StatusOr<ResolvedConfig> resolve(const TestbedOptions& options, int world_size) {
    return resolve(options, ResolveEnv{.world_size = world_size});
}

StatusOr<ResolvedConfig> resolve(const TestbedOptions& in, const ResolveEnv& env) {
    const int world_size = env.world_size;
    ResolvedConfig rc;
    rc.options = in;
    TestbedOptions& o = rc.options;

    // ---- flags that stand alone ----
    PDSIM_RETURN_IF_ERROR(check_ranges(o));
    if (o.synthetic > 0 && !o.trace.empty())
        return invalid_argument_error("--trace and --synthetic are exclusive");
    const bool cuda = o.backend == kCudaBackend;
    if (o.backend != "cpu" && o.backend != "cpu_ref" && !cuda) {
        return invalid_argument_error(
            fmt::format("--backend {}: the testbed runs the `cpu` or `cpu_ref` attention "
                        "backend (CPU ranks, KV pools in host memory) or `cuda` (GPU ranks)",
                        o.backend));
    }
    const GpuProbe& probe = env.gpus != nullptr ? *env.gpus : system_gpu_probe();
    if (cuda) {
        if (std::string why = probe.build_problem(); !why.empty()) {
            return invalid_argument_error("--backend cuda: " + why);
        }
        if (o.shaping == "topology") {
            return invalid_argument_error(
                "--shaping topology: not with --backend cuda: a topology's shaping keeps a CPU "
                "run's compute:transfer ratio (time_scale), and a GPU computes at its own speed; "
                "give the link as --shaping GBPS[:LATENCY_US] (e.g. 50 for one 400 Gb/s NIC)");
        }
        if (o.fault == Fault::kStaleGraphMetadata) {
            // On GPU ranks the fault is planted in the decode CUDA graphs' replays (the decode
            // instances' metadata refresh is skipped): the KV is right and only the tokens are
            // wrong, which nothing but the comparison with the colocated run sees.
            if (!o.decode_graphs) {
                return invalid_argument_error(
                    "--fault stale-graph-metadata: on GPU ranks it is planted in the decode CUDA "
                    "graphs' replays, and --decode-graphs off replays none; use --decode-graphs "
                    "on");
            }
            if (o.mode != Mode::kBoth) {
                return invalid_argument_error(fmt::format(
                    "--fault stale-graph-metadata: with --backend cuda the stale decode replays "
                    "compute wrong tokens from the right KV, which only the comparison with the "
                    "colocated run catches; use --mode both (not {})",
                    mode_name(o.mode)));
            }
        }
    }
    // Transport name: known to the registry, and usable with host-memory KV pools.
    transfer::StaticCapabilities transport_caps;  // of o.transport, once it is known
    if (!o.transport.empty()) {
        StatusOr<transfer::TransportDescriptor> descriptor = transfer::find_transport(o.transport);
        if (!descriptor.ok()) {
            std::string known;
            for (const auto& n : transfer::registered_transports()) {
                known += (known.empty() ? "" : ", ") + n;
            }
            return invalid_argument_error(fmt::format(
                "--transport {}: unknown transport (available: {})", o.transport, known));
        }
        transport_caps = descriptor->caps;
        if (!transport_caps.host_memory && cuda) {
            return invalid_argument_error(fmt::format(
                "--transport {}: --transport is the control transport (the engine's messages: "
                "two-sided and tag-matching in host memory: local, mpi or tcp); GPU ranks' KV goes "
                "over --data-transport (cuda_ipc or nccl)",
                o.transport));
        }
        if (!transport_caps.host_memory) {
            return invalid_argument_error(
                fmt::format("--transport {}: moves GPU memory only, and CPU ranks' KV pools "
                            "are host memory; use mpi or tcp (GPU ranks, --backend cuda, move "
                            "their KV over --data-transport cuda_ipc or nccl)",
                            o.transport));
        }
        if (transport_caps.decorator) {
            return invalid_argument_error(
                fmt::format("--transport {}: use --transport-fault SPEC with mpi/tcp/local instead",
                            o.transport));
        }
    }
    if (o.shaping != "off") {
        if (o.shaping == "topology") {
            // Filled in below, once the topology is loaded.
        } else {
            const size_t colon = o.shaping.find(':');
            char* end = nullptr;
            const std::string g = o.shaping.substr(0, colon);
            rc.shape_gbps = std::strtod(g.c_str(), &end);
            bool ok = end != nullptr && *end == '\0' && !g.empty() && rc.shape_gbps > 0 &&
                      std::isfinite(rc.shape_gbps);
            if (colon != std::string::npos) {
                const std::string l = o.shaping.substr(colon + 1);
                rc.shape_latency_us = std::strtod(l.c_str(), &end);
                ok = ok && end != nullptr && *end == '\0' && !l.empty() && rc.shape_latency_us >= 0;
            }
            if (!ok) {
                return invalid_argument_error(fmt::format(
                    "--shaping {}: expected off, topology or GBPS[:LATENCY_US] (e.g. 0.5:20)",
                    o.shaping));
            }
            rc.shape = true;
            rc.shape_time_scale = 1;
        }
    }
    if (!o.tcp_interface.empty()) {
        if (o.transport != "tcp") {
            return invalid_argument_error(fmt::format(
                "--tcp-interface {}: only with --transport tcp", excerpt(o.tcp_interface)));
        }
        // This rank's host must have it (the others check theirs when they listen).
        StatusOr<std::string> addr = net::interface_ipv4(o.tcp_interface);
        if (!addr.ok()) {
            return invalid_argument_error(
                fmt::format("--tcp-interface: {}", addr.status().message()));
        }
    }
    if (!o.transport_fault.empty()) {
        auto names = transfer::registered_transports();
        if (std::find(names.begin(), names.end(), "fault") == names.end()) {
            return invalid_argument_error("--transport-fault: the fault transport is not built");
        }
        StatusOr<transfer::FaultSpec> spec = transfer::parse_fault_spec(o.transport_fault);
        if (!spec.ok()) {
            return invalid_argument_error(fmt::format(
                "--transport-fault {}: {}", excerpt(o.transport_fault), spec.status().message()));
        }
    }

    // ---- model ----
    // ---- topology ----
    topo::LoadOptions lo;
    std::string topo_path = o.topology;
    std::optional<model::ModelConfig> model_cfg;
    if (!o.model.empty()) {
        auto m = model::resolve_model(o.model);
        if (!m.ok())
            return invalid_argument_error(
                fmt::format("--model {}: {}", o.model, m.status().message()));
        model_cfg = *m;
    }
    auto apply_layers = [&](model::ModelConfig& m) -> Status {
        if (o.layers > 0) m.num_layers = o.layers;
        return model::validate_model(m).with_context("--model");
    };
    topo::ModelShape shape;
    if (model_cfg) {
        PDSIM_RETURN_IF_ERROR(apply_layers(*model_cfg));
        shape = model::to_model_shape(*model_cfg);
        lo.model = &shape;
    }
    if (topo_path.empty()) {
        topo_path = find_default_topology();
        if (topo_path.empty()) {
            PDSIM_ASSIGN_OR_RETURN(
                rc.topology, topo::parse_topology(embedded_default_topology(),
                                                  "<built-in cpu-1p1d>", topo::Format::kYaml, lo));
            rc.topology_label = "cpu-1p1d (built-in)";
        }
    }
    if (!topo_path.empty()) {
        // The file to read: a bare name (`cpu-1p1d`) is a shipped topology, and the report records
        // that file, so that `simulate --like` of it finds the same one from any directory.
        const std::string read = data::resolve_data_file(data::DataKind::kTopologies, topo_path);
        PDSIM_ASSIGN_OR_RETURN(rc.topology, topo::load_topology(read, lo));
        rc.topology_label = fs::path(topo_path).filename().string();
        std::error_code ec;
        const fs::path absolute = fs::absolute(read, ec);
        rc.topology_file = ec ? read : absolute.lexically_normal().string();
    }
    rc.model_source = o.model;
    if (std::error_code ec; !o.model.empty() && fs::is_regular_file(o.model, ec)) {
        const fs::path absolute = fs::absolute(o.model, ec);
        if (!ec) rc.model_source = absolute.lexically_normal().string();
    }
    if (!model_cfg) {
        // The topology's model section, whole (its overrides of a built-in included), else tiny.
        auto m = rc.topology.model ? model::model_from_shape(*rc.topology.model)
                                   : model::resolve_model("tiny");
        if (!m.ok()) {
            return invalid_argument_error(
                fmt::format("{}: model: the synthetic model cannot run it ({}); pass "
                            "--model NAME|F",
                            rc.topology_label, m.status().message()));
        }
        model_cfg = *m;
        PDSIM_RETURN_IF_ERROR(apply_layers(*model_cfg));
        // Re-validate TP against the model actually run (e.g. with --layers).
        shape = model::to_model_shape(*model_cfg);
        PDSIM_RETURN_IF_ERROR(topo::validate(rc.topology, &shape));
    }
    rc.model = *model_cfg;
    const bool recurrent = rc.model.count_layers(model::LayerKind::kRecurrent) > 0;
    if (const auto kind = fault_needs_layers(o.fault); kind && rc.model.count_layers(*kind) == 0) {
        return invalid_argument_error(
            fmt::format("--fault {}: model {} has no {} layers (use a hybrid model with them, "
                        "e.g. --model hybrid-tiny)",
                        fault_name(o.fault), rc.model.name, topo::layer_kind_name(*kind)));
    }
    if (rc.model.count_layers(model::LayerKind::kFullAttention) == 0 &&
        rc.model.count_layers(model::LayerKind::kFullAttention) != rc.model.num_layers &&
        o.mode != Mode::kColocated) {
        return invalid_argument_error(fmt::format(
            "--model {}: a hybrid model needs full-attention layers to run disaggregated (the KV "
            "engine carries them and the first token); use --mode colocated",
            rc.model.name));
    }
    if (recurrent && cuda) {
        return invalid_argument_error(
            fmt::format("--backend cuda: model {} has recurrent layers, which run on CPU ranks "
                        "only",
                        rc.model.name));
    }
    for (const auto& inst : rc.topology.instances) {
        if (Status st = model::check_tp(rc.model, inst.tp); !st.ok()) {
            return invalid_argument_error(
                fmt::format("{}: instance {}: tp {}", rc.topology_label, inst.id, st.message()));
        }
    }
    for (const auto& node : rc.topology.nodes) {
        for (const auto& d : node.devices) {
            if (!d.is_cpu() && !cuda) {
                return invalid_argument_error(fmt::format(
                    "{}: device {} is a {} GPU; CPU ranks (--backend {}) run on `cpu` devices "
                    "(a GPU topology is for `pdsim simulate` or `--backend cuda --mode "
                    "colocated`, or use a cpu-* topology with a `shaping` section to emulate its "
                    "links)",
                    rc.topology_label, d.id, d.type, o.backend));
            }
        }
    }
    bool colocated_topology = !rc.topology.instances.empty();
    for (const auto& inst : rc.topology.instances) {
        colocated_topology = colocated_topology && inst.role == topo::Role::kColocated;
    }
    if (colocated_topology && o.mode != Mode::kColocated) {
        return invalid_argument_error(
            fmt::format("--mode {}: topology {} has colocated instances only (no prefill or "
                        "decode instance to disaggregate); pass --mode colocated",
                        mode_name(o.mode), rc.topology_label));
    }
    if (cuda) PDSIM_RETURN_IF_ERROR(check_gpu_model(rc));

    if (o.shaping == "topology") {
        if (!rc.topology.shaping) {
            return invalid_argument_error(
                fmt::format("--shaping topology: {} has no `shaping` section", rc.topology_label));
        }
        const topo::ShapingSpec& sp = *rc.topology.shaping;
        rc.shape = true;
        rc.shape_gbps = sp.gbps;
        rc.shape_latency_us = sp.latency_us;
        rc.shape_time_scale = sp.time_scale;
        rc.shape_gpu = sp.gpu;
        if (sp.time_scale <= 0 && topo::gpu_spec(sp.gpu) == nullptr) {
            return invalid_argument_error(fmt::format(
                "--shaping topology: {}: shaping.time_scale auto needs shaping.gpu (a GPU "
                "model) to measure against",
                rc.topology_label));
        }
    }

    // ---- process model vs the launcher ----
    const int ranks = rc.topology.num_ranks();
    if (world_size > 1) {
        if (world_size != ranks) {
            return invalid_argument_error(
                fmt::format("mpirun -np {} but topology {} has {} ranks (run mpirun -np {})",
                            world_size, rc.topology_label, ranks, ranks));
        }
        if (!o.transport.empty() && !transport_caps.spans_processes) {
            return invalid_argument_error(
                fmt::format("--transport {} runs every rank as a thread of one process; "
                            "launch pdsim without mpirun (or with -np 1), not with -np {}",
                            o.transport, world_size));
        }
        if (o.transport.empty()) o.transport = "mpi";
    } else {
        // One process: every rank is a thread over the in-process world (local).
        if (ranks > 1 && !o.transport.empty() &&
            transport_caps.setup != transfer::TransportSetup::kSharedWorld) {
            return invalid_argument_error(
                fmt::format("--transport {} needs one process per rank: topology {} has {} ranks "
                            "but pdsim runs as 1 process (run it under mpirun -np {}, or use "
                            "--transport local to run every rank as a thread of this process)",
                            o.transport, rc.topology_label, ranks, ranks));
        }
        o.transport = "local";
    }

    if (o.transport_fault_rank >= ranks) {
        return invalid_argument_error(
            fmt::format("--transport-fault-rank {}: topology {} has ranks 0..{}",
                        o.transport_fault_rank, rc.topology_label, ranks - 1));
    }
    PDSIM_RETURN_IF_ERROR(check_tcp_environment(o.transport, ranks));
    PDSIM_ASSIGN_OR_RETURN(o.data_transport,
                           resolve_data_transport({.requested = o.data_transport,
                                                   .mode = o.mode,
                                                   .gpu_ranks = cuda,
                                                   .control = o.transport,
                                                   .world_size = world_size,
                                                   .topology = &rc.topology,
                                                   .topology_label = rc.topology_label}));
    PDSIM_ASSIGN_OR_RETURN(o.tp_exchange,
                           resolve_tp_exchange({.requested = o.tp_exchange,
                                                .gpu_ranks = cuda,
                                                .nccl_built = transfer::nccl_tp_comm_built(),
                                                .data_transport = o.data_transport,
                                                .topology = &rc.topology,
                                                .topology_label = rc.topology_label}));

    // ---- workload ----
    workload::LoadOptions wl;
    wl.max_input_len = o.max_input_len;
    wl.max_output_len = o.max_output_len;
    wl.max_requests = o.max_requests;
    wl.sample = o.sample;
    wl.seed = o.seed;
    wl.time_scale = 1.0;  // scaled below (auto needs the unscaled duration)
    if (o.synthetic > 0) {
        workload::SyntheticOptions so;
        so.num_requests = o.synthetic;
        so.rate_rps = 4.0;
        so.input = workload::LengthDist{workload::LengthDist::Kind::kUniform, 64, 1024};
        so.output = workload::LengthDist{workload::LengthDist::Kind::kUniform, 4, 64};
        so.seed = o.seed;
        PDSIM_ASSIGN_OR_RETURN(rc.requests, workload::make_synthetic(so));
        for (auto& r : rc.requests) {
            if (o.max_input_len > 0) r.input_len = std::min(r.input_len, o.max_input_len);
            if (o.max_output_len > 0) r.output_len = std::min(r.output_len, o.max_output_len);
        }
        rc.workload_label = fmt::format("synthetic {}", o.synthetic);
    } else {
        std::string path = o.trace;
        if (path.empty()) {
            PDSIM_ASSIGN_OR_RETURN(std::string dir, find_trace_dir());
            path = (fs::path(dir) / "mooncake_conversation.jsonl").string();
            if (o.max_requests == 0 && o.sample == 0) {
                wl.sample = 16;
                o.sample = 16;
            }
        }
        PDSIM_ASSIGN_OR_RETURN(workload::TraceFormat fmt_kind,
                               workload::parse_trace_format(o.trace_format));
        PDSIM_ASSIGN_OR_RETURN(rc.requests, workload::load_trace(path, fmt_kind, wl));
        rc.workload_label = fs::path(path).filename().string();
        if (o.sample > 0)
            rc.workload_label += fmt::format(" (sample {}, seed {})", o.sample, o.seed);
        if (o.max_requests > 0) rc.workload_label += fmt::format(" (first {})", o.max_requests);
    }
    if (rc.requests.empty()) return invalid_argument_error("the workload has no requests");
    for (auto& r : rc.requests) {
        r.input_len = std::max(r.input_len, 1);
        r.output_len = std::max(r.output_len, 1);
    }
    const double first = rc.requests.front().arrival_ms;
    for (auto& r : rc.requests) r.arrival_ms -= first;
    rc.trace_duration_ms = rc.requests.back().arrival_ms;
    if (o.time_scale == 0) {
        int prefill_instances = 0;
        for (const auto& inst : rc.topology.instances)
            prefill_instances += inst.role == topo::Role::kPrefill;
        if (o.mode == Mode::kColocated)
            prefill_instances = static_cast<int>(rc.topology.instances.size());
        double tokens = 0;
        for (const auto& r : rc.requests) tokens += r.input_len;
        const double target_ms = tokens * kAutoMsPerInputToken / std::max(1, prefill_instances);
        o.time_scale =
            rc.trace_duration_ms > 0 ? std::min(1.0, target_ms / rc.trace_duration_ms) : 1.0;
    }
    for (auto& r : rc.requests) r.arrival_ms *= o.time_scale;
    if (cuda) PDSIM_RETURN_IF_ERROR(plan_gpus(rc, env, probe));
    return rc;
}

std::string describe(const TestbedOptions& o) {
    return fmt::format(
        "--mode {} --layerwise {} --transport {} --data-transport {} --backend {}{} --fault {} "
        "--chunk-size {} --max-batch-tokens {} --time-scale {:.6g} --max-input-len {} "
        "--max-output-len {}",
        mode_name(o.mode), o.layerwise ? "on" : "off", o.transport, o.data_transport, o.backend,
        o.backend == kCudaBackend
            ? fmt::format(" --decode-graphs {} --device-gate {} --tp-exchange {}",
                          o.decode_graphs ? "on" : "off", o.device_gate ? "on" : "off",
                          o.tp_exchange)
            : fmt::format(" --stream-sync {}", o.stream_caller_runs ? "caller" : "worker"),
        fault_name(o.fault), o.chunk_size, o.max_batch_tokens, o.time_scale, o.max_input_len,
        o.max_output_len);
}

}  // namespace pdsim::testbed
