#include "backends/kv/kv_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "common/bf16.h"
#include "tests/attention_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::kv {
namespace {

using ::testing::HasSubstr;

// One slot, as the int32 view the write helpers take.
runtime::ConstTensorView locs_of(const int32_t* loc, int64_t n = 1) {
    return runtime::host_view(loc, {n});
}
// Rows of floats as a [n][heads][dim] fp32 host view.
runtime::ConstTensorView kv_rows(const std::vector<float>& x, int heads, int dim) {
    const int64_t n = static_cast<int64_t>(x.size()) / (heads * dim);
    return runtime::host_view(x.data(), {n, heads, dim});
}

TEST(PageAllocator, NeverHandsOutPageZero) {
    PageAllocator a(9);
    EXPECT_EQ(a.capacity(), 8);
    auto pages = a.alloc(8);
    ASSERT_OK(pages);
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
    ASSERT_OK(p);
    EXPECT_EQ(*p, (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

TEST(PageAllocator, RejectsBadFreesAtomically) {
    PageAllocator a(10);
    auto p = a.alloc(3);
    ASSERT_OK(p);
    EXPECT_EQ(a.free(std::vector<int32_t>{0}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(a.free(std::vector<int32_t>{10}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(a.free(std::vector<int32_t>{(*p)[0], 7}).code(),
              StatusCode::kInvalidArgument);  // 7 not allocated
    EXPECT_TRUE(a.is_allocated((*p)[0]));     // nothing was freed by the failed call
    EXPECT_EQ(a.free(std::vector<int32_t>{(*p)[1], (*p)[1]}).code(), StatusCode::kInvalidArgument);
    EXPECT_OK(a.free(*p));
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
    ASSERT_OK(pool);
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
    ASSERT_OK(p.set_kv_buffer(1, locs_of(&loc), kv_rows(k, 2, 8), kv_rows(v, 2, 8)));
    // The transfer engine's addressing: base + page * page_bytes + slot * token_bytes.
    auto* kb = reinterpret_cast<const float*>(static_cast<const char*>(p.data(1, 0)) +
                                              3 * p.page_bytes(1, 0) + 2 * p.token_bytes(1, 0));
    EXPECT_EQ(kb[5], 5.f);
    std::vector<float> back(16);
    p.read_token(1, 1, loc, back.data());
    EXPECT_EQ(back, v);
    const int32_t bad = 5 * 4;
    EXPECT_EQ(p.set_kv_buffer(1, locs_of(&bad), kv_rows(k, 2, 8), kv_rows(v, 2, 8)).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(p.set_kv_buffer(3, locs_of(&loc), kv_rows(k, 2, 8), kv_rows(v, 2, 8)).code(),
              StatusCode::kInvalidArgument);
}

TEST(MHATokenToKVPool, Bf16StoresRoundedBits) {
    MHAPoolConfig c;
    c.num_pages = 2;
    c.page_size = 1;
    c.num_kv_heads = 1;
    c.head_dim = 2;
    c.dtype = KVDtype::kBF16;
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    EXPECT_EQ((*pool)->page_bytes(0, 0), 4u);
    float k[2] = {1.0f + 1.0f / 64, 3.3f}, v[2] = {-2.f, 0.1f};
    const int32_t loc = 1;
    ASSERT_TRUE((*pool)
                    ->set_kv_buffer(0, locs_of(&loc),
                                    runtime::host_view(static_cast<const float*>(k), {1, 1, 2}),
                                    runtime::host_view(static_cast<const float*>(v), {1, 1, 2}))
                    .ok());
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
    ASSERT_OK(pool);
    EXPECT_EQ((*pool)->buffer_count(), 1);
    EXPECT_EQ((*pool)->page_bytes(1, 0), 2u * 20 * 4);
    std::vector<float> kv(20, 1.5f);
    const int32_t loc = 5;
    ASSERT_TRUE(
        (*pool)
            ->set_mla_kv_buffer(1, locs_of(&loc),
                                runtime::host_view(static_cast<const float*>(kv.data()), {1, 20}))
            .ok());
    std::vector<float> back(20);
    (*pool)->read_token(1, 0, loc, back.data());
    EXPECT_EQ(back, kv);
}

// kv::KVDtype is runtime::DType; the pool accepts only the dtypes it stores, with today's names.
static_assert(std::is_same_v<KVDtype, runtime::DType>);

TEST(KVDtype, IsTheRuntimeDTypeAndParsesOnlyPoolDtypes) {
    EXPECT_EQ(KVDtype::kF32, runtime::DType::kF32);
    EXPECT_EQ(dtype_name(KVDtype::kBF16), "bf16");
    EXPECT_EQ(dtype_size(KVDtype::kF32), 4u);
    EXPECT_EQ(*parse_dtype("bfloat16"), KVDtype::kBF16);
    EXPECT_EQ(*parse_dtype("fp32"), KVDtype::kF32);
    for (const char* bad : {"fp16", "fp8", "int32", "fp33"}) {
        auto st = parse_dtype(bad);
        ASSERT_FALSE(st.ok()) << bad;
        EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(st.status().message(), HasSubstr("unknown KV dtype '" + std::string(bad) +
                                                     "' (expected fp32 or bf16)"));
    }
    EXPECT_TRUE(is_pool_dtype(KVDtype::kBF16));
    EXPECT_FALSE(is_pool_dtype(runtime::DType::kF16));
    MHAPoolConfig c;
    c.dtype = runtime::DType::kF16;
    auto pool = MHATokenToKVPool::create(c);
    EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(pool.status().message(), HasSubstr("dtype fp16 is not a KV pool dtype"));
    MLAPoolConfig m;
    m.dtype = runtime::DType::kI32;
    EXPECT_THAT(MLATokenToKVPool::create(m).status().message(),
                HasSubstr("dtype int32 is not a KV pool dtype"));
}

// What a kernel sees: the layer's K/V base pointers, [pages][page_size][heads][dim] with element
// strides, dtype and device, matching data() / page_bytes() / token_bytes().
TEST(MHATokenToKVPool, LayerViewDescribesTheBuffers) {
    MHAPoolConfig c;
    c.num_layers = 3;
    c.num_pages = 5;
    c.page_size = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    c.v_head_dim = 6;
    c.dtype = KVDtype::kBF16;
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    auto& p = **pool;
    auto lv = p.layer_view(2);
    ASSERT_OK(lv);
    EXPECT_EQ(lv->layer, 2);
    EXPECT_EQ(lv->dtype, KVDtype::kBF16);
    EXPECT_EQ(lv->device.kind, runtime::DeviceKind::kCpu);
    EXPECT_EQ(lv->num_pages, 5);
    EXPECT_EQ(lv->page_size, 4);
    EXPECT_EQ(lv->k.data, p.data(2, 0));
    EXPECT_EQ(lv->v.data, p.data(2, 1));
    EXPECT_EQ(runtime::describe(lv->k), "bf16[5, 4, 2, 8] cpu:0");
    EXPECT_EQ(runtime::describe(lv->v), "bf16[5, 4, 2, 6] cpu:0");
    // Page and token strides in elements agree with the byte addressing of the transfer engine.
    EXPECT_EQ(static_cast<size_t>(lv->k.stride(0)) * 2, p.page_bytes(2, 0));
    EXPECT_EQ(static_cast<size_t>(lv->v.stride(1)) * 2, p.token_bytes(2, 1));
    EXPECT_EQ(lv->k.stride(2), 8);
    EXPECT_TRUE(lv->k.is_contiguous());
    auto bad = p.layer_view(3);
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr("layer 3 out of range [0, 3)"));
    EXPECT_THAT(p.buffer_view(0, 2).status().message(), HasSubstr("buf 2 out of range [0, 2)"));
}

TEST(MLATokenToKVPool, LayerViewHasOneBuffer) {
    MLAPoolConfig c;
    c.num_layers = 2;
    c.num_pages = 3;
    c.page_size = 2;
    c.kv_lora_rank = 16;
    c.rope_dim = 4;
    auto pool = MLATokenToKVPool::create(c);
    ASSERT_OK(pool);
    auto lv = (*pool)->layer_view(1);
    ASSERT_OK(lv);
    EXPECT_EQ(runtime::describe(lv->k), "bf16[3, 2, 1, 20] cpu:0");
    EXPECT_TRUE(lv->v.empty());
}

// Sources in fp32 or bf16, into fp32 or bf16 pools: bf16 -> bf16 copies the bits, bf16 -> fp32
// widens exactly, fp32 -> bf16 rounds to nearest even.
TEST(MHATokenToKVPool, WritesBf16AndFp32Sources) {
    const std::vector<float> kf{1.0f + 1.0f / 64, 3.3f, -0.7f, 1e-3f}, vf{-2.f, 0.1f, 7.5f, -1e4f};
    std::vector<bf16_t> kb, vb;
    for (float x : kf) kb.push_back(float_to_bf16(x));
    for (float x : vf) vb.push_back(float_to_bf16(x));
    for (KVDtype pool_dtype : {KVDtype::kF32, KVDtype::kBF16}) {
        for (KVDtype src : {KVDtype::kF32, KVDtype::kBF16}) {
            SCOPED_TRACE(std::string("pool ") + std::string(dtype_name(pool_dtype)) + ", source " +
                         std::string(dtype_name(src)));
            MHAPoolConfig c;
            c.num_pages = 3;
            c.page_size = 2;
            c.num_kv_heads = 2;
            c.head_dim = 2;
            c.dtype = pool_dtype;
            auto pool = MHATokenToKVPool::create(c);
            ASSERT_OK(pool);
            ASSERT_OK((*pool)->fill(0xFF));
            const int32_t loc = 3;
            const void* k = src == KVDtype::kF32 ? static_cast<const void*>(kf.data()) : kb.data();
            const void* v = src == KVDtype::kF32 ? static_cast<const void*>(vf.data()) : vb.data();
            ASSERT_TRUE((*pool)
                            ->set_kv_buffer(0, locs_of(&loc),
                                            runtime::make_view(k, src, {}, {1, 2, 2}),
                                            runtime::make_view(v, src, {}, {1, 2, 2}))
                            .ok());
            std::vector<float> back(4);
            (*pool)->read_token(0, 0, loc, back.data());
            for (size_t e = 0; e < 4; ++e) {
                const bool exact = pool_dtype == KVDtype::kF32 && src == KVDtype::kF32;
                EXPECT_EQ(back[e], exact ? kf[e] : bf16_to_float(kb[e])) << e;
            }
            (*pool)->read_token(0, 1, loc, back.data());
            EXPECT_EQ(back[3], pool_dtype == KVDtype::kF32 && src == KVDtype::kF32
                                   ? vf[3]
                                   : bf16_to_float(vb[3]));
            // Only slot 3 was written: slot 2 is still poison.
            (*pool)->read_token(0, 0, 2, back.data());
            EXPECT_TRUE(std::isnan(back[0]));
        }
    }
}

// Each bad argument is named, and nothing is written unless every check passes.
TEST(MHATokenToKVPool, SetKvBufferRejectsBadViewsBeforeWriting) {
    MHAPoolConfig c;
    c.num_layers = 2;
    c.num_pages = 4;
    c.page_size = 2;
    c.num_kv_heads = 2;
    c.head_dim = 4;
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    auto& p = **pool;
    ASSERT_OK(p.fill(0xFF));
    std::vector<float> k(2 * 2 * 4, 1.f), v(2 * 2 * 4, 2.f);
    const std::vector<int32_t> locs{2, 3}, bad_locs{2, 8};
    const std::vector<int64_t> wide{2, 3};
    auto kv = [](const std::vector<float>& x, std::initializer_list<int64_t> shape) {
        return runtime::make_view(x.data(), KVDtype::kF32, {}, shape);
    };
    struct Case {
        const char* what;
        Status st;
        const char* message;
    };
    const Case cases[] = {
        {"slot out of range",
         p.set_kv_buffer(0, runtime::host_view(bad_locs.data(), {2}), kv(k, {2, 2, 4}),
                         kv(v, {2, 2, 4})),
         "locs[1]: KV slot 8 out of range [0, 8)"},
        {"locs int64",
         p.set_kv_buffer(0, runtime::make_view(wide.data(), runtime::DType::kI64, {}, {2}),
                         kv(k, {2, 2, 4}), kv(v, {2, 2, 4})),
         "locs: dtype int64, expected int32"},
        {"k heads",
         p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}), kv(k, {2, 4, 2}),
                         kv(v, {2, 2, 4})),
         "k: shape [2, 4, 2], expected [2, 2, 4]"},
        {"v rows",
         p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}), kv(k, {2, 2, 4}),
                         kv(v, {1, 2, 4})),
         "v: shape [1, 2, 4], expected [2, 2, 4]"},
        {"k flat",
         p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}), kv(k, {2, 8}), kv(v, {2, 2, 4})),
         "k: shape [2, 8], expected [2, 2, 4]"},
        {"k fp16",
         p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}),
                         runtime::make_view(k.data(), runtime::DType::kF16, {}, {2, 2, 4}),
                         kv(v, {2, 2, 4})),
         "k: dtype fp16, expected fp32 or bf16"},
        {"v on cuda",
         p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}), kv(k, {2, 2, 4}),
                         runtime::make_view(v.data(), KVDtype::kF32,
                                            {runtime::DeviceKind::kCuda, 0}, {2, 2, 4})),
         "v: memory on cuda, expected cpu"},
        {"null k", p.set_kv_buffer(0, runtime::host_view(locs.data(), {2}), {}, kv(v, {2, 2, 4})),
         "k: null data pointer"},
        {"layer",
         p.set_kv_buffer(2, runtime::host_view(locs.data(), {2}), kv(k, {2, 2, 4}),
                         kv(v, {2, 2, 4})),
         "layer 2 out of range [0, 2)"},
    };
    for (const Case& cs : cases) {
        EXPECT_EQ(cs.st.code(), StatusCode::kInvalidArgument)
            << cs.what << ": " << cs.st.to_string();
        EXPECT_THAT(cs.st.message(), HasSubstr(cs.message)) << cs.what;
    }
    std::vector<float> back(8);
    for (int l = 0; l < 2; ++l) {
        for (int buf = 0; buf < 2; ++buf) {
            for (int64_t slot = 0; slot < 8; ++slot) {
                p.read_token(l, buf, slot, back.data());
                EXPECT_TRUE(std::isnan(back[0]))
                    << "a rejected write wrote layer " << l << " buf " << buf << " slot " << slot;
            }
        }
    }
    // Zero tokens: nothing to write, null k and v accepted.
    EXPECT_TRUE(
        p.set_kv_buffer(0, runtime::host_view(static_cast<const int32_t*>(nullptr), {0}), {}, {})
            .ok());
}

