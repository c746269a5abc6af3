// Reading and writing topology files (YAML or JSON; the schema is in topology/README.md).
//
// Every error is a kInvalidArgument Status whose message starts with
// "<file>:<line>: <path>: <what>", e.g.
//   "topo.yaml:31: instances[2].tp: 3 does not divide num_kv_heads 8 (...)"
// The line is the line of the field (or of its nearest enclosing node) in the file; it is
// omitted ("<file>: <path>: <what>") only when no line is known. Unknown keys, missing
// required fields, wrong types and bad values are all reported this way; the CLI turns them
// into exit status 2.
//
// The parsers never throw and never crash, whatever the input: yaml-cpp / nlohmann-json
// exceptions are caught at this edge. Documents are bounded (nesting depth 64, one million
// nodes after YAML alias expansion, 16 MiB of text). A YAML file holds exactly one document (a
// second `---` document is an error, not ignored); every key and string must be valid UTF-8
// ("<file>:<line>: nodes[0].id: "\xff" is not valid UTF-8 ..."). load_topology reads regular
// files only (a FIFO, device or directory is refused without blocking; common/input_file.h).
//
// Thread-safety: all functions are reentrant.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "topology/topology.h"

namespace pdsim::topo {

enum class Format : uint8_t {
    kAuto,  // by the source name's extension (.json / .yaml / .yml), else by the first character
    kYaml,
    kJson,
};

inline constexpr size_t kMaxTopologyBytes = size_t{16} << 20;

struct LoadOptions {
    bool validate = true;               // run validate() on the result
    const ModelShape* model = nullptr;  // validate against this model instead of the file's
};

// Parses `text`; source_name is used in messages (a file path, or "<stdin>").
StatusOr<Topology> parse_topology(std::string_view text, std::string_view source_name,
                                  Format format = Format::kAuto, const LoadOptions& options = {});

// Reads and parses the file at `path_or_name` (an unreadable file is kInvalidArgument too). A bare
// name that is not a file here (`cpu-1p1d`, `dgx-h100-2node-1p1d-tp8.yaml`) is looked up among the
// shipped topologies (common/data_dir.h). A topology without a `name` is named after the file's
// stem.
StatusOr<Topology> load_topology(const std::string& path_or_name, const LoadOptions& options = {});

// The topology as YAML that parse_topology() reads back to an equal Topology.
std::string to_yaml(const Topology& topology);

}  // namespace pdsim::topo
