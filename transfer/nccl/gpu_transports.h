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
//   come from MPI), else exchanged through TransportOptions.tcp.bootstrap_dir (file nccl-id).
//   No dead-peer detection (waits time out; close() then aborts the communicator).
// "cuda_ipc" (transfer/nccl/cuda_ipc_transport.cpp): one-sided writes between processes on one
//   node. register_memory takes the start of a cudaMalloc allocation and returns a descriptor
//   holding its cudaIpcMemHandle; import_remote opens it (or, in the same process, uses the
//   pointer); post_write is a cudaMemcpyAsync on a dedicated stream, completed when its event
//   has fired. No two-sided operations.
// With no usable GPU both factories return kUnavailable "no device: ...".
#pragma once

#include <memory>

#include "transfer/transport.h"

namespace pdsim::transfer {

[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_nccl_transport(
    const TransportOptions& options);
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_cuda_ipc_transport(
    const TransportOptions& options);

// kUnavailable "no device: ..." when no CUDA GPU can be used (else OK).
[[nodiscard]] Status check_cuda_device(int index);

}  // namespace pdsim::transfer
