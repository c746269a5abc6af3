// Private to the tcp transport (transfer/tcp/*.cpp): the TcpTransport class and the per-peer
// state its two translation units share. tcp_setup.cpp: listening, publishing the address,
// connecting and accepting the mesh with its hello handshake, and the factory;
// tcp_transport.cpp: posting (any thread), the data path (io thread), failure and close.
// The contract is tcp_transport.h's; locking is annotated (common/mutex.h) and checked by clang's
// -Wthread-safety (tests/CMakeLists.txt, thread_safety_check).
#pragma once

// <utility> before asio, in a block of its own: asio's headers use std::exchange without it.
#include <utility>
// Everything else.
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <deque>
#include <future>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "transfer/rendezvous.h"
#include "transfer/tcp/frame.h"
#include "transfer/tcp/tcp_transport.h"

namespace pdsim::transfer::tcp_detail {

namespace asio = boost::asio;

// The session token of a rendezvous through `dir`: the one in <dir>/session.token, or, when no
// rank has published one yet, a fresh 128-bit random token published there (mode 0600, atomically:
// link() of a complete file). Fails if the file is not a regular file private to its owner.
[[nodiscard]] StatusOr<std::string> bootstrap_session_token(const std::string& dir, int rank);
using asio::ip::tcp;
using boost::system::error_code;
using tcp_frame = frame::FrameType;
using frame::FrameHeader;
using frame::HeaderBytes;
using frame::kFrameHeaderBytes;

struct SendOp {
    HeaderBytes header{};
    const void* buf = nullptr;
    size_t bytes = 0;
    std::shared_ptr<OpState> op;
};

struct RecvOp {
    void* buf = nullptr;
    size_t capacity = 0;
    std::shared_ptr<OpState> op;
};

// A message that arrived before its receive was posted.
struct Unexpected {
    std::unique_ptr<uint8_t[]> data;
    size_t bytes = 0;
    bool complete = false;  // under Peer::recv_mu
    RecvOp waiter;          // under Peer::recv_mu: matched while the body was still arriving
};

// Where the body of the frame being read goes.
enum class BodySink : uint8_t {
    kNone,        // between frames
    kDirect,      // a posted receive's buffer
    kUnexpected,  // a new unexpected-message buffer
    kDiscard,     // a message larger than its receive buffer
    kErrorText,   // the reason of a kError frame
};

struct Peer {
    Peer(asio::io_context& io, int r) : rank(r), sock(io) {}

    const int rank;
    std::string address;  // remote "host:port", for messages (set at registration)
    tcp::socket sock;     // io thread only

    // Send side. Posting threads append; the io thread writes the first `in_flight` entries.
    // unique_ptr keeps each SendOp's header at a stable address while it is being written.
    Mutex send_mu;
    std::deque<std::unique_ptr<SendOp>> send_q PDSIM_GUARDED_BY(send_mu);
    size_t in_flight PDSIM_GUARDED_BY(send_mu) = 0;
    bool writing PDSIM_GUARDED_BY(send_mu) = false;  // a write is in progress or a kick queued
    bool send_dead PDSIM_GUARDED_BY(send_mu) = false;
    Status send_status PDSIM_GUARDED_BY(send_mu);

    // Receive side: matching between posted receives and arrived messages.
    Mutex recv_mu;
    std::unordered_map<Tag, std::deque<RecvOp>> posted PDSIM_GUARDED_BY(recv_mu);
    std::unordered_map<Tag, std::deque<std::shared_ptr<Unexpected>>> unexpected
        PDSIM_GUARDED_BY(recv_mu);
    bool recv_dead PDSIM_GUARDED_BY(recv_mu) = false;
    Status recv_status PDSIM_GUARDED_BY(recv_mu);

