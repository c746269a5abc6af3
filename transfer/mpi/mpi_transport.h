// "mpi": a two-sided Transport over nonblocking MPI point-to-point (see transfer/transport.h).
//
// - Its own communicator: MPI_Comm_dup(MPI_COMM_WORLD) at creation (collective: every rank creates
//   its transport at the same point), so its tags never meet the application's traffic; the error
//   handler is MPI_ERRORS_RETURN and every MPI call is checked (MPI_CHECK), so MPI errors become
//   Status values instead of aborting the job.
// - One progress thread per transport makes every MPI call of the data path (MPI_Isend,
//   MPI_Irecv, MPI_Testsome, MPI_Cancel). Posting threads only append to a queue under a mutex
//   and signal a condition variable: they never block on MPI, whatever the thread level. While
//   operations are active the progress thread polls MPI_Testsome (yielding between polls; after
//   100 ms without any completion it backs off to 200 us sleeps until something happens), and it
//   sleeps on the condition variable when nothing is active.
// - MPI must be initialized with at least MPI_THREAD_SERIALIZED; MPI_THREAD_MULTIPLE is needed
//   when the application itself calls MPI while a transport exists (the normal case). If MPI is
//   not initialized, creation calls MPI_Init_thread(MPI_THREAD_MULTIPLE) and finalizes at exit.
//   Close every mpi transport before MPI_Finalize.
// - Rank and world size come from MPI_COMM_WORLD (TransportOptions.rank/world_size are ignored).
//   max_tag is the communicator's MPI_TAG_UB; messages are limited to INT_MAX bytes.
// - Cancel: a receive is withdrawn with MPI_Cancel (cancel() returns once it has completed, either
//   cancelled or with data); a send can only be withdrawn before the progress thread has handed it
//   to MPI. MPI cannot detect a dead peer (OpenMPI aborts the job), so waits simply time out.
// - close() with sends still active: MPI cannot cancel them; their requests are freed and their
//   handles fail, but MPI may still read those buffers if the peer later receives. Wait for sends
//   before closing.
#pragma once

#include <memory>

#include "transfer/transport.h"

namespace pdsim::transfer {

// What "mpi" declares (registered with it, see transfer/transport.h). mpi reads no option block.
[[nodiscard]] inline TransportDescriptor mpi_transport_descriptor() {
    return {.name = "mpi",
            .caps = {.host_memory = true,
                     .two_sided = true,
                     .tag_matching = true,
                     .detects_peer_failure = false,
                     .spans_processes = true,
                     .spans_nodes = true,
                     .setup = TransportSetup::kLauncher,
                     .medium = TransportMedium::kMpi},
            .summary = "two-sided nonblocking MPI point-to-point; the ranks are mpirun's"};
}

[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_mpi_transport(
    const TransportOptions& options);

}  // namespace pdsim::transfer
