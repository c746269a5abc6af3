// Which GPUs this process has given up waiting for.
//
// A device is hung once a bounded wait for its work ran out where that work had to end: a
// CudaStream's destructor (backends/cuda/cuda_runtime_api.h), a GPU model's last forward in its
// destructor. From then on, for the rest of the process, the frees that would wait for the whole
// device (cudaFree, cudaFreeHost) skip it and leave the memory to the process exit, so that a
// rank's teardown ends and the run's report gets written instead of blocking forever ("nothing
// hangs"). Nothing here talks to a device: the CUDA code marks and asks.
//
// Thread-safety: both functions may be called from any thread at any time.
#pragma once

#include <string_view>

namespace pdsim {

// Devices 0 .. kMaxTrackedDevices-1 can be marked; others never are (device_hung is false).
inline constexpr int kMaxTrackedDevices = 64;

// Marks `device` hung for the rest of the process; the first mark of a device logs one warning
// with `why` (which wait ran out). Never blocks.
void mark_device_hung(int device, std::string_view why);
// Whether `device` was marked.
[[nodiscard]] bool device_hung(int device);

}  // namespace pdsim
