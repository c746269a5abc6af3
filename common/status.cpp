#include "common/status.h"

#include <cstring>

namespace pdsim {

std::string_view status_code_name(StatusCode code) {
    switch (code) {
        case StatusCode::kOk:
            return "OK";
        case StatusCode::kInvalidArgument:
            return "INVALID_ARGUMENT";
        case StatusCode::kNotFound:
            return "NOT_FOUND";
        case StatusCode::kAlreadyExists:
            return "ALREADY_EXISTS";
        case StatusCode::kOutOfRange:
            return "OUT_OF_RANGE";
        case StatusCode::kFailedPrecondition:
            return "FAILED_PRECONDITION";
        case StatusCode::kResourceExhausted:
            return "RESOURCE_EXHAUSTED";
        case StatusCode::kDeadlineExceeded:
            return "DEADLINE_EXCEEDED";
        case StatusCode::kUnavailable:
            return "UNAVAILABLE";
        case StatusCode::kAborted:
            return "ABORTED";
        case StatusCode::kDataLoss:
            return "DATA_LOSS";
        case StatusCode::kUnimplemented:
            return "UNIMPLEMENTED";
        case StatusCode::kInternal:
            return "INTERNAL";
    }
    return "UNKNOWN";
}

std::string Status::to_string() const {
    if (ok()) return "OK";
    return fmt::format("{}: {}", status_code_name(code_), message_);
}

Status Status::with_context(std::string_view context) const {
    if (ok()) return *this;
    return Status(code_, fmt::format("{}: {}", context, message_));
}

namespace detail {
std::string located(const char* file, int line, std::string message) {
    // Keep paths short: strip everything up to the project's top-level folder.
    const char* base = file;
    for (const char* top :
         {"/common/", "/backends/", "/transfer/", "/topology/", "/sim/", "/bench/", "/tests/"}) {
        if (const char* p = std::strstr(file, top)) {
            base = p + 1;
            break;
        }
    }
    return fmt::format("{}:{}: {}", base, line, message);
}
}  // namespace detail

}  // namespace pdsim
