// MPI_CHECK(call): turns a failing MPI call into a Status (kUnavailable) naming the call, the
// MPI error string and file:line, and returns it from the enclosing function. The communicator's
// error handler must be MPI_ERRORS_RETURN for failures to reach here rather than abort.
#pragma once

#include <mpi.h>

#include "common/status.h"

namespace pdsim::detail {
std::string mpi_error_string(int code);
}  // namespace pdsim::detail

#define MPI_CHECK(call)                                                                   \
    do {                                                                                  \
        int pdsim_mpi_rc_ = (call);                                                       \
        if (pdsim_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                    \
            return PDSIM_ERROR(::pdsim::StatusCode::kUnavailable, "{} failed: {}", #call, \
                               ::pdsim::detail::mpi_error_string(pdsim_mpi_rc_));         \
    } while (0)
