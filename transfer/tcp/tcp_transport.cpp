// The tcp transport's data plane: posting (any thread), the data path (io thread), failure and
// close. Setup is in tcp_setup.cpp; the class in tcp_internal.h.
#include <algorithm>
#include <cstring>

#include "common/logging.h"
#include "transfer/tcp/tcp_internal.h"

namespace pdsim::transfer::tcp_detail {

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
}  // namespace

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

}  // namespace pdsim::transfer::tcp_detail
