// `pdsim bench attention --backend cuda` without a GPU (label unit): the host logic of
// sim/cli/bench_attention_cuda.h against oracles written here (causal pair and FLOP counts by
// brute force, the decode's bytes, the GEMM dims' FLOPs, the per-layer roofline from the formulas
// of docs/cost-models.md, the GPU name match), the flag checks, and the real binary: bad flags
// exit 2 naming the flag, and the bench itself fails cleanly, "no device" (exit 1) in a CUDA
// build, "--backend cuda: pdsim was built without ..." (exit 2) otherwise. On a machine with a GPU
// the binary runs the bench instead; that case skips here (bench_attention_cuda_gpu_test covers
// it).
#include "sim/cli/bench_attention_cuda.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::cli {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// ---- counts -----------------------------------------------------------------------------------

TEST(BenchAttentionCudaCounts, CausalPairsMatchABruteForceCount) {
    for (int len : {1, 2, 7, 64, 4096}) {
        double per_request = 0;  // query q attends key k iff k <= q
        for (int q = 0; q < len; ++q) {
            for (int key = 0; key < len; ++key) per_request += key <= q ? 1 : 0;
        }
        for (int bs : {1, 3}) {
            const double pairs = bs * per_request;
            EXPECT_EQ(causal_pairs(bs, len), pairs) << bs << " x " << len;
            // Q K^T (head_dim multiply-adds per pair) and P V (v_head_dim), per query head.
            EXPECT_EQ(extend_causal_flops(bs, len, 32, 128, 128),
                      pairs * 32 * (2.0 * 128 + 2.0 * 128));
            EXPECT_EQ(extend_causal_flops(bs, len, 8, 64, 32), pairs * 8 * (2.0 * 64 + 2.0 * 32));
        }
    }
}

TEST(BenchAttentionCudaCounts, DecodeTrafficIsKvPlusQueriesAndOutputsInBf16) {
    // llama3-8b attention: 8 KV heads of 128 (K and V), 32 query heads.
    const double kv = 64.0 * 4096 * 8 * (128 + 128) * 2;
    const double q_out = 2.0 * 64 * 32 * 128 * 2;
    EXPECT_EQ(decode_traffic_bytes(64, 4096, 32, 8, 128, 128), kv + q_out);
    EXPECT_EQ(decode_traffic_bytes(1, 1, 1, 1, 64, 64), (64 + 64) * 2 + 2 * 64 * 2);
}

TEST(BenchAttentionCudaCounts, CopyBaselineIsAtLeast256MiBAndCoversTheDecode) {
    constexpr int64_t kMiB = int64_t{1} << 20;
    EXPECT_EQ(decode_copy_bytes(1), 256 * kMiB);
    EXPECT_EQ(decode_copy_bytes(256.0 * kMiB), 256 * kMiB);
    EXPECT_EQ(decode_copy_bytes(256.0 * kMiB + 1), 257 * kMiB);
    const double llama_decode = decode_traffic_bytes(64, 4096, 32, 8, 128, 128);
    EXPECT_GE(static_cast<double>(decode_copy_bytes(llama_decode)), llama_decode);
    EXPECT_LT(static_cast<double>(decode_copy_bytes(llama_decode)), llama_decode + kMiB);
}

