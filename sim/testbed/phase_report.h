// What rank 0 makes of one phase (colocated or disaggregated) of a testbed run once every rank's
// result is in (sim/testbed/testbed.cpp gathers them): the report's request figures, its
// per-rank entries and ordering checks, the request lifecycles and handoff times, the transfer
// summary from the engines' events (disaggregated: bytes, bandwidth, per-layer latency, how much
// of each request's transfer was exposed), and the Perfetto timeline's processes and slices.
//
// Thread-safety: none needed (rank 0's thread, after the phase). Blocking: none.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "sim/testbed/options.h"
#include "sim/testbed/protocol.h"
#include "sim/testbed/router.h"
#include "sim/testbed/server.h"

namespace pdsim::testbed {

// One phase's inputs (what the router and the ranks returned) and its report.
struct PhaseData {
    Phase phase;
    RouterResult router;
    std::map<uint64_t, double> prefill_end_ms;  // disagg: end of the request's last prefill forward
    std::vector<std::optional<RankResult>> results;  // by rank (nullopt: none came)
    metrics::Report report;
};

// Fills `phase.report` from the router's records and the ranks' results; `offsets` are the
// ranks' clock offsets to rank 0 (us) and `t_origin` the run's time origin on rank 0's clock (us).
// With `timeline`, also adds the phase's rank and request tracks to it.
void build_phase_report(const ResolvedConfig& cfg, PhaseData& phase,
                        const std::vector<double>& offsets, double t_origin,
                        metrics::Timeline* timeline);

// The report's "config" section: the command line and the settings of the run, with what
// `pdsim simulate --like` needs to replay it: topology_file, model_source, layers, kv_pool_mb and
// the request set.
[[nodiscard]] nlohmann::json testbed_config_json(const ResolvedConfig& cfg);
// config.request_set: the run's requests as columns (id, arrival_ms, input_len, output_len, and
// hash_ids when any request has prefix blocks).
[[nodiscard]] nlohmann::json request_set_json(const std::vector<workload::Request>& requests);

}  // namespace pdsim::testbed
