// Test harness for the layerwise KV transfer engine (transfer/engine/): prefill and decode "ranks"
// with a real CpuStream, StepCounter and KV pool each, usable with threads as ranks (in-process,
// over local/tcp) and with processes as ranks (under mpirun).
//
// Prefill rank: a "compute" sequence of extend forwards on its CpuStream. Per forward it reserves
// num_layers steps (begin = advance_step(L, 1)), submits one chunk per request of the batch to the
// KvSender, then enqueues per layer: the KV write (deterministic pseudo-random bytes, see
// fill_kv), the ordering validator's checksum, and record_cache(); finally the sampled first token
// and record_aux(). Faults change exactly that sequence (record before write, skip/double record,
// late write, free/reuse before the transfer completed).
// Decode rank: pre-allocates (scrambled, partly non-contiguous) pages, submits every request,
// waits layer by layer, then checks every byte it holds against fill_kv -- which is what the
// prefill side wrote -- and, in-process, the harness also compares against the prefill pages.
// Device layouts (ClusterSpec::device): every pool on a device (the host-backed fake CUDA runtime
// of tests/host_backed_cuda_runtime.h: host memory that says it is not), the engines' and the
// compute stream's gathers, scatters and checksums through KV memory ops (InProcessDeviceOps).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "tests/host_backed_cuda_runtime.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/engine/kv_receiver.h"
#include "transfer/engine/kv_sender.h"
#include "transfer/engine/ordering_validator.h"
#include "transfer/engine/transfer_plan.h"
#include "transfer/forwarding_transport.h"
#include "transfer/local/local_transport.h"
#include "transfer/transport.h"

namespace pdsim::transfer::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

#if defined(__SANITIZE_THREAD__)
inline constexpr int kSlow = 8;  // TSan slows everything down
#else
inline constexpr int kSlow = 1;
#endif

// ---- transports for the write mode ----

// A transport with edited capabilities (tests only): what the edit withdraws (two-sided or
// one-sided operations) returns kUnimplemented, as Transport's defaults do; everything else
// forwards. "local" without its two-sided operations is a one-sided, host-memory transport --
// the engine's write mode on the CPU, as cuda_ipc is on device memory.
class CapabilityView final : public ForwardingTransport {
public:
    CapabilityView(std::unique_ptr<Transport> inner, std::string name,
                   const std::function<void(Capabilities&)>& edit)
        : ForwardingTransport(std::move(inner)), name_(std::move(name)) {
        caps_ = ForwardingTransport::capabilities();
        edit(caps_);
    }
    [[nodiscard]] std::string_view name() const override { return name_; }
    [[nodiscard]] Capabilities capabilities() const override { return caps_; }

    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                    size_t bytes) override {
        if (!caps_.two_sided) return withdrawn("post_send");
        return ForwardingTransport::post_send(peer, tag, buf, bytes);
    }
    [[nodiscard]] StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf,
                                                    size_t capacity) override {
        if (!caps_.two_sided) return withdrawn("post_recv");
        return ForwardingTransport::post_recv(peer, tag, buf, capacity);
    }
    [[nodiscard]] StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override {
        if (!caps_.one_sided_write) return withdrawn("register_memory");
        return ForwardingTransport::register_memory(base, bytes);
    }
    [[nodiscard]] Status deregister_memory(uint64_t id) override {
        if (!caps_.one_sided_write) return withdrawn("deregister_memory");
        return ForwardingTransport::deregister_memory(id);
    }
    [[nodiscard]] StatusOr<RemoteRegion> import_remote(
        int peer, std::span<const uint8_t> descriptor) override {
        if (!caps_.one_sided_write) return withdrawn("import_remote");
        return ForwardingTransport::import_remote(peer, descriptor);
    }
    [[nodiscard]] StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset,
                                                     const void* src, size_t bytes) override {
        if (!caps_.one_sided_write) return withdrawn("post_write");
        return ForwardingTransport::post_write(dst, dst_offset, src, bytes);
    }

private:
    Status withdrawn(std::string_view op) const {
        return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: {} is not supported", name_, op);
    }
    std::string name_;
    Capabilities caps_;
};

// "local" as a one-sided transport: no post_send / post_recv, no tags.
inline void one_sided_only(Capabilities& c) {
    c.two_sided = false;
    c.tag_matching = false;
    c.max_tag = 0;
}

// A fake of a GPU transport's stream-ordered posts (tests only): post_send_after /
// post_write_after hand the operation to the inner transport once `ready` has fired, from one
// thread in posting order, as a GPU transport's stream waiting on the event would; the host of
// the posting thread does not wait. Plain sends and writes posted while something is held queue
// behind it (one stream: posting order is kept, as transport.h requires), and so do signals
// (post_signal: behind the writes before them). `honour_ready` false makes a broken one that
// posts at once (a test proves the engine's checks catch what that lets through). Capabilities:
// the inner transport's, with stream_ordered.
class StreamOrderedFake final : public ForwardingTransport {
public:
    StreamOrderedFake(std::unique_ptr<Transport> inner, std::string name, bool honour_ready)
        : ForwardingTransport(std::move(inner)), name_(std::move(name)), honour_(honour_ready) {
        thread_ = std::thread([this] { run(); });
    }
    ~StreamOrderedFake() override { close(); }

    [[nodiscard]] std::string_view name() const override { return name_; }
    [[nodiscard]] Capabilities capabilities() const override {
        Capabilities c = ForwardingTransport::capabilities();
        c.stream_ordered = true;
        return c;
    }
    [[nodiscard]] StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer,
                                                          Tag tag, const void* buf,
                                                          size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        return hold(&ready, OpKind::kSend, peer, tag, bytes, [this, peer, tag, buf, bytes] {
            return inner().post_send(peer, tag, buf, bytes);
        });
    }
    [[nodiscard]] StatusOr<RequestHandle> post_write_after(const runtime::Event& ready,
                                                           const RemoteRegion& dst,
                                                           size_t dst_offset, const void* src,
                                                           size_t bytes) override {
        return hold(&ready, OpKind::kWrite, dst.peer, 0, bytes,
                    [this, dst, dst_offset, src, bytes] {
                        return inner().post_write(dst, dst_offset, src, bytes);
                    });
    }
    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                    size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        return hold(nullptr, OpKind::kSend, peer, tag, bytes, [this, peer, tag, buf, bytes] {
            return inner().post_send(peer, tag, buf, bytes);
        });
    }
    [[nodiscard]] StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset,
                                                     const void* src, size_t bytes) override {
        return hold(nullptr, OpKind::kWrite, dst.peer, 0, bytes,
                    [this, dst, dst_offset, src, bytes] {
                        return inner().post_write(dst, dst_offset, src, bytes);
                    });
    }
    // A signal follows the writes held before it, as on cuda_ipc's one stream.
    [[nodiscard]] StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                                      uint64_t add) override {
        return hold(
            nullptr, OpKind::kSignal, dst.peer, 0, sizeof(uint64_t),
            [this, dst, dst_offset, add] { return inner().post_signal(dst, dst_offset, add); });
    }
    // Ops held here are handed to the device already (kFailedPrecondition), as on a GPU.
    [[nodiscard]] Status cancel(const RequestHandle& handle) override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (const Held& h : held_) {
                if (h.op == handle.state()) {
                    return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                       "{}: the operation waits on the device", name_);
                }
            }
        }
        return ForwardingTransport::cancel(handle);
    }
    void close() override {
        std::deque<Held> dropped;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            closed_ = true;
            dropped.swap(held_);
        }
        cv_.notify_all();
        if (thread_.joinable()) thread_.join();
        for (Held& h : dropped) {
            h.op->complete(Status(StatusCode::kUnavailable, name_ + ": transport closed"), 0);
        }
        ForwardingTransport::close();
    }
    // Operations posted ahead of their event so far (held when posted).
    [[nodiscard]] int posted_ahead() const { return posted_ahead_.load(); }

