// `pdsim testbed --backend cuda --mode both` on one node (label cuda), end to end: the real binary,
// every rank a thread of one process (`local` control transport), the KV over cuda_ipc (one-sided
// writes into the decode rank's bf16 device pool), the prefill ranks' device StepCounter, the
// ordering validator on (docs/testbed.md "GPU rank"):
//  - tiny on gpu-1p1d (one GPU: the prefill and the decode instance share it), 8 synthetic
//    single-chunk requests: exit 0; every request completes in both runs; 0 ordering violations
//    over a positive number of checked layers; the disaggregated tokens equal the colocated tokens
//    (outputs_match), and both equal the GPU model run on each request alone (an oracle outside
//    the testbed); the KV bytes received are exactly what the requests' prompts hold (layers x K,V
//    x KV heads x head_dim x 2 bytes per token); the config names the transports;
//  - the same on gpu-2g-1p1d (prefill on GPU 0, decode on GPU 1) where two GPUs are visible, and
//    there over nccl (--data-transport nccl: the engine's ordered plane);
//  - tiny on gpu-1p1d with --device-gate off (the host posts each layer once it sees the record);
//  - tiny on gpu-1p1d-tp2-to-tp1 (one GPU: a TP-2 prefill instance, its two ranks time-sharing
//    it, and a TP-1 decode instance): GPU tensor parallelism (the sliced forward, its partials
//    exchanged on the host) and heterogeneous TP (each prefill rank writes its KV heads into the
//    decode pool, and adds to the arrival words); tokens equal the colocated run's and the
//    sliced TP 1 model's on each request alone;
//  - the same TP 2 -> 1 on gpu-2g-1p1d-tp2-to-tp1 where two GPUs are visible: the prefill TP ranks
//    on GPUs 0 and 1, exchanging their partials over NCCL (--tp-exchange auto);
//  - llama3-8b --layers 2 with two 4096-token prompts (one chunk each) on gpu-1p1d.
// Should the engine refuse the device layouts at set-up (a regression), a run ends at once with
// exit 1 ("disagg phase set-up failed on rank R: ..."): these tests check that it stopped there
// (no hang: well under the request timeout) and fail with that message.
// Skips where there is no GPU, before spawning anything.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "tests/testbed_gpu_util.h"
#include "tests/testbed_solo_oracle.h"

