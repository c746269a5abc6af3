// The transport conformance suite: one set of test bodies, run over every two-sided transport
// (local and tcp in-process with threads as ranks, mpi under mpirun with processes as ranks).
//
// A test file provides a harness (how to get one Transport per rank and run a body on each) and
// instantiates the suite with PDSIM_TRANSPORT_CONFORMANCE_TESTS(SuiteName, harness_expr).
// Bodies are symmetric: every rank runs the same function and uses rank()/world_size(); they work
// for any world size >= 2. Tags stay below 32767 (the smallest MPI_TAG_UB MPI allows).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"
#include "transfer/transport.h"

namespace pdsim::transfer::conformance {

using namespace std::chrono_literals;

#if defined(__SANITIZE_THREAD__)
inline constexpr auto kWait = 120s;
// TSan's cost is per byte moved and checked, while the interleavings it looks for (a completion
// racing a cancel, a callback racing a close) happen at any size: the volume cases move a quarter
// of their bytes under it (the release suite moves all of them).
inline constexpr size_t kVolumeDivisor = 4;
#else
inline constexpr auto kWait = 30s;
inline constexpr size_t kVolumeDivisor = 1;
#endif

using Body = std::function<void(Transport&)>;

// Runs `body` once per rank, each with that rank's transport, and returns when all are done.
class Harness {
public:
    virtual ~Harness() = default;
    virtual void run(const Body& body) = 0;
    // Whether close() on one rank may be followed by its peers continuing (in-process only).
    [[nodiscard]] virtual bool in_process() const = 0;
};

// Threads act as ranks: `make(rank)` creates each rank's transport (all ranks concurrently, since
// connecting a mesh blocks until every rank is up), then `body` runs on one thread per rank.
class InProcessHarness : public Harness {
public:
    using MakeFn = std::function<StatusOr<std::unique_ptr<Transport>>(int rank)>;
    InProcessHarness(int world_size, MakeFn make) : n_(world_size), make_(std::move(make)) {}

    void run(const Body& body) override {
        std::vector<std::unique_ptr<Transport>> ts(static_cast<size_t>(n_));
        std::vector<Status> errors(static_cast<size_t>(n_));
        {
            std::vector<std::thread> threads;
            for (int r = 0; r < n_; ++r) {
                threads.emplace_back([&, r] {
                    auto t = make_(r);
                    if (t.ok()) {
                        ts[static_cast<size_t>(r)] = std::move(t).value();
                    } else {
                        errors[static_cast<size_t>(r)] = t.status();
                    }
                });
            }
            for (auto& th : threads) th.join();
        }
        for (int r = 0; r < n_; ++r) {
            ASSERT_OK(errors[static_cast<size_t>(r)])
                << "rank " << r << ": " << errors[static_cast<size_t>(r)].to_string();
        }
        std::vector<std::thread> threads;
        for (int r = 0; r < n_; ++r) {
            threads.emplace_back([&, r] { body(*ts[static_cast<size_t>(r)]); });
        }
        for (auto& th : threads) th.join();
    }
    [[nodiscard]] bool in_process() const override { return true; }

private:
    int n_;
    MakeFn make_;
};

// Deterministic bytes of message `seq` from `src` to `dst`.
inline uint8_t pattern_byte(int src, int dst, uint64_t seq, size_t i) {
    uint64_t x = (static_cast<uint64_t>(src) * 1000003u) ^ (static_cast<uint64_t>(dst) << 20) ^
                 (seq * 0x9E3779B97F4A7C15ull) ^ (i / 8 * 0xBF58476D1CE4E5B9ull);
    x ^= x >> 29;
    return static_cast<uint8_t>((x >> ((i % 8) * 8)) & 0xff);
}

inline std::vector<uint8_t> make_message(int src, int dst, uint64_t seq, size_t n) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = pattern_byte(src, dst, seq, i);
    return v;
}

// "" when equal, else a description of the first difference.
inline std::string compare_message(const uint8_t* got, size_t n, int src, int dst, uint64_t seq) {
    for (size_t i = 0; i < n; ++i) {
        uint8_t want = pattern_byte(src, dst, seq, i);
        if (got[i] != want) {
            return "byte " + std::to_string(i) + " of " + std::to_string(n) + ": got " +
                   std::to_string(got[i]) + " want " + std::to_string(want) + " (src " +
                   std::to_string(src) + ", seq " + std::to_string(seq) + ")";
        }
    }
    return "";
}

