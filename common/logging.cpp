#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>
#include <string>

namespace pdsim {

void init_logging(std::string_view level, int rank) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    auto logger = spdlog::get("pdsim");
    if (!logger) {
        logger = spdlog::stderr_color_mt("pdsim");
        spdlog::set_default_logger(logger);
    }
    std::string pattern = rank >= 0
                              ? "[%H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v"
                              : "[%H:%M:%S.%e] [%^%l%$] %v";
    logger->set_pattern(pattern);
    logger->set_level(spdlog::level::from_str(std::string(level)));
}

}  // namespace pdsim
