// The `cpu` attention backend (created through the registry) against the `cpu_ref` oracle.
//
// Metric: element-wise |cpu - cpu_ref| <= tol * max(1, |cpu_ref|), NaN never passes;
// tol = 1e-5 with fp32 KV, 1e-2 with bf16 KV.
//
// The parameterized suite covers every combination of
//   kind       decode | prefill (fresh extend) | chunked (cached prefix + new tokens, extend)
//   q/kv ratio 1, 4, 8;  head_dim 64, 128;  page_size 1, 16, 64;  KV fp32, bf16;
//   save_kv    true (the backend writes the new tokens' KV) | false (prewrite: the test writes it
//              into the pool before forward and hands the backend NaN decoys for k and v)
// and runs two or three multi-request batches per combination, with seq lens 1, page_size - 1,
// page_size, page_size + 1, 2 * page_size + 1 and up to 4096 (decode and chunked; fresh prefill
// up to ~300 here, 4096 in cpu_attention_slow_test). Page tables are shuffled (non-contiguous),
// pools poisoned (see attention_test_util.h). After each run the whole pool must equal the
// expected image: prefix + the new tokens' KV (bf16: rounded to nearest even) and nothing else.
// bf16 activations (q, k, v, out as bf16 views) are checked against the fp32 path on their own.
// Sliding-window layers (LayerSpec::sliding_window) have their own suite (CpuWindowVsRef) and
// checks: the oracle against a windowed naive computation, the window changing the output, and a
// negative window refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tests/attention_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::test {
namespace {

enum class Kind { kDecode, kPrefill, kChunked };

const char* kind_name(Kind k) {
    switch (k) {
        case Kind::kDecode:
            return "decode";
        case Kind::kPrefill:
            return "prefill";
        case Kind::kChunked:
            return "chunked";
    }
    return "?";
}

double tolerance(kv::KVDtype d) {
    return d == kv::KVDtype::kF32 ? 1e-5 : 1e-2;
}

// q/kv ratio -> (q heads, kv heads). More than one KV head everywhere, so a wrong head stride
// shows.
Shape shape_for(int ratio, int head_dim, int page_size, kv::KVDtype dtype) {
    Shape s;
    s.num_kv_heads = ratio == 1 ? 3 : 2;
    s.num_q_heads = s.num_kv_heads * ratio;
    s.head_dim = head_dim;
    s.page_size = page_size;
    s.dtype = dtype;
    return s;
}

// The layer of `s` with a sliding window (Shape::layer() has none).
LayerSpec windowed_layer(const Shape& s, int window) {
    LayerSpec layer = s.layer();
    layer.sliding_window = window;
    return layer;
}

// Runner::launch with `layer` in place of Shape::layer() (a sliding window): poisons r.out() with
// NaN, then init_forward_metadata + forward, not waited for. save_kv == false hands the backend
// NaN decoys for k and v, kept in `decoys`, which must outlive the run.
Status launch_layer(Runner& r, const Shape& s, const Batch& b, const LayerSpec& layer,
                    kv::MHATokenToKVPool& pool, bool save_kv, std::vector<float>& decoys) {
    PDSIM_RETURN_IF_ERROR(r.create_status());
    r.out().assign(static_cast<size_t>(b.num_tokens) * s.q_width(), kNaN);
    decoys.assign(std::max(b.k.size(), b.v.size()), kNaN);
    PDSIM_RETURN_IF_ERROR(r.backend().init_forward_metadata(b.forward_batch()));
    return forward_host(r.backend(), b.q.data(), save_kv ? b.k.data() : decoys.data(),
                        save_kv ? b.v.data() : decoys.data(), layer, b.locs.data(), b.num_tokens,
                        pool, b.mode, b.bs, r.out().data(), save_kv);
}

// Runs `b` through cpu_ref and cpu (concurrently, each on its own stream and pool) and checks the
// outputs and both pools. window > 0: a sliding-window layer.
void check_batch(const Shape& s, const Batch& b, bool save_kv, const std::string& label,
                 int cpu_threads = 0, int window = 0) {
    SCOPED_TRACE(label + " | " + s.describe() +
                 " | save_kv=" + (save_kv ? "true" : "false (prewrite)") + " | " + b.describe() +
                 " | sliding_window=" + std::to_string(window));
    auto ref_pool = make_pool(s, b.num_pages);
    auto cpu_pool = make_pool(s, b.num_pages);
    auto want_pool = make_pool(s, b.num_pages);
    ASSERT_TRUE(ref_pool && cpu_pool && want_pool);
    init_pool(*ref_pool, s, b, /*with_new=*/!save_kv);
    init_pool(*cpu_pool, s, b, /*with_new=*/!save_kv);
    init_pool(*want_pool, s, b, /*with_new=*/true);

    Runner ref("cpu_ref", s);
    Runner cpu("cpu", s, cpu_threads);
    ASSERT_OK(ref.create_status());
    ASSERT_OK(cpu.create_status());
    std::vector<float> ref_decoys, cpu_decoys;
    Status ref_launch, cpu_launch;
    if (window == 0) {
        ref_launch = ref.launch(b, *ref_pool, save_kv);
        cpu_launch = cpu.launch(b, *cpu_pool, save_kv);
    } else {
        const LayerSpec layer = windowed_layer(s, window);
        ref_launch = launch_layer(ref, s, b, layer, *ref_pool, save_kv, ref_decoys);
        cpu_launch = launch_layer(cpu, s, b, layer, *cpu_pool, save_kv, cpu_decoys);
    }
    Status ref_done = ref.wait();
    Status cpu_done = cpu.wait();
    ASSERT_OK(ref_launch) << "cpu_ref: " << ref_launch.to_string();
    ASSERT_OK(ref_done) << "cpu_ref: " << ref_done.to_string();
    ASSERT_OK(cpu_launch) << "cpu: " << cpu_launch.to_string();
    ASSERT_OK(cpu_done) << "cpu: " << cpu_done.to_string();
    EXPECT_TRUE(outputs_close(cpu.out(), ref.out(), tolerance(s.dtype), s, b)) << "cpu vs cpu_ref";
    EXPECT_TRUE(pools_equal(*cpu_pool, *want_pool)) << "cpu backend's KV pool after forward";
    EXPECT_TRUE(pools_equal(*ref_pool, *want_pool)) << "cpu_ref backend's KV pool after forward";
}

std::vector<int> boundary_lens(int ps, std::vector<int> extra) {
    std::set<int> lens(extra.begin(), extra.end());
    for (int l : {1, ps - 1, ps, ps + 1, 2 * ps + 1}) {
        if (l >= 1) lens.insert(l);
    }
    return {lens.begin(), lens.end()};
}

std::vector<Req> shuffled(std::vector<Req> reqs, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::shuffle(reqs.begin(), reqs.end(), rng);
    return reqs;
}

using Param = std::tuple<Kind, int /*ratio*/, int /*head_dim*/, int /*page_size*/, kv::KVDtype,
                         bool /*save_kv*/>;

class CpuVsRef : public ::testing::TestWithParam<Param> {};

TEST_P(CpuVsRef, MatchesOracleAndWritesKv) {
    const auto [kind, ratio, head_dim, ps, dtype, save_kv] = GetParam();
    const Shape s = shape_for(ratio, head_dim, ps, dtype);
    Shape scaled = s;
    scaled.scaling = 0.25f;
    uint64_t seed = 1000003ull * static_cast<uint64_t>(kind) +
                    10007ull * static_cast<uint64_t>(ratio) +
                    101ull * static_cast<uint64_t>(head_dim) + 7ull * static_cast<uint64_t>(ps) +
                    (dtype == kv::KVDtype::kBF16 ? 3 : 0) + (save_kv ? 1 : 0);
    std::mt19937_64 rng(seed);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const std::string name = kind_name(kind);
    switch (kind) {
        case Kind::kDecode: {
            std::vector<Req> reqs;
            for (int l : boundary_lens(ps, {100, 1000, 4096})) reqs.push_back({l - 1, 1});
            check_batch(s, make_batch(s, ForwardMode::kDecode, shuffled(reqs, seed), seed), save_kv,
                        name + " boundary lens");
            check_batch(scaled, make_batch(scaled, ForwardMode::kDecode, {{4095, 1}}, seed + 1),
                        save_kv, name + " single 4096, scaling 0.25");
            reqs.clear();
            for (int i = 0; i < 24; ++i) reqs.push_back({uni(1, 300) - 1, 1});
            check_batch(s, make_batch(s, ForwardMode::kDecode, reqs, seed + 2), save_kv,
                        name + " bs 24");
            break;
        }
        case Kind::kPrefill: {
            std::vector<Req> reqs;
            for (int l : boundary_lens(ps, {97})) reqs.push_back({0, l});
            check_batch(s, make_batch(s, ForwardMode::kExtend, shuffled(reqs, seed), seed), save_kv,
                        name + " boundary lens");
            check_batch(scaled,
                        make_batch(scaled, ForwardMode::kExtend, {{0, uni(200, 300)}}, seed + 1),
                        save_kv, name + " single, scaling 0.25");
            break;
        }
        case Kind::kChunked: {
            std::vector<Req> reqs{{1, 1}, {0, 5}, {4093, 3}, {4095, 1}};
            for (Req r :
                 {Req{.prefix = ps - 1, .new_tokens = 1}, Req{.prefix = ps - 1, .new_tokens = 2},
                  Req{.prefix = ps, .new_tokens = ps},
                  Req{.prefix = ps + 1, .new_tokens = std::max(ps - 1, 1)},
                  Req{.prefix = 2 * ps - 3, .new_tokens = 7}}) {
                if (r.prefix >= 1) reqs.push_back(r);
            }
            check_batch(s, make_batch(s, ForwardMode::kExtend, shuffled(reqs, seed), seed), save_kv,
                        name + " boundary lens");
            check_batch(scaled,
                        make_batch(scaled, ForwardMode::kExtend, {{uni(100, 200), uni(150, 200)}},
                                   seed + 1),
                        save_kv, name + " single, scaling 0.25");
            reqs.clear();
            for (int i = 0; i < 8; ++i) reqs.push_back({uni(0, 300), uni(1, 40)});
            check_batch(s, make_batch(s, ForwardMode::kExtend, reqs, seed + 2), save_kv,
                        name + " bs 8");
            break;
        }
    }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
    const auto [kind, ratio, head_dim, ps, dtype, save_kv] = info.param;
    return std::string(kind_name(kind)) + "_ratio" + std::to_string(ratio) + "_d" +
           std::to_string(head_dim) + "_ps" + std::to_string(ps) + "_" +
           std::string(kv::dtype_name(dtype)) + (save_kv ? "_save" : "_prewrite");
}

INSTANTIATE_TEST_SUITE_P(
    AllCombinations, CpuVsRef,
    ::testing::Combine(::testing::Values(Kind::kDecode, Kind::kPrefill, Kind::kChunked),
                       ::testing::Values(1, 4, 8), ::testing::Values(64, 128),
                       ::testing::Values(1, 16, 64),
                       ::testing::Values(kv::KVDtype::kF32, kv::KVDtype::kBF16), ::testing::Bool()),
    param_name);

// ---- sliding-window attention (LayerSpec::sliding_window) -----------------------------------
// Every combination of window W (1, 3, 16, 63, 128, 700, and more than every sequence), q/kv ratio
// 1, 4, 8 (GQA), page_size 1, 16 and KV fp32, bf16, at head_dim 64, over decode, extend (fresh
// prefill and chunked prefill with a cached prefix, q_len < seq_len) and mixed batches. The sizes
// make the decode kernel split long requests into several KV chunks (4096 tokens; W = 700 still
// spans three 256-token chunks) and give the extend kernel several key blocks and query tiles
// (300 new tokens; 150 new over a 500-token prefix), with windows that start inside a block, a
// page, the cached prefix, or before the first key.
using WindowParam = std::tuple<int /*window*/, int /*ratio*/, int /*page_size*/, kv::KVDtype>;

class CpuWindowVsRef : public ::testing::TestWithParam<WindowParam> {};

constexpr int kWindowBeyondEverySeq = 1 << 20;

TEST_P(CpuWindowVsRef, MatchesOracle) {
    const auto [window, ratio, ps, dtype] = GetParam();
    const Shape s = shape_for(ratio, 64, ps, dtype);
    const uint64_t seed = 7919ull * static_cast<uint64_t>(window % 10007) +
                          131ull * static_cast<uint64_t>(ratio) +
                          17ull * static_cast<uint64_t>(ps) + (dtype == kv::KVDtype::kBF16 ? 5 : 0);
    const std::string w = "window " + std::to_string(window);
    // Lengths around the page size and around the window.
    std::vector<int> lens = boundary_lens(ps, {100, 1000, 4096});
    for (int l : {window - 1, window, window + 1, window + ps + 1}) {
        if (l >= 1 && l <= 4096) lens.push_back(l);
    }
    std::vector<Req> dec;
    for (int l : lens) dec.push_back({l - 1, 1});
    check_batch(s, make_batch(s, ForwardMode::kDecode, shuffled(dec, seed), seed), true,
                w + ", decode", 0, window);
    const int wl = std::min(window, 900);  // a prefix about the window's length
    std::vector<Req> ext{{0, 300},     {500, 150}, {0, 1},  {4000, 3},
                         {ps, ps + 2}, {wl, 5},    {3, 70}, {wl + 40, 90}};
    check_batch(s, make_batch(s, ForwardMode::kExtend, shuffled(ext, seed + 1), seed + 1), true,
                w + ", extend (prefill + chunked)", 0, window);
    std::vector<Req> mixed{{4095, 1}, {0, 70}, {130, 40}, {2000, 1}, {10, 1}, {wl, 1}};
    check_batch(s, make_batch(s, ForwardMode::kMixed, shuffled(mixed, seed + 2), seed + 2), true,
                w + ", mixed", 0, window);
}

std::string window_param_name(const ::testing::TestParamInfo<WindowParam>& info) {
    const auto [window, ratio, ps, dtype] = info.param;
    return "w" + (window == kWindowBeyondEverySeq ? std::string("huge") : std::to_string(window)) +
           "_ratio" + std::to_string(ratio) + "_ps" + std::to_string(ps) + "_" +
           std::string(kv::dtype_name(dtype));
}

INSTANTIATE_TEST_SUITE_P(
    Windows, CpuWindowVsRef,
    ::testing::Combine(::testing::Values(1, 3, 16, 63, 128, 700, kWindowBeyondEverySeq),
                       ::testing::Values(1, 4, 8), ::testing::Values(1, 16),
                       ::testing::Values(kv::KVDtype::kF32, kv::KVDtype::kBF16)),
    window_param_name);

// Windows on the other kernel paths: head dims the decode kernel's vectors do not divide (q_len 1
// requests then go through the extend kernel), head_dim 128, the prewrite path (save_kv false),
// and thread counts that change the work partition.
TEST(CpuAttention, WindowOtherHeadDimsAndThreads) {
    for (int d : {36, 80, 128}) {
        for (int window : {5, 100}) {
            Shape s = shape_for(4, d, 16, kv::KVDtype::kBF16);
            const std::string w = ", window " + std::to_string(window);
            check_batch(s, make_batch(s, ForwardMode::kDecode, {{0, 1}, {16, 1}, {700, 1}}, 60 + d),
                        false, "decode, head_dim " + std::to_string(d) + w, 0, window);
            check_batch(s,
                        make_batch(s, ForwardMode::kExtend, {{0, 37}, {120, 12}, {5, 1}}, 70 + d),
                        true, "extend, head_dim " + std::to_string(d) + w, 0, window);
        }
    }
    for (int threads : {1, 3}) {
        Shape s = shape_for(8, 128, 16, kv::KVDtype::kF32);
        std::vector<Req> dec, ext;
        for (int i = 0; i < 9; ++i) dec.push_back({i * 397 % 3000, 1});
        for (int i = 0; i < 5; ++i) ext.push_back({i * 53 % 200, 1 + i * 37 % 90});
        check_batch(s, make_batch(s, ForwardMode::kDecode, dec, 8 + threads), true,
                    "decode, window 300, threads " + std::to_string(threads), threads, 300);
        check_batch(s, make_batch(s, ForwardMode::kExtend, ext, 9 + threads), false,
                    "extend, window 20, threads " + std::to_string(threads), threads, 20);
    }
}

// The window matters: on the same inputs, a query whose position is at least W sees fewer keys
// than with full attention and its output differs; a query at position < W sees the same keys
// and its output is the same. W = 1 attends only the query's own key: the output is its own V
// row. (A kernel that ignored the window would fail all three.)
TEST(CpuAttention, WindowChangesTheOutput) {
    constexpr int kWindow = 4;
    const Shape s = shape_for(4, 64, 16, kv::KVDtype::kF32);
    const int hq = s.num_q_heads, d = s.head_dim, group = s.num_q_heads / s.num_kv_heads;
    for (auto mode : {ForwardMode::kExtend, ForwardMode::kDecode}) {
        const Batch b = make_batch(s, mode,
                                   mode == ForwardMode::kDecode
                                       ? std::vector<Req>{{2, 1}, {50, 1}, {300, 1}, {3, 1}}
                                       : std::vector<Req>{{0, 40}, {100, 20}, {1, 2}},
                                   31);
        // Request and position of every query token.
        std::vector<int> req_of, pos_of;
        for (int i = 0; i < b.bs; ++i) {
            const int seq = b.seq_lens[static_cast<size_t>(i)],
                      ql = b.extend_lens[static_cast<size_t>(i)];
            for (int j = 0; j < ql; ++j) {
                req_of.push_back(i);
                pos_of.push_back(seq - ql + j);
            }
        }
        for (const char* name : {"cpu_ref", "cpu"}) {
            SCOPED_TRACE(std::string(name) + " | " + b.describe());
            std::vector<std::vector<float>> outs;
            for (int window : {0, kWindow, 1}) {
                auto pool = make_pool(s, b.num_pages);
                ASSERT_TRUE(pool);
                init_pool(*pool, s, b, false);
                Runner r(name, s);
                std::vector<float> decoys;
                ASSERT_OK(launch_layer(r, s, b, windowed_layer(s, window), *pool, true, decoys));
                ASSERT_OK(r.wait());
                outs.push_back(r.out());
            }
            const std::vector<float>&full = outs[0], &windowed = outs[1], &own = outs[2];
            EXPECT_FALSE(outputs_close(windowed, full, 1e-2, s, b))
                << "a window of " << kWindow << " did not change the output";
            for (int token = 0; token < b.num_tokens; ++token) {
                const int pos = pos_of[static_cast<size_t>(token)];
                const auto& v = b.req_v[static_cast<size_t>(req_of[static_cast<size_t>(token)])];
                for (int h = 0; h < hq; ++h) {
                    double diff = 0.0, own_err = 0.0;
                    for (int e = 0; e < d; ++e) {
                        const size_t idx = (static_cast<size_t>(token) * hq + h) * d + e;
                        diff = std::max(diff, std::fabs(double{windowed[idx]} - full[idx]));
                        const float want =
                            v[(static_cast<size_t>(pos) * s.num_kv_heads + h / group) * d + e];
                        own_err = std::max(own_err, std::fabs(double{own[idx]} - want));
                    }
                    if (pos < kWindow) {
                        EXPECT_LE(diff, 1e-5) << "token " << token << " position " << pos
                                              << " head " << h << ": inside the window";
                    } else {
                        EXPECT_GT(diff, 1e-3) << "token " << token << " position " << pos
                                              << " head " << h << ": the window was ignored";
                    }
                    EXPECT_LE(own_err, 1e-5) << "token " << token << " position " << pos << " head "
                                             << h << ": window 1 != own V row";
                }
            }
        }
    }
}

// Both CPU backends declare sliding-window attention; a negative window is refused by forward()
// (kInvalidArgument, nothing enqueued: the output stays poisoned).
TEST(CpuAttention, NegativeWindowIsRejected) {
    const Shape s = shape_for(4, 64, 16, kv::KVDtype::kF32);
    const Batch b = make_batch(s, ForwardMode::kExtend, {{10, 4}, {0, 3}}, 3);
    for (const char* name : {"cpu_ref", "cpu"}) {
        SCOPED_TRACE(name);
        auto pool = make_pool(s, b.num_pages);
        ASSERT_TRUE(pool);
        init_pool(*pool, s, b, false);
        Runner r(name, s);
        ASSERT_OK(r.create_status());
        EXPECT_TRUE(r.backend().capabilities().sliding_window);
        std::vector<float> decoys;
        EXPECT_THAT(launch_layer(r, s, b, windowed_layer(s, -1), *pool, true, decoys),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("sliding_window")));
        ASSERT_OK(r.wait());
        EXPECT_TRUE(std::all_of(r.out().begin(), r.out().end(), [](float x) {
            return std::isnan(x);
        })) << "the output was written";
    }
}

