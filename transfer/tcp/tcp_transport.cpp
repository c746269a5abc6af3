#include "transfer/tcp/tcp_transport.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/logging.h"
#include "common/mutex.h"
#include "common/thread_info.h"
#include "transfer/rendezvous.h"
#include "transfer/tcp/frame.h"

namespace pdsim::transfer {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using tcp_frame = frame::FrameType;
using frame::FrameHeader;
using frame::HeaderBytes;
using frame::kFrameHeaderBytes;

StatusOr<HostPort> parse_host_port(std::string_view text) {
    std::string_view host;
    std::string_view port;
    if (!text.empty() && text.front() == '[') {
        size_t close = text.find(']');
        if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "tcp: endpoint '{}': expected [v6addr]:port", text);
        }
        host = text.substr(1, close - 1);
        port = text.substr(close + 2);
    } else {
        size_t colon = text.rfind(':');
        if (colon == std::string_view::npos) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "tcp: endpoint '{}': expected host:port", text);
        }
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
    }
    if (host.empty() || port.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: endpoint '{}': expected host:port",
                           text);
    }
    unsigned long value = 0;
    for (char c : port) {
        if (c < '0' || c > '9') {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: endpoint '{}': bad port '{}'",
                               text, port);
        }
        value = value * 10 + static_cast<unsigned long>(c - '0');
        if (value > 65535) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: endpoint '{}': port above 65535",
                               text);
        }
    }
    return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

namespace {

// asio's transfer_all() caps every read/write system call at 64 KiB, so a 64 MiB layer would take
// a thousand syscalls and handler dispatches. Allow up to 64 MiB per call instead; the kernel
// returns early on a short socket buffer anyway.
struct LargeTransfers {
    size_t operator()(const error_code& ec, size_t /*done*/) const {
        return ec ? 0 : (size_t{64} << 20);
    }
};

constexpr size_t kMaxBatchFrames = 32;           // frames per gather write
constexpr size_t kBatchBytes = size_t{4} << 20;  // stop adding frames beyond this
constexpr auto kConnectRetry = std::chrono::milliseconds(20);

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

constexpr size_t kStageBytes = 64 * 1024;

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

std::string env_or(const char* name, std::string fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::string(v) : std::move(fallback);
}

std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> out;
    std::string item;
    std::istringstream in(text);
    while (std::getline(in, item, ',')) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

std::string remote_of(const tcp::socket& s) {
    error_code ec;
    auto ep = s.remote_endpoint(ec);
    if (ec) return "?";
    return ep.address().to_string() + ":" + std::to_string(ep.port());
}

bool tokens_equal(const std::string& a, const std::string& b) {
    // Constant-time in the common length so a wrong token does not leak a prefix by timing.
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

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

// ---------------------------------------------------------------------------------------------
// Setup

Status TcpTransport::start(std::chrono::milliseconds connect_timeout) {
    connect_timeout_ = connect_timeout;
    missing_ = world_ - 1;
    if (world_ > 1) {
        // Listen before publishing our address, so a peer that reads it can connect at once.
        std::string bind = opts_.bind_address;
        uint16_t port = 0;
        if (!endpoints_.empty()) {
            PDSIM_ASSIGN_OR_RETURN(HostPort self, parse_host_port(endpoints_[rank_]));
            if (bind.empty()) bind = self.host;
            port = self.port;
        }
        if (bind.empty()) bind = "127.0.0.1";
        error_code ec;
        auto addr = asio::ip::make_address(bind, ec);
        if (ec) {
            tcp::resolver resolver(io_);
            auto results = resolver.resolve(bind, std::to_string(port), ec);
            if (ec || results.empty()) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "tcp rank {}: cannot resolve bind address '{}': {}", rank_, bind,
                                   ec.message());
            }
            addr = results.begin()->endpoint().address();
        }
        tcp::endpoint ep(addr, port);
        acceptor_.open(ep.protocol(), ec);
        if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
        if (!ec && opts_.socket_buffer_bytes > 0) {
            // Set on the listener so accepted sockets inherit it before the window is negotiated.
            acceptor_.set_option(asio::socket_base::receive_buffer_size(opts_.socket_buffer_bytes),
                                 ec);
        }
        if (!ec) acceptor_.bind(ep, ec);
        if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
        if (ec) {
            return PDSIM_ERROR(StatusCode::kUnavailable, "tcp rank {}: cannot listen on {}:{}: {}",
                               rank_, bind, port, ec.message());
        }
        if (!bootstrap_dir_.empty()) {
            auto local = acceptor_.local_endpoint(ec);
            std::string host = bind;
            if (addr.is_unspecified()) host = asio::ip::host_name();
            std::string text = (host.find(':') != std::string::npos ? "[" + host + "]" : host) +
                               ":" + std::to_string(local.port());
            PDSIM_RETURN_IF_ERROR(
                rendezvous_.publish(rank_, text).with_context(fmt::format("tcp rank {}", rank_)));
        }
    }

