#include "backends/runtime/cpu_stream.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <string>

#include "common/thread_info.h"

namespace pdsim::runtime {

std::string_view device_kind_name(DeviceKind kind) {
    switch (kind) {
        case DeviceKind::kCpu:
            return "cpu";
        case DeviceKind::kCuda:
            return "cuda";
    }
    return "unknown";
}

Status run_task(const Task& task, std::string_view stream_name) noexcept {
    // Formatting the message may itself throw (bad_alloc): then a fixed message.
    auto threw = [stream_name](std::string_view what) noexcept {
        try {
            return Status(StatusCode::kInternal,
                          fmt::format("a task on stream {} threw: {}", stream_name, what));
        } catch (...) {
            return Status(StatusCode::kInternal, "a stream task threw");
        }
    };
    try {
        return task();
    } catch (const std::exception& e) {
        return threw(e.what());
    } catch (...) {
        return threw("an exception that is not a std::exception");
    }
}

namespace {

// Host-visible state of a CPU event. `recorded` counts record() calls made by the host;
// `completed` is the highest record generation whose stream position has been reached. Stream tasks
// hold the state by shared_ptr, so destroying the Event while a record or wait is still queued is
// safe (as cudaEventDestroy is).
struct CpuEventState {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t recorded = 0;
    uint64_t completed = 0;

    void complete(uint64_t gen) {
        // Notify under the lock: a waiter may destroy the state as soon as it sees `completed`.
        std::lock_guard<std::mutex> lock(mu);
        if (gen > completed) completed = gen;
        cv.notify_all();
    }
    bool wait_for(uint64_t gen, std::chrono::milliseconds timeout) {
        std::unique_lock<std::mutex> lock(mu);
        return cv.wait_for(lock, timeout, [&] { return completed >= gen; });
    }
};

class CpuEvent final : public Event {
public:
    [[nodiscard]] bool query() const override {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->completed >= state_->recorded;
    }
    [[nodiscard]] Status synchronize(std::chrono::milliseconds timeout) const override {
        uint64_t target;
        {
            std::lock_guard<std::mutex> lock(state_->mu);
            target = state_->recorded;
        }
        if (!state_->wait_for(target, timeout)) {
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded, "event not reached after {} ms",
                               timeout.count());
        }
        return {};
    }
    // Host side: a new record generation.
    uint64_t next_generation() {
        std::lock_guard<std::mutex> lock(state_->mu);
        return ++state_->recorded;
    }
    uint64_t recorded_generation() const {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->recorded;
    }
    const std::shared_ptr<CpuEventState>& state() const { return state_; }

private:
    std::shared_ptr<CpuEventState> state_ = std::make_shared<CpuEventState>();
};

}  // namespace

// Record and wait nodes are replayed through the stream API, so that each launch takes a fresh
// event generation on the host, exactly as an eager record/wait would.
class CpuGraph final : public Graph {
public:
    explicit CpuGraph(std::vector<CpuStream::Node> nodes) : nodes_(std::move(nodes)) {}
    [[nodiscard]] Status launch(Stream& stream) override {
        if (stream.device().kind != DeviceKind::kCpu) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "CPU graph launched on {}",
                               stream.name());
        }
        for (const CpuStream::Node& n : nodes_) {
            switch (n.kind) {
                case CpuStream::Node::kTask:
                    PDSIM_RETURN_IF_ERROR(stream.enqueue(n.task));
                    break;
                case CpuStream::Node::kRecord:
                    PDSIM_RETURN_IF_ERROR(stream.record(*n.event));
                    break;
                case CpuStream::Node::kWait:
                    PDSIM_RETURN_IF_ERROR(stream.wait(*n.event));
                    break;
            }
        }
        return {};
    }
    [[nodiscard]] size_t num_nodes() const override { return nodes_.size(); }

private:
    std::vector<CpuStream::Node> nodes_;
};

