// "cuda_ipc": one-sided device-to-device writes over CUDA IPC (see gpu_transports.h).
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/cuda_stream.h"
#include "common/cuda_check.h"
#include "common/thread_info.h"
#include "transfer/cuda/kv_memory_kernels.h"
#include "transfer/nccl/gpu_transports.h"

namespace pdsim::transfer {

Status check_cuda_device(int index) {
    int n = 0;
    cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no driver" error for later calls
        return PDSIM_ERROR(StatusCode::kUnavailable, "no device: {}", cudaGetErrorString(rc));
    }
    if (n == 0) return PDSIM_ERROR(StatusCode::kUnavailable, "no device: no CUDA GPU visible");
    if (index < 0 || index >= n) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "no device: GPU {} requested, {} visible",
                           index, n);
    }
    return {};
}

namespace {

constexpr uint32_t kDescriptorMagic = 0x43495043;  // "CPIC"
// close(): how long writes still on the stream get to finish before they are failed and the
// stream is destroyed without waiting (a write behind a `ready` event that never fires would
// otherwise hold close() forever).
constexpr auto kCloseDrain = std::chrono::seconds(10);

// This process, for descriptors: the pid alone is not unique on a node (two containers with
// their own pid namespaces may both run pdsim as pid 1), so a random number drawn once per
// process goes with it.
uint64_t process_nonce() {
    static const uint64_t nonce = [] {
        std::random_device rd;
        return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }();
    return nonce;
}

struct Descriptor {
    uint32_t magic;
    int32_t rank;
    int32_t pid;
    uint64_t process;  // process_nonce() of the owner: same process iff equal
    int32_t device;
    uint64_t id;
    uint64_t bytes;
    uint64_t address;  // the region's base in the owner's address space (same-process imports)
    uint64_t offset;   // the region's start within the allocation that `handle` names
    cudaIpcMemHandle_t handle;
};

struct Pending {
    cudaEvent_t event;
    std::shared_ptr<OpState> op;
    size_t bytes;
};

class CudaIpcTransport final : public Transport {
public:
    CudaIpcTransport(int rank, int world, int device)
        : rank_(rank), world_(world), device_(device) {}
    ~CudaIpcTransport() override { close(); }

    Status init() {
        CUDA_CHECK(cudaSetDevice(device_));
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        progress_ = std::thread([this] {
            set_thread_name("pdsim-ipc-prog");
            progress_loop();
        });
        return {};
    }

    std::string_view name() const override { return "cuda_ipc"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_; }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = false;
        c.one_sided_write = true;
        c.device_memory = true;
        c.host_memory = false;
        c.stream_ordered = true;
        c.write_signals = true;
        c.max_tag = 0;
        c.max_message_bytes = std::numeric_limits<size_t>::max();
        return c;
    }

    StatusOr<RequestHandle> post_send(int, Tag, const void*, size_t) override {
        return PDSIM_ERROR(StatusCode::kUnimplemented, "cuda_ipc: one-sided only (post_write)");
    }
    StatusOr<RequestHandle> post_recv(int, Tag, void*, size_t) override {
        return PDSIM_ERROR(StatusCode::kUnimplemented, "cuda_ipc: one-sided only (post_write)");
    }

