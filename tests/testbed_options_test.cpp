// testbed::resolve's checks of options and environment, before any rank runs (docs/inputs.md
// "Flags and environment"): the ranges of TestbedLimits, the --transport-fault spec and rank, and
// PDSIM_TCP_ENDPOINTS for the tcp transport, so that --mode both fails before its first phase.
// GPU ranks (--backend cuda, docs/testbed.md "GPU rank"), against a fake GPU probe: a build
// without CUDA, no GPU, shaping, TP > 1, models the GPU model or the cuda attention backend cannot
// run, faults a device stream cannot carry, the KV pool against each GPU's free memory (two ranks
// on one GPU in gpu-1p1d); which GPU each rank gets (choose_gpu; gpu-1p1d, gpu-2g-1p1d, several
// nodes); the KV data transport (--data-transport: auto, none, cuda_ipc and what each refuses);
// and that CPU runs resolve as before.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "sim/testbed/gpu_plan.h"
#include "sim/testbed/options.h"
#include "tests/status_matchers.h"
#include "topology/builders.h"
#include "topology/loader.h"
#include "transfer/nccl/nccl_tp_comm.h"

namespace pdsim::testbed {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Sets an environment variable for one scope.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
    ~ScopedEnv() { ::unsetenv(name_); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    const char* name_;
};

TEST(TestbedOptions, SessionTokenIsCheckedAtTheEdge) {
    const TestbedOptions tcp{.transport = "tcp", .mode = Mode::kBoth};
    {
        ScopedEnv env("PDSIM_SESSION_TOKEN", "short");
        EXPECT_THAT(resolve(tcp, 2), StatusIs(StatusCode::kInvalidArgument,
                                              HasSubstr("PDSIM_SESSION_TOKEN: 5 characters")));
        // Only a rendezvous transport reads it.
        const TestbedOptions mpi{.transport = "mpi", .mode = Mode::kBoth};
        EXPECT_THAT(resolve(mpi, 2).status().message(), Not(HasSubstr("PDSIM_SESSION_TOKEN")));
    }
    {
        ScopedEnv env("PDSIM_SESSION_TOKEN", "0123456789abcdef");
        EXPECT_THAT(resolve(tcp, 2).status().message(), Not(HasSubstr("PDSIM_SESSION_TOKEN")));
    }
}

TEST(TestbedOptions, TcpEndpointsCheckedBeforeAnyPhase) {
    const TestbedOptions tcp{.transport = "tcp", .mode = Mode::kBoth};
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500,nohostport");
        EXPECT_THAT(resolve(tcp, 2),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("PDSIM_TCP_ENDPOINTS")));
    }
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500");
        EXPECT_THAT(resolve(tcp, 2),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("1 endpoints")));
    }
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500,127.0.0.1:29501");
        EXPECT_THAT(resolve(tcp, 2).status().message(), Not(HasSubstr("PDSIM_TCP_ENDPOINTS")));
    }
}

