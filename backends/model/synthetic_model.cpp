#include "backends/model/synthetic_model.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/splitmix.h"
#include "common/thread_pool.h"

namespace pdsim::model {

namespace {

enum TensorKind : uint64_t {
    kWq = 1,
    kWk,
    kWv,
    kWo,
    kGate,
    kUp,
    kDown,
    kNorm1,
    kNorm2,
    kEmbed,
    kFinalNorm,
    kLmHead,
    kRecQkv,  // recurrent layers
    kRecDecay,
    kRecConv,
    kRecOut
};

uint64_t tensor_id(int layer, TensorKind kind) {
    return (static_cast<uint64_t>(layer + 1) << 8) | kind;
}

// Y[T][N] = X[T][K] @ W[K][N] (row-major; ldx, ldy are row strides of X and Y).
//
// Batch-invariant by construction: every output element is one FMA chain over k = 0..K-1 in
// order, whatever row block or column block it falls in, so a token's result does not depend on
// which tokens share its batch. (OpenBLAS sgemm is not: its micro-kernels round a row differently
// depending on its position inside the tile, measured on this machine.) Rows are processed four at
// a time so each W load feeds four FMAs; work is split over column blocks on the ThreadPool.
void gemm_rows(const float* x, int ldx, int T, int K, const float* w, int N, float* y, int ldy) {
    constexpr int kCols = 32;  // 4 ymm accumulators per row
    const int col_blocks = (N + kCols - 1) / kCols;
    ThreadPool::global().parallel_for(static_cast<size_t>(col_blocks), [&](size_t cb, size_t ce,
                                                                           int) {
        for (size_t blk = cb; blk < ce; ++blk) {
            const int n0 = static_cast<int>(blk) * kCols;
            const int nw = std::min(kCols, N - n0);
            if (nw == kCols) {
                int t = 0;
                for (; t + 4 <= T; t += 4) {
                    __m256 acc[4][4];
                    for (auto& r : acc)
                        for (auto& a : r) a = _mm256_setzero_ps();
                    for (int k = 0; k < K; ++k) {
                        const float* wr = w + static_cast<size_t>(k) * N + n0;
                        const __m256 w0 = _mm256_loadu_ps(wr), w1 = _mm256_loadu_ps(wr + 8);
                        const __m256 w2 = _mm256_loadu_ps(wr + 16), w3 = _mm256_loadu_ps(wr + 24);
                        for (int r = 0; r < 4; ++r) {
                            const __m256 xv =
                                _mm256_broadcast_ss(x + static_cast<size_t>(t + r) * ldx + k);
                            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                            acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
                            acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
                        }
                    }
                    for (int r = 0; r < 4; ++r) {
                        float* yr = y + static_cast<size_t>(t + r) * ldy + n0;
                        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(yr + 8 * c, acc[r][c]);
                    }
                }
                for (; t < T; ++t) {  // same per-element FMA chain as above
                    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                     _mm256_setzero_ps()};
                    for (int k = 0; k < K; ++k) {
                        const float* wr = w + static_cast<size_t>(k) * N + n0;
                        const __m256 xv = _mm256_broadcast_ss(x + static_cast<size_t>(t) * ldx + k);
                        for (int c = 0; c < 4; ++c)
                            acc[c] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wr + 8 * c), acc[c]);
                    }
                    float* yr = y + static_cast<size_t>(t) * ldy + n0;
                    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(yr + 8 * c, acc[c]);
                }
            } else {
                for (int t = 0; t < T; ++t) {  // ragged last block: scalar fused multiply-adds
                    for (int n = n0; n < n0 + nw; ++n) {
                        float acc = 0.f;
                        for (int k = 0; k < K; ++k) {
                            acc = std::fma(x[static_cast<size_t>(t) * ldx + k],
                                           w[static_cast<size_t>(k) * N + n], acc);
                        }
                        y[static_cast<size_t>(t) * ldy + n] = acc;
                    }
                }
            }
        }
    });
}

void rmsnorm(const float* in, const float* w, float* out, int T, int H, float eps) {
    for (int t = 0; t < T; ++t) {
        const float* row = in + static_cast<size_t>(t) * H;
        double ss = 0;
        for (int i = 0; i < H; ++i) ss += static_cast<double>(row[i]) * row[i];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / H + eps));
        float* o = out + static_cast<size_t>(t) * H;
        for (int i = 0; i < H; ++i) o[i] = row[i] * inv * w[i];
    }
}

