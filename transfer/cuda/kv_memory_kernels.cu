// The kernels of CudaKvMemoryOps (see cuda_kv_memory_ops.h and kv_memory_kernels.h). No pdsim
// headers beyond kv_memory_kernels.h and kv_hash.h, to keep nvcc's front end small.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "transfer/cuda/kv_memory_kernels.h"
#include "transfer/engine/kv_hash.h"

namespace pdsim::transfer::cuda::detail {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
// Grid-stride loops beyond this many blocks.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// The last item whose running index `first` is <= `index` (items are sorted by it, the first
// is 0, and `index` is below the launch's total).
template <typename Item, int64_t Item::*kFirst>
__device__ __forceinline__ const Item& find_item(const Item* items, int64_t count, int64_t index) {
    int64_t lo = 0;
    int64_t hi = count - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (items[mid].*kFirst <= index) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return items[lo];
}

// One warp per token: 16-byte vectors for the bulk when the item allows it, then bytes.
__global__ void kv_copy_kernel(const CopyItem* items, int64_t item_count, int64_t total_tokens) {
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
         t < total_tokens; t += warps) {
        const CopyItem& item = find_item<CopyItem, &CopyItem::first_token>(items, item_count, t);
        const int64_t k = t - item.first_token;
        const unsigned char* src = item.src + k * item.src_stride;
        unsigned char* dst = item.dst + k * item.dst_stride;
        int64_t done = 0;
        if (item.vector16 != 0) {
            const int64_t vectors = item.bytes / 16;
            const auto* src4 = reinterpret_cast<const uint4*>(src);
            auto* dst4 = reinterpret_cast<uint4*>(dst);
            for (int64_t v = lane; v < vectors; v += kWarp) dst4[v] = src4[v];
            done = vectors * 16;
        }
        for (int64_t b = done + lane; b < item.bytes; b += kWarp) dst[b] = src[b];
    }
}

// One thread per (token, head).
__global__ void kv_checksums_kernel(const ChecksumItem* items, int64_t item_count,
                                    int64_t total_work) {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total_work;
         w += threads) {
        const ChecksumItem& item =
            find_item<ChecksumItem, &ChecksumItem::first_work>(items, item_count, w);
        const int64_t local = w - item.first_work;
        const int64_t k = local / item.head_count;
        const int h = static_cast<int>(local % item.head_count);
        const unsigned char* head = item.first + k * item.slot_stride + h * item.head_bytes;
        const uint64_t hash = kv_hash_inline(head, static_cast<size_t>(item.head_bytes),
                                             static_cast<uint64_t>(item.token_begin + k));
        atomicAdd(reinterpret_cast<unsigned long long*>(item.sums + h),
                  static_cast<unsigned long long>(hash));
    }
}

__global__ void kv_fold_sums_kernel(uint64_t* dst, const uint64_t* scratch, int64_t count) {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
         i += threads) {
        dst[i] += scratch[i];
    }
}

// The writes before it on the stream have completed when it starts (stream order); the system-scope
// atomic makes the add itself safe against adds of other GPUs and processes to the same word.
__global__ void signal_add_kernel(unsigned long long* word, unsigned long long add) {
    atomicAdd_system(word, add);
}

// The launch's own error: cudaGetLastError after a launch returns any error still pending on the
// thread, so one left by an earlier failed call (a CUDA_CHECK does not clear it) is cleared first
// instead of being reported as this launch's. A sticky (context) error fails the launch itself.
void clear_stale_error() {
    (void)cudaGetLastError();
}

unsigned blocks_for(int64_t work, int64_t per_block) {
    return static_cast<unsigned>(
        std::clamp<int64_t>((work + per_block - 1) / per_block, 1, kMaxBlocks));
}

}  // namespace

int launch_kv_copy(const CopyItem* items, int64_t item_count, int64_t total_tokens, void* stream) {
    clear_stale_error();
    kv_copy_kernel<<<blocks_for(total_tokens, kWarpsPerBlock), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(items, item_count, total_tokens);
    return static_cast<int>(cudaGetLastError());
}

int launch_kv_checksums(const ChecksumItem* items, int64_t item_count, int64_t total_work,
                        void* stream) {
    clear_stale_error();
    kv_checksums_kernel<<<blocks_for(total_work, kThreads), kThreads, 0,
                          static_cast<cudaStream_t>(stream)>>>(items, item_count, total_work);
    return static_cast<int>(cudaGetLastError());
}

int launch_kv_fold_sums(uint64_t* dst, const uint64_t* scratch, int64_t count, void* stream) {
    clear_stale_error();
    kv_fold_sums_kernel<<<blocks_for(count, kThreads), kThreads, 0,
                          static_cast<cudaStream_t>(stream)>>>(dst, scratch, count);
    return static_cast<int>(cudaGetLastError());
}

int launch_signal_add(uint64_t* word, uint64_t add, void* stream) {
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
    clear_stale_error();
    signal_add_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(add));
    return static_cast<int>(cudaGetLastError());
}

}  // namespace pdsim::transfer::cuda::detail
