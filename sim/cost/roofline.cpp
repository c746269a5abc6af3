// The roofline cost model. Per layer, for T new tokens of a forward at TP size t (weights and KV
// bf16 on GPUs: 2 bytes; KV bytes per element from InstanceSpec::kv_dtype_bytes):
//   GEMMs      FLOPs 2 T P / t, bytes 2 P / t, P = the layer's weights:
//                MHA/GQA: H (HQ + 2 HKV) D [QKV] + HQ D H [O] + 3 H I [SwiGLU MLP]
//                MLA:     H (R + r) [KV down] + R HQ 2D [KV up] + H HQ (D + r) [Q] + HQ D H [O]
//                         + 3 H I   (R = kv_lora_rank, r = rope_dim; the weights of
//                         ModelConfig::num_params, every one used once per token, absorbed form)
//   attention  FLOPs 2 HQ (d_qk + d_v) pairs / t: MHA d_qk = d_v = D (4 HQ D pairs / t); MLA in the
//              absorbed form scores against the latent and the rope key (d_qk = R + r) and sums the
//              latent values (d_v = R); pairs = sum new (cached + (new + 1) / 2) (decode: the KV
//              tokens); a sliding-window layer counts only keys inside the window.
//              bytes: every KV token read once plus the new tokens written, times the KV bytes of
//              one token on one rank (MHA: 2 HKV D / t elements; MLA: R + r, replicated).
//   time = max(FLOPs / (peak mfu), bytes / (HBM mbu)) for the GEMMs, plus the same for attention.
// A recurrent layer (LayerKind::kRecurrent: SH state heads of Ds channels, conv kernel K; the
// mixer of backends/attention/hybrid_backend.h) replaces attention by:
//   GEMMs      as above with P = H (3 SH Ds + SH) [q, k, v and the decay gate in] + SH Ds H [out]
//              + 3 H I [MLP] (the conv filter, 3 SH Ds K weights, is left out: it is tiny);
//   mixer      FLOPs T (SH / t) (5 Ds^2 + 6 Ds K): per head and token the state update
//              S = g S + k v^T (3 Ds^2: a multiply, and a multiply-add per element) and the read
//              q . S (2 Ds^2), and the depthwise causal conv of the q, k, v channels (3 Ds taps of
//              K multiply-adds); bytes: each request's state (recurrent + conv, fp32:
//              state_elems_per_request_layer(t) x 4 on a rank) read and written once per forward.
// Then 2 ring all-reduces per layer (every kind) of T H 2 bytes when t > 1, the LM head (2 H V
// FLOPs per sampled token, one per request, vocab-parallel over t; its weights 2 H V / t bytes
// read once) and fixed_overhead_us per forward.
#include "sim/cost/roofline.h"

#include <fmt/format.h>

#include <algorithm>

#include "topology/gpu_spec.h"

