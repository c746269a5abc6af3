#include "transfer/fault/fault_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "common/text.h"
#include "transfer/forwarding_transport.h"
#include "transfer/hold_queue.h"

namespace pdsim::transfer {

namespace {

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
    std::vector<std::string_view> out;
    size_t start = 0;
    for (;;) {
        size_t pos = s.find(sep, start);
        out.push_back(trim(s.substr(start, pos == std::string_view::npos ? s.npos : pos - start)));
        if (pos == std::string_view::npos) break;
        start = pos + 1;
    }
    return out;
}

using text::excerpt;  // at most 80 bytes of the user's spec, on one line

// Bounds of the spec's numbers (fault_transport.h).
constexpr double kMaxFaultMs = 60'000;           // ms, jitter_ms, hold_ms
constexpr double kMaxCorruptBytes = 1 << 20;     // bytes
constexpr double kMaxAfter = 1e15;               // after
constexpr double kMaxSeed = 9007199254740992.0;  // 2^53: seeds are whole doubles

// One key a fault kind takes: its bounds, whether it must be a whole number, whether it is
// required.
struct KeyRule {
    std::string_view key;
    double max;
    bool integer;
    bool required;
};

// The keys of `kind` (besides `seed`, which every kind takes), or nullptr for an unknown kind.
const std::vector<KeyRule>* rules_of(std::string_view kind) {
    static const std::map<std::string_view, std::vector<KeyRule>> kRules = {
        {"delay", {{"ms", kMaxFaultMs, false, true}, {"jitter_ms", kMaxFaultMs, false, false}}},
        {"drop", {{"p", 1, false, true}}},
        {"corrupt", {{"p", 1, false, true}, {"bytes", kMaxCorruptBytes, true, false}}},
        {"reorder", {{"p", 1, false, false}, {"hold_ms", kMaxFaultMs, false, false}}},
        {"disconnect", {{"after", kMaxAfter, true, true}}},
    };
    auto it = kRules.find(kind);
    return it == kRules.end() ? nullptr : &it->second;
}

StatusOr<double> parse_value(std::string_view part, const KeyRule& rule, std::string_view v) {
    double x = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    const bool number =
        !v.empty() && ec == std::errc() && end == v.data() + v.size() && std::isfinite(x) && x >= 0;
    if (!number || x > rule.max || (rule.integer && x != std::floor(x))) {
        return invalid_argument_error(
            fmt::format("fault spec: '{}': {}='{}' is not {} in [0, {:g}]", excerpt(part), rule.key,
                        excerpt(v), rule.integer ? "an integer" : "a number", rule.max));
    }
    return x;
}

// One fault "kind[:key=value,...]" into key -> value, every key known to the kind, the required
// ones present.
StatusOr<std::map<std::string, double, std::less<>>> parse_part(std::string_view part,
                                                                std::string_view kind) {
    const std::vector<KeyRule>* rules = rules_of(kind);
    if (rules == nullptr) {
        return invalid_argument_error(
            fmt::format("fault spec: unknown fault '{}' (delay, drop, corrupt, reorder, "
                        "disconnect)",
                        excerpt(kind)));
    }
    static const KeyRule kSeed{"seed", kMaxSeed, true, false};
    std::map<std::string, double, std::less<>> kv;
    const size_t colon = part.find(':');
    if (colon != std::string_view::npos) {
        for (std::string_view item : split(part.substr(colon + 1), ',')) {
            const size_t eq = item.find('=');
            if (item.empty() || eq == std::string_view::npos) {
                return invalid_argument_error(fmt::format(
                    "fault spec: '{}' in '{}': expected key=value", excerpt(item), excerpt(part)));
            }
            const std::string_view key = trim(item.substr(0, eq));
            const KeyRule* rule = key == "seed" ? &kSeed : nullptr;
            for (const KeyRule& r : *rules) rule = r.key == key ? &r : rule;
            if (rule == nullptr) {
                return invalid_argument_error(
                    fmt::format("fault spec: unknown key '{}' for {}", excerpt(key), kind));
            }
            if (kv.count(key) != 0) {
                return invalid_argument_error(
                    fmt::format("fault spec: '{}': key '{}' given twice", excerpt(part), key));
            }
            PDSIM_ASSIGN_OR_RETURN(double v, parse_value(part, *rule, trim(item.substr(eq + 1))));
            kv[std::string(key)] = v;
        }
    }
    for (const KeyRule& r : *rules) {
        if (r.required && kv.count(r.key) == 0) {
            return invalid_argument_error(
                fmt::format("fault spec: '{}': {} needs {}=VALUE", excerpt(part), kind, r.key));
        }
    }
    return kv;
}

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

}  // namespace