private:
    struct Held {
        const runtime::Event* ready;
        std::function<StatusOr<RequestHandle>()> post;
        std::shared_ptr<OpState> op;
    };

    // `ready` null: a plain post (queued only behind what is held).
    StatusOr<RequestHandle> hold(const runtime::Event* ready, OpKind kind, int peer, Tag tag,
                                 size_t bytes, std::function<StatusOr<RequestHandle>()> post) {
        auto op = std::make_shared<OpState>(kind, peer, tag, bytes);
        if (ready != nullptr && !ready->query()) posted_ahead_.fetch_add(1);
        {
            std::unique_lock<std::mutex> lock(mu_);
            if (closed_) {
                return PDSIM_ERROR(StatusCode::kUnavailable, "{}: transport closed", name_);
            }
            if (!honour_ || (ready == nullptr && held_.empty())) {
                lock.unlock();
                forward(Held{nullptr, std::move(post), op});
                return RequestHandle(op);
            }
            held_.push_back(Held{ready, std::move(post), op});
        }
        cv_.notify_all();
        return RequestHandle(op);
    }
    static void forward(Held h) {
        StatusOr<RequestHandle> inner = h.post();
        if (!inner.ok()) {
            h.op->complete(inner.status(), 0);
            return;
        }
        inner->on_complete([op = h.op](const Status& st, size_t n) { op->complete(st, n); });
    }
    void run() {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [&] { return closed_ || !held_.empty(); });
            if (closed_) return;
            const runtime::Event* ready = held_.front().ready;
            lock.unlock();
            const bool fired =
                ready == nullptr || ready->synchronize(std::chrono::milliseconds(5)).ok();
            lock.lock();
            if (!fired || closed_ || held_.empty()) continue;
            Held h = std::move(held_.front());
            held_.pop_front();
            lock.unlock();
            forward(std::move(h));
            lock.lock();
        }
    }

    const std::string name_;
    const bool honour_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Held> held_;  // under mu_
    bool closed_ = false;    // under mu_
    std::atomic<int> posted_ahead_{0};
    std::thread thread_;
};

// A fake of NCCL's two-sided matching (tests only), over a tag-matching transport ("local"):
// capabilities say tag_matching = false, and it behaves so -- every send and receive of a (source,
// destination) pair goes to the inner transport on one tag (kInnerTag), whatever tag it was posted
// with, so messages match in post order; a receive whose capacity differs from the message's size
// fails with kDataLoss (NCCL would silently misdeliver). cancel() is kFailedPrecondition (the
// operation is handed to the device) and counted: the ordered plane never withdraws one.
// `misorder` makes a broken one that posts the first two sends to each peer in swapped order (it
// holds the first until the second comes), so a test can prove the engine catches a transport
// that does not keep the announced order.
class OrderedMatchingFake final : public ForwardingTransport {
public:
    static constexpr Tag kInnerTag = 0;

    OrderedMatchingFake(std::unique_ptr<Transport> inner, std::string name, bool misorder)
        : ForwardingTransport(std::move(inner)), name_(std::move(name)), misorder_(misorder) {}
    ~OrderedMatchingFake() override { close(); }

    [[nodiscard]] std::string_view name() const override { return name_; }
    [[nodiscard]] Capabilities capabilities() const override {
        Capabilities c = ForwardingTransport::capabilities();
        c.tag_matching = false;
        return c;
    }
    [[nodiscard]] StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                    size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        if (!misorder_) return inner().post_send(peer, kInnerTag, buf, bytes);
        std::unique_lock<std::mutex> lock(mu_);
        if (closed_) return PDSIM_ERROR(StatusCode::kUnavailable, "{}: transport closed", name_);
        int& sends = sends_[peer];
        ++sends;
        if (sends == 1) {
            // Held until the next send to this peer overtakes it.
            auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
            held_[peer] = Held{op, buf, bytes};
            return RequestHandle(op);
        }
        StatusOr<RequestHandle> h = inner().post_send(peer, kInnerTag, buf, bytes);
        auto it = held_.find(peer);
        if (it != held_.end()) {
            Held first = it->second;
            held_.erase(it);
            lock.unlock();
            forward(first, inner().post_send(peer, kInnerTag, first.buf, first.bytes));
        }
        return h;
    }
    [[nodiscard]] StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf,
                                                    size_t capacity) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
        PDSIM_ASSIGN_OR_RETURN(RequestHandle in, inner().post_recv(peer, kInnerTag, buf, capacity));
        auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        in.on_complete([op, capacity, name = name_](const Status& st, size_t n) {
            if (st.code() == StatusCode::kOutOfRange || (st.ok() && n != capacity)) {
                op->complete(Status(StatusCode::kDataLoss,
                                    fmt::format("{}: a message of {} bytes matched a receive of "
                                                "{} bytes (sizes must be equal){}",
                                                name, st.ok() ? std::to_string(n) : "more",
                                                capacity, st.ok() ? "" : ": " + st.message())),
                             0);
                return;
            }
            op->complete(st, n);
        });
        return RequestHandle(op);
    }
    [[nodiscard]] Status cancel(const RequestHandle& handle) override {
        if (handle.done()) return {};
        cancels_.fetch_add(1);
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "{}: a posted operation cannot be withdrawn", name_);
    }
    void close() override {
        std::map<int, Held> dropped;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            closed_ = true;
            dropped.swap(held_);
        }
        for (auto& [peer, h] : dropped) {
            h.op->complete(Status(StatusCode::kUnavailable, name_ + ": transport closed"), 0);
        }
        ForwardingTransport::close();
    }
    // cancel() calls on pending operations so far.
    [[nodiscard]] int cancels() const { return cancels_.load(); }

private:
    struct Held {
        std::shared_ptr<OpState> op;
        const void* buf = nullptr;
        size_t bytes = 0;
    };
    static void forward(const Held& h, StatusOr<RequestHandle> inner) {
        if (!inner.ok()) {
            h.op->complete(inner.status(), 0);
            return;
        }
        inner->on_complete([op = h.op](const Status& st, size_t n) { op->complete(st, n); });
    }

    const std::string name_;
    const bool misorder_;
    std::mutex mu_;
    std::map<int, int> sends_;  // under mu_: sends posted per peer (misorder)
    std::map<int, Held> held_;  // under mu_
    bool closed_ = false;       // under mu_
    std::atomic<int> cancels_{0};
};

