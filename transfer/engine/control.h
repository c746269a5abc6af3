// The control plane of the layerwise KV transfer engine: tags, wire messages and the
// ControlChannel (one per engine) that carries them over the engine's Transport.
//
// Tags (capabilities().max_tag bounds them; the engine needs max_tag >= kDataTagBase):
//   kControlTag (0)        every control message between two engines, in both directions.
//                          Each engine keeps one receive per peer posted on it at all times.
//   kOrderedDataTag (1)    in a Bootstrap only: the decode rank uses the ordered data plane.
//   [2, kDataTagBase)      reserved (unused).
//   kDataTagBase + slot    the data tag of one request at one decode rank: the KV data messages
//                          and the completion message every prefill rank sends to that decode
//                          rank for that request. The DECODE rank allocates the slot (it is the
//                          receiver, so it owns the namespace of messages addressed to it) and
//                          sends it in the bootstrap. Matching is per (source, destination, tag),
//                          so two requests can only collide if the same decode rank handed out
//                          the same slot twice while messages of the first could still arrive.
//                          It never does: a slot is returned to the decode rank's free list only
//                          when every message of its request was matched (Success, or a
//                          checksum failure found after everything landed); the slot of a
//                          request that failed with messages possibly still in flight is
//                          quarantined for the lifetime of the engine (counted in stats). Slots
//                          number max_tag - kDataTagBase + 1 (32,752 with MPI's minimum tag
//                          bound of 32,767); submit() fails with kResourceExhausted past that.
//
// Control messages (all start with magic "PDKV", version, type, request id; host byte order:
// peers run on the same architecture). Each message struct declares its fields once, in wire
// order, in `fields(Self&, Visitor&)`: control.cpp's one encoder and one decoder both walk that
// list, so the two directions cannot disagree (tests/transfer_control_wire_test.cpp pins the
// bytes):
//   Bootstrap  decode -> every prefill rank of the request's prefill instance, on admission:
//              {request_id, decode world rank, decode tp rank/size, data tag, num tokens,
//               max message bytes, decode layout summary, page size (in the summary), dst pages}
//   Ack        prefill -> decode: {prefill tp rank/size, ok | refusal reason, prefill layout
//              summary, max message bytes}. Both sides then use min(max message bytes).
//   Chunk      prefill -> decode, before the chunk's data: {chunk index, token range, is_last,
//              the prefill pages of that range} so the decode rank can cut the same runs and
//              post the matching receives in the plan's order.
//   Abort      either way: the request failed on the sender of the message {reason}.
//   Heartbeat  either way, every heartbeat_interval to peers with active requests.
//   Completion prefill -> decode on the request's DATA tag, after the last chunk's data:
//              {src tp rank, first sampled token, the compute stream's checksums of the
//               fragment's heads per (layer, buffer)}. Non-overtaking per tag puts it after
//              every data message of the request. In the write mode (below) it travels on
//              the control tag instead, after every LayerWritten of the request to that rank.
//
// The one-sided write data plane (kv_sender.h / kv_receiver.h; data tag 0 in the Bootstrap: no
// data tag slot is taken) adds three messages, all on the control tag:
//   Regions      decode -> prefill, once per (decode engine, prefill rank), before the first
//                Bootstrap to that rank: {decode world rank, layers, buffers, the data
//                transport's descriptor of every (layer, buffer) region, [layer][buffer]}. The
//                request id is the request whose Bootstrap follows (for logs only).
//   LayerWritten prefill -> decode, once per (chunk, layer) with a fragment, after every write of
//                that chunk's layer to that decode rank completed (the bytes are visible there):
//                {src tp rank, chunk index, layer, writes, bytes}.
//   Quiesced     prefill -> decode, for a Failed request, once none of this prefill rank's writes
//                of the request to that decode rank can land any more (every write completed
//                or failed, and none will be posted), or at once in answer to an Abort of a
//                request it never wrote: {src tp rank, why it failed}. The decode rank keeps the
//                request's pages pinned until then (see kv_receiver.h).
//
// The ordered data plane (data_plane.h: a two-sided data transport that matches per peer in post
// order, without tags: NCCL) sends the data messages on the data transport with no data tag (the
// Bootstrap's data tag is kOrderedDataTag: no slot is taken) and adds one message, on the control
// tag; its Completion travels on the control tag too, after the request's last DataPosted:
//   DataPosted   prefill -> decode, before each batch of data sends of a (chunk, layer interval),
//                posted under the destination's lock so that the announcements to a decode rank
//                are in the order of the sends on the data transport: {src tp rank, chunk
//                index, layer interval, the exact byte size of every message in post order}.
//                The decode rank posts one receive of exactly each size, in that order -- into
//                scratch memory when the request is unknown, failed or the sizes disagree with
//                its plan -- so the pair's stream never falls out of step.
//
// ControlChannel threading: one control thread runs every handler (incoming messages, ticks,
// tasks posted by other threads), so engine state touched only by handlers needs no lock.
// Transport callbacks only enqueue work for it (they never re-enter the transport or block).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

