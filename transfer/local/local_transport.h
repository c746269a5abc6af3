// "local": an in-process transport for unit tests of the layers above the Transport interface.
//
// A LocalWorld is shared by world_size endpoints in one process; threads act as ranks. Each
// endpoint is a real Transport with the full contract of transfer/transport.h:
//   - two-sided: a send waits in its (src, dst, tag) queue until the matching receive is posted
//     (or the other way round); the match copies once, directly from the send buffer into the
//     receive buffer, on the thread whose post made the match. FIFO per (src, dst, tag).
//   - one-sided: register_memory publishes a region in the world; post_write copies into it on the
//     posting thread (so it is complete when the post returns).
//   - close() (or destruction) marks the rank dead: its pending operations fail with kUnavailable
//     "transport closed", peers' operations that involve it fail with kUnavailable naming it,
//     and later posts to it fail at once.
// Thread-safety: one mutex per world guards all queues; copies run outside it.
//
// "local_writes": the same endpoint with only its one-sided operations (register_memory,
// import_remote, post_write, post_signal): post_send / post_recv are kUnimplemented and it
// declares no tags. Given to the transfer engine as its data transport, it makes the engine run
// its write plane over host memory -- the plane GPU ranks run over cuda_ipc -- so CPU ranks
// (threads of one process: the testbed's --data-transport local_writes) exercise it end to end.
// Its world must be its own (a rank attaches one endpoint per world), not the control
// transport's.
#pragma once

#include <memory>

#include "transfer/transport.h"

namespace pdsim::transfer {

class LocalWorld;

// local's option block (TransportOptions::set): the shared world every rank attaches to.
struct LocalOptions {
    std::shared_ptr<LocalWorld> world;  // make_local_world; required
};

// What "local" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor local_transport_descriptor() {
    return {.name = "local",
            .caps = {.host_memory = true,
                     .two_sided = true,
                     .one_sided_write = true,
                     .tag_matching = true,
                     .detects_peer_failure = true,
                     .write_signals = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kSharedWorld,
                     .medium = TransportMedium::kProcessMemory},
            .summary = "in-process: threads of one process act as ranks (LocalOptions::world)"};
}

// A world of `world_size` (>= 1) in-process ranks. Each rank may attach one endpoint at a time.
[[nodiscard]] std::shared_ptr<LocalWorld> make_local_world(int world_size);

// Needs LocalOptions::world and options.rank in [0, world size).
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_local_transport(
    const TransportOptions& options);

// What "local_writes" declares: local's one-sided half.
[[nodiscard]] inline TransportDescriptor local_writes_transport_descriptor() {
    return {.name = "local_writes",
            .caps = {.host_memory = true,
                     .two_sided = false,
                     .one_sided_write = true,
                     .tag_matching = false,
                     .detects_peer_failure = true,
                     .write_signals = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kSharedWorld,
                     .medium = TransportMedium::kProcessMemory},
            .summary =
                "in-process one-sided writes (local without its two-sided operations): "
                "the engine's write plane on host memory"};
}

// As make_local_transport, for "local_writes".
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_local_writes_transport(
    const TransportOptions& options);

}  // namespace pdsim::transfer
