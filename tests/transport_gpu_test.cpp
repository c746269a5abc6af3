// The GPU transports (nccl, cuda_ipc). Without a GPU (or when pdsim was built without CUDA/NCCL)
// creation fails with kUnavailable and a reason, and the functional tests skip with that reason;
// they never pass silently. The nccl tests need two GPUs (NCCL refuses two ranks of one
// communicator on one GPU), except the init timeout, whose peer never comes.
//
// Stream-ordered posts are checked with a delayed event: on a CUDA stream, a host task sleeps
// kDelay, then a device fill overwrites the source with its final bytes, then the event is
// recorded. A transport that read the source before the event would move the old bytes (the
// copy itself takes micro- to milliseconds, far less than kDelay).
//
// cuda_ipc between two processes (what the two-process testbed on one GPU does, and threads of one
// process never do: CUDA refuses to open its own handles) runs this binary a second time as the
// importing process (CudaIpcTransportChild, which skips unless the parent started it).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/transport.h"
#if defined(PDSIM_TEST_HAVE_CUDA)
#include "backends/cuda/device_memory_ops.h"
#endif

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;

int gpu_count() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    return rt.ok() ? (*rt)->device_count() : 0;
}

std::string temp_dir(const std::string& tag) {
    auto p = std::filesystem::temp_directory_path() /
             ("pdsim-gpu-" + tag + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(p);
    return p.string();
}

constexpr auto kDelay = std::chrono::milliseconds(300);

// A CUDA stream on `device` and an event recorded on it after a host sleep of kDelay and a fill
// of [dst, dst + bytes) with `byte`.
struct DelayedEvent {
    std::unique_ptr<runtime::Stream> stream;
    std::unique_ptr<runtime::Event> event;
};

StatusOr<DelayedEvent> delayed_fill_event(int device, void* dst, int byte, size_t bytes) {
#if defined(PDSIM_TEST_HAVE_CUDA)
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) return rt.status();
    auto stream = (*rt)->create_stream(device, "delayed-event");
    if (!stream.ok()) return stream.status();
    DelayedEvent d{std::move(stream).value(), nullptr};
    PDSIM_RETURN_IF_ERROR(
        runtime::enqueue_void(*d.stream, [] { std::this_thread::sleep_for(kDelay); }));
    PDSIM_RETURN_IF_ERROR(runtime::cuda::enqueue_device_fill(*d.stream, dst, byte, bytes));
    d.event = d.stream->create_event();
    if (!d.event) return Status(StatusCode::kUnavailable, "create_event failed");
    PDSIM_RETURN_IF_ERROR(d.stream->record(*d.event));
    return d;
#else
    (void)device;
    (void)dst;
    (void)byte;
    (void)bytes;
    return Status(StatusCode::kUnavailable, "pdsim was built without CUDA");
#endif
}

// An event of the CPU runtime: no GPU transport can wait on it.
std::unique_ptr<runtime::Event> cpu_event() {
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCpu);
    if (!rt.ok()) return nullptr;
    auto stream = (*rt)->create_stream(0, "cpu-event");
    if (!stream.ok()) return nullptr;
    return (*stream)->create_event();
}

bool all_equal(const std::vector<uint8_t>& v, uint8_t byte) {
    return std::all_of(v.begin(), v.end(), [&](uint8_t b) { return b == byte; });
}

// Ranks 0 and 1 of nccl on GPUs 0 and 1 (threads of this process); empty (with the reason in
// `skip`) when that cannot run here.
struct NcclPair {
    std::unique_ptr<Transport> t[2];
    std::string dir;
    std::string skip;
    ~NcclPair() {
        t[0].reset();
        t[1].reset();
        if (!dir.empty()) std::filesystem::remove_all(dir);
    }
};

