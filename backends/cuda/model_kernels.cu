// The GPU synthetic model's kernels and their launchers (contracts: model_kernels.h; arguments:
// model_kernels_launch.h). Only the CUDA runtime is included here; the checks, layouts and Status
// wrappers are host code in model_kernels.cpp.
//
// Conventions:
//  - bf16 is handled as its uint16_t bits, converted with the same integer rounding as
//    common/bf16.h (so no cuda_bf16.h); rows move as uint4 packs of 8 bf16, which is why the row
//    lengths, row strides and pointers of those kernels are 16-byte multiples (checked by the
//    host).
//  - Every value whose bits matter is computed with explicitly rounded intrinsics (__fmul_rn,
//    __fadd_rn, __fmaf_rn, ...), which nvcc never contracts or reassociates.
//  - One block per row for the reductions (RMSNorm, argmax), with a block size that depends on the
//    row length alone; grid-stride loops elsewhere. Each output element is written by one thread.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "backends/cuda/model_kernels_launch.h"

namespace pdsim::model::cuda::detail {

namespace {

constexpr uint16_t kBf16NaN = 0x7fc0;
constexpr int kPack = 8;  // bf16 per uint4
constexpr int kElementwiseThreads = 256;
constexpr int kMaxGridBlocks = 8192;  // grid-stride kernels cap their grid here
constexpr int kArgmaxThreads = 512;   // fixed: the argmax result does not depend on it anyway
constexpr int kPositionsThreads = 128;

// ---- device helpers ----

__device__ __forceinline__ float bf16_to_f32(uint32_t bits16) {
    return __uint_as_float(bits16 << 16);
}

// Round to nearest even, NaN kept quiet: common/bf16.h's float_to_bf16, bit for bit.
__device__ __forceinline__ uint32_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x0040u) & 0xffffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kPack]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = bf16_to_f32(w[j] & 0xffffu);
        f[2 * j + 1] = bf16_to_f32(w[j] >> 16);
    }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[kPack]) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = f32_to_bf16(f[2 * j]) | (f32_to_bf16(f[2 * j + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 nan_pack() {
    constexpr uint32_t kTwo = (uint32_t{kBf16NaN} << 16) | kBf16NaN;
    return make_uint4(kTwo, kTwo, kTwo, kTwo);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// SyntheticModel::weight_value, bit for bit: 24 random bits -> [-1, 1) (the product by 2^-23 is
// exact), times scale.
__device__ __forceinline__ float synthetic_weight(uint64_t seed, uint64_t tensor, uint64_t index,
                                                  float scale) {
    const uint64_t r = splitmix64(seed ^ splitmix64(tensor * 0x100000001b3ULL + index));
    const float u = __fsub_rn(__fmul_rn(static_cast<float>(r >> 40), 1.0f / 8388608.0f), 1.0f);
    return __fmul_rn(u, scale);
}

// The sum of `v` over the block, identical in every thread: a butterfly within each warp (lane i
// and lane i ^ o add the same two values, so every lane holds the same sum), then the warp sums in
// warp order. blockDim.x is a multiple of 32, at most 1024. The order depends on blockDim only.
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int warp = static_cast<int>(threadIdx.x) >> 5;
    const int warps = static_cast<int>(blockDim.x) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    float t = lane < warps ? warp_sums[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, o));
    __syncthreads();  // warp_sums may be reused by the caller's next call
    return t;
}

// ---- kernels ----

__global__ void weight_gen_kernel(WeightGenArgs a) {
    const int64_t c_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
        for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < a.cols;
             c += c_step) {
            const uint64_t index = a.index_base + static_cast<uint64_t>(r) * a.index_row_stride +
                                   static_cast<uint64_t>(c) * a.index_col_stride;
            float v = synthetic_weight(a.seed, a.tensor, index, a.scale);
            if (a.offset != 0.f) v = __fadd_rn(a.offset, v);
            const int64_t o = r * a.out_ld + c;
            if (a.bf16) {
                static_cast<uint16_t*>(a.out)[o] = static_cast<uint16_t>(f32_to_bf16(v));
            } else {
                static_cast<float*>(a.out)[o] = v;
            }
        }
    }
}

__global__ void embedding_kernel(EmbeddingArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = e / a.packs, p = e % a.packs;
        const int32_t tok = a.tokens[t];
        a.out[t * a.out_ld_packs + p] = (tok >= 0 && tok < a.vocab)
                                            ? a.table[static_cast<int64_t>(tok) * a.packs + p]
                                            : nan_pack();
    }
}

