// RequestTable: the id -> request map of one side of the KV transfer engine (KvSender::Impl,
// KvReceiver::Impl) and the lifecycle both sides share: add with a duplicate-id check, lookup,
// a bounded wait on a condition variable, the transitions to Success / Failed (once), release of
// a terminal request, shutdown (which requests were still pending), the watchdog's deadline test
// and the request counts of EngineStats.
//
// Use (a side's record derives from RequestLifecycle):
//   RequestTable<SendReq> table_{RequestTableNames{"sender", transport.rank()}};
//   { MutexLock lock(table_.mu());
//     PDSIM_RETURN_IF_ERROR(table_.check_addable_locked(id));
//     table_.insert_locked(record); }
//   ... { MutexLock lock(table_.mu()); failed = table_.mark_failed_locked(*r, reason); }
//   if (failed) table_.notify_waiters();
//   ... status / wait: MutexLock, get_locked(id), wait_terminal_locked(*r, timeout).
//
// Locks. The table's mutex (mu()) is the engine lock of its side: it guards the map, the
// lifecycle fields of every record (RequestLifecycle::state, reason, finished; the terminal
// transitions go through mark_*_locked, Bootstrapping -> Transferring is the side's), the counts,
// and -- by the side's own PDSIM_GUARDED_BY(table_.mu())
// annotations -- the side's per-request bookkeeping and stats. One lock, so a transition and
// the bookkeeping that decides it are one atomic step. The sides' other locks (the sender's
// worker queues, the receiver's scatter queue) are leaves: never held while taking this one,
// and never taken while holding it. Record fields other than the lifecycle's are the side's
// business (documented there); the table reads id, deadline, timeout and state, and writes
// state, reason and finished. Records are not annotated (clang cannot name the table's mutex
// from a record): their "under the table's mutex" fields are checked by review and TSan.
//
// Errors (codes the engine's callers and tests match; messages unchanged from before the table):
// kUnavailable "<engine> rank R is shut down" (add after shutdown), kAlreadyExists "request N is
// already known" (add of a known id), kNotFound "request N is not known" (lookup, release),
// kFailedPrecondition "request N is still <state>" (release of an active request),
// kDeadlineExceeded "request N still <state> after T ms (awaiting <what>)" (a wait timed out).
//
// Blocking: only wait_for_locked / wait_terminal_locked block (on the condition variable,
// releasing the mutex, bounded by their timeout); everything else returns at once. A side calls
// notify_waiters() after every change a waiter's predicate may depend on (a transition, an
// arrival), after releasing the mutex or with it held.
//
// Thread-safety: all methods may be called from any thread; *_locked ones with mu() held (the
// others take it themselves, so callers must not hold it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "transfer/engine/engine_types.h"

namespace pdsim::transfer {

using Clock = std::chrono::steady_clock;

// Whole milliseconds from `since` to `now` (for messages: "silent for 1200 ms").
[[nodiscard]] inline int64_t ms_since(Clock::time_point since, Clock::time_point now) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count();
}

// A request's progress deadline (EngineOptions::request_timeout): "no progress for `timeout`".
// arm(now) restarts the clock (now + timeout); each side arms it when the request is created and
// again at every sign of progress (a message of the request, a landed or sent layer, a chunk
// handed over) and, while the request only waits for the other side to start it (queued there:
// the peer's liveness is the peer timeout's business), on every watchdog tick. Readable and
// armable from any thread without a lock (an atomic); the deadline only ever moves forward.
class ProgressDeadline {
public:
    using Clock = std::chrono::steady_clock;
    [[nodiscard]] Clock::time_point get() const {
        return Clock::time_point(Clock::duration(at_.load(std::memory_order_relaxed)));
    }
    // Sets the deadline to `at` unconditionally (creation).
    void set(Clock::time_point at) {
        at_.store(at.time_since_epoch().count(), std::memory_order_relaxed);
    }
    // Moves the deadline to `at` unless it is later already.
    void extend_to(Clock::time_point at) {
        const Clock::rep v = at.time_since_epoch().count();
        Clock::rep cur = at_.load(std::memory_order_relaxed);
        while (cur < v && !at_.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
        }
    }

private:
    std::atomic<Clock::rep> at_{0};
};

