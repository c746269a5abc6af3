// The transfer plan: which bytes a prefill rank sends to a decode rank, cut into messages, in an
// order both sides compute identically from the same inputs (the layouts exchanged in the
// bootstrap/ack, the page tables, the chunk's token range).
//
// Fragment (heterogeneous TP). For a (prefill rank, decode rank) pair the fragment is the set of
// KV heads the decode rank needs and takes from that prefill rank; it is one contiguous head
// range (or nothing). Source selection, per head h the decode rank holds:
//   MHA: the prefill TP ranks holding h (kv_head_slice); with replicated heads (prefill TP > H)
//        there are r = tp / H of them and decode TP rank d takes h from the (d mod r)-th, so
//        replicas share the load;
//   MLA: every prefill rank holds the whole latent buffer; decode TP rank d takes it from
//        prefill TP rank d mod P (one sender per decode rank; all decode ranks receive the same
//        bytes).
// Per buffer a fragment is, within one token slot, `bytes` at `src_offset` on the prefill side
// and at `dst_offset` on the decode side. When bytes == the side's token_bytes, a run of slots
// is one contiguous range on that side; otherwise the side needs a staging copy (sender: gather
// before the send; receiver: scatter after the receive).
//
// Runs (different page sizes). Token t of a request lives in slot pages[t / ps] * ps + t % ps on
// each side. A run is a maximal range of tokens whose slots are consecutive on BOTH sides (and
// whose message stays under max_message_bytes); each (layer, buffer, run) is one message. The
// decode side learns the prefill pages of each chunk from the Chunk header, so both sides cut
// exactly the same runs.
//
// Message order for one (prefill rank, decode rank, request): for each chunk in submission
// order, for each layer ascending, for each buffer, for each run ascending; then one completion
// message. (The layer interval only groups the sender's step waits; intervals are consecutive
// ascending layer ranges, so it does not change the order.)
//
// Thread-safety: pure functions on values.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "transfer/engine/kv_layout.h"

namespace pdsim::transfer {

struct Fragment {
    int src_tp_rank = 0;
    int dst_tp_rank = 0;
    int head_begin = 0;  // global head index
    int head_count = 0;
    std::array<size_t, kMaxKvBuffers> src_offset{};
    std::array<size_t, kMaxKvBuffers> dst_offset{};
    std::array<size_t, kMaxKvBuffers> bytes{};         // per token
    std::array<bool, kMaxKvBuffers> src_contiguous{};  // bytes == src token_bytes
    std::array<bool, kMaxKvBuffers> dst_contiguous{};  // bytes == dst token_bytes
};

// The prefill TP rank (of src.tp_size) that provides global head `head` to decode TP rank
// `dst_tp_rank` (MLA: `head` is ignored).
[[nodiscard]] int source_tp_rank(const KvLayoutSummary& src, int dst_tp_rank, int head);

// The fragment prefill rank `src` sends to decode rank `dst`, or nullopt when it sends nothing.
// Precondition: check_compatible(src, dst) is OK.
[[nodiscard]] std::optional<Fragment> make_fragment(const KvLayoutSummary& src,
                                                    const KvLayoutSummary& dst);

struct TokenRun {
    int64_t token_begin = 0;
    int64_t count = 0;
    int64_t src_slot = 0;  // slot of token_begin on the prefill side
    int64_t dst_slot = 0;  // ... on the decode side
};

// Runs covering tokens [t0, t1), each at most `max_tokens` (>= 1) long. src_pages[i] is the
// prefill page of page index src_first_page + i (the sender passes its whole table and 0; the
// receiver gets the slice covering the chunk in the Chunk header). dst_pages starts at index 0.
// Precondition: the tables cover [t0, t1).
[[nodiscard]] std::vector<TokenRun> make_runs(std::span<const int32_t> src_pages, int src_page_size,
                                              int64_t src_first_page,
                                              std::span<const int32_t> dst_pages, int dst_page_size,
                                              int64_t t0, int64_t t1, int64_t max_tokens);

// The longest run (in tokens) for which every buffer's message of `frag` stays within
// `max_message_bytes` (at least 1).
[[nodiscard]] int64_t max_run_tokens(const Fragment& frag, int buffer_count,
                                     size_t max_message_bytes);

// Bytes of one (layer, buffer, run) message.
inline size_t message_bytes(const Fragment& frag, int buf, const TokenRun& run) {
    return frag.bytes[static_cast<size_t>(buf)] * static_cast<size_t>(run.count);
}

// Bytes of one token of one layer that `frag` carries, over buffers [0, buffer_count).
inline uint64_t token_bytes(const Fragment& frag, int buffer_count) {
    uint64_t bytes = 0;
    for (int b = 0; b < buffer_count; ++b) bytes += frag.bytes[static_cast<size_t>(b)];
    return bytes;
}

// Copies a run's fragment out of the prefill pages into `dst` (packed [token][fragment bytes]).
void gather_run(const KvLayout& src, const Fragment& frag, int layer, int buf, const TokenRun& run,
                std::byte* dst);
// Copies packed [token][fragment bytes] from `src` into the decode pages.
void scatter_run(const KvLayout& dst, const Fragment& frag, int layer, int buf, const TokenRun& run,
                 const std::byte* src);

// For chunked prefill: the end of what a chunk that computed tokens up to `computed_end` may
// send. Middle chunks send only full prefill pages (the partial tail page is still being
// written by later chunks); the last chunk sends everything up to the request's end.
inline int64_t sendable_end(int64_t computed_end, int src_page_size, bool is_last) {
    return is_last ? computed_end : computed_end / src_page_size * src_page_size;
}

}  // namespace pdsim::transfer
