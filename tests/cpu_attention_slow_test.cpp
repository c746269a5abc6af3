// Label `slow`: the long cases of cpu_attention_test. Fresh prefills of 4096 tokens (the oracle is
// quadratic in fp64), a long chunk over a long prefix, and a large decode batch, all `cpu` against
// `cpu_ref` with the same metric: |cpu - cpu_ref| <= tol * max(1, |cpu_ref|), tol 1e-5 (fp32 KV)
// or 1e-2 (bf16 KV); pools poisoned and checked as in cpu_attention_test.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "tests/attention_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::attn::test {
namespace {

double tolerance(kv::KVDtype d) {
    return d == kv::KVDtype::kF32 ? 1e-5 : 1e-2;
}

void check(const Shape& s, const Batch& b, bool save_kv) {
    SCOPED_TRACE(s.describe() + " | save_kv=" + (save_kv ? "true" : "false") + " | " +
                 b.describe());
    auto ref_pool = make_pool(s, b.num_pages);
    auto cpu_pool = make_pool(s, b.num_pages);
    auto want = make_pool(s, b.num_pages);
    ASSERT_TRUE(ref_pool && cpu_pool && want);
    init_pool(*ref_pool, s, b, !save_kv);
    init_pool(*cpu_pool, s, b, !save_kv);
    init_pool(*want, s, b, true);
    Runner ref("cpu_ref", s), cpu("cpu", s);
    Status a = ref.launch(b, *ref_pool, save_kv);
    Status c = cpu.launch(b, *cpu_pool, save_kv);
    Status aw = ref.wait(), cw = cpu.wait();
    ASSERT_TRUE(a.ok() && aw.ok()) << a.to_string() << " / " << aw.to_string();
    ASSERT_TRUE(c.ok() && cw.ok()) << c.to_string() << " / " << cw.to_string();
    EXPECT_TRUE(outputs_close(cpu.out(), ref.out(), tolerance(s.dtype), s, b));
    EXPECT_TRUE(pools_equal(*cpu_pool, *want));
}

Shape shape(int hq, int hkv, int d, int ps, kv::KVDtype dtype) {
    Shape s;
    s.num_q_heads = hq;
    s.num_kv_heads = hkv;
    s.head_dim = d;
    s.page_size = ps;
    s.dtype = dtype;
    return s;
}

TEST(CpuAttentionSlow, FreshPrefill4096) {
    check(shape(1, 1, 64, 16, kv::KVDtype::kF32),
          make_batch(shape(1, 1, 64, 16, kv::KVDtype::kF32), ForwardMode::kExtend, {{0, 4096}}, 1),
          true);
    const Shape b = shape(4, 1, 128, 1, kv::KVDtype::kBF16);
    check(b, make_batch(b, ForwardMode::kExtend, {{0, 4096}}, 2), false);
    const Shape c = shape(8, 1, 128, 64, kv::KVDtype::kF32);
    check(c, make_batch(c, ForwardMode::kExtend, {{0, 4096}, {0, 63}}, 3), true);
}

TEST(CpuAttentionSlow, LongChunkOverLongPrefix) {
    const Shape s = shape(8, 2, 128, 16, kv::KVDtype::kF32);
    check(s, make_batch(s, ForwardMode::kExtend, {{3584, 512}, {1000, 1}, {0, 300}}, 4), true);
    const Shape t = shape(16, 2, 64, 64, kv::KVDtype::kBF16);
    check(t, make_batch(t, ForwardMode::kExtend, {{2047, 1025}}, 5), false);
}

TEST(CpuAttentionSlow, LargeDecodeBatch) {
    std::mt19937_64 rng(6);
    std::vector<Req> reqs;
    for (int i = 0; i < 96; ++i)
        reqs.push_back({std::uniform_int_distribution<int>(0, 4095)(rng), 1});
    for (auto dtype : {kv::KVDtype::kF32, kv::KVDtype::kBF16}) {
        const Shape s = shape(32, 4, 128, 16, dtype);
        check(s, make_batch(s, ForwardMode::kDecode, reqs, 7), dtype == kv::KVDtype::kF32);
    }
}

}  // namespace
}  // namespace pdsim::attn::test
