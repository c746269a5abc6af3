// Helpers the commands of sim/cli share: flag values that are lists, and JSON output files with
// one error mapping (every error here is kInvalidArgument, which the CLI maps to exit 2, and its
// message names the flag and the value or file).
// Thread-safety: reentrant functions.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/text.h"

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

// Fails early, before a long run, if `path` cannot be written: kInvalidArgument "<flag> <path>: "
// and the reason (empty path, a directory, its directory missing or not writable, the file not
// writable). Creates and modifies nothing.
[[nodiscard]] Status check_writable(const std::string& flag, const std::string& path);

// What an error message quotes of a user's input (common/text.h: at most 80 bytes, one line).
using text::excerpt;

// ---- Bounds the commands' flags share (docs/inputs.md "Flags and environment") ----
inline constexpr int64_t kMaxLayers = 1024;                  // --layers
inline constexpr int64_t kMaxRequestCount = 100'000'000;     // --max-requests, --sample
inline constexpr int64_t kMaxSyntheticRequests = 1'000'000;  // --synthetic (simulate, search)
inline constexpr int64_t kMaxLengthCap = 10'000'000;         // --max-input-len, --max-output-len
inline constexpr double kMaxTimeScale = 1e6;                 // --time-scale
inline constexpr double kMaxSloMs = 1e9;                     // --slo-ttft-ms, --slo-tpot-ms
inline constexpr int64_t kMaxKvPoolMb = int64_t{1} << 20;    // --kv-pool-mb (1 TiB)
inline constexpr int kMaxCoreId = 65535;                     // --cpu-binding

// A KV cache of `sequences` x `tokens` tokens (each of `kv_heads` x `head_dim` K and V values of
// 4 bytes, the widest dtype) over `limit_bytes`: kInvalidArgument naming `flags` and the size.
[[nodiscard]] Status check_kv_bytes(const std::string& flags, int64_t sequences, int64_t tokens,
                                    int64_t kv_heads, int64_t head_dim, int64_t limit_bytes);

// ---- Flag checks: CLI11 validators ----
// They run while the command line is parsed, before any command starts, on values given on the
// command line only (a flag's default is not checked). A bad value is a CLI::ValidationError:
// exit 2, "pdsim: error: INVALID_ARGUMENT: --flag: <why>" (main.cpp). Each validator's
// description is the accepted range, shown in --help next to the flag.

// An integer (decimal, optional sign) in [lo, hi].
[[nodiscard]] CLI::Validator int_in(int64_t lo, int64_t hi);
// A finite number in [lo, hi] (NaN and infinities rejected); lo_open: lo itself rejected too.
[[nodiscard]] CLI::Validator real_in(double lo, double hi, bool lo_open = false);
// A string that is not empty (nor only blanks).
[[nodiscard]] CLI::Validator non_empty();
// The non-empty items of a comma-separated list ("a.json,,b.json" -> a.json, b.json).
[[nodiscard]] std::vector<std::string> split_paths(const std::string& text);
// An output file path that check_writable("", path) accepts.
[[nodiscard]] CLI::Validator output_file();

}  // namespace pdsim::cli
