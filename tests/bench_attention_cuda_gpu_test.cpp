// `pdsim bench attention --backend cuda` on a GPU (label cuda), end to end at tiny sizes: the real
// binary runs every figure (decode vs the device copy, extend vs the cuBLASLt GEMM, the GPU model
// at llama3-8b shapes with one layer), exits 0, prints its table and writes the JSON keys
// docs/design.md "bench JSON" promises, with positive, finite figures and outputs checked against
// the bench's host oracle (it exits 1 with kDataLoss otherwise). Ratios are not checked here
// (tiny sizes measure launch latency); scripts/gpu_check.sh runs the full-size bench.
// Skips with the CUDA runtime's reason where there is no GPU (before spawning anything).
//
// The binary: $PDSIM_GPU_TEST_PDSIM when set (a command prefix, split by the shell: the GPU
// check's bundle runs pdsim through its own loader), else the pdsim this test was built with.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/cli_test_util.h"

namespace pdsim::cli {
namespace {

using ::testing::HasSubstr;

std::string skip_reason() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->unavailable_reason();
}

std::string pdsim_command() {
    const char* env = std::getenv("PDSIM_GPU_TEST_PDSIM");
    if (env != nullptr && *env != '\0') return env;
    return test::shell_quote(PDSIM_BINARY);
}

test::CmdResult run(const std::vector<std::string>& args, int timeout_s) {
    test::TempDir io("bench_cuda_cmd");
    std::string cmd = "timeout -k 5 ";
    cmd += std::to_string(timeout_s);
    cmd += " ";
    cmd += pdsim_command();
    // (Appended piece by piece: `" " + std::string` trips GCC 12's -Wrestrict false positive.)
    for (const auto& a : args) {
        cmd += ' ';
        cmd += test::shell_quote(a);
    }
    cmd += " >";
    cmd += test::shell_quote(io.str("out"));
    cmd += " 2>";
    cmd += test::shell_quote(io.str("err"));
    cmd += " </dev/null";
    test::CmdResult r;
    const int st = std::system(cmd.c_str());
    if (st != -1 && WIFEXITED(st)) {
        r.rc = WEXITSTATUS(st);
    } else if (st != -1 && WIFSIGNALED(st)) {
        r.rc = 128 + WTERMSIG(st);
    }
    r.out = test::slurp(io.path() / "out");
    r.err = test::slurp(io.path() / "err");
    return r;
}

void expect_positive(const nlohmann::json& j, const char* block, const char* key) {
    ASSERT_TRUE(j.contains(block)) << block;
    ASSERT_TRUE(j[block].contains(key)) << block << "." << key;
    ASSERT_TRUE(j[block][key].is_number()) << block << "." << key << ": " << j[block][key];
    const double v = j[block][key].get<double>();
    EXPECT_TRUE(std::isfinite(v) && v > 0) << block << "." << key << " = " << v;
}

TEST(BenchAttentionCudaGpu, TinyRunWritesTheReport) {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok() || (*rt)->device_count() == 0) GTEST_SKIP() << skip_reason();
    test::TempDir dir("bench_attention_cuda_gpu");
    const std::string json = dir.str("bench.json");
    const test::CmdResult r =
        run({"bench",        "attention", "--backend",       "cuda", "--decode-batch", "4",
             "--decode-len", "200",       "--extend-batch",  "2",    "--extend-len",   "100",
             "--layers",     "1",         "--model-prefill", "64",   "--reps",         "3",
             "--warmup",     "1",         "--json",          json},
            240);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("pdsim bench attention: backend cuda on"));
    EXPECT_THAT(r.out, HasSubstr("decode 4x200 KV tokens"));
    EXPECT_THAT(r.out, HasSubstr("extend 2x100 tokens causal"));
    EXPECT_THAT(r.out, HasSubstr("llama3-8b prefill 64 tok, per layer"));
    EXPECT_THAT(r.out, HasSubstr("outputs checked: finite, and against an fp64 host oracle"));

    const nlohmann::json j = nlohmann::json::parse(test::slurp(json));
    for (const char* key : {"gbps", "baseline_gbps", "ratio", "kv_bytes", "bytes", "seconds_median",
                            "seconds_best", "baseline_bytes"}) {
        expect_positive(j, "decode", key);
    }
    EXPECT_EQ(j["decode"]["target"], 0.75);
    EXPECT_EQ(j["decode"]["batch"], 4);
    EXPECT_EQ(j["decode"]["kv_len"], 200);
    EXPECT_EQ(j["decode"]["baseline"], "cuda_memcpy_d2d");
    EXPECT_TRUE(j["decode"]["pass"].is_boolean());
    for (const char* key : {"gflops", "baseline_gflops", "ratio", "flops", "seconds_median",
                            "baseline_flops", "baseline_m", "baseline_n", "baseline_k"}) {
        expect_positive(j, "extend", key);
    }
    EXPECT_EQ(j["extend"]["target"], 0.40);
    EXPECT_EQ(j["extend"]["baseline"], "cublaslt_bf16_gemm");
    // Exact causal FLOPs: 2 * (128 + 128) * 32 heads * 2 requests * 100 * 101 / 2 pairs.
    EXPECT_EQ(j["extend"]["flops"].get<double>(), 2.0 * 256 * 32 * 2 * 100 * 101 / 2);
    for (const char* block : {"decode", "extend"}) {
        EXPECT_LE(j[block]["max_abs_error"].get<double>(), 0.03) << block;
    }

    const nlohmann::json& m = j.at("model");
    EXPECT_EQ(m["name"], "llama3-8b");
    EXPECT_EQ(m["layers"], 1);
    for (const char* phase : {"prefill", "decode"}) {
        SCOPED_TRACE(phase);
        const nlohmann::json& p = m.at(phase);
        EXPECT_GT(p["per_layer_ms"].get<double>(), 0);
        EXPECT_GE(p["forward_ms"].get<double>(), p["per_layer_ms"].get<double>());
        EXPECT_EQ(p["layer_ms"].size(), 1u);
        if (m["roofline"].is_null()) {
            EXPECT_TRUE(p["ratio"].is_null());
        } else {
            EXPECT_GT(p["roofline_per_layer_ms"].get<double>(), 0);
            EXPECT_GT(p["roofline_per_layer_ms"].get<double>(),
                      p["roofline_peak_per_layer_ms"].get<double>());
            EXPECT_NEAR(p["ratio"].get<double>(),
                        p["per_layer_ms"].get<double>() / p["roofline_per_layer_ms"].get<double>(),
                        1e-9);
        }
    }
    EXPECT_EQ(m["prefill"]["tokens"], 64);
    EXPECT_EQ(m["decode"]["batch"], 4);

    const nlohmann::json& d = j.at("device");
    EXPECT_FALSE(d["name"].get<std::string>().empty());
    EXPECT_GT(d["sms"].get<int>(), 0);
    EXPECT_GT(d["memory_gib"].get<double>(), 0);
    EXPECT_EQ(m["roofline"].is_null(), d["gpu_spec"].is_null());
    std::printf("[ bench ] %s: decode %.1f GB/s (x%.2f), extend %.1f TFLOP/s (x%.2f), %s\n",
                d["name"].get<std::string>().c_str(), j["decode"]["gbps"].get<double>(),
                j["decode"]["ratio"].get<double>(), j["extend"]["gflops"].get<double>() / 1e3,
                j["extend"]["ratio"].get<double>(),
                m["roofline"].is_null() ? d["gpu_spec_reason"].get<std::string>().c_str()
                                        : m["roofline"].get<std::string>().c_str());
}

}  // namespace
}  // namespace pdsim::cli
