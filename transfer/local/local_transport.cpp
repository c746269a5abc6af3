#include "transfer/local/local_transport.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "transfer/forwarding_transport.h"

namespace pdsim::transfer {

namespace {

struct SendEntry {
    const void* buf;
    size_t bytes;
    std::shared_ptr<OpState> op;
};

struct RecvEntry {
    void* buf;
    size_t capacity;
    std::shared_ptr<OpState> op;
};

// At most one of the two deques is non-empty at any time: a post first matches the other side.
struct Mailbox {
    std::deque<SendEntry> sends;
    std::deque<RecvEntry> recvs;
};

struct Region {
    void* base;
    size_t bytes;
};

uint64_t mailbox_key(int src, int dst, Tag tag) {
    return (static_cast<uint64_t>(static_cast<uint16_t>(src)) << 48) |
           (static_cast<uint64_t>(static_cast<uint16_t>(dst)) << 32) | tag;
}

int key_src(uint64_t key) {
    return static_cast<int>((key >> 48) & 0xffff);
}
int key_dst(uint64_t key) {
    return static_cast<int>((key >> 32) & 0xffff);
}

// Copies a matched pair and completes both (outside the world lock).
void deliver(const SendEntry& s, const RecvEntry& r) {
    if (s.bytes > r.capacity) {
        r.op->complete(Status(StatusCode::kOutOfRange,
                              fmt::format("local: message of {} bytes from rank {} (tag {}) does "
                                          "not fit the receive buffer of {} bytes",
                                          s.bytes, r.op->peer(), r.op->tag(), r.capacity)),
                       0);
        s.op->complete({}, s.bytes);
        return;
    }
    if (s.bytes > 0) std::memcpy(r.buf, s.buf, s.bytes);
    // Receive first: a sender that sees its send done may assume the data has landed here.
    r.op->complete({}, s.bytes);
    s.op->complete({}, s.bytes);
}

}  // namespace

class LocalWorld {
public:
    explicit LocalWorld(int world_size)
        : world_size_(world_size), attached_(world_size, false), closed_(world_size, false) {}

    int world_size() const { return world_size_; }

    std::mutex mu;
    std::unordered_map<uint64_t, Mailbox> boxes;
    std::map<std::pair<int, uint64_t>, Region> regions;  // (rank, id)
    uint64_t next_region_id = 1;

    const int world_size_;
    std::vector<bool> attached_;  // under mu
    std::vector<bool> closed_;    // under mu: closed ranks stay closed (until re-attached)
};

std::shared_ptr<LocalWorld> make_local_world(int world_size) {
    // Mailbox keys hold ranks in 16 bits.
    return std::make_shared<LocalWorld>(std::clamp(world_size, 1, 65535));
}

namespace {

class LocalTransport final : public Transport {
public:
    LocalTransport(std::shared_ptr<LocalWorld> world, int rank)
        : world_(std::move(world)), rank_(rank) {}
    ~LocalTransport() override { close(); }

