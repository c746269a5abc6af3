// Types shared by the KV sender (prefill side) and receiver (decode side): request states,
// per-request status, events for timelines and metrics, options and counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::transfer {

class KvMemoryOps;
class OrderingValidator;
class Transport;

// Makes the engine's comm stream on `device` (EngineOptions::comm_stream_factory_for_testing).
using CommStreamFactory =
    std::function<StatusOr<std::unique_ptr<runtime::Stream>>(runtime::Device device)>;

// Bootstrapping: waiting for the other side's handshake (decode: the acks; prefill: the
// bootstraps of every decode rank). Transferring: the handshake is done; data may flow.
// Success / Failed are terminal. A Failed request always has a reason naming the request, the
// peer (or local component) and what was awaited.
enum class RequestState : uint8_t { kBootstrapping, kTransferring, kSuccess, kFailed };
std::string_view request_state_name(RequestState state);
inline bool is_terminal(RequestState s) {
    return s == RequestState::kSuccess || s == RequestState::kFailed;
}

struct RequestStatus {
    RequestState state = RequestState::kBootstrapping;
    std::string reason;  // Failed: why
    bool has_first_token = false;
    int32_t first_token = -1;  // the first sampled token (decode side, on Success)
    uint64_t bytes = 0;        // KV bytes moved by this rank for the request
    int layers_arrived = 0;    // decode side
    // True while a send/receive/write of the request may still touch its pages (they stay
    // pinned). A Failed request turns terminal at once; its pages are released once its
    // operations were withdrawn or completed (decode side, write mode: once every prefill rank
    // that may write them quiesced, completed or is known dead) -- free them (pins().free_pages)
    // after this turns false.
    bool pages_in_use = false;
    std::chrono::steady_clock::time_point started{};
    std::chrono::steady_clock::time_point finished{};
};

struct TransferEvent {
    enum class Kind : uint8_t {
        kLayerReady,    // sender: the layer's step is ready (its KV is written)
        kLayerPosted,   // sender: every send of the layer (this chunk, this peer) is posted
        kLayerSent,     // sender: ... and has completed (the pages were read; write mode:
                        // the bytes are visible at the decode rank and LayerWritten was sent)
        kLayerArrived,  // receiver: every byte of the layer (all chunks, all sources) landed
        kRequestDone,
        kRequestFailed,
    };
    Kind kind = Kind::kLayerReady;
    uint64_t request = 0;
    int layer = -1;
    int peer = -1;  // world rank of the other side (-1: not about one peer)
    uint32_t chunk = 0;
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point time{};
};
std::string_view transfer_event_name(TransferEvent::Kind kind);

// Called from engine threads (workers, control thread, transport callbacks): must be quick,
// thread-safe, and must not call back into the engine that emitted the event. Never called once
// the engine's shutdown() (or destructor) has returned: shutdown waits for the calls in progress
// (event_sink.h), so what the hook captures need only outlive the engine's shutdown.
using EventHook = std::function<void(const TransferEvent&)>;

