// CudaKvMemoryOps (see cuda_kv_memory_ops.h): validation, descriptor staging and launches; the
// kernels are in kv_memory_kernels.cu.
#include "transfer/cuda/cuda_kv_memory_ops.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/cuda_pinned_memory.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/flashinfer_staging.h"
#include "backends/runtime/device.h"
#include "common/cuda_check.h"
#include "common/device_health.h"
#include "transfer/cuda/kv_memory_kernels.h"

namespace pdsim::transfer::cuda {

namespace {

using detail::ChecksumItem;
using detail::CopyItem;

constexpr size_t kSlotAlignment = 256;

size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A caller buffer as the kernels reach it.
struct CallerMemory {
    void* device = nullptr;  // the address a kernel uses
    bool host = false;       // mapped pinned host memory
};

// The memory of allocate_staging (device memory, runtime::DeviceBuffer) and allocate_sums (mapped
// pinned host memory), in power-of-two size classes. A handle gives its block back to the free
// list of its class without a CUDA call (so it may be dropped on any thread); take() reuses a
// free block of the class, trims the free lists to kMaxCachedBytes (CUDA calls: take() runs on
// a caller's thread), and allocates otherwise. Everything is freed when the cache goes: the ops
// and every handle share it. Thread-safe.
class MemoryCache : public std::enable_shared_from_this<MemoryCache> {
public:
    static constexpr size_t kMinBlock = 4096;
    static constexpr size_t kMaxCachedBytes = size_t{256} << 20;

    explicit MemoryCache(int device) : device_(device) {}
    ~MemoryCache() {
        runtime::cuda::ScopedDevice scoped(device_);
        // cudaFreeHost waits for the device: not on a hung one (common/device_health.h).
        if (!device_hung(device_)) {
            for (auto& [p, bytes] : host_blocks_) cudaFreeHost(p);
        }
        device_blocks_.clear();  // cudaFree through the runtime (which skips a hung device)
    }
    MemoryCache(const MemoryCache&) = delete;
    MemoryCache& operator=(const MemoryCache&) = delete;

    // Device memory (`host` false) or zeroed mapped pinned host memory (`host` true).
    StatusOr<KvOpsMemory> take(bool host, size_t bytes) {
        const size_t block = block_size(bytes);
        void* p = nullptr;
        std::vector<runtime::DeviceBuffer> drop_device;
        std::vector<void*> drop_host;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto& free = host ? free_host_ : free_device_;
            if (auto it = free.find(block); it != free.end() && !it->second.empty()) {
                p = it->second.back();
                it->second.pop_back();
                cached_bytes_ -= block;
            }
            trim_locked(drop_device, drop_host);
        }
        if (!drop_host.empty() || !drop_device.empty()) {
            runtime::cuda::ScopedDevice scoped(device_);
            for (void* h : drop_host) cudaFreeHost(h);
            drop_device.clear();
        }
        if (p == nullptr) {
            PDSIM_ASSIGN_OR_RETURN(p, allocate(host, block));
        }
        if (host) std::memset(p, 0, block);
        std::shared_ptr<MemoryCache> self = shared_from_this();
        return KvOpsMemory(p, block, host, [self, host](void* data, size_t size) {
            self->give_back(host, data, size);
        });
    }

private:
    static size_t block_size(size_t bytes) {
        size_t block = kMinBlock;
        while (block < bytes) block *= 2;
        return block;
    }

