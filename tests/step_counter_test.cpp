// StepCounter (backends/pd/step_counter.h) on CPU streams, its pure host logic (step_gate.h: the
// raw/wrapped rule and the gate decision), and the front end's use of a registered device
// implementation, driven here through a fake "cuda" stream and implementation. The CUDA
// implementation itself is tested in device_step_counter_test.cpp.
#include "backends/pd/step_counter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backends/pd/step_gate.h"
#include "backends/runtime/cpu_stream.h"
#include "tests/status_matchers.h"

namespace pdsim::pd {
namespace {

using namespace std::chrono_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kMax = StepCounter::kCountMax;
constexpr uint64_t kUMax = static_cast<uint64_t>(kMax);

// ---- The wrapped/raw rule (step_gate.h) ----

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

TEST(StepGate, WrapTakesTheResidue) {
    EXPECT_EQ(wrap_step(0), 0);
    EXPECT_EQ(wrap_step(kMax), 0);
    EXPECT_EQ(wrap_step(kMax + 3), 3);
    EXPECT_EQ(wrap_step(-1), kMax - 1);
    EXPECT_EQ(wrap_step(INT64_MIN), 0);
    EXPECT_EQ(wrap_step(INT64_MAX), kMax - 1);
    EXPECT_EQ(StepCounter::wrap(-kMax - 2), kMax - 2);
    EXPECT_EQ(wrap_raw(kUMax - 1), kMax - 1);
    EXPECT_EQ(wrap_raw(kUMax), 0);
    EXPECT_EQ(wrap_raw(3 * kUMax + 5), 5);
    EXPECT_EQ(wrap_raw(UINT64_MAX), kMax - 1);
}

TEST(StepGate, RawReachedIsACyclicGreaterOrEqual) {
    EXPECT_TRUE(raw_reached(5, 5));
    EXPECT_TRUE(raw_reached(6, 5));
    EXPECT_FALSE(raw_reached(4, 5));
    EXPECT_TRUE(raw_reached(kUMax + 1, kUMax - 1));  // raw values never wrap at 2^62
    EXPECT_FALSE(raw_reached(kUMax - 1, kUMax + 1));
    EXPECT_TRUE(raw_reached(1, UINT64_MAX));  // ... and compare cyclically at 2^64, as the device
}

TEST(StepGate, RawWaitTargetForTargetsBehindEqualAndAhead) {
    const uint64_t now = 100;
    EXPECT_EQ(raw_wait_target(99, now), now);  // behind: ready, nothing to wait for
    EXPECT_EQ(raw_wait_target(0, now), now);
    EXPECT_EQ(raw_wait_target(100, now), 101u);  // equal: the next record
    EXPECT_EQ(raw_wait_target(101, now), 102u);  // ahead
    EXPECT_EQ(raw_wait_target(105, now), 106u);
    // The farthest target still "ahead" is half the ring away; one more is "behind".
    EXPECT_EQ(raw_wait_target(100 + kMax / 2, now), now + kUMax / 2 + 1);
    EXPECT_EQ(raw_wait_target(100 + kMax / 2 + 1, now), now);
    // Only the residue of the target counts.
    EXPECT_EQ(raw_wait_target(105 + kMax, now), 106u);
    EXPECT_EQ(raw_wait_target(105 - kMax, now), 106u);
    EXPECT_EQ(raw_wait_target(INT64_MIN + 105, now), 106u);  // -2^63 is a multiple of 2^62
    EXPECT_EQ(raw_wait_target(99 + kMax, now), now);
}

TEST(StepGate, RawWaitTargetAcrossTheWrap) {
    // The raw counter just before 2^62 (wrapped MAX - 2).
    const uint64_t before = kUMax - 2;
    EXPECT_EQ(raw_wait_target(kMax - 2, before), kUMax - 1);
    EXPECT_EQ(raw_wait_target(kMax - 1, before), kUMax);      // shows wrapped step 0
    EXPECT_EQ(raw_wait_target(0, before), kUMax + 1);         // a target after the wrap
    EXPECT_EQ(raw_wait_target(kMax + 1, before), kUMax + 2);  // begin + l, unwrapped
    EXPECT_EQ(raw_wait_target(kMax - 3, before), before);     // behind
    // Just after the wrap (raw 2^62 + 1, wrapped 1): targets before the wrap are behind.
    const uint64_t after = kUMax + 1;
    EXPECT_EQ(raw_wait_target(kMax - 1, after), after);
    EXPECT_EQ(raw_wait_target(0, after), after);
    EXPECT_EQ(raw_wait_target(1, after), after + 1);
    EXPECT_EQ(raw_wait_target(kMax + 1, after), after + 1);
    EXPECT_EQ(raw_wait_target(4, after), after + 4);
    // Many wraps in: the raw value keeps growing, the residues still line up.
    const uint64_t far = 5 * kUMax + 7;
    EXPECT_EQ(raw_wait_target(7, far), far + 1);
    EXPECT_EQ(raw_wait_target(6, far), far);
}

// raw_reached(r, raw_wait_target(t, now)) == is_step_ready(wrap_raw(r), t) for a counter that
// moves on from `now` (by less than it takes for a "behind" target to look ahead again).
TEST(StepGate, RawWaitTargetAgreesWithIsStepReady) {
    const std::vector<uint64_t> nows = {
        0,         1,     7,         kUMax / 2,     kUMax - 3,
        kUMax - 1, kUMax, kUMax + 2, 3 * kUMax - 1, uint64_t{1} << 63};
    const std::vector<int64_t> offsets = {-5, -2, -1,           0,        1,
                                          2,  5,  kMax / 2 - 1, kMax / 2, -(kMax / 2 - 20)};
    for (uint64_t now : nows) {
        for (int64_t offset : offsets) {
            for (int64_t alias : {int64_t{0}, kMax, -kMax}) {
                const int64_t target = wrap_step(wrap_raw(now) + offset) + alias;
                const uint64_t target_raw = raw_wait_target(target, now);
                EXPECT_EQ(target_raw == now, is_step_ready(wrap_raw(now), target))
                    << "now " << now << " target " << target;
                if (target_raw != now) {
                    EXPECT_EQ(step_of_raw_target(target_raw), wrap_step(target));
                }
                for (uint64_t k = 0; k <= 8; ++k) {
                    EXPECT_EQ(raw_reached(now + k, target_raw),
                              is_step_ready(wrap_raw(now + k), target))
                        << "now " << now << " target " << target << " +" << k;
                }
            }
        }
    }
}

// ---- The gate decision (step_gate.h) ----

GateInputs inputs(uint64_t ready, uint64_t target, uint64_t enqueued) {
    GateInputs in;
    in.ready_raw = ready;
    in.target_raw = target;
    in.enqueued_raw = enqueued;
    in.ring_capacity = 4;
    return in;
}

TEST(StepGate, DecideReadyWhenTheCounterReachedTheTarget) {
    EXPECT_EQ(decide_gate(inputs(10, 10, 12)), GatePath::kReady);
    EXPECT_EQ(decide_gate(inputs(11, 10, 12)), GatePath::kReady);
    GateInputs after_capture = inputs(kUMax + 1, kUMax, 0);
    after_capture.exact = false;
    after_capture.same_stream = true;
    EXPECT_EQ(decide_gate(after_capture), GatePath::kReady);
}

TEST(StepGate, DecideEventForAnEnqueuedRecordStillInTheRing) {
    // Raw values straddling 2^62: no wrapped comparison anywhere.
    const uint64_t ready = kUMax - 2;
    EXPECT_EQ(decide_gate(inputs(ready, kUMax - 1, kUMax + 2)), GatePath::kEvent);  // 3 newer
    EXPECT_EQ(decide_gate(inputs(ready, kUMax + 2, kUMax + 2)), GatePath::kEvent);  // the last
    EXPECT_EQ(decide_gate(inputs(ready, kUMax + 1, kUMax + 2)), GatePath::kEvent);
}

TEST(StepGate, DecideValueWaitForARecordEvictedFromTheRing) {
    const uint64_t ready = kUMax - 2;
    EXPECT_EQ(decide_gate(inputs(ready, kUMax - 1, kUMax + 2)), GatePath::kEvent);      // 3 newer
    EXPECT_EQ(decide_gate(inputs(ready, kUMax - 1, kUMax + 3)), GatePath::kValueWait);  // 4 newer
    EXPECT_EQ(decide_gate(inputs(ready, kUMax - 1, kUMax + 300)), GatePath::kValueWait);
    GateInputs no_ring = inputs(ready, kUMax - 1, kUMax - 1);
    no_ring.ring_capacity = 0;  // the CPU implementation keeps no events
    EXPECT_EQ(decide_gate(no_ring), GatePath::kValueWait);
}

TEST(StepGate, DecideValueWaitForARecordNotEnqueuedYet) {
    EXPECT_EQ(decide_gate(inputs(10, 11, 10)), GatePath::kValueWait);
    EXPECT_EQ(decide_gate(inputs(10, 15, 12)), GatePath::kValueWait);
    EXPECT_EQ(decide_gate(inputs(kUMax - 1, kUMax + 1, kUMax)), GatePath::kValueWait);
}

TEST(StepGate, DecideValueWaitAfterACapture) {
    GateInputs in = inputs(10, 12, 14);  // enqueued and in the ring: an event, while exact
    EXPECT_EQ(decide_gate(in), GatePath::kEvent);
    in.exact = false;
    EXPECT_EQ(decide_gate(in), GatePath::kValueWait);
    in.target_raw = 20;  // not enqueued (as far as the host knows)
    EXPECT_EQ(decide_gate(in), GatePath::kValueWait);
}

TEST(StepGate, DecideOnTheCountersOwnStream) {
    GateInputs in = inputs(10, 12, 14);
    in.same_stream = true;
    EXPECT_EQ(decide_gate(in), GatePath::kStreamOrder);
    in.enqueued_raw = 100;  // evicted from the ring: stream order still holds
    EXPECT_EQ(decide_gate(in), GatePath::kStreamOrder);
    in.enqueued_raw = 11;  // not enqueued: nothing could ever satisfy it
    EXPECT_EQ(decide_gate(in), GatePath::kWouldDeadlock);
    in.exact = false;  // it may sit in a graph launched earlier on this stream
    EXPECT_EQ(decide_gate(in), GatePath::kValueWait);
}

TEST(StepGate, PathNames) {
    EXPECT_EQ(gate_path_name(GatePath::kReady), "ready");
    EXPECT_EQ(gate_path_name(GatePath::kStreamOrder), "stream_order");
    EXPECT_EQ(gate_path_name(GatePath::kEvent), "event");
    EXPECT_EQ(gate_path_name(GatePath::kValueWait), "value_wait");
    EXPECT_EQ(gate_path_name(GatePath::kWouldDeadlock), "would_deadlock");
}

// ---- The CPU counter ----

TEST(StepCounter, CreateOnACpuStream) {
    runtime::CpuStream s("compute");
    auto c = StepCounter::create(s, 7);
    ASSERT_OK(c);
    EXPECT_OK((*c)->status());
    EXPECT_EQ((*c)->query_ready_cache_step(), 7);
    EXPECT_EQ((*c)->current_step(), 7);
    EXPECT_EQ((*c)->records_published(), 0u);
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
        ASSERT_OK(c.record_cache());
        ASSERT_OK(s.synchronize());
        const int64_t ready = c.query_ready_cache_step();
        for (int m = 0; m < 4; ++m) {
            EXPECT_EQ(StepCounter::is_step_ready(ready, StepCounter::wrap(begin + m)), m <= l)
                << "after record " << l << " layer " << m << " ready " << ready;
        }
    }
    EXPECT_EQ(c.query_ready_cache_step(), 2);
    EXPECT_EQ(c.records_published(), 4u);
    // A wait across the wrap on a target passed unwrapped.
    EXPECT_OK(c.wait_until_ready(begin + 3, 1s));
}

TEST(StepCounter, RecordAfterASlowWriteIsNotVisibleBeforeTheWriteEnds) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    const int64_t begin = c.advance_step(1);
    std::atomic<bool> release{false};
    std::atomic<bool> write_done{false};
    ASSERT_TRUE(runtime::enqueue_void(s,
                                      [&] {  // the slow KV write
                                          while (!release.load()) std::this_thread::sleep_for(1ms);
                                          write_done.store(true, std::memory_order_relaxed);
                                      })
                    .ok());
    ASSERT_OK(c.record_cache());
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
    EXPECT_THAT(st.message(), HasSubstr("cache step 3 not ready after 30ms; last ready step 0"));
    EXPECT_GE(dt, 30ms);
    EXPECT_LT(dt, 5s);
    Status aux = c.wait_until_aux_ready(kMax + 2, 1ms);  // named wrapped
    EXPECT_THAT(aux.message(), HasSubstr("aux step 2 not ready"));
}

