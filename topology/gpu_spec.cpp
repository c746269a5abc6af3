#include "topology/gpu_spec.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

namespace pdsim::topo {

namespace {

constexpr std::array<GpuSpec, 5> kGpuSpecs{{
    {"A100", "NVIDIA A100 SXM4 80GB", 312.0, 2039.0, 80.0, 300.0, 32.0},
    {"H100", "NVIDIA H100 SXM5 80GB", 989.0, 3350.0, 80.0, 450.0, 64.0},
    {"H200", "NVIDIA H200 SXM 141GB", 989.0, 4800.0, 141.0, 450.0, 64.0},
    {"B200", "NVIDIA B200 SXM 180GB", 2250.0, 8000.0, 180.0, 900.0, 64.0},
    {"GB200", "NVIDIA GB200 (Blackwell GPU of a Grace Blackwell superchip)", 2500.0, 8000.0, 186.0,
     900.0, 64.0},
}};

std::string normalize(std::string_view name) {
    std::string out;
    for (char c : name) {
        if (c == '-' || c == '_' || c == ' ') continue;
        out.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
    }
    return out;
}

}  // namespace

const GpuSpec* gpu_spec(std::string_view name) {
    if (name.empty() || name.size() > 32) return nullptr;
    const std::string normalized = normalize(name);
    std::string_view n = normalized;
    for (std::string_view suffix : {"SXM5", "SXM4", "SXM"}) {
        if (n.size() > suffix.size() && n.ends_with(suffix)) {
            n.remove_suffix(suffix.size());
            break;
        }
    }
    for (const GpuSpec& g : kGpuSpecs) {
        if (n == g.name) return &g;
    }
    return nullptr;
}

std::span<const GpuSpec> gpu_specs() {
    return kGpuSpecs;
}

std::string_view gpu_spec_names() {
    return "A100, H100, H200, B200, GB200";
}

double roofline_time_s(const GpuSpec& gpu, double flops, double bytes) {
    return std::max(flops / (gpu.bf16_tflops * 1e12), bytes / (gpu.hbm_gbps * 1e9));
}

}  // namespace pdsim::topo
