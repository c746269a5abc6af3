// ForwardingTransport (transfer/forwarding_transport.h): every virtual reaches the inner
// transport with its arguments and returns the inner's result (checked against a recording fake);
// a subclass that overrides one call changes only that one; and the conformance suite passes
// through a pure forwarder over the local transport.
#include "transfer/forwarding_transport.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/status_matchers.h"
#include "tests/transport_conformance.h"
#include "transfer/local/local_transport.h"
#include "transfer/tag_space_transport.h"

namespace pdsim::transfer {
namespace {

// Records each call (its name and arguments) and answers with values the test can recognise.
class RecordingTransport final : public Transport {
public:
    explicit RecordingTransport(std::vector<std::string>* calls) : calls_(calls) {}

    std::string_view name() const override { return "recording"; }
    int rank() const override { return 3; }
    int world_size() const override { return 7; }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = true;
        c.one_sided_write = true;
        c.max_tag = 41;
        c.max_message_bytes = 4242;
        return c;
    }
    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* /*buf*/,
                                      size_t bytes) override {
        record("post_send", peer, tag, bytes);
        return RequestHandle(std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes));
    }
    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* /*buf*/, size_t capacity) override {
        record("post_recv", peer, tag, capacity);
        return RequestHandle(std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity));
    }
    StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override {
        record("register_memory", 0, 0, bytes);
        return MemoryRegion{.id = 17, .base = base, .bytes = bytes, .descriptor = {1, 2}};
    }
    Status deregister_memory(uint64_t id) override {
        record("deregister_memory", 0, 0, id);
        return Status(StatusCode::kNotFound, "recording: deregister");
    }
    StatusOr<RemoteRegion> import_remote(int peer, std::span<const uint8_t> descriptor) override {
        record("import_remote", peer, 0, descriptor.size());
        return RemoteRegion{.peer = peer, .id = 23, .bytes = 99};
    }
    StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset,
                                       const void* /*src*/, size_t bytes) override {
        record("post_write", dst.peer, static_cast<Tag>(dst_offset), bytes);
        return RequestHandle(std::make_shared<OpState>(OpKind::kWrite, dst.peer, 0, bytes));
    }
    StatusOr<bool> test(const RequestHandle& handle) override {
        record("test", handle.peer(), handle.tag(), 0);
        return Status(StatusCode::kDataLoss, "recording: test");
    }
    Status wait(const RequestHandle& handle, Timeout timeout) override {
        record("wait", handle.peer(), handle.tag(),
               static_cast<uint64_t>(std::chrono::nanoseconds(timeout).count()));
        return Status(StatusCode::kDeadlineExceeded, "recording: wait");
    }
    Status cancel(const RequestHandle& handle) override {
        record("cancel", handle.peer(), handle.tag(), 0);
        return Status(StatusCode::kFailedPrecondition, "recording: cancel");
    }
    void close() override { record("close", 0, 0, 0); }

private:
    void record(const char* call, int peer, Tag tag, uint64_t n) {
        calls_->push_back(std::string(call) + " " + std::to_string(peer) + " " +
                          std::to_string(tag) + " " + std::to_string(n));
    }
    std::vector<std::string>* calls_;
};

class PlainForwarder final : public ForwardingTransport {
public:
    using ForwardingTransport::ForwardingTransport;
};

