// HostKvMemoryOps (see kv_memory_ops.h). make_kv_memory_ops is in transfer/builtin.cpp.
#include "transfer/engine/kv_memory_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "transfer/engine/kv_hash.h"

namespace pdsim::transfer {

Status KvMemoryOps::enqueue_wait_value(runtime::Stream& stream, const uint64_t* word,
                                       uint64_t value, std::chrono::milliseconds timeout) {
    if (word == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: wait on a null word", name());
    }
    return stream.enqueue([word, value, timeout]() -> Status {
        // The word is written with atomic adds (post_signal); read it as an atomic.
        std::atomic_ref<uint64_t> atom(*const_cast<uint64_t*>(word));
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (int polls = 0;; ++polls) {
            const uint64_t now = atom.load(std::memory_order_acquire);
            if (static_cast<int64_t>(now - value) >= 0) return Status();
            if (std::chrono::steady_clock::now() > deadline) {
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "arrival word at {} is {} after {} ms, waiting for >= {}",
                                   static_cast<const void*>(word), now, timeout.count(), value);
            }
            if (polls < 1000) {
                std::this_thread::yield();
            } else {
                std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
        }
    });
}

namespace {

Status check_host_layout(const KvLayout& layout) {
    if (layout.device().kind != runtime::DeviceKind::kCpu) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layout: memory on {}:{}; HostKvMemoryOps works on cpu memory",
                           runtime::device_kind_name(layout.device().kind), layout.device().index);
    }
    return {};
}

bool has_tokens(std::span<const KvCopyOp> ops) {
    for (const KvCopyOp& op : ops) {
        if (op.token_count > 0) return true;
    }
    return false;
}

// Token k of a slot-side run: `stride` is the buffer's token_bytes (check_copy_ops).
std::byte* slot_address(const KvLayout& layout, const KvCopyOp& op, int64_t slot, uint64_t offset,
                        uint64_t stride, int64_t k) {
    return layout.base(op.layer, op.buf) + static_cast<uint64_t>(slot + k) * stride + offset;
}

// `ops` passed check_copy_ops(kGather): slots -> staging.
void run_gather(const KvLayout& layout, const std::vector<KvCopyOp>& ops, std::byte* staging) {
    for (const KvCopyOp& op : ops) {
        for (int64_t k = 0; k < op.token_count; ++k) {
            std::memcpy(staging + op.dst_offset + static_cast<uint64_t>(k) * op.dst_stride,
                        slot_address(layout, op, op.src_slot, op.src_offset, op.src_stride, k),
                        op.bytes);
        }
    }
}

// `ops` passed check_copy_ops(kScatter): staging -> slots.
void run_scatter(const KvLayout& layout, const std::vector<KvCopyOp>& ops,
                 const std::byte* staging) {
    for (const KvCopyOp& op : ops) {
        for (int64_t k = 0; k < op.token_count; ++k) {
            std::memcpy(slot_address(layout, op, op.dst_slot, op.dst_offset, op.dst_stride, k),
                        staging + op.src_offset + static_cast<uint64_t>(k) * op.src_stride,
                        op.bytes);
        }
    }
}

}  // namespace

Status HostKvMemoryOps::enqueue_gather(runtime::Stream& stream, const KvLayout& layout,
                                       std::span<const KvCopyOp> ops, std::byte* staging) {
    PDSIM_RETURN_IF_ERROR(check_host_layout(layout));
    PDSIM_RETURN_IF_ERROR(check_copy_ops(layout, ops, KvCopyDirection::kGather));
    if (!has_tokens(ops)) return {};
    if (staging == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "staging: null");
    return stream.enqueue([layout, ops = std::vector<KvCopyOp>(ops.begin(), ops.end()), staging] {
        run_gather(layout, ops, staging);
        return Status();
    });
}

Status HostKvMemoryOps::enqueue_scatter(runtime::Stream& stream, const KvLayout& layout,
                                        std::span<const KvCopyOp> ops, const std::byte* staging) {
    PDSIM_RETURN_IF_ERROR(check_host_layout(layout));
    PDSIM_RETURN_IF_ERROR(check_copy_ops(layout, ops, KvCopyDirection::kScatter));
    if (!has_tokens(ops)) return {};
    if (staging == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "staging: null");
    return stream.enqueue([layout, ops = std::vector<KvCopyOp>(ops.begin(), ops.end()), staging] {
        run_scatter(layout, ops, staging);
        return Status();
    });
}

Status HostKvMemoryOps::enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                          std::span<const KvChecksumOp> ops, uint64_t* sums_out) {
    PDSIM_RETURN_IF_ERROR(check_host_layout(layout));
    PDSIM_RETURN_IF_ERROR(check_checksum_ops(layout, ops));
    bool work = false;
    for (const KvChecksumOp& op : ops) work = work || op.token_count > 0;
    if (!work) return {};
    if (sums_out == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "sums_out: null");
    return stream.enqueue(
        [layout, ops = std::vector<KvChecksumOp>(ops.begin(), ops.end()), sums_out] {
            for (const KvChecksumOp& op : ops) {
                const std::byte* base = layout.base(op.layer, op.buf);
                uint64_t* sums = sums_out + op.sum_index;
                for (int64_t k = 0; k < op.token_count; ++k) {
                    const std::byte* token =
                        base + static_cast<uint64_t>(op.slot + k) * op.slot_stride + op.offset;
                    const auto seed = static_cast<uint64_t>(op.token_begin + k);
                    for (int h = 0; h < op.head_count; ++h) {
                        sums[h] += kv_hash_inline(token + static_cast<uint64_t>(h) * op.head_bytes,
                                                  op.head_bytes, seed);
                    }
                }
            }
            return Status();
        });
}

StatusOr<KvOpsMemory> HostKvMemoryOps::allocate_staging(size_t bytes) {
    constexpr size_t kAlign = 256;
    const size_t rounded = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, rounded);
    if (p == nullptr) {
        return PDSIM_ERROR(StatusCode::kResourceExhausted,
                           "host KV memory ops: staging of {} bytes could not be allocated", bytes);
    }
    return KvOpsMemory(p, rounded, /*host_readable=*/true,
                       [](void* data, size_t) { std::free(data); });
}

StatusOr<KvOpsMemory> HostKvMemoryOps::allocate_sums(size_t count) {
    const size_t n = std::max<size_t>(count, 1);
    void* p = std::calloc(n, sizeof(uint64_t));
    if (p == nullptr) {
        return PDSIM_ERROR(StatusCode::kResourceExhausted,
                           "host KV memory ops: {} sums could not be allocated", count);
    }
    return KvOpsMemory(p, n * sizeof(uint64_t), /*host_readable=*/true,
                       [](void* data, size_t) { std::free(data); });
}

}  // namespace pdsim::transfer