void make_nccl_pair(NcclPair& p, const std::string& tag, std::chrono::milliseconds op_timeout) {
    {
        TransportOptions probe;
        probe.edit<GpuTransportOptions>().rendezvous_dir = temp_dir("probe-" + tag);
        auto t = create_transport("nccl", probe);  // world of 1
        if (!t.ok()) {
            p.skip = t.status().to_string();
            return;
        }
    }
    if (gpu_count() < 2) {
        p.skip = "needs 2 GPUs (NCCL refuses two ranks on one GPU)";
        return;
    }
    p.dir = temp_dir(tag);
    std::thread th[2];
    Status st[2];
    for (int r = 0; r < 2; ++r) {
        th[r] = std::thread([&, r] {
            TransportOptions o;
            o.rank = r;
            o.world_size = 2;
            o.edit<GpuTransportOptions>().device_index = r;
            o.edit<GpuTransportOptions>().rendezvous_dir = p.dir;
            o.edit<GpuTransportOptions>().op_timeout = op_timeout;
            auto x = create_transport("nccl", o);
            if (!x.ok()) {
                st[r] = x.status();
                return;
            }
            p.t[r] = std::move(x).value();
        });
    }
    th[0].join();
    th[1].join();
    ASSERT_OK(st[0]);
    ASSERT_OK(st[1]);
}

TEST(GpuTransports, UnavailableIsReportedWithAReason) {
    for (const char* name : {"nccl", "cuda_ipc"}) {
        TransportOptions o;
        o.edit<GpuTransportOptions>().rendezvous_dir = temp_dir(name);
        auto t = create_transport(name, o);
        if (t.ok()) continue;  // a GPU is present: the functional tests below cover it
        EXPECT_THAT(t, StatusIs(StatusCode::kUnavailable,
                                ::testing::AnyOf(HasSubstr("no device"), HasSubstr("not built"))));
    }
}

TEST(CudaIpcTransport, WriteBetweenDeviceBuffers) {
    TransportOptions o;
    auto t = create_transport("cuda_ipc", o);
    if (!t.ok()) GTEST_SKIP() << t.status().to_string();
    Transport& x = **t;
    EXPECT_TRUE(x.capabilities().one_sided_write);
    EXPECT_FALSE(x.capabilities().two_sided);
    const size_t n = size_t{8} << 20;
    auto src = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto dst = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    ASSERT_TRUE(src.ok() && dst.ok());
    std::vector<uint8_t> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint8_t>(i * 7 + 1);
    ASSERT_OK(src->copy_from_host(host.data(), n));
    ASSERT_OK(dst->fill(0));
    auto mr = x.register_memory(dst->data(), n);
    ASSERT_OK(mr);
    auto remote = x.import_remote(0, mr->descriptor);
    ASSERT_OK(remote);
    auto w = x.post_write(*remote, 4096, src->data(), n - 4096);
    ASSERT_OK(w);
    ASSERT_OK(x.wait(*w, 30s));
    std::vector<uint8_t> back(n);
    ASSERT_OK(dst->copy_to_host(back.data(), n));
    EXPECT_EQ(back[4095], 0);
    EXPECT_EQ(std::memcmp(back.data() + 4096, host.data(), n - 4096), 0);
    EXPECT_EQ(x.post_write(*remote, n, src->data(), 1).status().code(), StatusCode::kOutOfRange);
}

TEST(NcclTransport, SendRecvBetweenTwoGpus) {
    NcclPair p;
    make_nccl_pair(p, "pair", 120s);
    if (!p.skip.empty()) GTEST_SKIP() << p.skip;
    ASSERT_TRUE(p.t[0] && p.t[1]);
    EXPECT_FALSE(p.t[0]->capabilities().tag_matching);
    EXPECT_TRUE(p.t[0]->capabilities().stream_ordered);
    const size_t n = size_t{64} << 20;
    auto a = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto b = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 1}, n);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<uint8_t> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint8_t>(i * 13 + 5);
    ASSERT_OK(a->copy_from_host(host.data(), n));
    auto r = p.t[1]->post_recv(0, 0, b->data(), n);
    auto s = p.t[0]->post_send(1, 0, a->data(), n);
    ASSERT_TRUE(r.ok() && s.ok());
    ASSERT_OK(p.t[1]->wait(*r, 60s));
    ASSERT_OK(p.t[0]->wait(*s, 60s));
    std::vector<uint8_t> back(n);
    ASSERT_OK(b->copy_to_host(back.data(), n));
    EXPECT_EQ(back, host);
}