// Rotates pairs (i, i + D/2) of each head by position * inv_freq[i] (NeoX-style RoPE).
void rope(float* x, int T, int heads, int D, const int32_t* pos, const float* inv_freq) {
    const int half = D / 2;
    for (int t = 0; t < T; ++t) {
        for (int h = 0; h < heads; ++h) {
            float* v = x + (static_cast<size_t>(t) * heads + h) * D;
            for (int i = 0; i < half; ++i) {
                const double ang = static_cast<double>(pos[t]) * inv_freq[i];
                const float c = static_cast<float>(std::cos(ang)),
                            s = static_cast<float>(std::sin(ang));
                const float a = v[i], b = v[i + half];
                v[i] = a * c - b * s;
                v[i + half] = a * s + b * c;
            }
        }
    }
}

}  // namespace

float SyntheticModel::weight_value(uint64_t seed, uint64_t tensor, uint64_t index, float scale) {
    const uint64_t r = splitmix64(seed ^ splitmix64(tensor * 0x100000001b3ULL + index));
    // 24 random bits -> [-1, 1)
    const float u = static_cast<float>(r >> 40) * (1.0f / 8388608.0f) - 1.0f;
    return u * scale;
}

SyntheticModel::SyntheticModel(const ModelConfig& config, TpComm* tp, int max_tokens)
    : cfg_(config), tp_(tp), max_tokens_(max_tokens) {
    tp_size_ = tp != nullptr ? tp->size() : 1;
    tp_rank_ = tp != nullptr ? tp->rank() : 0;
    hq_ = cfg_.num_q_heads / tp_size_;
    hkv_ = cfg_.num_kv_heads / tp_size_;
    inter_ = cfg_.intermediate / tp_size_;
    slices_ = cfg_.num_kv_heads;
    num_recurrent_ = cfg_.count_layers(LayerKind::kRecurrent);
    hs_ = num_recurrent_ > 0 ? cfg_.state_heads / tp_size_ : 0;
}

size_t SyntheticModel::weight_bytes() const {
    const size_t H = static_cast<size_t>(cfg_.hidden), D = static_cast<size_t>(cfg_.head_dim);
    const size_t mlp = 3 * H * static_cast<size_t>(inter_) + 2 * H;
    const size_t attention =
        H * (static_cast<size_t>(hq_ + 2 * hkv_) * D) + static_cast<size_t>(hq_) * D * H;
    const size_t hs = static_cast<size_t>(hs_), ds = static_cast<size_t>(cfg_.state_head_dim);
    const size_t recurrent = H * hs * 3 * ds + H * hs +
                             hs * 3 * ds * static_cast<size_t>(cfg_.conv_kernel) + hs * ds * H;
    const size_t rec_layers = static_cast<size_t>(num_recurrent_);
    const size_t att_layers = static_cast<size_t>(cfg_.num_layers) - rec_layers;
    return sizeof(float) * (att_layers * attention + rec_layers * recurrent +
                            static_cast<size_t>(cfg_.num_layers) * mlp +
                            2 * H * static_cast<size_t>(cfg_.vocab) + H);
}

kv::StatePoolConfig SyntheticModel::state_pool_config(int num_slots) const {
    return kv::StatePoolConfig{.num_layers = num_recurrent_,
                               .num_slots = num_slots,
                               .num_heads = hs_,
                               .head_dim = cfg_.state_head_dim,
                               .conv_kernel = cfg_.conv_kernel};
}

Status SyntheticModel::attach_state_pool(kv::StatePool* pool) {
    if (num_recurrent_ == 0) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "model {}: no recurrent layers to attach a state pool to", cfg_.name);
    }
    if (pool == nullptr) {
        state_pool_ = nullptr;  // detached: forwards fail until a pool is attached again
        return {};
    }
    const kv::StatePoolConfig want = state_pool_config(2);
    if (pool->num_layers() != want.num_layers || pool->num_heads() != want.num_heads ||
        pool->head_dim() != want.head_dim || pool->conv_kernel() != want.conv_kernel) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: the state pool must have {} layers of {} heads x {} (conv "
                           "{}) on this rank",
                           cfg_.name, want.num_layers, want.num_heads, want.head_dim,
                           want.conv_kernel);
    }
    state_pool_ = pool;
    return {};
}

