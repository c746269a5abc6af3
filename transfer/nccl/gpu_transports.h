// Entry points of the GPU transports (compiled only when pdsim is built with CUDA / NCCL; the
// registration in transfer/builtin.cpp is the only caller). Plain C++: no CUDA headers here.
//
// "nccl" (transfer/nccl/nccl_transport.cpp): two-sided ncclSend/ncclRecv, device memory only.
//   - One two-rank communicator per pair of ranks (transfer/nccl/nccl_pair_ids.h), each with its
//     own non-blocking comm stream, all created eagerly when the transport is created: a dead or
//     stuck peer then holds up only its own pair (its stream, its communicator), never the others.
//     Each pair's ncclUniqueId is made by the lower rank and sent to the higher one over MPI (when
//     MPI is initialized and no rendezvous_dir is set; rank and size then come from
//     MPI_COMM_WORLD), else through one FileRendezvous file per pair in
//     GpuTransportOptions::rendezvous_dir ("rank-<low>.nccl-pair-<low>-<high>"; use a fresh
//     directory per run). A world of N ranks holds N-1 communicators per rank.
//   - Setup is bounded by TransportOptions::connect_timeout (the id exchange and the inits
//     together): the communicators are non-blocking (ncclCommInitRankConfig, config.blocking = 0)
//     and polled with ncclCommGetAsyncError; past the timeout the unfinished ones are aborted
//     (ncclCommAbort) and creation fails with kDeadlineExceeded naming the peer rank(s) and the
//     timeout.
//   - Posting: everything posted to one peer since the progress thread last looked is issued as
//     one ncclGroupStart/ncclGroupEnd on that pair's communicator and stream, followed by an event;
//     the progress thread polls the events and completes the handles. No tag matching (NCCL matches
//     per peer in issue order: both sides must post in the same order, and a receive's capacity
//     must equal the message size; bytes() of a receive is its capacity).
//   - Stream-ordered: post_send_after(ready, ...) captures `ready`'s latest record at post time (a
//     per-pair gate stream waits on it and records an event of the transport's own) and the comm
//     stream waits on that (cudaStreamWaitEvent) before the send's group: the send does not read
//     its buffer before `ready` has fired, and the host never waits. An event that never fires
//     holds up every later operation of that pair (one stream per pair) and, past op_timeout, the
//     watchdog aborts the pair. kInvalidArgument: `ready` is not a CUDA event, or is one of
//     another GPU than device_index.
//   - Watchdog (GpuTransportOptions::op_timeout): an operation pending longer than that (from its
//     post, including time spent waiting for `ready`) aborts its pair's communicator
//     (ncclCommAbort); every pending operation of the pair completes with kDeadlineExceeded
//     ("nccl: op to/from rank R pending > T s; communicator aborted") and later posts to that peer
//     fail at once with kUnavailable. An asynchronous NCCL error of a pair's communicator
//     (ncclCommGetAsyncError) does the same with kUnavailable naming the error. Other pairs carry
//     on. The transport does not detect a dead peer otherwise (capabilities: no
//     detects_peer_failure): without the watchdog, waits time out and close() aborts.
//     Known limit (NCCL 2.28, not run yet): ncclCommAbort synchronizes NCCL's internal stream,
//     which waits behind the pair's stream; when that stream waits on a `ready` event that never
//     fires, the abort (watchdog or close) blocks until it fires. A stalled compute stream is
//     failed by its own bounded waits first (the testbed's forward synchronize); a `ready` that
//     never fires at all is not recovered by this transport.
//   - close(): aborts the communicators that still had operations issued or in flight, then fails
//     the pending operations with kUnavailable (so no kernel touches a buffer after its handle
//     failed), and finalizes and destroys the others.
// "cuda_ipc" (transfer/nccl/cuda_ipc_transport.cpp): one-sided writes between processes on one
//   node. register_memory takes any range inside one cudaMalloc allocation (kInvalidArgument for
//   host memory or a range past the allocation's end) and returns a descriptor holding the
//   allocation's cudaIpcMemHandle and the range's offset in it; import_remote opens the handle and
//   adds the offset (or, in the same process, uses the pointer: CUDA refuses to open its own
//   handles, so only a second process exercises the offset); post_write is a cudaMemcpyAsync on one
//   dedicated stream, completed when its event has fired. post_write_after(ready, ...) makes that
//   stream wait on `ready` (cudaStreamWaitEvent, at post time) before the copy: one stream, so an
//   event that never fires holds up every later write of the transport. kInvalidArgument: `ready`
//   not a CUDA event of device_index's GPU. post_signal(dst, offset, add) is a one-thread kernel
//   (atomicAdd_system on the mapped word) enqueued on that stream after the writes before it, so
//   it lands once they have; an offset that is not a multiple of 8 is kInvalidArgument. The word
//   lives in device memory the target registered. A kernel reaches another GPU's memory only with
//   peer access: an IPC mapping has it, and import_remote of another GPU's region of this process
//   enables it; where the GPUs cannot (no P2P), post_signal to that region is kUnavailable.
//   close() waits up to 10 s for the writes still on the
//   stream (a write behind a `ready` that never fires would hold it forever), then fails them with
//   kUnavailable and destroys the stream without waiting, and closes the imported handles. No
//   two-sided operations; op_timeout and rendezvous_dir are ignored.
// With no usable GPU both factories return kUnavailable "no device: ...".
// The descriptors below are declared whether or not the transports were built (a compiled-out
// transport stays registered with its descriptor and a "not built" factory).
//
// NCCL's environment: the transports never set, change or unset an NCCL_* variable; NCCL reads
// the process environment as the user left it. Those users typically set: NCCL_DEBUG=WARN|INFO
// (and NCCL_DEBUG_SUBSYS) to see what NCCL does, NCCL_SOCKET_IFNAME (the interface of NCCL's
// bootstrap and socket transport, e.g. =eth0 or =^docker), NCCL_P2P_DISABLE=1 / NCCL_SHM_DISABLE=1
// / NCCL_IB_DISABLE=1 (force another path between GPUs), NCCL_P2P_LEVEL, NCCL_NET_GDR_LEVEL,
// NCCL_BUFFSIZE, NCCL_NTHREADS. Each pair communicator is named "pdsim-nccl-<low>-<high>"
// (config.commName) in NCCL's logs.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "transfer/transport.h"

