// The raw baseline of `pdsim bench transfer --transport cuda_ipc`: device-to-device
// cudaMemcpyAsync on one stream, with the same rolling window of copies in flight as the
// transport run. Plain C++: raw_device_copy_cuda.cpp (built with CUDA) calls cudart;
// raw_device_copy_none.cpp (built without) only says so.
#pragma once

#include <cstddef>
#include <memory>

#include "common/status.h"

namespace pdsim::cli {

class RawDeviceCopy {
public:
    virtual ~RawDeviceCopy() = default;
    // Copies `bytes` from `src` into slot k % window of `dst` (dst + (k % window) * bytes) for
    // k < messages, each copy followed by an event; copy k waits on the host for copy k - window.
    // Returns the seconds from the first enqueue to the completion of the last copy. `src` and
    // `dst` are device memory of this object's device.
    [[nodiscard]] virtual StatusOr<double> run(void* dst, const void* src, size_t bytes,
                                               size_t messages, int window) = 0;
};

// kUnavailable when pdsim was built without CUDA or the device cannot be used.
[[nodiscard]] StatusOr<std::unique_ptr<RawDeviceCopy>> make_raw_device_copy(int device);

}  // namespace pdsim::cli
