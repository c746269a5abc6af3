#include "transfer/engine/event_sink.h"

namespace pdsim::transfer {
namespace {

// The sink whose hook this thread is calling now (innermost, when a hook makes another engine
// emit on the same thread), so that a close() from inside that hook does not wait for itself.
thread_local const EventSink* tls_sink = nullptr;

}  // namespace

void EventSink::emit(const TransferEvent& event) const {
    if (!hook_) return;
    {
        MutexLock lock(mu_);
        if (closed_) return;
        ++calls_in_progress_;
    }
    const EventSink* outer = tls_sink;
    tls_sink = this;
    hook_(event);
    tls_sink = outer;
    MutexLock lock(mu_);
    --calls_in_progress_;
    // Under the lock: once close() sees no call in progress, its engine may free this sink.
    idle_.notify_all();
}

void EventSink::close() {
    // A close() from inside this sink's own hook call must not wait for that call.
    const int own = tls_sink == this ? 1 : 0;
    MutexLock lock(mu_);
    closed_ = true;
    idle_.wait(mu_, [&]() PDSIM_REQUIRES(mu_) { return calls_in_progress_ <= own; });
}

}  // namespace pdsim::transfer
