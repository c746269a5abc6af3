// KvCache (sim/des/kv_cache.h): page accounting, prefix hits, pinning and LRU eviction, checked
// against hand-worked cases; and the layer groups' rules (sim/des/kv_groups.h): a hybrid
// request's pages and transfer bytes worked by hand.
#include <gtest/gtest.h>

#include <vector>

#include "sim/des/kv_cache.h"
#include "sim/des/kv_groups.h"

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

// 4 layers (full, sliding, recurrent, full), 4 KV heads of 64, window 100; the recurrent layer has
// 4 state heads of 32 and a conv kernel of 4.
topo::ModelShape mixed_model() {
    topo::ModelShape m;
    m.name = "mixed";
    m.num_layers = 4;
    m.num_q_heads = 8;
    m.num_kv_heads = 4;
    m.head_dim = 64;
    m.hidden = 256;
    m.layer_kinds = {topo::LayerKind::kFullAttention, topo::LayerKind::kSlidingWindow,
                     topo::LayerKind::kRecurrent, topo::LayerKind::kFullAttention};
    m.sliding_window = 100;
    m.state_heads = 4;
    m.state_head_dim = 32;
    m.conv_kernel = 4;
    return m;
}

TEST(KvFootprint, HybridPagesByGroupWorkedByHand) {
    const topo::ModelShape m = mixed_model();
    // bf16 at TP 1: a layer page is 16 tokens x 2*4*64 elements x 2 B = 16,384 B. The state of
    // one request: 1 recurrent layer x 4 heads x (32^2 + 3*3*32) x 4 B = 20,992 B -> 2 pages.
    // Decode span W = 100: 100 consecutive tokens touch at most ceil(99/16) + 1 = 8 pages.
    const KvFootprint d = kv_footprint(m, 1, 2, 16, 100);
    EXPECT_FALSE(d.dense);
    EXPECT_EQ(d.page_layers, 1);
    EXPECT_EQ(d.page_bytes, 16384.0);
    EXPECT_EQ(d.full_layers, 2);
    EXPECT_EQ(d.sliding_layers, 1);
    EXPECT_EQ(d.sliding_max_pages, 8);
    EXPECT_EQ(d.state_pages, 2);
    // P = ceil(T/16); pages = 2 P (full) + min(P, 8) (sliding) + 2 (state).
    EXPECT_EQ(d.pages_for(0), 0);
    EXPECT_EQ(d.pages_for(1), 2 + 1 + 2);
    EXPECT_EQ(d.pages_for(100), 14 + 7 + 2);    // P = 7: the window is not full yet
    EXPECT_EQ(d.pages_for(129), 18 + 8 + 2);    // P = 9: the sliding layer stops at 8
    EXPECT_EQ(d.pages_for(4096), 512 + 8 + 2);  // P = 256
    // Where prompts are computed in chunks of 512 the span is 100 - 1 + 512 = 611 tokens:
    // ceil(610/16) + 1 = 40 pages per sliding layer.
    const KvFootprint p = kv_footprint(m, 1, 2, 16, 611);
    EXPECT_EQ(p.sliding_max_pages, 40);
    EXPECT_EQ(p.pages_for(4096), 512 + 40 + 2);
    // TP 2 halves a page (8,192 B) and the state (10,496 B: still 2 pages).
    const KvFootprint t2 = kv_footprint(m, 2, 2, 16, 100);
    EXPECT_EQ(t2.page_bytes, 8192.0);
    EXPECT_EQ(t2.state_pages, 2);
    // The same dimensions with every layer full attention: a page spans the 4 layers
    // (65,536 B) and 4096 tokens are 256 pages. In 1 GiB per rank: 16,384 dense pages fit 64
    // such requests; 65,536 layer pages fit 65,536 / 522 = 125 hybrid ones.
    topo::ModelShape dense = m;
    dense.layer_kinds.clear();
    const KvFootprint f = kv_footprint(dense, 1, 2, 16, 100);
    EXPECT_TRUE(f.dense);
    EXPECT_EQ(f.page_layers, 4);
    EXPECT_EQ(f.page_bytes, 65536.0);
    EXPECT_EQ(f.pages_for(4096), 256);
    EXPECT_EQ((int64_t{1} << 30) / 65536 / f.pages_for(4096), 64);
    EXPECT_EQ((int64_t{1} << 30) / 16384 / d.pages_for(4096), 125);
    // A request's pages never shrink as it grows.
    for (const KvFootprint& k : {d, p, f}) {
        for (int64_t t = 1; t < 2000; ++t) EXPECT_LE(k.pages_for(t - 1), k.pages_for(t)) << t;
    }
}

TEST(KvFootprint, AHybridPoolHasNoPrefixCache) {
    const KvFootprint d = kv_footprint(mixed_model(), 1, 2, 16, 100);
    KvCache kv(100, d, /*prefix_cache=*/true);
    EXPECT_FALSE(kv.prefix_cache());
    EXPECT_EQ(kv.pages_for(129), 28);
    EXPECT_EQ(kv.page_size(), 16);
    EXPECT_TRUE(KvCache(100, dense_kv_footprint(16), true).prefix_cache());
}

TEST(KvTransferBytes, ChunksByGroupWorkedByHand) {
    // bf16: one token of one layer is 2*4*64*2 = 1,024 B; 2 full layers (2,048 B per token), one
    // sliding layer (1,024 B), the state 20,992 B (fp32, as the model keeps it).
    const KvTransferBytes t = kv_transfer_bytes(mixed_model(), 2);
    EXPECT_EQ(t.full_per_token, 2048.0);
    EXPECT_EQ(t.sliding_per_token, 1024.0);
    EXPECT_EQ(t.window, 100);
    EXPECT_EQ(t.state, 20992.0);
    // A prompt of 300 tokens in chunks [0, 128), [128, 256), [256, 300); its window is [200, 300).
    const KvGroupBytes a = t.chunk(300, 0, 128);
    EXPECT_EQ(a.full, 128 * 2048.0);
    EXPECT_EQ(a.sliding, 0.0);
    EXPECT_EQ(a.state, 0.0);
    const KvGroupBytes b = t.chunk(300, 128, 128);
    EXPECT_EQ(b.full, 128 * 2048.0);
    EXPECT_EQ(b.sliding, 56 * 1024.0);  // tokens 200..255
    EXPECT_EQ(b.state, 0.0);
    const KvGroupBytes c = t.chunk(300, 256, 44);
    EXPECT_EQ(c.full, 44 * 2048.0);
    EXPECT_EQ(c.sliding, 44 * 1024.0);
    EXPECT_EQ(c.state, 20992.0);  // the last prompt token: the state goes
    // The whole request: 614,400 + 102,400 + 20,992 B (the chunks add up to it).
    const KvGroupBytes r = t.request(300);
    EXPECT_EQ(r.full, 614400.0);
    EXPECT_EQ(r.sliding, 102400.0);
    EXPECT_EQ(r.state, 20992.0);
    EXPECT_EQ(a.sliding + b.sliding + c.sliding, r.sliding);
    // A prompt shorter than the window sends all of it to the sliding layer.
    EXPECT_EQ(t.request(60).sliding, 60 * 1024.0);
    // Dense: every layer's KV of every token, nothing else.
    topo::ModelShape dense = mixed_model();
    dense.layer_kinds.clear();
    const KvGroupBytes dr = kv_transfer_bytes(dense, 2).request(300);
    EXPECT_EQ(dr.full, 300 * 4 * 1024.0);
    EXPECT_EQ(dr.sliding + dr.state, 0.0);
}

}  // namespace
}  // namespace pdsim::des
