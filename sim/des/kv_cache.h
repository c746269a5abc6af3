// One simulated instance's KV memory: a pool of pages (counts only, no page ids) with an optional
// prefix cache of 512-token blocks keyed by the trace's hash_ids (workload::kHashBlockTokens).
//
// Pages: capacity() pages of page_size tokens; requests hold pages between alloc() and free().
// How many pages a request of T tokens holds is its KvFootprint's pages_for(T) (kv_groups.h: a
// dense model's page spans every layer; a hybrid's is one attention layer's, with the sliding
// window's and the recurrent state's rules).
// Prefix cache (enabled when page_size divides 512): a cached block holds 512 / page_size pages of
// the same pool. A request looks up its hash_ids from the first block (match(): the number of
// leading blocks cached; the walk stops at the first miss, as a radix tree would), pins the hits
// while it runs (pinned blocks are never evicted), and on release() moves its own full blocks into
// the cache instead of freeing their pages. Unpinned blocks are evicted least recently used first,
// and only when an alloc() would otherwise fail; a request's later blocks are older than its
// earlier ones in that order, so the deepest blocks of a prefix go first.
// Invariant: free_pages() + cached_pages() + pages held by requests == capacity().
//
// Thread-safety: none (the simulator's thread). Costs: O(1) per page operation and per block.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "sim/des/kv_groups.h"

namespace pdsim::des {

class KvCache {
public:
    // capacity_pages >= 0, footprint.page_size >= 1. `prefix_cache` is ignored when the page
    // size does not divide the 512-token block or the footprint is not dense (kv_groups.h).
    KvCache(int64_t capacity_pages, const KvFootprint& footprint, bool prefix_cache);
    // A dense model's pool: pages of page_size tokens of every layer.
    KvCache(int64_t capacity_pages, int page_size, bool prefix_cache)
        : KvCache(capacity_pages, dense_kv_footprint(page_size), prefix_cache) {}

    [[nodiscard]] int64_t capacity() const { return capacity_; }
    [[nodiscard]] int page_size() const { return footprint_.page_size; }
    [[nodiscard]] const KvFootprint& footprint() const { return footprint_; }
    [[nodiscard]] bool prefix_cache() const { return block_pages_ > 0; }
    [[nodiscard]] int64_t free_pages() const { return free_; }
    [[nodiscard]] int64_t cached_pages() const;
    // Pages a request holding `tokens` tokens needs (footprint().pages_for).
    [[nodiscard]] int64_t pages_for(int64_t tokens) const { return footprint_.pages_for(tokens); }

    // Takes n pages, evicting unpinned cached blocks (LRU) when the free pages are short. Returns
    // false, changing nothing, when even evicting every unpinned block would not free enough.
    bool alloc(int64_t n);
    void free(int64_t n);

    // Leading blocks of `hashes` that are cached (0 without a prefix cache).
    [[nodiscard]] int64_t match(std::span<const int64_t> hashes) const;
    // Pins / unpins the first n blocks of `hashes`. Precondition (pin): n <= match(hashes).
    void pin(std::span<const int64_t> hashes, int64_t n);
    void unpin(std::span<const int64_t> hashes, int64_t n);
    // A request that pinned the first `pinned` blocks and holds `own_pages` pages for the rest of
    // its KV releases everything: it unpins its hits, moves its full blocks [pinned, full_blocks)
    // that are not cached yet into the cache (512 / page_size of its pages each) and frees the
    // remaining pages. Without a prefix cache this is free(own_pages).
    void release(std::span<const int64_t> hashes, int64_t pinned, int64_t full_blocks,
                 int64_t own_pages);

    // Statistics since construction.
    [[nodiscard]] int64_t evicted_blocks() const { return evicted_; }
    [[nodiscard]] int64_t cached_blocks() const { return static_cast<int64_t>(index_.size()); }

private:
    struct Block {
        int64_t hash = 0;
        int32_t pins = 0;
        uint32_t prev = kNil, next = kNil;  // LRU list of unpinned blocks (head: least recent)
    };
    static constexpr uint32_t kNil = 0xffffffffu;

    void lru_push_back(uint32_t b);
    void lru_remove(uint32_t b);
    void evict_one();

    int64_t capacity_;
    KvFootprint footprint_;
    int64_t block_pages_ = 0;  // 0: no prefix cache
    int64_t free_;
    int64_t evictable_blocks_ = 0;
    int64_t evicted_ = 0;
    std::vector<Block> blocks_;
    std::vector<uint32_t> free_blocks_;
    std::unordered_map<int64_t, uint32_t> index_;  // hash -> block slot
    uint32_t lru_head_ = kNil, lru_tail_ = kNil;
};

}  // namespace pdsim::des