namespace {

// The stream whose task this thread runs as a synchronizing caller (caller runs), if any.
thread_local const CpuStream* tls_caller_running = nullptr;

}  // namespace

CpuStream::CpuStream(std::string name, std::chrono::milliseconds wait_timeout)
    : CpuStream(std::move(name), CpuStreamOptions{.wait_timeout = wait_timeout}) {}

namespace {

CpuStreamOptions checked(CpuStreamOptions options) {
    // A grace of zero would make the watching worker spin.
    options.caller_grace = std::max(options.caller_grace, std::chrono::microseconds(1));
    return options;
}

}  // namespace

CpuStream::CpuStream(std::string name, CpuStreamOptions options)
    : name_(std::move(name)), options_(checked(options)) {
    worker_ = std::thread([this] {
        set_thread_name("pdsim-stream");
        worker_loop();
    });
}

CpuStream::~CpuStream() {
    {
        std::unique_lock<std::mutex> lock(mu_);
        idle_cv_.wait(lock, [&] { return completed_ == enqueued_ && !busy_; });
        stop_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
}

bool CpuStream::on_worker_thread() const {
    return std::this_thread::get_id() == worker_.get_id();
}

void CpuStream::push(Task task, bool blocking) {
    bool wake = true;
    {
        std::lock_guard<std::mutex> lock(mu_);
        const auto now = std::chrono::steady_clock::now();
        queue_.push_back(Queued{std::move(task), blocking, now});
        ++enqueued_;
        if (options_.caller_runs) {
            // Caller first (cpu_stream.h): a watching worker finds the task by itself.
            last_push_ = now;
            wake = blocking || worker_parked_;
            worker_parked_ = false;
        }
    }
    if (wake) work_cv_.notify_one();
}

Status CpuStream::enqueue(Task task) {
    if (!task) return PDSIM_ERROR(StatusCode::kInvalidArgument, "empty task on stream {}", name_);
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (capturing_) {
            captured_.push_back(Node{Node::kTask, std::move(task), nullptr});
            return {};
        }
    }
    push(std::move(task), /*blocking=*/false);
    return {};
}

std::unique_ptr<Event> CpuStream::create_event() {
    return std::make_unique<CpuEvent>();
}

Status CpuStream::record(Event& event) {
    auto* ev = dynamic_cast<CpuEvent*>(&event);
    if (ev == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "stream {}: event is not a CPU event",
                           name_);
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (capturing_) {
            captured_.push_back(Node{Node::kRecord, nullptr, &event});
            return {};
        }
    }
    uint64_t gen = ev->next_generation();
    return enqueue([state = ev->state(), gen] {
        state->complete(gen);
        return Status();
    });
}

Status CpuStream::wait(Event& event) {
    auto* ev = dynamic_cast<CpuEvent*>(&event);
    if (ev == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "stream {}: event is not a CPU event",
                           name_);
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (capturing_) {
            captured_.push_back(Node{Node::kWait, nullptr, &event});
            return {};
        }
    }
    uint64_t gen = ev->recorded_generation();
    auto timeout = options_.wait_timeout;
    std::string name = name_;
    push(
        [state = ev->state(), gen, timeout, name] {
            if (!state->wait_for(gen, timeout)) {
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "stream {}: wait on event generation {} timed out after {} ms",
                                   name, gen, timeout.count());
            }
            return Status();
        },
        /*blocking=*/true);
    return {};
}

