// Plans of the transfer engine's memory work (gathers, scatters, checksums) as flat descriptors
// that a kernel can consume from a device array: planning is separate from running (as in
// FlashInfer's plan/run split). A builder turns the engine's plan types (KvLayout, Fragment,
// TokenRun, transfer_plan.h) into descriptors once, with every derived field (strides, offsets,
// output positions) computed; a KvMemoryOps (kv_memory_ops.h) runs them on a stream, on the host
// or on a GPU, and computes nothing but addresses.
//
// Addressing. Descriptors carry no addresses: a slot s of (layer, buf) is at
//     layout.base(layer, buf) + s * token_bytes(buf)
// (slot_addr(); pages are page_size consecutive slots, so a run of consecutive slots is
// contiguous, token_bytes apart), and the staging buffer and the sums array are passed to the
// enqueue call. The same plan can therefore run on any layout with the same summary and pages.
//
// KvCopyOp: token_count tokens of (layer, buf), `bytes` per token, from one side to the other.
// Each side is either the layout's slots (slot >= 0: token k at slot + k, `offset` bytes into the
// slot, stride == token_bytes(buf)) or the staging buffer (slot == kStagingSlot: token k at
// staging + offset + k * stride). A gather reads slots and writes staging; a scatter the reverse.
//
// KvChecksumOp: the ordering validator's checksum terms (ordering_validator.h) of token_count
// tokens: for token k (seed token_begin + k) and head h in [0, head_count),
//     sums[sum_index + h] += kv_hash(slot_addr(slot + k) + offset + h * head_bytes, head_bytes,
//                                    token_begin + k)     (mod 2^64)
// exactly what kv_checksums_add_run adds; sums are added, never assigned, so ops may share sums
// and their order does not matter.
//
// Staging layout (KvStagingPlan): one buffer per (chunk, fragment, layer range) holding every
// (layer, buf, run) message of the engine's order (layer ascending, then buffer, then run; see
// transfer_plan.h), each packed [token][fragment bytes] and starting at a multiple of
// kStagingAlignment. plan_gather (sender, source side) and plan_scatter (receiver, destination
// side) of the same fragment and runs give the same offsets, so a staging buffer gathered on one
// side scatters on the other unchanged.
//
// Checksum layout (KvChecksumPlan): sums [layer][buf][head] for every layer of the layout (not
// only the planned range), head_count heads per (layer, buf): the engine's `observed` arrays, so
// several layer ranges accumulate into one array.
//
// Errors: every builder and check returns kInvalidArgument naming what is wrong (a layer range,
// a run outside the pool, a head range outside the layout, an op's field) and produces nothing.
// Thread-safety: pure functions on values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "common/status.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer {

// The slot of a KvCopyOp side that is the staging buffer.
inline constexpr int64_t kStagingSlot = -1;
// Every message in a staging plan starts at a multiple of this (16-byte vector copies).
inline constexpr uint64_t kStagingAlignment = 16;

struct KvCopyOp {
    int32_t layer = 0;
    int32_t buf = 0;
    int64_t token_count = 0;
    int64_t src_slot = 0;     // slot of the first token, or kStagingSlot
    uint64_t src_offset = 0;  // bytes into each slot; staging: of the first token
    uint64_t src_stride = 0;  // bytes from a token to the next (slots: token_bytes(buf))
    int64_t dst_slot = kStagingSlot;
    uint64_t dst_offset = 0;
    uint64_t dst_stride = 0;
    uint64_t bytes = 0;  // per token
    friend bool operator==(const KvCopyOp&, const KvCopyOp&) = default;
};
static_assert(std::is_trivially_copyable_v<KvCopyOp> && std::is_standard_layout_v<KvCopyOp>);

struct KvChecksumOp {
    int32_t layer = 0;
    int32_t buf = 0;
    int64_t token_begin = 0;  // seed of the first token
    int64_t token_count = 0;
    int64_t slot = 0;          // slot of token_begin; the others follow consecutively
    uint64_t offset = 0;       // bytes into each slot of the first head
    uint64_t slot_stride = 0;  // token_bytes(buf)
    int32_t head_count = 0;
    int32_t reserved = 0;  // 0
    uint64_t head_bytes = 0;
    uint64_t sum_index = 0;  // the first head's sum; head h adds into sums[sum_index + h]
    friend bool operator==(const KvChecksumOp&, const KvChecksumOp&) = default;
};
static_assert(std::is_trivially_copyable_v<KvChecksumOp> &&
              std::is_standard_layout_v<KvChecksumOp>);

// Which side of a Fragment / TokenRun a plan addresses: the prefill rank's (src_slot,
// src_offset) or the decode rank's (dst_slot, dst_offset).
enum class KvSide : uint8_t { kSource, kDestination };

