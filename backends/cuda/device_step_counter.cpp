// The CUDA StepCounter implementation's host side (backends/cuda/device_step_counter.h); the
// record kernel is in device_step_counter.cu.
#include "backends/cuda/device_step_counter.h"

// The driver API is reached only through its entry points (backends/cuda/cuda_driver.h): <cuda.h>
// and <cudaTypedefs.h> are included for CUresult/CUdeviceptr/enums and the PFN types, and no cu*
// function is called by name, so the binary does not need libcuda.so at link time.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/device_step_counter_launch.h"
#include "common/cuda_check.h"
#include "common/device_health.h"

namespace pdsim::pd::cuda {

namespace {

using Clock = std::chrono::steady_clock;

// Counter i lives at word i * kStride of the device block and of the mirror block: one 64-byte
// line each, so the host's polls of one mirror never share a line with the other's writes.
constexpr size_t kStride = 8;
constexpr size_t kBlockBytes = kNumCounters * kStride * sizeof(uint64_t);

// Host waiters: spin (yielding) this long, then sleep between polls. A layer's record lands a
// few microseconds after its KV write; the cuda_ipc poller measured a fixed 20 us sleep to cost
// 10-20% of a short write, hence the spin first (docs/gpu-results.md).
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr auto kPollSleep = std::chrono::microseconds(20);

size_t index_of(CounterId id) {
    return static_cast<size_t>(id);
}

// Makes `device` current on the calling thread, as CudaStream's calls do. Not restored after:
// switching back could create a context on a device this process never meant to use.
Status use_device(int device) {
    int current = -1;
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) CUDA_CHECK(cudaSetDevice(device));
    return {};
}

// The driver's cuStreamWaitValue64 when `device` can run it with 64-bit values, or why not
// (kUnavailable). The caller has made `device` current.
// cuStreamWaitValue64_v2 appeared in CUDA 11.7 (cuda_driver.h asks for that version, which works
// with any driver that can run this CUDA 13 build).
StatusOr<PFN_cuStreamWaitValue64_v11070> load_value_wait(int device) {
    StatusOr<void*> entry = runtime::cuda::stream_wait_value64_entry(device);
    if (!entry.ok()) {
        return entry.status().with_context("a StepCounter gate cannot wait on the counter's value");
    }
    return reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(*entry);
}

class DeviceStepCounterImpl final : public StepCounterImpl {
public:
    static StatusOr<std::unique_ptr<StepCounterImpl>> create(runtime::Stream& stream,
                                                             uint64_t initial_raw) {
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t handle, runtime::cuda::native_stream(stream));
        const int device = stream.device().index;
        PDSIM_RETURN_IF_ERROR(use_device(device));
        // Not fatal: without stream memory operations only GatePath::kValueWait is unavailable.
        std::unique_ptr<DeviceStepCounterImpl> impl(
            new DeviceStepCounterImpl(device, handle, load_value_wait(device)));
        PDSIM_RETURN_IF_ERROR(impl->init(initial_raw));  // on error the destructor frees
        return std::unique_ptr<StepCounterImpl>(std::move(impl));
    }

    // The StepCounter has drained the stream (or leaked this object instead). Best effort: the
    // frees cannot report errors.
    ~DeviceStepCounterImpl() override {
        use_device(device_).ignore_error();
        for (std::vector<Slot>& ring : rings_) {
            for (Slot& slot : ring) {
                if (slot.event != nullptr) cudaEventDestroy(slot.event);
            }
        }
        // Both frees wait for the device: not on a hung one (common/device_health.h).
        if (!device_hung(device_)) {
            if (d_counters_ != nullptr) cudaFree(d_counters_);
            if (h_mirror_ != nullptr) cudaFreeHost(h_mirror_);
        }
    }

    [[nodiscard]] Status record(CounterId id, std::optional<uint64_t> eager_raw) override {
        PDSIM_RETURN_IF_ERROR(use_device(device_));
        const size_t i = index_of(id);
        CUDA_CHECK(detail::launch_record_step(stream_, d_counters_ + i * kStride,
                                              h_mirror_on_device_ + i * kStride));
        if (eager_raw.has_value()) {
            // The event right after this record: complete exactly when this record is.
            Slot& slot = rings_[i][*eager_raw % kEventRingCapacity];
            slot.valid = false;
            CUDA_CHECK(cudaEventRecord(slot.event, stream_));
            slot.raw = *eager_raw;
            slot.valid = true;
        }
        return {};
    }

    [[nodiscard]] uint64_t ready_raw(CounterId id) const override {
        return std::atomic_ref<uint64_t>(h_mirror_[index_of(id) * kStride])
            .load(std::memory_order_acquire);
    }

    [[nodiscard]] bool wait_raw(CounterId id, uint64_t target_raw,
                                Clock::time_point deadline) const override {
        const Clock::time_point start = Clock::now();
        for (;;) {
            if (raw_reached(ready_raw(id), target_raw)) return true;
            const Clock::time_point now = Clock::now();
            if (now >= deadline) return false;
            if (now - start < kSpin) {
                std::this_thread::yield();
            } else {
                std::this_thread::sleep_for(std::min<Clock::duration>(kPollSleep, deadline - now));
            }
        }
    }

