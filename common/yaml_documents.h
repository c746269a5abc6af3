// How many YAML documents a file holds, without YAML::LoadAll: in yaml-cpp 0.7 LoadAll loops
// forever (allocating) on some malformed input, so this reads at most two documents with
// YAML::Parser and stops. Readers that expect one document (topology, model files) call it after
// parsing the first one with YAML::Load.
//
// Thread-safety: pure function.
#pragma once

#include <optional>
#include <string>

namespace pdsim::yaml {

// The 1-based line where a second document starts (0 when yaml-cpp gives no position), or nullopt
// when `text` holds at most one. A syntax error after the first document counts as a second
// document at the error's line; a syntax error in the first one is left to YAML::Load to report
// (nullopt). Never throws.
[[nodiscard]] std::optional<int> second_document_line(const std::string& text);

}  // namespace pdsim::yaml
