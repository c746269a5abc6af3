// The discrete-event simulator of PD serving: the testbed's scheduling on simulated time, with
// forward times from cost models and KV transfers as max-min fair flows over the topology's
// links. docs/simulator.md has the model, the assumptions and the figures.
//
//   SimConfig c;  c.topology = ...; c.model = ...;
//   c.instances = make_instance_setups(topology, model, "roofline", nullptr, {}).value();
//   StatusOr<SimResult> r = run_simulation(c, requests);   // r->report: the testbed's keys
//
// What is simulated (disaggregated mode; colocated: every instance serves whole requests,
// alternating extend and decode forwards like the testbed):
//   routing      policy::LoadBalancer (least loaded, ties round-robin), at arrival.
//   prefill      per instance: FCFS admission when its prompt's KV pages are free (the prefix
//                cache's hit blocks are pinned and not allocated again); extend forwards planned
//                by policy::ExtendPlanner; a hit's tokens are the first chunk's cached_tokens and
//                are not computed. Pages are held until the request's KV transfer completed.
//   memory       a request holds pages of its instance's pool per layer group (kv_groups.h: a
//                dense model's page spans every layer; a hybrid's sliding layers keep a window's
//                pages, its recurrent layers a fixed state per request).
//   transfer     each chunk's KV (its tokens' KV per layer group, kv_groups.h) is a flow over
//                the path(s) between the prefill and the decode instance's devices (one lane per
//                pair of TP ranks whose KV heads overlap). Layerwise: the flow starts with the
//                extend forward and is rate capped at bytes / forward time until the forward ends
//                (it cannot overtake the layers being written), then uncapped; --layerwise off: it
//                starts uncapped when the forward ends. A chunk computed before the decode
//                instance admitted the request waits for that admission (the receiver's pages),
//                then goes uncapped.
//   decode       per instance: FCFS admission when the prompt's pages are free; a request joins the
//                continuous batch once its KV is complete (its first token: stamped when the
//                decode scheduler next looks, i.e. at once when idle, else when its forward ends,
//                as in the testbed); decode forwards planned by policy::DecodePlanner; pages grow
//                with the generated tokens; when the pool is out of pages the newest running
//                request is preempted (pages freed, back to the front of the admission queue; on
//                readmission its prompt + generated tokens are recomputed by extend forwards on the
//                instance that decodes it, and the recompute samples its next token).
//   metrics      metrics::RequestRecord per request (TTFT, TPOT, E2E from the simulated times, the
//                transfer's bytes, time and exposed part) and the report's transfer summary.
// One event per forward per instance (never per token per request), one per arrival time, and
// the flow network's events. Memory: O(requests in flight) plus one RequestRecord per request.
//
// Thread-safety: run_simulation is reentrant (no globals); a SimConfig's cost models are shared
// immutable objects. The timeline, if any, is written from the calling thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"
#include "sim/cost/cost_model.h"
#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "sim/policy/batching.h"
#include "sim/workload/workload.h"
#include "topology/topology.h"

