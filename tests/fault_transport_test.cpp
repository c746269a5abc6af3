// FaultTransport: each fault kind over the local transport (deterministic given the seed), the
// conformance suite through a benign decorator, and a disconnect over tcp.
#include "transfer/fault/fault_transport.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include "tests/status_matchers.h"
#include "tests/transport_conformance.h"
#include "transfer/local/local_transport.h"
#include "transfer/tcp/tcp_transport.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using conformance::compare_message;
using conformance::kWait;
using conformance::make_message;

// Two local ranks; rank `faulty` is wrapped with `spec`.
struct Pair {
    std::unique_ptr<Transport> t[2];
};

Pair make_pair_with(const std::string& spec, int faulty = 0, const std::string& inner = "local") {
    auto world = make_local_world(2);
    Pair p;
    for (int r = 0; r < 2; ++r) {
        TransportOptions o;
        o.set(LocalOptions{.world = world});
        o.rank = r;
        o.edit<FaultOptions>().inner = inner;
        o.edit<FaultOptions>().spec = spec;
        auto t = create_transport(r == faulty ? "fault" : inner, o);
        EXPECT_OK(t);
        if (t.ok()) p.t[r] = std::move(t).value();
    }
    return p;
}

class FaultLocalHarness : public conformance::Harness {
public:
    void run(const conformance::Body& body) override {
        auto world = make_local_world(3);
        conformance::InProcessHarness inner(3, [&](int rank) {
            TransportOptions o;
            o.set(LocalOptions{.world = world});
            o.rank = rank;
            o.edit<FaultOptions>().inner = "local";
            o.edit<FaultOptions>().spec = "delay:ms=1";
            return create_transport("fault", o);
        });
        inner.run(body);
    }
    [[nodiscard]] bool in_process() const override { return true; }
};
FaultLocalHarness g_fault_local;

}  // namespace

PDSIM_TRANSPORT_CONFORMANCE_TESTS(FaultDelayConformance, g_fault_local)

TEST(FaultSpec, Parses) {
    auto s = parse_fault_spec("delay:ms=5,jitter_ms=2; drop:p=0.25,seed=9");
    ASSERT_OK(s);
    EXPECT_EQ(s->delay_ms, 5);
    EXPECT_EQ(s->jitter_ms, 2);
    EXPECT_EQ(s->drop_p, 0.25);
    EXPECT_EQ(s->seed, 9u);
    EXPECT_EQ(parse_fault_spec("disconnect:after=5")->disconnect_after, 5);
    EXPECT_EQ(parse_fault_spec("corrupt:p=1,bytes=4")->corrupt_bytes, 4);
    EXPECT_EQ(parse_fault_spec("reorder")->reorder_p, 0.5);
    EXPECT_TRUE(parse_fault_spec("")->text.empty());
    for (const char* bad : {"explode:p=1", "drop:q=1", "drop:p=abc", "drop:p=2", "delay:ms"}) {
        auto b = parse_fault_spec(bad);
        EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    }
    EXPECT_THAT(parse_fault_spec("explode:p=1").status().message(), HasSubstr("explode"));
    EXPECT_THAT(parse_fault_spec("drop:q=1").status().message(), HasSubstr("'q'"));
}

TEST(FaultTransport, RegistryAndName) {
    Pair p = make_pair_with("drop:p=0");
    ASSERT_TRUE(p.t[0] && p.t[1]);
    EXPECT_EQ(p.t[0]->name(), "fault:local");
    TransportOptions o;
    o.edit<FaultOptions>().inner = "fault";
    EXPECT_EQ(create_transport("fault", o).status().code(), StatusCode::kInvalidArgument);
    o.edit<FaultOptions>().inner = "local";
    o.edit<FaultOptions>().spec = "bogus";
    EXPECT_EQ(create_transport("fault", o).status().code(), StatusCode::kInvalidArgument);
}

// Which of 200 single-message tags arrive under drop:p=0.3 with `seed`.
std::set<int> delivered_under_drop(uint64_t seed) {
    Pair p = make_pair_with("drop:p=0.3,seed=" + std::to_string(seed));
    constexpr int kN = 200;
    std::vector<std::vector<uint8_t>> in(kN, std::vector<uint8_t>(8));
    std::vector<RequestHandle> recvs;
    for (int k = 0; k < kN; ++k) recvs.push_back(*p.t[1]->post_recv(0, k, in[k].data(), 8));
    std::vector<std::vector<uint8_t>> out;
    for (int k = 0; k < kN; ++k) {
        out.push_back(make_message(0, 1, k, 8));
        auto s = p.t[0]->post_send(1, k, out.back().data(), 8);
        EXPECT_OK(s);
        EXPECT_OK(p.t[0]->wait(*s, kWait));  // a dropped send still "completes"
    }
    std::set<int> got;
    for (int k = 0; k < kN; ++k) {
        if (recvs[k].done()) {
            EXPECT_EQ(compare_message(in[k].data(), 8, 0, 1, k), "");
            got.insert(k);
        } else {
            EXPECT_EQ(p.t[1]->wait(recvs[k], 1ms).code(), StatusCode::kDeadlineExceeded);
        }
    }
    return got;
}