    std::future<Status> setup = setup_promise_.get_future();
    io_thread_ = std::thread([this] {
        set_thread_name("pdsim-tcp-io");
        try {
            io_.run();
        } catch (const std::exception& e) {
            PDSIM_LOG_ERROR("tcp rank {}: io thread stopped by an exception: {}", rank_, e.what());
        }
    });
    asio::post(io_, [this] {
        if (missing_ == 0) {
            finish_setup({});
            return;
        }
        deadline_.expires_after(connect_timeout_);
        deadline_.async_wait([this](const error_code& ec) {
            if (ec || setup_finished_) return;
            std::string missing;
            for (int r = 0; r < world_; ++r) {
                if (r != rank_ && !peers_[r]->connected) {
                    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                }
            }
            std::string msg = fmt::format(
                "tcp rank {}: mesh not connected after {} ms: no connection with rank(s) {}", rank_,
                connect_timeout_.count(), missing);
            StatusCode code = StatusCode::kDeadlineExceeded;
            if (!rejections_.empty()) {
                code = StatusCode::kFailedPrecondition;
                msg += "; rejected connection(s): ";
                for (size_t i = 0; i < rejections_.size(); ++i) {
                    msg += (i ? "; " : "") + rejections_[i];
                }
            }
            finish_setup(Status(code, msg));
        });
        if (rank_ < world_ - 1) accept_next();
        for (int j = 0; j < rank_; ++j) connect_to(j);
    });

    // The deadline timer guarantees an answer; the extra margin only guards against an io thread
    // that died (it logs why).
    Status st;
    if (setup.wait_for(connect_timeout_ + std::chrono::seconds(10)) != std::future_status::ready) {
        st = PDSIM_ERROR(StatusCode::kInternal, "tcp rank {}: setup never finished", rank_);
    } else {
        st = setup.get();
    }
    if (!st.ok()) {
        close();
        return st;
    }
    return {};
}

void TcpTransport::apply_socket_options(tcp::socket& s) {
    error_code ec;
    s.set_option(tcp::no_delay(true), ec);
    if (opts_.socket_buffer_bytes > 0) {
        s.set_option(asio::socket_base::send_buffer_size(opts_.socket_buffer_bytes), ec);
        s.set_option(asio::socket_base::receive_buffer_size(opts_.socket_buffer_bytes), ec);
    }
    s.set_option(asio::socket_base::keep_alive(true), ec);
}

void TcpTransport::accept_next() {
    acceptor_.async_accept([this](const error_code& ec, tcp::socket sock) {
        if (setup_finished_ || ec == asio::error::operation_aborted) return;
        if (!ec) {
            auto hs = std::make_shared<Handshake>(io_);
            hs->sock = std::move(sock);
            hs->remote = remote_of(hs->sock);
            apply_socket_options(hs->sock);
            handshake_accepted(std::move(hs));
        }
        accept_next();
    });
}

void TcpTransport::handshake_accepted(std::shared_ptr<Handshake> hs) {
    hs->timer.expires_after(opts_.handshake_timeout);
    hs->timer.async_wait([this, hs](const error_code& ec) {
        if (ec) return;
        rejections_.push_back(fmt::format("from {}: no hello within {} ms", hs->remote,
                                          opts_.handshake_timeout.count()));
        error_code ignored;
        hs->sock.close(ignored);
    });
    asio::async_read(hs->sock, asio::buffer(hs->hdr), [this, hs](const error_code& ec, size_t n) {
        if (setup_finished_) return;
        if (ec) {
            if (ec != asio::error::operation_aborted) {
                rejections_.push_back(
                    fmt::format("from {}: connection closed during the hello "
                                "({} of {} header bytes): {}",
                                hs->remote, n, kFrameHeaderBytes, ec.message()));
                PDSIM_LOG_WARN("tcp rank {}: {}", rank_, rejections_.back());
            }
            hs->timer.cancel();
            return;
        }
        auto h = frame::decode_header(hs->hdr, opts_.max_frame_bytes);
        if (!h.ok() || h->type != tcp_frame::kHello) {
            reject(hs, h.ok() ? "expected a hello frame" : "bad hello: " + h.status().message());
            return;
        }
        hs->peer = static_cast<int>(h->tag);
        hs->payload.resize(h->length);
        asio::async_read(hs->sock, asio::buffer(hs->payload),
                         [this, hs](const error_code& ec2, size_t) { on_hello(hs, ec2); });
    });
}

