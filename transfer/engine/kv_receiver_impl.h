// KvReceiver::Impl, the receiver's implementation (private to transfer/engine: included only by
// kv_receiver.cpp -- the public API, the control messages, the watchdog and failure -- and
// kv_receiver_landing.cpp -- the acks, the chunk headers and the receives they post, the
// scatter workers, arrival, the completions and the final check). kv_receiver.h describes the
// protocol.
//
// Threads: the caller's (public API), the control thread (ControlListener, receives posted,
// completions decoded, finalize), the scatter workers and the transport's completion callbacks
// (on_recv_complete).
//
// Locks: table_.mu() is the engine lock (request_table.h): the request table, every RecvReq's
// fields marked "under the table's mutex", the data tag slots and stats_. jobs_mu_ guards only the
// scatter queue and stopping_. The two are never nested. A function named *_locked is called with
// the engine lock held.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "transfer/engine/arrival_words.h"
#include "transfer/engine/control.h"
#include "transfer/engine/data_plane.h"
#include "transfer/engine/event_sink.h"
#include "transfer/engine/kv_comm_stream.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/engine/kv_receiver.h"
#include "transfer/engine/request_table.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer {
namespace receiver_detail {

struct RecvReq;

// Device layouts: the staging of one chunk's messages from one source (plan_scatter over every
// layer, the engine's message order): the receives of the messages that fill only part of a
// decode slot land there, and the comm stream scatters them into the pages. `memory` (the ops'
// staging memory) is allocated outside the engine lock, before any receive is posted.
struct DeviceStaging {
    KvStagingPlan plan;
    KvOpsMemory memory;
};

struct ScatterJob {
    std::shared_ptr<RecvReq> req;
    Fragment frag;
    int layer = 0;
    int buf = 0;
    TokenRun run;
    std::shared_ptr<std::vector<std::byte>> staging;  // host layouts
    // Device layouts: message `message` of `device_staging` (its op scatters it).
    std::shared_ptr<DeviceStaging> device_staging;
    size_t message = 0;
};

// One receive to post (computed under the lock, posted outside it).
struct RecvOp {
    int layer = -1;  // -1: the completion message
    uint32_t chunk = 0;
    int buf = 0;
    TokenRun run;
    void* ptr = nullptr;
    size_t bytes = 0;
    std::shared_ptr<std::vector<std::byte>> staging;  // host layouts: lands here, then scattered
    // Device layouts: lands in message `message` of `device_staging`, then scattered.
    std::shared_ptr<DeviceStaging> device_staging;
    size_t message = 0;
    std::shared_ptr<Bytes> completion;
};

// One prefill rank of a request.
struct SourceState {
    int world_rank = -1;
    bool acked = false;
    KvLayoutSummary layout;
    std::optional<Fragment> frag;  // nullopt: this prefill rank sends this decode rank nothing
    int64_t max_run = 1;
    int64_t next_token = 0;  // the next chunk must start here
    uint32_t next_chunk = 0;
    bool last_header = false;
    bool completed = false;  // its completion message arrived
    CompletionMsg completion;

    // Write mode: whether this prefill rank may still write into the request's pages (see
    // settled()). Set on the control thread, under the table's mutex.
    bool quiesced = false;  // it sent Quiesced: none of its writes can land any more
    bool dead = false;      // its control link failed, or it was silent past peer_timeout
    bool detached = false;  // it never attached the request (refused, or never bootstrapped)
    bool signals = false;   // its Ack: it adds its writes' bytes to the arrival words
    // Write mode: tokens of each announced chunk, and which (chunk, layer) it reported written
    // ([chunk * num_layers + layer]).
    std::vector<int64_t> chunk_tokens;
    std::vector<uint8_t> written;

    // Ordered plane: the planned receives of the chunks announced by headers that no DataPosted
    // has announced yet, in plan order (each counted outstanding), and whether the completion
    // (on the control channel) is still awaited (counted outstanding too). Both are withdrawn
    // when the request fails.
    std::deque<RecvOp> unposted;
    bool completion_pending = false;

