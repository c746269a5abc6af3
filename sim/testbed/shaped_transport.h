// ShapedTransport: a Transport decorator that throttles this rank's outgoing messages to a link's
// bandwidth and latency (topology/shaping.h), so a CPU testbed run can keep an emulated GPU
// cluster's compute:transfer ratio, or make the KV transfer long enough to see the overlap.
//
// Contract (topology/shaping.h): a message of n bytes posted at t is handed to the inner
// transport no earlier than t + latency_us + n / bytes_per_s; messages to one destination share
// the bandwidth through one token bucket, in posting order (so per-peer order, and with it the
// transport's non-overtaking rule, is kept). One-sided writes are shaped as sends are (per
// destination dst.peer, in the same bucket): a GPU rank's KV over cuda_ipc. Receives, the
// one-sided set-up calls, and sends and writes to an unlimited link pass straight through. A held
// operation completes when the inner one completes; cancel() withdraws it while it is still held;
// close() fails what is held and closes the inner transport. Stream-ordered posts
// (post_*_after) are withdrawn (capabilities().stream_ordered false): a device-side start would
// escape the bucket, so the engine posts each layer once the host saw it ready.
//
// Thread-safety: as transfer/transport.h; one scheduler thread posts the held sends.
#pragma once

#include <memory>

#include "topology/shaping.h"
#include "transfer/transport.h"

namespace pdsim::testbed {

[[nodiscard]] std::unique_ptr<transfer::Transport> make_shaped_transport(
    std::unique_ptr<transfer::Transport> inner, const topo::LinkShaping& shaping);

}  // namespace pdsim::testbed
