// The kv_append kernel (see kv_append.h): one CTA per (token, K or V), each thread moving kVec
// elements at a time through aligned vector loads/stores of at most 16 bytes. No pdsim headers
// beyond kv_append_launch.h, to keep nvcc's front end small.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/kv_append_launch.h"
#include "common/align.h"

namespace pdsim::attn::cuda::detail {

namespace {

// Plain-data copy of KvAppendLaunch for the kernel argument.
struct KernelArgs {
    const void* src[2];
    void* dst[2];
    int64_t src_stride[2];
    int64_t row_elems[2];
    const int32_t* out_cache_loc;
    int64_t num_slots;
};

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
    T v[kVec];
};

template <typename Dst, typename Src>
__device__ __forceinline__ Dst convert(Src x) {
    if constexpr (std::is_same_v<Src, Dst>) {
        return x;  // bits copied as they are
    } else if constexpr (std::is_same_v<Dst, float>) {
        return __bfloat162float(x);
    } else {
        return __float2bfloat16_rn(x);
    }
}

template <typename Src, typename Dst, int kVec>
__global__ void kv_append_kernel(const KernelArgs a) {
    const int64_t token = blockIdx.x;
    const int which = static_cast<int>(blockIdx.y);  // 0: K, 1: V
    const int32_t loc = a.out_cache_loc[token];
    if (loc < 0 || loc >= a.num_slots) return;
    const int64_t row = a.row_elems[which];
    const Src* src = static_cast<const Src*>(a.src[which]) + token * a.src_stride[which];
    Dst* dst = static_cast<Dst*>(a.dst[which]) + static_cast<int64_t>(loc) * row;
    for (int64_t e = static_cast<int64_t>(threadIdx.x) * kVec; e < row;
         e += static_cast<int64_t>(blockDim.x) * kVec) {
        const Vec<Src, kVec> in = *reinterpret_cast<const Vec<Src, kVec>*>(src + e);
        Vec<Dst, kVec> out;
#pragma unroll
        for (int i = 0; i < kVec; ++i) out.v[i] = convert<Dst>(in.v[i]);
        *reinterpret_cast<Vec<Dst, kVec>*>(dst + e) = out;
    }
}

template <typename Src, typename Dst>
cudaError_t launch(const KernelArgs& a, int n, cudaStream_t stream) {
    // The widest vector (<= 16 bytes on either side) that every row start and length allows:
    // rows start at base + index * stride (source) and base + slot * row (destination).
    constexpr int kMaxVec = static_cast<int>(16 / std::max(sizeof(Src), sizeof(Dst)));
    int vec = kMaxVec;
    for (; vec > 1; vec /= 2) {
        bool ok = true;
        for (int w = 0; w < 2; ++w) {
            ok = ok && a.row_elems[w] % vec == 0 && a.src_stride[w] % vec == 0 &&
                 is_aligned(a.src[w], sizeof(Src) * static_cast<size_t>(vec)) &&
                 is_aligned(a.dst[w], sizeof(Dst) * static_cast<size_t>(vec));
        }
        if (ok) break;
    }
    const int64_t longest = std::max(a.row_elems[0], a.row_elems[1]);
    const int64_t per_row = (longest + vec - 1) / vec;
    const int threads = static_cast<int>(std::clamp<int64_t>((per_row + 31) / 32 * 32, 32, 256));
    const dim3 grid(static_cast<unsigned>(n), 2);
    switch (vec) {
        case 8:
            if constexpr (kMaxVec >= 8) {
                kv_append_kernel<Src, Dst, 8><<<grid, threads, 0, stream>>>(a);
            }
            break;
        case 4:
            if constexpr (kMaxVec >= 4) {
                kv_append_kernel<Src, Dst, 4><<<grid, threads, 0, stream>>>(a);
            }
            break;
        case 2:
            kv_append_kernel<Src, Dst, 2><<<grid, threads, 0, stream>>>(a);
            break;
        default:
            kv_append_kernel<Src, Dst, 1><<<grid, threads, 0, stream>>>(a);
            break;
    }
    return cudaGetLastError();
}

}  // namespace

int launch_kv_append(const KvAppendLaunch& l, void* stream) {
    KernelArgs a{};
    for (int w = 0; w < 2; ++w) {
        a.src[w] = l.src[w];
        a.dst[w] = l.dst[w];
        a.src_stride[w] = l.src_stride[w];
        a.row_elems[w] = l.row_elems[w];
    }
    a.out_cache_loc = l.out_cache_loc;
    a.num_slots = l.num_slots;
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t rc;
    if (l.src_bf16 && l.dst_bf16) {
        rc = launch<__nv_bfloat16, __nv_bfloat16>(a, l.n, s);
    } else if (l.src_bf16) {
        rc = launch<__nv_bfloat16, float>(a, l.n, s);
    } else if (l.dst_bf16) {
        rc = launch<float, __nv_bfloat16>(a, l.n, s);
    } else {
        rc = launch<float, float>(a, l.n, s);
    }
    return static_cast<int>(rc);
}

}  // namespace pdsim::attn::cuda::detail
