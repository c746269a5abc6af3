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
// Lifecycle: arrival (the trace time, scaled, from the phase start), the router's queue,
// dispatch, prefill start, first token (colocated: sampled at the end of the last prefill chunk;
// disaggregated: the decode instance has every layer and the first token), each token, finish.
// Remote timestamps are converted with the clock offsets estimated at start. The first terminal
// report wins: a request is completed ("done" ok) or failed (a failed "done" or "pdone", or its
// deadline below: the router then fails it and tells its instances to drop it, and they abort
// its transfers, keeping its pages until no transfer can land in them). So
// requests_completed + requests_failed == requests_submitted, always.
//
// Backpressure: at most effective_max_inflight() requests are in flight per instance -- on a
// prefill instance until its prefill is done, on a decode (or colocated) instance until it is
// terminal. Arrivals wait in the router's queue and are dispatched in arrival order (the head
// waits until a prefill and a decode instance -- colocated: an instance -- have room; so does
// every later arrival). RequestRecord::queue_ms is the time a request waited there (arrival ->
// dispatch): the report's queue_ms percentiles and the requests CSV's queue_ms column.
//
// Deadlines: --request-timeout-s is "no progress for this long", not a bound on the wait. A
// request's clock starts at dispatch (never while it waits in the router's queue) and restarts
// at each of its own reports (first token, prefill done) and at every sign of progress of the
// instance it waits on (its prefill instance until the prefill is done, then its decode
// instance; colocated: its instance): any report from a rank of that instance, or a heartbeat
// whose progress count (forwards run, KV layers moved) changed. A request waiting in its
// instance's queue behind others that move is not failed; one whose instance stops moving (a
// hung forward or transfer, while its heartbeat thread lives) fails after --request-timeout-s
// plus a grace period ("no progress for N s (router timeout ...)"), which lets the engine's own
// timeout (also "no progress": transfer::EngineOptions::request_timeout) report first. A dead
// instance is the heartbeat's business (below). A request lost by a busy instance is failed
// only once that instance stops moving.
//
// Liveness: every rank but 0 sends a heartbeat on Channel::kHeartbeat once a second (with its
// progress count, RankContext::progress), and under mpirun rank 0 pulses every rank the same way
// (a rank that stops hearing it ends the job: testbed.cpp, Heartbeat); a rank
// silent for --heartbeat-timeout-s (or whose reports stopped) is dead or hung: the router fails
// every unfinished request its instance holds ("instance X (rank R) silent for N s: dead or
// hung"), routes nothing more to it (once no live instance of a role is left, every request
// not yet served fails at once, those still to arrive included), lists it in
// RouterResult::dead_ranks, and the rest of the run goes on.
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
    std::vector<std::vector<double>> token_ms;    // per request: time of each token
    double t_base_us = 0;                         // phase start on rank 0's clock
    double wall_s = 0;                            // phase start -> last request terminal
    std::vector<int> dead_ranks;                  // silent past --heartbeat-timeout-s
    // The KV-level parity check (kv_digest.h): requests whose decode-side digest was compared
    // with the prefill side's, and those that differed (each of them failed).
    int64_t kv_digests_checked = 0;
    std::vector<uint64_t> kv_digest_mismatches;
};

[[nodiscard]] Status run_router(const RouterConfig& config, RouterResult* result);

// The in-flight bound per instance (Backpressure): --max-inflight-per-instance, or for 0 (auto)
// min(--max-decode-batch, the requests of the trace's mean input + output length that one TP-1
// rank's KV pool holds), at least 1.
[[nodiscard]] int64_t effective_max_inflight(const ResolvedConfig& config);

}  // namespace pdsim::testbed
