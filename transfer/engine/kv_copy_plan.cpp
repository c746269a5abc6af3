#include "transfer/engine/kv_copy_plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace pdsim::transfer {

namespace {

uint64_t align_up(uint64_t value, uint64_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

Status check_layer_range(const KvLayout& layout, int layer_begin, int layer_end) {
    if (layer_begin < 0 || layer_end < layer_begin || layer_end > layout.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer range [{}, {}) is outside the layout's {} layers", layer_begin,
                           layer_end, layout.num_layers());
    }
    return {};
}

// Heads [head_begin, head_begin + head_count) inside the layout's.
Status check_heads(const KvLayout& layout, int head_begin, int head_count) {
    if (head_count < 1 || head_begin < layout.head_begin() ||
        head_begin + head_count > layout.head_begin() + layout.local_heads()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "head range [{}, {}) is outside the layout's heads [{}, {})", head_begin,
                           head_begin + head_count, layout.head_begin(),
                           layout.head_begin() + layout.local_heads());
    }
    return {};
}

// The fragment's side `side` is consistent with `layout`: its heads are the layout's, and per
// buffer its offset and bytes are those heads inside a slot.
Status check_fragment(const KvLayout& layout, KvSide side, const Fragment& frag) {
    PDSIM_RETURN_IF_ERROR(
        check_heads(layout, frag.head_begin, frag.head_count).with_context("fragment"));
    for (int b = 0; b < layout.buffer_count(); ++b) {
        const auto i = static_cast<size_t>(b);
        const size_t offset = side == KvSide::kSource ? frag.src_offset[i] : frag.dst_offset[i];
        const size_t want_offset =
            static_cast<size_t>(frag.head_begin - layout.head_begin()) * layout.head_bytes(b);
        const size_t want_bytes = static_cast<size_t>(frag.head_count) * layout.head_bytes(b);
        if (offset != want_offset || frag.bytes[i] != want_bytes) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "fragment buffer {}: {} offset {} and {} bytes per token, but "
                               "heads [{}, {}) are at {} and {} bytes in this layout ({})",
                               b, side == KvSide::kSource ? "src" : "dst", offset, frag.bytes[i],
                               frag.head_begin, frag.head_begin + frag.head_count, want_offset,
                               want_bytes, layout.summary().to_string());
        }
    }
    return {};
}

// Every run's slots on `side` are inside pages [1, num_pages) of `layout` (page 0 is the null
// page, never allocated), and its tokens are not negative.
Status check_runs(const KvLayout& layout, KvSide side, std::span<const TokenRun> runs) {
    const int64_t first = layout.page_size();  // the first slot of page 1
    const int64_t end = layout.num_slots();
    for (size_t r = 0; r < runs.size(); ++r) {
        const TokenRun& run = runs[r];
        const int64_t slot = side == KvSide::kSource ? run.src_slot : run.dst_slot;
        if (run.count < 1 || run.token_begin < 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "run {}: tokens [{}, {}) (a run holds at least one token, from 0)",
                               r, run.token_begin, run.token_begin + run.count);
        }
        if (slot < first || slot > end - run.count) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "run {}: {} slots [{}, {}) are outside the pool's slots [{}, {}) "
                               "(pages 1..{} of {} tokens)",
                               r, side == KvSide::kSource ? "src" : "dst", slot, slot + run.count,
                               first, end, layout.num_pages() - 1, layout.page_size());
        }
    }
    return {};
}

