// The GPU synthetic model (backends/cuda/cuda_synthetic_model.h) on a GPU with the "cuda"
// attention backend:
//  - against an independent host oracle written here (double precision over the same bf16
//    weights, regenerated with SyntheticModel::weight_value, rounding to bf16 where the GPU
//    rounds): logits, final hidden states and the KV cache within stated tolerances, tokens equal
//    wherever the oracle's top-2 margin is larger than the tolerance;
//  - batch invariance: a request alone and batched with 6 and 63 others gives identical tokens
//    over 16 decode steps and identical KV digests;
//  - chunked prefill (two chunks) vs one prefill: tokens, KV digests (reported, with the maximum
//    difference), layer 0's KV bit-identical;
//  - decode CUDA graphs: replay == eager bit for bit for several batch sizes inside buckets; the
//    stale-graph-metadata fault (replay without the backend's metadata refresh) is caught;
//  - the prewrite path (save_kv_cache=false) == the normal path, with a device StepCounter
//    counting one record per layer per extend forward in both;
//  - llama3-8b shapes with 2 layers: a smoke run (prefill, decode, invariance, one graph, timing);
//  - tensor parallelism: the sliced (TP-invariant) TP 1 forward against the same host oracle, and
//    two TP 2 ranks (threads on one GPU, the testbed's in-process TP group) against the sliced
//    TP 1 rank: tokens and logits bit for bit, each rank's KV equal to its heads of the TP 1 rank's
//    KV.
// Pools are poisoned (NaN) and the workspace too before forwards whose outputs are compared.
// Skips with the runtime's reason where there is no GPU, or when FlashInfer is not built; the
// argument checks that need no device run everywhere.
#include "backends/cuda/cuda_synthetic_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_synthetic_model_plan.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/synthetic_model.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "common/bf16.h"
#include "sim/testbed/comm.h"
#include "tests/status_matchers.h"
#include "transfer/nccl/nccl_tp_comm.h"

namespace pdsim::model::cuda {
namespace {

using runtime::DeviceKind;
using ::testing::HasSubstr;

// Stated tolerances (bf16 has 8 significant bits; the GPU accumulates in fp32 in another order
// and FlashInfer rounds its softmax weights to bf16, so single values may differ by a few ulps):
constexpr double kLogitTol = 0.05;          // absolute; the logits' spread is ~0.6 here
constexpr double kValueAbsTol = 0.05;       // hidden states and KV: absolute ...
constexpr double kValueRelTol = 2.0 / 128;  // ... plus two bf16 ulps of the value

std::string skip_reason() {
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->unavailable_reason();
}

bool have_gpu() {
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    return rt.ok() && (*rt)->device_count() > 0;
}

ModelConfig tiny2() {
    ModelConfig c = *resolve_model("tiny");  // hidden 256, 8 q / 4 kv heads of 64, vocab 512
    c.num_layers = 2;
    return c;
}

// A TP group that create() must refuse before it gathers anything (a fake: it gathers nothing).
class RefusedTpFake final : public TpComm {
public:
    explicit RefusedTpFake(int size) : size_(size) {}
    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] int rank() const override { return 0; }
    [[nodiscard]] Status allgather(const float*, size_t, float*) override {
        ADD_FAILURE() << "allgather on a refused TP group";
        return {};
    }

private:
    int size_;
};

// A device TP group for create()'s checks: a size and a rank, no gathers (fake for unit tests of
// the model's argument checks).
class RefusedDeviceTpFake final : public DeviceTpComm {
public:
    RefusedDeviceTpFake(int size, int rank) : size_(size), rank_(rank) {}
    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] std::string name() const override { return "fake"; }
    [[nodiscard]] Status enqueue_allgather(const float*, size_t, float*,
                                           runtime::Stream&) override {
        ADD_FAILURE() << "a gather on a refused device TP group";
        return {};
    }
    [[nodiscard]] std::shared_ptr<const TpGroupHealth> health() const override { return health_; }

private:
    int size_, rank_;
    std::shared_ptr<TpGroupHealth> health_ = std::make_shared<TpGroupHealth>();
};

// ---- no device needed ---------------------------------------------------------------------------

TEST(CudaSyntheticModelCreate, RejectsWhatItDoesNotBuildBeforeTouchingADevice) {
    RefusedTpFake tp3(3);  // tiny has 4 KV heads
    auto tp = CudaSyntheticModel::create(tiny2(), &tp3);
    EXPECT_EQ(tp.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(tp.status().message(), HasSubstr("tp 3: 3 does not divide num_kv_heads 4"));
    auto mla = CudaSyntheticModel::create(*resolve_model("deepseek-v3"), nullptr);
    EXPECT_EQ(mla.status().code(), StatusCode::kUnimplemented);
    EXPECT_THAT(mla.status().message(), HasSubstr("MLA"));
    auto swa = CudaSyntheticModel::create(*resolve_model("hybrid-tiny"), nullptr);
    EXPECT_EQ(swa.status().code(), StatusCode::kUnimplemented);
    EXPECT_THAT(swa.status().message(), HasSubstr("sliding-window"));
    CudaModelOptions o;
    o.max_bs = 0;
    auto bad = CudaSyntheticModel::create(tiny2(), nullptr, o);
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr("options.max_bs"));
}

// The device TP group must be the host group's, rank for rank; checked before any device work.
TEST(CudaSyntheticModelCreate, TheDeviceTpGroupMustMatchTheHostGroup) {
    RefusedTpFake tp2(2);  // rank 0 of 2
    RefusedDeviceTpFake bigger(4, 0), other_rank(2, 1);
    EXPECT_THAT(
        CudaSyntheticModel::create(tiny2(), &tp2, {}, &bigger).status(),
        StatusIs(StatusCode::kInvalidArgument,
                 HasSubstr("device_tp: rank 0 of 4, but the host TP group is rank 0 of 2")));
    EXPECT_THAT(
        CudaSyntheticModel::create(tiny2(), &tp2, {}, &other_rank).status(),
        StatusIs(StatusCode::kInvalidArgument,
                 HasSubstr("device_tp: rank 1 of 2, but the host TP group is rank 0 of 2")));
    RefusedDeviceTpFake alone(1, 0);
    EXPECT_THAT(
        CudaSyntheticModel::create(tiny2(), nullptr, {}, &alone).status(),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("the host TP group is absent (TP 1)")));
}

TEST(CudaSyntheticModelCreate, SaysNoDeviceWithoutAGpu) {
    if (have_gpu()) GTEST_SKIP() << "a GPU is present";
    auto m = CudaSyntheticModel::create(tiny2(), nullptr);
    EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(m.status().message(), HasSubstr("no device"));
}

// ---- the rig --------------------------------------------------------------------------------

// One rank on GPU 0: a stream, the "cuda" backend, a bf16 pool and the model. Members are
// destroyed model first, stream last.
struct Rig {
    ModelConfig cfg;
    std::unique_ptr<runtime::Stream> stream;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::unique_ptr<attn::AttentionBackend> backend;
    std::unique_ptr<CudaSyntheticModel> model;
    int page_size = 16;
};

struct RigOptions {
    int num_pages = 256;
    int page_size = 16;
    CudaModelOptions model;
    TpComm* tp = nullptr;               // this rank's TP group: its pool and backend hold its heads
    DeviceTpComm* device_tp = nullptr;  // the group on the device (model.device's GPU)
};