namespace pdsim::cost {

namespace {

using model::AttentionKind;
using model::LayerKind;
using model::ModelConfig;

// sum_{j=a}^{b} min(j, w) for 1 <= a <= b (w <= 0: no window).
double sum_min(double a, double b, double w) {
    if (b < a) return 0;
    auto arith = [](double lo, double hi) { return (lo + hi) * (hi - lo + 1) / 2; };
    if (w <= 0 || b <= w) return arith(a, b);
    if (a >= w) return (b - a + 1) * w;
    return arith(a, w) + (b - w) * w;
}

class RooflineModel final : public CostModel {
public:
    RooflineModel(const InstanceSpec& spec, const topo::GpuSpec& gpu, const RooflineOptions& o)
        : spec_(spec), gpu_(gpu), o_(o) {
        const ModelConfig& m = spec.model;
        const double H = m.hidden, HQ = m.num_q_heads, HKV = m.num_kv_heads, D = m.head_dim;
        const double I = m.intermediate, R = m.kv_lora_rank, r = m.rope_dim;
        double attn_params = 0;
        if (m.attention == AttentionKind::kMla) {
            attn_params = H * (R + r) + R * HQ * 2 * D + H * HQ * (D + r) + HQ * D * H;
            qk_plus_v_ = (R + r) + R;
        } else {
            attn_params = H * (HQ + 2 * HKV) * D + HQ * D * H;
            qk_plus_v_ = 2 * D;
        }
        layer_params_ = attn_params + 3 * H * I;
        kv_bytes_per_token_ =
            static_cast<double>(m.kv_elems_per_token_per_layer(spec.tp)) * spec.kv_dtype_bytes;
        full_layers_ = m.count_layers(LayerKind::kFullAttention);
        sliding_layers_ = m.count_layers(LayerKind::kSlidingWindow);
        recurrent_layers_ = m.count_layers(LayerKind::kRecurrent);
        if (recurrent_layers_ > 0) {
            const double SH = m.state_heads, Ds = m.state_head_dim, K = m.conv_kernel;
            recurrent_params_ = H * (3 * SH * Ds + SH) + SH * Ds * H + 3 * H * I;
            recurrent_flops_per_token_ = SH / spec.tp * (5 * Ds * Ds + 6 * Ds * K);
            state_bytes_ = static_cast<double>(m.state_elems_per_request_layer(spec.tp)) * 4;
        }
        flops_per_s_ = gpu.bf16_tflops * 1e12 * o.mfu;
        bytes_per_s_ = gpu.hbm_gbps * 1e9 * o.mbu;
    }

    [[nodiscard]] std::string describe() const override {
        return fmt::format("roofline {} tp{} (mfu {:.2f}, mbu {:.2f})", gpu_.name, spec_.tp, o_.mfu,
                           o_.mbu);
    }

    [[nodiscard]] double extend_s(std::span<const ExtendItem> batch) const override {
        double tokens = 0;
        Attn full, sliding;
        const double w = spec_.model.sliding_window;
        for (const ExtendItem& it : batch) {
            const double n = static_cast<double>(it.new_tokens);
            const double c = static_cast<double>(it.cached_tokens);
            if (n <= 0) continue;
            tokens += n;
            // Query at position p (c <= p < c + n) attends keys 0..p: p + 1 of them.
            full.pairs += sum_min(c + 1, c + n, 0);
            full.kv_read += c + n;
            sliding.pairs += sum_min(c + 1, c + n, w);
            sliding.kv_read += std::min(c + n, w + n);
        }
        full.kv_write = sliding.kv_write = tokens;
        return forward_s(tokens, static_cast<double>(batch.size()), full, sliding);
    }

    [[nodiscard]] double decode_s(int64_t batch_size, int64_t kv_tokens) const override {
        const double b = static_cast<double>(batch_size);
        const double kv = static_cast<double>(kv_tokens);
        const double w = spec_.model.sliding_window;
        Attn full{kv, kv, b};
        const double in_window = std::min(kv, b * w);  // per-request lengths are unknown here
        Attn sliding{in_window, in_window, b};
        return forward_s(b, b, full, sliding);
    }

private:
    struct Attn {
        double pairs = 0;
        double kv_read = 0;   // tokens
        double kv_write = 0;  // tokens
    };

    [[nodiscard]] double roof(double flops, double bytes) const {
        return std::max(flops / flops_per_s_, bytes / bytes_per_s_);
    }

    [[nodiscard]] double attention_s(const Attn& a) const {
        const double t = spec_.tp;
        const double flops = 2 * spec_.model.num_q_heads * qk_plus_v_ * a.pairs / t;
        const double bytes = (a.kv_read + a.kv_write) * kv_bytes_per_token_;
        return roof(flops, bytes);
    }