// Registers the test transports (idempotent):
//   local_device_writes  "local_writes" (pdsim's: local without two-sided operations) that also
//                        claims device memory: with a host-backed "CUDA" runtime
//                        (a device-kind pool in host memory) it plays cuda_ipc on the CPU.
//   local_device         "local" (two-sided) that also claims device memory: a two-sided data
//                        transport of device layouts over the host-backed runtime.
//   local_ordered, local_device_ordered
//                        OrderedMatchingFake over "local" (over local_device): NCCL's untagged
//                        in-order matching, for the engine's ordered data plane;
//   local_ordered_misordered  ... broken: swaps the first two sends to each peer.
//   local_device_gated_ordered(_broken)  StreamOrderedFake over local_device_ordered (NCCL's
//                        stream order; "_broken": posts without waiting for the event).
inline void register_test_transports() {
    static const bool done = [] {
        for (const bool device : {false, true}) {
            for (const bool misorder : {false, true}) {
                if (device && misorder) continue;
                const std::string name =
                    std::string(device ? "local_device_ordered" : "local_ordered") +
                    (misorder ? "_misordered" : "");
                TransportDescriptor d = local_transport_descriptor();
                d.name = name;
                d.caps.tag_matching = false;
                d.caps.device_memory = device;
                d.summary = "tests: local matching in post order without tags (nccl's kind)";
                register_transport(
                    d,
                    [name, device,
                     misorder](const TransportOptions& o) -> StatusOr<std::unique_ptr<Transport>> {
                        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner,
                                               make_local_transport(o));
                        auto view = std::make_unique<CapabilityView>(
                            std::move(inner), name,
                            [device](Capabilities& c) { c.device_memory = device; });
                        return std::unique_ptr<Transport>(
                            std::make_unique<OrderedMatchingFake>(std::move(view), name, misorder));
                    });
            }
        }
        for (const bool broken : {false, true}) {
            const std::string name =
                std::string("local_device_gated_ordered") + (broken ? "_broken" : "");
            TransportDescriptor d = local_transport_descriptor();
            d.name = name;
            d.caps.tag_matching = false;
            d.caps.device_memory = true;
            d.caps.stream_ordered = true;
            d.summary = "tests: stream-ordered fake over the ordered fake over local";
            register_transport(
                d,
                [name, broken](const TransportOptions& o) -> StatusOr<std::unique_ptr<Transport>> {
                    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner,
                                           make_local_transport(o));
                    auto view = std::make_unique<CapabilityView>(
                        std::move(inner), name, [](Capabilities& c) { c.device_memory = true; });
                    auto ordered =
                        std::make_unique<OrderedMatchingFake>(std::move(view), name, false);
                    return std::unique_ptr<Transport>(
                        std::make_unique<StreamOrderedFake>(std::move(ordered), name, !broken));
                });
        }
        TransportDescriptor two_sided = local_transport_descriptor();
        two_sided.name = "local_device";
        two_sided.caps.device_memory = true;
        two_sided.summary = "tests: local claiming device memory";
        register_transport(
            two_sided, [](const TransportOptions& o) -> StatusOr<std::unique_ptr<Transport>> {
                PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner, make_local_transport(o));
                return std::unique_ptr<Transport>(std::make_unique<CapabilityView>(
                    std::move(inner), "local_device",
                    [](Capabilities& c) { c.device_memory = true; }));
            });
        {
            // "local_writes" itself is pdsim's (transfer/local/local_transport.h); this is it
            // claiming device memory.
            TransportDescriptor d = local_writes_transport_descriptor();
            d.name = "local_device_writes";
            d.caps.device_memory = true;
            d.summary = "tests: local with one-sided writes only, claiming device memory";
            register_transport(
                d, [](const TransportOptions& o) -> StatusOr<std::unique_ptr<Transport>> {
                    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner,
                                           make_local_writes_transport(o));
                    return std::unique_ptr<Transport>(std::make_unique<CapabilityView>(
                        std::move(inner), "local_device_writes",
                        [](Capabilities& c) { c.device_memory = true; }));
                });
        }
        // Stream-ordered fakes of a GPU transport (StreamOrderedFake) over local_device and
        // local_device_writes; "_broken" ones post without waiting for the event.
        for (const bool writes : {false, true}) {
            for (const bool broken : {false, true}) {
                const std::string name = std::string("local_device_gated") +
                                         (writes ? "_writes" : "") + (broken ? "_broken" : "");
                TransportDescriptor d = local_transport_descriptor();
                d.name = name;
                d.caps.device_memory = true;
                d.caps.stream_ordered = true;
                if (writes) {
                    d.caps.two_sided = false;
                    d.caps.tag_matching = false;
                }
                d.summary = "tests: stream-ordered fake over local";
                register_transport(
                    d,
                    [name, writes,
                     broken](const TransportOptions& o) -> StatusOr<std::unique_ptr<Transport>> {
                        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner,
                                               make_local_transport(o));
                        auto view = std::make_unique<CapabilityView>(std::move(inner), name,
                                                                     [writes](Capabilities& c) {
                                                                         if (writes)
                                                                             one_sided_only(c);
                                                                         c.device_memory = true;
                                                                     });
                        return std::unique_ptr<Transport>(
                            std::make_unique<StreamOrderedFake>(std::move(view), name, !broken));
                    });
            }
        }
        return true;
    }();
    (void)done;
}

// ---- device memory ----

// An in-process stand-in for a GPU's KV memory ops (tests only): HostKvMemoryOps running on the
// memory of the host-backed fake CUDA runtime (tests/host_backed_cuda_runtime.h), which is host
// memory, while declaring kCuda memory as the CUDA ops do; its staging and sums are host memory
// too. It counts its calls, so a test can prove that the engine's device path ran them, and can
// be poisoned, so a test can prove that a wrong result of an op is caught:
//   kGather     every gathered message's first byte is flipped after the gather;
//   kScatter    every scattered token's first byte is flipped in the pages after the scatter;
//   kChecksums  1 is added to the first sum of every checksum op.
// Its staging is handed out filled with 0xA5 (a gather that did not run shows).
class InProcessDeviceOps final : public KvMemoryOps {
public:
    enum class Poison { kNone, kGather, kScatter, kChecksums };
    explicit InProcessDeviceOps(Poison poison = Poison::kNone) : poison_(poison) {}

