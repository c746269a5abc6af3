#include "common/speed_probe.h"

#include <cmath>

#include "common/stats.h"
#include "common/thread_info.h"

namespace pdsim {

namespace {

constexpr size_t kRows = 2048, kCols = 1024;

// out = matrix x vec, eight independent partial sums per row (so the loop vectorizes without
// reassociating one sum).
void gemv(const float* matrix, const float* vec, float* out) {
    for (size_t r = 0; r < kRows; ++r) {
        const float* row = matrix + r * kCols;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (size_t c = 0; c < kCols; c += 8) {
            for (size_t k = 0; k < 8; ++k) acc[k] += row[c + k] * vec[c + k];
        }
        out[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

}  // namespace

SpeedProbe::SpeedProbe() : matrix_(kRows * kCols), vec_(kCols), out_(kRows) {
    for (size_t i = 0; i < matrix_.size(); ++i) {
        matrix_[i] = static_cast<float>(static_cast<int>(i % 61) - 30) * (1.0F / 64);
    }
    for (size_t i = 0; i < vec_.size(); ++i) vec_[i] = static_cast<float>(i % 7) * 0.125F;
}

double SpeedProbe::sample_ms() {
    gemv(matrix_.data(), vec_.data(), out_.data());  // warm
    const double t0_us = this_thread_cpu_us();
    gemv(matrix_.data(), vec_.data(), out_.data());
    const double ms = (this_thread_cpu_us() - t0_us) * 1e-3;
    // Keep the result observable so the passes are not optimized away.
    vec_[0] = std::fmod(vec_[0] + out_[kRows / 2] * 1e-9F, 1.0F);
    return ms;
}

SpeedSampler::SpeedSampler(std::chrono::milliseconds period) : period_(period) {}

SpeedSampler::~SpeedSampler() {
    stop();
}

void SpeedSampler::start() {
    stop_ = false;
    thread_ = std::thread([this] { loop(); });
}

void SpeedSampler::stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

size_t SpeedSampler::count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_.size();
}

void SpeedSampler::loop() {
    set_thread_name("pdsim-speed");
    SpeedProbe probe;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
        lock.unlock();
        const double ms = probe.sample_ms();
        lock.lock();
        samples_.push_back(ms);
        cv_.wait_for(lock, period_, [this] { return stop_; });
    }
}

nlohmann::json speed_probe_json(const std::vector<double>& samples_ms,
                                std::chrono::milliseconds period) {
    nlohmann::json rounded = nlohmann::json::array();
    for (double s : samples_ms) rounded.push_back(std::round(s * 1e3) / 1e3);
    return {{"kernel", std::string(kSpeedProbeKernel)},
            {"period_ms", period.count()},
            {"samples", samples_ms.size()},
            {"cpu_ms_p50", samples_ms.empty() ? 0.0 : stats::median(samples_ms)},
            {"cpu_ms", std::move(rounded)}};
}

}  // namespace pdsim