inline constexpr Tag kControlTag = 0;
inline constexpr Tag kOrderedDataTag = 1;
inline constexpr Tag kDataTagBase = 16;

enum class MsgType : uint16_t {
    kBootstrap = 1,
    kAck = 2,
    kChunk = 3,
    kAbort = 4,
    kHeartbeat = 5,
    kCompletion = 6,
    kRegions = 7,
    kLayerWritten = 8,
    kQuiesced = 9,
    kDataPosted = 10,
};
std::string_view msg_type_name(MsgType type);

struct BootstrapMsg {
    static constexpr MsgType kType = MsgType::kBootstrap;
    uint64_t request_id = 0;
    int32_t decode_rank = -1;  // world rank
    int32_t decode_tp_rank = 0;
    int32_t decode_tp_size = 1;
    Tag data_tag = 0;
    int64_t num_tokens = 0;
    uint64_t max_message_bytes = 0;
    KvLayoutSummary layout;
    std::vector<int32_t> dst_pages;
    // Write mode with arrival words (RegionsMsg::arrival_slots > 0): the request's slot, whose
    // word of layer l sits at (arrival_slot * num_layers + l) * 8 of the arrival region; -1: none
    // (the prefill rank signals nothing for this request).
    int32_t arrival_slot = -1;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.decode_rank);
        v(m.decode_tp_rank);
        v(m.decode_tp_size);
        v(m.data_tag);
        v(m.num_tokens);
        v(m.max_message_bytes);
        v(m.layout);
        v(m.dst_pages);
        v(m.arrival_slot);
    }
};

struct AckMsg {
    static constexpr MsgType kType = MsgType::kAck;
    uint64_t request_id = 0;
    int32_t prefill_tp_rank = 0;
    int32_t prefill_tp_size = 1;
    bool ok = true;
    std::string reason;
    uint64_t max_message_bytes = 0;
    KvLayoutSummary layout;
    // Write mode: this rank adds every (chunk, layer)'s bytes to the request's arrival word
    // (the Bootstrap named a slot, and this rank's data transport has write signals).
    bool arrival_signals = false;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.prefill_tp_rank);
        v(m.prefill_tp_size);
        v(m.ok);
        v(m.reason);
        v(m.max_message_bytes);
        v(m.layout);
        v(m.arrival_signals);
    }
};

struct ChunkMsg {
    static constexpr MsgType kType = MsgType::kChunk;
    uint64_t request_id = 0;
    uint32_t chunk_index = 0;
    int64_t token_begin = 0;
    int64_t token_end = 0;
    bool is_last = false;
    // The prefill pages holding [token_begin, token_end): page indices src_first_page.. of the
    // request's prefill page table (the receiver needs them to cut the same runs).
    int64_t src_first_page = 0;
    std::vector<int32_t> src_pages;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.chunk_index);
        v(m.token_begin);
        v(m.token_end);
        v(m.is_last);
        v(m.src_first_page);
        v(m.src_pages);
    }
};

