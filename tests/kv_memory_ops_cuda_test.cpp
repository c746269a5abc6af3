// The CUDA KV memory ops (transfer/cuda/cuda_kv_memory_ops.h) on device pools against
// HostKvMemoryOps on host copies of the same bytes (itself proven against gather_run /
// scatter_run / kv_checksums_add_run by kv_copy_plan_test): gathers and scatters byte for byte
// into poisoned outputs, checksums bit for bit into device and mapped pinned host sums, on the
// layout matrix of kv_memory_ops_test_util.h and a llama3-8b-sized layer set. Skips with the
// runtime's reason where there is no GPU; never passes silently there.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "tests/kv_memory_ops_test_util.h"
#include "tests/status_matchers.h"
#include "transfer/cuda/cuda_kv_memory_ops.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_memory_ops.h"

namespace pdsim::transfer {
namespace {

using ::testing::HasSubstr;
using testing::KvOpsCase;
using testing::RankPool;

constexpr auto kWait = std::chrono::seconds(60);
constexpr int kStagingPoison = 0xA5;
constexpr int kPoolPoison = 0x5A;
const runtime::Device kGpu{runtime::DeviceKind::kCuda, 0};

runtime::DeviceRuntime* gpu_runtime() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok() || (*rt)->device_count() == 0) return nullptr;
    return *rt;
}

std::string skip_reason() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    return (*rt)->unavailable_reason();
}

// Mapped pinned host memory (cudaHostAlloc), freed on scope exit.
struct PinnedSums {
    uint64_t* data = nullptr;
    explicit PinnedSums(size_t n) {
        if (cudaHostAlloc(reinterpret_cast<void**>(&data), std::max<size_t>(n, 1) * 8,
                          cudaHostAllocMapped) != cudaSuccess) {
            data = nullptr;
        }
    }
    ~PinnedSums() { cudaFreeHost(data); }
    PinnedSums(const PinnedSums&) = delete;
    PinnedSums& operator=(const PinnedSums&) = delete;
};

std::vector<uint64_t> random_sums(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint64_t> v(n);
    for (uint64_t& x : v) x = rng();
    return v;
}

// Every buffer of a device layout, copied to the host and concatenated (host_bytes' order).
std::vector<std::byte> device_bytes(runtime::DeviceRuntime& rt, const KvLayout& layout) {
    std::vector<std::byte> out;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            std::vector<std::byte> part(testing::buffer_bytes(layout, b));
            EXPECT_OK(rt.copy(part.data(), layout.base(l, b), part.size()));
            out.insert(out.end(), part.begin(), part.end());
        }
    }
    return out;
}

// Copies every buffer of host layout `from` into device layout `to` (same shape).
Status upload(runtime::DeviceRuntime& rt, const KvLayout& from, const KvLayout& to) {
    for (int l = 0; l < from.num_layers(); ++l) {
        for (int b = 0; b < from.buffer_count(); ++b) {
            PDSIM_RETURN_IF_ERROR(
                rt.copy(to.base(l, b), from.base(l, b), testing::buffer_bytes(from, b)));
        }
    }
    return {};
}

uint64_t max_byte_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
    if (a.size() != b.size()) return 256;
    uint64_t worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const int d = std::abs(static_cast<int>(a[i]) - static_cast<int>(b[i]));
        worst = std::max<uint64_t>(worst, static_cast<uint64_t>(d));
    }
    return worst;
}

TEST(CudaKvMemoryOps, ReportsNoDeviceClearly) {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) GTEST_SKIP() << "built without CUDA: " << rt.status().to_string();
    if ((*rt)->device_count() > 0) GTEST_SKIP() << "a GPU is present";
    EXPECT_THAT(make_kv_memory_ops(kGpu),
                StatusIs(StatusCode::kUnavailable, HasSubstr("no device")));
}

// One side (prefill or decode) of a case: host pools and device pools of the same shape.
struct Side {
    std::vector<RankPool> host;
    std::vector<RankPool> device;
};