// One block per row: pass 1 sums squares (one fused multiply-add chain per thread over its packs,
// in order, then block_sum), pass 2 rereads the row and scales it. In place is safe: a thread
// rewrites only the packs it read, after every thread has finished pass 1.
__global__ void rms_norm_kernel(RmsNormArgs a) {
    const int64_t row = blockIdx.x;
    const uint4* x = a.in + row * a.in_ld_packs;
    float ss = 0.f;
    for (int p = static_cast<int>(threadIdx.x); p < a.packs; p += static_cast<int>(blockDim.x)) {
        float f[kPack];
        unpack8(x[p], f);
#pragma unroll
        for (int j = 0; j < kPack; ++j) ss = __fmaf_rn(f[j], f[j], ss);
    }
    ss = block_sum(ss);
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, a.hidden), a.eps)));
    uint4* y = a.out + row * a.out_ld_packs;
    for (int p = static_cast<int>(threadIdx.x); p < a.packs; p += static_cast<int>(blockDim.x)) {
        float f[kPack];
        unpack8(x[p], f);
        const float4 w0 = a.weight[2 * p], w1 = a.weight[2 * p + 1];
        const float w[kPack] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int j = 0; j < kPack; ++j) f[j] = __fmul_rn(__fmul_rn(f[j], inv), w[j]);
        y[p] = pack8(f);
    }
}

// One thread per rotated pair (token, head, i < half).
__global__ void rope_kernel(RopeArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int i = static_cast<int>(e % a.half);
        const int64_t th = e / a.half;
        const int h = static_cast<int>(th % a.heads);
        const int64_t t = th / a.heads;
        uint16_t* v = h < a.q_heads
                          ? a.q + t * a.q_ld + static_cast<int64_t>(h) * a.head_dim
                          : a.k + t * a.k_ld + static_cast<int64_t>(h - a.q_heads) * a.head_dim;
        const int32_t pos = a.positions[t];
        if (pos < 0 || pos >= a.max_positions) {
            v[i] = kBf16NaN;
            v[i + a.half] = kBf16NaN;
            continue;
        }
        const float* cs = a.cos_sin + static_cast<int64_t>(pos) * a.head_dim;
        const float c = cs[i], s = cs[a.half + i];
        const float x0 = bf16_to_f32(v[i]), x1 = bf16_to_f32(v[i + a.half]);
        v[i] = static_cast<uint16_t>(f32_to_bf16(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s))));
        v[i + a.half] =
            static_cast<uint16_t>(f32_to_bf16(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c))));
    }
}

__global__ void positions_kernel(PositionsArgs a) {
    for (int r = static_cast<int>(blockIdx.x); r < a.requests; r += static_cast<int>(gridDim.x)) {
        const int32_t begin = a.qo_indptr[r], len = a.qo_indptr[r + 1] - begin;
        const int32_t first = a.seq_lens[r] - len;
        for (int32_t j = static_cast<int32_t>(threadIdx.x); j < len;
             j += static_cast<int32_t>(blockDim.x)) {
            a.positions[begin + j] = first + j;
        }
    }
}

__global__ void silu_mul_kernel(SiluMulArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = e / a.packs, p = e % a.packs;
        const uint4* row = a.gate_up + t * a.gate_up_ld_packs;
        float g[kPack], u[kPack];
        unpack8(row[p], g);
        unpack8(row[a.packs + p], u);
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
            g[j] = __fmul_rn(__fdiv_rn(g[j], __fadd_rn(1.0f, expf(-g[j]))), u[j]);
        }
        a.out[t * a.out_ld_packs + p] = pack8(g);
    }
}

__global__ void residual_add_kernel(ResidualArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = e / a.packs, p = e % a.packs;
        float h[kPack], d[kPack];
        uint4* dst = a.residual + t * a.residual_ld_packs + p;
        unpack8(*dst, h);
        unpack8(a.delta[t * a.delta_ld_packs + p], d);
#pragma unroll
        for (int j = 0; j < kPack; ++j) h[j] = __fadd_rn(h[j], d[j]);
        *dst = pack8(h);
    }
}

__global__ void slice_reduce_kernel(SliceReduceArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = e / a.packs, p = e % a.packs;
        const int64_t at = t * a.partial_ld_quads + 2 * p;
        float d[kPack];
        for (int s = 0; s < a.slices; ++s) {
            const float4* src = a.partials + s * a.slice_stride_quads + at;
            const float4 lo = src[0], hi = src[1];
            const float f[kPack] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < kPack; ++j) d[j] = s == 0 ? f[j] : __fadd_rn(d[j], f[j]);
        }
        // delta rounds to bf16 first, as the O / down GEMM's bf16 output does on the TP 1 path.
        float h[kPack];
        uint4* dst = a.residual + t * a.residual_ld_packs + p;
        unpack8(*dst, h);
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
            h[j] = __fadd_rn(h[j], bf16_to_f32(f32_to_bf16(d[j])));
        }
        *dst = pack8(h);
    }
}