    std::string_view name() const override { return "local"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_->world_size(); }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = true;
        c.one_sided_write = true;
        c.write_signals = true;
        c.host_memory = true;
        c.detects_peer_failure = true;
        c.max_tag = std::numeric_limits<Tag>::max();
        c.max_message_bytes = std::numeric_limits<size_t>::max();
        return c;
    }

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
        SendEntry s{buf, bytes, op};
        RecvEntry r{};
        {
            std::lock_guard<std::mutex> lock(world_->mu);
            PDSIM_RETURN_IF_ERROR(check_alive_locked(peer));
            Mailbox& box = world_->boxes[mailbox_key(rank_, peer, tag)];
            if (box.recvs.empty()) {
                box.sends.push_back(std::move(s));
                return RequestHandle(std::move(op));
            }
            r = std::move(box.recvs.front());
            box.recvs.pop_front();
        }
        deliver(s, r);
        return RequestHandle(std::move(op));
    }

    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
        auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        RecvEntry r{buf, capacity, op};
        SendEntry s{};
        {
            std::lock_guard<std::mutex> lock(world_->mu);
            PDSIM_RETURN_IF_ERROR(check_alive_locked(peer));
            Mailbox& box = world_->boxes[mailbox_key(peer, rank_, tag)];
            if (box.sends.empty()) {
                box.recvs.push_back(std::move(r));
                return RequestHandle(std::move(op));
            }
            s = std::move(box.sends.front());
            box.sends.pop_front();
        }
        deliver(s, r);
        return RequestHandle(std::move(op));
    }

    StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override {
        if (base == nullptr && bytes > 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "local: null region of {} bytes",
                               bytes);
        }
        std::lock_guard<std::mutex> lock(world_->mu);
        uint64_t id = world_->next_region_id++;
        world_->regions[{rank_, id}] = Region{base, bytes};
        MemoryRegion mr{id, base, bytes, {}};
        mr.descriptor.resize(sizeof(int32_t) + 2 * sizeof(uint64_t));
        auto r32 = static_cast<int32_t>(rank_);
        auto b64 = static_cast<uint64_t>(bytes);
        std::memcpy(mr.descriptor.data(), &r32, 4);
        std::memcpy(mr.descriptor.data() + 4, &id, 8);
        std::memcpy(mr.descriptor.data() + 12, &b64, 8);
        return mr;
    }

    Status deregister_memory(uint64_t id) override {
        std::lock_guard<std::mutex> lock(world_->mu);
        if (world_->regions.erase({rank_, id}) == 0) {
            return PDSIM_ERROR(StatusCode::kNotFound, "local rank {}: no region {}", rank_, id);
        }
        return {};
    }

    StatusOr<RemoteRegion> import_remote(int peer, std::span<const uint8_t> descriptor) override {
        if (descriptor.size() != 20) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "local: region descriptor of {} bytes (expected 20)",
                               descriptor.size());
        }
        int32_t r32 = 0;
        uint64_t id = 0;
        uint64_t bytes = 0;
        std::memcpy(&r32, descriptor.data(), 4);
        std::memcpy(&id, descriptor.data() + 4, 8);
        std::memcpy(&bytes, descriptor.data() + 12, 8);
        if (r32 != peer) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "local: descriptor of rank {} imported as rank {}", r32, peer);
        }
        return RemoteRegion{peer, id, static_cast<size_t>(bytes)};
    }

    StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset, const void* src,
                                       size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, src, bytes, /*is_send=*/true));
        PDSIM_ASSIGN_OR_RETURN(uint8_t * target, remote_target(dst, dst_offset, bytes, "write"));
        // The target must keep the region registered while writes may arrive (control-plane
        // contract), so the copy can run outside the lock.
        if (bytes > 0) std::memcpy(target, src, bytes);
        auto op = std::make_shared<OpState>(OpKind::kWrite, dst.peer, 0, bytes);
        op->complete({}, bytes);
        return RequestHandle(std::move(op));
    }

    // Writes are copies done inside post_write, so every write posted before this call is in
    // place: the add only has to publish them (release order; the target loads with acquire).
    StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                        uint64_t add) override {
        PDSIM_RETURN_IF_ERROR(check_post(dst.peer, 0, nullptr, 0, /*is_send=*/true));
        PDSIM_ASSIGN_OR_RETURN(uint8_t * at,
                               remote_target(dst, dst_offset, sizeof(uint64_t), "signal"));
        if (reinterpret_cast<uintptr_t>(at) % alignof(uint64_t) != 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "local: signal word at offset {} of region {} of rank {} is not "
                               "8-byte aligned",
                               dst_offset, dst.id, dst.peer);
        }
        std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(at))
            .fetch_add(add, std::memory_order_release);
        auto op = std::make_shared<OpState>(OpKind::kSignal, dst.peer, 0, sizeof(uint64_t));
        op->complete({}, sizeof(uint64_t));
        return RequestHandle(std::move(op));
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "local: cancel of an invalid handle");
        }
        const std::shared_ptr<OpState>& op = handle.state();
        bool removed = false;
        {
            std::lock_guard<std::mutex> lock(world_->mu);
            if (op->kind() == OpKind::kSend) {
                auto it = world_->boxes.find(mailbox_key(rank_, op->peer(), op->tag()));
                if (it != world_->boxes.end()) {
                    removed = erase_op(it->second.sends, op.get());
                }
            } else if (op->kind() == OpKind::kRecv) {
                auto it = world_->boxes.find(mailbox_key(op->peer(), rank_, op->tag()));
                if (it != world_->boxes.end()) {
                    removed = erase_op(it->second.recvs, op.get());
                }
            }
        }
        if (removed) {
            op->complete(Status(StatusCode::kAborted, fmt::format("local rank {}: {} cancelled",
                                                                  rank_, op_kind_name(op->kind()))),
                         0);
            return {};
        }
        if (op->done()) return {};
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "local rank {}: {} already in flight",
                           rank_, op_kind_name(op->kind()));
    }

    void close() override {
        std::vector<std::pair<std::shared_ptr<OpState>, Status>> failed;
        {
            std::lock_guard<std::mutex> lock(world_->mu);
            if (closed_) return;
            closed_ = true;
            world_->closed_[rank_] = true;
            world_->attached_[rank_] = false;
            Status mine(StatusCode::kUnavailable,
                        fmt::format("local rank {}: transport closed", rank_));
            Status theirs(StatusCode::kUnavailable,
                          fmt::format("local: peer rank {} closed its transport", rank_));
            for (auto it = world_->boxes.begin(); it != world_->boxes.end();) {
                int src = key_src(it->first);
                int dst = key_dst(it->first);
                if (src == rank_ || dst == rank_) {
                    for (auto& s : it->second.sends) {
                        failed.emplace_back(s.op, src == rank_ ? mine : theirs);
                    }
                    for (auto& r : it->second.recvs) {
                        failed.emplace_back(r.op, dst == rank_ ? mine : theirs);
                    }
                    it = world_->boxes.erase(it);
                } else {
                    ++it;
                }
            }
            for (auto it = world_->regions.begin(); it != world_->regions.end();) {
                it = it->first.first == rank_ ? world_->regions.erase(it) : std::next(it);
            }
        }
        for (auto& [op, st] : failed) op->complete(st, 0);
    }

    // Called by the factory under no lock.
    Status attach() {
        std::lock_guard<std::mutex> lock(world_->mu);
        if (world_->attached_[rank_]) {
            return PDSIM_ERROR(StatusCode::kAlreadyExists,
                               "local: rank {} already has an endpoint in this world", rank_);
        }
        world_->attached_[rank_] = true;
        world_->closed_[rank_] = false;
        closed_ = false;
        return {};
    }

