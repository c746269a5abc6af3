// cpu: the fast CPU attention backend. Tiled online-softmax (flash-attention style) kernels,
// vectorized, run on the compute stream and parallelized over (request, kv head, query tile) with a
// ThreadPool. fp32 and bf16 KV; MHA and GQA (query heads of one KV group share each KV load);
// decode and extend (causal, cached prefix, chunked); the prewrite path (save_kv_cache = false).
#pragma once

#include <memory>

#include "backends/attention/attention_backend.h"

namespace pdsim::attn {

[[nodiscard]] StatusOr<std::unique_ptr<AttentionBackend>> make_cpu_backend(const AttentionConfig& config);

}  // namespace pdsim::attn
