#include "common/mpi_check.h"

#include <string>

namespace pdsim::detail {

std::string mpi_error_string(int code) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS)
        return "MPI error " + std::to_string(code);
    return std::string(buf, static_cast<size_t>(len));
}

}  // namespace pdsim::detail
