#include "sim/testbed/prompt.h"

#include "common/splitmix.h"

namespace pdsim::testbed {

std::vector<int32_t> make_prompt(int64_t request_id, int32_t input_len,
                                 const std::vector<int64_t>& hash_ids, int vocab, uint64_t seed) {
    std::vector<int32_t> out(static_cast<size_t>(std::max(0, input_len)));
    const uint64_t s = splitmix64(seed ^ 0x5eed5eed5eedULL);
    for (int32_t t = 0; t < input_len; ++t) {
        const size_t block = static_cast<size_t>(t / workload::kHashBlockTokens);
        uint64_t h;
        if (block < hash_ids.size()) {
            h = splitmix64(
                s ^ splitmix64(static_cast<uint64_t>(hash_ids[block]) * 0x100000001b3ULL + 1) ^
                static_cast<uint64_t>(t % workload::kHashBlockTokens));
        } else {
            h = splitmix64(s ^
                           splitmix64(static_cast<uint64_t>(request_id) * 0x100000001b3ULL + 2) ^
                           static_cast<uint64_t>(t));
        }
        out[static_cast<size_t>(t)] = static_cast<int32_t>(h % static_cast<uint64_t>(vocab));
    }
    return out;
}

}  // namespace pdsim::testbed