void TcpTransport::on_hello(std::shared_ptr<Handshake> hs, const error_code& ec) {
    if (setup_finished_) return;
    if (ec) {
        hs->timer.cancel();
        if (ec != asio::error::operation_aborted) {
            rejections_.push_back(fmt::format("from {}: connection closed inside the hello: {}",
                                              hs->remote, ec.message()));
        }
        return;
    }
    auto hello = frame::decode_hello(hs->payload);
    if (!hello.ok()) {
        reject(hs, "bad hello: " + hello.status().message());
        return;
    }
    if (!tokens_equal(hello->token, token_)) {
        reject(hs, "session token mismatch");
        return;
    }
    if (hello->world_size != world_) {
        reject(hs, fmt::format("world size mismatch: the peer has {}, rank {} has {}",
                               hello->world_size, rank_, world_));
        return;
    }
    if (hs->peer <= rank_ || hs->peer >= world_) {
        reject(hs, fmt::format("rank {} accepts ranks {}..{}, not {}", rank_, rank_ + 1, world_ - 1,
                               hs->peer));
        return;
    }
    if (peers_[hs->peer]->connected) {
        reject(hs, fmt::format("rank {} is already connected", hs->peer));
        return;
    }
    uint8_t ack[4];
    for (int i = 0; i < 4; ++i) {
        ack[i] = static_cast<uint8_t>(static_cast<uint32_t>(world_) >> (8 * i));
    }
    hs->out = frame::make_frame(tcp_frame::kHelloAck, static_cast<Tag>(rank_), ack);
    asio::async_write(hs->sock, asio::buffer(hs->out), [this, hs](const error_code& ec2, size_t) {
        hs->timer.cancel();
        if (setup_finished_ || ec2 || peers_[hs->peer]->connected) return;
        register_peer(hs->peer, std::move(hs->sock));
    });
}

void TcpTransport::reject(std::shared_ptr<Handshake> hs, const std::string& reason) {
    std::string who = hs->peer >= 0 ? fmt::format(" (claims rank {})", hs->peer) : "";
    rejections_.push_back(fmt::format("from {}{}: {}", hs->remote, who, reason));
    PDSIM_LOG_WARN("tcp rank {}: rejected connection {}", rank_, rejections_.back());
    auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(reason.data()),
                                          std::min(reason.size(), frame::kMaxControlPayload));
    hs->out = frame::make_frame(tcp_frame::kReject, static_cast<Tag>(rank_), bytes);
    asio::async_write(hs->sock, asio::buffer(hs->out), [hs](const error_code&, size_t) {
        hs->timer.cancel();
        error_code ignored;
        hs->sock.shutdown(tcp::socket::shutdown_both, ignored);
        hs->sock.close(ignored);
    });
}

StatusOr<HostPort> TcpTransport::endpoint_of(int peer) const {
    if (!endpoints_.empty()) return parse_host_port(endpoints_[peer]);
    std::optional<std::string> published = rendezvous_.try_read(peer);
    if (!published || published->empty()) {
        return PDSIM_ERROR(StatusCode::kNotFound, "tcp: {} not published yet",
                           rendezvous_.path_of(peer));
    }
    return parse_host_port(*published);
}

void TcpTransport::connect_to(int peer) {
    if (setup_finished_) return;
    auto ep = endpoint_of(peer);
    if (!ep.ok()) {
        if (ep.status().code() == StatusCode::kNotFound) {
            retry_connect(peer);
        } else {
            finish_setup(ep.status());
        }
        return;
    }
    error_code ec;
    tcp::endpoint target;
    auto addr = asio::ip::make_address(ep->host, ec);
    if (!ec) {
        target = tcp::endpoint(addr, ep->port);
    } else {
        tcp::resolver resolver(io_);
        auto results = resolver.resolve(ep->host, std::to_string(ep->port), ec);
        if (ec || results.empty()) {
            retry_connect(peer);
            return;
        }
        target = *results.begin();
    }
    auto hs = std::make_shared<Handshake>(io_);
    hs->peer = peer;
    hs->remote = ep->host + ":" + std::to_string(ep->port);
    hs->sock.open(target.protocol(), ec);
    if (ec) {
        finish_setup(PDSIM_ERROR(StatusCode::kUnavailable, "tcp rank {}: socket(): {}", rank_,
                                 ec.message()));
        return;
    }
    apply_socket_options(hs->sock);
    hs->sock.async_connect(target, [this, hs](const error_code& ec2) {
        if (setup_finished_) return;
        if (ec2) {
            retry_connect(hs->peer);  // refused: the peer is not listening yet
            return;
        }
        handshake_connected(hs);
    });
}

void TcpTransport::retry_connect(int peer) {
    auto timer = std::make_shared<asio::steady_timer>(io_, kConnectRetry);
    timer->async_wait([this, timer, peer](const error_code& ec) {
        if (!ec && !setup_finished_) connect_to(peer);
    });
}

