#include "transfer/engine/control.h"

#include <fmt/format.h>

#include <atomic>

#include "common/thread_info.h"

namespace pdsim::transfer {

// ---- ControlChannel ----

std::shared_ptr<ControlChannel> ControlChannel::create(Transport& transport,
                                                       ControlOptions options) {
    return std::shared_ptr<ControlChannel>(new ControlChannel(transport, options));
}

ControlChannel::ControlChannel(Transport& transport, ControlOptions options)
    : transport_(transport), options_(options) {
    const auto n = static_cast<size_t>(transport.world_size());
    last_heard_.assign(n, Clock::now());
    failed_.assign(n, 0);
    interest_.assign(n, 0);
    last_heartbeat_.assign(n, Clock::time_point{});
    recv_handles_.resize(n);
    heartbeat_busy_ = std::make_unique<std::atomic<bool>[]>(n);
    for (size_t i = 0; i < n; ++i) heartbeat_busy_[i].store(false);
}

ControlChannel::~ControlChannel() {
    stop(false);
}

Status ControlChannel::start(ControlListener* listener) {
    if (started_) return PDSIM_ERROR(StatusCode::kFailedPrecondition, "control channel started");
    listener_ = listener;
    started_ = true;
    const auto now = Clock::now();
    for (auto& t : last_heard_) t = now;
    for (int p = 0; p < transport_.world_size(); ++p) {
        if (p != transport_.rank()) post_control_recv(p);
    }
    thread_ = std::thread([this] {
        set_thread_name("pdsim-control");
        loop();
    });
    return {};
}

void ControlChannel::stop(bool drain, std::chrono::milliseconds linger) {
    {
        MutexLock lock(mu_);
        if (stop_) return;
        stop_ = true;
        if (!drain) tasks_.clear();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    {
        MutexLock lock(mu_);
        closed_ = true;
        tasks_.clear();
    }
    if (linger.count() > 0) {
        MutexLock lock(sends_mu_);
        (void)sends_cv_.wait_for(sends_mu_, linger,
                                 [&]() PDSIM_REQUIRES(sends_mu_) { return sends_.empty(); });
    }
    // Withdraw what is still posted. A receive or send that is already moving data cannot be
    // cancelled; it completes on its own (its buffer is owned by its callback, so that is safe).
    for (RequestHandle& h : recv_handles_) {
        if (h.valid() && !h.done()) transport_.cancel(h).ignore_error();
    }
    std::unordered_map<uint64_t, RequestHandle> sends;
    {
        MutexLock lock(sends_mu_);
        sends.swap(sends_);
    }
    for (auto& [id, h] : sends) {
        if (h.valid() && !h.done()) transport_.cancel(h).ignore_error();
    }
}

bool ControlChannel::on_control_thread() const {
    return std::this_thread::get_id() == thread_.get_id();
}

void ControlChannel::post(std::function<void()> fn) {
    {
        MutexLock lock(mu_);
        if (closed_) return;
        tasks_.push_back(std::move(fn));
    }
    cv_.notify_one();
}

void ControlChannel::loop() {
    auto next_tick = Clock::now() + options_.tick;
    auto last_tick = Clock::now();
    while (true) {
        // One task at a time, with the lock released while it runs; stop(false) clears what is
        // still queued. The tick runs once the queue is empty.
        std::function<void()> task;
        bool stopping = false;
        {
            MutexLock lock(mu_);
            (void)cv_.wait_until(mu_, next_tick,
                                 [&]() PDSIM_REQUIRES(mu_) { return stop_ || !tasks_.empty(); });
            if (!tasks_.empty()) {
                task = std::move(tasks_.front());
                tasks_.pop_front();
            } else {
                stopping = stop_;
            }
        }
        if (task) {
            task();
            continue;
        }
        if (stopping) return;
        const auto now = Clock::now();
        if (now >= next_tick) {
            if (now - last_tick > options_.stall) {
                // We did not run (SIGSTOP, starvation): nobody's silence over the gap is theirs.
                for (auto& t : last_heard_) t = now;
                listener_->on_stall(now);
            }
            last_tick = now;
            send_heartbeats(now);
            listener_->on_tick(now);
            next_tick = now + options_.tick;
        }
    }
}

void ControlChannel::post_control_recv(int peer) {
    if (failed_[static_cast<size_t>(peer)]) return;
    std::shared_ptr<Bytes> buf;
    if (!spare_recv_buffers_.empty()) {
        buf = std::move(spare_recv_buffers_.back());
        spare_recv_buffers_.pop_back();
    } else {
        buf = std::make_shared<Bytes>(options_.max_control_bytes);
    }
    auto h = transport_.post_recv(peer, kControlTag, buf->data(), buf->size());
    if (!h.ok()) {
        failed_[static_cast<size_t>(peer)] = 1;
        listener_->on_peer_failed(peer, h.status());
        return;
    }
    recv_handles_[static_cast<size_t>(peer)] = *h;
    std::weak_ptr<ControlChannel> weak = weak_from_this();
    // The callback only hands the message to the control thread: it may run on a transport
    // thread (or inside post_recv on this thread), where re-entering the engine is not allowed.
    h->on_complete([weak, peer, buf](const Status& st, size_t n) {
        if (auto self = weak.lock()) {
            self->post(
                [self = self.get(), peer, buf, st, n] { self->on_recv_done(peer, buf, st, n); });
        }
    });
}

void ControlChannel::on_recv_done(int peer, const std::shared_ptr<Bytes>& buf, const Status& st,
                                  size_t n) {
    if (!st.ok()) {
        if (st.code() == StatusCode::kAborted) return;  // withdrawn at stop
        failed_[static_cast<size_t>(peer)] = 1;
        listener_->on_peer_failed(peer,
                                  st.with_context(fmt::format("control link to rank {}", peer)));
        return;
    }
    last_heard_[static_cast<size_t>(peer)] = Clock::now();
    // Repost before handling: the next message from this peer can land while we work.
    post_control_recv(peer);
    listener_->on_control(peer, std::span<const uint8_t>(buf->data(), n));
    // Handled, and its receive completed: the transport writes into it no more. One spare per
    // peer covers the steady state (one receive posted per peer, one message being handled).
    if (spare_recv_buffers_.size() < last_heard_.size()) spare_recv_buffers_.push_back(buf);
}

void ControlChannel::send(int peer, Bytes bytes) {
    post_tracked_send(peer, std::make_shared<Bytes>(std::move(bytes)), nullptr);
}

void ControlChannel::post_tracked_send(int peer, std::shared_ptr<Bytes> buf,
                                       std::function<void()> on_finished) {
    uint64_t id;
    {
        MutexLock lock(sends_mu_);
        id = next_send_id_++;
        sends_.emplace(id, RequestHandle{});
    }
    auto h = transport_.post_send(peer, kControlTag, buf->data(), buf->size());
    std::weak_ptr<ControlChannel> weak = weak_from_this();
    auto on_done = [weak, peer, id, buf, on_finished](const Status& st, size_t) {
        if (on_finished) on_finished();
        auto self = weak.lock();
        if (!self) return;
        {
            MutexLock lock(self->sends_mu_);
            self->sends_.erase(id);
        }
        self->sends_cv_.notify_all();
        if (!st.ok() && st.code() == StatusCode::kUnavailable) {
            self->post([self = self.get(), peer, st] {
                if (self->failed_[static_cast<size_t>(peer)]) return;
                self->failed_[static_cast<size_t>(peer)] = 1;
                self->listener_->on_peer_failed(
                    peer, st.with_context(fmt::format("control send to rank {}", peer)));
            });
        }
    };
    if (!h.ok()) {
        on_done(h.status(), 0);
        return;
    }
    {
        MutexLock lock(sends_mu_);
        auto it = sends_.find(id);
        if (it != sends_.end()) it->second = *h;
    }
    h->on_complete(on_done);
}

void ControlChannel::send_heartbeats(Clock::time_point now) {
    for (int p = 0; p < transport_.world_size(); ++p) {
        const auto i = static_cast<size_t>(p);
        if (interest_[i] == 0 || failed_[i]) continue;
        if (now - last_heartbeat_[i] < options_.heartbeat_interval) continue;
        // At most one heartbeat in flight per peer: a silent peer that never posts receives
        // must not accumulate an unbounded queue of them.
        bool expected = false;
        if (!heartbeat_busy_[i].compare_exchange_strong(expected, true)) continue;
        last_heartbeat_[i] = now;
        // The flag lives as long as the channel's shared state; the callback holds a weak ref.
        std::weak_ptr<ControlChannel> weak = weak_from_this();
        post_tracked_send(p, std::make_shared<Bytes>(encode_heartbeat()), [weak, i] {
            if (auto self = weak.lock()) self->heartbeat_busy_[i].store(false);
        });
    }
}

ControlChannel::Clock::time_point ControlChannel::last_heard(int peer) const {
    return last_heard_[static_cast<size_t>(peer)];
}

bool ControlChannel::peer_failed(int peer) const {
    return failed_[static_cast<size_t>(peer)] != 0;
}

void ControlChannel::set_interest(std::vector<uint8_t> peers) {
    peers.resize(interest_.size(), 0);
    interest_ = std::move(peers);
}

}  // namespace pdsim::transfer