TEST(BenchAttentionCudaCounts, GemmDimsHaveTheFlopsSquareishAndAligned) {
    const double llama_extend = extend_causal_flops(4, 4096, 32, 128, 128);
    for (double flops : {1.0, 1e6, 1.35e8, 3e9, llama_extend, 1e13}) {
        SCOPED_TRACE(flops);
        auto d = gemm_dims_for_flops(flops);
        ASSERT_OK(d);
        EXPECT_EQ(d->n, d->k);
        EXPECT_EQ(d->n % 256, 0);
        EXPECT_EQ(d->m % 8, 0);
        EXPECT_GE(d->m, 8);
        EXPECT_GE(d->n, 256);
        EXPECT_EQ(d->flops(), 2.0 * d->m * d->n * d->k);
        if (flops >= 2.0 * 8 * 256 * 256) {
            EXPECT_LE(std::fabs(d->flops() - flops), 8.0 * d->n * d->k);
        }
        // Square-ish once the 256 floor no longer dominates: n off cbrt(flops / 2) by at most
        // 128 puts m off n by a factor (1 + 128 / n)^3 at most.
        const double aspect = static_cast<double>(d->m) / static_cast<double>(d->n);
        if (flops >= 1e9) {
            EXPECT_GT(aspect, 0.5);
            EXPECT_LT(aspect, 2.0);
            EXPECT_LT(std::fabs(d->flops() / flops - 1.0), 0.01);
        }
        if (flops >= 3e11) {
            EXPECT_LT(std::fabs(aspect - 1.0), 0.1);
        }
    }
    EXPECT_EQ(gemm_dims_for_flops(0).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(gemm_dims_for_flops(-5).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(gemm_dims_for_flops(1e40).status().code(), StatusCode::kInvalidArgument);
}

// The report of a run (host logic): the JSON's derived figures from made-up results, against
// values worked out here.
TEST(BenchAttentionCudaReport, JsonDerivesTheFiguresFromTheResults) {
    CudaBenchOptions o;
    CudaBenchResults r;
    r.device.name = "NVIDIA Test GPU";
    r.device.cc_major = 9;
    r.decode.bytes = 4e9;
    r.decode.seconds_best = 0.5;
    r.decode.ratio = 0.80;  // above the 0.75 target
    r.extend.flops = 6e12;
    r.extend.seconds_best = 2.0;
    r.extend.ratio = 0.30;  // below the 0.40 target
    r.extend.gemm = {8, 256, 256};
    r.model.config.name = "tiny";
    r.model.prefill.per_layer_ms = 3;
    r.model.prefill.roofline_ms = 2;
    r.model.prefill.roofline_peak_ms = 1;
    const nlohmann::json j = cuda_bench_json(o, r);
    EXPECT_EQ(j["decode"]["pass"], true);
    EXPECT_EQ(j["extend"]["pass"], false);
    EXPECT_DOUBLE_EQ(j["decode"]["gbps_best"].get<double>(), 4e9 / 0.5 / 1e9);
    EXPECT_DOUBLE_EQ(j["extend"]["gflops_best"].get<double>(), 6e12 / 2.0 / 1e9);
    EXPECT_DOUBLE_EQ(j["extend"]["baseline_flops"].get<double>(), 2.0 * 8 * 256 * 256);
    EXPECT_DOUBLE_EQ(j["model"]["prefill"]["ratio"].get<double>(), 1.5);
    EXPECT_TRUE(j["model"]["decode"]["ratio"].is_null());  // no roofline for the decode phase
    EXPECT_EQ(j["model"]["decode"]["batch"], o.decode_batch);
    EXPECT_EQ(j["device"]["compute_capability"], "9.0");
    EXPECT_TRUE(j["device"]["gpu_spec"].is_null());
}

// ---- the GPU spec of a device name --------------------------------------------------------------

TEST(BenchAttentionCudaGpuSpec, MatchesTheNamesTheRuntimeReports) {
    const std::vector<std::pair<std::string, std::string>> cases{
        {"NVIDIA H200", "H200"},
        {"NVIDIA H100 80GB HBM3", "H100"},
        {"NVIDIA A100-SXM4-80GB", "A100"},
        {"NVIDIA A100-SXM4-40GB", "A100"},
        {"NVIDIA B200", "B200"},
        {"NVIDIA GB200", "GB200"},
        {"H100 SXM5", "H100"},
    };
    for (const auto& [name, spec] : cases) {
        const GpuSpecMatch m = match_gpu_spec(name);
        ASSERT_NE(m.spec, nullptr) << name << ": " << m.reason;
        EXPECT_EQ(m.spec->name, spec) << name;
        EXPECT_THAT(m.reason, IsEmpty());
    }
}

TEST(BenchAttentionCudaGpuSpec, RefusesOtherPartsAndSaysWhy) {
    for (const std::string name : {"NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA H100 NVL"}) {
        const GpuSpecMatch m = match_gpu_spec(name);
        EXPECT_EQ(m.spec, nullptr) << name;
        EXPECT_THAT(m.reason, AllOf(HasSubstr(name), HasSubstr("SXM parts"))) << name;
    }
    for (const std::string name :
         {"NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "Tesla T4", "NVIDIA L40S", ""}) {
        const GpuSpecMatch m = match_gpu_spec(name);
        EXPECT_EQ(m.spec, nullptr) << name;
        EXPECT_THAT(m.reason, HasSubstr("is not in the GPU spec table (A100, H100, H200")) << name;
    }
}

// ---- the per-layer roofline ---------------------------------------------------------------------

// docs/cost-models.md's roofline for one MHA/GQA layer at TP 1, bf16 weights and KV.
struct Oracle {
    double peak_flops, bytes_per_s;
    double layer(const model::ModelConfig& m, double tokens, double pairs, double kv_read,
                 double kv_write) const {
        const double H = m.hidden, HQ = m.num_q_heads, HKV = m.num_kv_heads, D = m.head_dim;
        const double params = H * (HQ + 2 * HKV) * D + HQ * D * H + 3 * H * m.intermediate;
        const double gemm = std::max(2 * tokens * params / peak_flops, 2 * params / bytes_per_s);
        const double attn_flops = 2 * HQ * (2 * D) * pairs;
        const double attn_bytes = (kv_read + kv_write) * (2 * HKV * D) * 2;
        return gemm + std::max(attn_flops / peak_flops, attn_bytes / bytes_per_s);
    }
};

TEST(BenchAttentionCudaRoofline, PerLayerIsTheCostModelsLayerTermOnTheDetectedGpu) {
    model::ModelConfig cfg = *model::resolve_model("llama3-8b");
    const topo::GpuSpec& h200 = *topo::gpu_spec("H200");
    for (double mfu : {0.5, 1.0}) {
        const double mbu = mfu == 1.0 ? 1.0 : 0.8;
        const Oracle o{h200.bf16_tflops * 1e12 * mfu, h200.hbm_gbps * 1e9 * mbu};
        for (int layers : {1, 4}) {
            cfg.num_layers = layers;
            auto r = roofline_per_layer(cfg, "H200", 4096, 64, 64 * 4096, mfu, mbu);
            ASSERT_OK(r);
            const double prefill = o.layer(cfg, 4096, 4096.0 * 4097 / 2, 4096, 4096);
            const double decode = o.layer(cfg, 64, 64.0 * 4096, 64.0 * 4096, 64);
            EXPECT_NEAR(r->prefill_s, prefill, prefill * 1e-9) << layers << " layers";
            EXPECT_NEAR(r->decode_s, decode, decode * 1e-9) << layers << " layers";
            EXPECT_THAT(r->describe, HasSubstr("roofline H200 tp1"));
        }
    }
}

TEST(BenchAttentionCudaRoofline, UnknownGpuIsInvalidArgument) {
    model::ModelConfig cfg = *model::resolve_model("llama3-8b");
    auto r = roofline_per_layer(cfg, "RTX4090", 16, 1, 16);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("not a GPU of the spec table"));
}

// ---- option checks ------------------------------------------------------------------------------

TEST(BenchAttentionCudaOptions, DefaultsAreLlama8bShapesAndPass) {
    const CudaBenchOptions o;
    EXPECT_EQ(o.q_heads, 32);
    EXPECT_EQ(o.kv_heads, 8);
    EXPECT_EQ(o.head_dim, 128);
    EXPECT_EQ(o.decode_batch, 64);
    EXPECT_EQ(o.decode_len, 4096);
    EXPECT_EQ(o.extend_batch, 4);
    EXPECT_EQ(o.extend_len, 4096);
    EXPECT_EQ(o.model, "llama3-8b");
    EXPECT_EQ(o.layers, 4);
    EXPECT_OK(check_cuda_bench_options(o));
    auto cfg = bench_model_config(o);
    ASSERT_OK(cfg);
    EXPECT_EQ(cfg->num_layers, 4);
    EXPECT_EQ(cfg->hidden, 4096);
    const model::cuda::CudaModelOptions m = bench_model_options(o);
    EXPECT_EQ(m.max_tokens, 4096);
    EXPECT_EQ(m.max_bs, 64);
    EXPECT_EQ(m.max_positions, 4096);
}

TEST(BenchAttentionCudaOptions, BadOptionsNameTheFlag) {
    struct Case {
        std::string expect;
        std::function<void(CudaBenchOptions&)> edit;
    };
    const std::vector<Case> cases{
        {"--kv-heads 5", [](CudaBenchOptions& o) { o.kv_heads = 5; }},
        {"--head-dim 96", [](CudaBenchOptions& o) { o.head_dim = 96; }},
        {"--q-heads 40 --kv-heads 8", [](CudaBenchOptions& o) { o.q_heads = 40; }},  // group 5
        {"--decode-batch 0", [](CudaBenchOptions& o) { o.decode_batch = 0; }},
        {"--extend-len 0", [](CudaBenchOptions& o) { o.extend_len = 0; }},
        {"--reps 0", [](CudaBenchOptions& o) { o.reps = 0; }},
        {"--warmup -1", [](CudaBenchOptions& o) { o.warmup = -1; }},
        {"--layers 0", [](CudaBenchOptions& o) { o.layers = 0; }},
        {"--model no-such-model", [](CudaBenchOptions& o) { o.model = "no-such-model"; }},
        {"--model deepseek-v3", [](CudaBenchOptions& o) { o.model = "deepseek-v3"; }},  // MLA
        {"more KV slots than int32",
         [](CudaBenchOptions& o) {
             o.decode_batch = 4096;
             o.decode_len = 1 << 20;
         }},
    };
    for (const Case& c : cases) {
        CudaBenchOptions o;
        c.edit(o);
        const Status st = check_cuda_bench_options(o);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.expect << ": " << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr(c.expect));
    }
}

// ---- the binary ---------------------------------------------------------------------------------

const std::vector<std::string> kTiny{"bench",           "attention", "--backend",    "cuda",
                                     "--decode-batch",  "2",         "--decode-len", "64",
                                     "--extend-batch",  "1",         "--extend-len", "64",
                                     "--model",         "tiny",      "--layers",     "1",
                                     "--model-prefill", "32",        "--reps",       "2"};

TEST(BenchAttentionCudaCli, FailsCleanlyWithoutAGpu) {
    test::TempDir dir("bench_attention_cuda");
    std::vector<std::string> args = kTiny;
    args.insert(args.end(), {"--json", dir.str("out.json")});
    const test::CmdResult r = test::run_pdsim(args, 300);
    if (r.rc == 0) GTEST_SKIP() << "a GPU ran the bench (bench_attention_cuda_gpu_test checks it)";
    if (r.rc == 1) {  // built with CUDA and FlashInfer: no device here
        EXPECT_THAT(r.err, HasSubstr("bench attention --backend cuda: no device")) << r.describe();
    } else {
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("--backend cuda: pdsim was built without")) << r.describe();
    }
    EXPECT_THAT(r.err, Not(HasSubstr("Segmentation"))) << r.describe();
    EXPECT_THAT(r.out, IsEmpty()) << "no table without a measurement";
}