    [[nodiscard]] runtime::DeviceKind memory_kind() const override {
        return runtime::DeviceKind::kCuda;
    }
    [[nodiscard]] std::string_view name() const override {
        return "in-process stand-in (host ops on host-backed cuda memory)";
    }
    [[nodiscard]] Status enqueue_gather(runtime::Stream& stream, const KvLayout& layout,
                                        std::span<const KvCopyOp> ops,
                                        std::byte* staging) override {
        PDSIM_ASSIGN_OR_RETURN(KvLayout host, as_host(layout));
        PDSIM_RETURN_IF_ERROR(host_.enqueue_gather(stream, host, ops, staging));
        gathers_.fetch_add(1);
        if (poison_ != Poison::kGather) return {};
        return stream.enqueue([staging, ops = std::vector<KvCopyOp>(ops.begin(), ops.end())] {
            for (const KvCopyOp& op : ops) {
                if (op.token_count > 0) staging[op.dst_offset] ^= std::byte{0xFF};
            }
            return Status();
        });
    }
    [[nodiscard]] Status enqueue_scatter(runtime::Stream& stream, const KvLayout& layout,
                                         std::span<const KvCopyOp> ops,
                                         const std::byte* staging) override {
        PDSIM_ASSIGN_OR_RETURN(KvLayout host, as_host(layout));
        PDSIM_RETURN_IF_ERROR(host_.enqueue_scatter(stream, host, ops, staging));
        scatters_.fetch_add(1);
        if (poison_ != Poison::kScatter) return {};
        return stream.enqueue([host, ops = std::vector<KvCopyOp>(ops.begin(), ops.end())] {
            for (const KvCopyOp& op : ops) {
                for (int64_t k = 0; k < op.token_count; ++k) {
                    host.base(op.layer,
                              op.buf)[static_cast<uint64_t>(op.dst_slot + k) * op.dst_stride +
                                      op.dst_offset] ^= std::byte{0xFF};
                }
            }
            return Status();
        });
    }
    [[nodiscard]] Status enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                           std::span<const KvChecksumOp> ops,
                                           uint64_t* sums_out) override {
        PDSIM_ASSIGN_OR_RETURN(KvLayout host, as_host(layout));
        PDSIM_RETURN_IF_ERROR(host_.enqueue_checksums(stream, host, ops, sums_out));
        checksums_.fetch_add(1);
        if (poison_ != Poison::kChecksums) return {};
        return stream.enqueue([sums_out, ops = std::vector<KvChecksumOp>(ops.begin(), ops.end())] {
            for (const KvChecksumOp& op : ops) {
                if (op.token_count > 0) sums_out[op.sum_index] += 1;
            }
            return Status();
        });
    }
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_staging(size_t bytes) override {
        PDSIM_ASSIGN_OR_RETURN(KvOpsMemory m, host_.allocate_staging(bytes));
        std::memset(m.data(), 0xA5, m.size());
        staging_allocations_.fetch_add(1);
        return m;
    }
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_sums(size_t count) override {
        sums_allocations_.fetch_add(1);
        return host_.allocate_sums(count);
    }

    [[nodiscard]] uint64_t gathers() const { return gathers_.load(); }
    [[nodiscard]] uint64_t scatters() const { return scatters_.load(); }
    [[nodiscard]] uint64_t checksums() const { return checksums_.load(); }
    [[nodiscard]] uint64_t staging_allocations() const { return staging_allocations_.load(); }
    [[nodiscard]] uint64_t sums_allocations() const { return sums_allocations_.load(); }

private:
    // The same memory, declared as host memory (it is: the fake runtime allocates on the heap),
    // for the host ops. A layout of another memory than kCuda is refused as the CUDA ops do.
    static StatusOr<KvLayout> as_host(const KvLayout& layout) {
        if (layout.device().kind != runtime::DeviceKind::kCuda) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "layout: memory on {}; the stand-in device ops work on cuda memory",
                               runtime::device_kind_name(layout.device().kind));
        }
        std::vector<std::byte*> bases;
        for (int l = 0; l < layout.num_layers(); ++l) {
            for (int b = 0; b < layout.buffer_count(); ++b) bases.push_back(layout.base(l, b));
        }
        return KvLayout::create(layout.summary(), layout.num_pages(), std::move(bases));
    }

    const Poison poison_;
    HostKvMemoryOps host_;
    std::atomic<uint64_t> gathers_{0};
    std::atomic<uint64_t> scatters_{0};
    std::atomic<uint64_t> checksums_{0};
    std::atomic<uint64_t> staging_allocations_{0};
    std::atomic<uint64_t> sums_allocations_{0};
};

// ---- deterministic KV content ----

inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// The bytes of head `head` (global; 0 for MLA) of token `token` of (request, layer, buffer).
// `gen` != 0 gives different bytes (late writes, reused pages).
inline void fill_kv(std::byte* dst, size_t n, uint64_t seed, uint64_t req, int layer, int buf,
                    int head, int64_t token, uint32_t gen) {
    uint64_t s = mix64(seed ^ mix64(req * 0x100000001B3ull + static_cast<uint64_t>(layer)) ^
                       mix64((static_cast<uint64_t>(buf) << 32) | static_cast<uint32_t>(head)) ^
                       mix64(static_cast<uint64_t>(token) * 31 + gen));
    for (size_t i = 0; i < n; i += 8) {
        const uint64_t v = mix64(s + i);
        std::memcpy(dst + i, &v, std::min<size_t>(8, n - i));
    }
}

// ---- cluster description ----

struct ModelSpec {
    KvKind kind = KvKind::kMHA;
    int layers = 4;
    int kv_heads = 4;  // MHA total KV heads
    int head_dim = 8;
    int mla_lora = 24;  // MLA: kv_lora_rank + rope_dim = mla_lora + mla_rope
    int mla_rope = 8;
    kv::KVDtype dtype = kv::KVDtype::kF32;
};

struct InstanceSpec {
    int tp = 1;
    int page_size = 16;
    int num_pages = 256;
};

// Where the ranks' KV lives. Host by default; a device (the host-backed fake CUDA runtime)
// needs the compute stream's checksums through `compute_ops` (enqueue_layer_checksum), and the
// engines their ops through their options (kv_memory_ops_for_testing).
struct DeviceSpec {
    runtime::Device memory{};
    KvMemoryOps* compute_ops = nullptr;
    // The prefill ranks' compute streams (and StepCounters) on the fake GPU too, as on a GPU
    // rank, so that the engine's comm stream can be gated on them (device gating); the counters
    // use the CPU implementation, registered for the fake device's kind. False: CPU streams.
    bool compute_on_device = false;
};

// A prefill rank's compute stream: a CpuStream, or (DeviceSpec::compute_on_device) a stream of
// the host-backed fake GPU with the CPU StepCounter registered for it.
inline std::unique_ptr<runtime::Stream> make_compute_stream(const DeviceSpec& device) {
    if (!device.compute_on_device) {
        return std::make_unique<runtime::CpuStream>("prefill-compute");
    }
    static const bool registered = [] {
        pd::register_step_counter_impl(runtime::DeviceKind::kCuda, &pd::make_cpu_step_counter_impl);
        return true;
    }();
    (void)registered;
    return std::make_unique<runtime::testing::HostBackedCudaStream>(device.memory.index,
                                                                    "prefill-compute");
}

struct ClusterSpec {
    ModelSpec model;
    std::vector<InstanceSpec> prefill;
    std::vector<InstanceSpec> decode;
    DeviceSpec device;