std::unique_ptr<Rig> make_rig(const ModelConfig& cfg, const RigOptions& o) {
    const int tp = o.tp != nullptr ? o.tp->size() : 1;
    auto rig = std::make_unique<Rig>();
    rig->cfg = cfg;
    rig->page_size = o.page_size;
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    if (!rt.ok()) {
        ADD_FAILURE() << rt.status().to_string();
        return nullptr;
    }
    auto stream = (*rt)->create_stream(o.model.device, "cuda-model-test");
    if (!stream.ok()) {
        ADD_FAILURE() << stream.status().to_string();
        return nullptr;
    }
    rig->stream = std::move(*stream);
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_pages = o.num_pages;
    pc.page_size = o.page_size;
    pc.num_kv_heads = cfg.num_kv_heads / tp;
    pc.head_dim = cfg.head_dim;
    pc.dtype = kv::KVDtype::kBF16;
    pc.device = {DeviceKind::kCuda, o.model.device};
    auto pool = kv::MHATokenToKVPool::create(pc);
    if (!pool.ok()) {
        ADD_FAILURE() << pool.status().to_string();
        return nullptr;
    }
    rig->pool = std::move(*pool);
    // Poison: every KV element a forward should not read is NaN (0xffff), which would surface
    // as non-finite logits (kDataLoss) if it were read.
    EXPECT_OK(rig->pool->fill(0xff));
    attn::AttentionConfig ac;
    ac.num_q_heads = cfg.num_q_heads / tp;
    ac.num_kv_heads = cfg.num_kv_heads / tp;
    ac.head_dim = cfg.head_dim;
    ac.kv_dtype = kv::KVDtype::kBF16;
    ac.stream = rig->stream.get();
    auto backend = attn::create_attention_backend("cuda", ac);
    if (!backend.ok()) {
        ADD_FAILURE() << "the \"cuda\" attention backend: " << backend.status().to_string();
        return nullptr;
    }
    rig->backend = std::move(*backend);
    auto model = CudaSyntheticModel::create(cfg, o.tp, o.model, o.device_tp);
    if (!model.ok()) {
        ADD_FAILURE() << model.status().to_string();
        return nullptr;
    }
    rig->model = std::move(*model);
    return rig;
}

class CudaSyntheticModelTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (!have_gpu()) GTEST_SKIP() << skip_reason();
#ifndef PDSIM_HAVE_FLASHINFER
        GTEST_SKIP() << "FlashInfer not built: the \"cuda\" attention backend is missing (run "
                        "scripts/fetch_flashinfer.sh and reconfigure)";
#endif
    }
};

// A request: its tokens so far (prompt, then generated) and its pages.
struct Seq {
    std::vector<int32_t> tokens;
    std::vector<int32_t> pages;
};

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = std::uniform_int_distribution<int>(0, vocab - 1)(rng);
    return t;
}

// Makes sure `s` has pages for `len` tokens.
void ensure_pages(Rig& r, Seq& s, int len) {
    const int need = (len + r.page_size - 1) / r.page_size;
    while (static_cast<int>(s.pages.size()) < need) {
        auto p = r.pool->allocator().alloc(1);
        ASSERT_OK(p);
        s.pages.push_back((*p)[0]);
    }
}

void free_pages(Rig& r, std::vector<Seq>& seqs) {
    for (Seq& s : seqs) {
        EXPECT_OK(r.pool->allocator().free(s.pages));
        s.pages.clear();
    }
}

constexpr int kStride = 8;  // pages per request in the page table (128 tokens)

// The batch of tokens [begin_i, end_i) of every request (extend), or each one's last token.
StepBatch make_batch(Rig& r, std::vector<Seq*> seqs, const std::vector<std::pair<int, int>>& ranges,
                     attn::ForwardMode mode) {
    StepBatch b;
    b.mode = mode;
    b.page_table_stride = kStride;
    for (size_t i = 0; i < seqs.size(); ++i) {
        auto [begin, end] = ranges[i];
        ensure_pages(r, *seqs[i], end);
        for (int t = begin; t < end; ++t) {
            b.tokens.push_back(seqs[i]->tokens[static_cast<size_t>(t)]);
            b.out_cache_loc.push_back(seqs[i]->pages[static_cast<size_t>(t / r.page_size)] *
                                          r.page_size +
                                      t % r.page_size);
        }
        b.seq_lens.push_back(end);
        b.extend_lens.push_back(end - begin);
        for (int p = 0; p < kStride; ++p) {
            b.page_table.push_back(p < static_cast<int>(seqs[i]->pages.size())
                                       ? seqs[i]->pages[static_cast<size_t>(p)]
                                       : 0);
        }
    }
    return b;
}

StepBatch prefill_batch(Rig& r, std::vector<Seq*> seqs) {
    std::vector<std::pair<int, int>> ranges;
    for (Seq* s : seqs) ranges.emplace_back(0, static_cast<int>(s->tokens.size()));
    return make_batch(r, std::move(seqs), ranges, attn::ForwardMode::kExtend);
}

StepBatch decode_batch(Rig& r, std::vector<Seq*> seqs) {
    std::vector<std::pair<int, int>> ranges;
    for (Seq* s : seqs) {
        const int n = static_cast<int>(s->tokens.size());
        ranges.emplace_back(n - 1, n);
    }
    return make_batch(r, std::move(seqs), ranges, attn::ForwardMode::kDecode);
}

std::vector<Seq*> pointers(std::vector<Seq>& seqs) {
    std::vector<Seq*> out;
    for (Seq& s : seqs) out.push_back(&s);
    return out;
}

// Runs one forward to completion (the workspace poisoned first); returns the sampled tokens.
std::vector<int32_t> run(Rig& r, const StepBatch& b, bool save_kv_cache = true) {
    EXPECT_OK(r.model->fill_workspace(0xff));
    std::vector<int32_t> next(b.seq_lens.size(), -1);
    Status st = r.model->forward(b, *r.backend, *r.pool, next.data(), save_kv_cache);
    EXPECT_OK(st);
    st = r.stream->synchronize();
    EXPECT_OK(st);
    EXPECT_TRUE(r.model->forward_done().query());
    return next;
}

void append(std::vector<Seq*> seqs, const std::vector<int32_t>& next) {
    for (size_t i = 0; i < seqs.size(); ++i) seqs[i]->tokens.push_back(next[i]);
}

std::vector<float> logits(Rig& r, int rows) {
    auto l = r.model->copy_last_logits(rows);
    EXPECT_OK(l);
    return l.ok() ? *l : std::vector<float>{};
}

std::vector<uint64_t> digest(Rig& r, const Seq& s, int len) {
    auto d = request_kv_digest(*r.pool, s.pages, len);
    EXPECT_OK(d);
    return d.ok() ? *d : std::vector<uint64_t>{};
}

std::vector<float> kv_values(Rig& r, const Seq& s, int len, int layer, int buf) {
    auto bytes = read_request_kv(*r.pool, layer, buf, s.pages, len);
    EXPECT_OK(bytes);
    std::vector<float> out;
    if (!bytes.ok()) return out;
    out.resize(bytes->size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
        bf16_t bits = 0;
        std::memcpy(&bits, bytes->data() + 2 * i, 2);
        out[i] = bf16_to_float(bits);
    }
    return out;
}