struct EngineOptions {
    // Whole-request bound: a request not terminal this long after it was submitted fails.
    std::chrono::milliseconds request_timeout{60'000};
    // An awaited peer silent (no message, heartbeat included) this long fails its requests.
    std::chrono::milliseconds peer_timeout{10'000};
    std::chrono::milliseconds heartbeat_interval{500};
    // Watchdog period: timeouts are detected within one tick.
    std::chrono::milliseconds tick{10};
    // Data messages are cut to at most this (and the transport's limit; the two sides agree on
    // the smaller of their values in the handshake).
    size_t max_message_bytes = size_t{64} << 20;
    size_t max_control_bytes = size_t{4} << 20;
    // Not owned; may be null (no checksums). Must outlive the engine. With a device KvLayout the
    // engine hashes through its KV memory ops on its comm stream (below).
    OrderingValidator* validator = nullptr;
    // The transport that carries the KV bytes. Not owned; must outlive the engine, with the same
    // rank and world size as the control transport (the Transport& given to create(); world rank
    // r is the same process on both). Null: the control transport carries the data too. The data
    // plane follows from its declared capabilities (kv_sender.h, "Data plane"): two-sided and
    // tag-matching -> data messages on per-request data tags; two-sided without tag matching
    // (nccl) -> the ordered plane (untagged messages announced on the control channel); else
    // one-sided writes -> the write mode; else create() is kUnimplemented.
    Transport* data_transport = nullptr;
    EventHook on_event;
    // Device layouts (KvLayout::device() not the CPU; kv_sender.h, "Device memory"): the engine
    // gets its KV memory ops from make_kv_memory_ops(layout.device()) and creates one comm stream
    // on that device through the runtime registry (runtime::device_runtime(kind)->create_stream)
    // at create(). Tests only: these replace either (the ops are not owned and must outlive the
    // engine, and must declare the layout's memory kind; the factory is called once, at create(),
    // and the engine owns the stream it returns). Ignored for host layouts.
    KvMemoryOps* kv_memory_ops_for_testing = nullptr;
    CommStreamFactory comm_stream_factory_for_testing;
};

struct SenderOptions : EngineOptions {
    // Worker threads; destination rank r is served by worker r % num_workers.
    int num_workers = 2;
    // With a validator: re-hash a request's pages once all its sends completed (late writes,
    // pages reused in flight).
    bool verify_after_send = true;
    // Bound of one blocking wait of a worker on the StepCounter (a condition-variable wait that
    // wakes on every record): after it the worker re-checks shutdown, cancellation, deadlines and
    // tasks queued meanwhile (e.g. chunks held until a late bootstrap, whose steps may be ready).
    std::chrono::milliseconds cancel_check{20};
    // Device gating (kv_sender.h, "Device gating"): with a device layout, a StepCounter on the
    // layout's device and a data transport that posts in stream order
    // (Capabilities::stream_ordered), the comm stream waits on the device for each layer's
    // record and the sends (writes) wait for the comm stream, so an interval is posted as soon
    // as its record is enqueued on the compute stream, not after the host saw it land. False, or
    // any of those missing: the host path (wait for the step on the host, then post).
    bool device_gate = true;
    // Where each layer's record sits among a forward's records: layer l of the layout is ready
    // once step begin_step + layer_steps[l] is (SendChunk::begin_step). Empty: layer_steps[l] = l,
    // the layout's layers are the model's. A layout over one cache group of a hybrid model (its
    // recurrent layers' states, say) names the model layers it holds: strictly increasing, >= 0,
    // one per layer of the layout (create() checks it).
    std::vector<int> layer_steps;
};

struct ReceiverOptions : EngineOptions {
    // Threads that scatter staged fragments into the pages.
    int num_workers = 1;
    // A checksum mismatch in landed KV fails the request (else it is only reported).
    bool fail_on_violation = true;
    // Write mode over a data transport with write signals: requests that can hold arrival words
    // at once (kv_receiver.h, "Arrival words"); submit() is kResourceExhausted past that. 0: no
    // arrival words (the LayerWritten messages alone report arrival).
    int arrival_slots = 1024;
};

struct EngineStats {
    uint64_t requests_submitted = 0;
    uint64_t requests_completed = 0;  // Success
    uint64_t requests_failed = 0;
    uint64_t bytes = 0;             // KV payload bytes sent / received (written, write mode)
    uint64_t messages = 0;          // data messages or one-sided writes (completions not counted)
    uint64_t staged_bytes = 0;      // bytes copied through staging buffers (gather/scatter)
    uint64_t layers = 0;            // (request, layer, peer) transfers completed
    uint64_t tags_quarantined = 0;  // receiver: data tags retired after failures (two-sided)
    // Receiver, ordered plane: announced data messages received into scratch memory and dropped
    // (their request was unknown, failed, or disagreed with the announcement).
    uint64_t messages_drained = 0;
};

}  // namespace pdsim::transfer
