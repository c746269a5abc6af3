// KvSender: the prefill side of the layerwise KV transfer engine.
//
// Use (one prefill rank; the testbed's scheduler thread drives it):
//   auto sender = KvSender::create(transport, layout, step_counter, options);
//   sender->add_request({id, num_tokens});            // when the request is scheduled
//   begin = counter.advance_step(num_layers);         // per extend forward (shared by the batch)
//   sender->submit_chunk({id, pages, t0, t1, begin, interval, is_last, first token...});
//   ... enqueue the forward on the compute stream: per layer write KV, (checksum), record ...
//   sender->wait(id, timeout) / status(id); sender->release(id) once terminal.
// The decode ranks' bootstraps may arrive before or after add_request; chunks submitted before
// every decode rank of the request bootstrapped are held until then.
//
// Data plane (data_plane.h). The control transport (the Transport& given to create()) carries
// every control message and must be two-sided and tag-matching. The KV bytes go over
// options.data_transport (null: the control transport), whose declared capabilities choose how:
//   two_sided && tag_matching  -> two-sided: data messages on the request's data tag (below);
//   two_sided, no tag matching -> ordered (nccl; below);
//   else one_sided_write       -> the write mode (below);
//   else                       -> create() is kUnimplemented, naming the transport.
// The decode rank chooses the same way; a Bootstrap of another plane is refused (its data tag
// says which: 0 = writes, kOrderedDataTag = ordered, kDataTagBase and up = two-sided).
//
// Ordered plane (the data transport matches per pair in post order, ignores tags and needs
// receives of the exact size). The data path is the two-sided one (same messages, order, sizes,
// copies) except how an interval is posted: the worker collects its messages, then, holding the
// destination's lock, sends DataPosted{request, chunk, [l0, l1), every message's size in post
// order} on the control channel and posts the sends in exactly that order (untagged), so that
// per (this rank, decode rank) the announcements and the posts are in the same order. Nothing is
// announced for a failed request; an announced send is posted even if the request failed
// meanwhile and is never cancelled (the decode rank posts its receive whatever happens), so a
// failed request's pages stay pinned until those sends complete. The Completion goes on the
// control channel after the request's last DataPosted to that rank. A send the data transport
// refuses to post after its announcement puts that pair's stream out of step: every later
// interval to that decode rank fails, naming it. Device gating works unchanged: the DataPosted
// goes out when the interval is posted (ahead of the record); the sends wait on the event.
//
// Data path. Per destination decode rank a chunk becomes a task on worker (rank % num_workers).
// A task sends the Chunk header, then for each interval [l0, l1) of layers, once step
// begin + l1 - 1 is ready on the StepCounter (begin + layer_steps[l1 - 1] when the layout holds
// only some of the model's layers: SenderOptions::layer_steps), posts for each layer, buffer and
// run one send (address = base + page * page_bytes + offset; runs contiguous on both sides are
// coalesced, see transfer_plan.h). A worker interleaves its tasks in step order, so every request
// of a batch goes out layer by layer while the forward is still computing later layers; per
// (request, destination) only the oldest unfinished task may post (chunk order on the data tag).
// When no task can move the worker blocks in StepCounter::wait_until_ready (or wait_until_aux_ready
// for a first token) on the soonest target -- a condition-variable wait woken by every record, no
// sleep-polling -- bounded by cancel_check so that shutdown, cancellation, deadlines and tasks
// dispatched meanwhile are noticed. Middle chunks send only full prefill pages; the last chunk
// sends the rest (the partial tail page) and then the Completion message with the first token.
// Sends complete through callbacks (no polling); a request is Success once every send of every
// destination completed (and, with a validator, the after-send verification ran).
//
// Copies: none when the fragment is a whole prefill token slot (same TP, prefill TP > decode TP,
// MLA, any page sizes): the transport reads the pages. When the decode rank needs only some of
// this rank's heads (prefill TP < decode TP), the worker gathers the run's fragment into a
// staging buffer first (one host copy, or on a device layout one gather on the comm stream, see
// "Device memory"; counted in stats().staged_bytes).
//
// Write mode. Each decode rank sends its regions (one per (layer, buffer) of its KvLayout, as
// registered with its data transport) once per (decode engine, prefill rank), before its first
// Bootstrap; this rank imports them once and caches them per decode rank (importing may be slow
// on a GPU). A task then sends the Chunk header as above and, per layer once its step is ready,
// for each buffer and run post_write()s into the decode rank's page bytes: one write per run at
// dst_slot * token_bytes when the fragment is a whole decode token slot
// (Fragment::dst_contiguous), else one write per token at its slot + dst_offset, straight from
// the page bytes (correct, but many small writes). The source is the page bytes, or the gathered
// staging copy when a whole decode slot takes part of ours. Arrival words (kv_receiver.h): when
// the decode rank sent an arrival region, named a slot in the Bootstrap, and this rank's data
// transport has write signals (checked once per Regions message with an add of 0), the layer's
// writes are followed by one post_signal adding their bytes to the slot's word of that layer;
// the Ack says whether this rank signals. When every write (and the signal) of (chunk, layer)
// to that decode rank has completed (the bytes are visible there, transport.h), a LayerWritten
// goes to it on the control channel; the Completion (first token, checksums) follows there once
// every LayerWritten of the request to that rank was sent. A request is Success once every write
// completed and every Completion was handed to the control channel: the decode rank is not
// waited for (a silent decode rank fails only a request that still awaits something).
//
// Device memory. A KvLayout whose device() is not the CPU (a GPU rank's pools) is never touched
// by the host. create() gets the KV memory ops of that memory (kv_memory_ops.h:
// make_kv_memory_ops(layout.device()), or options.kv_memory_ops_for_testing) and makes one comm
// stream on that device through the runtime registry (runtime::device_runtime(kind)->
// create_stream; or options.comm_stream_factory_for_testing); kv_comm_stream.h. Per (chunk,
// destination, layer interval), once the interval's step is ready, the worker
//   1. plans the interval's gathers (plan_gather: the buffers a host layout would gather) and,
//      with a validator, the fragment's read checksums (plan_fragment_checksums);
//   2. enqueues them on the comm stream, into staging and sums memory of the ops
//      (allocate_staging / allocate_sums);
//   3. waits on the host for an event behind them, in slices of cancel_check, bounded by the
//      request's deadline (a timeout fails the request with a reason naming the layers, the
//      decode rank and the comm stream; the stream's sticky error fails it too);
//   4. adds the sums into the destination's observed sums, and posts the sends (writes) in the
//      host path's order and sizes -- from the staging memory for gathered messages, straight
//      from the pages otherwise -- so the decode rank cannot tell the two paths apart.
// The after-send verification hashes the pages through the ops too (plan_page_checksums), on
// the control thread, which waits for the comm stream (bounded by the request's deadline).
// Work whose wait failed may still run: its staging and sums stay alive until the stream has
// passed it (the control thread's tick sweeps them); it only reads the pages, so their pins are
// released as on the host path. Those are host waits: the comm stream runs after the host has
// seen the StepCounter record, and the sends are posted after a host wait for the gathers.
//
// Device gating (SenderOptions::device_gate, on by default) removes both where it can: with a
// device layout, a StepCounter whose stream is on the layout's device (a GPU rank's compute
// stream) and a data transport that declares stream_ordered (transfer/transport.h:
// post_send_after / post_write_after; the GPU transports), per interval the worker
//   1. waits only until the interval's record is *enqueued* on the compute stream
//      (StepCounter::is_step_enqueued / wait_until_enqueued), not until it ran;
//   2. gates the comm stream on the step (StepCounter::gate: an event wait, since the record is
//      enqueued), enqueues the gathers and read checksums behind it, and records an event;
//   3. posts the interval's sends (writes) with post_*_after(that event), in the host path's
//      order and sizes, and goes on: no host wait. The transport's stream starts them when the
//      layer's record lands on the device.
// The read checksums of those intervals are added into the destination's sums before the
// completion, once the comm stream has passed them (a bounded host wait there, not on the
// data path). kLayerReady is still emitted when the host sees the step (the worker polls for
// it while nothing else is due), so the timeline's ready -> sent latency keeps its meaning.
// The gathers' staging and sums are retired at once (kept until the stream passed them), so a
// failed post or request never frees memory a gather still writes. A record that never comes
// leaves the interval's operations pending on the transport: the request fails at its deadline
// as on the host path, and its pins stay until they complete or the transport fails them (a GPU
// transport's watchdog, or close()).
// What is still refused: a data transport without device_memory (kInvalidArgument; it must
// reach the pages and the staging memory), KV memory ops that cannot be made (make_kv_memory_ops'
// error: kUnavailable without CUDA or without that GPU), injected ops of another memory kind or a
// comm stream of another device (kInvalidArgument).
//
// Pins: a chunk's pages are pinned from submit_chunk until no send can read them any more;
// pins().free_pages() refuses to free them meanwhile (see page_pins.h). A Failed request turns
// terminal at once; its pages are released once its sends were withdrawn or completed
// (RequestStatus::pages_in_use turns false).
//
// Failure: every wait is bounded: the request's timeout (from add_request), the peer timeout
// (decode rank silent, heartbeats included), transport errors (kUnavailable: the decode rank is
// gone). A failed request's pending sends (writes) are cancelled, the decode ranks get an Abort,
// and the reason names the request, the peer and what was awaited. A bootstrap that arrives
// before add_request waits here (its Ack goes out at once); if its decode rank fails or falls
// silent meanwhile, or aborts the request, the later add_request fails the request at once.
// A request whose bootstrap never arrived waits for it with no timeout running (the decode
// instance's admission queue, no fault); abort() or shutdown ends that wait, and so does the
// failure of the control links to every other rank (this rank's control transport closed, or
// every peer gone: no bootstrap can come), after which add_request's requests fail at once.
// Write mode, quiescence: a failed request stops writing (no task posts again) and cancels what
// the transport lets it; once none of its writes can still land (every one completed or failed:
// the moment pages_in_use turns false) this rank sends Quiesced{request, reason} to each of its
// decode ranks and to every decode rank that aborted it -- at once for an Abort of a request it
// never wrote (unknown here, or already quiet). Until then it keeps heartbeating those decode
// ranks, which keep the pages pinned (kv_receiver.h, "Page safety"). A graceful shutdown with
// requests that are not quiet (it fails the active ones) waits (at most peer_timeout) for them
// to turn quiet; every graceful shutdown then lets the control messages still unmatched (the
// Quiesced ones, including those sent before the shutdown) reach live peers (at most 200 ms)
// before it stops the control channel; an abrupt one sends nothing.
//
// Thread-safety: all public methods may be called from any thread. Lifetime: destroy (or
// shutdown) the sender before closing its transports (control and data), and close the data
// transport before freeing the pool's memory: an ordered plane's announced sends that no decode
// rank received yet stay posted after any shutdown (they are never withdrawn, above) and read the
// pages when received; closing fails them. Events: SenderOptions::on_event is never called once
// shutdown() (or the destructor) has returned, not even for such a late completion.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/pd/step_counter.h"
#include "common/status.h"
#include "transfer/engine/engine_types.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/page_pins.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

