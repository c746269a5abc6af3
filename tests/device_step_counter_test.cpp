// The CUDA StepCounter (backends/cuda/device_step_counter.h): a gated copy on another stream sees
// the data a slow kernel wrote before the record, through both gate paths (event, wait-value);
// host waiters see every step in order across the 2^62 wrap; records captured into a CUDA graph
// count on every replay; timeouts name the target. Skips with the CUDA runtime's reason where
// there is no GPU; never passes silently there.
#include "backends/cuda/device_step_counter.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_stream.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "tests/device_step_counter_test_kernels.h"

namespace pdsim::pd {
namespace {

using namespace std::chrono_literals;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr int64_t kMax = StepCounter::kCountMax;
constexpr size_t kWords = size_t{1} << 20;  // 4 MiB of "KV"
constexpr uint32_t kOld = 0x11111111u;
constexpr uint32_t kFinal = 0x5EED0042u;
constexpr uint32_t kPoison = 0xEEEEEEEEu;
constexpr uint64_t kKernelBackstopNs = 20'000'000'000;  // 20 s

// These need no GPU: the factory refuses a non-CUDA stream before touching CUDA.
TEST(DeviceStepCounter, RefusesANonCudaStream) {
    runtime::CpuStream s("cpu");
    auto impl = cuda::make_device_step_counter_impl(s, 0);
    EXPECT_EQ(impl.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(impl.status().message(), HasSubstr("not a CUDA stream"));
}

TEST(DeviceStepCounter, ValueWaitSupportIsOkOrUnavailableWithAReason) {
    Status st = cuda::device_value_wait_support(0);
    if (st.ok()) return;
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    EXPECT_THAT(st.message(), AnyOf(HasSubstr("stream memory operations"),
                                    HasSubstr("does not export"), HasSubstr("failed")));
}

// A flag in pinned, mapped host memory that a kernel polls.
class HostFlag {
public:
    HostFlag() {
        if (cudaHostAlloc(reinterpret_cast<void**>(&host_), 64, cudaHostAllocMapped) !=
            cudaSuccess) {
            host_ = nullptr;
            return;
        }
        *host_ = 0;
        if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0) != cudaSuccess) {
            device_ = nullptr;
        }
    }
    ~HostFlag() {
        if (host_ != nullptr) cudaFreeHost(host_);
    }
    HostFlag(const HostFlag&) = delete;
    HostFlag& operator=(const HostFlag&) = delete;
    [[nodiscard]] bool ok() const { return host_ != nullptr && device_ != nullptr; }
    [[nodiscard]] const uint32_t* device() const { return device_; }
    void set() { std::atomic_ref<uint32_t>(*host_).store(1, std::memory_order_release); }

private:
    uint32_t* host_ = nullptr;
    uint32_t* device_ = nullptr;
};

// Releases the flag when the test leaves, so a failed assertion never leaves a kernel spinning
// under a stream or counter destructor.
class ReleaseOnExit {
public:
    explicit ReleaseOnExit(HostFlag& flag) : flag_(flag) {}
    ~ReleaseOnExit() {
        if (flag_.ok()) flag_.set();
    }
    ReleaseOnExit(const ReleaseOnExit&) = delete;
    ReleaseOnExit& operator=(const ReleaseOnExit&) = delete;

private:
    HostFlag& flag_;
};

class DeviceStepCounterTest : public ::testing::Test {
protected:
    void SetUp() override {
        auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
        if (!rt.ok()) GTEST_SKIP() << "built without CUDA: " << rt.status().to_string();
        if ((*rt)->device_count() == 0) GTEST_SKIP() << (*rt)->unavailable_reason();
        auto compute = (*rt)->create_stream(0, "compute");
        auto other = (*rt)->create_stream(0, "other");
        ASSERT_TRUE(compute.ok()) << compute.status().to_string();
        ASSERT_TRUE(other.ok()) << other.status().to_string();
        compute_ = std::move(*compute);
        other_ = std::move(*other);
        auto ch = runtime::cuda::native_stream(*compute_);
        auto oh = runtime::cuda::native_stream(*other_);
        ASSERT_TRUE(ch.ok() && oh.ok());
        compute_handle_ = *ch;
        other_handle_ = *oh;
        value_wait_ = cuda::device_value_wait_support(0);
    }

