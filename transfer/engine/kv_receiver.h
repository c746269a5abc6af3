// KvReceiver: the decode side of the layerwise KV transfer engine.
//
// Use (one decode rank):
//   auto receiver = KvReceiver::create(transport, layout, options);
//   pages = pool.allocator().alloc(...);                       // admission: pre-allocate
//   receiver->submit({id, prefill world ranks (by prefill TP rank), pages, num_tokens});
//   for each layer l: receiver->wait_layer(id, l, timeout); run decode layer l ...
//   auto st = receiver->wait_done(id, timeout);                // first token, Success/Failed
//   receiver->release(id); pins().free_pages(...) when the request is finished with.
//
// Data plane (data_plane.h): as the sender's (kv_sender.h) -- the control transport given to
// create() carries the control messages; options.data_transport (null: the control transport)
// chooses from its declared capabilities between the two-sided data plane (this paragraph and
// the next), the ordered plane (nccl; below) and the write mode (below); none of them is
// kUnimplemented at create().
//
// Ordered plane (a two-sided data transport without tag matching: NCCL matches per pair in post
// order and needs receives of the exact size). No data tag slot is taken (the Bootstrap's data
// tag is kOrderedDataTag). A Chunk header plans the chunk's receives as two-sided (counted
// outstanding) but posts none; each DataPosted of a source (control.h) posts, from the control
// thread, in announcement order, one receive of each announced size: the planned ones when the
// announcement agrees with the plan, else receives into scratch memory whose bytes are dropped
// (stats().messages_drained) -- for a request that is unknown or failed, and for one whose plan
// disagrees (which fails with a DATA_LOSS reason naming the request and the layer). Every
// announced message is matched, so the pair's stream stays in step. Posted receives are never
// cancelled: a failed request withdraws only what is not announced yet, and keeps its pages
// pinned until its posted receives completed. The Completion arrives on the control channel,
// after the source's last DataPosted.
//
// Protocol (control.h): submit() pins the pages, takes a data tag slot and sends a Bootstrap to
// every prefill rank of the instance; each answers with an Ack carrying its layout, from which
// the receiver computes which heads that rank sends it (transfer_plan.h). For each Chunk header
// a source sends, the control thread posts the matching receives in the plan's order (layer,
// buffer, run) straight into the pages, or into a staging buffer when the fragment is only
// part of a token slot (prefill TP > decode TP with a partial slice, or any case where the
// decode rank holds more heads than the fragment): a receiver worker then scatters it into
// [token][head][dim] (one host copy, or on a device layout a scatter on the comm stream, see
// "Device memory"; counted in stats().staged_bytes). After its last chunk a
// source's Completion message (first token, the compute stream's checksums) is received on the
// same tag.
//
// Arrival: a per-request per-layer bitmap. Layer l has arrived once every source has sent its
// last chunk header and every receive (and scatter) of layer l completed; wait_layer(l) returns
// then, so decode can start layer l while later layers are still in flight. The request is
// Success once every layer arrived, every source's completion was received and (with a
// validator and checksums in the completions) the landed bytes matched.
//
// Write mode (a one-sided data transport). create() registers every (layer, buffer) buffer of the
// layout with the data transport (register_memory(base(layer, buf), num_pages * page_bytes(buf));
// on a GPU each is its own allocation, as cuda_ipc needs) and keeps the descriptors; they go to
// each prefill rank once, in a Regions message before this engine's first Bootstrap to it. No
// receives are posted, nothing is scattered and no data tag slot is taken (the Bootstrap's data
// tag is 0). Chunk headers still arrive (token range, prefill pages); each announces one
// LayerWritten per layer from that source, which that source sends once every write of that
// chunk's layer has landed. Layer l has arrived once every source with a fragment has sent its
// last chunk header and a LayerWritten of layer l for every chunk; the Completion (first token,
// checksums) comes on the control channel after all of them. wait_layer, layer_arrived,
// wait_done, events and stats behave as in the two-sided mode (stats().messages counts the
// sources' writes), and the landed pages are checked against the checksums as there.
//
// Arrival words (write mode over a data transport with write signals: cuda_ipc, local; and
// ReceiverOptions::arrival_slots > 0). create() also allocates arrival_slots x layers 8-byte
// words in the layout's memory (a GPU's for a device layout), registers them and sends their
// descriptor with the Regions message. submit() takes a slot for the request (kResourceExhausted
// when none is free) and names it in the Bootstrap; each prefill rank whose data transport can
// signal says so in its Ack and, after the writes of every (chunk, layer), adds their bytes to
// word (slot, layer) with post_signal, which the transport orders behind those writes (on a GPU,
// a kernel on cuda_ipc's stream after the copies): the words are the data path's own count of
// what landed, written by the prefill side's stream with no host in between. Words are never
// reset (arrival_words.h: a slot's base is what its words showed when it was handed out). Before
// Success the receiver reads the request's words: each must equal base + the layer's bytes (the
// fragment bytes per token of every source, times the request's tokens); a word that disagrees
// is a Violation and, with fail_on_violation, fails the request. The targets are kept until
// release(): enqueue_arrival_wait orders a stream's later work (the decode forward) behind them.
// A failed request's slot is read again before reuse, or quarantined when a source given up as
// dead may still add to it.
//
// Device memory (as the sender's, kv_sender.h: KV memory ops and one comm stream per engine,
// made at create(); kv_comm_stream.h). Two-sided, the messages that fill part of a decode slot of
// one chunk from one source land in one staging buffer of the ops (plan_scatter over every
// layer; same message order and sizes as on the host), allocated once the chunk's header arrived;
// a worker then takes every queued scatter, enqueues them on the comm stream (one call per
// staging buffer), waits on the host for the stream, bounded by the request's deadline, in
// slices of `tick`, and reports the layers. A wait that fails (a timeout, the stream's error)
// fails the request naming the comm stream and the layers; its scatters may still write the
// pages, so they count as outstanding -- the pages stay pinned, pages_in_use true -- until the
// stream has passed them (seen on the control thread's tick, or at shutdown, bounded by
// peer_timeout). The final check hashes the landed pages through the ops
// (plan_page_checksums) on the control thread, waiting for the comm stream (bounded by the
// request's deadline; a timeout fails the request naming it). Still refused: a data transport
// without device_memory, ops that cannot be made, injected ops or streams of another device
// (as the sender's create()).
//
// Failure: bounded by the request timeout, the peer timeout (prefill rank silent: no ack, no
// data, no heartbeat) and transport errors; the reason names request, peer and what was awaited.
// The prefill ranks get an Abort. Pages stay pinned until no receive can write them any more.
//
// Page safety (write mode). Other ranks write into the pages, and a failed request cannot
// withdraw their writes. A Failed request therefore keeps its pages pinned (pins().free_pages
// refuses them, RequestStatus::pages_in_use stays true) until every prefill rank of the request
// that may write them has settled:
//   - it sent Quiesced (none of its writes for the request can land any more; control.h),
//   - or its Completion arrived (it sent everything),
//   - or it never attached the request (it refused the bootstrap, the bootstrap was never sent,
//     or its ack said it sends this rank nothing),
//   - or it is known dead: its control link failed (kUnavailable), or it was silent (no message,
//     heartbeat included) for peer_timeout -- a live prefill rank keeps heartbeating while its
//     writes of a failed request are in flight.
// Nothing in this engine frees a page a write can still reach. A graceful shutdown waits (at most
// peer_timeout) for the failed requests to settle, then deregisters the regions; after an abrupt
// one (or a graceful one whose wait ran out: pages_in_use still true) the regions stay writable
// until the data transport is closed -- close it before freeing the pool.
//
// Thread-safety: all public methods may be called from any thread. Lifetime: destroy (or
// shutdown) the receiver before closing its transports (control and data) and before freeing the
// pool's memory (and close the data transport first when pages may still be in use, above).
// Events: ReceiverOptions::on_event is never called once shutdown() (or the destructor) returned.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"
#include "transfer/engine/engine_types.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/kv_sender.h"
#include "transfer/engine/page_pins.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