TEST(TestbedOptions, TransportFaultSpecAndRank) {
    EXPECT_THAT(resolve(TestbedOptions{.transport_fault = "delay"}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--transport-fault delay")));
    EXPECT_THAT(
        resolve(TestbedOptions{.transport_fault = "drop:p=0", .transport_fault_rank = 2}, 1),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("--transport-fault-rank 2")));
}

// --tcp-interface: only with tcp, and an interface this host has (loopback "lo" always has
// 127.0.0.1); a missing one is named with the host's interfaces, before any phase.
// config.topology_file is the file that was read, so that `simulate --like` of the report finds it
// from any directory: a bare name is the shipped topology's path, not the working directory's.
TEST(TestbedOptions, TopologyFileIsTheFileThatWasRead) {
    const auto by_name = resolve(TestbedOptions{.topology = "cpu-1p1d", .synthetic = 2}, 2);
    ASSERT_OK(by_name.status());
    const std::filesystem::path file(by_name->topology_file);
    EXPECT_TRUE(file.is_absolute()) << file;
    EXPECT_EQ(file.filename(), "cpu-1p1d.yaml");
    EXPECT_TRUE(std::filesystem::is_regular_file(file)) << file;
    ASSERT_OK(topo::load_topology(file.string()).status());
    EXPECT_EQ(topo::load_topology(file.string())->name, by_name->topology.name);

    // A path is kept as given, made absolute.
    const auto by_path = resolve(TestbedOptions{.topology = file.string(), .synthetic = 2}, 2);
    ASSERT_OK(by_path.status());
    EXPECT_EQ(by_path->topology_file, file.lexically_normal().string());
}

TEST(TestbedOptions, TcpInterfaceIsCheckedAtTheEdge) {
    TestbedOptions o{.synthetic = 2};
    o.tcp_interface = "lo";
    EXPECT_THAT(resolve(o, 1),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tcp-interface lo: only with --transport tcp")));
    o.transport = "tcp";
    EXPECT_OK(resolve(o, 2));
    o.tcp_interface = "pdsim-no-such0";
    EXPECT_THAT(resolve(o, 2), StatusIs(StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("--tcp-interface: no interface "
                                                        "'pdsim-no-such0'"),
                                              HasSubstr("have: "), HasSubstr("lo"))));
}

TEST(TestbedOptions, RangesOfTestbedLimits) {
    EXPECT_THAT(resolve(TestbedOptions{.threads = 100000}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--threads 100000")));
    EXPECT_THAT(resolve(TestbedOptions{.request_timeout_s = 1e10}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--request-timeout-s")));
    EXPECT_THAT(resolve(TestbedOptions{.max_batch_tokens = 2147483647}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--max-batch-tokens")));
    EXPECT_THAT(resolve(TestbedOptions{.synthetic = 2147483647}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--synthetic")));
    TestbedOptions o{.synthetic = 2};
    for (double bad : {-1.0, 1.0, 1e9}) {
        o.heartbeat_timeout_s = bad;
        EXPECT_THAT(resolve(o, 1),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("--heartbeat-timeout-s")))
            << bad;
    }
    for (double good : {0.0, 2.0, 30.0}) {
        o.heartbeat_timeout_s = good;
        EXPECT_OK(resolve(o, 1)) << good;
    }
    o.heartbeat_timeout_s = 5;
    for (int64_t bad : {int64_t{-1}, int64_t{1'000'001}}) {
        o.max_inflight_per_instance = bad;
        EXPECT_THAT(resolve(o, 1), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr("--max-inflight-per-instance")))
            << bad;
    }
    for (int64_t good : {int64_t{0}, int64_t{1}, int64_t{1'000'000}}) {
        o.max_inflight_per_instance = good;
        EXPECT_OK(resolve(o, 1)) << good;
    }
    o.max_inflight_per_instance = 0;
    for (int bad : {-1, 1, 9, 60'001}) {
        o.speed_probe_ms = bad;
        EXPECT_THAT(resolve(o, 1), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr(fmt::format("--speed-probe-ms {}", bad))))
            << bad;
    }
    for (int good : {0, 10, 250, 60'000}) {
        o.speed_probe_ms = good;
        EXPECT_OK(resolve(o, 1)) << good;
    }
}

// ---- GPU ranks --------------------------------------------------------------------------------

const std::string kExamples = std::string(PDSIM_SOURCE_DIR) + "/topology/examples/";

// This host's GPUs as a test wants them.
class FakeGpus final : public GpuProbe {
public:
    std::string problem;  // build_problem()
    int count = 1;        // 0: no device
    int64_t total_bytes = int64_t{141} << 30;
    int64_t free_bytes = int64_t{139} << 30;
    mutable std::vector<int> asked;  // device_info's arguments

    [[nodiscard]] std::string build_problem() const override { return problem; }
    [[nodiscard]] StatusOr<int> device_count() const override {
        if (count == 0) return Status(StatusCode::kUnavailable, "no device: no CUDA GPU visible");
        return count;
    }
    [[nodiscard]] StatusOr<GpuInfo> device_info(int device) const override {
        asked.push_back(device);
        return GpuInfo{.device = device,
                       .name = "Fake H200 " + std::to_string(device),
                       .total_bytes = total_bytes,
                       .free_bytes = free_bytes};
    }
};

// --backend cuda --mode colocated on `topology` with 4 small synthetic requests.
TestbedOptions gpu_options(const std::string& topology = kExamples + "gpu-1c.yaml") {
    return TestbedOptions{.topology = topology,
                          .synthetic = 4,
                          .max_input_len = 128,
                          .max_output_len = 8,
                          .backend = "cuda",
                          .mode = Mode::kColocated,
                          .kv_pool_mb = 64};
}

StatusOr<ResolvedConfig> resolve_on(const TestbedOptions& o, const FakeGpus& gpus,
                                    int world_size = 1, int rank = 0, int local_rank = 0,
                                    int local_size = 0) {
    return resolve(o, ResolveEnv{.world_size = world_size,
                                 .rank = rank,
                                 .local_rank = local_rank,
                                 .local_size = local_size > 0 ? local_size : world_size,
                                 .gpus = &gpus});
}

// A file with `body`, removed at the end of the scope.
class TempFile {
public:
    TempFile(const std::string& tag, const std::string& body)
        : path_(std::filesystem::temp_directory_path() /
                ("pdsim_testbed_options_" + tag + "_" + std::to_string(::getpid()) + ".yaml")) {
        std::ofstream(path_) << body;
    }
    ~TempFile() { std::filesystem::remove(path_); }
    TempFile(const TempFile&) = delete;
    TempFile& operator=(const TempFile&) = delete;
    [[nodiscard]] std::string path() const { return path_.string(); }

private:
    std::filesystem::path path_;
};

TEST(TestbedGpuOptions, RunsOnAFakeGpu) {
    FakeGpus gpus;
    auto rc = resolve_on(gpu_options(), gpus);
    ASSERT_OK(rc);
    EXPECT_TRUE(rc->gpu_ranks());
    ASSERT_EQ(rc->gpus.size(), 1u);
    EXPECT_EQ(rc->gpus[0].rank, 0);
    EXPECT_EQ(rc->gpus[0].choice.device, 0);
    EXPECT_TRUE(rc->gpus[0].choice.from_topology);
    EXPECT_EQ(rc->gpus[0].info.name, "Fake H200 0");
    EXPECT_EQ(gpus.asked, (std::vector<int>{0}));
    // The GPU model holds the run's batches and sequences.
    int64_t longest = 0;
    for (const auto& r : rc->requests)
        longest = std::max<int64_t>(longest, r.input_len + r.output_len);
    EXPECT_GE(rc->gpu_model.max_positions, longest);
    EXPECT_GE(rc->gpu_model.max_tokens, rc->options.max_batch_tokens);
    EXPECT_GE(rc->gpu_model.max_bs, rc->options.max_decode_batch);
    EXPECT_GE(rc->gpu_model.max_bs, static_cast<int>(rc->requests.size()));
    EXPECT_THAT(describe(rc->options), HasSubstr("--backend cuda --decode-graphs on"));
}

TEST(TestbedGpuOptions, BuildWithoutCudaNamesTheFlag) {
    FakeGpus gpus;
    gpus.problem = "this pdsim was built without CUDA (configure with a CUDA toolkit)";
    EXPECT_THAT(resolve_on(gpu_options(), gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--backend cuda: this pdsim was built without CUDA")));
    // The real probe of this build: either it has CUDA (then no GPU here is kUnavailable, a GPU
    // resolves), or it says it was built without.
    const GpuProbe& real = system_gpu_probe();
    auto rc = resolve(gpu_options(), 1);
    if (!real.build_problem().empty()) {
        EXPECT_THAT(rc, StatusIs(StatusCode::kInvalidArgument,
                                 HasSubstr("--backend cuda: this pdsim was built without")));
    } else if (!real.device_count().ok()) {
        EXPECT_THAT(rc, StatusIs(StatusCode::kUnavailable, HasSubstr("--backend cuda: no device")));
    } else {
        EXPECT_OK(rc);
    }
}

TEST(TestbedGpuOptions, NoDeviceIsUnavailable) {
    FakeGpus gpus;
    gpus.count = 0;
    EXPECT_THAT(resolve_on(gpu_options(), gpus),
                StatusIs(StatusCode::kUnavailable, HasSubstr("--backend cuda: no device")));
}

// GPU ranks take a link rate (--shaping GBPS[:LAT]: the data transport's writes are throttled,
// sim/testbed/shaped_transport.h) at time scale 1; `topology` (a CPU run's time-scaled link) is
// refused before the GPUs are asked anything.
TEST(TestbedGpuOptions, ShapingTakesALinkRateNotATopologysTimeScale) {
    FakeGpus gpus;
    TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
    o.mode = Mode::kBoth;
    o.shaping = "topology";
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--shaping topology: not with --backend cuda")));
    EXPECT_TRUE(gpus.asked.empty()) << "refused before asking the GPUs";
    o.shaping = "50:2";
    auto rc = resolve_on(o, gpus);
    ASSERT_OK(rc);
    EXPECT_TRUE(rc->shape);
    EXPECT_DOUBLE_EQ(rc->shape_gbps, 50);
    EXPECT_DOUBLE_EQ(rc->shape_latency_us, 2);
    EXPECT_DOUBLE_EQ(rc->shape_time_scale, 1);
    EXPECT_EQ(rc->options.data_transport, "cuda_ipc");
    EXPECT_EQ(TestbedOptions{.backend = "cuda"}.mode, Mode::kBoth);
    o.shaping = "off";
    EXPECT_OK(resolve_on(o, gpus));
}

// One GPU, a prefill and a decode instance on it (gpu-1p1d): --mode both and disagg resolve, both
// ranks compute on CUDA ordinal 0 (the topology's), the KV goes over cuda_ipc, and the memory check
// counts two ranks on the GPU.
TEST(TestbedGpuOptions, DisaggregatedOnOneGpu) {
    FakeGpus gpus;
    for (Mode mode : {Mode::kBoth, Mode::kDisagg}) {
        SCOPED_TRACE(std::string(mode_name(mode)));
        TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
        o.mode = mode;
        auto rc = resolve_on(o, gpus);
        ASSERT_OK(rc);
        EXPECT_EQ(rc->options.transport, "local");
        EXPECT_EQ(rc->options.data_transport, "cuda_ipc");
        ASSERT_EQ(rc->gpus.size(), 2u);
        for (int r = 0; r < 2; ++r) {
            EXPECT_EQ(rc->gpu_of(r)->choice.device, 0);
            EXPECT_TRUE(rc->gpu_of(r)->choice.from_topology);
            EXPECT_EQ(rc->gpu_of(r)->choice.how, "topology device node0.gpu0");
        }
        EXPECT_THAT(describe(rc->options),
                    HasSubstr("--transport local --data-transport cuda_ipc --backend cuda"));
    }
    // Two ranks' pools, weights and workspaces on the one GPU.
    TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
    o.mode = Mode::kDisagg;
    o.kv_pool_mb = 512;
    gpus.free_bytes = int64_t{2} << 30;  // one rank fits (KvPoolAgainstFreeMemory), two do not
    EXPECT_THAT(resolve_on(o, gpus), StatusIs(StatusCode::kInvalidArgument,
                                              HasSubstr("GPU 0 (Fake H200 0) has 2048 MiB free of "
                                                        "144384 MiB, and its 2 ranks need")));
    // Under mpirun each process places its own rank, and counts the other process's rank on its
    // GPU: neither fits where two do not.
    for (int rank : {0, 1}) {
        EXPECT_THAT(resolve_on(o, gpus, /*world_size=*/2, rank, /*local_rank=*/rank),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("and its 2 ranks need")))
            << "rank " << rank;
    }
    // ... the decode rank on GPU 0 too.
    gpus.free_bytes = int64_t{139} << 30;
    auto decode = resolve_on(o, gpus, /*world_size=*/2, /*rank=*/1, /*local_rank=*/1);
    ASSERT_OK(decode);
    EXPECT_EQ(decode->options.transport, "mpi");
    EXPECT_EQ(decode->options.data_transport, "cuda_ipc");
    ASSERT_EQ(decode->gpus.size(), 1u);
    EXPECT_EQ(decode->gpus[0].rank, 1);
    EXPECT_EQ(decode->gpus[0].choice.device, 0);
}

// Two GPUs (gpu-2g-1p1d): prefill on GPU 0, decode on GPU 1, as the topology maps them (as the DGX
// examples do: a GPU device's `index` is its CUDA ordinal on its node), whatever the local rank.
TEST(TestbedGpuOptions, DisaggregatedOnTwoGpus) {
    FakeGpus gpus;
    gpus.count = 2;
    TestbedOptions o = gpu_options(kExamples + "gpu-2g-1p1d.yaml");
    o.mode = Mode::kBoth;
    auto rc = resolve_on(o, gpus);
    ASSERT_OK(rc);
    EXPECT_EQ(rc->gpu_of(0)->choice.device, 0);
    EXPECT_EQ(rc->gpu_of(1)->choice.device, 1);
    EXPECT_EQ(rc->gpu_of(1)->choice.how, "topology device node0.gpu1");
    auto decode = resolve_on(o, gpus, 2, /*rank=*/1, /*local_rank=*/0);
    ASSERT_OK(decode);
    EXPECT_EQ(decode->gpus[0].choice.device, 1);
    // The decode rank's GPU must be one this process sees.
    gpus.count = 1;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("gpu-2g-1p1d.yaml: rank 1 runs on H200 device node0.gpu1 (CUDA "
                                   "ordinal 1), but this process sees 1 GPU")));
}

// --data-transport through resolve(): auto picks by the ranks' memory, and what cannot reach that
// memory is refused naming the flag.
TEST(TestbedGpuOptions, DataTransportChoiceThroughResolve) {
    FakeGpus gpus;
    TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
    o.mode = Mode::kDisagg;
    o.data_transport = "none";
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport none: the KV would go over the control "
                                   "transport local, which moves host memory only")));
    o.data_transport = "cuda_ipc";
    EXPECT_OK(resolve_on(o, gpus));
    // --transport is the control transport: a GPU-only transport there is refused, saying where
    // the KV goes.
    o.transport = "cuda_ipc";
    EXPECT_THAT(resolve_on(o, gpus), StatusIs(StatusCode::kInvalidArgument,
                                              HasSubstr("--transport cuda_ipc: --transport is the "
                                                        "control transport")));
    // CPU ranks: auto is none, cuda_ipc is refused.
    auto cpu = resolve_on(TestbedOptions{.synthetic = 2}, gpus);
    ASSERT_OK(cpu);
    EXPECT_EQ(cpu->options.data_transport, "none");
    EXPECT_THAT(describe(cpu->options), HasSubstr("--data-transport none"));
    EXPECT_THAT(resolve_on(TestbedOptions{.synthetic = 2, .data_transport = "cuda_ipc"}, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport cuda_ipc: it moves GPU memory only, and CPU "
                                   "ranks' KV pools are host memory; use --data-transport none")));
    // Colocated runs move no KV: none, whatever auto would pick.
    auto colocated = resolve_on(gpu_options(), gpus);
    ASSERT_OK(colocated);
    EXPECT_EQ(colocated->options.data_transport, "none");
}

// A prefill rank and a decode rank on different nodes (a two-node GPU topology).
const char* kTwoNodes = R"(name: gpu-2node
model: tiny
nodes:
  - id: node0
    devices:
      - {id: node0.gpu0, type: H200, index: 0}
    nics:
      - {id: node0.nic0, type: ib, gbps: 50}
  - id: node1
    devices:
      - {id: node1.gpu0, type: H200, index: 0}
    nics:
      - {id: node1.nic0, type: ib, gbps: 50}
switches:
  - {id: ib-fabric, type: ib}
links:
  - {a: node0.gpu0, b: node0.nic0, type: pcie, gbps: 64, latency_us: 0.5}
  - {a: node1.gpu0, b: node1.nic0, type: pcie, gbps: 64, latency_us: 0.5}
  - {a: node0.nic0, b: ib-fabric, type: ib, gbps: 50, latency_us: 1}
  - {a: node1.nic0, b: ib-fabric, type: ib, gbps: 50, latency_us: 1}
instances:
  - {id: prefill0, role: ROLE0, tp: 1, devices: [node0.gpu0]}
  - {id: decode0, role: ROLE1, tp: 1, devices: [node1.gpu0]}
)";

std::string two_nodes(const std::string& role0, const std::string& role1) {
    std::string text = kTwoNodes;
    text.replace(text.find("ROLE0"), 5, role0);
    text.replace(text.find("ROLE1"), 5, role1);
    return text;
}

// What a resolve_* function chose, or "error: <message>".
std::string or_error(const StatusOr<std::string>& name) {
    return name.ok() ? *name : "error: " + name.status().message();
}
std::string chosen(const DataTransportQuery& q) {
    return or_error(resolve_data_transport(q));
}
std::string chosen(const TpExchangeQuery& q) {
    return or_error(resolve_tp_exchange(q));
}

// The DGX examples map ranks to GPUs by the rank map (prefill instances first, TP ranks in the
// instance's device order) and each device's `index` on its node: every rank of a two-node DGX
// topology gets its node's ordinal, whatever its local index (as under mpirun on those nodes).
TEST(TestbedGpuOptions, DgxRanksTakeTheirNodesOrdinals) {
    auto dgx = topo::load_topology(kExamples + "dgx-h100-2node-1p1d-tp8.yaml");
    ASSERT_OK(dgx);
    const topo::RankMap map = dgx->rank_map();
    ASSERT_EQ(map.world_size(), 16);
    for (int r = 0; r < 16; ++r) {
        auto c = choose_gpu(*dgx, map.at(r), /*local_index=*/7 - r % 8, 8, "dgx.yaml");
        ASSERT_OK(c);
        EXPECT_EQ(c->device, r % 8) << "rank " << r;
        EXPECT_TRUE(c->from_topology);
        EXPECT_EQ(c->how,
                  "topology device n" + std::to_string(r / 8) + ".gpu" + std::to_string(r % 8));
    }
}

// The TP-8 DGX example, as one of its processes under mpirun sees it: it resolves now that GPU
// ranks run any TP (before: refused), with the sliced forward, KV over nccl across the nodes, the
// rank's node-local ordinal, and the memory check per TP-8 rank (weights 1/8 of the model's).
TEST(TestbedGpuOptions, DgxTp8ExampleResolvesUnderMpirun) {
    FakeGpus gpus;
    gpus.count = 8;
    gpus.total_bytes = int64_t{80} << 30;
    gpus.free_bytes = int64_t{79} << 30;
    TestbedOptions o = gpu_options(kExamples + "dgx-h100-2node-1p1d-tp8.yaml");
    o.model = "llama3-70b";
    o.layers = 4;
    o.mode = Mode::kDisagg;
    o.transport = "mpi";
    o.kv_pool_mb = 4096;
    auto rc = resolve_on(o, gpus, /*world_size=*/16, /*rank=*/11, /*local_rank=*/3,
                         /*local_size=*/8);
    ASSERT_OK(rc);
    EXPECT_TRUE(rc->gpu_model.sliced_reduction);
    EXPECT_EQ(rc->options.data_transport, "nccl");
    // A GPU per TP rank, but the KV's nccl communicators are on the same GPUs, driven from
    // another thread (NCCL forbids that): the host exchange.
    EXPECT_EQ(rc->options.tp_exchange, "host");
    o.tp_exchange = "nccl";
    EXPECT_THAT(resolve_on(o, gpus, 16, 11, 3, 8),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange nccl: the KV goes over --data-transport nccl")));
    ASSERT_EQ(rc->gpus.size(), 1u);
    EXPECT_EQ(rc->gpus[0].rank, 11);
    EXPECT_EQ(rc->gpus[0].choice.device, 3);
    // A TP-8 rank's weights: 1/8 of the projections, the embeddings and norms whole.
    const model::ModelConfig& m = rc->model;
    const GpuMemoryNeed tp8 = gpu_memory_need(m, rc->gpu_model, 0, 8);
    const GpuMemoryNeed tp1 = gpu_memory_need(m, rc->gpu_model, 0, 1);
    EXPECT_LT(tp8.weight_bytes, tp1.weight_bytes);
    EXPECT_EQ(tp1.weight_bytes - tp8.weight_bytes,
              7 *
                  (model::cuda::estimate_weight_memory(m, 1).per_layer -
                   model::cuda::estimate_weight_memory(m, 1).norms) /
                  8 * m.num_layers);
}

// The TP exchange, case by case: NCCL where every TP > 1 instance has a GPU per rank, the host
// otherwise; an explicit nccl refused, naming why, where it cannot run.
TEST(TestbedGpuOptions, TpExchangeChoice) {
    auto dgx = topo::load_topology(kExamples + "dgx-h100-2node-1p1d-tp8.yaml");
    ASSERT_OK(dgx);
    auto shared = topo::load_topology(kExamples + "gpu-1p1d-tp2-to-tp1.yaml");
    ASSERT_OK(shared);
    auto cpu_tp2 = topo::load_topology(kExamples + "cpu-2p1d-tp2-to-tp1.yaml");
    ASSERT_OK(cpu_tp2);
    auto tp1 = topo::load_topology(kExamples + "gpu-2g-1p1d.yaml");
    ASSERT_OK(tp1);
    TpExchangeQuery q{.requested = "auto",
                      .gpu_ranks = true,
                      .nccl_built = true,
                      .data_transport = "cuda_ipc",
                      .topology = &*dgx,
                      .topology_label = "dgx.yaml"};
    EXPECT_EQ(chosen(q), "nccl");
    q.requested = "nccl";
    EXPECT_EQ(chosen(q), "nccl");
    q.requested = "host";
    EXPECT_EQ(chosen(q), "host");
    // The KV over nccl: two threads would drive NCCL communicators of one GPU.
    q.data_transport = "nccl";
    q.requested = "auto";
    EXPECT_EQ(chosen(q), "host");
    q.requested = "nccl";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange nccl: the KV goes over --data-transport nccl")));
    q.data_transport = "none";
    q.requested = "auto";
    q.nccl_built = false;
    EXPECT_EQ(chosen(q), "host");
    q.requested = "nccl";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange nccl: this pdsim was built without NCCL")));
    q.nccl_built = true;
    q.gpu_ranks = false;
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("GPU ranks only")));
    q.requested = "auto";
    EXPECT_EQ(chosen(q), "host");  // CPU ranks always exchange on the host
    q.gpu_ranks = true;

    // Both prefill TP ranks on the one shared H200.
    q.topology = &*shared;
    q.topology_label = "gpu-1p1d-tp2-to-tp1.yaml";
    EXPECT_EQ(chosen(q), "host");
    q.requested = "nccl";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange nccl: gpu-1p1d-tp2-to-tp1.yaml: instance "
                                   "prefill0 has ranks 0 and 1 on GPU node0.gpu0, and NCCL refuses "
                                   "two ranks of one communicator on one GPU; use --tp-exchange "
                                   "host")));
    // Two TP 2 instances on the same two GPUs: two communicators per GPU, one thread each.
    auto two_groups = topo::parse_topology(R"(name: "two-tp2-on-two-gpus"
model: tiny
nodes:
  - id: node0
    devices:
      - {id: node0.gpu0, type: H200, index: 0, shared: true}
      - {id: node0.gpu1, type: H200, index: 1, shared: true}
    switches:
      - {id: node0.nvswitch, type: nvlink}
links:
  - {a: node0.gpu0, b: node0.nvswitch, type: nvlink, gbps: 450, latency_us: 1}
  - {a: node0.gpu1, b: node0.nvswitch, type: nvlink, gbps: 450, latency_us: 1}
instances:
  - {id: prefill0, role: prefill, tp: 2, devices: [node0.gpu0, node0.gpu1]}
  - {id: decode0, role: decode, tp: 2, devices: [node0.gpu0, node0.gpu1]}
)",
                                           "two-groups.yaml");
    ASSERT_OK(two_groups);
    q.topology = &*two_groups;
    q.topology_label = "two-groups.yaml";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("two-groups.yaml: instances prefill0 and decode0 (tp > 1 both) "
                                   "share GPU node0.gpu0")));
    q.requested = "auto";
    EXPECT_EQ(chosen(q), "host");
    q.requested = "nccl";
    // CPU devices: which GPU a rank takes is chosen at run time.
    q.topology = &*cpu_tp2;
    q.topology_label = "cpu-2p1d-tp2-to-tp1.yaml";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("runs on cpu devices")));
    q.requested = "auto";
    EXPECT_EQ(chosen(q), "host");
    // Nothing to exchange.
    q.topology = &*tp1;
    q.topology_label = "gpu-2g-1p1d.yaml";
    EXPECT_EQ(chosen(q), "none");
    q.requested = "host";
    EXPECT_EQ(chosen(q), "none");
    q.requested = "nccl";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("no instance of gpu-2g-1p1d.yaml has tp > 1")));
    q.requested = "mpi";
    EXPECT_THAT(resolve_tp_exchange(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange mpi: expected auto, host or nccl")));
}

// The pure choice, case by case.
TEST(TestbedGpuOptions, DataTransportChoice) {
    auto pd = topo::parse_topology(two_nodes("prefill", "decode"), "gpu-2node.yaml");
    ASSERT_OK(pd);
    auto one = topo::load_topology(kExamples + "gpu-1p1d.yaml");
    ASSERT_OK(one);
    DataTransportQuery q{.requested = "auto",
                         .mode = Mode::kBoth,
                         .gpu_ranks = true,
                         .control = "mpi",
                         .world_size = 2,
                         .topology = &*one,
                         .topology_label = "gpu-1p1d.yaml"};
    EXPECT_EQ(chosen(q), "cuda_ipc");
    q.world_size = 1;
    q.control = "local";
    EXPECT_EQ(chosen(q), "cuda_ipc");
    q.mode = Mode::kColocated;
    EXPECT_EQ(chosen(q), "none");
    q.requested = "cuda_ipc";
    EXPECT_EQ(chosen(q), "none");
    q.mode = Mode::kDisagg;
    q.gpu_ranks = false;
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--data-transport cuda_ipc")));
    q.requested = "auto";
    EXPECT_EQ(chosen(q), "none");
    q.requested = "none";
    EXPECT_EQ(chosen(q), "none");
    q.gpu_ranks = true;
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--data-transport none")));
    // nccl (two-sided, matched in post order: the engine's ordered plane) on one shared GPU:
    // NCCL refuses two ranks of a communicator on one device.
    q.requested = "nccl";
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport nccl: gpu-1p1d.yaml: prefill instance "
                                   "prefill0 (rank 0) and decode instance decode0 (rank 1) share "
                                   "GPU node0.gpu0, and NCCL refuses two ranks")));
    q.requested = "rdma";
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport rdma: expected auto, none, cuda_ipc, "
                                   "nccl or local_writes")));
    q.requested = "nccl";
    q.gpu_ranks = false;
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport nccl: it moves GPU memory only")));
    q.gpu_ranks = true;
    // Between nodes: auto is nccl, threads or processes alike; cuda_ipc is refused, naming the
    // pair.
    q.topology = &*pd;
    q.topology_label = "gpu-2node.yaml";
    for (int world : {1, 2}) {
        q.world_size = world;
        q.requested = "auto";
        EXPECT_EQ(chosen(q), "nccl");
        q.requested = "nccl";
        EXPECT_EQ(chosen(q), "nccl");
        q.requested = "cuda_ipc";
        EXPECT_THAT(resolve_data_transport(q),
                    StatusIs(StatusCode::kInvalidArgument,
                             HasSubstr("--data-transport cuda_ipc: gpu-2node.yaml: prefill "
                                       "instance prefill0 (rank 0, node0) and decode instance "
                                       "decode0 (rank 1, node1) are on different nodes")));
    }
    // ... but a colocated run of it moves no KV.
    q.requested = "auto";
    q.mode = Mode::kColocated;
    EXPECT_EQ(chosen(q), "none");
    // local_writes: the write plane on CPU ranks that are threads of one process; host memory
    // only, and no mpirun.
    auto cpu = topo::load_topology(kExamples + "cpu-1p1d.yaml");
    ASSERT_OK(cpu);
    q = DataTransportQuery{.requested = "local_writes",
                           .mode = Mode::kDisagg,
                           .gpu_ranks = false,
                           .control = "local",
                           .world_size = 1,
                           .topology = &*cpu,
                           .topology_label = "cpu-1p1d.yaml"};
    EXPECT_EQ(chosen(q), "local_writes");
    q.world_size = 2;
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport local_writes: its ranks are threads of one "
                                   "process; launch pdsim without mpirun")));
    q.world_size = 1;
    q.gpu_ranks = true;
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--data-transport local_writes: it moves host memory only")));
}

