// The graceful end of an NCCL communicator, shared by the nccl transport (nccl_transport.cpp) and
// the NCCL TP group (nccl_tp_comm.cpp). Include only from transfer/nccl/ sources built with NCCL.
#pragma once

#include <nccl.h>

#include <chrono>
#include <thread>

namespace pdsim::transfer {

// Finalizes `comm` (ncclCommFinalize, which may return ncclInProgress on a non-blocking
// communicator) and polls ncclCommGetAsyncError every millisecond until it is done. true: the
// communicator finalized within `timeout`, so the caller may ncclCommDestroy it; false: the
// finalize failed, hit an asynchronous error or took longer, and the caller must ncclCommAbort it.
// Blocks at most `timeout` (plus a poll).
[[nodiscard]] inline bool finalize_nccl_comm(ncclComm_t comm, std::chrono::milliseconds timeout) {
    const ncclResult_t rc = ncclCommFinalize(comm);
    if (rc != ncclSuccess && rc != ncclInProgress) return false;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return false;
        if (state == ncclSuccess) return true;
        if (state != ncclInProgress || std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

}  // namespace pdsim::transfer