// Fills KV slot `loc` of every layer (K and V) with NaN.
void poison_slot(Rig& r, int32_t loc) {
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    ASSERT_OK(rt);
    for (int l = 0; l < r.pool->num_layers(); ++l) {
        for (int buf = 0; buf < 2; ++buf) {
            const size_t tb = r.pool->token_bytes(l, buf);
            ASSERT_TRUE(
                (*rt)
                    ->fill(static_cast<char*>(r.pool->data(l, buf)) + static_cast<size_t>(loc) * tb,
                           0xff, tb)
                    .ok());
        }
    }
}

// ---- the host oracle --------------------------------------------------------------------------

double round_bf16(double x) {
    return static_cast<double>(bf16_to_float(float_to_bf16(static_cast<float>(x))));
}

// The synthetic model in double precision over the bf16 weights, rounding every activation to
// bf16 where the GPU model does (embedding, norms, projections, RoPE, attention, SiLU, residuals;
// the logits stay unrounded, as the GPU's fp32 LM head output). Tokens of a request are run one
// at a time (causal attention makes that equal to running them as one chunk).
class Oracle {
public:
    // bf16 = false: fp32 weights and no rounding at all (the CPU model's arithmetic, in double).
    explicit Oracle(const ModelConfig& c, bool bf16 = true) : c_(c), bf16_(bf16) {
        H_ = c.hidden;
        D_ = c.head_dim;
        HQ_ = c.num_q_heads;
        HKV_ = c.num_kv_heads;
        I_ = c.intermediate;
        V_ = c.vocab;
        // The CPU model's tensor ids ((layer + 1) << 8 | kind) and scales, written out here.
        const float s_h = 1.0f / std::sqrt(static_cast<float>(H_));
        const float s_o = 1.0f / std::sqrt(static_cast<float>(HQ_ * D_));
        const float s_i = 1.0f / std::sqrt(static_cast<float>(I_));
        auto id = [](int layer, uint64_t kind) {
            return (static_cast<uint64_t>(layer + 1) << 8) | kind;
        };
        auto matrix = [&](uint64_t tensor, int rows, int cols, float scale) {
            std::vector<double> w(static_cast<size_t>(rows) * cols);
            for (size_t i = 0; i < w.size(); ++i) {
                w[i] = r(SyntheticModel::weight_value(c.seed, tensor, i, scale));
            }
            return w;
        };
        auto norm = [&](uint64_t tensor) {
            std::vector<double> w(static_cast<size_t>(H_));
            for (int i = 0; i < H_; ++i) {
                w[static_cast<size_t>(i)] =
                    1.0f +
                    SyntheticModel::weight_value(c.seed, tensor, static_cast<uint64_t>(i), 0.1f);
            }
            return w;
        };
        for (int l = 0; l < c.num_layers; ++l) {
            Layer L;
            L.wq = matrix(id(l, 1), H_, HQ_ * D_, s_h);  // [K][N], as the CPU model keeps them
            L.wk = matrix(id(l, 2), H_, HKV_ * D_, s_h);
            L.wv = matrix(id(l, 3), H_, HKV_ * D_, s_h);
            L.wo = matrix(id(l, 4), HQ_ * D_, H_, s_o);
            L.wg = matrix(id(l, 5), H_, I_, s_h);
            L.wu = matrix(id(l, 6), H_, I_, s_h);
            L.wd = matrix(id(l, 7), I_, H_, s_i);
            L.n1 = norm(id(l, 8));
            L.n2 = norm(id(l, 9));
            layers_.push_back(std::move(L));
        }
        embed_ = matrix(id(-1, 10), V_, H_, 1.0f);
        final_norm_ = norm(id(-1, 11));
        lm_ = matrix(id(-1, 12), H_, V_, s_h);
        inv_freq_.resize(static_cast<size_t>(D_ / 2));
        for (int i = 0; i < D_ / 2; ++i) {
            inv_freq_[static_cast<size_t>(i)] =
                static_cast<float>(std::pow(c.rope_theta, -2.0 * i / static_cast<double>(D_)));
        }
    }

    struct Output {
        std::vector<double> hidden;  // the final norm of the last token [H]
        std::vector<double> logits;  // [V]
    };

    // Runs `tokens` as request `req`'s next tokens; returns the output of the last one.
    Output run(int req, const std::vector<int32_t>& tokens) {
        if (static_cast<int>(cache_.size()) <= req) cache_.resize(static_cast<size_t>(req) + 1);
        Cache& kvc = cache_[static_cast<size_t>(req)];
        if (kvc.k.empty()) {
            kvc.k.resize(layers_.size());
            kvc.v.resize(layers_.size());
        }
        std::vector<double> h;
        for (int32_t tok : tokens) {
            const int pos = kvc.len++;
            h.assign(embed_.begin() + static_cast<int64_t>(tok) * H_,
                     embed_.begin() + static_cast<int64_t>(tok + 1) * H_);
            for (size_t l = 0; l < layers_.size(); ++l) {
                const Layer& L = layers_[l];
                const std::vector<double> x = rms_norm(h, L.n1);
                std::vector<double> q = matvec(x, L.wq, HQ_ * D_);
                std::vector<double> k = matvec(x, L.wk, HKV_ * D_);
                const std::vector<double> v = matvec(x, L.wv, HKV_ * D_);
                rope(q, HQ_, pos);
                rope(k, HKV_, pos);
                kvc.k[l].insert(kvc.k[l].end(), k.begin(), k.end());
                kvc.v[l].insert(kvc.v[l].end(), v.begin(), v.end());
                const std::vector<double> a = attention(q, kvc.k[l], kvc.v[l], pos + 1);
                const std::vector<double> o = matvec(a, L.wo, H_);
                for (int i = 0; i < H_; ++i) h[i] = r(h[i] + o[i]);
                const std::vector<double> x2 = rms_norm(h, L.n2);
                const std::vector<double> g = matvec(x2, L.wg, I_);
                const std::vector<double> u = matvec(x2, L.wu, I_);
                std::vector<double> act(static_cast<size_t>(I_));
                for (int i = 0; i < I_; ++i) {
                    act[i] = r(g[i] / (1.0 + std::exp(-g[i])) * u[i]);
                }
                const std::vector<double> d = matvec(act, L.wd, H_);
                for (int i = 0; i < H_; ++i) h[i] = r(h[i] + d[i]);
            }
        }
        Output out;
        out.hidden = rms_norm(h, final_norm_);
        out.logits.assign(static_cast<size_t>(V_), 0.0);
        for (int kk = 0; kk < H_; ++kk) {
            const double xv = out.hidden[kk];
            const double* row = &lm_[static_cast<size_t>(kk) * V_];
            for (int n = 0; n < V_; ++n) out.logits[n] += xv * row[n];
        }
        return out;
    }

    // Request `req`'s cached K (buf 0) or V (buf 1) of `layer`, [len][kv heads * head_dim].
    const std::vector<double>& kv(int req, int layer, int buf) const {
        const Cache& kvc = cache_[static_cast<size_t>(req)];
        return buf == 0 ? kvc.k[static_cast<size_t>(layer)] : kvc.v[static_cast<size_t>(layer)];
    }

private:
    struct Layer {
        std::vector<double> wq, wk, wv, wo, wg, wu, wd, n1, n2;
    };
    struct Cache {
        int len = 0;
        std::vector<std::vector<double>> k, v;  // [layer][len * kv heads * head_dim]
    };