struct AbortMsg {
    static constexpr MsgType kType = MsgType::kAbort;
    uint64_t request_id = 0;
    std::string reason;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.reason);
    }
};

struct CompletionMsg {
    static constexpr MsgType kType = MsgType::kCompletion;
    uint64_t request_id = 0;
    int32_t src_tp_rank = 0;
    bool has_first_token = false;
    int32_t first_token = -1;
    int32_t num_layers = 0;
    int32_t buffer_count = 0;
    int32_t head_begin = 0;
    int32_t head_count = 0;
    uint32_t chunks = 0;
    bool has_checksums = false;
    std::vector<uint64_t> checksums;  // [layer][buffer][head], when has_checksums
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.src_tp_rank);
        v(m.has_first_token);
        v(m.first_token);
        v(m.num_layers);
        v(m.buffer_count);
        v(m.head_begin);
        v(m.head_count);
        v(m.chunks);
        v(m.has_checksums);
        v(m.checksums);
    }

    [[nodiscard]] uint64_t checksum(int layer, int buf, int head_index) const {
        return checksums[(static_cast<size_t>(layer) * static_cast<size_t>(buffer_count) +
                          static_cast<size_t>(buf)) *
                             static_cast<size_t>(head_count) +
                         static_cast<size_t>(head_index)];
    }
};

// The write mode's region descriptors: descriptor i (of layer i / buffer_count, buffer
// i % buffer_count) is descriptor_bytes[i] bytes of `descriptors`, after those of 0..i-1. With
// arrival words (the decode rank's data transport has write signals): `arrival_descriptor` is
// the region of arrival_slots x num_layers 8-byte words (kv_receiver.h, "Arrival words");
// otherwise it is empty and arrival_slots is 0.
struct RegionsMsg {
    static constexpr MsgType kType = MsgType::kRegions;
    uint64_t request_id = 0;  // the request whose Bootstrap follows (logs only)
    int32_t decode_rank = -1;
    int32_t num_layers = 0;
    int32_t buffer_count = 0;
    std::vector<uint32_t> descriptor_bytes;
    std::vector<uint8_t> descriptors;
    int32_t arrival_slots = 0;
    std::vector<uint8_t> arrival_descriptor;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.decode_rank);
        v(m.num_layers);
        v(m.buffer_count);
        v(m.descriptor_bytes);
        v(m.descriptors);
        v(m.arrival_slots);
        v(m.arrival_descriptor);
    }

    // Appends the descriptor of the next (layer, buffer) region.
    void add(std::span<const uint8_t> descriptor);
    // Descriptor `index` (layer * buffer_count + buffer). Precondition: decode_regions accepted
    // the message (or every descriptor was add()ed), index < descriptor_bytes.size().
    [[nodiscard]] std::span<const uint8_t> descriptor(size_t index) const;
};

struct LayerWrittenMsg {
    static constexpr MsgType kType = MsgType::kLayerWritten;
    uint64_t request_id = 0;
    int32_t src_tp_rank = 0;
    uint32_t chunk_index = 0;
    int32_t layer = 0;
    uint32_t writes = 0;  // one-sided writes of this (chunk, layer)
    uint64_t bytes = 0;   // their payload bytes
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.src_tp_rank);
        v(m.chunk_index);
        v(m.layer);
        v(m.writes);
        v(m.bytes);
    }
};

struct QuiescedMsg {
    static constexpr MsgType kType = MsgType::kQuiesced;
    uint64_t request_id = 0;
    int32_t src_tp_rank = 0;
    std::string reason;  // why the request failed on the prefill rank
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.src_tp_rank);
        v(m.reason);
    }
};

