#include "sim/des/kv_cache.h"

#include "common/check.h"
#include "sim/workload/workload.h"

namespace pdsim::des {

KvCache::KvCache(int64_t capacity_pages, const KvFootprint& footprint, bool prefix_cache)
    : capacity_(capacity_pages), footprint_(footprint), free_(capacity_pages) {
    const int page_size = footprint.page_size;
    PDSIM_CHECK(capacity_pages >= 0 && page_size >= 1);
    if (prefix_cache && footprint.dense && workload::kHashBlockTokens % page_size == 0) {
        block_pages_ = workload::kHashBlockTokens / page_size;
    }
}

int64_t KvCache::cached_pages() const {
    return static_cast<int64_t>(index_.size()) * block_pages_;
}

void KvCache::lru_push_back(uint32_t b) {
    Block& x = blocks_[b];
    x.prev = lru_tail_;
    x.next = kNil;
    if (lru_tail_ != kNil) {
        blocks_[lru_tail_].next = b;
    } else {
        lru_head_ = b;
    }
    lru_tail_ = b;
    ++evictable_blocks_;
}

void KvCache::lru_remove(uint32_t b) {
    Block& x = blocks_[b];
    if (x.prev != kNil) {
        blocks_[x.prev].next = x.next;
    } else {
        lru_head_ = x.next;
    }
    if (x.next != kNil) {
        blocks_[x.next].prev = x.prev;
    } else {
        lru_tail_ = x.prev;
    }
    x.prev = x.next = kNil;
    --evictable_blocks_;
}

void KvCache::evict_one() {
    const uint32_t b = lru_head_;
    PDSIM_CHECK(b != kNil);
    lru_remove(b);
    index_.erase(blocks_[b].hash);
    free_blocks_.push_back(b);
    free_ += block_pages_;
    ++evicted_;
}

bool KvCache::alloc(int64_t n) {
    PDSIM_CHECK(n >= 0);
    if (free_ + evictable_blocks_ * block_pages_ < n) return false;
    while (free_ < n) evict_one();
    free_ -= n;
    return true;
}

void KvCache::free(int64_t n) {
    PDSIM_CHECK(n >= 0);
    free_ += n;
    PDSIM_CHECK_MSG(free_ + cached_pages() <= capacity_, "KvCache: freed more pages than held");
}

int64_t KvCache::match(std::span<const int64_t> hashes) const {
    if (block_pages_ == 0) return 0;
    int64_t n = 0;
    for (int64_t h : hashes) {
        if (index_.find(h) == index_.end()) break;
        ++n;
    }
    return n;
}

void KvCache::pin(std::span<const int64_t> hashes, int64_t n) {
    for (int64_t i = n - 1; i >= 0; --i) {
        auto it = index_.find(hashes[static_cast<size_t>(i)]);
        PDSIM_CHECK_MSG(it != index_.end(), "KvCache::pin: block {} is not cached", i);
        Block& b = blocks_[it->second];
        if (b.pins++ == 0) lru_remove(it->second);
    }
}

void KvCache::unpin(std::span<const int64_t> hashes, int64_t n) {
    // Last block first, so the first block ends up most recently used.
    for (int64_t i = n - 1; i >= 0; --i) {
        auto it = index_.find(hashes[static_cast<size_t>(i)]);
        PDSIM_CHECK_MSG(it != index_.end(), "KvCache::unpin: block {} is not cached", i);
        Block& b = blocks_[it->second];
        PDSIM_CHECK(b.pins > 0);
        if (--b.pins == 0) lru_push_back(it->second);
    }
}

void KvCache::release(std::span<const int64_t> hashes, int64_t pinned, int64_t full_blocks,
                      int64_t own_pages) {
    if (block_pages_ == 0) {
        free(own_pages);
        return;
    }
    const int64_t last = std::min<int64_t>(full_blocks, static_cast<int64_t>(hashes.size()));
    // New blocks last to first, then the hits: earlier blocks end up more recently used.
    for (int64_t i = last - 1; i >= pinned; --i) {
        if (own_pages < block_pages_) break;
        const int64_t h = hashes[static_cast<size_t>(i)];
        if (index_.find(h) != index_.end()) continue;  // cached meanwhile by another request
        uint32_t slot;
        if (!free_blocks_.empty()) {
            slot = free_blocks_.back();
            free_blocks_.pop_back();
        } else {
            slot = static_cast<uint32_t>(blocks_.size());
            blocks_.emplace_back();
        }
        blocks_[slot] = Block{h, 0, kNil, kNil};
        index_.emplace(h, slot);
        lru_push_back(slot);
        own_pages -= block_pages_;
    }
    unpin(hashes, pinned);
    free(own_pages);
}

}  // namespace pdsim::des
