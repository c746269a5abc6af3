// Transport: the point-to-point data plane of the KV transfer engine (NIXL-backend style).
//
// A Transport is one rank's endpoint in a world of `world_size()` ranks. Implementations are
// chosen by name from a registry (create_transport): "local" (in-process, threads act as ranks),
// "tcp" (Boost.Asio), "mpi", "nccl", "cuda_ipc", and "fault" (a decorator that wraps any of them).
// Each is registered with a static descriptor (find_transport: memory kinds, operations, how its
// ranks meet), so callers ask what a transport can do before creating one, not its name.
// The layerwise sender/receiver is written against this interface only.
//
// Operations
//   Two-sided:  post_send(peer, tag, buf, bytes) / post_recv(peer, tag, buf, capacity).
//   One-sided:  register_memory -> descriptor (sent to peers over the control plane),
//               import_remote(peer, descriptor) -> RemoteRegion, post_write(region, off, src, n);
//               post_signal(region, off, add): an arrival counter's add, ordered after the writes.
//   Every post returns a RequestHandle at once (posting never waits for the peer or the wire);
//   test(handle) polls it, wait(handle, timeout) blocks on it, cancel(handle) withdraws it.
//
// Completion semantics
//   - A send completes when its buffer may be reused (the data was copied out or handed to the
//     network), not when the receiver has it. A send may stay pending until the matching receive
//     is posted (rendezvous): callers must not rely on buffering to avoid deadlock.
//   - A receive completes when the whole message is in the buffer; bytes() is the message size.
//   - A write completes when the data is visible in the target region. One-sided writes do not
//     notify the target: post a send after the write has completed to tell it, or (where
//     capabilities().write_signals) a signal that the target's memory itself shows (post_signal).
//   - A signal completes when its add is visible in the target word.
//   - Progress is internal (a progress thread per transport): handles complete whether or not
//     anybody calls test/wait. Completion callbacks (RequestHandle::on_complete) run on the thread
//     that completes the operation (a transport thread, or the posting thread when the match
//     happens inside a post, as in "local"); they must be short and must not block, wait(),
//     cancel() or close(). Posting new operations from a callback is allowed (and is the cheapest
//     way to keep a pipeline full).
//   - A handle completes exactly once, with OK or an error; its state outlives the transport.
//
// Matching rule (two-sided)
//   Messages from one peer with one tag are non-overtaking (MPI's rule): the k-th send from A to B
//   with tag t matches the k-th receive that B posts for (A, t). Different tags or peers are
//   independent: a receive for tag 2 is never blocked behind an unmatched message of tag 1.
//   The order of posts is the order in which the post_* calls return; threads that need an order
//   across them must serialize their posts. No wildcard source or tag. A message larger than the
//   receive buffer fails the receive with kOutOfRange (the message is consumed, the send
//   completes OK); a smaller one completes it with bytes() = the message size.
//   Transports whose capabilities().tag_matching is false (nccl) match per peer in post order and
//   ignore tags: both sides must post in the same order with equal sizes.
//
// Ownership
//   The caller owns every buffer; it must stay valid and unmodified (send) or untouched (receive)
//   until the handle has completed; for a send that holds even when the peer's matching receive
//   has already completed. A failed or cancelled handle has released its buffer: the transport
//   no longer touches it once the error is visible through test/wait.
//
// Thread-safety
//   All methods may be called concurrently from any number of threads, except that the
//   destructor (and close()) must not race with other calls on the same object. A RequestHandle
//   may be tested/waited from several threads.
//
// Blocking and timeouts
//   post_*, test and cancel never block on the peer or the network (they may take a short
//   internal lock; mpi's cancel of a receive waits for its own progress thread to withdraw it).
//   Only wait blocks, and every wait takes a timeout: when it expires wait returns
//   kDeadlineExceeded and the operation stays pending (wait again, or cancel it). A peer that is
//   known to be dead (connection lost, transport closed) fails that peer's pending handles with
//   kUnavailable naming the peer, and later posts to it fail at once; nothing hangs on it.
//   capabilities().detects_peer_failure says whether the transport can notice this by itself
//   (tcp, local: yes; mpi: no, OpenMPI aborts the job when a rank dies, so waits time out).
//
// Error codes
//   kInvalidArgument  bad peer (out of range or self), tag above max_tag, null buffer with
//                     bytes > 0, message above the transport's size limit, unknown handle.
//   kUnimplemented    the operation is not supported (post_write on a two-sided transport).
//   kUnavailable      peer dead / disconnected / closed, transport closed, no device.
//   kDeadlineExceeded wait timed out (the operation is still pending).
//   kOutOfRange       message larger than the receive buffer; write outside the remote region.
//   kDataLoss         protocol violation on the wire (bad magic, oversized or corrupt frame).
//   kAborted          cancelled.
//   kFailedPrecondition  setup refused (e.g. wrong session token), cancel of an operation that is
//                     already in flight.
//   kNotFound         unknown transport name or remote region; kAlreadyExists: a rank attached
//                     twice to one local world.
#pragma once