    std::unique_ptr<StepCounter> make_counter(int64_t initial) {
        auto c = StepCounter::create(*compute_, initial);
        EXPECT_TRUE(c.ok()) << c.status().to_string();
        return c.ok() ? std::move(*c) : nullptr;
    }

    // The "KV" (old contents) and the gated copy's destination (poisoned).
    void make_buffers() {
        auto d = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, kWords * 4);
        auto r = runtime::DeviceBuffer::allocate({runtime::DeviceKind::kCuda, 0}, kWords * 4);
        ASSERT_TRUE(d.ok() && r.ok());
        data_ = std::move(*d);
        result_ = std::move(*r);
        ASSERT_TRUE(data_.fill(0x11).ok());
        ASSERT_TRUE(result_.fill(0xEE).ok());
    }

    // The slow write on the compute stream: fills the "KV" with kFinal once `flag` is set.
    void enqueue_slow_write(const HostFlag& flag) {
        ASSERT_EQ(test_kernels::launch_spin_then_fill(compute_handle_, flag.device(),
                                                      data_.as<uint32_t>(), kWords, kFinal,
                                                      kKernelBackstopNs),
                  cudaSuccess);
    }

    // The gated work on `other`: copy the "KV" into the result.
    void enqueue_gated_copy() {
        EXPECT_EQ(cudaMemcpyAsync(result_.data(), data_.data(), kWords * 4,
                                  cudaMemcpyDeviceToDevice, other_handle_),
                  cudaSuccess);
    }

    // How many words of the result are not kFinal (and a description of the first one).
    size_t count_not_final(std::string* first) {
        std::vector<uint32_t> host(kWords, 0);
        EXPECT_TRUE(result_.copy_to_host(host.data(), kWords * 4).ok());
        size_t bad = 0;
        for (size_t i = 0; i < kWords; ++i) {
            if (host[i] == kFinal) continue;
            if (bad++ == 0) {
                *first = "word " + std::to_string(i) + " = " + std::to_string(host[i]) +
                         (host[i] == kOld      ? " (the old data)"
                          : host[i] == kPoison ? " (poison)"
                                               : "");
            }
        }
        return bad;
    }

    // Declared first, destroyed last: the streams' destructors drain them before the buffers go.
    runtime::DeviceBuffer data_;
    runtime::DeviceBuffer result_;
    std::unique_ptr<runtime::Stream> compute_;
    std::unique_ptr<runtime::Stream> other_;
    cudaStream_t compute_handle_ = nullptr;
    cudaStream_t other_handle_ = nullptr;
    Status value_wait_;
};

TEST_F(DeviceStepCounterTest, EventGateHoldsTheCopyUntilTheSlowWriteAndItsRecord) {
    auto c = make_counter(0);
    ASSERT_NE(c, nullptr);
    ASSERT_NO_FATAL_FAILURE(make_buffers());
    HostFlag flag;
    ASSERT_TRUE(flag.ok());
    ReleaseOnExit release(flag);
    const int64_t begin = c->advance_step(1);
    ASSERT_NO_FATAL_FAILURE(enqueue_slow_write(flag));
    ASSERT_TRUE(c->record_cache().ok());
    auto path = c->gate(*other_, begin);
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    EXPECT_EQ(*path, GatePath::kEvent);
    enqueue_gated_copy();
    auto copied = other_->create_event();
    ASSERT_NE(copied, nullptr);
    ASSERT_TRUE(other_->record(*copied).ok());
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(copied->query()) << "the gated copy ran before the record";
    EXPECT_FALSE(StepCounter::is_step_ready(c->query_ready_cache_step(), begin));
    flag.set();
    ASSERT_TRUE(other_->synchronize(10s).ok());
    std::string first;
    EXPECT_EQ(count_not_final(&first), 0u) << first;
    EXPECT_TRUE(StepCounter::is_step_ready(c->query_ready_cache_step(), begin));
    EXPECT_EQ(c->records_published(), 1u);
}

