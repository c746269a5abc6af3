// KvSender::Impl, the sender's implementation (private to transfer/engine: included only by
// kv_sender.cpp -- the public API, the control messages, bootstrap, dispatch, finalization and
// failure -- and kv_sender_worker.cpp -- the worker threads that post the sends and their
// completions). kv_sender.h describes the protocol and the data path.
//
// Threads: the caller's (public API), the control thread (ControlListener, finalize, the posted
// cancellations), the workers (one per num_workers; destination rank r is served by worker
// r % num_workers) and the transport's completion callbacks (on_send_done).
//
// Locks: table_.mu() is the engine lock (request_table.h): the request table, every SendReq's
// fields marked "under the table's mutex", pending_bootstraps_, aborted_ and stats_. Each
// Worker::mu guards only its queue. The two are never nested: the engine lock is released before
// a task is queued, and a worker takes the engine lock only after releasing its queue lock.
// Ordered plane: a destination's OrderedPeer::mu is taken by its worker around an announcement
// and its posts; the engine lock may be taken under it, never the other way round.
// A function named *_locked is called with the engine lock held.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
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
#include "transfer/engine/control.h"
#include "transfer/engine/data_plane.h"
#include "transfer/engine/event_sink.h"
#include "transfer/engine/kv_comm_stream.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/engine/kv_sender.h"
#include "transfer/engine/request_table.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer {
namespace sender_detail {

// Write mode: what a decode rank registered, as imported here: its (layer, buffer) regions
// ([layer * buffers + buffer]) and, when it takes arrival signals and this rank's data transport
// can send them, its arrival region of `arrival_slots` x layers words.
struct DecodeRegions {
    std::vector<RemoteRegion> kv;
    std::optional<RemoteRegion> arrival;
    int32_t arrival_slots = 0;
};

// One decode rank of a request.
struct DestState {
    int world_rank = -1;
    int tp_rank = 0;
    Tag tag = 0;
    KvLayoutSummary layout;
    std::vector<int32_t> dst_pages;
    std::optional<Fragment> frag;
    int64_t max_run = 1;
    // Touched only by the destination's worker (every task of one destination runs on one
    // worker), so no lock: what this rank read, [layer][buf][fragment head], and the chunk whose
    // task may post next (tasks can reach the queue out of order: they are queued outside the
    // engine lock by the scheduler thread and, for chunks held until the bootstrap, the control
    // thread).
    std::vector<uint64_t> observed;
    uint32_t next_chunk_to_post = 0;
    // Device gating: read checksums of intervals posted ahead of their records, final once the
    // comm stream passed `passed`; added into `observed` before the completion (worker only).
    struct PendingSums {
        std::shared_ptr<runtime::Event> passed;
        std::shared_ptr<KvOpsMemory> sums;
    };
    std::vector<PendingSums> pending_sums;

    // Write mode with arrival words: the decode rank's arrival region and this request's slot
    // there (BootstrapMsg::arrival_slot); after the writes of each (chunk, layer) the sender adds
    // their bytes to word (slot * layers + layer). Unset / -1: no signals. Constant once attached.
    std::optional<RemoteRegion> arrival;
    int32_t arrival_slot = -1;
    // Write mode: the decode rank's (layer, buffer) regions as imported here ([layer * buffers +
    // buffer]); constant once attached.
    std::vector<RemoteRegion> regions;
    // Write mode: LayerWritten messages not sent yet (one per (chunk, layer) whose writes
    // started), plus 1 until the last chunk's task has armed `completion`. Whoever brings it to
    // 0 sends the completion (so it follows every LayerWritten on the control tag). `completion`
    // is written before the decrement that arms it (acq_rel) and read after reaching 0.
    std::atomic<int64_t> notices_pending{1};
    std::shared_ptr<Bytes> completion;
};

// A request of this rank; the lifecycle (id, deadline, state, reason) is the table's.
struct SendReq : RequestLifecycle {
    int64_t num_tokens = 0;
    // Set (under the table's mutex) when the request turns terminal-failed; read by workers without
    // the lock to stop early. A stale false only costs one more post, which post_data re-checks.
    std::atomic<bool> cancelled{false};

