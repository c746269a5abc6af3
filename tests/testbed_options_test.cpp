// testbed::resolve's checks of options and environment, before any rank runs (docs/inputs.md
// "Flags and environment"): the ranges of TestbedLimits, the --transport-fault spec and rank, and
// PDSIM_TCP_ENDPOINTS for the tcp transport, so that --mode both fails before its first phase.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "sim/testbed/options.h"
#include "tests/status_matchers.h"

namespace pdsim::testbed {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Sets an environment variable for one scope.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
    ~ScopedEnv() { ::unsetenv(name_); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    const char* name_;
};

TEST(TestbedOptions, TcpEndpointsCheckedBeforeAnyPhase) {
    const TestbedOptions tcp{.transport = "tcp", .mode = Mode::kBoth};
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500,nohostport");
        EXPECT_THAT(resolve(tcp, 2),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("PDSIM_TCP_ENDPOINTS")));
    }
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500");
        EXPECT_THAT(resolve(tcp, 2),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("1 endpoints")));
    }
    {
        ScopedEnv env("PDSIM_TCP_ENDPOINTS", "127.0.0.1:29500,127.0.0.1:29501");
        EXPECT_THAT(resolve(tcp, 2).status().message(), Not(HasSubstr("PDSIM_TCP_ENDPOINTS")));
    }
}

TEST(TestbedOptions, TransportFaultSpecAndRank) {
    EXPECT_THAT(resolve(TestbedOptions{.transport_fault = "delay"}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--transport-fault delay")));
    EXPECT_THAT(
        resolve(TestbedOptions{.transport_fault = "drop:p=0", .transport_fault_rank = 2}, 1),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("--transport-fault-rank 2")));
}

TEST(TestbedOptions, RangesOfTestbedLimits) {
    EXPECT_THAT(resolve(TestbedOptions{.threads = 100000}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--threads 100000")));
    EXPECT_THAT(resolve(TestbedOptions{.request_timeout_s = 1e10}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--request-timeout-s")));
    EXPECT_THAT(resolve(TestbedOptions{.max_batch_tokens = 2147483647}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--max-batch-tokens")));
    EXPECT_THAT(resolve(TestbedOptions{.synthetic = 2147483647}, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--synthetic")));
}

}  // namespace
}  // namespace pdsim::testbed