class CudaKvOpsMatrix : public ::testing::TestWithParam<KvOpsCase> {
protected:
    void SetUp() override {
        rt_ = gpu_runtime();
        if (rt_ == nullptr) GTEST_SKIP() << skip_reason();
        c_ = GetParam();
        auto stream = rt_->create_stream(0, "kv-ops-cuda");
        ASSERT_OK(stream);
        stream_ = std::move(*stream);
        auto ops = make_kv_memory_ops(kGpu);
        ASSERT_OK(ops);
        ASSERT_EQ((*ops)->memory_kind(), runtime::DeviceKind::kCuda);
        cuda_ops_.push_back(std::move(*ops));
        // Two slots of 4 KiB: 64 copy items per launch, so calls split and the ring waits.
        auto small = cuda::make_cuda_kv_memory_ops({.device = 0, .slots = 2, .slot_bytes = 4096});
        ASSERT_OK(small);
        cuda_ops_.push_back(std::move(*small));
        for (bool source : {true, false}) {
            Side& side = source ? src_ : dst_;
            for (int r = 0; r < (source ? c_.src_tp : c_.dst_tp); ++r) {
                auto host = testing::make_rank_pool(c_, source, r);
                auto device = testing::make_rank_pool(c_, source, r, kGpu);
                ASSERT_OK(host);
                ASSERT_OK(device);
                ASSERT_EQ(device->layout.device(), kGpu);
                side.host.push_back(std::move(*host));
                side.device.push_back(std::move(*device));
            }
        }
        for (size_t r = 0; r < src_.host.size(); ++r) {
            testing::fill_random(src_.host[r].layout, 200 + r);
            ASSERT_OK(upload(*rt_, src_.host[r].layout, src_.device[r].layout));
        }
        src_pages_ = testing::make_page_table(src_.host[0].layout.num_pages(), c_.src_page_size,
                                              c_.num_tokens, c_.shuffled_pages, 17);
        dst_pages_ = testing::make_page_table(dst_.host[0].layout.num_pages(), c_.dst_page_size,
                                              c_.num_tokens, c_.shuffled_pages, 18);
        pairs_ = testing::fragment_pairs(c_, src_.host, dst_.host);
        ASSERT_FALSE(pairs_.empty());
    }

    runtime::DeviceRuntime* rt_ = nullptr;
    KvOpsCase c_;
    std::unique_ptr<runtime::Stream> stream_;
    std::vector<std::unique_ptr<KvMemoryOps>> cuda_ops_;
    HostKvMemoryOps host_ops_;
    runtime::CpuStream host_stream_{"kv-ops-host"};
    Side src_;
    Side dst_;
    std::vector<int32_t> src_pages_;
    std::vector<int32_t> dst_pages_;
    std::vector<testing::KvOpsPair> pairs_;
};

