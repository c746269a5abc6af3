// What `pdsim testbed --mode colocated` must produce for each request, computed without the
// testbed: the same model run on the request alone, its whole prompt in one extend forward, then
// one decode forward per further token, on a pool poisoned before every request. The models are
// batch-invariant (backends/model/synthetic_model.h; backends/cuda/cuda_synthetic_model.h: "a
// request's hidden states, KV and tokens do not depend on the rest of its batch"), so these
// tokens equal the testbed's bit for bit as long as the testbed prefilled every prompt in one
// chunk (a chunked prefill is not promised to match on the GPU) and decoded one token per forward,
// whatever it batched them with, and whether it replayed a CUDA graph or not (replay == eager is
// promised and tested in tests/cuda_synthetic_model_test.cpp).
//
// The requests come from testbed::resolve() with the options the binary was given, and each
// prompt from testbed::make_prompt, as the testbed's leader makes it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/model.h"
#include "backends/runtime/stream.h"
#include "common/status.h"
#include "sim/testbed/options.h"
#include "sim/testbed/prompt.h"

namespace pdsim::test {

// Request `prompt` alone: `output_len` greedy tokens. The pool must hold the request (pages 1..n
// are used) and is poisoned first (0xFF bytes: NaN in fp32 and bf16), and the token buffer before
// every forward, so a KV slot or a token the model did not write shows as a failure.
inline StatusOr<std::vector<int32_t>> solo_tokens(model::Model& model,
                                                  attn::AttentionBackend& backend, kv::KVPool& pool,
                                                  runtime::Stream& stream,
                                                  std::span<const int32_t> prompt, int output_len) {
    const int ps = pool.page_size();
    const int64_t total = static_cast<int64_t>(prompt.size()) + output_len;
    const int pages = static_cast<int>((total + ps - 1) / ps);
    if (pages + 1 > pool.num_pages()) {
        return Status(StatusCode::kInvalidArgument, "solo_tokens: the pool is too small");
    }
    PDSIM_RETURN_IF_ERROR(pool.fill(0xFF));
    std::vector<int32_t> page_table;
    for (int p = 1; p <= pages; ++p) page_table.push_back(p);
    auto slot = [&](int64_t t) { return static_cast<int32_t>(page_table[t / ps] * ps + t % ps); };
    std::vector<int32_t> out;
    int32_t next = -1;
    model::StepBatch b;
    b.mode = attn::ForwardMode::kExtend;
    b.tokens.assign(prompt.begin(), prompt.end());
    for (int64_t t = 0; t < static_cast<int64_t>(prompt.size()); ++t) {
        b.out_cache_loc.push_back(slot(t));
    }
    b.seq_lens = {static_cast<int32_t>(prompt.size())};
    b.extend_lens = b.seq_lens;
    b.page_table = page_table;
    b.page_table_stride = pages;
    for (int step = 0; step < output_len; ++step) {
        next = -1;
        PDSIM_RETURN_IF_ERROR(model.forward(b, backend, pool, &next));
        PDSIM_RETURN_IF_ERROR(stream.synchronize());
        if (next < 0 || next >= model.config().vocab) {
            return Status(StatusCode::kInternal,
                          "solo_tokens: step " + std::to_string(step) + " wrote no token");
        }
        out.push_back(next);
        const int64_t pos = static_cast<int64_t>(prompt.size()) + step;  // the token just sampled
        b.mode = attn::ForwardMode::kDecode;
        b.tokens = {next};
        b.out_cache_loc = {slot(pos)};
        b.seq_lens = {static_cast<int32_t>(pos + 1)};
        b.extend_lens = {1};
    }
    return out;
}

// The prompt the testbed gives request `id` of `cfg`.
inline std::vector<int32_t> testbed_prompt(const testbed::ResolvedConfig& cfg, size_t id) {
    const workload::Request& r = cfg.requests[id];
    return testbed::make_prompt(static_cast<int64_t>(id), r.input_len, r.hash_ids, cfg.model.vocab,
                                cfg.options.seed);
}

// The testbed's tokens of request `id` from a report's lifecycle (empty when absent).
inline std::vector<int32_t> report_tokens(const nlohmann::json& report, size_t id) {
    std::vector<int32_t> out;
    if (!report.contains("lifecycle") || id >= report["lifecycle"].size()) return out;
    const nlohmann::json& t = report["lifecycle"][id]["tokens"];
    if (!t.is_array()) return out;
    for (const auto& v : t) out.push_back(v.get<int32_t>());
    return out;
}

}  // namespace pdsim::test
