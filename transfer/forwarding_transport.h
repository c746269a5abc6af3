// ForwardingTransport: a Transport that forwards every call to an inner transport, so that a
// decorator (transfer/fault/fault_transport.cpp, sim/testbed/shaped_transport.cpp) derives from
// it and overrides only what it changes (the shape of LevelDB's EnvWrapper).
//
// Ownership: the forwarding transport owns the inner one when given a unique_ptr (never null) and
// destroys it after the subclass's own members; given a reference it borrows it (the inner
// transport must outlive the forwarding one, and its owner closes it). Its destructor does not call
// close(): the inner transport's destructor closes the inner transport; a subclass that overrides
// close() calls it from its own destructor (virtual calls in ~ForwardingTransport would not reach
// the subclass).
//
// What a subclass must override together:
//   - If it returns handles of its own (an OpState it completes, chained from the inner handle)
//     instead of the inner transport's, it overrides cancel() (the inner transport does not know
//     that handle) and test()/wait() (so errors name the decorator; the generic
//     Transport::test/Transport::wait work on any handle).
//   - If it holds operations back (a queue, a thread), it overrides close() to fail what it holds
//     and then closes the inner transport (ForwardingTransport::close()).
//   - If it changes capabilities() (say, turns one-sided writes off), it overrides the calls that
//     the change withdraws (register_memory, deregister_memory, import_remote, post_write,
//     post_signal) to return what Transport's defaults return (kUnimplemented).
// Everything not overridden behaves exactly as the inner transport's call (name() included).
//
// Thread-safety, blocking and error codes: those of the inner transport (transfer/transport.h);
// the forwarding adds no lock and no state. inner() may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "common/status.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

class ForwardingTransport : public Transport {
public:
    // Precondition: inner is not null.
    explicit ForwardingTransport(std::unique_ptr<Transport> inner);
    // Borrows `inner` (see "Ownership").
    explicit ForwardingTransport(Transport& inner);
    ~ForwardingTransport() override = default;

    [[nodiscard]] std::string_view name() const override;
    [[nodiscard]] int rank() const override;
    [[nodiscard]] int world_size() const override;
    [[nodiscard]] Capabilities capabilities() const override;

    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                    size_t bytes) override;
    [[nodiscard]] StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf,
                                                    size_t capacity) override;

    [[nodiscard]] StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override;
    [[nodiscard]] Status deregister_memory(uint64_t id) override;
    [[nodiscard]] StatusOr<RemoteRegion> import_remote(
        int peer, std::span<const uint8_t> descriptor) override;
    [[nodiscard]] StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset,
                                                     const void* src, size_t bytes) override;
    [[nodiscard]] StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                                      uint64_t add) override;
    [[nodiscard]] StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer,
                                                          Tag tag, const void* buf,
                                                          size_t bytes) override;
    [[nodiscard]] StatusOr<RequestHandle> post_write_after(const runtime::Event& ready,
                                                           const RemoteRegion& dst,
                                                           size_t dst_offset, const void* src,
                                                           size_t bytes) override;

    [[nodiscard]] StatusOr<bool> test(const RequestHandle& handle) override;
    [[nodiscard]] Status wait(const RequestHandle& handle, Timeout timeout) override;
    [[nodiscard]] Status cancel(const RequestHandle& handle) override;

    void close() override;

protected:
    // The wrapped transport; valid for the forwarding transport's lifetime.
    [[nodiscard]] Transport& inner() const { return *inner_; }

private:
    const std::unique_ptr<Transport> owned_;
    Transport* const inner_;
};

}  // namespace pdsim::transfer