TEST(StepCounter, WaiterWakesOnRecordWithoutPolling) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    const int64_t begin = c.advance_step(3);
    std::atomic<bool> done{false};
    std::thread waiter([&] {
        EXPECT_OK(c.wait_until_ready(begin + 2, 10s));
        done = true;
    });
    for (int i = 0; i < 2; ++i) ASSERT_OK(c.record_cache());
    ASSERT_OK(s.synchronize());
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(done.load());  // layer 2 not recorded yet
    ASSERT_OK(c.record_cache());
    waiter.join();
    EXPECT_TRUE(done.load());
}

TEST(StepCounter, AuxCounterIsIndependent) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    EXPECT_EQ(c.advance_step(0, 1), 0);
    EXPECT_EQ(c.current_aux_step(), 1);
    ASSERT_OK(c.record_aux());
    ASSERT_OK(s.synchronize());
    EXPECT_EQ(c.query_ready_aux_step(), 1);
    EXPECT_EQ(c.query_ready_cache_step(), 0);
    EXPECT_OK(c.wait_until_aux_ready(0, 1s));
    EXPECT_EQ(c.records_published(), 1u);
}

TEST(StepCounter, CapturedRecordsCountOnEveryReplay) {
    runtime::CpuStream s("compute");
    StepCounter c(s, kMax - 3);
    ASSERT_OK(s.begin_capture());
    ASSERT_OK(c.record_cache());
    ASSERT_OK(c.record_cache());
    ASSERT_OK(c.record_aux());
    auto graph = s.end_capture();
    ASSERT_OK(graph);
    ASSERT_OK(s.synchronize());
    EXPECT_EQ(c.records_published(), 0u);  // captured, not run
    for (int replay = 1; replay <= 3; ++replay) {
        ASSERT_OK((*graph)->launch(s));
        ASSERT_OK(s.synchronize());
        EXPECT_EQ(c.query_ready_cache_step(), wrap_step(kMax - 3 + 2 * replay)) << replay;
        EXPECT_EQ(c.query_ready_aux_step(), wrap_step(kMax - 3 + replay)) << replay;
        EXPECT_EQ(c.records_published(), static_cast<uint64_t>(3 * replay));
    }
    EXPECT_EQ(c.query_ready_cache_step(), 3);  // wrapped
}