private:
    // Where `bytes` at `dst_offset` of the peer's region `dst` lie: kUnavailable for a dead peer,
    // kNotFound for a region it does not have (any more), kOutOfRange past its end.
    StatusOr<uint8_t*> remote_target(const RemoteRegion& dst, size_t dst_offset, size_t bytes,
                                     std::string_view what) {
        std::lock_guard<std::mutex> lock(world_->mu);
        PDSIM_RETURN_IF_ERROR(check_alive_locked(dst.peer));
        auto it = world_->regions.find({dst.peer, dst.id});
        if (it == world_->regions.end()) {
            return PDSIM_ERROR(StatusCode::kNotFound, "local: rank {} has no region {}", dst.peer,
                               dst.id);
        }
        if (dst_offset > it->second.bytes || bytes > it->second.bytes - dst_offset) {
            return PDSIM_ERROR(StatusCode::kOutOfRange,
                               "local: {} of {} bytes at offset {} outside the {}-byte region {} "
                               "of rank {}",
                               what, bytes, dst_offset, it->second.bytes, dst.id, dst.peer);
        }
        return static_cast<uint8_t*>(it->second.base) + dst_offset;
    }

    Status check_alive_locked(int peer) const {
        if (closed_) {
            return PDSIM_ERROR(StatusCode::kUnavailable, "local rank {}: transport closed", rank_);
        }
        if (world_->closed_[peer]) {
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "local rank {}: peer rank {} closed its transport", rank_, peer);
        }
        return {};
    }

    template <typename Entry>
    static bool erase_op(std::deque<Entry>& q, const OpState* op) {
        auto it =
            std::find_if(q.begin(), q.end(), [&](const Entry& e) { return e.op.get() == op; });
        if (it == q.end()) return false;
        q.erase(it);
        return true;
    }

    std::shared_ptr<LocalWorld> world_;
    const int rank_;
    bool closed_ = true;  // under world_->mu; false once attach() succeeded
};

// "local_writes": a local endpoint seen through its one-sided operations only.
class LocalWritesTransport final : public ForwardingTransport {
public:
    explicit LocalWritesTransport(std::unique_ptr<Transport> inner)
        : ForwardingTransport(std::move(inner)) {}
    std::string_view name() const override { return "local_writes"; }
    Capabilities capabilities() const override {
        Capabilities c = ForwardingTransport::capabilities();
        c.two_sided = false;
        c.tag_matching = false;
        c.max_tag = 0;
        return c;
    }
    StatusOr<RequestHandle> post_send(int, Tag, const void*, size_t) override {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "local_writes: one-sided only (post_send is local's)");
    }
    StatusOr<RequestHandle> post_recv(int, Tag, void*, size_t) override {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "local_writes: one-sided only (post_recv is local's)");
    }
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_local_writes_transport(const TransportOptions& options) {
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner, make_local_transport(options));
    return std::unique_ptr<Transport>(std::make_unique<LocalWritesTransport>(std::move(inner)));
}

StatusOr<std::unique_ptr<Transport>> make_local_transport(const TransportOptions& options) {
    const std::shared_ptr<LocalWorld> world = options.get<LocalOptions>().world;
    if (!world) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "local: LocalOptions.world is not set (make_local_world)");
    }
    int n = world->world_size();
    if (options.rank < 0 || options.rank >= n) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "local: rank {} out of range [0, {})",
                           options.rank, n);
    }
    auto t = std::make_unique<LocalTransport>(world, options.rank);
    PDSIM_RETURN_IF_ERROR(t->attach());
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