// The fields of a request that the table's lifecycle reads and writes. A side's record derives
// from it (and is owned by std::shared_ptr: the table, the side's tasks and callbacks share it).
struct RequestLifecycle {
    // Set before insert_locked, then constant: readable without the lock.
    uint64_t id = 0;
    Clock::time_point started;
    std::chrono::milliseconds timeout{0};
    // The progress deadline (see ProgressDeadline; any thread, no lock): set to started + timeout
    // before insert_locked, extended by touch() at every sign of progress.
    ProgressDeadline deadline;
    // Restarts the progress clock: the request moved at `now`.
    void touch(Clock::time_point now = Clock::now()) { deadline.extend_to(now + timeout); }

    // Under the table's mutex; written only by the table (mark_succeeded_locked /
    // mark_failed_locked).
    RequestState state = RequestState::kBootstrapping;
    std::string reason;  // Failed: why
    Clock::time_point finished;
};

// Which side a table serves, for its error messages ("sender rank 3 is shut down").
struct RequestTableNames {
    std::string_view engine;  // "sender" / "receiver"
    int rank = -1;            // this rank (world)
};

// The messages the table's errors carry (out of line: request_table.cpp).
namespace request_table_detail {
[[nodiscard]] Status shut_down_error(std::string_view engine, int rank);
[[nodiscard]] Status already_known_error(uint64_t id);
[[nodiscard]] Status not_known_error(uint64_t id);
[[nodiscard]] Status still_active_error(uint64_t id, RequestState state);
[[nodiscard]] Status wait_timed_out_error(uint64_t id, RequestState state,
                                          std::chrono::nanoseconds timeout,
                                          std::string_view awaiting);
[[nodiscard]] std::string timed_out_reason(uint64_t id, std::chrono::milliseconds timeout,
                                           std::string_view awaiting);
}  // namespace request_table_detail

template <typename Record>
class RequestTable {
    static_assert(std::is_base_of_v<RequestLifecycle, Record>,
                  "a request record derives from RequestLifecycle");

public:
    using Map = std::unordered_map<uint64_t, std::shared_ptr<Record>>;

    explicit RequestTable(RequestTableNames names) : names_(names) {}
    RequestTable(const RequestTable&) = delete;
    RequestTable& operator=(const RequestTable&) = delete;

    // The engine lock (see the header note).
    [[nodiscard]] Mutex& mu() const PDSIM_LOCK_RETURNED(mu_) { return mu_; }

    // ---- add, look up ----

    // OK when a request `id` may be added now. kUnavailable ("<engine> rank R is shut down")
    // after begin_shutdown(); kAlreadyExists ("request N is already known") while `id` is in the
    // table (until release()).
    [[nodiscard]] Status check_addable_locked(uint64_t id) const PDSIM_REQUIRES(mu_) {
        if (shut_down_) return request_table_detail::shut_down_error(names_.engine, names_.rank);
        if (requests_.count(id) != 0) return request_table_detail::already_known_error(id);
        return {};
    }
    // Adds `record` (check_addable_locked(record->id) passed under the same hold) and counts it
    // as submitted.
    void insert_locked(std::shared_ptr<Record> record) PDSIM_REQUIRES(mu_) {
        const uint64_t id = record->id;
        requests_[id] = std::move(record);
        ++submitted_;
    }

    // The request, or null when `id` is not in the table.
    [[nodiscard]] std::shared_ptr<Record> find_locked(uint64_t id) const PDSIM_REQUIRES(mu_) {
        auto it = requests_.find(id);
        return it == requests_.end() ? nullptr : it->second;
    }
    [[nodiscard]] std::shared_ptr<Record> find(uint64_t id) const PDSIM_EXCLUDES(mu_) {
        MutexLock lock(mu_);
        return find_locked(id);
    }
    // The request; kNotFound ("request N is not known") when `id` is not in the table.
    [[nodiscard]] StatusOr<std::shared_ptr<Record>> get_locked(uint64_t id) const
        PDSIM_REQUIRES(mu_) {
        auto it = requests_.find(id);
        if (it == requests_.end()) return request_table_detail::not_known_error(id);
        return it->second;
    }
    // Every request, terminal ones included (until released), in the map's order. The reference
    // is valid while mu() stays held.
    [[nodiscard]] const Map& requests_locked() const PDSIM_REQUIRES(mu_) { return requests_; }

    // ---- wait ----