inline constexpr Tag kBarrierTag = 32000;

// A barrier built on the transport itself (0-byte all-to-all).
inline void barrier(Transport& t, Tag tag = kBarrierTag) {
    std::vector<RequestHandle> hs;
    for (int p = 0; p < t.world_size(); ++p) {
        if (p == t.rank()) continue;
        auto r = t.post_recv(p, tag, nullptr, 0);
        ASSERT_OK(r);
        hs.push_back(*r);
        auto s = t.post_send(p, tag, nullptr, 0);
        ASSERT_OK(s);
        hs.push_back(*s);
    }
    Status st = wait_all(t, hs, kWait);
    ASSERT_OK(st);
}

inline int right_of(const Transport& t) {
    return (t.rank() + 1) % t.world_size();
}
inline int left_of(const Transport& t) {
    return (t.rank() + t.world_size() - 1) % t.world_size();
}

// ---- Bodies ----

inline void basics(Transport& t) {
    EXPECT_FALSE(t.name().empty());
    EXPECT_GE(t.world_size(), 2);
    EXPECT_GE(t.rank(), 0);
    EXPECT_LT(t.rank(), t.world_size());
    Capabilities c = t.capabilities();
    EXPECT_TRUE(c.two_sided);
    EXPECT_TRUE(c.tag_matching);
    EXPECT_GE(c.max_tag, Tag{32767});
    EXPECT_GE(c.max_message_bytes, size_t{64} << 20);
}

// Ring exchange of each size, receives posted first.
inline void ring_sizes(Transport& t, const std::vector<size_t>& sizes) {
    int right = right_of(t);
    int left = left_of(t);
    for (size_t k = 0; k < sizes.size(); ++k) {
        size_t n = sizes[k];
        std::vector<uint8_t> out = make_message(t.rank(), right, k, n);
        std::vector<uint8_t> in(n + 16, 0xEE);
        auto r = t.post_recv(left, static_cast<Tag>(k), in.data(), in.size());
        ASSERT_OK(r);
        auto s = t.post_send(right, static_cast<Tag>(k), out.data(), n);
        ASSERT_OK(s);
        Status st = t.wait(*s, kWait);
        ASSERT_OK(st) << "send of " << n << ": " << st.to_string();
        st = t.wait(*r, kWait);
        ASSERT_OK(st) << "recv of " << n << ": " << st.to_string();
        EXPECT_EQ(r->bytes(), n);
        EXPECT_EQ(compare_message(in.data(), n, left, t.rank(), k), "") << "size " << n;
        // Bytes past the message are untouched.
        EXPECT_TRUE(std::all_of(in.begin() + static_cast<ptrdiff_t>(n), in.end(),
                                [](uint8_t b) { return b == 0xEE; }));
    }
}

inline void ring_small_and_medium(Transport& t) {
    ring_sizes(t, {0, 1, 3, 8, 4096, 65536 + 3, (size_t{1} << 20) + 5, size_t{8} << 20});
}

// 64 MiB per message (16 MiB under TSan): many socket buffers and partial writes per message.
inline void ring_large(Transport& t) {
    ring_sizes(t, {(size_t{64} << 20) / kVolumeDivisor});
}

// Sends before the receives exist (unexpected-message path), then receives.
inline void send_before_recv(Transport& t) {
    int right = right_of(t);
    int left = left_of(t);
    const std::vector<size_t> sizes = {0, 17, 100000, size_t{3} << 20};
    std::vector<std::vector<uint8_t>> outs;
    std::vector<RequestHandle> sends;
    for (size_t k = 0; k < sizes.size(); ++k) {
        outs.push_back(make_message(t.rank(), right, 100 + k, sizes[k]));
        auto s = t.post_send(right, 200 + static_cast<Tag>(k), outs.back().data(), sizes[k]);
        ASSERT_OK(s);
        sends.push_back(*s);
    }
    std::this_thread::sleep_for(100ms);        // let the messages arrive before anyone receives
    for (size_t k = sizes.size(); k-- > 0;) {  // reverse tag order, on purpose
        std::vector<uint8_t> in(sizes[k] + 1);
        auto r = t.post_recv(left, 200 + static_cast<Tag>(k), in.data(), in.size());
        ASSERT_OK(r);
        Status st = t.wait(*r, kWait);
        ASSERT_OK(st);
        EXPECT_EQ(r->bytes(), sizes[k]);
        EXPECT_EQ(compare_message(in.data(), sizes[k], left, t.rank(), 100 + k), "");
    }
    Status st = wait_all(t, sends, kWait);
    EXPECT_OK(st);
}

