// CPU core contention between simulated CPU instances on one node (SimConfig::cpu_contention,
// docs/simulator.md section 1): processor sharing per compute thread.
//
// An instance with cpu_cores = k > 0 runs k compute threads; a forward of isolated duration T is
// k x T core-seconds of work. While the forwards of a node's instances run together, every compute
// thread gets min(1, node cores / threads running on the node) cores, and a forward that shares
// the node with another also runs 1 + interference times slower (the cost model's
// CostModel::interference for its kind). A forward's rate therefore changes only when a forward
// on its node starts or ends; between those instants it progresses linearly.
//
// Where the ranks are bound to cores (SimConfig::rank_core; mpirun --bind-to core), each core is
// shared instead: the threads bound to a core split it evenly, a TP instance runs at the pace of
// its slowest rank (its ranks meet in an all-gather every layer), and what a bottlenecked
// instance leaves of a core goes to the others on it (max-min fairness per thread by progressive
// filling, the kernel's per-core fair share with waiters that yield). The 2p1d TP-2 example on
// 2 cores binds ranks 0, 2, 4 (both prefill instances' TP rank 0 and the decode rank) to core 0,
// so a decode forward beside one prefill forward gets half a core, beside two a third, where the
// node-wide rule would give it 2/3 and 2/5. Interference then slows a forward while another
// forward runs on one of its cores.
//
// Only nodes that can contend are modelled (CpuContention::plan): where the CPU instances'
// threads together exceed the cores (bound: where a core has more than one thread), or where two
// of them share the node and one's cost model reports interference. The other instances keep the
// simulator's one-event-per-forward path.
//
// The simulator owns the events: share() returns the new rates and CpuForward keeps the state
// (work left, rate, end event) that the simulator moves forward with retime().
//
// Thread-safety: none (the simulator's thread). Cost: share() is O(forwards on the node), no
// allocation once the scratch has grown.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "sim/des/event_loop.h"
#include "topology/topology.h"

namespace pdsim::cost {
class CostModel;
}

namespace pdsim::des {

// The forward in flight of one contended instance.
struct CpuForward {
    int node = -1;     // index into CpuContention's nodes; -1: not contended
    double cores = 0;  // its compute threads: the rate (cores) at which it runs alone
    double interference[2] = {0, 0};  // extend, decode (cost::CostModel::interference)
    double isolated_s = 0;            // the forward's duration alone
    double work_core_s = 0;           // core-seconds left at rate_since_s
    double rate_cores = 0;            // current rate
    double rate_since_s = 0;          // when work_core_s was last brought up to date
    bool decode = false;              // the forward's kind
    bool slowed = false;              // it ran below `cores` at some point
    // Bound nodes: the cores its threads are bound to, as (core id, threads on it), ascending.
    std::vector<std::pair<int, double>> core_threads;
    EventLoop::EventId end_event = 0;

    // Brings the work left up to `now_s` at the current rate (never below 0).
    void advance(double now_s) {
        work_core_s = std::max(0.0, work_core_s - rate_cores * (now_s - rate_since_s));
    }
    // Runs at `rate` from `now_s` on (rate > 0); returns the time left until the forward ends.
    double retime(double rate, double now_s) {
        rate_since_s = now_s;
        rate_cores = rate;
        if (rate < cores) slowed = true;
        return work_core_s / rate;
    }
};

class CpuContention {
public:
    struct Node {
        double cores = 1;
        bool bound = false;       // its ranks are bound to cores: shared per core
        std::vector<int> active;  // instances whose forward is in flight, in start order
    };

    CpuContention() = default;
    // Which instances contend (see the file comment). `cpu_cores[i]` and `costs[i]` are instance
    // i's InstanceSetup::cpu_cores and cost model (non-null); a node's cores are `node_cpus` when
    // > 0, else the topology node's `cpus`, else std::thread::hardware_concurrency().
    // `rank_core`: empty, ranks run anywhere on their node; else, per rank of the topology's rank
    // order, the core (an id on its node, >= 0) that rank's compute threads are bound to.
    // Precondition: cpu_cores.size() == costs.size() == topology.instances.size(); rank_core is
    // empty or has topology.num_ranks() ids, each >= 0 (SimConfig's checks).
    static CpuContention plan(const topo::Topology& topology, std::span<const int> cpu_cores,
                              std::span<const cost::CostModel* const> costs, double node_cpus,
                              std::span<const int> rank_core = {});

    // The cores of topology node `node` as the model counts them: `node_cpus` when > 0, else the
    // node's `cpus`, else std::thread::hardware_concurrency() (the testbed runs a cpu topology on
    // the machine that runs it).
    [[nodiscard]] static double node_cores(const topo::Topology& topology, size_t node,
                                           double node_cpus);

    [[nodiscard]] bool contended(int instance) const { return forward(instance).node >= 0; }
    [[nodiscard]] CpuForward& forward(int instance) {
        return forwards_[static_cast<size_t>(instance)];
    }
    [[nodiscard]] const CpuForward& forward(int instance) const {
        return forwards_[static_cast<size_t>(instance)];
    }
    [[nodiscard]] const std::vector<Node>& nodes() const { return nodes_; }

    // A forward of isolated duration `isolated_s` starts at `now_s` on contended `instance`: it is
    // added to its node with all its work left and rate 0 (the caller then calls share()).
    void start_forward(int instance, double isolated_s, bool decode, double now_s);
    // The forward of contended `instance` ended: removed from its node; returns the node.
    int end_forward(int instance);
    // The rate (cores) of every forward in flight on `node`, as (rate, instance) in start order.
    // Valid until the next call.
    [[nodiscard]] std::span<const std::pair<double, int>> share(int node);
    // Whether a forward of another instance is in flight on a core that contended `instance`'s
    // threads need (bound nodes: a core it is bound to; else anywhere on its node): work that
    // reaches it idle then waits for the kernel to schedule its threads (SimConfig::core_wait_s).
    // O(forwards on the node x cores of each); false for an instance that is not contended.
    [[nodiscard]] bool core_busy_for(int instance) const { return competitors(instance) > 0; }
    // How many other instances' forwards are in flight on a core that contended `instance`'s
    // threads need (as core_busy_for); 0 for an instance that is not contended.
    [[nodiscard]] int competitors(int instance) const;

private:
    std::vector<CpuForward> forwards_;  // per instance
    std::vector<Node> nodes_;
    // Bound nodes: per-thread core share of each active forward (progressive filling).
    void fill_bound(const Node& node);

    std::vector<std::pair<double, int>> rates_;  // share() scratch
    struct CoreFill {
        int core = 0;
        double used = 0;      // capacity taken by frozen forwards
        double unfrozen = 0;  // threads of forwards still rising
        int forwards = 0;     // active forwards with threads on it
    };
    std::vector<CoreFill> fill_;       // share() scratch (bound)
    std::vector<double> thread_rate_;  // share() scratch (bound), per active forward
};

}  // namespace pdsim::des
