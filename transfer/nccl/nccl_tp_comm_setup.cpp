// The host side of the NCCL device TP group (transfer/nccl/nccl_tp_comm.h): option checks, the
// root id's trip through the host TP group, the watchdog's message. Built with or without CUDA.
#include <cstring>
#include <string>
#include <vector>

#include "transfer/nccl/nccl_pair_ids.h"
#include "transfer/nccl/nccl_tp_comm.h"

namespace pdsim::transfer {

Status validate_nccl_tp_comm_options(const NcclTpCommOptions& options) {
    if (options.device < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "NcclTpCommOptions.device must be >= 0, got {}", options.device);
    }
    if (options.connect_timeout.count() <= 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "NcclTpCommOptions.connect_timeout must be > 0 ms, got {} ms",
                           options.connect_timeout.count());
    }
    if (options.op_timeout.count() < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "NcclTpCommOptions.op_timeout must be >= 0 ms (0 turns the watchdog "
                           "off), got {} ms",
                           options.op_timeout.count());
    }
    if (options.name.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "NcclTpCommOptions.name is empty");
    }
    return {};
}

StatusOr<std::string> share_root_id(model::TpComm& host, const std::string& root_id,
                                    size_t id_bytes) {
    if (id_bytes == 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "share_root_id: id_bytes is 0");
    }
    if (host.rank() == 0 && root_id.size() != id_bytes) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "share_root_id: rank 0's id is {} bytes, expected {}", root_id.size(),
                           id_bytes);
    }
    const size_t floats = (id_bytes + sizeof(float) - 1) / sizeof(float);
    std::vector<float> mine(floats, 0.f);
    if (host.rank() == 0) std::memcpy(mine.data(), root_id.data(), id_bytes);
    std::vector<float> all(floats * static_cast<size_t>(host.size()), 0.f);
    PDSIM_RETURN_IF_ERROR(host.allgather(mine.data(), floats, all.data())
                              .with_context("the NCCL TP group's id, over the host TP group"));
    std::string id(id_bytes, '\0');
    std::memcpy(id.data(), all.data(), id_bytes);  // rank 0's block comes first
    return id;
}

std::string tp_gather_timeout_message(const std::string& name, int rank, int size,
                                      std::chrono::milliseconds op_timeout) {
    return fmt::format(
        "nccl TP group {}: rank {} of {}: an all-gather pending > {} (a peer gone or stuck); "
        "communicator aborted",
        name, rank, size, seconds_text(op_timeout));
}

}  // namespace pdsim::transfer
