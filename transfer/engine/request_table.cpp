#include "transfer/engine/request_table.h"

#include <fmt/format.h>

namespace pdsim::transfer {

std::string_view request_state_name(RequestState state) {
    switch (state) {
        case RequestState::kBootstrapping:
            return "Bootstrapping";
        case RequestState::kTransferring:
            return "Transferring";
        case RequestState::kSuccess:
            return "Success";
        case RequestState::kFailed:
            return "Failed";
    }
    return "?";
}

namespace request_table_detail {

Status shut_down_error(std::string_view engine, int rank) {
    return PDSIM_ERROR(StatusCode::kUnavailable, "{} rank {} is shut down", engine, rank);
}

Status already_known_error(uint64_t id) {
    return PDSIM_ERROR(StatusCode::kAlreadyExists, "request {} is already known", id);
}

Status not_known_error(uint64_t id) {
    return PDSIM_ERROR(StatusCode::kNotFound, "request {} is not known", id);
}

Status still_active_error(uint64_t id, RequestState state) {
    return PDSIM_ERROR(StatusCode::kFailedPrecondition, "request {} is still {}", id,
                       request_state_name(state));
}

Status wait_timed_out_error(uint64_t id, RequestState state, std::chrono::nanoseconds timeout,
                            std::string_view awaiting) {
    return PDSIM_ERROR(
        StatusCode::kDeadlineExceeded, "request {} still {} after {} ms (awaiting {})", id,
        request_state_name(state),
        std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(), awaiting);
}

std::string timed_out_reason(uint64_t id, std::chrono::milliseconds timeout,
                             std::string_view awaiting) {
    return fmt::format("request {}: no progress for {} ms while awaiting {}", id, timeout.count(),
                       awaiting);
}

}  // namespace request_table_detail
}  // namespace pdsim::transfer
