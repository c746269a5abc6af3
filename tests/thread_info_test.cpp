#include "common/thread_info.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace pdsim {
namespace {

void burn(std::chrono::milliseconds d) {
    const auto end = std::chrono::steady_clock::now() + d;
    volatile uint64_t x = 0;
    while (std::chrono::steady_clock::now() < end) x = x + 1;
}

TEST(ThreadInfo, NamedThreadAndItsCpuAreListed) {
#ifndef __linux__
    GTEST_SKIP() << "thread names and per-thread CPU come from /proc (Linux only)";
#endif
    std::atomic<bool> named{false}, go{false}, burned{false}, quit{false};
    std::thread t([&] {
        set_thread_name("pdsim-test-burner-long-name");  // cut to 15 bytes by the kernel
        named = true;
        while (!go) std::this_thread::yield();
        burn(std::chrono::milliseconds(150));
        burned = true;
        while (!quit) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    while (!named) std::this_thread::yield();
    const auto before = thread_cpu_times();
    go = true;
    while (!burned) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto after = thread_cpu_times();
    quit = true;
    t.join();

    int found = 0;
    for (const auto& x : after) found += x.name == "pdsim-test-burn" ? 1 : 0;
    EXPECT_EQ(found, 1) << "the named thread is listed once, its name cut to 15 bytes";
    const auto used = cpu_by_name(before, after);
    ASSERT_TRUE(used.count("pdsim-test-burn"));
    // 150 ms of spinning; clock ticks are 10 ms and a loaded machine may deschedule it.
    EXPECT_GE(used.at("pdsim-test-burn"), 0.05);
    EXPECT_LE(used.at("pdsim-test-burn"), 1.0);
    // The main thread mostly slept meanwhile.
    EXPECT_GE(after.size(), 2u);
}

// Two threads spinning on one core: each one's wall time holds the other's turns, which its own
// CPU time does not, and the kernel preempted each of them; a sleep costs no CPU.
TEST(ThreadInfo, ThisThreadUsageTellsOwnCpuFromAWaitForTheCore) {
#ifndef __linux__
    GTEST_SKIP() << "per-thread CPU time and preemptions are Linux-only here";
#endif
    const std::vector<int> cpus = allowed_cpus();
    ASSERT_FALSE(cpus.empty());
    struct Seen {
        double wall_us = 0;
        ThreadUsage used;
        bool bound = false;
    };
    std::atomic<int> ready{0};
    auto spin_on_one_core = [&](Seen* seen) {
        seen->bound = bind_this_thread({cpus.front()});
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        const ThreadUsage start = this_thread_usage();
        const auto t0 = std::chrono::steady_clock::now();
        burn(std::chrono::milliseconds(300));
        const ThreadUsage done = this_thread_usage();
        seen->wall_us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        seen->used = {done.cpu_us - start.cpu_us, done.preemptions - start.preemptions};
    };
    Seen a, b;
    std::thread ta(spin_on_one_core, &a), tb(spin_on_one_core, &b);
    ta.join();
    tb.join();
    ASSERT_TRUE(a.bound && b.bound);
    for (const Seen* s : {&a, &b}) {
        EXPECT_GT(s->used.preemptions, 0) << "two spinners on one core take turns";
        EXPECT_GT(s->used.cpu_us, 0.0);
        // Each had the core for part of its 300 ms at most: well under its wall time together.
        EXPECT_LT(s->used.cpu_us, 0.9 * s->wall_us);
    }
    const ThreadUsage before_sleep = this_thread_usage();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_LT(this_thread_usage().cpu_us - before_sleep.cpu_us, 20'000.0);
}

TEST(ThreadInfo, CpuByNameSumsThreadsOfOneNameAndCountsNewOnesFromZero) {
    const std::vector<ThreadCpu> before = {{1, "a", 1.0}, {2, "a", 2.0}, {3, "b", 5.0}};
    const std::vector<ThreadCpu> after = {{1, "a", 1.5}, {2, "a", 2.25}, {4, "c", 0.5}};
    const auto d = cpu_by_name(before, after);
    EXPECT_DOUBLE_EQ(d.at("a"), 0.75);
    EXPECT_DOUBLE_EQ(d.at("c"), 0.5);
    EXPECT_EQ(d.count("b"), 0u) << "a thread gone before the second snapshot is not listed";
}

TEST(ThreadInfo, WaitByNameLeavesOutThreadsWithAnUnknownWait) {
    const std::vector<ThreadCpu> before = {
        {1, "a", 1.0, 0.5}, {2, "a", 2.0, -1}, {3, "b", 5.0, 1.0}};
    const std::vector<ThreadCpu> after = {
        {1, "a", 1.5, 0.75}, {2, "a", 2.25, 0.1}, {4, "c", 0.5, 0.2}};
    const auto w = wait_by_name(before, after);
    EXPECT_DOUBLE_EQ(w.at("a"), 0.25) << "thread 2's wait was unknown at the start";
    EXPECT_DOUBLE_EQ(w.at("c"), 0.2);
    EXPECT_EQ(w.count("b"), 0u);
}

// Two threads pinned to one CPU, each spinning 150 ms: each waits while the other runs, so
// together they wait for a CPU about 150 ms (at least 50 ms here, for a coarse scheduler).
TEST(ThreadInfo, ThreadsSharingACpuWaitForIt) {
#ifndef __linux__
    GTEST_SKIP() << "run-queue wait comes from /proc (Linux only)";
#else
    if (thread_cpu_times().front().wait_s < 0) {
        GTEST_SKIP() << "this kernel has no /proc/self/task/*/schedstat";
    }
    const int cpu = sched_getcpu();
    ASSERT_GE(cpu, 0);
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    auto spinner = [&](const char* name) {
        set_thread_name(name);
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        ++ready;
        while (!go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        burn(std::chrono::milliseconds(150));
    };
    std::thread a(spinner, "pdsim-test-wa"), b(spinner, "pdsim-test-wb");
    while (ready < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto before = thread_cpu_times();
    go = true;
    // Snapshot while both are still alive (burn() is wall-clock: both end by ~300 ms at most).
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    const auto after = thread_cpu_times();
    a.join();
    b.join();
    const auto w = wait_by_name(before, after);
    ASSERT_TRUE(w.count("pdsim-test-wa") && w.count("pdsim-test-wb"));
    EXPECT_GE(w.at("pdsim-test-wa") + w.at("pdsim-test-wb"), 0.03)
        << "in 120 ms on one CPU two spinners wait about 60 ms together";
    EXPECT_LE(w.at("pdsim-test-wa") + w.at("pdsim-test-wb"), 0.5);
#endif
}

}  // namespace
}  // namespace pdsim
