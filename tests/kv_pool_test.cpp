#include "backends/kv/kv_pool.h"

#include <gtest/gtest.h>

#include <set>

#include "common/bf16.h"

namespace pdsim::kv {
namespace {

TEST(PageAllocator, NeverHandsOutPageZero) {
    PageAllocator a(9);
    EXPECT_EQ(a.capacity(), 8);
    auto pages = a.alloc(8);
    ASSERT_TRUE(pages.ok());
    std::set<int32_t> s(pages->begin(), pages->end());
    EXPECT_EQ(s.size(), 8u);
    EXPECT_EQ(s.count(0), 0u);
    EXPECT_EQ(*s.begin(), 1);
    EXPECT_EQ(*s.rbegin(), 8);
    EXPECT_EQ(a.alloc(1).status().code(), StatusCode::kResourceExhausted);
}

TEST(PageAllocator, FreshAllocationsAreContiguous) {
    PageAllocator a(100);
    auto p = a.alloc(5);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

TEST(PageAllocator, RejectsBadFreesAtomically) {
    PageAllocator a(10);
    auto p = a.alloc(3);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(a.free(std::vector<int32_t>{0}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(a.free(std::vector<int32_t>{10}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(a.free(std::vector<int32_t>{(*p)[0], 7}).code(), StatusCode::kInvalidArgument);  // 7 not allocated
    EXPECT_TRUE(a.is_allocated((*p)[0]));  // nothing was freed by the failed call
    EXPECT_EQ(a.free(std::vector<int32_t>{(*p)[1], (*p)[1]}).code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(a.free(*p).ok());
    EXPECT_EQ(a.available(), 9);
    EXPECT_EQ(a.free(*p).code(), StatusCode::kInvalidArgument);  // double free
}

TEST(MHATokenToKVPool, LayoutAndAddressing) {
    MHAPoolConfig c;
    c.num_layers = 3;
    c.num_pages = 5;
    c.page_size = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_TRUE(pool.ok()) << pool.status().to_string();
    auto& p = **pool;
    EXPECT_EQ(p.buffer_count(), 2);
    EXPECT_EQ(p.page_bytes(0, 0), 4u * 2 * 8 * 4);
    EXPECT_EQ(p.token_bytes(2, 1), 2u * 8 * 4);
    EXPECT_NE(p.data(0, 0), p.data(0, 1));
    EXPECT_NE(p.data(0, 0), p.data(1, 0));
    std::vector<float> k(16), v(16);
    for (int i = 0; i < 16; ++i) {
        k[static_cast<size_t>(i)] = static_cast<float>(i);
        v[static_cast<size_t>(i)] = static_cast<float>(-i);
    }
    const int32_t loc = 3 * 4 + 2;  // page 3, slot 2
    ASSERT_TRUE(p.set_kv_buffer(1, &loc, 1, k.data(), v.data()).ok());
    // The transfer engine's addressing: base + page * page_bytes + slot * token_bytes.
    auto* kb = reinterpret_cast<const float*>(static_cast<const char*>(p.data(1, 0)) + 3 * p.page_bytes(1, 0) +
                                              2 * p.token_bytes(1, 0));
    EXPECT_EQ(kb[5], 5.f);
    std::vector<float> back(16);
    p.read_token(1, 1, loc, back.data());
    EXPECT_EQ(back, v);
    const int32_t bad = 5 * 4;
    EXPECT_EQ(p.set_kv_buffer(1, &bad, 1, k.data(), v.data()).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(p.set_kv_buffer(3, &loc, 1, k.data(), v.data()).code(), StatusCode::kInvalidArgument);
}

TEST(MHATokenToKVPool, Bf16StoresRoundedBits) {
    MHAPoolConfig c;
    c.num_pages = 2;
    c.page_size = 1;
    c.num_kv_heads = 1;
    c.head_dim = 2;
    c.dtype = KVDtype::kBF16;
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->page_bytes(0, 0), 4u);
    float k[2] = {1.0f + 1.0f / 64, 3.3f}, v[2] = {-2.f, 0.1f};
    const int32_t loc = 1;
    ASSERT_TRUE((*pool)->set_kv_buffer(0, &loc, 1, k, v).ok());
    auto* bits = static_cast<const bf16_t*>((*pool)->data(0, 0));
    EXPECT_EQ(bits[2], float_to_bf16(k[0]));
    EXPECT_EQ(bits[3], float_to_bf16(k[1]));
}

TEST(MLATokenToKVPool, OneBufferPerLayer) {
    MLAPoolConfig c;
    c.num_layers = 2;
    c.num_pages = 3;
    c.page_size = 2;
    c.kv_lora_rank = 16;
    c.rope_dim = 4;
    c.dtype = KVDtype::kF32;
    auto pool = MLATokenToKVPool::create(c);
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->buffer_count(), 1);
    EXPECT_EQ((*pool)->page_bytes(1, 0), 2u * 20 * 4);
    std::vector<float> kv(20, 1.5f);
    const int32_t loc = 5;
    ASSERT_TRUE((*pool)->set_mla_kv_buffer(1, &loc, 1, kv.data()).ok());
    std::vector<float> back(20);
    (*pool)->read_token(1, 0, loc, back.data());
    EXPECT_EQ(back, kv);
}

TEST(KVPool, RejectsBadConfigs) {
    MHAPoolConfig c;
    c.num_pages = 1;
    EXPECT_EQ(MHATokenToKVPool::create(c).status().code(), StatusCode::kInvalidArgument);
    c.num_pages = 4;
    c.page_size = 0;
    EXPECT_EQ(MHATokenToKVPool::create(c).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(parse_dtype("fp8").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdsim::kv
