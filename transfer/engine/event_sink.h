// Hands an engine's TransferEvents to the user's EventHook until the engine shuts down: once
// close() has returned, the hook is never called again (engine_types.h, EventHook). Completions
// can outlive an engine's shutdown -- an ordered plane's announced send stays posted until its
// decode rank receives it or the data transport is closed (kv_sender.h), and its callback still
// runs then -- so the rule is kept here rather than by every caller of emit.
//
//   EventSink events(options.on_event);
//   events.emit(e);   // any engine thread
//   events.close();   // shutdown: waits for hook calls in progress, then no more
//
// Thread-safety: emit() may be called from any number of threads at once; the hook calls are not
// serialized (the hook is thread-safe by contract). close() may be called from any thread, more
// than once, and from inside a hook call on this sink (it then waits only for the other threads'
// calls, not for its own).
// Blocking: emit() blocks only for the hook call. close() blocks until every hook call that
// started on another thread before it has returned -- unbounded, as the hook is quick by contract.
#pragma once

#include <utility>

#include "common/mutex.h"
#include "transfer/engine/engine_types.h"

namespace pdsim::transfer {

class EventSink {
public:
    explicit EventSink(EventHook hook) : hook_(std::move(hook)) {}
    EventSink(const EventSink&) = delete;
    EventSink& operator=(const EventSink&) = delete;

    // Whether a hook was given (an engine may skip building events without one).
    [[nodiscard]] bool has_hook() const { return static_cast<bool>(hook_); }

    // Calls the hook with `event`, unless there is none or close() has begun.
    void emit(const TransferEvent& event) const PDSIM_EXCLUDES(mu_);

    // From now on emit() calls nothing; returns once the calls in progress on other threads have.
    void close() PDSIM_EXCLUDES(mu_);

private:
    const EventHook hook_;
    mutable Mutex mu_;
    mutable CondVar idle_;
    bool closed_ PDSIM_GUARDED_BY(mu_) = false;
    mutable int calls_in_progress_ PDSIM_GUARDED_BY(mu_) = 0;
};

}  // namespace pdsim::transfer