namespace pdsim::test {
namespace {

using nlohmann::json;

// KV bytes of `tokens` prompt tokens of the run's model (bf16, every layer, K and V).
int64_t kv_bytes(const testbed::TestbedOptions& options, int64_t tokens) {
    auto cfg = testbed::resolve(options, 1);
    EXPECT_OK(cfg);
    if (!cfg.ok()) return -1;
    const model::ModelConfig& m = cfg->model;
    return tokens * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2;
}

int64_t prompt_tokens(const testbed::TestbedOptions& options) {
    auto cfg = testbed::resolve(options, 1);
    EXPECT_OK(cfg);
    int64_t n = 0;
    if (cfg.ok()) {
        for (const auto& r : cfg->requests) n += r.input_len;
    }
    return n;
}

// Runs `run`; on the engine's refusal of device layouts (in this run or an earlier one of this
// binary) checks that it was a prompt, clear error and returns false (the caller fails: the engine
// takes device layouts, so a refusal is a bug; later tests fail at once instead of spending device
// time on the same refusal); else expects exit 0, puts the report in `rep` and returns true.
bool run_clean(const GpuPdRun& run, const TempDir& dir, json* rep, int timeout_s = 150) {
    if (!first_engine_refusal().empty()) return false;
    double wall_s = 0;
    const CmdResult r = run_gpu_pdsim(run.args(dir), timeout_s, &wall_s);
    if (const std::string refusal = engine_refusal(r); !refusal.empty()) {
        EXPECT_LT(wall_s, kRefusalBoundS) << "the refusal must stop the run at set-up";
        EXPECT_THAT(refusal, ::testing::HasSubstr("disagg phase set-up failed on rank"));
        std::cout << "[ refused ] " << refusal << " (" << wall_s << " s)\n";
        first_engine_refusal() = refusal;
        return false;
    }
    EXPECT_EQ(r.rc, 0) << r.describe();
    *rep = load_json(dir.str("report.json"));
    EXPECT_TRUE(rep->is_object()) << r.describe();
    return true;
}

// What every clean disaggregated run must show.
void expect_clean(const GpuPdRun& run, const json& rep) {
    const int n = static_cast<int>(run.options().trace.empty() ? run.requests : 0);
    const int submitted = rep.value("requests_submitted", -1);
    if (n > 0) {
        EXPECT_EQ(submitted, n);
    }
    EXPECT_EQ(rep.value("requests_completed", -1), submitted) << rep.dump(1).substr(0, 4000);
    EXPECT_EQ(rep.value("requests_failed", -1), 0);
    ASSERT_TRUE(rep.contains("ordering"));
    EXPECT_EQ(rep["ordering"].value("violations", -1), 0) << rep["ordering"].dump(1);
    EXPECT_GT(rep["ordering"].value("checked_layers", 0), 0);
    EXPECT_EQ(rep["config"]["backend"], "cuda");
    EXPECT_EQ(rep["config"]["transport"], "local");
    EXPECT_EQ(rep["config"]["data_transport"],
              run.data_transport == "auto" ? "cuda_ipc" : run.data_transport);
    EXPECT_EQ(rep["config"].value("device_gate", !run.device_gate), run.device_gate);
    const testbed::TestbedOptions o = run.options();
    EXPECT_EQ(rep["transfer"].value("bytes", int64_t{-1}), kv_bytes(o, prompt_tokens(o)));
    if (run.mode == "both") {
        ASSERT_TRUE(rep.contains("colocated"));
        EXPECT_EQ(rep["colocated"].value("requests_completed", -1), submitted);
        EXPECT_EQ(rep.value("outputs_match", false), true);
        for (int i = 0; i < submitted; ++i) {
            EXPECT_EQ(report_tokens(rep, static_cast<size_t>(i)),
                      report_tokens(rep["colocated"], static_cast<size_t>(i)))
                << "request " << i;
        }
    }
}

TEST(TestbedGpuDisagg, TinyBothOnOneGpu) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_pd_tiny");
    const GpuPdRun run;
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    // Both ranks on GPU 0, sending and receiving.
    ASSERT_TRUE(rep["ranks"].is_array());
    ASSERT_EQ(rep["ranks"].size(), 2u);
    EXPECT_THAT(rep["ranks"][0]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "));
    EXPECT_THAT(rep["ranks"][1]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "));
    EXPECT_GT(rep["ranks"][0]["stats"]["sender"].value("bytes", 0), 0);
    EXPECT_GT(rep["ranks"][1]["stats"]["receiver"].value("bytes", 0), 0);
    // cuda_ipc signals: the decode rank's compute stream waited on every request's arrival
    // words (cuStreamWaitValue64) before its decode forwards.
    EXPECT_EQ(rep["ranks"][1]["stats"].value("arrival_waits", -1),
              rep.value("requests_submitted", -2))
        << rep["ranks"][1]["stats"].dump(1);
    // The tokens, against the GPU model run on each request alone.
    expect_solo_gpu_tokens(run.options(), rep);
}

TEST(TestbedGpuDisagg, TinyTp2PrefillToTp1DecodeOnOneGpu) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_pd_tp2");
    GpuPdRun run;
    run.topology = "gpu-1p1d-tp2-to-tp1";
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    ASSERT_TRUE(rep["ranks"].is_array());
    ASSERT_EQ(rep["ranks"].size(), 3u);
    for (int r = 0; r < 3; ++r) {
        EXPECT_THAT(rep["ranks"][r]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "))
            << "rank " << r;
    }
    // Both prefill TP ranks sent their heads; the decode rank received them all (expect_clean
    // checked the total) and waited on every request's arrival words, which both sources add to.
    EXPECT_GT(rep["ranks"][0]["stats"]["sender"].value("bytes", 0), 0);
    EXPECT_GT(rep["ranks"][1]["stats"]["sender"].value("bytes", 0), 0);
    EXPECT_EQ(rep["ranks"][2]["stats"].value("arrival_waits", -1),
              rep.value("requests_submitted", -2))
        << rep["ranks"][2]["stats"].dump(1);
    EXPECT_EQ(rep["config"]["gpu_model"].value("sliced_reduction", false), true);
    // Both prefill TP ranks on one GPU: NCCL cannot hold them, so auto takes the host exchange.
    EXPECT_EQ(rep["config"]["gpu_model"].value("tp_exchange", ""), "host");
    expect_solo_gpu_tokens(run.options(), rep);
}

// gpu-2g-1p1d-tp2-to-tp1: the TP-2 prefill instance on GPUs 0 and 1, so its TP exchange runs on
// NCCL (--tp-exchange auto), and the TP-1 decode instance sharing GPU 0 (KV over cuda_ipc).
TEST(TestbedGpuDisagg, TinyTp2OverNcclOnTwoGpus) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    if (gpu_count() < 2)
        GTEST_SKIP() << "gpu-2g-1p1d-tp2-to-tp1 needs 2 GPUs, this process sees " << gpu_count();
    TempDir dir("tb_gpu_pd_tp2_nccl");
    GpuPdRun run;
    run.topology = "gpu-2g-1p1d-tp2-to-tp1";
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    ASSERT_EQ(rep["ranks"].size(), 3u);
    EXPECT_THAT(rep["ranks"][0]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "));
    EXPECT_THAT(rep["ranks"][1]["stats"].value("device", ""), ::testing::StartsWith("cuda:1 "));
    EXPECT_THAT(rep["ranks"][2]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "));
    EXPECT_GT(rep["ranks"][0]["stats"]["sender"].value("bytes", 0), 0);
    EXPECT_GT(rep["ranks"][1]["stats"]["sender"].value("bytes", 0), 0);
    EXPECT_EQ(rep["config"]["gpu_model"].value("tp_exchange", ""), "nccl");
    expect_solo_gpu_tokens(run.options(), rep);
}

TEST(TestbedGpuDisagg, TinyBothOnTwoGpus) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    if (gpu_count() < 2)
        GTEST_SKIP() << "gpu-2g-1p1d needs 2 GPUs, this process sees " << gpu_count();
    TempDir dir("tb_gpu_pd_2g");
    GpuPdRun run;
    run.topology = "gpu-2g-1p1d";
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    EXPECT_THAT(rep["ranks"][0]["stats"].value("device", ""), ::testing::StartsWith("cuda:0 "));
    EXPECT_THAT(rep["ranks"][1]["stats"].value("device", ""), ::testing::StartsWith("cuda:1 "));
}

// The gate's baseline: the host posts each layer's writes once it sees the record.
TEST(TestbedGpuDisagg, TinyBothOnOneGpuWithoutTheDeviceGate) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_pd_nogate");
    GpuPdRun run;
    run.device_gate = false;
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
}

// The KV over nccl (the engine's ordered plane: sends announced on the control transport, received
// in that order), one GPU per rank, the ranks threads of one process meeting in a directory.
TEST(TestbedGpuDisagg, TinyBothOnTwoGpusOverNccl) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    if (gpu_count() < 2)
        GTEST_SKIP() << "gpu-2g-1p1d needs 2 GPUs, this process sees " << gpu_count();
    TempDir dir("tb_gpu_pd_nccl");
    GpuPdRun run;
    run.topology = "gpu-2g-1p1d";
    run.data_transport = "nccl";
    json rep;
    if (!run_clean(run, dir, &rep)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    expect_solo_gpu_tokens(run.options(), rep);
}

// llama3-8b's shapes (head_dim 128, GQA 4) with 2 layers and two 4096-token prompts, each one
// chunk and one extend forward (--max-batch-tokens 4096 holds one of them).
TEST(TestbedGpuDisagg, Llama3TwoLayersLongPrompts) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    TempDir dir("tb_gpu_pd_llama");
    {
        std::ofstream trace(dir.str("trace.jsonl"));
        trace << R"({"timestamp": 0, "input_length": 4096, "output_length": 4, "hash_ids": [1]})"
              << "\n"
              << R"({"timestamp": 50, "input_length": 4096, "output_length": 4, "hash_ids": [2]})"
              << "\n";
    }
    GpuPdRun run;
    run.model = "llama3-8b";
    run.layers = 2;
    run.trace = dir.str("trace.jsonl");
    run.max_input_len = 4096;
    run.max_output_len = 4;
    run.chunk_size = 4096;
    run.max_batch_tokens = 4096;
    run.max_decode_batch = 2;
    run.kv_pool_mb = 1024;
    run.request_timeout_s = 60;
    json rep;
    if (!run_clean(run, dir, &rep, 240)) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    ASSERT_TRUE(rep.is_object());
    expect_clean(run, rep);
    EXPECT_EQ(rep.value("requests_submitted", -1), 2);
    EXPECT_EQ(rep["config"]["model"]["name"], "llama3-8b");
    EXPECT_EQ(rep["config"]["model"]["num_layers"], 2);
    expect_solo_gpu_tokens(run.options(), rep, /*num_pages=*/300);
}

}  // namespace
}  // namespace pdsim::test
