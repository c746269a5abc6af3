// KvMemoryOps: runs the plans of kv_copy_plan.h (gathers, scatters, checksums) on a stream, on
// the memory kind it declares. HostKvMemoryOps runs them in stream tasks on host memory; the CUDA
// implementation (transfer/cuda/cuda_kv_memory_ops.h, CUDA builds) runs them as kernels on a
// CudaStream over device memory, producing the same bytes and bit-identical sums. The engine
// (KvSender, KvReceiver) runs them on a comm stream of its own for a KvLayout in device memory
// (kv_sender.h, "Device memory"), and enqueue_layer_checksum on the compute stream; for host
// layouts it keeps gather_run, scatter_run and kv_checksums_add_run, which the tests use as the
// oracle of the ops.
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
// Memory for the ops (allocate_staging / allocate_sums): each ops object says what memory its
// callers need, so that a caller (the engine) allocates it without knowing the device:
//   staging: at least `bytes` bytes that enqueue_gather can write and enqueue_scatter read, and
//            that a data transport reaching this memory kind can read and write (the engine
//            sends or writes from it, and receives into it). Contents unspecified.
//   sums:    `count` uint64 sums, zeroed, that enqueue_checksums can add into and the host can
//            read (without a copy) once the stream has passed the op.
// Both come as a KvOpsMemory, an owning handle (below). Lifetime: the caller keeps the handle
// until every op it enqueued on the memory has been passed by its stream (an event recorded
// after the op, or synchronize), and until every transport operation on it completed. Dropping
// a handle never calls the device runtime (the CUDA ops keep released memory for reuse, and
// return it to the runtime once the ops object and every handle are gone), so a handle may be
// dropped on any thread, a transport's completion callback included; the last reference to the
// ops' memory (the ops object or the last handle, whichever goes last) must not be dropped
// inside a stream's host task (a CUDA host function may not call CUDA).
//
// Where the memory may live:
//   HostKvMemoryOps (memory_kind kCpu): layout, staging and sums_out in host memory. Any stream:
//     the work is a host task (runtime::Stream::enqueue), so on a CudaStream it also runs after
//     the GPU work before it. Graph capture is allowed (the task holds its own descriptors).
//     allocate_staging: host memory (256-byte aligned); allocate_sums: zeroed host memory.
//   CudaKvMemoryOps (memory_kind kCuda): see transfer/cuda/cuda_kv_memory_ops.h (layout on that
//     device; staging and sums_out in device memory or mapped pinned host memory).
//     allocate_staging: device memory of its device (runtime::DeviceBuffer); allocate_sums:
//     mapped pinned host memory (cudaHostAllocMapped), zeroed.
//
// Thread-safety: an implementation may be called from any thread; calls on one stream from one
// thread run in that thread's call order.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

#include "backends/runtime/stream.h"
#include "common/status.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::transfer {

// Memory a KvMemoryOps allocated for its caller: move-only; the destructor gives it back
// (`release`, which never calls the device runtime; see "Memory for the ops" above).
class KvOpsMemory {
public:
    // Gives back `data` (`bytes` long); called once, from the destructor or reset().
    using Release = std::function<void(void* data, size_t bytes)>;

    KvOpsMemory() = default;
    KvOpsMemory(void* data, size_t bytes, bool host_readable, Release release)
        : data_(data), bytes_(bytes), host_readable_(host_readable), release_(std::move(release)) {}
    ~KvOpsMemory() { reset(); }
    KvOpsMemory(KvOpsMemory&& other) noexcept { *this = std::move(other); }
    KvOpsMemory& operator=(KvOpsMemory&& other) noexcept {
        if (this != &other) {
            reset();
            data_ = std::exchange(other.data_, nullptr);
            bytes_ = std::exchange(other.bytes_, 0);
            host_readable_ = other.host_readable_;
            release_ = std::move(other.release_);
            other.release_ = nullptr;
        }
        return *this;
    }
    KvOpsMemory(const KvOpsMemory&) = delete;
    KvOpsMemory& operator=(const KvOpsMemory&) = delete;

    [[nodiscard]] std::byte* data() const { return static_cast<std::byte*>(data_); }
    template <typename T>
    [[nodiscard]] T* as() const {
        return static_cast<T*>(data_);
    }
    [[nodiscard]] size_t size() const { return bytes_; }
    [[nodiscard]] bool empty() const { return data_ == nullptr; }
    // Whether the host may read (and write) the memory directly (sums always are; staging is on
    // host ops, not on a device).
    [[nodiscard]] bool host_readable() const { return host_readable_; }

    void reset() {
        if (data_ != nullptr && release_) release_(data_, bytes_);
        data_ = nullptr;
        bytes_ = 0;
        release_ = nullptr;
    }

private:
    void* data_ = nullptr;
    size_t bytes_ = 0;
    bool host_readable_ = false;
    Release release_;
};

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

    // Staging memory of at least `bytes` bytes (0 is taken as 1), 16-byte aligned, of the kind
    // described above. kResourceExhausted / kUnavailable (the runtime's reason) when it cannot be
    // had. Thread-safe.
    [[nodiscard]] virtual StatusOr<KvOpsMemory> allocate_staging(size_t bytes) = 0;
    // `count` zeroed sums (0 is taken as 1), host-readable, that enqueue_checksums can add into.
    // Errors as allocate_staging's. Thread-safe.
    [[nodiscard]] virtual StatusOr<KvOpsMemory> allocate_sums(size_t count) = 0;

    // Makes `stream`'s later work wait until the 8-byte word at `word` -- memory of this kind
    // that a data transport's post_signal adds into (transport.h) -- is >= `value` (cyclic, as
    // cuStreamWaitValue64: exact for values less than 2^63 apart). Returns once enqueued. This
    // implementation, for ops whose memory the host reads (host ops, in-process fakes): a stream
    // task polling the word with acquire loads, which fails the stream with kDeadlineExceeded
    // ("arrival word at <addr> is <v> after <timeout>, waiting for >= <value>") once `timeout`
    // passed. The CUDA ops: the device waits (cuStreamWaitValue64, GEQ) without a timeout (the
    // host's bounded waits on the stream report one that never ends); kUnavailable where the
    // device cannot run 64-bit stream waits; kInvalidArgument for a stream of another device.
    [[nodiscard]] virtual Status enqueue_wait_value(runtime::Stream& stream, const uint64_t* word,
                                                    uint64_t value,
                                                    std::chrono::milliseconds timeout);

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
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_staging(size_t bytes) override;
    [[nodiscard]] StatusOr<KvOpsMemory> allocate_sums(size_t count) override;
};

// The ops for memory of `memory` (its kind; a CUDA device's index): HostKvMemoryOps for kCpu,
// the CUDA ops on that device for kCuda. kUnavailable when pdsim was built without CUDA or the
// device cannot be used (the runtime's reason). Registered in transfer/builtin.cpp.
[[nodiscard]] StatusOr<std::unique_ptr<KvMemoryOps>> make_kv_memory_ops(runtime::Device memory);

}  // namespace pdsim::transfer