// post_send_after: the send does not read its buffer before the event fires (the receiver gets
// the bytes the delayed fill wrote, not the old ones), and the posting thread does not wait.
// Events it cannot wait on (the CPU runtime's, another GPU's) are kInvalidArgument.
TEST(NcclTransport, PostSendAfterDoesNotReadBeforeTheEvent) {
    NcclPair p;
    make_nccl_pair(p, "after", 120s);
    if (!p.skip.empty()) GTEST_SKIP() << p.skip;
    ASSERT_TRUE(p.t[0] && p.t[1]);
    const size_t n = size_t{16} << 20;
    auto a = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto b = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 1}, n);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_OK(a->fill(0x11));  // the old bytes
    ASSERT_OK(b->fill(0));

    auto cpu = cpu_event();
    ASSERT_NE(cpu, nullptr);
    EXPECT_THAT(p.t[0]->post_send_after(*cpu, 1, 0, a->data(), n),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a CUDA event")));
    auto other = delayed_fill_event(1, b->data(), 0, 0);  // an event of GPU 1
    ASSERT_OK(other);
    EXPECT_THAT(p.t[0]->post_send_after(*other->event, 1, 0, a->data(), n),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("belongs to GPU 1")));

    auto ready = delayed_fill_event(0, a->data(), 0xB7, n);
    ASSERT_OK(ready);
    auto r = p.t[1]->post_recv(0, 0, b->data(), n);
    ASSERT_OK(r);
    const auto posted = std::chrono::steady_clock::now();
    auto s = p.t[0]->post_send_after(*ready->event, 1, 0, a->data(), n);
    ASSERT_OK(s);
    EXPECT_LT(std::chrono::steady_clock::now() - posted, kDelay / 2) << "the post waited";
    std::this_thread::sleep_for(kDelay / 3);
    EXPECT_FALSE(s->done()) << "the send completed before its event fired";
    ASSERT_OK(p.t[1]->wait(*r, 60s));
    ASSERT_OK(p.t[0]->wait(*s, 60s));
    EXPECT_GE(std::chrono::steady_clock::now() - posted, kDelay);
    std::vector<uint8_t> back(n);
    ASSERT_OK(b->copy_to_host(back.data(), n));
    EXPECT_TRUE(all_equal(back, 0xB7)) << "the send read its buffer before the event: got "
                                       << static_cast<int>(back[0]) << " first";
}

// The watchdog: a receive with no matching send, op_timeout 1 s: it fails with kDeadlineExceeded
// (the watchdog's message, not wait's own timeout) after about a second, the pair is aborted and
// later posts to that peer fail at once with kUnavailable.
TEST(NcclTransport, WatchdogAbortsAPairWhoseReceiveHasNoSend) {
    NcclPair p;
    make_nccl_pair(p, "watchdog", 1s);
    if (!p.skip.empty()) GTEST_SKIP() << p.skip;
    ASSERT_TRUE(p.t[0] && p.t[1]);
    const size_t n = size_t{1} << 20;
    auto b = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 1}, n);
    ASSERT_TRUE(b.ok());
    const auto posted = std::chrono::steady_clock::now();
    auto r = p.t[1]->post_recv(0, 0, b->data(), n);
    ASSERT_OK(r);
    EXPECT_THAT(p.t[1]->wait(*r, 30s),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("nccl: op to/from rank 0 pending > 1 s; communicator aborted")));
    EXPECT_TRUE(r->done());
    const auto took = std::chrono::steady_clock::now() - posted;
    EXPECT_GE(took, 1s);
    EXPECT_LT(took, 20s);
    EXPECT_THAT(p.t[1]->post_recv(0, 0, b->data(), n),
                StatusIs(StatusCode::kUnavailable, HasSubstr("aborted by the watchdog")));
    EXPECT_THAT(p.t[1]->post_send(0, 0, b->data(), n), StatusIs(StatusCode::kUnavailable));
}

