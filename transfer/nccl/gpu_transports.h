// Entry points of the GPU transports (compiled only when pdsim is built with CUDA / NCCL; the
// registration in transfer/builtin.cpp is the only caller). Plain C++: no CUDA headers here.
//
// "nccl" (transfer/nccl/nccl_transport.cpp): two-sided ncclSend/ncclRecv on a dedicated
//   non-blocking comm stream. Everything posted since the progress thread last looked is issued
//   as one ncclGroupStart/ncclGroupEnd batch, followed by an event; the progress thread polls the
//   events (and ncclCommGetAsyncError) and completes the handles. Capabilities: device memory only,
//   no tag matching (NCCL matches per peer in issue order: both sides must post in the same order
//   and a receive's capacity must equal the message size; bytes() of a receive is its capacity).
//   The ncclUniqueId is broadcast over MPI_COMM_WORLD when MPI is initialized (rank and size then
//   come from MPI), else through a FileRendezvous (transfer/rendezvous.h) in
//   GpuTransportOptions::rendezvous_dir.
//   No dead-peer detection (waits time out; close() then aborts the communicator).
// "cuda_ipc" (transfer/nccl/cuda_ipc_transport.cpp): one-sided writes between processes on one
//   node. register_memory takes the start of a cudaMalloc allocation and returns a descriptor
//   holding its cudaIpcMemHandle; import_remote opens it (or, in the same process, uses the
//   pointer); post_write is a cudaMemcpyAsync on a dedicated stream, completed when its event
//   has fired. No two-sided operations.
// With no usable GPU both factories return kUnavailable "no device: ...".
// The descriptors below are declared whether or not the transports were built (a compiled-out
// transport stays registered with its descriptor and a "not built" factory).
#pragma once

#include <memory>
#include <string>

#include "transfer/transport.h"

namespace pdsim::transfer {

// The option block of nccl and cuda_ipc (TransportOptions::set).
struct GpuTransportOptions {
    int device_index = 0;  // the CUDA device to use
    // nccl without MPI: the directory where rank 0 publishes the ncclUniqueId (rank-0.nccl-id) and
    // the other ranks read it. Set: used even under MPI. Ignored by cuda_ipc.
    std::string rendezvous_dir;
};

// What "nccl" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor nccl_transport_descriptor() {
    return {.name = "nccl",
            .caps = {.host_memory = false,
                     .device_memory = true,
                     .two_sided = true,
                     .tag_matching = false,
                     .spans_processes = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kRendezvous,
                     .medium = TransportMedium::kGpu},
            .summary =
                "two-sided ncclSend/ncclRecv of GPU memory; the unique id over MPI or "
                "GpuTransportOptions::rendezvous_dir"};
}

// What "cuda_ipc" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor cuda_ipc_transport_descriptor() {
    return {.name = "cuda_ipc",
            .caps = {.host_memory = false,
                     .device_memory = true,
                     .two_sided = false,
                     .one_sided_write = true,
                     .spans_processes = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kNone,
                     .medium = TransportMedium::kGpu},
            .summary =
                "one-sided writes into GPU memory of processes on one node "
                "(cudaIpcMemHandle)"};
}

[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_nccl_transport(
    const TransportOptions& options);
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_cuda_ipc_transport(
    const TransportOptions& options);

// kUnavailable "no device: ..." when no CUDA GPU can be used (else OK).
[[nodiscard]] Status check_cuda_device(int index);

}  // namespace pdsim::transfer
