// The router: runs on a thread of rank 0 during a phase. It replays the requests by their
// (scaled) arrival times, assigns each to instances, and tracks its lifecycle on rank 0's clock.
//
// Assignment (least loaded, ties broken round-robin starting after the last choice):
//   colocated: the instance with the fewest outstanding tokens (assigned input not yet prefilled
//     + output not yet generated);
//   disaggregated: the prefill instance with the fewest assigned input tokens not yet prefilled,
//     and the decode instance with the fewest KV tokens (input + output) of unfinished requests.
// The request goes to the leader (TP rank 0) of each chosen instance ("submit").
//
// Lifecycle: arrival (the trace time, scaled, from the phase start), prefill start, first token
// (colocated: sampled at the end of the last prefill chunk; disaggregated: the decode instance
// has every layer and the first token), each token, finish. Remote timestamps are converted with
// the clock offsets estimated at start. The first terminal report wins: a request is completed
// ("done" ok) or failed (a failed "done" or "pdone", or no result within --request-timeout-s of
// its arrival plus a grace period: the router then fails it and tells its instances to drop it).
// So requests_completed + requests_failed == requests_submitted, always.
//
// Liveness: every rank but 0 sends a heartbeat on Channel::kHeartbeat once a second; a rank
// silent for --heartbeat-timeout-s (or whose reports stopped) is dead or hung: the router fails
// every unfinished request its instance holds ("instance X (rank R) silent for N s: dead or
// hung"), routes nothing more to it (requests that find no live instance of a role fail at
// once), lists it in RouterResult::dead_ranks, and the rest of the run goes on.
//
// When every request is terminal the router sends "end" to every instance leader.
// Thread-safety: run_router owns its state; it uses the mailbox's kRouter channel only.
#pragma once

#include <vector>

#include "common/status.h"
#include "sim/metrics/report.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/options.h"
#include "sim/testbed/result_journal.h"
#include "sim/testbed/server.h"

namespace pdsim::testbed {

struct RouterConfig {
    Phase phase = Phase::kDisagg;
    const ResolvedConfig* config = nullptr;
    Mailbox* mbox = nullptr;
    std::vector<double> offsets;  // per rank: its clock - rank 0's clock (us)
    bool progress = false;
    std::string label;  // for the progress line
    // Rank 0's journal (result_journal.h): told of the phase and of every request that reaches
    // its end, as it does. Null: none.
    ResultJournal* journal = nullptr;
};

struct RouterResult {
    std::vector<metrics::RequestRecord> records;  // times in ms from t_base
    std::vector<double> prefill_start_ms;         // per request; -1: unknown
    std::vector<std::vector<double>> token_ms;    // per request: time of each token
    double t_base_us = 0;                         // phase start on rank 0's clock
    double wall_s = 0;                            // phase start -> last request terminal
    std::vector<int> dead_ranks;                  // silent past --heartbeat-timeout-s
};

[[nodiscard]] Status run_router(const RouterConfig& config, RouterResult* result);

}  // namespace pdsim::testbed