    StatusOr<MemoryRegion> register_memory(void* base, size_t bytes) override {
        cudaPointerAttributes attr{};
        CUDA_CHECK(cudaPointerGetAttributes(&attr, base));
        if (attr.type != cudaMemoryTypeDevice) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: region at {} is not device memory", base);
        }
        Descriptor d{};
        d.magic = kDescriptorMagic;
        d.rank = rank_;
        d.pid = static_cast<int32_t>(::getpid());
        d.process = process_nonce();
        d.device = attr.device;
        d.bytes = bytes;
        d.address = reinterpret_cast<uint64_t>(base);
        // A handle names a whole cudaMalloc allocation, and the importer maps that allocation's
        // start: the region may lie anywhere inside one allocation, so its offset travels too.
        PDSIM_ASSIGN_OR_RETURN(const runtime::cuda::AllocationRange alloc,
                               runtime::cuda::allocation_range(device_, base));
        const auto* start = static_cast<const uint8_t*>(alloc.base);
        d.offset = static_cast<uint64_t>(static_cast<const uint8_t*>(base) - start);
        if (d.offset + bytes > alloc.bytes) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: region of {} bytes at {} runs past the end of its "
                               "allocation ({} bytes at {}): a region must lie inside one "
                               "cudaMalloc allocation",
                               bytes, base, alloc.bytes, alloc.base);
        }
        CUDA_CHECK(cudaIpcGetMemHandle(&d.handle, alloc.base));
        {
            std::lock_guard<std::mutex> lock(mu_);
            d.id = next_id_++;
            local_[d.id] = base;
        }
        MemoryRegion mr{d.id, base, bytes, {}};
        mr.descriptor.resize(sizeof(d));
        std::memcpy(mr.descriptor.data(), &d, sizeof(d));
        return mr;
    }

    Status deregister_memory(uint64_t id) override {
        std::lock_guard<std::mutex> lock(mu_);
        if (local_.erase(id) == 0) {
            return PDSIM_ERROR(StatusCode::kNotFound, "cuda_ipc: no region {}", id);
        }
        return {};
    }

    StatusOr<RemoteRegion> import_remote(int peer, std::span<const uint8_t> descriptor) override {
        Descriptor d{};
        if (descriptor.size() != sizeof(d)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "cuda_ipc: descriptor of {} bytes",
                               descriptor.size());
        }
        std::memcpy(&d, descriptor.data(), sizeof(d));
        if (d.magic != kDescriptorMagic || d.rank != peer) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: not a cuda_ipc descriptor of rank {}", peer);
        }
        void* ptr = nullptr;
        void* mapped = nullptr;        // the allocation mapped here (closed in close()); null: own
        std::string no_kernel_access;  // why a kernel of this GPU cannot reach it ("": it can)
        if (d.process == process_nonce()) {
            ptr = reinterpret_cast<void*>(d.address);  // CUDA refuses to open its own handles
            if (d.device != device_) {
                // Copies reach another GPU's memory anyway; a kernel (post_signal's) only with
                // peer access, which an IPC mapping gets by itself (LazyEnablePeerAccess).
                CUDA_CHECK(cudaSetDevice(device_));
                int can = 0;
                CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, d.device));
                const cudaError_t rc = can != 0 ? cudaDeviceEnablePeerAccess(d.device, 0)
                                                : cudaErrorPeerAccessUnsupported;
                if (rc == cudaErrorPeerAccessAlreadyEnabled) {
                    (void)cudaGetLastError();
                } else if (rc != cudaSuccess) {
                    (void)cudaGetLastError();
                    no_kernel_access = fmt::format(
                        "GPU {} has no peer access to GPU {}'s memory ({}): cuda_ipc cannot "
                        "signal into it",
                        device_, d.device, cudaGetErrorName(rc));
                }
            }
        } else {
            CUDA_CHECK(cudaSetDevice(device_));
            // Opening one allocation's handle again returns the same mapping, reference-counted:
            // each import closes its own in close().
            CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, d.handle, cudaIpcMemLazyEnablePeerAccess));
            ptr = static_cast<uint8_t*>(mapped) + d.offset;
        }
        std::lock_guard<std::mutex> lock(mu_);
        uint64_t key = next_remote_++;
        remote_[key] = Remote{ptr, static_cast<size_t>(d.bytes), mapped, no_kernel_access};
        return RemoteRegion{peer, key, static_cast<size_t>(d.bytes)};
    }

    StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset, const void* src,
                                       size_t bytes) override {
        return write(nullptr, dst, dst_offset, src, bytes);
    }

    // Every write goes on the one stream in post order, so a one-thread kernel enqueued after
    // them adds once they have landed (atomicAdd_system: the word may be another process's or
    // another GPU's memory, read by its host or waited on by its streams).
    StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                        uint64_t add) override {
        if (dst_offset % sizeof(uint64_t) != 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: signal word at offset {} is not 8-byte aligned",
                               dst_offset);
        }
        return enqueue(OpKind::kSignal, nullptr, dst, dst_offset, sizeof(uint64_t),
                       [add](void* target, cudaStream_t stream) -> Status {
                           const int rc = cuda::detail::launch_signal_add(
                               static_cast<uint64_t*>(target), add, stream);
                           CUDA_CHECK(static_cast<cudaError_t>(rc));
                           return {};
                       });
    }

    StatusOr<RequestHandle> post_write_after(const runtime::Event& ready, const RemoteRegion& dst,
                                             size_t dst_offset, const void* src,
                                             size_t bytes) override {
        auto native = runtime::cuda::native_event_of(ready);
        if (!native.ok()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: post_write_after: the ready event is not a CUDA event");
        }
        if (native->device != device_) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "cuda_ipc: post_write_after: the ready event belongs to GPU {}, the "
                               "transport works on GPU {} (GpuTransportOptions.device_index)",
                               native->device, device_);
        }
        return write(native->event, dst, dst_offset, src, bytes);
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) return PDSIM_ERROR(StatusCode::kInvalidArgument, "cuda_ipc: cancel");
        if (handle.done()) return {};
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda_ipc: a write already on the stream cannot be cancelled");
    }

    void close() override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            closed_ = true;
        }
        cv_.notify_one();
        if (progress_.joinable()) progress_.join();
        cudaSetDevice(device_);
        if (stream_ != nullptr) {
            // Bounded: the progress thread already waited kCloseDrain for what was pending.
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
            while (cudaStreamQuery(stream_) == cudaErrorNotReady &&
                   std::chrono::steady_clock::now() < deadline) {
                std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
            cudaStreamDestroy(stream_);  // does not wait: work left on it finishes (or not) alone
            stream_ = nullptr;
        }
        for (auto& [k, r] : remote_) {
            if (r.mapped != nullptr) cudaIpcCloseMemHandle(r.mapped);
        }
        remote_.clear();
    }

