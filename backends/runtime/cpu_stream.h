// CpuStream: a Stream backed by one worker thread and a FIFO queue (see stream.h for the contract).
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/runtime/stream.h"

namespace pdsim::runtime {

class CpuStream final : public Stream {
public:
    // `wait_timeout` bounds each stream-side wait(Event); exceeding it poisons the stream.
    explicit CpuStream(std::string name = "cpu",
                       std::chrono::milliseconds wait_timeout = kDefaultWaitTimeout);
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
    void worker_loop();
    void push(Task task);

    const std::string name_;
    const std::chrono::milliseconds wait_timeout_;

    mutable std::mutex mu_;
    std::condition_variable work_cv_;  // worker waits for tasks
    std::condition_variable idle_cv_;  // synchronize waits for the queue to drain
    std::deque<Task> queue_;
    uint64_t enqueued_ = 0;   // tasks pushed
    uint64_t completed_ = 0;  // tasks finished (run or skipped)
    Status error_;
    bool stop_ = false;

    bool capturing_ = false;
    std::vector<Node> captured_;

    std::thread worker_;
};

}  // namespace pdsim::runtime