// The DGX H200 examples: one node (4 prefill and 4 decode instances, a GPU each) takes
// cuda_ipc, or nccl when asked; two nodes (prefill on n0, decode on n1) take nccl.
TEST(TestbedGpuOptions, DgxExamplesDataTransport) {
    auto one_node = topo::load_topology(kExamples + "dgx-h200-1node-4p4d.yaml");
    ASSERT_OK(one_node);
    auto two_nodes = topo::load_topology(kExamples + "dgx-h200-2node-8p8d.yaml");
    ASSERT_OK(two_nodes);
    DataTransportQuery q{.requested = "auto",
                         .mode = Mode::kDisagg,
                         .gpu_ranks = true,
                         .control = "mpi",
                         .world_size = 8,
                         .topology = &*one_node,
                         .topology_label = "dgx-h200-1node-4p4d.yaml"};
    EXPECT_EQ(chosen(q), "cuda_ipc");
    q.requested = "nccl";
    EXPECT_EQ(chosen(q), "nccl");
    q.requested = "auto";
    q.world_size = 16;
    q.topology = &*two_nodes;
    q.topology_label = "dgx-h200-2node-8p8d.yaml";
    EXPECT_EQ(chosen(q), "nccl");
    q.requested = "cuda_ipc";
    EXPECT_THAT(resolve_data_transport(q),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("are on different nodes")));
}