Status SyntheticModel::attach_window_pool(kv::MHATokenToKVPool* pool) {
    if (cfg_.count_layers(LayerKind::kSlidingWindow) == 0) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "model {}: no sliding-window layers to attach a window pool to",
                           cfg_.name);
    }
    if (pool == nullptr) {
        window_pool_ = nullptr;
        return {};
    }
    if (pool->num_layers() != cfg_.num_layers || pool->num_kv_heads() != hkv_ ||
        pool->head_dim() != cfg_.head_dim || pool->v_head_dim() != cfg_.head_dim) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: the window pool must number {} layers with {} KV heads x {} "
                           "on this rank (it has {} layers, {} heads x {})",
                           cfg_.name, cfg_.num_layers, hkv_, cfg_.head_dim, pool->num_layers(),
                           pool->num_kv_heads(), pool->head_dim());
    }
    for (int l = 0; l < cfg_.num_layers; ++l) {
        if (cfg_.layer_kind(l) == LayerKind::kSlidingWindow && !pool->holds_layer(l)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "model {}: the window pool does not hold sliding layer {}",
                               cfg_.name, l);
        }
    }
    window_pool_ = pool;
    return {};
}

attn::LayerSpec SyntheticModel::layer_spec(int layer) const {
    const bool sliding = cfg_.layer_kind(layer) == LayerKind::kSlidingWindow;
    return attn::LayerSpec{
        layer, hq_, hkv_, cfg_.head_dim, 0, 0.f, sliding ? cfg_.sliding_window : 0};
}

StatusOr<std::unique_ptr<SyntheticModel>> SyntheticModel::create(const ModelConfig& config,
                                                                 TpComm* tp, int max_tokens) {
    PDSIM_RETURN_IF_ERROR(validate_model(config));
    if (config.attention != AttentionKind::kMha) {
        return Status(
            StatusCode::kUnimplemented,
            fmt::format(
                "model {}: the synthetic model runs MHA/GQA attention only (MLA is not built yet)",
                config.name));
    }
    if (config.count_layers(LayerKind::kRecurrent) > 0) {
        if (config.state_heads % config.num_kv_heads != 0) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("model {}: state_heads {} must be a multiple of "
                                      "num_kv_heads {} (the canonical reduction slices)",
                                      config.name, config.state_heads, config.num_kv_heads));
        }
        if (config.conv_kernel < 2) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("model {}: conv_kernel {} must be >= 2", config.name,
                                      config.conv_kernel));
        }
    }
    const int tp_size = tp != nullptr ? tp->size() : 1;
    PDSIM_RETURN_IF_ERROR(check_tp(config, tp_size).with_context("model " + config.name + ": tp"));
    if (config.intermediate % config.num_kv_heads != 0) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format(
                "model {}: intermediate {} must be a multiple of num_kv_heads {} (the canonical "
                "reduction slices)",
                config.name, config.intermediate, config.num_kv_heads));
    }
    if (config.head_dim % 2 != 0) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("model {}: head_dim {} must be even (RoPE)", config.name, config.head_dim));
    }
    if (max_tokens < 1) return Status(StatusCode::kInvalidArgument, "max_tokens must be >= 1");
    std::unique_ptr<SyntheticModel> m(new SyntheticModel(config, tp, max_tokens));
    constexpr size_t kMaxWeightBytes = size_t{16} << 30;
    if (m->weight_bytes() > kMaxWeightBytes) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format(
                "model {}: {:.1f} GiB of fp32 weights per rank is more than this CPU testbed "
                "allows (16 GiB); shrink it (--layers, or a model file with smaller hidden/vocab)",
                config.name, static_cast<double>(m->weight_bytes()) / (1 << 30)));
    }
    PDSIM_RETURN_IF_ERROR(m->init_weights());
    return m;
}