    // Everything below is under the table's mutex (Impl::table_.mu()).
    int decode_tp_size = -1;
    std::map<int, std::shared_ptr<DestState>> dests;  // by decode TP rank
    std::deque<SendChunk> held;                       // submitted before the bootstrap finished
    int64_t computed_end = 0;                         // tokens computed by submitted chunks
    int64_t sent_end = 0;                             // tokens handed to workers
    bool last_submitted = false;
    bool last_dispatched = false;
    uint32_t next_chunk = 0;
    std::vector<int32_t> pages;  // the latest page table
    int tasks_outstanding = 0;
    int64_t ops_outstanding = 0;
    bool finalizing = false;
    bool pins_released = false;
    std::vector<RequestHandle> handles;  // posted sends / writes (for cancellation)
    std::string awaiting;                // what a worker is blocked on
    uint64_t bytes = 0;
    // Write mode: decode ranks that aborted the request; they get a Quiesced too (with the
    // destinations) once the request is quiet.
    std::vector<int> abort_peers;
};

// Per (task, layer) sends not yet completed, plus a guard of 1 while the layer is being posted,
// so the count can only reach 0 once every send of the layer was posted and completed.
struct TaskProgress {
    explicit TaskProgress(int layers, uint64_t req, int peer, uint32_t chunk)
        : pending(std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(layers))),
          bytes(std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(layers))),
          ops(std::make_unique<std::atomic<uint32_t>[]>(static_cast<size_t>(layers))),
          request(req),
          peer(peer),
          chunk(chunk) {
        for (int l = 0; l < layers; ++l) {
            pending[static_cast<size_t>(l)].store(0);
            bytes[static_cast<size_t>(l)].store(0);
            ops[static_cast<size_t>(l)].store(0);
        }
    }
    std::unique_ptr<std::atomic<int64_t>[]> pending;
    std::unique_ptr<std::atomic<uint64_t>[]> bytes;  // completed OK, per layer
    std::unique_ptr<std::atomic<uint32_t>[]> ops;    // completed OK, per layer
    std::atomic<bool> failed{false};                 // an operation of the task failed
    const uint64_t request;
    const int peer;
    const uint32_t chunk;
    // Write mode: the LayerWritten of a layer goes to this destination of this request.
    std::shared_ptr<SendReq> req;
    std::shared_ptr<DestState> dest;
};

struct Task {
    std::shared_ptr<SendReq> req;
    std::shared_ptr<DestState> dest;
    uint32_t chunk_index = 0;
    int64_t t0 = 0;
    int64_t t1 = 0;
    int64_t begin_step = 0;
    int interval = 1;
    bool is_last = false;
    std::vector<int32_t> src_pages;
    int32_t first_token = -1;
    const int32_t* first_token_src = nullptr;
    int64_t first_token_aux_step = 0;
};

// Device layouts: one layer interval of a task after its comm-stream work (gathers into staging,
// the read checksums added into the destination's `observed`) completed: where each gathered
// message is, for the posts. `staging` is kept alive by every send or write posted from it.
struct DeviceInterval {
    std::array<bool, kMaxKvBuffers> gathered{};  // per buffer: sent from the staging copy
    std::optional<KvStagingPlan> plan;
    std::shared_ptr<KvOpsMemory> staging;
    // Device gating: recorded on the comm stream behind the gate and the interval's work; every
    // send (write) of the interval is posted to start after it (Transport::post_*_after).
    std::shared_ptr<runtime::Event> after;

    // The gathered copy of (layer, buf, run), or null when that buffer is not gathered.
    [[nodiscard]] const std::byte* address(int layer, int buf, size_t run) const {
        if (!staging || !gathered[static_cast<size_t>(buf)]) return nullptr;
        return staging->data() + plan->message(layer, buf, static_cast<int>(run)).staging_offset;
    }
};

// One worker thread and its queue of tasks (filled by enqueue(), drained by worker_loop()).
struct Worker {
    Mutex mu;  // a leaf: never held while taking the engine lock, nor taken under it
    CondVar cv;
    std::deque<Task> queue PDSIM_GUARDED_BY(mu);
    std::thread thread;
};

}  // namespace sender_detail