TEST_P(CudaKvOpsMatrix, GatherScatterAndChecksumsMatchTheHostOps) {
    const int L = c_.num_layers;
    for (size_t o = 0; o < cuda_ops_.size(); ++o) {
        KvMemoryOps& gpu = *cuda_ops_[o];
        for (const auto& p : pairs_) {
            const auto s = static_cast<size_t>(p.src_rank);
            const auto d = static_cast<size_t>(p.dst_rank);
            for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 40}, {40, c_.num_tokens}}) {
                SCOPED_TRACE(::testing::Message()
                             << "ops " << o << ", prefill rank " << p.src_rank << " -> decode "
                             << p.dst_rank << ", tokens [" << t0 << ", " << t1 << ")");
                const std::vector<TokenRun> rs = testing::chunk_runs(
                    c_, p.frag, src_.host[s].layout.buffer_count(), src_pages_, dst_pages_, t0, t1);
                ASSERT_OK_AND_ASSIGN(KvStagingPlan g,
                                     plan_gather(src_.host[s].layout, p.frag, rs, 0, L));
                ASSERT_OK_AND_ASSIGN(KvStagingPlan g_dev,
                                     plan_gather(src_.device[s].layout, p.frag, rs, 0, L));
                EXPECT_EQ(g_dev.ops, g.ops) << "plans carry no addresses";

                // Gather into poisoned staging on both sides.
                std::vector<std::byte> host_staging(g.staging_bytes, std::byte{kStagingPoison});
                ASSERT_OK(host_ops_.enqueue_gather(host_stream_, src_.host[s].layout, g.ops,
                                                   host_staging.data()));
                ASSERT_OK_AND_ASSIGN(runtime::DeviceBuffer staging,
                                     runtime::DeviceBuffer::allocate(kGpu, g.staging_bytes));
                ASSERT_OK(staging.fill(kStagingPoison));
                ASSERT_OK(gpu.enqueue_gather(*stream_, src_.device[s].layout, g.ops,
                                             staging.as<std::byte>()));
                ASSERT_OK(stream_->synchronize(kWait));
                ASSERT_OK(host_stream_.synchronize(kWait));
                std::vector<std::byte> gpu_staging(g.staging_bytes);
                ASSERT_OK(staging.copy_to_host(gpu_staging.data(), gpu_staging.size()));
                ASSERT_EQ(testing::first_difference(gpu_staging, host_staging), std::nullopt);

                // Scatter into poisoned decode pools on both sides.
                const KvLayout& host_dst = dst_.host[d].layout;
                const KvLayout& dev_dst = dst_.device[d].layout;
                ASSERT_OK(dst_.host[d].pool->fill(kPoolPoison));
                ASSERT_OK(dst_.device[d].pool->fill(kPoolPoison));
                ASSERT_OK_AND_ASSIGN(KvStagingPlan sc, plan_scatter(host_dst, p.frag, rs, 0, L));
                ASSERT_OK(
                    host_ops_.enqueue_scatter(host_stream_, host_dst, sc.ops, host_staging.data()));
                ASSERT_OK(gpu.enqueue_scatter(*stream_, dev_dst, sc.ops, staging.as<std::byte>()));
                ASSERT_OK(stream_->synchronize(kWait));
                ASSERT_OK(host_stream_.synchronize(kWait));
                EXPECT_EQ(testing::first_difference(device_bytes(*rt_, dev_dst),
                                                    testing::host_bytes(host_dst)),
                          std::nullopt);

                // Checksums: the sender's fragment sums on the prefill side and the page sums
                // over the decode rank's heads, into device sums and into mapped pinned sums,
                // added to the same random start.
                ASSERT_OK_AND_ASSIGN(KvChecksumPlan frag_sums,
                                     plan_fragment_checksums(src_.host[s].layout, KvSide::kSource,
                                                             p.frag, rs, 0, L));
                ASSERT_OK_AND_ASSIGN(
                    KvChecksumPlan page_sums,
                    plan_page_checksums(host_dst, dst_pages_, t0, t1, 0, L, host_dst.head_begin(),
                                        host_dst.local_heads()));
                struct Check {
                    const KvChecksumPlan& plan;
                    const KvLayout& host;
                    const KvLayout& device;
                };
                for (const Check& ck :
                     {Check{frag_sums, src_.host[s].layout, src_.device[s].layout},
                      Check{page_sums, host_dst, dev_dst}}) {
                    const std::vector<uint64_t> start = random_sums(ck.plan.sum_count, 9);
                    std::vector<uint64_t> want = start;
                    ASSERT_OK(host_ops_.enqueue_checksums(host_stream_, ck.host, ck.plan.ops,
                                                          want.data()));
                    ASSERT_OK(host_stream_.synchronize(kWait));
                    ASSERT_NE(want, start);
                    // Device memory.
                    ASSERT_OK_AND_ASSIGN(
                        runtime::DeviceBuffer dev_sums,
                        runtime::DeviceBuffer::allocate(kGpu, ck.plan.sum_count * 8));
                    ASSERT_OK(dev_sums.copy_from_host(start.data(), ck.plan.sum_count * 8));
                    ASSERT_OK(gpu.enqueue_checksums(*stream_, ck.device, ck.plan.ops,
                                                    dev_sums.as<uint64_t>()));
                    ASSERT_OK(stream_->synchronize(kWait));
                    std::vector<uint64_t> got(ck.plan.sum_count);
                    ASSERT_OK(dev_sums.copy_to_host(got.data(), got.size() * 8));
                    EXPECT_EQ(got, want) << "device sums";
                    // Mapped pinned host memory.
                    PinnedSums pinned(ck.plan.sum_count);
                    ASSERT_NE(pinned.data, nullptr);
                    std::copy(start.begin(), start.end(), pinned.data);
                    ASSERT_OK(gpu.enqueue_checksums(*stream_, ck.device, ck.plan.ops, pinned.data));
                    ASSERT_OK(stream_->synchronize(kWait));
                    EXPECT_EQ(std::vector<uint64_t>(pinned.data, pinned.data + ck.plan.sum_count),
                              want)
                        << "mapped pinned sums";
                }
            }
        }
    }
}

