// Host logic of the GPU synthetic model's kernels and GEMM (backends/cuda/model_kernels.h,
// gemm.h), no GPU needed: sizes and their checks, the tensor ids, scales and weight layouts
// (fused QKV and gate/up, TP slices) against the CPU model's scheme re-derived here, the RoPE
// table against the CPU model's formula, GEMM shape checks, and argument checks that fail before
// anything reaches a device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backends/cuda/gemm.h"
#include "backends/cuda/model_kernels.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "tests/status_matchers.h"

namespace pdsim::model::cuda {
namespace {

using ::testing::HasSubstr;

ModelConfig tiny() {
    return *resolve_model("tiny");
}

// The CPU model's tensor ids and scales (backends/model/synthetic_model.cpp), written out.
constexpr uint64_t kCpuWq = 1, kCpuWk = 2, kCpuWv = 3, kCpuWo = 4, kCpuGate = 5, kCpuUp = 6,
                   kCpuDown = 7, kCpuNorm1 = 8, kCpuNorm2 = 9, kCpuEmbed = 10, kCpuFinalNorm = 11,
                   kCpuLmHead = 12;
uint64_t cpu_tensor_id(int layer, uint64_t kind) {
    return (static_cast<uint64_t>(layer + 1) << 8) | kind;
}

// What the CPU model's weight (tensor, index, scale) is at element (r, c) of a layout: the CPU
// model keeps Wq etc. as [K][N] (index k * N_full + n) and Wo/Wdown as [K][H] rows.
struct Source {
    uint64_t tensor;
    uint64_t index;
    float scale;
    float offset;
};

const WeightBlock* block_at(const WeightLayout& l, int64_t r, int64_t c) {
    const WeightBlock* hit = nullptr;
    for (const WeightBlock& b : l.blocks) {
        if (r >= b.row0 && r < b.row0 + b.rows && c >= b.col0 && c < b.col0 + b.cols) {
            EXPECT_EQ(hit, nullptr) << l.name << ": blocks overlap at (" << r << ", " << c << ")";
            hit = &b;
        }
    }
    return hit;
}

Source layout_source(const WeightLayout& l, int64_t r, int64_t c) {
    const WeightBlock* b = block_at(l, r, c);
    if (b == nullptr) {
        ADD_FAILURE() << l.name << ": no block covers (" << r << ", " << c << ")";
        return {};
    }
    return {b->tensor, b->index(r - b->row0, c - b->col0), b->scale, b->offset};
}

void expect_same(const Source& got, const Source& want, const std::string& where) {
    EXPECT_EQ(got.tensor, want.tensor) << where;
    EXPECT_EQ(got.index, want.index) << where;
    EXPECT_EQ(got.scale, want.scale) << where;
    EXPECT_EQ(got.offset, want.offset) << where;
}

// Every element of `l` (a sample grid for big ones) against `want(r, c)`.
template <typename F>
void check_layout(const WeightLayout& l, int64_t rows, int64_t cols, F want) {
    ASSERT_EQ(l.rows, rows) << l.name;
    ASSERT_EQ(l.cols, cols) << l.name;
    const int64_t rs = std::max<int64_t>(1, rows / 97), cs = std::max<int64_t>(1, cols / 89);
    for (int64_t r = 0; r < rows; r += rs) {
        for (int64_t c = 0; c < cols; c += cs) {
            expect_same(layout_source(l, r, c), want(r, c),
                        l.name + " (" + std::to_string(r) + ", " + std::to_string(c) + ")");
        }
    }
    // The last row and column too (slice ends).
    expect_same(layout_source(l, rows - 1, cols - 1), want(rows - 1, cols - 1), l.name + " last");
}

TEST(CudaModelDims, DerivesRankSlices) {
    ModelConfig c = tiny();
    auto d1 = make_model_dims(c);
    ASSERT_OK(d1);
    EXPECT_EQ(d1->q_cols, 8 * 64);
    EXPECT_EQ(d1->kv_cols, 4 * 64);
    EXPECT_EQ(d1->qkv_cols, 8 * 64 + 2 * 4 * 64);
    EXPECT_EQ(d1->gate_up_cols, 2 * 512);
    EXPECT_EQ(d1->q_col0, 0);
    auto d2 = make_model_dims(c, 2, 1);
    ASSERT_OK(d2);
    EXPECT_EQ(d2->q_heads, 4);
    EXPECT_EQ(d2->kv_heads, 2);
    EXPECT_EQ(d2->intermediate, 256);
    EXPECT_EQ(d2->q_col0, 4 * 64);
    EXPECT_EQ(d2->kv_col0, 2 * 64);
    EXPECT_EQ(d2->inter_col0, 256);
    EXPECT_EQ(d2->qkv_cols, 4 * 64 + 2 * 2 * 64);
}

TEST(CudaModelDims, RejectsShapesTheKernelsCannotRun) {
    ModelConfig c = tiny();
    c.hidden = 252;  // heads still divide; not a multiple of 8
    auto r = make_model_dims(c);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("hidden 252"));
    c = tiny();
    c.vocab = 1001;
    EXPECT_THAT(make_model_dims(c).status().message(), HasSubstr("vocab 1001"));
    c = tiny();
    c.head_dim = 36;
    EXPECT_THAT(make_model_dims(c).status().message(), HasSubstr("head_dim 36"));
    c = tiny();
    c.intermediate = 520;  // 260 per rank of 2
    EXPECT_THAT(make_model_dims(c, 2).status().message(), HasSubstr("intermediate / tp 260"));
    c = tiny();
    EXPECT_EQ(make_model_dims(c, 3).status().code(), StatusCode::kInvalidArgument);  // check_tp
    EXPECT_THAT(make_model_dims(c, 2, 2).status().message(), HasSubstr("tp_rank 2"));
    c.attention = AttentionKind::kMla;
    c.kv_lora_rank = 64;
    c.rope_dim = 16;
    EXPECT_EQ(make_model_dims(c).status().code(), StatusCode::kUnimplemented);
}

TEST(CudaModelWeights, TensorIdsAndScalesMirrorTheCpuModel) {
    EXPECT_EQ(weight_tensor_id(-1, WeightKind::kEmbed), cpu_tensor_id(-1, kCpuEmbed));
    EXPECT_EQ(weight_tensor_id(-1, WeightKind::kFinalNorm), cpu_tensor_id(-1, kCpuFinalNorm));
    EXPECT_EQ(weight_tensor_id(-1, WeightKind::kLmHead), cpu_tensor_id(-1, kCpuLmHead));
    const std::pair<WeightKind, uint64_t> kinds[] = {
        {WeightKind::kWq, kCpuWq},      {WeightKind::kWk, kCpuWk},
        {WeightKind::kWv, kCpuWv},      {WeightKind::kWo, kCpuWo},
        {WeightKind::kGate, kCpuGate},  {WeightKind::kUp, kCpuUp},
        {WeightKind::kDown, kCpuDown},  {WeightKind::kNorm1, kCpuNorm1},
        {WeightKind::kNorm2, kCpuNorm2}};
    for (int layer : {0, 3, 200}) {
        for (auto [kind, cpu] : kinds)
            EXPECT_EQ(weight_tensor_id(layer, kind), cpu_tensor_id(layer, cpu));
    }
    ModelConfig c = tiny();
    c.hidden = 320;
    c.num_q_heads = 10;
    c.num_kv_heads = 2;
    c.head_dim = 32;
    c.intermediate = 1200;
    const ModelDims d = *make_model_dims(c, 2, 0);
    EXPECT_EQ(weight_scale(d, WeightKind::kWq), 1.0f / std::sqrt(320.0f));
    EXPECT_EQ(weight_scale(d, WeightKind::kLmHead), 1.0f / std::sqrt(320.0f));
    EXPECT_EQ(weight_scale(d, WeightKind::kWo), 1.0f / std::sqrt(320.0f));  // total q heads * D
    EXPECT_EQ(weight_scale(d, WeightKind::kDown),
              1.0f / std::sqrt(1200.0f));  // total, not per rank
    EXPECT_EQ(weight_scale(d, WeightKind::kEmbed), 1.0f);
    EXPECT_EQ(weight_scale(d, WeightKind::kNorm2), 0.1f);
}

// The layouts against the CPU model's tensors, for TP 1 and both ranks of TP 2.
TEST(CudaModelWeights, LayoutsMatchTheCpuModelSlices) {
    const ModelConfig c = tiny();
    const int H = c.hidden, D = c.head_dim, HQ = c.num_q_heads, HKV = c.num_kv_heads,
              I = c.intermediate, V = c.vocab;
    const float s_h = 1.0f / std::sqrt(static_cast<float>(H));
    const float s_o = 1.0f / std::sqrt(static_cast<float>(HQ * D));
    const float s_i = 1.0f / std::sqrt(static_cast<float>(I));
    for (int tp : {1, 2}) {
        for (int rank = 0; rank < tp; ++rank) {
            SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
            const ModelDims d = *make_model_dims(c, tp, rank);
            const int hq = HQ / tp, hkv = HKV / tp, il = I / tp;
            const int layer = 1;
            // qkv [(hq + 2 hkv) D][H]: row n is output column n of [q | k | v].
            check_layout(qkv_weight_layout(d, layer), int64_t{hq + 2 * hkv} * D, H,
                         [&](int64_t n, int64_t k) {
                             if (n < hq * D) {
                                 return Source{
                                     cpu_tensor_id(layer, kCpuWq),
                                     static_cast<uint64_t>(k * HQ * D + rank * hq * D + n), s_h,
                                     0.f};
                             }
                             n -= hq * D;
                             const uint64_t kind = n < hkv * D ? kCpuWk : kCpuWv;
                             n %= hkv * D;
                             return Source{cpu_tensor_id(layer, kind),
                                           static_cast<uint64_t>(k * HKV * D + rank * hkv * D + n),
                                           s_h, 0.f};
                         });
            // o_proj [H][hq D]: Wo rows q_col0 + k (the CPU model's rows_of slices).
            check_layout(
                o_proj_weight_layout(d, layer), H, int64_t{hq} * D, [&](int64_t n, int64_t k) {
                    return Source{cpu_tensor_id(layer, kCpuWo),
                                  static_cast<uint64_t>((rank * hq * D + k) * H + n), s_o, 0.f};
                });
            check_layout(gate_up_weight_layout(d, layer), 2 * int64_t{il}, H,
                         [&](int64_t n, int64_t k) {
                             const uint64_t kind = n < il ? kCpuGate : kCpuUp;
                             n %= il;
                             return Source{cpu_tensor_id(layer, kind),
                                           static_cast<uint64_t>(k * I + rank * il + n), s_h, 0.f};
                         });
            check_layout(down_weight_layout(d, layer), H, il, [&](int64_t n, int64_t k) {
                return Source{cpu_tensor_id(layer, kCpuDown),
                              static_cast<uint64_t>((rank * il + k) * H + n), s_i, 0.f};
            });
            check_layout(norm_weight_layout(d, layer, WeightKind::kNorm2), 1, H,
                         [&](int64_t, int64_t i) {
                             return Source{cpu_tensor_id(layer, kCpuNorm2),
                                           static_cast<uint64_t>(i), 0.1f, 1.0f};
                         });
            check_layout(norm_weight_layout(d, -1, WeightKind::kFinalNorm), 1, H,
                         [&](int64_t, int64_t i) {
                             return Source{cpu_tensor_id(-1, kCpuFinalNorm),
                                           static_cast<uint64_t>(i), 0.1f, 1.0f};
                         });
            check_layout(embedding_layout(d), V, H, [&](int64_t v, int64_t h) {
                return Source{cpu_tensor_id(-1, kCpuEmbed), static_cast<uint64_t>(v * H + h), 1.0f,
                              0.f};
            });
            check_layout(lm_head_weight_layout(d), V, H, [&](int64_t v, int64_t h) {
                return Source{cpu_tensor_id(-1, kCpuLmHead), static_cast<uint64_t>(h * V + v), s_h,
                              0.f};
            });
        }
    }
}

// Every element of a layout is covered by exactly one block (not only the sampled ones).
TEST(CudaModelWeights, BlocksTileTheirMatrix) {
    const ModelDims d = *make_model_dims(tiny(), 2, 1);
    for (const WeightLayout& l :
         {qkv_weight_layout(d, 0), gate_up_weight_layout(d, 3), o_proj_weight_layout(d, 2),
          down_weight_layout(d, 1), embedding_layout(d), lm_head_weight_layout(d),
          norm_weight_layout(d, 0, WeightKind::kNorm1)}) {
        int64_t covered = 0;
        for (const WeightBlock& b : l.blocks) {
            EXPECT_GE(b.row0, 0);
            EXPECT_LE(b.row0 + b.rows, l.rows) << l.name;
            EXPECT_LE(b.col0 + b.cols, l.cols) << l.name;
            covered += b.rows * b.cols;
        }
        EXPECT_EQ(covered, l.rows * l.cols) << l.name;  // with no overlap (checked above): a tiling
    }
}

TEST(CudaModelRope, TableIsTheCpuModelsFormula) {
    const double theta = 500000.0;
    const int D = 64, P = 300;
    const std::vector<float> t = rope_cos_sin_cache(theta, D, P);
    ASSERT_EQ(t.size(), size_t{P} * D);
    for (int p : {0, 1, 17, 299}) {
        for (int i : {0, 1, 15, 31}) {
            // backends/model/synthetic_model.cpp: inv_freq in float, the angle and cos/sin in
            // double.
            const float inv =
                static_cast<float>(std::pow(theta, -2.0 * i / static_cast<double>(D)));
            const double ang = static_cast<double>(p) * inv;
            EXPECT_EQ(t[static_cast<size_t>(p) * D + i], static_cast<float>(std::cos(ang)))
                << p << " " << i;
            EXPECT_EQ(t[static_cast<size_t>(p) * D + D / 2 + i], static_cast<float>(std::sin(ang)))
                << p << " " << i;
        }
    }
    EXPECT_EQ(t[0], 1.0f);
    EXPECT_EQ(t[D / 2], 0.0f);
    EXPECT_TRUE(rope_cos_sin_cache(theta, 63, 4).empty());
    EXPECT_TRUE(rope_cos_sin_cache(theta, 64, 0).empty());
}

TEST(CudaGemmShape, ResolvesStridesAndRejectsBadOnes) {
    GemmOptions o;
    auto s = resolve_gemm_shape({256, 1024}, o);
    ASSERT_OK(s);
    EXPECT_EQ(s->ldx, 256);
    EXPECT_EQ(s->ldw, 256);
    EXPECT_EQ(s->ldy, 1024);
    GemmShape strided{256, 512, 1024, 0, 2048};  // a column slice of X, Y written into a wider row
    ASSERT_OK(resolve_gemm_shape(strided, o));

    EXPECT_THAT(resolve_gemm_shape({0, 8}, o).status().message(), HasSubstr("k 0"));
    EXPECT_THAT(resolve_gemm_shape({100, 8}, o).status().message(),
                HasSubstr("ldx 100"));  // 200 bytes
    GemmShape short_ld{256, 64, 128};
    EXPECT_THAT(resolve_gemm_shape(short_ld, o).status().message(),
                HasSubstr("ldx 128 must be >="));
    GemmShape f32{256, 36};
    f32.out_dtype = runtime::DType::kF32;
    EXPECT_OK(resolve_gemm_shape(f32, o));  // 144-byte rows of fp32
    f32.n = 34;
    EXPECT_THAT(resolve_gemm_shape(f32, o).status().message(), HasSubstr("ldy 34"));
    GemmShape i32{256, 64};
    i32.out_dtype = runtime::DType::kI32;
    EXPECT_THAT(resolve_gemm_shape(i32, o).status().message(), HasSubstr("out_dtype int32"));
    o.max_rows = 0;
    EXPECT_THAT(resolve_gemm_shape({256, 64}, o).status().message(), HasSubstr("max_rows 0"));
}

// Arguments are checked before the stream is looked at: a bad one is kInvalidArgument naming it,
// and a good launch on a CPU stream is kInvalidArgument "not a CUDA stream". No device touched.
TEST(CudaModelKernels, ChecksArgumentsBeforeLaunching) {
    runtime::CpuStream cpu{"not-cuda"};
    alignas(16) static uint16_t buf[4096];
    alignas(16) static float w[512];
    RmsNormParams p;
    p.in = buf;
    p.in_ld = 256;
    p.out = buf;
    p.out_ld = 256;
    p.weight = w;
    p.rows = 4;
    p.hidden = 256;
    p.eps = 1e-5f;
    RmsNormParams bad = p;
    bad.hidden = 252;
    EXPECT_THAT(rms_norm(bad, cpu).message(), HasSubstr("rms_norm: hidden 252"));
    bad = p;
    bad.in = buf + 1;
    EXPECT_THAT(rms_norm(bad, cpu).message(), HasSubstr("rms_norm: in is not 16-byte aligned"));
    bad = p;
    bad.out_ld = 260;
    EXPECT_THAT(rms_norm(bad, cpu).message(), HasSubstr("row stride 260"));
    const Status st = rms_norm(p, cpu);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("not a CUDA stream"));
    p.rows = 0;
    EXPECT_OK(rms_norm(p, cpu));  // nothing to enqueue

