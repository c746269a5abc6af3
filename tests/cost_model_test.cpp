// Cost models (sim/cost): the roofline against numbers worked out by hand from the formulas of
// docs/cost-models.md, its monotonicity and TP scaling; the cost file's validation; the calibrated
// model against a hand-written file; the non-negative fit on data with known coefficients; and
// `pdsim calibrate --quick` end to end (a file that loads, sane fits, bad flags exit 2).
#include "sim/cost/cost_model.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "common/speed_probe.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/forward_check.h"
#include "sim/cost/timeline_fit.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::cost {
namespace {

using json = nlohmann::json;

model::ModelConfig named(const std::string& name) {
    auto m = model::resolve_model(name);
    EXPECT_OK(m);
    return *m;
}

InstanceSpec h100(const std::string& model, int tp) {
    InstanceSpec s;
    s.model = named(model);
    s.tp = tp;
    s.device = "H100";
    s.tp_link_gbps = 450;
    s.tp_link_latency_us = 3;
    s.kv_dtype_bytes = 2;
    return s;
}

std::unique_ptr<CostModel> roofline(const InstanceSpec& s, RooflineOptions o = {}) {
    auto m = make_cost_model("roofline", s, nullptr, o);
    EXPECT_OK(m);
    return m.ok() ? std::move(*m) : nullptr;
}

// llama3-70b (80 layers, hidden 8192, 64 q / 8 kv heads of 128, intermediate 28672, vocab 128256)
// on H100 (989 TFLOP/s bf16, 3350 GB/s HBM) at TP 8, mfu 0.5, mbu 0.8, NVLink 450 GB/s + 3 us.
constexpr double kPeak = 989e12 * 0.5;  // FLOP/s
constexpr double kHbm = 3350e9 * 0.8;   // B/s
// Weights of one layer: QKV 8192*(64+2*8)*128 = 83,886,080; O 64*128*8192 = 67,108,864;
// MLP 3*8192*28672 = 704,643,072; total 855,638,016.
constexpr double kLayerParams = 855638016.0;
constexpr double kHv = 8192.0 * 128256.0;  // LM head weights, 1,050,673,152

TEST(Roofline, Llama70bH100Tp8ExtendByHand) {
    // Two requests: 1024 new tokens with nothing cached, 512 new on top of 1024 cached. T = 1536.
    // GEMMs: 2 * 1536 * P / 8 = 328,564,998,144 FLOP -> 6.6444e-4 s; bytes 2P/8 = 213,909,504 ->
    //   7.98e-5 s: compute bound.
    const double gemm =
        std::max(2.0 * 1536 * kLayerParams / 8 / kPeak, 2.0 * kLayerParams / 8 / kHbm);
    EXPECT_NEAR(gemm, 6.64439e-4, 1e-8);
    // Attention pairs: 1024*1025/2 + 512*1024 + 512*513/2 = 524,800 + 655,616 = 1,180,416.
    // FLOPs 4 * 64 * 128 * 1,180,416 / 8 = 4,834,983,936 -> 9.777e-6 s. KV bytes per token per
    // rank: 2 * (8/8) * 128 * 2 B = 512; read 1024 + 1536 tokens, write 1536: 2,097,152 B.
    const double attn =
        std::max(4.0 * 64 * 128 * 1180416 / 8 / kPeak, (2560.0 + 1536) * 512 / kHbm);
    EXPECT_NEAR(attn, 9.7775e-6, 1e-9);
    // Two ring all-reduces per layer of 1536 * 8192 * 2 = 25,165,824 B:
    //   2*7/8 * 25,165,824 / 450e9 + 2*7*3e-6 = 1.39867e-4 s each.
    const double ar = 2 * 7.0 / 8 * 25165824 / 450e9 + 2 * 7 * 3e-6;
    EXPECT_NEAR(ar, 1.39867e-4, 1e-9);
    // LM head, 2 sampled tokens: 2 * H * V * 2 / 8 FLOP (1.06e-6 s) vs 2 * H * V / 8 B (9.80e-5 s).
    const double lm = std::max(2 * kHv * 2 / 8 / kPeak, 2 * kHv / 8 / kHbm);
    EXPECT_NEAR(lm, 9.8010e-5, 1e-8);
    const double expected = 80 * (gemm + attn) + 80 * 2 * ar + lm + 25e-6;  // ~0.076439 s
    EXPECT_NEAR(expected, 0.076439, 1e-5);

    RooflineOptions o;
    o.fixed_overhead_us = 25;
    auto m = roofline(h100("llama3-70b", 8), o);
    ASSERT_NE(m, nullptr);
    const std::vector<ExtendItem> batch = {{1024, 0}, {512, 1024}};
    EXPECT_NEAR(m->extend_s(batch), expected, expected * 1e-9);
    EXPECT_THAT(m->describe(), HasSubstr("H100"));
    EXPECT_THAT(m->describe(), HasSubstr("tp8"));
}

TEST(Roofline, Llama70bH100Tp8DecodeByHand) {
    // 32 requests, 64,000 KV tokens in all. GEMMs: weights 2P/8 B dominate (7.98e-5 s vs 1.38e-5).
    const double gemm =
        std::max(2.0 * 32 * kLayerParams / 8 / kPeak, 2.0 * kLayerParams / 8 / kHbm);
    EXPECT_NEAR(gemm, 7.98170e-5, 1e-9);
    // Attention: 4*64*128*64000/8 FLOP (5.3e-7 s) vs (64000 read + 32 written) * 512 B (1.2233e-5).
    const double attn = std::max(4.0 * 64 * 128 * 64000 / 8 / kPeak, (64000.0 + 32) * 512 / kHbm);
    EXPECT_NEAR(attn, 1.22330e-5, 1e-9);
    const double ar = 2 * 7.0 / 8 * (32 * 8192 * 2) / 450e9 + 2 * 7 * 3e-6;    // 4.40389e-5
    const double lm = std::max(2 * kHv * 32 / 8 / kPeak, 2 * kHv / 8 / kHbm);  // 9.8010e-5
    const double expected = 80 * (gemm + attn) + 160 * ar + lm;                // ~0.014508 s
    EXPECT_NEAR(expected, 0.014508, 2e-6);
    auto m = roofline(h100("llama3-70b", 8));
    ASSERT_NE(m, nullptr);
    EXPECT_NEAR(m->decode_s(32, 64000), expected, expected * 1e-9);
}

TEST(Roofline, MlaDeepseekV3Tp8DecodeByHand) {
    // deepseek-v3: 61 layers, hidden 7168, 128 q heads, head_dim 128, kv_lora_rank 512, rope 64,
    // intermediate 18432, vocab 129280. Weights per layer: 7168*576 + 512*128*256 +
    // 7168*128*192 + 128*128*7168 = 314,507,264 attention + 3*7168*18432 = 396,361,728 MLP.
    const double p = 314507264.0 + 396361728.0;
    // One request: the GEMMs read their weights (2P/8 B: 6.63e-5 s, far above 2P/8 FLOPs).
    const double gemm = std::max(2 * p / 8 / kPeak, 2 * p / 8 / kHbm);
    // Absorbed MLA attention over 100,000 KV tokens: 2 * 128 * (2*512 + 64) * 1e5 / 8 FLOP
    // (7.04e-6 s) vs the latent (512 + 64) * 2 B per token, NOT divided by TP (4.30e-5 s).
    const double attn =
        std::max(2.0 * 128 * (2 * 512 + 64) * 1e5 / 8 / kPeak, (1e5 + 1) * (512 + 64) * 2 / kHbm);
    EXPECT_NEAR(attn, 4.29855e-5, 1e-9);
    const double ar = 2 * 7.0 / 8 * (7168 * 2) / 450e9 + 2 * 7 * 3e-6;
    const double hv = 7168.0 * 129280;
    const double lm = std::max(2 * hv / 8 / kPeak, 2 * hv / 8 / kHbm);
    const double expected = 61 * (gemm + attn) + 61 * 2 * ar + lm;  // ~0.0118845 s
    EXPECT_NEAR(expected, 0.0118845, 1e-6);
    auto m = roofline(h100("deepseek-v3", 8));
    ASSERT_NE(m, nullptr);
    EXPECT_NEAR(m->decode_s(1, 100000), expected, expected * 1e-9);
}

// qwen3-next-80b (48 layers: 3 recurrent to 1 full, so 36 recurrent and 12 full; hidden 2048,
// 16 q / 2 kv heads of 256, intermediate 5632, vocab 151936; 32 state heads of 128, conv 4) on
// one H100 (no all-reduce). Weights of a full layer: QKV 2048*(16+2*2)*256 = 10,485,760, O
// 16*256*2048 = 8,388,608, MLP 3*2048*5632 = 34,603,008: 53,477,376. Of a recurrent layer:
// in 2048*(3*32*128 + 32) = 25,231,360, out 32*128*2048 = 8,388,608, MLP: 68,222,976. A request's
// state in one layer: 32 * (128^2 + 3 * 3 * 128) fp32 = 2,244,608 B.
constexpr double kQwenFullParams = 53477376.0;
constexpr double kQwenRecurrentParams = 68222976.0;
constexpr double kQwenStateBytes = 2244608.0;
constexpr double kQwenHv = 2048.0 * 151936.0;

TEST(Roofline, RecurrentLayersByHandDecode) {
    // 8 requests, 32,768 KV tokens in all.
    // Full layers: GEMMs read 2P B (3.99085e-5 s; FLOPs 2*8*P: 1.7e-6 s); attention reads
    //   (32768 + 8) tokens x 2*2*256*2 B = 67,125,248 B (2.50467e-5 s; FLOPs
    //   4*16*256*32768: 1.1e-6).
    const double gemm = std::max(2.0 * 8 * kQwenFullParams / kPeak, 2 * kQwenFullParams / kHbm);
    const double attn = std::max(4.0 * 16 * 256 * 32768 / kPeak, (32768.0 + 8) * 2048 / kHbm);
    EXPECT_NEAR(gemm, 3.99085e-5, 1e-9);
    EXPECT_NEAR(attn, 2.50467e-5, 1e-9);
    // Recurrent layers: GEMMs read 2R B = 136,445,952 B (5.09127e-5 s); the mixer does
    //   8 * 32 * (5*128^2 + 6*128*4) = 21,757,952 FLOPs (4.4e-8 s) but reads and writes 8 states,
    //   2 * 8 * 2,244,608 = 35,913,728 B (1.34006e-5 s): memory bound.
    const double rgemm =
        std::max(2.0 * 8 * kQwenRecurrentParams / kPeak, 2 * kQwenRecurrentParams / kHbm);
    const double mixer = std::max(8.0 * 32 * (5 * 128 * 128 + 6 * 128 * 4) / kPeak,
                                  2.0 * 8 * kQwenStateBytes / kHbm);
    EXPECT_NEAR(rgemm, 5.09127e-5, 1e-9);
    EXPECT_NEAR(mixer, 1.34006e-5, 1e-9);
    // LM head: its weights, 2 * H * V B (2.32213e-4 s).
    const double lm = std::max(2 * kQwenHv * 8 / kPeak, 2 * kQwenHv / kHbm);
    const double expected = 12 * (gemm + attn) + 36 * (rgemm + mixer) + lm;  // ~3.32695e-3 s
    EXPECT_NEAR(expected, 3.32695e-3, 1e-8);
    auto m = roofline(h100("qwen3-next-80b", 1));
    ASSERT_NE(m, nullptr);
    EXPECT_NEAR(m->decode_s(8, 32768), expected, expected * 1e-9);
    // Counting the recurrent layers as full attention (48 x (gemm + attn) + lm) gives 3.35006e-3 s.
    EXPECT_GT(std::abs(m->decode_s(8, 32768) - (48 * (gemm + attn) + lm)), 1e-5);
}

TEST(Roofline, RecurrentLayersByHandExtend) {
    // One request, 4096 new tokens, nothing cached.
    // Full layers: GEMMs 2*4096*P FLOPs (8.85918e-4 s); attention over 4096*4097/2 pairs,
    //   4*16*256 FLOPs each (2.78003e-4 s; its KV bytes, 8192 tokens x 2048 B, take 6.3e-6 s).
    const double gemm = std::max(2.0 * 4096 * kQwenFullParams / kPeak, 2 * kQwenFullParams / kHbm);
    const double attn =
        std::max(4.0 * 16 * 256 * (4096.0 * 4097 / 2) / kPeak, 8192.0 * 2048 / kHbm);
    EXPECT_NEAR(gemm, 8.85918e-4, 1e-9);
    EXPECT_NEAR(attn, 2.78003e-4, 1e-9);
    // Recurrent layers: GEMMs 2*4096*R FLOPs (1.130197e-3 s); the mixer 4096 * 32 * 84,992 =
    //   11,140,071,424 FLOPs (2.25280e-5 s) against one state read and written (1.68e-6 s):
    //   compute bound.
    const double rgemm =
        std::max(2.0 * 4096 * kQwenRecurrentParams / kPeak, 2 * kQwenRecurrentParams / kHbm);
    const double mixer = std::max(11140071424.0 / kPeak, 2 * kQwenStateBytes / kHbm);
    EXPECT_NEAR(rgemm, 1.130197e-3, 1e-9);
    EXPECT_NEAR(mixer, 2.25280e-5, 1e-9);
    const double lm = std::max(2 * kQwenHv / kPeak, 2 * kQwenHv / kHbm);
    const double expected = 12 * (gemm + attn) + 36 * (rgemm + mixer) + lm;  // ~0.0556974 s
    EXPECT_NEAR(expected, 0.0556974, 1e-7);
    auto m = roofline(h100("qwen3-next-80b", 1));
    ASSERT_NE(m, nullptr);
    const std::vector<ExtendItem> batch = {{4096, 0}};
    EXPECT_NEAR(m->extend_s(batch), expected, expected * 1e-9);
}

TEST(Roofline, DecodeMonotoneInBatchAndKvTokens) {
    for (int tp : {1, 8}) {
        auto m = roofline(h100("llama3-70b", tp));
        ASSERT_NE(m, nullptr);
        double prev = 0;
        for (int64_t b : {1, 2, 8, 32, 128, 512}) {
            const double s = m->decode_s(b, b * 1000);
            EXPECT_GT(s, prev) << "tp " << tp << " batch " << b;
            prev = s;
        }
        prev = 0;
        for (int64_t kv : {1000, 10000, 100000, 1000000, 4000000}) {
            const double s = m->decode_s(16, kv);
            EXPECT_GT(s, prev) << "tp " << tp << " kv " << kv;
            prev = s;
        }
    }
}

TEST(Roofline, TpScaling) {
    // With a free link every term divides by t (the 8 KV heads split evenly up to TP 8).
    const std::vector<ExtendItem> batch = {{4096, 0}};
    double prev = 0;
    for (int tp : {8, 4, 2, 1}) {
        InstanceSpec s = h100("llama3-8b", tp);
        s.tp_link_gbps = 1e12;
        s.tp_link_latency_us = 0;
        auto m = roofline(s);
        ASSERT_NE(m, nullptr);
        const double t = m->extend_s(batch);
        if (prev > 0) {
            EXPECT_NEAR(t / prev, 2.0, 1e-6) << "tp " << tp;
        }
        prev = t;
    }
    // A real link: TP 8 is faster than TP 1, but less than 8x (the all-reduces).
    auto t1 = roofline(h100("llama3-8b", 1))->extend_s(batch);
    auto t8 = roofline(h100("llama3-8b", 8))->extend_s(batch);
    EXPECT_LT(t8, t1);
    EXPECT_GT(t8, t1 / 8);
}

TEST(Roofline, RejectsBadSpecs) {
    InstanceSpec cpu = h100("tiny", 1);
    cpu.device = "cpu";
    auto r = make_cost_model("roofline", cpu);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r, StatusIs(StatusCode::kInvalidArgument, HasSubstr("'cpu'")))
        << r.status().message();

