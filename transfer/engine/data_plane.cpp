#include "transfer/engine/data_plane.h"

#include <fmt/format.h>

#include <string>

#include "transfer/engine/control.h"

namespace pdsim::transfer {

std::string_view data_plane_name(DataPlane plane) {
    switch (plane) {
        case DataPlane::kTwoSided:
            return "two-sided";
        case DataPlane::kOneSidedWrite:
            return "one-sided write";
        case DataPlane::kOrdered:
            return "ordered";
    }
    return "?";
}

StatusOr<DataPlane> data_plane_of_tag(Tag data_tag) {
    if (data_tag == kControlTag) return DataPlane::kOneSidedWrite;
    if (data_tag == kOrderedDataTag) return DataPlane::kOrdered;
    if (data_tag >= kDataTagBase) return DataPlane::kTwoSided;
    return PDSIM_ERROR(StatusCode::kInvalidArgument,
                       "data tag {} is reserved (0: writes, {}: ordered, >= {}: two-sided)",
                       data_tag, kOrderedDataTag, kDataTagBase);
}

StatusOr<DataPlaneChoice> choose_data_plane(std::string_view engine, Transport& control,
                                            Transport* data, const KvLayout& layout) {
    const Capabilities cc = control.capabilities();
    if (!cc.two_sided || !cc.tag_matching) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "the {} needs a two-sided, tag-matching control transport; '{}' is not",
                           engine, control.name());
    }
    DataPlaneChoice choice;
    choice.data = data != nullptr ? data : &control;
    Transport& dt = *choice.data;
    if (dt.rank() != control.rank() || dt.world_size() != control.world_size()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "data transport '{}' is rank {} of {}, the control transport '{}' rank "
                           "{} of {}: both must number the same ranks",
                           dt.name(), dt.rank(), dt.world_size(), control.name(), control.rank(),
                           control.world_size());
    }
    const Capabilities dc = dt.capabilities();
    if (dc.two_sided && dc.tag_matching) {
        choice.plane = DataPlane::kTwoSided;
        if (dc.max_tag < kDataTagBase) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "transport '{}' max_tag {} leaves no data tags (need >= {})",
                               dt.name(), dc.max_tag, kDataTagBase);
        }
    } else if (dc.two_sided) {
        // No tags (NCCL): matched per pair in post order, announced on the control channel.
        choice.plane = DataPlane::kOrdered;
    } else if (dc.one_sided_write) {
        choice.plane = DataPlane::kOneSidedWrite;
    } else {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "the {} cannot move KV over data transport '{}': it has neither "
                           "two-sided operations nor one-sided writes",
                           engine, dt.name());
    }
    if (!layout.is_host() && !dc.device_memory) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "the {}'s KV layout is in {} memory (device {}), which data transport "
                           "'{}' cannot reach (no device_memory capability)",
                           engine, runtime::device_kind_name(layout.device().kind),
                           layout.device().index, dt.name());
    }
    if (layout.is_host() && !dc.host_memory) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "the {}'s KV layout is in host memory, which data transport '{}' cannot "
                           "reach (no host_memory capability)",
                           engine, dt.name());
    }
    return choice;
}

}  // namespace pdsim::transfer
