#include "common/thread_info.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace pdsim {

void set_thread_name(std::string_view name) {
#ifdef __linux__
    char buf[16];
    const size_t n = std::min(name.size(), sizeof(buf) - 1);
    std::memcpy(buf, name.data(), n);
    buf[n] = '\0';
    pthread_setname_np(pthread_self(), buf);
#else
    (void)name;
#endif
}

std::vector<ThreadCpu> thread_cpu_times() {
    std::vector<ThreadCpu> out;
#ifdef __linux__
    DIR* dir = opendir("/proc/self/task");
    if (dir == nullptr) return out;
    const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
    while (const dirent* e = readdir(dir)) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300];
        std::snprintf(path, sizeof(path), "/proc/self/task/%s/stat", e->d_name);
        FILE* f = std::fopen(path, "r");
        if (f == nullptr) continue;  // the thread exited meanwhile
        char line[1024];
        const size_t len = std::fread(line, 1, sizeof(line) - 1, f);
        std::fclose(f);
        line[len] = '\0';
        // "tid (comm) state ppid ..." - comm may hold spaces and ')', so split at the last ')'.
        char* open = std::strchr(line, '(');
        char* close = std::strrchr(line, ')');
        if (open == nullptr || close == nullptr || close < open) continue;
        ThreadCpu t;
        t.tid = std::atoi(line);
        t.name.assign(open + 1, close);
        // Fields after ')': 3 state, 4 ppid, ... 14 utime, 15 stime (1-based over the whole line).
        char* p = close + 1;
        unsigned long long utime = 0, stime = 0;
        if (std::sscanf(p, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
                        &stime) != 2) {
            continue;
        }
        t.cpu_s = static_cast<double>(utime + stime) / tick;
        // schedstat: "<ns on a CPU> <ns runnable, waiting for one> <timeslices>".
        std::snprintf(path, sizeof(path), "/proc/self/task/%s/schedstat", e->d_name);
        if (FILE* s = std::fopen(path, "r")) {
            unsigned long long on_cpu_ns = 0, wait_ns = 0;
            if (std::fscanf(s, "%llu %llu", &on_cpu_ns, &wait_ns) == 2) {
                t.wait_s = static_cast<double>(wait_ns) * 1e-9;
            }
            std::fclose(s);
        }
        out.push_back(std::move(t));
    }
    closedir(dir);
#endif
    return out;
}

namespace {

// `field` used per thread name between two snapshots. A thread only in `after` counts from zero;
// a value below zero (unknown) in either snapshot leaves that thread out.
std::map<std::string, double> delta_by_name(const std::vector<ThreadCpu>& before,
                                            const std::vector<ThreadCpu>& after,
                                            double ThreadCpu::*field) {
    std::unordered_map<int, double> base;
    for (const auto& t : before) base[t.tid] = t.*field;
    std::map<std::string, double> out;
    for (const auto& t : after) {
        auto it = base.find(t.tid);
        const double start = it == base.end() ? 0.0 : it->second;
        if (t.*field < 0 || start < 0) continue;
        out[t.name] += t.*field - start;
    }
    return out;
}

}  // namespace

std::map<std::string, double> cpu_by_name(const std::vector<ThreadCpu>& before,
                                          const std::vector<ThreadCpu>& after) {
    return delta_by_name(before, after, &ThreadCpu::cpu_s);  // never below zero
}

std::map<std::string, double> wait_by_name(const std::vector<ThreadCpu>& before,
                                           const std::vector<ThreadCpu>& after) {
    return delta_by_name(before, after, &ThreadCpu::wait_s);
}

double this_thread_cpu_us() {
#ifdef __linux__
    timespec ts{};
    if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
        return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
    }
#endif
    return 0;
}

ThreadUsage this_thread_usage() {
    ThreadUsage u;
    u.cpu_us = this_thread_cpu_us();
#ifdef __linux__
    rusage r{};
    if (::getrusage(RUSAGE_THREAD, &r) == 0) u.preemptions = r.ru_nivcsw;
#endif
    return u;
}

std::vector<int> allowed_cpus() {
    std::vector<int> out;
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (CPU_ISSET(cpu, &set)) out.push_back(cpu);
    }
#endif
    return out;
}

bool bind_this_thread(const std::vector<int>& cpus) {
#ifdef __linux__
    if (cpus.empty()) return false;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) {
        if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
        CPU_SET(cpu, &set);
    }
    return sched_setaffinity(0, sizeof(set), &set) == 0;
#else
    (void)cpus;
    return false;
#endif
}

}  // namespace pdsim