// The comparison can fail: an element nudged just past the tolerance, or a NaN, is reported.
TEST(CpuAttention, ComparisonRejectsPerturbedOutputs) {
    Shape s = shape_for(4, 64, 16, kv::KVDtype::kF32);
    Batch b = make_batch(s, ForwardMode::kExtend, {{3, 4}, {0, 2}}, 1);
    std::vector<float> ref = naive_attention(s, b);
    EXPECT_TRUE(outputs_close(ref, ref, 1e-5, s, b));
    for (double tol : {1e-5, 1e-2}) {
        std::vector<float> got = ref;
        got[77] += static_cast<float>(2 * tol * std::max(1.0f, std::fabs(ref[77])));
        EXPECT_FALSE(outputs_close(got, ref, tol, s, b)) << tol;
        got = ref;
        got[5] = kNaN;
        EXPECT_FALSE(outputs_close(got, ref, tol, s, b)) << tol;
        got = ref;
        got[got.size() - 1] +=
            static_cast<float>(0.5 * tol * std::max(1.0f, std::fabs(ref.back())));
        EXPECT_TRUE(outputs_close(got, ref, tol, s, b)) << tol;
    }
}

// The oracle itself against a naive fp64 computation from the logical (unpaged) data, and `cpu`
// against the same: if cpu_ref were wrong, the suite above would compare against a wrong answer.
// Full attention and sliding windows (naive_attention's window): windows shorter
// than, equal to and longer than the sequences.
TEST(CpuAttention, OracleMatchesNaiveAttention) {
    for (auto dtype : {kv::KVDtype::kF32, kv::KVDtype::kBF16}) {
        for (int ps : {1, 16}) {
            Shape s = shape_for(4, 64, ps, dtype);
            Batch b = make_batch(s, ForwardMode::kExtend, {{0, 33}, {17, 5}, {40, 1}}, 77 + ps);
            Batch d = make_batch(s, ForwardMode::kDecode, {{0, 1}, {ps, 1}, {300, 1}}, 91 + ps);
            for (int window : {0, 1, 5, 16, 33, 1000}) {
                for (const Batch* batch : {&b, &d}) {
                    const std::vector<float> naive = naive_attention(s, *batch, window);
                    for (const char* name : {"cpu_ref", "cpu"}) {
                        SCOPED_TRACE(std::string(name) + " | " + s.describe() + " | " +
                                     batch->describe() + " | sliding_window " +
                                     std::to_string(window));
                        auto pool = make_pool(s, batch->num_pages);
                        ASSERT_TRUE(pool);
                        init_pool(*pool, s, *batch, false);
                        Runner r(name, s);
                        std::vector<float> decoys;
                        ASSERT_OK(launch_layer(r, s, *batch, windowed_layer(s, window), *pool, true,
                                               decoys));
                        ASSERT_OK(r.wait());
                        EXPECT_TRUE(outputs_close(r.out(), naive, tolerance(dtype), s, *batch))
                            << name << " vs naive";
                    }
                }
            }
        }
    }
}

