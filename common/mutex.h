// Lock annotations that clang checks (-Wthread-safety), and a mutex that carries them.
//
//   class Queue {
//       Mutex mu_;
//       std::deque<Item> items_ PDSIM_GUARDED_BY(mu_);
//       void push_locked(Item item) PDSIM_REQUIRES(mu_);
//   public:
//       void push(Item item) PDSIM_EXCLUDES(mu_) { MutexLock lock(mu_); push_locked(item); }
//   };
//
// A member marked PDSIM_GUARDED_BY(mu_) may be read or written only while mu_ is held; a function
// marked PDSIM_REQUIRES(mu_) only be called with it held. clang proves both at compile time (ctest
// `thread_safety_check`, which builds the annotated translation units with -Wthread-safety
// -Werror); GCC ignores the annotations. libstdc++'s std::mutex and std::lock_guard are not
// annotated, so annotated code locks a pdsim::Mutex through a MutexLock.
//
// Thread-safety: Mutex is a std::mutex (not recursive; unlock only from the locking thread).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define PDSIM_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define PDSIM_THREAD_ANNOTATION(x)
#endif

#define PDSIM_CAPABILITY(name) PDSIM_THREAD_ANNOTATION(capability(name))
#define PDSIM_SCOPED_CAPABILITY PDSIM_THREAD_ANNOTATION(scoped_lockable)
// The member is read and written only with the named mutex held.
#define PDSIM_GUARDED_BY(mu) PDSIM_THREAD_ANNOTATION(guarded_by(mu))
// What the (smart) pointer member points to is accessed only with the named mutex held.
#define PDSIM_PT_GUARDED_BY(mu) PDSIM_THREAD_ANNOTATION(pt_guarded_by(mu))
// The function is called with these mutexes held, and returns with them still held.
#define PDSIM_REQUIRES(...) PDSIM_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// The function takes these mutexes itself: callers must not hold them.
#define PDSIM_EXCLUDES(...) PDSIM_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define PDSIM_ACQUIRE(...) PDSIM_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define PDSIM_RELEASE(...) PDSIM_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
// The function returns a reference to this mutex (an accessor: `Mutex& mu() const
// PDSIM_LOCK_RETURNED(mu_)`), so members of another class can be PDSIM_GUARDED_BY(obj.mu()).
#define PDSIM_LOCK_RETURNED(mu) PDSIM_THREAD_ANNOTATION(lock_returned(mu))
// Turns the analysis off for one function (say why beside it).
#define PDSIM_NO_THREAD_SAFETY_ANALYSIS PDSIM_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace pdsim {

class PDSIM_CAPABILITY("mutex") Mutex {
public:
    Mutex() = default;
    Mutex(const Mutex&) = delete;
    Mutex& operator=(const Mutex&) = delete;

    void lock() PDSIM_ACQUIRE() { mu_.lock(); }
    void unlock() PDSIM_RELEASE() { mu_.unlock(); }

private:
    friend class CondVar;  // waits on mu_ itself
    std::mutex mu_;
};

// Holds a Mutex for its scope (std::lock_guard, annotated).
class PDSIM_SCOPED_CAPABILITY MutexLock {
public:
    explicit MutexLock(Mutex& mu) PDSIM_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
    ~MutexLock() PDSIM_RELEASE() { mu_.unlock(); }
    MutexLock(const MutexLock&) = delete;
    MutexLock& operator=(const MutexLock&) = delete;

private:
    Mutex& mu_;
};

// A condition variable whose waits take a pdsim::Mutex (a std::condition_variable on the Mutex's
// std::mutex, so no extra lock and no extra wake-ups).
//
//   MutexLock lock(mu_);
//   if (!cv_.wait_for(mu_, timeout, [&] { return done; })) ...  // timed out, `done` still false
//
// Contract: the caller holds `mu` (PDSIM_REQUIRES), which the wait releases while blocked and
// holds again when it returns; every waiter of one CondVar uses the same Mutex. `pred` runs with
// `mu` held (clang's analysis does not see inside the lambda: annotate it PDSIM_REQUIRES(mu) when
// it reads PDSIM_GUARDED_BY members). Spurious wake-ups are absorbed (pred is re-checked).
// notify_* may be called with or without the mutex held. Thread-safety: like
// std::condition_variable.
class CondVar {
public:
    CondVar() = default;
    CondVar(const CondVar&) = delete;
    CondVar& operator=(const CondVar&) = delete;

    // Blocks until pred() holds.
    template <typename Predicate>
    void wait(Mutex& mu, Predicate pred) PDSIM_REQUIRES(mu) {
        std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
        cv_.wait(lock, std::move(pred));
        lock.release();  // still held: the caller's MutexLock unlocks it
    }
    // Blocks until pred() holds or `timeout` passed; returns pred()'s last value (false: timed
    // out).
    template <typename Rep, typename Period, typename Predicate>
    bool wait_for(Mutex& mu, const std::chrono::duration<Rep, Period>& timeout, Predicate pred)
        PDSIM_REQUIRES(mu) {
        std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
        const bool done = cv_.wait_for(lock, timeout, std::move(pred));
        lock.release();
        return done;
    }
    // Blocks until pred() holds or the clock reaches `deadline`; returns pred()'s last value
    // (false: the deadline passed).
    template <typename Clock, typename Duration, typename Predicate>
    bool wait_until(Mutex& mu, const std::chrono::time_point<Clock, Duration>& deadline,
                    Predicate pred) PDSIM_REQUIRES(mu) {
        std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
        const bool done = cv_.wait_until(lock, deadline, std::move(pred));
        lock.release();
        return done;
    }

    void notify_one() noexcept { cv_.notify_one(); }
    void notify_all() noexcept { cv_.notify_all(); }

private:
    std::condition_variable cv_;
};

}  // namespace pdsim
