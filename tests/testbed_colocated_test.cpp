// `pdsim testbed --mode colocated` on CPU ranks, end to end (the real binary, every rank a thread
// over the local transport), after the server learned to drive GPU ranks too:
//  - every request completes, and each request's tokens equal the same CPU model run on that
//    request alone (tests/testbed_solo_oracle.h), so the server computes what it computed before;
//    the CPU layer hook still fills the timeline's compute track, and the report has the keys of
//    sim/metrics/report.h plus each request's tokens;
//  - --backend cuda's and --data-transport's refusals through the binary: exit 2 naming the flag
//    (a bad --decode-graphs or --data-transport, cuda_ipc with CPU ranks, a topology's shaping
//    with GPU ranks, --data-transport none with GPU ranks, stale-graph-metadata outside --mode
//    both); exit 1 ("no device") where this process sees no GPU, colocated (gpu-1c) and
//    disaggregated (gpu-1p1d) (skipped where it sees one: the cuda tests run those).
// Label unit; the GPU run itself is tests/testbed_gpu_test.cpp (label cuda).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/cpu_stream.h"
#include "sim/testbed/gpu_plan.h"
#include "sim/testbed/options.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "tests/testbed_solo_oracle.h"

namespace pdsim::test {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

const std::string kExamples = std::string(PDSIM_SOURCE_DIR) + "/topology/examples/";

json load_json(const std::string& path) {
    std::ifstream f(path);
    if (!f) return json();
    return json::parse(f, nullptr, false);
}

TEST(TestbedColocatedCpu, TokensEqualSoloRunsOfTheSameModel) {
    TempDir dir("tb_colocated_cpu");
    // Three colocated instances (cpu-1p2d's prefill and decode instances both serve whole
    // requests); 8 prompts of at most 128 tokens: every prompt is one chunk of one forward.
    const testbed::TestbedOptions o{.topology = kExamples + "cpu-1p2d.yaml",
                                    .model = "tiny",
                                    .synthetic = 8,
                                    .seed = 3,
                                    .max_input_len = 128,
                                    .max_output_len = 6,
                                    .mode = testbed::Mode::kColocated,
                                    .kv_pool_mb = 32,
                                    .threads = 1};
    const CmdResult r = run_pdsim({"testbed",    "--topology",
                                   o.topology,   "--model",
                                   o.model,      "--synthetic",
                                   "8",          "--seed",
                                   "3",          "--max-input-len",
                                   "128",        "--max-output-len",
                                   "6",          "--mode",
                                   "colocated",  "--kv-pool-mb",
                                   "32",         "--threads",
                                   "1",          "--quiet",
                                   "--report",   dir.str("report.json"),
                                   "--timeline", dir.str("timeline.json")},
                                  120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    const json rep = load_json(dir.str("report.json"));
    ASSERT_TRUE(rep.is_object()) << r.describe();
    for (const char* key :
         {"schema_version", "mode", "topology", "model", "requests_submitted", "requests_completed",
          "requests_failed", "ttft_ms", "tpot_ms", "e2e_ms", "goodput_rps", "slo_attainment",
          "transfer", "ordering", "wall_s", "config", "ranks", "lifecycle"}) {
        EXPECT_TRUE(rep.contains(key)) << key;
    }
    EXPECT_EQ(rep["mode"], "colocated");
    EXPECT_EQ(rep["config"]["backend"], "cpu");
    EXPECT_FALSE(rep["config"].contains("gpu"));
    EXPECT_EQ(rep["requests_completed"].get<int>(), 8) << rep.dump(1);
    EXPECT_EQ(rep["requests_failed"].get<int>(), 0);

    // The oracle: the same requests and prompts, each alone on a fresh CPU rank's parts.
    auto cfg = testbed::resolve(o, 1);
    ASSERT_OK(cfg);
    ASSERT_EQ(cfg->requests.size(), 8u);
    auto model = model::SyntheticModel::create(cfg->model, nullptr, 256);
    ASSERT_OK(model);
    runtime::CpuStream stream("oracle");
    attn::AttentionConfig ac;
    ac.num_q_heads = cfg->model.num_q_heads;
    ac.num_kv_heads = cfg->model.num_kv_heads;
    ac.head_dim = cfg->model.head_dim;
    ac.stream = &stream;
    ac.num_threads = 1;
    auto backend = attn::create_attention_backend("cpu", ac);
    ASSERT_OK(backend);
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg->model.num_layers;
    pc.num_kv_heads = cfg->model.num_kv_heads;
    pc.head_dim = cfg->model.head_dim;
    pc.page_size = cfg->options.page_size;
    pc.num_pages = 16;
    auto pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(pool);
    int compared = 0;
    for (size_t i = 0; i < cfg->requests.size(); ++i) {
        SCOPED_TRACE("request " + std::to_string(i));
        const std::vector<int32_t> got = report_tokens(rep, i);
        ASSERT_EQ(static_cast<int>(got.size()), cfg->requests[i].output_len);
        auto want = solo_tokens(**model, **backend, **pool, stream, testbed_prompt(*cfg, i),
                                cfg->requests[i].output_len);
        ASSERT_OK(want);
        EXPECT_EQ(got, *want);
        compared += static_cast<int>(got.size());
    }
    EXPECT_GT(compared, 8);

    // The CPU model's layer hook still fills the compute track: one slice per layer per forward.
    const json tl = load_json(dir.str("timeline.json"));
    ASSERT_TRUE(tl.contains("traceEvents"));
    int layer_slices = 0;
    for (const json& e : tl["traceEvents"]) {
        if (e.value("cat", "") == "compute" && e.value("name", "").rfind("L0 ", 0) == 0) {
            ++layer_slices;
        }
    }
    EXPECT_GT(layer_slices, 0);

    // Each CPU forward carries its thread's CPU time and preemptions (docs/testbed.md section 1).
    int forwards = 0;
    double wall_us = 0, cpu_us = 0;
    for (const json& e : tl["traceEvents"]) {
        if (e.value("cat", "") != "forward") continue;
        ++forwards;
        const json& args = e.at("args");
        ASSERT_TRUE(args.contains("thread_cpu_us") && args.contains("preemptions")) << e.dump();
        EXPECT_GE(args["thread_cpu_us"].get<double>(), 0.0);
        EXPECT_GE(args["preemptions"].get<int64_t>(), 0);
        wall_us += e["dur"].get<double>();
        cpu_us += args["thread_cpu_us"].get<double>();
    }
    EXPECT_GT(forwards, 0);
    // The caller ran its forwards (--stream-sync caller, the default): their CPU time is theirs.
    // Had another thread run them, the caller's would be its blocking waits' (near 0). The bound
    // leaves room for a loaded machine: under ctest -j2 on 2 cores, beside multi-process tests,
    // the forwards got 0.19 of their wall time.
    EXPECT_GT(cpu_us, 0.05 * wall_us);
    EXPECT_LE(cpu_us, 1.05 * wall_us + 1000.0 * forwards);
}

TEST(TestbedColocatedCpu, CudaRefusalsThroughTheBinary) {
    // A build without CUDA says so first, whatever else the command line holds.
    const testbed::GpuProbe& gpus = testbed::system_gpu_probe();
    const bool built = gpus.build_problem().empty();
    const std::string no_cuda = "--backend cuda: this pdsim was built without";
    // The flags' own values are checked by the command, in every build.
    CmdResult r = run_pdsim(
        {"testbed", "--backend", "cuda", "--mode", "colocated", "--decode-graphs", "sometimes"},
        60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--decode-graphs sometimes: expected on or off"));
    r = run_pdsim({"testbed", "--backend", "cuda", "--device-gate", "1"}, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--device-gate 1: expected on or off"));
    r = run_pdsim({"testbed", "--data-transport", "nccl"}, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--data-transport"));
    // cuda_ipc writes GPU memory: CPU ranks refuse it, in every build (its descriptor is
    // registered either way).
    r = run_pdsim({"testbed", "--data-transport", "cuda_ipc", "--synthetic", "2"}, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--data-transport cuda_ipc: it moves GPU memory only, and CPU "
                                 "ranks' KV pools are host memory"));
    // Disaggregated GPU runs on one GPU (the default mode, both).
    const std::vector<std::string> pd_on_gpu = {"testbed",  "--backend",   "cuda", "--topology",
                                                "gpu-1p1d", "--synthetic", "2"};
    std::vector<std::string> args = pd_on_gpu;
    args.insert(args.end(), {"--shaping", "topology"});
    r = run_pdsim(args, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr(built ? "--shaping topology: not with --backend cuda" : no_cuda));
    if (built) {
        args = pd_on_gpu;
        args.insert(args.end(), {"--mode", "disagg", "--data-transport", "none"});
        r = run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("--data-transport none: the KV would go over the control "
                                     "transport local"));
        args = pd_on_gpu;
        args.insert(args.end(), {"--fault", "stale-graph-metadata", "--mode", "disagg"});
        r = run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("use --mode both (not disagg)"));
        // Both TP ranks of gpu-1p1d-tp2-to-tp1's prefill instance share its one GPU: no NCCL.
        r = run_pdsim({"testbed", "--backend", "cuda", "--topology", "gpu-1p1d-tp2-to-tp1",
                       "--synthetic", "2", "--tp-exchange", "nccl"},
                      60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("--tp-exchange nccl: gpu-1p1d-tp2-to-tp1: instance "
                                     "prefill0 has ranks 0 and 1 on GPU node0.gpu0"));
    }
    r = run_pdsim({"testbed", "--tp-exchange", "nccl", "--synthetic", "2"}, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--tp-exchange nccl: GPU ranks only (--backend cuda)"));
    r = run_pdsim({"testbed", "--backend", "cuda", "--tp-exchange", "mpi"}, 60);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("--tp-exchange: mpi not in {auto,host,nccl}"));
    const std::vector<std::string> run_on_gpu = {"testbed", "--backend",   "cuda",
                                                 "--mode",  "colocated",   "--topology",
                                                 "gpu-1c",  "--synthetic", "2"};
    if (!built) {
        for (const auto& cmd : {run_on_gpu, pd_on_gpu}) {
            r = run_pdsim(cmd, 60);
            EXPECT_EQ(r.rc, 2) << r.describe();
            EXPECT_THAT(r.err, HasSubstr(no_cuda));
        }
        return;
    }
    if (gpus.device_count().ok()) GTEST_SKIP() << "a GPU is present: testbed_gpu_test runs it";
    // No GPU: kUnavailable, which the CLI maps to exit 1 (cli::exit_code_for), colocated and
    // disaggregated alike (the options themselves are fine).
    for (const auto& cmd : {run_on_gpu, pd_on_gpu}) {
        r = run_pdsim(cmd, 60);
        EXPECT_EQ(r.rc, 1) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE: --backend cuda: no device"));
    }
}

}  // namespace
}  // namespace pdsim::test