// The work partition must not change the answer: 1 thread, an odd count, more threads than cores.
TEST(CpuAttention, ThreadCountsAgree) {
    for (int threads : {1, 3, 8}) {
        Shape s = shape_for(4, 128, 16, kv::KVDtype::kF32);
        std::vector<Req> dec, ext;
        for (int i = 0; i < 13; ++i) dec.push_back({i * 97 % 1500, 1});
        for (int i = 0; i < 5; ++i) ext.push_back({i * 53 % 200, 1 + i * 37 % 90});
        check_batch(s, make_batch(s, ForwardMode::kDecode, dec, 5 + threads), true,
                    "decode, threads " + std::to_string(threads), threads);
        check_batch(s, make_batch(s, ForwardMode::kExtend, ext, 6 + threads), false,
                    "extend, threads " + std::to_string(threads), threads);
    }
}

// One init_forward_metadata per batch, then one forward per layer (what the model runner does):
// every layer reads its own KV and writes its own new tokens.
TEST(CpuAttention, LayersShareOneMetadataInit) {
    constexpr int kLayers = 3;
    for (auto mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
        Shape s = shape_for(8, 64, 16, kv::KVDtype::kBF16);
        s.num_layers = kLayers;
        std::vector<Req> reqs = mode == ForwardMode::kDecode
                                    ? std::vector<Req>{{30, 1}, {200, 1}, {0, 1}}
                                    : std::vector<Req>{{30, 9}, {0, 40}, {16, 16}};
        std::vector<Batch> per_layer;
        std::vector<Shape> shapes;
        for (int l = 0; l < kLayers; ++l) {
            shapes.push_back(s);
            shapes.back().layer_id = l;
            per_layer.push_back(make_batch(shapes.back(), mode, reqs, 11, 2, 0, 0, 100 + l));
        }
        auto ref_pool = make_pool(s, per_layer[0].num_pages);
        auto cpu_pool = make_pool(s, per_layer[0].num_pages);
        auto want = make_pool(s, per_layer[0].num_pages);
        ASSERT_TRUE(ref_pool && cpu_pool && want);
        for (int l = 0; l < kLayers; ++l) {
            init_pool(*ref_pool, shapes[static_cast<size_t>(l)], per_layer[static_cast<size_t>(l)],
                      false, l == 0);
            init_pool(*cpu_pool, shapes[static_cast<size_t>(l)], per_layer[static_cast<size_t>(l)],
                      false, l == 0);
            init_pool(*want, shapes[static_cast<size_t>(l)], per_layer[static_cast<size_t>(l)],
                      true, l == 0);
        }
        Runner ref("cpu_ref", s), cpu("cpu", s);
        std::vector<std::vector<float>> ref_out(kLayers), cpu_out(kLayers);
        for (auto* r : {&ref, &cpu}) {
            auto& outs = r == &ref ? ref_out : cpu_out;
            auto& pool = r == &ref ? *ref_pool : *cpu_pool;
            ASSERT_OK(r->create_status());
            ASSERT_OK(r->backend().init_forward_metadata(per_layer[0].forward_batch()));
            for (int l = 0; l < kLayers; ++l) {
                const Batch& b = per_layer[static_cast<size_t>(l)];
                outs[static_cast<size_t>(l)].assign(static_cast<size_t>(b.num_tokens) * s.q_width(),
                                                    kNaN);
                ASSERT_TRUE(forward_host(r->backend(), b.q.data(), b.k.data(), b.v.data(),
                                         shapes[static_cast<size_t>(l)].layer(), b.locs.data(),
                                         b.num_tokens, pool, mode, b.bs,
                                         outs[static_cast<size_t>(l)].data())
                                .ok());
            }
        }
        ASSERT_OK(ref.wait());
        ASSERT_OK(cpu.wait());
        for (int l = 0; l < kLayers; ++l) {
            SCOPED_TRACE("layer " + std::to_string(l) + " | " +
                         per_layer[static_cast<size_t>(l)].describe());
            EXPECT_TRUE(outputs_close(cpu_out[static_cast<size_t>(l)],
                                      ref_out[static_cast<size_t>(l)], tolerance(s.dtype), s,
                                      per_layer[static_cast<size_t>(l)]));
        }
        EXPECT_TRUE(pools_equal(*cpu_pool, *want));
        EXPECT_TRUE(pools_equal(*ref_pool, *want));
    }
}