TEST(ForwardingTransport, ForwardsEveryCallWithItsArguments) {
    std::vector<std::string> calls;
    PlainForwarder t(std::make_unique<RecordingTransport>(&calls));
    EXPECT_EQ(t.name(), "recording");
    EXPECT_EQ(t.rank(), 3);
    EXPECT_EQ(t.world_size(), 7);
    EXPECT_EQ(t.capabilities().max_tag, 41u);
    EXPECT_EQ(t.capabilities().max_message_bytes, 4242u);
    EXPECT_TRUE(t.capabilities().one_sided_write);

    char buf[8] = {};
    auto send = t.post_send(1, 5, buf, 8);
    ASSERT_OK(send);
    EXPECT_EQ(send->peer(), 1);
    auto recv = t.post_recv(2, 6, buf, 7);
    ASSERT_OK(recv);
    EXPECT_EQ(recv->tag(), 6u);
    auto region = t.register_memory(buf, 8);
    ASSERT_OK(region);
    EXPECT_EQ(region->id, 17u);
    EXPECT_EQ(region->base, buf);
    EXPECT_THAT(t.deregister_memory(17), StatusIs(StatusCode::kNotFound, HasSubstr("deregister")));
    const std::vector<uint8_t> descriptor = {9, 9, 9};
    auto remote = t.import_remote(4, descriptor);
    ASSERT_OK(remote);
    EXPECT_EQ(remote->id, 23u);
    auto write = t.post_write(*remote, 3, buf, 2);
    ASSERT_OK(write);
    EXPECT_THAT(t.test(*send).status(), StatusIs(StatusCode::kDataLoss));
    EXPECT_THAT(t.wait(*recv, std::chrono::nanoseconds(11)),
                StatusIs(StatusCode::kDeadlineExceeded));
    EXPECT_THAT(t.cancel(*send), StatusIs(StatusCode::kFailedPrecondition));
    t.close();

    EXPECT_EQ(calls, (std::vector<std::string>{
                         "post_send 1 5 8",
                         "post_recv 2 6 7",
                         "register_memory 0 0 8",
                         "deregister_memory 0 0 17",
                         "import_remote 4 0 3",
                         "post_write 4 3 2",
                         "test 1 5 0",
                         "wait 2 6 11",
                         "cancel 1 5 0",
                         "close 0 0 0",
                     }));
}

// A decorator that changes one call: the rest still reach the inner transport.
class RenamingForwarder final : public ForwardingTransport {
public:
    using ForwardingTransport::ForwardingTransport;
    std::string_view name() const override { return "renamed"; }
    StatusOr<RequestHandle> post_send(int /*peer*/, Tag /*tag*/, const void* /*buf*/,
                                      size_t /*bytes*/) override {
        return Status(StatusCode::kUnimplemented, "renamed: no sends");
    }
};

TEST(ForwardingTransport, AnOverrideChangesOnlyItsCall) {
    std::vector<std::string> calls;
    RenamingForwarder t(std::make_unique<RecordingTransport>(&calls));
    EXPECT_EQ(t.name(), "renamed");
    EXPECT_EQ(t.rank(), 3);
    char buf[4] = {};
    EXPECT_THAT(t.post_send(1, 1, buf, 4).status(), StatusIs(StatusCode::kUnimplemented));
    ASSERT_OK(t.post_recv(1, 2, buf, 4));
    EXPECT_EQ(calls, (std::vector<std::string>{"post_recv 1 2 4"}));
}

TEST(ForwardingTransport, DestroysTheInnerTransport) {
    auto world = make_local_world(1);
    std::weak_ptr<LocalWorld> weak_world = world;
    {
        TransportOptions o;
        o.set(LocalOptions{.world = world});
        o.rank = 0;
        auto inner = create_transport("local", o);
        ASSERT_OK(inner);
        world.reset();
        PlainForwarder t(std::move(inner).value());
        EXPECT_EQ(t.name(), "local");
        EXPECT_FALSE(weak_world.expired());  // the inner transport holds the world
    }
    EXPECT_TRUE(weak_world.expired());
}