void TcpTransport::handshake_connected(std::shared_ptr<Handshake> hs) {
    hs->timer.expires_after(opts_.handshake_timeout);
    hs->timer.async_wait([hs](const error_code& ec) {
        if (ec) return;
        error_code ignored;
        hs->sock.close(ignored);  // the pending read fails; the connect is retried
    });
    hs->out = frame::make_frame(tcp_frame::kHello, static_cast<Tag>(rank_),
                                frame::encode_hello(frame::Hello{world_, token_}));
    asio::async_write(hs->sock, asio::buffer(hs->out), [this, hs](const error_code& ec, size_t) {
        if (setup_finished_) return;
        if (ec) {
            hs->timer.cancel();
            retry_connect(hs->peer);
            return;
        }
        asio::async_read(
            hs->sock, asio::buffer(hs->hdr), [this, hs](const error_code& ec2, size_t) {
                if (setup_finished_) return;
                if (ec2) {
                    hs->timer.cancel();
                    retry_connect(hs->peer);
                    return;
                }
                auto h = frame::decode_header(hs->hdr, opts_.max_frame_bytes);
                if (!h.ok() || (h->type != tcp_frame::kHelloAck && h->type != tcp_frame::kReject)) {
                    hs->timer.cancel();
                    finish_setup(
                        Status(StatusCode::kDataLoss,
                               fmt::format("tcp rank {}: {} (rank {}) answered the hello with "
                                           "{}",
                                           rank_, hs->remote, hs->peer,
                                           h.ok() ? "an unexpected frame" : h.status().message())));
                    return;
                }
                bool rejected = h->type == tcp_frame::kReject;
                auto answered_by = static_cast<int>(h->tag);
                hs->payload.resize(h->length);
                asio::async_read(
                    hs->sock, asio::buffer(hs->payload),
                    [this, hs, rejected, answered_by](const error_code& ec3, size_t) {
                        hs->timer.cancel();
                        if (setup_finished_) return;
                        if (ec3) {
                            retry_connect(hs->peer);
                            return;
                        }
                        if (rejected) {
                            std::string reason(hs->payload.begin(), hs->payload.end());
                            PDSIM_LOG_ERROR(
                                "tcp rank {}: rank {} at {} rejected the connection: {}", rank_,
                                hs->peer, hs->remote, reason);
                            finish_setup(
                                Status(StatusCode::kFailedPrecondition,
                                       fmt::format("tcp rank {}: rank {} at {} rejected the "
                                                   "connection: {}",
                                                   rank_, hs->peer, hs->remote, reason)));
                            return;
                        }
                        if (answered_by != hs->peer) {
                            finish_setup(
                                Status(StatusCode::kFailedPrecondition,
                                       fmt::format("tcp rank {}: {} should be rank {} but "
                                                   "says it is rank {}",
                                                   rank_, hs->remote, hs->peer, answered_by)));
                            return;
                        }
                        register_peer(hs->peer, std::move(hs->sock));
                    });
            });
    });
}

void TcpTransport::register_peer(int peer, tcp::socket sock) {
    Peer* p = peers_[peer].get();
    p->sock = std::move(sock);
    p->address = remote_of(p->sock);
    p->connected = true;
    p->stage.resize(kStageBytes);
    pump(p);
    if (--missing_ == 0) finish_setup({});
}

void TcpTransport::finish_setup(Status st) {
    if (setup_finished_) return;
    setup_finished_ = true;
    deadline_.cancel();
    error_code ignored;
    acceptor_.close(ignored);  // the mesh is complete (or failed): no more connections
    setup_promise_.set_value(std::move(st));
}

// ---------------------------------------------------------------------------------------------
// Posting (any thread)

StatusOr<RequestHandle> TcpTransport::post_send(int peer, Tag tag, const void* buf, size_t bytes) {
    PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
    if (closed_.load(std::memory_order_acquire)) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "tcp rank {}: transport closed", rank_);
    }
    auto s = std::make_unique<SendOp>();
    s->header = frame::encode_header(FrameHeader{tcp_frame::kData, tag, bytes});
    s->buf = buf;
    s->bytes = bytes;
    s->op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
    RequestHandle handle(s->op);
    Peer* p = peers_[peer].get();
    bool kick = false;
    {
        MutexLock lock(p->send_mu);
        if (p->send_dead) return p->send_status;
        p->send_q.push_back(std::move(s));
        if (!p->writing) {
            p->writing = true;
            kick = true;
        }
    }
    // Only an idle writer needs a kick; a busy one picks new sends up when its write completes.
    if (kick) asio::post(io_, [this, p] { start_write(p); });
    return handle;
}

