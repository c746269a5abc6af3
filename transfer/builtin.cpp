// Built-in registration of the transports, the KV memory ops (make_kv_memory_ops) and the NCCL TP
// group (make_nccl_tp_comm, transfer/nccl/nccl_tp_comm.h). This is
// the one file that knows which optional parts were compiled in: PDSIM_HAVE_CUDA /
// PDSIM_HAVE_NCCL are private definitions of this file (transfer/CMakeLists.txt), never seen by a
// public header.
#include <memory>

#include "transfer/cuda/cuda_kv_memory_ops.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/fault/fault_transport.h"
#include "transfer/local/local_transport.h"
#include "transfer/mpi/mpi_transport.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/nccl/nccl_tp_comm.h"
#include "transfer/tcp/tcp_transport.h"
#include "transfer/transport.h"

namespace pdsim::transfer {

namespace {

// Compiled-out transports stay known by name and descriptor, so asking for one says why it is
// missing.
[[maybe_unused]] TransportFactory not_built(std::string name, std::string dependency) {
    return [name, dependency](const TransportOptions&) -> StatusOr<std::unique_ptr<Transport>> {
        return PDSIM_ERROR(StatusCode::kUnavailable,
                           "transport '{}' was not built (pdsim was built without {})", name,
                           dependency);
    };
}

}  // namespace

#if defined(PDSIM_HAVE_NCCL)
// transfer/nccl/nccl_tp_comm.cpp (built with NCCL only).
StatusOr<std::unique_ptr<model::DeviceTpComm>> make_nccl_tp_comm_on_device(
    model::TpComm& host, const NcclTpCommOptions& options);
#endif

bool nccl_tp_comm_built() {
#if defined(PDSIM_HAVE_NCCL)
    return true;
#else
    return false;
#endif
}

StatusOr<std::unique_ptr<model::DeviceTpComm>> make_nccl_tp_comm(model::TpComm& host,
                                                                 const NcclTpCommOptions& options) {
    PDSIM_RETURN_IF_ERROR(validate_nccl_tp_comm_options(options));
#if defined(PDSIM_HAVE_NCCL)
    return make_nccl_tp_comm_on_device(host, options);
#else
    (void)host;
    return PDSIM_ERROR(StatusCode::kUnavailable,
                       "the NCCL TP group was not built (pdsim was built without NCCL)");
#endif
}

// Called once, lazily, by the registry (transport.cpp).
void register_builtin_transports() {
    register_transport(local_transport_descriptor(), make_local_transport);
    register_transport(local_writes_transport_descriptor(), make_local_writes_transport);
    register_transport(tcp_transport_descriptor(), make_tcp_transport);
    register_transport(mpi_transport_descriptor(), make_mpi_transport);
    register_transport(fault_transport_descriptor(), make_fault_transport);
#if defined(PDSIM_HAVE_NCCL)
    register_transport(nccl_transport_descriptor(), make_nccl_transport);
#else
    register_transport(nccl_transport_descriptor(), not_built("nccl", "NCCL"));
#endif
#if defined(PDSIM_HAVE_CUDA)
    register_transport(cuda_ipc_transport_descriptor(), make_cuda_ipc_transport);
#else
    register_transport(cuda_ipc_transport_descriptor(), not_built("cuda_ipc", "CUDA"));
#endif
}

StatusOr<std::unique_ptr<KvMemoryOps>> make_kv_memory_ops(runtime::Device memory) {
    switch (memory.kind) {
        case runtime::DeviceKind::kCpu:
            return std::unique_ptr<KvMemoryOps>(std::make_unique<HostKvMemoryOps>());
        case runtime::DeviceKind::kCuda:
#if defined(PDSIM_HAVE_CUDA)
            return cuda::make_cuda_kv_memory_ops({.device = memory.index});
#else
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "KV memory ops for cuda memory were not built (pdsim was built "
                               "without CUDA)");
#endif
    }
    return PDSIM_ERROR(StatusCode::kInvalidArgument, "memory: unknown device kind {}",
                       static_cast<int>(memory.kind));
}

}  // namespace pdsim::transfer