TEST(FaultTransport, DropIsDeterministicGivenASeed) {
    auto a = delivered_under_drop(1);
    auto b = delivered_under_drop(1);
    auto c = delivered_under_drop(2);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, c);
    // Roughly 30% dropped.
    EXPECT_GT(a.size(), 100u);
    EXPECT_LT(a.size(), 180u);
}

TEST(FaultTransport, DelayKeepsOrder) {
    Pair p = make_pair_with("delay:ms=300");
    constexpr int kN = 10;
    std::vector<std::vector<uint8_t>> in(kN, std::vector<uint8_t>(100));
    std::vector<RequestHandle> recvs;
    for (int k = 0; k < kN; ++k) recvs.push_back(*p.t[1]->post_recv(0, 3, in[k].data(), 100));
    std::vector<std::vector<uint8_t>> out(kN);
    std::vector<RequestHandle> sends;
    auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kN; ++k) {
        out[k] = make_message(0, 1, k, 100);
        auto s = p.t[0]->post_send(1, 3, out[k].data(), 100);
        ASSERT_OK(s);
        sends.push_back(*s);
        if (k == 0) {
            EXPECT_FALSE(recvs[0].done());  // still held by the delay
        }
    }
    ASSERT_OK(wait_all(*p.t[1], recvs, kWait));
    EXPECT_GE(std::chrono::steady_clock::now() - t0, 299ms);
    for (int k = 0; k < kN; ++k) EXPECT_EQ(compare_message(in[k].data(), 100, 0, 1, k), "") << k;
    EXPECT_OK(wait_all(*p.t[0], sends, kWait));
}

TEST(FaultTransport, CancelADelayedSend) {
    Pair p = make_pair_with("delay:ms=5000");
    std::vector<uint8_t> out(16, 1);
    std::vector<uint8_t> in(16);
    auto s = p.t[0]->post_send(1, 1, out.data(), out.size());
    ASSERT_OK(s);
    ASSERT_OK(p.t[0]->cancel(*s));
    EXPECT_EQ(p.t[0]->wait(*s, kWait).code(), StatusCode::kAborted);
    auto r = p.t[1]->post_recv(0, 1, in.data(), in.size());
    ASSERT_OK(r);
    EXPECT_EQ(p.t[1]->wait(*r, 200ms).code(), StatusCode::kDeadlineExceeded);
}

// Received bytes differ from what was sent in exactly `bytes` positions (or fewer if collisions),
// at positions that repeat run to run.
std::vector<size_t> corrupted_positions(uint64_t seed) {
    Pair p = make_pair_with("corrupt:p=1,bytes=3,seed=" + std::to_string(seed), /*faulty=*/1);
    auto out = make_message(0, 1, 5, 4096);
    std::vector<uint8_t> in(4096);
    auto r = p.t[1]->post_recv(0, 9, in.data(), in.size());
    auto s = p.t[0]->post_send(1, 9, out.data(), out.size());
    EXPECT_TRUE(r.ok() && s.ok());
    EXPECT_OK(p.t[1]->wait(*r, kWait));
    std::vector<size_t> diff;
    for (size_t i = 0; i < in.size(); ++i) {
        if (in[i] != out[i]) diff.push_back(i);
    }
    return diff;
}

TEST(FaultTransport, CorruptFlipsBytesDeterministically) {
    auto a = corrupted_positions(5);
    auto b = corrupted_positions(5);
    auto c = corrupted_positions(6);
    EXPECT_GE(a.size(), 1u);
    EXPECT_LE(a.size(), 3u);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, c);
}