TEST_F(DeviceStepCounterTest, ValueWaitGateHoldsForARecordNotEnqueuedYet) {
    auto c = make_counter(0);
    ASSERT_NE(c, nullptr);
    ASSERT_NO_FATAL_FAILURE(make_buffers());
    HostFlag flag;
    ASSERT_TRUE(flag.ok());
    ReleaseOnExit release(flag);
    const int64_t begin = c->advance_step(1);
    auto path = c->gate(*other_, begin);  // before anything is enqueued on the compute stream
    if (!value_wait_.ok()) {
        EXPECT_EQ(path.status().code(), StatusCode::kUnavailable);
        GTEST_SKIP() << "no stream memory operations: " << value_wait_.to_string();
    }
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    EXPECT_EQ(*path, GatePath::kValueWait);
    // From here to the record, nothing may return early: `other` waits for it.
    enqueue_gated_copy();
    auto copied = other_->create_event();
    const bool have_event = copied != nullptr && other_->record(*copied).ok();
    std::this_thread::sleep_for(30ms);
    EXPECT_TRUE(have_event && !copied->query()) << "the copy ran with nothing recorded";
    EXPECT_EQ(
        test_kernels::launch_spin_then_fill(compute_handle_, flag.device(), data_.as<uint32_t>(),
                                            kWords, kFinal, kKernelBackstopNs),
        cudaSuccess);
    EXPECT_TRUE(c->record_cache().ok());
    std::this_thread::sleep_for(30ms);
    EXPECT_TRUE(have_event && !copied->query()) << "the copy ran before the slow write ended";
    flag.set();
    ASSERT_TRUE(other_->synchronize(10s).ok());
    std::string first;
    EXPECT_EQ(count_not_final(&first), 0u) << first;
}

TEST_F(DeviceStepCounterTest, RecordEvictedFromTheEventRingFallsBackToValueWait) {
    auto c = make_counter(0);
    ASSERT_NE(c, nullptr);
    ASSERT_NO_FATAL_FAILURE(make_buffers());
    HostFlag flag;
    ASSERT_TRUE(flag.ok());
    ReleaseOnExit release(flag);
    const int records = static_cast<int>(cuda::kEventRingCapacity) + 10;
    const int64_t begin = c->advance_step(records);
    ASSERT_NO_FATAL_FAILURE(enqueue_slow_write(flag));
    for (int l = 0; l < records; ++l) ASSERT_TRUE(c->record_cache().ok());
    auto latest = c->gate(*other_, begin + records - 1);
    ASSERT_TRUE(latest.ok()) << latest.status().to_string();
    EXPECT_EQ(*latest, GatePath::kEvent);
    auto oldest = c->gate(*other_, begin);
    if (!value_wait_.ok()) {
        EXPECT_EQ(oldest.status().code(), StatusCode::kUnavailable);
        GTEST_SKIP() << "no stream memory operations: " << value_wait_.to_string();
    }
    ASSERT_TRUE(oldest.ok()) << oldest.status().to_string();
    EXPECT_EQ(*oldest, GatePath::kValueWait);
    enqueue_gated_copy();
    auto copied = other_->create_event();
    ASSERT_NE(copied, nullptr);
    ASSERT_TRUE(other_->record(*copied).ok());
    std::this_thread::sleep_for(30ms);
    EXPECT_FALSE(copied->query());
    flag.set();
    ASSERT_TRUE(other_->synchronize(10s).ok());
    std::string first;
    EXPECT_EQ(count_not_final(&first), 0u) << first;
    ASSERT_TRUE(compute_->synchronize(10s).ok());
    EXPECT_EQ(c->records_published(), static_cast<uint64_t>(records));
}

