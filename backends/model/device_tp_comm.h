// DeviceTpComm: a TP group's all-gather on the device, enqueued on the caller's stream, with no
// host round trip (the GPU model's fast TP exchange, backends/cuda/cuda_synthetic_model.h "Tensor
// parallelism"; the NCCL implementation is transfer/nccl/nccl_tp_comm.h). The host TpComm
// (synthetic_model.h) is the exchange that runs anywhere; this one runs where the group's ranks
// each have a GPU of their own (NCCL refuses two ranks of one communicator on one GPU).
//
// Contract of enqueue_allgather: every rank of the group enqueues the same sequence of gathers
// with the same counts, in the same order (the gathers of a group are matched by their order, as
// NCCL's collectives are); each contributes `count` floats at `mine` and receives every rank's
// contribution, rank-major, at `out` (size() * count floats). Both are device memory of the
// rank's GPU, and `out` must not overlap `mine`. The gather runs in `stream` order: it reads
// `mine` once the work enqueued before it has run, and the work enqueued after it sees `out`.
//
// Thread-safety: one thread per rank enqueues (the rank's forward thread); health() and the
// TpGroupHealth it returns may be used from any thread, a stream host task included (the shared
// object outlives the group for whoever holds it). Blocking: enqueue_allgather does not wait for
// the gather or for the peers (it may wait, bounded, while the library enqueues it). Failure: a
// gather that does not complete in time (a peer gone or stuck) or an asynchronous error of the
// library breaks the group for good: its health turns into that error (it never turns OK again),
// the pending gathers are aborted (their kernels end, and `out` holds garbage), and later
// enqueues fail at once with that error. A caller that read `out` of a gather enqueued before the
// break must check the health after that gather has run (a stream host task behind it, holding
// the shared TpGroupHealth) and discard what it computed from it.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::model {

// A device TP group's health: OK until the first break, then that break's error for good.
// Thread-safe.
class TpGroupHealth {
public:
    [[nodiscard]] Status status() const {
        std::lock_guard<std::mutex> lock(mu_);
        return broken_;
    }
    // Breaks the group with `why` (not OK); a later break keeps the first error.
    void break_with(Status why) {
        std::lock_guard<std::mutex> lock(mu_);
        if (broken_.ok()) broken_ = std::move(why);
    }

private:
    mutable std::mutex mu_;
    Status broken_;
};

class DeviceTpComm {
public:
    virtual ~DeviceTpComm() = default;
    [[nodiscard]] virtual int size() const = 0;
    [[nodiscard]] virtual int rank() const = 0;
    // The implementation, in reports ("nccl").
    [[nodiscard]] virtual std::string name() const = 0;
    // Enqueues the gather (see the file comment). kInvalidArgument: a null or unaligned pointer,
    // count 0, or a stream not of the rank's GPU; the break's error once the group is broken;
    // kUnavailable: the library refused the call (which breaks the group).
    [[nodiscard]] virtual Status enqueue_allgather(const float* mine, size_t count, float* out,
                                                   runtime::Stream& stream) = 0;
    // The group's health (never null; shared, so a stream task may hold it past the group).
    [[nodiscard]] virtual std::shared_ptr<const TpGroupHealth> health() const = 0;

protected:
    DeviceTpComm() = default;
};

}  // namespace pdsim::model