class KvSender::Impl : public ControlListener, public std::enable_shared_from_this<Impl> {
    using DestState = sender_detail::DestState;
    using DecodeRegions = sender_detail::DecodeRegions;
    using SendReq = sender_detail::SendReq;
    using TaskProgress = sender_detail::TaskProgress;
    using Task = sender_detail::Task;
    using Worker = sender_detail::Worker;
    using DeviceInterval = sender_detail::DeviceInterval;
    using Table = RequestTable<SendReq>;

public:
    // `comm`: the device-memory path (kv_comm_stream.h) of a device layout; null for a host one.
    Impl(Transport& transport, DataPlaneChoice plane, KvLayout layout, pd::StepCounter& counter,
         SenderOptions options, std::unique_ptr<KvCommStream> comm);
    Status start();

    // ---- public API ----

    Status add_request(const SendRequestSpec& spec);
    Status submit_chunk(SendChunk c);
    StatusOr<RequestStatus> status(uint64_t id) const;
    StatusOr<RequestStatus> wait(uint64_t id, std::chrono::nanoseconds timeout) const;
    Status release(uint64_t id);
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
    struct PendingBootstrap {
        int peer;
        BootstrapMsg msg;
        Clock::time_point at;
        DecodeRegions regions;  // write mode: the peer's, when it bootstrapped
    };
    // Write mode: a decode rank's regions as imported from its Regions message (or why not).
    struct PeerRegions {
        DecodeRegions regions;
        Status error;
    };

    [[nodiscard]] bool write_mode() const { return plane_ == DataPlane::kOneSidedWrite; }
    [[nodiscard]] bool ordered() const { return plane_ == DataPlane::kOrdered; }

