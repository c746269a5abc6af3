// `pdsim testbed --backend cuda --mode colocated` on a GPU (label cuda), end to end: the real
// binary on the one-GPU topology topology/examples/gpu-1c.yaml (found by name, so the GPU
// bundle's copy under share/pdsim/topologies serves too):
//  - tiny, 8 synthetic requests: exit 0, every request completed; the report has the keys of a CPU
//    run of the same requests and names the backend and the GPU (its cudaGetDeviceProperties
//    name) in its config; the rank's stats say it replayed decode CUDA graphs; the timeline's
//    compute track has per-layer slices (device events) and graph replays;
//  - the tokens: what the GPU model promises (backends/cuda/cuda_synthetic_model.h) is batch
//    invariance, and graph replay == eager; it does NOT promise the CPU model's fp32 tokens (it
//    computes in bf16). So each request's tokens must equal the GPU model run on that request alone
//    (tests/testbed_solo_oracle.h: one extend forward of the whole prompt, then eager decode
//    steps, on a fresh bf16 pool poisoned first) bit for bit; prompts are single chunks here. How
//    many tokens also equal the CPU testbed's is printed, not checked;
//  - --decode-graphs off gives the same tokens;
//  - llama3-8b with --layers 2 (head_dim 128, GQA 4): the same checks on 4 requests.
// Skips with the CUDA runtime's reason where there is no GPU, before spawning anything.
//
// The binary: $PDSIM_GPU_TEST_PDSIM when set (scripts/gpu_check.sh: the bundle's pdsim behind its
// loader), else the pdsim this test was built with.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/cuda_device_info.h"
#include "sim/testbed/options.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "tests/testbed_gpu_util.h"
#include "tests/testbed_solo_oracle.h"

namespace pdsim::test {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string skip_reason() {
    return gpu_skip_reason();
}

CmdResult run_binary(const std::vector<std::string>& args, int timeout_s) {
    return run_gpu_pdsim(args, timeout_s);
}

std::set<std::string> keys(const json& j) {
    std::set<std::string> out;
    for (const auto& [k, v] : j.items()) out.insert(k);
    return out;
}

// One run's options, as flags for the binary and as TestbedOptions for resolve().
struct TestbedRun {
    std::string model = "tiny";
    int layers = 0;
    int requests = 8;
    std::string backend = "cuda";
    std::string topology = "gpu-1c";
    bool decode_graphs = true;