// Head dims other than 64 / 128, including ones that are not a multiple of the SIMD width
// (the vectorized paths need tails or a fallback).
TEST(CpuAttention, OtherHeadDims) {
    for (int d : {8, 32, 36, 80, 96, 100, 256}) {
        for (auto dtype : {kv::KVDtype::kF32, kv::KVDtype::kBF16}) {
            Shape s = shape_for(4, d, 16, dtype);
            check_batch(s, make_batch(s, ForwardMode::kDecode, {{0, 1}, {16, 1}, {700, 1}}, 40 + d),
                        true, "decode, head_dim " + std::to_string(d));
            check_batch(s, make_batch(s, ForwardMode::kExtend, {{0, 37}, {20, 12}, {5, 1}}, 50 + d),
                        false, "extend, head_dim " + std::to_string(d));
        }
    }
}

// bf16 activations (q, k, v in, out back): the CPU backends widen q to fp32, write k and v into the
// pool (bits into a bf16 pool, widened into an fp32 one) and round the output to bf16. On inputs
// that bf16 represents exactly, that is the fp32 path's output rounded to bf16 (bit for bit on the
// deterministic cpu_ref), and the pools are byte-identical.
TEST(CpuAttention, Bf16ActivationsMatchTheFp32PathRounded) {
    auto to_bf16 = [](std::vector<float>& x) {
        std::vector<bf16_t> bits;
        for (float& f : x) {
            f = round_bf16(f);
            bits.push_back(float_to_bf16(f));
        }
        return bits;
    };
    for (const char* name : {"cpu_ref", "cpu"}) {
        for (auto dtype : {kv::KVDtype::kF32, kv::KVDtype::kBF16}) {
            for (auto mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
                Shape s = shape_for(4, 64, 16, dtype);
                Batch b = make_batch(s, mode,
                                     mode == ForwardMode::kDecode
                                         ? std::vector<Req>{{0, 1}, {40, 1}, {300, 1}}
                                         : std::vector<Req>{{0, 33}, {17, 5}, {40, 1}},
                                     123);
                SCOPED_TRACE(std::string(name) + " | " + s.describe() + " | " + b.describe());
                for (auto& rk : b.req_k) to_bf16(rk);
                for (auto& rv : b.req_v) to_bf16(rv);
                const std::vector<bf16_t> qb = to_bf16(b.q), kb = to_bf16(b.k), vb = to_bf16(b.v);

                auto ref_pool = make_pool(s, b.num_pages);
                auto pool = make_pool(s, b.num_pages);
                ASSERT_TRUE(ref_pool && pool);
                init_pool(*ref_pool, s, b, false);
                init_pool(*pool, s, b, false);
                Runner ref(name, s);
                ASSERT_OK(ref.run(b, *ref_pool, true));
                ASSERT_TRUE(
                    outputs_close(ref.out(), naive_attention(s, b), tolerance(dtype), s, b));

                Runner r(name, s);
                ASSERT_OK(r.create_status());
                const int64_t n = b.num_tokens;
                std::vector<bf16_t> out(static_cast<size_t>(n) * s.q_width(), 0xFFFF);  // NaN
                ASSERT_OK(r.backend().init_forward_metadata(b.forward_batch()));
                using runtime::DType;
                const LayerSpec L = s.layer();
                Status st = r.backend().forward(
                    runtime::make_view(qb.data(), DType::kBF16, {}, {n, L.num_q_heads, L.head_dim}),
                    runtime::make_view(kb.data(), DType::kBF16, {},
                                       {n, L.num_kv_heads, L.head_dim}),
                    runtime::make_view(vb.data(), DType::kBF16, {},
                                       {n, L.num_kv_heads, L.head_dim}),
                    L, locs_view(b.locs.data(), n), *pool, b.mode, b.bs,
                    runtime::make_view(out.data(), DType::kBF16, {},
                                       {n, L.num_q_heads, L.head_dim}));
                ASSERT_OK(st);
                ASSERT_OK(r.wait());
                std::vector<float> got(out.size());
                for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_float(out[i]);
                if (std::string(name) == "cpu_ref") {
                    size_t differ = 0;
                    for (size_t i = 0; i < got.size(); ++i)
                        differ += got[i] == round_bf16(ref.out()[i]) ? 0 : 1;
                    EXPECT_EQ(differ, 0u) << "bf16 output != the fp32 output rounded to bf16";
                }
                EXPECT_TRUE(outputs_close(got, ref.out(), 8e-3, s, b))
                    << "bf16 output vs the fp32 path";
                EXPECT_TRUE(pools_equal(*pool, *ref_pool))
                    << "KV written from bf16 k/v vs from their fp32 values";
            }
        }
    }
}

