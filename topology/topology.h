// Topology: the cluster an experiment runs on, as data.
//
// A topology has nodes (hosts) holding devices (GPUs of a model from gpu_spec.h, or CPU ranks),
// NICs and switches; links between any two of those endpoints; and instances: the prefill and
// decode groups, each with a TP size and exactly `tp` devices. Ids of devices, NICs and switches
// share one namespace and are unique in the topology (the generators use "n0.gpu3",
// "n0.nic3", "n0.nvswitch", "ib-fabric"). The file format and every rule are in
// topology/README.md; loader.h reads files, validate.h checks a topology.
//
// Units: bandwidth in GB/s (10^9 bytes per second, per direction: links are full duplex);
// latency in microseconds. `gbps` everywhere in pdsim means GB/s, not Gb/s.
//
// Instances are disaggregated (prefill and decode instances, the KV moving from one to the other)
// or colocated (each serves whole requests, prefill and decode, on its own devices: no KV
// transfer). A topology holds at least one prefill and one decode instance, or colocated instances
// only (validate.h).
//
// Rank map rule: MPI ranks are given to instances in this order: every prefill instance in file
// order, then every decode instance in file order, then every colocated instance in file order;
// inside an instance, TP rank i is the i-th listed device and ranks are consecutive. So ranks
// [0, P) are prefill and [P, world) decode (or every rank colocated).
//
// Paths: a path between two endpoints is a chain of links whose intermediate endpoints are NICs
// or switches (devices never forward). The chosen path is the widest one (largest bottleneck
// bandwidth, where a NIC on the path also caps it at its own `gbps`); among equally wide paths
// the one with the least total latency, then the fewest links. Bottlenecks ignore contention
// between concurrent transfers. Topology::path_info() builds the endpoint graph per call
// (O(E log V)); callers that query in a loop use a PathFinder, which builds it once.
//
// Thread-safety: a Topology is a value; const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "topology/gpu_spec.h"
#include "topology/model_shape.h"

namespace pdsim::topo {

enum class LinkType : uint8_t { kNvlink, kPcie, kIb, kEthernet, kLoopback };
std::string_view link_type_name(LinkType type);  // "nvlink", "pcie", "ib", "ethernet", "loopback"
std::optional<LinkType> parse_link_type(std::string_view name);

enum class Role : uint8_t { kPrefill, kDecode, kColocated };
std::string_view role_name(Role role);  // "prefill", "decode", "colocated"
std::optional<Role> parse_role(std::string_view name);

inline constexpr std::string_view kCpuDeviceType = "cpu";

struct Device {
    std::string id;
    std::string type;   // a GPU model known to gpu_spec() ("H100"), or "cpu"
    int index = -1;     // device ordinal on its node (CUDA device); -1: its position in the list
    std::string cores;  // cores to bind its rank to ("0-13", "4", "0,2,4"); "": derived
    // Several ranks may run on it, time-sharing the device: several instances (a prefill and a
    // decode instance on a machine's one GPU), or several TP ranks of one instance, which lists
    // it more than once (TP 2 on a one-GPU machine). false: one rank at most.
    bool shared = false;
    [[nodiscard]] bool is_cpu() const { return type == kCpuDeviceType; }
    [[nodiscard]] const GpuSpec* gpu() const { return gpu_spec(type); }  // nullptr for cpu
    friend bool operator==(const Device&, const Device&) = default;
};

struct Nic {
    std::string id;
    LinkType type = LinkType::kIb;  // ib or ethernet
    double gbps = 0;                // port bandwidth per direction; caps every path through it
    friend bool operator==(const Nic&, const Nic&) = default;
};

struct Switch {
    std::string id;
    LinkType type = LinkType::kNvlink;  // the fabric it switches: an NVSwitch is nvlink
    friend bool operator==(const Switch&, const Switch&) = default;
};

struct Node {
    std::string id;
    std::string hostname;  // for the hostfile; the loader defaults it to id
    int cpus = 0;          // CPU cores on the host; 0: unknown
    std::vector<Device> devices;
    std::vector<Nic> nics;
    std::vector<Switch> switches;  // switches inside the node (an NVSwitch, a PCIe switch)
    friend bool operator==(const Node&, const Node&) = default;
};

struct Link {
    std::string a;  // endpoint ids: devices, NICs or switches
    std::string b;
    LinkType type = LinkType::kNvlink;
    double gbps = 0;        // per direction
    double latency_us = 0;  // one way, this hop
    friend bool operator==(const Link&, const Link&) = default;
};

struct Instance {
    std::string id;
    Role role = Role::kPrefill;
    int tp = 1;
    std::vector<std::string> devices;  // tp device ids; TP rank i runs on devices[i]
    std::vector<int> ranks;            // as declared in the file (checked); empty: not declared
    friend bool operator==(const Instance&, const Instance&) = default;
};

// How the CPU testbed shapes its transport to emulate a GPU cluster's link (see shaping.h).
struct ShapingSpec {
    std::string emulate;  // what is emulated, free text ("dgx-h100 cross-node GPU->GPU (IB)")
    LinkType type = LinkType::kIb;
    double gbps = 0;
    double latency_us = 0;
    std::string gpu;        // the GPU whose compute the CPU stands in for ("" = none given)
    double time_scale = 0;  // CPU time / GPU time; 0 = "auto": the testbed measures it
    friend bool operator==(const ShapingSpec&, const ShapingSpec&) = default;
};

// Where each field came from: file name and, for YAML (and JSON), the line of each field path
// ("instances[2].tp"). Does not take part in equality.
struct SourceInfo {
    std::string name;                            // file path or "<builder:dgx-h100>"
    std::unordered_map<std::string, int> lines;  // field path -> 1-based line
    // The line of `path` or of its nearest ancestor that has one; 0 when none.
    [[nodiscard]] int line_of(std::string_view path) const;
    // "name:line: path" (or "name: path" without a line).
    [[nodiscard]] std::string where(std::string_view path) const;
    friend bool operator==(const SourceInfo&, const SourceInfo&) { return true; }
};

struct PathInfo {
    bool found = false;
    std::vector<const Link*> links;  // in order from a to b; empty when a == b
    double bottleneck_gbps = 0;      // +inf when a == b; 0 when not found
    double latency_us = 0;           // sum of the links' latencies
};

struct RankInfo {
    int rank = 0;
    int instance = 0;  // index into Topology::instances
    Role role = Role::kPrefill;
    int tp_rank = 0;
    int tp_size = 1;
    int node = -1;  // index into Topology::nodes; -1 when the device is unknown
    std::string device;
    int device_index = 0;  // the device's ordinal on its node
};

// rank -> (node, device, instance, role, tp_rank), built by the rule above.
class RankMap {
public:
    RankMap() = default;
    RankMap(std::vector<RankInfo> ranks, std::vector<int> first_rank);

