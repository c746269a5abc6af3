// The instances' own decisions (sim/des/instances.h): admission, extend and decode batches,
// preemption and retiring a batch, on hand-made requests with page counts worked out by hand
// (16-token pages, 512-token prefix blocks).
#include <gtest/gtest.h>

#include <vector>

#include "sim/des/instances.h"

namespace pdsim::des {
namespace {

constexpr int kPageSize = 16;

struct Fixture {
    explicit Fixture(InstanceRole role, int64_t pages, bool prefix_cache = false)
        : x(0, role, nullptr, KvCache(pages, kPageSize, prefix_cache)) {}
    // A request in flight, queued on x.waiting.
    uint32_t add(int32_t input_len, int32_t output_len, uint32_t trace_index = 0) {
        const uint32_t slot = slots.acquire();
        slots[slot].trace_index = trace_index;
        slots[slot].input_len = input_len;
        slots[slot].output_len = output_len;
        x.waiting.push_back(slot);
        return slot;
    }
    // Admits the front, whose trace entry has block hashes `hashes`.
    Admission admit(std::vector<int64_t> hashes = {}, bool reserve_output = false) {
        const uint32_t slot = x.waiting.front();
        std::vector<workload::Request> trace(slots[slot].trace_index + 1);
        trace.back().hash_ids = std::move(hashes);
        int64_t hit = 100;  // added to
        const Admission a =
            admit_front(x, slots[slot], trace, AdmissionOptions{reserve_output}, &hit);
        last_hit_tokens = hit - 100;
        return a;
    }
    Instance x;
    RequestSlots slots;
    int64_t last_hit_tokens = 0;
};

TEST(Admission, DecodeSideTakesThePromptsPagesFcfs) {
    Fixture f(InstanceRole::kDecode, 5);
    const uint32_t a = f.add(40, 8);  // 3 pages
    const uint32_t b = f.add(40, 8);
    EXPECT_EQ(f.admit(), Admission::kDecodeSide);
    EXPECT_EQ(f.slots[a].decode_pages, 3);
    EXPECT_TRUE(f.slots[a].decode_admitted);
    EXPECT_EQ(f.x.kv.free_pages(), 2);
    EXPECT_EQ(f.admit(), Admission::kBlocked);  // 3 > 2 free
    ASSERT_EQ(f.x.waiting.size(), 1u);
    EXPECT_EQ(f.x.waiting.front(), b);
    EXPECT_FALSE(f.slots[b].decode_admitted);
    EXPECT_TRUE(f.x.extend_q.empty());
}

TEST(Admission, ReserveOutputHoldsPromptAndOutput) {
    Fixture f(InstanceRole::kDecode, 100);
    const uint32_t a = f.add(40, 10);  // 50 tokens: 4 pages
    EXPECT_EQ(f.admit({}, true), Admission::kDecodeSide);
    EXPECT_EQ(f.slots[a].decode_pages, 4);
}

TEST(Admission, APromptIsQueuedForItsExtendForwards) {
    Fixture f(InstanceRole::kPrefill, 100);
    const uint32_t a = f.add(40, 10);
    EXPECT_EQ(f.admit({}, true), Admission::kCompute);  // reserve_output: not on prefill
    EXPECT_EQ(f.last_hit_tokens, 0);
    EXPECT_EQ(f.slots[a].compute_pages, 3);
    EXPECT_EQ(f.slots[a].target_tokens, 40);
    EXPECT_EQ(f.slots[a].computed_tokens, 0);
    ASSERT_EQ(f.x.extend_q.size(), 1u);
    EXPECT_EQ(f.x.extend_q.front(), a);
}

TEST(Admission, PrefixHitsAreWholeBlocksAndLeaveATokenToCompute) {
    Fixture f(InstanceRole::kPrefill, 1000, true);
    const std::vector<int64_t> hashes = {11, 12, 13};
    const uint32_t first = f.add(1100, 4);  // 2 full blocks
    ASSERT_EQ(f.admit(hashes), Admission::kCompute);
    EXPECT_EQ(f.last_hit_tokens, 0);
    EXPECT_EQ(f.slots[first].compute_pages, 69);  // ceil(1100 / 16)
    // Done: its two full blocks go into the cache.
    f.x.kv.release(hashes, 0, 2, f.slots[first].compute_pages);
    f.x.extend_q.clear();
    const uint32_t second = f.add(1100, 4);
    ASSERT_EQ(f.admit(hashes), Admission::kCompute);
    EXPECT_EQ(f.last_hit_tokens, 1024);
    EXPECT_EQ(f.slots[second].pinned_blocks, 2);
    EXPECT_EQ(f.slots[second].computed_tokens, 1024);
    EXPECT_EQ(f.slots[second].unsent_hit_tokens, 1024);
    EXPECT_EQ(f.slots[second].compute_pages, 5);  // ceil(76 / 16)
    // A prompt of exactly one block may hit none of it: a token must be left to compute.
    f.x.extend_q.clear();
    const uint32_t third = f.add(512, 4);
    ASSERT_EQ(f.admit(hashes), Admission::kCompute);
    EXPECT_EQ(f.last_hit_tokens, 0);
    EXPECT_EQ(f.slots[third].computed_tokens, 0);
}

TEST(ExtendBatch, ChunksFillTheTokenBudgetFcfs) {
    Fixture f(InstanceRole::kPrefill, 100);
    policy::BatchingOptions batching;
    batching.chunk_size = 32;
    batching.max_batch_tokens = 48;
    const uint32_t a = f.add(40, 1);
    const uint32_t b = f.add(40, 1);
    const uint32_t c = f.add(40, 1);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(f.admit(), Admission::kCompute);
    std::vector<cost::ExtendItem> items;
    EXPECT_EQ(plan_extend(f.x, f.slots, batching, &items), 48);
    ASSERT_EQ(f.x.extend_batch.size(), 2u);
    EXPECT_EQ(f.x.extend_batch[0].slot, a);
    EXPECT_EQ(f.x.extend_batch[0].tokens, 32);
    EXPECT_EQ(f.x.extend_batch[1].slot, b);
    EXPECT_EQ(f.x.extend_batch[1].tokens, 16);
    ASSERT_EQ(items.size(), 2u);
    EXPECT_EQ(items[1].new_tokens, 16);
    // Both still have KV to compute: they stay at the front, in order; c behind them.
    std::vector<uint32_t> scratch;
    retire_extend_batch(f.x, f.slots, &scratch);
    ASSERT_EQ(f.x.extend_q.size(), 3u);
    EXPECT_EQ(f.x.extend_q[0], a);
    EXPECT_EQ(f.x.extend_q[1], b);
    EXPECT_EQ(f.x.extend_q[2], c);
    // Next forward: a's last 8 tokens start where it stopped.
    f.slots[a].computed_tokens = 32;
    f.slots[b].computed_tokens = 16;
    EXPECT_EQ(plan_extend(f.x, f.slots, batching, &items), 48);
    EXPECT_EQ(items[0].new_tokens, 8);
    EXPECT_EQ(items[0].cached_tokens, 32);
    EXPECT_EQ(items[1].new_tokens, 24);
    EXPECT_EQ(items[2].new_tokens, 16);
    retire_extend_batch(f.x, f.slots, &scratch);  // a and b complete; c does not
    ASSERT_EQ(f.x.extend_q.size(), 1u);
    EXPECT_EQ(f.x.extend_q[0], c);
}

TEST(DecodeBatch, GrowsPagesAndPreemptsTheNewestWhenShort) {
    // 4 pages; two running requests of 16 prompt tokens and 1 generated hold 2 pages each
    // (17 tokens), so the pool is full. The next step writes token 18: no new page needed.
    Fixture f(InstanceRole::kDecode, 4);
    const uint32_t a = f.add(16, 100);
    const uint32_t b = f.add(16, 100);
    for (uint32_t s : {a, b}) {
        ASSERT_TRUE(f.x.kv.alloc(2));
        f.slots[s].decode_pages = 2;
        f.slots[s].generated = 1;
        f.x.running.push_back(s);
    }
    f.x.waiting.clear();
    policy::BatchingOptions batching;
    int64_t preemptions = 0;
    EXPECT_EQ(plan_decode(f.x, f.slots, batching, false, {}, &preemptions), 2u);
    EXPECT_EQ(preemptions, 0);
    EXPECT_EQ(decode_kv_tokens(f.x, f.slots, 2), 34);
    // At 33 tokens (generated 17) the next step needs a third page each: b (newest) goes.
    f.slots[a].generated = 17;
    f.slots[b].generated = 17;
    ASSERT_EQ(plan_decode(f.x, f.slots, batching, false, {}, &preemptions), 1u);
    EXPECT_EQ(preemptions, 1);
    EXPECT_EQ(f.slots[a].decode_pages, 3);
    EXPECT_EQ(f.slots[b].decode_pages, 0);
    EXPECT_TRUE(f.slots[b].needs_recompute);
    ASSERT_EQ(f.x.waiting.size(), 1u);
    EXPECT_EQ(f.x.waiting.front(), b);
    ASSERT_EQ(f.x.running.size(), 1u);
    EXPECT_EQ(f.x.kv.free_pages(), 1);
}

TEST(DecodeBatch, ALoneRequestThatCannotGrowPreemptsItself) {
    Fixture f(InstanceRole::kDecode, 2);
    const uint32_t a = f.add(32, 100);
    f.x.waiting.clear();
    ASSERT_TRUE(f.x.kv.alloc(2));
    f.slots[a].decode_pages = 2;
    f.slots[a].generated = 1;  // 33 tokens: a third page
    f.x.running.push_back(a);
    int64_t preemptions = 0;
    EXPECT_EQ(plan_decode(f.x, f.slots, policy::BatchingOptions{}, false, {}, &preemptions), 0u);
    EXPECT_EQ(preemptions, 1);
    EXPECT_TRUE(f.x.running.empty());
    EXPECT_EQ(f.x.kv.free_pages(), 2);
}

TEST(DecodeBatch, RetiringDropsTheFinishedAndKeepsTheOrder) {
    Fixture f(InstanceRole::kDecode, 100);
    std::vector<uint32_t> slots;
    const int32_t outputs[4] = {3, 2, 5, 2};
    for (int32_t out : outputs) {
        const uint32_t s = f.add(8, out);
        f.slots[s].generated = 1;
        f.x.running.push_back(s);
        slots.push_back(s);
    }
    f.x.decode_batch_size = 3;  // the last one was not in the batch
    std::vector<uint32_t> finished;
    retire_decode_batch(f.x, f.slots, &finished);
    ASSERT_EQ(finished.size(), 1u);
    EXPECT_EQ(finished[0], slots[1]);
    ASSERT_EQ(f.x.running.size(), 3u);
    EXPECT_EQ(f.x.running[0], slots[0]);
    EXPECT_EQ(f.x.running[1], slots[2]);
    EXPECT_EQ(f.x.running[2], slots[3]);
    EXPECT_EQ(f.slots[slots[3]].generated, 1);  // not in the batch
    EXPECT_EQ(f.slots[slots[2]].generated, 2);
}

TEST(RequestSlots, ReusesReleasedSlotsFresh) {
    RequestSlots slots;
    const uint32_t a = slots.acquire();
    const uint32_t b = slots.acquire();
    EXPECT_NE(a, b);
    slots[a].generated = 7;
    slots.release(a);
    EXPECT_EQ(slots.free_mask(), (std::vector<bool>{true, false}));
    EXPECT_EQ(slots.acquire(), a);
    EXPECT_EQ(slots[a].generated, 0);
    EXPECT_EQ(slots.size(), 2u);
}

}  // namespace
}  // namespace pdsim::des
