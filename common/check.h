// Invariant checks. PDSIM_CHECK is for programming errors (a broken invariant inside pdsim): it
// logs file:line and aborts. Errors that input, peers or devices can cause are returned as Status.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "common/status.h"

namespace pdsim::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* expr,
                               const std::string& msg);
}  // namespace pdsim::detail

#define PDSIM_CHECK(cond)                                                            \
    do {                                                                             \
        if (!(cond)) [[unlikely]]                                                    \
            ::pdsim::detail::check_failed(__FILE__, __LINE__, #cond, std::string()); \
    } while (0)

#define PDSIM_CHECK_MSG(cond, ...)                                                                \
    do {                                                                                          \
        if (!(cond)) [[unlikely]]                                                                 \
            ::pdsim::detail::check_failed(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
    } while (0)

// Aborts if the Status expression is not OK (for tests, tools and unrecoverable paths).
#define PDSIM_CHECK_OK(expr)                                                \
    do {                                                                    \
        ::pdsim::Status pdsim_check_status_ = (expr);                       \
        if (!pdsim_check_status_.ok()) [[unlikely]]                         \
            ::pdsim::detail::check_failed(__FILE__, __LINE__, #expr,        \
                                          pdsim_check_status_.to_string()); \
    } while (0)