// Communicator init is non-blocking and bounded: rank 0 of 2 alone (its peer never starts) fails
// after about connect_timeout, naming the peer and the timeout. Rank 1 alone times out earlier,
// waiting for the pair's id. One GPU is enough.
TEST(NcclTransport, InitTimesOutWhenThePeerNeverComes) {
    for (int rank : {0, 1}) {
        TransportOptions o;
        o.rank = rank;
        o.world_size = 2;
        o.connect_timeout = 1s;
        const std::string dir = temp_dir("init-timeout-" + std::to_string(rank));
        o.edit<GpuTransportOptions>().rendezvous_dir = dir;
        const auto start = std::chrono::steady_clock::now();
        auto t = create_transport("nccl", o);
        const auto took = std::chrono::steady_clock::now() - start;
        std::filesystem::remove_all(dir);
        if (!t.ok() &&
            ::testing::Value(t.status().message(),
                             ::testing::AnyOf(HasSubstr("no device"), HasSubstr("not built")))) {
            GTEST_SKIP() << t.status().to_string();
        }
        if (rank == 0) {
            EXPECT_THAT(t, StatusIs(StatusCode::kDeadlineExceeded,
                                    HasSubstr("nccl rank 0: communicator with rank(s) 1 not "
                                              "initialized after 1 s")));
        } else {
            EXPECT_THAT(t, StatusIs(StatusCode::kDeadlineExceeded,
                                    HasSubstr("nccl rank 1: no pair id from rank(s) 0 after 1 s")));
        }
        EXPECT_GE(took, 1s) << "rank " << rank;
        EXPECT_LT(took, 30s) << "rank " << rank;
    }
}