    StatusOr<void*> allocate(bool host, size_t block) {
        if (host) {
            runtime::cuda::ScopedDevice scoped(device_);
            PDSIM_RETURN_IF_ERROR(scoped.status());
            void* p = nullptr;
            CUDA_CHECK(cudaHostAlloc(&p, block, cudaHostAllocMapped | cudaHostAllocPortable));
            std::lock_guard<std::mutex> lock(mu_);
            host_blocks_[p] = block;
            return p;
        }
        PDSIM_ASSIGN_OR_RETURN(
            runtime::DeviceBuffer buffer,
            runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, device_}, block));
        void* p = buffer.data();
        std::lock_guard<std::mutex> lock(mu_);
        device_blocks_.emplace(p, std::move(buffer));
        return p;
    }

    void give_back(bool host, void* p, size_t block) {
        std::lock_guard<std::mutex> lock(mu_);
        (host ? free_host_ : free_device_)[block].push_back(p);
        cached_bytes_ += block;
    }

    // Takes free blocks (largest classes first) out of the cache until it holds at most
    // kMaxCachedBytes; the caller frees them outside the lock.
    void trim_locked(std::vector<runtime::DeviceBuffer>& drop_device,
                     std::vector<void*>& drop_host) {
        for (auto* free : {&free_device_, &free_host_}) {
            for (auto it = free->rbegin(); it != free->rend() && cached_bytes_ > kMaxCachedBytes;
                 ++it) {
                while (!it->second.empty() && cached_bytes_ > kMaxCachedBytes) {
                    void* p = it->second.back();
                    it->second.pop_back();
                    cached_bytes_ -= it->first;
                    if (free == &free_host_) {
                        host_blocks_.erase(p);
                        drop_host.push_back(p);
                    } else {
                        auto block = device_blocks_.find(p);
                        drop_device.push_back(std::move(block->second));
                        device_blocks_.erase(block);
                    }
                }
            }
        }
    }

    const int device_;
    std::mutex mu_;
    std::unordered_map<void*, runtime::DeviceBuffer> device_blocks_;  // every device block
    std::unordered_map<void*, size_t> host_blocks_;                   // every pinned block
    std::map<size_t, std::vector<void*>> free_device_;                // by block size
    std::map<size_t, std::vector<void*>> free_host_;
    size_t cached_bytes_ = 0;  // in the free lists
};

// One launch's share of a call: items [begin, end); for checksums into host sums, the sums
// [sum_lo, sum_hi) it touches (its device scratch).
struct LaunchBatch {
    size_t begin = 0;
    size_t end = 0;
    uint64_t sum_lo = 0;
    uint64_t sum_hi = 0;
};

class CudaKvMemoryOps final : public KvMemoryOps {
public:
    CudaKvMemoryOps(const CudaKvMemoryOpsOptions& options, runtime::DeviceBuffer device_slots,
                    std::unique_ptr<attn::cuda::PinnedStagingRing> ring)
        : options_(options),
          device_slots_(std::move(device_slots)),
          ring_(std::move(ring)),
          memory_(std::make_shared<MemoryCache>(options.device)) {}

    [[nodiscard]] runtime::DeviceKind memory_kind() const override {
        return runtime::DeviceKind::kCuda;
    }
    [[nodiscard]] std::string_view name() const override { return "cuda"; }

    [[nodiscard]] Status enqueue_gather(runtime::Stream& stream, const KvLayout& layout,
                                        std::span<const KvCopyOp> ops,
                                        std::byte* staging) override {
        return enqueue_copies(stream, layout, ops, staging, KvCopyDirection::kGather);
    }
    [[nodiscard]] Status enqueue_scatter(runtime::Stream& stream, const KvLayout& layout,
                                         std::span<const KvCopyOp> ops,
                                         const std::byte* staging) override {
        return enqueue_copies(stream, layout, ops, staging, KvCopyDirection::kScatter);
    }
    [[nodiscard]] Status enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                           std::span<const KvChecksumOp> ops,
                                           uint64_t* sums_out) override;
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_staging(size_t bytes) override {
        return memory_->take(/*host=*/false, std::max<size_t>(bytes, 1));
    }
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_sums(size_t count) override {
        return memory_->take(/*host=*/true, std::max<size_t>(count, 1) * sizeof(uint64_t));
    }
    // The device waits on the word (cuStreamWaitValue64, GEQ): no host thread, no timeout.
    [[nodiscard]] Status enqueue_wait_value(runtime::Stream& stream, const uint64_t* word,
                                            uint64_t value,
                                            std::chrono::milliseconds /*timeout*/) override {
        if (stream.device() != runtime::Device{runtime::DeviceKind::kCuda, options_.device}) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda ops of GPU {}: value wait on stream {} of another device",
                               options_.device, stream.name());
        }
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
        return runtime::cuda::stream_wait_value64_geq(options_.device, s, word, value);
    }