    [[nodiscard]] testbed::TestbedOptions options() const {
        testbed::TestbedOptions o{.topology = topology,
                                  .model = model,
                                  .layers = layers,
                                  .synthetic = requests,
                                  .seed = 5,
                                  .max_input_len = 128,
                                  .max_output_len = 8,
                                  .backend = backend,
                                  .decode_graphs = decode_graphs,
                                  .mode = testbed::Mode::kColocated,
                                  .kv_pool_mb = 256};
        return o;
    }
    [[nodiscard]] std::vector<std::string> args(const TempDir& dir) const {
        std::vector<std::string> a = {"testbed",
                                      "--topology",
                                      topology,
                                      "--model",
                                      model,
                                      "--synthetic",
                                      std::to_string(requests),
                                      "--seed",
                                      "5",
                                      "--max-input-len",
                                      "128",
                                      "--max-output-len",
                                      "8",
                                      "--backend",
                                      backend,
                                      "--mode",
                                      "colocated",
                                      "--kv-pool-mb",
                                      "256",
                                      "--quiet",
                                      "--report",
                                      dir.str("report.json"),
                                      "--timeline",
                                      dir.str("timeline.json")};
        if (layers > 0) {
            a.push_back("--layers");
            a.push_back(std::to_string(layers));
        }
        if (backend == "cuda") {
            a.push_back("--decode-graphs");
            a.push_back(decode_graphs ? "on" : "off");
        }
        return a;
    }
};

// Runs `run` and checks what every run must show: exit 0, every request completed.
json run_ok(const TestbedRun& run_opts, const TempDir& dir, int timeout_s = 120) {
    const CmdResult r = run_binary(run_opts.args(dir), timeout_s);
    EXPECT_EQ(r.rc, 0) << r.describe();
    const json rep = load_json(dir.str("report.json"));
    EXPECT_TRUE(rep.is_object()) << r.describe();
    if (!rep.is_object()) return rep;
    EXPECT_EQ(rep.value("requests_completed", -1), run_opts.requests) << rep.dump(1);
    EXPECT_EQ(rep.value("requests_failed", -1), 0);
    return rep;
}

// Every request's tokens in `rep` against the GPU model run on that request alone on GPU 0.
void expect_solo_tokens(const TestbedRun& run_opts, const json& rep) {
    expect_solo_gpu_tokens(run_opts.options(), rep);
}

TEST(TestbedGpu, TinyColocatedOnOneGpu) {
    if (std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_tiny");
    const TestbedRun gpu;
    const json rep = run_ok(gpu, dir);
    ASSERT_TRUE(rep.is_object());

    // The config names the backend and the GPU, as the CUDA runtime names it.
    auto dev = runtime::cuda::query_cuda_device(0);
    ASSERT_OK(dev);
    EXPECT_EQ(rep["config"]["backend"], "cuda");
    EXPECT_EQ(rep["config"]["gpu"]["name"], dev->name);
    EXPECT_EQ(rep["config"]["gpu"]["device"], 0);
    EXPECT_TRUE(rep["config"]["decode_graphs"].get<bool>());
    ASSERT_TRUE(rep["ranks"].is_array());
    ASSERT_FALSE(rep["ranks"].empty());
    ASSERT_TRUE(rep["ranks"][0].contains("stats")) << rep["ranks"].dump(1);
    const json& stats = rep["ranks"][0]["stats"];
    EXPECT_EQ(stats.value("device", ""), "cuda:0 (" + dev->name + ")");
    EXPECT_THAT(stats.value("decode_graphs", ""), StartsWith("on (buckets 1,2,4,"));

    // The same keys as a CPU run of the same requests (a one-instance CPU topology).
    TempDir cpu_dir("tb_gpu_tiny_cpu");
    TestbedRun cpu = gpu;
    cpu.backend = "cpu";
    cpu.topology = "cpu-1p1d";
    const json cpu_rep = run_ok(cpu, cpu_dir);
    ASSERT_TRUE(cpu_rep.is_object());
    EXPECT_EQ(keys(rep), keys(cpu_rep));
    // Not promised equal (bf16 on the GPU, fp32 on the CPU): printed for the record.
    int same = 0, total = 0;
    for (size_t i = 0; i < static_cast<size_t>(gpu.requests); ++i) {
        const auto a = report_tokens(rep, i);
        const auto b = report_tokens(cpu_rep, i);
        for (size_t t = 0; t < std::min(a.size(), b.size()); ++t, ++total) same += a[t] == b[t];
    }
    std::cout << "[ info ] GPU vs CPU testbed tokens (not promised equal): " << same << "/" << total
              << " equal\n";

    // The compute track: per-layer slices of eager forwards, whole-forward slices of replays.
    const json tl = load_json(dir.str("timeline.json"));
    ASSERT_TRUE(tl.contains("traceEvents"));
    int layers = 0, graphs = 0;
    for (const json& e : tl["traceEvents"]) {
        if (e.value("cat", "") != "compute") continue;
        const std::string name = e.value("name", "");
        layers += name.rfind("L0 extend", 0) == 0;
        graphs += name.find("(graph bucket") != std::string::npos;
        EXPECT_GE(e.value("dur", -1.0), 0.0) << name;
    }
    EXPECT_GT(layers, 0);
    EXPECT_GT(graphs, 0);
    EXPECT_GT(stats.value("graph_forwards", 0), 0);

    expect_solo_tokens(gpu, rep);

    // Eager decode: the same tokens (replay == eager).
    TempDir eager_dir("tb_gpu_tiny_eager");
    TestbedRun eager = gpu;
    eager.decode_graphs = false;
    const json eager_rep = run_ok(eager, eager_dir);
    ASSERT_TRUE(eager_rep.is_object());
    EXPECT_EQ(eager_rep["ranks"][0]["stats"].value("graph_forwards", -1), 0);
    EXPECT_EQ(eager_rep["ranks"][0]["stats"].value("decode_graphs", ""),
              "off (--decode-graphs off)");
    for (size_t i = 0; i < static_cast<size_t>(gpu.requests); ++i) {
        EXPECT_EQ(report_tokens(eager_rep, i), report_tokens(rep, i)) << "request " << i;
    }
}

TEST(TestbedGpu, Llama3With2LayersColocatedOnOneGpu) {
    if (std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_llama");
    TestbedRun run_opts;
    run_opts.model = "llama3-8b";
    run_opts.layers = 2;
    run_opts.requests = 4;
    const json rep = run_ok(run_opts, dir, 180);
    ASSERT_TRUE(rep.is_object());
    EXPECT_EQ(rep["config"]["model"]["name"], "llama3-8b");
    EXPECT_EQ(rep["config"]["model"]["num_layers"], 2);
    expect_solo_tokens(run_opts, rep);
}

}  // namespace
}  // namespace pdsim::test