    InstanceSpec nolink = h100("llama3-8b", 8);
    nolink.tp_link_gbps = 0;
    r = make_cost_model("roofline", nolink);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("tp_link_gbps"));

    r = make_cost_model("roofline", h100("llama3-8b", 3));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

    r = make_cost_model("guesswork", h100("llama3-8b", 1));
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("guesswork"));
}

// ---- the cost file and the calibrated model ----

json hand_written() {
    return json::parse(R"({
      "schema_version": 1,
      "model": "tiny",
      "fits": [
        {"tp": 1, "threads": 1,
         "extend": {"const_s": 0.001, "per_token_s": 2e-5, "per_attn_pair_s": 3e-9,
                    "per_request_s": 4e-4, "r2": 0.99, "max_rel_err": 0.03},
         "decode": {"const_s": 5e-4, "per_request_s": 1e-5, "per_weight_pass_s": 3e-4,
                    "per_kv_token_s": 2e-8}},
        {"tp": 2, "threads": 1,
         "extend": {"const_s": 0.002, "per_token_s": 1e-5, "per_attn_pair_s": 2e-9,
                    "per_request_s": 4e-4},
         "decode": {"const_s": 9e-4, "per_request_s": 1e-5, "per_kv_token_s": 1e-8}}
      ],
      "transports": {"tcp": {"gbps": 2.5, "latency_us": 30}}
    })");
}

InstanceSpec cpu_spec(const std::string& model, int tp, int threads) {
    InstanceSpec s;
    s.model = named(model);
    s.tp = tp;
    s.device = "cpu";
    s.kv_dtype_bytes = 4;
    s.threads = threads;
    return s;
}

TEST(Calibrated, HandWrittenFileGivesTheLinearValue) {
    auto f = CostFile::from_json(hand_written(), "hand.json");
    ASSERT_OK(f);
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(m);
    // tokens 120; pairs 100*(50 + 101/2) + 20*(0 + 21/2) = 10050 + 210 = 10260; 2 requests:
    // 0.001 + 120*2e-5 + 10260*3e-9 + 2*4e-4 = 0.00423078 s.
    const std::vector<ExtendItem> batch = {{100, 50}, {20, 0}};
    EXPECT_NEAR((*m)->extend_s(batch), 0.00423078, 1e-12);
    // 8 rows: 2 weight passes (blocks of 4): 5e-4 + 8*1e-5 + 2*3e-4 + 4000*2e-8 = 1.26e-3 s.
    EXPECT_NEAR((*m)->decode_s(8, 4000), 1.26e-3, 1e-12);
    // 3 rows stream the weights 3 times, 4 rows once, 7 rows 1 + 3 times.
    EXPECT_NEAR((*m)->decode_s(3, 0), 5e-4 + 3e-5 + 9e-4, 1e-12);
    EXPECT_NEAR((*m)->decode_s(4, 0), 5e-4 + 4e-5 + 3e-4, 1e-12);
    EXPECT_NEAR((*m)->decode_s(7, 0), 5e-4 + 7e-5 + 12e-4, 1e-12);
    // TP 2 (no per_weight_pass_s: 0) and threads 0 (the only thread count calibrated for TP 2).
    auto m2 = make_cost_model("calibrated", cpu_spec("tiny", 2, 0), &*f);
    ASSERT_OK(m2);
    EXPECT_NEAR((*m2)->decode_s(1, 1000), 9e-4 + 1e-5 + 1e-5, 1e-12);
    EXPECT_THAT((*m2)->describe(), HasSubstr("hand.json"));
    // The measured transport.
    auto tcp = f->transport("tcp");
    ASSERT_TRUE(tcp.has_value());
    EXPECT_DOUBLE_EQ(tcp->gbps, 2.5);
    EXPECT_DOUBLE_EQ(tcp->latency_us, 30);
    EXPECT_FALSE(f->transport("mpi").has_value());
}

// A file fitted on GPU ranks' timelines (device: gpu) serves GPU devices and only them; a CPU
// file refuses GPU devices; the field is checked.
TEST(Calibrated, TheFilesDeviceKindDecidesWhichDevicesItServes) {
    InstanceSpec gpu = cpu_spec("tiny", 1, 0);
    gpu.device = "h200";
    auto cpu_file = CostFile::from_json(hand_written(), "hand.json");
    ASSERT_OK(cpu_file);
    EXPECT_THAT(make_cost_model("calibrated", gpu, &*cpu_file),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("device 'h200' is not cpu")));
    json g = hand_written();
    g["device"] = "gpu";
    auto gpu_file = CostFile::from_json(g, "gpu.json");
    ASSERT_OK(gpu_file);
    auto m = make_cost_model("calibrated", gpu, &*gpu_file);
    ASSERT_OK(m);
    const std::vector<ExtendItem> batch = {{100, 50}, {20, 0}};
    EXPECT_NEAR((*m)->extend_s(batch), 0.00423078, 1e-12);  // the same fit as on the CPU
    EXPECT_THAT(make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*gpu_file),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("fitted on GPU ranks")));
    g["device"] = "tpu";
    EXPECT_THAT(CostFile::from_json(g, "bad.json"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("device")));
}