// Without mpirun every rank is a thread of this process on this host's GPUs: a topology whose
// ranks are on several nodes is refused (its CUDA ordinals are per node); under mpirun each
// process runs its own rank on its node's GPU.
TEST(TestbedGpuOptions, RanksOfSeveralNodesNeedMpirun) {
    FakeGpus gpus;
    TempFile topo("two_nodes", two_nodes("colocated", "colocated"));
    TestbedOptions o = gpu_options(topo.path());
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("rank 0 is on node node0 and rank 1 on node node1; without "
                                   "mpirun every rank is a thread of this process")));
    auto second = resolve_on(o, gpus, /*world_size=*/2, /*rank=*/1, /*local_rank=*/0);
    ASSERT_OK(second);
    EXPECT_EQ(second->gpus[0].choice.device, 0);
    EXPECT_EQ(second->gpus[0].choice.how, "topology device node1.gpu0");
}

// --fault on GPU ranks: every kind a device stream carries resolves; stale-graph-metadata lives in
// the decode CUDA graphs and only the colocated comparison catches it.
TEST(TestbedGpuOptions, FaultsOnGpuRanks) {
    FakeGpus gpus;
    for (Fault f : {Fault::kRecordBeforeWrite, Fault::kSkipRecord, Fault::kDoubleRecord,
                    Fault::kFreeBeforeTransfer, Fault::kLateWrite}) {
        SCOPED_TRACE(std::string(fault_name(f)));
        TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
        o.mode = Mode::kDisagg;
        o.fault = f;
        EXPECT_OK(resolve_on(o, gpus));
    }
    TestbedOptions o = gpu_options(kExamples + "gpu-1p1d.yaml");
    o.fault = Fault::kStaleGraphMetadata;
    o.mode = Mode::kBoth;
    EXPECT_OK(resolve_on(o, gpus));
    o.mode = Mode::kDisagg;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--fault stale-graph-metadata: with --backend cuda the stale "
                                   "decode replays compute wrong tokens")));
    o.mode = Mode::kBoth;
    o.decode_graphs = false;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("use --decode-graphs on")));
}

