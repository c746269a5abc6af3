// Internal to sim/cost: the roofline cost model (formulas in docs/cost-models.md and roofline.cpp).
#pragma once

#include <memory>

#include "common/status.h"
#include "sim/cost/cost_model.h"

namespace pdsim::cost {

// kInvalidArgument unless spec.device is a GPU of the spec table, the TP size divides the model,
// a TP group > 1 has a link (tp_link_gbps > 0) and mfu, mbu are in (0, 1].
[[nodiscard]] StatusOr<std::unique_ptr<CostModel>> make_roofline_model(
    const InstanceSpec& spec, const RooflineOptions& options);

}  // namespace pdsim::cost