    RequestStatus status_locked(const SendReq& r) const PDSIM_REQUIRES(table_.mu());
    std::string describe_awaiting_locked(const SendReq& r) const PDSIM_REQUIRES(table_.mu());
    void emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer, uint32_t chunk,
              uint64_t bytes) const;
    void handle_bootstrap(int peer, BootstrapMsg m);
    Status validate_bootstrap(int peer, const BootstrapMsg& m) const;
    // Write mode (control thread): imports the decode rank's regions (once per Regions message).
    void handle_regions(int peer, const RegionsMsg& m);
    void handle_abort(int peer, const AbortMsg& m);

    // Adds decode rank `peer` to `r`; once every decode rank is in, the request is Transferring
    // and its held chunks are dispatched. Returns a failure reason, or "".
    std::string attach_locked(SendReq& r, int peer, const BootstrapMsg& m, DecodeRegions regions,
                              std::vector<Task>& out) PDSIM_REQUIRES(table_.mu());

    // Turns a chunk into one task per destination that receives a fragment from this rank.
    void dispatch_locked(SendReq& r, const SendChunk& c, std::vector<Task>& out)
        PDSIM_REQUIRES(table_.mu());
    void enqueue(std::vector<Task> tasks);

    // True when every send of the request completed: the caller posts the finalization.
    bool maybe_finish_locked(SendReq& r) PDSIM_REQUIRES(table_.mu());
    // Releases a Failed request's pins once nothing can read them (no task may post, no
    // operation is live): the request is then quiet. True when that happened now; in the write
    // mode the caller then calls post_quiesced.
    bool maybe_release_pins_locked(SendReq& r) PDSIM_REQUIRES(table_.mu());
    void post_finalize(uint64_t id);
    // Write mode: on the control thread, sends Quiesced to every destination and every decode
    // rank that aborted the request.
    void post_quiesced(const std::shared_ptr<SendReq>& r);

    // Control thread: after-send verification, then Success.
    void finalize(uint64_t id);

    // Any thread. Marks the request Failed (once) and, on the control thread, withdraws its
    // sends and tells the decode ranks.
    void fail(const std::shared_ptr<SendReq>& r, std::string reason, bool notify_peers);

    // ---- workers ----

    // A task as its worker tracks it.
    struct Active {
        Task t;
        std::vector<TokenRun> runs;
        std::shared_ptr<TaskProgress> progress;
        int next_l0 = 0;         // first layer of the next interval to send
        bool started = false;    // Chunk header sent, runs cut
        bool data_done = false;  // every interval posted
        bool finished = false;
        bool has_first_token = false;
        int32_t first_token = -1;
        // Device gating: intervals posted before the host saw their step ([l0, l1), target),
        // oldest first; kLayerReady is emitted for them when the host sees the step (timeline
        // only: nothing on the data path waits for it).
        struct Ahead {
            int l0 = 0;
            int l1 = 0;
            int64_t target = 0;
        };
        std::deque<Ahead> ahead;
    };

    int64_t next_target(const Active& a) const;

    // The worker interleaves its tasks in step order: every pass services each task whose next
    // interval is ready (so a batch's requests all go out layer by layer, overlapping the
    // forward), keeping one rule: per (request, destination) only the task of the next chunk may
    // post, so a request's messages on its data tag follow chunk order. When no task can move,
    // it blocks on the StepCounter (aux counter for first tokens) for the soonest target.
    void worker_loop(int index);
    Clock::duration wait_slice(const Active& a) const;
    void set_awaiting(SendReq& r, std::string what);

    // Moves one task as far as it can without blocking. Returns whether it did anything.
    bool step_task(Active& a);
    void start_task(Active& a);

    // Posts every send of layers [l0, l1) (plan order: layer, buffer, run). False: stop the task.
    bool post_interval(Active& a, int l0, int l1);
    // Device layouts, before post_interval posts: plans the interval's gathers (plan_gather) and
    // read checksums (plan_fragment_checksums), enqueues them on the comm stream and waits for it
    // (bounded by the request's deadline; a timeout fails the request naming the layers and the
    // comm stream); adds the sums into the destination's `observed`. False: stop the task (the
    // request failed, or the sender stops).
    bool run_device_interval(Active& a, int l0, int l1, DeviceInterval& out);
    void finish_task(Active& a);

    enum class Progress { kDone, kWaiting, kFailed };

    // The last chunk's completion message: first token (aux step), the compute stream's
    // checksums (compared with what this rank read), then the send. Never blocks.
    Progress try_completion(Active& a);
    // With a validator: the compute stream's checksums of the fragment, compared with what this
    // rank read and put into `m`; kWaiting while they are not recorded yet (kFailed once `late`).
    Progress add_checksums(Active& a, bool late, CompletionMsg& m);
    // Device gating: emits kLayerReady for the intervals of `a` posted ahead whose step the host
    // now sees ready. True if any.
    bool note_ready_ahead(Active& a, int64_t ready);
    // Device gating: adds the pending sums whose comm-stream work has passed into `observed`;
    // kWaiting while some have not (kFailed once `late`, or the comm stream failed).
    Progress settle_pending_sums(Active& a, bool late);

    // Posts one send of the request on its data tag. layer < 0: the completion message.
    // `after` (device gating): the op starts on the device once it has fired.
    bool post_data(const Task& t, int layer, const void* ptr, size_t bytes,
                   std::shared_ptr<void> keep, const std::shared_ptr<TaskProgress>& progress,
                   const std::shared_ptr<runtime::Event>& after = nullptr);
    // Write mode: posts one write of `bytes` at `offset` of the destination's region of
    // (layer, buf).
    // Write mode with arrival words: adds `bytes` (this (chunk, layer)'s writes) to the layer's
    // word of the request's slot, behind the writes; one operation of the layer. False when the
    // post failed (the request is being failed).
    bool post_arrival_signal(Active& a, int layer, uint64_t bytes);
    bool post_write(const Task& t, int layer, int buf, size_t offset, const void* ptr, size_t bytes,
                    std::shared_ptr<void> keep, const std::shared_ptr<TaskProgress>& progress,
                    const std::shared_ptr<runtime::Event>& after = nullptr);
    // The bookkeeping shared by both: `post` posts the operation on data_. `announced` (ordered
    // plane): the operation was announced, so it is posted even if the request failed meanwhile
    // and never withdrawn.
    bool post_op(const Task& t, int layer, OpKind kind, std::shared_ptr<void> keep,
                 const std::shared_ptr<TaskProgress>& progress,
                 const std::function<StatusOr<RequestHandle>()>& post, bool announced = false);
    // Ordered plane: one data message of an interval, collected before the announcement.
    struct OrderedSend {
        int layer = 0;
        const void* ptr = nullptr;
        size_t bytes = 0;
        std::shared_ptr<void> keep;
    };
    // Ordered plane: under the destination's lock, announces `sends` (DataPosted: layers
    // [l0, l1) of the task's chunk) on the control channel and posts them in that order on the
    // data transport. Nothing is announced when the request failed or the destination's stream is
    // out of step (a post of an announced message failed before); once announced, every message
    // is posted. False: stop the task.
    bool post_ordered(Active& a, int l0, int l1, std::vector<OrderedSend>& sends,
                      const std::shared_ptr<runtime::Event>& after);
    // Write mode: the (chunk, layer) writes of `a` to its destination, in plan order. `gathered`
    // (device layouts): the run's gathered copy in `gathered_keep`, when the write reads one.
    bool post_run_writes(Active& a, int layer, int buf, const TokenRun& run, uint64_t& staged,
                         const std::byte* gathered, const DeviceInterval& dev);

    // Any thread (transport callbacks included): never re-enters the transport.
    void on_op_done(const std::shared_ptr<SendReq>& r, const std::shared_ptr<TaskProgress>& p,
                    int layer, int peer, OpKind kind, const Status& st, size_t n);
    void layer_op_done(const std::shared_ptr<TaskProgress>& p, int layer);
    // Write mode: one LayerWritten sent (or given up); the last one sends the armed completion.
    void notice_done(const std::shared_ptr<SendReq>& r, const std::shared_ptr<DestState>& d);
    Transport& transport_;
    Transport& data_;  // the data plane's transport (transport_ unless a data transport is given)
    const DataPlane plane_;
    const KvLayout layout_;
    pd::StepCounter& counter_;
    const SenderOptions opt_;
    // opt_.on_event, closed at the end of shutdown() (no hook call after it returns).
    EventSink events_{opt_.on_event};
    // The record of layout layer `layer` within a forward (SenderOptions::layer_steps).
    [[nodiscard]] int64_t step_offset(int layer) const {
        return opt_.layer_steps.empty() ? layer : opt_.layer_steps[static_cast<size_t>(layer)];
    }
    // Device layouts: the KV memory ops and the comm stream (null: a host layout).
    const std::unique_ptr<KvCommStream> comm_;
    // Device gating is on (SenderOptions::device_gate and what it needs; set at create()).
    bool gate_ahead_ = false;
    size_t max_msg_ = 0;
    std::shared_ptr<ControlChannel> channel_;
    PagePins pins_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::atomic<bool> stopping_{false};
    // Set by a graceful shutdown in the write mode: exiting workers finish (let go of) their
    // tasks, so that failed requests turn quiet and are announced Quiesced.
    std::atomic<bool> quiesce_on_exit_{false};

    // The requests and the engine lock: table_.mu() guards what is below and the requests'
    // bookkeeping (see request_table.h).
    RequestTable<SendReq> table_;
    std::unordered_map<uint64_t, std::vector<PendingBootstrap>> pending_bootstraps_
        PDSIM_GUARDED_BY(table_.mu());
    // Requests a decode rank aborted, or whose decode rank died or fell silent while their
    // bootstrap waited here, before this rank scheduled them (id -> reason, when): a later
    // add_request fails at once instead of waiting for a bootstrap that will not come.
    std::unordered_map<uint64_t, std::pair<std::string, Clock::time_point>> aborted_
        PDSIM_GUARDED_BY(table_.mu());
    // How many request timeouts an entry of aborted_ is kept.
    static constexpr int kAbortMemory = 20;
    // Set once the control link to every other rank failed (this rank's control transport
    // closed, or every peer gone): why no bootstrap can come any more. The requests still
    // awaiting one fail then, and every later add_request fails at once ("" until then).
    std::string no_peer_left_ PDSIM_GUARDED_BY(table_.mu());
    // The byte, message, layer and staging counts (the request counts are the table's).
    EngineStats stats_ PDSIM_GUARDED_BY(table_.mu());

    // Ordered plane: per destination world rank, the lock that keeps the announcements on the
    // control transport in the order of the posts on the data transport, and (under it) why the
    // pair's stream is out of step ("" while it is not). Leaves: nothing else is taken under
    // them except the engine lock inside post_op (never the other way round).
    struct OrderedPeer {
        Mutex mu;
        std::string broken PDSIM_GUARDED_BY(mu);
    };
    std::vector<std::unique_ptr<OrderedPeer>> ordered_peers_;

    // Write mode, control thread only: every decode rank's regions (by world rank).
    std::unordered_map<int, PeerRegions> peer_regions_;
};

}  // namespace pdsim::transfer