// Many messages with one tag: the k-th receive gets the k-th send (non-overtaking), whether
// the receive was posted before or after the message arrived.
inline void fifo_per_tag(Transport& t) {
    constexpr int kCount = 120;
    constexpr Tag kTag = 300;
    int right = right_of(t);
    int left = left_of(t);
    auto size_of = [](int k) { return static_cast<size_t>((k * 7919) % 20000 + (k % 3) * 65536); };
    std::vector<std::vector<uint8_t>> ins(kCount);
    std::vector<RequestHandle> recvs;
    // First half of the receives before any send.
    for (int k = 0; k < kCount / 2; ++k) {
        ins[k].assign(size_of(k), 0);
        auto r = t.post_recv(left, kTag, ins[k].data(), ins[k].size());
        ASSERT_OK(r);
        recvs.push_back(*r);
    }
    std::vector<std::vector<uint8_t>> outs(kCount);
    std::vector<RequestHandle> sends;
    for (int k = 0; k < kCount; ++k) {
        outs[k] = make_message(t.rank(), right, 1000 + k, size_of(k));
        auto s = t.post_send(right, kTag, outs[k].data(), outs[k].size());
        ASSERT_OK(s);
        sends.push_back(*s);
    }
    std::this_thread::sleep_for(20ms);
    for (int k = kCount / 2; k < kCount; ++k) {
        ins[k].assign(size_of(k), 0);
        auto r = t.post_recv(left, kTag, ins[k].data(), ins[k].size());
        ASSERT_OK(r);
        recvs.push_back(*r);
    }
    Status st = wait_all(t, recvs, kWait);
    ASSERT_OK(st);
    for (int k = 0; k < kCount; ++k) {
        ASSERT_EQ(recvs[k].bytes(), size_of(k)) << "message " << k;
        ASSERT_EQ(compare_message(ins[k].data(), ins[k].size(), left, t.rank(), 1000 + k), "")
            << "message " << k;
    }
    st = wait_all(t, sends, kWait);
    EXPECT_OK(st);
}

// A receive for tag B completes although an earlier message with tag A is still unmatched.
inline void tags_are_independent(Transport& t) {
    int right = right_of(t);
    int left = left_of(t);
    std::vector<uint8_t> a = make_message(t.rank(), right, 1, 5000);
    std::vector<uint8_t> b = make_message(t.rank(), right, 2, 7000);
    auto sa = t.post_send(right, 401, a.data(), a.size());
    auto sb = t.post_send(right, 402, b.data(), b.size());
    ASSERT_TRUE(sa.ok() && sb.ok());
    std::vector<uint8_t> ib(7000);
    auto rb = t.post_recv(left, 402, ib.data(), ib.size());
    ASSERT_OK(rb);
    Status st = t.wait(*rb, kWait);
    ASSERT_OK(st);
    EXPECT_EQ(compare_message(ib.data(), ib.size(), left, t.rank(), 2), "");
    std::vector<uint8_t> ia(5000);
    auto ra = t.post_recv(left, 401, ia.data(), ia.size());
    ASSERT_OK(ra);
    st = t.wait(*ra, kWait);
    ASSERT_OK(st);
    EXPECT_EQ(compare_message(ia.data(), ia.size(), left, t.rank(), 1), "");
    RequestHandle sends[] = {*sa, *sb};
    EXPECT_OK(wait_all(t, sends, kWait));
}