    [[nodiscard]] int world_size() const {
        int n = 0;
        for (const auto& i : prefill) n += i.tp;
        for (const auto& i : decode) n += i.tp;
        return n;
    }
    // World rank of (prefill?, instance, tp rank): prefill instances first, then decode.
    [[nodiscard]] int rank_of(bool is_prefill, int instance, int tp_rank) const {
        int r = 0;
        if (!is_prefill) {
            for (const auto& i : prefill) r += i.tp;
        }
        const auto& v = is_prefill ? prefill : decode;
        for (int k = 0; k < instance; ++k) r += v[static_cast<size_t>(k)].tp;
        return r + tp_rank;
    }
    struct Role {
        bool is_prefill;
        int instance;
        int tp_rank;
    };
    [[nodiscard]] Role role_of(int rank) const {
        int r = 0;
        for (int k = 0; k < static_cast<int>(prefill.size()); ++k) {
            if (rank < r + prefill[static_cast<size_t>(k)].tp) return {true, k, rank - r};
            r += prefill[static_cast<size_t>(k)].tp;
        }
        for (int k = 0; k < static_cast<int>(decode.size()); ++k) {
            if (rank < r + decode[static_cast<size_t>(k)].tp) return {false, k, rank - r};
            r += decode[static_cast<size_t>(k)].tp;
        }
        return {false, -1, -1};
    }
    [[nodiscard]] std::vector<int> prefill_ranks(int instance) const {
        std::vector<int> out;
        for (int t = 0; t < prefill[static_cast<size_t>(instance)].tp; ++t) {
            out.push_back(rank_of(true, instance, t));
        }
        return out;
    }
};

struct RequestSpec {
    uint64_t id = 0;
    int64_t tokens = 1;
    int prefill_instance = 0;
    int decode_instance = 0;
    int64_t chunk = 0;  // chunked prefill: tokens per forward (0: one forward)
};

struct Fault {
    enum Kind {
        kNone,
        kRecordBeforeWrite,    // record(layer) enqueued before write(layer)
        kSkipRecord,           // record(layer) never enqueued
        kDoubleRecord,         // record(layer) enqueued twice
        kLateWrite,            // layer rewritten after its record (before the last record)
        kFreeBeforeTransfer,   // prefill frees the pages (through the pins) mid-transfer
        kReuseBeforeTransfer,  // prefill frees the pages behind the engine's back, reuses them
        kDecodeFreeEarly,      // decode frees its destination pages mid-transfer
        kLostFirstToken,       // the request's first token is never written; its aux record
                               // still comes (a CUDA stream's record kernel after a failed task)
    };
    Kind kind = kNone;
    uint64_t request = 0;
    int layer = 1;
};

inline const char* fault_name(Fault::Kind k) {
    switch (k) {
        case Fault::kNone:
            return "none";
        case Fault::kRecordBeforeWrite:
            return "record-before-write";
        case Fault::kSkipRecord:
            return "skip-record";
        case Fault::kDoubleRecord:
            return "double-record";
        case Fault::kLateWrite:
            return "late-write";
        case Fault::kFreeBeforeTransfer:
            return "free-before-transfer";
        case Fault::kReuseBeforeTransfer:
            return "reuse-before-transfer";
        case Fault::kDecodeFreeEarly:
            return "decode-free-early";
        case Fault::kLostFirstToken:
            return "lost-first-token";
    }
    return "?";
}

// A one-shot host-side gate.
class Gate {
public:
    void open() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            open_ = true;
        }
        cv_.notify_all();
    }
    bool wait(std::chrono::milliseconds timeout) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return open_; });
    }
    bool is_open() {
        std::lock_guard<std::mutex> lock(mu_);
        return open_;
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool open_ = false;
};

struct RunOptions {
    uint64_t seed = 1;
    int batch = 4;  // requests per forward
    int layer_interval = 1;
    Fault fault;
    std::chrono::milliseconds wait{60'000 * kSlow};  // bound on waiting for requests
    // Prefill compute of the first forward blocks (on its stream) before writing this layer
    // until `hold` opens (overlap tests, kill tests).
    Gate* hold = nullptr;
    int hold_layer = -1;
    // How long a fault's compute-stream wait for the engine (e.g. "layer sent") lasts at most.
    // Device gating lets the transport queue sends behind a send whose record is behind that
    // very wait, so there it cannot be met and only bounds the fault's window.
    std::chrono::milliseconds fault_wait{5000 * kSlow};
    // Decode: wait for every layer in order (wait_layer) before waiting for completion.
    bool wait_layers = true;
    bool scramble_pages = true;
    // Decode ranks call this after submitting (e.g. to signal a test thread).
    std::function<void(int rank)> after_submit;
    // Decode ranks open this once their fault is done (kDecodeFreeEarly: the free was tried).
    Gate* after_fault = nullptr;
};

struct RankResult {
    int rank = -1;
    bool is_prefill = false;
    EngineStats stats;
    OrderingReport report;
    std::map<uint64_t, RequestStatus> statuses;
    std::vector<std::string> errors;  // harness-level problems (byte mismatches, bad states)
    uint64_t bytes_checked = 0;
};

// `device`: where the pool lives (host by default; a CUDA pool needs a GPU, or the host-backed
// fake runtime of tests/host_backed_cuda_runtime.h).
inline std::unique_ptr<kv::KVPool> make_pool(const ModelSpec& m, const InstanceSpec& inst,
                                             int tp_rank, KvLayout* layout,
                                             runtime::Device device = {}) {
    if (m.kind == KvKind::kMHA) {
        auto slice = kv_head_slice(m.kv_heads, inst.tp, tp_rank);
        EXPECT_TRUE(slice.ok()) << slice.status().to_string();
        kv::MHAPoolConfig c;
        c.num_layers = m.layers;
        c.num_pages = inst.num_pages;
        c.page_size = inst.page_size;
        c.num_kv_heads = slice->count;
        c.head_dim = m.head_dim;
        c.dtype = m.dtype;
        c.device = device;
        auto pool = kv::MHATokenToKVPool::create(c);
        EXPECT_TRUE(pool.ok()) << pool.status().to_string();
        auto l = KvLayout::from_mha_pool(**pool, inst.tp, tp_rank, m.kv_heads);
        EXPECT_TRUE(l.ok()) << l.status().to_string();
        *layout = *l;
        return std::move(pool).value();
    }
    kv::MLAPoolConfig c;
    c.num_layers = m.layers;
    c.num_pages = inst.num_pages;
    c.page_size = inst.page_size;
    c.kv_lora_rank = m.mla_lora;
    c.rope_dim = m.mla_rope;
    c.dtype = m.dtype;
    c.device = device;
    auto pool = kv::MLATokenToKVPool::create(c);
    EXPECT_TRUE(pool.ok()) << pool.status().to_string();
    auto l = KvLayout::from_mla_pool(**pool, inst.tp, tp_rank);
    EXPECT_TRUE(l.ok()) << l.status().to_string();
    *layout = *l;
    return std::move(pool).value();
}

// Writes fill_kv bytes for tokens [t0, t1) of every buffer of `layer`.
inline void write_layer(const KvLayout& L, const std::vector<int32_t>& pages, uint64_t seed,
                        uint64_t req, int layer, int64_t t0, int64_t t1, uint32_t gen) {
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t slot = token_slot(pages, L.page_size(), t);
        for (int b = 0; b < L.buffer_count(); ++b) {
            std::byte* tok = L.slot_addr(layer, b, slot);
            const size_t hb = L.head_bytes(b);
            for (int h = 0; h < L.local_heads(); ++h) {
                fill_kv(tok + static_cast<size_t>(h) * hb, hb, seed, req, layer, b,
                        L.head_begin() + h, t, gen);
            }
        }
    }
}

