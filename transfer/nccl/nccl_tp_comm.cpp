// The NCCL device TP group (see nccl_tp_comm.h): one communicator per TP group, ncclAllGather on
// the caller's stream, a watchdog that aborts the communicator on a stuck gather. Built only with
// NCCL; make_nccl_tp_comm (transfer/builtin.cpp) is the caller.
#include "transfer/nccl/nccl_tp_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_stream.h"
#include "common/cuda_check.h"
#include "common/nccl_check.h"
#include "common/thread_info.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/nccl/nccl_comm_finalize.h"
#include "transfer/nccl/nccl_pair_ids.h"

namespace pdsim::transfer {

namespace {

using Clock = std::chrono::steady_clock;

// The watchdog's poll period, and how long the destructor lets a clean communicator finalize.
constexpr auto kTpWatchdogPeriod = std::chrono::milliseconds(10);
constexpr auto kTpFinalizeTimeout = std::chrono::seconds(5);

class NcclTpComm final : public model::DeviceTpComm {
public:
    NcclTpComm(const NcclTpCommOptions& options, int rank, int size)
        : options_(options), rank_(rank), size_(size) {}

    ~NcclTpComm() override {
        std::deque<Pending> pending;
        std::vector<cudaEvent_t> free_events;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        if (watchdog_.joinable()) watchdog_.join();
        {
            std::lock_guard<std::mutex> lock(mu_);
            pending.swap(pending_);
            free_events.swap(free_events_);
        }
        runtime::cuda::ScopedDevice on_device(options_.device);
        std::lock_guard<std::mutex> comm_lock(comm_mu_);
        if (comm_ != nullptr) {  // else never initialized, or aborted
            // A gather still pending (its stream's work never ran) must not outlive the
            // communicator's resources: abort. Otherwise finalize, bounded.
            bool clean = true;
            for (const Pending& p : pending) {
                if (cudaEventQuery(p.done) != cudaSuccess) clean = false;
            }
            if (clean && finalize_nccl_comm(comm_, kTpFinalizeTimeout)) {
                ncclCommDestroy(comm_);
            } else {
                health_->break_with(
                    PDSIM_ERROR(StatusCode::kUnavailable,
                                "nccl TP group {}: rank {} of {}: closed without a "
                                "clean finalize (gathers pending?); communicator aborted",
                                options_.name, rank_, size_));
                ncclCommAbort(comm_);
            }
            comm_ = nullptr;
        }
        // An event still pending is released by CUDA once it completes.
        for (const Pending& p : pending) cudaEventDestroy(p.done);
        for (cudaEvent_t e : free_events) cudaEventDestroy(e);
    }

    NcclTpComm(const NcclTpComm&) = delete;
    NcclTpComm& operator=(const NcclTpComm&) = delete;

    // Makes the id (rank 0), shares it, initializes this member (bounded), starts the watchdog.
    Status init(model::TpComm& host) {
        runtime::cuda::ScopedDevice on_device(options_.device);
        PDSIM_RETURN_IF_ERROR(on_device.status());
        std::string root;
        if (rank_ == 0) {
            ncclUniqueId id{};
            NCCL_CHECK(ncclGetUniqueId(&id));
            root.assign(reinterpret_cast<const char*>(&id), sizeof(id));
        }
        PDSIM_ASSIGN_OR_RETURN(std::string shared, share_root_id(host, root, sizeof(ncclUniqueId)));
        ncclUniqueId id{};
        std::memcpy(&id, shared.data(), sizeof(id));
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        config.commName = options_.name.c_str();
        const auto deadline = Clock::now() + options_.connect_timeout;
        std::lock_guard<std::mutex> comm_lock(comm_mu_);
        const ncclResult_t rc = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
        if (rc != ncclSuccess && rc != ncclInProgress) {
            if (comm_ != nullptr) ncclCommAbort(comm_);
            comm_ = nullptr;
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "nccl TP group {}: rank {} of {}: ncclCommInitRankConfig failed: {}",
                               options_.name, rank_, size_, ncclGetErrorString(rc));
        }
        for (;;) {
            ncclResult_t state = ncclSuccess;
            const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
            if (q != ncclSuccess) state = q;
            if (state == ncclSuccess) break;
            if (state != ncclInProgress) {
                const std::string last = ncclGetLastError(comm_);
                ncclCommAbort(comm_);
                comm_ = nullptr;
                return PDSIM_ERROR(StatusCode::kUnavailable,
                                   "nccl TP group {}: rank {} of {}: the communicator failed to "
                                   "initialize: {} ({})",
                                   options_.name, rank_, size_, ncclGetErrorString(state), last);
            }
            if (Clock::now() >= deadline) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "nccl TP group {}: rank {} of {}: communicator not initialized "
                                   "after {} (did every rank of the group start, on a GPU of its "
                                   "own?); aborted",
                                   options_.name, rank_, size_,
                                   seconds_text(options_.connect_timeout));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        watchdog_ = std::thread([this] {
            set_thread_name("pdsim-nccl-tp");
            watchdog_loop();
        });
        return {};
    }

    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] std::string name() const override { return "nccl"; }

