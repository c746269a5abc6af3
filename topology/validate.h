// Validation of a topology: every rule of topology/README.md ("Rules").
//
// validate() returns OK or the first violation as a kInvalidArgument Status whose message is
// "<file>:<line>: <path>: <what>" (source positions come from Topology::source), e.g.
//   "dgx.yaml:40: instances[2].tp: 3 does not divide num_kv_heads 8 (...)".
// `model` overrides the topology's own `model` (the testbed's --model); with neither, the
// TP-vs-heads rule is skipped.
//
// Thread-safety: reentrant; reads the topology only.
#pragma once

#include <string_view>

#include "common/status.h"
#include "topology/topology.h"

namespace pdsim::topo {

Status validate(const Topology& topology, const ModelShape* model = nullptr);

// The model rules alone (positive sizes, q heads a multiple of KV heads, MLA fields); `path` is
// the path of the model mapping in `source` ("model"; "" for a file that is just a model).
Status validate_model(const ModelShape& model, const SourceInfo& source, std::string_view path);

}  // namespace pdsim::topo