Status SyntheticModel::init_weights() {
    const int H = cfg_.hidden, D = cfg_.head_dim, HQ = cfg_.num_q_heads, HKV = cfg_.num_kv_heads,
              I = cfg_.intermediate;
    const uint64_t seed = cfg_.seed;
    const float s_h = 1.0f / std::sqrt(static_cast<float>(H));
    const float s_o = 1.0f / std::sqrt(static_cast<float>(HQ * D));
    const float s_i = 1.0f / std::sqrt(static_cast<float>(I));
    // Column slice [c0, c0 + n) of a full [rows][cols] tensor.
    auto cols = [&](uint64_t tid, int rows, int full_cols, int c0, int n, float scale) {
        std::vector<float> w(static_cast<size_t>(rows) * n);
        for (int r = 0; r < rows; ++r) {
            for (int c = 0; c < n; ++c) {
                w[static_cast<size_t>(r) * n + c] =
                    weight_value(seed, tid, static_cast<uint64_t>(r) * full_cols + c0 + c, scale);
            }
        }
        return w;
    };
    // Row slice [r0, r0 + n) of a full [rows][full_cols] tensor.
    auto rows_of = [&](uint64_t tid, int r0, int n, int full_cols, float scale) {
        std::vector<float> w(static_cast<size_t>(n) * full_cols);
        for (int r = 0; r < n; ++r) {
            for (int c = 0; c < full_cols; ++c) {
                w[static_cast<size_t>(r) * full_cols + c] =
                    weight_value(seed, tid, static_cast<uint64_t>(r0 + r) * full_cols + c, scale);
            }
        }
        return w;
    };
    auto norm = [&](uint64_t tid) {
        std::vector<float> w(static_cast<size_t>(H));
        for (int i = 0; i < H; ++i)
            w[static_cast<size_t>(i)] =
                1.0f + weight_value(seed, tid, static_cast<uint64_t>(i), 0.1f);
        return w;
    };
    // Slices are stored one after another, each a contiguous [K][n] matrix, so every sgemm call has
    // the same shape and leading dimensions whatever the TP size.
    const int qs = HQ / slices_, is = I / slices_;
    const int s0 = tp_rank_ * (slices_ / tp_size_), ns = slices_ / tp_size_;
    const int SH = cfg_.state_heads, DS = cfg_.state_head_dim, K = cfg_.conv_kernel;
    const int shs = num_recurrent_ > 0 ? SH / slices_ : 0;  // state heads per slice
    const float s_so = num_recurrent_ > 0 ? 1.0f / std::sqrt(static_cast<float>(SH * DS)) : 0.f;
    layers_.resize(static_cast<size_t>(cfg_.num_layers));
    int state_layer = 0;
    for (int l = 0; l < cfg_.num_layers; ++l) {
        Layer& L = layers_[static_cast<size_t>(l)];
        L.norm1 = norm(tensor_id(l, kNorm1));
        L.norm2 = norm(tensor_id(l, kNorm2));
        const bool recurrent = cfg_.layer_kind(l) == LayerKind::kRecurrent;
        if (recurrent) L.state_layer = state_layer++;
        for (int s = s0; s < s0 + ns; ++s) {
            auto append = [](std::vector<float>& dst, const std::vector<float>& src) {
                dst.insert(dst.end(), src.begin(), src.end());
            };
            append(L.w_gate, cols(tensor_id(l, kGate), H, I, s * is, is, s_h));
            append(L.w_up, cols(tensor_id(l, kUp), H, I, s * is, is, s_h));
            append(L.w_down, rows_of(tensor_id(l, kDown), s * is, is, H, s_i));
            if (recurrent) {
                append(L.w_qkv, cols(tensor_id(l, kRecQkv), H, SH * 3 * DS, s * shs * 3 * DS,
                                     shs * 3 * DS, s_h));
                append(L.w_decay, cols(tensor_id(l, kRecDecay), H, SH, s * shs, shs, s_h));
                append(L.conv,
                       rows_of(tensor_id(l, kRecConv), s * shs * 3 * DS, shs * 3 * DS, K, 0.5f));
                append(L.w_out, rows_of(tensor_id(l, kRecOut), s * shs * DS, shs * DS, H, s_so));
                continue;
            }
            append(L.wq, cols(tensor_id(l, kWq), H, HQ * D, s * qs * D, qs * D, s_h));
            append(L.wk, cols(tensor_id(l, kWk), H, HKV * D, s * D, D, s_h));
            append(L.wv, cols(tensor_id(l, kWv), H, HKV * D, s * D, D, s_h));
            append(L.wo, rows_of(tensor_id(l, kWo), s * qs * D, qs * D, H, s_o));
        }
    }
    embed_ = rows_of(tensor_id(-1, kEmbed), 0, cfg_.vocab, H, 1.0f);
    final_norm_ = norm(tensor_id(-1, kFinalNorm));
    lm_head_ = cols(tensor_id(-1, kLmHead), H, cfg_.vocab, 0, cfg_.vocab, s_h);
    rope_inv_freq_.resize(static_cast<size_t>(D / 2));
    for (int i = 0; i < D / 2; ++i) {
        rope_inv_freq_[static_cast<size_t>(i)] =
            static_cast<float>(std::pow(cfg_.rope_theta, -2.0 * i / static_cast<double>(D)));
    }
    const size_t T = static_cast<size_t>(max_tokens_);
    h_.assign(T * H, 0.f);
    x_.assign(T * H, 0.f);
    q_.assign(T * hq_ * D, 0.f);
    k_.assign(T * hkv_ * D, 0.f);
    v_.assign(T * hkv_ * D, 0.f);
    attn_.assign(T * hq_ * D, 0.f);
    gate_.assign(T * inter_, 0.f);
    up_.assign(T * inter_, 0.f);
    partial_.assign(static_cast<size_t>(ns) * T * H, 0.f);
    if (num_recurrent_ > 0) {
        qkv_.assign(T * static_cast<size_t>(hs_) * 3 * DS, 0.f);
        decay_.assign(T * static_cast<size_t>(hs_), 0.f);
        mixed_.assign(T * static_cast<size_t>(hs_) * DS, 0.f);
    }
    gathered_.assign(static_cast<size_t>(slices_) * T * H, 0.f);
    return {};
}