// ---- gate() on CPU streams ----

// A slow "KV write" on `s`: a task that blocks until `release`, then writes `value`.
void enqueue_slow_write(runtime::Stream& s, std::atomic<bool>& release, int& data, int value) {
    ASSERT_TRUE(runtime::enqueue_void(s, [&release, &data, value] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                    data = value;  // plain: the gate must make it visible to the reader
                }).ok());
}

class CpuGate : public ::testing::TestWithParam<bool> {};  // record enqueued before the gate?

TEST_P(CpuGate, GatedTaskSeesTheFinalData) {
    const bool record_first = GetParam();
    runtime::CpuStream s("compute");
    runtime::CpuStream other("other");
    StepCounter c(s);
    const int64_t begin = c.advance_step(1);
    int data = -1;  // poison
    std::atomic<bool> release{false};
    enqueue_slow_write(s, release, data, 42);
    if (record_first) {
        ASSERT_OK(c.record_cache());
    }
    auto path = c.gate(other, begin, 10s);
    ASSERT_OK(path);
    EXPECT_EQ(*path, GatePath::kValueWait);  // CPU: no event ring
    int seen = -2;
    std::atomic<bool> read{false};
    ASSERT_TRUE(runtime::enqueue_void(other, [&] {
                    seen = data;
                    read = true;
                }).ok());
    if (!record_first) {
        ASSERT_OK(c.record_cache());
    }
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(read.load()) << "the gated task ran before the record";
    release = true;
    ASSERT_OK(other.synchronize(10s));
    EXPECT_TRUE(read.load());
    EXPECT_EQ(seen, 42);
}

