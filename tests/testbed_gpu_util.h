// What the GPU testbed tests (label cuda: tests/testbed_gpu_test.cpp, testbed_gpu_disagg_test.cpp,
// testbed_gpu_fault_test.cpp) share: why to skip (no CUDA build, no GPU), the pdsim they run
// ($PDSIM_GPU_TEST_PDSIM when set: scripts/gpu_check.sh's bundled pdsim behind its loader; else the
// pdsim this test was built with), a bounded run of it, its JSON outputs, and the oracle for a GPU
// run's tokens: the GPU model run on each request alone on GPU 0 (tests/testbed_solo_oracle.h).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_synthetic_model.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/device.h"
#include "sim/testbed/gpu_plan.h"
#include "sim/testbed/options.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "tests/testbed_solo_oracle.h"

namespace pdsim::test {

// Why a GPU test cannot run here ("" when it can): the build's, or the CUDA runtime's reason.
inline std::string gpu_skip_reason() {
    if (std::string why = testbed::system_gpu_probe().build_problem(); !why.empty()) return why;
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->device_count() > 0 ? std::string() : (*rt)->unavailable_reason();
}

// GPUs this process sees (0 without CUDA).
inline int gpu_count() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    return rt.ok() ? (*rt)->device_count() : 0;
}

inline std::string gpu_pdsim_command() {
    const char* env = std::getenv("PDSIM_GPU_TEST_PDSIM");
    if (env != nullptr && *env != '\0') return env;
    return shell_quote(PDSIM_BINARY);
}

// `pdsim <args>` (see gpu_pdsim_command), bounded by `timeout_s`; `wall_s` (not null) gets how long
// it ran.
inline CmdResult run_gpu_pdsim(const std::vector<std::string>& args, int timeout_s,
                               double* wall_s = nullptr) {
    return run_command(gpu_pdsim_command(), args, timeout_s, wall_s);
}

inline nlohmann::json load_json(const std::string& path) {
    std::ifstream f(path);
    if (!f) return nlohmann::json();
    return nlohmann::json::parse(f, nullptr, false);
}

// Every request's tokens in `rep` (a report of a run with `options`, single-chunk prompts) against
// the GPU model run on that request alone on GPU 0, sized as the run sizes it (its GEMM plans,
// and so its bits, depend on max_tokens and max_bs: gemm.h) and sliced where the run is (a run
// with a TP > 1 instance). `num_pages` sizes the oracle's pool for the run's longest request.
inline void expect_solo_gpu_tokens(const testbed::TestbedOptions& options,
                                   const nlohmann::json& rep, int num_pages = 32) {
    auto cfg = testbed::resolve(options, 1);
    ASSERT_OK(cfg);
    // Declared in construction order: the stream first, destroyed last (after the model, the
    // pool and the backend, which enqueue on it).
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    ASSERT_OK(rt);
    auto stream = (*rt)->create_stream(0, "oracle");
    ASSERT_OK(stream);
    model::cuda::CudaModelOptions mo = cfg->gpu_model;
    mo.device = 0;
    auto model = model::cuda::CudaSyntheticModel::create(cfg->model, nullptr, mo);
    ASSERT_OK(model);
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg->model.num_layers;
    pc.num_kv_heads = cfg->model.num_kv_heads;
    pc.head_dim = cfg->model.head_dim;
    pc.page_size = cfg->options.page_size;
    pc.num_pages = num_pages;
    pc.dtype = kv::KVDtype::kBF16;
    pc.device = {runtime::DeviceKind::kCuda, 0};
    auto pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(pool);
    attn::AttentionConfig ac;
    ac.num_q_heads = cfg->model.num_q_heads;
    ac.num_kv_heads = cfg->model.num_kv_heads;
    ac.head_dim = cfg->model.head_dim;
    ac.kv_dtype = kv::KVDtype::kBF16;
    ac.stream = stream->get();
    auto backend = attn::create_attention_backend("cuda", ac);
    ASSERT_OK(backend);
    int compared = 0;
    for (size_t i = 0; i < cfg->requests.size(); ++i) {
        SCOPED_TRACE("request " + std::to_string(i));
        const std::vector<int32_t> got = report_tokens(rep, i);
        ASSERT_EQ(static_cast<int>(got.size()), cfg->requests[i].output_len);
        auto want = solo_tokens(**model, **backend, **pool, **stream, testbed_prompt(*cfg, i),
                                cfg->requests[i].output_len);
        ASSERT_OK(want);
        EXPECT_EQ(got, *want);
        compared += static_cast<int>(got.size());
    }
    EXPECT_GE(compared, static_cast<int>(cfg->requests.size()));
}

