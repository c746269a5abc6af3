#include "backends/pd/step_counter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "backends/runtime/cpu_stream.h"

namespace pdsim::pd {
namespace {

using namespace std::chrono_literals;
constexpr int64_t kMax = StepCounter::kCountMax;

TEST(StepCounter, IsStepReadyIsStrict) {
    EXPECT_FALSE(StepCounter::is_step_ready(5, 5));  // equal: not ready (strict)
    EXPECT_TRUE(StepCounter::is_step_ready(6, 5));   // ready has moved past target
    EXPECT_FALSE(StepCounter::is_step_ready(5, 6));  // target is ahead
    EXPECT_TRUE(StepCounter::is_step_ready(1, 0));
    EXPECT_FALSE(StepCounter::is_step_ready(0, 0));
}

TEST(StepCounter, IsStepReadyIsWrapSafe) {
    // ready wrapped past 0, target just before the wrap: ready.
    EXPECT_TRUE(StepCounter::is_step_ready(2, kMax - 1));
    EXPECT_TRUE(StepCounter::is_step_ready(0, kMax - 1));
    // target wrapped past 0, ready just before the wrap: not ready.
    EXPECT_FALSE(StepCounter::is_step_ready(kMax - 1, 0));
    EXPECT_FALSE(StepCounter::is_step_ready(kMax - 2, 1));
    // Targets computed as begin + l without wrapping (begin near MAX) compare as their residue;
    // no operand combination overflows (UBSan checks this in CI).
    EXPECT_TRUE(StepCounter::is_step_ready(1, kMax));
    EXPECT_TRUE(StepCounter::is_step_ready(2, kMax + 1));
    EXPECT_FALSE(StepCounter::is_step_ready(1, kMax + 1));
    EXPECT_FALSE(StepCounter::is_step_ready(0, kMax + 1));
    EXPECT_FALSE(StepCounter::is_step_ready(kMax - 1, INT64_MAX));
    EXPECT_TRUE(StepCounter::is_step_ready(INT64_MIN, INT64_MAX));  // residues 0 and MAX - 1
    // Half the ring is the boundary: ready may lead target by less than MAX/2.
    EXPECT_TRUE(StepCounter::is_step_ready(kMax / 2 - 1, 0));
    EXPECT_FALSE(StepCounter::is_step_ready(kMax / 2, 0));
    EXPECT_FALSE(StepCounter::is_step_ready(kMax / 2 + 1, 0));
}

TEST(StepCounter, RecordPublishesInStreamOrderAcrossTheWrap) {
    runtime::CpuStream s("compute");
    StepCounter c(s, kMax - 2);
    EXPECT_EQ(c.current_step(), kMax - 2);
    int64_t begin = c.advance_step(4);
    EXPECT_EQ(begin, kMax - 2);
    EXPECT_EQ(c.current_step(), 2);  // wrapped
    for (int l = 0; l < 4; ++l) {
        EXPECT_FALSE(StepCounter::is_step_ready(c.query_ready_cache_step(), begin + l));
    }
    for (int l = 0; l < 4; ++l) {
        ASSERT_TRUE(c.record_cache().ok());
        ASSERT_TRUE(s.synchronize().ok());
        const int64_t ready = c.query_ready_cache_step();
        for (int m = 0; m < 4; ++m) {
            EXPECT_EQ(StepCounter::is_step_ready(ready, StepCounter::wrap(begin + m)), m <= l)
                << "after record " << l << " layer " << m << " ready " << ready;
        }
    }
    EXPECT_EQ(c.query_ready_cache_step(), 2);
}

TEST(StepCounter, RecordAfterASlowWriteIsNotVisibleBeforeTheWriteEnds) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    const int64_t begin = c.advance_step(1);
    std::atomic<bool> release{false};
    std::atomic<bool> write_done{false};
    ASSERT_TRUE(runtime::enqueue_void(s, [&] {  // the slow KV write
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                    write_done.store(true, std::memory_order_relaxed);
                }).ok());
    ASSERT_TRUE(c.record_cache().ok());
    // An observer that sees the step must also see the write.
    std::atomic<bool> observed_ok{false};
    std::thread observer([&] {
        Status st = c.wait_until_ready(begin, 10s);
        observed_ok = st.ok() && write_done.load(std::memory_order_relaxed);
    });
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(StepCounter::is_step_ready(c.query_ready_cache_step(), begin));
    EXPECT_EQ(c.records_published(), 0u);
    release = true;
    observer.join();
    EXPECT_TRUE(observed_ok.load());
    EXPECT_TRUE(StepCounter::is_step_ready(c.query_ready_cache_step(), begin));
}

TEST(StepCounter, WaitTimesOutWithTargetInMessage) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    auto t0 = std::chrono::steady_clock::now();
    Status st = c.wait_until_ready(3, 30ms);
    auto dt = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(st.message().find("step 3"), std::string::npos) << st.message();
    EXPECT_GE(dt, 30ms);
    EXPECT_LT(dt, 5s);
}

TEST(StepCounter, WaiterWakesOnRecordWithoutPolling) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    const int64_t begin = c.advance_step(3);
    std::atomic<bool> done{false};
    std::thread waiter([&] {
        EXPECT_TRUE(c.wait_until_ready(begin + 2, 10s).ok());
        done = true;
    });
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(c.record_cache().ok());
    ASSERT_TRUE(s.synchronize().ok());
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(done.load());  // layer 2 not recorded yet
    ASSERT_TRUE(c.record_cache().ok());
    waiter.join();
    EXPECT_TRUE(done.load());
}

TEST(StepCounter, AuxCounterIsIndependent) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    EXPECT_EQ(c.advance_step(0, 1), 0);
    EXPECT_EQ(c.current_aux_step(), 1);
    ASSERT_TRUE(c.record_aux().ok());
    ASSERT_TRUE(s.synchronize().ok());
    EXPECT_EQ(c.query_ready_aux_step(), 1);
    EXPECT_EQ(c.query_ready_cache_step(), 0);
    EXPECT_TRUE(c.wait_until_aux_ready(0, 1s).ok());
}

}  // namespace
}  // namespace pdsim::pd
