// CudaStream and the CUDA DeviceRuntime.
#include "backends/cuda/cuda_stream.h"

#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_runtime_api.h"
#include "common/cuda_check.h"
#include "common/device_health.h"
#include "common/logging.h"

namespace pdsim::runtime::cuda {

namespace {

class CudaEvent final : public Event {
public:
    CudaEvent(cudaEvent_t ev, int device) : ev_(ev), device_(device) {}
    ~CudaEvent() override { cudaEventDestroy(ev_); }
    [[nodiscard]] bool query() const override { return cudaEventQuery(ev_) == cudaSuccess; }
    [[nodiscard]] Status synchronize(std::chrono::milliseconds timeout) const override {
        auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            cudaError_t rc = cudaEventQuery(ev_);
            if (rc == cudaSuccess) return {};
            if (rc != cudaErrorNotReady) CUDA_CHECK(rc);
            if (std::chrono::steady_clock::now() > deadline) {
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "CUDA event not reached after {} ms", timeout.count());
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
    cudaEvent_t handle() const { return ev_; }
    int device() const { return device_; }

private:
    cudaEvent_t ev_;
    int device_;
};

// What a CudaStream's host tasks report into: shared with every task still queued, so that a
// stream destroyed without waiting (its destructor's wait ran out) leaves them nothing dangling.
struct StreamState {
    explicit StreamState(std::string stream_name) : name(std::move(stream_name)) {}
    const std::string name;
    std::mutex mu;
    Status error;  // the first failure, under mu
    std::atomic<bool> failed{false};
};

// One host task on a CUDA stream (cudaLaunchHostFunc's user data). An eager task deletes itself
// once it has run; a captured one belongs to its graph (owned_by_graph), which runs it on every
// launch and frees it with the graph.
struct HostTask {
    Task task;
    std::shared_ptr<StreamState> state;
    bool owned_by_graph = false;
};

void CUDART_CB run_host_task(void* user) {
    auto* t = static_cast<HostTask*>(user);
    if (!t->state->failed.load(std::memory_order_acquire)) {
        Status st = run_task(t->task, t->state->name);
        if (!st.ok()) {
            std::lock_guard<std::mutex> lock(t->state->mu);
            if (t->state->error.ok()) t->state->error = st;
            t->state->failed.store(true, std::memory_order_release);
        }
    }
    if (!t->owned_by_graph) delete t;
}

// A captured graph and the host tasks captured in it: each launch runs them, and they report into
// the state of the stream that captured them, whichever stream launches the graph.
class CudaGraph final : public Graph {
public:
    CudaGraph(int device, cudaGraph_t g, cudaGraphExec_t e, size_t nodes,
              std::vector<std::unique_ptr<HostTask>> host_tasks)
        : device_(device), graph_(g), exec_(e), nodes_(nodes), host_tasks_(std::move(host_tasks)) {}
    // The owner destroys a graph once its launches finished (cudaGraphExecDestroy does not wait
    // for them). On a hung GPU that cannot be known: its host tasks are left to the process exit
    // (a launch still queued there may run them yet).
    ~CudaGraph() override {
        cudaGraphExecDestroy(exec_);
        cudaGraphDestroy(graph_);
        if (device_hung(device_)) {
            for (auto& t : host_tasks_) (void)t.release();
        }
    }
    [[nodiscard]] Status launch(Stream& stream) override;
    [[nodiscard]] size_t num_nodes() const override { return nodes_; }

private:
    int device_;
    cudaGraph_t graph_;
    cudaGraphExec_t exec_;
    size_t nodes_;
    std::vector<std::unique_ptr<HostTask>> host_tasks_;
};

class CudaStream final : public Stream {
public:
    CudaStream(int device, cudaStream_t s, std::string name)
        : device_(device),
          s_(s),
          name_(std::move(name)),
          state_(std::make_shared<StreamState>(name_)) {}
    // Waits for the stream's work, bounded (kDestroyWait); past it the device is marked hung
    // (mark_device_hung: later frees on it are skipped, they would wait for it too) and the
    // stream is destroyed without waiting: its queued host tasks hold the shared state, not this.
    ~CudaStream() override {
        cudaSetDevice(device_);
        const auto deadline = std::chrono::steady_clock::now() + kDestroyWait;
        while (!device_hung(device_) && cudaStreamQuery(s_) == cudaErrorNotReady) {
            if (std::chrono::steady_clock::now() > deadline) {
                mark_device_hung(device_, fmt::format("stream {} still had work {} s after its "
                                                      "owner let it go",
                                                      name_, kDestroyWait.count()));
                break;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        (void)cudaGetLastError();  // a sticky query error is the owner's, already reported
        cudaStreamDestroy(s_);     // does not wait: work left on it finishes (or not) alone
    }
    [[nodiscard]] Device device() const override { return {DeviceKind::kCuda, device_}; }
    [[nodiscard]] std::string name() const override { return name_; }
    cudaStream_t handle() const { return s_; }

    [[nodiscard]] Status enqueue(Task task) override {
        if (!task)
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "empty task on stream {}", name_);
        auto owned = std::make_unique<HostTask>(HostTask{std::move(task), state_, false});
        HostTask* t = owned.get();
        // A task enqueued while capturing becomes a node of the graph, run by every launch: the
        // graph owns it then (end_capture hands the captured ones over).
        std::lock_guard<std::mutex> lock(capture_mu_);
        t->owned_by_graph = capturing_;
        CUDA_CHECK(cudaLaunchHostFunc(s_, run_host_task, t));
        if (capturing_) {
            captured_tasks_.push_back(std::move(owned));
        } else {
            (void)owned.release();  // run_host_task deletes it
        }
        return {};
    }
    [[nodiscard]] std::unique_ptr<Event> create_event() override {
        cudaEvent_t ev = nullptr;
        cudaSetDevice(device_);
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return nullptr;
        return std::make_unique<CudaEvent>(ev, device_);
    }
    [[nodiscard]] Status record(Event& event) override {
        auto* ev = dynamic_cast<CudaEvent*>(&event);
        if (ev == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "not a CUDA event");
        CUDA_CHECK(cudaEventRecord(ev->handle(), s_));
        return {};
    }
    [[nodiscard]] Status wait(Event& event) override {
        auto* ev = dynamic_cast<CudaEvent*>(&event);
        if (ev == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "not a CUDA event");
        CUDA_CHECK(cudaStreamWaitEvent(s_, ev->handle(), 0));
        return {};
    }
    [[nodiscard]] Status synchronize(
        std::chrono::milliseconds timeout = kDefaultWaitTimeout) override {
        auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            cudaError_t rc = cudaStreamQuery(s_);
            if (rc == cudaSuccess) break;
            if (rc != cudaErrorNotReady) CUDA_CHECK(rc);
            if (std::chrono::steady_clock::now() > deadline) {
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "stream {}: synchronize timed out after {} ms", name_,
                                   timeout.count());
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        return error();
    }
    [[nodiscard]] Status error() const override {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->error;
    }
    [[nodiscard]] Status begin_capture() override {
        std::lock_guard<std::mutex> lock(capture_mu_);
        CUDA_CHECK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
        capturing_ = true;
        captured_tasks_.clear();
        return {};
    }
    [[nodiscard]] StatusOr<std::unique_ptr<Graph>> end_capture() override {
        cudaGraph_t g = nullptr;
        std::vector<std::unique_ptr<HostTask>> host_tasks;
        // Held through cudaStreamEndCapture: a task another thread enqueues meanwhile is either
        // captured (and owned by the graph) or eager, never captured but self-deleting. The
        // capture ends here whatever happens below: the captured tasks go to the graph, or are
        // freed with it (a captured host function never ran).
        std::unique_lock<std::mutex> capture_lock(capture_mu_);
        capturing_ = false;
        host_tasks.swap(captured_tasks_);
        // A failed capture (or instantiation) leaves its error as this thread's last error, which
        // the next kernel launcher's cudaGetLastError would report as its own: the caller's eager
        // fallback would fail its first forward. Clear it here; the Status carries it.
        auto failed = [&](const char* call, cudaError_t rc) {
            (void)cudaGetLastError();
            if (g != nullptr) cudaGraphDestroy(g);
            return PDSIM_ERROR(StatusCode::kUnavailable, "stream {}: {} failed: {} ({})", name_,
                               call, cudaGetErrorName(rc), cudaGetErrorString(rc));
        };
        const cudaError_t ended = cudaStreamEndCapture(s_, &g);
        capture_lock.unlock();
        if (ended != cudaSuccess) return failed("cudaStreamEndCapture", ended);
        cudaGraphExec_t exec = nullptr;
        if (const cudaError_t rc = cudaGraphInstantiate(&exec, g, 0); rc != cudaSuccess) {
            return failed("cudaGraphInstantiate", rc);
        }
        size_t n = 0;
        cudaGraphGetNodes(g, nullptr, &n);
        return std::unique_ptr<Graph>(
            std::make_unique<CudaGraph>(device_, g, exec, n, std::move(host_tasks)));
    }
    [[nodiscard]] bool is_capturing() const override {
        cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        cudaStreamIsCapturing(s_, &st);
        return st == cudaStreamCaptureStatusActive;
    }

private:
    static constexpr std::chrono::seconds kDestroyWait{30};
    int device_;
    cudaStream_t s_;
    std::string name_;
    std::shared_ptr<StreamState> state_;
    // Capture: begin_capture .. end_capture; the host tasks enqueued meanwhile.
    std::mutex capture_mu_;
    bool capturing_ = false;
    std::vector<std::unique_ptr<HostTask>> captured_tasks_;
};

Status CudaGraph::launch(Stream& stream) {
    auto* cs = dynamic_cast<CudaStream*>(&stream);
    if (cs == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "CUDA graph launched on {}",
                           stream.name());
    CUDA_CHECK(cudaGraphLaunch(exec_, cs->handle()));
    return {};
}

class CudaRuntime final : public DeviceRuntime {
public:
    CudaRuntime() {
        int n = 0;
        cudaError_t rc = cudaGetDeviceCount(&n);
        if (rc != cudaSuccess) {
            reason_ = std::string("no device: ") + cudaGetErrorString(rc);
            n = 0;
            cudaGetLastError();
        } else if (n == 0) {
            reason_ = "no device: no CUDA GPU visible";
        }
        count_ = n;
    }
    [[nodiscard]] DeviceKind kind() const override { return DeviceKind::kCuda; }
    [[nodiscard]] int device_count() const override { return count_; }
    [[nodiscard]] std::string unavailable_reason() const override { return reason_; }
    [[nodiscard]] StatusOr<void*> allocate(size_t bytes, int index) override {
        PDSIM_RETURN_IF_ERROR(check_index(index));
        CUDA_CHECK(cudaSetDevice(index));
        void* p = nullptr;
        CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
        return p;
    }
    void deallocate(void* ptr, int index) noexcept override {
        // cudaFree waits for the whole device: on a hung one it would never return.
        if (device_hung(index)) return;
        cudaSetDevice(index);
        cudaFree(ptr);
    }
    // cudaMemcpy may return before a device-to-device or pageable host-to-device copy has
    // landed, and cudaMemset before the fill has run; CudaStreams are non-blocking streams that
    // do not order against the legacy stream, so wait here to keep these calls synchronous.
    [[nodiscard]] Status copy(void* dst, const void* src, size_t bytes) override {
        CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
        CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
        return {};
    }
    [[nodiscard]] Status fill(void* dst, int byte, size_t bytes) override {
        CUDA_CHECK(cudaMemset(dst, byte, bytes));
        CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
        return {};
    }
    // The device made current (and left current, as CudaStream's calls leave it) first.
    [[nodiscard]] Status copy_on(int index, void* dst, const void* src, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_index(index));
        CUDA_CHECK(cudaSetDevice(index));
        return copy(dst, src, bytes);
    }
    [[nodiscard]] Status fill_on(int index, void* dst, int byte, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_index(index));
        CUDA_CHECK(cudaSetDevice(index));
        return fill(dst, byte, bytes);
    }
    [[nodiscard]] StatusOr<std::unique_ptr<Stream>> create_stream(int index,
                                                                  std::string name) override {
        return make_cuda_stream(index, std::move(name));
    }