// Polls `pred` until true or `timeout` (for state that settles asynchronously).
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!pred()) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

inline int32_t first_token_of(uint64_t req) {
    return static_cast<int32_t>(mix64(req) % 50000);
}

// ---------------------------------------------------------------------------------------------
class PrefillRank {
public:
    PrefillRank(Transport& t, const ClusterSpec& cluster, int instance, int tp_rank,
                SenderOptions opts)
        : cluster_(cluster),
          inst_(cluster.prefill[static_cast<size_t>(instance)]),
          instance_(instance),
          stream_(make_compute_stream(cluster.device)),
          counter_(*stream_),
          validator_(t.rank()) {
        pool_ = make_pool(cluster.model, inst_, tp_rank, &layout_, cluster.device.memory);
        // Poison: a read before the write must not find the right bytes left over from an
        // earlier run in recycled memory.
        EXPECT_TRUE(pool_->fill(0xA5).ok());
        opts.validator = &validator_;
        auto user_hook = opts.on_event;
        opts.on_event = [this, user_hook](const TransferEvent& e) {
            on_event(e);
            if (user_hook) user_hook(e);
        };
        auto s = KvSender::create(t, layout_, counter_, opts);
        EXPECT_TRUE(s.ok()) << s.status().to_string();
        if (s.ok()) sender_ = std::move(s).value();
    }

    ~PrefillRank() {
        sender_.reset();
        stream_->synchronize().ignore_error();
    }

    // Shuts the engine down (graceful), so that its transports may be closed before this rank
    // (and its pool) goes: kv_sender.h, "Lifetime". Null-safe when create() failed.
    void shutdown_engine() {
        if (sender_) sender_->shutdown();
    }

    KvSender& sender() { return *sender_; }
    kv::KVPool& pool() { return *pool_; }
    const KvLayout& layout() const { return layout_; }
    OrderingValidator& validator() { return validator_; }
    const std::vector<int32_t>& pages(uint64_t id) { return pages_.at(id); }

    struct Piece {
        uint64_t id;
        int64_t t0, t1;
        bool last;
        // A copy for the stream tasks: the scheduler thread keeps adding to pages_ meanwhile.
        std::shared_ptr<const std::vector<int32_t>> pages;
    };

    void run(const std::vector<RequestSpec>& all, const RunOptions& o, RankResult* out) {
        out->is_prefill = true;
        std::vector<RequestSpec> mine;
        for (const auto& r : all) {
            if (r.prefill_instance == instance_) mine.push_back(r);
        }
        const int L = cluster_.model.layers;
        bool first_forward = true;
        std::set<uint64_t> aborted_submits;  // requests whose submit_chunk said kAborted
        for (size_t g = 0; g < mine.size(); g += static_cast<size_t>(o.batch)) {
            std::vector<RequestSpec> group(
                mine.begin() + static_cast<std::ptrdiff_t>(g),
                mine.begin() + static_cast<std::ptrdiff_t>(
                                   std::min(mine.size(), g + static_cast<size_t>(o.batch))));
            std::map<uint64_t, int64_t> done;
            for (const auto& r : group) {
                const int64_t need = (r.tokens + inst_.page_size - 1) / inst_.page_size;
                auto p = pool_->allocator().alloc(static_cast<int>(need));
                if (!p.ok()) {
                    out->errors.push_back("prefill alloc: " + p.status().to_string());
                    return;
                }
                pages_[r.id] = *p;
                auto tok = std::make_unique<int32_t>(-1);
                tokens_[r.id] = std::move(tok);
                Status st = sender_->add_request({.request_id = r.id, .num_tokens = r.tokens});
                if (!st.ok()) out->errors.push_back("add_request: " + st.to_string());
                done[r.id] = 0;
            }
            // Forwards: each takes the next chunk of every unfinished request of the group.
            while (true) {
                std::vector<Piece> fwd;
                for (const auto& r : group) {
                    int64_t& d = done[r.id];
                    if (d >= r.tokens) continue;
                    const int64_t step = r.chunk > 0 ? r.chunk : r.tokens;
                    const int64_t t1 = std::min(r.tokens, d + step);
                    fwd.push_back({r.id, d, t1, t1 == r.tokens,
                                   std::make_shared<const std::vector<int32_t>>(pages_[r.id])});
                    d = t1;
                }
                if (fwd.empty()) break;
                const int64_t aux_begin = counter_.current_aux_step();
                const int64_t begin = counter_.advance_step(L, 1);
                for (const Piece& p : fwd) {
                    SendChunk c;
                    c.request_id = p.id;
                    c.src_pages = pages_[p.id];
                    c.token_begin = p.t0;
                    c.token_end = p.t1;
                    c.begin_step = begin;
                    c.layer_interval = o.layer_interval;
                    c.is_last = p.last;
                    c.first_token_src = tokens_[p.id].get();
                    c.first_token_aux_step = aux_begin;
                    Status st = sender_->submit_chunk(std::move(c));
                    // kAborted is the contract for a request that already failed (a dead or
                    // faulty peer can fail it between two chunks); its wait below must then
                    // report Failed. Any other error is the harness's or the engine's bug.
                    if (st.code() == StatusCode::kAborted) {
                        aborted_submits.insert(p.id);
                    } else if (!st.ok()) {
                        out->errors.push_back("submit_chunk: " + st.to_string());
                    }
                }
                enqueue_forward(fwd, o, first_forward);
                first_forward = false;
            }
        }
        // Wait for every request to end (Success or Failed).
        const auto deadline = Clock::now() + o.wait;
        for (const auto& r : mine) {
            auto left = std::max<Clock::duration>(deadline - Clock::now(), 0ms);
            auto st = sender_->wait(r.id, left);
            if (!st.ok()) {
                out->errors.push_back("prefill wait: " + st.status().to_string());
                continue;
            }
            if (aborted_submits.count(r.id) > 0 && st->state != RequestState::kFailed) {
                out->errors.push_back(
                    fmt::format("request {}: submit_chunk said kAborted but the request ended {}",
                                r.id, request_state_name(st->state)));
            }
            out->statuses[r.id] = *st;
        }
        Status sync = stream_->synchronize();
        if (!sync.ok()) out->errors.push_back("prefill stream: " + sync.to_string());
        out->stats = sender_->stats();
        out->report = validator_.report();
    }

    // Events from the sender (any thread).
    void on_event(const TransferEvent& e) {
        if (e.kind != TransferEvent::Kind::kLayerSent) return;
        std::lock_guard<std::mutex> lock(mu_);
        sent_[{e.request, e.layer}] += 1;
        auto it = sent_gates_.find({e.request, e.layer});
        if (it != sent_gates_.end()) it->second->open();
    }

private:
    std::shared_ptr<Gate> sent_gate(uint64_t req, int layer) {
        std::lock_guard<std::mutex> lock(mu_);
        auto& g = sent_gates_[{req, layer}];
        if (!g) g = std::make_shared<Gate>();
        if (sent_[{req, layer}] > 0) g->open();
        return g;
    }

