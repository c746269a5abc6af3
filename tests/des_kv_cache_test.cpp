// KvCache (sim/des/kv_cache.h): page accounting, prefix hits, pinning and LRU eviction, checked
// against hand-worked cases.
#include <gtest/gtest.h>

#include <vector>

#include "sim/des/kv_cache.h"

namespace pdsim::des {
namespace {

TEST(KvCache, PagesWithoutAPrefixCache) {
    KvCache kv(10, 16, /*prefix_cache=*/false);
    EXPECT_FALSE(kv.prefix_cache());
    EXPECT_EQ(kv.pages_for(1), 1);
    EXPECT_EQ(kv.pages_for(16), 1);
    EXPECT_EQ(kv.pages_for(17), 2);
    EXPECT_TRUE(kv.alloc(7));
    EXPECT_FALSE(kv.alloc(4));  // 3 free
    EXPECT_EQ(kv.free_pages(), 3);
    EXPECT_TRUE(kv.alloc(3));
    kv.free(10);
    EXPECT_EQ(kv.free_pages(), 10);
    const std::vector<int64_t> h = {1, 2, 3};
    EXPECT_EQ(kv.match(h), 0);
    EXPECT_TRUE(kv.alloc(4));
    kv.release(h, 0, 3, 4);  // no cache: just frees
    EXPECT_EQ(kv.free_pages(), 10);
    EXPECT_EQ(kv.cached_blocks(), 0);
}

TEST(KvCache, PrefixCacheNeedsAPageSizeThatDividesTheBlock) {
    EXPECT_TRUE(KvCache(10, 16, true).prefix_cache());
    EXPECT_TRUE(KvCache(10, 512, true).prefix_cache());
    EXPECT_FALSE(KvCache(10, 100, true).prefix_cache());
}

TEST(KvCache, ReleasedFullBlocksBecomeHitsAndHoldTheirPages) {
    // Page size 256: a 512-token block is 2 pages.
    KvCache kv(20, 256, true);
    const std::vector<int64_t> a = {10, 11, 12};  // 1300 tokens: 2 full blocks + a partial one
    ASSERT_TRUE(kv.alloc(kv.pages_for(1300)));    // 6 pages
    EXPECT_EQ(kv.free_pages(), 14);
    kv.release(a, 0, 1300 / 512, 6);  // blocks 10, 11 cached (4 pages); 2 pages freed
    EXPECT_EQ(kv.cached_blocks(), 2);
    EXPECT_EQ(kv.cached_pages(), 4);
    EXPECT_EQ(kv.free_pages(), 16);
    EXPECT_EQ(kv.match(a), 2);
    EXPECT_EQ(kv.match(std::vector<int64_t>{10, 99, 12}), 1);  // the walk stops at the first miss
    EXPECT_EQ(kv.match(std::vector<int64_t>{11}), 1);
    EXPECT_EQ(kv.match(std::vector<int64_t>{99, 10}), 0);

    // A second request hits both blocks, computes one more full block and releases.
    const std::vector<int64_t> b = {10, 11, 13, 14};  // 1800 tokens: 3 full blocks
    kv.pin(b, 2);
    ASSERT_TRUE(kv.alloc(kv.pages_for(1800 - 1024)));  // 4 pages
    kv.release(b, 2, 1800 / 512, 4);                   // block 13 cached (2 pages), 2 freed
    EXPECT_EQ(kv.cached_blocks(), 3);
    EXPECT_EQ(kv.free_pages(), 20 - 6);
    EXPECT_EQ(kv.evicted_blocks(), 0);
}

TEST(KvCache, EvictsUnpinnedBlocksLeastRecentlyUsedDeepestFirst) {
    KvCache kv(8, 256, true);  // 4 blocks' worth
    const std::vector<int64_t> a = {1, 2, 3};
    ASSERT_TRUE(kv.alloc(6));
    kv.release(a, 0, 3, 6);  // blocks 1, 2, 3 cached; 3 is the least recently used
    EXPECT_EQ(kv.free_pages(), 2);
    EXPECT_TRUE(kv.alloc(4));  // evicts block 3 only
    EXPECT_EQ(kv.evicted_blocks(), 1);
    EXPECT_EQ(kv.match(a), 2);
    kv.free(4);

    // Pinned blocks are never evicted; an alloc that cannot succeed changes nothing.
    kv.pin(a, 2);
    EXPECT_FALSE(kv.alloc(5));  // 4 free, nothing evictable
    EXPECT_EQ(kv.free_pages(), 4);
    EXPECT_EQ(kv.cached_blocks(), 2);
    kv.unpin(a, 2);
    EXPECT_TRUE(kv.alloc(6));  // evicts block 2 (the deeper one) and keeps block 1
    EXPECT_EQ(kv.cached_blocks(), 1);
    EXPECT_EQ(kv.evicted_blocks(), 2);
    EXPECT_EQ(kv.match(a), 1);
}

TEST(KvCache, ABlockCachedMeanwhileIsNotDuplicated) {
    KvCache kv(12, 256, true);
    const std::vector<int64_t> h = {7, 8};
    ASSERT_TRUE(kv.alloc(4));  // two requests computed the same prompt concurrently
    ASSERT_TRUE(kv.alloc(4));
    kv.release(h, 0, 2, 4);
    kv.release(h, 0, 2, 4);  // already cached: its pages are freed
    EXPECT_EQ(kv.cached_blocks(), 2);
    EXPECT_EQ(kv.free_pages(), 8);
}

}  // namespace
}  // namespace pdsim::des