// TP > 1 instances run the GPU model's TP-invariant (sliced) reduction, and so does every other
// rank of that run (TP 1 ranks must compute the bits TP 2 ranks do); TP 1 runs keep the plain
// forward. A TP split the model does not divide is refused naming the instance; a TP 2 decode
// instance has no decode graphs to plant stale metadata in.
TEST(TestbedGpuOptions, TpAboveOneRunsTheSlicedReduction) {
    FakeGpus gpus;
    gpus.count = 8;
    auto rc = resolve_on(gpu_options(kExamples + "cpu-2p1d-tp2-to-tp1.yaml"), gpus);
    ASSERT_OK(rc);
    EXPECT_TRUE(rc->gpu_model.sliced_reduction);
    EXPECT_EQ(rc->options.tp_exchange, "host");
    EXPECT_THAT(describe(rc->options), HasSubstr("--tp-exchange host"));
    auto one = resolve_on(gpu_options(kExamples + "gpu-1p1d.yaml"), gpus);
    ASSERT_OK(one);
    EXPECT_FALSE(one->gpu_model.sliced_reduction);
    EXPECT_EQ(one->options.tp_exchange, "none");
    // The TP-2 prefill instance on two GPUs, its KV over cuda_ipc: auto takes NCCL (this build
    // has it), and the memory check counts NCCL's buffers.
    TestbedOptions two_gpus = gpu_options(kExamples + "gpu-2g-1p1d-tp2-to-tp1.yaml");
    two_gpus.mode = Mode::kBoth;
    auto two = resolve_on(two_gpus, gpus);
    ASSERT_OK(two);
    EXPECT_EQ(two->options.data_transport, "cuda_ipc");
    EXPECT_EQ(two->options.tp_exchange, transfer::nccl_tp_comm_built() ? "nccl" : "host");
    EXPECT_THAT(describe(two->options), HasSubstr("--tp-exchange "));
    TestbedOptions shared = gpu_options(kExamples + "gpu-1p1d-tp2-to-tp1.yaml");
    shared.tp_exchange = "nccl";
    EXPECT_THAT(resolve_on(shared, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--tp-exchange nccl: gpu-1p1d-tp2-to-tp1.yaml: instance "
                                   "prefill0 has ranks 0 and 1 on GPU")));

    TempFile tp2_decode("tp2decode", R"(name: "tp1-to-tp2"
model: tiny
nodes:
  - id: node0
    devices:
      - {id: node0.cpu0, type: cpu}
      - {id: node0.cpu1, type: cpu}
      - {id: node0.cpu2, type: cpu}
    switches:
      - {id: node0.shm, type: loopback}
links:
  - {a: node0.cpu0, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: node0.cpu1, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: node0.cpu2, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
instances:
  - {id: prefill0, role: prefill, tp: 1, devices: [node0.cpu0]}
  - {id: decode0, role: decode, tp: 2, devices: [node0.cpu1, node0.cpu2]}
)");
    TestbedOptions o = gpu_options(tp2_decode.path());
    EXPECT_OK(resolve_on(o, gpus));
    o.mode = Mode::kBoth;
    o.fault = Fault::kStaleGraphMetadata;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("decode instance decode0 has tp 2; GPU ranks plant it in the "
                                   "decode CUDA graphs")));
    // A model whose intermediate size splits over TP 2 but not into its 4 reduction slices.
    TempFile odd("odd", "base: tiny\nname: tiny-odd\nintermediate: 528\n");
    o = gpu_options(kExamples + "cpu-2p1d-tp2-to-tp1.yaml");
    o.model = odd.path();
    EXPECT_THAT(resolve_on(o, gpus), StatusIs(StatusCode::kInvalidArgument,
                                              HasSubstr("the GPU model cannot run it on ")));
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("instance prefill0 (tp 2)")));
    o.topology = kExamples + "gpu-1p1d.yaml";  // TP 1 only: the plain forward runs it
    EXPECT_OK(resolve_on(o, gpus));
}

