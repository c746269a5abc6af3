// Pointer alignment, for the checks in front of vectorised loads and library calls that require
// it (cuBLASLt, FlashInfer, the KV append kernel: 16 bytes for 128-bit accesses).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pdsim {

// Whether the address `p` is a multiple of `alignment` bytes (alignment > 0).
[[nodiscard]] inline bool is_aligned(const void* p, size_t alignment) {
    return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace pdsim