    // io thread only.
    bool connected = false;
    bool failed = false;
    // Incoming bytes are read into `stage` (several small frames per system call); a body's
    // first staged bytes are copied out, the rest of a large body is read straight into its
    // destination.
    std::vector<uint8_t> stage;
    size_t stage_pos = 0;
    size_t stage_end = 0;
    FrameHeader cur;  // the frame whose body is being read (body != kNone)
    BodySink body = BodySink::kNone;
    uint8_t* body_dst = nullptr;  // kDirect / kUnexpected
    uint64_t body_got = 0;
    std::string error_text;  // kErrorText
    RecvOp cur_recv;
    std::shared_ptr<Unexpected> cur_unexpected;
    std::vector<asio::const_buffer> gather;
};

struct Handshake {
    explicit Handshake(asio::io_context& io) : sock(io), timer(io) {}
    tcp::socket sock;
    asio::steady_timer timer;
    HeaderBytes hdr{};
    std::vector<uint8_t> payload;
    std::vector<uint8_t> out;
    std::string remote;
    int peer = -1;
};

class TcpTransport final : public Transport {
public:
    TcpTransport(const TransportOptions& o, std::vector<std::string> endpoints,
                 std::string bootstrap_dir, std::string token)
        : rank_(o.rank),
          world_(o.world_size),
          opts_(o.get<TcpOptions>()),
          endpoints_(std::move(endpoints)),
          bootstrap_dir_(std::move(bootstrap_dir)),
          rendezvous_(bootstrap_dir_, "addr"),
          token_(std::move(token)),
          work_(asio::make_work_guard(io_)),
          acceptor_(io_),
          deadline_(io_) {
        for (int r = 0; r < world_; ++r) peers_.push_back(std::make_unique<Peer>(io_, r));
    }

    ~TcpTransport() override { close(); }

    std::string_view name() const override { return "tcp"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_; }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = true;
        c.host_memory = true;
        c.detects_peer_failure = true;
        c.max_tag = std::numeric_limits<Tag>::max();
        c.max_message_bytes = opts_.max_frame_bytes;
        return c;
    }

    Status start(std::chrono::milliseconds connect_timeout);

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override;
    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override;
    Status cancel(const RequestHandle& handle) override;
    void close() override;

private:
    // ---- setup: start's thread, before the io thread runs ----
    [[nodiscard]] Status listen_and_publish();
    // ---- setup (io thread) ----
    void accept_next();
    void handshake_accepted(std::shared_ptr<Handshake> hs);
    void on_hello(std::shared_ptr<Handshake> hs, const error_code& ec);
    void reject(std::shared_ptr<Handshake> hs, const std::string& reason);
    void connect_to(int peer);
    void retry_connect(int peer);
    void handshake_connected(std::shared_ptr<Handshake> hs);
    void register_peer(int peer, tcp::socket sock);
    void finish_setup(Status st);
    StatusOr<HostPort> endpoint_of(int peer) const;
    void apply_socket_options(tcp::socket& s);

    // ---- data path (io thread) ----
    void start_write(Peer* p);
    void on_written(Peer* p, const error_code& ec);
    void pump(Peer* p);
    void fill(Peer* p);
    bool on_frame_header(Peer* p);
    bool start_data(Peer* p);
    void finish_body(Peer* p);
    std::string read_position(const Peer* p) const;
    void fail_peer(Peer* p, Status st);
    void protocol_error(Peer* p, const Status& st);
    bool try_send_control(Peer* p, tcp_frame type, std::span<const uint8_t> payload);
    Status lost(const Peer* p, const error_code& ec, const std::string& where) const;
    void shutdown_io();

    static void deliver(const std::shared_ptr<Unexpected>& u, const RecvOp& r, int peer, Tag tag);

    const int rank_;
    const int world_;
    const TcpOptions opts_;
    const std::vector<std::string> endpoints_;
    const std::string bootstrap_dir_;
    const FileRendezvous rendezvous_;  // over bootstrap_dir_ (when it is set)
    const std::string token_;

    // Declared first among the asio objects so that it is destroyed last: sockets and timers
    // deregister from it in their destructors.
    asio::io_context io_;
    asio::executor_work_guard<asio::io_context::executor_type> work_;
    tcp::acceptor acceptor_;
    asio::steady_timer deadline_;
    std::vector<std::unique_ptr<Peer>> peers_;
    std::thread io_thread_;
    std::atomic<bool> closed_{false};

    // Setup state, io thread only (the promise hands the result to start()).
    std::promise<Status> setup_promise_;
    bool setup_finished_ = false;
    int missing_ = 0;
    std::vector<std::string> rejections_;
    std::chrono::milliseconds connect_timeout_{0};
};

}  // namespace pdsim::transfer::tcp_detail