// cuda_ipc's post_write_after: the copy does not start before the event fires (the target gets
// the delayed fill's bytes), the posting thread does not wait; a CPU event is kInvalidArgument.
TEST(CudaIpcTransport, PostWriteAfterWaitsForTheEvent) {
    TransportOptions o;
    auto t = create_transport("cuda_ipc", o);
    if (!t.ok()) GTEST_SKIP() << t.status().to_string();
    Transport& x = **t;
    EXPECT_TRUE(x.capabilities().stream_ordered);
    const size_t n = size_t{8} << 20;
    auto src = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto dst = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    ASSERT_TRUE(src.ok() && dst.ok());
    ASSERT_OK(src->fill(0x11));  // the old bytes
    ASSERT_OK(dst->fill(0));
    auto mr = x.register_memory(dst->data(), n);
    ASSERT_OK(mr);
    auto remote = x.import_remote(0, mr->descriptor);
    ASSERT_OK(remote);

    auto cpu = cpu_event();
    ASSERT_NE(cpu, nullptr);
    EXPECT_THAT(x.post_write_after(*cpu, *remote, 0, src->data(), n),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a CUDA event")));

    auto ready = delayed_fill_event(0, src->data(), 0xB7, n);
    ASSERT_OK(ready);
    const auto posted = std::chrono::steady_clock::now();
    auto w = x.post_write_after(*ready->event, *remote, 0, src->data(), n);
    ASSERT_OK(w);
    EXPECT_LT(std::chrono::steady_clock::now() - posted, kDelay / 2) << "the post waited";
    std::this_thread::sleep_for(kDelay / 3);
    EXPECT_FALSE(w->done()) << "the write completed before its event fired";
    EXPECT_THAT(x.cancel(*w), StatusIs(StatusCode::kFailedPrecondition));
    ASSERT_OK(x.wait(*w, 30s));
    EXPECT_GE(std::chrono::steady_clock::now() - posted, kDelay);
    std::vector<uint8_t> back(n);
    ASSERT_OK(dst->copy_to_host(back.data(), n));
    EXPECT_TRUE(all_equal(back, 0xB7)) << "the write read its source before the event: got "
                                       << static_cast<int>(back[0]) << " first";
}

// post_signal lands after the writes posted before it: with the write held behind an event that
// fires late, the counter must still read 0 while the write waits, and read the add (with the
// write's bytes in place) once both completed. Two signals add up.
TEST(CudaIpcTransport, SignalLandsAfterTheWritesBeforeIt) {
    TransportOptions o;
    auto t = create_transport("cuda_ipc", o);
    if (!t.ok()) GTEST_SKIP() << t.status().to_string();
    Transport& x = **t;
    EXPECT_TRUE(x.capabilities().write_signals);
    const size_t n = size_t{8} << 20;
    auto src = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto dst = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto words = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, 64);
    ASSERT_TRUE(src.ok() && dst.ok() && words.ok());
    ASSERT_OK(src->fill(0x11));
    ASSERT_OK(dst->fill(0));
    ASSERT_OK(words->fill(0));
    auto data_mr = x.register_memory(dst->data(), n);
    auto word_mr = x.register_memory(words->data(), 64);
    ASSERT_TRUE(data_mr.ok() && word_mr.ok());
    auto data = x.import_remote(0, data_mr->descriptor);
    auto word = x.import_remote(0, word_mr->descriptor);
    ASSERT_TRUE(data.ok() && word.ok());
    EXPECT_THAT(x.post_signal(*word, 4, 1), StatusIs(StatusCode::kInvalidArgument));
    EXPECT_THAT(x.post_signal(*word, 64, 1), StatusIs(StatusCode::kOutOfRange));

    auto ready = delayed_fill_event(0, src->data(), 0xC3, n);
    ASSERT_OK(ready);
    auto w = x.post_write_after(*ready->event, *data, 0, src->data(), n);
    ASSERT_OK(w);
    auto s1 = x.post_signal(*word, 8, n);
    auto s2 = x.post_signal(*word, 8, 5);
    ASSERT_TRUE(s1.ok() && s2.ok());
    std::this_thread::sleep_for(kDelay / 3);
    uint64_t seen[8] = {};
    ASSERT_OK(words->copy_to_host(seen, sizeof(seen)));
    EXPECT_FALSE(w->done());
    EXPECT_EQ(seen[1], 0u) << "the signal landed before the write it follows";
    ASSERT_OK(x.wait(*w, 30s));
    ASSERT_OK(x.wait(*s1, 30s));
    ASSERT_OK(x.wait(*s2, 30s));
    ASSERT_OK(words->copy_to_host(seen, sizeof(seen)));
    EXPECT_EQ(seen[0], 0u);
    EXPECT_EQ(seen[1], n + 5);
    EXPECT_EQ(seen[2], 0u);
    std::vector<uint8_t> back(n);
    ASSERT_OK(dst->copy_to_host(back.data(), n));
    EXPECT_TRUE(all_equal(back, 0xC3));
}

// ---- cuda_ipc between two processes ----
// The parent allocates kAllocBytes poisoned with kPoison and registers the range [kRangeAt,
// kRangeAt + kRangeBytes) of it; the child imports the descriptor and writes kWriteBytes of a
// pattern at kWriteAt into the range. Exactly [kRangeAt + kWriteAt, +kWriteBytes) of the
// allocation must change: a mapping of the allocation's start instead of the range's would write
// kRangeAt bytes too early.
constexpr const char* kChildEnv = "PDSIM_CUDA_IPC_CHILD";
constexpr size_t kAllocBytes = size_t{4} << 20;
constexpr size_t kRangeAt = size_t{1} << 20;
constexpr size_t kRangeBytes = size_t{1} << 20;
constexpr size_t kWriteAt = 4096;
constexpr size_t kWriteBytes = size_t{64} << 10;
constexpr uint8_t kPoison = 0xAB;

uint8_t pattern_byte(size_t i) {
    return static_cast<uint8_t>(i * 13 + 5);
}