// A pool in (what claims to be) CUDA memory: host writes are a precondition failure; kernels get
// its views.
TEST(KVPool, DevicePoolRejectsHostWrites) {
    attn::test::install_host_backed_cuda_runtime();
    MHAPoolConfig c;
    c.num_pages = 2;
    c.page_size = 1;
    c.num_kv_heads = 1;
    c.head_dim = 2;
    c.device = {runtime::DeviceKind::kCuda, 0};
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    std::vector<float> k(2, 1.f);
    const int32_t loc = 1;
    Status st = (*pool)->set_kv_buffer(0, locs_of(&loc), kv_rows(k, 1, 2), kv_rows(k, 1, 2));
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), HasSubstr("set_kv_buffer on a cuda pool from the host"));
    auto lv = (*pool)->layer_view(0);
    ASSERT_OK(lv);
    EXPECT_EQ(runtime::describe(lv->k), "fp32[2, 1, 1, 2] cuda:0");

    MLAPoolConfig m;
    m.device = c.device;
    m.num_pages = 2;
    m.page_size = 1;
    m.kv_lora_rank = 2;
    m.rope_dim = 0;
    auto mla = MLATokenToKVPool::create(m);
    ASSERT_OK(mla);
    st = (*mla)->set_mla_kv_buffer(0, locs_of(&loc), runtime::host_view(k.data(), {1, 2}));
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), HasSubstr("set_mla_kv_buffer on a cuda pool from the host"));
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