StatusOr<KvStagingPlan> plan_staging(const KvLayout& layout, KvSide side, const Fragment& frag,
                                     std::span<const TokenRun> runs, int layer_begin,
                                     int layer_end) {
    PDSIM_RETURN_IF_ERROR(check_layer_range(layout, layer_begin, layer_end));
    PDSIM_RETURN_IF_ERROR(check_fragment(layout, side, frag));
    PDSIM_RETURN_IF_ERROR(check_runs(layout, side, runs));
    KvStagingPlan plan{.layer_begin = layer_begin,
                       .layer_end = layer_end,
                       .buffer_count = layout.buffer_count(),
                       .run_count = static_cast<int>(runs.size())};
    const size_t n = static_cast<size_t>(layer_end - layer_begin) *
                     static_cast<size_t>(layout.buffer_count()) * runs.size();
    plan.messages.reserve(n);
    plan.ops.reserve(n);
    uint64_t at = 0;
    for (int l = layer_begin; l < layer_end; ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            const auto i = static_cast<size_t>(b);
            const uint64_t bytes = frag.bytes[i];
            const uint64_t slot_stride = layout.token_bytes(b);
            for (size_t r = 0; r < runs.size(); ++r) {
                const TokenRun& run = runs[r];
                at = align_up(at, kStagingAlignment);
                const KvStagedMessage message{.layer = l,
                                              .buf = b,
                                              .run = static_cast<int32_t>(r),
                                              .staging_offset = at,
                                              .bytes = bytes * static_cast<uint64_t>(run.count)};
                KvCopyOp op{.layer = l, .buf = b, .token_count = run.count, .bytes = bytes};
                if (side == KvSide::kSource) {
                    op.src_slot = run.src_slot;
                    op.src_offset = frag.src_offset[i];
                    op.src_stride = slot_stride;
                    op.dst_slot = kStagingSlot;
                    op.dst_offset = at;
                    op.dst_stride = bytes;
                } else {
                    op.src_slot = kStagingSlot;
                    op.src_offset = at;
                    op.src_stride = bytes;
                    op.dst_slot = run.dst_slot;
                    op.dst_offset = frag.dst_offset[i];
                    op.dst_stride = slot_stride;
                }
                plan.messages.push_back(message);
                plan.ops.push_back(op);
                at += message.bytes;
            }
        }
    }
    plan.staging_bytes = at;
    return plan;
}

KvChecksumPlan empty_checksum_plan(const KvLayout& layout, int head_begin, int head_count) {
    return KvChecksumPlan{.num_layers = layout.num_layers(),
                          .buffer_count = layout.buffer_count(),
                          .head_begin = head_begin,
                          .head_count = head_count,
                          .sum_count = static_cast<size_t>(layout.num_layers()) *
                                       static_cast<size_t>(layout.buffer_count()) *
                                       static_cast<size_t>(head_count)};
}

// The op of `count` tokens from token_begin at consecutive slots from `slot`.
KvChecksumOp checksum_op(const KvLayout& layout, const KvChecksumPlan& plan, int layer, int buf,
                         int64_t token_begin, int64_t count, int64_t slot) {
    const uint64_t hb = layout.head_bytes(buf);
    return KvChecksumOp{
        .layer = layer,
        .buf = buf,
        .token_begin = token_begin,
        .token_count = count,
        .slot = slot,
        .offset = static_cast<uint64_t>(plan.head_begin - layout.head_begin()) * hb,
        .slot_stride = layout.token_bytes(buf),
        .head_count = plan.head_count,
        .head_bytes = hb,
        .sum_index = plan.sum_index(layer, buf),
    };
}

// Side `what` of op `index` (slots or staging) is valid on `layout`'s buffer `buf`.
Status check_copy_side(const KvLayout& layout, size_t index, const char* what, int64_t slot,
                       uint64_t offset, uint64_t stride, const KvCopyOp& op) {
    if (slot == kStagingSlot) {
        if (op.token_count > 1 && stride < op.bytes) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: staging {}_stride {} is shorter than its {} bytes per "
                               "token (tokens would overlap)",
                               index, what, stride, op.bytes);
        }
        return {};
    }
    const uint64_t token_bytes = layout.token_bytes(op.buf);
    if (slot < 0 || slot > layout.num_slots() - op.token_count) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "op {}: {}_slot {}: slots [{}, {}) are outside the pool's {} slots",
                           index, what, slot, slot, slot + op.token_count, layout.num_slots());
    }
    if (stride != token_bytes) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "op {}: {}_stride {} is not buffer {}'s token_bytes {}", index, what,
                           stride, op.buf, token_bytes);
    }
    if (op.bytes > token_bytes || offset > token_bytes - op.bytes) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "op {}: {}_offset {} + bytes {} run past a slot of {} bytes", index,
                           what, offset, op.bytes, token_bytes);
    }
    return {};
}

