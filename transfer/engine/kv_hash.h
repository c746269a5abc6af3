// kv_hash: the 64-bit hash of the ordering validator's checksums (ordering_validator.h), as one
// inline function that the host and CUDA kernels (transfer/cuda/) both compile, so that a sum
// taken on the device and one taken on the host over the same bytes are bit-identical.
//
// The construction is xxHash64's (32-byte stripes over four lanes, then 8-, 4- and 1-byte tails,
// then the avalanche); words are read little-endian. tests/kv_copy_plan_test.cpp pins its values
// from before it moved here: changing this function changes every checksum the engine compares.
//
// Plain C++ with no pdsim headers beyond this one, so a .cu translation unit can include it
// without fmt. PDSIM_HOST_DEVICE is __host__ __device__ under nvcc and empty otherwise.
// Thread-safety: a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#if !defined(PDSIM_HOST_DEVICE)
#if defined(__CUDACC__)
#define PDSIM_HOST_DEVICE __host__ __device__
#else
#define PDSIM_HOST_DEVICE
#endif
#endif

namespace pdsim::transfer {

namespace kv_hash_detail {

inline constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

PDSIM_HOST_DEVICE inline uint64_t rotl(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

// `n` (4 or 8) bytes at `p`, little-endian. The host reads them with memcpy (one load on the
// little-endian targets pdsim builds for); the device reads an aligned word directly and
// assembles an unaligned one from bytes (a misaligned wide load faults on the GPU).
PDSIM_HOST_DEVICE inline uint64_t read_le(const unsigned char* p, int n) {
#if defined(__CUDA_ARCH__)
    const auto address = reinterpret_cast<uintptr_t>(p);
    if (n == 8 && (address & 7u) == 0) return *reinterpret_cast<const uint64_t*>(p);
    if (n == 4 && (address & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
    return v;
#else
    if (n == 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        return v;
    }
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
#endif
}

PDSIM_HOST_DEVICE inline uint64_t round64(uint64_t acc, uint64_t input) {
    acc += input * kP2;
    acc = rotl(acc, 31);
    return acc * kP1;
}

PDSIM_HOST_DEVICE inline uint64_t merge64(uint64_t acc, uint64_t val) {
    acc ^= round64(0, val);
    return acc * kP1 + kP4;
}

}  // namespace kv_hash_detail

// 64-bit hash of `bytes` bytes at `data` (any alignment) with `seed` (the validator uses the
// token index).
PDSIM_HOST_DEVICE inline uint64_t kv_hash_inline(const void* data, size_t bytes, uint64_t seed) {
    using namespace kv_hash_detail;
    const auto* p = static_cast<const unsigned char*>(data);
    const unsigned char* end = p + bytes;
    uint64_t h;
    if (bytes >= 32) {
        uint64_t v1 = seed + kP1 + kP2;
        uint64_t v2 = seed + kP2;
        uint64_t v3 = seed;
        uint64_t v4 = seed - kP1;
        const unsigned char* limit = end - 32;
        do {
            v1 = round64(v1, read_le(p, 8));
            v2 = round64(v2, read_le(p + 8, 8));
            v3 = round64(v3, read_le(p + 16, 8));
            v4 = round64(v4, read_le(p + 24, 8));
            p += 32;
        } while (p <= limit);
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = merge64(h, v1);
        h = merge64(h, v2);
        h = merge64(h, v3);
        h = merge64(h, v4);
    } else {
        h = seed + kP5;
    }
    h += static_cast<uint64_t>(bytes);
    while (p + 8 <= end) {
        h ^= round64(0, read_le(p, 8));
        h = rotl(h, 27) * kP1 + kP4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= read_le(p, 4) * kP1;
        h = rotl(h, 23) * kP2 + kP3;
        p += 4;
    }
    while (p < end) {
        h ^= static_cast<uint64_t>(*p) * kP5;
        h = rotl(h, 11) * kP1;
        ++p;
    }
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
}

}  // namespace pdsim::transfer
