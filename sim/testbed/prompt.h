// Deterministic prompt token ids for a trace request, so the same request has the same prompt in
// every mode and on every rank (disaggregated tokens can then be compared with colocated ones).
//
// Token t of a request: when the trace gives prefix blocks (Mooncake hash_ids, 512 tokens each)
// and t falls in block b, the token depends only on (seed, hash_ids[b], t % 512), so requests that
// share a prefix block share its tokens, as in the real trace; otherwise it depends on (seed,
// request id, t). Ids are uniform in [0, vocab).
// Thread-safety: pure function.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/workload/workload.h"

namespace pdsim::testbed {

[[nodiscard]] std::vector<int32_t> make_prompt(int64_t request_id, int32_t input_len,
                                               const std::vector<int64_t>& hash_ids, int vocab,
                                               uint64_t seed);

}  // namespace pdsim::testbed