StatusOr<FaultSpec> parse_fault_spec(std::string_view text) {
    FaultSpec spec;
    spec.text = std::string(text);
    if (trim(text).empty()) return spec;
    std::set<std::string, std::less<>> kinds;
    int index = 0;
    for (std::string_view part : split(text, ';')) {
        ++index;
        if (part.empty()) {
            return invalid_argument_error(
                fmt::format("fault spec '{}': fault {} is empty (faults are separated by ';')",
                            excerpt(text), index));
        }
        const std::string_view kind = trim(part.substr(0, part.find(':')));
        PDSIM_ASSIGN_OR_RETURN(auto kv, parse_part(part, kind));
        if (!kinds.insert(std::string(kind)).second) {
            return invalid_argument_error(
                fmt::format("fault spec '{}': {} given twice", excerpt(text), kind));
        }
        auto take = [&](std::string_view key, double fallback) {
            auto it = kv.find(key);
            return it == kv.end() ? fallback : it->second;
        };
        spec.seed = static_cast<uint64_t>(take("seed", static_cast<double>(spec.seed)));
        if (kind == "delay") {
            spec.delay_ms = take("ms", 1);
            spec.jitter_ms = take("jitter_ms", 0);
        } else if (kind == "drop") {
            spec.drop_p = take("p", 0.1);
        } else if (kind == "corrupt") {
            spec.corrupt_p = take("p", 1);
            spec.corrupt_bytes = std::max(1, static_cast<int>(take("bytes", 1)));
        } else if (kind == "reorder") {
            spec.reorder_p = take("p", 0.5);
            spec.reorder_hold_ms = take("hold_ms", 50);
        } else {  // disconnect
            spec.disconnect_after = static_cast<int64_t>(take("after", 0));
        }
    }
    return spec;
}

namespace {

// One operation held by the decorator until it is handed to the inner transport.
struct Item {
    enum class State : uint8_t { kQueued, kPosted, kCancelled };
    int peer = 0;
    std::shared_ptr<OpState> outer;
    std::function<StatusOr<RequestHandle>()> post;  // posts it to the inner transport
    double delay_ms = 0;
    State state = State::kQueued;  // under Core::mu
    RequestHandle inner;           // under Core::mu, once posted
};
using ItemPtr = std::shared_ptr<Item>;

// State shared with completion callbacks, which may outlive a call into the decorator.
struct Core {
    std::mutex mu;
    std::unordered_map<const OpState*, ItemPtr> items;  // not yet completed
    void erase(const OpState* op) {
        std::lock_guard<std::mutex> lock(mu);
        items.erase(op);
    }
};

// Forwards rank, world_size and capabilities; overrides the posts (where faults happen), the
// one-sided setup calls (only to take inner_mu_ against disconnect()'s close of the inner
// transport), test/wait/cancel (it returns handles of its own) and close (it holds sends back).
class FaultTransport final : public ForwardingTransport {
public:
    FaultTransport(std::unique_ptr<Transport> inner, FaultSpec spec)
        : ForwardingTransport(std::move(inner)),
          spec_(std::move(spec)),
          name_("fault:" + std::string(this->inner().name())),
          rng_(splitmix64(spec_.seed * 1000003u + static_cast<uint64_t>(this->inner().rank()))),
          core_(std::make_shared<Core>()) {
        if (spec_.disconnect_after == 0) schedule(0, [this] { disconnect(); });
    }
    ~FaultTransport() override { close(); }

    std::string_view name() const override { return name_; }

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        return post_outgoing(peer, OpKind::kSend, tag, bytes, [this, peer, tag, buf, bytes] {
            return inner().post_send(peer, tag, buf, bytes);
        });
    }

    StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset, const void* src,
                                       size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, src, bytes, /*is_send=*/true));
        return post_outgoing(dst.peer, OpKind::kWrite, 0, bytes,
                             [this, dst, dst_offset, src, bytes] {
                                 return inner().post_write(dst, dst_offset, src, bytes);
                             });
    }

    // A signal meets the faults of a write (dropped, delayed, held back): a reordered one may
    // overtake the writes it was to follow, which is the fault.
    StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                        uint64_t add) override {
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, nullptr, 0, /*is_send=*/true));
        return post_outgoing(
            dst.peer, OpKind::kSignal, 0, sizeof(uint64_t),
            [this, dst, dst_offset, add] { return inner().post_signal(dst, dst_offset, add); });
    }

    // Stream-ordered posts meet the same faults; the inner post then waits for `ready` (which
    // the caller keeps alive until the handle completes).
    StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer, Tag tag,
                                            const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        return post_outgoing(peer, OpKind::kSend, tag, bytes,
                             [this, &ready, peer, tag, buf, bytes] {
                                 return inner().post_send_after(ready, peer, tag, buf, bytes);
                             });
    }

    StatusOr<RequestHandle> post_write_after(const runtime::Event& ready, const RemoteRegion& dst,
                                             size_t dst_offset, const void* src,
                                             size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, src, bytes, /*is_send=*/true));
        return post_outgoing(
            dst.peer, OpKind::kWrite, 0, bytes, [this, &ready, dst, dst_offset, src, bytes] {
                return inner().post_write_after(ready, dst, dst_offset, src, bytes);
            });
    }

    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override {
        bool corrupt = false;
        uint64_t index = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (disconnected_) return disconnect_status_;
            if (spec_.corrupt_p > 0) {
                index = recvs_++;
                corrupt = uniform() < spec_.corrupt_p;
            }
        }
        std::shared_lock<std::shared_mutex> inner_lock(inner_mu_);
        if (!corrupt) return inner().post_recv(peer, tag, buf, capacity);
        PDSIM_ASSIGN_OR_RETURN(RequestHandle h, inner().post_recv(peer, tag, buf, capacity));
        auto outer = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        auto item = std::make_shared<Item>();
        item->peer = peer;
        item->outer = outer;
        item->state = Item::State::kPosted;
        item->inner = h;
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            core_->items[outer.get()] = item;
        }
        uint64_t key = splitmix64(spec_.seed ^ (static_cast<uint64_t>(rank()) << 40) ^ index);
        int nbytes = spec_.corrupt_bytes;
        std::weak_ptr<Core> core = core_;
        h.on_complete([outer, buf, key, nbytes, core](const Status& st, size_t n) {
            if (st.ok() && n > 0) {
                auto* b = static_cast<uint8_t*>(buf);
                for (int j = 0; j < nbytes && static_cast<size_t>(j) < n; ++j) {
                    uint64_t h2 = splitmix64(key + static_cast<uint64_t>(j));
                    size_t pos = static_cast<size_t>(h2 % n);
                    b[pos] ^= static_cast<uint8_t>(1 + (h2 >> 32) % 255);  // never a no-op
                }
            }
            if (auto c = core.lock()) c->erase(outer.get());
            outer->complete(st, n);
        });
        return RequestHandle(outer);
    }

    StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override {
        std::shared_lock<std::shared_mutex> lock(inner_mu_);
        return ForwardingTransport::register_memory(base, bytes);
    }
    Status deregister_memory(uint64_t id) override {
        std::shared_lock<std::shared_mutex> lock(inner_mu_);
        return ForwardingTransport::deregister_memory(id);
    }
    StatusOr<RemoteRegion> import_remote(int peer, std::span<const uint8_t> descriptor) override {
        std::shared_lock<std::shared_mutex> lock(inner_mu_);
        return ForwardingTransport::import_remote(peer, descriptor);
    }

    // The generic completion checks (transfer/transport.h), so that errors name this decorator.
    StatusOr<bool> test(const RequestHandle& handle) override { return Transport::test(handle); }
    Status wait(const RequestHandle& handle, Timeout timeout) override {
        return Transport::wait(handle, timeout);
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "fault: cancel of an invalid handle");
        }
        ItemPtr item;
        RequestHandle inner;
        bool withdrawn = false;
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            auto it = core_->items.find(handle.state().get());
            if (it != core_->items.end()) {
                item = it->second;
                if (item->state == Item::State::kQueued) {
                    item->state = Item::State::kCancelled;
                    core_->items.erase(it);
                    withdrawn = true;
                } else {
                    inner = item->inner;
                }
            }
        }
        if (withdrawn) {
            std::lock_guard<std::mutex> lock(mu_);
            for (auto it = held_.begin(); it != held_.end(); ++it) {
                if (it->second == item) {
                    held_.erase(it);
                    break;
                }
            }
        }
        if (withdrawn) {
            item->outer->complete(
                Status(StatusCode::kAborted, fmt::format("{} rank {}: cancelled", name_, rank())),
                0);
            return {};
        }
        if (handle.done()) return {};
        std::shared_lock<std::shared_mutex> lock(inner_mu_);
        if (item) {
            if (!inner.valid()) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition, "{}: operation in flight",
                                   name_);
            }
            return this->inner().cancel(inner);
        }
        return this->inner().cancel(handle);  // a pass-through receive: the inner's handle
    }

    void close() override {
        if (closed_.exchange(true)) return;
        scheduler_.stop();
        fail_queued(Status(StatusCode::kUnavailable,
                           fmt::format("{} rank {}: transport closed", name_, rank())));
        std::unique_lock<std::shared_mutex> lock(inner_mu_);
        ForwardingTransport::close();
    }

