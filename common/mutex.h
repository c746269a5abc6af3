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

}  // namespace pdsim