// Sums the canonical slice partials (gathered across the TP group) into h_, in slice order.
Status SyntheticModel::reduce_into_h(int T) {
    const int H = cfg_.hidden, ns = slices_ / tp_size_;
    const size_t per = static_cast<size_t>(T) * H;
    const float* all = partial_.data();
    if (tp_size_ > 1) {
        // Partials are laid out [slice][T][H] with stride max_tokens_ * H; compact them first.
        for (int s = 1; s < ns; ++s) {
            std::memmove(&partial_[s * per], &partial_[static_cast<size_t>(s) * max_tokens_ * H],
                         per * sizeof(float));
        }
        PDSIM_RETURN_IF_ERROR(tp_->allgather(partial_.data(), ns * per, gathered_.data()));
        all = gathered_.data();
    }
    const size_t stride = tp_size_ > 1 ? per : static_cast<size_t>(max_tokens_) * H;
    for (size_t i = 0; i < per; ++i) {
        float acc = all[i];
        for (int s = 1; s < slices_; ++s) acc += all[static_cast<size_t>(s) * stride + i];
        h_[i] += acc;
    }
    return Status();
}

Status SyntheticModel::enqueue_recurrent_layer(int l, int T, int bs,
                                               const std::shared_ptr<const StepBatch>& staged,
                                               attn::AttentionBackend& backend,
                                               const std::function<Status(int)>& mlp) {
    runtime::Stream& stream = backend.stream();
    const int H = cfg_.hidden, DS = cfg_.state_head_dim, ns = slices_ / tp_size_;
    const int shs = cfg_.state_heads / slices_;
    PDSIM_RETURN_IF_ERROR(stream.enqueue([this, l, T, H, DS, ns, shs] {
        if (hook_) hook_(l, true);
        const Layer& L = layers_[static_cast<size_t>(l)];
        rmsnorm(h_.data(), L.norm1.data(), x_.data(), T, H, cfg_.rms_eps);
        for (int s = 0; s < ns; ++s) {
            gemm_rows(x_.data(), H, T, H, &L.w_qkv[static_cast<size_t>(s) * H * shs * 3 * DS],
                      shs * 3 * DS, &qkv_[static_cast<size_t>(s) * shs * 3 * DS], hs_ * 3 * DS);
            gemm_rows(x_.data(), H, T, H, &L.w_decay[static_cast<size_t>(s) * H * shs], shs,
                      &decay_[static_cast<size_t>(s) * shs], hs_);
        }
        return Status();
    }));
    const Layer& layer = layers_[static_cast<size_t>(l)];
    attn::RecurrentArgs args;
    args.qkv = runtime::host_view(static_cast<const float*>(qkv_.data()), {T, hs_, 3 * DS});
    args.gate = runtime::host_view(static_cast<const float*>(decay_.data()), {T, hs_});
    args.conv_weight = runtime::host_view(static_cast<const float*>(layer.conv.data()),
                                          {hs_, 3 * DS, cfg_.conv_kernel});
    args.state_slots = runtime::host_view(staged->state_slots.data(), {bs});
    args.layer = attn::RecurrentSpec{.layer_id = l,
                                     .state_layer = layer.state_layer,
                                     .num_heads = hs_,
                                     .head_dim = DS,
                                     .conv_kernel = cfg_.conv_kernel};
    args.pool = state_pool_;
    args.mode = staged->mode;
    args.bs = bs;
    args.out = runtime::host_view(mixed_.data(), {T, hs_, DS});
    PDSIM_RETURN_IF_ERROR(backend.forward_recurrent(args));
    return stream.enqueue([this, l, T, H, DS, ns, shs, mlp] {
        const Layer& L = layers_[static_cast<size_t>(l)];
        const size_t pstride = static_cast<size_t>(max_tokens_) * H;
        for (int s = 0; s < ns; ++s) {
            gemm_rows(&mixed_[static_cast<size_t>(s) * shs * DS], hs_ * DS, T, shs * DS,
                      &L.w_out[static_cast<size_t>(s) * shs * DS * H], H, &partial_[s * pstride],
                      H);
        }
        PDSIM_RETURN_IF_ERROR(reduce_into_h(T));
        return mlp(l);
    });
}

