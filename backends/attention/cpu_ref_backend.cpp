#include "backends/attention/cpu_ref_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backends/attention/cpu_kernel_common.h"

namespace pdsim::attn {

BackendCapabilities CpuRefBackend::capabilities() const {
    return cpu::cpu_capabilities();
}

void CpuRefBackend::attend(const ForwardArgs& args, const BatchView& view) {
    const auto& pool = *args.pool;
    const LayerSpec& L = args.layer;
    const int hq = L.num_q_heads, hkv = L.num_kv_heads, d = L.head_dim, dv = v_dim(L);
    const int group = hq / hkv;
    const double scale = layer_scaling(L);
    const int ps = pool.page_size();
    const void* kbase = pool.data(L.layer_id, 0);
    const void* vbase = pool.data(L.layer_id, 1);
    std::vector<double> scores;
    std::vector<double> acc(static_cast<size_t>(dv));
    for (int i = 0; i < view.bs; ++i) {
        const int s = view.seq_lens[i], ql = view.q_lens[i];
        for (int j = 0; j < ql; ++j) {
            const int pos = s - ql + j;  // causal: attends keys lo..pos
            // Sliding window W > 0: keys [max(0, pos - W + 1), pos]; W == 0: keys [0, pos].
            const int lo = L.sliding_window > 0 ? std::max(0, pos - L.sliding_window + 1) : 0;
            const int token = view.q_start[i] + j;
            scores.assign(static_cast<size_t>(pos) + 1, 0.0);
            for (int h = 0; h < hq; ++h) {
                const int kh = h / group;
                const float* qv = args.q.as<float>() + (static_cast<size_t>(token) * hq + h) * d;
                double mx = -std::numeric_limits<double>::infinity();
                for (int t = lo; t <= pos; ++t) {
                    const int64_t slot = cpu::kv_slot(view, i, t, ps);
                    double dot = 0.0;
                    for (int e = 0; e < d; ++e) {
                        dot += static_cast<double>(qv[e]) *
                               cpu::kv_elem(kbase, pool.dtype(), slot, hkv, d, kh, e);
                    }
                    scores[static_cast<size_t>(t)] = dot * scale;
                    mx = std::max(mx, scores[static_cast<size_t>(t)]);
                }
                double sum = 0.0;
                for (int t = lo; t <= pos; ++t) {
                    double p = std::exp(scores[static_cast<size_t>(t)] - mx);
                    scores[static_cast<size_t>(t)] = p;
                    sum += p;
                }
                std::fill(acc.begin(), acc.end(), 0.0);
                for (int t = lo; t <= pos; ++t) {
                    const int64_t slot = cpu::kv_slot(view, i, t, ps);
                    const double p = scores[static_cast<size_t>(t)];
                    for (int e = 0; e < dv; ++e) {
                        acc[static_cast<size_t>(e)] +=
                            p * cpu::kv_elem(vbase, pool.dtype(), slot, hkv, dv, kh, e);
                    }
                }
                float* o = args.out.as<float>() + (static_cast<size_t>(token) * hq + h) * dv;
                for (int e = 0; e < dv; ++e)
                    o[e] = static_cast<float>(acc[static_cast<size_t>(e)] / sum);
            }
        }
    }
}

Status CpuRefBackend::enqueue(const ForwardArgs& args) {
    return stream().enqueue([args] {
        const BatchView view = args.meta->view();
        if (view.mode != args.mode && !(is_idle(args.mode) && view.bs == 0)) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "forward mode {} but the metadata describes a {} batch",
                               forward_mode_name(args.mode), forward_mode_name(view.mode));
        }
        if (view.graph ? view.bs > args.bs : view.bs != args.bs) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "forward bs {} but the metadata has bs {}", args.bs, view.bs);
        }
        PDSIM_RETURN_IF_ERROR(cpu::validate_view(view, *args.pool, args.layer));
        PDSIM_RETURN_IF_ERROR(cpu::check_rows(args, view));
        if (args.save_kv_cache) PDSIM_RETURN_IF_ERROR(cpu::write_kv(args, view));
        cpu::with_fp32_activations(args, view.num_tokens,
                                   [&view](const ForwardArgs& f) { attend(f, view); });
        return Status();
    });
}

Status CpuRefBackend::forward_decode(const ForwardArgs& args) {
    return enqueue(args);
}
Status CpuRefBackend::forward_extend(const ForwardArgs& args) {
    return enqueue(args);
}

}  // namespace pdsim::attn
