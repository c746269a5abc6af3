// The "tcp" transport, in-process: N endpoints on threads over real loopback sockets. The
// conformance suite, plus the wire-level failure cases: wrong session token, oversized frame,
// truncated frame, a peer that disconnects mid-transfer (raw sockets play a misbehaving rank).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>

#include "tests/status_matchers.h"
#include "tests/transport_conformance.h"
#include "transfer/tcp/frame.h"
#include "transfer/tcp/tcp_transport.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using conformance::compare_message;
using conformance::kWait;
using conformance::make_message;

// A fresh bootstrap directory per use.
class TempDir {
public:
    TempDir() {
        std::string tmpl = (std::filesystem::temp_directory_path() / "pdsim-tcp-XXXXXX").string();
        char* p = mkdtemp(tmpl.data());
        EXPECT_NE(p, nullptr);
        path_ = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    [[nodiscard]] const std::string& path() const { return path_; }

private:
    std::string path_;
};

TransportOptions tcp_options(int rank, int n, const std::string& dir) {
    TransportOptions o;
    o.rank = rank;
    o.world_size = n;
    o.edit<TcpOptions>().bootstrap_dir = dir;
    o.connect_timeout = 20s;
    return o;
}

class TcpHarness : public conformance::Harness {
public:
    explicit TcpHarness(int n) : n_(n) {}
    void run(const conformance::Body& body) override {
        TempDir dir;
        conformance::InProcessHarness inner(n_, [&](int rank) {
            return create_transport("tcp", tcp_options(rank, n_, dir.path()));
        });
        inner.run(body);
    }
    [[nodiscard]] bool in_process() const override { return true; }

private:
    int n_;
};

TcpHarness g_tcp3(3);
TcpHarness g_tcp2(2);

// Creates n endpoints concurrently (setup blocks until the mesh is up).
std::vector<StatusOr<std::unique_ptr<Transport>>> make_world(
    const std::vector<TransportOptions>& opts) {
    std::vector<std::optional<StatusOr<std::unique_ptr<Transport>>>> slots(opts.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < opts.size(); ++r) {
        threads.emplace_back([&, r] { slots[r].emplace(create_transport("tcp", opts[r])); });
    }
    for (auto& t : threads) t.join();
    std::vector<StatusOr<std::unique_ptr<Transport>>> out;
    for (auto& s : slots) out.push_back(std::move(*s));
    return out;
}

// A misbehaving rank on a raw blocking socket: it speaks just enough of the protocol to join.
class RawPeer {
public:
    ~RawPeer() { close_socket(); }

    // Connects to the rank whose address is published in `dir` and says hello as `rank` with
    // `token` ("": the session token the ranks publish in `dir`).
    ::testing::AssertionResult join(const std::string& dir, int to_rank, int rank, int world,
                                    const std::string& token, bool expect_ack = true) {
        std::string line;
        auto deadline = std::chrono::steady_clock::now() + 10s;
        while (std::chrono::steady_clock::now() < deadline) {
            std::ifstream in(dir + "/rank-" + std::to_string(to_rank) + ".addr");
            if (in && std::getline(in, line) && !line.empty()) break;
            std::this_thread::sleep_for(5ms);
        }
        auto hp = parse_host_port(line);
        if (!hp.ok()) return ::testing::AssertionFailure() << hp.status().to_string();
        std::string session_token = token;
        if (session_token.empty()) {
            // The one the ranks share through the directory (written before any address).
            std::ifstream tf(dir + "/session.token");
            std::getline(tf, session_token);
        }
        fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(hp->port);
        ::inet_pton(AF_INET, hp->host.c_str(), &addr.sin_addr);
        if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
            return ::testing::AssertionFailure() << "connect: " << std::strerror(errno);
        }
        if (!expect_ack) return ::testing::AssertionSuccess();
        auto hello = frame::make_frame(
            frame::FrameType::kHello, static_cast<Tag>(rank),
            frame::encode_hello(frame::Hello{.world_size = world, .token = session_token}));
        if (!send_all(hello.data(), hello.size())) return ::testing::AssertionFailure() << "send";
        frame::HeaderBytes hb{};
        if (!recv_all(hb.data(), hb.size())) return ::testing::AssertionFailure() << "recv ack";
        auto h = frame::decode_header(hb, 1 << 20);
        if (!h.ok()) return ::testing::AssertionFailure() << h.status().to_string();
        std::vector<uint8_t> payload(h->length);
        if (!recv_all(payload.data(), payload.size())) {
            return ::testing::AssertionFailure() << "recv ack payload";
        }
        if (h->type != frame::FrameType::kHelloAck) {
            return ::testing::AssertionFailure()
                   << "answer type " << static_cast<int>(h->type) << ": "
                   << std::string(payload.begin(), payload.end());
        }
        return ::testing::AssertionSuccess();
    }

