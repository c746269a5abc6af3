// Builders for the clusters people have. scripts/topology/gen_topology.py writes the same
// topologies as YAML (same ids, links and numbers; tests/topology_test.cpp checks that the
// generated examples equal these builders' output).
//
// Conventions (shared with the generator):
//   DGX (A100/H100/H200/B200): nodes "n<i>", 8 GPUs "n<i>.gpu<j>", one NVSwitch "n<i>.nvswitch"
//   (nvlink, the GPU's per-direction NVLink bandwidth, 0.5 us a hop), 8 NICs "n<i>.nic<j>"
//   (400 Gb/s = 50 GB/s; 200 Gb/s for A100) each behind its GPU's PCIe link (0.5 us), all on
//   one fabric switch "ib-fabric" (1.0 us a hop). GPU->GPU: 1.0 us over NVLink in a node;
//   3.0 us and 50 GB/s across nodes.
//   GB200 NVL72: per rack 18 compute trays "t<i>" (global tray index) of 4 GB200 GPUs
//   "t<i>.gpu<j>", all on the rack's NVLink switch "rack<k>.nvswitch" (900 GB/s, 0.5 us), plus
//   4 NICs per tray as above on "ib-fabric".
//   CPU: one node "node0" (hostname localhost) with one `cpu` device per rank
//   "node0.cpu<j>" on a loopback switch "node0.shm" (10 GB/s, 1.0 us: nominal, informational).
//   GPU host: one node "node0" (hostname localhost) with N GPUs "node0.gpu<j>" (CUDA ordinal j)
//   on a PCIe switch "node0.pcie" (the GPU's PCIe bandwidth, 0.5 us a hop): a workstation or a
//   cloud GPU box, for the testbed's GPU ranks (docs/testbed.md "GPU rank").
// Placement: prefill instances, then decode instances, then colocated instances take GPUs in
// order; an instance never straddles an NVLink domain (a DGX node, an NVL72 rack, a GPU host)
// unless its TP is a multiple of the domain size, in which case it starts on a domain boundary.
// Instance ids "prefill<k>", "decode<k>", "colocated<k>".
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "topology/topology.h"

namespace pdsim::topo {

struct ClusterOptions {
    int prefill = 1;  // number of prefill instances
    int decode = 1;   // number of decode instances
    int prefill_tp = 8;
    int decode_tp = 8;
    std::string model;                   // a built-in model name, or "" for none
    std::string name;                    // "" = "<cluster>-<n>node-<P>p<D>d-tp<T>[-tp<T>]"
    std::vector<std::string> hostnames;  // one per node; empty = the node ids
};

// gpu: A100, H100, H200 or B200. nodes >= 1.
StatusOr<Topology> make_dgx(std::string_view gpu, int nodes, const ClusterOptions& options);
// racks >= 1 NVL72 racks of GB200.
StatusOr<Topology> make_gb200_nvl72(int racks, const ClusterOptions& options);

struct CpuOptions {
    int prefill = 1;
    int decode = 1;
    int prefill_tp = 1;
    int decode_tp = 1;
    std::string model = "tiny";
    std::string name;                     // "" = "cpu-<P>p<D>d[-tp..]"
    int cpus = 0;                         // cores on the machine; 0 = unknown (not written)
    std::string emulate = "dgx-h100-ib";  // an emulation preset, or "none"
    double time_scale = 0;                // 0 = auto
};
StatusOr<Topology> make_cpu(const CpuOptions& options);

struct GpuHostOptions {
    int gpus = 1;       // GPUs on the host
    int colocated = 0;  // colocated instances; > 0: prefill and decode must be 0
    int colocated_tp = 1;
    int prefill = 1;  // prefill / decode instances (when not colocated)
    int decode = 1;
    int prefill_tp = 1;
    int decode_tp = 1;
    // Prefill and decode instances each take GPUs from GPU 0 (so prefill i and decode i share
    // GPUs); a GPU both use is `shared` (Device::shared). false: decode GPUs follow prefill GPUs.
    bool share_gpus = false;
    std::string model = "tiny";
    // "" = "gpu-<N>x<gpu>-<C>c-tp<T>" or "gpu-<N>x<gpu>-<P>p<D>d-tp<T>[-tp<T>][-shared]"
    std::string name;
    int cpus = 0;  // cores on the host; 0 = unknown (not written)
};
// gpu: a GPU model of gpu_spec.h. A topology with only colocated instances (o.colocated > 0) or
// with prefill and decode instances (share_gpus: both roles from GPU 0; not with colocated).
StatusOr<Topology> make_gpu_host(std::string_view gpu, const GpuHostOptions& options);

// Emulation presets for a CPU topology's `shaping` section, each the GPU->GPU path of a
// builder's cluster: dgx-{a100,h100,h200,b200}-{ib,nvlink}, gb200-nvl72-nvlink, gb200-nvl72-ib.
StatusOr<ShapingSpec> emulation_preset(std::string_view name);
std::vector<std::string> emulation_preset_names();

}  // namespace pdsim::topo