TEST(TestbedGpuOptions, ModelsTheGpuModelCannotRun) {
    FakeGpus gpus;
    TestbedOptions o = gpu_options();
    o.model = "deepseek-v3";  // MLA
    o.layers = 2;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--model deepseek-v3: the GPU model cannot run it")));
    o.model = "hybrid-tiny";  // recurrent layers: CPU ranks only
    o.layers = 0;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("model hybrid-tiny has recurrent layers, which run on CPU")));
    TempFile swa("swa",
                 "base: tiny\nname: swa\nlayer_kinds: [full, sliding]\nsliding_window: 64\n");
    o.model = swa.path();  // sliding-window layers: the GPU model has none yet
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("the GPU model cannot run it")));
    // head_dim 96: the model's kernels take it, FlashInfer's are built for 64 and 128.
    TempFile hd96("hd96", "base: tiny\nname: tiny-hd96\nhead_dim: 96\n");
    o.model = hd96.path();
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("the cuda attention backend cannot run it")));
    // The same model on CPU ranks is fine (nothing GPU is checked there).
    o.backend = "cpu";
    o.topology = kExamples + "cpu-1p1d.yaml";
    EXPECT_OK(resolve_on(o, gpus));
}

TEST(TestbedGpuOptions, KvPoolAgainstFreeMemory) {
    FakeGpus gpus;
    gpus.free_bytes = int64_t{2} << 30;
    TestbedOptions o = gpu_options();
    o.kv_pool_mb = 4096;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--kv-pool-mb 4096: GPU 0 (Fake H200 0) has 2048 MiB free")));
    o.kv_pool_mb = 512;  // 512 MiB + 1 GiB headroom + tiny's weights and workspace fit in 2 GiB
    auto one = resolve_on(o, gpus);
    ASSERT_OK(one);
    // Two ranks on the one GPU need twice that.
    o.topology = kExamples + "cpu-1p1d.yaml";
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("its 2 ranks need")));
    // Under mpirun each process checks only its rank before any allocates: on a cpu topology
    // the GPU is the local rank's % visible, so the other process on this host that picks the
    // same GPU counts too (here 2 processes, 1 GPU) ...
    EXPECT_THAT(resolve_on(o, gpus, /*world_size=*/2, /*rank=*/1, /*local_rank=*/1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("its 2 ranks need")));
    // ... and one on another GPU does not (2 processes, 2 GPUs).
    FakeGpus two = gpus;
    two.count = 2;
    EXPECT_OK(resolve_on(o, two, /*world_size=*/2, /*rank=*/1, /*local_rank=*/1));
    // The need is what the pool, the model's weights and workspace and the headroom take.
    const GpuMemoryNeed need =
        gpu_memory_need(one->model, one->gpu_model,
                        kv_pool_pages(one->model, 1, o.page_size, 512, runtime::DType::kBF16) *
                            kv_page_bytes(one->model, 1, o.page_size, runtime::DType::kBF16));
    EXPECT_GE(need.kv_pool_bytes, int64_t{512} << 20);
    EXPECT_GT(need.weight_bytes, 0);
    EXPECT_GT(need.workspace_bytes, 0);
    EXPECT_EQ(need.total(),
              need.kv_pool_bytes + need.weight_bytes + need.workspace_bytes + kGpuHeadroomBytes);
}

