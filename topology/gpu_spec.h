// GPU spec table: the few numbers the simulator and the link shaping need per GPU model.
//
// Units: TFLOP/s (10^12), GB/s (10^9 bytes per second, per direction), GiB. Values are the
// vendors' datasheet figures for the SXM parts: dense (not 2:4 sparse) BF16 tensor throughput,
// HBM bandwidth and capacity (nominal), and NVLink bandwidth per GPU per direction (half the
// "bidirectional" figure vendors quote). pcie_gbps is the per-direction bandwidth of the PCIe
// generation the part attaches its NICs with (Gen4 x16 for A100, Gen5 x16 after).
//
// Thread-safety: the table is immutable; every function here may be called from any thread.
#pragma once

#include <span>
#include <string_view>

namespace pdsim::topo {

struct GpuSpec {
    std::string_view name;       // canonical name as written in topology files: "H100"
    std::string_view full_name;  // "NVIDIA H100 SXM5 80GB"
    double bf16_tflops;          // dense BF16 tensor TFLOP/s
    double hbm_gbps;             // HBM bandwidth, GB/s
    double hbm_gib;              // HBM capacity (nominal), GiB
    double nvlink_gbps;          // NVLink bandwidth per GPU, per direction, GB/s
    double pcie_gbps;            // PCIe (NIC attach) bandwidth per direction, GB/s
};

// The spec of a GPU model, or nullptr when unknown. Case-insensitive; "-", "_" and spaces are
// ignored and a trailing "SXM"/"SXM4"/"SXM5" is accepted ("h100-sxm" -> H100).
const GpuSpec* gpu_spec(std::string_view name);

// Every known GPU, in table order: A100, H100, H200, B200, GB200.
std::span<const GpuSpec> gpu_specs();

// "A100, H100, H200, B200, GB200": for error messages.
std::string_view gpu_spec_names();

// Roofline time of a kernel on `gpu`: max(flops / peak, bytes / hbm), in seconds. The CPU
// testbed divides its measured time by this to get a shaping time scale (see shaping.h).
double roofline_time_s(const GpuSpec& gpu, double flops, double bytes);

}  // namespace pdsim::topo