    std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& w) const {
        double ss = 0;
        for (double e : x) ss += e * e;
        const double inv = 1.0 / std::sqrt(ss / H_ + static_cast<double>(c_.rms_eps));
        std::vector<double> out(x.size());
        for (size_t i = 0; i < x.size(); ++i) out[i] = r(x[i] * inv * w[i]);
        return out;
    }
    // out[n] = bf16(sum_k x[k] w[k][n]), w [K][N].
    std::vector<double> matvec(const std::vector<double>& x, const std::vector<double>& w,
                               int n_out) const {
        std::vector<double> out(static_cast<size_t>(n_out), 0.0);
        for (size_t kk = 0; kk < x.size(); ++kk) {
            const double xv = x[kk];
            const double* row = &w[kk * static_cast<size_t>(n_out)];
            for (int n = 0; n < n_out; ++n) out[n] += xv * row[n];
        }
        for (double& e : out) e = r(e);
        return out;
    }
    void rope(std::vector<double>& x, int heads, int pos) const {
        const int half = D_ / 2;
        for (int h = 0; h < heads; ++h) {
            double* v = &x[static_cast<size_t>(h) * D_];
            for (int i = 0; i < half; ++i) {
                const double ang = static_cast<double>(pos) * inv_freq_[static_cast<size_t>(i)];
                const double c = static_cast<float>(std::cos(ang));
                const double s = static_cast<float>(std::sin(ang));
                const double a = v[i], b = v[i + half];
                v[i] = r(a * c - b * s);
                v[i + half] = r(a * s + b * c);
            }
        }
    }
    std::vector<double> attention(const std::vector<double>& q, const std::vector<double>& k,
                                  const std::vector<double>& v, int len) const {
        const int group = HQ_ / HKV_;
        const double scale = 1.0f / std::sqrt(static_cast<float>(D_));
        std::vector<double> out(static_cast<size_t>(HQ_) * D_, 0.0);
        std::vector<double> p(static_cast<size_t>(len));
        for (int h = 0; h < HQ_; ++h) {
            const int g = h / group;
            double m = -std::numeric_limits<double>::infinity();
            for (int t = 0; t < len; ++t) {
                double s = 0;
                for (int e = 0; e < D_; ++e) {
                    s += q[static_cast<size_t>(h) * D_ + e] *
                         k[(static_cast<size_t>(t) * HKV_ + g) * D_ + e];
                }
                p[t] = s * scale;
                m = std::max(m, p[t]);
            }
            double z = 0;
            for (int t = 0; t < len; ++t) z += (p[t] = std::exp(p[t] - m));
            for (int t = 0; t < len; ++t) {
                for (int e = 0; e < D_; ++e) {
                    out[static_cast<size_t>(h) * D_ + e] +=
                        p[t] / z * v[(static_cast<size_t>(t) * HKV_ + g) * D_ + e];
                }
            }
        }
        for (double& e : out) e = r(e);
        return out;
    }

    double r(double x) const { return bf16_ ? round_bf16(x) : x; }

    ModelConfig c_;
    bool bf16_ = true;
    int H_ = 0, D_ = 0, HQ_ = 0, HKV_ = 0, I_ = 0, V_ = 0;
    std::vector<Layer> layers_;
    std::vector<double> embed_, final_norm_, lm_;
    std::vector<float> inv_freq_;
    std::vector<Cache> cache_;
};

// The largest |gpu - oracle| over `n` values, and the largest excess over the value tolerance.
struct Compare {
    double max_abs = 0;
    double worst_excess = -1;  // > 0: some value is outside kValueAbsTol + kValueRelTol * |ref|
};
Compare compare_values(const float* gpu, const double* ref, size_t n) {
    Compare c;
    for (size_t i = 0; i < n; ++i) {
        const double d = std::abs(static_cast<double>(gpu[i]) - ref[i]);
        c.max_abs =
            std::max(c.max_abs, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
        const double excess = d - (kValueAbsTol + kValueRelTol * std::abs(ref[i]));
        c.worst_excess = std::max(c.worst_excess, std::isnan(excess) ? 1e9 : excess);
    }
    return c;
}

// Checks one request's step: logits, final hidden, token.
void check_step(const char* what, int req, const float* gpu_logits, const float* gpu_hidden,
                int32_t gpu_token, const Oracle::Output& ref, double& max_logit_err,
                double& max_hidden_err) {
    const size_t V = ref.logits.size(), H = ref.hidden.size();
    double err = 0;
    for (size_t v = 0; v < V; ++v) {
        const double d = std::abs(gpu_logits[v] - ref.logits[v]);
        err = std::max(err, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
    }
    max_logit_err = std::max(max_logit_err, err);
    EXPECT_LE(err, kLogitTol) << what << " request " << req << ": logits";
    const Compare hc = compare_values(gpu_hidden, ref.hidden.data(), H);
    max_hidden_err = std::max(max_hidden_err, hc.max_abs);
    EXPECT_LE(hc.worst_excess, 0.0)
        << what << " request " << req << ": final hidden, max |err| " << hc.max_abs;
    // The token: the oracle's argmax unless a near tie (within the tolerance) makes either valid.
    std::vector<size_t> order(V);
    for (size_t v = 0; v < V; ++v) order[v] = v;
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](size_t a, size_t b) { return ref.logits[a] > ref.logits[b]; });
    ASSERT_GE(gpu_token, 0) << what << " request " << req;
    ASSERT_LT(static_cast<size_t>(gpu_token), V);
    const double top = ref.logits[order[0]], margin = top - ref.logits[order[1]];
    if (margin > 2 * kLogitTol) {
        EXPECT_EQ(static_cast<size_t>(gpu_token), order[0]) << what << " request " << req;
    } else {
        EXPECT_GE(ref.logits[static_cast<size_t>(gpu_token)], top - 2 * kLogitTol)
            << what << " request " << req << ": a near tie";
    }
}

