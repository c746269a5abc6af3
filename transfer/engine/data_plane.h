// The data plane of the layerwise KV transfer engine: how the KV bytes travel from a prefill rank
// to a decode rank. Both sides choose it at create() from their data transport's declared
// capabilities (EngineOptions::data_transport, else the control transport), never from its name:
//
//   two_sided && tag_matching  -> kTwoSided: post_send / post_recv on per-request data tags
//                                 (control.h), on the data transport;
//   two_sided && !tag_matching -> kOrdered: post_send / post_recv without tags on the data
//                                 transport, which matches per (source, destination) pair in
//                                 post order and needs receives of exactly the message's size
//                                 (NCCL). Before each batch of sends of a (chunk, layer interval)
//                                 the prefill rank announces it on the control channel
//                                 (DataPosted: the sizes, in post order) and posts the sends in
//                                 that order under its per-destination lock; the decode rank
//                                 posts one receive of each announced size in announcement order,
//                                 per source -- always, into scratch memory for a request it does
//                                 not know or that failed -- so the pair's stream never falls out
//                                 of step. Neither side ever withdraws an announced operation;
//                                 the completion travels on the control channel (kv_sender.h,
//                                 kv_receiver.h);
//   else one_sided_write       -> kOneSidedWrite: the prefill rank post_write()s into regions the
//                                 decode rank registered, and says so on the control channel
//                                 (LayerWritten; kv_sender.h, kv_receiver.h);
//   else                       -> kUnimplemented (no two-sided operations, no writes).
// The two sides of a request must choose the same plane: the Bootstrap's data tag says which one
// the decode rank uses (data_plane_of_tag: 0 writes, kOrderedDataTag ordered, kDataTagBase and up
// two-sided), and a prefill rank refuses a Bootstrap of another plane.
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
    kOrdered,        // untagged two-sided messages matched in post order, announced on control
};
std::string_view data_plane_name(DataPlane plane);
// The plane a Bootstrap's data tag stands for (control.h: kControlTag writes, kOrderedDataTag
// ordered, kDataTagBase and up two-sided); kInvalidArgument for a reserved tag.
[[nodiscard]] StatusOr<DataPlane> data_plane_of_tag(Tag data_tag);
// The tag every data message of the ordered plane is posted with (the transport ignores it).
inline constexpr Tag kOrderedPostTag = 0;

struct DataPlaneChoice {
    DataPlane plane = DataPlane::kTwoSided;
    Transport* data = nullptr;  // the transport that carries the bytes (never null)
};

// The data plane of an engine (`engine`: "KV sender" / "KV receiver", for messages) over
// `control` (the Transport& given to create()) and `data` (EngineOptions::data_transport; null:
// `control` carries the data), for a KvLayout `layout`. Errors:
//   kUnimplemented    `control` is not two-sided and tag-matching (control messages need both);
//                     the data transport offers no data plane: neither two-sided operations nor
//                     one-sided writes (the message names it).
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