struct SendRequestSpec {
    uint64_t request_id = 0;
    int64_t num_tokens = 0;  // >= 1
    // 0: options.request_timeout.
    std::chrono::milliseconds timeout{0};
};

struct SendChunk {
    uint64_t request_id = 0;
    // The request's page table on this rank, covering at least token_end tokens (copied).
    std::vector<int32_t> src_pages;
    // Tokens this forward computes: [token_begin, token_end). token_begin must equal the previous
    // chunk's token_end (0 for the first); token_end == num_tokens exactly when is_last.
    int64_t token_begin = 0;
    int64_t token_end = 0;
    // StepCounter step of layer 0 of this forward (begin = advance_step(num_layers)).
    int64_t begin_step = 0;
    int layer_interval = 1;
    bool is_last = false;
    // The first sampled token (last chunk only): a known value, or, when first_token_src is set,
    // read from *first_token_src once the aux step first_token_aux_step is ready (the compute
    // stream writes the token and then record_aux()s).
    int32_t first_token = -1;
    const int32_t* first_token_src = nullptr;
    int64_t first_token_aux_step = 0;
};

enum class ShutdownMode {
    kGraceful,  // fail active requests ("shutting down"), tell the peers, withdraw operations
    // Stop the threads and send nothing (emulates a crash). Operations already posted stay with
    // the transport: close the transport before freeing the pool's memory.
    kAbrupt,
};