__global__ void last_token_kernel(LastTokenArgs a) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.total;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = e / a.packs, p = e % a.packs;
        const int32_t begin = a.qo_indptr[r], end = a.qo_indptr[r + 1];
        a.out[r * a.out_ld_packs + p] =
            end > begin ? a.in[static_cast<int64_t>(end - 1) * a.in_ld_packs + p] : nan_pack();
    }
}

__device__ __forceinline__ float logit(const ArgmaxArgs& a, int64_t i) {
    return a.f32 ? static_cast<const float*>(a.logits)[i]
                 : bf16_to_f32(static_cast<const uint16_t*>(a.logits)[i]);
}

// (value, index) with index INT_MAX meaning "no candidate": the larger value wins, the lower index
// on a tie. A total order on the non-NaN candidates, so the result does not depend on the order
// in which candidates meet.
__device__ __forceinline__ void take_better(float& v, int& i, float ov, int oi) {
    if (oi == INT_MAX) return;
    if (i == INT_MAX || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__global__ void argmax_kernel(ArgmaxArgs a) {
    __shared__ float warp_v[32];
    __shared__ int warp_i[32];
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int warp = static_cast<int>(threadIdx.x) >> 5;
    const int warps = static_cast<int>(blockDim.x) >> 5;
    for (int row = static_cast<int>(blockIdx.x); row < a.rows; row += static_cast<int>(gridDim.x)) {
        const int64_t base = static_cast<int64_t>(row) * a.ld;
        float best = 0.f;
        int best_i = INT_MAX;
        for (int j = static_cast<int>(threadIdx.x); j < a.vocab;
             j += static_cast<int>(blockDim.x)) {
            const float x = logit(a, base + j);
            if (!isnan(x)) take_better(best, best_i, x, j);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            take_better(best, best_i, ov, oi);
        }
        if (lane == 0) {
            warp_v[warp] = best;
            warp_i[warp] = best_i;
        }
        __syncthreads();
        if (warp == 0) {
            float v = lane < warps ? warp_v[lane] : 0.f;
            int i = lane < warps ? warp_i[lane] : INT_MAX;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, v, o);
                const int oi = __shfl_xor_sync(0xffffffffu, i, o);
                take_better(v, i, ov, oi);
            }
            if (lane == 0) {
                const bool ok = i != INT_MAX && !isnan(logit(a, base)) && isfinite(v);
                a.tokens[row] = ok ? i : -1;
            }
        }
        __syncthreads();  // warp_v / warp_i are rewritten for the next row
    }
}

int grid_for(int64_t work, int threads) {
    const int64_t blocks = (work + threads - 1) / threads;
    return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

int capped(int n) {
    return n < 1 ? 1 : (n > kMaxGridBlocks ? kMaxGridBlocks : n);
}

}  // namespace

cudaError_t launch_weight_gen(const WeightGenArgs& a, cudaStream_t stream) {
    // x: the columns of a row (contiguous in the destination: coalesced stores); y: rows.
    const int gx = grid_for(a.cols, kElementwiseThreads);
    const dim3 grid(static_cast<unsigned>(gx < 64 ? gx : 64),
                    static_cast<unsigned>(a.rows < 65535 ? a.rows : 65535));
    weight_gen_kernel<<<grid, kElementwiseThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_embedding(const EmbeddingArgs& a, cudaStream_t stream) {
    embedding_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
    rms_norm_kernel<<<a.rows, a.threads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_rope(const RopeArgs& a, cudaStream_t stream) {
    rope_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_positions(const PositionsArgs& a, cudaStream_t stream) {
    positions_kernel<<<capped(a.requests), kPositionsThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
    silu_mul_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launch_residual_add(const ResidualArgs& a, cudaStream_t stream) {
    residual_add_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        a);
    return cudaGetLastError();
}

cudaError_t launch_slice_reduce(const SliceReduceArgs& a, cudaStream_t stream) {
    slice_reduce_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        a);
    return cudaGetLastError();
}

cudaError_t launch_last_token(const LastTokenArgs& a, cudaStream_t stream) {
    last_token_kernel<<<grid_for(a.total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        a);
    return cudaGetLastError();
}

cudaError_t launch_argmax(const ArgmaxArgs& a, cudaStream_t stream) {
    argmax_kernel<<<capped(a.rows), kArgmaxThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

}  // namespace pdsim::model::cuda::detail
