#include "common/check.h"

namespace pdsim::detail {

void check_failed(const char* file, int line, const char* expr, const std::string& msg) {
    std::fprintf(stderr, "pdsim: check failed at %s:%d: %s%s%s\n", file, line, expr,
                 msg.empty() ? "" : ": ", msg.c_str());
    std::fflush(stderr);
    std::abort();
}

}  // namespace pdsim::detail