// This process's command line (the GPU check starts test binaries through the bundle's loader, so
// /proc/self/exe alone would not run it again), as shell words.
std::string own_command_line() {
    const std::string raw = test::slurp("/proc/self/cmdline");
    std::string words;
    size_t start = 0;
    while (start < raw.size()) {
        const size_t end = raw.find('\0', start);
        const std::string arg = raw.substr(start, end == std::string::npos ? end : end - start);
        if (arg.rfind("--gtest_", 0) != 0)
            words += (words.empty() ? "" : " ") + test::shell_quote(arg);
        if (end == std::string::npos) break;
        start = end + 1;
    }
    return words;
}

TEST(CudaIpcTransport, ASecondProcessWritesIntoARangeOfAnAllocation) {
    TransportOptions o;
    o.world_size = 2;
    auto t = create_transport("cuda_ipc", o);
    if (!t.ok()) GTEST_SKIP() << t.status().to_string();
    auto buf = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, kAllocBytes);
    ASSERT_OK(buf);
    ASSERT_OK(buf->fill(kPoison));
    auto* range = static_cast<uint8_t*>(buf->data()) + kRangeAt;
    auto mr = (*t)->register_memory(range, kRangeBytes);
    ASSERT_OK(mr);
    // A range past the allocation's end is refused: no offset could map it.
    EXPECT_THAT((*t)->register_memory(range, kAllocBytes),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("runs past the end")));

    test::TempDir dir("cuda-ipc-child");
    {
        std::ofstream f(dir.str("descriptor"), std::ios::binary);
        f.write(reinterpret_cast<const char*>(mr->descriptor.data()),
                static_cast<std::streamsize>(mr->descriptor.size()));
        ASSERT_TRUE(f.good());
    }
    const test::CmdResult child =
        test::run_command("env " + std::string(kChildEnv) + "=" + test::shell_quote(dir.str()) +
                              " " + own_command_line(),
                          {"--gtest_filter=CudaIpcTransportChild.*", "--gtest_color=no"}, 90);
    ASSERT_EQ(child.rc, 0) << child.describe();
    ASSERT_THAT(child.out, HasSubstr("[  PASSED  ] 1 test")) << child.describe();

    std::vector<uint8_t> back(kAllocBytes);
    ASSERT_OK(buf->copy_to_host(back.data(), kAllocBytes));
    const size_t first = kRangeAt + kWriteAt;
    size_t wrong = 0;
    for (size_t i = 0; i < kAllocBytes; ++i) {
        const bool written = i >= first && i < first + kWriteBytes;
        wrong += back[i] != (written ? pattern_byte(i - first) : kPoison) ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0u) << "bytes of the allocation other than the child's write, or the write "
                            "itself, are not what they should be";
}

// The importing half of the test above; skips unless that test started this process.
TEST(CudaIpcTransportChild, ImportsTheRangeAndWritesIntoIt) {
    const char* dir = std::getenv(kChildEnv);
    if (dir == nullptr) {
        GTEST_SKIP() << "the importing process of "
                        "CudaIpcTransport.ASecondProcessWritesIntoARangeOfAnAllocation, which "
                        "starts it";
    }
    TransportOptions o;
    o.rank = 1;
    o.world_size = 2;
    auto t = create_transport("cuda_ipc", o);
    ASSERT_OK(t);
    const std::string blob = test::slurp(std::filesystem::path(dir) / "descriptor");
    auto remote = (*t)->import_remote(
        0, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(blob.data()), blob.size()));
    ASSERT_OK(remote);
    EXPECT_EQ(remote->bytes, kRangeBytes);
    std::vector<uint8_t> host(kWriteBytes);
    for (size_t i = 0; i < kWriteBytes; ++i) host[i] = pattern_byte(i);
    auto src = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, kWriteBytes);
    ASSERT_OK(src);
    ASSERT_OK(src->copy_from_host(host.data(), kWriteBytes));
    auto w = (*t)->post_write(*remote, kWriteAt, src->data(), kWriteBytes);
    ASSERT_OK(w);
    ASSERT_OK((*t)->wait(*w, 30s));
    EXPECT_EQ((*t)->post_write(*remote, kRangeBytes - 1, src->data(), 2).status().code(),
              StatusCode::kOutOfRange);
    (*t)->close();
}

}  // namespace
}  // namespace pdsim::transfer
