// Logging: spdlog, with one process-wide logger named "pdsim" writing to stderr.
// init_logging() is idempotent and thread-safe; the PDSIM_LOG_* macros may be used before it
// (they fall back to spdlog's default logger). Under MPI the rank is part of the pattern.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace pdsim {

// level: trace|debug|info|warn|error|off. rank < 0: no rank in the prefix.
void init_logging(std::string_view level = "info", int rank = -1);

}  // namespace pdsim

#define PDSIM_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define PDSIM_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define PDSIM_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define PDSIM_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define PDSIM_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
