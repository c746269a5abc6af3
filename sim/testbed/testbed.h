// `pdsim testbed`: the multi-rank PD serving testbed (docs/design.md "The pdsim command line").
//
// Process model: under mpirun every MPI rank is one topology rank (the world size must equal the
// topology's rank count); without a launcher (world size 1) every rank runs as a thread of this
// process over the `local` transport. MPI is initialized with MPI_THREAD_MULTIPLE.
//
// A run: every rank loads the same configuration (options.h), builds the synthetic model (with
// a TP group per instance), estimates its clock offset to rank 0, then runs the phases of
// --mode (both: colocated first, then disaggregated, on the same requests): each phase starts
// with a barrier, rank 0 starts the router (router.h) and every rank runs its server
// (server.h); at the end every rank sends rank 0 its timeline, transfer events, ordering report
// and stats, and rank 0 builds the report.
//
// Report (sim/metrics/report.h keys; times on rank 0's clock; definitions in docs/testbed.md):
//   TTFT: arrival -> first token available (colocated: sampled by the last prefill chunk;
//     disaggregated: the decode instance holds every layer and the first token).
//   transfer.bytes: KV payload bytes received by decode ranks; gbps: bytes / the time at least
//     one layer send was in flight (posted -> send completed, union over all prefill ranks);
//     layer_latency_us: per (request, layer), the layer's step ready on the prefill side (last
//     chunk, latest TP rank) -> the layer landed on the decode side;
//     exposed_fraction: sum over requests of (last layer landed - end of the prefill forward
//     that computed the last chunk, clamped to [0, transfer time]) / sum over requests of the
//     transfer time (first layer send posted -> last layer landed).
//   ordering: the validators of every rank (sender, receiver, after-send) plus the testbed's own
//     StepCounter check (an extend forward must publish exactly num_layers steps).
//   outputs_match (--mode both): every request completed in both runs with identical tokens.
// Exit status: 0 when every request completed, no ordering violation and (both) outputs match;
// 2 for bad input; 1 otherwise (the report is written first). A run that stops early (a phase
// fails, SIGTERM or SIGINT) still writes a report of what finished, from rank 0's journal
// (result_journal.h; 128 + the signal's number on a signal).
//   requests_lost: 0, or (stopped early) the requests that had not finished, named.
//
// Output: only rank 0 prints (summary table on stdout, progress on stderr) and writes files.
#pragma once

#include "common/status.h"
#include "sim/testbed/options.h"

namespace pdsim::testbed {

struct RunInfo {
    int rank = 0;                // this process's rank (0 when in-process)
    bool error_printed = false;  // rank 0 already printed "pdsim: error: ..." (before the other
                                 // ranks were released, so mpirun cannot cut it off)
};

// Runs the testbed. Every rank returns the run's outcome (rank 0's decision is broadcast).
[[nodiscard]] Status run_testbed(const TestbedOptions& options, RunInfo* info);

}  // namespace pdsim::testbed
