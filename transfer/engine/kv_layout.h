// KvLayout: how one rank's paged KV cache sits in memory, as the transfer engine sees it.
//
// A layout says, per layer and buffer (MHA: 0 = K, 1 = V; MLA: 0 = the latent buffer), where the
// buffer starts, how many bytes one page / one token / one head of one token occupy, and which
// slice of the model's KV heads this rank holds (its TP slice). The engine addresses
//   page p of (layer, buf)           at base(layer, buf) + p * page_bytes(buf)
//   token slot s = page * page_size + offset   at base(layer, buf) + s * token_bytes(buf)
//   head h (global index) of slot s  at ... + (h - head_begin) * head_bytes(buf)
// which is exactly the [num_pages][page_size][local_heads][head_dim] layout of kv::KVPool.
//
// Memory kind. A layout declares where its memory is (device(): host for CPU pools, a CUDA device
// for device pools). It is address arithmetic only: building one never touches the memory. What
// may touch it is the engine's business (kv_sender.h, "Device memory": the data transport must
// reach that memory kind, and on device memory the engine hashes, gathers and scatters through
// the KV memory ops of that device on a comm stream, never on the host).
//
// KvLayoutSummary is the address-free part of a layout, exchanged by the control plane so that
// each side can map the other's fragments (different TP sizes, page sizes) without knowing its
// addresses.
//
// TP convention (kv_head_slice; both sides must follow it, create() checks it):
//   tp_size <= total_kv_heads: rank r holds heads [r * H / tp, (r + 1) * H / tp) (tp | H);
//   tp_size >  total_kv_heads: each rank holds one head, head r / (tp / H), replicated on
//                              tp / H consecutive ranks (H | tp).
// MLA has no heads to slice: every TP rank holds the whole latent buffer (one "head" of
// token_bytes, total_kv_heads == 1).
//
// Thread-safety: a KvLayout is an immutable value once built; copy it freely.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::transfer {

enum class KvKind : uint8_t { kMHA = 0, kMLA = 1 };
std::string_view kv_kind_name(KvKind kind);

inline constexpr int kMaxKvBuffers = 2;

struct HeadSlice {
    int begin = 0;
    int count = 0;
    friend bool operator==(const HeadSlice&, const HeadSlice&) = default;
};

// The heads of TP rank `tp_rank` of `tp_size` under the convention above; kInvalidArgument when
// neither tp_size divides total_kv_heads nor total_kv_heads divides tp_size.
[[nodiscard]] StatusOr<HeadSlice> kv_head_slice(int total_kv_heads, int tp_size, int tp_rank);

// The part of a layout that travels over the wire (no addresses).
struct KvLayoutSummary {
    KvKind kind = KvKind::kMHA;
    int32_t num_layers = 0;
    int32_t buffer_count = 0;  // 2 (MHA K/V) or 1 (MLA)
    int32_t page_size = 0;     // tokens per page
    int32_t dtype_bytes = 0;
    int32_t tp_size = 1;
    int32_t tp_rank = 0;
    int32_t total_kv_heads = 1;
    int32_t head_begin = 0;                            // global index of this rank's first head
    int32_t local_heads = 1;                           // heads held by this rank (MLA: 1)
    std::array<uint64_t, kMaxKvBuffers> head_bytes{};  // per buffer: one head of one token

    [[nodiscard]] uint64_t token_bytes(int buf) const {
        return head_bytes[static_cast<size_t>(buf)] * static_cast<uint64_t>(local_heads);
    }
    [[nodiscard]] std::string to_string() const;
    friend bool operator==(const KvLayoutSummary&, const KvLayoutSummary&) = default;
};

// OK when KV from a rank with layout `a` can be transferred to a rank with layout `b` (or back):
// same kind, layers, buffers, dtype, total heads and per-head bytes. Page sizes and TP may differ.
[[nodiscard]] Status check_compatible(const KvLayoutSummary& a, const KvLayoutSummary& b);

class KvLayout {
public:
    KvLayout() = default;