    [[nodiscard]] size_t event_ring_capacity() const override { return kEventRingCapacity; }

    [[nodiscard]] Status gate_on_event(runtime::Stream& other, CounterId id,
                                       uint64_t raw) override {
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t handle, runtime::cuda::native_stream(other));
        const Slot& slot = rings_[index_of(id)][raw % kEventRingCapacity];
        if (!slot.valid || slot.raw != raw) {
            return PDSIM_ERROR(StatusCode::kInternal,
                               "gate on stream {}: the event of {} record {} is not in the ring "
                               "(its slot holds record {})",
                               other.name(), counter_name(id), raw,
                               slot.valid ? static_cast<int64_t>(slot.raw) : int64_t{-1});
        }
        CUDA_CHECK(cudaStreamWaitEvent(handle, slot.event, 0));
        return {};
    }

    [[nodiscard]] Status gate_on_value(runtime::Stream& other, CounterId id, uint64_t target_raw,
                                       std::chrono::nanoseconds /*host_timeout*/) override {
        if (!wait_value64_.ok()) {
            return wait_value64_.status().with_context(
                fmt::format("gate on stream {}", other.name()));
        }
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t handle, runtime::cuda::native_stream(other));
        PDSIM_RETURN_IF_ERROR(use_device(device_));
        const auto address = static_cast<CUdeviceptr>(
            reinterpret_cast<uintptr_t>(d_counters_ + index_of(id) * kStride));
        // Cyclic >= on the raw 64-bit value ((int64_t)(*addr - value) >= 0): exact across the
        // API's 2^62 wrap. No FLUSH flag: the writer is a kernel on this device, not a remote
        // (RDMA) write.
        const CUresult rc = (*wait_value64_)(handle, address, target_raw, CU_STREAM_WAIT_VALUE_GEQ);
        if (rc != CUDA_SUCCESS) {
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "cuStreamWaitValue64 on stream {} ({} counter, raw {}) failed: "
                               "CUresult {}",
                               other.name(), counter_name(id), target_raw, static_cast<int>(rc));
        }
        return {};
    }

private:
    struct Slot {
        cudaEvent_t event = nullptr;
        uint64_t raw = 0;    // the eager record the event was last recorded after
        bool valid = false;  // `raw` is meaningful (the last cudaEventRecord succeeded)
    };

    DeviceStepCounterImpl(int device, cudaStream_t stream,
                          StatusOr<PFN_cuStreamWaitValue64_v11070> wait_value64)
        : device_(device), stream_(stream), wait_value64_(std::move(wait_value64)) {}

    // The caller has made device_ current.
    [[nodiscard]] Status init(uint64_t initial_raw) {
        CUDA_CHECK(detail::preload_record_step());
        CUDA_CHECK(
            cudaHostAlloc(reinterpret_cast<void**>(&h_mirror_), kBlockBytes, cudaHostAllocMapped));
        std::fill(h_mirror_, h_mirror_ + kNumCounters * kStride, uint64_t{0});
        for (size_t i = 0; i < kNumCounters; ++i) h_mirror_[i * kStride] = initial_raw;
        CUDA_CHECK(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&h_mirror_on_device_), h_mirror_, 0));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_counters_), kBlockBytes));
        // Seed the device counters before any stream can see them: a value gate enqueued right
        // after construction must not compare against uninitialized memory. A copy from pinned
        // memory is synchronous with the host; the legacy-stream sync (as the runtime's copy
        // does) only makes sure of it. The compute stream is not involved, so it may be busy.
        CUDA_CHECK(cudaMemcpy(d_counters_, h_mirror_, kBlockBytes, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
        for (std::vector<Slot>& ring : rings_) {
            ring.resize(kEventRingCapacity);
            for (Slot& slot : ring) {
                CUDA_CHECK(cudaEventCreateWithFlags(&slot.event, cudaEventDisableTiming));
            }
        }
        return {};
    }

    const int device_;
    const cudaStream_t stream_;               // the compute stream (owned by its CudaStream)
    uint64_t* d_counters_ = nullptr;          // device memory: the raw counters
    uint64_t* h_mirror_ = nullptr;            // pinned mapped host memory: the mirrors
    uint64_t* h_mirror_on_device_ = nullptr;  // the mirrors' device-side address
    std::array<std::vector<Slot>, kNumCounters> rings_;  // under the StepCounter's mutex
    // The driver's cuStreamWaitValue64, or why GatePath::kValueWait is unavailable.
    const StatusOr<PFN_cuStreamWaitValue64_v11070> wait_value64_;
};

}  // namespace

StatusOr<std::unique_ptr<StepCounterImpl>> make_device_step_counter_impl(runtime::Stream& stream,
                                                                         uint64_t initial_raw) {
    return DeviceStepCounterImpl::create(stream, initial_raw);
}

Status device_value_wait_support(int device) {
    PDSIM_RETURN_IF_ERROR(use_device(device));
    return load_value_wait(device).status();
}

}  // namespace pdsim::pd::cuda