// The ordered data plane (data_plane.h: a two-sided data transport without tag matching, NCCL)
// announces every batch of data sends before posting it: the data transport matches per (source,
// destination) pair in post order and needs a receive of exactly the message's size, so the
// decode rank posts its receives from these, in their order.
struct DataPostedMsg {
    static constexpr MsgType kType = MsgType::kDataPosted;
    uint64_t request_id = 0;
    int32_t src_tp_rank = 0;
    uint32_t chunk_index = 0;
    int32_t layer_begin = 0;  // the layer interval [layer_begin, layer_end) of the chunk
    int32_t layer_end = 0;
    // The exact size of every data message of the interval, in post order (layer, buffer, run).
    std::vector<uint64_t> sizes;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
        v(m.src_tp_rank);
        v(m.chunk_index);
        v(m.layer_begin);
        v(m.layer_end);
        v(m.sizes);
    }
};

// The largest encoded CompletionMsg for these dimensions (the receive buffer's capacity).
[[nodiscard]] size_t completion_capacity(int num_layers, int buffer_count, int head_count);

using Bytes = std::vector<uint8_t>;

[[nodiscard]] Bytes encode(const BootstrapMsg& m);
[[nodiscard]] Bytes encode(const AckMsg& m);
[[nodiscard]] Bytes encode(const ChunkMsg& m);
[[nodiscard]] Bytes encode(const AbortMsg& m);
[[nodiscard]] Bytes encode_heartbeat();
[[nodiscard]] Bytes encode(const CompletionMsg& m);
[[nodiscard]] Bytes encode(const RegionsMsg& m);
[[nodiscard]] Bytes encode(const LayerWrittenMsg& m);
[[nodiscard]] Bytes encode(const QuiescedMsg& m);
[[nodiscard]] Bytes encode(const DataPostedMsg& m);

