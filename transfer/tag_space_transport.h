// TagSpaceTransport: a view of a shared two-sided, tag-matching transport that offers tags
// [0, span) and carries tag t as the inner transport's tag base + t, so that several users (the
// transfer engines of a hybrid model's cache groups: one for the paged KV, one for the recurrent
// states) share one transport, each with the whole engine tag plan of its own (control tag, data
// tags; transfer/engine/control.h) and none matching another's messages.
//
// split_tag_space(inner, n) cuts the inner transport's tags [0, max_tag] into n equal spaces and
// returns one view per space. Everything but the tags is the inner transport's (a decorator over
// ForwardingTransport, borrowing it): handles, capabilities (max_tag becomes span - 1), one-sided
// writes (which carry no tags). close() closes nothing: the shared transport's owner closes it,
// after every view's users are gone.
//
// A one-sided transport (writes, no two-sided operations: cuda_ipc, local_writes) has no tags to
// split: split_tag_space returns n views of all of it (span 1), since writes and signals name
// regions that each user registers and imports for itself.
//
// Errors: split_tag_space is kInvalidArgument for a two-sided transport that does not match tags
// (its messages would interleave across spaces: NCCL's ordered pairs) and for n < 1 or spaces
// too small for the engine (fewer than `min_span` tags each). post_send / post_recv outside [0,
// span) are kInvalidArgument naming the tag and the space.
//
// Thread-safety, blocking: the inner transport's.
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "transfer/forwarding_transport.h"

namespace pdsim::transfer {

class TagSpaceTransport final : public ForwardingTransport {
public:
    // Borrows `inner`; tags [0, span) map to [base, base + span). Preconditions (checked by
    // split_tag_space): span >= 1 and base + span - 1 <= inner's max_tag.
    TagSpaceTransport(Transport& inner, Tag base, Tag span);

    [[nodiscard]] Capabilities capabilities() const override;
    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                    size_t bytes) override;
    [[nodiscard]] StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf,
                                                    size_t capacity) override;
    [[nodiscard]] StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer,
                                                          Tag tag, const void* buf,
                                                          size_t bytes) override;
    void close() override {}

    [[nodiscard]] Tag base() const { return base_; }
    [[nodiscard]] Tag span() const { return span_; }

private:
    [[nodiscard]] StatusOr<Tag> map(Tag tag) const;
    const Tag base_;
    const Tag span_;
};

[[nodiscard]] StatusOr<std::vector<std::unique_ptr<TagSpaceTransport>>> split_tag_space(
    Transport& inner, int n, Tag min_span);

}  // namespace pdsim::transfer