TEST(Calibrated, MonotoneInBatchAndKvTokens) {
    auto f = CostFile::from_json(hand_written(), "hand.json");
    ASSERT_OK(f);
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(m);
    double prev = 0;
    for (int64_t kv : {0, 100, 1000, 100000}) {
        EXPECT_GT((*m)->decode_s(2, kv), prev) << kv;
        prev = (*m)->decode_s(2, kv);
    }
    // In batch: monotone between equal numbers of weight passes (1, 2, 3 rows; 4 rows is one
    // 4-row block, cheaper than 3 single rows on the testbed's kernel).
    EXPECT_LT((*m)->decode_s(1, 1000), (*m)->decode_s(2, 1000));
    EXPECT_LT((*m)->decode_s(2, 1000), (*m)->decode_s(3, 1000));
    EXPECT_LT((*m)->decode_s(4, 1000), (*m)->decode_s(8, 1000));
    EXPECT_LT((*m)->decode_s(8, 1000), (*m)->decode_s(64, 1000));
}

void expect_invalid(const json& j, const std::vector<std::string>& mentions) {
    auto f = CostFile::from_json(j, "bad.json");
    ASSERT_FALSE(f.ok()) << j.dump();
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
    for (const auto& s : mentions) {
        EXPECT_THAT(f.status().message(), HasSubstr(s))
            << "'" << s << "' not in: " << f.status().message();
    }
}

TEST(CostFile, ValidationNamesTheFileAndField) {
    json j = hand_written();
    j["fits"][0]["extend"].erase("per_token_s");
    expect_invalid(j, {"bad.json", "fits[0].extend.per_token_s", "missing"});

    j = hand_written();
    j["fits"][1]["tp"] = "two";
    expect_invalid(j, {"bad.json", "fits[1].tp", "integer"});

    j = hand_written();
    j["fits"][0]["decode"]["per_kv_token_s"] = -1e-9;
    expect_invalid(j, {"fits[0].decode.per_kv_token_s", ">= 0"});

    j = hand_written();
    j.erase("schema_version");
    expect_invalid(j, {"schema_version", "missing"});

    j = hand_written();
    j["schema_version"] = 7;
    expect_invalid(j, {"schema_version", "7"});

    j = hand_written();
    j["transports"]["tcp"]["gbps"] = "fast";
    expect_invalid(j, {"transports.tcp.gbps", "number"});

    j = hand_written();
    j["fits"] = json::array();
    expect_invalid(j, {"fits", "empty"});

    j = hand_written();
    j["fits"][1]["tp"] = 1;
    expect_invalid(j, {"fits[1]", "second fit"});
}

// ---- the warm-up after an idle period (CostWake, fit_wake) ----

TEST(CostWake, ExtraTimeAddsUpToTheLostTime) {
    const CostWake w = {.min_idle_s = 0.005, .lost_s = 0.002, .tau_s = 0.0005};
    // Over the whole warm-up: lost_s; split in forwards: the same, whatever the split.
    EXPECT_NEAR(w.extra_s(0, 1.0), 0.002, 1e-15);
    EXPECT_NEAR(w.extra_s(0, 0.0003) + w.extra_s(0.0003, 0.0004) + w.extra_s(0.0007, 1.0), 0.002,
                1e-15);
    // The first forward of d: lost * (1 - exp(-d / tau)).
    EXPECT_NEAR(w.extra_s(0, 0.0005), 0.002 * (1 - std::exp(-1.0)), 1e-15);
    EXPECT_GT(w.extra_s(0, 0.0005), w.extra_s(0.0005, 0.0005));
    EXPECT_EQ(w.extra_s(0, 0), 0);
    EXPECT_EQ(CostWake{}.extra_s(0, 1.0), 0);
    EXPECT_FALSE(CostWake{}.any());
}

// Per-index medians made from a known warm-up (the k-th forward of 0.4 ms pays the model's extra
// over [0.4 k, 0.4 (k + 1)) ms): the fit recovers it. Flat or growing medians give none.
TEST(CostWake, FitRecoversAKnownWarmup) {
    const CostWake truth = {.min_idle_s = kWakeMinIdleS, .lost_s = 0.0015, .tau_s = 0.0004};
    const double warm = 0.0004;
    std::vector<double> medians;
    for (int k = 0; k < 16; ++k) medians.push_back(warm + truth.extra_s(k * warm, warm));
    const std::optional<WakeFit> f = fit_wake(medians);
    ASSERT_TRUE(f.has_value());
    EXPECT_NEAR(f->wake.lost_s, truth.lost_s, truth.lost_s * 0.01);
    EXPECT_NEAR(f->wake.tau_s, truth.tau_s, truth.tau_s * 0.01);
    EXPECT_EQ(f->wake.min_idle_s, kWakeMinIdleS);
    EXPECT_NEAR(f->warm_forward_s, warm, warm * 1e-3);

    EXPECT_FALSE(fit_wake(std::vector<double>(16, warm)).has_value());  // no warm-up
    std::vector<double> growing;
    for (int k = 0; k < 16; ++k) growing.push_back(warm * (1 + 0.1 * k));
    EXPECT_FALSE(fit_wake(growing).has_value());
    EXPECT_FALSE(fit_wake(std::vector<double>(5, warm)).has_value());  // too few
}

TEST(CostWake, TheFitsWakeIsCheckedAndServed) {
    json j = hand_written();
    j["fits"][0]["wake"] = {{"min_idle_s", 0.005}, {"lost_s", 0.002}, {"tau_s", 0.0005}};
    auto f = CostFile::from_json(j, "wake.json");
    ASSERT_OK(f);
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(m);
    EXPECT_DOUBLE_EQ((*m)->wake().lost_s, 0.002);
    EXPECT_DOUBLE_EQ((*m)->wake().tau_s, 0.0005);
    EXPECT_DOUBLE_EQ((*m)->wake().min_idle_s, 0.005);
    auto m2 = make_cost_model("calibrated", cpu_spec("tiny", 2, 1), &*f);  // no wake there
    ASSERT_OK(m2);
    EXPECT_FALSE((*m2)->wake().any());

    j["fits"][0]["wake"]["lost_s"] = -1;
    expect_invalid(j, {"fits[0].wake.lost_s", ">= 0"});
    j["fits"][0]["wake"] = json::object();
    expect_invalid(j, {"fits[0].wake.min_idle_s", "missing"});
}

// ---- the machine-speed probe (SpeedLevel, ScaledCostModel) ----

TEST(SpeedLevel, TheCostFilesProbeIsCheckedAndServed) {
    json j = hand_written();
    auto plain = CostFile::from_json(j, "plain.json");
    ASSERT_OK(plain);
    EXPECT_FALSE(plain->speed_probe().has_value());
    j["speed_probe"] = {{"kernel", "k1"}, {"cpu_ms_p50", 0.25}, {"runs", 6}};
    auto f = CostFile::from_json(j, "speed.json");
    ASSERT_OK(f);
    ASSERT_TRUE(f->speed_probe().has_value());
    EXPECT_EQ(f->speed_probe()->kernel, "k1");
    EXPECT_DOUBLE_EQ(f->speed_probe()->cpu_ms_p50, 0.25);

    j["speed_probe"]["cpu_ms_p50"] = 0;
    expect_invalid(j, {"bad.json", "speed_probe.cpu_ms_p50", "> 0"});
    j["speed_probe"] = {{"cpu_ms_p50", 0.25}};
    expect_invalid(j, {"speed_probe.kernel"});
    j["speed_probe"] = 3;
    expect_invalid(j, {"speed_probe", "expected an object"});
}

TEST(CoreWait, TheCostFilesCoreWaitIsCheckedAndServed) {
    json j = hand_written();
    auto plain = CostFile::from_json(j, "plain.json");
    ASSERT_OK(plain);
    EXPECT_FALSE(plain->core_wait().has_value());
    j["core_wait"] = {{"dispatch_ms", 6.5}, {"events", 40}, {"topology", "cpu-2p1d"}};
    auto f = CostFile::from_json(j, "wait.json");
    ASSERT_OK(f);
    ASSERT_TRUE(f->core_wait().has_value());
    EXPECT_DOUBLE_EQ(f->core_wait()->dispatch_s, 6.5e-3);
    j["core_wait"]["dispatch_ms"] = -1;
    expect_invalid(j, {"bad.json", "core_wait.dispatch_ms", ">= 0"});
    j["core_wait"]["dispatch_ms"] = 5000;
    expect_invalid(j, {"core_wait.dispatch_ms", "at most 1000 ms"});
    j["core_wait"] = {{"events", 3}};
    expect_invalid(j, {"core_wait.dispatch_ms", "missing"});
    j["core_wait"] = "soon";
    expect_invalid(j, {"core_wait", "expected an object"});
}

TEST(StepWait, TheCostFilesStepWaitIsCheckedAndServed) {
    json j = hand_written();
    auto plain = CostFile::from_json(j, "plain.json");
    ASSERT_OK(plain);
    EXPECT_FALSE(plain->step_wait().has_value());
    j["step_wait"] = {{"decode",
                       {{{"competitors", 1}, {"chance", 0.25}, {"wait_ms", 3}, {"gaps", 300}},
                        {{"competitors", 2}, {"chance", 0.45}, {"wait_ms", 3.5}}}},
                      {"topology", "cpu-2p1d"}};
    auto f = CostFile::from_json(j, "steps.json");
    ASSERT_OK(f);
    ASSERT_TRUE(f->step_wait().has_value());
    ASSERT_EQ(f->step_wait()->decode.size(), 2u);
    EXPECT_DOUBLE_EQ(f->step_wait()->decode[0].chance, 0.25);
    EXPECT_DOUBLE_EQ(f->step_wait()->decode[0].wait_s, 3e-3);
    EXPECT_DOUBLE_EQ(f->step_wait()->decode[1].chance, 0.45);
    EXPECT_DOUBLE_EQ(f->step_wait()->decode[1].wait_s, 3.5e-3);
    json bad = j;
    bad["step_wait"]["decode"][1]["chance"] = 1.5;
    expect_invalid(bad, {"bad.json", "step_wait.decode[1].chance", "at most 1"});
    bad = j;
    bad["step_wait"]["decode"][0]["wait_ms"] = -2;
    expect_invalid(bad, {"step_wait.decode[0].wait_ms", ">= 0"});
    bad = j;
    bad["step_wait"]["decode"][0]["wait_ms"] = 4000;
    expect_invalid(bad, {"step_wait.decode[0].wait_ms", "at most 1000 ms"});
    bad = j;
    bad["step_wait"]["decode"][1]["competitors"] = 3;
    expect_invalid(bad, {"step_wait.decode[1].competitors", "expected 2"});
    bad = j;
    bad["step_wait"]["decode"][0].erase("chance");
    expect_invalid(bad, {"step_wait.decode[0].chance", "missing"});
    bad = j;
    bad["step_wait"]["decode"] = {{"competitors", 1}};
    expect_invalid(bad, {"step_wait.decode", "expected an array"});
    bad = j;
    bad["step_wait"] = json::object();
    expect_invalid(bad, {"step_wait.decode", "missing"});
    bad = j;
    bad["step_wait"] = 7;
    expect_invalid(bad, {"step_wait", "expected an object"});
    // No rows: present, and no wait.
    j["step_wait"]["decode"] = json::array();
    auto empty = CostFile::from_json(j, "none.json");
    ASSERT_OK(empty);
    EXPECT_TRUE(empty->step_wait()->decode.empty());
}

