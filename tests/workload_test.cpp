#include "sim/workload/workload.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "tests/status_matchers.h"

namespace pdsim::workload {
namespace {

const std::string kTraces = PDSIM_SOURCE_DIR "/data/traces/";

StatusOr<std::vector<Request>> mooncake(const std::string& text, LoadOptions o = {}) {
    std::istringstream in(text);
    return parse_mooncake(in, "t.jsonl", o);
}

StatusOr<std::vector<Request>> azure(const std::string& text, LoadOptions o = {}) {
    std::istringstream in(text);
    return parse_azure(in, "t.csv", o);
}

TEST(Mooncake, ParsesTheRealTrace) {
    auto r = load_trace(kTraces + "mooncake_conversation.jsonl", TraceFormat::kAuto, {});
    ASSERT_OK(r);
    ASSERT_EQ(r->size(), 12031u);
    const Request& first = r->front();
    EXPECT_EQ(first.input_len, 6758);
    EXPECT_EQ(first.output_len, 500);
    EXPECT_EQ(first.hash_ids.size(), 14u);
    EXPECT_EQ(first.source_line, 1);
    for (size_t i = 1; i < r->size(); ++i) ASSERT_LE((*r)[i - 1].arrival_ms, (*r)[i].arrival_ms);
    // Every request's prefix blocks cover its input: ceil(input / 512) ids.
    for (const auto& q : *r) {
        ASSERT_EQ(q.hash_ids.size(), static_cast<size_t>((q.input_len + 511) / 512))
            << "line " << q.source_line;
    }
}

TEST(Azure, ParsesTheRealTrace) {
    auto r = load_trace(kTraces + "azure_llm_code.csv", TraceFormat::kAuto, {});
    ASSERT_OK(r);
    EXPECT_EQ(r->size(), 8819u);  // 8820 lines, the last without a newline
    EXPECT_EQ(r->front().arrival_ms, 0.0);
    EXPECT_EQ(r->front().input_len, 4808);
    EXPECT_EQ(r->front().output_len, 10);
    // Second line is 52 ms after the first (18:17:03.97996 -> 18:17:04.03196).
    EXPECT_NEAR((*r)[1].arrival_ms, 52.0, 1e-3);
    EXPECT_TRUE(r->front().hash_ids.empty());
}

TEST(Mooncake, ErrorsNameFileLineAndField) {
    struct Case {
        std::string text;
        std::string expect;
    } cases[] = {
        {"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\nnot json\n",
         "t.jsonl:2: not a JSON object"},
        {"{\"timestamp\": 0, \"output_length\": 1}\n", "t.jsonl:1: missing field 'input_length'"},
        {"{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 1}\n",
         "t.jsonl:1: input_length: -3 must be >= 1"},
        {"{\"timestamp\": 0, \"input_length\": 3, \"output_length\": \"x\"}\n",
         "t.jsonl:1: output_length: \"x\" is not an integer"},
        {"{\"timestamp\": -1, \"input_length\": 3, \"output_length\": 2}\n",
         "t.jsonl:1: timestamp"},
        {"{\"input_length\": 3, \"output_length\": 2}\n", "t.jsonl:1: missing field 'timestamp'"},
        {"\n\n{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 2, \"hash_ids\": [1, "
         "\"a\"]}\n",
         "t.jsonl:3: hash_ids[1]"},
        {"", "no requests"},
    };
    for (const auto& c : cases) {
        auto r = mooncake(c.text);
        ASSERT_FALSE(r.ok()) << c.text;
        EXPECT_THAT(r, StatusIs(StatusCode::kInvalidArgument, HasSubstr(c.expect)))
            << "got: " << r.status().message() << "\nexpected: " << c.expect;
    }
}

TEST(Azure, ErrorsNameFileLineAndField) {
    const std::string hdr = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
    struct Case {
        std::string text;
        std::string expect;
    } cases[] = {
        {"a,b,c\n", "t.csv:1: expected header"},
        {hdr + "2023-11-16 18:17:03.97,10,2\n2023-11-16 18:17:04,10\n",
         "t.csv:3: expected 3 fields"},
        {hdr + "yesterday,10,2\n", "t.csv:2: TIMESTAMP"},
        {hdr + "2023-11-16 18:17:03.97,ten,2\n", "t.csv:2: ContextTokens"},
        {hdr + "2023-11-16 18:17:03.97,10,0\n", "t.csv:2: GeneratedTokens"},
    };
    for (const auto& c : cases) {
        auto r = azure(c.text);
        ASSERT_FALSE(r.ok()) << c.text;
        EXPECT_THAT(r.status().message(), HasSubstr(c.expect))
            << "got: " << r.status().message() << "\nexpected: " << c.expect;
    }
}

TEST(LoadOptions, SortsRebasesScalesAndCaps) {
    const std::string text =
        "{\"timestamp\": 300, \"input_length\": 1500, \"output_length\": 90, \"hash_ids\": [7, 8, "
        "9]}\n"
        "{\"timestamp\": 100, \"input_length\": 10, \"output_length\": 5}\n"
        "{\"timestamp\": 200, \"input_length\": 20, \"output_length\": 6}\n";
    LoadOptions o;
    o.time_scale = 0.5;
    o.max_input_len = 600;
    o.max_output_len = 50;
    auto r = mooncake(text, o);
    ASSERT_OK(r);
    ASSERT_EQ(r->size(), 3u);
    EXPECT_EQ((*r)[0].source_line, 2);
    EXPECT_EQ((*r)[0].arrival_ms, 0.0);
    EXPECT_EQ((*r)[1].arrival_ms, 50.0);
    EXPECT_EQ((*r)[2].arrival_ms, 100.0);
    EXPECT_EQ((*r)[2].input_len, 600);
    EXPECT_EQ((*r)[2].output_len, 50);
    EXPECT_EQ((*r)[2].hash_ids, (std::vector<int64_t>{7, 8}));  // 600 tokens -> 2 blocks
    EXPECT_EQ((*r)[2].id, 2);
    o = {};
    o.skip = 1;
    o.max_requests = 1;
    r = mooncake(text, o);
    ASSERT_OK(r);
    ASSERT_EQ(r->size(), 1u);
    EXPECT_EQ((*r)[0].source_line, 3);
    EXPECT_EQ((*r)[0].arrival_ms, 0.0);
    o = {};
    o.time_scale = 0;
    EXPECT_EQ(mooncake(text, o).status().code(), StatusCode::kInvalidArgument);
}

TEST(LoadOptions, SampleKeepsOrderAndIsDeterministic) {
    LoadOptions o;
    o.sample = 200;
    o.seed = 42;
    auto a = load_trace(kTraces + "mooncake_conversation.jsonl", TraceFormat::kMooncake, o);
    auto b = load_trace(kTraces + "mooncake_conversation.jsonl", TraceFormat::kMooncake, o);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->size(), 200u);
    for (size_t i = 0; i < 200; ++i) {
        EXPECT_EQ((*a)[i].source_line, (*b)[i].source_line);
        if (i > 0) {
            EXPECT_LT((*a)[i - 1].source_line, (*a)[i].source_line);
        }
    }
    o.seed = 43;
    auto c = load_trace(kTraces + "mooncake_conversation.jsonl", TraceFormat::kMooncake, o);
    ASSERT_OK(c);
    int same = 0;
    for (size_t i = 0; i < 200; ++i) same += (*a)[i].source_line == (*c)[i].source_line;
    EXPECT_LT(same, 50);
}

TEST(Synthetic, PoissonRateAndLengths) {
    SyntheticOptions o;
    o.num_requests = 20000;
    o.rate_rps = 50;
    o.input = *parse_length_dist("uniform:100:200");
    o.output = *parse_length_dist("fixed:7");
    auto r = make_synthetic(o);
    ASSERT_OK(r);
    const double mean_gap = r->back().arrival_ms / (20000 - 1);
    EXPECT_NEAR(mean_gap, 20.0, 20.0 * 0.03);
    double var = 0;
    for (size_t i = 1; i < r->size(); ++i) {
        double g = (*r)[i].arrival_ms - (*r)[i - 1].arrival_ms;
        var += (g - mean_gap) * (g - mean_gap);
    }
    const double cv = std::sqrt(var / (20000 - 2)) / mean_gap;
    EXPECT_NEAR(cv, 1.0, 0.05);  // exponential gaps
    for (const auto& q : *r) {
        ASSERT_GE(q.input_len, 100);
        ASSERT_LE(q.input_len, 200);
        ASSERT_EQ(q.output_len, 7);
    }
}

TEST(Synthetic, GammaBurstiness) {
    SyntheticOptions o;
    o.num_requests = 20000;
    o.rate_rps = 10;
    o.gamma = true;
    o.cv = 3.0;
    auto r = make_synthetic(o);
    ASSERT_OK(r);
    std::vector<double> gaps;
    for (size_t i = 1; i < r->size(); ++i)
        gaps.push_back((*r)[i].arrival_ms - (*r)[i - 1].arrival_ms);
    double mean = 0, var = 0;
    for (double g : gaps) mean += g;
    mean /= static_cast<double>(gaps.size());
    for (double g : gaps) var += (g - mean) * (g - mean);
    var /= static_cast<double>(gaps.size() - 1);
    EXPECT_NEAR(mean, 100.0, 100.0 * 0.1);
    EXPECT_NEAR(std::sqrt(var) / mean, 3.0, 0.3);
}

TEST(Synthetic, RejectsBadOptions) {
    EXPECT_FALSE(parse_length_dist("normal:5").ok());
    EXPECT_FALSE(parse_length_dist("uniform:10:5").ok());
    EXPECT_FALSE(parse_length_dist("fixed:0").ok());
    EXPECT_OK(parse_length_dist("lognormal:2048:0.8"));
    SyntheticOptions o;
    o.rate_rps = 0;
    EXPECT_EQ(make_synthetic(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdsim::workload