INSTANTIATE_TEST_SUITE_P(RecordBeforeOrAfter, CpuGate, ::testing::Bool());

// is_step_enqueued: enqueued (not yet run) vs ready vs neither, across the wrap, and never after a
// capture made the host's bookkeeping inexact.
TEST(StepCounter, IsStepEnqueuedTracksEagerRecordsNotTheirCompletion) {
    runtime::CpuStream s("compute");
    StepCounter c(s, kMax - 2);
    const int64_t begin = c.advance_step(3);  // steps kMax-2, kMax-1, 0 (wrapped)
    EXPECT_FALSE(c.is_step_enqueued(begin));
    std::atomic<bool> release{false};
    int data = 0;
    enqueue_slow_write(s, release, data, 1);  // holds the stream: records below do not run yet
    ASSERT_OK(c.record_cache());
    ASSERT_OK(c.record_cache());
    EXPECT_FALSE(StepCounter::is_step_ready(c.query_ready_cache_step(), begin));
    EXPECT_TRUE(c.is_step_enqueued(begin));
    EXPECT_TRUE(c.is_step_enqueued(wrap_step(begin + 1)));
    EXPECT_FALSE(c.is_step_enqueued(wrap_step(begin + 2)));  // across the wrap: step 0
    ASSERT_OK(c.record_cache());
    EXPECT_TRUE(c.is_step_enqueued(wrap_step(begin + 2)));
    EXPECT_FALSE(c.is_step_enqueued(wrap_step(begin + 3)));
    // wait_until_enqueued: at once for an enqueued step, false at its timeout for a step no
    // record was enqueued for, and woken by the record that enqueues it.
    EXPECT_TRUE(c.wait_until_enqueued(wrap_step(begin + 2), 0ms));
    EXPECT_FALSE(c.wait_until_enqueued(wrap_step(begin + 3), 20ms));
    std::thread recorder([&] {
        std::this_thread::sleep_for(20ms);
        EXPECT_OK(c.record_cache());
    });
    EXPECT_TRUE(c.wait_until_enqueued(wrap_step(begin + 3), 10s));
    recorder.join();
    EXPECT_FALSE(StepCounter::is_step_ready(c.query_ready_cache_step(), wrap_step(begin + 3)));
    release = true;
    ASSERT_OK(s.synchronize(10s));
    EXPECT_TRUE(c.is_step_enqueued(wrap_step(begin + 2)));  // ready now
    EXPECT_FALSE(c.is_step_enqueued(wrap_step(begin + 4)));

    // A captured record: the host no longer knows what an eager record publishes.
    ASSERT_OK(s.begin_capture());
    ASSERT_OK(c.record_cache());
    auto graph = s.end_capture();
    ASSERT_OK(graph);
    std::atomic<bool> release_again{false};
    enqueue_slow_write(s, release_again, data, 2);  // the eager record below waits behind it
    ASSERT_OK(c.record_cache());                    // eager, but the bookkeeping is inexact now
    EXPECT_FALSE(c.is_step_enqueued(wrap_step(begin + 4)));
    release_again = true;
    ASSERT_OK(s.synchronize(10s));
    EXPECT_TRUE(c.is_step_enqueued(wrap_step(begin + 4)));  // ready: true again
}