    // Write mode: no write of this source can land in the pages any more.
    [[nodiscard]] bool settled() const {
        return quiesced || completed || dead || detached || (acked && !frag);
    }
};

// A request of this rank; the lifecycle (id, deadline, state, reason) is the table's.
struct RecvReq : RequestLifecycle {
    int64_t num_tokens = 0;
    std::vector<int32_t> dst_pages;
    std::vector<int> prefill_ranks;
    uint32_t slot = 0;
    Tag tag = 0;

    // Under the table's mutex (Impl::table_.mu()).
    std::vector<SourceState> sources;  // by prefill TP rank
    int acks = 0;
    int frag_sources = 0;
    int last_headers = 0;
    int completions = 0;
    std::vector<int64_t> layer_pending;  // receives (+ scatters) not yet done, per layer
    std::vector<uint8_t> arrived;
    int layers_arrived = 0;
    int64_t ops_outstanding = 0;
    std::vector<RequestHandle> handles;  // two-sided: posted receives (for cancellation)
    bool finalizing = false;             // every message matched: the tag slot can be reused
    bool pins_released = false;
    bool slot_settled = false;
    bool has_first_token = false;
    int32_t first_token = -1;
    uint64_t bytes = 0;
    // Device layouts: what a worker waits for on the comm stream (its scatters), while it waits.
    std::string awaiting_comm;
    // Arrival words (the write mode, arrival_ set): the request's slot and its words' values
    // when it was taken; once the request succeeded with every byte counted, each layer's
    // target (base + the layer's bytes), which enqueue_arrival_wait waits for. Slot -1: none.
    int32_t arrival_slot = -1;
    std::vector<uint64_t> arrival_base;
    std::vector<uint64_t> arrival_target;
};

}  // namespace receiver_detail

class KvReceiver::Impl : public ControlListener, public std::enable_shared_from_this<Impl> {
    using SourceState = receiver_detail::SourceState;
    using RecvReq = receiver_detail::RecvReq;
    using ScatterJob = receiver_detail::ScatterJob;
    using RecvOp = receiver_detail::RecvOp;
    using DeviceStaging = receiver_detail::DeviceStaging;
    using Table = RequestTable<RecvReq>;

public:
    // `comm`: the device-memory path (kv_comm_stream.h) of a device layout; null for a host one.
    Impl(Transport& transport, DataPlaneChoice plane, KvLayout layout, ReceiverOptions options,
         std::unique_ptr<KvCommStream> comm);
    // Write mode: registers the layout's regions with the data transport first.
    Status start();

    // ---- public API ----

    Status submit(const ReceiveRequestSpec& spec);
    Status wait_layer(uint64_t id, int layer, std::chrono::nanoseconds timeout) const;
    bool layer_arrived(uint64_t id, int layer) const;
    StatusOr<RequestStatus> wait_done(uint64_t id, std::chrono::nanoseconds timeout) const;
    StatusOr<RequestStatus> status(uint64_t id) const;
    Status enqueue_arrival_wait(uint64_t id, runtime::Stream& stream,
                                std::chrono::milliseconds timeout) const;
    Status release(uint64_t id) { return table_.release(id); }
    Status abort(uint64_t id, const std::string& reason);

    PagePins& pins() { return pins_; }
    const KvLayout& layout() const { return layout_; }
    EngineStats stats() const;
    void shutdown(ShutdownMode mode);

    // ---- ControlListener (control thread) ----

    void on_control(int peer, std::span<const uint8_t> bytes) override;
    void on_peer_failed(int peer, const Status& st) override;
    void on_tick(Clock::time_point now) override;
    void on_stall(Clock::time_point now) override;

private:
    static int source_index(const RecvReq& r, int world_rank);
    // Whether any prefill rank started sending the request (a chunk header or its completion).
    static bool started_locked(const RecvReq& r);

