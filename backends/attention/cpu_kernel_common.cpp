#include "backends/attention/cpu_kernel_common.h"

namespace pdsim::attn::cpu {

BackendCapabilities cpu_capabilities() {
    using runtime::DType;
    BackendCapabilities caps{
        {DType::kF32, DType::kBF16}, {DType::kF32, DType::kBF16}, {runtime::DeviceKind::kCpu}};
    caps.sliding_window = true;
    caps.flat_cache_groups = true;
    return caps;
}

Status validate_view(const BatchView& view, const kv::KVPool& pool, const LayerSpec& layer) {
    const auto* mha = dynamic_cast<const kv::MHATokenToKVPool*>(&pool);
    if (mha == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs an MHA KV pool");
    if (pool.device().kind != runtime::DeviceKind::kCpu) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs a CPU KV pool");
    }
    if (layer.layer_id < 0 || layer.layer_id >= pool.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "layer {} out of range [0, {})",
                           layer.layer_id, pool.num_layers());
    }
    if (mha->num_kv_heads() != layer.num_kv_heads || mha->head_dim() != layer.head_dim ||
        mha->v_head_dim() != v_dim(layer)) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "pool shape (kv_heads {}, head_dim {}, v_head_dim {}) != layer {} (kv_heads {}, "
            "head_dim {}, v_head_dim {})",
            mha->num_kv_heads(), mha->head_dim(), mha->v_head_dim(), layer.layer_id,
            layer.num_kv_heads, layer.head_dim, v_dim(layer));
    }
    if (layer.num_kv_heads < 1 || layer.num_q_heads % layer.num_kv_heads != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "num_q_heads {} not a multiple of num_kv_heads {}", layer.num_q_heads,
                           layer.num_kv_heads);
    }
    const int ps = pool.page_size();
    for (int i = 0; i < view.bs; ++i) {
        const int s = view.seq_lens[i];
        const int q = view.q_lens[i];
        if (q < 1 || s < q) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: q_len {} seq_len {}", i,
                               q, s);
        }
        const int pages = (s + ps - 1) / ps;
        if (pages > view.stride) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "request {}: seq_len {} needs {} pages of {}, page table row has {}",
                               i, s, pages, ps, view.stride);
        }
        for (int p = 0; p < pages; ++p) {
            int32_t id = view.page_table[static_cast<size_t>(i) * static_cast<size_t>(view.stride) +
                                         static_cast<size_t>(p)];
            if (id < 0 || id >= pool.num_pages()) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "request {}: page_table[{}] = {} out of range [0, {})", i, p, id,
                                   pool.num_pages());
            }
        }
    }
    return {};
}

Status check_rows(const ForwardArgs& args, const BatchView& view) {
    const int64_t n = view.num_tokens;
    if (n == 0) return {};
    if (args.q.empty() || args.out.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "null q or out");
    }
    struct Rows {
        const char* name;
        runtime::ConstTensorView view;
        bool used;
    };
    const bool save = args.save_kv_cache;
    for (const Rows& r :
         {Rows{"q", args.q, true}, Rows{"out", args.out, true}, Rows{"k", args.k, save},
          Rows{"v", args.v, save}, Rows{"out_cache_loc", args.out_cache_loc, save}}) {
        if (r.used && !r.view.empty() && r.view.size(0) < n) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "{}: {} rows, but the metadata describes {} new tokens", r.name,
                               r.view.size(0), n);
        }
    }
    return {};
}

Status write_kv(const ForwardArgs& args, const BatchView& view) {
    auto* mha = dynamic_cast<kv::MHATokenToKVPool*>(args.pool);
    if (mha == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs an MHA KV pool");
    if (view.num_tokens == 0) return {};
    if (args.k.empty() || args.v.empty() || args.out_cache_loc.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "save_kv_cache with null k, v or out_cache_loc");
    }
    const int64_t n = view.num_tokens;  // <= every view's rows (check_rows)
    return mha->set_kv_buffer(args.layer.layer_id, leading_rows(args.out_cache_loc, n),
                              leading_rows(args.k, n), leading_rows(args.v, n));
}

void widen_q(const ForwardArgs& args, int64_t num_tokens, Fp32Activations& staged) {
    const int hq = args.layer.num_q_heads;
    const size_t q_elems = static_cast<size_t>(num_tokens) * static_cast<size_t>(hq) *
                           static_cast<size_t>(args.layer.head_dim);
    const size_t out_elems = static_cast<size_t>(num_tokens) * static_cast<size_t>(hq) *
                             static_cast<size_t>(v_dim(args.layer));
    staged.q_buf.resize(q_elems);
    staged.out_buf.assign(out_elems, 0.f);
    const bf16_t* q = args.q.as<bf16_t>();
    for (size_t i = 0; i < q_elems; ++i) staged.q_buf[i] = bf16_to_float(q[i]);
    staged.args = args;
    staged.args.q = runtime::host_view(static_cast<const float*>(staged.q_buf.data()),
                                       {num_tokens, hq, args.layer.head_dim});
    staged.args.out =
        runtime::host_view(staged.out_buf.data(), {num_tokens, hq, v_dim(args.layer)});
}

void narrow_out(const Fp32Activations& staged, const ForwardArgs& args) {
    bf16_t* out = args.out.as<bf16_t>();
    for (size_t i = 0; i < staged.out_buf.size(); ++i) out[i] = float_to_bf16(staged.out_buf[i]);
}

}  // namespace pdsim::attn::cpu