// A report's level is the median of its ranks' medians; ranks without samples (or malformed) are
// left out, ranks naming different kernels give none.
TEST(SpeedLevel, AReportsLevelIsTheMedianOfItsRanks) {
    auto rank = [](json probe) { return json{{"stats", {{"speed_probe", std::move(probe)}}}}; };
    json report = {{"ranks",
                    {rank({{"kernel", "k1"}, {"cpu_ms_p50", 0.30}}),
                     rank({{"kernel", "k1"}, {"cpu_ms_p50", 0.20}}),
                     rank({{"kernel", "k1"}, {"cpu_ms_p50", 0.0}}),  // no samples
                     rank({{"kernel", "k1"}, {"cpu_ms_p50", "slow"}}),
                     json{{"stats", json::object()}},  // a GPU rank: no probe
                     rank({{"kernel", "k1"}, {"cpu_ms_p50", 0.28}})}}};
    std::optional<SpeedLevel> level = report_speed_level(report);
    ASSERT_TRUE(level.has_value());
    EXPECT_EQ(level->kernel, "k1");
    EXPECT_DOUBLE_EQ(level->cpu_ms_p50, 0.28);
    report["ranks"].push_back(rank({{"kernel", "k2"}, {"cpu_ms_p50", 0.28}}));
    EXPECT_FALSE(report_speed_level(report).has_value());
    EXPECT_FALSE(report_speed_level(json{{"ranks", json::array()}}).has_value());
    EXPECT_FALSE(report_speed_level(json::array()).has_value());
    EXPECT_FALSE(report_speed_level(json{{"ranks", 5}}).has_value());
}

// Every forward and the wake-up scale by the factor (or extends and decodes each by its own);
// interference and noise, which are relative, pass through.
TEST(ScaledCostModel, ScalesForwardsAndTheWakeUpOnly) {
    json j = hand_written();
    j["fits"][0]["wake"] = {{"min_idle_s", 0.005}, {"lost_s", 0.002}, {"tau_s", 0.0005}};
    j["interference"] = {{"extend", 0.1}, {"decode", 0.3}};
    j["noise"] = {{"decode", {{"fast_cv", 0.2}, {"slow_cv", 0.1}, {"slow_period_s", 0.05}}}};
    auto f = CostFile::from_json(j, "hand.json");
    ASSERT_OK(f);
    auto base = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(base);
    std::shared_ptr<const CostModel> shared(std::move(*base));
    const ScaledCostModel scaled(shared, 1.25);
    const std::array<ExtendItem, 2> batch = {ExtendItem{300, 0}, ExtendItem{100, 64}};
    EXPECT_DOUBLE_EQ(scaled.extend_s(batch), 1.25 * shared->extend_s(batch));
    EXPECT_DOUBLE_EQ(scaled.decode_s(8, 4000), 1.25 * shared->decode_s(8, 4000));
    EXPECT_DOUBLE_EQ(scaled.wake().lost_s, 1.25 * 0.002);
    EXPECT_DOUBLE_EQ(scaled.wake().tau_s, 1.25 * 0.0005);
    EXPECT_DOUBLE_EQ(scaled.wake().min_idle_s, 0.005);
    EXPECT_DOUBLE_EQ(scaled.interference(true), shared->interference(true));
    EXPECT_DOUBLE_EQ(scaled.interference(false), shared->interference(false));
    EXPECT_DOUBLE_EQ(scaled.noise(true).fast_cv, shared->noise(true).fast_cv);
    EXPECT_DOUBLE_EQ(scaled.noise(true).slow_cv, 0.1);
    EXPECT_DOUBLE_EQ(scaled.extend_factor(), 1.25);
    EXPECT_DOUBLE_EQ(scaled.decode_factor(), 1.25);
    EXPECT_THAT(scaled.describe(), HasSubstr("x1.250 (machine speed)"));
    EXPECT_THAT(scaled.describe(), HasSubstr(shared->describe()));

    // Decodes only (what `simulate --speed-scale auto` builds): extends keep the base's time; the
    // wake-up, measured on decode forwards, follows the decode factor.
    const ScaledCostModel decodes(shared, 1.0, 0.8);
    EXPECT_DOUBLE_EQ(decodes.extend_s(batch), shared->extend_s(batch));
    EXPECT_DOUBLE_EQ(decodes.decode_s(8, 4000), 0.8 * shared->decode_s(8, 4000));
    EXPECT_DOUBLE_EQ(decodes.decode_s(1, 16), 0.8 * shared->decode_s(1, 16));
    EXPECT_DOUBLE_EQ(decodes.wake().lost_s, 0.8 * 0.002);
    EXPECT_DOUBLE_EQ(decodes.wake().tau_s, 0.8 * 0.0005);
    EXPECT_DOUBLE_EQ(decodes.interference(true), shared->interference(true));
    EXPECT_THAT(decodes.describe(), HasSubstr("extends x1.000, decodes x0.800 (machine speed)"));
}

// A fit's own interference (the serve probe's, measured in that fit's layout) wins over the
// file's; a fit without one takes the file's; both are checked.
TEST(CostFile, AFitsInterferenceWinsOverTheFiles) {
    json j = hand_written();
    j["interference"] = {{"extend", 0.1}, {"decode", 0.3}};
    j["fits"][0]["interference"] = {{"extend", 0.05}, {"decode", 0.07}, {"node_cpus", 2}};
    auto f = CostFile::from_json(j, "ix.json");
    ASSERT_OK(f);
    auto tp1 = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    auto tp2 = make_cost_model("calibrated", cpu_spec("tiny", 2, 1), &*f);
    ASSERT_OK(tp1);
    ASSERT_OK(tp2);
    EXPECT_DOUBLE_EQ((*tp1)->interference(false), 0.05);
    EXPECT_DOUBLE_EQ((*tp1)->interference(true), 0.07);
    EXPECT_DOUBLE_EQ((*tp2)->interference(false), 0.1);
    EXPECT_DOUBLE_EQ((*tp2)->interference(true), 0.3);
    j["fits"][0]["interference"]["decode"] = -0.1;
    expect_invalid(j, {"fits[0].interference.decode", ">= 0"});
    j["fits"][0]["interference"] = "high";
    expect_invalid(j, {"fits[0].interference", "expected an object"});
}

// The serve probe leaves out each instance's decode warm-up after an idle gap (the fit's wake
// adds it): the first `warmup` leader forwards after a gap of min_idle or more, decodes only.
TEST(ForwardCheck, DecodeWarmupMarksTheDecodesAfterAnIdleGap) {
    std::vector<TimelineForward> in;
    double t = 0;
    auto add = [&](int instance, bool decode, double gap_us, int tp_rank = 0) {
        t += gap_us;
        TimelineForward f;
        f.begin_us = t;
        f.duration_us = 1000;
        f.end_us = t + 1000;
        f.instance = instance;
        f.decode = decode;
        f.tp_rank = tp_rank;
        f.batch = static_cast<int64_t>(in.size());  // an id: the position in `in`
        in.push_back(f);
        t += 1000;
    };
    for (int i = 0; i < 5; ++i) add(1, true, 10);  // 0-4: the first 3 are the warm-up
    add(1, true, 10'000);                          // 5: after a 10 ms gap: warm-up again
    add(1, true, 10);                              // 6
    add(1, true, 10);                              // 7
    add(1, true, 10);                              // 8: kept
    add(1, true, 2'000);                           // 9: a 2 ms gap is not idle: kept
    add(0, false, 50'000);                         // 10: an extend after idling: kept
    add(0, true, 10);                              // 11: instance 0's second: dropped
    add(1, true, 10, /*tp_rank=*/1);               // 12: a follower: kept
    const std::vector<bool> warmup = decode_warmup(in, 0.005, 3);
    ASSERT_EQ(warmup.size(), in.size());
    std::vector<int64_t> kept;
    for (size_t i = 0; i < in.size(); ++i) {
        if (!warmup[i]) kept.push_back(in[i].batch);
    }
    EXPECT_EQ(kept, (std::vector<int64_t>{3, 4, 8, 9, 10, 12}));
    EXPECT_EQ(decode_warmup(in, 0.005, 0), std::vector<bool>(in.size(), false));
}

TEST(CostFile, UnknownModelTpOrThreadsListsWhatItHas) {
    auto f = CostFile::from_json(hand_written(), "hand.json");
    ASSERT_OK(f);
    auto m = make_cost_model("calibrated", cpu_spec("hybrid-tiny", 1, 1), &*f);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m, StatusIs(StatusCode::kInvalidArgument, HasSubstr("hand.json")))
        << m.status().message();
    EXPECT_THAT(m.status().message(), HasSubstr("hybrid-tiny"));
    EXPECT_THAT(m.status().message(), HasSubstr("tp 1 threads 1, tp 2 threads 1"));

    m = make_cost_model("calibrated", cpu_spec("tiny", 4, 1), &*f);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("tp 4"));
    EXPECT_THAT(m.status().message(), HasSubstr("tp 1 threads 1, tp 2 threads 1"));

    m = make_cost_model("calibrated", cpu_spec("tiny", 1, 2), &*f);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("threads 2"));

    // No file; a GPU device.
    m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), nullptr);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    InstanceSpec gpu = cpu_spec("tiny", 1, 1);
    gpu.device = "H100";
    m = make_cost_model("calibrated", gpu, &*f);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("H100"));

    // A model of the same name but another shape.
    json j = hand_written();
    j["model_config"] = {{"num_layers", 8}, {"hidden", 256}};
    auto g = CostFile::from_json(j, "shape.json");
    ASSERT_OK(g);
    m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*g);
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("model_config.num_layers"));
}