Status SyntheticModel::forward(const StepBatch& batch, attn::AttentionBackend& backend,
                               kv::KVPool& pool, int32_t* next_tokens, bool save_kv_cache) {
    const int T = static_cast<int>(batch.tokens.size());
    const int bs = static_cast<int>(batch.seq_lens.size());
    if (T > max_tokens_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "forward of {} tokens, model workspace holds {}", T, max_tokens_);
    }
    if (batch.out_cache_loc.size() != static_cast<size_t>(T) ||
        batch.extend_lens.size() != static_cast<size_t>(bs)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch: {} tokens, {} slots, {} seq_lens, {} extend_lens", T,
                           batch.out_cache_loc.size(), bs, batch.extend_lens.size());
    }
    int sum = 0;
    for (int e : batch.extend_lens) sum += e;
    if (sum != T)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: extend_lens sum to {}, {} tokens",
                           sum, T);
    for (int32_t tok : batch.tokens) {
        if (tok < 0 || tok >= cfg_.vocab) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "token id {} outside the vocabulary [0, {})", tok, cfg_.vocab);
        }
    }
    if (num_recurrent_ > 0) {
        if (state_pool_ == nullptr) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "model {} has recurrent layers and no state pool attached",
                               cfg_.name);
        }
        if (batch.state_slots.size() != static_cast<size_t>(bs)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch: {} state slots for {} requests (model {} has recurrent "
                               "layers)",
                               batch.state_slots.size(), bs, cfg_.name);
        }
        if (!backend.capabilities().recurrent_layers) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "model {} has recurrent layers; backend {} runs attention only "
                               "(wrap it in attn::HybridBackend)",
                               cfg_.name, backend.name());
        }
    }
    if (window_pool_ != nullptr) {
        if (batch.window_out_cache_loc.size() != static_cast<size_t>(T) ||
            batch.window_page_table_stride < 1 ||
            batch.window_page_table.size() !=
                static_cast<size_t>(bs) * static_cast<size_t>(batch.window_page_table_stride)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch: {} window slots and {} window page table entries (stride "
                               "{}) for {} tokens of {} requests (model {} keeps its sliding "
                               "layers in a window pool)",
                               batch.window_out_cache_loc.size(), batch.window_page_table.size(),
                               batch.window_page_table_stride, T, bs, cfg_.name);
        }
    }
    // Every attention layer's KV has a home (checked before anything is enqueued).
    for (int l = 0; l < cfg_.num_layers; ++l) {
        if (cfg_.layer_kind(l) == LayerKind::kRecurrent) continue;
        const bool windowed = cfg_.layer_kind(l) == LayerKind::kSlidingWindow && window_pool_;
        if (!(windowed ? window_pool_->holds_layer(l) : pool.holds_layer(l))) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "model {}: layer {} ({}) is not held by the pool given to forward "
                               "(a sliding layer in its own pool needs attach_window_pool)",
                               cfg_.name, l, topo::layer_kind_name(cfg_.layer_kind(l)));
        }
    }
    runtime::Stream& stream = backend.stream();
    attn::ForwardBatch fb;
    fb.mode = batch.mode;
    fb.bs = bs;
    fb.seq_lens = batch.seq_lens;
    fb.extend_lens = batch.extend_lens;
    fb.page_table = batch.page_table;
    fb.page_table_stride = batch.page_table_stride;
    if (window_pool_ != nullptr) {
        fb.window_page_table = batch.window_page_table;
        fb.window_page_table_stride = batch.window_page_table_stride;
    }
    PDSIM_RETURN_IF_ERROR(backend.init_forward_metadata(fb));

    // Stage the host inputs by value: the caller may reuse its vectors as soon as we return.
    auto staged = std::make_shared<StepBatch>(batch);
    auto positions = std::make_shared<std::vector<int32_t>>();
    for (int i = 0, t = 0; i < bs; ++i) {
        for (int j = 0; j < batch.extend_lens[static_cast<size_t>(i)]; ++j, ++t) {
            positions->push_back(batch.seq_lens[static_cast<size_t>(i)] -
                                 batch.extend_lens[static_cast<size_t>(i)] + j);
        }
    }
    const int H = cfg_.hidden, D = cfg_.head_dim;
    const int qs = cfg_.num_q_heads / slices_, is = cfg_.intermediate / slices_,
              ns = slices_ / tp_size_;

    PDSIM_RETURN_IF_ERROR(stream.enqueue([this, staged, T, H] {
        for (int t = 0; t < T; ++t) {
            std::memcpy(&h_[static_cast<size_t>(t) * H],
                        &embed_[static_cast<size_t>(staged->tokens[static_cast<size_t>(t)]) * H],
                        sizeof(float) * H);
        }
        return Status();
    }));

    // The second half of every layer: RMSNorm -> MLP -> residual, then the layer hook.
    auto mlp = [this, T, H, is, ns](int l) -> Status {
        const Layer& L = layers_[static_cast<size_t>(l)];
        const size_t pstride = static_cast<size_t>(max_tokens_) * H;
        rmsnorm(h_.data(), L.norm2.data(), x_.data(), T, H, cfg_.rms_eps);
        for (int s = 0; s < ns; ++s) {
            gemm_rows(x_.data(), H, T, H, &L.w_gate[static_cast<size_t>(s) * H * is], is,
                      &gate_[static_cast<size_t>(s) * is], inter_);
            gemm_rows(x_.data(), H, T, H, &L.w_up[static_cast<size_t>(s) * H * is], is,
                      &up_[static_cast<size_t>(s) * is], inter_);
        }
        for (size_t i = 0; i < static_cast<size_t>(T) * inter_; ++i) {
            const float g = gate_[i];
            gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];
        }
        for (int s = 0; s < ns; ++s) {
            gemm_rows(&gate_[static_cast<size_t>(s) * is], inter_, T, is,
                      &L.w_down[static_cast<size_t>(s) * is * H], H, &partial_[s * pstride], H);
        }
        PDSIM_RETURN_IF_ERROR(reduce_into_h(T));
        if (hook_) hook_(l, false);
        return Status();
    };

    for (int l = 0; l < cfg_.num_layers; ++l) {
        if (cfg_.layer_kind(l) == LayerKind::kRecurrent) {
            PDSIM_RETURN_IF_ERROR(enqueue_recurrent_layer(l, T, bs, staged, backend, mlp));
            continue;
        }
        PDSIM_RETURN_IF_ERROR(stream.enqueue([this, l, T, H, D, qs, ns, positions] {
            if (hook_) hook_(l, true);
            const Layer& L = layers_[static_cast<size_t>(l)];
            rmsnorm(h_.data(), L.norm1.data(), x_.data(), T, H, cfg_.rms_eps);
            for (int s = 0; s < ns; ++s) {
                gemm_rows(x_.data(), H, T, H, &L.wq[static_cast<size_t>(s) * H * qs * D], qs * D,
                          &q_[static_cast<size_t>(s) * qs * D], hq_ * D);
                gemm_rows(x_.data(), H, T, H, &L.wk[static_cast<size_t>(s) * H * D], D,
                          &k_[static_cast<size_t>(s) * D], hkv_ * D);
                gemm_rows(x_.data(), H, T, H, &L.wv[static_cast<size_t>(s) * H * D], D,
                          &v_[static_cast<size_t>(s) * D], hkv_ * D);
            }
            rope(q_.data(), T, hq_, D, positions->data(), rope_inv_freq_.data());
            rope(k_.data(), T, hkv_, D, positions->data(), rope_inv_freq_.data());
            return Status();
        }));
        const attn::LayerSpec spec = layer_spec(l);
        // This forward's rows of the workspace, as the backend's views ([T][heads][D], fp32, host).
        const runtime::ConstTensorView q =
            runtime::host_view(static_cast<const float*>(q_.data()), {T, hq_, D});
        const runtime::ConstTensorView k =
            runtime::host_view(static_cast<const float*>(k_.data()), {T, hkv_, D});
        const runtime::ConstTensorView v =
            runtime::host_view(static_cast<const float*>(v_.data()), {T, hkv_, D});
        const runtime::TensorView out = runtime::host_view(attn_.data(), {T, hq_, D});
        // A sliding layer in its own cache group: its pool and slots.
        const bool windowed = spec.sliding_window > 0 && window_pool_ != nullptr;
        kv::KVPool& layer_pool = windowed ? *window_pool_ : pool;
        const runtime::ConstTensorView locs = runtime::host_view(
            static_cast<const int32_t*>(windowed ? staged->window_out_cache_loc.data()
                                                 : staged->out_cache_loc.data()),
            {T});
        if (!save_kv_cache) {
            // Fused-prewrite path: the KV lands before the attention call, which then records
            // first.
            auto* mha = dynamic_cast<kv::MHATokenToKVPool*>(&layer_pool);
            if (mha == nullptr)
                return PDSIM_ERROR(StatusCode::kInvalidArgument, "prewrite needs an MHA pool");
            PDSIM_RETURN_IF_ERROR(stream.enqueue(
                [mha, l, locs, k, v, staged] { return mha->set_kv_buffer(l, locs, k, v); }));
        }
        PDSIM_RETURN_IF_ERROR(
            backend.forward(q, k, v, spec, locs, layer_pool, batch.mode, bs, out, save_kv_cache));
        PDSIM_RETURN_IF_ERROR(stream.enqueue([this, l, T, H, D, qs, ns, mlp] {
            const Layer& L = layers_[static_cast<size_t>(l)];
            const size_t pstride = static_cast<size_t>(max_tokens_) * H;
            for (int s = 0; s < ns; ++s) {
                gemm_rows(&attn_[static_cast<size_t>(s) * qs * D], hq_ * D, T, qs * D,
                          &L.wo[static_cast<size_t>(s) * qs * D * H], H, &partial_[s * pstride], H);
            }
            PDSIM_RETURN_IF_ERROR(reduce_into_h(T));
            return mlp(l);
        }));
    }

    // Final norm + LM head on each request's last token, greedy argmax (lowest id on ties).
    return stream.enqueue([this, staged, bs, H, next_tokens] {
        const int V = cfg_.vocab;
        std::vector<float> last(static_cast<size_t>(bs) * H), normed(static_cast<size_t>(bs) * H);
        for (int i = 0, t = 0; i < bs; ++i) {
            t += staged->extend_lens[static_cast<size_t>(i)];
            std::memcpy(&last[static_cast<size_t>(i) * H], &h_[static_cast<size_t>(t - 1) * H],
                        sizeof(float) * H);
        }
        rmsnorm(last.data(), final_norm_.data(), normed.data(), bs, H, cfg_.rms_eps);
        std::vector<float> logits(static_cast<size_t>(bs) * V);
        gemm_rows(normed.data(), H, bs, H, lm_head_.data(), V, logits.data(), V);
        for (int i = 0; i < bs; ++i) {
            const float* row = &logits[static_cast<size_t>(i) * V];
            int best = 0;
            for (int v = 1; v < V; ++v) {
                if (row[v] > row[best]) best = v;
            }
            if (!std::isfinite(row[best])) {
                return PDSIM_ERROR(StatusCode::kDataLoss,
                                   "request {} of the batch: non-finite logits", i);
            }
            next_tokens[i] = best;
        }
        return Status();
    });
}

}  // namespace pdsim::model