    // Blocks until done() (called with mu() held) or `timeout` passed, releasing mu() meanwhile;
    // returns done()'s last value. Woken by notify_waiters().
    template <typename Predicate>
    [[nodiscard]] bool wait_for_locked(std::chrono::nanoseconds timeout, Predicate done) const
        PDSIM_REQUIRES(mu_) {
        return cv_.wait_for(mu_, timeout, std::move(done));
    }
    // Blocks until `record` is terminal (true) or `timeout` passed (false).
    [[nodiscard]] bool wait_terminal_locked(const Record& record,
                                            std::chrono::nanoseconds timeout) const
        PDSIM_REQUIRES(mu_) {
        return wait_for_locked(timeout, [&] { return is_terminal(record.state); });
    }
    // The error of a wait that timed out: kDeadlineExceeded ("request N still <state> after T ms
    // (awaiting <what>)").
    [[nodiscard]] static Status wait_timed_out(const Record& record,
                                               std::chrono::nanoseconds timeout,
                                               std::string_view awaiting) {
        return request_table_detail::wait_timed_out_error(record.id, record.state, timeout,
                                                          awaiting);
    }
    // Wakes every wait_*_locked so it re-checks its predicate.
    void notify_waiters() const { cv_.notify_all(); }

    // ---- transitions ----

    // Success, once: false (and nothing changes) when the request is terminal already.
    [[nodiscard]] bool mark_succeeded_locked(Record& record) PDSIM_REQUIRES(mu_) {
        if (is_terminal(record.state)) return false;
        record.state = RequestState::kSuccess;
        record.finished = Clock::now();
        ++completed_;
        return true;
    }
    // Failed with `reason`, once: false (and nothing changes) when the request is terminal
    // already.
    [[nodiscard]] bool mark_failed_locked(Record& record, std::string reason) PDSIM_REQUIRES(mu_) {
        if (is_terminal(record.state)) return false;
        record.state = RequestState::kFailed;
        record.reason = std::move(reason);
        record.finished = Clock::now();
        ++failed_;
        return true;
    }

    // Forgets a terminal request. kNotFound for an unknown id; kFailedPrecondition ("request N
    // is still <state>") while it is active.
    [[nodiscard]] Status release(uint64_t id) PDSIM_EXCLUDES(mu_) {
        MutexLock lock(mu_);
        auto it = requests_.find(id);
        if (it == requests_.end()) return request_table_detail::not_known_error(id);
        if (!is_terminal(it->second->state)) {
            return request_table_detail::still_active_error(id, it->second->state);
        }
        requests_.erase(it);
        return {};
    }

    // ---- shutdown, watchdog, counts ----

    // The first call refuses further adds and returns the requests still active (in the map's
    // order), which the caller then fails; later calls return nullopt (shutdown is idempotent).
    [[nodiscard]] std::optional<std::vector<std::shared_ptr<Record>>> begin_shutdown()
        PDSIM_EXCLUDES(mu_) {
        MutexLock lock(mu_);
        if (shut_down_) return std::nullopt;
        shut_down_ = true;
        std::vector<std::shared_ptr<Record>> active;
        for (auto& [id, record] : requests_) {
            if (!is_terminal(record->state)) active.push_back(record);
        }
        return active;
    }

    // The watchdog's deadline test: whether an active request made no progress for its timeout
    // at `now`, and the reason it then fails with ("request N: no progress for T ms while
    // awaiting <what>").
    [[nodiscard]] static bool past_deadline(const Record& record, Clock::time_point now) {
        return now >= record.deadline.get();
    }
    [[nodiscard]] static std::string timed_out_reason(const Record& record,
                                                      std::string_view awaiting) {
        return request_table_detail::timed_out_reason(record.id, record.timeout, awaiting);
    }

    // Copies the request counts (submitted, completed, failed) into `stats`.
    void copy_counts_locked(EngineStats& stats) const PDSIM_REQUIRES(mu_) {
        stats.requests_submitted = submitted_;
        stats.requests_completed = completed_;
        stats.requests_failed = failed_;
    }

private:
    const RequestTableNames names_;
    mutable Mutex mu_;
    mutable CondVar cv_;
    Map requests_ PDSIM_GUARDED_BY(mu_);
    bool shut_down_ PDSIM_GUARDED_BY(mu_) = false;
    uint64_t submitted_ PDSIM_GUARDED_BY(mu_) = 0;
    uint64_t completed_ PDSIM_GUARDED_BY(mu_) = 0;
    uint64_t failed_ PDSIM_GUARDED_BY(mu_) = 0;
};

}  // namespace pdsim::transfer