TEST(FaultTransport, ReorderSwapsConsecutiveSends) {
    Pair p = make_pair_with("reorder:p=1,hold_ms=2000");
    constexpr int kN = 4;
    std::vector<std::vector<uint8_t>> in(kN, std::vector<uint8_t>(64));
    std::vector<RequestHandle> recvs;
    for (int k = 0; k < kN; ++k) recvs.push_back(*p.t[1]->post_recv(0, 2, in[k].data(), 64));
    std::vector<std::vector<uint8_t>> out(kN);
    std::vector<RequestHandle> sends;
    for (int k = 0; k < kN; ++k) {
        out[k] = make_message(0, 1, k, 64);
        auto s = p.t[0]->post_send(1, 2, out[k].data(), 64);
        ASSERT_OK(s);
        sends.push_back(*s);
    }
    ASSERT_OK(wait_all(*p.t[1], recvs, kWait));
    EXPECT_OK(wait_all(*p.t[0], sends, kWait));
    // Held A is released after B: receive order B A D C.
    EXPECT_EQ(compare_message(in[0].data(), 64, 0, 1, 1), "");
    EXPECT_EQ(compare_message(in[1].data(), 64, 0, 1, 0), "");
    EXPECT_EQ(compare_message(in[2].data(), 64, 0, 1, 3), "");
    EXPECT_EQ(compare_message(in[3].data(), 64, 0, 1, 2), "");
    // A lone held send goes out after hold_ms.
    Pair q = make_pair_with("reorder:p=1,hold_ms=300");
    std::vector<uint8_t> x(8, 7);
    std::vector<uint8_t> y(8);
    auto r = q.t[1]->post_recv(0, 1, y.data(), 8);
    auto xs = q.t[0]->post_send(1, 1, x.data(), 8);
    ASSERT_OK(xs);
    EXPECT_EQ(q.t[1]->wait(*r, 50ms).code(), StatusCode::kDeadlineExceeded);
    EXPECT_OK(q.t[1]->wait(*r, kWait));
    EXPECT_EQ(x, y);
    EXPECT_OK(q.t[0]->wait(*xs, kWait));
}

TEST(FaultTransport, DisconnectAfterN) {
    Pair p = make_pair_with("disconnect:after=3");
    std::vector<std::vector<uint8_t>> in(5, std::vector<uint8_t>(32));
    std::vector<RequestHandle> recvs;
    for (int k = 0; k < 5; ++k) recvs.push_back(*p.t[1]->post_recv(0, 1, in[k].data(), 32));
    std::vector<std::vector<uint8_t>> out;
    for (int k = 0; k < 3; ++k) {
        out.push_back(make_message(0, 1, k, 32));
        auto s = p.t[0]->post_send(1, 1, out.back().data(), 32);
        ASSERT_OK(s);
        ASSERT_OK(p.t[0]->wait(*s, kWait));
    }
    auto fourth = p.t[0]->post_send(1, 1, out.back().data(), 32);
    EXPECT_THAT(fourth, StatusIs(StatusCode::kUnavailable, HasSubstr("disconnected after 3")));
    for (int k = 0; k < 3; ++k) {
        ASSERT_OK(p.t[1]->wait(recvs[k], kWait));
        EXPECT_EQ(compare_message(in[k].data(), 32, 0, 1, k), "");
    }
    // The peer sees the rank go away: its pending receives fail, naming rank 0.
    Status st = p.t[1]->wait(recvs[3], kWait);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("rank 0")) << st.to_string();
    EXPECT_EQ(p.t[0]->post_recv(1, 1, in[4].data(), 32).status().code(), StatusCode::kUnavailable);
}

TEST(FaultTransport, DisconnectOverTcp) {
    std::string dir =
        (std::filesystem::temp_directory_path() / ("pdsim-fault-" + std::to_string(::getpid())))
            .string();
    std::filesystem::remove_all(dir);
    std::unique_ptr<Transport> t[2];
    std::thread th[2];
    for (int r = 0; r < 2; ++r) {
        th[r] = std::thread([&, r] {
            TransportOptions o;
            o.rank = r;
            o.world_size = 2;
            o.edit<TcpOptions>().bootstrap_dir = dir;
            o.edit<FaultOptions>().inner = "tcp";
            o.edit<FaultOptions>().spec = "disconnect:after=1";
            auto x = create_transport(r == 0 ? "fault" : "tcp", o);
            ASSERT_OK(x);
            t[r] = std::move(x).value();
        });
    }
    th[0].join();
    th[1].join();
    ASSERT_TRUE(t[0] && t[1]);
    std::vector<uint8_t> a(1000, 1);
    std::vector<uint8_t> b(1000);
    auto r1 = t[1]->post_recv(0, 1, b.data(), b.size());
    auto r2 = t[1]->post_recv(0, 1, b.data(), b.size());
    ASSERT_TRUE(r1.ok() && r2.ok());
    auto sa = t[0]->post_send(1, 1, a.data(), a.size());
    ASSERT_OK(sa);
    ASSERT_OK(t[1]->wait(*r1, kWait));
    EXPECT_EQ(a, b);
    EXPECT_OK(t[0]->wait(*sa, kWait));
    Status st = t[1]->wait(*r2, kWait);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("rank 0")) << st.to_string();
    std::filesystem::remove_all(dir);
}

}  // namespace pdsim::transfer