// One (layer, buf, run) message inside a staging buffer.
struct KvStagedMessage {
    int32_t layer = 0;
    int32_t buf = 0;
    int32_t run = 0;  // index into the plan's runs
    uint64_t staging_offset = 0;
    uint64_t bytes = 0;  // frag.bytes[buf] * run.count
    friend bool operator==(const KvStagedMessage&, const KvStagedMessage&) = default;
};

struct KvStagingPlan {
    int layer_begin = 0;
    int layer_end = 0;
    int buffer_count = 0;
    int run_count = 0;
    // Engine message order: layer, then buffer, then run. ops[i] moves messages[i].
    std::vector<KvStagedMessage> messages;
    std::vector<KvCopyOp> ops;
    uint64_t staging_bytes = 0;  // the buffer's size (the end of the last message)

    // The message of (layer, buf, run); precondition: inside the plan's ranges.
    [[nodiscard]] const KvStagedMessage& message(int layer, int buf, int run) const {
        return messages[(static_cast<size_t>(layer - layer_begin) *
                             static_cast<size_t>(buffer_count) +
                         static_cast<size_t>(buf)) *
                            static_cast<size_t>(run_count) +
                        static_cast<size_t>(run)];
    }
};

struct KvChecksumPlan {
    int num_layers = 0;  // the layout's, so sums cover every layer
    int buffer_count = 0;
    int head_begin = 0;  // global index of the first summed head
    int head_count = 0;
    std::vector<KvChecksumOp> ops;
    size_t sum_count = 0;  // num_layers * buffer_count * head_count

    // Index of the sum of head head_begin of (layer, buf).
    [[nodiscard]] size_t sum_index(int layer, int buf) const {
        return (static_cast<size_t>(layer) * static_cast<size_t>(buffer_count) +
                static_cast<size_t>(buf)) *
               static_cast<size_t>(head_count);
    }
};

// Sender side: the ops that copy `frag`'s bytes of every (layer in [layer_begin, layer_end),
// buf, run) from `src`'s slots (run.src_slot, frag.src_offset) into one staging buffer. `src` is
// the prefill rank's layout the fragment was made for (its heads hold the fragment's).
[[nodiscard]] StatusOr<KvStagingPlan> plan_gather(const KvLayout& src, const Fragment& frag,
                                                  std::span<const TokenRun> runs, int layer_begin,
                                                  int layer_end);
// Receiver side: the ops that copy the same staging layout into `dst`'s slots (run.dst_slot,
// frag.dst_offset).
[[nodiscard]] StatusOr<KvStagingPlan> plan_scatter(const KvLayout& dst, const Fragment& frag,
                                                   std::span<const TokenRun> runs, int layer_begin,
                                                   int layer_end);

// The checksums of `frag`'s heads over `runs` on `side` of the fragment (the sender's read
// checks: kSource on the prefill layout), for layers [layer_begin, layer_end); head_begin =
// frag.head_begin, head_count = frag.head_count.
[[nodiscard]] StatusOr<KvChecksumPlan> plan_fragment_checksums(const KvLayout& layout, KvSide side,
                                                               const Fragment& frag,
                                                               std::span<const TokenRun> runs,
                                                               int layer_begin, int layer_end);
// The checksums of tokens [t0, t1) of a request with page table `pages`, for heads
// [head_begin, head_begin + head_count) (global; inside the layout's), layers [layer_begin,
// layer_end): what kv_checksums computes (the compute stream's truth, the receiver's landed
// check), one op per page segment.
[[nodiscard]] StatusOr<KvChecksumPlan> plan_page_checksums(const KvLayout& layout,
                                                           std::span<const int32_t> pages,
                                                           int64_t t0, int64_t t1, int layer_begin,
                                                           int layer_end, int head_begin,
                                                           int head_count);

// What a KvMemoryOps checks before it enqueues anything.
enum class KvCopyDirection : uint8_t {
    kGather,   // slots -> staging
    kScatter,  // staging -> slots
};
// OK when every op fits `layout` (layer, buffer, slots inside the pool, offset + bytes inside a
// slot, slot stride == token_bytes) and moves in `direction` with a staging stride >= bytes;
// kInvalidArgument naming the op's index and field otherwise.
[[nodiscard]] Status check_copy_ops(const KvLayout& layout, std::span<const KvCopyOp> ops,
                                    KvCopyDirection direction);
// OK when every op fits `layout` (layer, buffer, slots, heads inside a slot, slot stride);
// kInvalidArgument naming the op's index and field otherwise.
[[nodiscard]] Status check_checksum_ops(const KvLayout& layout, std::span<const KvChecksumOp> ops);
// The staging bytes `ops` touch: max over ops of offset + (token_count - 1) * stride + bytes on
// the staging side (0 for no tokens). Precondition: check_copy_ops is OK.
[[nodiscard]] uint64_t staging_extent(std::span<const KvCopyOp> ops);
// The sums `ops` touch: max over ops of sum_index + head_count (0 for none).
[[nodiscard]] uint64_t sums_extent(std::span<const KvChecksumOp> ops);

}  // namespace pdsim::transfer
