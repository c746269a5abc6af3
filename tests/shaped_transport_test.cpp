// ShapedTransport (sim/testbed/shaped_transport.h) over the local transport: a held send reaches
// the peer no earlier than latency + bytes / bandwidth after its post, sends to one peer keep their
// order, cancel withdraws a held send, close fails what is held, receives and unlimited links pass
// straight through, and one-sided writes are shaped as sends are.
#include "sim/testbed/shaped_transport.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "backends/runtime/cpu_stream.h"
#include "tests/status_matchers.h"
#include "transfer/local/local_transport.h"

namespace pdsim::testbed {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using transfer::RequestHandle;
using transfer::Transport;

// Two local ranks; rank 0's transport is shaped with `shaping`.
struct ShapedPair {
    std::unique_ptr<Transport> shaped;  // rank 0
    std::unique_ptr<Transport> peer;    // rank 1
};

ShapedPair make_pair_shaped(const topo::LinkShaping& shaping) {
    auto world = transfer::make_local_world(2);
    ShapedPair p;
    for (int r = 0; r < 2; ++r) {
        transfer::TransportOptions o;
        o.set(transfer::LocalOptions{.world = world});
        o.rank = r;
        auto t = transfer::create_transport("local", o);
        EXPECT_OK(t);
        if (!t.ok()) return p;
        if (r == 0) {
            p.shaped = make_shaped_transport(std::move(t).value(), shaping);
        } else {
            p.peer = std::move(t).value();
        }
    }
    return p;
}

topo::LinkShaping latency_only(double latency_us) {
    topo::LinkShaping s;
    s.latency_us = latency_us;
    return s;
}

TEST(ShapedTransport, ASendArrivesNoEarlierThanLatencyPlusSerialization) {
    topo::LinkShaping shaping;
    shaping.latency_us = 20'000;      // 20 ms
    shaping.bytes_per_s = 1'000'000;  // 1 MB/s: 10 kB take 10 ms
    auto p = make_pair_shaped(shaping);
    ASSERT_TRUE(p.shaped && p.peer);
    std::vector<uint8_t> msg(10'000, 7), got(10'000, 0);
    auto recv = p.peer->post_recv(0, 3, got.data(), got.size());
    ASSERT_OK(recv);
    const auto posted = Clock::now();
    auto send = p.shaped->post_send(1, 3, msg.data(), msg.size());
    ASSERT_OK(send);
    EXPECT_FALSE(send->done());  // held, not handed to the inner transport yet
    ASSERT_OK(p.peer->wait(*recv, 30s));
    const auto arrived = Clock::now();
    // The oracle: the link's own formula (topology/shaping.h), 20 ms + 10 ms.
    EXPECT_GE(arrived - posted, 30ms);
    ASSERT_OK(p.shaped->wait(*send, 30s));
    EXPECT_EQ(got, msg);
}

TEST(ShapedTransport, SendsToOnePeerKeepTheirOrder) {
    topo::LinkShaping shaping;
    shaping.latency_us = 1'000;
    shaping.bytes_per_s = 50'000'000;
    auto p = make_pair_shaped(shaping);
    ASSERT_TRUE(p.shaped && p.peer);
    constexpr int kMessages = 40;
    std::vector<std::vector<uint8_t>> sent, got;
    std::vector<RequestHandle> sends, recvs;
    for (int i = 0; i < kMessages; ++i) {
        // Varying sizes, so that a per-message delay alone would reorder them.
        sent.emplace_back(static_cast<size_t>(1 + (kMessages - i) * 997), static_cast<uint8_t>(i));
        got.emplace_back(sent.back().size() + 16, 0);
    }
    for (int i = 0; i < kMessages; ++i) {
        auto r = p.peer->post_recv(0, 5, got[static_cast<size_t>(i)].data(),
                                   got[static_cast<size_t>(i)].size());
        ASSERT_OK(r);
        recvs.push_back(*r);
    }
    for (int i = 0; i < kMessages; ++i) {
        auto s = p.shaped->post_send(1, 5, sent[static_cast<size_t>(i)].data(),
                                     sent[static_cast<size_t>(i)].size());
        ASSERT_OK(s);
        sends.push_back(*s);
    }
    for (int i = 0; i < kMessages; ++i) {
        const auto k = static_cast<size_t>(i);
        ASSERT_OK(p.peer->wait(recvs[k], 30s));
        // The k-th receive got the k-th send (non-overtaking): its size and its fill byte.
        EXPECT_EQ(recvs[k].bytes(), sent[k].size()) << "message " << i;
        EXPECT_EQ(got[k][0], static_cast<uint8_t>(i)) << "message " << i;
        ASSERT_OK(p.shaped->wait(sends[k], 30s));
    }
}

TEST(ShapedTransport, CancelWithdrawsAHeldSend) {
    auto p = make_pair_shaped(latency_only(10'000'000));  // 10 s: held for the whole test
    ASSERT_TRUE(p.shaped && p.peer);
    uint8_t byte = 1;
    auto send = p.shaped->post_send(1, 2, &byte, 1);
    ASSERT_OK(send);
    ASSERT_OK(p.shaped->cancel(*send));
    EXPECT_THAT(p.shaped->wait(*send, 1s), StatusIs(StatusCode::kAborted));
    // Nothing reached the peer.
    uint8_t got = 0;
    auto recv = p.peer->post_recv(0, 2, &got, 1);
    ASSERT_OK(recv);
    EXPECT_THAT(p.peer->wait(*recv, 50ms), StatusIs(StatusCode::kDeadlineExceeded));
    ASSERT_OK(p.peer->cancel(*recv));
}

TEST(ShapedTransport, CloseFailsHeldSendsAndRefusesNewOnes) {
    auto p = make_pair_shaped(latency_only(10'000'000));
    ASSERT_TRUE(p.shaped && p.peer);
    uint8_t bytes[3] = {1, 2, 3};
    std::vector<RequestHandle> held;
    for (uint8_t& b : bytes) {
        auto s = p.shaped->post_send(1, 4, &b, 1);
        ASSERT_OK(s);
        held.push_back(*s);
    }
    p.shaped->close();
    for (const RequestHandle& h : held) {
        EXPECT_THAT(p.shaped->wait(h, 1s),
                    StatusIs(StatusCode::kUnavailable, HasSubstr("transport closed")));
    }
    EXPECT_THAT(p.shaped->post_send(1, 4, bytes, 1).status(),
                StatusIs(StatusCode::kUnavailable, HasSubstr("closed")));
}

TEST(ShapedTransport, ReceivesAndUnlimitedLinksPassStraightThrough) {
    auto p = make_pair_shaped(topo::LinkShaping{});  // unlimited, no latency
    ASSERT_TRUE(p.shaped && p.peer);
    EXPECT_EQ(p.shaped->name(), "local");
    EXPECT_EQ(p.shaped->rank(), 0);
    EXPECT_EQ(p.shaped->world_size(), 2);
    uint8_t out = 9, in = 0;
    auto recv = p.shaped->post_recv(1, 1, &in, 1);
    ASSERT_OK(recv);
    auto send = p.peer->post_send(0, 1, &out, 1);
    ASSERT_OK(send);
    ASSERT_OK(p.shaped->wait(*recv, 30s));
    EXPECT_EQ(in, 9);
    ASSERT_OK(p.peer->wait(*send, 30s));
}

// One-sided writes (a GPU rank's KV over cuda_ipc) are shaped as sends are: held for latency +
// bytes / bandwidth, in one bucket with the sends to that peer (a write posted after a send goes
// out after it), cancellable while held. The stream-ordered posts are withdrawn.
TEST(ShapedTransport, WritesAreHeldAsSendsAreInTheSameBucket) {
    topo::LinkShaping shaping;
    shaping.latency_us = 20'000;      // 20 ms
    shaping.bytes_per_s = 1'000'000;  // 1 MB/s: 10 kB take 10 ms
    auto p = make_pair_shaped(shaping);
    ASSERT_TRUE(p.shaped && p.peer);
    EXPECT_TRUE(p.shaped->capabilities().one_sided_write);
    EXPECT_FALSE(p.shaped->capabilities().stream_ordered);
    std::vector<uint8_t> region(20'000, 0);
    auto mine = p.peer->register_memory(region.data(), region.size());
    ASSERT_OK(mine);
    auto remote = p.shaped->import_remote(1, mine->descriptor);
    ASSERT_OK(remote);
    std::vector<uint8_t> first(10'000, 5), second(10'000, 9), got(10'000, 0);
    auto recv = p.peer->post_recv(0, 3, got.data(), got.size());
    ASSERT_OK(recv);
    const auto posted = Clock::now();
    auto send = p.shaped->post_send(1, 3, first.data(), first.size());
    ASSERT_OK(send);
    auto write = p.shaped->post_write(*remote, 10'000, second.data(), second.size());
    ASSERT_OK(write);
    EXPECT_FALSE(write->done());  // held
    EXPECT_EQ(region[10'000], 0);
    ASSERT_OK(p.shaped->wait(*write, 30s));
    // The oracle: the send's 10 ms of the bucket, then the write's 10 ms, then 20 ms latency.
    EXPECT_GE(Clock::now() - posted, 40ms);
    EXPECT_TRUE(recv->done()) << "the write went out before the send posted ahead of it";
    EXPECT_EQ(std::vector<uint8_t>(region.begin() + 10'000, region.end()), second);
    // Cancel withdraws a held write: its bytes never land.
    auto late = p.shaped->post_write(*remote, 0, first.data(), first.size());
    ASSERT_OK(late);
    ASSERT_OK(p.shaped->cancel(*late));
    EXPECT_THAT(p.shaped->wait(*late, 1s), StatusIs(StatusCode::kAborted));
    EXPECT_EQ(region[0], 0);
    runtime::CpuStream stream("events");
    std::unique_ptr<runtime::Event> ready = stream.create_event();
    EXPECT_THAT(p.shaped->post_write_after(*ready, *remote, 0, first.data(), 1).status(),
                StatusIs(StatusCode::kUnimplemented));
    EXPECT_THAT(p.shaped->post_send_after(*ready, 1, 3, first.data(), 1).status(),
                StatusIs(StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace pdsim::testbed