    bool send_all(const void* p, size_t n) {
        const auto* b = static_cast<const uint8_t*>(p);
        while (n > 0) {
            ssize_t k = ::send(fd_, b, n, MSG_NOSIGNAL);
            if (k <= 0) return false;
            b += k;
            n -= static_cast<size_t>(k);
        }
        return true;
    }
    bool recv_all(void* p, size_t n) {
        auto* b = static_cast<uint8_t*>(p);
        while (n > 0) {
            ssize_t k = ::recv(fd_, b, n, 0);
            if (k <= 0) return false;
            b += k;
            n -= static_cast<size_t>(k);
        }
        return true;
    }
    void close_socket() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

private:
    int fd_ = -1;
};

}  // namespace

PDSIM_TRANSPORT_CONFORMANCE_TESTS(TcpConformance3, g_tcp3)
PDSIM_TRANSPORT_CONFORMANCE_TESTS(TcpConformance2, g_tcp2)

TEST(TcpFrame, HeaderRoundTripAndValidation) {
    auto hb = frame::encode_header(
        frame::FrameHeader{.type = frame::FrameType::kData, .tag = 77, .length = 12345});
    auto h = frame::decode_header(hb, 1 << 20);
    ASSERT_OK(h);
    EXPECT_EQ(h->type, frame::FrameType::kData);
    EXPECT_EQ(h->tag, 77u);
    EXPECT_EQ(h->length, 12345u);
    auto over = frame::decode_header(hb, 1000);
    EXPECT_THAT(over, StatusIs(StatusCode::kDataLoss, HasSubstr("exceeds max_frame_bytes")));
    auto bad = hb;
    bad[0] ^= 0xff;
    EXPECT_THAT(frame::decode_header(bad, 1 << 20).status().message(), HasSubstr("magic"));
    bad = hb;
    bad[6] = 99;
    EXPECT_THAT(frame::decode_header(bad, 1 << 20).status().message(), HasSubstr("type"));
    auto hello =
        frame::decode_hello(frame::encode_hello(frame::Hello{.world_size = 4, .token = "secret"}));
    ASSERT_OK(hello);
    EXPECT_EQ(hello->world_size, 4);
    EXPECT_EQ(hello->token, "secret");
    EXPECT_FALSE(frame::decode_hello(std::vector<uint8_t>{1, 2, 3}).ok());
}

TEST(TcpTransport, ParseHostPort) {
    auto a = parse_host_port("10.0.0.1:5000");
    ASSERT_OK(a);
    EXPECT_EQ(a->host, "10.0.0.1");
    EXPECT_EQ(a->port, 5000);
    auto b = parse_host_port("[::1]:80");
    ASSERT_OK(b);
    EXPECT_EQ(b->host, "::1");
    EXPECT_FALSE(parse_host_port("nohost").ok());
    EXPECT_FALSE(parse_host_port("h:99999").ok());
    EXPECT_FALSE(parse_host_port("h:12x").ok());
}

TEST(TcpTransport, NeedsARendezvous) {
    TransportOptions o;
    o.world_size = 2;
    ::unsetenv("PDSIM_TCP_ENDPOINTS");
    ::unsetenv("PDSIM_TCP_BOOTSTRAP_DIR");
    auto t = create_transport("tcp", o);
    EXPECT_THAT(t, StatusIs(StatusCode::kInvalidArgument, HasSubstr("rendezvous")));
    o.edit<TcpOptions>().endpoints = {"127.0.0.1:1"};
    EXPECT_EQ(create_transport("tcp", o).status().code(), StatusCode::kInvalidArgument);
}