struct ReceiveRequestSpec {
    uint64_t request_id = 0;
    // World ranks of the prefill instance's TP ranks, index = prefill TP rank.
    std::vector<int> prefill_ranks;
    // Pre-allocated destination pages covering num_tokens tokens (copied).
    std::vector<int32_t> dst_pages;
    int64_t num_tokens = 0;
    // 0: options.request_timeout.
    std::chrono::milliseconds timeout{0};
};

class KvReceiver {
public:
    // `transport` carries the control messages; the data goes over options.data_transport or,
    // when null, `transport` too. Errors as KvSender::create's (data_plane.h), and, in the write
    // mode, the data transport's error when registering a region (with the layer and buffer), or
    // kInvalidArgument when the Regions message would exceed max_control_bytes.
    [[nodiscard]] static StatusOr<std::unique_ptr<KvReceiver>> create(Transport& transport,
                                                                      KvLayout layout,
                                                                      ReceiverOptions options);
    ~KvReceiver();
    KvReceiver(const KvReceiver&) = delete;
    KvReceiver& operator=(const KvReceiver&) = delete;

    // kAlreadyExists for a known id; kInvalidArgument for bad ranks/pages; kResourceExhausted
    // when no data tag slot is free (two-sided only: the write mode takes none).
    [[nodiscard]] Status submit(const ReceiveRequestSpec& spec);