    SiluMulParams sm{buf, 128, buf, 64, 3, 64};
    EXPECT_THAT(silu_mul(sm, cpu).message(),
                HasSubstr("not a CUDA stream"));  // [gate | up] fits 128
    sm.gate_up_ld = 100;
    EXPECT_THAT(silu_mul(sm, cpu).message(), HasSubstr("silu_mul: gate_up: row stride 100"));

    ArgmaxParams am{buf, runtime::DType::kI32, 512, 2, 512, reinterpret_cast<int32_t*>(w)};
    EXPECT_THAT(argmax(am, cpu).message(), HasSubstr("logits dtype int32"));
    am.dtype = runtime::DType::kBF16;
    am.ld = 100;
    EXPECT_THAT(argmax(am, cpu).message(), HasSubstr("vocab 512 must be > 0 and <= ld 100"));

    SliceReduceParams sr;
    sr.partials = w;
    sr.slice_stride = 4 * 64;
    sr.partial_ld = 64;
    sr.slices = 2;
    sr.residual = buf;
    sr.residual_ld = 64;
    sr.rows = 4;
    sr.hidden = 64;
    EXPECT_THAT(slice_reduce_residual(sr, cpu).message(), HasSubstr("not a CUDA stream"));
    SliceReduceParams bad_sr = sr;
    bad_sr.slices = 0;
    EXPECT_THAT(slice_reduce_residual(bad_sr, cpu).message(), HasSubstr("slices 0"));
    bad_sr = sr;
    bad_sr.slice_stride = 64;  // the slices would overlap
    EXPECT_THAT(slice_reduce_residual(bad_sr, cpu).message(), HasSubstr("slice_stride 64"));
    bad_sr = sr;
    bad_sr.partials = w + 1;
    EXPECT_THAT(slice_reduce_residual(bad_sr, cpu).message(),
                HasSubstr("partials is null or not 16-byte aligned"));
    bad_sr = sr;
    bad_sr.hidden = 60;
    EXPECT_THAT(slice_reduce_residual(bad_sr, cpu).message(),
                HasSubstr("slice_reduce_residual: hidden 60"));

    const ModelDims d = *make_model_dims(tiny());
    EXPECT_THAT(
        generate_weights(1, qkv_weight_layout(d, 0), buf, runtime::DType::kF16, cpu).message(),
        HasSubstr("dtype fp16"));
    WeightLayout broken = qkv_weight_layout(d, 0);
    broken.blocks[1].row0 = broken.rows;  // k block past the end
    EXPECT_THAT(generate_weights(1, broken, buf, runtime::DType::kBF16, cpu).message(),
                HasSubstr("block 1"));
}

// With no GPU the GEMM plans report it (the cuda tests skip with the same reason).
TEST(CudaGemm, NoDeviceIsUnavailable) {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (rt.ok() && (*rt)->device_count() > 0) GTEST_SKIP() << "a GPU is present";
    auto g = BatchInvariantGemm::create({256, 256});
    EXPECT_EQ(g.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(g.status().message(), HasSubstr("no device"));
    auto h = HeuristicGemm::create(64, {256, 256});
    EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pdsim::model::cuda
