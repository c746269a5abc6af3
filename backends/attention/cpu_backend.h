// cpu: the fast CPU attention backend. Tiled online-softmax (flash-attention style) kernels,
// vectorized (AVX2, AVX-512 when the CPU has it), run on the compute stream and parallelized with
// a ThreadPool of config.num_threads (0 = all cores) over (request, kv head, query tile) for
// extend and (request, KV chunk) for decode. fp32 and bf16 KV; fp32 activations (bf16 ones are
// accepted and staged through fp32 copies: q widened, the output rounded back); host memory only
// (cpu::cpu_capabilities()). MHA and GQA (query heads of one KV group share each KV load); decode
// and extend (causal, cached prefix, chunked); the prewrite path (save_kv_cache = false).
// Kernels and their blocking: cpu_kernels.h.
#pragma once

#include <memory>

#include "backends/attention/attention_backend.h"

namespace pdsim::attn {

[[nodiscard]] StatusOr<std::unique_ptr<AttentionBackend>> make_cpu_backend(
    const AttentionConfig& config);

}  // namespace pdsim::attn
