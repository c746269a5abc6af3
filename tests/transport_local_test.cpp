// The "local" transport: the conformance suite (threads as ranks) plus local-only behaviour
// (one-sided writes, attach rules, close semantics) and the registry.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"
#include "tests/transport_conformance.h"
#include "transfer/local/local_transport.h"

namespace pdsim::transfer {
using namespace std::chrono_literals;

// A fresh world per test run, shared by the ranks' endpoints.
class LocalHarness : public conformance::Harness {
public:
    explicit LocalHarness(int n) : n_(n) {}
    void run(const conformance::Body& body) override {
        auto world = make_local_world(n_);
        conformance::InProcessHarness inner(n_, [&](int rank) {
            TransportOptions o;
            o.set(LocalOptions{.world = world});
            o.rank = rank;
            return create_transport("local", o);
        });
        inner.run(body);
    }
    [[nodiscard]] bool in_process() const override { return true; }

private:
    int n_;
};

namespace {
LocalHarness g_local3(3);
LocalHarness g_local2(2);
}  // namespace

PDSIM_TRANSPORT_CONFORMANCE_TESTS(LocalConformance3, g_local3)
PDSIM_TRANSPORT_CONFORMANCE_TESTS(LocalConformance2, g_local2)

TEST(LocalTransport, RegistryKnowsBuiltins) {
    auto names = registered_transports();
    EXPECT_NE(std::find(names.begin(), names.end(), "local"), names.end());
    auto bad = create_transport("carrier-pigeon", TransportOptions{});
    EXPECT_THAT(bad, StatusIs(StatusCode::kNotFound, HasSubstr("local")))
        << bad.status().to_string();
}

TEST(LocalTransport, NeedsAWorldAndAValidRank) {
    TransportOptions o;
    EXPECT_EQ(create_transport("local", o).status().code(), StatusCode::kInvalidArgument);
    o.set(LocalOptions{.world = make_local_world(2)});
    o.rank = 2;
    EXPECT_EQ(create_transport("local", o).status().code(), StatusCode::kInvalidArgument);
    o.rank = 1;
    auto a = create_transport("local", o);
    ASSERT_OK(a);
    // A second endpoint for the same rank is refused, and does not disturb the first.
    EXPECT_EQ(create_transport("local", o).status().code(), StatusCode::kAlreadyExists);
    o.rank = 0;
    auto b = create_transport("local", o);
    ASSERT_OK(b);
    uint8_t x = 7;
    uint8_t y = 0;
    auto r = (*a)->post_recv(0, 1, &y, 1);
    auto s = (*b)->post_send(1, 1, &x, 1);
    ASSERT_TRUE(r.ok() && s.ok());
    ASSERT_OK((*a)->wait(*r, 1s));
    EXPECT_EQ(y, 7);
    EXPECT_OK((*b)->wait(*s, 1s));
}

TEST(LocalTransport, SendWaitsForTheMatchingRecv) {
    auto world = make_local_world(2);
    TransportOptions o;
    o.set(LocalOptions{.world = world});
    auto t0 = create_transport("local", o);
    o.rank = 1;
    auto t1 = create_transport("local", o);
    ASSERT_TRUE(t0.ok() && t1.ok());
    std::vector<uint8_t> out(1000, 3);
    auto s = (*t0)->post_send(1, 5, out.data(), out.size());
    ASSERT_OK(s);
    EXPECT_EQ((*t0)->wait(*s, 20ms).code(), StatusCode::kDeadlineExceeded);  // rendezvous
    std::vector<uint8_t> in(1000);
    auto r = (*t1)->post_recv(0, 5, in.data(), in.size());
    ASSERT_OK(r);
    EXPECT_TRUE(r->done());  // matched and copied inside the post
    EXPECT_OK((*t0)->wait(*s, 1s));
    EXPECT_EQ(in, out);
    // A pending send can be cancelled; then the receive does not see it.
    auto s2 = (*t0)->post_send(1, 6, out.data(), out.size());
    ASSERT_OK(s2);
    EXPECT_OK((*t0)->cancel(*s2));
    EXPECT_EQ((*t0)->wait(*s2, 1s).code(), StatusCode::kAborted);
    auto r2 = (*t1)->post_recv(0, 6, in.data(), in.size());
    ASSERT_OK(r2);
    EXPECT_EQ((*t1)->wait(*r2, 20ms).code(), StatusCode::kDeadlineExceeded);
    // Cancel of a completed op is OK.
    EXPECT_OK((*t0)->cancel(*s));
    // Closing rank 1 fails its pending receive with "transport closed"...
    (*t1)->close();
    Status st = (*t1)->wait(*r2, 1s);
    EXPECT_THAT(st, StatusIs(StatusCode::kUnavailable, HasSubstr("closed"))) << st.to_string();
    // ...and rank 0's later posts to it fail at once, naming it.
    auto s3 = (*t0)->post_send(1, 6, out.data(), out.size());
    EXPECT_THAT(s3, StatusIs(StatusCode::kUnavailable, HasSubstr("rank 1")));
}

TEST(LocalTransport, OneSidedWrite) {
    auto world = make_local_world(2);
    TransportOptions o;
    o.set(LocalOptions{.world = world});
    auto t0 = create_transport("local", o);
    o.rank = 1;
    auto t1 = create_transport("local", o);
    ASSERT_TRUE(t0.ok() && t1.ok());
    EXPECT_TRUE((*t0)->capabilities().one_sided_write);
    std::vector<uint8_t> target(4096, 0);
    auto mr = (*t1)->register_memory(target.data(), target.size());
    ASSERT_OK(mr);
    auto remote = (*t0)->import_remote(1, mr->descriptor);
    ASSERT_OK(remote);
    EXPECT_EQ(remote->bytes, 4096u);
    EXPECT_EQ((*t0)->import_remote(0, mr->descriptor).status().code(),
              StatusCode::kInvalidArgument);
    std::vector<uint8_t> src(100, 0xAB);
    auto w = (*t0)->post_write(*remote, 1000, src.data(), src.size());
    ASSERT_OK(w);
    ASSERT_OK((*t0)->wait(*w, 1s));
    EXPECT_EQ(target[999], 0);
    EXPECT_EQ(target[1000], 0xAB);
    EXPECT_EQ(target[1099], 0xAB);
    EXPECT_EQ(target[1100], 0);
    EXPECT_EQ((*t0)->post_write(*remote, 4000, src.data(), src.size()).status().code(),
              StatusCode::kOutOfRange);
    ASSERT_OK((*t1)->deregister_memory(mr->id));
    EXPECT_EQ((*t0)->post_write(*remote, 0, src.data(), 1).status().code(), StatusCode::kNotFound);
}

// post_signal: the arrival counter's add, after the writes before it. Two ranks write their
// halves of a region and signal one word from several threads each; an observer that sees the
// full sum (acquire) must see every byte (TSan checks the release/acquire pairing: a plain add
// would be a data race on the bytes here).
TEST(LocalTransport, SignalPublishesTheWritesBeforeIt) {
    constexpr int kThreads = 4;
    constexpr int kRounds = 200;
    constexpr size_t kChunk = 64;
    auto world = make_local_world(3);
    std::vector<std::unique_ptr<Transport>> t;
    for (int r = 0; r < 3; ++r) {
        TransportOptions o;
        o.rank = r;
        o.set(LocalOptions{.world = world});
        auto x = create_transport("local", o);
        ASSERT_OK(x);
        t.push_back(std::move(x).value());
    }
    EXPECT_TRUE(t[0]->capabilities().write_signals);
    // Rank 2 owns the data and the counter.
    std::vector<uint8_t> data(2 * kThreads * kRounds * kChunk, 0);
    alignas(8) std::array<uint64_t, 4> words{};
    auto data_mr = t[2]->register_memory(data.data(), data.size());
    auto word_mr = t[2]->register_memory(words.data(), sizeof(words));
    ASSERT_OK(data_mr);
    ASSERT_OK(word_mr);
    const uint64_t total = 2ull * kThreads * kRounds * kChunk;
    std::atomic<bool> saw_all{false};
    std::thread observer([&] {
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        while (std::atomic_ref<uint64_t>(words[1]).load(std::memory_order_acquire) < total) {
            if (std::chrono::steady_clock::now() > deadline) return;
            std::this_thread::yield();
        }
        bool all = true;
        for (uint8_t b : data) all = all && b == 0x5C;
        saw_all = all;
    });
    std::vector<std::thread> writers;
    for (int src = 0; src < 2; ++src) {
        auto data_remote = t[static_cast<size_t>(src)]->import_remote(2, data_mr->descriptor);
        auto word_remote = t[static_cast<size_t>(src)]->import_remote(2, word_mr->descriptor);
        ASSERT_OK(data_remote);
        ASSERT_OK(word_remote);
        for (int th = 0; th < kThreads; ++th) {
            writers.emplace_back([&, src, th, d = *data_remote, w = *word_remote] {
                std::vector<uint8_t> bytes(kChunk, 0x5C);
                for (int i = 0; i < kRounds; ++i) {
                    const size_t at =
                        ((static_cast<size_t>(src) * kThreads + th) * kRounds + i) * kChunk;
                    auto wr = t[static_cast<size_t>(src)]->post_write(d, at, bytes.data(), kChunk);
                    auto sg = t[static_cast<size_t>(src)]->post_signal(w, 8, kChunk);
                    EXPECT_OK(wr);
                    EXPECT_OK(sg);
                    if (sg.ok()) {
                        EXPECT_OK(t[static_cast<size_t>(src)]->wait(*sg, 1s));
                    }
                }
            });
        }
    }
    for (std::thread& w : writers) w.join();
    observer.join();
    EXPECT_TRUE(saw_all.load()) << "the observer saw the sum " << words[1] << " of " << total
                                << " without every byte";
    EXPECT_EQ(words[0], 0u);
    EXPECT_EQ(words[1], total);
    EXPECT_EQ(words[2], 0u);

    auto w = t[0]->import_remote(2, word_mr->descriptor);
    ASSERT_OK(w);
    EXPECT_THAT(t[0]->post_signal(*w, 4, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("not 8-byte aligned")));
    EXPECT_THAT(t[0]->post_signal(*w, sizeof(words) - 4, 1), StatusIs(StatusCode::kOutOfRange));
    EXPECT_THAT(t[0]->post_signal(*w, sizeof(words), 1), StatusIs(StatusCode::kOutOfRange));
    ASSERT_OK(t[2]->deregister_memory(word_mr->id));
    EXPECT_THAT(t[0]->post_signal(*w, 0, 1), StatusIs(StatusCode::kNotFound));
}

}  // namespace pdsim::transfer