// The oracle itself, without a GPU: unrounded over fp32 weights it is the CPU SyntheticModel
// computed in double, so it must pick the CPU model's tokens (cpu_ref attention) wherever its
// top-2 margin is not a near tie. This checks the oracle's weight indexing, RoPE, attention, norms
// and MLP against the model the GPU one mirrors, before the GPU is compared with it.
TEST(CudaSyntheticModelOracle, MatchesTheCpuModelUnrounded) {
    const ModelConfig cfg = tiny2();
    runtime::CpuStream stream("oracle-check");
    auto model = SyntheticModel::create(cfg, nullptr, 256);
    ASSERT_OK(model);
    attn::AttentionConfig ac;
    ac.num_q_heads = cfg.num_q_heads;
    ac.num_kv_heads = cfg.num_kv_heads;
    ac.head_dim = cfg.head_dim;
    ac.stream = &stream;
    auto backend = attn::create_attention_backend("cpu_ref", ac);
    ASSERT_OK(backend);
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_pages = 32;
    pc.page_size = 16;
    pc.num_kv_heads = cfg.num_kv_heads;
    pc.head_dim = cfg.head_dim;
    auto pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(pool);
    Oracle oracle(cfg, /*bf16=*/false);
    constexpr double kTieTol = 1e-3;  // fp32 vs double
    std::vector<std::vector<int32_t>> seqs = {random_tokens(5, cfg.vocab, 100),
                                              random_tokens(17, cfg.vocab, 101),
                                              random_tokens(33, cfg.vocab, 102)};
    std::vector<std::vector<int32_t>> pages = {{1}, {2, 3}, {4, 5, 6}};
    int checked = 0;
    for (int step = 0; step <= 4; ++step) {
        StepBatch b;
        b.mode = step == 0 ? attn::ForwardMode::kExtend : attn::ForwardMode::kDecode;
        b.page_table_stride = 4;
        for (size_t i = 0; i < seqs.size(); ++i) {
            const int n = static_cast<int>(seqs[i].size());
            const int begin = step == 0 ? 0 : n - 1;
            for (int t = begin; t < n; ++t) {
                b.tokens.push_back(seqs[i][static_cast<size_t>(t)]);
                b.out_cache_loc.push_back(pages[i][static_cast<size_t>(t / 16)] * 16 + t % 16);
            }
            b.seq_lens.push_back(n);
            b.extend_lens.push_back(n - begin);
            for (int p = 0; p < 4; ++p) {
                b.page_table.push_back(
                    p < static_cast<int>(pages[i].size()) ? pages[i][static_cast<size_t>(p)] : 0);
            }
        }
        std::vector<int32_t> next(seqs.size(), -1);
        ASSERT_OK((*model)->forward(b, **backend, **pool, next.data()));
        ASSERT_OK(stream.synchronize());
        for (size_t i = 0; i < seqs.size(); ++i) {
            const std::vector<int32_t> fed =
                step == 0 ? seqs[i] : std::vector<int32_t>{seqs[i].back()};
            const Oracle::Output ref = oracle.run(static_cast<int>(i), fed);
            std::vector<size_t> order(ref.logits.size());
            for (size_t v = 0; v < order.size(); ++v) order[v] = v;
            std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                              [&](size_t x, size_t y) { return ref.logits[x] > ref.logits[y]; });
            ASSERT_GE(next[i], 0);
            const double top = ref.logits[order[0]];
            if (top - ref.logits[order[1]] > kTieTol) {
                EXPECT_EQ(static_cast<size_t>(next[i]), order[0])
                    << "step " << step << " request " << i;
                ++checked;
            } else {
                EXPECT_GE(ref.logits[static_cast<size_t>(next[i])], top - kTieTol);
            }
            seqs[i].push_back(next[i]);
        }
    }
    EXPECT_GE(checked, 10);  // near ties are rare: most tokens were compared exactly
}

// The oracle comparison of one model: the default forward, or the sliced (TP-invariant) one.
void check_against_the_host_oracle(bool sliced) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 32;
    ro.model.max_tokens = 256;
    ro.model.max_bs = 8;
    ro.model.sliced_reduction = sliced;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    Oracle oracle(cfg);
    const int H = cfg.hidden, V = cfg.vocab;

    // Three prompts crossing page boundaries (pages of 16), prefilled as one extend batch.
    std::vector<Seq> seqs(3);
    const int lens[] = {5, 17, 33};
    for (int i = 0; i < 3; ++i) seqs[i].tokens = random_tokens(lens[i], V, 100 + i);
    double max_logit_err = 0, max_hidden_err = 0, max_kv_err = 0;
    for (int step = 0; step <= 4; ++step) {
        const bool prefill = step == 0;
        const StepBatch b =
            prefill ? prefill_batch(*rig, pointers(seqs)) : decode_batch(*rig, pointers(seqs));
        const std::vector<int32_t> next = run(*rig, b);
        const std::vector<float> gl = logits(*rig, 3);
        auto gh = rig->model->copy_last_final_hidden(3);
        ASSERT_OK(gh);
        ASSERT_EQ(gl.size(), 3u * V);
        for (int i = 0; i < 3; ++i) {
            const std::vector<int32_t> fed =
                prefill ? seqs[i].tokens : std::vector<int32_t>{seqs[i].tokens.back()};
            const Oracle::Output ref = oracle.run(i, fed);
            check_step(prefill ? "prefill" : "decode", i, &gl[static_cast<size_t>(i) * V],
                       &(*gh)[static_cast<size_t>(i) * H], next[static_cast<size_t>(i)], ref,
                       max_logit_err, max_hidden_err);
        }
        // Every layer's K (after RoPE) and V of every request against the oracle's cache.
        for (int i = 0; i < 3; ++i) {
            const int len = static_cast<int>(seqs[i].tokens.size());
            for (int l = 0; l < cfg.num_layers; ++l) {
                for (int buf = 0; buf < 2; ++buf) {
                    const std::vector<float> got = kv_values(*rig, seqs[i], len, l, buf);
                    const std::vector<double>& want = oracle.kv(i, l, buf);
                    ASSERT_EQ(got.size(), want.size());
                    const Compare c = compare_values(got.data(), want.data(), got.size());
                    max_kv_err = std::max(max_kv_err, c.max_abs);
                    EXPECT_LE(c.worst_excess, 0.0)
                        << "step " << step << " request " << i << " layer " << l << " buf " << buf;
                }
            }
        }
        append(pointers(seqs), next);  // teacher forcing: both sides continue with the GPU's
    }
    std::cout << "[ oracle" << (sliced ? ", sliced" : "") << " ] max |logit err| " << max_logit_err
              << " (tol " << kLogitTol << "), max |final hidden err| " << max_hidden_err
              << ", max |KV err| " << max_kv_err << "\n";
}

TEST_F(CudaSyntheticModelTest, MatchesTheHostOracle) {
    check_against_the_host_oracle(/*sliced=*/false);
}

TEST_F(CudaSyntheticModelTest, SlicedForwardMatchesTheHostOracle) {
    check_against_the_host_oracle(/*sliced=*/true);
}

