// The registry's static descriptors (transfer/transport.h): every registered transport has one,
// unknown names are refused with the list of known ones, and the descriptor of each transport that
// can be created here agrees with what its instances report (capabilities()). Also the typed
// option holder of TransportOptions.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"
#include "transfer/fault/fault_transport.h"
#include "transfer/local/local_transport.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/tcp/tcp_transport.h"
#include "transfer/transport.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;

// The fields a descriptor shares with the runtime Capabilities must be equal.
void expect_agree(const StaticCapabilities& declared, const Capabilities& runtime,
                  const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(declared.host_memory, runtime.host_memory);
    EXPECT_EQ(declared.device_memory, runtime.device_memory);
    EXPECT_EQ(declared.two_sided, runtime.two_sided);
    EXPECT_EQ(declared.one_sided_write, runtime.one_sided_write);
    EXPECT_EQ(declared.tag_matching, runtime.tag_matching);
    EXPECT_EQ(declared.detects_peer_failure, runtime.detects_peer_failure);
    if (!declared.decorator) {
        EXPECT_EQ(declared.stream_ordered, runtime.stream_ordered);
        EXPECT_EQ(declared.write_signals, runtime.write_signals);
    }
}

TransportDescriptor must_find(const std::string& name) {
    StatusOr<TransportDescriptor> d = find_transport(name);
    EXPECT_OK(d);
    return d.ok() ? *d : TransportDescriptor{};
}

TEST(TransportDescriptor, EveryRegisteredTransportHasOneUnderItsName) {
    const std::vector<std::string> names = registered_transports();
    for (const char* builtin : {"local", "tcp", "mpi", "fault", "nccl", "cuda_ipc"}) {
        EXPECT_NE(std::find(names.begin(), names.end(), builtin), names.end()) << builtin;
    }
    for (const std::string& name : names) {
        TransportDescriptor d = must_find(name);
        EXPECT_EQ(d.name, name);
        EXPECT_FALSE(d.summary.empty()) << name;
        // Some memory, some operation, some way to run the ranks.
        EXPECT_TRUE(d.caps.host_memory || d.caps.device_memory) << name;
        EXPECT_TRUE(d.caps.two_sided || d.caps.one_sided_write) << name;
        EXPECT_TRUE(d.caps.spans_processes || d.caps.threads_of_one_process) << name;
        // A decorator is exactly a transport set up as the one it wraps.
        EXPECT_EQ(d.caps.decorator, d.caps.setup == TransportSetup::kInner) << name;
        EXPECT_EQ(d.caps.decorator, d.caps.medium == TransportMedium::kInner) << name;
        // A shared in-process world cannot span processes; a launcher's ranks are processes.
        if (d.caps.setup == TransportSetup::kSharedWorld) {
            EXPECT_FALSE(d.caps.spans_processes) << name;
        }
        if (d.caps.setup == TransportSetup::kLauncher) {
            EXPECT_TRUE(d.caps.spans_processes) << name;
        }
        // Ranks on several hosts are several processes.
        if (d.caps.spans_nodes) {
            EXPECT_TRUE(d.caps.spans_processes) << name;
        }
    }
}

// Where the ranks may be is declared, not inferred from the setup or the medium: the testbed's
// placement checks (sim/testbed/options.cpp resolve_data_transport) read these fields, so that a
// cuda_ipc run across nodes and an nccl run of two ranks on one GPU are refused before any rank
// starts.
TEST(TransportDescriptor, WhereTheRanksMayBeIsDeclared) {
    const StaticCapabilities ipc = must_find("cuda_ipc").caps;
    EXPECT_TRUE(ipc.spans_processes);
    EXPECT_FALSE(ipc.spans_nodes);  // CUDA IPC handles open only on their node
    EXPECT_FALSE(ipc.one_rank_per_device);
    const StaticCapabilities nccl = must_find("nccl").caps;
    EXPECT_TRUE(nccl.spans_nodes);
    EXPECT_TRUE(nccl.one_rank_per_device);
    for (const char* name : {"tcp", "mpi"}) {
        EXPECT_TRUE(must_find(name).caps.spans_nodes) << name;
        EXPECT_FALSE(must_find(name).caps.one_rank_per_device) << name;
    }
    EXPECT_FALSE(must_find("local").caps.spans_nodes);
    // A decorator declares what it can wrap: everything.
    EXPECT_TRUE(must_find("fault").caps.spans_nodes);
    EXPECT_FALSE(must_find("fault").caps.one_rank_per_device);
}

