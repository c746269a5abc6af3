// The NCCL device TP group (transfer/nccl/nccl_tp_comm.h). Here, everywhere: its options, the root
// id's trip through the host TP group (the testbed's in-process LocalTpGroup, threads as ranks),
// the watchdog's message, and creation without a usable GPU (kUnavailable with the reason). On a
// GPU (the same binary; those tests skip with the reason elsewhere): a one-rank group's gather in
// stream order, its watchdog breaking a gather held up on the stream, and (two GPUs) a two-rank
// gather against the host gather of the same data and the abort of a gather whose peer never
// comes.
#include "transfer/nccl/nccl_tp_comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "backends/runtime/stream.h"
#include "sim/testbed/comm.h"
#include "tests/status_matchers.h"
#if defined(PDSIM_TEST_HAVE_CUDA)
#include "backends/cuda/device_memory_ops.h"
#endif

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

int gpu_count() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    return rt.ok() ? (*rt)->device_count() : 0;
}

// Runs fn(r) for r in [0, n) on n threads (the group's ranks) and returns their results.
template <typename Fn>
auto on_ranks(int n, Fn fn) {
    using R = decltype(fn(0));
    std::vector<std::optional<R>> out(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] { out[static_cast<size_t>(r)].emplace(fn(r)); });
    }
    for (auto& t : threads) t.join();
    std::vector<R> results;
    for (auto& o : out) results.push_back(std::move(*o));
    return results;
}

TEST(NcclTpCommSetup, ValidatesOptions) {
    EXPECT_OK(validate_nccl_tp_comm_options({}));
    NcclTpCommOptions o;
    o.device = -1;
    EXPECT_THAT(validate_nccl_tp_comm_options(o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("NcclTpCommOptions.device")));
    o = {};
    o.connect_timeout = 0ms;
    EXPECT_THAT(validate_nccl_tp_comm_options(o),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("NcclTpCommOptions.connect_timeout must be > 0 ms, got 0 ms")));
    o = {};
    o.op_timeout = -1ms;
    EXPECT_THAT(validate_nccl_tp_comm_options(o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("NcclTpCommOptions.op_timeout")));
    o.op_timeout = 0ms;  // the watchdog off
    EXPECT_OK(validate_nccl_tp_comm_options(o));
    o.name.clear();
    EXPECT_THAT(validate_nccl_tp_comm_options(o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("NcclTpCommOptions.name")));
    // make_nccl_tp_comm checks them before it touches the group or a GPU.
    testbed::LocalTpGroup group(1, 1000ms);
    EXPECT_THAT(make_nccl_tp_comm(*group.member(0), o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("NcclTpCommOptions.name")));
}

// Every rank gets rank 0's bytes, whatever they are: every byte value, NaN patterns included (the
// id travels as floats), an id whose size is not a multiple of a float's.
TEST(NcclTpCommSetup, ShareRootIdGivesEveryRankRankZerosBytes) {
    for (size_t id_bytes : {size_t{128}, size_t{130}, size_t{1}}) {
        std::string root(id_bytes, '\0');
        for (size_t i = 0; i < id_bytes; ++i) root[i] = static_cast<char>((i * 37 + 255) & 0xff);
        if (id_bytes >= 4) std::memset(root.data(), 0xff, 4);  // a NaN's bits
        testbed::LocalTpGroup group(3, 10'000ms);
        auto got = on_ranks(3, [&](int r) {
            // The other ranks' ids differ: only rank 0's may come back.
            const std::string mine = r == 0 ? root : std::string(id_bytes, static_cast<char>(r));
            return share_root_id(*group.member(r), mine, id_bytes);
        });
        for (int r = 0; r < 3; ++r) {
            ASSERT_OK(got[static_cast<size_t>(r)]);
            EXPECT_EQ(*got[static_cast<size_t>(r)], root) << "rank " << r << ", " << id_bytes;
        }
    }
}

TEST(NcclTpCommSetup, ShareRootIdChecksItsArgumentsAndTheHostGroup) {
    testbed::LocalTpGroup one(1, 1000ms);
    EXPECT_THAT(share_root_id(*one.member(0), "", 0),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("id_bytes is 0")));
    EXPECT_THAT(
        share_root_id(*one.member(0), "abc", 128),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 0's id is 3 bytes, expected 128")));
    auto alone = share_root_id(*one.member(0), std::string(128, 'x'), 128);
    ASSERT_OK(alone);
    EXPECT_EQ(*alone, std::string(128, 'x'));
    // Rank 1 never comes: the host group's timeout, named as the id's exchange.
    testbed::LocalTpGroup two(2, 200ms);
    EXPECT_THAT(share_root_id(*two.member(0), std::string(128, 'x'), 128),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("the NCCL TP group's id, over the host TP group: TP "
                                   "allgather (2 ranks) timed out")));
}