// Cost files are fitted on full-attention models only (pdsim calibrate refuses the others): a
// model of the file's name and dimensions but with sliding or recurrent layers is refused.
TEST(CostFile, HybridModelsAreRefused) {
    auto f = CostFile::from_json(hand_written(), "hand.json");
    ASSERT_OK(f);
    InstanceSpec spec = cpu_spec("tiny", 1, 1);
    spec.model.layer_kinds = {model::LayerKind::kFullAttention, model::LayerKind::kSlidingWindow};
    spec.model.sliding_window = 64;
    auto m = make_cost_model("calibrated", spec, &*f);
    EXPECT_THAT(m, StatusIs(StatusCode::kInvalidArgument,
                            HasSubstr("model tiny has 2 sliding-window and 0 recurrent layers")))
        << m.status().message();
    EXPECT_THAT(m.status().message(), HasSubstr("hand.json"));
    EXPECT_THAT(m.status().message(), HasSubstr("--cost-model roofline"));
    // Every layer full attention, spelled out: the dense model, accepted.
    spec.model.layer_kinds = {model::LayerKind::kFullAttention};
    EXPECT_OK(make_cost_model("calibrated", spec, &*f));
}

TEST(CostFile, LoadReportsUnreadableAndMalformedFiles) {
    test::TempDir dir("cost");
    auto f = CostFile::load(dir.str("none.json"));
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(f, StatusIs(StatusCode::kInvalidArgument, HasSubstr("none.json")));
    {
        std::ofstream out(dir.str("broken.json"));
        out << "{\"schema_version\": 1,";
    }
    f = CostFile::load(dir.str("broken.json"));
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(f.status().message(), HasSubstr("broken.json"));
}

// ---- the fit ----

TEST(Fit, RecoversKnownCoefficientsAndClampsNegativeOnes) {
    // y = 0.002 + 3e-5 x1 + 4e-9 x2, exactly.
    std::vector<std::vector<double>> x;
    std::vector<double> y;
    for (double a : {16.0, 128.0, 512.0, 2048.0}) {
        for (double b : {0.0, 1e4, 1e6, 3e6}) {
            x.push_back({1, a, b});
            y.push_back(0.002 + 3e-5 * a + 4e-9 * b);
        }
    }
    auto f = fit_nonnegative(x, y);
    ASSERT_OK(f);
    EXPECT_NEAR(f->coef[0], 0.002, 1e-12);
    EXPECT_NEAR(f->coef[1], 3e-5, 1e-15);
    EXPECT_NEAR(f->coef[2], 4e-9, 1e-18);
    EXPECT_NEAR(f->r2, 1.0, 1e-12);
    EXPECT_LT(f->max_rel_err, 1e-9);
    // A falling trend in x1 cannot be followed with coef >= 0: x1 gets 0, the rest is the mean.
    x = {{1, 1}, {1, 2}, {1, 3}};
    y = {3, 2, 1};
    f = fit_nonnegative(x, y);
    ASSERT_OK(f);
    EXPECT_EQ(f->coef[1], 0.0);
    // Relative weighting: minimizes sum ((c - y) / y)^2 -> c = sum(1/y) / sum(1/y^2) = 18/11.
    EXPECT_NEAR(f->coef[0], (1.0 / 3 + 0.5 + 1) / (1.0 / 9 + 0.25 + 1), 1e-12);
    EXPECT_GE(f->max_rel_err, 0.5);

    EXPECT_FALSE(fit_nonnegative({{1, 2}}, {1.0}).ok());         // fewer points than features
    EXPECT_FALSE(fit_nonnegative({{1}, {1}}, {1.0, 0.0}).ok());  // a zero time
}

// ---- pdsim calibrate ----

TEST(CalibrateCli, QuickRunWritesALoadableFileWithSaneFits) {
    test::TempDir dir("calibrate");
    const std::string out = dir.str("cost.json");
    // TP 2 runs its two ranks as threads over a LocalTpGroup.
    test::CmdResult r = test::run_pdsim({"calibrate", "--quick", "--model", "tiny", "--tp", "1,2",
                                         "--threads", "1", "--serve-probe", "off", "--out", out},
                                        240);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("R^2"));
    EXPECT_THAT(r.out, HasSubstr("wrote"));

    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& j = f->json();
    EXPECT_EQ(j["schema_version"], 1);
    EXPECT_EQ(j["model"], "tiny");
    EXPECT_TRUE(j["machine"]["cpu"].is_string());
    EXPECT_GE(j["machine"]["cores"].get<int>(), 1);
    EXPECT_TRUE(j["created"].is_string());
    ASSERT_EQ(j["fits"].size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        const json& fit = j["fits"][i];
        EXPECT_EQ(fit["tp"], static_cast<int>(i) + 1);
        EXPECT_EQ(fit["threads"], 1);
        for (const char* kind : {"extend", "decode"}) {
            ASSERT_TRUE(fit[kind]["r2"].is_number()) << kind;
            EXPECT_LE(fit[kind]["r2"].get<double>(), 1.0) << kind;
            ASSERT_TRUE(fit[kind]["max_rel_err"].is_number()) << kind;
        }
        // Extend times span 16 to 1024 tokens, so even a noisy measurement (a loaded 2-core CI
        // machine gives R^2 0.7-0.8 at --quick) leaves a linear model explaining a good part of it.
        EXPECT_GT(fit["extend"]["r2"].get<double>(), 0.3) << fit.dump();
        ASSERT_FALSE(fit["points"].empty());
        for (const auto& p : fit["points"]) EXPECT_GT(p["s"].get<double>(), 0) << p.dump();
    }
    // Transports: local and tcp measured, mpi skipped (not under mpirun) with a note.
    ASSERT_TRUE(f->transport("local").has_value());
    ASSERT_TRUE(f->transport("tcp").has_value());
    EXPECT_GT(f->transport("tcp")->gbps, 0);
    EXPECT_FALSE(f->transport("mpi").has_value());
    EXPECT_THAT(j["notes"].dump(), HasSubstr("mpi"));
    EXPECT_THAT(j["notes"].dump(), HasSubstr("serve probe: off"));
    // The worker timed decode forwards after an idle period; on a machine where those are
    // measurably slower (the VMs here: about 2x for the first) the fit has a wake part.
    for (const auto& fit : j["fits"]) {
        EXPECT_FALSE(fit.contains("serve_probe"));
        if (fit.contains("wake")) {
            EXPECT_GT(fit["wake"]["lost_s"].get<double>(), 0) << fit["wake"].dump();
            EXPECT_EQ(fit["wake"]["measured"]["median_s"].size(), 16u);
        }
    }

    // The simulator's view: positive, growing times.
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 0), &*f);
    ASSERT_OK(m);
    const std::vector<ExtendItem> small = {{64, 0}};
    const std::vector<ExtendItem> large = {{512, 512}};
    EXPECT_GT((*m)->extend_s(small), 0);
    EXPECT_GT((*m)->extend_s(large), (*m)->extend_s(small));
    EXPECT_GT((*m)->decode_s(1, 100), 0);
    EXPECT_GE((*m)->decode_s(8, 2000), (*m)->decode_s(1, 100));
}

// The serve probe: a short bound `pdsim testbed` under mpirun, whose forwards scale the grid's fit.
// The oracle for the scaling: the grid's points refitted here, times the probe's factors, must be
// the file's coefficients.
TEST(CalibrateCli, ServeProbeScalesTheGridsFitByTheTestbedsForwards) {
    test::TempDir dir("calibrate_probe");
    const std::string out = dir.str("cost.json");
    test::CmdResult r = test::run_pdsim({"calibrate", "--quick", "--model", "tiny", "--tp", "1",
                                         "--threads", "1", "--transport", "none", "--out", out},
                                        300);
    ASSERT_EQ(r.rc, 0) << r.describe();
    if (r.err.find("no mpirun on PATH") != std::string::npos) GTEST_SKIP() << "no mpirun";
    EXPECT_THAT(r.err, HasSubstr("serve probe tp 1 threads 1"));
    EXPECT_THAT(r.out, HasSubstr("serve probe tp 1 threads 1: fits scaled by"));
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& fit = f->json()["fits"][0];
    ASSERT_TRUE(fit.contains("serve_probe")) << fit.dump();
    const json& probe = fit["serve_probe"];
    // The grid and the probe ran as a testbed rank does by default: bound, the caller running its
    // stream's work; the probe's testbed ranks sampled the speed probe, whose level is kept.
    EXPECT_EQ(f->json()["stream_sync"], "caller");
    EXPECT_EQ(f->json()["bind"], "core");
    EXPECT_THAT(r.err, HasSubstr("--stream-sync caller"));
    EXPECT_THAT(r.err, HasSubstr("--bind-to core"));
    ASSERT_EQ(probe["speed_cpu_ms"].size(), 1u) << probe.dump();  // --quick: one run
    ASSERT_TRUE(f->speed_probe().has_value()) << f->json().dump();
    EXPECT_EQ(f->speed_probe()->kernel, std::string(kSpeedProbeKernel));
    EXPECT_DOUBLE_EQ(f->speed_probe()->cpu_ms_p50, probe["speed_cpu_ms"][0].get<double>());
    EXPECT_GT(f->speed_probe()->cpu_ms_p50, 0);
    // The probe's forwards that the other instance overlapped give the fit its interference.
    ASSERT_TRUE(fit.contains("interference")) << fit.dump();
    for (const char* kind : {"extend", "decode"}) {
        EXPECT_GE(fit["interference"][kind].get<double>(), 0) << kind;
        EXPECT_TRUE(fit["interference"]["overlapped_forwards"][kind].is_number_unsigned());
    }
    EXPECT_THAT(r.err, HasSubstr("serve probe tp 1 threads 1: interference extend"));
    std::vector<std::vector<double>> ex, dx;
    std::vector<double> ey, dy;
    for (const auto& p : fit["points"]) {
        if (p["kind"] == "extend") {
            std::vector<ExtendItem> items(
                p["requests"].get<size_t>(),
                {p["new_tokens"].get<int64_t>(), p["cached_tokens"].get<int64_t>()});
            const auto x = extend_features(items);
            ex.emplace_back(x.begin(), x.end());
            ey.push_back(p["s"].get<double>());
        } else {
            const auto x =
                decode_features(p["batch"].get<int64_t>(), p["kv_tokens"].get<int64_t>());
            dx.emplace_back(x.begin(), x.end());
            dy.push_back(p["s"].get<double>());
        }
    }
    for (bool decode : {false, true}) {
        const char* kind = decode ? "decode" : "extend";
        const double factor = probe[std::string(kind) + "_factor"].get<double>();
        EXPECT_GE(factor, 0.2) << kind;
        EXPECT_LE(factor, 5.0) << kind;
        EXPECT_GT(probe[std::string(kind) + "_forwards"].get<size_t>(), 0u) << kind;
        auto grid = fit_nonnegative(decode ? dx : ex, decode ? dy : ey);
        ASSERT_OK(grid);
        const auto& keys = decode
                               ? std::vector<const char*>(kDecodeKeys.begin(), kDecodeKeys.end())
                               : std::vector<const char*>(kExtendKeys.begin(), kExtendKeys.end());
        for (size_t i = 0; i < keys.size(); ++i) {
            const double want = grid->coef[i] * factor;
            EXPECT_NEAR(fit[kind].value(keys[i], 0.0), want, 1e-12 + 1e-9 * want)
                << kind << "." << keys[i];
        }
    }
}