// Op `i`'s (layer, buf) inside the layout; else kInvalidArgument naming them.
Status check_layer_buf(const KvLayout& layout, size_t i, int layer, int buf) {
    if (layer < 0 || layer >= layout.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "op {}: layer {} outside the layout's {} layers", i, layer,
                           layout.num_layers());
    }
    if (buf < 0 || buf >= layout.buffer_count()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "op {}: buf {} outside the layout's {} buffers", i, buf,
                           layout.buffer_count());
    }
    return {};
}

}  // namespace

StatusOr<KvStagingPlan> plan_gather(const KvLayout& src, const Fragment& frag,
                                    std::span<const TokenRun> runs, int layer_begin,
                                    int layer_end) {
    return plan_staging(src, KvSide::kSource, frag, runs, layer_begin, layer_end);
}

StatusOr<KvStagingPlan> plan_scatter(const KvLayout& dst, const Fragment& frag,
                                     std::span<const TokenRun> runs, int layer_begin,
                                     int layer_end) {
    return plan_staging(dst, KvSide::kDestination, frag, runs, layer_begin, layer_end);
}

StatusOr<KvChecksumPlan> plan_fragment_checksums(const KvLayout& layout, KvSide side,
                                                 const Fragment& frag,
                                                 std::span<const TokenRun> runs, int layer_begin,
                                                 int layer_end) {
    PDSIM_RETURN_IF_ERROR(check_layer_range(layout, layer_begin, layer_end));
    PDSIM_RETURN_IF_ERROR(check_fragment(layout, side, frag));
    PDSIM_RETURN_IF_ERROR(check_runs(layout, side, runs));
    KvChecksumPlan plan = empty_checksum_plan(layout, frag.head_begin, frag.head_count);
    plan.ops.reserve(static_cast<size_t>(layer_end - layer_begin) *
                     static_cast<size_t>(layout.buffer_count()) * runs.size());
    for (int l = layer_begin; l < layer_end; ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            for (const TokenRun& run : runs) {
                const int64_t slot = side == KvSide::kSource ? run.src_slot : run.dst_slot;
                plan.ops.push_back(
                    checksum_op(layout, plan, l, b, run.token_begin, run.count, slot));
            }
        }
    }
    return plan;
}

StatusOr<KvChecksumPlan> plan_page_checksums(const KvLayout& layout, std::span<const int32_t> pages,
                                             int64_t t0, int64_t t1, int layer_begin, int layer_end,
                                             int head_begin, int head_count) {
    PDSIM_RETURN_IF_ERROR(check_layer_range(layout, layer_begin, layer_end));
    PDSIM_RETURN_IF_ERROR(check_heads(layout, head_begin, head_count));
    if (t0 < 0 || t1 < t0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "token range [{}, {}): expected 0 <= t0 <= t1", t0, t1);
    }
    PDSIM_RETURN_IF_ERROR(layout.check_pages(pages, t1));
    KvChecksumPlan plan = empty_checksum_plan(layout, head_begin, head_count);
    const int ps = layout.page_size();
    for (int l = layer_begin; l < layer_end; ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            // One op per page segment (kv_checksums' walk): slots are consecutive in a page.
            for (int64_t t = t0; t < t1;) {
                const int64_t n = std::min<int64_t>(t1 - t, ps - t % ps);
                plan.ops.push_back(checksum_op(layout, plan, l, b, t, n, token_slot(pages, ps, t)));
                t += n;
            }
        }
    }
    return plan;
}

