// DType and TensorView (backends/runtime/tensor.h): names round-trip, views are row-major, and
// check_view names the argument and what was wrong.
#include "backends/runtime/tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/status_matchers.h"

namespace pdsim::runtime {
namespace {

using ::testing::HasSubstr;

TEST(DType, NamesRoundTripAndSizes) {
    for (DType d :
         {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3, DType::kI32, DType::kI64}) {
        auto parsed = parse_dtype(dtype_name(d));
        ASSERT_OK(parsed) << dtype_name(d);
        EXPECT_EQ(*parsed, d);
    }
    EXPECT_EQ(dtype_size(DType::kBF16), 2u);
    EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1u);
    EXPECT_EQ(dtype_size(DType::kI64), 8u);
    EXPECT_EQ(*parse_dtype("bfloat16"), DType::kBF16);
    auto bad = parse_dtype("fp33");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr("fp33"));
    EXPECT_THAT(bad.status().message(), HasSubstr("bf16"));
}

TEST(TensorView, ContiguousStridesAndConstConversion) {
    float buf[2 * 3 * 4] = {};
    TensorView v = host_view(buf, {2, 3, 4});
    EXPECT_EQ(v.rank, 3);
    EXPECT_EQ(v.stride(0), 12);
    EXPECT_EQ(v.stride(1), 4);
    EXPECT_EQ(v.stride(2), 1);
    EXPECT_EQ(v.numel(), 24);
    EXPECT_EQ(v.bytes(), 96u);
    EXPECT_TRUE(v.is_contiguous());
    ConstTensorView c = v;
    EXPECT_EQ(c.data, static_cast<const void*>(buf));
    EXPECT_EQ(c.as<float>(), buf);
    c.strides[1] = 5;
    EXPECT_FALSE(c.is_contiguous());
    EXPECT_EQ(describe(v), "fp32[2, 3, 4] cpu:0");
}

TEST(CheckView, AcceptsAMatchAndNamesEachMismatch) {
    float buf[8 * 16] = {};
    ConstTensorView v = host_view(static_cast<const float*>(buf), {8, 16});
    EXPECT_OK(check_view(v, "q", {.dtypes = {DType::kF32}, .shape = {-1, 16}}));

    Status dtype = check_view(v, "q", {.dtypes = {DType::kBF16}, .shape = {-1, 16}});
    EXPECT_EQ(dtype.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(dtype.message(), HasSubstr("q: dtype fp32, expected bf16"));

    Status device = check_view(v, "k", {.device = DeviceKind::kCuda, .shape = {-1, 16}});
    EXPECT_THAT(device.message(), HasSubstr("k: memory on cpu, expected cuda"));

    Status shape = check_view(v, "out", {.shape = {8, 32}});
    EXPECT_THAT(shape.message(), HasSubstr("out: shape [8, 16], expected [8, 32]"));

    Status rank = check_view(v, "out", {.shape = {-1}});
    EXPECT_THAT(rank.message(), HasSubstr("expected [*]"));

    ConstTensorView null_view;
    EXPECT_THAT(check_view(null_view, "v", {.shape = {}}).message(), HasSubstr("v: null"));
    EXPECT_OK(check_view(null_view, "v", {.shape = {}, .allow_null = true}));

    ConstTensorView strided = v;
    strided.strides[0] = 32;
    EXPECT_THAT(check_view(strided, "q", {.shape = {8, 16}}).message(),
                HasSubstr("not contiguous"));
    EXPECT_OK(check_view(strided, "q", {.shape = {8, 16}, .contiguous = false}));
}

}  // namespace
}  // namespace pdsim::runtime