// A pool that holds some layers only (a hybrid model's cache group): the others have no memory,
// every accessor refuses them naming the layer, and the bytes are the held layers' only.
TEST(KVPool, HoldsOnlyItsLayers) {
    MHAPoolConfig c;
    c.num_layers = 4;
    c.num_pages = 4;
    c.page_size = 2;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.layers = {1, 3};
    auto pool = MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    EXPECT_EQ((*pool)->num_layers(), 4);
    EXPECT_EQ((*pool)->held_layers(), (std::vector<int>{1, 3}));
    EXPECT_TRUE((*pool)->holds_layer(3));
    EXPECT_FALSE((*pool)->holds_layer(0));
    EXPECT_FALSE((*pool)->holds_layer(4));
    EXPECT_EQ((*pool)->data(0, 0), nullptr);
    EXPECT_NE((*pool)->data(1, 1), nullptr);
    EXPECT_EQ((*pool)->total_bytes(), 2u * 2 * 4 * 2 * 8 * sizeof(float));  // 2 layers x K,V
    EXPECT_THAT((*pool)->layer_view(2).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer 2 is not held")));
    const int32_t locs[] = {2};
    const float k[8] = {}, v[8] = {};
    EXPECT_THAT(
        (*pool)->set_kv_buffer(0, runtime::host_view(locs, {1}), runtime::host_view(k, {1, 1, 8}),
                               runtime::host_view(v, {1, 1, 8})),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer 0 is not held")));
    EXPECT_OK((*pool)->set_kv_buffer(3, runtime::host_view(locs, {1}),
                                     runtime::host_view(k, {1, 1, 8}),
                                     runtime::host_view(v, {1, 1, 8})));
    for (const std::vector<int>& bad : {std::vector<int>{4}, {-1}, {1, 1}}) {
        c.layers = bad;
        EXPECT_THAT(MHATokenToKVPool::create(c).status(),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("layers[")));
    }
}

}  // namespace
}  // namespace pdsim::kv