TEST(TcpTransport, ExplicitEndpoints) {
    // Ask the kernel for two free ports (tiny race with other processes; fine for a test).
    std::vector<std::string> eps;
    for (int i = 0; i < 2; ++i) {
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
        socklen_t len = sizeof(a);
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
        eps.push_back("127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
        ::close(fd);
    }
    std::vector<TransportOptions> opts(2);
    for (int r = 0; r < 2; ++r) {
        opts[r].rank = r;
        opts[r].world_size = 2;
        opts[r].edit<TcpOptions>().endpoints = eps;
        opts[r].edit<TcpOptions>().session_token = "explicit-endpoints-test-secret";
        opts[r].connect_timeout = 10s;
    }
    auto ts = make_world(opts);
    ASSERT_OK(ts[0]);
    ASSERT_OK(ts[1]);
    auto msg = make_message(1, 0, 3, 1000);
    std::vector<uint8_t> in(1000);
    auto r = (*ts[0])->post_recv(1, 3, in.data(), in.size());
    auto s = (*ts[1])->post_send(0, 3, msg.data(), msg.size());
    ASSERT_TRUE(r.ok() && s.ok());
    ASSERT_OK((*ts[0])->wait(*r, kWait));
    EXPECT_EQ(in, msg);
    // The send buffer must outlive the send handle (and TSan cannot see the kernel ordering the
    // sender's read before the receiver's completion).
    EXPECT_OK((*ts[1])->wait(*s, kWait));
}

TEST(TcpTransport, ConnectTimeoutNamesTheMissingRank) {
    TempDir dir;
    auto o = tcp_options(0, 2, dir.path());
    o.connect_timeout = 300ms;
    auto t0 = std::chrono::steady_clock::now();
    auto t = create_transport("tcp", o);
    EXPECT_THAT(t, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("rank(s) 1")))
        << t.status().to_string();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(TcpTransport, WrongSessionTokenIsRejectedOnBothSides) {
    TempDir dir;
    std::vector<TransportOptions> opts = {tcp_options(0, 2, dir.path()),
                                          tcp_options(1, 2, dir.path())};
    opts[0].edit<TcpOptions>().session_token = "alpha";
    opts[1].edit<TcpOptions>().session_token = "beta";
    opts[0].connect_timeout = 1500ms;
    opts[1].connect_timeout = 1500ms;
    auto ts = make_world(opts);
    // The connecting side is told at once, with the reason.
    ASSERT_FALSE(ts[1].ok());
    EXPECT_THAT(ts[1], StatusIs(StatusCode::kFailedPrecondition, HasSubstr("rejected")));
    EXPECT_THAT(ts[1].status().message(), HasSubstr("session token mismatch"))
        << ts[1].status().to_string();
    // The accepting side keeps waiting for the right peer, then names it and the rejection.
    ASSERT_FALSE(ts[0].ok());
    EXPECT_THAT(ts[0], StatusIs(StatusCode::kFailedPrecondition, HasSubstr("rank(s) 1")));
    EXPECT_THAT(ts[0].status().message(), HasSubstr("session token mismatch"))
        << ts[0].status().to_string();
}

TEST(TcpTransport, BadHelloIsRejectedAndTheRealPeerStillJoins) {
    TempDir dir;
    std::optional<StatusOr<std::unique_ptr<Transport>>> t0;
    std::thread th([&] { t0.emplace(create_transport("tcp", tcp_options(0, 2, dir.path()))); });
    {
        // A stray client: 10 bytes of a header, then gone.
        RawPeer stray;
        ASSERT_TRUE(stray.join(dir.path(), 0, 1, 2, "", /*expect_ack=*/false));
        auto hello = frame::make_frame(frame::FrameType::kHello, 1, {});
        ASSERT_TRUE(stray.send_all(hello.data(), 10));
    }
    {
        RawPeer wrong_world;
        EXPECT_FALSE(wrong_world.join(dir.path(), 0, 1, 5, ""));
    }
    RawPeer good;
    ASSERT_TRUE(good.join(dir.path(), 0, 1, 2, ""));
    th.join();
    ASSERT_TRUE(t0->ok()) << t0->status().to_string();
}

// No built-in token: ranks that meet through a directory share the random token the first of
// them wrote there (private to its owner); endpoints without a token are refused.
TEST(TcpTransport, SessionTokenIsRandomPrivateAndNeverBuiltIn) {
    ::unsetenv("PDSIM_SESSION_TOKEN");
    std::string tokens[2];
    for (std::string& token : tokens) {
        TempDir dir;
        auto ts = make_world({tcp_options(0, 2, dir.path()), tcp_options(1, 2, dir.path())});
        ASSERT_OK(ts[0]);
        ASSERT_OK(ts[1]);
        const std::string path = dir.path() + "/session.token";
        struct stat st {};
        ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
        EXPECT_EQ(st.st_mode & 0777, 0600u);
        std::ifstream(path) >> token;
        EXPECT_EQ(token.size(), 32u) << token;
        EXPECT_NE(token, "pdsim");
    }
    EXPECT_NE(tokens[0], tokens[1]) << "two sessions, one token";

    TransportOptions o;
    o.world_size = 2;
    o.edit<TcpOptions>().endpoints = {"127.0.0.1:1", "127.0.0.1:2"};
    EXPECT_THAT(create_transport("tcp", o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("without a session token")));

    // A token file others can read is refused, not used.
    TempDir dir;
    const std::string path = dir.path() + "/session.token";
    std::ofstream(path) << "0123456789abcdef0123456789abcdef";
    ::chmod(path.c_str(), 0644);
    auto o2 = tcp_options(0, 2, dir.path());
    o2.connect_timeout = 200ms;
    EXPECT_THAT(create_transport("tcp", o2),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("only its owner can read")));
}