// ---- bad inputs: an error from init_forward_metadata, forward or synchronize, never a crash ----
struct BadCase {
    std::string what;
    ForwardMode meta_mode;
    ForwardMode forward_mode;
    std::function<void(Batch&, int pool_pages)> corrupt;  // edits the batch after it is built
    int forward_bs_delta = 0;
};

Status run_bad(const std::string& backend, const BadCase& c) {
    Shape s = shape_for(4, 64, 16, kv::KVDtype::kF32);
    std::vector<Req> reqs = c.meta_mode == ForwardMode::kDecode ? std::vector<Req>{{40, 1}, {7, 1}}
                                                                : std::vector<Req>{{40, 2}, {0, 7}};
    Batch b = make_batch(s, c.meta_mode, reqs, 5);
    auto pool = make_pool(s, b.num_pages);
    if (!pool) return Status(StatusCode::kInternal, "no pool");
    init_pool(*pool, s, b, false);
    c.corrupt(b, b.num_pages);
    Runner r(backend, s);
    PDSIM_RETURN_IF_ERROR(r.create_status());
    std::vector<float> out(static_cast<size_t>(b.num_tokens + 4) * s.q_width(), kNaN);
    PDSIM_RETURN_IF_ERROR(r.backend().init_forward_metadata(b.forward_batch()));
    PDSIM_RETURN_IF_ERROR(forward_host(r.backend(), b.q.data(), b.k.data(), b.v.data(), s.layer(),
                                       b.locs.data(), b.num_tokens, *pool, c.forward_mode,
                                       b.bs + c.forward_bs_delta, out.data()));
    return r.wait();
}

