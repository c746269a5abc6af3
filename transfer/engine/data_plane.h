// The data plane of the layerwise KV transfer engine: how the KV bytes travel from a prefill rank
// to a decode rank. Both sides choose it at create() from their data transport's declared
// capabilities (EngineOptions::data_transport, else the control transport), never from its name:
//
//   two_sided && tag_matching  -> kTwoSided: post_send / post_recv on per-request data tags
//                                 (control.h), on the data transport;
//   else one_sided_write       -> kOneSidedWrite: the prefill rank post_write()s into regions the
//                                 decode rank registered, and says so on the control channel
//                                 (LayerWritten; kv_sender.h, kv_receiver.h);
//   else                       -> kUnimplemented (NCCL's untagged in-order matching is not used
//                                 yet).
// The two sides of a request must choose the same plane: the Bootstrap's data tag says which one
// the decode rank uses (0: writes), and a prefill rank refuses a Bootstrap of the other plane.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

enum class DataPlane : uint8_t {
    kTwoSided,       // data messages on data tags (the control transport, or a separate one)
    kOneSidedWrite,  // one-sided writes into the decode rank's registered KV regions
};
std::string_view data_plane_name(DataPlane plane);

struct DataPlaneChoice {
    DataPlane plane = DataPlane::kTwoSided;
    Transport* data = nullptr;  // the transport that carries the bytes (never null)
};

// The data plane of an engine (`engine`: "KV sender" / "KV receiver", for messages) over
// `control` (the Transport& given to create()) and `data` (EngineOptions::data_transport; null:
// `control` carries the data), for a KvLayout `layout`. Errors:
//   kUnimplemented    `control` is not two-sided and tag-matching (control messages need both);
//                     the data transport offers neither data plane (the message names it and
//                     what it lacks).
//   kInvalidArgument  the data transport's rank or world size differ from the control
//                     transport's; a two-sided data transport whose max_tag leaves no data tags;
//                     a layout in memory the data transport cannot reach (a device layout with a
//                     transport without device_memory, a host layout with one without
//                     host_memory). The transport sends, receives and writes from and into the
//                     layout's pages and the staging memory of the engine's KV memory ops, which
//                     is of the layout's memory kind (kv_memory_ops.h).
// (A device layout's gathers, scatters and checksums run on the engine's comm stream: nothing
// here depends on a validator or on the TP / page layouts.)
[[nodiscard]] StatusOr<DataPlaneChoice> choose_data_plane(std::string_view engine,
                                                          Transport& control, Transport* data,
                                                          const KvLayout& layout);

}  // namespace pdsim::transfer