TEST(NcclTpCommSetup, TimeoutMessage) {
    EXPECT_EQ(tp_gather_timeout_message("pdsim-tp-decode0", 1, 8, 1500ms),
              "nccl TP group pdsim-tp-decode0: rank 1 of 8: an all-gather pending > 1.5 s (a peer "
              "gone or stuck); communicator aborted");
}

// Without a usable GPU (or NCCL) creation fails at once, saying why, before the id's exchange:
// a one-rank group would not notice, so a two-rank group whose peer never comes checks that it
// does not wait for it.
TEST(NcclTpCommSetup, WithoutAGpuCreationSaysWhy) {
    if (gpu_count() > 0 && nccl_tp_comm_built()) GTEST_SKIP() << "a GPU and NCCL are present";
    testbed::LocalTpGroup group(2, 30'000ms);
    const auto t0 = std::chrono::steady_clock::now();
    auto comm = make_nccl_tp_comm(*group.member(0), {});
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
    EXPECT_THAT(comm.status(), StatusIs(StatusCode::kUnavailable));
    if (nccl_tp_comm_built()) {
        EXPECT_THAT(comm.status(), StatusIs(StatusCode::kUnavailable, HasSubstr("no device")));
    } else {
        EXPECT_THAT(comm.status(), StatusIs(StatusCode::kUnavailable, HasSubstr("not built")));
    }
}

// ---- on a GPU ----

class NcclTpCommGpuTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (!nccl_tp_comm_built()) GTEST_SKIP() << "pdsim was built without NCCL";
        if (gpu_count() == 0) {
            auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
            GTEST_SKIP() << "no device: "
                         << (rt.ok() ? (*rt)->unavailable_reason() : rt.status().to_string());
        }
    }
};

struct DeviceFloats {
    runtime::DeviceBuffer buffer;
    float* data() { return static_cast<float*>(buffer.data()); }
};

StatusOr<DeviceFloats> device_floats(int device, const std::vector<float>& host) {
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceBuffer b,
                           runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, device},
                                                           host.size() * sizeof(float)));
    PDSIM_RETURN_IF_ERROR(b.copy_from_host(host.data(), host.size() * sizeof(float)));
    return DeviceFloats{std::move(b)};
}

StatusOr<std::vector<float>> to_host(DeviceFloats& d, size_t n) {
    std::vector<float> out(n);
    PDSIM_RETURN_IF_ERROR(d.buffer.copy_to_host(out.data(), n * sizeof(float)));
    return out;
}