    [[nodiscard]] int world_size() const { return static_cast<int>(ranks_.size()); }
    [[nodiscard]] const RankInfo& at(int rank) const {
        return ranks_.at(static_cast<size_t>(rank));
    }
    [[nodiscard]] const std::vector<RankInfo>& ranks() const { return ranks_; }
    // The rank of TP rank 0 of `instance` (an index into Topology::instances).
    [[nodiscard]] int first_rank(int instance) const {
        return first_rank_.at(static_cast<size_t>(instance));
    }
    [[nodiscard]] int num_prefill_ranks() const;
    // The ranks of the node with index `node`, ascending.
    [[nodiscard]] std::vector<int> ranks_on_node(int node) const;

private:
    std::vector<RankInfo> ranks_;
    std::vector<int> first_rank_;
};

struct Topology;

// Path queries over one topology with the endpoint graph built once (Topology::path_info builds
// it per call). The topology must outlive the PathFinder and not change while it is used; the
// returned Link pointers point into it. Thread-safety: const methods may run concurrently.
class PathFinder {
public:
    explicit PathFinder(const Topology& topology);
    ~PathFinder();
    PathFinder(PathFinder&&) noexcept;
    PathFinder& operator=(PathFinder&&) noexcept;

    [[nodiscard]] PathInfo path_info(std::string_view a, std::string_view b) const;
    // Same answer as path_info(a, b).found, in O(degree) after an O(E) set-up.
    [[nodiscard]] bool reachable(std::string_view a, std::string_view b) const;

private:
    struct Graph;
    const Topology* topology_;
    std::unique_ptr<const Graph> graph_;
};

// Pairs (i, j) of TP ranks of a source group of size tp_src and a destination group of size
// tp_dst whose head slices overlap: rank i holds heads [i/tp_src, (i+1)/tp_src) of the whole,
// so each KV head moves from i to every j it overlaps. tp 2 -> 1: (0,0), (1,0).
std::vector<std::pair<int, int>> tp_overlap_pairs(int tp_src, int tp_dst);

struct Topology {
    std::string name;
    std::string description;
    std::optional<ModelShape> model;
    std::vector<Node> nodes;
    std::vector<Switch> switches;  // fabric switches outside any node
    std::vector<Link> links;
    std::vector<Instance> instances;
    std::optional<int> world_size;  // as declared; the rank map's size must equal it
    std::optional<ShapingSpec> shaping;
    SourceInfo source;

    friend bool operator==(const Topology&, const Topology&) = default;

    [[nodiscard]] const Device* find_device(std::string_view id) const;
    // Index into nodes of the node holding device (or NIC or node switch) `id`; -1 if none.
    [[nodiscard]] int node_index_of(std::string_view id) const;
    [[nodiscard]] int num_devices() const;
    // Sum of the instances' TP sizes.
    [[nodiscard]] int num_ranks() const;

    // Path queries between two endpoints (normally devices). Unknown ids: not found.
    [[nodiscard]] PathInfo path_info(std::string_view a, std::string_view b) const;
    [[nodiscard]] std::vector<const Link*> path(std::string_view a, std::string_view b) const;
    [[nodiscard]] double bottleneck_gbps(std::string_view a, std::string_view b) const;
    [[nodiscard]] double path_latency_us(std::string_view a, std::string_view b) const;

    // The rank map of a validated topology (instances with unknown devices get node -1).
    [[nodiscard]] RankMap rank_map() const;
};

}  // namespace pdsim::topo