TEST_F(DeviceStepCounterTest, HostWaitersSeeEveryStepInOrderAcrossTheWrap) {
    constexpr int kLayers = 12;
    auto c = make_counter(kMax - 5);
    ASSERT_NE(c, nullptr);
    const int64_t begin = c->advance_step(kLayers);
    std::vector<int64_t> observed(kLayers, -1);
    std::vector<Status> waits(kLayers);
    std::thread waiter([&] {
        for (int l = 0; l < kLayers; ++l) {
            waits[l] = c->wait_until_ready(begin + l, 10s);
            observed[l] = c->query_ready_cache_step();
        }
    });
    for (int l = 0; l < kLayers; ++l) {
        EXPECT_EQ(test_kernels::launch_busy_wait(compute_handle_, 300'000), cudaSuccess);  // 300 us
        EXPECT_TRUE(c->record_cache().ok());
    }
    waiter.join();
    int64_t previous = 0;
    for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(waits[l].ok()) << "layer " << l << ": " << waits[l].to_string();
        EXPECT_TRUE(StepCounter::is_step_ready(observed[l], begin + l)) << "layer " << l;
        const int64_t progress = StepCounter::wrap(observed[l] - begin);  // records seen
        EXPECT_GE(progress, l + 1) << "layer " << l;
        EXPECT_LE(progress, kLayers) << "layer " << l;
        EXPECT_GE(progress, previous) << "layer " << l << ": the mirror went backwards";
        previous = progress;
    }
    EXPECT_EQ(c->query_ready_cache_step(), StepCounter::wrap(begin + kLayers));  // 7, wrapped
    EXPECT_EQ(c->query_ready_cache_step(), 7);
    EXPECT_EQ(c->records_published(), static_cast<uint64_t>(kLayers));
}

TEST_F(DeviceStepCounterTest, CapturedRecordsCountOnEveryReplayAndGatesThenWaitOnTheValue) {
    auto c = make_counter(kMax - 4);
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(compute_->begin_capture().ok());
    Status r1 = c->record_cache();
    Status r2 = c->record_cache();
    Status r3 = c->record_aux();
    auto graph = compute_->end_capture();
    ASSERT_TRUE(r1.ok() && r2.ok() && r3.ok())
        << r1.to_string() << r2.to_string() << r3.to_string();
    ASSERT_TRUE(graph.ok()) << graph.status().to_string();
    EXPECT_EQ(c->records_published(), 0u);  // captured, not run
    for (int replay = 1; replay <= 3; ++replay) {
        ASSERT_TRUE((*graph)->launch(*compute_).ok());
        ASSERT_TRUE(compute_->synchronize(10s).ok());
        EXPECT_EQ(c->query_ready_cache_step(), StepCounter::wrap(kMax - 4 + 2 * replay)) << replay;
        EXPECT_EQ(c->query_ready_aux_step(), StepCounter::wrap(kMax - 4 + replay)) << replay;
        EXPECT_EQ(c->records_published(), static_cast<uint64_t>(3 * replay)) << replay;
    }
    EXPECT_EQ(c->query_ready_cache_step(), 2);  // raw 2^62 + 2

    // After a capture an eagerly enqueued record is gated by value, not by its event.
    ASSERT_NO_FATAL_FAILURE(make_buffers());
    HostFlag flag;
    ASSERT_TRUE(flag.ok());
    ReleaseOnExit release(flag);
    const int64_t target = c->query_ready_cache_step();  // the next record moves past it
    ASSERT_NO_FATAL_FAILURE(enqueue_slow_write(flag));
    ASSERT_TRUE(c->record_cache().ok());
    auto path = c->gate(*other_, target);
    if (!value_wait_.ok()) {
        EXPECT_EQ(path.status().code(), StatusCode::kUnavailable);
        GTEST_SKIP() << "no stream memory operations: " << value_wait_.to_string();
    }
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    EXPECT_EQ(*path, GatePath::kValueWait);
    enqueue_gated_copy();
    auto copied = other_->create_event();
    ASSERT_NE(copied, nullptr);
    ASSERT_TRUE(other_->record(*copied).ok());
    std::this_thread::sleep_for(30ms);
    EXPECT_FALSE(copied->query());
    flag.set();
    ASSERT_TRUE(other_->synchronize(10s).ok());
    std::string first;
    EXPECT_EQ(count_not_final(&first), 0u) << first;
    EXPECT_EQ(c->query_ready_cache_step(), 3);
}

TEST_F(DeviceStepCounterTest, TimeoutsNameTheTargetAndTheLastReadyStep) {
    auto c = make_counter(kMax - 1);
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->record_cache().ok());
    ASSERT_TRUE(compute_->synchronize(10s).ok());
    EXPECT_EQ(c->query_ready_cache_step(), 0);
    const auto t0 = std::chrono::steady_clock::now();
    Status st = c->wait_until_ready(5, 30ms);
    const auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
    EXPECT_THAT(st.message(), HasSubstr("cache step 5 not ready after 30ms; last ready step 0"));
    EXPECT_GE(waited, 30ms);
    EXPECT_LT(waited, 5s);
    Status aux = c->wait_until_aux_ready(kMax - 1, 10ms);  // equal to the seed: not ready
    EXPECT_THAT(aux.message(), HasSubstr("aux step " + std::to_string(kMax - 1) + " not ready"));

    // A device-side gate has no timeout of its own: the host gives up on the stream instead,
    // and a later record still releases it.
    if (!value_wait_.ok())
        GTEST_SKIP() << "no stream memory operations: " << value_wait_.to_string();
    auto path = c->gate(*other_, 0);  // ready is 0: needs the next record
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    EXPECT_EQ(*path, GatePath::kValueWait);
    Status stuck = other_->synchronize(50ms);
    EXPECT_EQ(stuck.code(), StatusCode::kDeadlineExceeded);
    EXPECT_THAT(stuck.message(), HasSubstr("synchronize timed out"));
    EXPECT_TRUE(c->record_cache().ok());
    EXPECT_TRUE(other_->synchronize(10s).ok());
}