    // Whether the request still waits for something from source `s`.
    static bool source_pending(const RecvReq& /*r*/, const SourceState& s);
    RequestStatus status_locked(const RecvReq& r) const PDSIM_REQUIRES(table_.mu());

    // What the request awaits from source `src` (-1: from the first source it awaits anything).
    std::string describe_awaiting_locked(const RecvReq& r, int src) const
        PDSIM_REQUIRES(table_.mu());
    void emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer, uint64_t bytes) const;
    bool headers_complete_locked(const RecvReq& r) const PDSIM_REQUIRES(table_.mu());

    // Marks layers whose data is complete; returns them (for events).
    std::vector<int> sweep_arrivals_locked(RecvReq& r) PDSIM_REQUIRES(table_.mu());
    bool maybe_finish_locked(RecvReq& r) PDSIM_REQUIRES(table_.mu());

    // Pins and the tag slot are released only once no receive can write into the pages or match
    // on the tag any more (write mode: once every source settled()). True when the pins were
    // released now (the caller notifies the waiters).
    bool maybe_settle_locked(RecvReq& r) PDSIM_REQUIRES(table_.mu());
    [[nodiscard]] bool write_mode() const { return plane_ == DataPlane::kOneSidedWrite; }
    [[nodiscard]] bool ordered() const { return plane_ == DataPlane::kOrdered; }
    void after_change(const std::shared_ptr<RecvReq>& r, std::vector<int> newly);
    void handle_ack(int peer, const AckMsg& m);
    void handle_chunk(int peer, const ChunkMsg& m);

    // Write mode (control thread): the sources' LayerWritten, Completion and Quiesced messages.
    void handle_layer_written(int peer, const LayerWrittenMsg& m);
    void handle_control_completion(int peer, std::span<const uint8_t> bytes);
    void handle_quiesced(int peer, const QuiescedMsg& m);
    // Sends the Bootstrap (write mode: preceded by the Regions message to a prefill rank that
    // has not had it from this engine).
    void send_bootstrap(const RecvReq& r, const Bytes& bootstrap);

    // The receives of one chunk in plan order (layer, buffer, run), then (last chunk) the
    // completion message. Counts them as outstanding before any is posted, so the arrival state
    // can never look complete while a chunk is half posted. Device layouts: the ops of messages
    // that need a scatter share one DeviceStaging (its memory still to be allocated); `why` is set
    // (and nothing counted) when its plan fails.
    std::vector<RecvOp> plan_chunk_locked(RecvReq& r, const SourceState& s, const ChunkMsg& m,
                                          std::string& why) PDSIM_REQUIRES(table_.mu());
    // `announced` (ordered plane): the sender announced these messages, so every one is posted
    // even if the request failed meanwhile, and none is withdrawn.
    void post_ops(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                  std::vector<RecvOp> ops, bool announced = false);

    // Ordered plane (control thread): posts the receives a DataPosted announces, in its order --
    // the planned ones of the request, or, for a request that is unknown, failed, or whose plan
    // disagrees (which fails it: a data loss naming the request and the layer), receives of
    // exactly the announced sizes into scratch memory whose bytes are dropped.
    void handle_data_posted(int peer, const DataPostedMsg& m);
    void drain_announced(int peer, const DataPostedMsg& m);

    // Any thread (transport callbacks included): never re-enters the transport.
    void on_recv_complete(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                          const std::shared_ptr<RecvOp>& op, const Status& st, size_t n);
    void handle_completion(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                           StatusOr<CompletionMsg> m);

    // One receive (or scatter; write mode: one (chunk, layer) reported written, `messages`
    // writes) finished. `why` non-empty: it failed.
    void op_done(const std::shared_ptr<RecvReq>& r, int layer, size_t bytes, const std::string& why,
                 uint64_t messages = 1);

    // Control thread: checks what landed against the compute stream's checksums, then Success.
    void finalize(const std::shared_ptr<RecvReq>& r);
    // finalize(), arrival words: reads the request's words into `words` and checks each against
    // its target (base + every signalling source's bytes of the layer), returned in `targets`.
    // "" when they agree or a source with a fragment does not signal (then `targets` stays
    // empty); else why (each disagreeing layer is also a Violation). Control thread, no lock.
    // `slot`: the request's slot and base as finalize() took them under the lock (r's own fields
    // change under it when the request fails meanwhile); r's id and tokens are constant.
    std::string check_arrival_words(const RecvReq& r, const ArrivalWords::Slot& slot,
                                    const std::vector<SourceState>& sources,
                                    std::vector<uint64_t>& words, std::vector<uint64_t>& targets);

    // Any thread. Marks the request Failed (once); on the control thread, withdraws its receives
    // and tells the prefill ranks.
    void fail(const std::shared_ptr<RecvReq>& r, std::string reason, bool notify_peers);
    void worker_loop();
    // Device layouts (a worker): enqueues the jobs' scatters on the comm stream, one request at a
    // time, and waits for it (bounded by the request's deadline); a failed wait fails the request
    // naming the layers and the comm stream, and the scatters stay outstanding (the pages
    // pinned) until the stream has passed them.
    void scatter_on_device(std::vector<ScatterJob> jobs);
    // Whether the workers stop (for the comm-stream waits).
    bool stopping() const;
    // Write mode, graceful shutdown: waits (bounded) until no failed request waits for a source
    // to settle.
    void wait_settled(std::chrono::nanoseconds timeout);
    Transport& transport_;
    Transport& data_;  // the data plane's transport (transport_ unless a data transport is given)
    const DataPlane plane_;
    const KvLayout layout_;
    const ReceiverOptions opt_;
    // opt_.on_event, closed at the end of shutdown() (no hook call after it returns).
    EventSink events_{opt_.on_event};
    // Device layouts: the KV memory ops and the comm stream (null: a host layout).
    const std::unique_ptr<KvCommStream> comm_;
    // Write mode over a data transport with write signals: the arrival words (null: none).
    // Created in start(); its memory outlives every request of the engine.
    std::unique_ptr<ArrivalWords> arrival_;
    size_t max_msg_ = 0;
    uint32_t slot_capacity_ = 0;
    std::shared_ptr<ControlChannel> channel_;
    PagePins pins_;
    std::vector<std::thread> workers_;

    // Write mode: this rank's (layer, buffer) regions registered with data_ (deregistered at
    // shutdown), and the Regions message that announces them. Constant after start().
    std::vector<MemoryRegion> regions_;
    RegionsMsg regions_msg_;
    // Write mode: the prefill ranks that had the Regions message (by world rank). Held across
    // the Regions + Bootstrap sends so that no Bootstrap overtakes its Regions. A leaf lock.
    Mutex bootstrap_mu_;
    std::vector<uint8_t> regions_sent_ PDSIM_GUARDED_BY(bootstrap_mu_);

    // The scatter queue: a leaf lock, never held while taking the engine lock, nor taken under it.
    mutable Mutex jobs_mu_;
    CondVar jobs_cv_;
    std::deque<ScatterJob> jobs_ PDSIM_GUARDED_BY(jobs_mu_);
    bool stopping_ PDSIM_GUARDED_BY(jobs_mu_) = false;

    // The requests and the engine lock: table_.mu() guards what is below and the requests'
    // bookkeeping (see request_table.h).
    RequestTable<RecvReq> table_;
    // Data tag slots: never handed out (next_slot_ and up), free for reuse (free_slots_).
    uint32_t next_slot_ PDSIM_GUARDED_BY(table_.mu()) = 0;
    std::vector<uint32_t> free_slots_ PDSIM_GUARDED_BY(table_.mu());
    // The byte, message, layer, staging and tag counts (the request counts are the table's).
    EngineStats stats_ PDSIM_GUARDED_BY(table_.mu());
};

}  // namespace pdsim::transfer