TEST(TransportDescriptor, UnknownNameIsNotFoundAndListsTheKnownOnes) {
    StatusOr<TransportDescriptor> d = find_transport("carrier-pigeon");
    EXPECT_THAT(d, StatusIs(StatusCode::kNotFound, HasSubstr("carrier-pigeon")));
    for (const std::string& name : registered_transports()) {
        EXPECT_THAT(d.status().message(), HasSubstr(name));
    }
    // create_transport refuses it the same way.
    EXPECT_THAT(create_transport("carrier-pigeon", TransportOptions{}),
                StatusIs(StatusCode::kNotFound, HasSubstr("registered: ")));
}

TEST(TransportDescriptor, DescriptorsAreTheImplementationsDeclarations) {
    // The registry hands out what each implementation's header declares.
    for (const TransportDescriptor& declared :
         {local_transport_descriptor(), tcp_transport_descriptor(), fault_transport_descriptor(),
          nccl_transport_descriptor(), cuda_ipc_transport_descriptor()}) {
        TransportDescriptor registered = must_find(declared.name);
        EXPECT_EQ(registered.summary, declared.summary);
        EXPECT_EQ(registered.caps.setup, declared.caps.setup) << declared.name;
        EXPECT_EQ(registered.caps.medium, declared.caps.medium) << declared.name;
        EXPECT_EQ(registered.caps.spans_processes, declared.caps.spans_processes);
        EXPECT_EQ(registered.caps.threads_of_one_process, declared.caps.threads_of_one_process);
        EXPECT_EQ(registered.caps.spans_nodes, declared.caps.spans_nodes) << declared.name;
        EXPECT_EQ(registered.caps.one_rank_per_device, declared.caps.one_rank_per_device)
            << declared.name;
    }
}

TEST(TransportDescriptor, LocalInstancesAgreeWithTheDescriptor) {
    TransportOptions o;
    o.world_size = 2;
    o.set(LocalOptions{.world = make_local_world(2)});
    auto t = create_transport("local", o);
    ASSERT_OK(t);
    expect_agree(must_find("local").caps, (*t)->capabilities(), "local");
}

// Two tcp endpoints on threads of this process, meeting in a fresh directory.
std::vector<std::unique_ptr<Transport>> make_tcp_pair(const std::string& dir,
                                                      const std::string& name,
                                                      const TransportOptions& base) {
    std::vector<std::unique_ptr<Transport>> out(2);
    std::vector<Status> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
            TransportOptions o = base;
            o.rank = r;
            o.world_size = 2;
            o.connect_timeout = 20s;
            o.edit<TcpOptions>().bootstrap_dir = dir;
            auto t = create_transport(name, o);
            if (t.ok()) {
                out[r] = std::move(t).value();
            } else {
                errors[r] = t.status();
            }
        });
    }
    for (auto& th : threads) th.join();
    for (const Status& st : errors) EXPECT_OK(st);
    return out;
}

std::string fresh_dir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "pdsim-descriptor-XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    return tmpl;
}

TEST(TransportDescriptor, TcpInstancesAgreeWithTheDescriptor) {
    const std::string dir = fresh_dir();
    auto pair = make_tcp_pair(dir, "tcp", TransportOptions{});
    for (const auto& t : pair) {
        ASSERT_NE(t, nullptr);
        expect_agree(must_find("tcp").caps, t->capabilities(), "tcp");
    }
    pair.clear();
    std::filesystem::remove_all(dir);
}

