// A planted violation for ctest thread_safety_check_self_test: clang's -Wthread-safety must reject
// the unlocked read below ("reading variable 'value' requires holding mutex 'counter.mu'"), or the
// annotations of common/mutex.h check nothing and thread_safety_check would pass vacuously.
#include "common/mutex.h"

namespace {

struct Counter {
    pdsim::Mutex mu;
    int value PDSIM_GUARDED_BY(mu) = 0;
};

int read_locked(Counter& counter) {
    pdsim::MutexLock lock(counter.mu);
    return counter.value;
}

int read_unlocked(Counter& counter) {
    return counter.value;  // the violation
}

}  // namespace

int main() {
    Counter counter;
    return read_locked(counter) + read_unlocked(counter);
}
