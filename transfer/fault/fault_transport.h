// FaultTransport: a decorator that injects transport faults into any Transport, for tests of the
// layers above (the sender/receiver must report these failures, never hang on them).
//
// Spec: one or more faults separated by ';', each "kind[:key=value[,key=value...]]":
//   delay:ms=5[,jitter_ms=0]     each outgoing send/write is handed to the inner transport `ms`
//                                (+ uniform [0, jitter_ms]) later. Without jitter the per-peer
//                                order is kept; with jitter sends may overtake each other.
//   drop:p=0.1[,seed=1]          each outgoing send is dropped with probability p: its handle
//                                completes OK, nothing reaches the peer (its receive times out).
//   corrupt:p=1[,seed=1][,bytes=1]  each incoming message is damaged with probability p: `bytes`
//                                bytes of the received buffer are XOR-flipped (never to the same
//                                value) before the receive completes, as if damaged in flight.
//   reorder:p=0.5[,seed=1][,hold_ms=50]  with probability p an outgoing send is held back and
//                                released right after the next send to the same peer (or after
//                                hold_ms), so two consecutive sends to a peer swap order.
//   disconnect:after=5           the first `after` sends go out; then this rank disconnects: the
//                                inner transport is closed (peers see the rank as gone), pending
//                                and later operations fail with kUnavailable naming the fault.
// Example: "delay:ms=2;drop:p=0.05,seed=7".
// Every kind also takes seed=N. Strict: an unknown kind or key, a key given twice, a kind given
// twice, a missing required key (delay's ms, drop's and corrupt's p, disconnect's after), an empty
// fault (";;"), an empty item, and a number that is not finite, negative, not whole where it
// counts (bytes, after, seed) or above its bound (p <= 1; ms, jitter_ms, hold_ms <= 60000;
// bytes <= 2^20; after <= 1e15; seed <= 2^53) are kInvalidArgument naming the part. "" (or only
// blanks): no fault.
//
// Determinism: every random decision is drawn at post time from a generator seeded with
// (seed, rank), so the same spec and the same sequence of posts give the same faults. Byte
// positions for corruption are derived from (seed, rank, receive index).
//
// Thread-safety and contract: as transfer/transport.h. Delayed and held sends are posted to the
// inner transport by the decorator's own scheduler thread; completions are chained from the
// inner handle to the returned one. close() fails operations still held by the decorator and
// closes the inner transport.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "transfer/transport.h"

namespace pdsim::transfer {

struct FaultSpec {
    double delay_ms = 0;
    double jitter_ms = 0;
    double drop_p = 0;
    double corrupt_p = 0;
    int corrupt_bytes = 1;
    double reorder_p = 0;
    double reorder_hold_ms = 50;
    int64_t disconnect_after = -1;  // -1: never
    uint64_t seed = 1;
    std::string text;  // the spec as given
};

// fault's option block (TransportOptions::set).
struct FaultOptions {
    std::string spec;             // parse_fault_spec's grammar (above)
    std::string inner = "local";  // the registered transport to wrap (not "fault")
};

// What "fault" declares (registered with it, see transfer/transport.h): a decorator; it can wrap
// any transport, and an instance has the capabilities of the one it wraps.
[[nodiscard]] inline TransportDescriptor fault_transport_descriptor() {
    return {.name = "fault",
            .caps = {.host_memory = true,
                     .device_memory = true,
                     .two_sided = true,
                     .one_sided_write = true,
                     .tag_matching = true,
                     .detects_peer_failure = true,
                     .write_signals = true,
                     .spans_processes = true,
                     .spans_nodes = true,
                     .threads_of_one_process = true,
                     .decorator = true,
                     .setup = TransportSetup::kInner,
                     .medium = TransportMedium::kInner},
            .summary =
                "decorator injecting delays, drops, corruption, reordering and disconnects "
                "into FaultOptions::inner"};
}

// The grammar above. kInvalidArgument naming the bad kind, key or value (quoting at most 80
// bytes of the spec).
[[nodiscard]] StatusOr<FaultSpec> parse_fault_spec(std::string_view spec);

[[nodiscard]] StatusOr<std::unique_ptr<Transport>> wrap_with_faults(
    std::unique_ptr<Transport> inner, const FaultSpec& spec);

// Registry entry "fault": creates FaultOptions::inner with the same options and wraps it with
// FaultOptions::spec.
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_fault_transport(
    const TransportOptions& options);

}  // namespace pdsim::transfer