// Two TP 2 ranks of tiny (threads, each with its stream, backend, pool of 2 KV heads and the
// testbed's in-process TP group) against a sliced TP 1 rank on GPU 0: the same tokens and
// bit-identical logits over a prefill of 3 requests and 4 decode steps, each rank's KV equal to
// the TP 1 rank's KV of its heads, bit for bit. Then the TP 1 rank without slicing: the same tokens
// (rounding apart). `nccl`: the TP ranks on GPUs 0 and 1, exchanging over an NCCL TP group
// (transfer/nccl/nccl_tp_comm.h) instead of the host.
void check_tp_two_ranks(bool nccl) {
    const ModelConfig cfg = tiny2();
    const int V = cfg.vocab;
    RigOptions ro;
    ro.num_pages = 32;
    ro.model.max_tokens = 256;
    ro.model.max_bs = 8;
    RigOptions sliced = ro;
    sliced.model.sliced_reduction = true;
    testbed::LocalTpGroup group(2, std::chrono::milliseconds(60'000));
    // The NCCL group: collective, so both ranks make theirs at once.
    std::vector<std::unique_ptr<DeviceTpComm>> device_tp(2);
    if (nccl) {
        std::vector<Status> made(2);
        auto make = [&](int r) {
            auto comm = transfer::make_nccl_tp_comm(
                *group.member(r), {.device = r,
                                   .op_timeout = std::chrono::milliseconds(60'000),
                                   .name = "model-test-tp"});
            made[static_cast<size_t>(r)] = comm.status();
            if (comm.ok()) device_tp[static_cast<size_t>(r)] = std::move(*comm);
        };
        std::thread peer(make, 1);
        make(0);
        peer.join();
        ASSERT_OK(made[0]);
        ASSERT_OK(made[1]);
    }
    std::vector<std::unique_ptr<Rig>> rigs;  // [0] sliced TP 1, [1] plain TP 1, [2..3] TP ranks
    rigs.push_back(make_rig(cfg, sliced));
    rigs.push_back(make_rig(cfg, ro));
    for (int r = 0; r < 2; ++r) {
        RigOptions tp = ro;
        tp.tp = group.member(r);
        tp.device_tp = device_tp[static_cast<size_t>(r)].get();
        if (nccl) tp.model.device = r;
        rigs.push_back(make_rig(cfg, tp));
    }
    for (const auto& rig : rigs) ASSERT_NE(rig, nullptr);
    ASSERT_TRUE(rigs[0]->model->sliced_reduction());
    ASSERT_FALSE(rigs[1]->model->sliced_reduction());
    ASSERT_EQ(rigs[2]->model->tp_size(), 2);
    ASSERT_EQ(rigs[2]->model->local_kv_heads(), cfg.num_kv_heads / 2);
    EXPECT_EQ(rigs[0]->model->tp_exchange(), "none");
    EXPECT_EQ(rigs[2]->model->tp_exchange(), nccl ? "nccl" : "host");
    // A decode graph cannot hold the exchange.
    EXPECT_THAT(rigs[2]->model->capture_decode_graphs(*rigs[2]->backend, *rigs[2]->pool),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("decode runs eagerly")));

    // Each rig's own copy of the requests (its pool's pages).
    const int lens[] = {5, 17, 33};
    std::vector<std::vector<Seq>> seqs(rigs.size(), std::vector<Seq>(3));
    for (auto& per_rig : seqs) {
        for (int i = 0; i < 3; ++i)
            per_rig[static_cast<size_t>(i)].tokens = random_tokens(lens[i], V, 300 + i);
    }
    for (int step = 0; step <= 4; ++step) {
        std::vector<std::vector<int32_t>> next(rigs.size());
        std::vector<std::vector<float>> logit_rows(rigs.size());
        auto one_rank = [&](size_t k) {
            Rig& rig = *rigs[k];
            const StepBatch b = step == 0 ? prefill_batch(rig, pointers(seqs[k]))
                                          : decode_batch(rig, pointers(seqs[k]));
            next[k] = run(rig, b);
            logit_rows[k] = logits(rig, 3);
        };
        one_rank(0);
        one_rank(1);
        std::thread peer(one_rank, size_t{3});  // the TP ranks forward together
        one_rank(2);
        peer.join();
        SCOPED_TRACE("step " + std::to_string(step));
        EXPECT_EQ(next[2], next[0]) << "TP rank 0 vs sliced TP 1";
        EXPECT_EQ(next[3], next[0]) << "TP rank 1 vs sliced TP 1";
        ASSERT_EQ(logit_rows[2].size(), logit_rows[0].size());
        EXPECT_EQ(std::memcmp(logit_rows[2].data(), logit_rows[0].data(),
                              logit_rows[0].size() * sizeof(float)),
                  0)
            << "TP rank 0's logits are not the sliced TP 1 rank's bits";
        EXPECT_EQ(logit_rows[3], logit_rows[2]) << "the TP ranks' logits differ";
        // The plain TP 1 forward differs by rounding only: its logits within the tolerance, and its
        // tokens equal wherever the sliced logits' top-2 margin is wider than that (no near tie).
        double max_plain = 0;
        for (size_t v = 0; v < logit_rows[0].size(); ++v) {
            max_plain = std::max(
                max_plain, std::abs(static_cast<double>(logit_rows[1][v]) - logit_rows[0][v]));
        }
        EXPECT_LE(max_plain, kLogitTol) << "plain vs sliced TP 1 logits";
        for (size_t i = 0; i < next[0].size(); ++i) {
            const float* row = logit_rows[0].data() + i * static_cast<size_t>(V);
            std::vector<float> sorted(row, row + V);
            std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
            if (sorted[0] - sorted[1] > 2 * kLogitTol) {
                EXPECT_EQ(next[1][i], next[0][i]) << "plain vs sliced TP 1, request " << i;
            }
        }
        // Everyone continues with the sliced TP 1 rank's tokens.
        for (auto& per_rig : seqs) append(pointers(per_rig), next[0]);
    }
    // KV: TP rank r holds KV heads [2r, 2r + 2) of the TP 1 rank's, token by token.
    const size_t head_bytes = static_cast<size_t>(cfg.head_dim) * 2;
    const size_t per_rank = head_bytes * static_cast<size_t>(cfg.num_kv_heads / 2);
    for (int i = 0; i < 3; ++i) {
        const int len = static_cast<int>(seqs[0][static_cast<size_t>(i)].tokens.size()) - 1;
        for (int l = 0; l < cfg.num_layers; ++l) {
            for (int buf = 0; buf < 2; ++buf) {
                auto whole = read_request_kv(*rigs[0]->pool, l, buf,
                                             seqs[0][static_cast<size_t>(i)].pages, len);
                ASSERT_OK(whole);
                for (int r = 0; r < 2; ++r) {
                    const size_t k = 2 + static_cast<size_t>(r);
                    auto part = read_request_kv(*rigs[k]->pool, l, buf,
                                                seqs[k][static_cast<size_t>(i)].pages, len);
                    ASSERT_OK(part);
                    ASSERT_EQ(part->size() * 2, whole->size());
                    for (int t = 0; t < len; ++t) {
                        const std::byte* want = whole->data() +
                                                static_cast<size_t>(t) * 2 * per_rank +
                                                static_cast<size_t>(r) * per_rank;
                        const std::byte* got = part->data() + static_cast<size_t>(t) * per_rank;
                        ASSERT_EQ(std::memcmp(got, want, per_rank), 0)
                            << "request " << i << " layer " << l << " buf " << buf << " token " << t
                            << " TP rank " << r;
                    }
                }
            }
        }
    }
    for (int r = 0; r < 2 && nccl; ++r)
        EXPECT_OK(device_tp[static_cast<size_t>(r)]->health()->status());
    rigs.clear();  // the models go before their device TP groups
}

TEST_F(CudaSyntheticModelTest, TpTwoRanksComputeTheSlicedTpOneBits) {
    check_tp_two_ranks(false);
}

TEST_F(CudaSyntheticModelTest, TpTwoRanksOverNcclComputeTheSlicedTpOneBits) {
    if (!transfer::nccl_tp_comm_built()) GTEST_SKIP() << "pdsim was built without NCCL";
    auto rt = runtime::device_runtime(DeviceKind::kCuda);
    if (!rt.ok() || (*rt)->device_count() < 2) {
        GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks of one communicator on one GPU)";
    }
    check_tp_two_ranks(true);
}

TEST_F(CudaSyntheticModelTest, RequestsAreBatchInvariant) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 400;
    ro.model.max_tokens = 4096;
    ro.model.max_bs = 64;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    constexpr int kSteps = 16;
    const std::vector<int32_t> prompt = random_tokens(21, cfg.vocab, 7);
    std::vector<std::vector<int32_t>> tokens_by_run;
    std::vector<std::vector<uint64_t>> digest_by_run;
    for (int others : {0, 6, 63}) {
        std::mt19937_64 rng(static_cast<uint64_t>(others) + 1);
        std::vector<Seq> seqs(static_cast<size_t>(others) + 1);
        const size_t target = static_cast<size_t>(others) / 2;
        for (size_t i = 0; i < seqs.size(); ++i) {
            seqs[i].tokens = i == target
                                 ? prompt
                                 : random_tokens(std::uniform_int_distribution<int>(1, 40)(rng),
                                                 cfg.vocab, rng());
        }
        append(pointers(seqs), run(*rig, prefill_batch(*rig, pointers(seqs))));
        for (int s = 0; s < kSteps; ++s) {
            append(pointers(seqs), run(*rig, decode_batch(*rig, pointers(seqs))));
        }
        const Seq& t = seqs[target];
        tokens_by_run.emplace_back(t.tokens.begin() + static_cast<int64_t>(prompt.size()),
                                   t.tokens.end());
        // The KV of every token that went through a forward (the last sampled one did not).
        digest_by_run.push_back(digest(*rig, t, static_cast<int>(t.tokens.size()) - 1));
        free_pages(*rig, seqs);
    }
    ASSERT_EQ(tokens_by_run[0].size(), static_cast<size_t>(kSteps + 1));
    EXPECT_EQ(tokens_by_run[1], tokens_by_run[0]) << "batched with 6 others";
    EXPECT_EQ(tokens_by_run[2], tokens_by_run[0]) << "batched with 63 others";
    EXPECT_EQ(digest_by_run[1], digest_by_run[0]) << "KV, batched with 6 others";
    EXPECT_EQ(digest_by_run[2], digest_by_run[0]) << "KV, batched with 63 others";
}

