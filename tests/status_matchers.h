// GoogleTest matchers for pdsim::Status and pdsim::StatusOr<T>, after Abseil's
// status_matchers.h:
//
//   EXPECT_THAT(st, IsOk());
//   EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument));
//   EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad.yaml:3")));
//   EXPECT_THAT(load(path), StatusIs(StatusCode::kNotFound));          // a StatusOr<T> too
//   ASSERT_OK(st);  ASSERT_OK_AND_ASSIGN(auto value, make_value());
//
// A failed match prints the status as "CODE: message". HasSubstr, Not, AllOf, ... are gmock's
// (HasSubstr is using-declared in namespace pdsim below).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <utility>

#include "common/status.h"

namespace pdsim {

// gtest prints a value through PrintTo when one is declared in the value's namespace.
inline void PrintTo(const Status& status, std::ostream* os) {
    *os << status.to_string();
}
inline void PrintTo(StatusCode code, std::ostream* os) {
    *os << status_code_name(code);
}
template <typename T>
void PrintTo(const StatusOr<T>& status_or, std::ostream* os) {
    if (status_or.ok()) {
        *os << "OK (a value)";
    } else {
        *os << status_or.status().to_string();
    }
}

namespace testing_internal {

inline const Status& status_of(const Status& status) {
    return status;
}
template <typename T>
Status status_of(const StatusOr<T>& status_or) {
    return status_or.status();
}

// T: what the matcher is applied to: Status or StatusOr<U>, by value or const reference.
template <typename T>
class StatusIsMatcher : public ::testing::MatcherInterface<T> {
public:
    StatusIsMatcher(StatusCode code, ::testing::Matcher<const std::string&> message)
        : code_(code), message_(std::move(message)) {}

    bool MatchAndExplain(T value, ::testing::MatchResultListener* listener) const override {
        const Status status = status_of(value);
        if (status.code() != code_) {
            *listener << "whose code is " << status_code_name(status.code());
            return false;
        }
        ::testing::StringMatchResultListener message_listener;
        if (!message_.MatchAndExplain(status.message(), &message_listener)) {
            *listener << "whose message \"" << status.message() << "\" does not match";
            if (!message_listener.str().empty()) *listener << " (" << message_listener.str() << ")";
            return false;
        }
        return true;
    }
    void DescribeTo(std::ostream* os) const override {
        *os << "has code " << status_code_name(code_) << " and a message that ";
        message_.DescribeTo(os);
    }
    void DescribeNegationTo(std::ostream* os) const override {
        *os << "does not have code " << status_code_name(code_) << " or has a message that ";
        message_.DescribeNegationTo(os);
    }

private:
    StatusCode code_;
    ::testing::Matcher<const std::string&> message_;
};

// Polymorphic: converts to a matcher of Status or of any StatusOr<T>.
class StatusIsPolymorphic {
public:
    StatusIsPolymorphic(StatusCode code, ::testing::Matcher<const std::string&> message)
        : code_(code), message_(std::move(message)) {}
    template <typename T>
    operator ::testing::Matcher<T>() const {  // NOLINT(google-explicit-constructor)
        return ::testing::Matcher<T>(new StatusIsMatcher<T>(code_, message_));
    }

private:
    StatusCode code_;
    ::testing::Matcher<const std::string&> message_;
};

}  // namespace testing_internal

// Matches a Status or StatusOr<T> whose code is `code` and whose message matches `message`
// (a string matcher: HasSubstr, StartsWith, Eq, ...; any message by default).
inline testing_internal::StatusIsPolymorphic StatusIs(
    StatusCode code, ::testing::Matcher<const std::string&> message = ::testing::_) {
    return {code, std::move(message)};
}

// Matches an OK Status or a StatusOr<T> holding a value.
inline testing_internal::StatusIsPolymorphic IsOk() {
    return StatusIs(StatusCode::kOk);
}

// The message matcher the suites use most, named without `::testing::` inside pdsim's
// namespaces (not at global scope, where it would leak into every file that includes this).
using ::testing::HasSubstr;

}  // namespace pdsim

// Fatal / non-fatal checks that print the status on failure.
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::pdsim::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::pdsim::IsOk())

#define PDSIM_TEST_CONCAT_INNER(a, b) a##b
#define PDSIM_TEST_CONCAT(a, b) PDSIM_TEST_CONCAT_INNER(a, b)
// ASSERT_OK_AND_ASSIGN(lhs, expr): asserts that `expr` (a StatusOr) holds a value and assigns it.
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                                    \
    auto PDSIM_TEST_CONCAT(status_or_, __LINE__) = (expr);                 \
    ASSERT_THAT(PDSIM_TEST_CONCAT(status_or_, __LINE__), ::pdsim::IsOk()); \
    lhs = std::move(PDSIM_TEST_CONCAT(status_or_, __LINE__)).value()
