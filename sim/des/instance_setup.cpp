// instance_spec, kv_capacity_pages and make_instance_setups (sim/des/simulator.h): what each
// topology instance is to the simulator (cost model, KV pool, CPU cores).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "sim/des/kv_groups.h"
#include "sim/des/simulator.h"
#include "topology/gpu_spec.h"

namespace pdsim::des {

namespace {

const topo::Device* instance_device(const topo::Topology& t, int instance) {
    const topo::Instance& inst = t.instances[static_cast<size_t>(instance)];
    return inst.devices.empty() ? nullptr : t.find_device(inst.devices.front());
}

}  // namespace

StatusOr<cost::InstanceSpec> instance_spec(const topo::Topology& topology,
                                           const model::ModelConfig& model, int instance) {
    if (instance < 0 || static_cast<size_t>(instance) >= topology.instances.size()) {
        return invalid_argument_error(
            fmt::format("{}: no instance {}", topology.source.name, instance));
    }
    const topo::Instance& inst = topology.instances[static_cast<size_t>(instance)];
    const topo::Device* dev = instance_device(topology, instance);
    if (dev == nullptr) {
        return invalid_argument_error(
            fmt::format("{}: instance {}: unknown device", topology.source.name, inst.id));
    }
    cost::InstanceSpec spec;
    spec.model = model;
    spec.tp = inst.tp;
    if (dev->is_cpu()) {
        spec.device = "cpu";
        spec.kv_dtype_bytes = 4;  // the CPU testbed's pools are fp32
    } else {
        const topo::GpuSpec* gpu = dev->gpu();
        if (gpu == nullptr) {
            return invalid_argument_error(
                fmt::format("{}: instance {}: device {} has unknown type {}", topology.source.name,
                            inst.id, dev->id, dev->type));
        }
        spec.device = std::string(gpu->name);
        spec.kv_dtype_bytes = 2;
    }
    if (inst.tp > 1) {
        double gbps = std::numeric_limits<double>::infinity(), lat = 0;
        for (size_t i = 1; i < inst.devices.size(); ++i) {
            const topo::PathInfo p = topology.path_info(inst.devices[0], inst.devices[i]);
            if (!p.found) {
                return invalid_argument_error(
                    fmt::format("{}: instance {}: no path between its devices {} and {}",
                                topology.source.name, inst.id, inst.devices[0], inst.devices[i]));
            }
            gbps = std::min(gbps, p.bottleneck_gbps);
            lat = std::max(lat, p.latency_us);
        }
        spec.tp_link_gbps = gbps;
        spec.tp_link_latency_us = lat;
    }
    return spec;
}

StatusOr<int64_t> kv_capacity_pages(const topo::Topology& topology, const model::ModelConfig& model,
                                    int instance, const KvCapacityOptions& o) {
    PDSIM_ASSIGN_OR_RETURN(cost::InstanceSpec spec, instance_spec(topology, model, instance));
    const topo::Instance& inst = topology.instances[static_cast<size_t>(instance)];
    if (o.page_size < 1)
        return invalid_argument_error(fmt::format("page size {}: must be >= 1", o.page_size));
    // A dense model's page spans every layer, a hybrid's one attention layer (kv_groups.h).
    const double page_bytes =
        kv_footprint(model, inst.tp, spec.kv_dtype_bytes, o.page_size, 1).page_bytes;
    if (spec.device == "cpu") {
        return static_cast<int64_t>(
            std::floor(static_cast<double>(o.kv_pool_mb << 20) / page_bytes));
    }
    const topo::GpuSpec* gpu = topo::gpu_spec(spec.device);
    const double hbm = gpu->hbm_gib * double(1 << 30) * o.mem_fraction;
    const double weights = static_cast<double>(model.num_params()) * 2.0 / inst.tp;
    const double pages = std::floor((hbm - weights) / page_bytes);
    if (pages < 1) {
        return invalid_argument_error(
            fmt::format("{}: instance {}: {} weights ({:.1f} GiB per rank at tp {}) leave no "
                        "KV memory in {} x {} GiB x mem fraction {}",
                        topology.source.name, inst.id, model.name, weights / double(1 << 30),
                        inst.tp, gpu->name, gpu->hbm_gib, o.mem_fraction));
    }
    return static_cast<int64_t>(pages);
}

StatusOr<std::vector<InstanceSetup>> make_instance_setups(const topo::Topology& topology,
                                                          const model::ModelConfig& model,
                                                          const std::string& cost_kind,
                                                          const cost::CostFile* file,
                                                          const KvCapacityOptions& kv,
                                                          const cost::RooflineOptions& roofline) {
    std::vector<InstanceSetup> out;
    for (int i = 0; i < static_cast<int>(topology.instances.size()); ++i) {
        const std::string& id = topology.instances[static_cast<size_t>(i)].id;
        PDSIM_ASSIGN_OR_RETURN(cost::InstanceSpec spec, instance_spec(topology, model, i));
        StatusOr<std::unique_ptr<cost::CostModel>> cm =
            cost::make_cost_model(cost_kind, spec, file, roofline);
        if (!cm.ok()) return cm.status().with_context(fmt::format("instance {}", id));
        InstanceSetup s;
        s.cost = std::shared_ptr<const cost::CostModel>(std::move(*cm));
        PDSIM_ASSIGN_OR_RETURN(s.kv_pages, kv_capacity_pages(topology, model, i, kv));
        s.kv_dtype_bytes = spec.kv_dtype_bytes;
        if (spec.device == "cpu") {
            // The fit's thread count for this tp (calibrated fits are per (tp, threads)).
            int threads = 0;
            if (file != nullptr && file->json().contains("fits")) {
                for (const auto& f : file->json().at("fits")) {
                    if (f.value("tp", 0) != spec.tp) continue;
                    const int th = f.value("threads", 1);
                    threads = threads == 0 || threads == th ? th : -1;
                }
            }
            s.cpu_cores = spec.tp * std::max(1, threads);
        }
        out.push_back(std::move(s));
    }
    return out;
}

}  // namespace pdsim::des
