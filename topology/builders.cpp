#include "topology/builders.h"

#include <fmt/format.h>

#include <map>

#include "topology/validate.h"

namespace pdsim::topo {

namespace {

constexpr double kHopNvlinkUs = 0.5;
constexpr double kHopPcieUs = 0.5;
constexpr double kHopIbUs = 1.0;
constexpr int kDgxGpus = 8;
constexpr int kTrayGpus = 4;
constexpr int kTraysPerRack = 18;

Status invalid(std::string what) {
    return Status(StatusCode::kInvalidArgument, std::move(what));
}

std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

std::string default_name(std::string_view cluster, int nodes, const ClusterOptions& o,
                         std::string_view unit) {
    std::string n =
        fmt::format("{}-{}{}-{}p{}d-tp{}", cluster, nodes, unit, o.prefill, o.decode, o.prefill_tp);
    if (o.decode_tp != o.prefill_tp) n += fmt::format("-tp{}", o.decode_tp);
    return n;
}

Status check_counts(int prefill, int decode, int ptp, int dtp) {
    if (prefill < 1 || decode < 1) {
        return invalid(fmt::format("need at least one prefill and one decode instance, got {}:{}",
                                   prefill, decode));
    }
    if (ptp < 1 || dtp < 1)
        return invalid(fmt::format("TP sizes must be >= 1, got {} and {}", ptp, dtp));
    if (static_cast<int64_t>(prefill) * ptp + static_cast<int64_t>(decode) * dtp > (1 << 20)) {
        return invalid("too many ranks");
    }
    return ok_status();
}

// Places prefill, then decode, then colocated instances on `gpus` (global order), never
// straddling a domain of `domain` GPUs unless tp is a multiple of it. With `wrap` (shared GPUs),
// an instance wider than all of `gpus` puts TP rank i on gpus[i % size] (its ranks time-share
// them) and must be its role's only instance.
Status place(const std::vector<std::string>& gpus, int domain, int prefill, int decode,
             int prefill_tp, int decode_tp, std::vector<Instance>* out, int colocated = 0,
             int colocated_tp = 1, bool wrap = false) {
    size_t cursor = 0;
    const size_t dom = static_cast<size_t>(domain);
    for (Role role : {Role::kPrefill, Role::kDecode, Role::kColocated}) {
        const int count = role == Role::kPrefill  ? prefill
                          : role == Role::kDecode ? decode
                                                  : colocated;
        const int tp = role == Role::kPrefill  ? prefill_tp
                       : role == Role::kDecode ? decode_tp
                                               : colocated_tp;
        const size_t utp = static_cast<size_t>(tp);
        if (wrap && count > 0 && utp > gpus.size()) {
            if (count > 1) {
                return invalid(fmt::format(
                    "{} {} instances at TP {} on {} shared GPUs: an instance wider than the host "
                    "wraps around its GPUs and must be its role's only one",
                    count, role_name(role), tp, gpus.size()));
            }
            Instance in;
            in.id = fmt::format("{}0", role_name(role));
            in.role = role;
            in.tp = tp;
            for (size_t i = 0; i < utp; ++i) in.devices.push_back(gpus[i % gpus.size()]);
            out->push_back(std::move(in));
            continue;
        }
        for (int k = 0; k < count; ++k) {
            if (utp <= dom) {
                if (cursor % dom + utp > dom) cursor = (cursor / dom + 1) * dom;
            } else {
                if (utp % dom != 0) {
                    return invalid(
                        fmt::format("{} TP {} spans NVLink domains of {} GPUs but is not "
                                    "a multiple of {}",
                                    role_name(role), tp, domain, domain));
                }
                cursor = (cursor + dom - 1) / dom * dom;
            }
            if (cursor + utp > gpus.size()) {
                if (colocated > 0) {
                    return invalid(
                        fmt::format("{} colocated instances at TP {} do not fit on {} GPUs",
                                    colocated, colocated_tp, gpus.size()));
                }
                return invalid(
                    fmt::format("{}:{} instances at TP {}:{} do not fit on {} GPUs "
                                "(instances do not straddle {}-GPU NVLink domains)",
                                prefill, decode, prefill_tp, decode_tp, gpus.size(), domain));
            }
            Instance in;
            in.id = fmt::format("{}{}", role_name(role), k);
            in.role = role;
            in.tp = tp;
            in.devices.assign(gpus.begin() + static_cast<std::ptrdiff_t>(cursor),
                              gpus.begin() + static_cast<std::ptrdiff_t>(cursor + utp));
            cursor += utp;
            out->push_back(std::move(in));
        }
    }
    return ok_status();
}

Status set_model(const std::string& name, Topology* t) {
    if (name.empty()) return ok_status();
    const ModelShape* m = builtin_model_shape(name);
    if (m == nullptr) {
        return invalid(
            fmt::format("unknown model \"{}\" (built in: {})", name, builtin_model_names()));
    }
    t->model = *m;
    return ok_status();
}

std::string hostname_for(const std::vector<std::string>& hostnames, size_t i,
                         const std::string& id) {
    return i < hostnames.size() ? hostnames[i] : id;
}

void add_gpu_tray(Topology* t, const std::string& node_id, const std::string& hostname, int cpus,
                  const GpuSpec& gpu, int gpus, double nic_gbps, const std::string& nvswitch,
                  bool node_switch) {
    Node n;
    n.id = node_id;
    n.hostname = hostname;
    n.cpus = cpus;
    for (int j = 0; j < gpus; ++j) {
        n.devices.push_back(
            {.id = fmt::format("{}.gpu{}", node_id, j), .type = std::string(gpu.name), .index = j});
    }
    for (int j = 0; j < gpus; ++j) {
        n.nics.push_back({fmt::format("{}.nic{}", node_id, j), LinkType::kIb, nic_gbps});
    }
    if (node_switch) n.switches.push_back({nvswitch, LinkType::kNvlink});
    for (int j = 0; j < gpus; ++j) {
        const std::string g = fmt::format("{}.gpu{}", node_id, j);
        const std::string nic = fmt::format("{}.nic{}", node_id, j);
        t->links.push_back({g, nvswitch, LinkType::kNvlink, gpu.nvlink_gbps, kHopNvlinkUs});
        t->links.push_back({g, nic, LinkType::kPcie, gpu.pcie_gbps, kHopPcieUs});
        t->links.push_back({nic, "ib-fabric", LinkType::kIb, nic_gbps, kHopIbUs});
    }
    t->nodes.push_back(std::move(n));
}

}  // namespace

StatusOr<Topology> make_dgx(std::string_view gpu, int nodes, const ClusterOptions& o) {
    const GpuSpec* spec = gpu_spec(gpu);
    if (spec == nullptr || spec->name == "GB200") {
        return invalid(
            fmt::format("make_dgx: unknown DGX GPU \"{}\" (A100, H100, H200 or B200)", gpu));
    }
    if (nodes < 1 || nodes > 4096)
        return invalid(fmt::format("make_dgx: nodes must be in [1, 4096], got {}", nodes));
    PDSIM_RETURN_IF_ERROR(check_counts(o.prefill, o.decode, o.prefill_tp, o.decode_tp));
    const bool a100 = spec->name == "A100";
    const double nic_gbps = a100 ? 25.0 : 50.0;  // 200 / 400 Gb/s
    const int cpus = a100 ? 128 : 112;
    const std::string cluster = "dgx-" + lower(spec->name);

    Topology t;
    t.name = o.name.empty() ? default_name(cluster, nodes, o, "node") : o.name;
    t.description =
        fmt::format("{} DGX {} node{}: 8x {} each, NVSwitch, 8x {} Gb/s InfiniBand", nodes,
                    spec->name, nodes == 1 ? "" : "s", spec->name, a100 ? 200 : 400);
    t.source.name = "<builder:" + cluster + ">";
    PDSIM_RETURN_IF_ERROR(set_model(o.model, &t));
    std::vector<std::string> gpus;
    for (int i = 0; i < nodes; ++i) {
        const std::string id = fmt::format("n{}", i);
        add_gpu_tray(&t, id, hostname_for(o.hostnames, static_cast<size_t>(i), id), cpus, *spec,
                     kDgxGpus, nic_gbps, id + ".nvswitch", /*node_switch=*/true);
        for (int j = 0; j < kDgxGpus; ++j) gpus.push_back(fmt::format("{}.gpu{}", id, j));
    }
    t.switches.push_back({"ib-fabric", LinkType::kIb});
    PDSIM_RETURN_IF_ERROR(
        place(gpus, kDgxGpus, o.prefill, o.decode, o.prefill_tp, o.decode_tp, &t.instances));
    t.world_size = t.num_ranks();
    PDSIM_RETURN_IF_ERROR(validate(t));
    return t;
}

StatusOr<Topology> make_gb200_nvl72(int racks, const ClusterOptions& o) {
    if (racks < 1 || racks > 256)
        return invalid(fmt::format("make_gb200_nvl72: racks must be in [1, 256], got {}", racks));
    PDSIM_RETURN_IF_ERROR(check_counts(o.prefill, o.decode, o.prefill_tp, o.decode_tp));
    const GpuSpec& spec = *gpu_spec("GB200");
    Topology t;
    t.name = o.name.empty() ? default_name("gb200-nvl72", racks, o, "rack") : o.name;
    t.description = fmt::format(
        "{} GB200 NVL72 rack{}: 18 trays of 4 GB200 on one NVLink domain "
        "per rack, 4x 400 Gb/s InfiniBand per tray",
        racks, racks == 1 ? "" : "s");
    t.source.name = "<builder:gb200-nvl72>";
    PDSIM_RETURN_IF_ERROR(set_model(o.model, &t));
    std::vector<std::string> gpus;
    for (int r = 0; r < racks; ++r) {
        const std::string nvswitch = fmt::format("rack{}.nvswitch", r);
        for (int k = 0; k < kTraysPerRack; ++k) {
            const int tray = r * kTraysPerRack + k;
            const std::string id = fmt::format("t{}", tray);
            add_gpu_tray(&t, id, hostname_for(o.hostnames, static_cast<size_t>(tray), id), 144,
                         spec, kTrayGpus, 50.0, nvswitch, /*node_switch=*/false);
            for (int j = 0; j < kTrayGpus; ++j) gpus.push_back(fmt::format("{}.gpu{}", id, j));
        }
    }
    for (int r = 0; r < racks; ++r)
        t.switches.push_back({fmt::format("rack{}.nvswitch", r), LinkType::kNvlink});
    t.switches.push_back({"ib-fabric", LinkType::kIb});
    PDSIM_RETURN_IF_ERROR(place(gpus, kTrayGpus * kTraysPerRack, o.prefill, o.decode, o.prefill_tp,
                                o.decode_tp, &t.instances));
    t.world_size = t.num_ranks();
    PDSIM_RETURN_IF_ERROR(validate(t));
    return t;
}

StatusOr<Topology> make_cpu(const CpuOptions& o) {
    PDSIM_RETURN_IF_ERROR(check_counts(o.prefill, o.decode, o.prefill_tp, o.decode_tp));
    if (o.cpus < 0) return invalid(fmt::format("make_cpu: cpus must be >= 0, got {}", o.cpus));
    Topology t;
    if (o.name.empty()) {
        t.name = fmt::format("cpu-{}p{}d", o.prefill, o.decode);
        if (o.prefill_tp != 1 || o.decode_tp != 1) {
            t.name += fmt::format("-tp{}-to-tp{}", o.prefill_tp, o.decode_tp);
        }
    } else {
        t.name = o.name;
    }
    t.description = "CPU testbed on this machine: one cpu device per MPI rank";
    t.source.name = "<builder:cpu>";
    PDSIM_RETURN_IF_ERROR(set_model(o.model, &t));
    const int world = o.prefill * o.prefill_tp + o.decode * o.decode_tp;
    Node n;
    n.id = "node0";
    n.hostname = "localhost";
    n.cpus = o.cpus;
    std::vector<std::string> devs;
    for (int j = 0; j < world; ++j) {
        devs.push_back(fmt::format("node0.cpu{}", j));
        n.devices.push_back({.id = devs.back(), .type = "cpu", .index = -1});
        t.links.push_back({devs.back(), "node0.shm", LinkType::kLoopback, 10.0, 1.0});
    }
    n.switches.push_back({"node0.shm", LinkType::kLoopback});
    t.nodes.push_back(std::move(n));
    PDSIM_RETURN_IF_ERROR(
        place(devs, world, o.prefill, o.decode, o.prefill_tp, o.decode_tp, &t.instances));
    t.world_size = world;
    if (o.emulate != "none") {
        PDSIM_ASSIGN_OR_RETURN(ShapingSpec s, emulation_preset(o.emulate));
        s.time_scale = o.time_scale;
        t.shaping = std::move(s);
    }
    PDSIM_RETURN_IF_ERROR(validate(t));
    return t;
}

StatusOr<Topology> make_gpu_host(std::string_view gpu, const GpuHostOptions& o) {
    const GpuSpec* spec = gpu_spec(gpu);
    if (spec == nullptr) {
        return invalid(fmt::format("make_gpu_host: unknown GPU \"{}\" (expected one of: {})", gpu,
                                   gpu_spec_names()));
    }
    if (o.gpus < 1 || o.gpus > 64)
        return invalid(fmt::format("make_gpu_host: gpus must be in [1, 64], got {}", o.gpus));
    if (o.cpus < 0) return invalid(fmt::format("make_gpu_host: cpus must be >= 0, got {}", o.cpus));
    if (o.colocated > 0) {
        if (o.prefill != 0 || o.decode != 0) {
            return invalid(fmt::format(
                "make_gpu_host: {} colocated with {}:{} prefill:decode instances (a topology is "
                "disaggregated or colocated)",
                o.colocated, o.prefill, o.decode));
        }
        if (o.colocated_tp < 1)
            return invalid(fmt::format("TP sizes must be >= 1, got {}", o.colocated_tp));
        if (o.share_gpus) {
            return invalid(
                "make_gpu_host: share_gpus places prefill and decode instances on the "
                "same GPUs; colocated instances share nothing");
        }
    } else {
        PDSIM_RETURN_IF_ERROR(check_counts(o.prefill, o.decode, o.prefill_tp, o.decode_tp));
    }
    const std::string type = lower(spec->name);
    Topology t;
    if (!o.name.empty()) {
        t.name = o.name;
    } else if (o.colocated > 0) {
        t.name = fmt::format("gpu-{}x{}-{}c-tp{}", o.gpus, type, o.colocated, o.colocated_tp);
    } else {
        t.name =
            fmt::format("gpu-{}x{}-{}p{}d-tp{}", o.gpus, type, o.prefill, o.decode, o.prefill_tp);
        if (o.decode_tp != o.prefill_tp) t.name += fmt::format("-tp{}", o.decode_tp);
        if (o.share_gpus) t.name += "-shared";
    }
    t.description = fmt::format("one host: {}x {} on a PCIe switch", o.gpus, spec->name);
    t.source.name = "<builder:gpu>";
    PDSIM_RETURN_IF_ERROR(set_model(o.model, &t));
    Node n;
    n.id = "node0";
    n.hostname = "localhost";
    n.cpus = o.cpus;
    std::vector<std::string> devs;
    for (int j = 0; j < o.gpus; ++j) {
        devs.push_back(fmt::format("node0.gpu{}", j));
        n.devices.push_back({.id = devs.back(), .type = std::string(spec->name), .index = j});
        t.links.push_back(
            {devs.back(), "node0.pcie", LinkType::kPcie, spec->pcie_gbps, kHopPcieUs});
    }
    n.switches.push_back({"node0.pcie", LinkType::kPcie});
    if (o.share_gpus) {
        // Each role on its own from GPU 0; the GPUs both roles use are shared.
        PDSIM_RETURN_IF_ERROR(place(devs, o.gpus, o.prefill, 0, o.prefill_tp, o.decode_tp,
                                    &t.instances, 0, 1, /*wrap=*/true));
        PDSIM_RETURN_IF_ERROR(place(devs, o.gpus, 0, o.decode, o.prefill_tp, o.decode_tp,
                                    &t.instances, 0, 1, /*wrap=*/true));
        std::map<std::string, int> users;
        for (const Instance& in : t.instances) {
            for (const std::string& d : in.devices) ++users[d];
        }
        for (Device& d : n.devices) d.shared = users[d.id] > 1;
    } else {
        PDSIM_RETURN_IF_ERROR(place(devs, o.gpus, o.prefill, o.decode, o.prefill_tp, o.decode_tp,
                                    &t.instances, o.colocated, o.colocated_tp));
    }
    t.nodes.push_back(std::move(n));
    t.world_size = t.num_ranks();
    PDSIM_RETURN_IF_ERROR(validate(t));
    return t;
}

std::vector<std::string> emulation_preset_names() {
    return {"dgx-a100-ib",        "dgx-a100-nvlink", "dgx-h100-ib", "dgx-h100-nvlink",
            "dgx-h200-ib",        "dgx-h200-nvlink", "dgx-b200-ib", "dgx-b200-nvlink",
            "gb200-nvl72-nvlink", "gb200-nvl72-ib"};
}

StatusOr<ShapingSpec> emulation_preset(std::string_view name) {
    // Build a minimal cluster of the preset's kind and take the path between two of its GPUs.
    const std::string n(name);
    const bool nvlink = n.ends_with("-nvlink");
    const bool ib = n.ends_with("-ib");
    const std::string cluster = n.substr(0, n.size() - (nvlink ? 7 : ib ? 3 : 0));
    if (!nvlink && !ib) {
        return invalid(fmt::format("unknown emulation preset \"{}\" (expected none or one of: {})",
                                   name, fmt::join(emulation_preset_names(), ", ")));
    }
    ClusterOptions o;
    o.prefill_tp = o.decode_tp = 1;
    StatusOr<Topology> t = Status(StatusCode::kInvalidArgument, "");
    std::string a, b, gpu;
    if (cluster == "gb200-nvl72") {
        t = make_gb200_nvl72(ib ? 2 : 1, o);
        a = "t0.gpu0";
        b = ib ? "t18.gpu0" : "t1.gpu0";
        gpu = "GB200";
    } else if (cluster.starts_with("dgx-") && gpu_spec(cluster.substr(4)) != nullptr &&
               cluster != "dgx-gb200") {
        gpu = std::string(gpu_spec(cluster.substr(4))->name);
        t = make_dgx(gpu, 2, o);
        a = "n0.gpu0";
        b = ib ? "n1.gpu0" : "n0.gpu1";
    } else {
        return invalid(fmt::format("unknown emulation preset \"{}\" (expected none or one of: {})",
                                   name, fmt::join(emulation_preset_names(), ", ")));
    }
    if (!t.ok()) return t.status();
    const PathInfo p = t->path_info(a, b);
    ShapingSpec s;
    s.emulate =
        fmt::format("{} GPU->GPU {}", cluster, ib ? "across nodes (InfiniBand)" : "over NVLink");
    s.type = ib ? LinkType::kIb : LinkType::kNvlink;
    s.gbps = p.bottleneck_gbps;
    s.latency_us = p.latency_us;
    s.gpu = gpu;
    s.time_scale = 0;
    return s;
}

}  // namespace pdsim::topo