void TcpTransport::deliver(const std::shared_ptr<Unexpected>& u, const RecvOp& r, int peer,
                           Tag tag) {
    if (u->bytes > r.capacity) {
        r.op->complete(Status(StatusCode::kOutOfRange,
                              fmt::format("tcp: message of {} bytes from rank {} (tag {}) does not "
                                          "fit the receive buffer of {} bytes",
                                          u->bytes, peer, tag, r.capacity)),
                       0);
        return;
    }
    if (u->bytes > 0) std::memcpy(r.buf, u->data.get(), u->bytes);
    r.op->complete({}, u->bytes);
}

StatusOr<RequestHandle> TcpTransport::post_recv(int peer, Tag tag, void* buf, size_t capacity) {
    PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
    if (closed_.load(std::memory_order_acquire)) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "tcp rank {}: transport closed", rank_);
    }
    auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
    RequestHandle handle(op);
    Peer* p = peers_[peer].get();
    std::shared_ptr<Unexpected> u;
    {
        MutexLock lock(p->recv_mu);
        auto it = p->unexpected.find(tag);
        if (it != p->unexpected.end() && !it->second.empty()) {
            u = std::move(it->second.front());
            it->second.pop_front();
            if (it->second.empty()) p->unexpected.erase(it);
            if (!u->complete) {
                // Still arriving: the io thread copies it here when the body is in.
                u->waiter = RecvOp{buf, capacity, op};
                return handle;
            }
        } else {
            // Messages that arrived before the peer died stay receivable (above); nothing more
            // will come.
            if (p->recv_dead) return p->recv_status;
            p->posted[tag].push_back(RecvOp{buf, capacity, op});
            return handle;
        }
    }
    deliver(u, RecvOp{buf, capacity, op}, peer, tag);  // copy outside the lock
    return handle;
}

Status TcpTransport::cancel(const RequestHandle& handle) {
    if (!handle.valid()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: cancel of an invalid handle");
    }
    const std::shared_ptr<OpState>& op = handle.state();
    if (op->peer() < 0 || op->peer() >= world_ || op->peer() == rank_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: handle of another transport");
    }
    Peer* p = peers_[op->peer()].get();
    bool removed = false;
    if (op->kind() == OpKind::kRecv) {
        MutexLock lock(p->recv_mu);
        auto it = p->posted.find(op->tag());
        if (it != p->posted.end()) {
            auto& q = it->second;
            auto e = std::find_if(q.begin(), q.end(), [&](const RecvOp& r) { return r.op == op; });
            if (e != q.end()) {
                q.erase(e);
                if (q.empty()) p->posted.erase(it);
                removed = true;
            }
        }
    } else if (op->kind() == OpKind::kSend) {
        MutexLock lock(p->send_mu);
        // Entries before in_flight are being written; the rest are only queued.
        for (size_t i = p->in_flight; i < p->send_q.size(); ++i) {
            if (p->send_q[i]->op == op) {
                p->send_q.erase(p->send_q.begin() + static_cast<ptrdiff_t>(i));
                removed = true;
                break;
            }
        }
    }
    if (removed) {
        op->complete(Status(StatusCode::kAborted, fmt::format("tcp rank {}: {} cancelled", rank_,
                                                              op_kind_name(op->kind()))),
                     0);
        return {};
    }
    if (op->done()) return {};
    return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                       "tcp rank {}: {} to/from rank {} is "
                       "already in flight",
                       rank_, op_kind_name(op->kind()), op->peer());
}

// ---------------------------------------------------------------------------------------------
// Data path (io thread)

void TcpTransport::start_write(Peer* p) {
    {
        MutexLock lock(p->send_mu);
        if (p->failed || p->send_q.empty()) {
            p->writing = false;
            return;
        }
        p->gather.clear();
        size_t n = 0;
        size_t total = 0;
        for (const auto& s : p->send_q) {
            if (n == kMaxBatchFrames || (n > 0 && total >= kBatchBytes)) break;
            p->gather.emplace_back(s->header.data(), s->header.size());
            if (s->bytes > 0) p->gather.emplace_back(s->buf, s->bytes);
            total += kFrameHeaderBytes + s->bytes;
            ++n;
        }
        p->in_flight = n;
    }
    asio::async_write(p->sock, p->gather, LargeTransfers{},
                      [this, p](const error_code& ec, size_t) { on_written(p, ec); });
}

void TcpTransport::on_written(Peer* p, const error_code& ec) {
    if (p->failed) return;
    if (ec) {
        fail_peer(p, lost(p, ec, "while sending"));
        return;
    }
    std::vector<std::unique_ptr<SendOp>> done;
    bool more = false;
    {
        MutexLock lock(p->send_mu);
        for (size_t i = 0; i < p->in_flight; ++i) {
            done.push_back(std::move(p->send_q.front()));
            p->send_q.pop_front();
        }
        p->in_flight = 0;
        more = !p->send_q.empty();
        if (!more) p->writing = false;
    }
    for (auto& s : done) s->op->complete({}, s->bytes);
    if (more) start_write(p);
}