private:
    double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

    StatusOr<RequestHandle> post_outgoing(int peer, OpKind kind, Tag tag, size_t bytes,
                                          std::function<StatusOr<RequestHandle>()> post) {
        auto outer = std::make_shared<OpState>(kind, peer, tag, bytes);
        auto item = std::make_shared<Item>();
        item->peer = peer;
        item->outer = outer;
        item->post = std::move(post);
        std::vector<ItemPtr> now;
        bool drop = false;
        bool last_before_disconnect = false;
        {
            // Every random draw happens here, in post order: same spec + same posts = same faults.
            std::lock_guard<std::mutex> lock(mu_);
            if (disconnected_) return disconnect_status_;
            ++sends_;
            if (spec_.disconnect_after >= 0 && sends_ > spec_.disconnect_after) {
                return Status(StatusCode::kUnavailable,
                              fmt::format("{} rank {}: disconnected after {} sends ({})", name_,
                                          rank(), spec_.disconnect_after, spec_.text));
            }
            last_before_disconnect = sends_ == spec_.disconnect_after;
            drop = spec_.drop_p > 0 && uniform() < spec_.drop_p;
            bool hold = spec_.reorder_p > 0 && uniform() < spec_.reorder_p;
            item->delay_ms =
                spec_.delay_ms + (spec_.jitter_ms > 0 ? uniform() * spec_.jitter_ms : 0);
            if (!drop) {
                auto held = held_.find(peer);
                if (held != held_.end()) {
                    // This one overtakes the held one.
                    now = {item, held->second};
                    held_.erase(held);
                } else if (hold) {
                    held_[peer] = item;
                    schedule(spec_.reorder_hold_ms, [this, item] { release_held(item); });
                } else {
                    now = {item};
                }
            }
        }
        if (last_before_disconnect) {
            // Disconnect once the last allowed send has gone out (or failed).
            outer->on_complete(
                [this](const Status&, size_t) { schedule(0, [this] { disconnect(); }); });
        }
        if (drop) {
            outer->complete({}, bytes);  // "sent": it just never arrives
            return RequestHandle(outer);
        }
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            core_->items[outer.get()] = item;
        }
        for (const ItemPtr& it : now) submit(it);
        return RequestHandle(outer);
    }

    void release_held(const ItemPtr& item) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = held_.find(item->peer);
            if (it == held_.end() || it->second != item) return;  // released by the next send
            held_.erase(it);
        }
        submit(item);
    }

    void submit(const ItemPtr& item) {
        if (item->delay_ms > 0) {
            schedule(item->delay_ms, [this, item] { dispatch(item); });
        } else {
            dispatch(item);
        }
    }

    void dispatch(const ItemPtr& item) {
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            if (item->state != Item::State::kQueued) return;  // cancelled or failed meanwhile
            item->state = Item::State::kPosted;
        }
        StatusOr<RequestHandle> h = [&] {
            std::shared_lock<std::shared_mutex> lock(inner_mu_);
            return item->post();  // posts to inner()
        }();
        if (!h.ok()) {
            core_->erase(item->outer.get());
            item->outer->complete(h.status(), 0);
            return;
        }
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            item->inner = *h;
        }
        std::weak_ptr<Core> core = core_;
        std::shared_ptr<OpState> outer = item->outer;
        h->on_complete([core, outer](const Status& st, size_t n) {
            if (auto c = core.lock()) c->erase(outer.get());
            outer->complete(st, n);
        });
    }

    void fail_queued(const Status& st) {
        std::vector<ItemPtr> failed;
        {
            std::lock_guard<std::mutex> lock(core_->mu);
            for (auto it = core_->items.begin(); it != core_->items.end();) {
                if (it->second->state == Item::State::kQueued) {
                    it->second->state = Item::State::kCancelled;
                    failed.push_back(it->second);
                    it = core_->items.erase(it);
                } else {
                    ++it;
                }
            }
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            held_.clear();
        }
        for (auto& item : failed) item->outer->complete(st, 0);
    }

    // Worker thread.
    void disconnect() {
        Status st(StatusCode::kUnavailable,
                  fmt::format("{} rank {}: disconnected after {} sends ({})", name_, rank(),
                              spec_.disconnect_after, spec_.text));
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (disconnected_) return;
            disconnected_ = true;
            disconnect_status_ = st;
        }
        fail_queued(st);
        // Exclusive: no post is inside the inner transport while it closes.
        std::unique_lock<std::shared_mutex> lock(inner_mu_);
        ForwardingTransport::close();
    }

    // Runs `fn` on the scheduler thread `delay_ms` from now (FIFO among equal due times); dropped
    // once closed.
    void schedule(double delay_ms, HoldQueue::Task fn) {
        scheduler_.push_after_ms(delay_ms, std::move(fn));
    }

    // Shared by posts and dispatches; exclusive for closing the inner transport (not concurrent
    // with calls).
    std::shared_mutex inner_mu_;
    const FaultSpec spec_;
    const std::string name_;

    std::mutex mu_;  // decisions: rng_, counters, held sends, disconnect state
    std::mt19937_64 rng_;
    int64_t sends_ = 0;
    uint64_t recvs_ = 0;
    std::unordered_map<int, ItemPtr> held_;  // at most one held send per peer
    bool disconnected_ = false;
    Status disconnect_status_;

    std::shared_ptr<Core> core_;
    std::atomic<bool> closed_{false};

    // The scheduler: delayed dispatches, reorder releases, the disconnect. Last: its thread runs
    // tasks that use the members above, and it is stopped (by close()) before they go.
    HoldQueue scheduler_{"pdsim-fault"};
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> wrap_with_faults(std::unique_ptr<Transport> inner,
                                                      const FaultSpec& spec) {
    if (!inner) return PDSIM_ERROR(StatusCode::kInvalidArgument, "fault: no inner transport");
    return std::unique_ptr<Transport>(std::make_unique<FaultTransport>(std::move(inner), spec));
}

StatusOr<std::unique_ptr<Transport>> make_fault_transport(const TransportOptions& options) {
    const FaultOptions fault = options.get<FaultOptions>();
    // A decorator over a decorator would read this same FaultOptions block again (and recurse).
    StatusOr<TransportDescriptor> inner_descriptor = find_transport(fault.inner);
    if (inner_descriptor.ok() && inner_descriptor->caps.decorator) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "fault: cannot wrap {}",
                           fault.inner == "fault" ? "itself" : "a decorator");
    }
    PDSIM_ASSIGN_OR_RETURN(FaultSpec spec, parse_fault_spec(fault.spec));
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner,
                           create_transport(fault.inner, options));
    return wrap_with_faults(std::move(inner), spec);
}

}  // namespace pdsim::transfer
