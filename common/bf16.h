// bfloat16 <-> float conversion (round to nearest even, NaN preserved). Header-only, constexpr-
// friendly, used by the KV pools and the CPU kernels. A bf16 value is stored as its uint16_t bits.
#pragma once

#include <bit>
#include <cstdint>

namespace pdsim {

using bf16_t = uint16_t;

inline float bf16_to_float(bf16_t h) {
    return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline bf16_t float_to_bf16(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x0040u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<bf16_t>(u >> 16);
}

}  // namespace pdsim
