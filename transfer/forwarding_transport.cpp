#include "transfer/forwarding_transport.h"

#include <utility>

namespace pdsim::transfer {

ForwardingTransport::ForwardingTransport(std::unique_ptr<Transport> inner)
    : owned_(std::move(inner)), inner_(owned_.get()) {}

ForwardingTransport::ForwardingTransport(Transport& inner) : inner_(&inner) {}

std::string_view ForwardingTransport::name() const {
    return inner_->name();
}
int ForwardingTransport::rank() const {
    return inner_->rank();
}
int ForwardingTransport::world_size() const {
    return inner_->world_size();
}
Capabilities ForwardingTransport::capabilities() const {
    return inner_->capabilities();
}

StatusOr<RequestHandle> ForwardingTransport::post_send(int peer, Tag tag, const void* buf,
                                                       size_t bytes) {
    return inner_->post_send(peer, tag, buf, bytes);
}

StatusOr<RequestHandle> ForwardingTransport::post_recv(int peer, Tag tag, void* buf,
                                                       size_t capacity) {
    return inner_->post_recv(peer, tag, buf, capacity);
}

StatusOr<MemoryRegion> ForwardingTransport::register_memory(void* base, size_t bytes) {
    return inner_->register_memory(base, bytes);
}

Status ForwardingTransport::deregister_memory(uint64_t id) {
    return inner_->deregister_memory(id);
}

StatusOr<RemoteRegion> ForwardingTransport::import_remote(int peer,
                                                          std::span<const uint8_t> descriptor) {
    return inner_->import_remote(peer, descriptor);
}

StatusOr<RequestHandle> ForwardingTransport::post_write(const RemoteRegion& dst, size_t dst_offset,
                                                        const void* src, size_t bytes) {
    return inner_->post_write(dst, dst_offset, src, bytes);
}

StatusOr<RequestHandle> ForwardingTransport::post_send_after(const runtime::Event& ready, int peer,
                                                             Tag tag, const void* buf,
                                                             size_t bytes) {
    return inner_->post_send_after(ready, peer, tag, buf, bytes);
}

StatusOr<RequestHandle> ForwardingTransport::post_signal(const RemoteRegion& dst, size_t dst_offset,
                                                         uint64_t add) {
    return inner_->post_signal(dst, dst_offset, add);
}

StatusOr<RequestHandle> ForwardingTransport::post_write_after(const runtime::Event& ready,
                                                              const RemoteRegion& dst,
                                                              size_t dst_offset, const void* src,
                                                              size_t bytes) {
    return inner_->post_write_after(ready, dst, dst_offset, src, bytes);
}

StatusOr<bool> ForwardingTransport::test(const RequestHandle& handle) {
    return inner_->test(handle);
}

Status ForwardingTransport::wait(const RequestHandle& handle, Timeout timeout) {
    return inner_->wait(handle, timeout);
}

Status ForwardingTransport::cancel(const RequestHandle& handle) {
    return inner_->cancel(handle);
}

void ForwardingTransport::close() {
    inner_->close();
}

}  // namespace pdsim::transfer
