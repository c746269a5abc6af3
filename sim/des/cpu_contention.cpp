#include "sim/des/cpu_contention.h"

#include <algorithm>
#include <thread>

#include "sim/cost/cost_model.h"

namespace pdsim::des {

CpuContention CpuContention::plan(const topo::Topology& topology, std::span<const int> cpu_cores,
                                  std::span<const cost::CostModel* const> costs, double node_cpus) {
    CpuContention out;
    const size_t num_instances = topology.instances.size();
    out.forwards_.resize(num_instances);
    const size_t num_nodes = topology.nodes.size();
    std::vector<double> demand(num_nodes, 0);  // compute threads wanting the node's cores
    std::vector<int> cpu_instances(num_nodes, 0);
    std::vector<bool> interferes(num_nodes, false);
    std::vector<int> node_of(num_instances, -1);
    for (size_t i = 0; i < num_instances; ++i) {
        const int threads = cpu_cores[i];
        if (threads <= 0 || topology.instances[i].devices.empty()) continue;
        const int node = topology.node_index_of(topology.instances[i].devices.front());
        if (node < 0) continue;
        node_of[i] = node;
        const auto n = static_cast<size_t>(node);
        demand[n] += threads;
        ++cpu_instances[n];
        CpuForward& f = out.forwards_[i];
        f.interference[0] = costs[i]->interference(false);
        f.interference[1] = costs[i]->interference(true);
        if (f.interference[0] > 0 || f.interference[1] > 0) interferes[n] = true;
    }
    std::vector<int> contended_index(num_nodes, -1);
    for (size_t i = 0; i < num_instances; ++i) {
        if (node_of[i] < 0) continue;
        const auto n = static_cast<size_t>(node_of[i]);
        double cores = node_cpus > 0 ? node_cpus : topology.nodes[n].cpus;
        if (cores <= 0) cores = std::max(1u, std::thread::hardware_concurrency());
        // Neither oversubscribed nor slowed by each other's forwards: no contention to model.
        if (demand[n] <= cores && !(interferes[n] && cpu_instances[n] > 1)) continue;
        if (contended_index[n] < 0) {
            contended_index[n] = static_cast<int>(out.nodes_.size());
            out.nodes_.push_back(Node{cores, {}});
        }
        out.forwards_[i].node = contended_index[n];
        out.forwards_[i].cores = cpu_cores[i];
    }
    return out;
}

void CpuContention::start_forward(int instance, double isolated_s, bool decode, double now_s) {
    CpuForward& f = forward(instance);
    f.isolated_s = isolated_s;
    f.work_core_s = f.cores * isolated_s;
    f.rate_cores = 0;
    f.rate_since_s = now_s;
    f.decode = decode;
    f.slowed = false;
    nodes_[static_cast<size_t>(f.node)].active.push_back(instance);
}

int CpuContention::end_forward(int instance) {
    const int node = forward(instance).node;
    std::vector<int>& active = nodes_[static_cast<size_t>(node)].active;
    active.erase(std::find(active.begin(), active.end(), instance));
    return node;
}

std::span<const std::pair<double, int>> CpuContention::share(int node) {
    const Node& nd = nodes_[static_cast<size_t>(node)];
    // The kernel shares cores per runnable thread: every compute thread gets the same share, at
    // most one core, and a TP instance runs at its ranks' common pace.
    double threads = 0;
    for (int i : nd.active) threads += forward(i).cores;
    const double per_thread = std::min(1.0, nd.cores / threads);
    const bool shared = nd.active.size() > 1;
    rates_.clear();
    for (int i : nd.active) {
        const CpuForward& f = forward(i);
        const double slow = shared ? 1 + f.interference[f.decode ? 1 : 0] : 1;
        rates_.emplace_back(f.cores * per_thread / slow, i);
    }
    return rates_;
}

}  // namespace pdsim::des