    // OK once layer `layer` has arrived; kAborted with the request's failure reason if it failed;
    // kDeadlineExceeded after `timeout`; kNotFound for an unknown request.
    [[nodiscard]] Status wait_layer(uint64_t request_id, int layer,
                                    std::chrono::nanoseconds timeout) const;
    // Non-blocking arrival test.
    [[nodiscard]] bool layer_arrived(uint64_t request_id, int layer) const;
    // Blocks until the request is terminal (Success: first_token is set); kDeadlineExceeded after
    // `timeout`.
    [[nodiscard]] StatusOr<RequestStatus> wait_done(uint64_t request_id,
                                                    std::chrono::nanoseconds timeout) const;
    [[nodiscard]] StatusOr<RequestStatus> status(uint64_t request_id) const;
    // Arrival words (below): makes `stream`'s later work wait until every layer's arrival word
    // of the request reached its target -- the decode side's device-enforced "no layer read
    // before it landed", independent of the control messages. Returns once enqueued. On a CUDA
    // stream of a GPU layout the device waits (cuStreamWaitValue64, one per layer); otherwise a
    // stream task polls the words and fails the stream with kDeadlineExceeded after `timeout`.
    // For a request that succeeded (wait_done), so the waits are satisfied when enqueued: they
    // order the stream's reads behind the data path's own proof. kFailedPrecondition when the
    // request did not succeed or has no targets (no arrival words on this plane or transport, a
    // source that did not signal); kNotFound for an unknown or released request; the ops' error
    // (kUnavailable: a GPU without 64-bit stream waits) otherwise.
    [[nodiscard]] Status enqueue_arrival_wait(uint64_t request_id, runtime::Stream& stream,
                                              std::chrono::milliseconds timeout) const;
    // Forgets a terminal request. kFailedPrecondition while it is active.
    [[nodiscard]] Status release(uint64_t request_id);
    // Fails an active request now (the caller gave up on it: e.g. the router cancelled it), with
    // a reason naming `reason`; the prefill ranks get an Abort. As for any failed request, its
    // pages stay pinned (RequestStatus::pages_in_use) until no receive or write can land in them
    // any more. No-op for a terminal request; kNotFound for an unknown one.
    [[nodiscard]] Status abort(uint64_t request_id, const std::string& reason);

    [[nodiscard]] PagePins& pins();
    [[nodiscard]] EngineStats stats() const;
    [[nodiscard]] const KvLayout& layout() const;

    void shutdown(ShutdownMode mode = ShutdownMode::kGraceful);

    class Impl;

private:
    explicit KvReceiver(std::shared_ptr<Impl> impl);
    std::shared_ptr<Impl> impl_;
};

}  // namespace pdsim::transfer
