#include "common/status.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "common/bf16.h"
#include "common/npy.h"
#include "common/thread_pool.h"
#include "tests/status_matchers.h"

namespace pdsim {
namespace {

Status fails_at_line() {
    return PDSIM_ERROR(StatusCode::kInvalidArgument, "bad value {}", 42);
}

Status propagates() {
    PDSIM_RETURN_IF_ERROR(fails_at_line());
    return Status(StatusCode::kInternal, "not reached");
}

StatusOr<int> maybe(bool ok) {
    if (!ok) return Status(StatusCode::kNotFound, "nope");
    return 7;
}

Status assigns(bool ok, int* out) {
    PDSIM_ASSIGN_OR_RETURN(int v, maybe(ok));
    *out = v;
    return {};
}

TEST(Status, OkByDefault) {
    Status s;
    EXPECT_OK(s);
    EXPECT_EQ(s.to_string(), "OK");
}

TEST(Status, ErrorCarriesFileLineAndCode) {
    Status s = fails_at_line();
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument, HasSubstr("tests/status_test.cpp:")))
        << s.message();
    EXPECT_THAT(s.message(), HasSubstr("bad value 42"));
    EXPECT_EQ(s.to_string().rfind("INVALID_ARGUMENT: ", 0), 0u);
}

TEST(Status, ReturnIfErrorPropagatesTheFirstError) {
    Status s = propagates();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(Status, WithContextPrefixes) {
    Status s = Status(StatusCode::kDataLoss, "crc").with_context("layer 3");
    EXPECT_EQ(s.message(), "layer 3: crc");
    EXPECT_OK(Status().with_context("x"));
}

TEST(StatusOr, ValueAndError) {
    int v = 0;
    EXPECT_OK(assigns(true, &v));
    EXPECT_EQ(v, 7);
    Status s = assigns(false, &v);
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    StatusOr<int> from_ok{Status()};
    EXPECT_FALSE(from_ok.ok());
    EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(Bf16, RoundTripAndRounding) {
    for (float f : {0.f, 1.f, -2.5f, 3.140625f, 65280.f, 0x1p-100f}) {
        EXPECT_EQ(bf16_to_float(float_to_bf16(f)), f) << f;
    }
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
    EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
    // Slightly above halfway rounds up.
    EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256 + 1.0f / 4096)), 1.0f + 1.0f / 128);
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(ThreadPool, CoversEveryIndexOnce) {
    ThreadPool pool(3);
    for (size_t n : {1u, 2u, 7u, 1000u, 12345u}) {
        std::vector<std::atomic<int>> hits(n);
        pool.parallel_for(n, [&](size_t b, size_t e, int) {
            for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
}

TEST(ThreadPool, ManyBackToBackJobs) {
    ThreadPool pool(2);
    std::atomic<long> sum{0};
    for (int it = 0; it < 2000; ++it) {
        pool.parallel_for(64, [&](size_t b, size_t e, int) {
            for (size_t i = b; i < e; ++i) sum.fetch_add(static_cast<long>(i));
        });
    }
    EXPECT_EQ(sum.load(), 2000L * (63 * 64 / 2));
}

TEST(Npy, WriteReadRoundTrip) {
    auto dir = std::filesystem::temp_directory_path() / "pdsim_npy_test";
    std::filesystem::create_directories(dir);
    std::vector<float> a(2 * 3 * 4);
    std::iota(a.begin(), a.end(), 0.5f);
    auto p = (dir / "a.npy").string();
    ASSERT_OK(write_npy(p, "<f4", {2, 3, 4}, a.data(), a.size() * 4));
    auto r = read_npy(p);
    ASSERT_OK(r);
    EXPECT_EQ(r->descr, "<f4");
    EXPECT_EQ(r->shape, (std::vector<int64_t>{2, 3, 4}));
    EXPECT_EQ(std::vector<float>(r->as<float>(), r->as<float>() + 24), a);
    std::vector<int32_t> one{5};
    ASSERT_OK(write_npy((dir / "b.npy").string(), "<i4", {1}, one.data(), 4));
    auto rb = read_npy((dir / "b.npy").string());
    ASSERT_OK(rb);
    EXPECT_EQ(rb->shape, (std::vector<int64_t>{1}));
    EXPECT_EQ(write_npy(p, "<f4", {5}, a.data(), 8).code(), StatusCode::kInvalidArgument);
}

// The matchers of tests/status_matchers.h: each must reject what it should (a matcher that accepts
// everything would let every test that uses it pass).
TEST(StatusMatchers, StatusIsChecksCodeAndMessage) {
    const Status bad(StatusCode::kInvalidArgument, "topo.yaml:3: nodes: expected a list");
    EXPECT_THAT(bad, StatusIs(StatusCode::kInvalidArgument));
    EXPECT_THAT(bad, StatusIs(StatusCode::kInvalidArgument, HasSubstr("topo.yaml:3")));
    EXPECT_THAT(bad, ::testing::Not(StatusIs(StatusCode::kNotFound)));
    EXPECT_THAT(bad, ::testing::Not(StatusIs(StatusCode::kInvalidArgument, HasSubstr("line 4"))));
    EXPECT_THAT(bad, ::testing::Not(IsOk()));
    EXPECT_THAT(Status(), IsOk());
    EXPECT_THAT(Status(), ::testing::Not(StatusIs(StatusCode::kInvalidArgument)));
}

TEST(StatusMatchers, StatusIsMatchesStatusOr) {
    const StatusOr<int> value = 7;
    const StatusOr<int> missing = Status(StatusCode::kNotFound, "no such rank");
    EXPECT_THAT(value, IsOk());
    EXPECT_THAT(missing, StatusIs(StatusCode::kNotFound, HasSubstr("rank")));
    EXPECT_THAT(missing, ::testing::Not(IsOk()));
    EXPECT_THAT(value, ::testing::Not(StatusIs(StatusCode::kNotFound)));
}

TEST(StatusMatchers, FailuresExplainWhatDiffered) {
    const Status bad(StatusCode::kDeadlineExceeded, "waited 5 s for layer 3");
    const ::testing::Matcher<const Status&> wrong_code = StatusIs(StatusCode::kAborted);
    ::testing::StringMatchResultListener listener;
    EXPECT_FALSE(wrong_code.MatchAndExplain(bad, &listener));
    EXPECT_THAT(listener.str(), HasSubstr("DEADLINE_EXCEEDED"));
    const ::testing::Matcher<const Status&> wrong_message =
        StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("layer 4"));
    ::testing::StringMatchResultListener message_listener;
    EXPECT_FALSE(wrong_message.MatchAndExplain(bad, &message_listener));
    EXPECT_THAT(message_listener.str(), HasSubstr("waited 5 s for layer 3"));
}

TEST(StatusMatchers, AssertOkAndAssignTakesTheValue) {
    auto make = [](bool ok) -> StatusOr<std::string> {
        if (!ok) return Status(StatusCode::kInternal, "no");
        return std::string("value");
    };
    ASSERT_OK_AND_ASSIGN(std::string got, make(true));
    EXPECT_EQ(got, "value");
    EXPECT_OK(Status());
}

}  // namespace
}  // namespace pdsim
