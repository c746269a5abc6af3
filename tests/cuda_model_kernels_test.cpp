// The GPU synthetic model's kernels and its GEMMs (backends/cuda/model_kernels.h, gemm.h) on a
// GPU, each against a host oracle written here: outputs are poisoned before every launch and the
// largest error is printed. Weights must be bit-equal to SyntheticModel::weight_value; the pinned
// GEMM must give bit-identical rows whatever rows it is batched with. Skips with the runtime's
// reason where there is no GPU (or pdsim was built without CUDA); never passes silently there.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cuda/gemm.h"
#include "backends/cuda/model_kernels.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/device.h"
#include "common/bf16.h"
#include "tests/status_matchers.h"

namespace pdsim::model::cuda {
namespace {

using runtime::DeviceBuffer;
using runtime::DeviceKind;
using runtime::DType;
using ::testing::HasSubstr;

constexpr uint16_t kPoisonBf16 = 0xffff;  // a NaN
constexpr float kBf16Eps = 1.0f / 128;    // bf16 has 8 significant bits: ulp(1) = 2^-7

std::string skip_reason() {
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->unavailable_reason();
}

bool have_gpu() {
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    return rt.ok() && (*rt)->device_count() > 0;
}

// A CUDA stream and device buffers for one test.
class GpuTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (!have_gpu()) GTEST_SKIP() << skip_reason();
        auto rt = runtime::device_runtime(DeviceKind::kCuda);
        auto s = (*rt)->create_stream(0, "model-kernels-test");
        ASSERT_OK(s);
        stream_ = std::move(*s);
    }

    runtime::Stream& stream() { return *stream_; }

    template <typename T>
    DeviceBuffer upload(const std::vector<T>& host) {
        auto b = DeviceBuffer::allocate({DeviceKind::kCuda, 0},
                                        std::max<size_t>(1, host.size() * sizeof(T)));
        EXPECT_OK(b);
        if (!host.empty()) {
            EXPECT_OK(b->copy_from_host(host.data(), host.size() * sizeof(T)));
        }
        return std::move(*b);
    }
    // `count` elements of poison (every byte 0xff: NaN for bf16/fp32, -1 for int32).
    template <typename T>
    DeviceBuffer poisoned(size_t count) {
        auto b =
            DeviceBuffer::allocate({DeviceKind::kCuda, 0}, std::max<size_t>(1, count * sizeof(T)));
        EXPECT_OK(b);
        EXPECT_OK(b->fill(0xff));
        return std::move(*b);
    }
    // Waits for the stream, then copies `count` elements back.
    template <typename T>
    std::vector<T> download(const DeviceBuffer& b, size_t count) {
        EXPECT_OK(stream_->synchronize());
        std::vector<T> host(count);
        if (count > 0) {
            EXPECT_OK(b.copy_to_host(host.data(), count * sizeof(T)));
        }
        return host;
    }

private:
    std::unique_ptr<runtime::Stream> stream_;
};

class CudaModelKernels : public GpuTest {};
class CudaModelGemm : public GpuTest {};

std::vector<bf16_t> random_bf16(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<bf16_t> v(n);
    for (auto& x : v) x = float_to_bf16(dist(gen));
    return v;
}

float f(bf16_t h) {
    return bf16_to_float(h);
}

bool is_nan_bf16(bf16_t h) {
    return std::isnan(bf16_to_float(h));
}

// |got - want| <= tol * max(|want|, floor): bf16 results against double oracles.
struct ErrorTracker {
    double worst = 0;  // in units of the tolerance
    double max_abs = 0;
    int64_t bad = 0;
    void add(double got, double want, double tol_rel, double floor_abs) {
        const double err = std::abs(got - want);
        const double tol = tol_rel * std::max(std::abs(want), floor_abs);
        max_abs = std::max(max_abs, err);
        worst = std::max(worst, err / tol);
        if (!(err <= tol)) ++bad;
    }
};

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

// What the CPU model stores at element (r, c) of a GPU layout, from its own code
// (synthetic_model.cpp init_weights): [K][N] tensors indexed k * N_full + n, Wo/Wdown rows.
float cpu_weight(const ModelConfig& c, int tp, int rank, const std::string& which, int layer,
                 int64_t r, int64_t cc) {
    const int H = c.hidden, D = c.head_dim, HQ = c.num_q_heads, HKV = c.num_kv_heads,
              I = c.intermediate, V = c.vocab;
    const int hq = HQ / tp, hkv = HKV / tp, il = I / tp;
    const float s_h = 1.0f / std::sqrt(static_cast<float>(H));
    const float s_o = 1.0f / std::sqrt(static_cast<float>(HQ * D));
    const float s_i = 1.0f / std::sqrt(static_cast<float>(I));
    auto id = [](int l, uint64_t kind) { return (static_cast<uint64_t>(l + 1) << 8) | kind; };
    auto w = [&](uint64_t tensor, uint64_t index, float scale) {
        return SyntheticModel::weight_value(c.seed, tensor, index, scale);
    };
    if (which == "qkv") {  // (n, k)
        int64_t n = r;
        const int64_t k = cc;
        if (n < int64_t{hq} * D)
            return w(id(layer, 1), static_cast<uint64_t>(k * HQ * D + rank * hq * D + n), s_h);
        n -= int64_t{hq} * D;
        const uint64_t kind = n < int64_t{hkv} * D ? 2 : 3;
        n %= int64_t{hkv} * D;
        return w(id(layer, kind), static_cast<uint64_t>(k * HKV * D + rank * hkv * D + n), s_h);
    }
    if (which == "o_proj")
        return w(id(layer, 4), static_cast<uint64_t>((rank * hq * D + cc) * H + r), s_o);
    if (which == "gate_up") {
        const uint64_t kind = r < il ? 5 : 6;
        return w(id(layer, kind), static_cast<uint64_t>(cc * I + rank * il + r % il), s_h);
    }
    if (which == "down")
        return w(id(layer, 7), static_cast<uint64_t>((rank * il + cc) * H + r), s_i);
    if (which == "norm1") return 1.0f + w(id(layer, 8), static_cast<uint64_t>(cc), 0.1f);
    if (which == "final_norm") return 1.0f + w(id(-1, 11), static_cast<uint64_t>(cc), 0.1f);
    if (which == "embed") return w(id(-1, 10), static_cast<uint64_t>(r * H + cc), 1.0f);
    if (which == "lm_head") return w(id(-1, 12), static_cast<uint64_t>(cc * V + r), s_h);
    ADD_FAILURE() << "unknown tensor " << which;
    return 0.f;
}