TEST(BenchAttentionCudaCli, BadFlagsExitWith2NamingTheFlag) {
    struct Case {
        std::vector<std::string> extra;
        std::string expect;
    };
    const std::vector<Case> cases{
        {{"--backend", "cuda", "--dtype", "fp32"}, "--dtype fp32: --backend cuda measures bf16"},
        {{"--backend", "cuda", "--threads", "4"}, "--threads"},
        {{"--backend", "cuda", "--kv-heads", "5"}, "--kv-heads 5"},
        {{"--backend", "cuda", "--head-dim", "96"}, "--head-dim 96"},
        {{"--backend", "cuda", "--model", "no-such-model"}, "--model no-such-model"},
        {{"--backend", "cuda", "--model", "deepseek-v3"}, "--model deepseek-v3"},
        {{"--backend", "cuda", "--layers", "0"}, "--layers"},
        {{"--backend", "cuda", "--reps", "-3"}, "--reps"},
        {{"--backend", "cpu", "--layers", "2"}, "--layers: only with --backend cuda"},
        {{"--backend", "cpu_ref", "--model", "tiny"}, "--model: only with --backend cuda"},
    };
    for (const Case& c : cases) {
        std::vector<std::string> args{"bench", "attention"};
        args.insert(args.end(), c.extra.begin(), c.extra.end());
        const test::CmdResult r = test::run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.expect)) << r.describe();
    }
}

}  // namespace
}  // namespace pdsim::cli