    [[nodiscard]] std::shared_ptr<const model::TpGroupHealth> health() const override {
        return health_;
    }

    [[nodiscard]] Status enqueue_allgather(const float* mine, size_t count, float* out,
                                           runtime::Stream& stream) override {
        PDSIM_RETURN_IF_ERROR(health_->status());
        if (mine == nullptr || out == nullptr || count == 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "nccl TP group {}: all-gather of {} floats from {} to {}",
                               options_.name, count, static_cast<const void*>(mine),
                               static_cast<void*>(out));
        }
        if (stream.device().index != options_.device) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "nccl TP group {}: stream {} is on device {}, the group's rank is "
                               "on cuda:{}",
                               options_.name, stream.name(), stream.device().index,
                               options_.device);
        }
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
        runtime::cuda::ScopedDevice on_device(options_.device);
        PDSIM_RETURN_IF_ERROR(on_device.status());
        cudaEvent_t done = nullptr;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!free_events_.empty()) {
                done = free_events_.back();
                free_events_.pop_back();
            }
        }
        if (done == nullptr) CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
        std::lock_guard<std::mutex> comm_lock(comm_mu_);
        if (comm_ == nullptr) {
            cudaEventDestroy(done);
            return health_->status();
        }
        // A non-blocking communicator returns ncclInProgress while NCCL's own thread enqueues: wait
        // for it (bounded) before the next call on the communicator and before the event, as
        // NCCL asks. A yield, not a sleep: this is on the forward's path, twice per layer.
        ncclResult_t rc = ncclAllGather(mine, out, count, ncclFloat32, comm_, s);
        const auto deadline = Clock::now() + enqueue_bound();
        while (rc == ncclInProgress) {
            ncclResult_t state = ncclSuccess;
            const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
            rc = q != ncclSuccess ? q : state;
            if (rc == ncclInProgress && Clock::now() >= deadline) break;
            if (rc == ncclInProgress) std::this_thread::yield();
        }
        if (rc != ncclSuccess) {
            cudaEventDestroy(done);
            const Status why =
                rc == ncclInProgress
                    ? PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                  "nccl TP group {}: rank {} of {}: ncclAllGather not enqueued "
                                  "after {}; communicator aborted",
                                  options_.name, rank_, size_, seconds_text(enqueue_bound()))
                    : PDSIM_ERROR(StatusCode::kUnavailable,
                                  "nccl TP group {}: rank {} of {}: ncclAllGather failed: {} ({}); "
                                  "communicator aborted",
                                  options_.name, rank_, size_, ncclGetErrorString(rc),
                                  ncclGetLastError(comm_));
            break_locked(why);
            return why;
        }
        if (const cudaError_t e = cudaEventRecord(done, s); e != cudaSuccess) {
            cudaEventDestroy(done);
            const Status why = PDSIM_ERROR(StatusCode::kUnavailable,
                                           "nccl TP group {}: rank {} of {}: recording the "
                                           "gather's event failed: {}; communicator aborted",
                                           options_.name, rank_, size_, cudaGetErrorString(e));
            break_locked(why);
            return why;
        }
        std::lock_guard<std::mutex> lock(mu_);
        pending_.push_back(Pending{done, Clock::now()});
        return {};
    }