class KvSender {
public:
    // `transport` carries the control messages (two-sided, tag-matching); the data goes over
    // options.data_transport or, when null, `transport` too. `counter` must outlive the sender.
    // Errors (data_plane.h, choose_data_plane): kUnimplemented for a control transport that is
    // not two-sided and tag-matching, a data transport with neither data plane; kInvalidArgument
    // for a data transport whose ranks differ, a two-sided data transport with max_tag <
    // kDataTagBase, a layout in memory the data transport cannot reach, an empty layout or a
    // validator of another rank. A device layout (above, "Device memory"): the errors of its KV
    // memory ops and comm stream (kUnavailable without that GPU or without CUDA; kInvalidArgument
    // for injected ops of another memory kind or a stream of another device).
    [[nodiscard]] static StatusOr<std::unique_ptr<KvSender>> create(Transport& transport,
                                                                    KvLayout layout,
                                                                    pd::StepCounter& counter,
                                                                    SenderOptions options);
    ~KvSender();
    KvSender(const KvSender&) = delete;
    KvSender& operator=(const KvSender&) = delete;

    // kAlreadyExists for a request id that is known (until release()).
    [[nodiscard]] Status add_request(const SendRequestSpec& spec);
    // kInvalidArgument for a chunk that breaks the rules above; kAborted (with the reason) if the
    // request already failed; kNotFound for an unknown request.
    [[nodiscard]] Status submit_chunk(SendChunk chunk);