    void check(Status st, const char* what) {
        EXPECT_TRUE(st.ok()) << what << ": " << st.to_string();
    }

    void enqueue_forward(const std::vector<Piece>& fwd, const RunOptions& o, bool first) {
        const int L = cluster_.model.layers;
        const Fault& f = o.fault;
        bool faulty = false;
        for (const Piece& p : fwd) faulty = faulty || (f.kind != Fault::kNone && p.id == f.request);
        // Faults apply to the forward holding the faulty request's first chunk.
        if (faulty) {
            bool first_chunk = false;
            for (const Piece& p : fwd)
                first_chunk = first_chunk || (p.id == f.request && p.t0 == 0);
            faulty = first_chunk;
        }
        auto write = [this, fwd, seed = o.seed](int l, uint32_t gen) {
            return [this, fwd, seed, l, gen]() {
                for (const Piece& p : fwd) {
                    write_layer(layout_, *p.pages, seed, p.id, l, p.t0, p.t1, gen);
                }
                return Status();
            };
        };
        for (int l = 0; l < L; ++l) {
            if (first && o.hold != nullptr && l == o.hold_layer) {
                Gate* g = o.hold;
                check(stream_->enqueue([g, o] {
                    // A bounded hold: a test that forgets to open fails, not hangs.
                    return g->wait(o.wait) ? Status()
                                           : Status(StatusCode::kDeadlineExceeded, "hold");
                }),
                      "hold");
            }
            const bool at = faulty && l == f.layer;
            if (at && (f.kind == Fault::kRecordBeforeWrite)) {
                check(counter_.record_cache(), "record");
                // The write waits (bounded) until the sender has sent this layer: the engine
                // read it before it was written.
                auto g = sent_gate(f.request, l);
                check(stream_->enqueue([g, wait = o.fault_wait] {
                    g->wait(wait);
                    return Status();
                }),
                      "gate");
                check(stream_->enqueue(write(l, 0)), "write");
                enqueue_checksums(fwd, l);
                continue;
            }
            if (faulty && f.kind == Fault::kDoubleRecord && l == f.layer + 1) {
                // Layer f was recorded twice, so layer f+1 looks ready before it is written.
                auto g = sent_gate(f.request, l);
                check(stream_->enqueue([g, wait = o.fault_wait] {
                    g->wait(wait);
                    return Status();
                }),
                      "gate");
            }
            if (faulty &&
                (f.kind == Fault::kFreeBeforeTransfer || f.kind == Fault::kReuseBeforeTransfer) &&
                l == f.layer) {
                // Mid-transfer: layer f-1 has been sent, layer f is not written yet.
                auto g = sent_gate(f.request, l - 1);
                const uint64_t id = f.request;
                const Fault::Kind kind = f.kind;
                std::shared_ptr<const std::vector<int32_t>> pages;
                for (const Piece& p : fwd) {
                    if (p.id == id) pages = p.pages;
                }
                check(stream_->enqueue(
                          [this, g, id, kind, pages, seed = o.seed, wait = o.fault_wait] {
                              g->wait(wait);
                              free_mid_transfer(id, kind, *pages, seed);
                              return Status();
                          }),
                      "free");
            }
            check(stream_->enqueue(write(l, 0)), "write");
            enqueue_checksums(fwd, l);
            if (faulty && f.kind == Fault::kLateWrite && l == L - 1) {
                // Rewrite layer f after its record, before the last record (so the engine
                // cannot have finished the request before the late write).
                for (const Piece& p : fwd) {
                    if (p.id != f.request) continue;
                    check(stream_->enqueue([this, p, seed = o.seed, layer = f.layer] {
                        write_layer(layout_, *p.pages, seed, p.id, layer, p.t0, p.t1, 7);
                        return Status();
                    }),
                          "late write");
                }
            }
            if (at && f.kind == Fault::kSkipRecord) continue;
            check(counter_.record_cache(), "record");
            if (at && f.kind == Fault::kDoubleRecord) check(counter_.record_cache(), "record");
        }
        // The sampled first token, then the aux record.
        std::vector<std::pair<int32_t*, int32_t>> toks;
        for (const Piece& p : fwd) {
            if (!p.last || (f.kind == Fault::kLostFirstToken && p.id == f.request)) continue;
            toks.emplace_back(tokens_.at(p.id).get(), first_token_of(p.id));
        }
        check(stream_->enqueue([toks] {
            for (auto& [ptr, v] : toks) *ptr = v;
            return Status();
        }),
              "token");
        check(counter_.record_aux(), "record_aux");
    }

    void enqueue_checksums(const std::vector<Piece>& fwd, int l) {
        for (const Piece& p : fwd) {
            check(enqueue_layer_checksum(*stream_, validator_, layout_, p.id, l, *p.pages, p.t0,
                                         p.t1, cluster_.device.compute_ops),
                  "checksum");
        }
    }

    // Runs on the compute stream.
    void free_mid_transfer(uint64_t id, Fault::Kind kind, const std::vector<int32_t>& pages,
                           uint64_t seed) {
        if (kind == Fault::kFreeBeforeTransfer) {
            Status st = sender_->pins().free_pages(pool_->allocator(), pages);
            free_refused_ = st.code() == StatusCode::kFailedPrecondition;
            return;
        }
        // Behind the engine's back: free, reuse for another request, overwrite layer 0 (already
        // sent) -- the after-send verification must notice.
        if (!pool_->allocator().free(pages).ok()) return;
        auto again = pool_->allocator().alloc(static_cast<int>(pages.size()));
        if (!again.ok()) return;
        for (int l = 0; l < layout_.num_layers(); ++l) {
            write_layer(layout_, *again, seed, id + 999'999, l, 0,
                        static_cast<int64_t>(again->size()) * layout_.page_size(), 3);
        }
    }

public:
    bool free_refused() const { return free_refused_; }

private:
    const ClusterSpec& cluster_;
    const InstanceSpec inst_;
    const int instance_;
    std::unique_ptr<runtime::Stream> stream_;
    pd::StepCounter counter_;
    std::unique_ptr<kv::KVPool> pool_;
    KvLayout layout_;
    OrderingValidator validator_;
    std::unique_ptr<KvSender> sender_;
    std::map<uint64_t, std::vector<int32_t>> pages_;
    std::map<uint64_t, std::unique_ptr<int32_t>> tokens_;
    std::mutex mu_;
    std::map<std::pair<uint64_t, int>, int> sent_;
    std::map<std::pair<uint64_t, int>, std::shared_ptr<Gate>> sent_gates_;
    std::atomic<bool> free_refused_{false};
};

// ---------------------------------------------------------------------------------------------
class DecodeRank {
public:
    DecodeRank(Transport& t, const ClusterSpec& cluster, int instance, int tp_rank,
               ReceiverOptions opts)
        : cluster_(cluster),
          inst_(cluster.decode[static_cast<size_t>(instance)]),
          instance_(instance),
          rank_(t.rank()),
          validator_(t.rank()) {
        pool_ = make_pool(cluster.model, inst_, tp_rank, &layout_, cluster.device.memory);
        EXPECT_TRUE(pool_->fill(0x5A).ok());
        opts.validator = &validator_;
        auto r = KvReceiver::create(t, layout_, opts);
        EXPECT_TRUE(r.ok()) << r.status().to_string();
        if (r.ok()) receiver_ = std::move(r).value();
    }