#include <any>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::transfer {

using Tag = uint32_t;
using Timeout = std::chrono::nanoseconds;

// A sensible default for callers that have no better bound (control-plane timeouts should be
// derived from the workload instead).
inline constexpr std::chrono::milliseconds kDefaultTransferTimeout{60'000};

enum class OpKind : uint8_t { kSend, kRecv, kWrite, kSignal };
std::string_view op_kind_name(OpKind kind);

// The shared completion state of one posted operation. Transports create it and complete it
// (exactly once: later complete() calls are ignored); callers see it through RequestHandle.
class OpState {
public:
    using Callback = std::function<void(const Status& status, size_t bytes)>;

    OpState(OpKind kind, int peer, Tag tag, size_t bytes)
        : kind_(kind), peer_(peer), tag_(tag), posted_bytes_(bytes) {}
    OpState(const OpState&) = delete;
    OpState& operator=(const OpState&) = delete;

    [[nodiscard]] OpKind kind() const { return kind_; }
    [[nodiscard]] int peer() const { return peer_; }
    [[nodiscard]] Tag tag() const { return tag_; }
    // Bytes given at post time (the receive buffer's capacity for receives).
    [[nodiscard]] size_t posted_bytes() const { return posted_bytes_; }

    // Acquire: once true, status() and bytes() are final and the buffer is released.
    [[nodiscard]] bool done() const { return done_.load(std::memory_order_acquire); }
    // Valid once done().
    [[nodiscard]] const Status& status() const { return status_; }
    [[nodiscard]] size_t bytes() const { return bytes_; }

    // Completes the operation; returns false (and changes nothing) if it was already complete.
    // Runs the registered callbacks on the calling thread, after waking waiters.
    bool complete(Status status, size_t bytes);
    // Blocks until done or `deadline`; true if done.
    bool wait_until(std::chrono::steady_clock::time_point deadline) const;
    // Runs fn(status, bytes) once the operation completes: at once (on this thread) if it already
    // has, else on the completing thread.
    void on_complete(Callback fn);

private:
    const OpKind kind_;
    const int peer_;
    const Tag tag_;
    const size_t posted_bytes_;
    std::atomic<bool> done_{false};
    // status_/bytes_ are written once before done_ is released; mu_ orders waiters and callbacks.
    Status status_;
    size_t bytes_ = 0;
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    std::vector<Callback> callbacks_;
};

// A handle to a posted operation. Cheap to copy; all copies refer to the same operation.
class RequestHandle {
public:
    RequestHandle() = default;
    explicit RequestHandle(std::shared_ptr<OpState> op) : op_(std::move(op)) {}

    [[nodiscard]] bool valid() const { return op_ != nullptr; }
    [[nodiscard]] bool done() const { return op_ && op_->done(); }
    // Bytes moved (a receive: the message size); 0 until done.
    [[nodiscard]] size_t bytes() const { return op_ && op_->done() ? op_->bytes() : 0; }
    [[nodiscard]] int peer() const { return op_ ? op_->peer() : -1; }
    [[nodiscard]] Tag tag() const { return op_ ? op_->tag() : 0; }
    // See OpState::on_complete. No-op on an invalid handle.
    void on_complete(OpState::Callback fn) const {
        if (op_) op_->on_complete(std::move(fn));
    }

    [[nodiscard]] const std::shared_ptr<OpState>& state() const { return op_; }

private:
    std::shared_ptr<OpState> op_;
};

struct Capabilities {
    bool two_sided = false;        // post_send / post_recv
    bool one_sided_write = false;  // register_memory / import_remote / post_write
    bool device_memory = false;    // buffers may be GPU memory
    bool host_memory = true;       // buffers may be host memory
    bool tag_matching = true;      // false: match per peer in post order (see the header note)
    bool detects_peer_failure = false;
    bool stream_ordered = false;   // post_send_after / post_write_after (see below)
    bool write_signals = false;    // post_signal (see below)
    Tag max_tag = 0;               // tags in [0, max_tag] are accepted
    size_t max_message_bytes = 0;  // larger posts fail with kInvalidArgument
};

// A locally registered region. `descriptor` is an opaque blob to give to peers (over the control
// plane); they turn it into a RemoteRegion with import_remote.
struct MemoryRegion {
    uint64_t id = 0;
    void* base = nullptr;
    size_t bytes = 0;
    std::vector<uint8_t> descriptor;
};

// A peer's region, as imported from its descriptor.
struct RemoteRegion {
    int peer = -1;
    uint64_t id = 0;
    size_t bytes = 0;
};

// ---- Static capabilities: what a caller needs to know before creating a transport ----

// How the ranks of a transport find each other when it is created.
enum class TransportSetup : uint8_t {
    kSharedWorld,  // threads of one process attach to one shared in-process world object
    kLauncher,     // the ranks come from a launcher (mpirun): rank and size are the launcher's
    kRendezvous,   // the ranks meet through a rendezvous (a shared directory or an endpoint list)
    kNone,         // nothing to connect: peers exchange region descriptors over the control plane
    kInner,        // a decorator: set up as the transport it wraps
};

// What the bytes travel over (a benchmark picks its baseline by it: memcpy, a raw socket, ...).
enum class TransportMedium : uint8_t {
    kProcessMemory,  // copies inside one process
    kSocket,         // TCP sockets
    kMpi,            // MPI point-to-point
    kGpu,            // GPU copies or a GPU collective library
    kInner,          // a decorator: the medium of the transport it wraps
};

// A registered transport's capabilities as declared by its implementation, independent of any
// instance. The fields shared with Capabilities (memory kinds, operations, tag matching, peer
// failure detection) equal what every instance's capabilities() reports (a test checks this for
// the transports that can be created in the test environment). A decorator (fault) declares what
// it can wrap (everything); an instance reports the capabilities of the transport it wraps.
struct StaticCapabilities {
    bool host_memory = true;       // buffers may be host memory
    bool device_memory = false;    // buffers may be GPU memory
    bool two_sided = false;        // post_send / post_recv
    bool one_sided_write = false;  // register_memory / import_remote / post_write
    bool tag_matching = true;      // false: match per peer in post order
    bool detects_peer_failure = false;
    bool stream_ordered = false;   // post_send_after / post_write_after
    bool write_signals = false;    // post_signal
    bool spans_processes = false;  // the ranks may be separate processes (mpirun, hosts)
    // The ranks may be on different hosts. False where the peers exchange something that works
    // only on the node that made it (cuda_ipc: CUDA IPC memory handles); implies spans_processes
    // or nothing (a transport of one process's threads never spans nodes).
    bool spans_nodes = false;
    // Two ranks of one transport may not use one device (nccl: NCCL refuses two ranks of one
    // communicator on one GPU). A caller that places ranks checks it before creating any.
    bool one_rank_per_device = false;
    bool threads_of_one_process = false;  // the ranks may be threads of one process
    bool decorator = false;               // wraps another transport (fault)
    TransportSetup setup = TransportSetup::kNone;
    TransportMedium medium = TransportMedium::kProcessMemory;
};

// One registered transport: its name, what it can do, and one line for listings.
struct TransportDescriptor {
    std::string name;
    StaticCapabilities caps;
    std::string summary;
};

// ---- Options ----

// What a factory receives. The fields are the ones every transport reads; each implementation
// owns its own option block (TcpOptions in transfer/tcp/tcp_transport.h, LocalOptions in
// transfer/local/local_transport.h, FaultOptions in transfer/fault/fault_transport.h,
// GpuTransportOptions in transfer/nccl/gpu_transports.h), carried here by type: at most one block
// of each type, set with set(), read with get() (the block, or a default-constructed one when it
// was not set). A factory reads only its own block and ignores the others, so a caller may set
// blocks for several transports on one TransportOptions.
// Thread-safety: a value; concurrent reads of one object are safe, writes are not. Copies are deep
// (each block is copied), so a decorator may hand a modified copy to the transport it wraps.
struct TransportOptions {
    // Ignored by mpi (taken from the communicator) and by nccl/cuda_ipc under MPI.
    int rank = 0;
    int world_size = 1;
    // Setup (connecting the mesh) must finish within this, else creation fails.
    std::chrono::milliseconds connect_timeout{30'000};

    // Stores `block` (replacing a block of the same type). Block: a copyable struct.
    template <typename Block>
    TransportOptions& set(Block block) {
        blocks_[std::type_index(typeid(Block))] = std::move(block);
        return *this;
    }
    // The block of type Block, or Block{} when none was set.
    template <typename Block>
    [[nodiscard]] Block get() const {
        auto it = blocks_.find(std::type_index(typeid(Block)));
        return it == blocks_.end() ? Block{} : std::any_cast<const Block&>(it->second);
    }
    // The stored block of type Block for changing in place (a default one is stored first when
    // none was set). The reference is valid until the next set() of that type or the end of this
    // object.
    template <typename Block>
    [[nodiscard]] Block& edit() {
        std::any& slot = blocks_[std::type_index(typeid(Block))];
        if (!slot.has_value()) slot = Block{};
        return std::any_cast<Block&>(slot);
    }
    template <typename Block>
    [[nodiscard]] bool has() const {
        return blocks_.count(std::type_index(typeid(Block))) != 0;
    }

private:
    std::map<std::type_index, std::any> blocks_;
};

class Transport {
public:
    virtual ~Transport() = default;
    Transport(const Transport&) = delete;
    Transport& operator=(const Transport&) = delete;
    Transport(Transport&&) = delete;
    Transport& operator=(Transport&&) = delete;

    [[nodiscard]] virtual std::string_view name() const = 0;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int world_size() const = 0;
    [[nodiscard]] virtual Capabilities capabilities() const = 0;

    [[nodiscard]] virtual StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf,
                                                            size_t bytes) = 0;
    [[nodiscard]] virtual StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf,
                                                            size_t capacity) = 0;

    // One-sided; the defaults return kUnimplemented.
    [[nodiscard]] virtual StatusOr<MemoryRegion> register_memory(void* base, size_t bytes);
    [[nodiscard]] virtual Status deregister_memory(uint64_t id);
    [[nodiscard]] virtual StatusOr<RemoteRegion> import_remote(int peer,
                                                               std::span<const uint8_t> descriptor);
    [[nodiscard]] virtual StatusOr<RequestHandle> post_write(const RemoteRegion& dst,
                                                             size_t dst_offset, const void* src,
                                                             size_t bytes);

    // One-sided arrival signal (capabilities().write_signals; the default returns
    // kUnimplemented): atomically adds `add` to the 8-byte unsigned integer at `dst_offset` of
    // `dst` (a multiple of 8, the word inside the region), once every write this rank posted to
    // dst.peer before this call (post_write or post_write_after, from any thread whose post
    // returned before this call) is visible there. This is the put-with-signal of NVSHMEM
    // (nvshmem_putmem_signal) and UCX (put, fence, atomic add): whoever observes the sum -- a
    // host load with acquire order, a stream waiting for the value (cuStreamWaitValue64) --
    // sees the bytes of those writes. Adds of several ranks to one word never lose each other.
    // The word's memory is the target's: it registered it like any region, and it resets it.
    // Completes when the add is visible. Errors as post_write's, plus kInvalidArgument for an
    // offset (or word address) that is not a multiple of 8. Where an earlier write failed, the
    // signal may fail or land: the sender learns of the failure from that write's handle, and a
    // target must not take a complete sum for proof of bytes the sender reports lost.
    [[nodiscard]] virtual StatusOr<RequestHandle> post_signal(const RemoteRegion& dst,
                                                              size_t dst_offset, uint64_t add);

    // Stream-ordered posts (capabilities().stream_ordered; the defaults return kUnimplemented):
    // as post_send / post_write, but the operation does not start moving data before `ready`
    // (an event of the device runtime, recorded by the caller on a stream of the device the
    // transport works on) has fired; the host does not wait for it. This is how a GPU transport
    // lets a device-side producer (a kernel, a gate on a StepCounter) order its reads without a
    // host round trip. The caller keeps `ready` alive until the handle completes. An event that
    // never fires leaves the operation pending (wait() times out; cancel() of an operation already
    // handed to the device is kFailedPrecondition); what else it holds up is the transport's to
    // say. kInvalidArgument: an event this transport cannot wait on (another device or kind).
    [[nodiscard]] virtual StatusOr<RequestHandle> post_send_after(const runtime::Event& ready,
                                                                  int peer, Tag tag,
                                                                  const void* buf, size_t bytes);
    [[nodiscard]] virtual StatusOr<RequestHandle> post_write_after(const runtime::Event& ready,
                                                                   const RemoteRegion& dst,
                                                                   size_t dst_offset,
                                                                   const void* src, size_t bytes);

    // false: pending; true: completed OK; an error: the operation failed (see Error codes).
    [[nodiscard]] virtual StatusOr<bool> test(const RequestHandle& handle);
    // OK or the operation's error once it completes; kDeadlineExceeded after `timeout`.
    [[nodiscard]] virtual Status wait(const RequestHandle& handle, Timeout timeout);
    // Withdraws a pending operation that has not started moving data: it then completes with
    // kAborted and its buffer is released. kFailedPrecondition if it is already in flight (it will
    // complete on its own); OK if it had already completed.
    [[nodiscard]] virtual Status cancel(const RequestHandle& handle) = 0;

    // Fails every pending handle with kUnavailable ("transport closed") and disconnects; peers see
    // this rank as gone. Idempotent; the destructor calls it. Not concurrent with other calls.
    virtual void close() = 0;

protected:
    Transport() = default;

    // Shared argument checks for posts: peer range, not self, buffer, tag, and (for sends and
    // writes, not for receive capacities) the message size limit.
    [[nodiscard]] Status check_post(int peer, Tag tag, const void* buf, size_t bytes,
                                    bool is_send) const;
};

// Waits for every handle (all share one deadline); returns the first error, or
// kDeadlineExceeded naming how many are still pending.
[[nodiscard]] Status wait_all(Transport& transport, std::span<const RequestHandle> handles,
                              Timeout timeout);

// ---- Registry ----

using TransportFactory =
    std::function<StatusOr<std::unique_ptr<Transport>>(const TransportOptions& options)>;

// Registers (or replaces) a transport under descriptor.name. The built-in ones are registered on
// first use (transfer/builtin.cpp), each with the descriptor its implementation's header declares.
// Thread-safe.
void register_transport(TransportDescriptor descriptor, TransportFactory factory);
// The descriptor of a registered transport, without creating one (compiled-out transports keep
// theirs). kNotFound for an unknown name; the message lists the registered ones.
[[nodiscard]] StatusOr<TransportDescriptor> find_transport(std::string_view name);
// kNotFound for an unknown name (as find_transport); else the factory's result (kUnavailable
// "no device" for GPU transports without a GPU, "not built" when compiled out).
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> create_transport(
    std::string_view name, const TransportOptions& options);
// The registered names, sorted.
[[nodiscard]] std::vector<std::string> registered_transports();

}  // namespace pdsim::transfer