    Status check_index(int index) const {
        if (count_ == 0) return PDSIM_ERROR(StatusCode::kUnavailable, "{}", reason_);
        if (index < 0 || index >= count_) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "cuda device {} (have {})", index,
                               count_);
        }
        return {};
    }

private:
    int count_ = 0;
    std::string reason_;
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_cuda_runtime() {
    return std::make_unique<CudaRuntime>();
}

StatusOr<std::unique_ptr<Stream>> make_cuda_stream(int index, std::string name) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return PDSIM_ERROR(StatusCode::kUnavailable, "no device: no CUDA GPU visible");
    }
    CUDA_CHECK(cudaSetDevice(index));
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(index, s, std::move(name)));
}

StatusOr<cudaStream_t> native_stream(Stream& stream) {
    auto* cs = dynamic_cast<CudaStream*>(&stream);
    if (cs == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "stream {} is not a CUDA stream ({})",
                           stream.name(), device_kind_name(stream.device().kind));
    }
    return cs->handle();
}

StatusOr<cudaEvent_t> native_event(Event& event) {
    auto* ev = dynamic_cast<CudaEvent*>(&event);
    if (ev == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "not a CUDA event");
    return ev->handle();
}

StatusOr<NativeEvent> native_event_of(const Event& event) {
    const auto* ev = dynamic_cast<const CudaEvent*>(&event);
    if (ev == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "not a CUDA event");
    return NativeEvent{ev->handle(), ev->device()};
}

}  // namespace pdsim::runtime::cuda
