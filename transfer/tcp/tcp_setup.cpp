// The tcp transport's setup: listening, publishing this rank's address, the full mesh (connect
// to lower ranks, accept higher ones) with its hello handshake, and the factory. See
// transfer/tcp/tcp_internal.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <sstream>

#include "common/logging.h"
#include "common/thread_info.h"
#include "transfer/tcp/tcp_internal.h"

namespace pdsim::transfer {

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

namespace tcp_detail {

namespace {

constexpr auto kConnectRetry = std::chrono::milliseconds(20);
constexpr size_t kStageBytes = 64 * 1024;

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

// Reads a session token file: regular, private to its owner, 16..256 printable characters.
StatusOr<std::string> read_token_file(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        return PDSIM_ERROR(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                           "tcp: cannot open the session token file {}: {}", path,
                           std::strerror(errno));
    }
    struct stat st {};
    std::string token(257, '\0');
    ssize_t n = -1;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 077) == 0) {
        n = ::read(fd, token.data(), token.size());
    }
    ::close(fd);
    if (!S_ISREG(st.st_mode) || (st.st_mode & 077) != 0) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "tcp: the session token file {} must be a regular file that only its "
                           "owner can read (mode {:o})",
                           path, st.st_mode & 0777);
    }
    if (n < 16 || n > 256) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "tcp: the session token file {} holds {} bytes (16..256 expected)", path,
                           n);
    }
    token.resize(static_cast<size_t>(n));
    return token;
}

}  // namespace

StatusOr<std::string> bootstrap_session_token(const std::string& dir, int rank) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);  // as the rendezvous does; it may exist
    const std::string path = dir + "/session.token";
    StatusOr<std::string> existing = read_token_file(path);
    if (existing.ok() || existing.status().code() != StatusCode::kNotFound) return existing;
    // The first rank to get here publishes a fresh random token; link() makes the whole file
    // appear at once (a rank never reads half a token) and fails if another rank won the race.
    std::random_device rd;
    std::string token;
    for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", rd());
    const std::string tmp = fmt::format("{}/session.token.{}.{}.tmp", dir, rank, ::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "tcp: cannot write {}: {}", tmp,
                           std::strerror(errno));
    }
    const bool written =
        ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
    ::close(fd);
    const int linked = written ? ::link(tmp.c_str(), path.c_str()) : -1;
    const int link_errno = errno;
    ::unlink(tmp.c_str());
    if (!written || (linked != 0 && link_errno != EEXIST)) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "tcp: cannot publish {}: {}", path,
                           std::strerror(written ? link_errno : EIO));
    }
    return read_token_file(path);
}

// ---------------------------------------------------------------------------------------------
// Setup

// Listens (on the endpoint's port, or port 0 with a bootstrap directory) and, with a bootstrap
// directory, publishes the bound address: before any peer can read it, so it can connect at once.
Status TcpTransport::listen_and_publish() {
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
        acceptor_.set_option(asio::socket_base::receive_buffer_size(opts_.socket_buffer_bytes), ec);
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
        std::string text = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                           std::to_string(local.port());
        PDSIM_RETURN_IF_ERROR(
            rendezvous_.publish(rank_, text).with_context(fmt::format("tcp rank {}", rank_)));
    }
    return {};
}

Status TcpTransport::start(std::chrono::milliseconds connect_timeout) {
    connect_timeout_ = connect_timeout;
    missing_ = world_ - 1;
    if (world_ > 1) PDSIM_RETURN_IF_ERROR(listen_and_publish());

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

}  // namespace tcp_detail

StatusOr<std::unique_ptr<Transport>> make_tcp_transport(const TransportOptions& options) {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tcp: rank {} / world size {} invalid",
                           options.rank, options.world_size);
    }
    const TcpOptions tcp = options.get<TcpOptions>();
    std::vector<std::string> endpoints = tcp.endpoints;
    std::string dir = tcp.bootstrap_dir;
    if (endpoints.empty() && dir.empty()) {
        endpoints = tcp_detail::split_list(tcp_detail::env_or("PDSIM_TCP_ENDPOINTS", ""));
        if (endpoints.empty()) dir = tcp_detail::env_or("PDSIM_TCP_BOOTSTRAP_DIR", "");
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
    // The session token: given, or PDSIM_SESSION_TOKEN, or (with a bootstrap directory) the one
    // the first rank publishes there. Never a built-in string: with explicit endpoints and no
    // token any process that can reach the port could join.
    std::string token = tcp.session_token;
    if (token.empty()) token = tcp_detail::env_or("PDSIM_SESSION_TOKEN", "");
    if (token.empty() && options.world_size > 1) {
        if (dir.empty()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "tcp: endpoints without a session token: set "
                               "TcpOptions.session_token or PDSIM_SESSION_TOKEN (the same secret "
                               "of at least 16 characters on every rank)");
        }
        PDSIM_ASSIGN_OR_RETURN(token, tcp_detail::bootstrap_session_token(dir, options.rank));
    }
    if (token.size() > frame::kMaxControlPayload - 64) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "tcp: session token of {} bytes is too long", token.size());
    }
    auto t = std::make_unique<tcp_detail::TcpTransport>(options, std::move(endpoints),
                                                        std::move(dir), std::move(token));
    PDSIM_RETURN_IF_ERROR(t->start(options.connect_timeout));
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