// kDataLoss on a short/garbled message, a bad magic or version, or (decode_*) a message of
// another type, an invalid layout summary, (completion) a checksum count that disagrees with
// the dimensions, (regions) descriptor sizes that disagree with the dimensions or the bytes, or
// (data posted) an empty or inverted layer interval, no sizes, or a zero size.
[[nodiscard]] StatusOr<MsgType> peek_type(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<BootstrapMsg> decode_bootstrap(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<AckMsg> decode_ack(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<ChunkMsg> decode_chunk(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<AbortMsg> decode_abort(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<CompletionMsg> decode_completion(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<RegionsMsg> decode_regions(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<LayerWrittenMsg> decode_layer_written(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<QuiescedMsg> decode_quiesced(std::span<const uint8_t> bytes);
[[nodiscard]] StatusOr<DataPostedMsg> decode_data_posted(std::span<const uint8_t> bytes);

struct ControlOptions {
    std::chrono::milliseconds heartbeat_interval{200};
    // Period of on_tick (timeouts are detected within one tick).
    std::chrono::milliseconds tick{10};
    // A gap between two ticks longer than this is a stall of this process (ControlListener::
    // on_stall), not silence of the peers.
    std::chrono::milliseconds stall{1000};
    // Capacity of each posted control receive; a larger control message is a protocol error.
    size_t max_control_bytes = size_t{4} << 20;
};

// Implemented by the engine; every method runs on the control thread.
class ControlListener {
public:
    virtual ~ControlListener() = default;
    // `bytes` is valid only during the call (its buffer receives a later message).
    virtual void on_control(int peer, std::span<const uint8_t> bytes) = 0;
    // The control link to `peer` failed (kUnavailable: peer gone or this transport closed;
    // kDataLoss: oversized or garbled control message). No more control messages from it.
    virtual void on_peer_failed(int peer, const Status& status) = 0;
    virtual void on_tick(std::chrono::steady_clock::time_point now) = 0;
    // The control thread did not run for longer than ControlOptions::stall (this process was
    // stopped or starved): the peers' silence over that gap is ours, not theirs (last_heard() of
    // every peer restarts at `now`), and the listener should not count it against its requests'
    // progress either. Called before the tick at `now`.
    virtual void on_stall(std::chrono::steady_clock::time_point /*now*/) {}
};

class ControlChannel : public std::enable_shared_from_this<ControlChannel> {
public:
    using Clock = std::chrono::steady_clock;

    // Not started; `transport` must outlive the channel's operations (close the transport after
    // stopping the channel, or destroy the channel first).
    static std::shared_ptr<ControlChannel> create(Transport& transport, ControlOptions options);
    ~ControlChannel();
    ControlChannel(const ControlChannel&) = delete;
    ControlChannel& operator=(const ControlChannel&) = delete;

    // Posts a control receive for every peer and starts the control thread.
    [[nodiscard]] Status start(ControlListener* listener);
    // Stops the thread. drain: run the tasks already posted first (graceful shutdown; they may
    // send Aborts). Then waits up to `linger` for the control sends in flight to complete (a
    // live peer's control receive matches them), and withdraws (cancels) the pending control
    // receives and whatever sends are still pending.
    void stop(bool drain, std::chrono::milliseconds linger = std::chrono::milliseconds(0));

    // Any thread. Posts `bytes` to `peer` on kControlTag; a failure is reported through
    // on_peer_failed when it means the peer is gone.
    void send(int peer, Bytes bytes);
    // Any thread. Runs `fn` on the control thread (dropped once stopped).
    void post(std::function<void()> fn);

    // Control thread only.
    [[nodiscard]] Clock::time_point last_heard(int peer) const;
    [[nodiscard]] bool peer_failed(int peer) const;
    // Heartbeats go to the peers flagged here (the peers of active requests; the engine
    // recomputes the set every tick). Indexed by world rank.
    void set_interest(std::vector<uint8_t> peers);

    [[nodiscard]] Transport& transport() const { return transport_; }
    [[nodiscard]] bool on_control_thread() const;

private:
    ControlChannel(Transport& transport, ControlOptions options);
    void loop();
    void post_control_recv(int peer);
    void on_recv_done(int peer, const std::shared_ptr<Bytes>& buf, const Status& st, size_t n);
    void send_heartbeats(Clock::time_point now);
    void post_tracked_send(int peer, std::shared_ptr<Bytes> buf, std::function<void()> on_finished);

    Transport& transport_;
    const ControlOptions options_;
    ControlListener* listener_ = nullptr;
    std::thread thread_;

    Mutex mu_;
    CondVar cv_;
    std::deque<std::function<void()>> tasks_ PDSIM_GUARDED_BY(mu_);
    bool stop_ PDSIM_GUARDED_BY(mu_) = false;
    bool closed_ PDSIM_GUARDED_BY(mu_) = false;  // the thread is gone: posts are dropped
    bool started_ = false;                       // start()/stop() caller's thread

    // Control thread only.
    std::vector<Clock::time_point> last_heard_;
    std::vector<uint8_t> failed_;
    std::vector<uint8_t> interest_;
    std::vector<Clock::time_point> last_heartbeat_;
    std::vector<RequestHandle> recv_handles_;
    // Receive buffers (max_control_bytes each) whose message was handled, reused by the next
    // post: a fresh zero-filled buffer per message cost a 4 MiB memset per control message (and,
    // under TSan, a page-fault storm that stalled the control thread for seconds).
    std::vector<std::shared_ptr<Bytes>> spare_recv_buffers_;

    // Heartbeat in flight per peer (set by the control thread, cleared by the send's callback).
    std::unique_ptr<std::atomic<bool>[]> heartbeat_busy_;

    // Pending control sends, for withdrawal at stop.
    Mutex sends_mu_;
    CondVar sends_cv_;  // signalled when a tracked send completes
    uint64_t next_send_id_ PDSIM_GUARDED_BY(sends_mu_) = 0;
    std::unordered_map<uint64_t, RequestHandle> sends_ PDSIM_GUARDED_BY(sends_mu_);
};

}  // namespace pdsim::transfer
