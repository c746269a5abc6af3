// Thread names and per-thread CPU time of this process (Linux; elsewhere the calls are no-ops
// and the list is empty).
//
// set_thread_name names the calling thread (the kernel keeps 15 bytes; longer names are cut),
// so `top -H`, `ps -L`, perf and gdb show which pdsim thread is which. thread_cpu_times reads
// /proc/self/task/*/stat: user + system CPU seconds of every thread alive at the call, and
// /proc/self/task/*/schedstat: the seconds each spent runnable but waiting for a CPU (the
// scheduler's run-queue wait). Both are thread-safe; thread_cpu_times costs about 20 us per
// thread and is meant for reports, not loops.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace pdsim {

void set_thread_name(std::string_view name);

struct ThreadCpu {
    int tid = 0;
    std::string name;
    double cpu_s = 0;
    double wait_s = -1;  // run-queue wait; -1 where the kernel does not report it
};

[[nodiscard]] std::vector<ThreadCpu> thread_cpu_times();

// The calling thread's CPU time so far, microseconds (CLOCK_THREAD_CPUTIME_ID: time it waited for
// a core does not count); 0 off Linux or where the clock cannot be read.
[[nodiscard]] double this_thread_cpu_us();

// The calling thread's CPU time and involuntary context switches so far (CLOCK_THREAD_CPUTIME_ID,
// getrusage(RUSAGE_THREAD)): two of them bracket a piece of work, so that its wall time can be
// told apart from the time it was runnable but another thread held its core. About 1 us per call;
// zeros off Linux.
struct ThreadUsage {
    double cpu_us = 0;
    int64_t preemptions = 0;  // involuntary context switches (ru_nivcsw)
};
[[nodiscard]] ThreadUsage this_thread_usage();

// The CPU ids the calling thread may run on (sched_getaffinity), ascending: one id where mpirun
// bound the process to a core. Empty where it cannot be read (or off Linux).
[[nodiscard]] std::vector<int> allowed_cpus();

// Binds the calling thread to `cpus` (sched_setaffinity; threads it starts afterwards inherit
// it), as `mpirun --bind-to core` binds a rank's process. False when `cpus` is empty or the kernel
// refuses (an id it does not have); always false off Linux.
[[nodiscard]] bool bind_this_thread(const std::vector<int>& cpus);

// CPU seconds per thread name used between two snapshots (threads of one name are summed; a
// thread that is only in `after` counts from zero; one that exited before `after` is lost).
[[nodiscard]] std::map<std::string, double> cpu_by_name(const std::vector<ThreadCpu>& before,
                                                        const std::vector<ThreadCpu>& after);
// The same for the run-queue wait; threads whose wait is unknown (in either snapshot) are left
// out.
[[nodiscard]] std::map<std::string, double> wait_by_name(const std::vector<ThreadCpu>& before,
                                                         const std::vector<ThreadCpu>& after);

}  // namespace pdsim