void TcpTransport::pump(Peer* p) {
    for (;;) {
        if (p->failed) return;
        const size_t staged = p->stage_end - p->stage_pos;
        if (p->body == BodySink::kNone) {
            if (staged < kFrameHeaderBytes) {
                fill(p);
                return;
            }
            if (!on_frame_header(p)) return;
            continue;
        }
        const uint64_t left = p->cur.length - p->body_got;
        if (left == 0) {
            finish_body(p);
            continue;
        }
        if (staged > 0) {
            const auto take = static_cast<size_t>(std::min<uint64_t>(left, staged));
            const uint8_t* from = p->stage.data() + p->stage_pos;
            if (p->body == BodySink::kDirect || p->body == BodySink::kUnexpected) {
                std::memcpy(p->body_dst + p->body_got, from, take);
            } else if (p->body == BodySink::kErrorText) {
                p->error_text.append(reinterpret_cast<const char*>(from), take);
            }
            p->body_got += take;
            p->stage_pos += take;
            continue;
        }
        if (p->body == BodySink::kDirect || p->body == BodySink::kUnexpected) {
            // The rest of the body goes straight into its destination: no intermediate copy.
            asio::async_read(p->sock,
                             asio::buffer(p->body_dst + p->body_got, static_cast<size_t>(left)),
                             LargeTransfers{}, [this, p](const error_code& ec, size_t n) {
                                 if (p->failed) return;
                                 p->body_got += n;
                                 if (ec) {
                                     fail_peer(p, lost(p, ec, read_position(p)));
                                     return;
                                 }
                                 pump(p);
                             });
            return;
        }
        fill(p);  // discarded bytes and error text go through the stage
        return;
    }
}

void TcpTransport::fill(Peer* p) {
    // Keep a partial header at the front; everything else has been consumed.
    const size_t staged = p->stage_end - p->stage_pos;
    if (staged > 0 && p->stage_pos > 0) {
        std::memmove(p->stage.data(), p->stage.data() + p->stage_pos, staged);
    }
    p->stage_pos = 0;
    p->stage_end = staged;
    p->sock.async_read_some(
        asio::buffer(p->stage.data() + p->stage_end, p->stage.size() - p->stage_end),
        [this, p](const error_code& ec, size_t n) {
            if (p->failed) return;
            if (ec) {
                fail_peer(p, lost(p, ec, read_position(p)));
                return;
            }
            p->stage_end += n;
            pump(p);
        });
}

std::string TcpTransport::read_position(const Peer* p) const {
    if (p->body == BodySink::kNone) {
        const size_t staged = p->stage_end - p->stage_pos;
        if (staged == 0) return "between frames";
        return fmt::format("inside a frame header (truncated frame: {} of {} bytes)", staged,
                           kFrameHeaderBytes);
    }
    return fmt::format("mid-message (tag {}, {} of {} bytes received)", p->cur.tag, p->body_got,
                       p->cur.length);
}

bool TcpTransport::on_frame_header(Peer* p) {
    std::span<const uint8_t, kFrameHeaderBytes> hb(p->stage.data() + p->stage_pos,
                                                   kFrameHeaderBytes);
    auto h = frame::decode_header(hb, opts_.max_frame_bytes);
    if (!h.ok()) {
        protocol_error(p, h.status());
        return false;
    }
    p->stage_pos += kFrameHeaderBytes;
    p->cur = *h;
    p->body_got = 0;
    p->body_dst = nullptr;
    switch (h->type) {
        case tcp_frame::kData:
            return start_data(p);
        case tcp_frame::kBye:
            PDSIM_LOG_DEBUG("tcp rank {}: rank {} closed its transport", rank_, p->rank);
            fail_peer(p, Status(StatusCode::kUnavailable,
                                fmt::format("tcp rank {}: peer rank {} closed its transport", rank_,
                                            p->rank)));
            return false;
        case tcp_frame::kError:
            p->body = BodySink::kErrorText;
            p->error_text.clear();
            return true;
        default:
            protocol_error(
                p, Status(StatusCode::kDataLoss, fmt::format("unexpected frame type {} after setup",
                                                             static_cast<int>(h->type))));
            return false;
    }
}

