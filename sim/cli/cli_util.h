// Helpers the commands of sim/cli share: flag values that are lists, and JSON output files with
// one error mapping (every error here is kInvalidArgument, which the CLI maps to exit 2, and its
// message names the flag and the value or file).
// Thread-safety: reentrant functions.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim::cli {

// Parses `text`, the value of `flag`, as a comma-separated list of positive integers, dropping
// repeats (the first occurrence keeps its place). kInvalidArgument, naming the flag: an item that
// is empty, not an integer or < 1 ("--tp: 'x' is not a positive integer"), or no item at all
// ("--tp: empty list").
[[nodiscard]] StatusOr<std::vector<int>> parse_int_list(const std::string& flag,
                                                        const std::string& text);

// Writes `j` to `path` (the value of `flag`) as j.dump(indent) and a newline, replacing the file.
// kInvalidArgument: "<flag> <path>: cannot open for writing" or "<flag> <path>: write failed".
[[nodiscard]] Status write_json_file(const std::string& flag, const std::string& path,
                                     const nlohmann::json& j, int indent = 2);

// Fails early, before a long run, if `path` cannot be written (the same error as
// write_json_file's); leaves no file behind that was not there.
[[nodiscard]] Status check_writable(const std::string& flag, const std::string& path);

}  // namespace pdsim::cli
