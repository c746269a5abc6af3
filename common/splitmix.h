// splitmix64: the 64-bit finalizer pdsim uses wherever it derives deterministic values from
// integers (the synthetic model's weights, the testbed's prompts, the KV digest's seeds). Pure.
#pragma once

#include <cstdint>

namespace pdsim {

[[nodiscard]] inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

}  // namespace pdsim