bool TcpTransport::start_data(Peer* p) {
    const Tag tag = p->cur.tag;
    const auto len = static_cast<size_t>(p->cur.length);
    RecvOp r;
    std::shared_ptr<Unexpected> u;
    {
        MutexLock lock(p->recv_mu);
        auto it = p->posted.find(tag);
        if (it != p->posted.end() && !it->second.empty()) {
            r = std::move(it->second.front());
            it->second.pop_front();
            if (it->second.empty()) p->posted.erase(it);
        } else {
            // Queued at header time (not when the body is in) so that a receive posted meanwhile
            // matches this message and not the next one with the same tag.
            u = std::make_shared<Unexpected>();
            u->bytes = len;
            if (len > 0) {
                // No zero-fill: the body overwrites it. nothrow: a huge frame must fail the peer,
                // not throw out of the io thread.
                u->data.reset(new (std::nothrow) uint8_t[len]);
            }
            if (len == 0 || u->data) p->unexpected[tag].push_back(u);
        }
    }
    if (u && len > 0 && !u->data) {
        fail_peer(p, Status(StatusCode::kResourceExhausted,
                            fmt::format("tcp rank {}: cannot buffer a {}-byte message from rank {}",
                                        rank_, len, p->rank)));
        return false;
    }
    if (u) {
        p->body = BodySink::kUnexpected;
        p->body_dst = u->data.get();
        p->cur_unexpected = std::move(u);
        return true;
    }
    if (len > r.capacity) {
        r.op->complete(Status(StatusCode::kOutOfRange,
                              fmt::format("tcp: message of {} bytes from rank {} (tag {}) does not "
                                          "fit the receive buffer of {} bytes",
                                          len, p->rank, tag, r.capacity)),
                       0);
        p->body = BodySink::kDiscard;
        return true;
    }
    p->body = BodySink::kDirect;
    p->body_dst = static_cast<uint8_t*>(r.buf);
    p->cur_recv = std::move(r);
    return true;
}

void TcpTransport::finish_body(Peer* p) {
    const BodySink sink = p->body;
    p->body = BodySink::kNone;
    p->body_dst = nullptr;
    switch (sink) {
        case BodySink::kDirect: {
            RecvOp r = std::move(p->cur_recv);
            p->cur_recv = {};
            r.op->complete({}, static_cast<size_t>(p->cur.length));
            return;
        }
        case BodySink::kUnexpected: {
            std::shared_ptr<Unexpected> u = std::move(p->cur_unexpected);
            p->cur_unexpected.reset();
            RecvOp waiter;
            {
                MutexLock lock(p->recv_mu);
                u->complete = true;
                waiter = std::move(u->waiter);
                u->waiter = {};
            }
            if (waiter.op) deliver(u, waiter, p->rank, p->cur.tag);
            return;
        }
        case BodySink::kErrorText:
            fail_peer(p, Status(StatusCode::kUnavailable,
                                fmt::format("tcp rank {}: peer rank {} ({}) dropped the "
                                            "connection: {}",
                                            rank_, p->rank, p->address, p->error_text)));
            return;
        case BodySink::kDiscard:
        case BodySink::kNone:
            return;
    }
}

Status TcpTransport::lost(const Peer* p, const error_code& ec, const std::string& where) const {
    return Status(StatusCode::kUnavailable,
                  fmt::format("tcp rank {}: connection to rank {} ({}) lost {}: {}", rank_, p->rank,
                              p->address, where, ec.message()));
}

bool TcpTransport::try_send_control(Peer* p, tcp_frame type, std::span<const uint8_t> payload) {
    {
        // A frame may only go out between frames: not while a gather write is in progress.
        MutexLock lock(p->send_mu);
        if (p->in_flight > 0) return false;
    }
    std::vector<uint8_t> frame = frame::make_frame(type, static_cast<Tag>(rank_), payload);
    error_code ec;
    p->sock.non_blocking(true, ec);  // never block the io thread on a full socket buffer
    if (ec) return false;
    size_t n = p->sock.write_some(asio::buffer(frame), ec);
    return !ec && n == frame.size();
}

void TcpTransport::protocol_error(Peer* p, const Status& st) {
    std::string reason =
        fmt::format("protocol error from rank {} ({}): {}", p->rank, p->address, st.message());
    PDSIM_LOG_ERROR("tcp rank {}: {}; dropping the connection", rank_, reason);
    std::string to_peer = fmt::format("rank {} saw a {}", rank_, reason);
    try_send_control(p, tcp_frame::kError,
                     std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(to_peer.data()),
                                              std::min(to_peer.size(), frame::kMaxControlPayload)));
    fail_peer(p, Status(StatusCode::kDataLoss, fmt::format("tcp rank {}: {}", rank_, reason)));
}

