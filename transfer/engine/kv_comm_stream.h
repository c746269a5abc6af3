// KvCommStream: the device-memory path of a KvSender / KvReceiver (private to transfer/engine):
// the engine's KV memory ops (kv_memory_ops.h) and the one comm stream it runs them on, for a
// KvLayout whose device() is not the CPU. Host layouts have none (the engine gathers, scatters
// and hashes with the host functions of transfer_plan.h and ordering_validator.h).
//
// What runs where (kv_sender.h, "Device memory"): the engine's threads plan the work
// (kv_copy_plan.h), enqueue it on the comm stream through the ops, and wait on the host for an
// event recorded behind it (wait()): a host wait, bounded by the request's deadline, that notices
// cancellation and the stream's sticky error between slices. With device gating (kv_sender.h)
// the sender instead gates this stream on the StepCounter and lets the transport wait on an
// event recorded here (Transport::post_*_after); its memory is then retired at once.
//
// Work whose wait failed (timed out, cancelled, the stream failed) may still run: retire() keeps
// its memory alive (staging, sums) and runs its completion (e.g. "this scatter no longer writes
// the pages") once the stream has passed it, as seen by sweep() (the engine's watchdog tick) or
// drain() (shutdown). No handle of the ops' memory is ever released inside a stream task.
//
// Thread-safety: every method may be called from any engine thread; the stream and the ops are
// thread-safe (stream.h, kv_memory_ops.h). The retired list is guarded by a leaf mutex; the
// completions run outside it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/mutex.h"
#include "common/status.h"
#include "transfer/engine/engine_types.h"
#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/kv_memory_ops.h"

namespace pdsim::transfer {

class KvCommStream {
public:
    using Clock = std::chrono::steady_clock;

    // For `layout` (device memory; `engine` names the engine in errors and the stream's name):
    // the ops are options.kv_memory_ops_for_testing or make_kv_memory_ops(layout.device()); the
    // stream comes from options.comm_stream_factory_for_testing or the runtime registry
    // (runtime::device_runtime(kind)->create_stream(index, name)). Errors: kInvalidArgument for
    // ops of another memory kind than the layout's, or a stream on another device; the errors of
    // make_kv_memory_ops (kUnavailable: built without CUDA, no such GPU) and of the stream's
    // creation, with context.
    [[nodiscard]] static StatusOr<std::unique_ptr<KvCommStream>> create(
        std::string_view engine, const KvLayout& layout, const EngineOptions& options);
    // Waits (bounded by kDefaultWaitTimeout) for the stream, then destroys it (which waits for what
    // is still queued on it), drops what is retired without running its completion, and then the
    // ops it owns.
    ~KvCommStream();
    KvCommStream(const KvCommStream&) = delete;
    KvCommStream& operator=(const KvCommStream&) = delete;

    [[nodiscard]] KvMemoryOps& ops() const { return *ops_; }
    [[nodiscard]] runtime::Stream& stream() const { return *stream_; }
    // "comm stream '<name>'", for reasons.
    [[nodiscard]] std::string describe() const;

    // Blocks until the stream has passed everything enqueued on it before this call (an event
    // recorded now), in waits of at most `slice`. kDeadlineExceeded at `deadline`; kAborted as
    // soon as `stop()` is true (checked between slices); the stream's sticky error once it has
    // one (a failed op; nothing after it runs); kUnavailable when no event can be made.
    [[nodiscard]] Status wait(Clock::time_point deadline, Clock::duration slice,
                              const std::function<bool()>& stop) const;

    // After a failed wait: what was enqueued before this call may still run. Keeps `keep` alive
    // and then runs `on_passed` (may be empty) once the stream has passed it or failed, as seen by
    // sweep() or drain(); both run on the thread that sees it.
    void retire(std::shared_ptr<void> keep, std::function<void()> on_passed);
    // Releases what the stream has passed (any thread; the engines call it on their tick).
    void sweep();
    // Shutdown: waits up to `timeout` for the stream, then releases what it passed. What it has
    // not passed stays retired until the destructor.
    void drain(std::chrono::milliseconds timeout);

    // The sums of `plan` over `layout` (the ops' memory kind): allocates sums, enqueues the
    // checksums, waits as wait() and returns plan.sum_count values in the plan's layout
    // ([layer][buf][head]). A failed wait retires the sums (the checksums may still run).
    [[nodiscard]] StatusOr<std::vector<uint64_t>> checksums(const KvLayout& layout,
                                                            const KvChecksumPlan& plan,
                                                            Clock::time_point deadline,
                                                            Clock::duration slice,
                                                            const std::function<bool()>& stop);

private:
    struct Retired {
        std::unique_ptr<runtime::Event> event;  // null: no event could be made (drain only)
        std::shared_ptr<void> keep;
        std::function<void()> on_passed;
    };

    KvCommStream(std::unique_ptr<KvMemoryOps> owned_ops, KvMemoryOps* ops,
                 std::unique_ptr<runtime::Stream> stream);
    // Takes the retired entries the stream has passed (all of them when `all`).
    std::vector<Retired> take_passed(bool all);

    // Destroyed in reverse order: the stream first (it waits for the work that uses the retired
    // memory and the ops), then the retired memory, then the ops.
    std::unique_ptr<KvMemoryOps> owned_ops_;  // made here (null when injected)
    KvMemoryOps* ops_ = nullptr;
    Mutex mu_;  // a leaf
    std::vector<Retired> retired_ PDSIM_GUARDED_BY(mu_);
    std::unique_ptr<runtime::Stream> stream_;
};

}  // namespace pdsim::transfer
