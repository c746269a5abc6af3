// The NCCL device TP group (model::DeviceTpComm, backends/model/device_tp_comm.h): one NCCL
// communicator per TP group, whose all-gather the GPU model runs on its forward's stream
// (backends/cuda/cuda_synthetic_model.h "Tensor parallelism"). Plain C++: no CUDA or NCCL headers
// here; the communicator is built only where pdsim is built with NCCL (transfer/builtin.cpp says
// which: make_nccl_tp_comm is kUnavailable "not built" otherwise).
//
// Setup (make_nccl_tp_comm, collective: every rank of the group calls it once, at the same point
// of its host TP group's rounds): rank 0 makes the ncclUniqueId, which reaches the others through
// the group's host TpComm (share_root_id: one allgather round), then every rank initializes its
// member of the communicator without blocking (ncclCommInitRankConfig, config.blocking = 0,
// config.commName = options.name) on options.device and polls it. Bounded by
// options.connect_timeout (the id's allgather has the host group's own timeout): past it the
// member is aborted and creation fails with kDeadlineExceeded naming the group, the rank and the
// timeout. The group's ranks need a GPU each: NCCL refuses two ranks of one communicator on one
// GPU (the testbed then uses the host exchange, sim/testbed/options.h --tp-exchange).
//
// Gathers: ncclAllGather of fp32 on the caller's stream (NCCL's rank order is the group's), then
// an event of the group's; a watchdog thread polls the events and the communicator's asynchronous
// error every 10 ms. A gather pending longer than options.op_timeout (from its enqueue; a peer
// gone or stuck), or an asynchronous NCCL error, breaks the group: health() turns into
// kDeadlineExceeded "nccl TP group <name>: rank R of N: an all-gather pending > T s (a peer gone
// or stuck); communicator aborted" (or kUnavailable naming the NCCL error), and the communicator
// is aborted (ncclCommAbort: the gathers' kernels end). The destructor finalizes a healthy
// communicator whose gathers have all completed (bounded, 5 s) and aborts it otherwise.
// Known limit (NCCL 2.28, not run on a GPU yet): the abort releases the communicator's resources,
// and a gather still queued behind unfinished work on its stream (its kernel not started) may
// then fault when it runs, which makes the stream's error sticky; the rank's forwards fail
// either way, but the fault is the CUDA error rather than the watchdog's message.
//
// NCCL's environment is the user's (NCCL_DEBUG, NCCL_SOCKET_IFNAME, NCCL_P2P_DISABLE, ...: see
// transfer/nccl/gpu_transports.h); nothing here sets one.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "backends/model/device_tp_comm.h"
#include "backends/model/synthetic_model.h"
#include "common/status.h"

namespace pdsim::transfer {

struct NcclTpCommOptions {
    int device = 0;  // the rank's CUDA device
    // The NCCL init's bound (after the id is through); > 0.
    std::chrono::milliseconds connect_timeout{60'000};
    // The watchdog: a gather pending longer than this breaks the group; 0 turns it off (a gather
    // that never completes then holds the stream forever); negative is refused.
    std::chrono::milliseconds op_timeout{120'000};
    std::string name = "pdsim-tp";  // NCCL's commName, in its logs and in errors
};

// OK, or kInvalidArgument naming the first bad field ("NcclTpCommOptions.op_timeout ...").
[[nodiscard]] Status validate_nccl_tp_comm_options(const NcclTpCommOptions& options);

// The group's root id on every rank: rank 0's `root_id` (id_bytes long; ignored on other ranks)
// goes to every rank of `host` in one allgather round (each rank contributes id_bytes rounded up
// to whole floats, carried as raw bytes: the group's ranks share a byte order; only rank 0's are
// read). Collective over `host`: blocks until every rank's contribution is in, bounded by the
// host group's timeout. kInvalidArgument: id_bytes 0, or rank 0's root_id not id_bytes long; the
// host gather's error (the host group is then broken).
[[nodiscard]] StatusOr<std::string> share_root_id(model::TpComm& host, const std::string& root_id,
                                                  size_t id_bytes);

// The error of a gather pending past the watchdog's bound (see the file comment).
[[nodiscard]] std::string tp_gather_timeout_message(const std::string& name, int rank, int size,
                                                    std::chrono::milliseconds op_timeout);

// Whether this pdsim was built with NCCL (transfer/builtin.cpp).
[[nodiscard]] bool nccl_tp_comm_built();

// This rank's member of the TP group's NCCL communicator (see the file comment); its size and
// rank are `host`'s. `host` is used during the call only. kInvalidArgument: bad options;
// kUnavailable: no usable GPU ("no device: ..."), a build without NCCL ("... not built"), an NCCL
// or CUDA call that failed; kDeadlineExceeded: the init did not finish in time; the host gather's
// errors.
[[nodiscard]] StatusOr<std::unique_ptr<model::DeviceTpComm>> make_nccl_tp_comm(
    model::TpComm& host, const NcclTpCommOptions& options);

}  // namespace pdsim::transfer