Status check_copy_ops(const KvLayout& layout, std::span<const KvCopyOp> ops,
                      KvCopyDirection direction) {
    const bool gather = direction == KvCopyDirection::kGather;
    for (size_t i = 0; i < ops.size(); ++i) {
        const KvCopyOp& op = ops[i];
        PDSIM_RETURN_IF_ERROR(check_layer_buf(layout, i, op.layer, op.buf));
        if (op.token_count < 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "op {}: token_count {} is negative", i,
                               op.token_count);
        }
        if (op.bytes < 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "op {}: bytes must be >= 1", i);
        }
        const bool src_staging = op.src_slot == kStagingSlot;
        const bool dst_staging = op.dst_slot == kStagingSlot;
        if (src_staging == gather || dst_staging != gather) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: src_slot {} / dst_slot {}: a {} reads {} and writes {} "
                               "(staging is slot {})",
                               i, op.src_slot, op.dst_slot, gather ? "gather" : "scatter",
                               gather ? "slots" : "staging", gather ? "staging" : "slots",
                               kStagingSlot);
        }
        PDSIM_RETURN_IF_ERROR(
            check_copy_side(layout, i, "src", op.src_slot, op.src_offset, op.src_stride, op));
        PDSIM_RETURN_IF_ERROR(
            check_copy_side(layout, i, "dst", op.dst_slot, op.dst_offset, op.dst_stride, op));
    }
    return {};
}

Status check_checksum_ops(const KvLayout& layout, std::span<const KvChecksumOp> ops) {
    for (size_t i = 0; i < ops.size(); ++i) {
        const KvChecksumOp& op = ops[i];
        PDSIM_RETURN_IF_ERROR(check_layer_buf(layout, i, op.layer, op.buf));
        if (op.token_count < 0 || op.token_begin < 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: token_begin {} / token_count {} must not be negative", i,
                               op.token_begin, op.token_count);
        }
        if (op.slot < 0 || op.slot > layout.num_slots() - op.token_count) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: slot {}: slots [{}, {}) are outside the pool's {} slots", i,
                               op.slot, op.slot, op.slot + op.token_count, layout.num_slots());
        }
        const uint64_t token_bytes = layout.token_bytes(op.buf);
        if (op.slot_stride != token_bytes) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: slot_stride {} is not buffer {}'s token_bytes {}", i,
                               op.slot_stride, op.buf, token_bytes);
        }
        if (op.head_count < 1 || op.head_bytes < 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: head_count {} and head_bytes {} must be >= 1", i,
                               op.head_count, op.head_bytes);
        }
        // head_count * head_bytes without overflow: head_bytes <= token_bytes first.
        if (op.head_bytes > token_bytes ||
            static_cast<uint64_t>(op.head_count) > token_bytes / op.head_bytes ||
            op.offset > token_bytes - static_cast<uint64_t>(op.head_count) * op.head_bytes) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "op {}: offset {} + head_count {} x head_bytes {} run past a slot "
                               "of {} bytes",
                               i, op.offset, op.head_count, op.head_bytes, token_bytes);
        }
    }
    return {};
}

uint64_t staging_extent(std::span<const KvCopyOp> ops) {
    uint64_t end = 0;
    for (const KvCopyOp& op : ops) {
        if (op.token_count < 1) continue;
        const bool src_staging = op.src_slot == kStagingSlot;
        const uint64_t offset = src_staging ? op.src_offset : op.dst_offset;
        const uint64_t stride = src_staging ? op.src_stride : op.dst_stride;
        end = std::max(end, offset + static_cast<uint64_t>(op.token_count - 1) * stride + op.bytes);
    }
    return end;
}

uint64_t sums_extent(std::span<const KvChecksumOp> ops) {
    uint64_t end = 0;
    for (const KvChecksumOp& op : ops) {
        end = std::max(end, op.sum_index + static_cast<uint64_t>(op.head_count));
    }
    return end;
}

}  // namespace pdsim::transfer