void TcpTransport::fail_peer(Peer* p, Status st) {
    if (p->failed) return;
    p->failed = true;
    if (st.code() != StatusCode::kUnavailable || st.message().find("lost") != std::string::npos) {
        PDSIM_LOG_WARN("{}", st.message());
    }
    // Close first: once the socket is closed no read or write touches a caller's buffer again, so
    // failing the handles below really releases those buffers.
    error_code ignored;
    p->sock.shutdown(tcp::socket::shutdown_both, ignored);
    p->sock.close(ignored);
    std::vector<std::shared_ptr<OpState>> ops;
    {
        MutexLock lock(p->send_mu);
        p->send_dead = true;
        p->send_status = st;
        for (auto& s : p->send_q) ops.push_back(s->op);
        p->send_q.clear();
        p->in_flight = 0;
        p->writing = false;
    }
    {
        MutexLock lock(p->recv_mu);
        p->recv_dead = true;
        p->recv_status = st;
        for (auto& [tag, q] : p->posted) {
            for (auto& r : q) ops.push_back(r.op);
        }
        p->posted.clear();
        // Messages still arriving can never complete; complete ones stay receivable.
        for (auto it = p->unexpected.begin(); it != p->unexpected.end();) {
            auto& q = it->second;
            q.erase(
                std::remove_if(q.begin(), q.end(),
                               [](const std::shared_ptr<Unexpected>& u) { return !u->complete; }),
                q.end());
            it = q.empty() ? p->unexpected.erase(it) : std::next(it);
        }
        if (p->cur_unexpected && p->cur_unexpected->waiter.op) {
            ops.push_back(p->cur_unexpected->waiter.op);
            p->cur_unexpected->waiter = {};
        }
    }
    if (p->cur_recv.op) ops.push_back(p->cur_recv.op);
    p->cur_recv = {};
    p->cur_unexpected.reset();
    for (auto& op : ops) op->complete(st, 0);
}

void TcpTransport::shutdown_io() {
    if (!setup_finished_) {
        setup_finished_ = true;
        setup_promise_.set_value(Status(StatusCode::kUnavailable, "tcp: closed during setup"));
    }
    error_code ignored;
    deadline_.cancel();
    acceptor_.close(ignored);
    Status closed(StatusCode::kUnavailable, fmt::format("tcp rank {}: transport closed", rank_));
    for (auto& up : peers_) {
        Peer* p = up.get();
        if (p->rank == rank_) continue;
        if (p->connected && !p->failed) try_send_control(p, tcp_frame::kBye, {});
        if (!p->failed) fail_peer(p, closed);
    }
    work_.reset();
    io_.stop();
}

void TcpTransport::close() {
    if (closed_.exchange(true, std::memory_order_acq_rel)) return;
    if (io_thread_.joinable()) {
        asio::post(io_, [this] { shutdown_io(); });
        io_thread_.join();
    } else {
        // Never started (setup failed before the io thread ran): fail whatever exists.
        for (auto& up : peers_) {
            Peer* p = up.get();
            if (p->rank != rank_ && !p->failed) {
                fail_peer(p, Status(StatusCode::kUnavailable,
                                    fmt::format("tcp rank {}: transport closed", rank_)));
            }
        }
    }
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_tcp_transport(const TransportOptions& options) {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: rank {} / world size {} invalid",
                           options.rank, options.world_size);
    }
    const TcpOptions tcp = options.get<TcpOptions>();
    std::vector<std::string> endpoints = tcp.endpoints;
    std::string dir = tcp.bootstrap_dir;
    if (endpoints.empty() && dir.empty()) {
        endpoints = split_list(env_or("PDSIM_TCP_ENDPOINTS", ""));
        if (endpoints.empty()) dir = env_or("PDSIM_TCP_BOOTSTRAP_DIR", "");
    }
    if (options.world_size > 1 && endpoints.empty() && dir.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "tcp: no rendezvous: set TcpOptions.endpoints or bootstrap_dir (or "
                           "PDSIM_TCP_ENDPOINTS / PDSIM_TCP_BOOTSTRAP_DIR)");
    }
    if (!endpoints.empty()) {
        if (endpoints.size() != static_cast<size_t>(options.world_size)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "tcp: {} endpoints for a world of {} ranks", endpoints.size(),
                               options.world_size);
        }
        for (const auto& e : endpoints) PDSIM_RETURN_IF_ERROR(parse_host_port(e).status());
    }
    if (tcp.max_frame_bytes == 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: max_frame_bytes must be > 0");
    }
    std::string token = tcp.session_token;
    if (token.empty()) token = env_or("PDSIM_SESSION_TOKEN", "pdsim");
    if (token.size() > frame::kMaxControlPayload - 64) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "tcp: session token of {} bytes is too long", token.size());
    }
    auto t = std::make_unique<TcpTransport>(options, std::move(endpoints), std::move(dir),
                                            std::move(token));
    PDSIM_RETURN_IF_ERROR(t->start(options.connect_timeout));
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