// Several threads per rank post concurrently, each with its own tag, to every peer.
inline void concurrent_threads(Transport& t) {
    constexpr int kThreads = 4;
    constexpr int kPerPeer = 25;
    std::vector<std::thread> threads;
    for (int j = 0; j < kThreads; ++j) {
        threads.emplace_back([&t, j] {
            const Tag tag = 500 + static_cast<Tag>(j);
            std::vector<std::vector<uint8_t>> outs;
            std::vector<std::vector<uint8_t>> ins;
            std::vector<RequestHandle> hs;
            std::vector<std::pair<int, int>> expect;  // (peer, seq) per recv, in ins order
            outs.reserve(static_cast<size_t>(t.world_size() * kPerPeer));
            ins.reserve(static_cast<size_t>(t.world_size() * kPerPeer));
            for (int m = 0; m < kPerPeer; ++m) {
                for (int p = 0; p < t.world_size(); ++p) {
                    if (p == t.rank()) continue;
                    size_t n = static_cast<size_t>(1 + (m * 131 + j * 17) % 9000);
                    uint64_t seq = static_cast<uint64_t>(j * 100000 + m);
                    ins.emplace_back(n);
                    auto r = t.post_recv(p, tag, ins.back().data(), n);
                    ASSERT_OK(r);
                    hs.push_back(*r);
                    expect.emplace_back(p, static_cast<int>(seq));
                    outs.push_back(make_message(t.rank(), p, seq, n));
                    auto s = t.post_send(p, tag, outs.back().data(), n);
                    ASSERT_OK(s);
                    hs.push_back(*s);
                }
            }
            Status st = wait_all(t, hs, kWait);
            ASSERT_OK(st);
            for (size_t i = 0; i < ins.size(); ++i) {
                ASSERT_EQ(compare_message(ins[i].data(), ins[i].size(), expect[i].first, t.rank(),
                                          static_cast<uint64_t>(expect[i].second)),
                          "");
            }
        });
    }
    for (auto& th : threads) th.join();
}

// A message larger than the receive buffer fails the receive (kOutOfRange), the send completes;
// a smaller one completes with its own size.
inline void truncation_and_short_messages(Transport& t) {
    int right = right_of(t);
    int left = left_of(t);
    std::vector<uint8_t> big = make_message(t.rank(), right, 7, 100);
    std::vector<uint8_t> small = make_message(t.rank(), right, 8, 10);
    std::vector<uint8_t> in1(50);
    std::vector<uint8_t> in2(50);
    auto r1 = t.post_recv(left, 601, in1.data(), in1.size());
    auto r2 = t.post_recv(left, 601, in2.data(), in2.size());
    ASSERT_TRUE(r1.ok() && r2.ok());
    auto s1 = t.post_send(right, 601, big.data(), big.size());
    auto s2 = t.post_send(right, 601, small.data(), small.size());
    ASSERT_TRUE(s1.ok() && s2.ok());
    Status st = t.wait(*r1, kWait);
    EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
    st = t.wait(*r2, kWait);
    ASSERT_OK(st);
    EXPECT_EQ(r2->bytes(), 10u);
    EXPECT_EQ(compare_message(in2.data(), 10, left, t.rank(), 8), "");
    EXPECT_OK(t.wait(*s1, kWait));
    EXPECT_OK(t.wait(*s2, kWait));
}

// wait() times out with kDeadlineExceeded and leaves the op pending; cancel withdraws it and the
// cancelled receive consumes nothing.
inline void timeout_then_cancel(Transport& t) {
    int right = right_of(t);
    int left = left_of(t);
    std::vector<uint8_t> in(64);
    auto r = t.post_recv(left, 701, in.data(), in.size());
    ASSERT_OK(r);
    auto t0 = std::chrono::steady_clock::now();
    Status st = t.wait(*r, 50ms);
    auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.to_string();
    EXPECT_GE(waited, 45ms);
    EXPECT_LT(waited, 5s);
    auto polled = t.test(*r);
    ASSERT_OK(polled);
    EXPECT_FALSE(*polled);
    st = t.cancel(*r);
    ASSERT_OK(st);
    st = t.wait(*r, kWait);
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st.to_string();
    barrier(t);
    // The tag still works, and the next message goes to the next receive.
    std::vector<uint8_t> out = make_message(t.rank(), right, 9, 64);
    auto r2 = t.post_recv(left, 701, in.data(), in.size());
    auto s2 = t.post_send(right, 701, out.data(), out.size());
    ASSERT_TRUE(r2.ok() && s2.ok());
    ASSERT_OK(t.wait(*r2, kWait));
    EXPECT_EQ(compare_message(in.data(), 64, left, t.rank(), 9), "");
    EXPECT_OK(t.wait(*s2, kWait));
    barrier(t);
}

