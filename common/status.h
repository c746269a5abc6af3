// Status: the one error type of pdsim.
//
// A Status is a value: OK, or a code plus a message that usually carries the file:line where the
// error was raised (PDSIM_ERROR) and the context added on the way up (with_context). Functions that
// can fail return Status or StatusOr<T>; both are [[nodiscard]]. Exceptions are used only at the
// edges (configuration parsing, main), never across library APIs.
//
// Thread-safety: a Status is an immutable value; copies may be used from any thread.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace pdsim {

enum class StatusCode : uint8_t {
    kOk = 0,
    kInvalidArgument,  // bad input: flag, file, field, frame (the CLI maps this to exit 2)
    kNotFound,
    kAlreadyExists,
    kOutOfRange,
    kFailedPrecondition,  // the call is not allowed in the current state
    kResourceExhausted,   // out of pages, memory, queue space
    kDeadlineExceeded,    // a wait timed out
    kUnavailable,         // no device, peer gone, transport closed
    kAborted,             // cancelled / request failed by the other side
    kDataLoss,            // checksum mismatch, truncated frame
    kUnimplemented,
    kInternal,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
public:
    Status() = default;  // OK
    Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

    static Status ok_status() { return {}; }

    [[nodiscard]] bool ok() const { return code_ == StatusCode::kOk; }
    [[nodiscard]] StatusCode code() const { return code_; }
    [[nodiscard]] const std::string& message() const { return message_; }
    // "CODE: message", or "OK".
    [[nodiscard]] std::string to_string() const;

    // Returns a copy whose message is "context: message". OK stays OK.
    [[nodiscard]] Status with_context(std::string_view context) const;

    // Explicitly drop a status that the caller has decided not to act on.
    void ignore_error() const {}

    friend bool operator==(const Status& a, const Status& b) {
        return a.code_ == b.code_ && a.message_ == b.message_;
    }

private:
    StatusCode code_ = StatusCode::kOk;
    std::string message_;
};

inline Status ok_status() {
    return {};
}

// kInvalidArgument with `message` as it is: for errors in the user's input (a flag, a file, a
// field), whose message names the input rather than the source line that found it.
[[nodiscard]] inline Status invalid_argument_error(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
}

// StatusOr<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
public:
    StatusOr(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
    StatusOr(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
        if (std::get<Status>(v_).ok()) {
            v_ = Status(StatusCode::kInternal, "StatusOr constructed from an OK Status");
        }
    }

    [[nodiscard]] bool ok() const { return std::holds_alternative<T>(v_); }
    [[nodiscard]] Status status() const { return ok() ? Status() : std::get<Status>(v_); }
    T& value() & { return std::get<T>(v_); }
    const T& value() const& { return std::get<T>(v_); }
    T&& value() && { return std::get<T>(std::move(v_)); }
    T* operator->() { return &std::get<T>(v_); }
    const T* operator->() const { return &std::get<T>(v_); }
    T& operator*() & { return std::get<T>(v_); }
    const T& operator*() const& { return std::get<T>(v_); }

private:
    std::variant<T, Status> v_;
};

namespace detail {
std::string located(const char* file, int line, std::string message);
}  // namespace detail

}  // namespace pdsim

// PDSIM_ERROR(code, fmt, args...): a Status whose message is "file:line: <formatted>".
#define PDSIM_ERROR(code, ...) \
    ::pdsim::Status((code),    \
                    ::pdsim::detail::located(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)))

#define PDSIM_STATUS_CONCAT_INNER(a, b) a##b
#define PDSIM_STATUS_CONCAT(a, b) PDSIM_STATUS_CONCAT_INNER(a, b)

// Evaluates expr (a Status); returns it from the enclosing function if it is not OK.
// The temporary's name is unique per expansion, so the macro nests (inside a lambda in `expr`).
#define PDSIM_RETURN_IF_ERROR(expr) \
    PDSIM_RETURN_IF_ERROR_IMPL(PDSIM_STATUS_CONCAT(pdsim_status_tmp_, __COUNTER__), expr)
#define PDSIM_RETURN_IF_ERROR_IMPL(tmp, expr) \
    do {                                      \
        ::pdsim::Status tmp = (expr);         \
        if (!tmp.ok()) return tmp;            \
    } while (0)

// PDSIM_ASSIGN_OR_RETURN(auto x, expr): expr is a StatusOr<T>; on error returns its Status.
#define PDSIM_ASSIGN_OR_RETURN(lhs, expr) \
    PDSIM_ASSIGN_OR_RETURN_IMPL(PDSIM_STATUS_CONCAT(pdsim_statusor_, __LINE__), lhs, expr)
#define PDSIM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
    auto tmp = (expr);                              \
    if (!tmp.ok()) return tmp.status();             \
    lhs = std::move(tmp).value()
