// Model shapes: the named configurations pdsim knows (tiny, llama3-8b, llama3-70b, deepseek-v3,
// hybrid-tiny) and YAML/JSON model files, with overrides that shrink a real shape for the CPU.
// A ModelConfig is what every rank needs to build the same synthetic model (weights come from
// `seed`) and what the topology validator checks TP sizes against.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "topology/model_shape.h"

namespace pdsim::model {

// One enum of each for the whole tree (topology/model_shape.h).
using AttentionKind = topo::AttentionKind;
using LayerKind = topo::LayerKind;

// What a rank needs to build the synthetic model: a topo::ModelShape (the one model description
// and table, topology/model_shape.h) whose default is the built-in `tiny`, the testbed's default
// model. A topology's ModelShape defaults to zeros instead (its fields are unknown until a file
// gives them), hence the separate name.
struct ModelConfig : topo::ModelShape {
    ModelConfig();                       // tiny
    ModelConfig(topo::ModelShape shape)  // NOLINT(google-explicit-constructor): a widening copy
        : topo::ModelShape(std::move(shape)) {}
};

// Names of the built-in configurations.
[[nodiscard]] std::vector<std::string> model_names();
// A built-in configuration by name, else a shipped model file by name (NAME.yaml in data/models or
// share/pdsim/models, common/data_dir.h), else a YAML/JSON file path (any field above;
// `base: NAME` starts from a built-in config). Unknown names/keys are kInvalidArgument naming the
// file, line and key. The file must be a regular file of at most 16 MiB (common/input_file.h)
// holding one YAML/JSON document whose keys and strings are valid UTF-8.
[[nodiscard]] StatusOr<ModelConfig> resolve_model(const std::string& name_or_file);
// Checks internal consistency (heads divide, dims positive and at most kMaxModelDim, layers at
// most kMaxModelLayers). The message names the field.
[[nodiscard]] Status validate_model(const ModelConfig& config);
inline constexpr int kMaxModelLayers = 4096;
inline constexpr int kMaxModelDim = 1 << 24;  // hidden, heads, head_dim, intermediate, vocab...
// The model a topology's `model` section describes (topo::Topology::model: a built-in shape with
// the section's overrides, or one spelled out), whole, so a run computes what `pdsim topology
// show` says; `layers` > 0 replaces num_layers (--layers). Validated (validate_model: a
// spelled-out section without intermediate or vocab is kInvalidArgument naming the field).
[[nodiscard]] StatusOr<ModelConfig> model_from_shape(const topo::ModelShape& shape, int layers = 0);
// kInvalidArgument unless tp divides the KV heads (MHA) and the query heads (topo::check_tp).
[[nodiscard]] Status check_tp(const ModelConfig& config, int tp);
// The shape the topology validator checks: the ModelShape part of `config`.
[[nodiscard]] inline topo::ModelShape to_model_shape(const ModelConfig& config) {
    return config;
}

}  // namespace pdsim::model