TEST_P(CudaKvOpsMatrix, RejectsWhatItCannotRun) {
    KvMemoryOps& gpu = *cuda_ops_[0];
    const KvLayout& dev = src_.device[0].layout;
    const KvLayout& host = src_.host[0].layout;
    const std::vector<TokenRun> rs = testing::chunk_runs(c_, pairs_[0].frag, dev.buffer_count(),
                                                         src_pages_, dst_pages_, 0, c_.num_tokens);
    ASSERT_OK_AND_ASSIGN(KvStagingPlan g, plan_gather(dev, pairs_[0].frag, rs, 0, 1));
    ASSERT_OK_AND_ASSIGN(runtime::DeviceBuffer staging,
                         runtime::DeviceBuffer::allocate(kGpu, g.staging_bytes));
    std::vector<std::byte> pageable(g.staging_bytes);
    EXPECT_THAT(gpu.enqueue_gather(host_stream_, dev, g.ops, staging.as<std::byte>()),
                StatusIs(StatusCode::kInvalidArgument));
    EXPECT_THAT(gpu.enqueue_gather(*stream_, host, g.ops, staging.as<std::byte>()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layout: memory on cpu")));
    EXPECT_THAT(gpu.enqueue_gather(*stream_, dev, g.ops, pageable.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("pageable host memory")));
    EXPECT_THAT(gpu.enqueue_scatter(*stream_, dev, g.ops, staging.as<std::byte>()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("a scatter reads staging")));
    EXPECT_THAT(host_ops_.enqueue_gather(host_stream_, dev, g.ops, pageable.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layout: memory on cuda:0")));
    ASSERT_OK(stream_->begin_capture());
    const Status captured = gpu.enqueue_gather(*stream_, dev, g.ops, staging.as<std::byte>());
    auto graph = stream_->end_capture();
    EXPECT_THAT(captured, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("capturing")));
    EXPECT_OK(stream_->synchronize(kWait));
}

// The memory the CUDA ops hand out (allocate_staging / allocate_sums): staging in device memory
// of the ops' device, sums in mapped pinned host memory, zeroed every time (also when a
// released block is reused), and both usable by the ops: a gather into that staging and checksums
// into those sums equal the host ops'.
TEST_P(CudaKvOpsMatrix, AllocatedStagingAndSumsWork) {
    KvMemoryOps& gpu = *cuda_ops_[0];
    const int L = c_.num_layers;
    const auto& p = pairs_[0];
    const auto s = static_cast<size_t>(p.src_rank);
    const std::vector<TokenRun> rs = testing::chunk_runs(
        c_, p.frag, src_.host[s].layout.buffer_count(), src_pages_, dst_pages_, 0, c_.num_tokens);
    ASSERT_OK_AND_ASSIGN(KvStagingPlan g, plan_gather(src_.host[s].layout, p.frag, rs, 0, L));
    ASSERT_OK_AND_ASSIGN(
        KvChecksumPlan sums_plan,
        plan_fragment_checksums(src_.host[s].layout, KvSide::kSource, p.frag, rs, 0, L));
    {
        // Dirty a block of the sums' size and give it back: the next one may be that block.
        ASSERT_OK_AND_ASSIGN(KvOpsMemory dirty, gpu.allocate_sums(sums_plan.sum_count));
        std::memset(dirty.data(), 0xFF, dirty.size());
    }
    ASSERT_OK_AND_ASSIGN(KvOpsMemory staging, gpu.allocate_staging(g.staging_bytes));
    ASSERT_OK_AND_ASSIGN(KvOpsMemory sums, gpu.allocate_sums(sums_plan.sum_count));
    ASSERT_GE(staging.size(), g.staging_bytes);
    ASSERT_GE(sums.size(), sums_plan.sum_count * sizeof(uint64_t));
    EXPECT_FALSE(staging.host_readable());
    EXPECT_TRUE(sums.host_readable());
    cudaPointerAttributes a{};
    ASSERT_EQ(cudaPointerGetAttributes(&a, staging.data()), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeDevice);
    EXPECT_EQ(a.device, 0);
    ASSERT_EQ(cudaPointerGetAttributes(&a, sums.data()), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeHost);
    EXPECT_NE(a.devicePointer, nullptr) << "sums must be mapped";
    for (size_t i = 0; i < sums_plan.sum_count; ++i) ASSERT_EQ(sums.as<uint64_t>()[i], 0u) << i;
    ASSERT_OK(rt_->fill(staging.data(), kStagingPoison, staging.size()));
    ASSERT_OK(gpu.enqueue_gather(*stream_, src_.device[s].layout, g.ops, staging.data()));
    ASSERT_OK(
        gpu.enqueue_checksums(*stream_, src_.device[s].layout, sums_plan.ops, sums.as<uint64_t>()));
    ASSERT_OK(stream_->synchronize(kWait));

    std::vector<std::byte> want(g.staging_bytes, std::byte{kStagingPoison});
    std::vector<uint64_t> want_sums(sums_plan.sum_count, 0);
    ASSERT_OK(host_ops_.enqueue_gather(host_stream_, src_.host[s].layout, g.ops, want.data()));
    ASSERT_OK(host_ops_.enqueue_checksums(host_stream_, src_.host[s].layout, sums_plan.ops,
                                          want_sums.data()));
    ASSERT_OK(host_stream_.synchronize(kWait));
    std::vector<std::byte> got(g.staging_bytes);
    ASSERT_OK(rt_->copy(got.data(), staging.data(), got.size()));
    EXPECT_EQ(testing::first_difference(got, want), std::nullopt);
    EXPECT_EQ(std::vector<uint64_t>(sums.as<uint64_t>(), sums.as<uint64_t>() + want_sums.size()),
              want_sums);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaKvOpsMatrix, ::testing::ValuesIn(testing::kv_ops_cases()),
                         [](const ::testing::TestParamInfo<KvOpsCase>& param) {
                             return param.param.name;
                         });

// A llama3-8b-sized transfer: 8 KV heads x 128 dims bf16, 4096 tokens, page 16, shuffled pages,
// prefill TP 1 -> decode TP 2 (each decode rank gathers half of every token's heads).
TEST(CudaKvMemoryOpsLarge, Llama3Sized) {
    runtime::DeviceRuntime* rt = gpu_runtime();
    if (rt == nullptr) GTEST_SKIP() << skip_reason();
    const KvOpsCase c{.name = "llama3-8b",
                      .total_heads = 8,
                      .src_tp = 1,
                      .dst_tp = 2,
                      .src_page_size = 16,
                      .dst_page_size = 16,
                      .head_dim = 128,
                      .num_layers = 4,
                      .num_tokens = 4096};
    ASSERT_OK_AND_ASSIGN(RankPool host_src, testing::make_rank_pool(c, true, 0));
    ASSERT_OK_AND_ASSIGN(RankPool dev_src, testing::make_rank_pool(c, true, 0, kGpu));
    ASSERT_OK_AND_ASSIGN(RankPool dst, testing::make_rank_pool(c, false, 1));
    testing::fill_random(host_src.layout, 42);
    ASSERT_OK(upload(*rt, host_src.layout, dev_src.layout));
    const auto src_pages =
        testing::make_page_table(host_src.layout.num_pages(), 16, c.num_tokens, true, 1);
    const auto dst_pages =
        testing::make_page_table(dst.layout.num_pages(), 16, c.num_tokens, true, 2);
    const std::optional<Fragment> frag =
        make_fragment(host_src.layout.summary(), dst.layout.summary());
    ASSERT_TRUE(frag.has_value());
    const std::vector<TokenRun> rs =
        testing::chunk_runs(c, *frag, 2, src_pages, dst_pages, 0, c.num_tokens);
    ASSERT_OK_AND_ASSIGN(KvStagingPlan g, plan_gather(host_src.layout, *frag, rs, 0, 4));

    HostKvMemoryOps host_ops;
    runtime::CpuStream host_stream("kv-ops-host");
    std::vector<std::byte> want(g.staging_bytes, std::byte{kStagingPoison});
    ASSERT_OK(host_ops.enqueue_gather(host_stream, host_src.layout, g.ops, want.data()));
    ASSERT_OK(host_stream.synchronize(kWait));

    ASSERT_OK_AND_ASSIGN(auto stream, rt->create_stream(0, "kv-ops-large"));
    ASSERT_OK_AND_ASSIGN(auto gpu, make_kv_memory_ops(kGpu));
    ASSERT_OK_AND_ASSIGN(runtime::DeviceBuffer staging,
                         runtime::DeviceBuffer::allocate(kGpu, g.staging_bytes));
    ASSERT_OK(staging.fill(kStagingPoison));
    ASSERT_OK(gpu->enqueue_gather(*stream, dev_src.layout, g.ops, staging.as<std::byte>()));
    ASSERT_OK(stream->synchronize(kWait));
    std::vector<std::byte> got(g.staging_bytes);
    ASSERT_OK(staging.copy_to_host(got.data(), got.size()));
    const uint64_t worst = max_byte_difference(got, want);
    std::printf("llama3-8b-sized gather (%zu ops, %.1f MiB): max byte difference %llu\n",
                g.ops.size(), static_cast<double>(g.staging_bytes) / (1 << 20),
                static_cast<unsigned long long>(worst));
    EXPECT_EQ(worst, 0u);
    EXPECT_EQ(testing::first_difference(got, want), std::nullopt);

    // Checksums of what was read, bit-equal to the host's.
    ASSERT_OK_AND_ASSIGN(
        KvChecksumPlan sums_plan,
        plan_fragment_checksums(host_src.layout, KvSide::kSource, *frag, rs, 0, 4));
    std::vector<uint64_t> want_sums(sums_plan.sum_count, 0);
    ASSERT_OK(
        host_ops.enqueue_checksums(host_stream, host_src.layout, sums_plan.ops, want_sums.data()));
    ASSERT_OK(host_stream.synchronize(kWait));
    ASSERT_OK_AND_ASSIGN(runtime::DeviceBuffer sums,
                         runtime::DeviceBuffer::allocate(kGpu, sums_plan.sum_count * 8));
    ASSERT_OK(sums.fill(0));
    ASSERT_OK(gpu->enqueue_checksums(*stream, dev_src.layout, sums_plan.ops, sums.as<uint64_t>()));
    ASSERT_OK(stream->synchronize(kWait));
    std::vector<uint64_t> got_sums(sums_plan.sum_count);
    ASSERT_OK(sums.copy_to_host(got_sums.data(), got_sums.size() * 8));
    EXPECT_EQ(got_sums, want_sums);

    // For information: gather bandwidth (bytes read + written once each), warm.
    constexpr int kReps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kReps; ++i) {
        ASSERT_OK(gpu->enqueue_gather(*stream, dev_src.layout, g.ops, staging.as<std::byte>()));
    }
    ASSERT_OK(stream->synchronize(kWait));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("llama3-8b-sized gather: %.2f GB/s of staging written (%d reps, %.3f ms each)\n",
                static_cast<double>(g.staging_bytes) * kReps / seconds / 1e9, kReps,
                seconds / kReps * 1e3);
}

}  // namespace
}  // namespace pdsim::transfer