// A one-rank group: set-up, and the gather in stream order (it reads `mine` after the fill behind a
// host sleep has rewritten it), into a poisoned `out`. NCCL runs a one-rank gather as a copy.
TEST_F(NcclTpCommGpuTest, OneRankGatherRunsInStreamOrder) {
#if !defined(PDSIM_TEST_HAVE_CUDA)
    GTEST_SKIP() << "pdsim was built without CUDA";
#else
    testbed::LocalTpGroup group(1, 10'000ms);
    auto comm = make_nccl_tp_comm(*group.member(0), {.device = 0, .name = "test-one"});
    ASSERT_OK(comm);
    EXPECT_EQ((*comm)->size(), 1);
    EXPECT_EQ((*comm)->rank(), 0);
    EXPECT_EQ((*comm)->name(), "nccl");
    constexpr size_t kCount = 4096;
    auto mine = device_floats(0, std::vector<float>(kCount, 1.f));
    ASSERT_OK(mine);
    auto out = device_floats(0, std::vector<float>(kCount, std::nanf("")));
    ASSERT_OK(out);
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    ASSERT_OK(rt);
    auto stream = (*rt)->create_stream(0, "nccl-tp-test");
    ASSERT_OK(stream);
    // A fill rewrites `mine` (bytes 0x3f) behind a host sleep on the stream: a gather that did
    // not wait for it would copy the 1s.
    ASSERT_OK(runtime::enqueue_void(**stream, [] { std::this_thread::sleep_for(200ms); }));
    ASSERT_OK(
        runtime::cuda::enqueue_device_fill(**stream, mine->data(), 0x3f, kCount * sizeof(float)));
    ASSERT_OK((*comm)->enqueue_allgather(mine->data(), kCount, out->data(), **stream));
    ASSERT_OK((*stream)->synchronize());
    auto got = to_host(*out, kCount);
    ASSERT_OK(got);
    std::vector<float> want(kCount);
    std::memset(want.data(), 0x3f, kCount * sizeof(float));
    EXPECT_EQ(std::memcmp(got->data(), want.data(), kCount * sizeof(float)), 0);
    EXPECT_OK((*comm)->health()->status());
    EXPECT_THAT((*comm)->enqueue_allgather(nullptr, kCount, out->data(), **stream),
                StatusIs(StatusCode::kInvalidArgument));
#endif
}

// A gather held up on its stream past op_timeout breaks the group: its health is the watchdog's
// error, and later gathers are refused with it (the watchdog's bookkeeping; the abort of a
// running gather kernel needs two GPUs, AbortEndsAGatherWhosePeerNeverComes).
TEST_F(NcclTpCommGpuTest, WatchdogBreaksAGatherPendingPastItsTimeout) {
    testbed::LocalTpGroup group(1, 10'000ms);
    auto comm = make_nccl_tp_comm(*group.member(0),
                                  {.device = 0, .op_timeout = 100ms, .name = "test-watchdog"});
    ASSERT_OK(comm);
    constexpr size_t kCount = 1024;
    auto mine = device_floats(0, std::vector<float>(kCount, 2.f));
    ASSERT_OK(mine);
    auto out = device_floats(0, std::vector<float>(kCount, 0.f));
    ASSERT_OK(out);
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    ASSERT_OK(rt);
    auto stream = (*rt)->create_stream(0, "nccl-tp-watchdog");
    ASSERT_OK(stream);
    ASSERT_OK(runtime::enqueue_void(**stream, [] { std::this_thread::sleep_for(1500ms); }));
    ASSERT_OK((*comm)->enqueue_allgather(mine->data(), kCount, out->data(), **stream));
    const auto deadline = std::chrono::steady_clock::now() + 1400ms;
    while ((*comm)->health()->status().ok() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(10ms);
    }
    EXPECT_THAT((*comm)->health()->status(),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("nccl TP group test-watchdog: rank 0 of 1: an all-gather "
                                   "pending > 0.1 s")));
    EXPECT_THAT((*comm)->enqueue_allgather(mine->data(), kCount, out->data(), **stream),
                StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("pending > 0.1 s")));
    (*stream)->synchronize().ignore_error();  // whatever the aborted gather left
}

