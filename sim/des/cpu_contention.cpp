#include "sim/des/cpu_contention.h"

#include <algorithm>
#include <cstddef>
#include <thread>

#include "sim/cost/cost_model.h"

namespace pdsim::des {

double CpuContention::node_cores(const topo::Topology& topology, size_t node, double node_cpus) {
    double cores = node_cpus > 0 ? node_cpus : topology.nodes[node].cpus;
    if (cores <= 0) cores = std::max(1u, std::thread::hardware_concurrency());
    return cores;
}

CpuContention CpuContention::plan(const topo::Topology& topology, std::span<const int> cpu_cores,
                                  std::span<const cost::CostModel* const> costs, double node_cpus,
                                  std::span<const int> rank_core) {
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
    // Bound ranks: each instance's threads per core, and each node's most loaded core.
    const bool bound = !rank_core.empty();
    std::vector<double> busiest_core(num_nodes, 0);
    if (bound) {
        const topo::RankMap map = topology.rank_map();
        std::vector<std::vector<std::pair<int, double>>> node_cores(num_nodes);
        auto add = [](std::vector<std::pair<int, double>>& cores, int core, double threads) {
            auto it = std::find_if(cores.begin(), cores.end(),
                                   [core](const auto& c) { return c.first == core; });
            if (it == cores.end()) {
                cores.emplace_back(core, threads);
            } else {
                it->second += threads;
            }
        };
        for (int r = 0; r < map.world_size() && static_cast<size_t>(r) < rank_core.size(); ++r) {
            const topo::RankInfo& info = map.at(r);
            const auto i = static_cast<size_t>(info.instance);
            // Not a CPU instance, or a TP rank on another node than the instance's first: only
            // the instance's own node is modelled.
            if (i >= num_instances || node_of[i] < 0 || info.node != node_of[i]) continue;
            const double threads =
                static_cast<double>(cpu_cores[i]) / std::max(1, topology.instances[i].tp);
            const int core = rank_core[static_cast<size_t>(r)];
            add(out.forwards_[i].core_threads, core, threads);
            add(node_cores[static_cast<size_t>(info.node)], core, threads);
        }
        for (size_t n = 0; n < num_nodes; ++n) {
            for (const auto& [core, threads] : node_cores[n]) {
                busiest_core[n] = std::max(busiest_core[n], threads);
            }
        }
        for (CpuForward& f : out.forwards_) std::sort(f.core_threads.begin(), f.core_threads.end());
    }
    std::vector<int> contended_index(num_nodes, -1);
    for (size_t i = 0; i < num_instances; ++i) {
        if (node_of[i] < 0) continue;
        const auto n = static_cast<size_t>(node_of[i]);
        const double cores = node_cores(topology, n, node_cpus);
        // Neither oversubscribed nor slowed by each other's forwards: no contention to model.
        const bool oversubscribed = bound ? busiest_core[n] > 1 : demand[n] > cores;
        if (!oversubscribed && !(interferes[n] && cpu_instances[n] > 1)) continue;
        if (contended_index[n] < 0) {
            contended_index[n] = static_cast<int>(out.nodes_.size());
            out.nodes_.push_back(Node{cores, bound, {}});
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

int CpuContention::competitors(int instance) const {
    const CpuForward& mine = forward(instance);
    if (mine.node < 0) return 0;
    const Node& nd = nodes_[static_cast<size_t>(mine.node)];
    const auto shares_a_core = [&](int other) {
        if (!nd.bound) return true;
        for (const auto& [core, threads] : forward(other).core_threads) {
            for (const auto& [my_core, my_threads] : mine.core_threads) {
                if (core == my_core) return true;
            }
        }
        return false;
    };
    int count = 0;
    for (int other : nd.active) {
        if (other != instance && shares_a_core(other)) ++count;
    }
    return count;
}

void CpuContention::fill_bound(const Node& nd) {
    fill_.clear();
    thread_rate_.assign(nd.active.size(), -1);  // -1: still rising
    auto core_fill = [this](int core) -> CoreFill& {
        for (CoreFill& c : fill_) {
            if (c.core == core) return c;
        }
        return fill_.emplace_back(CoreFill{core, 0, 0, 0});
    };
    for (int i : nd.active) {
        for (const auto& [core, threads] : forward(i).core_threads) {
            CoreFill& c = core_fill(core);
            c.unfrozen += threads;
            ++c.forwards;
        }
    }
    // Progressive filling: every rising forward's per-thread share grows together until a core
    // is full (or the share reaches one core); the forwards on a full core stop there.
    size_t rising = nd.active.size();
    while (rising > 0) {
        double level = 1;
        for (const CoreFill& c : fill_) {
            if (c.unfrozen > 0) level = std::min(level, (1 - c.used) / c.unfrozen);
        }
        level = std::max(level, 1e-9);  // retime() needs a rate > 0
        const size_t before = rising;
        for (bool force : {false, true}) {
            for (size_t k = 0; k < nd.active.size(); ++k) {
                if (thread_rate_[k] >= 0) continue;
                const CpuForward& f = forward(nd.active[k]);
                bool stops = force || level >= 1;
                for (const auto& [core, threads] : f.core_threads) {
                    const CoreFill& c = core_fill(core);
                    if (c.used + c.unfrozen * level >= 1 - 1e-9) stops = true;
                }
                if (!stops) continue;
                // Moving its threads from rising to used at `level` keeps every core's total.
                for (const auto& [core, threads] : f.core_threads) {
                    CoreFill& c = core_fill(core);
                    c.used += threads * level;
                    c.unfrozen -= threads;
                }
                thread_rate_[k] = level;
                --rising;
            }
            if (rising < before) break;  // the forced pass only guards against rounding
        }
    }
}

std::span<const std::pair<double, int>> CpuContention::share(int node) {
    const Node& nd = nodes_[static_cast<size_t>(node)];
    rates_.clear();
    if (nd.bound) {
        fill_bound(nd);
        for (size_t k = 0; k < nd.active.size(); ++k) {
            const CpuForward& f = forward(nd.active[k]);
            // Bound, a forward interferes with those that share one of its cores.
            bool shares_a_core = false;
            for (const auto& [core, threads] : f.core_threads) {
                for (const CoreFill& c : fill_) {
                    if (c.core == core && c.forwards > 1) shares_a_core = true;
                }
            }
            const double slow = shares_a_core ? 1 + f.interference[f.decode ? 1 : 0] : 1;
            rates_.emplace_back(f.cores * thread_rate_[k] / slow, nd.active[k]);
        }
        return rates_;
    }
    // The kernel shares cores per runnable thread: every compute thread gets the same share, at
    // most one core, and a TP instance runs at its ranks' common pace.
    double threads = 0;
    for (int i : nd.active) threads += forward(i).cores;
    const double per_thread = std::min(1.0, nd.cores / threads);
    const bool shared = nd.active.size() > 1;
    for (int i : nd.active) {
        const CpuForward& f = forward(i);
        const double slow = shared ? 1 + f.interference[f.decode ? 1 : 0] : 1;
        rates_.emplace_back(f.cores * per_thread / slow, i);
    }
    return rates_;
}

}  // namespace pdsim::des
