// Minimal NumPy .npy (format 1.0) writer and reader for little-endian, C-order arrays of
// float32 ("<f4"), int32 ("<i4") and uint16 ("<u2"). Used by `pdsim attn-dump` and its tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim {

struct NpyArray {
    std::string descr;  // "<f4", "<i4", "<u2"
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;  // raw little-endian bytes
    [[nodiscard]] int64_t count() const;
    template <typename T>
    [[nodiscard]] const T* as() const {
        return reinterpret_cast<const T*>(data.data());
    }
};

[[nodiscard]] Status write_npy(const std::string& path, const std::string& descr,
                               const std::vector<int64_t>& shape, const void* data, size_t bytes);
[[nodiscard]] StatusOr<NpyArray> read_npy(const std::string& path);

}  // namespace pdsim
