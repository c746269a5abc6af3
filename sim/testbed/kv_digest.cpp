#include "sim/testbed/kv_digest.h"

#include "common/splitmix.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::testbed {

namespace {

// One group's part: every (layer, buffer, local head, token) of `tokens` tokens; `group` keeps
// the KV's and the states' seeds apart.
uint64_t digest_group(const transfer::KvLayout& layout, std::span<const int32_t> pages,
                      int64_t tokens, uint64_t group) {
    uint64_t sum = 0;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            const size_t head_bytes = layout.head_bytes(b);
            for (int64_t t = 0; t < tokens; ++t) {
                const std::byte* slot =
                    layout.slot_addr(l, b, transfer::token_slot(pages, layout.page_size(), t));
                for (int h = 0; h < layout.local_heads(); ++h) {
                    const uint64_t head = static_cast<uint64_t>(layout.head_begin() + h);
                    const uint64_t seed =
                        splitmix64(group ^ splitmix64((static_cast<uint64_t>(l) << 40) ^
                                                      (static_cast<uint64_t>(b) << 32) ^
                                                      (head << 20) ^ static_cast<uint64_t>(t)));
                    sum += transfer::kv_hash(slot + static_cast<size_t>(h) * head_bytes, head_bytes,
                                             seed);
                }
            }
        }
    }
    return sum;
}

}  // namespace

uint64_t request_kv_digest(const transfer::KvLayout& kv, std::span<const int32_t> pages,
                           int64_t tokens, const transfer::KvLayout* states, int32_t state_slot) {
    uint64_t sum = digest_group(kv, pages, tokens, 1);
    if (states != nullptr) {
        const int32_t slot[] = {state_slot};
        sum += digest_group(*states, slot, 1, 2);
    }
    return sum;
}

}  // namespace pdsim::testbed