// --topology: the probe runs that topology (its TP sizes become --tp), each fit is scaled by its
// own forwards there, and the core wait is measured (or a note says too few requests saw it).
TEST(CalibrateCli, TopologyProbeRunsTheTopologyAndMeasuresTheCoreWait) {
    test::TempDir dir("calibrate_topology");
    const std::string out = dir.str("cost.json");
    test::CmdResult r =
        test::run_pdsim({"calibrate", "--quick", "--model", "tiny", "--topology",
                         "cpu-2p1d-tp2-to-tp1", "--transport", "none", "--out", out},
                        300);
    ASSERT_EQ(r.rc, 0) << r.describe();
    if (r.err.find("no mpirun on PATH") != std::string::npos) GTEST_SKIP() << "no mpirun";
    EXPECT_THAT(r.err, HasSubstr("serve probe topology cpu-2p1d-tp2-to-tp1 threads 1, run 1/1"));
    EXPECT_THAT(r.err, HasSubstr("-np 5"));
    EXPECT_THAT(r.err, HasSubstr("--synthetic 24 --time-scale"));
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& j = f->json();
    EXPECT_EQ(j["topology"], "cpu-2p1d-tp2-to-tp1");
    ASSERT_EQ(j["fits"].size(), 2u);  // TP 1 (decode) and TP 2 (prefill): the topology's
    for (const json& fit : j["fits"]) {
        ASSERT_TRUE(fit.contains("serve_probe")) << fit.dump();
        EXPECT_EQ(fit["serve_probe"]["topology"], "cpu-2p1d-tp2-to-tp1");
        EXPECT_EQ(fit["serve_probe"]["runs"], 1);
    }
    // The decode instance is TP 1, the prefill instances TP 2: each fit saw its own kind only.
    EXPECT_GT(j["fits"][0]["serve_probe"]["decode_forwards"].get<size_t>(), 0u);
    EXPECT_EQ(j["fits"][0]["serve_probe"]["extend_forwards"].get<size_t>(), 0u);
    EXPECT_EQ(j["fits"][1]["serve_probe"]["decode_forwards"].get<size_t>(), 0u);
    EXPECT_THAT(j["notes"].dump(), HasSubstr("extend forwards of tp 1 threads 1"));
    // One set of runs for both fits: the speed probe counts it once.
    ASSERT_TRUE(j.contains("speed_probe"));
    EXPECT_EQ(j["speed_probe"]["runs"], 1);
    if (j.contains("core_wait")) {
        EXPECT_GE(j["core_wait"]["events"].get<size_t>(), 8u);
        EXPECT_GE(f->core_wait()->dispatch_s, 0.0);
        EXPECT_THAT(r.out, HasSubstr("core wait (cpu-2p1d-tp2-to-tp1)"));
    } else {
        EXPECT_THAT(j["notes"].dump(), HasSubstr("fewer than 8: no core_wait"));
    }
    // The step wait: the decode rank shares core 0 with both prefill instances' rank 0.
    if (j.contains("step_wait")) {
        ASSERT_TRUE(f->step_wait().has_value());
        ASSERT_FALSE(f->step_wait()->decode.empty());
        EXPECT_EQ(j["step_wait"]["topology"], "cpu-2p1d-tp2-to-tp1");
        EXPECT_GE(j["step_wait"]["decode"][0]["gaps"].get<size_t>(), 30u);
        EXPECT_THAT(r.out, HasSubstr("step wait (cpu-2p1d-tp2-to-tp1)"));
    } else {
        EXPECT_THAT(j["notes"].dump(), HasSubstr("no step_wait"));
    }

    // One colocated instance: nothing for a --mode disagg probe to run. A GPU topology: the probe
    // runs CPU ranks.
    const std::string colocated = dir.str("colocated.yaml");
    std::ofstream(colocated)
        << "name: one\nmodel: tiny\nworld_size: 1\nnodes:\n  - id: n0\n    devices:\n"
           "      - {id: n0.cpu0, type: cpu}\ninstances:\n"
           "  - {id: c0, role: colocated, tp: 1, devices: [n0.cpu0]}\n";
    for (const auto& [args, flag] : std::vector<std::pair<std::vector<std::string>, std::string>>{
             {{"--topology", "no-such-topology"}, "--topology no-such-topology"},
             {{"--topology", "cpu-2p1d-tp2-to-tp1", "--serve-probe", "off"}, "--topology"},
             {{"--topology", colocated}, "prefill and decode instances"},
             {{"--topology", "gpu-1p1d"}, "the serve probe runs CPU ranks only"}}) {
        std::vector<std::string> a = {"calibrate", "--quick", "--model",
                                      "tiny",      "--out",   dir.str("bad.json")};
        a.insert(a.end(), args.begin(), args.end());
        test::CmdResult bad = test::run_pdsim(a, 60);
        EXPECT_EQ(bad.rc, 2) << bad.describe();
        EXPECT_THAT(bad.err, HasSubstr(flag));
    }
}

// A probe that fails (an mpirun that exits 3) does not throw the grid's measurement away: the file
// is written with the grid's fits and a note, and calibrate exits 1 naming the probe's command.
TEST(CalibrateCli, AFailedServeProbeStillWritesTheGridsFits) {
    test::TempDir dir("calibrate_probe_fail");
    const std::string out = dir.str("cost.json");
    std::filesystem::create_directories(dir.path() / "bin");
    {
        std::ofstream fake(dir.path() / "bin" / "mpirun");
        fake << "#!/bin/sh\necho 'fake mpirun: no launch' >&2\nexit 3\n";
    }
    std::filesystem::permissions(dir.path() / "bin" / "mpirun", std::filesystem::perms::owner_all);
    test::CmdResult r = test::run_command("env PATH=" + test::shell_quote(dir.str("bin")) +
                                              ":\"$PATH\" " + test::shell_quote(PDSIM_BINARY),
                                          {"calibrate", "--quick", "--model", "tiny", "--tp", "1",
                                           "--threads", "1", "--transport", "none", "--out", out},
                                          240);
    EXPECT_EQ(r.rc, 1) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("serve probe for tp 1 threads 1"));
    EXPECT_THAT(r.err, HasSubstr("exit 3"));
    EXPECT_THAT(r.err, HasSubstr("fake mpirun: no launch"));  // the log's tail
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& fit = f->json()["fits"][0];
    EXPECT_FALSE(fit.contains("serve_probe")) << fit.dump();
    EXPECT_GT(fit["extend"]["per_token_s"].get<double>(), 0);
    EXPECT_THAT(f->json()["notes"].dump(), HasSubstr("serve probe failed"));
}

TEST(CalibrateCli, BadFlagsExit2NamingTheFlag) {
    test::TempDir dir("calibrate");
    const std::string out = dir.str("cost.json");
    struct Case {
        std::vector<std::string> args;
        std::string mention;
    };
    const std::vector<Case> cases = {
        {{"calibrate", "--model", "tiny", "--out", out, "--bogus"}, "--bogus"},
        {{"calibrate", "--model", "tiny"}, "--out"},
        {{"calibrate", "--model", "tiny", "--out", out, "--tp", "3"}, "--tp"},
        {{"calibrate", "--model", "tiny", "--out", out, "--tp", "x"}, "--tp"},
        {{"calibrate", "--model", "tiny", "--out", out, "--threads", "0"}, "--threads"},
        {{"calibrate", "--model", "tiny", "--out", out, "--transport", "pigeon"}, "--transport"},
        {{"calibrate", "--model", "tiny", "--out", out, "--backend", "gpu"}, "--backend"},
        {{"calibrate", "--model", "tiny", "--out", out, "--serve-probe", "maybe"}, "--serve-probe"},
        {{"calibrate", "--model", "tiny", "--out", out, "--stream-sync", "maybe"}, "--stream-sync"},
        {{"calibrate", "--model", "tiny", "--out", out, "--bind", "socket"}, "--bind"},
        {{"calibrate", "--model", "no-such-model", "--out", out}, "--model"},
        {{"calibrate", "--model", "tiny", "--out", dir.str("no/such/dir/cost.json")}, "--out"},
    };
    for (const auto& c : cases) {
        test::CmdResult r = test::run_pdsim(c.args, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.mention)) << "stderr does not name " << c.mention << "\n"
                                                 << r.describe();
    }
}

// ---- pdsim calibrate --from-timeline ----

constexpr std::array<double, 4> kTimelineExtend = {1.0e-3, 1.0e-4, 5.0e-8, 2.0e-4};
constexpr std::array<double, 4> kTimelineDecode = {2.0e-4, 1.0e-5, 3.0e-4, 1.0e-8};

json forward_slice(int pid, double ts, double dur_us, json args) {
    return {{"name", "forward"}, {"cat", "forward"}, {"ph", "X"},     {"pid", pid},
            {"tid", 0},          {"ts", ts},         {"dur", dur_us}, {"args", std::move(args)}};
}

