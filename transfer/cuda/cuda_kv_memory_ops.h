// CudaKvMemoryOps: the KvMemoryOps (transfer/engine/kv_memory_ops.h) of CUDA device memory, in
// CUDA builds (transfer/CMakeLists.txt; make_kv_memory_ops in transfer/builtin.cpp returns it
// for a kCuda device). Plain C++ header; the host side is cuda_kv_memory_ops.cpp, the kernels
// kv_memory_kernels.cu, which share only kv_memory_kernels.h.
//
// How a call runs. The ops are validated (check_copy_ops / check_checksum_ops) and turned into
// flat kernel items with absolute device addresses (layout bases resolved, per-item vector
// alignment decided, a running token / work index for the kernel's search). The items go into a
// slot of a pinned staging ring (backends/cuda/flashinfer_staging.h), one cudaMemcpyAsync copies
// them into that slot's device array, and one kernel launch per call (per slot-full of items)
// consumes them: copies with one warp per token, 16-byte vector loads and stores when both sides
// of an item are 16-byte aligned and a byte loop otherwise; checksums with one thread per
// (token, head) computing kv_hash_inline and a 64-bit atomicAdd into the sum (addition mod 2^64
// is order-independent, so the result is deterministic). A slot (host and device) is reused
// only after the event recorded behind its kernel: a call may block while `slots` earlier calls
// are still in flight, up to `wait_timeout` (then kDeadlineExceeded). A call whose items need
// more than one slot launches once per slot-full, in order; if a later slot fails (timeout, CUDA
// error) the earlier launches stay enqueued: the call's outputs are then incomplete and the
// caller must treat them as lost (all validation happens before the first launch, so only a
// timeout or a CUDA failure can do this).
//
// Memory: the layout must be on this ops' device (device() == cuda:device). Staging and sums_out
// may be device memory of that device (or managed memory), or mapped pinned host memory
// (cudaHostAlloc; the kernel reaches it through its device pointer). Into device sums the
// kernel adds directly; into host sums it adds through a zeroed device scratch in the slot,
// folded into sums_out by one thread per sum, so no atomic ever targets host memory. Pageable
// host memory is kInvalidArgument.
//
// Memory for callers (KvMemoryOps::allocate_staging / allocate_sums): staging is device memory of
// this device (runtime::DeviceBuffer, cudaMalloc), sums are mapped pinned host memory
// (cudaHostAllocMapped, zeroed), both in power-of-two blocks of at least 4 KiB. A released
// handle's block goes back to a free list of this ops object for reuse (no CUDA call), so the
// engine's per-interval staging costs no cudaMalloc / cudaFree (whose implicit device
// synchronization would stall the compute stream) once warm; free blocks above 256 MiB are
// freed on the next allocation, and everything when the ops object and every handle are gone.
//
// Streams: `stream` must be a CudaStream (backends/cuda/cuda_stream.h) of this device, else
// kInvalidArgument; a stream that is capturing a graph is kFailedPrecondition (the descriptors
// travel through a ring slot that is reused after the kernel, which a replay would not respect).
// CUDA failures are kUnavailable with the call and the CUDA error.
//
// Thread-safety: calls are serialized by an internal mutex (the ring has one driver); any thread.
// Destruction waits (bounded) for the slots still in flight, then frees the ring and the device
// arrays; the caller's memory is never touched after the stream passes the work.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "backends/runtime/stream.h"
#include "common/status.h"
#include "transfer/engine/kv_memory_ops.h"

namespace pdsim::transfer::cuda {

struct CudaKvMemoryOpsOptions {
    int device = 0;
    // Ring slots: calls in flight before one waits. On a gated comm stream (the engine's device
    // gating) a call's slot stays busy until the layer it waits for is computed, and every
    // active transfer keeps one interval posted ahead with its gather and read checksum: with too
    // few slots the host would block here for a layer's compute, bringing back the host wait
    // that gating removes. 64 slots of 256 KiB: 16 MiB pinned and 16 MiB of device memory.
    int slots = 64;
    size_t slot_bytes = size_t{256} << 10;  // descriptors per launch: slot_bytes / item size
    std::chrono::milliseconds wait_timeout = runtime::kDefaultWaitTimeout;
};

// kInvalidArgument for bad options (naming the field); kUnavailable when there is no such
// device or an allocation fails (the CUDA error).
[[nodiscard]] StatusOr<std::unique_ptr<KvMemoryOps>> make_cuda_kv_memory_ops(
    const CudaKvMemoryOpsOptions& options);

}  // namespace pdsim::transfer::cuda