TEST(StepCounter, CpuGateTimesOutWithTheTargetAndTheLastReadyStep) {
    runtime::CpuStream s("compute");
    runtime::CpuStream other("other");
    StepCounter c(s);
    auto path = c.gate(other, 5, 30ms);
    ASSERT_OK(path);
    EXPECT_EQ(*path, GatePath::kValueWait);
    bool ran = false;
    ASSERT_OK(runtime::enqueue_void(other, [&] { ran = true; }));
    Status st = other.synchronize(10s);
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
    EXPECT_THAT(st.message(), HasSubstr("gate on stream other"));
    EXPECT_THAT(st.message(), HasSubstr("cache step 5 not ready after 30ms; last ready step 0"));
    EXPECT_FALSE(ran);  // the failed gate poisons the stream: later work is skipped
}

TEST(StepCounter, CpuGateOnAReadyStepEnqueuesNothing) {
    runtime::CpuStream s("compute");
    runtime::CpuStream other("other");
    StepCounter c(s, kMax - 1);
    const int64_t begin = c.advance_step(1);
    ASSERT_OK(c.record_cache());
    ASSERT_OK(s.synchronize());
    std::atomic<bool> release{false};
    ASSERT_TRUE(runtime::enqueue_void(other, [&] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    auto path = c.gate(other, begin);
    ASSERT_OK(path);
    EXPECT_EQ(*path, GatePath::kReady);
    release = true;
    EXPECT_OK(other.synchronize(10s));
}

TEST(StepCounter, CpuGateAuxWaitsForTheAuxCounter) {
    runtime::CpuStream s("compute");
    runtime::CpuStream other("other");
    StepCounter c(s);
    c.advance_step(1, 1);
    ASSERT_OK(c.record_cache());  // the cache counter moving does not open an aux gate
    ASSERT_OK(s.synchronize());
    auto path = c.gate_aux(other, 0, 10s);
    ASSERT_OK(path);
    EXPECT_EQ(*path, GatePath::kValueWait);
    std::atomic<bool> read{false};
    ASSERT_OK(runtime::enqueue_void(other, [&] { read = true; }));
    std::this_thread::sleep_for(30ms);
    EXPECT_FALSE(read.load());
    ASSERT_OK(c.record_aux());
    ASSERT_OK(other.synchronize(10s));
    EXPECT_TRUE(read.load());
}

TEST(StepCounter, CpuGateOnItsOwnStream) {
    runtime::CpuStream s("compute");
    StepCounter c(s);
    const int64_t begin = c.advance_step(2);
    std::atomic<bool> release{false};
    ASSERT_TRUE(runtime::enqueue_void(s, [&] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    ASSERT_OK(c.record_cache());
    auto ordered = c.gate(s, begin);
    ASSERT_OK(ordered);
    EXPECT_EQ(*ordered, GatePath::kStreamOrder);
    auto refused = c.gate(s, begin + 1);
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("own stream"));
    EXPECT_THAT(refused.status().message(), HasSubstr("cache step 1"));
    release = true;
    EXPECT_OK(s.synchronize());
}

// A Stream that runs on a CpuStream but reports a CUDA device: lets the front end's dispatch by
// device kind be tested without a GPU.
class FakeDeviceStream final : public runtime::Stream {
public:
    explicit FakeDeviceStream(std::string name) : inner_(name), name_(std::move(name)) {}
    [[nodiscard]] runtime::Device device() const override {
        return {runtime::DeviceKind::kCuda, 0};
    }
    [[nodiscard]] std::string name() const override { return name_; }
    [[nodiscard]] Status enqueue(runtime::Task task) override {
        return inner_.enqueue(std::move(task));
    }
    [[nodiscard]] std::unique_ptr<runtime::Event> create_event() override {
        return inner_.create_event();
    }
    [[nodiscard]] Status record(runtime::Event& event) override { return inner_.record(event); }
    [[nodiscard]] Status wait(runtime::Event& event) override { return inner_.wait(event); }
    [[nodiscard]] Status synchronize(
        std::chrono::milliseconds timeout = runtime::kDefaultWaitTimeout) override {
        return inner_.synchronize(timeout);
    }
    [[nodiscard]] Status error() const override { return inner_.error(); }
    [[nodiscard]] Status begin_capture() override { return inner_.begin_capture(); }
    [[nodiscard]] StatusOr<std::unique_ptr<runtime::Graph>> end_capture() override {
        return inner_.end_capture();
    }
    [[nodiscard]] bool is_capturing() const override { return inner_.is_capturing(); }
    runtime::CpuStream& inner() { return inner_; }

private:
    runtime::CpuStream inner_;
    std::string name_;
};

// Installs a StepCounter implementation for a device kind for one test, then restores the old one.
class ScopedImpl {
public:
    ScopedImpl(runtime::DeviceKind kind, StepCounterImplFactory factory)
        : kind_(kind), previous_(register_step_counter_impl(kind, std::move(factory))) {}
    ~ScopedImpl() { register_step_counter_impl(kind_, std::move(previous_)); }
    ScopedImpl(const ScopedImpl&) = delete;
    ScopedImpl& operator=(const ScopedImpl&) = delete;

private:
    runtime::DeviceKind kind_;
    StepCounterImplFactory previous_;
};

TEST(StepCounter, AStreamKindWithoutAnImplementationIsUnavailable) {
    ScopedImpl none(runtime::DeviceKind::kCuda, nullptr);
    FakeDeviceStream s("fake-cuda");
    auto created = StepCounter::create(s, 4);
    EXPECT_EQ(created.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(created.status().message(),
                HasSubstr("no StepCounter implementation for cuda streams"));
    EXPECT_THAT(created.status().message(), HasSubstr("StepCounter on stream fake-cuda"));
    // The constructor holds the error and returns it from every fallible call.
    StepCounter c(s, 4);
    EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(c.record_cache().code(), StatusCode::kUnavailable);
    EXPECT_EQ(c.wait_until_ready(4, 1ms).code(), StatusCode::kUnavailable);
    EXPECT_EQ(c.gate(s, 4).status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(c.query_ready_cache_step(), 4);
    EXPECT_EQ(c.records_published(), 0u);
}

// A device implementation that keeps a 4-event "ring" and logs what the front end asks of it.
struct FakeLog {
    std::mutex mu;
    std::vector<std::optional<uint64_t>> eager;  // record(): eager_raw per call
    std::vector<std::pair<GatePath, uint64_t>> gates;
    bool fail_next_record = false;
};

class FakeImpl final : public StepCounterImpl {
public:
    FakeImpl(runtime::Stream& s, uint64_t initial, FakeLog* log) : s_(s), log_(log) {
        for (auto& m : mirror_) m.store(initial);
    }
    [[nodiscard]] Status record(CounterId id, std::optional<uint64_t> eager_raw) override {
        {
            std::lock_guard<std::mutex> lock(log_->mu);
            log_->eager.push_back(eager_raw);
            if (log_->fail_next_record) {
                log_->fail_next_record = false;
                return Status(StatusCode::kUnavailable, "injected record failure");
            }
        }
        auto* m = &mirror_[static_cast<size_t>(id)];
        return s_.enqueue([m] {
            m->fetch_add(1, std::memory_order_acq_rel);
            return Status();
        });
    }
    [[nodiscard]] uint64_t ready_raw(CounterId id) const override {
        return mirror_[static_cast<size_t>(id)].load(std::memory_order_acquire);
    }
    [[nodiscard]] bool wait_raw(CounterId id, uint64_t target,
                                std::chrono::steady_clock::time_point deadline) const override {
        while (!raw_reached(ready_raw(id), target)) {
            if (std::chrono::steady_clock::now() >= deadline) return false;
            std::this_thread::sleep_for(100us);
        }
        return true;
    }
    [[nodiscard]] size_t event_ring_capacity() const override { return 4; }
    [[nodiscard]] Status gate_on_event(runtime::Stream&, CounterId, uint64_t raw) override {
        std::lock_guard<std::mutex> lock(log_->mu);
        log_->gates.emplace_back(GatePath::kEvent, raw);
        return {};
    }
    [[nodiscard]] Status gate_on_value(runtime::Stream&, CounterId, uint64_t target_raw,
                                       std::chrono::nanoseconds) override {
        std::lock_guard<std::mutex> lock(log_->mu);
        log_->gates.emplace_back(GatePath::kValueWait, target_raw);
        return {};
    }

private:
    runtime::Stream& s_;
    FakeLog* log_;
    std::array<std::atomic<uint64_t>, kNumCounters> mirror_{};
};

TEST(StepCounter, FrontEndDrivesTheRegisteredImplementationPerCall) {
    FakeLog log;
    ScopedImpl fake(
        runtime::DeviceKind::kCuda,
        [&log](runtime::Stream& s, uint64_t initial) -> StatusOr<std::unique_ptr<StepCounterImpl>> {
            return std::unique_ptr<StepCounterImpl>(std::make_unique<FakeImpl>(s, initial, &log));
        });
    FakeDeviceStream s("compute");
    FakeDeviceStream other("other");
    runtime::CpuStream cpu("cpu");
    auto created = StepCounter::create(s, kMax - 3);
    ASSERT_OK(created);
    StepCounter& c = **created;
    const int64_t begin = c.advance_step(8);  // raw of layer l's record: 2^62 - 3 + l + 1
    std::atomic<bool> release{false};
    ASSERT_TRUE(runtime::enqueue_void(s, [&] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    for (int l = 0; l < 6; ++l) ASSERT_OK(c.record_cache());
    EXPECT_THAT(log.eager,
                ElementsAre(kUMax - 2, kUMax - 1, kUMax, kUMax + 1, kUMax + 2, kUMax + 3));

    auto expect_gate = [&](runtime::Stream& on, int64_t step, GatePath want, uint64_t raw) {
        const size_t logged = log.gates.size();
        auto path = c.gate(on, step);
        ASSERT_OK(path);
        EXPECT_EQ(*path, want) << "step " << step;
        if (want == GatePath::kEvent || want == GatePath::kValueWait) {
            ASSERT_EQ(log.gates.size(), logged + 1) << "step " << step;
            EXPECT_EQ(log.gates.back(), std::make_pair(want, raw)) << "step " << step;
        } else {
            EXPECT_EQ(log.gates.size(), logged) << "step " << step;
        }
    };
    expect_gate(other, begin + 5, GatePath::kEvent, kUMax + 3);      // the latest record
    expect_gate(other, begin + 2, GatePath::kEvent, kUMax);          // 3 newer: still in the ring
    expect_gate(other, begin + 1, GatePath::kValueWait, kUMax - 1);  // 4 newer: evicted
    expect_gate(other, begin + 6, GatePath::kValueWait, kUMax + 4);  // not enqueued yet
    expect_gate(s, begin + 3, GatePath::kStreamOrder, 0);
    EXPECT_EQ(c.gate(s, begin + 6).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(c.gate(cpu, begin).status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(c.gate(cpu, begin).status().message(), HasSubstr("stream cpu is on cpu:0"));

    release = true;
    ASSERT_OK(s.synchronize());
    EXPECT_EQ(c.query_ready_cache_step(), 3);  // 2^62 + 3, wrapped
    EXPECT_EQ(c.records_published(), 6u);
    expect_gate(other, begin + 5, GatePath::kReady, 0);

    // A record captured into a graph: from then on eager records carry no raw value and gates wait
    // on the counter's value, even for records the host enqueued itself.
    ASSERT_OK(s.begin_capture());
    ASSERT_OK(c.record_cache());
    auto graph = s.end_capture();
    ASSERT_OK(graph);
    ASSERT_OK((*graph)->launch(s.inner()));
    release = false;
    ASSERT_TRUE(runtime::enqueue_void(s, [&] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    ASSERT_OK(c.record_cache());
    EXPECT_EQ(log.eager.size(), 8u);
    EXPECT_EQ(log.eager[6], std::nullopt);
    EXPECT_EQ(log.eager[7], std::nullopt);
    expect_gate(other, begin + 7, GatePath::kValueWait, kUMax + 5);
    expect_gate(s, begin + 7, GatePath::kValueWait, kUMax + 5);  // no longer provably a deadlock
    release = true;
    ASSERT_OK(s.synchronize());
    EXPECT_EQ(c.records_published(), 8u);
}

TEST(StepCounter, AFailedRecordEndsTheEventPath) {
    FakeLog log;
    ScopedImpl fake(
        runtime::DeviceKind::kCuda,
        [&log](runtime::Stream& s, uint64_t initial) -> StatusOr<std::unique_ptr<StepCounterImpl>> {
            return std::unique_ptr<StepCounterImpl>(std::make_unique<FakeImpl>(s, initial, &log));
        });
    FakeDeviceStream s("compute");
    FakeDeviceStream other("other");
    StepCounter c(s);
    ASSERT_OK(c.status());
    const int64_t begin = c.advance_step(3);
    std::atomic<bool> release{false};
    ASSERT_TRUE(runtime::enqueue_void(s, [&] {
                    while (!release.load()) std::this_thread::sleep_for(1ms);
                }).ok());
    ASSERT_OK(c.record_cache());
    auto event = c.gate(other, begin);
    ASSERT_OK(event);
    EXPECT_EQ(*event, GatePath::kEvent);
    log.fail_next_record = true;
    EXPECT_EQ(c.record_cache().code(), StatusCode::kUnavailable);
    ASSERT_OK(c.record_cache());
    EXPECT_THAT(log.eager,
                ElementsAre(std::optional<uint64_t>(1), std::optional<uint64_t>(2), std::nullopt));
    auto value = c.gate(other, begin);  // enqueued, in the ring, but no longer exact
    ASSERT_OK(value);
    EXPECT_EQ(*value, GatePath::kValueWait);
    release = true;
    ASSERT_OK(s.synchronize());
}

}  // namespace
}  // namespace pdsim::pd
