// Internal to the model kernels: the flat argument structs of the kernels in model_kernels.cu and
// their launchers, called by model_kernels.cpp after it has checked the public parameters
// (model_kernels.h) and derived these fields once. Kept apart so the .cu file includes nothing but
// the CUDA runtime (nvcc never parses fmt or the model headers). Not for other translation units.
//
// Each launcher enqueues one kernel on `stream` (whose device is current) and returns
// cudaGetLastError(). Row strides are in elements, or in uint4 packs of 8 bf16 ("_packs").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdsim::model::cuda::detail {

struct WeightGenArgs {
    uint64_t seed;
    uint64_t tensor;
    float scale;
    float offset;
    int64_t rows, cols;
    uint64_t index_base;
    uint64_t index_row_stride, index_col_stride;
    void* out;  // element (0, 0) of the block in the destination
    int64_t out_ld;
    bool bf16;  // else fp32
};
[[nodiscard]] cudaError_t launch_weight_gen(const WeightGenArgs& a, cudaStream_t stream);

struct EmbeddingArgs {
    const uint4* table;
    const int32_t* tokens;
    uint4* out;
    int64_t out_ld_packs;
    int64_t packs;  // per row
    int64_t total;  // rows * packs
    int vocab;
};
[[nodiscard]] cudaError_t launch_embedding(const EmbeddingArgs& a, cudaStream_t stream);

struct RmsNormArgs {
    const uint4* in;
    int64_t in_ld_packs;
    const float4* weight;  // [hidden / 4]
    uint4* out;
    int64_t out_ld_packs;
    int rows;
    int packs;    // hidden / 8
    int threads;  // block size: a function of hidden only
    float hidden;
    float eps;
};
[[nodiscard]] cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream);

struct RopeArgs {
    uint16_t* q;
    int64_t q_ld;
    uint16_t* k;
    int64_t k_ld;
    const int32_t* positions;
    const float* cos_sin;
    int q_heads;
    int heads;  // q_heads + k_heads
    int head_dim;
    int half;  // head_dim / 2
    int max_positions;
    int64_t total;  // rows * heads * half: one thread per rotated pair
};
[[nodiscard]] cudaError_t launch_rope(const RopeArgs& a, cudaStream_t stream);

struct PositionsArgs {
    const int32_t* qo_indptr;
    const int32_t* seq_lens;
    int requests;
    int32_t* positions;
};
[[nodiscard]] cudaError_t launch_positions(const PositionsArgs& a, cudaStream_t stream);

struct SiluMulArgs {
    const uint4* gate_up;
    int64_t gate_up_ld_packs;
    uint4* out;
    int64_t out_ld_packs;
    int64_t packs;  // intermediate / 8
    int64_t total;  // rows * packs
};
[[nodiscard]] cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream);

struct ResidualArgs {
    uint4* residual;
    int64_t residual_ld_packs;
    const uint4* delta;
    int64_t delta_ld_packs;
    int64_t packs;
    int64_t total;
};
[[nodiscard]] cudaError_t launch_residual_add(const ResidualArgs& a, cudaStream_t stream);

struct SliceReduceArgs {
    const float4* partials;      // 2 float4 per pack of 8
    int64_t slice_stride_quads;  // slice stride / 4
    int64_t partial_ld_quads;    // partial_ld / 4
    int slices;
    uint4* residual;
    int64_t residual_ld_packs;
    int64_t packs;  // hidden / 8
    int64_t total;  // rows * packs
};
[[nodiscard]] cudaError_t launch_slice_reduce(const SliceReduceArgs& a, cudaStream_t stream);

struct LastTokenArgs {
    const uint4* in;
    int64_t in_ld_packs;
    const int32_t* qo_indptr;
    uint4* out;
    int64_t out_ld_packs;
    int64_t packs;
    int64_t total;  // requests * packs
};
[[nodiscard]] cudaError_t launch_last_token(const LastTokenArgs& a, cudaStream_t stream);

struct ArgmaxArgs {
    const void* logits;
    int64_t ld;
    int rows;
    int vocab;
    bool f32;  // else bf16
    int32_t* tokens;
};
[[nodiscard]] cudaError_t launch_argmax(const ArgmaxArgs& a, cudaStream_t stream);

}  // namespace pdsim::model::cuda::detail