private:
    [[nodiscard]] StatusOr<cudaStream_t> check_target(runtime::Stream& stream,
                                                      const KvLayout& layout) const;
    [[nodiscard]] StatusOr<CallerMemory> caller_memory(const void* p, const char* what) const;
    [[nodiscard]] Status enqueue_copies(runtime::Stream& stream, const KvLayout& layout,
                                        std::span<const KvCopyOp> ops, const std::byte* staging,
                                        KvCopyDirection direction);
    // Acquires a slot, lets `fill` write the host side (returns the bytes to copy), copies them
    // to the slot's device array and lets `launch` enqueue the kernels reading it; then marks the
    // slot in flight behind them.
    template <typename Fill, typename Launch>
    [[nodiscard]] Status run_slot(cudaStream_t s, Fill&& fill, Launch&& launch);

    const CudaKvMemoryOpsOptions options_;
    std::mutex mu_;                       // one driver of the ring at a time
    runtime::DeviceBuffer device_slots_;  // slots * slot_bytes, slot i at i * slot_bytes
    // Destroyed before device_slots_: its destructor waits for the slots in flight.
    std::unique_ptr<attn::cuda::PinnedStagingRing> ring_;
    // allocate_staging / allocate_sums (shared with the handles, which may outlive the ops).
    std::shared_ptr<MemoryCache> memory_;
};

StatusOr<cudaStream_t> CudaKvMemoryOps::check_target(runtime::Stream& stream,
                                                     const KvLayout& layout) const {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    if (stream.device().index != options_.device) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "stream {} is on cuda:{}; these KV memory ops run on cuda:{}",
                           stream.name(), stream.device().index, options_.device);
    }
    if (stream.is_capturing()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "stream {} is capturing a graph: the CUDA KV memory ops stage their "
                           "descriptors through a reused ring slot and cannot be captured",
                           stream.name());
    }
    const runtime::Device want{runtime::DeviceKind::kCuda, options_.device};
    if (layout.device() != want) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layout: memory on {}:{}; these KV memory ops run on cuda:{}",
                           runtime::device_kind_name(layout.device().kind), layout.device().index,
                           options_.device);
    }
    return s;
}

StatusOr<CallerMemory> CudaKvMemoryOps::caller_memory(const void* p, const char* what) const {
    if (p == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: null", what);
    cudaPointerAttributes a{};
    const cudaError_t rc = cudaPointerGetAttributes(&a, p);
    if (rc != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: not memory CUDA knows ({})", what,
                           cudaGetErrorString(rc));
    }
    switch (a.type) {
        case cudaMemoryTypeDevice:
            if (a.device != options_.device) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "{}: memory of cuda:{}; these KV memory ops run on cuda:{}",
                                   what, a.device, options_.device);
            }
            return CallerMemory{.device = const_cast<void*>(p), .host = false};
        case cudaMemoryTypeManaged:
            return CallerMemory{.device = const_cast<void*>(p), .host = false};
        case cudaMemoryTypeHost:
            if (a.devicePointer == nullptr) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "{}: pinned host memory that is not mapped into the device's "
                                   "address space (allocate it with cudaHostAllocMapped)",
                                   what);
            }
            return CallerMemory{.device = a.devicePointer, .host = true};
        default:
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "{}: pageable host memory; use device memory or mapped pinned "
                               "host memory (cudaHostAlloc)",
                               what);
    }
}

template <typename Fill, typename Launch>
Status CudaKvMemoryOps::run_slot(cudaStream_t s, Fill&& fill, Launch&& launch) {
    PDSIM_ASSIGN_OR_RETURN(attn::cuda::PinnedStagingRing::Slot slot,
                           ring_->acquire(options_.wait_timeout));
    std::byte* device =
        device_slots_.as<std::byte>() + static_cast<size_t>(slot.index) * options_.slot_bytes;
    const size_t bytes = fill(slot.data.data(), device);
    const cudaError_t copied =
        cudaMemcpyAsync(device, slot.data.data(), bytes, cudaMemcpyHostToDevice, s);
    if (copied != cudaSuccess) {
        ring_->abandon(slot.index);  // nothing reads the slot
        CUDA_CHECK(copied);
    }
    Status launched = launch(device);
    // The copy is enqueued whatever the launch did: the slot stays in flight behind it.
    Status committed = ring_->commit(slot.index, s);
    PDSIM_RETURN_IF_ERROR(launched);
    return committed;
}

