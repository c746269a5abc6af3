// The testbed's own messages (sim/testbed/comm.h carries them): every kind the router, the
// instance leaders, their TP followers and rank 0's collection exchange, as a struct with named
// fields, and the records a rank's result carries (timeline slices, transfer-engine events).
//
// One field list per struct: each declares `static void fields(Self&, Visitor&)`, which names
// every field once with its wire key; encode_message() and decode_message() both walk it, so the
// two directions cannot disagree. On the wire a message is a JSON object whose "k" is the
// struct's kKind, with one member per field (serialized as CBOR by the Mailbox). Records marked
// kPositional travel as JSON arrays in field order (the bulk of a result: one per event).
//
// Engine events are recorded with transfer::TransferEvent::Kind itself (EngineEventRecord), so
// the writer (server.cpp) and the reader (testbed.cpp's transfer summary) share one enum.
//
// Thread-safety: the functions are pure; call them from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "common/status.h"
#include "transfer/engine/engine_types.h"

namespace pdsim::testbed {

// ---- router -> instance leaders (Channel::kInstance) ----

// A request for an instance (both instances of a disaggregated request get it).
struct SubmitMsg {
    static constexpr std::string_view kKind = "submit";
    uint64_t id = 0;
    int32_t input_len = 0;
    int32_t output_len = 0;
    std::vector<int64_t> hash;  // the prompt's prefix-block hash ids (the prompt is made from them)
    int prefill_instance = -1;  // colocated: both are the serving instance
    int decode_instance = -1;
    bool operator==(const SubmitMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
        v("in", m.input_len);
        v("out", m.output_len);
        v("hash", m.hash);
        v("p", m.prefill_instance);
        v("d", m.decode_instance);
    }
};

// The router gave up on the request: drop it (a no-op where it is already gone).
struct CancelMsg {
    static constexpr std::string_view kKind = "cancel";
    uint64_t id = 0;
    bool operator==(const CancelMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
    }
};

// The phase is over (router -> leaders, leaders -> their followers).
struct EndMsg {
    static constexpr std::string_view kKind = "end";
    bool operator==(const EndMsg&) const = default;
    template <class Self, class V>
    static void fields(Self&, V&) {}
};

// ---- instance leader -> its TP followers (Channel::kInstance) ----

// One request's part of a forward.
struct PlanEntry {
    uint64_t id = 0;
    int64_t t0 = 0, t1 = 0;       // positions computed by this forward
    std::vector<int32_t> tokens;  // t1 - t0 token ids
    std::vector<int32_t> pages;   // the request's page table
    bool first = false;           // first chunk (prefill: add_request)
    bool last = false;            // last prefill chunk (samples the first token)
    int32_t input_len = 0;
    int32_t state_slot = 0;  // models with recurrent layers: the request's state pool slot
    // Models whose sliding layers have their own pool: the request's ring of pages there
    // (sim/testbed/window.h); else empty.
    std::vector<int32_t> window_ring;
    bool operator==(const PlanEntry&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
        v("t0", m.t0);
        v("t1", m.t1);
        v("tok", m.tokens);
        v("pg", m.pages);
        v("f", m.first);
        v("l", m.last);
        v("n", m.input_len);
        v("ss", m.state_slot);
        v("wr", m.window_ring);
    }
};

// One forward, run by the leader and replayed by every follower. mode is kExtend or kDecode
// (on the wire "e" / "d"; any other mode is refused by decode_message).
struct Plan {
    static constexpr std::string_view kKind = "step";
    attn::ForwardMode mode = attn::ForwardMode::kExtend;
    std::vector<PlanEntry> entries;
    bool operator==(const Plan&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("m", m.mode);
        v("e", m.entries);
    }
};

// Decode: the leader admitted the request; the follower submits its own receive.
struct AdmitMsg {
    static constexpr std::string_view kKind = "admit";
    uint64_t id = 0;
    std::vector<int32_t> pages;        // destination pages
    int64_t input_len = 0;             // tokens to receive
    std::vector<int> prefill_ranks;    // world ranks of the prefill instance, by TP rank
    int32_t state_slot = 0;            // destination state slot (models with recurrent layers)
    std::vector<int32_t> window_ring;  // its sliding layers' ring (PlanEntry::window_ring)
    bool operator==(const AdmitMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
        v("pg", m.pages);
        v("n", m.input_len);
        v("pr", m.prefill_ranks);
        v("ss", m.state_slot);
        v("wr", m.window_ring);
    }
};

// Decode: the leader freed the request's pages; the follower releases its engine state.
struct ReleaseMsg {
    static constexpr std::string_view kKind = "release";
    uint64_t id = 0;
    bool operator==(const ReleaseMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
    }
};

// The leader gave up on a request its engines may still transfer (router cancel, instance
// failure), or frees a request that a follower has not reported idle: the follower aborts its
// engine request (its pages stay pinned until no transfer can land, then it sends PagesIdleMsg;
// at once if its engine does not hold the request).
struct EngineAbortMsg {
    static constexpr std::string_view kKind = "eabort";
    uint64_t id = 0;
    bool operator==(const EngineAbortMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
    }
};

// ---- TP follower -> its leader (Channel::kInstance) ----

// A follower's engine outcome for one request. ok false: `error` says why (first_token and bytes
// are then -1 and 0). pages_idle: no transfer into or out of the request's pages on this follower
// can still land (always so for ok; a failed request may stay in use until its transfers drain,
// and then the follower sends a PagesIdleMsg).
struct EngineOutcomeFields {
    uint64_t id = 0;
    bool ok = false;
    std::string error;
    int32_t first_token = -1;  // receiver: the first token that came with the KV
    uint64_t bytes = 0;        // receiver: KV bytes received
    bool pages_idle = true;
    // This rank's part of the request's KV digest (kv_digest.h; 0: none taken): the prefill
    // side's after its last chunk, the decode side's once everything arrived.
    uint64_t kv_digest = 0;
    bool operator==(const EngineOutcomeFields&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
        v("ok", m.ok);
        v("err", m.error);
        v("tok", m.first_token);
        v("bytes", m.bytes);
        v("idle", m.pages_idle);
        v("dg", m.kv_digest);
    }
};
// A follower's pages of the request are idle: no transfer into or out of them can still land
// (after a failed outcome that was not idle yet, or in answer to an EngineAbortMsg for a request
// its engine does not hold). The leader frees a request's pages only once every TP rank of the
// instance is idle for it.
struct PagesIdleMsg {
    static constexpr std::string_view kKind = "fidle";
    uint64_t id = 0;
    bool operator==(const PagesIdleMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("id", m.id);
    }
};
// Prefill follower: its sender finished the request.
struct SentReport : EngineOutcomeFields {
    static constexpr std::string_view kKind = "fsent";
    bool operator==(const SentReport&) const = default;
};
// Decode follower: its receiver has the whole request (or failed).
struct ReadyReport : EngineOutcomeFields {
    static constexpr std::string_view kKind = "fready";
    bool operator==(const ReadyReport&) const = default;
};

// ---- instance leaders -> router (Channel::kRouter) ----
// Times are microseconds on the sender's clock (now_us()); `phase` (phase_name()) lets the router
// drop a previous phase's stragglers. prefill_start_us is -1 when no prefill forward ran.

// The request's first token exists (colocated, or decode once the KV arrived).
struct FirstTokenReport {
    static constexpr std::string_view kKind = "first";
    std::string phase;
    uint64_t id = 0;
    double t_us = 0;
    double prefill_start_us = -1;
    bool operator==(const FirstTokenReport&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("ph", m.phase);
        v("id", m.id);
        v("t", m.t_us);
        v("ps", m.prefill_start_us);
    }
};

// Disaggregated prefill: the instance is done with the request (ok: every TP rank sent its KV).
struct PrefillDoneReport {
    static constexpr std::string_view kKind = "pdone";
    std::string phase;
    uint64_t id = 0;
    bool ok = false;
    std::string error;  // ok false: why
    double t_us = 0;
    double prefill_start_us = -1;
    uint64_t kv_digest = 0;  // ok: the instance's KV digest of the request (0: none taken)
    bool operator==(const PrefillDoneReport&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("ph", m.phase);
        v("id", m.id);
        v("ok", m.ok);
        v("err", m.error);
        v("t", m.t_us);
        v("ps", m.prefill_start_us);
        v("dg", m.kv_digest);
    }
};

// The request is finished (ok: every token generated) or failed.
struct RequestDoneReport {
    static constexpr std::string_view kKind = "done";
    std::string phase;
    uint64_t id = 0;
    bool ok = false;
    std::string error;               // ok false: why
    double t_us = 0;                 // the last token's time (or the failure's)
    std::vector<int32_t> tokens;     // ok: the generated tokens
    std::vector<double> token_t_us;  // ok: when each was generated
    uint64_t bytes = 0;              // ok: KV bytes received (decode)
    uint64_t kv_digest = 0;          // ok: the decode instance's KV digest (0: none taken)
    bool operator==(const RequestDoneReport&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("ph", m.phase);
        v("id", m.id);
        v("ok", m.ok);
        v("err", m.error);
        v("t", m.t_us);
        v("tokens", m.tokens);
        v("tt", m.token_t_us);
        v("bytes", m.bytes);
        v("dg", m.kv_digest);
    }
};

// ---- rank 0 <-> the other ranks (Channel::kCollect) ----

// The tcp transport's rendezvous directory and session token, chosen by rank 0.
struct TcpBootstrapMsg {
    static constexpr std::string_view kKind = "tcp";
    std::string dir;
    std::string token;
    bool operator==(const TcpBootstrapMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("dir", m.dir);
        v("tok", m.token);
    }
};

// The KV link shaping's time scale, decided by rank 0.
struct ShapeMsg {
    static constexpr std::string_view kKind = "shape";
    double time_scale = 0;
    bool operator==(const ShapeMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("ts", m.time_scale);
    }
};

// The run's outcome, decided by rank 0: every rank exits with it.
struct ExitMsg {
    static constexpr std::string_view kKind = "exit";
    int code = 0;         // exit code (exit_code_of)
    std::string message;  // the error's message ("" when code is 0)
    // A peer is dead or hung: MPI_Finalize would wait for it, so every rank ends the job with
    // MPI_Abort instead.
    bool peer_lost = false;
    bool operator==(const ExitMsg&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("code", m.code);
        v("msg", m.message);
        v("peer_lost", m.peer_lost);
    }
};

// One timeline slice (dur_us >= 0) or instant (dur_us -1) on a rank's clock. tid is one of the
// server's rows (scheduler, compute stream, record, send, receive); args a JSON object or null.
struct TimelineRecord {
    static constexpr bool kPositional = true;
    int tid = 0;
    std::string name;
    std::string category;
    double ts_us = 0;
    double dur_us = -1;
    nlohmann::json args;
    bool operator==(const TimelineRecord&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("tid", m.tid);
        v("name", m.name);
        v("cat", m.category);
        v("ts", m.ts_us);
        v("dur", m.dur_us);
        v("args", m.args);
    }
};

// One transfer-engine event (transfer::TransferEvent) at t_us on the rank's clock.
struct EngineEventRecord {
    static constexpr bool kPositional = true;
    transfer::TransferEvent::Kind kind = transfer::TransferEvent::Kind::kLayerReady;
    uint64_t request = 0;
    int layer = -1;
    int peer = -1;
    uint32_t chunk = 0;
    uint64_t bytes = 0;
    double t_us = 0;
    bool operator==(const EngineEventRecord&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("kind", m.kind);
        v("request", m.request);
        v("layer", m.layer);
        v("peer", m.peer);
        v("chunk", m.chunk);
        v("bytes", m.bytes);
        v("t", m.t_us);
    }
};

// The ordering validator's report on one rank.
struct OrderingResult {
    int64_t checked_layers = 0;
    std::vector<std::string> violations;
    bool operator==(const OrderingResult&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("checked", m.checked_layers);
        v("violations", m.violations);
    }
};

// What a rank sends rank 0 at the end of a phase (rank 0 keeps its own): everything the report
// needs, times on the rank's clock.
struct RankResult {
    static constexpr std::string_view kKind = "result";
    int rank = 0;
    std::string phase;  // phase_name()
    std::vector<TimelineRecord> timeline;
    std::vector<EngineEventRecord> engine_events;
    std::map<uint64_t, double> prefill_end_us;  // request -> end of its last prefill forward
    OrderingResult ordering;
    nlohmann::json stats = nlohmann::json::object();  // free-form counters, copied into the report
    std::string error;                                // "" unless the rank's phase failed
    bool operator==(const RankResult&) const = default;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v("rank", m.rank);
        v("phase", m.phase);
        v("timeline", m.timeline);
        v("xfer", m.engine_events);
        v("pend", m.prefill_end_us);
        v("ordering", m.ordering);
        v("stats", m.stats);
        v("error", m.error);
    }
};

// A message body from its CBOR bytes (the Mailbox's wire form), strict (no trailing bytes).
// kDataLoss for bytes that are not one CBOR value -- including a declared array or map size that
// nlohmann rejects by throwing even with exceptions off (out_of_range 408), and a value nested
// deeper than kMaxCborDepth (checked before parsing: the parser recurses per level). Never throws.
inline constexpr size_t kMaxCborDepth = 32;
[[nodiscard]] StatusOr<nlohmann::json> decode_cbor(std::span<const uint8_t> bytes);

// The wire form of `msg`: {"k": Msg::kKind, <key>: <field>...}.
template <class Msg>
[[nodiscard]] nlohmann::json encode_message(const Msg& msg);

// The message in `body`. Errors (kInvalidArgument): the kind is not Msg::kKind, or a field is
// missing or of the wrong type or range; the message names the kind and the field (with its path
// inside arrays and nested objects, e.g. "step: field 'e[2].t0': missing").
template <class Msg>
[[nodiscard]] StatusOr<Msg> decode_message(const nlohmann::json& body);

}  // namespace pdsim::testbed
