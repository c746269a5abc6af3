#include "sim/cli/sim_flags.h"

#include <fmt/format.h>

#include "sim/cli/cli_util.h"

namespace pdsim::cli {

void add_scheduling_flags(CLI::App* sub, SchedulingFlags& f) {
    sub->add_option("--prefix-cache", f.prefix_cache,
                    "on|off: prefix cache of 512-token blocks keyed by the trace's hash_ids")
        ->capture_default_str();
    sub->add_option("--kv-admission", f.kv_admission,
                    "prompt: decode pages for the prompt, growing per token (the newest request is "
                    "preempted when short); full: prompt + output reserved at admission (the "
                    "testbed's rule)")
        ->capture_default_str();
    sub->add_option("--chunk-size", f.chunk_size, "prefill tokens of one request per forward")
        ->check(int_in(1, kMaxBatchTokens))
        ->capture_default_str();
    sub->add_option("--max-batch-tokens", f.max_batch_tokens, "tokens per prefill forward")
        ->check(int_in(1, kMaxBatchTokens))
        ->capture_default_str();
    sub->add_option("--max-decode-batch", f.max_decode_batch, "requests per decode forward")
        ->check(int_in(1, kMaxDecodeBatch))
        ->capture_default_str();
    sub->add_option("--page-size", f.page_size, "KV page size in tokens")
        ->check(int_in(1, 4096))
        ->capture_default_str();
    sub->add_option("--mem-fraction", f.mem_fraction, "GPUs: share of HBM for weights + KV")
        ->check(real_in(0, 1, /*lo_open=*/true))
        ->capture_default_str();
}

Status check_scheduling_flags(const SchedulingFlags& f) {
    if (f.chunk_size < 1 || f.chunk_size > kMaxBatchTokens) {
        return invalid_argument_error(
            fmt::format("--chunk-size {}: must be in [1, {}]", f.chunk_size, kMaxBatchTokens));
    }
    if (f.max_batch_tokens < 1 || f.max_batch_tokens > kMaxBatchTokens) {
        return invalid_argument_error(fmt::format("--max-batch-tokens {}: must be in [1, {}]",
                                                  f.max_batch_tokens, kMaxBatchTokens));
    }
    if (f.max_decode_batch < 1 || f.max_decode_batch > kMaxDecodeBatch) {
        return invalid_argument_error(fmt::format("--max-decode-batch {}: must be in [1, {}]",
                                                  f.max_decode_batch, kMaxDecodeBatch));
    }
    if (f.page_size < 1 || f.page_size > 4096) {
        return invalid_argument_error(
            fmt::format("--page-size {}: must be in [1, 4096]", f.page_size));
    }
    if (!(f.mem_fraction > 0 && f.mem_fraction <= 1)) {
        return invalid_argument_error(
            fmt::format("--mem-fraction {}: must be in (0, 1]", f.mem_fraction));
    }
    if (f.prefix_cache != "on" && f.prefix_cache != "off") {
        return invalid_argument_error(
            fmt::format("--prefix-cache {}: expected on or off", f.prefix_cache));
    }
    if (f.kv_admission != "prompt" && f.kv_admission != "full") {
        return invalid_argument_error(
            fmt::format("--kv-admission {}: expected prompt or full", f.kv_admission));
    }
    return {};
}

void apply_scheduling_flags(const SchedulingFlags& f, des::SimConfig* config) {
    config->prefix_cache = f.prefix_cache == "on";
    config->reserve_output = f.kv_admission == "full";
    config->page_size = f.page_size;
    config->batching.chunk_size = f.chunk_size;
    config->batching.max_batch_tokens = f.max_batch_tokens;
    config->batching.max_decode_batch = f.max_decode_batch;
}

des::KvCapacityOptions kv_capacity_options(const SchedulingFlags& f) {
    des::KvCapacityOptions kv;
    kv.page_size = f.page_size;
    kv.mem_fraction = f.mem_fraction;
    return kv;
}

}  // namespace pdsim::cli