TEST_F(CudaSyntheticModelTest, ChunkedPrefillMatchesOnePrefill) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 32;
    ro.model.max_tokens = 256;
    ro.model.max_bs = 8;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    const std::vector<int32_t> prompt = random_tokens(40, cfg.vocab, 11);
    constexpr int kDecodes = 4;
    Seq whole{prompt, {}}, chunked{prompt, {}};
    append({&whole}, run(*rig, prefill_batch(*rig, {&whole})));
    run(*rig, make_batch(*rig, {&chunked}, {{0, 24}}, attn::ForwardMode::kExtend));
    append({&chunked},
           run(*rig, make_batch(*rig, {&chunked}, {{24, 40}}, attn::ForwardMode::kExtend)));
    for (int s = 0; s < kDecodes; ++s) {
        append({&whole}, run(*rig, decode_batch(*rig, {&whole})));
        append({&chunked}, run(*rig, decode_batch(*rig, {&chunked})));
    }
    EXPECT_EQ(chunked.tokens, whole.tokens);
    const int len = static_cast<int>(whole.tokens.size()) - 1;
    const std::vector<uint64_t> dw = digest(*rig, whole, len), dc = digest(*rig, chunked, len);
    ASSERT_EQ(dw.size(), static_cast<size_t>(cfg.num_layers));
    // Layer 0's KV depends on each token alone (embedding, norm, GEMM rows, RoPE): bit-identical.
    EXPECT_EQ(dc[0], dw[0]);
    for (int l = 0; l < cfg.num_layers; ++l) {
        double max_diff = 0;
        for (int buf = 0; buf < 2; ++buf) {
            const std::vector<float> a = kv_values(*rig, whole, len, l, buf);
            const std::vector<float> b = kv_values(*rig, chunked, len, l, buf);
            ASSERT_EQ(a.size(), b.size());
            std::vector<double> ref(a.begin(), a.end());
            const Compare c = compare_values(b.data(), ref.data(), b.size());
            max_diff = std::max(max_diff, c.max_abs);
            EXPECT_LE(c.worst_excess, 0.0) << "layer " << l << " buf " << buf;
        }
        std::cout << "[ chunked ] layer " << l << ": KV digest "
                  << (dc[static_cast<size_t>(l)] == dw[static_cast<size_t>(l)] ? "equal"
                                                                               : "differs")
                  << ", max |diff| " << max_diff << "\n";
    }
}

TEST_F(CudaSyntheticModelTest, GraphReplayEqualsEagerDecode) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 128;
    ro.model.max_tokens = 1024;
    ro.model.max_bs = 16;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    CudaSyntheticModel& m = *rig->model;
    ASSERT_OK(m.capture_decode_graphs(*rig->backend, *rig->pool));
    EXPECT_EQ(m.decode_buckets(), (std::vector<int>{1, 2, 4, 8, 16}));
    uint64_t seed = 1000;
    for (int bs : {1, 3, 5, 8, 13}) {
        std::vector<Seq> seqs(static_cast<size_t>(bs));
        std::mt19937_64 rng(static_cast<uint64_t>(bs));
        for (Seq& s : seqs) {
            s.tokens =
                random_tokens(std::uniform_int_distribution<int>(1, 60)(rng), cfg.vocab, seed++);
        }
        append(pointers(seqs), run(*rig, prefill_batch(*rig, pointers(seqs))));
        for (int step = 0; step < 2; ++step) {
            const StepBatch b = decode_batch(*rig, pointers(seqs));
            m.set_decode_graphs_enabled(false);
            const std::vector<int32_t> eager = run(*rig, b);
            EXPECT_EQ(m.last_forward_bucket(), 0);
            const std::vector<float> eager_logits = logits(*rig, bs);
            std::vector<std::vector<uint64_t>> eager_kv;
            for (const Seq& s : seqs) {
                eager_kv.push_back(digest(*rig, s, static_cast<int>(s.tokens.size())));
            }
            // Poison the step's new KV slots: the replay must write them again.
            for (size_t t = 0; t < b.out_cache_loc.size(); ++t) {
                poison_slot(*rig, b.out_cache_loc[t]);
            }
            m.set_decode_graphs_enabled(true);
            const std::vector<int32_t> graph = run(*rig, b);
            EXPECT_EQ(m.last_forward_bucket(), *choose_bucket(m.decode_buckets(), bs));
            EXPECT_EQ(graph, eager) << "bs " << bs << " step " << step;
            EXPECT_EQ(logits(*rig, bs), eager_logits) << "bs " << bs << " step " << step;
            for (size_t i = 0; i < seqs.size(); ++i) {
                EXPECT_EQ(digest(*rig, seqs[i], static_cast<int>(seqs[i].tokens.size())),
                          eager_kv[i])
                    << "bs " << bs << " request " << i;
            }
            append(pointers(seqs), eager);
        }
        free_pages(*rig, seqs);
    }
}

TEST_F(CudaSyntheticModelTest, StaleGraphMetadataIsCaught) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 64;
    ro.model.max_tokens = 512;
    ro.model.max_bs = 4;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    CudaSyntheticModel& m = *rig->model;
    DecodeGraphOptions go;
    go.buckets = {4};
    ASSERT_OK(m.capture_decode_graphs(*rig->backend, *rig->pool, go));
    // Two different batches of 4: other pages, other lengths.
    std::vector<Seq> x(4), y(4);
    for (int i = 0; i < 4; ++i) {
        x[static_cast<size_t>(i)].tokens = random_tokens(10 + 7 * i, cfg.vocab, 300 + i);
        y[static_cast<size_t>(i)].tokens = random_tokens(45 - 9 * i, cfg.vocab, 400 + i);
    }
    append(pointers(x), run(*rig, prefill_batch(*rig, pointers(x))));
    append(pointers(y), run(*rig, prefill_batch(*rig, pointers(y))));
    const StepBatch bx = decode_batch(*rig, pointers(x));
    const StepBatch by = decode_batch(*rig, pointers(y));

    run(*rig, bx);  // a replay refreshed for x
    EXPECT_EQ(m.last_forward_bucket(), 4);
    m.set_skip_graph_metadata_refresh(true);
    run(*rig, by);  // y's inputs, x's attention metadata
    EXPECT_EQ(m.last_forward_bucket(), 4);
    const std::vector<float> stale = logits(*rig, 4);
    m.set_skip_graph_metadata_refresh(false);

    m.set_decode_graphs_enabled(false);
    const std::vector<int32_t> eager_tokens = run(*rig, by);
    const std::vector<float> eager = logits(*rig, 4);
    ASSERT_EQ(stale.size(), eager.size());
    double max_diff = 0;
    for (size_t i = 0; i < eager.size(); ++i) {
        max_diff = std::max(max_diff, static_cast<double>(std::abs(stale[i] - eager[i])));
    }
    std::cout << "[ stale ] max |logit diff| stale replay vs eager: " << max_diff << "\n";
    EXPECT_NE(stale, eager) << "a replay without the metadata refresh must not match eager";

    // With the refresh the same replay matches eager again.
    m.set_decode_graphs_enabled(true);
    EXPECT_EQ(run(*rig, by), eager_tokens);
    EXPECT_EQ(logits(*rig, 4), eager);
}