TEST(TestbedGpuOptions, DeviceChoice) {
    // A topology that maps ranks to GPUs: each rank's GPU ordinal, whatever its local index.
    topo::GpuHostOptions host;
    host.gpus = 4;
    host.colocated = 4;
    host.prefill = host.decode = 0;
    auto four = topo::make_gpu_host("H100", host);
    ASSERT_OK(four);
    const topo::RankMap map = four->rank_map();
    for (int r = 0; r < 4; ++r) {
        auto c = choose_gpu(*four, map.at(r), /*local_index=*/0, 4, "four.yaml");
        ASSERT_OK(c);
        EXPECT_EQ(c->device, r);
        EXPECT_TRUE(c->from_topology);
        EXPECT_THAT(c->how, HasSubstr("node0.gpu" + std::to_string(r)));
    }
    // ... which must be a GPU this process sees.
    EXPECT_THAT(choose_gpu(*four, map.at(3), 0, 2, "four.yaml"),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("four.yaml: rank 3 runs on H100 device node0.gpu3 (CUDA "
                                   "ordinal 3), but this process sees 2 GPUs")));
    // cpu devices: the local index modulo the visible GPUs.
    auto cpu = topo::load_topology(kExamples + "cpu-1p2d.yaml");
    ASSERT_OK(cpu);
    const topo::RankMap cmap = cpu->rank_map();
    for (int r = 0; r < 3; ++r) {
        auto c = choose_gpu(*cpu, cmap.at(r), r, 2, "cpu-1p2d.yaml");
        ASSERT_OK(c);
        EXPECT_EQ(c->device, r % 2);
        EXPECT_FALSE(c->from_topology);
        EXPECT_EQ(c->how, "local rank " + std::to_string(r) + " % 2 GPUs");
    }
    // Through resolve: without mpirun every rank is placed (the local index is the rank) ...
    FakeGpus gpus;
    gpus.count = 2;
    auto all = resolve_on(gpu_options(kExamples + "cpu-1p2d.yaml"), gpus);
    ASSERT_OK(all);
    ASSERT_EQ(all->gpus.size(), 3u);
    EXPECT_EQ(all->gpu_of(2)->choice.device, 0);
    EXPECT_EQ(all->gpu_of(1)->choice.device, 1);
    // ... under mpirun only this process's rank, by its local rank on the host.
    auto mine = resolve_on(gpu_options(kExamples + "cpu-1p2d.yaml"), gpus, /*world_size=*/3,
                           /*rank=*/2, /*local_rank=*/1);
    ASSERT_OK(mine);
    ASSERT_EQ(mine->gpus.size(), 1u);
    EXPECT_EQ(mine->gpus[0].rank, 2);
    EXPECT_EQ(mine->gpus[0].choice.device, 1);
    EXPECT_EQ(mine->gpu_of(0), nullptr);
}