TEST_F(CudaModelKernels, WeightsAreBitEqualToTheCpuGenerator) {
    ModelConfig c = *resolve_model("tiny");
    c.seed = 98765;
    for (int tp : {1, 2}) {
        const int rank = tp - 1;
        const ModelDims d = *make_model_dims(c, tp, rank);
        const int layer = 2;
        const std::pair<std::string, WeightLayout> layouts[] = {
            {"qkv", qkv_weight_layout(d, layer)},
            {"o_proj", o_proj_weight_layout(d, layer)},
            {"gate_up", gate_up_weight_layout(d, layer)},
            {"down", down_weight_layout(d, layer)},
            {"norm1", norm_weight_layout(d, layer, WeightKind::kNorm1)},
            {"final_norm", norm_weight_layout(d, -1, WeightKind::kFinalNorm)},
            {"embed", embedding_layout(d)},
            {"lm_head", lm_head_weight_layout(d)},
        };
        for (const auto& [which, layout] : layouts) {
            SCOPED_TRACE(which + " tp " + std::to_string(tp));
            const size_t n = static_cast<size_t>(layout.rows * layout.cols);
            DeviceBuffer f32 = poisoned<float>(n), b16 = poisoned<bf16_t>(n);
            ASSERT_OK(generate_weights(c.seed, layout, f32.data(), DType::kF32, stream()));
            ASSERT_OK(generate_weights(c.seed, layout, b16.data(), DType::kBF16, stream()));
            const auto got32 = download<float>(f32, n);
            const auto got16 = download<bf16_t>(b16, n);
            int64_t bad32 = 0, bad16 = 0;
            for (int64_t r = 0; r < layout.rows; ++r) {
                for (int64_t cc = 0; cc < layout.cols; ++cc) {
                    const float want = cpu_weight(c, tp, rank, which, layer, r, cc);
                    const size_t i = static_cast<size_t>(r * layout.cols + cc);
                    uint32_t a = 0, b = 0;
                    std::memcpy(&a, &got32[i], 4);
                    std::memcpy(&b, &want, 4);
                    if (a != b && bad32++ < 3)
                        ADD_FAILURE()
                            << "fp32 (" << r << ", " << cc << "): " << got32[i] << " vs " << want;
                    if (got16[i] != float_to_bf16(want) && bad16++ < 3) {
                        ADD_FAILURE() << "bf16 (" << r << ", " << cc << "): " << f(got16[i])
                                      << " vs " << want;
                    }
                }
            }
            EXPECT_EQ(bad32, 0);
            EXPECT_EQ(bad16, 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per-token kernels
// ---------------------------------------------------------------------------------------------

TEST_F(CudaModelKernels, EmbeddingGathersRowsAndPoisonsBadTokens) {
    const int V = 96, H = 64, T = 9, ld = 72;
    const auto table = random_bf16(size_t{V} * H, 1);
    const std::vector<int32_t> tokens = {5, 0, 95, -1, 17, 96, 5, 40, 3};
    DeviceBuffer dt = upload(table), dtok = upload(tokens), out = poisoned<bf16_t>(size_t{T} * ld);
    ASSERT_TRUE(embedding_gather(
                    {dt.as<bf16_t>(), dtok.as<int32_t>(), out.as<bf16_t>(), ld, T, H, V}, stream())
                    .ok());
    const auto got = download<bf16_t>(out, size_t{T} * ld);
    for (int t = 0; t < T; ++t) {
        for (int i = 0; i < ld; ++i) {
            const bf16_t g = got[static_cast<size_t>(t) * ld + i];
            if (i >= H) {
                EXPECT_EQ(g, kPoisonBf16) << "padding column written, row " << t;
            } else if (tokens[static_cast<size_t>(t)] < 0 || tokens[static_cast<size_t>(t)] >= V) {
                EXPECT_TRUE(is_nan_bf16(g)) << "row " << t;
            } else {
                EXPECT_EQ(g, table[static_cast<size_t>(tokens[static_cast<size_t>(t)]) * H + i])
                    << t << " " << i;
            }
        }
    }
}

// The CPU model's RMSNorm in double: x * (1 / sqrt(mean(x^2) + eps)) * w.
std::vector<double> rms_oracle(const std::vector<bf16_t>& x, int64_t ld, int rows, int H,
                               const std::vector<float>& w, float eps) {
    std::vector<double> out(static_cast<size_t>(rows) * H);
    for (int t = 0; t < rows; ++t) {
        double ss = 0;
        for (int i = 0; i < H; ++i) ss += static_cast<double>(f(x[t * ld + i])) * f(x[t * ld + i]);
        const double inv = 1.0 / std::sqrt(ss / H + eps);
        for (int i = 0; i < H; ++i)
            out[static_cast<size_t>(t) * H + i] =
                f(x[t * ld + i]) * inv * w[static_cast<size_t>(i)];
    }
    return out;
}

TEST_F(CudaModelKernels, RmsNormMatchesOracleAndIsRowInvariant) {
    for (int H : {64, 1000, 4096, 12288}) {
        SCOPED_TRACE("hidden " + std::to_string(H));
        const int T = 37;
        const int64_t ld = H + 16;
        auto x =
            random_bf16(static_cast<size_t>(T) * ld, 10u + static_cast<uint32_t>(H), -3.f, 3.f);
        std::vector<float> w(static_cast<size_t>(H));
        for (int i = 0; i < H; ++i) w[static_cast<size_t>(i)] = 1.0f + 0.1f * std::sin(0.37f * i);
        const float eps = 1e-5f;
        DeviceBuffer dx = upload(x), dw = upload(w),
                     out = poisoned<bf16_t>(static_cast<size_t>(T) * H);
        ASSERT_TRUE(rms_norm({dx.as<bf16_t>(), ld, dw.as<float>(), out.as<bf16_t>(), H, T, H, eps},
                             stream())
                        .ok());
        const auto got = download<bf16_t>(out, static_cast<size_t>(T) * H);
        const auto want = rms_oracle(x, ld, T, H, w, eps);
        ErrorTracker e;
        for (size_t i = 0; i < got.size(); ++i) e.add(f(got[i]), want[i], kBf16Eps, 1e-3);
        std::printf("rms_norm hidden %d: max |err| %.3g, worst %.2f of the bound\n", H, e.max_abs,
                    e.worst);
        EXPECT_EQ(e.bad, 0);

        // Row r alone (T = 1, from a copy at another address) is bit-identical to row r of the
        // batch.
        for (int r : {0, 20, 36}) {
            std::vector<bf16_t> row(x.begin() + r * ld, x.begin() + r * ld + H);
            DeviceBuffer d1 = upload(row), o1 = poisoned<bf16_t>(static_cast<size_t>(H));
            ASSERT_TRUE(
                rms_norm({d1.as<bf16_t>(), H, dw.as<float>(), o1.as<bf16_t>(), H, 1, H, eps},
                         stream())
                    .ok());
            const auto g1 = download<bf16_t>(o1, static_cast<size_t>(H));
            EXPECT_EQ(0,
                      std::memcmp(g1.data(), &got[static_cast<size_t>(r) * H], sizeof(bf16_t) * H))
                << "row " << r;
        }
        // In place gives the same bits.
        ASSERT_TRUE(rms_norm({dx.as<bf16_t>(), ld, dw.as<float>(), dx.as<bf16_t>(), ld, T, H, eps},
                             stream())
                        .ok());
        const auto inplace = download<bf16_t>(dx, static_cast<size_t>(T) * ld);
        for (int t = 0; t < T; ++t) {
            EXPECT_EQ(0, std::memcmp(&inplace[static_cast<size_t>(t) * ld],
                                     &got[static_cast<size_t>(t) * H], sizeof(bf16_t) * H))
                << "in-place row " << t;
        }
    }
}

TEST_F(CudaModelKernels, RopeRotatesQAndKInTheFusedRowNeoxStyle) {
    const int T = 11, HQ = 4, HKV = 2, D = 64, P = 4096;
    const double theta = 10000.0;
    const int64_t ld = int64_t{HQ + 2 * HKV} * D;  // [q | k | v]
    const auto qkv = random_bf16(static_cast<size_t>(T) * ld, 3, -2.f, 2.f);
    std::vector<int32_t> pos = {0, 1, 2, 100, 4095, 7, 4096, 33, -1, 2048, 999};
    const auto table = rope_cos_sin_cache(theta, D, P);
    DeviceBuffer dqkv = upload(qkv), dpos = upload(pos), dtab = upload(table);
    RopeParams p;
    p.q = dqkv.as<bf16_t>();
    p.q_ld = ld;
    p.q_heads = HQ;
    p.k = dqkv.as<bf16_t>() + int64_t{HQ} * D;
    p.k_ld = ld;
    p.k_heads = HKV;
    p.head_dim = D;
    p.positions = dpos.as<int32_t>();
    p.cos_sin = dtab.as<float>();
    p.max_positions = P;
    p.rows = T;
    ASSERT_OK(apply_rope(p, stream()));
    const auto got = download<bf16_t>(dqkv, qkv.size());
    ErrorTracker e;
    for (int t = 0; t < T; ++t) {
        const bool bad_pos = pos[static_cast<size_t>(t)] < 0 || pos[static_cast<size_t>(t)] >= P;
        for (int h = 0; h < HQ + 2 * HKV; ++h) {
            const int64_t base = t * ld + int64_t{h} * D;
            for (int i = 0; i < D / 2; ++i) {
                const bf16_t g0 = got[static_cast<size_t>(base + i)],
                             g1 = got[static_cast<size_t>(base + i + D / 2)];
                if (h >= HQ + HKV) {  // v: untouched
                    EXPECT_EQ(g0, qkv[static_cast<size_t>(base + i)]);
                    EXPECT_EQ(g1, qkv[static_cast<size_t>(base + i + D / 2)]);
                    continue;
                }
                if (bad_pos) {
                    EXPECT_TRUE(is_nan_bf16(g0) && is_nan_bf16(g1))
                        << "token " << t << " head " << h;
                    continue;
                }
                // The CPU model's rope(): pairs (i, i + D/2), inv_freq in float, angle in double.
                const float inv =
                    static_cast<float>(std::pow(theta, -2.0 * i / static_cast<double>(D)));
                const double ang = static_cast<double>(pos[static_cast<size_t>(t)]) * inv;
                const double c = static_cast<float>(std::cos(ang)),
                             s = static_cast<float>(std::sin(ang));
                const double a = f(qkv[static_cast<size_t>(base + i)]),
                             b = f(qkv[static_cast<size_t>(base + i + D / 2)]);
                e.add(f(g0), a * c - b * s, kBf16Eps, 1e-2);
                e.add(f(g1), a * s + b * c, kBf16Eps, 1e-2);
            }
        }
    }
    std::printf("rope: max |err| %.3g, worst %.2f of the bound\n", e.max_abs, e.worst);
    EXPECT_EQ(e.bad, 0);
}

TEST_F(CudaModelKernels, TokenPositionsFollowSeqAndExtendLens) {
    const std::vector<int32_t> extend = {3, 1, 0, 200, 1};
    const std::vector<int32_t> seq = {10, 57, 4, 200, 1};
    std::vector<int32_t> indptr = {0};
    for (int32_t e : extend) indptr.push_back(indptr.back() + e);
    const int T = indptr.back();
    DeviceBuffer di = upload(indptr), ds = upload(seq),
                 out = poisoned<int32_t>(static_cast<size_t>(T));
    ASSERT_TRUE(token_positions({di.as<int32_t>(), ds.as<int32_t>(),
                                 static_cast<int>(extend.size()), out.as<int32_t>()},
                                stream())
                    .ok());
    const auto got = download<int32_t>(out, static_cast<size_t>(T));
    std::vector<int32_t> want;
    for (size_t r = 0; r < extend.size(); ++r) {
        for (int j = 0; j < extend[r]; ++j) want.push_back(seq[r] - extend[r] + j);
    }
    EXPECT_EQ(got, want);
}

TEST_F(CudaModelKernels, SiluMulOverTheFusedGateUp) {
    const int T = 13, I = 1376;
    const int64_t ld = 2 * I + 8, out_ld = I + 8;
    const auto gu = random_bf16(static_cast<size_t>(T) * ld, 4, -6.f, 6.f);
    DeviceBuffer dgu = upload(gu), out = poisoned<bf16_t>(static_cast<size_t>(T) * out_ld);
    ASSERT_OK(silu_mul({dgu.as<bf16_t>(), ld, out.as<bf16_t>(), out_ld, T, I}, stream()));
    const auto got = download<bf16_t>(out, static_cast<size_t>(T) * out_ld);
    ErrorTracker e;
    for (int t = 0; t < T; ++t) {
        for (int i = 0; i < out_ld; ++i) {
            const bf16_t g = got[static_cast<size_t>(t * out_ld + i)];
            if (i >= I) {
                EXPECT_EQ(g, kPoisonBf16);
                continue;
            }
            const double gate = f(gu[static_cast<size_t>(t * ld + i)]),
                         up = f(gu[static_cast<size_t>(t * ld + I + i)]);
            e.add(f(g), gate / (1.0 + std::exp(-gate)) * up, kBf16Eps, 1e-3);
        }
    }
    std::printf("silu_mul: max |err| %.3g, worst %.2f of the bound\n", e.max_abs, e.worst);
    EXPECT_EQ(e.bad, 0);
}

TEST_F(CudaModelKernels, ResidualAddIsOneRoundedFloatAdd) {
    const int T = 17, H = 520;
    const int64_t ld = 528;
    const auto h = random_bf16(static_cast<size_t>(T) * ld, 5, -4.f, 4.f);
    const auto d = random_bf16(static_cast<size_t>(T) * H, 6, -4.f, 4.f);
    DeviceBuffer dh = upload(h), dd = upload(d);
    ASSERT_OK(residual_add({dh.as<bf16_t>(), ld, dd.as<bf16_t>(), H, T, H}, stream()));
    const auto got = download<bf16_t>(dh, h.size());
    int64_t bad = 0;
    for (int t = 0; t < T; ++t) {
        for (int i = 0; i < ld; ++i) {
            const size_t k = static_cast<size_t>(t * ld + i);
            const bf16_t want =
                i < H ? float_to_bf16(f(h[k]) + f(d[static_cast<size_t>(t * H + i)])) : h[k];
            if (got[k] != want) ++bad;
        }
    }
    EXPECT_EQ(bad, 0);
}

// The TP-invariant reduction's last step: the slices' fp32 partials summed from slice 0 up, one
// rounding per add, rounded to bf16, then added to the residual as residual_add does; columns
// past hidden untouched; slice stride and row stride other than the dense ones (a gathered
// block's), NaN in the gaps between slices and rows (never read).
TEST_F(CudaModelKernels, SliceReduceSumsInSliceOrderThenAddsTheResidual) {
    const int T = 9, H = 264, slices = 4;
    const int64_t ld = 272, pld = 268, stride = int64_t{T} * pld + 8;
    const auto h = random_bf16(static_cast<size_t>(T) * ld, 21, -4.f, 4.f);
    std::vector<float> parts(static_cast<size_t>(stride) * slices, std::nanf(""));
    std::mt19937 rng(22);
    std::uniform_real_distribution<float> dist(-3.f, 3.f);
    for (int s = 0; s < slices; ++s) {
        for (int t = 0; t < T; ++t) {
            for (int i = 0; i < H; ++i)
                parts[static_cast<size_t>(s * stride + t * pld + i)] = dist(rng);
        }
    }
    DeviceBuffer dh = upload(h), dp = upload(parts);
    SliceReduceParams p;
    p.partials = dp.as<float>();
    p.slice_stride = stride;
    p.partial_ld = pld;
    p.slices = slices;
    p.residual = dh.as<bf16_t>();
    p.residual_ld = ld;
    p.rows = T;
    p.hidden = H;
    ASSERT_OK(slice_reduce_residual(p, stream()));
    const auto got = download<bf16_t>(dh, h.size());
    int64_t bad = 0;
    for (int t = 0; t < T; ++t) {
        for (int i = 0; i < ld; ++i) {
            const size_t k = static_cast<size_t>(t * ld + i);
            bf16_t want = h[k];
            if (i < H) {
                volatile float sum = parts[static_cast<size_t>(t * pld + i)];
                for (int s = 1; s < slices; ++s) {
                    sum = sum + parts[static_cast<size_t>(s * stride + t * pld + i)];
                }
                want = float_to_bf16(f(h[k]) + f(float_to_bf16(sum)));
            }
            if (got[k] != want) ++bad;
        }
    }
    EXPECT_EQ(bad, 0);
}

TEST_F(CudaModelKernels, GatherLastTokensOfEachRequest) {
    const int H = 256, T = 20;
    const auto x = random_bf16(static_cast<size_t>(T) * H, 7);
    const std::vector<int32_t> indptr = {0, 5, 6, 6, 20};  // request 2 has no tokens
    const int R = 4;
    DeviceBuffer dx = upload(x), di = upload(indptr),
                 out = poisoned<bf16_t>(static_cast<size_t>(R) * H);
    ASSERT_TRUE(gather_last_tokens(
                    {dx.as<bf16_t>(), H, di.as<int32_t>(), R, out.as<bf16_t>(), H, H}, stream())
                    .ok());
    const auto got = download<bf16_t>(out, static_cast<size_t>(R) * H);
    for (int r = 0; r < R; ++r) {
        for (int i = 0; i < H; ++i) {
            const bf16_t g = got[static_cast<size_t>(r * H + i)];
            if (indptr[static_cast<size_t>(r) + 1] == indptr[static_cast<size_t>(r)]) {
                EXPECT_TRUE(is_nan_bf16(g)) << "empty request " << r;
            } else {
                EXPECT_EQ(g,
                          x[static_cast<size_t>((indptr[static_cast<size_t>(r) + 1] - 1) * H + i)])
                    << r << " " << i;
            }
        }
    }
}

// The CPU model's sampling scan (synthetic_model.cpp), with its error as -1.
int32_t cpu_argmax(const std::vector<float>& row) {
    int best = 0;
    for (int v = 1; v < static_cast<int>(row.size()); ++v) {
        if (row[static_cast<size_t>(v)] > row[static_cast<size_t>(best)]) best = v;
    }
    return std::isfinite(row[static_cast<size_t>(best)]) ? best : -1;
}

TEST_F(CudaModelKernels, ArgmaxTakesTheLowestIndexOfTheMaximumLikeTheCpuModel) {
    const int V = 50272;
    const float inf = std::numeric_limits<float>::infinity(),
                nan = std::numeric_limits<float>::quiet_NaN();
    std::mt19937 gen(8);
    std::uniform_real_distribution<float> dist(-10.f, 10.f);
    std::vector<std::vector<float>> rows;
    for (int r = 0; r < 6; ++r) {
        std::vector<float> row(static_cast<size_t>(V));
        for (auto& x : row) x = bf16_to_float(float_to_bf16(dist(gen)));
        rows.push_back(row);
    }
    rows[1][40000] = 50.f;  // a tie: the lower index wins
    rows[1][7] = 50.f;
    rows[1][3000] = nan;               // ignored
    rows[2][0] = nan;                  // the CPU model's scan never moves off logit 0: an error
    rows[3][123] = inf;                // the maximum is not finite: an error
    for (auto& x : rows[4]) x = -inf;  // every logit -inf: an error
    rows[5][V - 1] = 20.f;             // the last one
    rows.push_back(std::vector<float>(static_cast<size_t>(V), 0.5f));  // all equal: index 0
    const int R = static_cast<int>(rows.size());
    const int64_t ld = V + 8;
    std::vector<int32_t> want;
    for (const auto& row : rows) want.push_back(cpu_argmax(row));
    EXPECT_EQ(want[1], 7);
    EXPECT_EQ(want[2], -1);
    EXPECT_EQ(want[3], -1);
    EXPECT_EQ(want[4], -1);
    EXPECT_EQ(want[5], V - 1);
    for (DType dt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(std::string(runtime::dtype_name(dt)));
        std::vector<float> f32(static_cast<size_t>(R * ld),
                               99.f);  // padding beyond vocab: never read
        std::vector<bf16_t> b16(static_cast<size_t>(R * ld), float_to_bf16(99.f));
        for (int r = 0; r < R; ++r) {
            for (int v = 0; v < V; ++v) {
                f32[static_cast<size_t>(r * ld + v)] =
                    rows[static_cast<size_t>(r)][static_cast<size_t>(v)];
                b16[static_cast<size_t>(r * ld + v)] =
                    float_to_bf16(rows[static_cast<size_t>(r)][static_cast<size_t>(v)]);
            }
        }
        DeviceBuffer logits = dt == DType::kF32 ? upload(f32) : upload(b16);
        DeviceBuffer out = poisoned<int32_t>(static_cast<size_t>(R));
        // Poison -1 is a legal answer: start from another value.
        ASSERT_TRUE(out.copy_from_host(std::vector<int32_t>(static_cast<size_t>(R), 12345).data(),
                                       sizeof(int32_t) * R)
                        .ok());
        ASSERT_OK(argmax({logits.data(), dt, ld, R, V, out.as<int32_t>()}, stream()));
        EXPECT_EQ(download<int32_t>(out, static_cast<size_t>(R)), want);
    }
}

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------

// Y[t][n] = sum_k X[t][k] * W[n][k] in double, and sum_k |X W| for the error bound.
void gemm_oracle(const std::vector<bf16_t>& x, int64_t ldx, const std::vector<bf16_t>& w,
                 int64_t ldw, int T, int64_t K, int64_t N, std::vector<double>& y,
                 std::vector<double>& mag) {
    y.assign(static_cast<size_t>(T * N), 0.0);
    mag.assign(static_cast<size_t>(T * N), 0.0);
    std::vector<double> xr(static_cast<size_t>(K));
    for (int t = 0; t < T; ++t) {
        for (int64_t k = 0; k < K; ++k)
            xr[static_cast<size_t>(k)] = f(x[static_cast<size_t>(t * ldx + k)]);
        for (int64_t n = 0; n < N; ++n) {
            double s = 0, m = 0;
            const bf16_t* wr = &w[static_cast<size_t>(n * ldw)];
            for (int64_t k = 0; k < K; ++k) {
                const double p = xr[static_cast<size_t>(k)] * f(wr[k]);
                s += p;
                m += std::abs(p);
            }
            y[static_cast<size_t>(t * N + n)] = s;
            mag[static_cast<size_t>(t * N + n)] = m;
        }
    }
}

// fp32 accumulation over K products: |err| <= K * 2^-22 * sum|x w| (a loose worst case that also
// covers tensor cores truncating instead of rounding in their adds), plus the final rounding to
// bf16 (half an ulp: at most 2^-8 relative) or fp32 (2^-24).
void check_gemm(const std::vector<bf16_t>& x, int64_t ldx, const std::vector<bf16_t>& w,
                int64_t ldw, int T, int64_t K, int64_t N, const void* y_host, int64_t ldy,
                DType out, const char* what) {
    std::vector<double> want, mag;
    gemm_oracle(x, ldx, w, ldw, T, K, N, want, mag);
    double worst = 0, max_abs = 0;
    int64_t bad = 0;
    for (int t = 0; t < T; ++t) {
        for (int64_t n = 0; n < N; ++n) {
            const size_t o = static_cast<size_t>(t * N + n);
            const double got = out == DType::kF32
                                   ? static_cast<const float*>(y_host)[t * ldy + n]
                                   : f(static_cast<const bf16_t*>(y_host)[t * ldy + n]);
            const double round = out == DType::kF32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
            const double tol = static_cast<double>(K) * std::ldexp(1.0, -22) * mag[o] +
                               round * std::abs(want[o]) + 1e-30;
            const double err = std::abs(got - want[o]);
            worst = std::max(worst, err / tol);
            max_abs = std::max(max_abs, err);
            if (!(err <= tol)) ++bad;
        }
    }
    std::printf("%s T=%d K=%lld N=%lld: max |err| %.3g, worst %.3f of the bound\n", what, T,
                static_cast<long long>(K), static_cast<long long>(N), max_abs, worst);
    EXPECT_EQ(bad, 0) << what;
}

TEST_F(CudaModelGemm, PinnedGemmMatchesDoubleOracle) {
    struct Case {
        int T;
        int64_t K, N;
        DType out;
    };
    for (const Case& c : {Case{37, 256, 384, DType::kBF16}, Case{5, 4096, 1024, DType::kBF16},
                          Case{64, 1024, 520, DType::kF32}, Case{1, 512, 4096, DType::kBF16}}) {
        const auto x = random_bf16(static_cast<size_t>(c.T * c.K), 20);
        const auto w = random_bf16(static_cast<size_t>(c.N * c.K), 21, -0.1f, 0.1f);
        GemmShape shape{c.K, c.N};
        shape.out_dtype = c.out;
        GemmOptions opt;
        opt.max_rows = 256;
        auto g = BatchInvariantGemm::create(shape, opt);
        ASSERT_OK(g);
        std::printf("pinned K=%lld N=%lld: %s\n", static_cast<long long>(c.K),
                    static_cast<long long>(c.N), (*g)->algo().to_string().c_str());
        EXPECT_EQ((*g)->algo().splitk, 1);
        EXPECT_EQ((*g)->algo().reduction, 0);
        const size_t elem = runtime::dtype_size(c.out);
        DeviceBuffer dx = upload(x), dw = upload(w);
        auto dy =
            DeviceBuffer::allocate({DeviceKind::kCuda, 0}, static_cast<size_t>(c.T * c.N) * elem);
        ASSERT_OK(dy);
        ASSERT_OK(dy->fill(0xff));
        ASSERT_OK((*g)->run(dx.as<bf16_t>(), dw.as<bf16_t>(), dy->data(), c.T, stream()));
        ASSERT_OK(stream().synchronize());
        std::vector<char> y(static_cast<size_t>(c.T * c.N) * elem);
        ASSERT_OK(dy->copy_to_host(y.data(), y.size()));
        check_gemm(x, c.K, w, c.K, c.T, c.K, c.N, y.data(), c.N, c.out, "pinned");
    }
}

// Row r of X computed alone, inside a batch of 7 and inside a batch of 64 (at another position,
// from another address): the same bits. Also with strided operands (a column slice of X written
// into a wider Y row, as TP slicing and fused outputs do).
TEST_F(CudaModelGemm, PinnedGemmRowsDoNotDependOnTheirBatch) {
    struct Case {
        int64_t K, N, ldx, ldy;
    };
    for (const Case& c : {Case{256, 1280, 256, 1280}, Case{4096, 6144, 4096, 6144},
                          Case{1024, 32000, 1024, 32000}, Case{512, 768, 1024, 1024}}) {
        SCOPED_TRACE("K " + std::to_string(c.K) + " N " + std::to_string(c.N));
        const int T = 64;
        GemmShape shape{c.K, c.N, c.ldx, 0, c.ldy};
        GemmOptions opt;
        opt.max_rows = 512;
        auto g = BatchInvariantGemm::create(shape, opt);
        ASSERT_OK(g);
        const auto x = random_bf16(static_cast<size_t>(T * c.ldx), 30);
        const auto w = random_bf16(static_cast<size_t>(c.N * c.K), 31, -0.05f, 0.05f);
        DeviceBuffer dx = upload(x), dw = upload(w);
        auto run = [&](const bf16_t* xs, int rows) {
            DeviceBuffer y = poisoned<bf16_t>(static_cast<size_t>(rows * c.ldy));
            EXPECT_OK((*g)->run(xs, dw.as<bf16_t>(), y.data(), rows, stream()));
            return download<bf16_t>(y, static_cast<size_t>(rows * c.ldy));
        };
        const auto y64 = run(dx.as<bf16_t>(), T);
        const auto y7 = run(dx.as<bf16_t>() + 20 * c.ldx, 7);  // rows 20..26
        // Accuracy of the first rows (the full oracle of the big shapes is slow on the host).
        check_gemm(std::vector<bf16_t>(x.begin(), x.begin() + 4 * c.ldx), c.ldx, w, c.K, 4, c.K,
                   c.N, y64.data(), c.ldy, DType::kBF16, "invariance batch");
        for (int r : {20, 23, 26}) {
            std::vector<bf16_t> row(x.begin() + r * c.ldx, x.begin() + (r + 1) * c.ldx);
            DeviceBuffer d1 = upload(row);
            const auto y1 = run(d1.as<bf16_t>(), 1);
            const size_t bytes = sizeof(bf16_t) * static_cast<size_t>(c.N);
            EXPECT_EQ(0, std::memcmp(y1.data(), &y64[static_cast<size_t>(r * c.ldy)], bytes))
                << "T=1 vs T=64, row " << r;
            EXPECT_EQ(0, std::memcmp(&y7[static_cast<size_t>((r - 20) * c.ldy)],
                                     &y64[static_cast<size_t>(r * c.ldy)], bytes))
                << "T=7 vs T=64, row " << r;
            for (int64_t n = c.N; n < c.ldy; ++n)
                EXPECT_EQ(y1[static_cast<size_t>(n)], kPoisonBf16) << "ldy padding";
        }
        // And every T up to 300 for one row (a sweep over tile-edge positions).
        std::vector<bf16_t> big = random_bf16(static_cast<size_t>(300 * c.ldx), 32);
        DeviceBuffer dbig = upload(big);
        const auto ref = run(dbig.as<bf16_t>(), 1);
        int64_t mismatched = 0;
        for (int rows : {2, 3, 8, 15, 16, 17, 31, 63, 65, 127, 128, 129, 200, 255, 256, 257, 300}) {
            const auto yr = run(dbig.as<bf16_t>(), rows);
            if (std::memcmp(yr.data(), ref.data(), sizeof(bf16_t) * static_cast<size_t>(c.N)) !=
                0) {
                ++mismatched;
                ADD_FAILURE() << "row 0 differs at T=" << rows;
            }
        }
        EXPECT_EQ(mismatched, 0);
    }
}

// The fused QKV weight generated on the device and multiplied by the pinned GEMM gives the CPU
// model's q, k and v: x @ Wq[:, q slice] etc. (the W layout and the GEMM's convention agree).
TEST_F(CudaModelGemm, FusedQkvGemmComputesTheCpuModelsProjections) {
    const ModelConfig c = *resolve_model("tiny");
    const int tp = 2, rank = 1, layer = 0, T = 9;
    const ModelDims d = *make_model_dims(c, tp, rank);
    const WeightLayout l = qkv_weight_layout(d, layer);
    DeviceBuffer dw = poisoned<bf16_t>(static_cast<size_t>(l.rows * l.cols));
    ASSERT_OK(generate_weights(c.seed, l, dw.data(), DType::kBF16, stream()));
    const auto x = random_bf16(static_cast<size_t>(T) * c.hidden, 40);
    DeviceBuffer dx = upload(x), dy = poisoned<bf16_t>(static_cast<size_t>(T * d.qkv_cols));
    auto g = BatchInvariantGemm::create({c.hidden, d.qkv_cols}, {0, 64});
    ASSERT_OK(g);
    ASSERT_OK((*g)->run(dx.as<bf16_t>(), dw.as<bf16_t>(), dy.data(), T, stream()));
    const auto y = download<bf16_t>(dy, static_cast<size_t>(T * d.qkv_cols));
    // The CPU model's weights in its own [H][N] form, bf16-rounded as the GPU stores them.
    std::vector<bf16_t> w_nk(static_cast<size_t>(l.rows * l.cols));
    for (int64_t n = 0; n < l.rows; ++n) {
        for (int64_t k = 0; k < l.cols; ++k) {
            w_nk[static_cast<size_t>(n * l.cols + k)] =
                float_to_bf16(cpu_weight(c, tp, rank, "qkv", layer, n, k));
        }
    }
    check_gemm(x, c.hidden, w_nk, c.hidden, T, c.hidden, d.qkv_cols, y.data(), d.qkv_cols,
               DType::kBF16, "fused qkv");
}

TEST_F(CudaModelGemm, PinnedGemmRejectsWhatItCannotRun) {
    auto g = BatchInvariantGemm::create({256, 256}, {0, 16});
    ASSERT_OK(g);
    DeviceBuffer a = poisoned<bf16_t>(64 * 256);
    Status st = (*g)->run(a.as<bf16_t>(), a.as<bf16_t>(), a.data(), 17, stream());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("rows 17 outside [1, max_rows 16]"));
    st = (*g)->run(a.as<bf16_t>() + 1, a.as<bf16_t>(), a.data(), 4, stream());
    EXPECT_THAT(st.message(), HasSubstr("16-byte aligned"));
    EXPECT_OK((*g)->run(a.as<bf16_t>(), a.as<bf16_t>(), a.data(), 0, stream()));
    for (int t = 1; t <= 16; ++t) EXPECT_OK((*g)->check_rows(t)) << t;
    EXPECT_OK(stream().synchronize());
}

TEST_F(CudaModelGemm, HeuristicGemmMatchesOracleAndReportsThroughput) {
    const int64_t M = 512, K = 2048, N = 2048;
    const auto x = random_bf16(static_cast<size_t>(M * K), 50);
    const auto w = random_bf16(static_cast<size_t>(N * K), 51, -0.05f, 0.05f);
    DeviceBuffer dx = upload(x), dw = upload(w), dy = poisoned<bf16_t>(static_cast<size_t>(M * N));
    auto h = HeuristicGemm::create(M, {K, N});
    ASSERT_OK(h);
    EXPECT_EQ((*h)->flops(), 2.0 * M * N * K);
    ASSERT_OK((*h)->run(dx.as<bf16_t>(), dw.as<bf16_t>(), dy.data(), stream()));
    const auto y = download<bf16_t>(dy, static_cast<size_t>(M * N));
    // The oracle on 64 rows is enough (and quick): the heuristic may split K, still fp32.
    std::vector<bf16_t> x64(x.begin(), x.begin() + 64 * K), y64(y.begin(), y.begin() + 64 * N);
    check_gemm(x64, K, w, K, 64, K, N, y64.data(), N, DType::kBF16, "heuristic");

    // Throughput, printed for the record: heuristic vs pinned, same shape.
    auto p = BatchInvariantGemm::create({K, N}, {0, static_cast<int>(M)});
    ASSERT_OK(p);
    auto time_it = [&](auto&& fn) {
        for (int i = 0; i < 3; ++i) EXPECT_OK(fn());
        EXPECT_OK(stream().synchronize());
        const int reps = 20;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) EXPECT_OK(fn());
        EXPECT_OK(stream().synchronize());
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    };
    const double th =
        time_it([&] { return (*h)->run(dx.as<bf16_t>(), dw.as<bf16_t>(), dy.data(), stream()); });
    const double tp = time_it([&] {
        return (*p)->run(dx.as<bf16_t>(), dw.as<bf16_t>(), dy.data(), static_cast<int>(M),
                         stream());
    });
    std::printf("M=%lld K=%lld N=%lld: heuristic %.1f TFLOP/s (%s), pinned %.1f TFLOP/s (%s)\n",
                static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                (*h)->flops() / th * 1e-12, (*h)->algo().to_string().c_str(),
                (*h)->flops() / tp * 1e-12, (*p)->algo().to_string().c_str());
}

// Without a GPU every test above skips; this one says so explicitly so a CPU-only run shows why.
TEST(CudaModelKernelsNoGpu, SkipsWithTheRuntimeReason) {
    if (have_gpu()) GTEST_SKIP() << "a GPU is present";
    EXPECT_FALSE(skip_reason().empty());
    GTEST_SKIP() << skip_reason();
}

}  // namespace
}  // namespace pdsim::model::cuda