// Forwards of a TP-1 instance (both kinds) and a TP-2 instance (extend only, leader and
// follower), timed exactly by the coefficients above, 1 s apart; the follower's times are 3x, so
// counting it would show in the fit. Plus one TP-1 extend forward 10x slow that overlaps a
// forward of another instance: it must be left out.
json synthetic_timeline(bool with_tp2) {
    json ev = json::array();
    ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "r0"}}}});
    double ts = 0;
    auto add_extend = [&](int pid, int instance, int tp, int tp_rank,
                          const std::vector<ExtendItem>& items, double scale) {
        const auto f = extend_features(items);
        double s = 0;
        for (size_t i = 0; i < f.size(); ++i) s += kTimelineExtend[i] * f[i] / tp;
        json it = json::array();
        for (const auto& x : items) it.push_back({x.new_tokens, x.cached_tokens});
        ev.push_back(forward_slice(pid, ts, s * 1e6 * scale,
                                   {{"instance", instance},
                                    {"tp", tp},
                                    {"tp_rank", tp_rank},
                                    {"threads", 1},
                                    {"num_requests", items.size()},
                                    {"items", it}}));
    };
    auto add_decode = [&](int b, int kv) {
        const auto f = decode_features(b, static_cast<int64_t>(b) * kv);
        double s = 0;
        for (size_t i = 0; i < f.size(); ++i) s += kTimelineDecode[i] * f[i];
        ev.push_back(forward_slice(1, ts, s * 1e6,
                                   {{"instance", 1},
                                    {"tp", 1},
                                    {"tp_rank", 0},
                                    {"threads", 1},
                                    {"batch", b},
                                    {"kv_tokens", static_cast<int64_t>(b) * kv}}));
    };
    for (int r : {1, 2, 3, 5}) {
        for (int n : {16, 100, 512}) {
            for (int c : {0, 300}) {
                std::vector<ExtendItem> items(static_cast<size_t>(r), {n, c});
                items[0].new_tokens += 7;  // unequal requests
                ts += 1e6;
                add_extend(0, 0, 1, 0, items, 1.0);
                if (with_tp2) {
                    ts += 1e6;
                    add_extend(2, 2, 2, 0, items, 1.0);
                    add_extend(3, 2, 2, 1, items, 3.0);
                }
            }
        }
    }
    for (int b : {1, 2, 3, 4, 5, 7, 8, 12, 16}) {
        for (int kv : {40, 500, 1500}) {
            ts += 1e6;
            add_decode(b, kv);
        }
    }
    ts += 1e6;
    add_extend(0, 0, 1, 0, {{300, 0}}, 10.0);
    ts += 1e3;
    add_decode(4, 100);  // inside the slow extend: another instance computing
    return {{"traceEvents", ev}, {"displayTimeUnit", "ms"}};
}

void write_json(const std::string& path, const json& j) {
    std::ofstream(path) << j.dump() << "\n";
}