TEST(TestbedGpuOptions, ModelSizing) {
    const model::cuda::CudaModelOptions o = gpu_model_options(
        {.max_batch_tokens = 2048, .max_decode_batch = 64, .requests = 8, .max_sequence = 1056}, 3);
    EXPECT_EQ(o.device, 3);
    EXPECT_EQ(o.max_tokens, 2048);
    EXPECT_EQ(o.max_bs, 64);  // 8 requests per extend forward at most, 64 per decode forward
    EXPECT_EQ(o.max_positions, 1088);  // 1056 up to a multiple of 64
    const model::cuda::CudaModelOptions many = gpu_model_options(
        {.max_batch_tokens = 512, .max_decode_batch = 16, .requests = 1000, .max_sequence = 1}, 0);
    EXPECT_EQ(many.max_bs, 512);  // an extend forward of 512 one-token chunks
    EXPECT_EQ(many.max_positions, 64);
    EXPECT_EQ(gpu_decode_buckets(16), (std::vector<int>{1, 2, 4, 8, 16}));
    EXPECT_EQ(gpu_decode_buckets(24), (std::vector<int>{1, 2, 4, 8, 16, 24}));
}

// A colocated topology (every instance serves whole requests) has nothing to disaggregate.
TEST(TestbedGpuOptions, ColocatedTopologyNeedsColocatedMode) {
    FakeGpus gpus;
    TestbedOptions o = gpu_options();
    o.backend = "cpu";
    // gpu-1c's device is a GPU: CPU ranks refuse it, naming the backend.
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("device node0.gpu0 is a H200 GPU; CPU ranks (--backend cpu) "
                                   "run on `cpu` devices")));
    TempFile topo("colocated_cpu", R"(name: cpu-1c
model: tiny
nodes:
  - id: node0
    devices:
      - {id: node0.cpu0, type: cpu}
instances:
  - {id: both0, role: colocated, tp: 1, devices: [node0.cpu0]}
)");
    o.topology = topo.path();
    o.mode = Mode::kBoth;
    EXPECT_THAT(resolve_on(o, gpus),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--mode both: topology " +
                                   std::filesystem::path(topo.path()).filename().string() +
                                   " has colocated instances only")));
    o.mode = Mode::kColocated;
    EXPECT_OK(resolve_on(o, gpus));
}

// CPU runs resolve as they did: the cpu backend, no GPU asked, the same pool size.
TEST(TestbedGpuOptions, CpuRunsAreUnchanged) {
    FakeGpus gpus;
    auto rc = resolve_on(TestbedOptions{}, gpus);
    ASSERT_OK(rc);
    EXPECT_EQ(rc->options.backend, "cpu");
    EXPECT_EQ(rc->options.mode, Mode::kBoth);
    EXPECT_FALSE(rc->gpu_ranks());
    EXPECT_TRUE(rc->gpus.empty());
    EXPECT_TRUE(gpus.asked.empty());
    EXPECT_THAT(describe(rc->options), Not(HasSubstr("decode-graphs")));
    EXPECT_THAT(resolve_on(TestbedOptions{.backend = "cuda_ref"}, gpus),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--backend cuda_ref")));
    // The KV pool: --kv-pool-mb MiB of fp32 pages (K and V of every layer and KV head) plus the
    // null page, as the CPU testbed always sized it.
    const model::ModelConfig& m = rc->model;
    const int64_t page_bytes =
        int64_t{m.num_layers} * 2 * m.num_kv_heads * m.head_dim * 4 * rc->options.page_size;
    EXPECT_EQ(kv_page_bytes(m, 1, rc->options.page_size, runtime::DType::kF32), page_bytes);
    EXPECT_EQ(kv_pool_pages(m, 1, rc->options.page_size, 512, runtime::DType::kF32),
              (int64_t{512} << 20) / page_bytes + 1);
    EXPECT_EQ(kv_pool_pages(m, 2, rc->options.page_size, 512, runtime::DType::kF32),
              (int64_t{512} << 20) / (page_bytes / 2) + 1);
    EXPECT_EQ(kv_pool_pages(m, 1, rc->options.page_size, 512, runtime::DType::kBF16),
              (int64_t{512} << 20) / (page_bytes / 2) + 1);
}

}  // namespace
}  // namespace pdsim::testbed