    [[nodiscard]] double forward_s(double tokens, double requests, const Attn& full,
                                   const Attn& sliding) const {
        if (tokens <= 0) return o_.fixed_overhead_us * 1e-6;
        const double t = spec_.tp;
        const ModelConfig& m = spec_.model;
        const double gemm = roof(2 * tokens * layer_params_ / t, 2 * layer_params_ / t);
        double layer_total = full_layers_ * (gemm + attention_s(full));
        if (sliding_layers_ > 0) layer_total += sliding_layers_ * (gemm + attention_s(sliding));
        if (recurrent_layers_ > 0) {
            const double rgemm =
                roof(2 * tokens * recurrent_params_ / t, 2 * recurrent_params_ / t);
            const double mixer =
                roof(tokens * recurrent_flops_per_token_, 2 * requests * state_bytes_);
            layer_total += recurrent_layers_ * (rgemm + mixer);
        }
        double allreduce = 0;
        if (spec_.tp > 1) {
            const double bytes = tokens * m.hidden * 2;
            const double one = 2 * (t - 1) / t * bytes / (spec_.tp_link_gbps * 1e9) +
                               2 * (t - 1) * spec_.tp_link_latency_us * 1e-6;
            allreduce = 2 * one * m.num_layers;
        }
        const double hv = static_cast<double>(m.hidden) * m.vocab;
        const double lm_head = roof(2 * hv * requests / t, 2 * hv / t);
        return layer_total + allreduce + lm_head + o_.fixed_overhead_us * 1e-6;
    }

    InstanceSpec spec_;
    const topo::GpuSpec& gpu_;
    RooflineOptions o_;
    double layer_params_ = 0;
    double qk_plus_v_ = 0;
    double kv_bytes_per_token_ = 0;
    int full_layers_ = 0;
    int sliding_layers_ = 0;
    int recurrent_layers_ = 0;
    double recurrent_params_ = 0;           // a recurrent layer's GEMM weights
    double recurrent_flops_per_token_ = 0;  // mixer FLOPs per token on one rank
    double state_bytes_ = 0;                // one request's state in one layer on one rank
    double flops_per_s_ = 0;
    double bytes_per_s_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<CostModel>> make_roofline_model(const InstanceSpec& spec,
                                                         const RooflineOptions& options) {
    const topo::GpuSpec* gpu = topo::gpu_spec(spec.device);
    if (gpu == nullptr) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("roofline cost model: device '{}' is not a GPU of the spec table "
                                  "({}); a cpu instance needs a calibrated cost file",
                                  spec.device, topo::gpu_spec_names()));
    }
    PDSIM_RETURN_IF_ERROR(model::validate_model(spec.model));
    PDSIM_RETURN_IF_ERROR(
        model::check_tp(spec.model, spec.tp)
            .with_context(fmt::format("roofline cost model: model {} tp", spec.model.name)));
    if (spec.tp > 1 && !(spec.tp_link_gbps > 0)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("roofline cost model: tp {} needs the TP link bandwidth "
                                  "(tp_link_gbps {} must be > 0)",
                                  spec.tp, spec.tp_link_gbps));
    }
    if (spec.tp_link_latency_us < 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("roofline cost model: tp_link_latency_us {} must be >= 0",
                                  spec.tp_link_latency_us));
    }
    if (spec.kv_dtype_bytes < 1) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("roofline cost model: kv_dtype_bytes {} must be >= 1",
                                  spec.kv_dtype_bytes));
    }
    auto frac = [](const char* name, double v) -> Status {
        if (!(v > 0 && v <= 1)) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("roofline cost model: {} {} must be in (0, 1]", name, v));
        }
        return {};
    };
    PDSIM_RETURN_IF_ERROR(frac("mfu", options.mfu));
    PDSIM_RETURN_IF_ERROR(frac("mbu", options.mbu));
    if (options.fixed_overhead_us < 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("roofline cost model: fixed_overhead_us {} must be >= 0",
                                  options.fixed_overhead_us));
    }
    return std::unique_ptr<CostModel>(new RooflineModel(spec, *gpu, options));
}

}  // namespace pdsim::cost
