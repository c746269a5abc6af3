// CpuStream: a Stream backed by one worker thread and a FIFO queue (see stream.h for the contract).
//
// Caller runs (CpuStreamOptions::caller_runs): synchronize() does not sleep while the tasks it
// waits for sit in the queue and the worker is not running one: it runs them itself, in order, one
// at a time (so tasks still never overlap and keep their enqueue order). On a GPU the host's wait
// for a kernel costs microseconds; a CPU stream's two thread hand-offs per forward (the worker
// wakes for the task, the host wakes for its end) cost milliseconds on a core that other ranks'
// compute keeps busy, which is the emulation's cost, not the engine's. Stream-side waits
// (wait(Event)) are never run by the caller: they block for another stream. The caller checks its
// deadline before each task it takes; a task it has started runs to its end. A task running on
// the caller is "on the stream" for synchronize's self-call check.
//
// Caller first: with caller_runs, enqueueing a task does not wake the worker for it. A worker that
// is woken per task takes the core from the caller that is about to synchronize (on a rank bound
// to one core: 5.5 involuntary switches per 0.5 ms decode forward, its wall time 9-77% above its
// CPU time; docs/fidelity.md section 8.9). The worker is woken at the first enqueue after it
// parked, then checks every `caller_grace`: it runs a task that waited that long while no caller
// was synchronizing (nobody synchronizes the stream, or a caller timed out), and every stream-side
// wait at once; with nothing queued over a whole grace it parks again. So work nobody
// synchronizes still runs, at most two graces late, and a rank that synchronizes every forward
// wakes its worker at most once per grace.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/runtime/stream.h"

namespace pdsim::runtime {

struct CpuStreamOptions {
    // Bounds each stream-side wait(Event); exceeding it poisons the stream.
    std::chrono::milliseconds wait_timeout = kDefaultWaitTimeout;
    // synchronize() runs the queued tasks it waits for on the calling thread (above).
    bool caller_runs = false;
    // With caller_runs: how long a task waits for a synchronizing caller before the worker runs
    // it, and how often the worker looks while tasks come (above). Must be > 0.
    std::chrono::microseconds caller_grace{2000};
};

class CpuStream final : public Stream {
public:
    // `wait_timeout` bounds each stream-side wait(Event); exceeding it poisons the stream.
    explicit CpuStream(std::string name = "cpu",
                       std::chrono::milliseconds wait_timeout = kDefaultWaitTimeout);
    CpuStream(std::string name, CpuStreamOptions options);
    // Drains the queue (waits for queued work to finish) and joins the worker.
    ~CpuStream() override;

    [[nodiscard]] Device device() const override { return {DeviceKind::kCpu, 0}; }
    [[nodiscard]] std::string name() const override { return name_; }
    [[nodiscard]] Status enqueue(Task task) override;
    [[nodiscard]] std::unique_ptr<Event> create_event() override;
    [[nodiscard]] Status record(Event& event) override;
    [[nodiscard]] Status wait(Event& event) override;
    [[nodiscard]] Status synchronize(
        std::chrono::milliseconds timeout = kDefaultWaitTimeout) override;
    [[nodiscard]] Status error() const override;
    [[nodiscard]] Status begin_capture() override;
    [[nodiscard]] StatusOr<std::unique_ptr<Graph>> end_capture() override;
    [[nodiscard]] bool is_capturing() const override;

    // True when called from this stream's worker thread.
    [[nodiscard]] bool on_worker_thread() const;

    // A captured graph node (internal; public for the graph implementation).
    struct Node {
        enum Kind { kTask, kRecord, kWait } kind;
        Task task;
        Event* event;  // not owned; must outlive the graph
    };

private:
    struct Queued {
        Task task;
        bool blocking = false;  // a stream-side wait: only the worker runs it
        std::chrono::steady_clock::time_point queued_at;  // caller_runs: for caller_grace
    };
    void worker_loop();
    // Caller runs: what the worker does next (mu_ held).
    [[nodiscard]] bool worker_may_run_locked(std::chrono::steady_clock::time_point now) const;
    void push(Task task, bool blocking);
    // Caller runs: the front task may be taken by a synchronizing caller now (mu_ held).
    [[nodiscard]] bool caller_may_run_locked() const;
    // Pops the front task, runs it with mu_ released, records its end (`lock` holds mu_ before
    // and after). `on_caller`: a synchronizing caller runs it, not the worker.
    void run_front(std::unique_lock<std::mutex>& lock, bool on_caller);

    const std::string name_;
    const CpuStreamOptions options_;

    mutable std::mutex mu_;
    std::condition_variable work_cv_;  // worker waits for tasks (and for a caller's task to end)
    std::condition_variable idle_cv_;  // synchronize waits for tasks to end (or to run one)
    std::deque<Queued> queue_;
    uint64_t enqueued_ = 0;   // tasks pushed
    uint64_t completed_ = 0;  // tasks finished (run or skipped)
    bool busy_ = false;       // a task is running (on the worker or on a synchronizing caller)
    Status error_;
    bool stop_ = false;
    int syncing_callers_ = 0;    // callers inside synchronize() (caller_runs)
    bool worker_parked_ = true;  // caller_runs: the worker sleeps until an enqueue wakes it
    std::chrono::steady_clock::time_point last_push_;  // caller_runs: for parking

    bool capturing_ = false;
    std::vector<Node> captured_;

    std::thread worker_;
};

}  // namespace pdsim::runtime