    [[nodiscard]] StatusOr<RequestStatus> status(uint64_t request_id) const;
    // Blocks until the request is terminal; kDeadlineExceeded after `timeout`.
    [[nodiscard]] StatusOr<RequestStatus> wait(uint64_t request_id,
                                               std::chrono::nanoseconds timeout) const;
    // Forgets a terminal request (and its validator checksums). kFailedPrecondition if active.
    [[nodiscard]] Status release(uint64_t request_id);
    // Fails an active request now (the caller gave up on it: e.g. the router cancelled it), with
    // a reason naming `reason`; its decode ranks get an Abort. As for any failed request, its
    // pages stay pinned (RequestStatus::pages_in_use) until no send or write can read them any
    // more. No-op for a terminal request; kNotFound for an unknown one.
    [[nodiscard]] Status abort(uint64_t request_id, const std::string& reason);

    [[nodiscard]] PagePins& pins();
    [[nodiscard]] EngineStats stats() const;
    [[nodiscard]] const KvLayout& layout() const;

    // Idempotent; the destructor runs kGraceful.
    void shutdown(ShutdownMode mode = ShutdownMode::kGraceful);

    class Impl;

private:
    explicit KvSender(std::shared_ptr<Impl> impl);
    std::shared_ptr<Impl> impl_;
};

}  // namespace pdsim::transfer