inline void invalid_arguments(Transport& t) {
    uint8_t b[4] = {};
    int other = right_of(t);
    EXPECT_EQ(t.post_send(-1, 1, b, 4).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.post_send(t.world_size(), 1, b, 4).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.post_send(t.rank(), 1, b, 4).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.post_recv(t.rank(), 1, b, 4).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.post_send(other, 1, nullptr, 4).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.post_recv(other, 1, nullptr, 4).status().code(), StatusCode::kInvalidArgument);
    Capabilities c = t.capabilities();
    if (c.max_tag < std::numeric_limits<Tag>::max()) {
        EXPECT_EQ(t.post_send(other, c.max_tag + 1, b, 4).status().code(),
                  StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(t.wait(RequestHandle(), 1ms).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.test(RequestHandle()).status().code(), StatusCode::kInvalidArgument);
    if (!c.one_sided_write) {
        EXPECT_EQ(t.post_write(RemoteRegion{other, 1, 4}, 0, b, 4).status().code(),
                  StatusCode::kUnimplemented);
    }
}

// Completion callbacks and test() polling.
inline void callbacks_and_polling(Transport& t) {
    int right = right_of(t);
    int left = left_of(t);
    std::vector<uint8_t> out = make_message(t.rank(), right, 11, 3000);
    std::vector<uint8_t> in(3000);
    std::atomic<int> calls{0};
    std::atomic<size_t> got_bytes{0};
    auto r = t.post_recv(left, 801, in.data(), in.size());
    ASSERT_OK(r);
    r->on_complete([&](const Status& st, size_t n) {
        EXPECT_OK(st);
        got_bytes.store(n);
        calls.fetch_add(1);
    });
    auto s = t.post_send(right, 801, out.data(), out.size());
    ASSERT_OK(s);
    auto deadline = std::chrono::steady_clock::now() + kWait;
    for (;;) {
        auto done = t.test(*r);
        ASSERT_OK(done);
        if (*done) break;
        ASSERT_LT(std::chrono::steady_clock::now(), deadline);
        std::this_thread::yield();
    }
    // The callback runs after done() becomes visible, on the completing thread: give it a moment.
    for (int i = 0; i < 1000 && calls.load() == 0; ++i) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(calls.load(), 1);
    EXPECT_EQ(got_bytes.load(), 3000u);
    EXPECT_EQ(compare_message(in.data(), 3000, left, t.rank(), 11), "");
    // A callback registered after completion runs at once.
    int late = 0;
    r->on_complete([&](const Status&, size_t) { ++late; });
    EXPECT_EQ(late, 1);
    EXPECT_OK(t.wait(*s, kWait));
}

// In-process only: rank 1 closes while rank 0 has a receive pending from it; that receive fails
// with kUnavailable naming rank 1, later posts to rank 1 fail, and traffic between the other ranks
// (world >= 3) still flows.
// peer_close_fails_pending: tells rank 1 that this rank is past its barrier. The send may
// complete or fail (rank 1 may close before its completion handler runs); either is fine.
inline void release_closer(Transport& t) {
    auto s = t.post_send(1, 904, nullptr, 0);
    ASSERT_OK(s);
    Status st = t.wait(*s, kWait);
    EXPECT_TRUE(st.ok() || st.code() == StatusCode::kUnavailable) << st.to_string();
}

inline void peer_close_fails_pending(Transport& t) {
    if (!t.capabilities().detects_peer_failure) GTEST_SKIP() << "transport cannot detect it";
    std::vector<uint8_t> in(1 << 16);
    if (t.rank() == 0) {
        auto r = t.post_recv(1, 901, in.data(), in.size());
        ASSERT_OK(r);
        barrier(t);
        release_closer(t);  // rank 1 closes after this
        Status st = t.wait(*r, kWait);
        EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr("rank 1")) << st.to_string();
        // A new post to the dead peer fails at once (maybe after the transport noticed).
        auto deadline = std::chrono::steady_clock::now() + kWait;
        for (;;) {
            auto s = t.post_recv(1, 902, in.data(), in.size());
            if (!s.ok()) {
                EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
                break;
            }
            ASSERT_TRUE(t.cancel(*s).ok() || s->done());
            ASSERT_LT(std::chrono::steady_clock::now(), deadline);
            std::this_thread::sleep_for(5ms);
        }
    } else if (t.rank() == 1) {
        barrier(t);
        // Close only once every other rank has finished its barrier: a send whose completion
        // handler has not run yet when the peer's close arrives fails as "peer closed", which
        // would fail that rank's barrier (seen on a loaded 2-core CI machine).
        std::vector<RequestHandle> go;
        for (int p = 0; p < t.world_size(); ++p) {
            if (p == 1) continue;
            auto g = t.post_recv(p, 904, nullptr, 0);
            ASSERT_OK(g);
            go.push_back(*g);
        }
        Status gs = wait_all(t, go, kWait);
        ASSERT_OK(gs);
        t.close();
        return;
    } else {
        barrier(t);
        release_closer(t);
    }
    if (t.world_size() >= 3 && t.rank() != 1) {
        // Ranks 0 and 2 still talk.
        int other = t.rank() == 0 ? 2 : (t.rank() == 2 ? 0 : -1);
        if (other < 0) return;
        std::vector<uint8_t> out = make_message(t.rank(), other, 5, 1 << 16);
        auto r = t.post_recv(other, 903, in.data(), in.size());
        auto s = t.post_send(other, 903, out.data(), out.size());
        ASSERT_TRUE(r.ok() && s.ok());
        ASSERT_OK(t.wait(*r, kWait));
        EXPECT_EQ(compare_message(in.data(), in.size(), other, t.rank(), 5), "");
        EXPECT_OK(t.wait(*s, kWait));
    }
}

}  // namespace pdsim::transfer::conformance

