// The GPU transports (nccl, cuda_ipc). Without a GPU (or when pdsim was built without CUDA/NCCL)
// creation fails with kUnavailable and a reason, and the functional tests skip with that reason;
// they never pass silently.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "backends/runtime/device.h"
#include "tests/status_matchers.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/transport.h"

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
    {
        TransportOptions probe;
        probe.edit<GpuTransportOptions>().rendezvous_dir = temp_dir("probe");
        auto t = create_transport("nccl", probe);  // world of 1
        if (!t.ok()) GTEST_SKIP() << t.status().to_string();
    }
    if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks on one GPU)";
    std::string dir = temp_dir("pair");
    std::unique_ptr<Transport> t[2];
    std::thread th[2];
    for (int r = 0; r < 2; ++r) {
        th[r] = std::thread([&, r] {
            TransportOptions o;
            o.rank = r;
            o.world_size = 2;
            o.edit<GpuTransportOptions>().device_index = r;
            o.edit<GpuTransportOptions>().rendezvous_dir = dir;
            auto x = create_transport("nccl", o);
            ASSERT_OK(x);
            t[r] = std::move(x).value();
        });
    }
    th[0].join();
    th[1].join();
    ASSERT_TRUE(t[0] && t[1]);
    EXPECT_FALSE(t[0]->capabilities().tag_matching);
    const size_t n = size_t{64} << 20;
    auto a = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, n);
    auto b = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 1}, n);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<uint8_t> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint8_t>(i * 13 + 5);
    ASSERT_OK(a->copy_from_host(host.data(), n));
    auto r = t[1]->post_recv(0, 0, b->data(), n);
    auto s = t[0]->post_send(1, 0, a->data(), n);
    ASSERT_TRUE(r.ok() && s.ok());
    ASSERT_OK(t[1]->wait(*r, 60s));
    ASSERT_OK(t[0]->wait(*s, 60s));
    std::vector<uint8_t> back(n);
    ASSERT_OK(b->copy_to_host(back.data(), n));
    EXPECT_EQ(back, host);
    std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pdsim::transfer