    // As PrefillRank::shutdown_engine (kv_receiver.h, "Lifetime").
    void shutdown_engine() {
        if (receiver_) receiver_->shutdown();
    }

    KvReceiver& receiver() { return *receiver_; }
    kv::KVPool& pool() { return *pool_; }
    const KvLayout& layout() const { return layout_; }
    OrderingValidator& validator() { return validator_; }
    const std::vector<int32_t>& pages(uint64_t id) { return pages_.at(id); }

    void run(const std::vector<RequestSpec>& all, const RunOptions& o, RankResult* out) {
        out->is_prefill = false;
        std::vector<RequestSpec> mine;
        for (const auto& r : all) {
            if (r.decode_instance == instance_) mine.push_back(r);
        }
        std::mt19937_64 rng(o.seed * 7919 + static_cast<uint64_t>(rank_));
        for (const auto& r : mine) {
            const int64_t need = (r.tokens + inst_.page_size - 1) / inst_.page_size;
            auto p = pool_->allocator().alloc(static_cast<int>(need));
            if (!p.ok()) {
                out->errors.push_back("decode alloc: " + p.status().to_string());
                return;
            }
            std::vector<int32_t> pages = *p;
            if (o.scramble_pages) {
                // Swap some neighbours: a mix of contiguous and broken runs.
                for (size_t i = 0; i + 1 < pages.size(); ++i) {
                    if (rng() % 3 == 0) std::swap(pages[i], pages[i + 1]);
                }
            }
            pages_[r.id] = pages;
            ReceiveRequestSpec spec;
            spec.request_id = r.id;
            spec.prefill_ranks = cluster_.prefill_ranks(r.prefill_instance);
            spec.dst_pages = pages;
            spec.num_tokens = r.tokens;
            Status st = receiver_->submit(spec);
            if (!st.ok()) out->errors.push_back("submit: " + st.to_string());
        }
        if (o.after_submit) o.after_submit(rank_);
        if (o.fault.kind == Fault::kDecodeFreeEarly && pages_.count(o.fault.request) != 0) {
            Status st = receiver_->pins().free_pages(pool_->allocator(), pages_[o.fault.request]);
            free_refused_ = st.code() == StatusCode::kFailedPrecondition;
            if (o.after_fault != nullptr) o.after_fault->open();
        }
        const auto deadline = Clock::now() + o.wait;
        for (const auto& r : mine) {
            if (o.wait_layers) {
                for (int l = 0; l < cluster_.model.layers; ++l) {
                    auto left = std::max<Clock::duration>(deadline - Clock::now(), 0ms);
                    Status st = receiver_->wait_layer(r.id, l, left);
                    if (!st.ok()) break;  // the request failed or timed out; wait_done says
                }
            }
            auto left = std::max<Clock::duration>(deadline - Clock::now(), 0ms);
            auto st = receiver_->wait_done(r.id, left);
            if (!st.ok()) {
                out->errors.push_back("decode wait: " + st.status().to_string());
                continue;
            }
            out->statuses[r.id] = *st;
            if (st->state == RequestState::kSuccess) {
                if (!st->has_first_token || st->first_token != first_token_of(r.id)) {
                    out->errors.push_back(fmt::format(
                        "request {}: first token {} (has {}), want "
                        "{}",
                        r.id, st->first_token, st->has_first_token, first_token_of(r.id)));
                }
                verify(r, o.seed, out);
            }
        }
        out->stats = receiver_->stats();
        out->report = validator_.report();
    }

    // Every byte this rank holds for the request equals fill_kv.
    void verify(const RequestSpec& r, uint64_t seed, RankResult* out) {
        const std::vector<int32_t>& pages = pages_.at(r.id);
        std::vector<std::byte> want(4096);
        size_t bad = 0;
        std::string first;
        for (int l = 0; l < layout_.num_layers(); ++l) {
            for (int b = 0; b < layout_.buffer_count(); ++b) {
                const size_t hb = layout_.head_bytes(b);
                if (want.size() < hb) want.resize(hb);
                for (int64_t t = 0; t < r.tokens; ++t) {
                    const std::byte* tok =
                        layout_.slot_addr(l, b, token_slot(pages, layout_.page_size(), t));
                    for (int h = 0; h < layout_.local_heads(); ++h) {
                        fill_kv(want.data(), hb, seed, r.id, l, b, layout_.head_begin() + h, t, 0);
                        if (std::memcmp(tok + static_cast<size_t>(h) * hb, want.data(), hb) != 0) {
                            if (bad++ == 0) {
                                first = fmt::format("layer {} buf {} token {} head {}", l, b, t,
                                                    layout_.head_begin() + h);
                            }
                        }
                        out->bytes_checked += hb;
                    }
                }
            }
        }
        if (bad > 0) {
            out->errors.push_back(
                fmt::format("decode rank {} request {}: {} (token, head) "
                            "mismatches, first at {}",
                            rank_, r.id, bad, first));
        }
    }

    bool free_refused() const { return free_refused_; }

private:
    const ClusterSpec& cluster_;
    const InstanceSpec inst_;
    const int instance_;
    const int rank_;
    std::unique_ptr<kv::KVPool> pool_;
    KvLayout layout_;
    OrderingValidator validator_;
    std::unique_ptr<KvReceiver> receiver_;
    std::map<uint64_t, std::vector<int32_t>> pages_;
    bool free_refused_ = false;
};

// Tight timeouts for tests (the defaults are for real runs).
template <typename Opts>
Opts test_options(Opts o) {
    o.request_timeout = std::chrono::milliseconds(60'000 * kSlow);
    o.peer_timeout = std::chrono::milliseconds(10'000 * kSlow);
    o.heartbeat_interval = 100ms;
    o.tick = 5ms;
    return o;
}

// Random request mix: lengths 1..max_tokens (skewed towards short), some chunked.
inline std::vector<RequestSpec> random_requests(uint64_t seed, int n, int64_t max_tokens,
                                                int prefill_instances, int decode_instances,
                                                bool chunked, uint64_t first_id = 1) {
    std::mt19937_64 rng(seed);
    std::vector<RequestSpec> out;
    for (int i = 0; i < n; ++i) {
        RequestSpec r;
        r.id = first_id + static_cast<uint64_t>(i);
        const double u = std::uniform_real_distribution<double>(0, 1)(rng);
        r.tokens = std::max<int64_t>(1, static_cast<int64_t>(std::pow(u, 3) * max_tokens));
        if (rng() % 8 == 0) r.tokens = std::max<int64_t>(1, max_tokens - (rng() % 7));
        r.prefill_instance = static_cast<int>(rng() % static_cast<uint64_t>(prefill_instances));
        r.decode_instance = static_cast<int>(rng() % static_cast<uint64_t>(decode_instances));
        if (chunked && rng() % 2 == 0) r.chunk = 1 + static_cast<int64_t>(rng() % 700);
        out.push_back(r);
    }
    return out;
}

}  // namespace pdsim::transfer::testing
