#include "transfer/tag_space_transport.h"

#include <fmt/format.h>

namespace pdsim::transfer {

TagSpaceTransport::TagSpaceTransport(Transport& inner, Tag base, Tag span)
    : ForwardingTransport(inner), base_(base), span_(span) {}

Capabilities TagSpaceTransport::capabilities() const {
    Capabilities caps = inner().capabilities();
    caps.max_tag = span_ - 1;
    return caps;
}

StatusOr<Tag> TagSpaceTransport::map(Tag tag) const {
    if (tag >= span_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{}: tag {} outside this tag space [0, {}) (inner tags from {})",
                           inner().name(), tag, span_, base_);
    }
    return base_ + tag;
}

StatusOr<RequestHandle> TagSpaceTransport::post_send(int peer, Tag tag, const void* buf,
                                                     size_t bytes) {
    PDSIM_ASSIGN_OR_RETURN(const Tag mapped, map(tag));
    return inner().post_send(peer, mapped, buf, bytes);
}

StatusOr<RequestHandle> TagSpaceTransport::post_recv(int peer, Tag tag, void* buf,
                                                     size_t capacity) {
    PDSIM_ASSIGN_OR_RETURN(const Tag mapped, map(tag));
    return inner().post_recv(peer, mapped, buf, capacity);
}

StatusOr<RequestHandle> TagSpaceTransport::post_send_after(const runtime::Event& ready, int peer,
                                                           Tag tag, const void* buf, size_t bytes) {
    PDSIM_ASSIGN_OR_RETURN(const Tag mapped, map(tag));
    return inner().post_send_after(ready, peer, mapped, buf, bytes);
}

StatusOr<std::vector<std::unique_ptr<TagSpaceTransport>>> split_tag_space(Transport& inner, int n,
                                                                          Tag min_span) {
    const Capabilities caps = inner.capabilities();
    if (!caps.two_sided && caps.one_sided_write) {
        // No tags to split: writes and signals name regions, which each user registers and
        // imports for itself (their descriptors travel on the user's own control tags).
        if (n < 1) return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} tag spaces", n);
        std::vector<std::unique_ptr<TagSpaceTransport>> out;
        for (int i = 0; i < n; ++i) out.push_back(std::make_unique<TagSpaceTransport>(inner, 0, 1));
        return out;
    }
    if (!caps.two_sided || !caps.tag_matching) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "transport '{}' does not match messages by tag, so it cannot be shared "
                           "by tag spaces",
                           inner.name());
    }
    if (n < 1) return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} tag spaces", n);
    const int64_t span = (static_cast<int64_t>(caps.max_tag) + 1) / n;
    if (span < min_span) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "transport '{}': max_tag {} split {} ways leaves {} tags per space, "
                           "need {}",
                           inner.name(), caps.max_tag, n, span, min_span);
    }
    std::vector<std::unique_ptr<TagSpaceTransport>> out;
    for (int i = 0; i < n; ++i) {
        out.push_back(std::make_unique<TagSpaceTransport>(inner, static_cast<Tag>(i * span),
                                                          static_cast<Tag>(span)));
    }
    return out;
}

}  // namespace pdsim::transfer