// Hostile clients during the setup -- garbage, a hello announcing 2^63 bytes, a half frame left
// open, a data frame instead of a hello, a wrong token -- are each dropped (none allocates what
// it announces, none holds the setup up); the real rank still joins and messages flow; after the
// setup the listener is closed.
TEST(TcpTransport, HostileClientsDuringSetupLeaveTheRunGoing) {
    TempDir dir;
    auto o0 = tcp_options(0, 2, dir.path());
    o0.edit<TcpOptions>().handshake_timeout = 500ms;
    std::optional<StatusOr<std::unique_ptr<Transport>>> t0;
    std::thread th([&] { t0.emplace(create_transport("tcp", o0)); });
    auto answer_of = [](RawPeer& p) {
        frame::HeaderBytes hb{};
        if (!p.recv_all(hb.data(), hb.size())) return std::string("closed");
        auto h = frame::decode_header(hb, 1 << 20);
        if (!h.ok()) return h.status().to_string();
        std::string text(h->length, '\0');
        p.recv_all(text.data(), text.size());
        return (h->type == frame::FrameType::kReject ? "reject: " : "other: ") + text;
    };
    {
        RawPeer garbage;
        ASSERT_TRUE(garbage.join(dir.path(), 0, 1, 2, "", /*expect_ack=*/false));
        std::vector<uint8_t> junk(64);
        std::mt19937 rng(7);
        for (auto& b : junk) b = static_cast<uint8_t>(rng());
        ASSERT_TRUE(garbage.send_all(junk.data(), junk.size()));
        EXPECT_THAT(answer_of(garbage), HasSubstr("reject: bad hello"));
    }
    {
        RawPeer huge;
        ASSERT_TRUE(huge.join(dir.path(), 0, 1, 2, "", /*expect_ack=*/false));
        auto hb = frame::encode_header(
            {.type = frame::FrameType::kHello, .tag = 1, .length = uint64_t{1} << 63});
        ASSERT_TRUE(huge.send_all(hb.data(), hb.size()));
        EXPECT_THAT(answer_of(huge), HasSubstr("reject: bad hello"));
    }
    {
        RawPeer data_first;
        ASSERT_TRUE(data_first.join(dir.path(), 0, 1, 2, "", /*expect_ack=*/false));
        auto f = frame::make_frame(frame::FrameType::kData, 1, std::vector<uint8_t>(8, 1));
        ASSERT_TRUE(data_first.send_all(f.data(), f.size()));
        EXPECT_THAT(answer_of(data_first), HasSubstr("reject: expected a hello frame"));
    }
    RawPeer half;  // stays open: its handshake timer drops it
    ASSERT_TRUE(half.join(dir.path(), 0, 1, 2, "", /*expect_ack=*/false));
    auto hello = frame::make_frame(frame::FrameType::kHello, 1,
                                   frame::encode_hello({.world_size = 2, .token = "x"}));
    ASSERT_TRUE(half.send_all(hello.data(), hello.size() / 2));
    {
        RawPeer wrong;
        EXPECT_FALSE(wrong.join(dir.path(), 0, 1, 2, "not-the-session-token"));
    }
    const auto t_half = std::chrono::steady_clock::now();
    // The half frame is dropped once its handshake time is up (not when the setup ends).
    EXPECT_EQ(answer_of(half), "closed");
    EXPECT_LT(std::chrono::steady_clock::now() - t_half, 5s);

    RawPeer good;
    ASSERT_TRUE(good.join(dir.path(), 0, 1, 2, ""));
    th.join();
    ASSERT_TRUE(t0->ok()) << t0->status().to_string();
    Transport& t = ***t0;
    std::vector<uint8_t> in(16);
    auto r = t.post_recv(1, 3, in.data(), in.size());
    ASSERT_OK(r);
    auto f = frame::make_frame(frame::FrameType::kData, 3, std::vector<uint8_t>(16, 0xAB));
    ASSERT_TRUE(good.send_all(f.data(), f.size()));
    ASSERT_OK(t.wait(*r, kWait));
    EXPECT_EQ(in, std::vector<uint8_t>(16, 0xAB));
    // The mesh is complete: no one else can connect.
    RawPeer late;
    EXPECT_FALSE(late.join(dir.path(), 0, 1, 2, ""));
}