// Tag spaces: the recording transport's tags [0, 41] cut in two spaces of 21; a view's tag t is
// the inner tag base + t, tags past its span are refused before reaching the inner transport, its
// capabilities say max_tag 20, and closing a view leaves the shared transport open.
TEST(TagSpaceTransport, MapsTagsIntoDisjointSpaces) {
    std::vector<std::string> calls;
    RecordingTransport inner(&calls);
    auto spaces = split_tag_space(inner, 2, 16);
    ASSERT_OK(spaces);
    ASSERT_EQ(spaces->size(), 2u);
    TagSpaceTransport& second = *(*spaces)[1];
    EXPECT_EQ(second.base(), 21u);
    EXPECT_EQ(second.capabilities().max_tag, 20u);
    EXPECT_EQ(second.capabilities().max_message_bytes, 4242u);
    char buf[4] = {};
    ASSERT_OK(second.post_send(2, 3, buf, 4));
    ASSERT_OK((*spaces)[0]->post_recv(2, 3, buf, 4));
    EXPECT_THAT(second.post_send(2, 21, buf, 4).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("tag 21 outside")));
    second.close();
    EXPECT_EQ(calls, (std::vector<std::string>{"post_send 2 24 4", "post_recv 2 3 4"}));
    EXPECT_THAT(split_tag_space(inner, 3, 16).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("leaves 14 tags per space")));
}

TEST(TagSpaceTransport, RefusesATransportThatDoesNotMatchTags) {
    class Untagged final : public ForwardingTransport {
    public:
        using ForwardingTransport::ForwardingTransport;
        Capabilities capabilities() const override {
            Capabilities c = inner().capabilities();
            c.tag_matching = false;
            return c;
        }
    };
    std::vector<std::string> calls;
    RecordingTransport recording(&calls);
    Untagged untagged(recording);
    EXPECT_THAT(
        split_tag_space(untagged, 2, 1).status(),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("does not match messages by tag")));
}

// A one-sided transport has no tags to split: every view is all of it, and writes and signals
// through two views land in the regions each registered (here: two engines' words of one rank).
TEST(TagSpaceTransport, OneSidedTransportIsSharedWhole) {
    auto world = make_local_world(2);
    std::vector<std::unique_ptr<Transport>> t;
    for (int r = 0; r < 2; ++r) {
        TransportOptions o;
        o.rank = r;
        o.set(LocalOptions{.world = world});
        auto x = create_transport("local_writes", o);
        ASSERT_OK(x);
        t.push_back(std::move(x).value());
    }
    EXPECT_THAT(t[0]->post_send(1, 0, nullptr, 0).status(),
                StatusIs(StatusCode::kUnimplemented, HasSubstr("one-sided only")));
    auto senders = split_tag_space(*t[0], 2, 16);
    auto receivers = split_tag_space(*t[1], 2, 16);
    ASSERT_OK(senders);
    ASSERT_OK(receivers);
    alignas(8) uint64_t words[2] = {0, 0};
    for (int v = 0; v < 2; ++v) {
        auto mr = (*receivers)[static_cast<size_t>(v)]->register_memory(&words[v], 8);
        ASSERT_OK(mr);
        auto remote = (*senders)[static_cast<size_t>(v)]->import_remote(1, mr->descriptor);
        ASSERT_OK(remote);
        auto sig = (*senders)[static_cast<size_t>(v)]->post_signal(*remote, 0, 10 + v);
        ASSERT_OK(sig);
    }
    EXPECT_EQ(words[0], 10u);
    EXPECT_EQ(words[1], 11u);
}

class ForwardingLocalHarness : public conformance::Harness {
public:
    void run(const conformance::Body& body) override {
        auto world = make_local_world(3);
        conformance::InProcessHarness inner(
            3, [&](int rank) -> StatusOr<std::unique_ptr<Transport>> {
                TransportOptions o;
                o.set(LocalOptions{.world = world});
                o.rank = rank;
                PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> local,
                                       create_transport("local", o));
                return std::unique_ptr<Transport>(
                    std::make_unique<PlainForwarder>(std::move(local)));
            });
        inner.run(body);
    }
    [[nodiscard]] bool in_process() const override { return true; }
};
ForwardingLocalHarness g_forwarding_local;

}  // namespace

PDSIM_TRANSPORT_CONFORMANCE_TESTS(ForwardingConformance, g_forwarding_local)

}  // namespace pdsim::transfer