TEST(TransportDescriptor, FaultInstancesHaveTheCapabilitiesOfWhatTheyWrap) {
    EXPECT_TRUE(must_find("fault").caps.decorator);
    {
        TransportOptions o;
        o.world_size = 2;
        o.set(LocalOptions{.world = make_local_world(2)});
        o.set(FaultOptions{.spec = "delay:ms=1", .inner = "local"});
        auto t = create_transport("fault", o);
        ASSERT_OK(t);
        expect_agree(must_find("local").caps, (*t)->capabilities(), "fault over local");
    }
    const std::string dir = fresh_dir();
    TransportOptions base;
    base.set(FaultOptions{.spec = "drop:p=0", .inner = "tcp"});
    auto pair = make_tcp_pair(dir, "fault", base);
    for (const auto& t : pair) {
        ASSERT_NE(t, nullptr);
        expect_agree(must_find("tcp").caps, t->capabilities(), "fault over tcp");
    }
    pair.clear();
    std::filesystem::remove_all(dir);
}

// Compiled out or without a GPU they cannot be created here, but they keep their descriptor and
// say why; with a GPU (a world of one) the instance must agree with the descriptor.
TEST(TransportDescriptor, GpuTransportsKeepTheirDescriptorAndTheirReason) {
    for (const char* name : {"nccl", "cuda_ipc"}) {
        TransportDescriptor d = must_find(name);
        EXPECT_FALSE(d.caps.host_memory) << name;
        EXPECT_TRUE(d.caps.device_memory) << name;
        EXPECT_EQ(d.caps.medium, TransportMedium::kGpu) << name;
        const std::string dir = fresh_dir();
        TransportOptions o;
        o.set(GpuTransportOptions{.device_index = 0, .rendezvous_dir = dir});
        auto t = create_transport(name, o);
        if (t.ok()) {
            expect_agree(d.caps, (*t)->capabilities(), name);
        } else {
            EXPECT_THAT(t,
                        StatusIs(StatusCode::kUnavailable,
                                 ::testing::AnyOf(HasSubstr("no device"), HasSubstr("not built"))));
        }
        std::filesystem::remove_all(dir);
    }
}

// ---- the typed option holder ----

TEST(TransportOptions, GetGivesTheBlockOrItsDefaults) {
    TransportOptions o;
    EXPECT_FALSE(o.has<TcpOptions>());
    EXPECT_EQ(o.get<TcpOptions>().max_frame_bytes, TcpOptions{}.max_frame_bytes);
    EXPECT_EQ(o.get<FaultOptions>().inner, "local");
    o.set(TcpOptions{.bootstrap_dir = "/tmp/x", .session_token = "s"});
    EXPECT_TRUE(o.has<TcpOptions>());
    EXPECT_EQ(o.get<TcpOptions>().bootstrap_dir, "/tmp/x");
    EXPECT_EQ(o.get<TcpOptions>().session_token, "s");
    EXPECT_FALSE(o.has<FaultOptions>());  // blocks of other types are untouched
    // set replaces the whole block.
    o.set(TcpOptions{.session_token = "t"});
    EXPECT_EQ(o.get<TcpOptions>().bootstrap_dir, "");
    EXPECT_EQ(o.get<TcpOptions>().session_token, "t");
}

TEST(TransportOptions, EditChangesInPlaceAndCopiesAreDeep) {
    TransportOptions a;
    a.edit<FaultOptions>().spec = "drop:p=1";
    EXPECT_EQ(a.get<FaultOptions>().spec, "drop:p=1");
    EXPECT_EQ(a.get<FaultOptions>().inner, "local");  // the rest keeps its defaults
    TransportOptions b = a;
    b.edit<FaultOptions>().spec = "delay:ms=1";
    EXPECT_EQ(a.get<FaultOptions>().spec, "drop:p=1");
    EXPECT_EQ(b.get<FaultOptions>().spec, "delay:ms=1");
}

}  // namespace
}  // namespace pdsim::transfer
