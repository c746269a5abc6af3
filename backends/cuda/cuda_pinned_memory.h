// The PinnedMemory of CUDA builds (backends/cuda/flashinfer_staging.h): cudaHostAlloc'd memory and
// cudaEvent_t events (timing disabled), for the pinned staging rings of the FlashInfer adapter and
// the GPU model. Plain C++ header.
//
// Device: with `device` >= 0 every allocation and event is made on that device (it is made
// current first, and left current, as CudaStream does); with -1, on the calling thread's current
// device. wait_event polls cudaEventQuery (20 us sleeps) until its timeout, then
// kDeadlineExceeded. CUDA failures are kUnavailable with the call and the CUDA error.
// Thread-safety: stateless apart from the device; call from the thread that drives the ring.
#pragma once

#include <memory>

#include "backends/cuda/flashinfer_staging.h"

namespace pdsim::attn::cuda {

[[nodiscard]] std::unique_ptr<PinnedMemory> make_cuda_pinned_memory(int device = -1);

}  // namespace pdsim::attn::cuda