Status CpuStream::synchronize(std::chrono::milliseconds timeout) {
    if (on_worker_thread() || tls_caller_running == this) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "stream {}: synchronize() called from its own worker", name_);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    // While this caller is here the worker leaves the tasks it may run to it (caller first).
    ++syncing_callers_;
    struct Leave {
        int& callers;
        ~Leave() { --callers; }  // runs with mu_ held: `lock` is destroyed after it
    } leave{syncing_callers_};
    // Tasks run one at a time in order, so while none runs the front one is task number
    // completed_: below `target`, it is one this call waits for.
    auto may_run = [&] { return completed_ < target && caller_may_run_locked(); };
    while (completed_ < target) {
        // Past the deadline it returns even with a task it could take: the worker runs that one
        // (the caller's leaving lets it) and a task already started ran to its end.
        const bool timed_out =
            std::chrono::steady_clock::now() >= deadline ||
            !idle_cv_.wait_until(lock, deadline, [&] { return completed_ >= target || may_run(); });
        if (timed_out && completed_ < target) {
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "stream {}: synchronize timed out after {} ms ({} of {} tasks done)",
                               name_, timeout.count(), completed_, target);
        }
        if (completed_ < target && may_run()) run_front(lock, /*on_caller=*/true);
    }
    return error_;
}

bool CpuStream::caller_may_run_locked() const {
    return options_.caller_runs && !busy_ && !queue_.empty() && !queue_.front().blocking;
}

void CpuStream::run_front(std::unique_lock<std::mutex>& lock, bool on_caller) {
    Task task = std::move(queue_.front().task);
    queue_.pop_front();
    busy_ = true;
    const bool skip = !error_.ok();
    lock.unlock();
    const CpuStream* outer = tls_caller_running;
    if (on_caller) tls_caller_running = this;
    Status st = skip ? Status() : run_task(task, name_);
    task = nullptr;  // release captures before reporting completion
    tls_caller_running = outer;
    lock.lock();
    if (!st.ok() && error_.ok()) error_ = st.with_context("stream " + name_);
    busy_ = false;
    ++completed_;
    idle_cv_.notify_all();
    // A caller's task ended: a stream-side wait behind it is the worker's to run at once.
    if (on_caller && !queue_.empty() && queue_.front().blocking) work_cv_.notify_one();
}

Status CpuStream::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

Status CpuStream::begin_capture() {
    std::lock_guard<std::mutex> lock(mu_);
    if (capturing_)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "stream {}: already capturing", name_);
    capturing_ = true;
    captured_.clear();
    return {};
}

StatusOr<std::unique_ptr<Graph>> CpuStream::end_capture() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!capturing_)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "stream {}: not capturing", name_);
    capturing_ = false;
    std::unique_ptr<Graph> graph = std::make_unique<CpuGraph>(std::move(captured_));
    captured_.clear();
    return graph;
}

bool CpuStream::is_capturing() const {
    std::lock_guard<std::mutex> lock(mu_);
    return capturing_;
}

bool CpuStream::worker_may_run_locked(std::chrono::steady_clock::time_point now) const {
    if (busy_ || queue_.empty()) return false;
    const Queued& front = queue_.front();
    return front.blocking || stop_ ||
           (syncing_callers_ == 0 && now - front.queued_at >= options_.caller_grace);
}

void CpuStream::worker_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!options_.caller_runs) {
        for (;;) {
            work_cv_.wait(lock, [&] { return !busy_ && (stop_ || !queue_.empty()); });
            if (queue_.empty()) return;  // stop_ and drained (the destructor waited for busy_)
            run_front(lock, /*on_caller=*/false);
        }
    }
    // Caller first (cpu_stream.h): park until an enqueue, then look every caller_grace.
    for (;;) {
        const auto now = std::chrono::steady_clock::now();
        if (worker_may_run_locked(now)) {
            run_front(lock, /*on_caller=*/false);
            continue;
        }
        if (queue_.empty() && !busy_) {
            if (stop_) return;  // drained (the destructor waited for busy_)
            if (now - last_push_ >= options_.caller_grace) worker_parked_ = true;
        }
        if (worker_parked_) {
            work_cv_.wait(lock, [&] { return stop_ || !worker_parked_; });
        } else {
            work_cv_.wait_for(lock, options_.caller_grace);
        }
    }
}

}  // namespace pdsim::runtime