Status CudaKvMemoryOps::enqueue_copies(runtime::Stream& stream, const KvLayout& layout,
                                       std::span<const KvCopyOp> ops, const std::byte* staging,
                                       KvCopyDirection direction) {
    std::lock_guard<std::mutex> lock(mu_);
    runtime::cuda::ScopedDevice scoped(options_.device);
    PDSIM_RETURN_IF_ERROR(scoped.status());
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, check_target(stream, layout));
    PDSIM_RETURN_IF_ERROR(check_copy_ops(layout, ops, direction));
    std::vector<CopyItem> items;
    items.reserve(ops.size());
    for (const KvCopyOp& op : ops) {
        if (op.token_count > 0) items.push_back(CopyItem{});
    }
    if (items.empty()) return {};
    PDSIM_ASSIGN_OR_RETURN(CallerMemory staging_memory, caller_memory(staging, "staging"));
    auto* staging_device = static_cast<unsigned char*>(staging_memory.device);
    size_t next = 0;
    for (const KvCopyOp& op : ops) {
        if (op.token_count < 1) continue;
        auto* slots = reinterpret_cast<unsigned char*>(layout.base(op.layer, op.buf));
        const bool gather = direction == KvCopyDirection::kGather;
        const unsigned char* src =
            gather ? slots + static_cast<uint64_t>(op.src_slot) * op.src_stride + op.src_offset
                   : staging_device + op.src_offset;
        unsigned char* dst =
            gather ? staging_device + op.dst_offset
                   : slots + static_cast<uint64_t>(op.dst_slot) * op.dst_stride + op.dst_offset;
        items[next++] = CopyItem{
            .src = src,
            .dst = dst,
            .src_stride = static_cast<int64_t>(op.src_stride),
            .dst_stride = static_cast<int64_t>(op.dst_stride),
            .bytes = static_cast<int64_t>(op.bytes),
            .token_count = op.token_count,
            .first_token = 0,
            .vector16 = aligned16(src) && aligned16(dst) && op.src_stride % 16 == 0 &&
                                op.dst_stride % 16 == 0
                            ? 1
                            : 0,
        };
    }
    const size_t per_slot = options_.slot_bytes / sizeof(CopyItem);
    for (size_t begin = 0; begin < items.size(); begin += per_slot) {
        const size_t end = std::min(items.size(), begin + per_slot);
        int64_t tokens = 0;
        PDSIM_RETURN_IF_ERROR(run_slot(
            s,
            [&](std::byte* host, std::byte*) {
                auto* out = reinterpret_cast<CopyItem*>(host);
                for (size_t i = begin; i < end; ++i) {
                    out[i - begin] = items[i];
                    out[i - begin].first_token = tokens;
                    tokens += items[i].token_count;
                }
                return (end - begin) * sizeof(CopyItem);
            },
            [&](std::byte* device) -> Status {
                CUDA_CHECK(static_cast<cudaError_t>(
                    detail::launch_kv_copy(reinterpret_cast<const CopyItem*>(device),
                                           static_cast<int64_t>(end - begin), tokens, s)));
                return {};
            }));
    }
    return {};
}

