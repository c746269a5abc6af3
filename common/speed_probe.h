// The machine-speed probe: one fixed piece of CPU work, timed again and again beside a run, so
// that runs taken at different times on one machine can be put on one speed scale.
//
// Why: on a shared or virtual machine the same forward takes up to a third longer in one run than
// in the next (docs/fidelity.md section 8.5). A cost file measured by `pdsim calibrate` describes
// the machine as it was during calibration; a testbed run an hour later may see it slower or
// faster. Both `pdsim calibrate` (its serve probe runs) and every `pdsim testbed` CPU rank sample
// this probe, and `pdsim simulate --like` scales the cost model's decode forwards by the ratio of
// the two medians (not its extends, which did not follow the probe: docs/fidelity.md 8.10).
//
// The work: a matrix-vector product over an 8 MiB fp32 matrix (2048 x 1024), the shape of a CPU
// decode forward's weight stream. Each sample runs it twice on the calling thread and times the
// second pass (the first brings the matrix into the caches, as back-to-back forwards find it) in
// the thread's CPU time (CLOCK_THREAD_CPUTIME_ID), so time spent waiting for a core, which the
// simulator models on its own, does not count. About 0.5-1 ms of CPU per sample.
//
// Thread-safety: SpeedProbe is not thread-safe (one thread per probe); SpeedSampler's methods
// are called from one owning thread, and its sampling thread touches only its own state.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string_view>
#include <thread>
#include <vector>

namespace pdsim {

// The kernel's identity. A cost file's probe and a report's are only compared when their
// `kernel` fields are equal: changing the work changes this name.
inline constexpr std::string_view kSpeedProbeKernel = "gemv-fp32-2048x1024-v1";

class SpeedProbe {
public:
    SpeedProbe();  // allocates and fills the 8 MiB matrix
    // One sample: the CPU milliseconds of the timed pass on the calling thread.
    [[nodiscard]] double sample_ms();

private:
    std::vector<float> matrix_, vec_, out_;
};

// Samples a SpeedProbe on its own thread ("pdsim-speed") every `period` from start() to stop().
// The thread sleeps between samples; its CPU share is about 1 ms per period.
class SpeedSampler {
public:
    explicit SpeedSampler(std::chrono::milliseconds period);
    ~SpeedSampler();  // stops the thread if running
    SpeedSampler(const SpeedSampler&) = delete;
    SpeedSampler& operator=(const SpeedSampler&) = delete;
    // Starts sampling (the first sample at once). Precondition: not started.
    void start();
    // Stops and joins; blocks for at most one sample. Idempotent.
    void stop();
    // The samples so far, in order, CPU ms. Call after stop().
    [[nodiscard]] const std::vector<double>& samples_ms() const { return samples_; }
    // How many samples were taken so far; may be called while sampling.
    [[nodiscard]] size_t count() const;

private:
    void loop();
    std::chrono::milliseconds period_;
    std::thread thread_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::vector<double> samples_;
};

// A report's `speed_probe` object: {"kernel", "period_ms", "samples", "cpu_ms_p50", "cpu_ms"
// (every sample, rounded to 1 us)}; cpu_ms_p50 is 0 without samples.
[[nodiscard]] nlohmann::json speed_probe_json(const std::vector<double>& samples_ms,
                                              std::chrono::milliseconds period);

}  // namespace pdsim