// A raw rank sends a frame header announcing 4096 bytes, 1000 of them, then closes: the posted
// receive fails with kUnavailable naming the peer and the truncation; a truncated header too.
TEST(TcpTransport, TruncatedFrameFailsThePendingReceive) {
    for (bool header_only : {false, true}) {
        TempDir dir;
        std::optional<StatusOr<std::unique_ptr<Transport>>> t0;
        std::thread th([&] { t0.emplace(create_transport("tcp", tcp_options(0, 2, dir.path()))); });
        RawPeer raw;
        ASSERT_TRUE(raw.join(dir.path(), 0, 1, 2, ""));
        th.join();
        ASSERT_TRUE(t0->ok()) << t0->status().to_string();
        Transport& t = ***t0;
        std::vector<uint8_t> in(4096);
        auto r = t.post_recv(1, 5, in.data(), in.size());
        ASSERT_OK(r);
        auto hb = frame::encode_header(
            frame::FrameHeader{.type = frame::FrameType::kData, .tag = 5, .length = 4096});
        if (header_only) {
            ASSERT_TRUE(raw.send_all(hb.data(), 10));
        } else {
            std::vector<uint8_t> part(1000, 0x5A);
            ASSERT_TRUE(raw.send_all(hb.data(), hb.size()));
            ASSERT_TRUE(raw.send_all(part.data(), part.size()));
        }
        raw.close_socket();
        Status st = t.wait(*r, kWait);
        EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
        EXPECT_THAT(st.message(), HasSubstr("rank 1")) << st.to_string();
        if (header_only) {
            EXPECT_THAT(st.message(), HasSubstr("truncated frame")) << st.to_string();
        } else {
            EXPECT_THAT(st.message(), HasSubstr("1000 of 4096")) << st.to_string();
        }
        // Later posts to the dead peer fail at once.
        EXPECT_EQ(t.post_send(1, 1, in.data(), 1).status().code(), StatusCode::kUnavailable);
    }
}

