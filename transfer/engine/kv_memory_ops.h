// KvMemoryOps: runs the plans of kv_copy_plan.h (gathers, scatters, checksums) on a stream, on
// the memory kind it declares. HostKvMemoryOps runs them in stream tasks on host memory; the CUDA
// implementation (transfer/cuda/cuda_kv_memory_ops.h, CUDA builds) runs them as kernels on a
// CudaStream over device memory, producing the same bytes and bit-identical sums. The engine
// (KvSender, KvReceiver) does not call them yet: it gathers, scatters and hashes on the host with
// gather_run, scatter_run and kv_checksums_add_run, which the tests use as the oracle.
//
// Contract (every implementation):
//  - Stream order: each enqueue_* returns once the work is enqueued; the work runs after
//    everything enqueued on `stream` before it, and later work sees its results. Nothing is
//    done on the calling thread but validation and descriptor staging.
//  - Descriptors are copied at enqueue: the caller may reuse or free its op vector (and the
//    layout object) as soon as the call returns.
//  - The KV memory of `layout`, the staging buffer and sums_out belong to the caller and must
//    stay valid, and must not be written by anyone else, until the stream has passed the op
//    (synchronize, or an event recorded after it).
//  - Validation: the layout's device() must be memory_kind() (else kInvalidArgument naming the
//    layout's memory), and the ops must pass check_copy_ops / check_checksum_ops for the call's
//    direction (kInvalidArgument naming the op and field). A null staging or sums_out with work
//    to do is kInvalidArgument. Nothing is enqueued unless every check passes.
//  - Staging: the caller's buffer holds at least staging_extent(ops) bytes (a KvStagingPlan's
//    staging_bytes); the gather writes exactly the bytes its ops name and nothing else.
//  - Sums: enqueue_checksums ADDS each op's terms into sums_out[sum_index + h] (mod 2^64, as
//    kv_checksums_add_run does); sums_out holds at least sums_extent(ops) values. The result does
//    not depend on the order the terms are added in.
//  - Errors of the work itself (a CUDA fault) surface through the stream (its sticky error).
//  - Ops that overlap in what they write race (the result is unspecified).
//
// Where the memory may live:
//   HostKvMemoryOps (memory_kind kCpu): layout, staging and sums_out in host memory. Any stream:
//     the work is a host task (runtime::Stream::enqueue), so on a CudaStream it also runs after
//     the GPU work before it. Graph capture is allowed (the task holds its own descriptors).
//   CudaKvMemoryOps (memory_kind kCuda): see transfer/cuda/cuda_kv_memory_ops.h (layout on that
//     device; staging and sums_out in device memory or mapped pinned host memory).
//
// Thread-safety: an implementation may be called from any thread; calls on one stream from one
// thread run in that thread's call order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "backends/runtime/stream.h"
#include "common/status.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::transfer {

class KvMemoryOps {
public:
    virtual ~KvMemoryOps() = default;
    KvMemoryOps(const KvMemoryOps&) = delete;
    KvMemoryOps& operator=(const KvMemoryOps&) = delete;

    // The kind of memory the layouts, staging buffers and sums must live in.
    [[nodiscard]] virtual runtime::DeviceKind memory_kind() const = 0;
    [[nodiscard]] virtual std::string_view name() const = 0;

    // Copies each op's tokens from `layout`'s slots into `staging` (check_copy_ops kGather).
    [[nodiscard]] virtual Status enqueue_gather(runtime::Stream& stream, const KvLayout& layout,
                                                std::span<const KvCopyOp> ops,
                                                std::byte* staging) = 0;
    // Copies each op's tokens from `staging` into `layout`'s slots (check_copy_ops kScatter).
    [[nodiscard]] virtual Status enqueue_scatter(runtime::Stream& stream, const KvLayout& layout,
                                                 std::span<const KvCopyOp> ops,
                                                 const std::byte* staging) = 0;
    // Adds each op's checksum terms into sums_out (check_checksum_ops).
    [[nodiscard]] virtual Status enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                                   std::span<const KvChecksumOp> ops,
                                                   uint64_t* sums_out) = 0;

protected:
    KvMemoryOps() = default;
};

// The host implementation: ops run inside one stream task per call, on host memory, reading the
// descriptors (not gather_run / scatter_run, so tests can prove the descriptors against those).
class HostKvMemoryOps final : public KvMemoryOps {
public:
    HostKvMemoryOps() = default;

    [[nodiscard]] runtime::DeviceKind memory_kind() const override {
        return runtime::DeviceKind::kCpu;
    }
    [[nodiscard]] std::string_view name() const override { return "host"; }
    [[nodiscard]] Status enqueue_gather(runtime::Stream& stream, const KvLayout& layout,
                                        std::span<const KvCopyOp> ops, std::byte* staging) override;
    [[nodiscard]] Status enqueue_scatter(runtime::Stream& stream, const KvLayout& layout,
                                         std::span<const KvCopyOp> ops,
                                         const std::byte* staging) override;
    [[nodiscard]] Status enqueue_checksums(runtime::Stream& stream, const KvLayout& layout,
                                           std::span<const KvChecksumOp> ops,
                                           uint64_t* sums_out) override;
};

// The ops for memory of `memory` (its kind; a CUDA device's index): HostKvMemoryOps for kCpu,
// the CUDA ops on that device for kCuda. kUnavailable when pdsim was built without CUDA or the
// device cannot be used (the runtime's reason). Registered in transfer/builtin.cpp.
[[nodiscard]] StatusOr<std::unique_ptr<KvMemoryOps>> make_kv_memory_ops(runtime::Device memory);

}  // namespace pdsim::transfer