TEST_F(CudaSyntheticModelTest, PrewritePathEqualsTheNormalPath) {
    const ModelConfig cfg = tiny2();
    RigOptions ro;
    ro.num_pages = 64;
    ro.model.max_tokens = 256;
    ro.model.max_bs = 4;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    auto counter = pd::StepCounter::create(*rig->stream);
    ASSERT_OK(counter);
    rig->backend->register_step_counter(counter->get());

    auto generate = [&](bool save) {
        std::vector<Seq> seqs(2);
        seqs[0].tokens = random_tokens(19, cfg.vocab, 500);
        seqs[1].tokens = random_tokens(34, cfg.vocab, 501);
        std::vector<std::vector<float>> all_logits;
        const uint64_t before = (*counter)->records_published();
        append(pointers(seqs), run(*rig, prefill_batch(*rig, pointers(seqs)), save));
        // One record per layer per extend forward, before or after the attention.
        EXPECT_EQ((*counter)->records_published() - before, static_cast<uint64_t>(cfg.num_layers))
            << "save_kv_cache " << save;
        all_logits.push_back(logits(*rig, 2));
        for (int s = 0; s < 3; ++s) {
            append(pointers(seqs), run(*rig, decode_batch(*rig, pointers(seqs)), save));
            all_logits.push_back(logits(*rig, 2));
        }
        EXPECT_EQ((*counter)->records_published() - before, static_cast<uint64_t>(cfg.num_layers))
            << "decode forwards record nothing";
        std::vector<std::vector<uint64_t>> kv;
        for (const Seq& sq : seqs)
            kv.push_back(digest(*rig, sq, static_cast<int>(sq.tokens.size()) - 1));
        std::vector<std::vector<int32_t>> toks;
        for (const Seq& sq : seqs) toks.push_back(sq.tokens);
        free_pages(*rig, seqs);
        return std::make_tuple(toks, all_logits, kv);
    };
    const auto [tokens_saved, logits_saved, kv_saved] = generate(true);
    const auto [tokens_pre, logits_pre, kv_pre] = generate(false);
    EXPECT_EQ(tokens_pre, tokens_saved);
    EXPECT_EQ(logits_pre, logits_saved);
    EXPECT_EQ(kv_pre, kv_saved);
    ASSERT_OK(rig->stream->synchronize());
    rig->backend->register_step_counter(nullptr);
}

TEST_F(CudaSyntheticModelTest, ArgumentsAreCheckedBeforeAnythingIsEnqueued) {
    RigOptions ro;
    ro.num_pages = 16;
    ro.model.max_tokens = 64;
    ro.model.max_bs = 4;
    auto rig = make_rig(tiny2(), ro);
    ASSERT_NE(rig, nullptr);
    Seq s{random_tokens(8, 512, 1), {}};
    StepBatch b = prefill_batch(*rig, {&s});
    std::vector<int32_t> next(1, -1);
    b.tokens[3] = 512;
    Status st = rig->model->forward(b, *rig->backend, *rig->pool, next.data());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("batch.tokens[3]"));
    b = prefill_batch(*rig, {&s});
    st = rig->model->forward(b, *rig->backend, *rig->pool, nullptr);
    EXPECT_THAT(st.message(), HasSubstr("next_tokens"));
    // A CPU pool is refused (the model is on cuda:0).
    kv::MHAPoolConfig pc;
    pc.num_layers = 2;
    pc.num_pages = 16;
    pc.num_kv_heads = 4;
    pc.head_dim = 64;
    pc.dtype = kv::KVDtype::kBF16;
    auto cpu_pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(cpu_pool);
    st = rig->model->forward(b, *rig->backend, **cpu_pool, next.data());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("pool: memory on cpu"));
    EXPECT_OK(rig->stream->synchronize());
    EXPECT_EQ(next[0], -1);  // nothing ran
    EXPECT_FALSE(rig->model->last_forward_timing().ok());
}

TEST_F(CudaSyntheticModelTest, Llama8bShapesSmoke) {
    ModelConfig cfg = *resolve_model("llama3-8b");
    cfg.num_layers = 2;
    RigOptions ro;
    ro.num_pages = 64;
    ro.model.max_tokens = 256;
    ro.model.max_bs = 4;
    ro.model.max_positions = 1024;
    auto rig = make_rig(cfg, ro);
    ASSERT_NE(rig, nullptr);
    CudaSyntheticModel& m = *rig->model;
    EXPECT_EQ(m.weight_bytes(), static_cast<size_t>(estimate_weight_memory(cfg).total));
    DecodeGraphOptions go;
    go.buckets = {2};
    ASSERT_OK(m.capture_decode_graphs(*rig->backend, *rig->pool, go));

    std::vector<Seq> pair(2);
    pair[0].tokens = random_tokens(37, cfg.vocab, 800);
    pair[1].tokens = random_tokens(64, cfg.vocab, 801);
    Seq alone{pair[0].tokens, {}};
    append(pointers(pair), run(*rig, prefill_batch(*rig, pointers(pair))));
    append({&alone}, run(*rig, prefill_batch(*rig, {&alone})));
    for (int s = 0; s < 3; ++s) {
        const StepBatch b = decode_batch(*rig, pointers(pair));
        m.set_decode_graphs_enabled(false);
        m.set_layer_timing(true);
        const std::vector<int32_t> eager = run(*rig, b);
        const std::vector<float> eager_logits = logits(*rig, 2);
        auto t = m.last_forward_timing();
        ASSERT_OK(t);
        EXPECT_FALSE(t->graph);
        ASSERT_EQ(t->layer_begin_ms.size(), 2u);
        EXPECT_LE(t->layer_begin_ms[0], t->layer_end_ms[0]);
        EXPECT_LE(t->layer_end_ms[0], t->layer_begin_ms[1]);
        EXPECT_LE(t->layer_end_ms[1], t->total_ms);
        m.set_layer_timing(false);
        m.set_decode_graphs_enabled(true);
        EXPECT_EQ(run(*rig, b), eager);
        EXPECT_EQ(m.last_forward_bucket(), 2);
        EXPECT_EQ(logits(*rig, 2), eager_logits);
        for (int32_t tok : eager) {
            EXPECT_GE(tok, 0);
            EXPECT_LT(tok, cfg.vocab);
        }
        append(pointers(pair), eager);
        // bs 1 replays bucket 2, padded with a null-page request.
        append({&alone}, run(*rig, decode_batch(*rig, {&alone})));
    }
    EXPECT_EQ(alone.tokens, pair[0].tokens) << "request 0 alone vs batched";
    EXPECT_EQ(digest(*rig, alone, static_cast<int>(alone.tokens.size()) - 1),
              digest(*rig, pair[0], static_cast<int>(pair[0].tokens.size()) - 1));
}

}  // namespace
}  // namespace pdsim::model::cuda