std::vector<BadCase> bad_cases() {
    using M = ForwardMode;
    return {
        {"page id == num_pages in a cached page", M::kExtend, M::kExtend,
         [](Batch& b, int pages) { b.page_table[0] = pages; }},
        {"negative page id", M::kDecode, M::kDecode, [](Batch& b, int) { b.page_table[1] = -1; }},
        {"huge page id", M::kExtend, M::kExtend, [](Batch& b, int) { b.page_table[1] = 1 << 30; }},
        {"seq_len needs more pages than the page-table row", M::kExtend, M::kExtend,
         [](Batch& b, int) {
             // Request 0 has 42 tokens = 3 pages of 16; squeeze every row to 2 entries.
             std::vector<int32_t> pt;
             for (int i = 0; i < b.bs; ++i) {
                 for (int p = 0; p < 2; ++p)
                     pt.push_back(b.page_table[static_cast<size_t>(i * b.stride + p)]);
             }
             b.page_table = pt;
             b.stride = 2;
         }},
        {"q_len > seq_len", M::kExtend, M::kExtend,
         [](Batch& b, int) { b.extend_lens[1] = b.seq_lens[1] + 1; }},
        {"q_len 0", M::kExtend, M::kExtend, [](Batch& b, int) { b.extend_lens[1] = 0; }},
        {"seq_len 0", M::kDecode, M::kDecode, [](Batch& b, int) { b.seq_lens[1] = 0; }},
        {"forward extend over decode metadata", M::kDecode, M::kExtend, [](Batch&, int) {}},
        {"forward decode over extend metadata", M::kExtend, M::kDecode, [](Batch&, int) {}},
        {"forward bs larger than the metadata's", M::kDecode, M::kDecode, [](Batch&, int) {}, 1},
        {"out_cache_loc out of range", M::kExtend, M::kExtend,
         [](Batch& b, int pages) { b.locs[1] = pages * 16 + 3; }},
        {"negative out_cache_loc", M::kDecode, M::kDecode, [](Batch& b, int) { b.locs[0] = -5; }},
    };
}

TEST(CpuAttention, BadInputsFailWithAnError) {
    for (const char* backend : {"cpu", "cpu_ref"}) {
        for (const BadCase& c : bad_cases()) {
            Status st = run_bad(backend, c);
            EXPECT_FALSE(st.ok()) << backend << ": '" << c.what << "' was accepted";
            if (!st.ok()) {
                EXPECT_FALSE(st.message().empty()) << backend << ": " << c.what;
            }
        }
    }
}

TEST(CpuAttention, RegistryRejectsBadConfig) {
    runtime::CpuStream stream("s");
    AttentionConfig c;
    c.num_q_heads = 6;
    c.num_kv_heads = 4;
    c.stream = &stream;
    EXPECT_FALSE(create_attention_backend("cpu", c).ok());
    c.num_q_heads = 8;
    c.stream = nullptr;
    EXPECT_FALSE(create_attention_backend("cpu", c).ok());
    c.stream = &stream;
    auto b = create_attention_backend("cpu", c);
    ASSERT_OK(b);
    EXPECT_EQ((*b)->config().num_q_heads, 8);
}

}  // namespace
}  // namespace pdsim::attn::test
