// The machine-speed probe (common/speed_probe.h): a sample is the CPU time of a fixed amount of
// work, so more work on the same thread takes more of it; the sampler collects samples on its own
// thread until stopped and reports them as the testbed does.
#include "common/speed_probe.h"

#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <string>
#include <thread>

namespace pdsim {
namespace {

double thread_cpu_ms() {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

// A sample is the timed pass's CPU time: positive, and within the CPU time the whole call used
// (which also includes the untimed warm pass).
TEST(SpeedProbe, ASampleIsTheTimedPassesCpuTime) {
    SpeedProbe probe;
    for (int i = 0; i < 5; ++i) {
        const double before = thread_cpu_ms();
        const double sample = probe.sample_ms();
        const double whole = thread_cpu_ms() - before;
        EXPECT_GT(sample, 0.0);
        EXPECT_LT(sample, whole);  // two passes ran; one was timed
        EXPECT_GT(sample, whole * 0.2);
    }
}

// The sampler takes one sample at once and then one per period (a sample takes ~0.3 ms here and
// tens of ms under a sanitizer, so the test waits for three rather than for a fixed time), and
// sleeps in between: no more than one sample per period elapsed.
TEST(SpeedSampler, CollectsSamplesUntilStopped) {
    SpeedSampler sampler(std::chrono::milliseconds(10));
    const auto t0 = std::chrono::steady_clock::now();
    sampler.start();
    const auto deadline = t0 + std::chrono::seconds(30);
    while (sampler.count() < 3 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    sampler.stop();
    const double elapsed_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::vector<double> samples = sampler.samples_ms();
    ASSERT_GE(samples.size(), 3u) << "fewer than 3 samples in 30 s";
    EXPECT_EQ(sampler.count(), samples.size());
    EXPECT_LE(static_cast<double>(samples.size()), elapsed_ms / 10 + 1);
    for (double s : samples) {
        EXPECT_GT(s, 0.0);
        EXPECT_LT(s, 1000.0);  // tens of ms under a sanitizer
    }
    sampler.stop();  // idempotent
    EXPECT_EQ(sampler.samples_ms().size(), samples.size());

    const nlohmann::json j = speed_probe_json(samples, std::chrono::milliseconds(10));
    EXPECT_EQ(j["kernel"], std::string(kSpeedProbeKernel));
    EXPECT_EQ(j["period_ms"], 10);
    EXPECT_EQ(j["samples"], samples.size());
    EXPECT_EQ(j["cpu_ms"].size(), samples.size());
    EXPECT_GT(j["cpu_ms_p50"].get<double>(), 0.0);
    EXPECT_EQ(speed_probe_json({}, std::chrono::milliseconds(10))["cpu_ms_p50"], 0.0);
    EXPECT_EQ(speed_probe_json({3.0, 1.0, 2.0}, std::chrono::milliseconds(10))["cpu_ms_p50"], 2.0);
}

// A sampler stopped at once still joins cleanly (the destructor stops one never stopped).
TEST(SpeedSampler, StopsAtOnceAndOnDestruction) {
    {
        SpeedSampler sampler(std::chrono::milliseconds(60'000));
        sampler.start();
        sampler.stop();
        EXPECT_LE(sampler.samples_ms().size(), 1u);
    }
    SpeedSampler running(std::chrono::milliseconds(10));
    running.start();
}

}  // namespace
}  // namespace pdsim