private:
    struct Pending {
        cudaEvent_t done = nullptr;
        Clock::time_point enqueued;
    };

    std::chrono::milliseconds enqueue_bound() const {
        return options_.op_timeout.count() > 0 ? options_.op_timeout : options_.connect_timeout;
    }

    // Breaks the group with `why` (the first break wins) and aborts the communicator. The caller
    // holds comm_mu_.
    void break_locked(const Status& why) {
        // Set before the abort: a host task behind an aborted gather sees the break.
        health_->break_with(why);
        if (comm_ != nullptr) {
            ncclCommAbort(comm_);
            comm_ = nullptr;
        }
    }

    void watchdog_loop() {
        cudaSetDevice(options_.device);  // this thread's own
        std::unique_lock<std::mutex> lock(mu_);
        while (!stop_) {
            cv_.wait_for(lock, kTpWatchdogPeriod, [this] { return stop_; });
            if (stop_ || !health_->status().ok()) continue;
            // Completed gathers, in order; the oldest pending one's age.
            Status why;
            while (!pending_.empty()) {
                const cudaError_t q = cudaEventQuery(pending_.front().done);
                if (q == cudaSuccess) {
                    free_events_.push_back(pending_.front().done);
                    pending_.pop_front();
                    continue;
                }
                if (q != cudaErrorNotReady) {
                    why = PDSIM_ERROR(StatusCode::kUnavailable,
                                      "nccl TP group {}: rank {} of {}: a gather's event: {}; "
                                      "communicator aborted",
                                      options_.name, rank_, size_, cudaGetErrorString(q));
                } else if (options_.op_timeout.count() > 0 &&
                           Clock::now() - pending_.front().enqueued > options_.op_timeout) {
                    why = Status(StatusCode::kDeadlineExceeded,
                                 tp_gather_timeout_message(options_.name, rank_, size_,
                                                           options_.op_timeout));
                }
                break;
            }
            lock.unlock();
            {
                std::lock_guard<std::mutex> comm_lock(comm_mu_);
                if (why.ok() && comm_ != nullptr) {
                    ncclResult_t state = ncclSuccess;
                    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
                    if (q != ncclSuccess) state = q;
                    if (state != ncclSuccess && state != ncclInProgress) {
                        why = PDSIM_ERROR(StatusCode::kUnavailable,
                                          "nccl TP group {}: rank {} of {}: asynchronous NCCL "
                                          "error: {} ({}); communicator aborted",
                                          options_.name, rank_, size_, ncclGetErrorString(state),
                                          ncclGetLastError(comm_));
                    }
                }
                if (!why.ok()) break_locked(why);
            }
            lock.lock();
        }
    }

    const NcclTpCommOptions options_;
    const int rank_;
    const int size_;
    // Serializes the NCCL calls on comm_ (enqueue, the watchdog's error poll, abort, teardown).
    // Taken before mu_ when both are held.
    std::mutex comm_mu_;
    ncclComm_t comm_ = nullptr;
    const std::shared_ptr<model::TpGroupHealth> health_ = std::make_shared<model::TpGroupHealth>();
    std::mutex mu_;  // pending_, free_events_, stop_
    std::deque<Pending> pending_;
    std::vector<cudaEvent_t> free_events_;
    bool stop_ = false;
    std::condition_variable cv_;
    std::thread watchdog_;
};

}  // namespace

// The NCCL build's factory behind make_nccl_tp_comm (transfer/builtin.cpp), which has checked
// the options.
StatusOr<std::unique_ptr<model::DeviceTpComm>> make_nccl_tp_comm_on_device(
    model::TpComm& host, const NcclTpCommOptions& options) {
    PDSIM_RETURN_IF_ERROR(check_cuda_device(options.device));
    auto comm = std::make_unique<NcclTpComm>(options, host.rank(), host.size());
    PDSIM_RETURN_IF_ERROR(comm->init(host));
    return std::unique_ptr<model::DeviceTpComm>(std::move(comm));
}

}  // namespace pdsim::transfer
