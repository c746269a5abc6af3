// Shared pieces of the CPU attention kernels (cpu_ref and cpu): validation of a batch against a
// pool at kernel time, the backend's own KV write, and element access into paged KV.
#pragma once

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "common/bf16.h"

namespace pdsim::attn::cpu {

// Checks, when the kernel runs, that `view` fits `pool` and `layer`: an MHA pool on the CPU with the
// layer's kv heads and head dims, every page id of every request in [0, num_pages), and
// ceil(seq_len / page_size) <= stride.
[[nodiscard]] Status validate_view(const BatchView& view, const kv::KVPool& pool, const LayerSpec& layer);

// Writes the new tokens' K and V (args.k, args.v) to args.out_cache_loc in layer args.layer.layer_id.
[[nodiscard]] Status write_kv(const ForwardArgs& args, const BatchView& view);

// Slot of KV token t of request i.
inline int64_t kv_slot(const BatchView& v, int i, int t, int page_size) {
    const int32_t page = v.page_table[static_cast<size_t>(i) * static_cast<size_t>(v.stride) +
                                      static_cast<size_t>(t / page_size)];
    return static_cast<int64_t>(page) * page_size + t % page_size;
}

// Reads element e of KV head h of the token in `slot` of a K or V buffer, as float.
inline float kv_elem(const void* base, kv::KVDtype dtype, int64_t slot, int heads, int dim, int h, int e) {
    const size_t idx = (static_cast<size_t>(slot) * static_cast<size_t>(heads) + static_cast<size_t>(h)) *
                           static_cast<size_t>(dim) + static_cast<size_t>(e);
    if (dtype == kv::KVDtype::kF32) return static_cast<const float*>(base)[idx];
    return bf16_to_float(static_cast<const bf16_t*>(base)[idx]);
}

}  // namespace pdsim::attn::cpu