// Two ranks on GPUs 0 and 1 (threads): the NCCL gather equals the host group's gather of the same
// data, bit for bit, rank-major.
TEST_F(NcclTpCommGpuTest, TwoRanksGatherAsTheHostGroupDoes) {
    if (gpu_count() < 2) {
        GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks of one communicator on one GPU)";
    }
    constexpr size_t kCount = 1 << 16;
    testbed::LocalTpGroup group(2, 30'000ms);
    testbed::LocalTpGroup host(2, 30'000ms);
    auto results = on_ranks(2, [&](int r) -> Status {
        PDSIM_ASSIGN_OR_RETURN(
            std::unique_ptr<model::DeviceTpComm> comm,
            make_nccl_tp_comm(*group.member(r),
                              {.device = r, .op_timeout = 30'000ms, .name = "test-two"}));
        std::vector<float> mine(kCount);
        for (size_t i = 0; i < kCount; ++i) {
            mine[i] = static_cast<float>(r * 1000003 + static_cast<int>(i)) * 1.25e-3f;
        }
        std::vector<float> want(2 * kCount);
        PDSIM_RETURN_IF_ERROR(host.member(r)->allgather(mine.data(), kCount, want.data()));
        PDSIM_ASSIGN_OR_RETURN(DeviceFloats d_mine, device_floats(r, mine));
        PDSIM_ASSIGN_OR_RETURN(DeviceFloats d_out,
                               device_floats(r, std::vector<float>(2 * kCount, std::nanf(""))));
        PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                               runtime::device_runtime(runtime::DeviceKind::kCuda));
        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Stream> stream,
                               rt->create_stream(r, "nccl-tp-two"));
        PDSIM_RETURN_IF_ERROR(
            comm->enqueue_allgather(d_mine.data(), kCount, d_out.data(), *stream));
        PDSIM_RETURN_IF_ERROR(stream->synchronize());
        PDSIM_ASSIGN_OR_RETURN(std::vector<float> got, to_host(d_out, 2 * kCount));
        if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
            return Status(StatusCode::kDataLoss, "rank " + std::to_string(r) +
                                                     ": the NCCL gather differs from the host's");
        }
        return comm->health()->status();
    });
    EXPECT_OK(results[0]);
    EXPECT_OK(results[1]);
}

// Two ranks on GPUs 0 and 1, and rank 1 never gathers: rank 0's gather kernel waits for it until
// the watchdog (op_timeout 1 s) aborts the communicator; the abort must end the kernel (rank 0's
// stream drains, within seconds), and the group's health is the watchdog's error. (The one-rank
// tests above cannot show this: NCCL runs a one-rank gather as a plain copy.)
TEST_F(NcclTpCommGpuTest, AbortEndsAGatherWhosePeerNeverComes) {
    if (gpu_count() < 2) {
        GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks of one communicator on one GPU)";
    }
    constexpr size_t kCount = 1 << 12;
    testbed::LocalTpGroup group(2, 30'000ms);
    auto comms = on_ranks(2, [&](int r) {
        return make_nccl_tp_comm(*group.member(r),
                                 {.device = r, .op_timeout = 1000ms, .name = "test-silent-peer"});
    });
    ASSERT_OK(comms[0]);
    ASSERT_OK(comms[1]);
    model::DeviceTpComm& rank0 = **comms[0];
    auto mine = device_floats(0, std::vector<float>(kCount, 3.f));
    ASSERT_OK(mine);
    auto out = device_floats(0, std::vector<float>(2 * kCount, 0.f));
    ASSERT_OK(out);
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    ASSERT_OK(rt);
    auto stream = (*rt)->create_stream(0, "nccl-tp-silent-peer");
    ASSERT_OK(stream);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_OK(rank0.enqueue_allgather(mine->data(), kCount, out->data(), **stream));
    // Bounded: a kernel the abort did not end would hold the stream past it.
    (*stream)->synchronize(20'000ms).ignore_error();
    const auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_GE(waited, 900ms) << "the gather completed without its peer";
    EXPECT_LT(waited, 15s) << "the abort did not end the gather's kernel";
    EXPECT_THAT(rank0.health()->status(),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("nccl TP group test-silent-peer: rank 0 of 2: an all-gather "
                                   "pending > 1 s")));
    EXPECT_OK((*comms[1])->health()->status());  // it never gathered
}

}  // namespace
}  // namespace pdsim::transfer