// A frame over the receiver's max_frame_bytes is a protocol error: the receiver fails that
// connection with kDataLoss and tells the sender, whose pending handles fail; other connections
// keep working.
TEST(TcpTransport, OversizedFrameFailsTheConnection) {
    TempDir dir;
    std::vector<TransportOptions> opts = {tcp_options(0, 3, dir.path()),
                                          tcp_options(1, 3, dir.path()),
                                          tcp_options(2, 3, dir.path())};
    opts[1].edit<TcpOptions>().max_frame_bytes = size_t{1} << 20;
    auto ts = make_world(opts);
    for (auto& t : ts) ASSERT_OK(t);
    Transport& t0 = **ts[0];
    Transport& t1 = **ts[1];
    Transport& t2 = **ts[2];
    // The sender's own cap refuses at post time.
    EXPECT_EQ(t1.post_send(0, 1, t1.name().data(), (size_t{1} << 20) + 1).status().code(),
              StatusCode::kInvalidArgument);

    std::vector<uint8_t> big = make_message(0, 1, 1, size_t{2} << 20);
    std::vector<uint8_t> in(size_t{4} << 20);
    std::vector<uint8_t> back(16);
    auto r1 = t1.post_recv(0, 1, in.data(), in.size());
    auto r0 = t0.post_recv(1, 2, back.data(), back.size());  // will never be satisfied
    ASSERT_TRUE(r1.ok() && r0.ok());
    auto s0 = t0.post_send(1, 1, big.data(), big.size());
    ASSERT_OK(s0);
    Status st = t1.wait(*r1, kWait);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("exceeds max_frame_bytes")) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("rank 0")) << st.to_string();
    st = t0.wait(*r0, kWait);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("rank 1")) << st.to_string();
    // The send either made it into the socket before the drop or failed with the connection.
    st = t0.wait(*s0, kWait);
    EXPECT_TRUE(st.ok() || st.code() == StatusCode::kUnavailable) << st.to_string();

    // Ranks 0-2 and 1-2 are unaffected.
    for (auto [a, b] : {std::pair{&t0, &t2}, std::pair{&t1, &t2}}) {
        auto m = make_message(a->rank(), 2, 9, 100000);
        std::vector<uint8_t> got(100000);
        auto rr = b->post_recv(a->rank(), 9, got.data(), got.size());
        auto ss = a->post_send(2, 9, m.data(), m.size());
        ASSERT_TRUE(rr.ok() && ss.ok());
        ASSERT_OK(b->wait(*rr, kWait));
        EXPECT_EQ(got, m);
        EXPECT_OK(a->wait(*ss, kWait));
    }
}

