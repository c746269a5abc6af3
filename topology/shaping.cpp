#include "topology/shaping.h"

#include <fmt/format.h>

#include <cmath>

namespace pdsim::topo {

double LinkShaping::transfer_time_us(uint64_t bytes) const {
    if (unlimited()) return latency_us;
    return latency_us + static_cast<double>(bytes) / bytes_per_s * 1e6;
}

LinkShaping shaping_for(double gbps, double latency_us, double time_scale) {
    LinkShaping s;
    s.time_scale = time_scale > 0 && std::isfinite(time_scale) ? time_scale : 1.0;
    s.source_gbps = gbps;
    s.source_latency_us = latency_us;
    s.bytes_per_s = gbps > 0 && std::isfinite(gbps) ? gbps * 1e9 / s.time_scale : 0.0;
    s.latency_us = latency_us > 0 && std::isfinite(latency_us) ? latency_us * s.time_scale : 0.0;
    return s;
}

LinkShaping shaping_for(const Link& link, double time_scale) {
    return shaping_for(link.gbps, link.latency_us, time_scale);
}

LinkShaping shaping_for_path(const Topology& topology, std::string_view a, std::string_view b,
                             double time_scale) {
    const PathInfo p = topology.path_info(a, b);
    if (!p.found || p.links.empty()) return shaping_for(0.0, 0.0, time_scale);
    return shaping_for(p.bottleneck_gbps, p.latency_us, time_scale);
}

StatusOr<LinkShaping> shaping_for(const Topology& cpu_topology, double measured_time_scale) {
    if (!cpu_topology.shaping) return LinkShaping{};
    const ShapingSpec& s = *cpu_topology.shaping;
    double scale = s.time_scale;
    if (scale <= 0) {
        if (!(measured_time_scale > 0) || !std::isfinite(measured_time_scale)) {
            return Status(
                StatusCode::kInvalidArgument,
                fmt::format("{}: shaping.time_scale is auto but no measured time scale "
                            "was given (got {})",
                            cpu_topology.source.where("shaping.time_scale"), measured_time_scale));
        }
        scale = measured_time_scale;
    }
    return shaping_for(s.gbps, s.latency_us, scale);
}

StatusOr<double> time_scale_from(double cpu_seconds, double gpu_seconds) {
    if (!(cpu_seconds > 0) || !(gpu_seconds > 0) || !std::isfinite(cpu_seconds) ||
        !std::isfinite(gpu_seconds)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("time scale needs positive times, got cpu {} s / gpu {} s",
                                  cpu_seconds, gpu_seconds));
    }
    return cpu_seconds / gpu_seconds;
}

}  // namespace pdsim::topo
