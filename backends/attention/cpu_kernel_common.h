// Shared pieces of the CPU attention kernels (cpu_ref and cpu): their capability declaration,
// validation of a batch against a pool and the views at kernel time, the backend's own KV write,
// bf16 activations staged through fp32, and element access into paged KV.
#pragma once

#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "common/bf16.h"

namespace pdsim::attn::cpu {

// What cpu and cpu_ref accept: fp32 or bf16 activations (bf16 is widened to fp32 for the kernels
// and the output rounded back), fp32 or bf16 KV, host memory, sliding-window attention
// (LayerSpec::sliding_window > 0).
[[nodiscard]] BackendCapabilities cpu_capabilities();

// Checks, when the kernel runs, that `view` fits `pool` and `layer`: an MHA pool on the CPU with
// the layer's kv heads and head dims, every page id of every request in [0, num_pages), and
// ceil(seq_len / page_size) <= stride.
[[nodiscard]] Status validate_view(const BatchView& view, const kv::KVPool& pool,
                                   const LayerSpec& layer);

// Checks, when the kernel runs, that the forward's views hold the metadata's num_tokens rows
// (graph metadata may describe a larger batch than the static buffers were captured with):
// kFailedPrecondition naming the view otherwise; q/out must be non-null when there are tokens.
[[nodiscard]] Status check_rows(const ForwardArgs& args, const BatchView& view);

// Writes the new tokens' K and V (the first view.num_tokens rows of args.k, args.v) to
// args.out_cache_loc in layer args.layer.layer_id.
[[nodiscard]] Status write_kv(const ForwardArgs& args, const BatchView& view);

// fp32 copies of bf16 activations for kernels that compute in fp32: args.q / args.out point at
// q_buf / out_buf ([num_tokens][heads][dim] fp32). Not copyable (args points into the buffers).
struct Fp32Activations {
    ForwardArgs args;
    std::vector<float> q_buf, out_buf;

    Fp32Activations() = default;
    Fp32Activations(const Fp32Activations&) = delete;
    Fp32Activations& operator=(const Fp32Activations&) = delete;
};

// Runs body(fp32_args): directly for fp32 activations; for bf16, on the first num_tokens rows of
// q widened to fp32, then rounds the fp32 output (round to nearest even) into args.out.
template <typename Body>
void with_fp32_activations(const ForwardArgs& args, int64_t num_tokens, Body&& body);

void widen_q(const ForwardArgs& args, int64_t num_tokens, Fp32Activations& staged);
void narrow_out(const Fp32Activations& staged, const ForwardArgs& args);

template <typename Body>
void with_fp32_activations(const ForwardArgs& args, int64_t num_tokens, Body&& body) {
    if (args.q.dtype == runtime::DType::kF32 || num_tokens == 0) {
        body(args);
        return;
    }
    Fp32Activations staged;
    widen_q(args, num_tokens, staged);
    body(static_cast<const ForwardArgs&>(staged.args));
    narrow_out(staged, args);
}

// Slot of KV token t of request i.
inline int64_t kv_slot(const BatchView& v, int i, int t, int page_size) {
    const int32_t page = v.page_table[static_cast<size_t>(i) * static_cast<size_t>(v.stride) +
                                      static_cast<size_t>(t / page_size)];
    return static_cast<int64_t>(page) * page_size + t % page_size;
}

// Reads element e of KV head h of the token in `slot` of a K or V buffer, as float.
inline float kv_elem(const void* base, runtime::DType dtype, int64_t slot, int heads, int dim,
                     int h, int e) {
    const size_t idx =
        (static_cast<size_t>(slot) * static_cast<size_t>(heads) + static_cast<size_t>(h)) *
            static_cast<size_t>(dim) +
        static_cast<size_t>(e);
    if (dtype == runtime::DType::kF32) return static_cast<const float*>(base)[idx];
    return bf16_to_float(static_cast<const bf16_t*>(base)[idx]);
}

}  // namespace pdsim::attn::cpu