namespace pdsim::transfer {

// The option block of nccl and cuda_ipc (TransportOptions::set).
struct GpuTransportOptions {
    int device_index = 0;  // the CUDA device to use
    // nccl without MPI: the directory where each pair's lower rank publishes the pair's
    // ncclUniqueId (rank-<low>.nccl-pair-<low>-<high>) and the higher rank reads it. Set: used even
    // under MPI. Ignored by cuda_ipc.
    std::string rendezvous_dir;
    // nccl's watchdog: an operation pending longer than this aborts its pair (see above); 0 turns
    // the watchdog off; negative is refused (kInvalidArgument naming the field). Ignored by
    // cuda_ipc.
    std::chrono::milliseconds op_timeout{120'000};
};

// OK, or kInvalidArgument naming the first bad field ("GpuTransportOptions.op_timeout ...").
// Both factories call it first. (Host code: defined in nccl_pair_ids.cpp, built with or without
// CUDA.)
[[nodiscard]] Status validate_gpu_transport_options(const GpuTransportOptions& options);

// What "nccl" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor nccl_transport_descriptor() {
    return {.name = "nccl",
            .caps = {.host_memory = false,
                     .device_memory = true,
                     .two_sided = true,
                     .tag_matching = false,
                     .stream_ordered = true,
                     .spans_processes = true,
                     .spans_nodes = true,
                     .one_rank_per_device = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kRendezvous,
                     .medium = TransportMedium::kGpu},
            .summary =
                "two-sided ncclSend/ncclRecv of GPU memory, stream-ordered sends; one "
                "communicator per rank pair (ids over MPI or GpuTransportOptions::rendezvous_dir), "
                "a watchdog (op_timeout)"};
}

// What "cuda_ipc" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor cuda_ipc_transport_descriptor() {
    return {.name = "cuda_ipc",
            .caps = {.host_memory = false,
                     .device_memory = true,
                     .two_sided = false,
                     .one_sided_write = true,
                     .stream_ordered = true,
                     .write_signals = true,
                     .spans_processes = true,
                     .spans_nodes = false,  // CUDA IPC handles open only on their node
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kNone,
                     .medium = TransportMedium::kGpu},
            .summary =
                "one-sided writes into GPU memory of processes on one node "
                "(cudaIpcMemHandle), stream-ordered writes"};
}

[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_nccl_transport(
    const TransportOptions& options);
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_cuda_ipc_transport(
    const TransportOptions& options);

// kUnavailable "no device: ..." when no CUDA GPU can be used (else OK).
[[nodiscard]] Status check_cuda_device(int index);

}  // namespace pdsim::transfer