    // From a pool on any device (the layout's device() is the pool's). `tp_size`/`tp_rank` place
    // the rank in its instance; `total_kv_heads` is the model's KV head count (the pool holds
    // kv_head_slice(total, tp, rank).count of them).
    // `layers`: the pool layers the layout holds, in order (layout layer i is pool layer
    // layers[i]: one cache group's engine over a hybrid model's pool); empty: every layer. A layer
    // the pool does not hold (kv::KVPool::holds_layer) is kInvalidArgument naming it.
    [[nodiscard]] static StatusOr<KvLayout> from_mha_pool(const kv::MHATokenToKVPool& pool,
                                                          int tp_size, int tp_rank,
                                                          int total_kv_heads,
                                                          std::span<const int> layers = {});
    [[nodiscard]] static StatusOr<KvLayout> from_mla_pool(const kv::MLATokenToKVPool& pool,
                                                          int tp_size, int tp_rank);
    // From raw parts (tests, or memory that is not a kv::KVPool). `bases` is [layer][buf]
    // flattened (layer * buffer_count + buf); each buffer holds `num_pages` pages. `device`: where
    // the memory is (host by default).
    [[nodiscard]] static StatusOr<KvLayout> create(const KvLayoutSummary& summary, int num_pages,
                                                   std::vector<std::byte*> bases,
                                                   runtime::Device device = {});

    [[nodiscard]] const KvLayoutSummary& summary() const { return summary_; }
    [[nodiscard]] int num_layers() const { return summary_.num_layers; }
    [[nodiscard]] int buffer_count() const { return summary_.buffer_count; }
    [[nodiscard]] int page_size() const { return summary_.page_size; }
    [[nodiscard]] int num_pages() const { return num_pages_; }
    // Where the memory is (kCpu: host memory the engine may read and write itself).
    [[nodiscard]] const runtime::Device& device() const { return device_; }
    [[nodiscard]] bool is_host() const { return device_.kind == runtime::DeviceKind::kCpu; }
    // Token slots per buffer: num_pages * page_size.
    [[nodiscard]] int64_t num_slots() const {
        return static_cast<int64_t>(num_pages_) * summary_.page_size;
    }
    [[nodiscard]] int head_begin() const { return summary_.head_begin; }
    [[nodiscard]] int local_heads() const { return summary_.local_heads; }
    [[nodiscard]] size_t head_bytes(int buf) const {
        return static_cast<size_t>(summary_.head_bytes[static_cast<size_t>(buf)]);
    }
    [[nodiscard]] size_t token_bytes(int buf) const {
        return static_cast<size_t>(summary_.token_bytes(buf));
    }
    [[nodiscard]] size_t page_bytes(int buf) const {
        return token_bytes(buf) * static_cast<size_t>(summary_.page_size);
    }
    [[nodiscard]] std::byte* base(int layer, int buf) const {
        return bases_[static_cast<size_t>(layer * summary_.buffer_count + buf)];
    }
    // base + page * page_bytes + offset * token_bytes, for slot = page * page_size + offset.
    [[nodiscard]] std::byte* slot_addr(int layer, int buf, int64_t slot) const {
        const int64_t ps = summary_.page_size;
        return base(layer, buf) + static_cast<size_t>(slot / ps) * page_bytes(buf) +
               static_cast<size_t>(slot % ps) * token_bytes(buf);
    }
    // OK when `pages` covers `num_tokens` tokens and every page it needs is in [1, num_pages);
    // else kInvalidArgument naming the bad entry.
    [[nodiscard]] Status check_pages(std::span<const int32_t> pages, int64_t num_tokens) const;

private:
    KvLayoutSummary summary_;
    int num_pages_ = 0;
    std::vector<std::byte*> bases_;
    runtime::Device device_{};
};

// Slot of token t for a page table with `page_size` tokens per page.
inline int64_t token_slot(std::span<const int32_t> pages, int page_size, int64_t t) {
    return static_cast<int64_t>(pages[static_cast<size_t>(t / page_size)]) * page_size +
           t % page_size;
}

}  // namespace pdsim::transfer