Status CudaKvMemoryOps::enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                          std::span<const KvChecksumOp> ops, uint64_t* sums_out) {
    std::lock_guard<std::mutex> lock(mu_);
    runtime::cuda::ScopedDevice scoped(options_.device);
    PDSIM_RETURN_IF_ERROR(scoped.status());
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, check_target(stream, layout));
    PDSIM_RETURN_IF_ERROR(check_checksum_ops(layout, ops));
    std::vector<const KvChecksumOp*> work;
    work.reserve(ops.size());
    for (const KvChecksumOp& op : ops) {
        if (op.token_count > 0) work.push_back(&op);
    }
    if (work.empty()) return {};
    PDSIM_ASSIGN_OR_RETURN(CallerMemory sums_memory, caller_memory(sums_out, "sums_out"));
    auto* sums_device = static_cast<uint64_t*>(sums_memory.device);

    // Batches: as many items as a slot holds, and, for host sums, their scratch with them.
    std::vector<LaunchBatch> batches;
    for (size_t begin = 0; begin < work.size();) {
        LaunchBatch b{.begin = begin, .end = begin};
        uint64_t lo = UINT64_MAX;
        uint64_t hi = 0;
        while (b.end < work.size()) {
            const KvChecksumOp& op = *work[b.end];
            const uint64_t new_lo = std::min(lo, op.sum_index);
            const uint64_t new_hi =
                std::max(hi, op.sum_index + static_cast<uint64_t>(op.head_count));
            size_t need = (b.end + 1 - begin) * sizeof(ChecksumItem);
            if (sums_memory.host) {
                need = align_up(need, kSlotAlignment) + (new_hi - new_lo) * sizeof(uint64_t);
            }
            if (need > options_.slot_bytes) break;
            lo = new_lo;
            hi = new_hi;
            ++b.end;
        }
        if (b.end == begin) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "checksum op with sum_index {} and {} heads does not fit a "
                               "descriptor slot of {} bytes (slot_bytes)",
                               work[begin]->sum_index, work[begin]->head_count,
                               options_.slot_bytes);
        }
        b.sum_lo = lo;
        b.sum_hi = hi;
        batches.push_back(b);
        begin = b.end;
    }

    for (const LaunchBatch& b : batches) {
        const size_t items_bytes = (b.end - b.begin) * sizeof(ChecksumItem);
        const size_t scratch_offset = align_up(items_bytes, kSlotAlignment);
        const uint64_t sum_count = b.sum_hi - b.sum_lo;
        int64_t total_work = 0;
        PDSIM_RETURN_IF_ERROR(run_slot(
            s,
            [&](std::byte* host, std::byte* device) {
                auto* out = reinterpret_cast<ChecksumItem*>(host);
                auto* scratch = reinterpret_cast<uint64_t*>(device + scratch_offset);
                for (size_t i = b.begin; i < b.end; ++i) {
                    const KvChecksumOp& op = *work[i];
                    const auto* base =
                        reinterpret_cast<const unsigned char*>(layout.base(op.layer, op.buf));
                    out[i - b.begin] = ChecksumItem{
                        .first = base + static_cast<uint64_t>(op.slot) * op.slot_stride + op.offset,
                        .sums = sums_memory.host ? scratch + (op.sum_index - b.sum_lo)
                                                 : sums_device + op.sum_index,
                        .slot_stride = static_cast<int64_t>(op.slot_stride),
                        .head_bytes = static_cast<int64_t>(op.head_bytes),
                        .token_begin = op.token_begin,
                        .token_count = op.token_count,
                        .first_work = total_work,
                        .head_count = op.head_count,
                    };
                    total_work += op.token_count * op.head_count;
                }
                return items_bytes;
            },
            [&](std::byte* device) -> Status {
                auto* scratch = reinterpret_cast<uint64_t*>(device + scratch_offset);
                if (sums_memory.host) {
                    CUDA_CHECK(cudaMemsetAsync(scratch, 0, sum_count * sizeof(uint64_t), s));
                }
                CUDA_CHECK(static_cast<cudaError_t>(detail::launch_kv_checksums(
                    reinterpret_cast<const ChecksumItem*>(device),
                    static_cast<int64_t>(b.end - b.begin), total_work, s)));
                if (sums_memory.host) {
                    CUDA_CHECK(static_cast<cudaError_t>(detail::launch_kv_fold_sums(
                        sums_device + b.sum_lo, scratch, static_cast<int64_t>(sum_count), s)));
                }
                return {};
            }));
    }
    return {};
}

}  // namespace

StatusOr<std::unique_ptr<KvMemoryOps>> make_cuda_kv_memory_ops(
    const CudaKvMemoryOpsOptions& options) {
    if (options.device < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "options.device: {} must be >= 0",
                           options.device);
    }
    if (options.slots < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "options.slots: {} must be >= 1",
                           options.slots);
    }
    if (options.slot_bytes < 4096 || options.slot_bytes % kSlotAlignment != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "options.slot_bytes: {} must be a multiple of {} and >= 4096",
                           options.slot_bytes, kSlotAlignment);
    }
    if (options.wait_timeout.count() < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "options.wait_timeout: {} ms must be >= 1 ms",
                           options.wait_timeout.count());
    }
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                           runtime::device_runtime(runtime::DeviceKind::kCuda));
    if (options.device >= rt->device_count()) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "cuda:{}: {}", options.device,
                           rt->device_count() == 0
                               ? rt->unavailable_reason()
                               : fmt::format("only {} devices", rt->device_count()));
    }
    runtime::cuda::ScopedDevice scoped(options.device);
    PDSIM_RETURN_IF_ERROR(scoped.status());
    PDSIM_ASSIGN_OR_RETURN(
        runtime::DeviceBuffer device_slots,
        runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, options.device},
                                        static_cast<size_t>(options.slots) * options.slot_bytes));
    PDSIM_ASSIGN_OR_RETURN(
        std::unique_ptr<attn::cuda::PinnedStagingRing> ring,
        attn::cuda::PinnedStagingRing::create(attn::cuda::make_cuda_pinned_memory(options.device),
                                              options.slots, options.slot_bytes));
    return std::unique_ptr<KvMemoryOps>(
        std::make_unique<CudaKvMemoryOps>(options, std::move(device_slots), std::move(ring)));
}

}  // namespace pdsim::transfer::cuda