// Instantiates the suite. `harness` is an expression yielding a Harness& (evaluated per test).
#define PDSIM_TRANSPORT_CONFORMANCE_TESTS(Suite, harness)                                        \
    TEST(Suite, Basics) {                                                                        \
        (harness).run(::pdsim::transfer::conformance::basics);                                   \
    }                                                                                            \
    TEST(Suite, RingSmallAndMedium) {                                                            \
        (harness).run(::pdsim::transfer::conformance::ring_small_and_medium);                    \
    }                                                                                            \
    TEST(Suite, RingLarge) {                                                                     \
        (harness).run(::pdsim::transfer::conformance::ring_large);                               \
    }                                                                                            \
    TEST(Suite, SendBeforeRecv) {                                                                \
        (harness).run(::pdsim::transfer::conformance::send_before_recv);                         \
    }                                                                                            \
    TEST(Suite, FifoPerTag) {                                                                    \
        (harness).run(::pdsim::transfer::conformance::fifo_per_tag);                             \
    }                                                                                            \
    TEST(Suite, TagsAreIndependent) {                                                            \
        (harness).run(::pdsim::transfer::conformance::tags_are_independent);                     \
    }                                                                                            \
    TEST(Suite, ConcurrentThreads) {                                                             \
        (harness).run(::pdsim::transfer::conformance::concurrent_threads);                       \
    }                                                                                            \
    TEST(Suite, TruncationAndShortMessages) {                                                    \
        (harness).run(::pdsim::transfer::conformance::truncation_and_short_messages);            \
    }                                                                                            \
    TEST(Suite, TimeoutThenCancel) {                                                             \
        (harness).run(::pdsim::transfer::conformance::timeout_then_cancel);                      \
    }                                                                                            \
    TEST(Suite, InvalidArguments) {                                                              \
        (harness).run(::pdsim::transfer::conformance::invalid_arguments);                        \
    }                                                                                            \
    TEST(Suite, CallbacksAndPolling) {                                                           \
        (harness).run(::pdsim::transfer::conformance::callbacks_and_polling);                    \
    }                                                                                            \
    TEST(Suite, PeerCloseFailsPending) {                                                         \
        if (!(harness).in_process()) GTEST_SKIP() << "needs ranks that can close independently"; \
        (harness).run(::pdsim::transfer::conformance::peer_close_fails_pending);                 \
    }