namespace pdsim::des {

enum class SimMode { kDisagg, kColocated };
[[nodiscard]] std::string_view sim_mode_name(SimMode mode);  // "disagg" | "colocated"

// One topology instance as the simulator sees it.
struct InstanceSetup {
    std::shared_ptr<const cost::CostModel> cost;  // required
    int64_t kv_pages = 0;    // KV pool of the instance, pages (>= 0) of kv_groups.h's footprint
    int kv_dtype_bytes = 2;  // bytes per KV element (transfer sizes)
    // CPU instances: cores one forward keeps busy when it runs alone (tp ranks x compute threads
    // per rank, what the cost model was calibrated with); 0: not a CPU instance (no contention).
    int cpu_cores = 0;
};

struct KvCapacityOptions {
    int page_size = 16;         // tokens per page (the testbed's --page-size)
    double mem_fraction = 0.9;  // GPU: share of HBM for weights + KV cache
    int64_t kv_pool_mb = 512;   // CPU: KV pool per rank, MiB (the testbed's --kv-pool-mb)
};

// The cost-model spec of topology instance `instance`: device of its TP rank 0 (canonical GPU name
// or "cpu"), TP size, the bottleneck link between its devices, KV dtype (bf16 on GPUs, fp32 on
// the CPU testbed).
[[nodiscard]] StatusOr<cost::InstanceSpec> instance_spec(const topo::Topology& topology,
                                                         const model::ModelConfig& model,
                                                         int instance);
// KV pages of an instance (every TP rank holds every token's head slice, so the instance holds
// what one rank holds): GPU: (HBM x mem_fraction - bf16 weights / tp) / page bytes per rank;
// CPU: kv_pool_mb / page bytes per rank, as the testbed sizes its pools. A page is kv_groups.h's:
// page_size tokens of every layer for a dense model, of one attention layer for a hybrid (whose
// requests then hold pages per layer group and state). kInvalidArgument when the weights do not
// fit.
[[nodiscard]] StatusOr<int64_t> kv_capacity_pages(const topo::Topology& topology,
                                                  const model::ModelConfig& model, int instance,
                                                  const KvCapacityOptions& options);
// Every instance's setup: cost::make_cost_model(cost_kind, instance_spec(...), file, roofline)
// and kv_capacity_pages(...); cpu_cores = tp x the thread count of the file's fit for that tp
// (1 when absent or ambiguous). Errors name the instance.
[[nodiscard]] StatusOr<std::vector<InstanceSetup>> make_instance_setups(
    const topo::Topology& topology, const model::ModelConfig& model, const std::string& cost_kind,
    const cost::CostFile* file, const KvCapacityOptions& kv,
    const cost::RooflineOptions& roofline = {});

struct SimProgress {
    int64_t finished = 0;  // requests terminal so far
    int64_t total = 0;
    double sim_s = 0;   // simulated clock
    double wall_s = 0;  // since run_simulation started
    uint64_t events = 0;
};

struct SimConfig {
    topo::Topology topology;     // validated (topo::validate) against `model`
    std::string topology_label;  // for the report
    model::ModelConfig model;
    std::vector<InstanceSetup> instances;  // one per topology.instances entry
    SimMode mode = SimMode::kDisagg;
    bool layerwise = true;
    bool prefix_cache = true;  // on prefill (and colocated) instances; dense models only
    // Decode-side (and colocated) admission: false, pages for the prompt, growing with the output
    // (preemption when short); true, prompt + output reserved at admission, as the testbed does
    // (never preempts).
    bool reserve_output = false;
    int page_size = 16;
    policy::BatchingOptions batching;  // the testbed's defaults
    // CPU core contention (docs/simulator.md section 1): the forwards of instances with
    // cpu_cores > 0 on one node share its cores as processor sharing per compute thread (each of
    // an instance's cpu_cores threads gets min(1, cores / threads running on the node), as the
    // kernel's scheduler shares them); a forward's isolated duration T is cpu_cores x T
    // core-seconds of work.
    // node_cpus: cores of every node (> 0), else the node's `cpus`, else
    // std::thread::hardware_concurrency() (the testbed runs a cpu topology on this machine).
    // rank_core: empty, a node's ranks run on any of its cores (the rule above); else per rank
    // (the topology's rank order) the core id (>= 0) it is bound to, as `mpirun --bind-to core`
    // binds the testbed's ranks: each core is then shared by the threads bound to it
    // (cpu_contention.h).
    bool cpu_contention = true;
    double node_cpus = 0;
    std::vector<int> rank_core;
    // The wait for a core (cost::CoreWait, `pdsim calibrate`'s core_wait): when work reaches an
    // idle contended instance (a request routed to it, a request's KV landed) while another
    // instance's forward runs on its cores, its next forward starts core_wait_s later (its
    // threads wait for the kernel to schedule them). 0: at once.
    double core_wait_s = 0;
    // The wait between a contended instance's own decode forwards (cost::StepWait, `pdsim
    // calibrate`'s step_wait): when a decode forward ends while n other instances' forwards run
    // on its cores, its next forward starts, with chance step_wait.decode[min(n, size) - 1].chance,
    // that entry's wait_s later (what the decode thread's scheduler slice costs the step);
    // otherwise at once. The wait is not idle time for the warm-up (cost::CostWake). Drawn from a
    // generator per instance seeded with noise_seed (reproducible; drawn whether or not cost_noise
    // is on). Empty: never.
    cost::StepWait step_wait;
    // Forward-time variation (cost::CostNoise) where an instance's cost model measured it; drawn
    // from a generator seeded with noise_seed and the instance index (a run is reproducible).
    bool cost_noise = true;
    uint64_t noise_seed = 1;
    metrics::Slo slo;
    // Optional outputs. The timeline gets one track per instance (forwards, sampled transfers) and
    // the lifecycle of every `timeline_sample`-th request (by position in the trace); forward
    // slices stop after timeline_max_forwards.
    metrics::Timeline* timeline = nullptr;  // not owned
    int timeline_pid_base = 0;              // process ids used: base + [0, instances]
    int64_t timeline_sample = 1;
    int64_t timeline_max_forwards = 20000;
    // Called as each request becomes terminal (completed or failed), in simulated-time order.
    std::function<void(const metrics::RequestRecord&)> on_request_done;
    // Called about every progress_interval_s of wall time, and once at the end.
    std::function<void(const SimProgress&)> on_progress;
    double progress_interval_s = 0.5;
};

struct SimStats {
    uint64_t events = 0;  // events run by the loop (the flow network's included)
    double wall_s = 0;    // run_simulation's own time (excluding trace loading)
    double cpu_s = 0;     // CPU time of the calling thread during the run
    double sim_s = 0;     // simulated time at the end
    int64_t extend_forwards = 0;
    int64_t decode_forwards = 0;
    int64_t prefill_tokens = 0;  // tokens computed by extend forwards (recomputes included)
    int64_t prefix_hit_tokens = 0;
    int64_t preemptions = 0;
    int64_t flows = 0;
    int64_t max_in_flight = 0;       // most requests admitted-but-unfinished at once
    bool bundled_lanes = false;      // one flow per chunk (symmetric lanes) instead of one per lane
    int64_t contended_forwards = 0;  // forwards that ran slower than alone (CPU core sharing)
    int64_t step_waits = 0;          // decode forwards followed by a step wait (SimConfig)
};

struct SimResult {
    metrics::Report report;  // testbed keys; extra.simulator holds SimStats and the cost models
    std::vector<metrics::RequestRecord> records;  // by position in `requests` (no token ids)
    SimStats stats;
};

// Runs the simulation of `requests` (sorted by arrival_ms, which is relative to time 0) on
// `config`. kInvalidArgument for a config that does not match the topology or unsorted requests.
// A request that could never fit an instance's KV pool fails (counted, with the reason); every
// other request completes, so requests_completed + requests_failed == requests_submitted.
[[nodiscard]] StatusOr<SimResult> run_simulation(const SimConfig& config,
                                                 std::span<const workload::Request> requests);

}  // namespace pdsim::des
