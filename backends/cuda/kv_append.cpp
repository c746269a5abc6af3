// kv_append (see kv_append.h): checks the parameters and derives the kernel's flat arguments;
// the kernel is in kv_append.cu.
#include "backends/cuda/kv_append.h"

#include <cuda_runtime.h>

#include "backends/cuda/kv_append_launch.h"
#include "common/cuda_check.h"

namespace pdsim::attn::cuda {

namespace {

bool supported(runtime::DType d) {
    return d == runtime::DType::kBF16 || d == runtime::DType::kF32;
}

}  // namespace

Status kv_append(const KvAppendParams& p, void* stream) {
    if (p.n < 0) return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.n: {} must be >= 0", p.n);
    if (!supported(p.src_dtype)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "params.src_dtype: {}, expected bf16 or fp32",
                           runtime::dtype_name(p.src_dtype));
    }
    if (!supported(p.cache_dtype)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "params.cache_dtype: {}, expected bf16 or fp32",
                           runtime::dtype_name(p.cache_dtype));
    }
    if (p.num_kv_heads < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.num_kv_heads: {} must be >= 1",
                           p.num_kv_heads);
    }
    if (p.head_dim < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.head_dim: {} must be >= 1",
                           p.head_dim);
    }
    if (p.v_head_dim < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.v_head_dim: {} must be >= 0",
                           p.v_head_dim);
    }
    if (p.num_slots < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.num_slots: {} must be >= 1",
                           p.num_slots);
    }
    if (p.n == 0) return ok_status();
    const char* missing = p.k == nullptr               ? "k"
                          : p.v == nullptr             ? "v"
                          : p.k_cache == nullptr       ? "k_cache"
                          : p.v_cache == nullptr       ? "v_cache"
                          : p.out_cache_loc == nullptr ? "out_cache_loc"
                                                       : nullptr;
    if (missing != nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "params.{}: null", missing);
    }
    detail::KvAppendLaunch l;
    l.src[0] = p.k;
    l.src[1] = p.v;
    l.dst[0] = p.k_cache;
    l.dst[1] = p.v_cache;
    l.row_elems[0] = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
    l.row_elems[1] =
        static_cast<int64_t>(p.num_kv_heads) * (p.v_head_dim > 0 ? p.v_head_dim : p.head_dim);
    l.src_stride[0] = p.k_row_stride != 0 ? p.k_row_stride : l.row_elems[0];
    l.src_stride[1] = p.v_row_stride != 0 ? p.v_row_stride : l.row_elems[1];
    for (int w = 0; w < 2; ++w) {
        if (l.src_stride[w] < l.row_elems[w]) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "params.{}_row_stride: {} is shorter than a row ({} elements)",
                               w == 0 ? "k" : "v", l.src_stride[w], l.row_elems[w]);
        }
    }
    l.out_cache_loc = p.out_cache_loc;
    l.num_slots = p.num_slots;
    l.n = p.n;
    l.src_bf16 = p.src_dtype == runtime::DType::kBF16;
    l.dst_bf16 = p.cache_dtype == runtime::DType::kBF16;
    CUDA_CHECK(static_cast<cudaError_t>(detail::launch_kv_append(l, stream)));
    return ok_status();
}

}  // namespace pdsim::attn::cuda
