#include "transfer/transport.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "common/logging.h"

namespace pdsim::transfer {

std::string_view op_kind_name(OpKind kind) {
    switch (kind) {
        case OpKind::kSend:
            return "send";
        case OpKind::kRecv:
            return "recv";
        case OpKind::kSignal:
            return "signal";
        case OpKind::kWrite:
            return "write";
    }
    return "?";
}

// ---- OpState ----

bool OpState::complete(Status status, size_t bytes) {
    std::vector<Callback> callbacks;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (done_.load(std::memory_order_relaxed)) return false;
        status_ = std::move(status);
        bytes_ = bytes;
        // Release: a thread that sees done() == true also sees status_/bytes_ and every write the
        // transport made into the user's buffer before completing.
        done_.store(true, std::memory_order_release);
        callbacks.swap(callbacks_);
    }
    cv_.notify_all();
    // Callbacks run outside the lock: they may post new operations or complete other states.
    for (auto& fn : callbacks) fn(status_, bytes_);
    return true;
}

bool OpState::wait_until(std::chrono::steady_clock::time_point deadline) const {
    if (done()) return true;
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return done_.load(std::memory_order_relaxed); });
}

void OpState::on_complete(Callback fn) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!done_.load(std::memory_order_relaxed)) {
            callbacks_.push_back(std::move(fn));
            return;
        }
    }
    fn(status_, bytes_);
}

// ---- Transport defaults ----

StatusOr<MemoryRegion> Transport::register_memory(void* /*base*/, size_t /*bytes*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: one-sided operations are not supported",
                       name());
}

Status Transport::deregister_memory(uint64_t /*id*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: one-sided operations are not supported",
                       name());
}

StatusOr<RemoteRegion> Transport::import_remote(int /*peer*/,
                                                std::span<const uint8_t> /*descriptor*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: one-sided operations are not supported",
                       name());
}

StatusOr<RequestHandle> Transport::post_write(const RemoteRegion& /*dst*/, size_t /*dst_offset*/,
                                              const void* /*src*/, size_t /*bytes*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: post_write needs a one-sided transport",
                       name());
}

StatusOr<RequestHandle> Transport::post_signal(const RemoteRegion& /*dst*/, size_t /*dst_offset*/,
                                               uint64_t /*add*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented,
                       "{}: post_signal needs a transport with write signals", name());
}

StatusOr<RequestHandle> Transport::post_send_after(const runtime::Event& /*ready*/, int /*peer*/,
                                                   Tag /*tag*/, const void* /*buf*/,
                                                   size_t /*bytes*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: stream-ordered posts are not supported",
                       name());
}

StatusOr<RequestHandle> Transport::post_write_after(const runtime::Event& /*ready*/,
                                                    const RemoteRegion& /*dst*/,
                                                    size_t /*dst_offset*/, const void* /*src*/,
                                                    size_t /*bytes*/) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: stream-ordered posts are not supported",
                       name());
}

StatusOr<bool> Transport::test(const RequestHandle& handle) {
    if (!handle.valid()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: test on an invalid handle", name());
    }
    const OpState& op = *handle.state();
    if (!op.done()) return false;
    if (!op.status().ok()) return op.status();
    return true;
}

Status Transport::wait(const RequestHandle& handle, Timeout timeout) {
    if (!handle.valid()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: wait on an invalid handle", name());
    }
    const OpState& op = *handle.state();
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
    if (!op.wait_until(deadline)) {
        return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                           "{} rank {}: {} (peer {}, tag {}, {} bytes) still pending after {} ms",
                           name(), rank(), op_kind_name(op.kind()), op.peer(), op.tag(),
                           op.posted_bytes(),
                           std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
    }
    return op.status();
}

Status Transport::check_post(int peer, Tag tag, const void* buf, size_t bytes, bool is_send) const {
    if (peer < 0 || peer >= world_size()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} rank {}: peer {} out of range [0, {})",
                           name(), rank(), peer, world_size());
    }
    if (peer == rank()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} rank {}: peer is this rank (self-sends are not supported)", name(),
                           rank());
    }
    if (buf == nullptr && bytes > 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} rank {}: null buffer of {} bytes",
                           name(), rank(), bytes);
    }
    Capabilities caps = capabilities();
    if (tag > caps.max_tag) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} rank {}: tag {} above max_tag {}",
                           name(), rank(), tag, caps.max_tag);
    }
    if (is_send && bytes > caps.max_message_bytes) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} rank {}: message of {} bytes above the limit of {} bytes", name(),
                           rank(), bytes, caps.max_message_bytes);
    }
    return {};
}

Status wait_all(Transport& transport, std::span<const RequestHandle> handles, Timeout timeout) {
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
    Status first_error;
    size_t pending = 0;
    for (const RequestHandle& h : handles) {
        auto left = std::max(deadline - std::chrono::steady_clock::now(),
                             std::chrono::steady_clock::duration::zero());
        Status st = transport.wait(h, left);
        if (st.code() == StatusCode::kDeadlineExceeded) {
            ++pending;
        } else if (!st.ok() && first_error.ok()) {
            first_error = st;
        }
    }
    if (!first_error.ok()) return first_error;
    if (pending > 0) {
        return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                           "{} rank {}: {} of {} operations still pending after {} ms",
                           transport.name(), transport.rank(), pending, handles.size(),
                           std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
    }
    return {};
}

// ---- Registry ----

void register_builtin_transports();  // builtin.cpp

namespace {

struct Entry {
    TransportDescriptor descriptor;
    TransportFactory factory;
};

struct Registry {
    std::mutex mu;
    std::map<std::string, Entry, std::less<>> entries;
};

Registry& registry() {
    static Registry r;
    return r;
}

void ensure_builtins() {
    static std::once_flag once;
    std::call_once(once, [] {
        // Transports log from their own threads. spdlog creates its registry lazily inside the
        // (uninstrumented) shared library, so ThreadSanitizer cannot see that static's guard and
        // reports two threads' first log calls as a race: create it here, before any transport
        // thread exists.
        (void)spdlog::default_logger_raw();
        register_builtin_transports();
    });
}

// kNotFound "unknown transport 'x' (registered: a, b, ...)". Called with r.mu held.
Status unknown_transport(const Registry& r, std::string_view name) {
    std::string known;
    for (const auto& [n, e] : r.entries) known += (known.empty() ? "" : ", ") + n;
    return PDSIM_ERROR(StatusCode::kNotFound, "unknown transport '{}' (registered: {})", name,
                       known);
}

}  // namespace

void register_transport(TransportDescriptor descriptor, TransportFactory factory) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::string name = descriptor.name;
    r.entries[std::move(name)] = Entry{std::move(descriptor), std::move(factory)};
}

StatusOr<TransportDescriptor> find_transport(std::string_view name) {
    ensure_builtins();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.entries.find(name);
    if (it == r.entries.end()) return unknown_transport(r, name);
    return it->second.descriptor;
}

StatusOr<std::unique_ptr<Transport>> create_transport(std::string_view name,
                                                      const TransportOptions& options) {
    ensure_builtins();
    TransportFactory factory;
    {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.mu);
        auto it = r.entries.find(name);
        if (it == r.entries.end()) return unknown_transport(r, name);
        factory = it->second.factory;
    }
    // The factory runs unlocked: it may block (connecting a mesh) or create an inner transport.
    return factory(options);
}

std::vector<std::string> registered_transports() {
    ensure_builtins();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::vector<std::string> names;
    for (const auto& [n, e] : r.entries) names.push_back(n);
    return names;
}

}  // namespace pdsim::transfer