// A raw rank reads part of a 64 MiB message and disconnects: the sender's handle fails with
// kUnavailable naming it within the timeout, its pending receive from that rank fails too, and
// traffic with the other rank completes.
TEST(TcpTransport, PeerDisconnectMidTransfer) {
    TempDir dir;
    std::optional<StatusOr<std::unique_ptr<Transport>>> t0;
    std::optional<StatusOr<std::unique_ptr<Transport>>> t1;
    std::thread th0([&] { t0.emplace(create_transport("tcp", tcp_options(0, 3, dir.path()))); });
    std::thread th1([&] { t1.emplace(create_transport("tcp", tcp_options(1, 3, dir.path()))); });
    RawPeer raw0;
    RawPeer raw1;
    ASSERT_TRUE(raw0.join(dir.path(), 0, 2, 3, ""));
    ASSERT_TRUE(raw1.join(dir.path(), 1, 2, 3, ""));
    th0.join();
    th1.join();
    ASSERT_TRUE(t0->ok()) << t0->status().to_string();
    ASSERT_TRUE(t1->ok()) << t1->status().to_string();
    Transport& a = ***t0;
    Transport& b = ***t1;

    std::vector<uint8_t> big = make_message(0, 2, 1, size_t{64} << 20);
    std::vector<uint8_t> from2(64);
    auto send = a.post_send(2, 1, big.data(), big.size());
    auto recv = a.post_recv(2, 7, from2.data(), from2.size());
    ASSERT_TRUE(send.ok() && recv.ok());
    std::vector<uint8_t> part(size_t{1} << 20);
    ASSERT_TRUE(raw0.recv_all(part.data(), 24));
    ASSERT_TRUE(raw0.recv_all(part.data(), part.size()));
    EXPECT_EQ(compare_message(part.data(), part.size(), 0, 2, 1), "");
    raw0.close_socket();  // with unread data: the kernel resets the connection

    // Meanwhile ranks 0 and 1 exchange a large message both ways.
    auto m01 = make_message(0, 1, 2, size_t{8} << 20);
    auto m10 = make_message(1, 0, 3, size_t{8} << 20);
    std::vector<uint8_t> in0(m10.size());
    std::vector<uint8_t> in1(m01.size());
    auto r0 = a.post_recv(1, 4, in0.data(), in0.size());
    auto r1 = b.post_recv(0, 4, in1.data(), in1.size());
    auto s0 = a.post_send(1, 4, m01.data(), m01.size());
    auto s1 = b.post_send(0, 4, m10.data(), m10.size());
    ASSERT_TRUE(r0.ok() && r1.ok() && s0.ok() && s1.ok());

    auto t_start = std::chrono::steady_clock::now();
    Status st = a.wait(*send, 10s);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("rank 2")) << st.to_string();
    st = a.wait(*recv, 10s);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_LT(std::chrono::steady_clock::now() - t_start, 10s);

    ASSERT_OK(a.wait(*r0, kWait));
    ASSERT_OK(b.wait(*r1, kWait));
    EXPECT_EQ(in0, m10);
    EXPECT_EQ(in1, m01);
    EXPECT_OK(a.wait(*s0, kWait));
    EXPECT_OK(b.wait(*s1, kWait));
}

// Many messages of random sizes (0 .. 256 KiB) both ways between two ranks, receives and sends
// interleaved at random; byte-exact.
TEST(TcpTransport, ManyRandomMessagesByteExact) {
    TempDir dir;
    auto ts = make_world({tcp_options(0, 2, dir.path()), tcp_options(1, 2, dir.path())});
    ASSERT_TRUE(ts[0].ok() && ts[1].ok());
    constexpr int kCount = 1500 / static_cast<int>(conformance::kVolumeDivisor);
    std::vector<std::thread> threads;
    for (int me = 0; me < 2; ++me) {
        threads.emplace_back([&, me] {
            Transport& t = **ts[static_cast<size_t>(me)];
            int other = 1 - me;
            std::mt19937 rng(42);  // same sizes on both sides
            std::vector<size_t> sizes(kCount);
            for (auto& s : sizes) s = rng() % 4 == 0 ? 0 : rng() % (256 * 1024);
            std::mt19937 order(static_cast<unsigned>(7 + me));
            std::vector<std::vector<uint8_t>> outs(kCount);
            std::vector<std::vector<uint8_t>> ins(kCount);
            std::vector<RequestHandle> rs;
            std::vector<RequestHandle> ss;
            int next_send = 0;
            int next_recv = 0;
            while (next_send < kCount || next_recv < kCount) {
                bool do_send = next_recv == kCount || (next_send < kCount && order() % 2 == 0);
                if (do_send) {
                    int k = next_send++;
                    outs[k] = make_message(me, other, k, sizes[k]);
                    auto s = t.post_send(other, static_cast<Tag>(k % 7), outs[k].data(), sizes[k]);
                    ASSERT_OK(s);
                    ss.push_back(*s);
                } else {
                    int k = next_recv++;
                    ins[k].resize(sizes[k]);
                    auto r = t.post_recv(other, static_cast<Tag>(k % 7), ins[k].data(), sizes[k]);
                    ASSERT_OK(r);
                    rs.push_back(*r);
                }
            }
            ASSERT_OK(wait_all(t, rs, kWait));
            ASSERT_OK(wait_all(t, ss, kWait));
            for (int k = 0; k < kCount; ++k) {
                ASSERT_EQ(compare_message(ins[k].data(), sizes[k], other, me, k), "") << k;
            }
        });
    }
    for (auto& th : threads) th.join();
}

}  // namespace pdsim::transfer
