#include "sim/testbed/shaped_transport.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/thread_info.h"

namespace pdsim::testbed {

namespace {

using Clock = std::chrono::steady_clock;
using transfer::OpState;
using transfer::RequestHandle;

class ShapedTransport final : public transfer::Transport {
public:
    ShapedTransport(std::unique_ptr<transfer::Transport> inner, const topo::LinkShaping& shaping)
        : inner_(std::move(inner)),
          shaping_(shaping),
          free_at_(static_cast<size_t>(inner_->world_size())) {
        thread_ = std::thread([this] {
            set_thread_name("pdsim-shaper");
            loop();
        });
    }
    ~ShapedTransport() override { close(); }

    [[nodiscard]] std::string_view name() const override { return inner_->name(); }
    [[nodiscard]] int rank() const override { return inner_->rank(); }
    [[nodiscard]] int world_size() const override { return inner_->world_size(); }
    [[nodiscard]] transfer::Capabilities capabilities() const override {
        transfer::Capabilities c = inner_->capabilities();
        c.one_sided_write = false;
        return c;
    }

    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, transfer::Tag tag, const void* buf,
                                                    size_t bytes) override {
        if (shaping_.unlimited() && shaping_.latency_us <= 0)
            return inner_->post_send(peer, tag, buf, bytes);
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, true));
        auto op = std::make_shared<OpState>(transfer::OpKind::kSend, peer, tag, bytes);
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_)
                return PDSIM_ERROR(StatusCode::kUnavailable, "shaped {}: closed", inner_->name());
            const auto now = Clock::now();
            auto& free_at = free_at_[static_cast<size_t>(peer)];
            if (free_at < now) free_at = now;
            if (!shaping_.unlimited()) {
                free_at +=
                    std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                        static_cast<double>(bytes) / shaping_.bytes_per_s));
            }
            const auto due =
                free_at + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double, std::micro>(shaping_.latency_us));
            held_.emplace(std::make_pair(due, seq_++), Held{peer, tag, buf, bytes, op});
        }
        cv_.notify_all();
        return RequestHandle(op);
    }

    [[nodiscard]] StatusOr<RequestHandle> post_recv(int peer, transfer::Tag tag, void* buf,
                                                    size_t capacity) override {
        return inner_->post_recv(peer, tag, buf, capacity);
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
        if (inner.valid()) return inner_->cancel(inner);
        if (handle.done()) return {};
        return inner_->cancel(handle);
    }

    void close() override {
        std::map<std::pair<Clock::time_point, uint64_t>, Held> held;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            closed_ = true;
            held.swap(held_);
        }
        cv_.notify_all();
        if (thread_.joinable()) thread_.join();
        for (auto& [k, h] : held)
            h.op->complete(Status(StatusCode::kUnavailable, "transport closed"), 0);
        inner_->close();
    }

private:
    struct Held {
        int peer;
        transfer::Tag tag;
        const void* buf;
        size_t bytes;
        std::shared_ptr<OpState> op;
    };

    void loop() {
        std::unique_lock<std::mutex> lock(mu_);
        while (!closed_) {
            if (held_.empty()) {
                cv_.wait(lock);
                continue;
            }
            const auto due = held_.begin()->first.first;
            if (Clock::now() < due) {
                cv_.wait_until(lock, due);
                continue;
            }
            Held h = std::move(held_.begin()->second);
            held_.erase(held_.begin());
            auto inner = inner_->post_send(h.peer, h.tag, h.buf, h.bytes);
            if (!inner.ok()) {
                lock.unlock();
                h.op->complete(inner.status(), 0);
                lock.lock();
                continue;
            }
            OpState* key = h.op.get();
            posted_[key] = *inner;
            auto op = h.op;
            lock.unlock();
            inner->on_complete([this, op, key](const Status& st, size_t n) {
                {
                    std::lock_guard<std::mutex> l(mu_);
                    posted_.erase(key);
                }
                op->complete(st, n);
            });
            lock.lock();
        }
    }

    std::unique_ptr<transfer::Transport> inner_;
    const topo::LinkShaping shaping_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<Clock::time_point> free_at_;
    std::map<std::pair<Clock::time_point, uint64_t>, Held> held_;
    std::map<OpState*, RequestHandle> posted_;
    uint64_t seq_ = 0;
    bool closed_ = false;
    std::thread thread_;
};

}  // namespace

std::unique_ptr<transfer::Transport> make_shaped_transport(
    std::unique_ptr<transfer::Transport> inner, const topo::LinkShaping& shaping) {
    return std::make_unique<ShapedTransport>(std::move(inner), shaping);
}

}  // namespace pdsim::testbed