TEST_F(DeviceStepCounterTest, GateOnTheCountersOwnStreamAndRefusals) {
    auto c = make_counter(0);
    ASSERT_NE(c, nullptr);
    HostFlag flag;
    ASSERT_TRUE(flag.ok());
    ReleaseOnExit release(flag);
    ASSERT_NO_FATAL_FAILURE(make_buffers());
    const int64_t begin = c->advance_step(2);
    ASSERT_NO_FATAL_FAILURE(enqueue_slow_write(flag));
    ASSERT_TRUE(c->record_cache().ok());
    auto ordered = c->gate(*compute_, begin);
    ASSERT_TRUE(ordered.ok()) << ordered.status().to_string();
    EXPECT_EQ(*ordered, GatePath::kStreamOrder);
    auto refused = c->gate(*compute_, begin + 1);
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("own stream"));
    runtime::CpuStream cpu("cpu");
    auto wrong_device = c->gate(cpu, begin);
    EXPECT_EQ(wrong_device.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(wrong_device.status().message(), HasSubstr("is on cpu:0"));
    ASSERT_TRUE(other_->begin_capture().ok());
    auto capturing = c->gate(*other_, begin);
    EXPECT_EQ(capturing.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(capturing.status().message(), HasSubstr("capturing"));
    EXPECT_TRUE(other_->end_capture().ok());
    flag.set();
    EXPECT_TRUE(compute_->synchronize(10s).ok());
}

TEST_F(DeviceStepCounterTest, ConstructorAndCreateAgreeOnACudaStream) {
    StepCounter c(*compute_, 3);
    ASSERT_TRUE(c.status().ok()) << c.status().to_string();
    EXPECT_EQ(c.query_ready_cache_step(), 3);
    EXPECT_EQ(c.query_ready_aux_step(), 3);
    ASSERT_TRUE(c.record_aux().ok());
    EXPECT_TRUE(c.wait_until_aux_ready(3, 10s).ok());
    EXPECT_EQ(c.query_ready_aux_step(), 4);
    EXPECT_EQ(c.query_ready_cache_step(), 3);
}

}  // namespace
}  // namespace pdsim::pd
