// Placement search: which split of a GPU budget serves a workload best under TTFT and TPOT SLOs.
//
// Candidates (enumerate_layouts), for a budget of N GPUs and the allowed TP sizes T:
//   disaggregated  P prefill instances of TP tp_p and D decode instances of TP tp_d, P, D >= 1,
//                  tp_p, tp_d in T, P * tp_p + D * tp_d <= N;
//   colocated      C instances of TP tp serving whole requests, C >= 1, tp in T, C * tp <= N;
//   either kind using at least min_gpus GPUs (default 1; N compares layouts of the whole budget).
// T (allowed_tp_sizes): the TP sizes that divide the model's heads (model::check_tp), fit in one
// NVLink domain (a DGX node of 8; a GB200 NVL72 rack of 72) and the budget, and leave KV memory
// after the bf16 weights (kv_capacity_pages).
// Each candidate is built with the topology builders (make_dgx / make_gb200_nvl72) on the budget's
// nodes (ceil(N / domain)); prefill instances first, then decode, none straddling a domain. A
// candidate that the builder cannot place there is listed, not run. Each one that builds is
// simulated (run_simulation, roofline costs) on the same requests.
// Ranking (rank_candidates): candidates whose SLO attainment >= the target first, by goodput per
// GPU used (goodput_rps / GPUs) descending; then the others by attainment, then goodput per GPU;
// then those not run. Ties: fewer GPUs, then the name. goodput_rps and slo_attainment are
// metrics::summarize_requests's (report.h), so at a fixed offered load the best candidate is the
// smallest layout that still meets the SLOs there.
//
// Thread-safety: run_search is reentrant; callbacks run on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"
#include "sim/cost/cost_model.h"
#include "sim/des/simulator.h"
#include "sim/metrics/report.h"
#include "sim/workload/workload.h"
#include "topology/topology.h"

namespace pdsim::des {

struct Layout {
    SimMode mode = SimMode::kDisagg;
    int prefill = 0;     // disagg: prefill instances; colocated: instances
    int prefill_tp = 0;  // disagg: their TP; colocated: the instances' TP
    int decode = 0;      // disagg only (0 when colocated)
    int decode_tp = 0;

    [[nodiscard]] int gpus() const { return prefill * prefill_tp + decode * decode_tp; }
    // "3P(tp4)+1D(tp8)" or "4x colocated tp4".
    [[nodiscard]] std::string name() const;
    friend bool operator==(const Layout&, const Layout&) = default;
};

[[nodiscard]] Layout disagg_layout(int prefill, int prefill_tp, int decode, int decode_tp);
[[nodiscard]] Layout colocated_layout(int instances, int tp);

struct SearchSpace {
    std::string gpu = "H100";  // a DGX GPU (A100, H100, H200, B200) or GB200 (NVL72 racks)
    int gpus = 8;              // the budget, >= 1
    bool disagg = true;
    bool colocated = true;
    std::vector<int> tp_sizes;  // restrict T to these (empty: no restriction)
    int min_gpus = 1;           // only candidates using at least this many GPUs
    int64_t max_candidates = 2000;
};

// GPUs of one NVLink domain for `gpu`: 8 (DGX) or 72 (GB200). kInvalidArgument naming --gpu for a
// GPU that has no builder.
[[nodiscard]] StatusOr<int> nvlink_domain(std::string_view gpu);

// T above, ascending. `notes` (optional) gets one line per TP size left out for memory.
// kInvalidArgument when no TP size is left.
[[nodiscard]] StatusOr<std::vector<int>> allowed_tp_sizes(
    const model::ModelConfig& model, const SearchSpace& space, const KvCapacityOptions& kv,
    std::vector<std::string>* notes = nullptr);

// Every candidate for TP sizes `tps`, in this order: disaggregated by (tp_p, tp_d, P, D), then
// colocated by (tp, C), all ascending. kInvalidArgument (naming --max-candidates) when there are
// more than space.max_candidates.
[[nodiscard]] StatusOr<std::vector<Layout>> enumerate_layouts(std::span<const int> tps,
                                                              const SearchSpace& space);

// The layout on the budget's nodes of `gpu` (see above). Colocated instances have the prefill
// role (the simulator's colocated mode ignores roles). kInvalidArgument when it cannot be placed.
[[nodiscard]] StatusOr<topo::Topology> layout_topology(std::string_view gpu, int budget,
                                                       const Layout& layout);

struct CandidateResult {
    Layout layout;
    bool ran = false;
    std::string error;   // why it was not run (ran == false)
    bool meets = false;  // slo_attainment >= the target
    double goodput_rps = 0;
    double goodput_per_gpu = 0;
    double slo_attainment = 0;
    double throughput_tokens_s = 0;
    metrics::Percentiles ttft_ms, tpot_ms;
    int64_t requests_completed = 0;
    int64_t requests_failed = 0;
    int64_t preemptions = 0;
    double sim_s = 0;   // simulated makespan
    double wall_s = 0;  // the simulation's wall time
};

// Orders `results` as described above (stable for equal keys).
void rank_candidates(std::vector<CandidateResult>* results);

struct SearchProgress {
    int64_t index = 0;  // 1-based, the candidate just finished
    int64_t total = 0;
    const CandidateResult* result = nullptr;
};

struct SearchOptions {
    SearchSpace space;
    // Everything but topology, topology_label, instances and mode (which each candidate sets):
    // model, batching, SLOs, page size, layerwise, prefix cache, KV admission. Callbacks and the
    // timeline are ignored.
    SimConfig base;
    KvCapacityOptions kv;
    cost::RooflineOptions roofline;
    double attainment_target = 0.9;  // in (0, 1]
    std::function<void(const SearchProgress&)> on_candidate;
};

struct SearchResult {
    std::vector<CandidateResult> ranked;  // rank_candidates order
    std::vector<int> tp_sizes;            // T
    std::vector<std::string> notes;       // TP sizes left out, and why
    int64_t candidates = 0;
    double wall_s = 0;
};

// Enumerates, builds and simulates every candidate on `requests` (sorted by arrival, relative to
// time 0). kInvalidArgument for bad options (a name of the flag in the message); a candidate that
// fails to build or simulate is listed with its error, not fatal.
[[nodiscard]] StatusOr<SearchResult> run_search(const SearchOptions& options,
                                                std::span<const workload::Request> requests);

}  // namespace pdsim::des