TEST(CalibrateTimeline, RecoversTheCoefficientsFromLeadersOnly) {
    test::TempDir dir("calibrate-timeline");
    const std::string tl = dir.str("tl.json"), base = dir.str("base.json");
    const std::string out = dir.str("cost.json");
    write_json(tl, synthetic_timeline(true));
    // TP 2 has no decode forwards: they come from --base, marked as such.
    json b = {
        {"schema_version", 1},
        {"model", "tiny"},
        {"fits",
         {{{"tp", 2},
           {"threads", 1},
           {"extend",
            {{"const_s", 9}, {"per_token_s", 9}, {"per_attn_pair_s", 9}, {"per_request_s", 9}}},
           {"decode", {{"const_s", 0.5}, {"per_request_s", 0}, {"per_kv_token_s", 0}}}}}}};
    write_json(base, b);
    test::CmdResult r = test::run_pdsim(
        {"calibrate", "--from-timeline", tl, "--base", base, "--model", "tiny", "--out", out}, 60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& j = f->json();
    EXPECT_EQ(j["source"]["kind"], "testbed timelines");
    EXPECT_EQ(j["source"]["files"][0]["path"], tl);
    EXPECT_EQ(j["source"]["files"][0]["overlapped_skipped"], 2);
    ASSERT_EQ(j["fits"].size(), 2u) << j.dump();
    for (const json& fit : j["fits"]) {
        const int tp = fit["tp"].get<int>();
        EXPECT_EQ(fit["threads"], 1);
        for (size_t i = 0; i < kExtendKeys.size(); ++i) {
            EXPECT_NEAR(fit["extend"][kExtendKeys[i]].get<double>(), kTimelineExtend[i] / tp,
                        1e-6 * kTimelineExtend[i])
                << "tp " << tp << " " << kExtendKeys[i];
        }
        EXPECT_EQ(fit["extend"]["num_points"], 24) << "tp " << tp;  // the follower not counted
        EXPECT_EQ(fit["extend"]["source"], "timeline");
        if (tp == 1) {
            for (size_t i = 0; i < kDecodeKeys.size(); ++i) {
                EXPECT_NEAR(fit["decode"][kDecodeKeys[i]].get<double>(), kTimelineDecode[i],
                            1e-6 * kTimelineDecode[i])
                    << kDecodeKeys[i];
            }
            EXPECT_EQ(fit["decode"]["num_points"], 27);  // the overlapped one left out
        } else {
            EXPECT_EQ(fit["decode"]["const_s"], 0.5);
            EXPECT_EQ(fit["decode"]["source"], "base " + base);
        }
    }
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(m);
    const std::vector<ExtendItem> one = {{256, 128}};
    const auto fe = extend_features(one);
    double want = 0;
    for (size_t i = 0; i < fe.size(); ++i) want += kTimelineExtend[i] * fe[i];
    EXPECT_NEAR((*m)->extend_s(one), want, 1e-9);
}

// Interference: the synthetic timeline's forwards (exact) plus pairs of one TP-1 extend and one
// TP-1 decode of two instances that overlap, timed as the simulator's model says for interference
// x_e (extend) and x_d (decode) on 2 cores (no core sharing): the decode runs inside the extend,
// (1 + x_d) slower all along; the extend is (1 + x_e) slower while the decode runs.
TEST(CalibrateTimeline, MeasuresInterferenceAndNoise) {
    constexpr double kXe = 0.1, kXd = 0.25;
    test::TempDir dir("calibrate-timeline");
    const std::string tl = dir.str("tl.json"), out = dir.str("cost.json");
    json t = synthetic_timeline(false);
    json& ev = t["traceEvents"];
    ev.erase(ev.end() - 2, ev.end());  // the overlapped pair of synthetic_timeline
    double ts = 1e9;
    for (int k = 0; k < 12; ++k) {
        const std::vector<ExtendItem> items = {{100 + 40 * k, 0}};
        const auto fe = extend_features(items);
        double e = 0;
        for (size_t i = 0; i < fe.size(); ++i) e += kTimelineExtend[i] * fe[i];
        const auto fd = decode_features(2, 600);
        double d = 0;
        for (size_t i = 0; i < fd.size(); ++i) d += kTimelineDecode[i] * fd[i];
        const double d_obs = d * (1 + kXd);
        // iso e = alone + shared / (1 + x_e), shared = d_obs.
        const double e_obs = e - d_obs / (1 + kXe) + d_obs;
        ASSERT_GT(e_obs, d_obs);
        ts += 1e6;
        ev.push_back(forward_slice(0, ts, e_obs * 1e6,
                                   {{"instance", 0},
                                    {"tp", 1},
                                    {"tp_rank", 0},
                                    {"threads", 1},
                                    {"num_requests", 1},
                                    {"items", {{items[0].new_tokens, 0}}}}));
        ev.push_back(forward_slice(1, ts + 10, d_obs * 1e6,
                                   {{"instance", 1},
                                    {"tp", 1},
                                    {"tp_rank", 0},
                                    {"threads", 1},
                                    {"batch", 2},
                                    {"kv_tokens", 600}}));
    }
    write_json(tl, t);
    test::CmdResult r = test::run_pdsim(
        {"calibrate", "--from-timeline", tl, "--node-cpus", "2", "--model", "tiny", "--out", out},
        60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& j = f->json();
    EXPECT_NEAR(j["interference"]["extend"].get<double>(), kXe, 1e-6) << j["interference"].dump();
    EXPECT_NEAR(j["interference"]["decode"].get<double>(), kXd, 1e-6) << j["interference"].dump();
    EXPECT_EQ(j["interference"]["overlapped_forwards"]["decode"], 12);
    EXPECT_THAT(r.out, HasSubstr("interference"));
    // The fitted forwards are exact: no noise, every quantile 1.
    for (const char* kind : {"extend", "decode"}) {
        const json& n = j["noise"][kind];
        EXPECT_NEAR(n["fast_cv"].get<double>(), 0, 1e-6) << kind;
        EXPECT_EQ(n["slow_cv"].get<double>(), 0) << kind;
        ASSERT_EQ(n["fast_quantiles"].size(), 33u) << kind;
        for (const auto& q : n["fast_quantiles"]) EXPECT_NEAR(q.get<double>(), 1, 1e-6) << kind;
    }
    auto m = make_cost_model("calibrated", cpu_spec("tiny", 1, 1), &*f);
    ASSERT_OK(m);
    EXPECT_NEAR((*m)->interference(false), kXe, 1e-6);
    EXPECT_NEAR((*m)->interference(true), kXd, 1e-6);
    EXPECT_EQ((*m)->noise(true).fast_quantiles.size(), 33u);

    // Decode forwards alternately 0.8x and 1.2x: fast noise of cv 0.2, spread 0.8 .. 1.2 (the
    // points are 1 s apart, so no window holds 3 of them: no slow part).
    json t2 = synthetic_timeline(false);
    int k = 0;
    for (json& e : t2["traceEvents"]) {
        if (!e.contains("args") || !e["args"].contains("kv_tokens")) continue;
        e["dur"] = e["dur"].get<double>() * (k++ % 2 ? 1.2 : 0.8);
    }
    // The distribution the simulator draws from (linear between the quantiles) has mean 1.
    auto drawn_mean = [](const json& q) {
        double sum = 0;
        for (size_t i = 0; i + 1 < q.size(); ++i) {
            sum += (q[i].get<double>() + q[i + 1].get<double>()) / 2;
        }
        return sum / static_cast<double>(q.size() - 1);
    };
    t2["traceEvents"].erase(t2["traceEvents"].end() - 2, t2["traceEvents"].end());
    write_json(tl, t2);
    r = test::run_pdsim({"calibrate", "--from-timeline", tl, "--model", "tiny", "--out", out}, 60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    auto f2 = CostFile::load(out);
    ASSERT_OK(f2);
    const json& n = f2->json()["noise"]["decode"];
    EXPECT_NEAR(n["fast_cv"].get<double>(), 0.2, 0.05) << n.dump();
    EXPECT_EQ(n["slow_cv"].get<double>(), 0);
    EXPECT_NEAR(n["fast_quantiles"].front().get<double>(), 0.8, 0.1) << n.dump();
    EXPECT_NEAR(n["fast_quantiles"].back().get<double>(), 1.2, 0.1) << n.dump();
    EXPECT_NEAR(drawn_mean(n["fast_quantiles"]), 1.0, 1e-9) << n.dump();

    // One extend forward 8x slow among 24 exact ones: the maximum alone, interpolated, would
    // make the drawn mean far above the sample's; the highest quantile is set to keep it at 1.
    json t3 = synthetic_timeline(false);
    t3["traceEvents"].erase(t3["traceEvents"].end() - 2, t3["traceEvents"].end());
    for (json& e : t3["traceEvents"]) {
        if (e.contains("args") && e["args"].contains("items")) {
            e["dur"] = e["dur"].get<double>() * 8;
            break;
        }
    }
    write_json(tl, t3);
    r = test::run_pdsim({"calibrate", "--from-timeline", tl, "--model", "tiny", "--out", out}, 60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    auto f3 = CostFile::load(out);
    ASSERT_OK(f3);
    const json& q3 = f3->json()["noise"]["extend"]["fast_quantiles"];
    EXPECT_NEAR(drawn_mean(q3), 1.0, 1e-9) << q3.dump();
    EXPECT_GT(q3.back().get<double>(), 2.0) << q3.dump();
}

// Three runs of the same forwards, the third 30% slower throughout (a slow host): the fit follows
// the median run, and the source reports each run's level.
TEST(CalibrateTimeline, FitsTheMedianRunLevel) {
    test::TempDir dir("calibrate-timeline");
    std::vector<std::string> files;
    for (double level : {1.0, 1.0, 1.3}) {
        json t = synthetic_timeline(false);
        for (json& e : t["traceEvents"]) {
            if (e.contains("dur")) e["dur"] = e["dur"].get<double>() * level;
        }
        files.push_back(dir.str("tl" + std::to_string(files.size()) + ".json"));
        write_json(files.back(), t);
    }
    const std::string out = dir.str("cost.json");
    test::CmdResult r =
        test::run_pdsim({"calibrate", "--from-timeline", files[0] + "," + files[1] + "," + files[2],
                         "--model", "tiny", "--out", out},
                        60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    auto f = CostFile::load(out);
    ASSERT_OK(f);
    const json& j = f->json();
    const json& fit = j["fits"][0];
    for (size_t i = 0; i < kExtendKeys.size(); ++i) {
        EXPECT_NEAR(fit["extend"][kExtendKeys[i]].get<double>(), kTimelineExtend[i],
                    1e-6 * kTimelineExtend[i])
            << kExtendKeys[i];
    }
    for (size_t i = 0; i < kDecodeKeys.size(); ++i) {
        EXPECT_NEAR(fit["decode"][kDecodeKeys[i]].get<double>(), kTimelineDecode[i],
                    1e-6 * kTimelineDecode[i])
            << kDecodeKeys[i];
    }
    const json& levels = j["source"]["run_levels"];
    ASSERT_EQ(levels.size(), 3u) << j["source"].dump();
    EXPECT_NEAR(levels[0]["decode"].get<double>(), 1.0, 1e-6);
    EXPECT_NEAR(levels[2]["decode"].get<double>(), 1.3, 1e-6);
    EXPECT_NEAR(levels[2]["extend"].get<double>(), 1.3, 1e-6);
    EXPECT_THAT(r.out, HasSubstr("run level"));
}

// The fit of the mean (testbed timelines) against the relative fit (microbenchmarks) on skewed
// times of one shape: 1, 1, 1, 1, 5.
TEST(CalibratedFit, MeanTargetFitsTheMeanOfSkewedTimes) {
    const std::vector<std::vector<double>> x(5, std::vector<double>{1.0});
    const std::vector<double> y = {1, 1, 1, 1, 5};
    auto rel = fit_nonnegative(x, y, FitTarget::kRelative);
    auto mean = fit_nonnegative(x, y, FitTarget::kMean);
    ASSERT_TRUE(rel.ok() && mean.ok());
    // Relative: sum (c / y - 1)^2 is least at c = sum(1 / y) / sum(1 / y^2) = 4.2 / 4.04.
    EXPECT_NEAR(rel->coef[0], 4.2 / 4.04, 1e-12);
    EXPECT_NEAR(mean->coef[0], 1.8, 1e-12);
}

TEST(CalibrateTimeline, BadTimelinesExit2NamingTheFile) {
    test::TempDir dir("calibrate-timeline");
    const std::string out = dir.str("cost.json");
    const std::string empty = dir.str("empty.json"), tp2 = dir.str("tp2.json");
    const std::string few = dir.str("few.json");
    // A timeline with other slices but no forward slices.
    write_json(empty, {{"traceEvents",
                        {{{"name", "L0"},
                          {"cat", "compute"},
                          {"ph", "X"},
                          {"pid", 0},
                          {"tid", 1},
                          {"ts", 0},
                          {"dur", 5}}}}});
    write_json(tp2, synthetic_timeline(true));  // tp 2 without decode forwards, no --base
    json t = synthetic_timeline(false);
    json& ev = t["traceEvents"];
    ev.erase(ev.begin() + 4, ev.begin() + 24);  // 3 TP-1 extend forwards left (+1 overlapped)
    write_json(few, t);
    struct Case {
        std::string file, mention;
    };
    for (const Case& c : {Case{empty, "no forward slices"}, Case{dir.str("missing.json"), "open"},
                          Case{tp2, "no decode forwards"}, Case{few, "too few"}}) {
        test::CmdResult r = test::run_pdsim(
            {"calibrate", "--from-timeline", c.file, "--model", "tiny", "--out", out}, 60);
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.file)) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.mention)) << r.describe();
    }
}

// pdsim cost-check: a cost file fitted from a timeline predicts that timeline's isolated forwards
// exactly (the synthetic forwards are exact); bad input exits 2 naming the file or the TP.
TEST(CostCheckCli, ComparesForwardsAndRefusesBadInput) {
    test::TempDir dir("cost-check");
    const std::string tl = dir.str("tl.json"), cost = dir.str("cost.json");
    const std::string tp4 = dir.str("tp4.json");
    write_json(tl, synthetic_timeline(false));
    test::CmdResult fit =
        test::run_pdsim({"calibrate", "--from-timeline", tl, "--model", "tiny", "--out", cost}, 60);
    ASSERT_EQ(fit.rc, 0) << fit.describe();
    // Three more decode forwards of 0.8 ms, 0.2 ms apart, long after the rest: two gaps.
    json with_gaps = synthetic_timeline(false);
    for (int i = 0; i < 3; ++i) {
        with_gaps["traceEvents"].push_back(forward_slice(1, 1e12 + 1000.0 * i, 800,
                                                         {{"instance", 1},
                                                          {"tp", 1},
                                                          {"tp_rank", 0},
                                                          {"threads", 1},
                                                          {"batch", 1},
                                                          {"kv_tokens", 64}}));
    }
    write_json(dir.str("gaps_tl.json"), with_gaps);
    test::CmdResult r =
        test::run_pdsim({"cost-check", "--timeline", dir.str("gaps_tl.json"), "--cost-model", cost,
                         "--json", dir.str("rows.json"), "--gaps-json", dir.str("gaps.json")},
                        60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("| extend | 1 | 1 | no | all |"));
    EXPECT_THAT(r.out, HasSubstr("Time between an instance's forwards"));
    // The gap rows are forward_gaps' (worked by hand in timeline_fit_test): here, as JSON.
    const json gaps = json::parse(std::ifstream(dir.str("gaps.json")));
    ASSERT_TRUE(gaps.is_array());
    ASSERT_EQ(gaps.size(), 1u) << gaps.dump();
    EXPECT_EQ(gaps[0]["instance"], 1);
    EXPECT_EQ(gaps[0]["kind"], "decode");
    EXPECT_EQ(gaps[0]["others_computing"], false);
    EXPECT_EQ(gaps[0]["count"], 2);
    EXPECT_NEAR(gaps[0]["gap_ms_mean"].get<double>(), 0.2, 1e-9);
    EXPECT_THAT(r.out, HasSubstr("| 1.00 / 1.00 / 1.00 |"));
    const json rows = json::parse(std::ifstream(dir.str("rows.json")));
    ASSERT_TRUE(rows.is_array());
    bool saw_isolated_decode = false;
    for (const json& row : rows) {
        if (row["kind"] == "decode" && !row["overlapped"].get<bool>() && row["bucket"] == "all") {
            saw_isolated_decode = true;
            EXPECT_NEAR(row["ratio_p50"].get<double>(), 1.0, 1e-6) << row.dump();
        }
    }
    EXPECT_TRUE(saw_isolated_decode) << rows.dump();
    // A timeline with a TP-4 forward, which the cost file has no fit for; a missing timeline; no
    // flags.
    json t = synthetic_timeline(false);
    for (json& ev : t["traceEvents"]) {
        if (ev.contains("args") && ev["args"].contains("tp")) {
            ev["args"]["tp"] = 4;
            break;
        }
    }
    write_json(tp4, t);
    test::CmdResult no_tp4 =
        test::run_pdsim({"cost-check", "--timeline", tp4, "--cost-model", cost}, 60);
    EXPECT_EQ(no_tp4.rc, 2) << no_tp4.describe();
    EXPECT_THAT(no_tp4.err, HasSubstr("tp 4")) << no_tp4.describe();
    const std::string missing = dir.str("missing.json");
    test::CmdResult gone =
        test::run_pdsim({"cost-check", "--timeline", missing, "--cost-model", cost}, 60);
    EXPECT_EQ(gone.rc, 2) << gone.describe();
    EXPECT_THAT(gone.err, HasSubstr(missing)) << gone.describe();
    test::CmdResult bare = test::run_pdsim({"cost-check"}, 60);
    EXPECT_EQ(bare.rc, 2) << bare.describe();
    EXPECT_THAT(bare.err, HasSubstr("--timeline")) << bare.describe();
}

}  // namespace
}  // namespace pdsim::cost