private:
    struct Remote {
        void* ptr;     // the region's start
        size_t bytes;  // the region's size
        void* mapped;  // what cudaIpcOpenMemHandle returned (the allocation's start); null: a
                       // region of this process
        std::string no_kernel_access;  // why post_signal cannot reach it; "": it can
    };

    // post_write / post_write_after: the copy on the stream, after `ready` when it is set.
    StatusOr<RequestHandle> write(cudaEvent_t ready, const RemoteRegion& dst, size_t dst_offset,
                                  const void* src, size_t bytes) {
        return enqueue(
            OpKind::kWrite, ready, dst, dst_offset, bytes,
            [src, bytes](void* target, cudaStream_t stream) -> Status {
                CUDA_CHECK(cudaMemcpyAsync(target, src, bytes, cudaMemcpyDefault, stream));
                return {};
            });
    }

    // One operation on the stream: `bytes` at `dst_offset` of `dst` (checked against the
    // region), enqueued by `work` after `ready` when it is set, then an event that the progress
    // thread polls to complete the handle.
    template <typename Work>
    StatusOr<RequestHandle> enqueue(OpKind kind, cudaEvent_t ready, const RemoteRegion& dst,
                                    size_t dst_offset, size_t bytes, Work work) {
        void* target = nullptr;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return PDSIM_ERROR(StatusCode::kUnavailable, "cuda_ipc: transport closed");
            auto it = remote_.find(dst.id);
            if (it == remote_.end()) {
                return PDSIM_ERROR(StatusCode::kNotFound, "cuda_ipc: region {} not imported",
                                   dst.id);
            }
            if (dst_offset > it->second.bytes || bytes > it->second.bytes - dst_offset) {
                return PDSIM_ERROR(StatusCode::kOutOfRange,
                                   "cuda_ipc: {} of {} bytes at {} outside {} bytes",
                                   op_kind_name(kind), bytes, dst_offset, it->second.bytes);
            }
            if (kind == OpKind::kSignal && !it->second.no_kernel_access.empty()) {
                return PDSIM_ERROR(StatusCode::kUnavailable, "cuda_ipc: {}",
                                   it->second.no_kernel_access);
            }
            target = static_cast<uint8_t*>(it->second.ptr) + dst_offset;
            // A misaligned atomic is a sticky error that would end this GPU's context.
            if (kind == OpKind::kSignal &&
                reinterpret_cast<uintptr_t>(target) % sizeof(uint64_t) != 0) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "cuda_ipc: signal word at {} (offset {} of a region at {}) is "
                                   "not 8-byte aligned",
                                   static_cast<void*>(target), dst_offset, it->second.ptr);
            }
        }
        auto op = std::make_shared<OpState>(kind, dst.peer, 0, bytes);
        cudaEvent_t ev = nullptr;
        {
            // One stream shared by all posting threads: serialize wait + enqueue + record.
            std::lock_guard<std::mutex> lock(stream_mu_);
            CUDA_CHECK(cudaSetDevice(device_));
            // The event first: once the copy is enqueued, the post must not fail.
            CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
            const Status enqueued = [&]() -> Status {
                if (ready != nullptr) CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
                return work(target, stream_);
            }();
            if (!enqueued.ok()) {
                cudaEventDestroy(ev);
                return enqueued;
            }
            CUDA_CHECK(cudaEventRecord(ev, stream_));
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            pending_.push_back(Pending{ev, op, bytes});
        }
        cv_.notify_one();
        return RequestHandle(std::move(op));
    }

    void progress_loop() {
        cudaSetDevice(device_);
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            if (pending_.empty()) {
                if (closed_) return;
                cv_.wait(lock, [&] { return closed_ || !pending_.empty(); });
                continue;
            }
            // Writes on one stream finish in order: poll the oldest.
            Pending p = pending_.front();
            const bool closing = closed_;
            lock.unlock();
            cudaError_t rc = cudaEventQuery(p.event);
            if (closing && rc == cudaErrorNotReady) {
                if (close_deadline_ == std::chrono::steady_clock::time_point{}) {
                    close_deadline_ = std::chrono::steady_clock::now() + kCloseDrain;
                }
                if (std::chrono::steady_clock::now() >= close_deadline_) {
                    // Fail it (and, in turn, the rest): close() must return.
                    cudaEventDestroy(p.event);
                    p.op->complete(Status(StatusCode::kUnavailable,
                                          fmt::format("cuda_ipc: transport closed with the write "
                                                      "still on its stream after {} s",
                                                      kCloseDrain.count())),
                                   0);
                    lock.lock();
                    pending_.pop_front();
                    continue;
                }
            }
            if (rc == cudaErrorNotReady) {
                // Spin (yielding) for the first 200 us of a wait, then sleep between polls: a
                // 1-4 MiB write takes 2-7 us on an H200, and a fixed 20 us sleep cost it 10-20%
                // of the raw copy's bandwidth (docs/gpu-results.md, 2026-11-30).
                const auto now = std::chrono::steady_clock::now();
                if (p.event != spin_event_) {
                    spin_event_ = p.event;
                    spin_start_ = now;
                }
                if (now - spin_start_ < std::chrono::microseconds(200)) {
                    std::this_thread::yield();
                } else {
                    std::this_thread::sleep_for(std::chrono::microseconds(20));
                }
                lock.lock();
                continue;
            }
            spin_event_ = nullptr;
            cudaEventDestroy(p.event);
            if (rc == cudaSuccess) {
                p.op->complete({}, p.bytes);
            } else {
                p.op->complete(
                    Status(StatusCode::kUnavailable,
                           fmt::format("cuda_ipc: write failed: {}", cudaGetErrorString(rc))),
                    0);
            }
            lock.lock();
            pending_.pop_front();
        }
    }

    // Progress thread only: the event being waited on and when that wait began; once closing,
    // when the pending writes stop being waited for.
    cudaEvent_t spin_event_ = nullptr;
    std::chrono::steady_clock::time_point spin_start_{};
    std::chrono::steady_clock::time_point close_deadline_{};

    const int rank_;
    const int world_;
    const int device_;
    cudaStream_t stream_ = nullptr;
    std::mutex stream_mu_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Pending> pending_;        // under mu_
    std::map<uint64_t, void*> local_;    // under mu_
    std::map<uint64_t, Remote> remote_;  // under mu_
    uint64_t next_id_ = 1;
    uint64_t next_remote_ = 1;
    bool closed_ = false;
    std::thread progress_;
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_cuda_ipc_transport(const TransportOptions& options) {
    const GpuTransportOptions gpu = options.get<GpuTransportOptions>();
    PDSIM_RETURN_IF_ERROR(validate_gpu_transport_options(gpu));
    const int device_index = gpu.device_index;
    PDSIM_RETURN_IF_ERROR(check_cuda_device(device_index));
    auto t = std::make_unique<CudaIpcTransport>(options.rank, std::max(options.world_size, 1),
                                                device_index);
    PDSIM_RETURN_IF_ERROR(t->init());
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
