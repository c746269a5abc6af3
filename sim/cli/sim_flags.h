// Flags that `pdsim simulate` and `pdsim search` share: how every instance schedules (batching,
// pages, prefix cache, decode admission), registered, checked and applied by one piece of code
// so that the two commands cannot drift apart.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "sim/des/simulator.h"

namespace pdsim::cli {

struct SchedulingFlags {
    int64_t chunk_size = 512, max_batch_tokens = 2048, max_decode_batch = 64;
    int page_size = 16;
    double mem_fraction = 0.9;
    std::string prefix_cache = "on", kv_admission = "prompt";
};

// Caps on what a flag makes the simulator hold per forward (sim/cli/cli_util.h validators).
inline constexpr int64_t kMaxBatchTokens = int64_t{1} << 20;  // --chunk-size, --max-batch-tokens
inline constexpr int64_t kMaxDecodeBatch = 65536;             // --max-decode-batch

// --chunk-size, --max-batch-tokens, --max-decode-batch, --page-size, --mem-fraction,
// --prefix-cache, --kv-admission.
void add_scheduling_flags(CLI::App* sub, SchedulingFlags& f);

// kInvalidArgument naming the flag (the same ranges as the flags' validators, for callers that
// fill SchedulingFlags themselves).
[[nodiscard]] Status check_scheduling_flags(const SchedulingFlags& f);

// Into a simulation's config: prefix cache, admission, page size, batch limits. `f` must have
// passed check_scheduling_flags.
void apply_scheduling_flags(const SchedulingFlags& f, des::SimConfig* config);
// KV capacity options with the flags' page size and memory fraction (the rest default).
[[nodiscard]] des::KvCapacityOptions kv_capacity_options(const SchedulingFlags& f);

}  // namespace pdsim::cli
