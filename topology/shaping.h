// Link shaping: the bandwidth and latency the CPU testbed imposes on its transport so that a
// CPU run keeps a GPU cluster's compute:transfer ratio.
//
// If the CPU computes a layer `time_scale` times slower than the GPU it stands in for, a
// transfer must also take `time_scale` times longer than on the GPU cluster's link for the
// overlap between compute and transfer to look the same. So for a link of B GB/s and L us:
//     bytes_per_s = B * 1e9 / time_scale        latency_us = L * time_scale
// Contract for the transport that applies it: a message of n bytes posted at time t completes
// no earlier than t + latency_us + n / bytes_per_s, and messages on one shaped channel share the
// bandwidth (pace them through one token bucket, in posting order). The transport's own latency
// counts against latency_us (wait only for what is left).
//
// time_scale: given in the topology's `shaping.time_scale`, or "auto": the testbed measures a
// prefill layer on the CPU and divides by roofline_time_s() (gpu_spec.h) of the same layer on
// `shaping.gpu` (see time_scale_from()).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "topology/topology.h"

namespace pdsim::topo {

struct LinkShaping {
    double bytes_per_s = 0;  // 0: unlimited (no shaping)
    double latency_us = 0;   // one-way per-message latency to impose
    double time_scale = 1;   // CPU time / emulated GPU time
    double source_gbps = 0;  // the emulated link's bandwidth, GB/s
    double source_latency_us = 0;

    [[nodiscard]] bool unlimited() const { return bytes_per_s <= 0; }
    // When a message of `bytes` posted at 0 may complete, in microseconds (scaled time).
    [[nodiscard]] double transfer_time_us(uint64_t bytes) const;
};

// Shaping for a link of `gbps` GB/s and `latency_us` us at `time_scale` (> 0; anything else is
// treated as 1).
LinkShaping shaping_for(double gbps, double latency_us, double time_scale);
LinkShaping shaping_for(const Link& link, double time_scale);
// Shaping for the path between two endpoints of a (GPU) topology: its bottleneck bandwidth and
// total latency. Unlimited when there is no path or a == b.
LinkShaping shaping_for_path(const Topology& topology, std::string_view a, std::string_view b,
                             double time_scale);

// The shaping a CPU topology asks for in its `shaping` section. `measured_time_scale` is used
// when the section says time_scale: auto (it must then be > 0, else kInvalidArgument). A
// topology without a shaping section gives an unlimited LinkShaping.
StatusOr<LinkShaping> shaping_for(const Topology& cpu_topology, double measured_time_scale = 0);

// time_scale = cpu_seconds / gpu_seconds (both > 0), e.g. gpu_seconds = roofline_time_s(...).
StatusOr<double> time_scale_from(double cpu_seconds, double gpu_seconds);

}  // namespace pdsim::topo
