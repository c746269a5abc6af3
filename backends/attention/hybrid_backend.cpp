#include "backends/attention/hybrid_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/thread_pool.h"

namespace pdsim::attn {

namespace {

class CpuRecurrentMixer final : public RecurrentMixer {
public:
    [[nodiscard]] std::string name() const override { return "cpu_recurrent"; }

    [[nodiscard]] Status enqueue(const RecurrentArgs& args, runtime::Stream& stream) override {
        if (args.bs == 0) return {};
        return stream.enqueue([args] {
            run(args);
            return Status();
        });
    }

private:
    // One (request, head): its new tokens in order.
    static void run_one(const RecurrentArgs& a, const BatchView& batch, int request, int head) {
        const int heads = a.layer.num_heads, d = a.layer.head_dim, taps = a.layer.conv_kernel;
        const int channels = 3 * d;
        const int32_t slot = a.state_slots.as<int32_t>()[request];
        float* state = a.pool->recurrent_state(a.layer.state_layer, slot, head);
        float* conv = a.pool->conv_state(a.layer.state_layer, slot, head);  // [taps - 1][C]
        const int q_len = batch.q_lens[request];
        const int start = batch.seq_lens[request] - q_len;
        if (start == 0) {
            std::fill_n(state, static_cast<size_t>(d) * d, 0.f);
            std::fill_n(conv, static_cast<size_t>(taps - 1) * channels, 0.f);
        }
        const float* weight =
            a.conv_weight.as<float>() + static_cast<size_t>(head) * channels * taps;
        std::vector<float> mixed(static_cast<size_t>(channels));
        const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
        for (int j = 0; j < q_len; ++j) {
            const int64_t t = batch.q_start[request] + j;
            const float* x = a.qkv.as<float>() + (static_cast<size_t>(t) * heads + head) * channels;
            for (int ch = 0; ch < channels; ++ch) {
                const float* w = weight + static_cast<size_t>(ch) * taps;
                float acc = 0.f;
                for (int tap = 0; tap + 1 < taps; ++tap) {
                    acc = std::fma(w[tap], conv[static_cast<size_t>(tap) * channels + ch], acc);
                }
                acc = std::fma(w[taps - 1], x[ch], acc);
                mixed[static_cast<size_t>(ch)] = acc / (1.0f + std::exp(-acc));  // silu
            }
            // Shift the convolution state: drop the oldest input, append this one.
            if (taps > 2) {
                std::memmove(conv, conv + channels,
                             sizeof(float) * static_cast<size_t>(taps - 2) * channels);
            }
            std::memcpy(conv + static_cast<size_t>(taps - 2) * channels, x,
                        sizeof(float) * static_cast<size_t>(channels));
            const float* q = mixed.data();
            const float* k = q + d;
            const float* v = k + d;
            double q_sq = 0, k_sq = 0;
            for (int i = 0; i < d; ++i) {
                q_sq += static_cast<double>(q[i]) * q[i];
                k_sq += static_cast<double>(k[i]) * k[i];
            }
            const float q_scale = static_cast<float>(1.0 / (std::sqrt(q_sq) + 1e-6)) * inv_sqrt_d;
            const float k_scale = static_cast<float>(1.0 / (std::sqrt(k_sq) + 1e-6));
            const float g = a.gate.as<float>()[static_cast<size_t>(t) * heads + head];
            const float decay = 1.0f / (1.0f + std::exp(-g));
            for (int row = 0; row < d; ++row) {
                const float kr = k[row] * k_scale;
                float* s = state + static_cast<size_t>(row) * d;
                for (int col = 0; col < d; ++col) s[col] = std::fma(kr, v[col], decay * s[col]);
            }
            float* out = a.out.as<float>() + (static_cast<size_t>(t) * heads + head) * d;
            std::fill_n(out, d, 0.f);
            for (int row = 0; row < d; ++row) {
                const float qr = q[row] * q_scale;
                const float* s = state + static_cast<size_t>(row) * d;
                for (int col = 0; col < d; ++col) out[col] = std::fma(qr, s[col], out[col]);
            }
        }
    }

    static void run(const RecurrentArgs& a) {
        const BatchView batch = a.meta->view();
        const int heads = a.layer.num_heads;
        const size_t pairs = static_cast<size_t>(a.bs) * static_cast<size_t>(heads);
        ThreadPool::global().parallel_for(pairs, [&](size_t begin, size_t end, int) {
            for (size_t p = begin; p < end; ++p) {
                run_one(a, batch, static_cast<int>(p / static_cast<size_t>(heads)),
                        static_cast<int>(p % static_cast<size_t>(heads)));
            }
        });
    }
};

}  // namespace

std::unique_ptr<RecurrentMixer> make_cpu_recurrent_mixer() {
    return std::make_unique<CpuRecurrentMixer>();
}

HybridBackend::HybridBackend(std::unique_ptr<AttentionBackend> attention,
                             std::unique_ptr<RecurrentMixer> mixer)
    : AttentionBackend(attention->config()),
      attention_(std::move(attention)),
      mixer_(std::move(mixer)) {}

StatusOr<std::unique_ptr<HybridBackend>> HybridBackend::create(
    std::unique_ptr<AttentionBackend> attention, std::unique_ptr<RecurrentMixer> mixer) {
    if (attention == nullptr || mixer == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "hybrid backend: needs an attention backend and a recurrent mixer");
    }
    if (attention->step_counter() != nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "hybrid backend: the attention child {} has a StepCounter; the hybrid "
                           "backend owns the records",
                           attention->name());
    }
    return std::unique_ptr<HybridBackend>(
        new HybridBackend(std::move(attention), std::move(mixer)));
}

std::string HybridBackend::name() const {
    return attention_->name() + "+" + mixer_->name();
}

BackendCapabilities HybridBackend::capabilities() const {
    BackendCapabilities caps = attention_->capabilities();
    caps.recurrent_layers = true;
    return caps;
}

Status HybridBackend::init_forward_metadata(const ForwardBatch& batch) {
    PDSIM_RETURN_IF_ERROR(AttentionBackend::init_forward_metadata(batch));
    return attention_->init_forward_metadata(batch);
}

Status HybridBackend::init_cuda_graph_state(int, const int32_t*, const GraphStateExtras&) {
    return PDSIM_ERROR(StatusCode::kUnimplemented,
                       "{}: the hybrid backend has no graph state (its recurrent layers read "
                       "eager metadata)",
                       name());
}

Status HybridBackend::call_attention(const ForwardArgs& args) {
    std::optional<bool> record = false;
    if (child_records_ && step_counter() != nullptr) {  // the planted bug (see the header)
        attention_->register_step_counter(step_counter());
        record.reset();
    }
    return attention_->forward(args.q, args.k, args.v, args.layer, args.out_cache_loc, *args.pool,
                               args.mode, args.bs, args.out, args.save_kv_cache, record);
}

Status HybridBackend::forward_decode(const ForwardArgs& args) {
    return call_attention(args);
}

Status HybridBackend::forward_extend(const ForwardArgs& args) {
    return call_attention(args);
}

Status HybridBackend::forward_recurrent_impl(const RecurrentArgs& args) {
    return mixer_->enqueue(args, stream());
}

}  // namespace pdsim::attn
