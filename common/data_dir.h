// Where pdsim's shipped data lives: the real traces, the example topologies and the model files.
//
// Lookup order (first match wins):
//   1. the caller's explicit path (a flag such as --trace F): callers handle it before asking here;
//   2. $PDSIM_DATA_DIR, a folder laid out like the install (traces/, topologies/, models/). When it
//      is set, it must hold the folder asked for: a missing folder is an error, never a silent
//      fallback to another copy;
//   3. the source tree the binary was built from: data/traces, topology/examples, data/models;
//   4. the install prefix: <dir of the binary>/../share/pdsim/<kind>, then
//      <configured CMAKE_INSTALL_PREFIX>/share/pdsim/<kind> (cmake --install puts them there).
// docs/design.md "Workloads" and data/README.md describe the files.
//
// Thread-safety: every function reads the environment and the file system only; safe from any
// thread. Nothing is cached, so a test may set PDSIM_DATA_DIR between calls.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pdsim::data {

enum class DataKind { kTraces, kTopologies, kModels };

// "traces", "topologies", "models": the folder name under $PDSIM_DATA_DIR and share/pdsim.
[[nodiscard]] std::string_view data_kind_name(DataKind kind);

struct DataCandidate {
    std::string path;    // a directory that may or may not exist
    std::string origin;  // "$PDSIM_DATA_DIR", "source tree", "install prefix"
};

// Every directory the lookup considers for `kind`, in order (existing or not). With
// $PDSIM_DATA_DIR set, only that one.
[[nodiscard]] std::vector<DataCandidate> data_search_path(DataKind kind);

// The first candidate that is a directory. kInvalidArgument when $PDSIM_DATA_DIR is set but is not
// a directory or lacks the folder (the message names the variable and the folder); kNotFound
// listing every place looked in, and how to point pdsim at the data, otherwise.
[[nodiscard]] StatusOr<std::string> find_data_dir(DataKind kind);

// `name` inside find_data_dir(kind); kNotFound naming the file and the folder when it is missing.
[[nodiscard]] StatusOr<std::string> find_data_file(DataKind kind, std::string_view name);

// For flags that take "a file or a shipped name" (--topology, --model, --trace): `text` unchanged
// when it names an existing file or contains a '/'; otherwise the first of text and text + each
// extension of its kind (.yaml, .yml, .json; traces: .jsonl, .csv) in find_data_dir(kind);
// otherwise `text` unchanged (the caller's loader then reports the missing file in its own words).
[[nodiscard]] std::string resolve_data_file(DataKind kind, const std::string& text);

}  // namespace pdsim::data
