// Stream, Event and Graph: the execution model shared by the CPU and CUDA backends.
//
// A Stream runs enqueued work in order, asynchronously to the host thread that enqueued it (the
// semantics of a CUDA stream). CpuStream is a worker thread with a FIFO queue, so the ordering bugs
// a GPU engine can have (reading a buffer before the kernel that writes it has run, reusing a
// buffer while in flight) exist on the CPU too. CudaStream wraps cudaStream_t (backends/cuda/).
//
// Errors: a task that fails (returns a non-OK Status) makes the stream's error sticky, like a CUDA
// error: later tasks are skipped and synchronize() returns the first error. A task that throws
// fails the same way (kInternal naming the exception; run_task below): a stream's worker thread
// or a CUDA host callback cannot pass an exception on, and letting it escape would end the
// process and every result it had not written yet.
//
// Thread-safety: enqueue/record/wait/synchronize may be called from any thread; work enqueued from
// one thread runs in that thread's enqueue order. Capture (begin_capture/end_capture) must be
// driven by a single thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pdsim::runtime {

enum class DeviceKind { kCpu, kCuda };

std::string_view device_kind_name(DeviceKind kind);

struct Device {
    DeviceKind kind = DeviceKind::kCpu;
    int index = 0;
    friend bool operator==(const Device&, const Device&) = default;
};

// The unit of stream work: runs on the stream (worker thread / CUDA host callback); a non-OK
// Status poisons the stream.
using Task = std::function<Status()>;

// Runs `task` as a stream runs it: its Status, or kInternal "a task on stream <stream_name>
// threw: <what>" when it throws (any exception; what() where it is a std::exception). Never
// throws. Every Stream implementation runs its tasks through this.
[[nodiscard]] Status run_task(const Task& task, std::string_view stream_name) noexcept;

inline constexpr std::chrono::milliseconds kDefaultWaitTimeout{60'000};

// An Event marks a point in a stream. It is created by a stream and may be waited on by any stream
// of the same device kind, or by the host.
class Event {
public:
    virtual ~Event() = default;
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;

    // True when all work before the most recent record() has completed (true if never recorded).
    [[nodiscard]] virtual bool query() const = 0;
    // Blocks the host until query() would be true; kDeadlineExceeded after `timeout`.
    [[nodiscard]] virtual Status synchronize(
        std::chrono::milliseconds timeout = kDefaultWaitTimeout) const = 0;

protected:
    Event() = default;
};

class Stream;

// A captured, replayable sequence of stream work (the CPU analogue of a CUDA graph). The captured
// tasks hold pointers into pre-allocated buffers; a replay runs the same tasks, which read whatever
// those buffers hold at execution time.
class Graph {
public:
    virtual ~Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;

    // Enqueues every captured task on `stream`, in capture order.
    [[nodiscard]] virtual Status launch(Stream& stream) = 0;
    [[nodiscard]] virtual size_t num_nodes() const = 0;

protected:
    Graph() = default;
};

class Stream {
public:
    virtual ~Stream() = default;
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    Stream(Stream&&) = delete;
    Stream& operator=(Stream&&) = delete;

    [[nodiscard]] virtual Device device() const = 0;
    [[nodiscard]] virtual std::string name() const = 0;

    // Enqueues a host task in stream order. Returns at once; the task runs after all earlier work.
    // While capturing, the task is appended to the graph instead and not run.
    [[nodiscard]] virtual Status enqueue(Task task) = 0;

    // Creates an event usable with this stream's device kind.
    [[nodiscard]] virtual std::unique_ptr<Event> create_event() = 0;
    // Records `event` at the current end of this stream.
    [[nodiscard]] virtual Status record(Event& event) = 0;
    // Work enqueued on this stream after this call does not start before `event`'s last record
    // (as of this call) has completed. The host does not block. A wait longer than the stream's
    // wait timeout fails the stream with kDeadlineExceeded.
    [[nodiscard]] virtual Status wait(Event& event) = 0;

    // Blocks the host until all enqueued work has run; returns the stream's sticky error if any, or
    // kDeadlineExceeded after `timeout`.
    [[nodiscard]] virtual Status synchronize(
        std::chrono::milliseconds timeout = kDefaultWaitTimeout) = 0;

    // The first error a task returned, or OK.
    [[nodiscard]] virtual Status error() const = 0;

    // Graph capture: between begin_capture() and end_capture(), enqueue/record/wait append to a
    // graph instead of running. Nested capture is an error.
    [[nodiscard]] virtual Status begin_capture() = 0;
    [[nodiscard]] virtual StatusOr<std::unique_ptr<Graph>> end_capture() = 0;
    [[nodiscard]] virtual bool is_capturing() const = 0;

protected:
    Stream() = default;
};

// Convenience: enqueue a void() callable.
template <typename F>
[[nodiscard]] Status enqueue_void(Stream& stream, F&& fn) {
    return stream.enqueue([f = std::forward<F>(fn)]() mutable {
        f();
        return Status();
    });
}

}  // namespace pdsim::runtime