// The transfer engine's refusal of a device KV layout, as a disaggregated GPU run reports it: exit
// 1, "<phase> phase set-up failed on rank R: ..." with the engine's kUnimplemented (the engine
// takes device layouts, so the tests fail on it). Returns the error line, or "" when `r` is not
// that refusal.
inline std::string engine_refusal(const CmdResult& r) {
    if (r.rc != 1) return {};
    const size_t at = r.err.find("phase set-up failed on rank");
    if (at == std::string::npos || r.err.find("UNIMPLEMENTED") == std::string::npos) return {};
    const size_t begin = r.err.rfind('\n', at);
    const size_t end = r.err.find('\n', at);
    return r.err.substr(begin == std::string::npos ? 0 : begin + 1,
                        end == std::string::npos
                            ? std::string::npos
                            : end - (begin == std::string::npos ? 0 : begin + 1));
}

// The first engine refusal a test binary saw ("" while none): later tests of that binary fail at
// once without spending device time on a run the engine would refuse the same way.
inline std::string& first_engine_refusal() {
    static std::string refusal;
    return refusal;
}

// How long a run refused by the engine may take, at most: the GPU set-up of both ranks (and, with
// --mode both, the colocated phase) and the agreement; no request timeout is waited for.
inline constexpr double kRefusalBoundS = 30;

// A disaggregated GPU run of `pdsim testbed` (tiny by default), as flags and as TestbedOptions.
struct GpuPdRun {
    std::string topology = "gpu-1p1d";
    std::string mode = "both";
    std::string model = "tiny";
    int layers = 0;
    int requests = 8;  // synthetic, unless `trace`
    std::string trace;
    int max_input_len = 128;  // prompts of one chunk (chunk size 512)
    int max_output_len = 8;
    int chunk_size = 512;
    int max_batch_tokens = 2048;
    int max_decode_batch = 8;
    int kv_pool_mb = 256;
    std::string fault = "none";
    std::string data_transport = "auto";  // --data-transport
    bool device_gate = true;              // --device-gate
    // Above kRefusalBoundS: a run that waited for a request timeout is told from one that stopped
    // at set-up.
    double request_timeout_s = 40;

    [[nodiscard]] testbed::TestbedOptions options() const {
        testbed::TestbedOptions o{.topology = topology,
                                  .model = model,
                                  .layers = layers,
                                  .trace = trace,
                                  .synthetic = trace.empty() ? requests : 0,
                                  .seed = 5,
                                  .max_input_len = max_input_len,
                                  .max_output_len = max_output_len,
                                  .data_transport = data_transport,
                                  .backend = "cuda",
                                  .mode = *testbed::parse_mode(mode),
                                  .fault = *testbed::parse_fault(fault),
                                  .chunk_size = chunk_size,
                                  .max_batch_tokens = max_batch_tokens,
                                  .max_decode_batch = max_decode_batch,
                                  .kv_pool_mb = kv_pool_mb,
                                  .request_timeout_s = request_timeout_s};
        o.device_gate = device_gate;
        return o;
    }
    [[nodiscard]] std::vector<std::string> args(const TempDir& dir) const {
        std::vector<std::string> a = {"testbed",
                                      "--backend",
                                      "cuda",
                                      "--topology",
                                      topology,
                                      "--mode",
                                      mode,
                                      "--model",
                                      model,
                                      "--seed",
                                      "5",
                                      "--max-input-len",
                                      std::to_string(max_input_len),
                                      "--max-output-len",
                                      std::to_string(max_output_len),
                                      "--chunk-size",
                                      std::to_string(chunk_size),
                                      "--max-batch-tokens",
                                      std::to_string(max_batch_tokens),
                                      "--max-decode-batch",
                                      std::to_string(max_decode_batch),
                                      "--kv-pool-mb",
                                      std::to_string(kv_pool_mb),
                                      "--fault",
                                      fault,
                                      "--request-timeout-s",
                                      std::to_string(request_timeout_s),
                                      "--quiet",
                                      "--report",
                                      dir.str("report.json")};
        if (trace.empty()) {
            a.insert(a.end(), {"--synthetic", std::to_string(requests)});
        } else {
            a.insert(a.end(), {"--trace", trace});
        }
        if (layers > 0) a.insert(a.end(), {"--layers", std::to_string(layers)});
        a.insert(a.end(),
                 {"--data-transport", data_transport, "--device-gate", device_gate ? "on" : "off"});
        return a;
    }
};

}  // namespace pdsim::test
