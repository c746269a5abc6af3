#include "backends/attention/cpu_kernel_common.h"

namespace pdsim::attn::cpu {

Status validate_view(const BatchView& view, const kv::KVPool& pool, const LayerSpec& layer) {
    const auto* mha = dynamic_cast<const kv::MHATokenToKVPool*>(&pool);
    if (mha == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs an MHA KV pool");
    if (pool.device().kind != runtime::DeviceKind::kCpu) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs a CPU KV pool");
    }
    if (layer.layer_id < 0 || layer.layer_id >= pool.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "layer {} out of range [0, {})", layer.layer_id,
                           pool.num_layers());
    }
    if (mha->num_kv_heads() != layer.num_kv_heads || mha->head_dim() != layer.head_dim ||
        mha->v_head_dim() != v_dim(layer)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pool shape (kv_heads {}, head_dim {}, v_head_dim {}) != layer {} (kv_heads {}, "
                           "head_dim {}, v_head_dim {})",
                           mha->num_kv_heads(), mha->head_dim(), mha->v_head_dim(), layer.layer_id,
                           layer.num_kv_heads, layer.head_dim, v_dim(layer));
    }
    if (layer.num_kv_heads < 1 || layer.num_q_heads % layer.num_kv_heads != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "num_q_heads {} not a multiple of num_kv_heads {}",
                           layer.num_q_heads, layer.num_kv_heads);
    }
    const int ps = pool.page_size();
    for (int i = 0; i < view.bs; ++i) {
        const int s = view.seq_lens[i];
        const int q = view.q_lens[i];
        if (q < 1 || s < q) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: q_len {} seq_len {}", i, q, s);
        }
        const int pages = (s + ps - 1) / ps;
        if (pages > view.stride) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "request {}: seq_len {} needs {} pages of {}, page table row has {}", i, s,
                               pages, ps, view.stride);
        }
        for (int p = 0; p < pages; ++p) {
            int32_t id = view.page_table[static_cast<size_t>(i) * static_cast<size_t>(view.stride) +
                                         static_cast<size_t>(p)];
            if (id < 0 || id >= pool.num_pages()) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: page_table[{}] = {} out of range [0, {})",
                                   i, p, id, pool.num_pages());
            }
        }
    }
    return {};
}

Status write_kv(const ForwardArgs& args, const BatchView& view) {
    auto* mha = dynamic_cast<kv::MHATokenToKVPool*>(args.pool);
    if (mha == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU attention needs an MHA KV pool");
    if (view.num_tokens == 0) return {};
    if (args.k == nullptr || args.v == nullptr || args.out_cache_loc == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "save_kv_cache with null k, v or out_cache_loc");
    }
    return mha->set_kv_buffer(args.layer.layer_id, args.out_cache_loc, view.num_tokens, args.k, args.v);
}

}  // namespace pdsim::attn::cpu
