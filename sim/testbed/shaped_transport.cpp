#include "sim/testbed/shaped_transport.h"

#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <vector>

#include "transfer/forwarding_transport.h"
#include "transfer/hold_queue.h"

namespace pdsim::testbed {

namespace {

using Clock = std::chrono::steady_clock;
using transfer::OpState;
using transfer::RequestHandle;

// Forwards receives, the one-sided set-up calls and everything else; overrides post_send and
// post_write (the shaping), the stream-ordered posts (withdrawn: capabilities() turns them off,
// so the engine posts once a layer is ready and the bucket starts then), test/wait/cancel (held
// operations have handles of their own) and close (it holds operations back).
class ShapedTransport final : public transfer::ForwardingTransport {
public:
    ShapedTransport(std::unique_ptr<transfer::Transport> inner, const topo::LinkShaping& shaping)
        : ForwardingTransport(std::move(inner)),
          shaping_(shaping),
          free_at_(static_cast<size_t>(this->inner().world_size())) {}
    ~ShapedTransport() override { close(); }

    [[nodiscard]] transfer::Capabilities capabilities() const override {
        transfer::Capabilities c = inner().capabilities();
        c.stream_ordered = false;
        return c;
    }

    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, transfer::Tag tag, const void* buf,
                                                    size_t bytes) override {
        if (shaping_.unlimited() && shaping_.latency_us <= 0)
            return inner().post_send(peer, tag, buf, bytes);
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, true));
        return hold(transfer::OpKind::kSend, peer, tag, bytes, [this, peer, tag, buf, bytes] {
            return inner().post_send(peer, tag, buf, bytes);
        });
    }

    // A write is held as a send is (its bytes cross the same link to dst.peer).
    [[nodiscard]] StatusOr<RequestHandle> post_write(const transfer::RemoteRegion& dst,
                                                     size_t dst_offset, const void* src,
                                                     size_t bytes) override {
        if (shaping_.unlimited() && shaping_.latency_us <= 0)
            return inner().post_write(dst, dst_offset, src, bytes);
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, src, bytes, true));
        return hold(transfer::OpKind::kWrite, dst.peer, 0, bytes,
                    [this, dst, dst_offset, src, bytes] {
                        return inner().post_write(dst, dst_offset, src, bytes);
                    });
    }

    // Stream-ordered posts would start on the device whenever their event fires, past the
    // bucket: withdrawn (Transport's defaults, kUnimplemented), as capabilities() says.
    [[nodiscard]] StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer,
                                                          transfer::Tag tag, const void* buf,
                                                          size_t bytes) override {
        return Transport::post_send_after(ready, peer, tag, buf, bytes);
    }
    [[nodiscard]] StatusOr<RequestHandle> post_write_after(const runtime::Event& ready,
                                                           const transfer::RemoteRegion& dst,
                                                           size_t dst_offset, const void* src,
                                                           size_t bytes) override {
        return Transport::post_write_after(ready, dst, dst_offset, src, bytes);
    }

    // The generic completion checks (transfer/transport.h): held sends are handles of our own.
    [[nodiscard]] StatusOr<bool> test(const RequestHandle& handle) override {
        return Transport::test(handle);
    }
    [[nodiscard]] Status wait(const RequestHandle& handle, transfer::Timeout timeout) override {
        return Transport::wait(handle, timeout);
    }

    [[nodiscard]] Status cancel(const RequestHandle& handle) override {
        std::shared_ptr<OpState> withdrawn;
        RequestHandle inner;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (auto it = held_.begin(); it != held_.end(); ++it) {
                if (it->second.op == handle.state()) {
                    withdrawn = it->second.op;
                    held_.erase(it);
                    break;
                }
            }
            if (!withdrawn) {
                auto it = posted_.find(handle.state().get());
                if (it != posted_.end()) inner = it->second;
            }
        }
        // Outside the lock: completions re-enter it.
        if (withdrawn) {
            withdrawn->complete(Status(StatusCode::kAborted, "cancelled"), 0);
            return {};
        }
        if (inner.valid()) return this->inner().cancel(inner);
        if (handle.done()) return {};
        return this->inner().cancel(handle);
    }

    void close() override {
        std::map<HeldKey, Held> held;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            closed_ = true;
            held.swap(held_);
        }
        scheduler_.stop();
        for (auto& [k, h] : held)
            h.op->complete(Status(StatusCode::kUnavailable, "transport closed"), 0);
        ForwardingTransport::close();
    }

private:
    struct Held {
        std::function<StatusOr<RequestHandle>()> post;  // the inner transport's post
        std::shared_ptr<OpState> op;
    };

    StatusOr<RequestHandle> hold(transfer::OpKind kind, int peer, transfer::Tag tag, size_t bytes,
                                 std::function<StatusOr<RequestHandle>()> post) {
        auto op = std::make_shared<OpState>(kind, peer, tag, bytes);
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_)
            return PDSIM_ERROR(StatusCode::kUnavailable, "shaped {}: closed", inner().name());
        const HeldKey key{due_locked(peer, bytes), seq_++};
        held_.emplace(key, Held{std::move(post), op});
        // Pushed under mu_, so the queue's order of equal due times is the keys' order (and
        // close(), which stops the queue after setting closed_, never refuses this push).
        scheduler_.push(key.first, [this, key] { release(key); });
        return RequestHandle(op);
    }
    // (due time, posting sequence): the order in which held sends go out.
    using HeldKey = std::pair<Clock::time_point, uint64_t>;

    // When a send of `bytes` posted now to `peer` may go out: after the link's token bucket for
    // that peer has drained it, plus the latency.
    Clock::time_point due_locked(int peer, size_t bytes) {
        const auto now = Clock::now();
        auto& free_at = free_at_[static_cast<size_t>(peer)];
        if (free_at < now) free_at = now;
        if (!shaping_.unlimited()) {
            free_at += std::chrono::duration_cast<Clock::duration>(
                std::chrono::duration<double>(static_cast<double>(bytes) / shaping_.bytes_per_s));
        }
        return free_at + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double, std::micro>(shaping_.latency_us));
    }

    // Scheduler thread: hands the held operation `key` to the inner transport, unless it was
    // cancelled or failed by close() meanwhile.
    void release(const HeldKey& key) {
        std::unique_lock<std::mutex> lock(mu_);
        auto found = held_.find(key);
        if (found == held_.end()) return;
        Held h = std::move(found->second);
        held_.erase(found);
        auto inner = h.post();
        if (!inner.ok()) {
            lock.unlock();
            h.op->complete(inner.status(), 0);
            return;
        }
        OpState* op_key = h.op.get();
        posted_[op_key] = *inner;
        auto op = h.op;
        lock.unlock();
        inner->on_complete([this, op, op_key](const Status& st, size_t n) {
            {
                std::lock_guard<std::mutex> l(mu_);
                posted_.erase(op_key);
            }
            op->complete(st, n);
        });
    }

    const topo::LinkShaping shaping_;
    std::mutex mu_;
    std::vector<Clock::time_point> free_at_;
    std::map<HeldKey, Held> held_;
    std::map<OpState*, RequestHandle> posted_;
    uint64_t seq_ = 0;
    bool closed_ = false;
    // Last: its thread runs release(), which uses the members above; close() stops it first.
    transfer::HoldQueue scheduler_{"pdsim-shaper"};
};

}  // namespace

std::unique_ptr<transfer::Transport> make_shaped_transport(
    std::unique_ptr<transfer::Transport> inner, const topo::LinkShaping& shaping) {
    return std::make_unique<ShapedTransport>(std::move(inner), shaping);
}

}  // namespace pdsim::testbed
