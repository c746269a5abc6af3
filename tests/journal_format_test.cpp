// The result journal's file format (sim/testbed/journal_format.h): what parse() accepts, skips
// and refuses, by line; to_text() round trips.
#include "sim/testbed/journal_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "common/text.h"
#include "tests/status_matchers.h"

namespace pdsim::testbed::journal {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

Contents sample() {
    Contents c;
    c.head = {.submitted = 5,
              .mode = "both",
              .topology = "cpu-1p1d",
              .model = "tiny",
              .rank0_instance = "prefill0",
              .slo_ttft_ms = 1000,
              .slo_tpot_ms = 100,
              .report_path = "r.json",
              .requests_path = "r.csv",
              .cwd = "/tmp/run",
              .config = json{{"requests", 5}},
              .started_unix_s = 1.7e9,
              .pid = 42};
    c.flags = "--synthetic 5";
    for (int id : {0, 3}) {
        Record r{.phase = "disagg", .record = {}};
        r.record.id = id;
        r.record.ok = id == 0;
        r.record.error = id == 0 ? "" : "decode rank 1 unreachable";
        r.record.arrival_ms = 10.5 * id;
        r.record.first_token_ms = 10.5 * id + 40;
        r.record.finish_ms = 10.5 * id + 90;
        r.record.input_len = 100 + id;
        r.record.generated = 8;
        c.records.push_back(r);
    }
    c.dead_ranks.push_back(
        {.phase = "disagg", .rank = 1, .instance = "decode0", .detected_at_s = 2, .silent_s = 5});
    c.stopping = "stopped by SIGTERM";
    return c;
}

TEST(JournalFormat, ToTextRoundTrips) {
    const Contents c = sample();
    const std::string text = to_text(c);
    StatusOr<Contents> back = parse(text, "j.jsonl");
    ASSERT_OK(back.status());
    EXPECT_EQ(to_text(*back), text);
    EXPECT_EQ(back->head.submitted, 5);
    EXPECT_EQ(back->head.cwd, "/tmp/run");
    EXPECT_EQ(back->head.config, json({{"requests", 5}}));
    ASSERT_EQ(back->records.size(), 2u);
    EXPECT_EQ(back->records[1].record.id, 3);
    EXPECT_EQ(back->records[1].record.error, "decode rank 1 unreachable");
    EXPECT_DOUBLE_EQ(back->records[1].record.arrival_ms, 31.5);
    ASSERT_EQ(back->dead_ranks.size(), 1u);
    EXPECT_EQ(back->dead_ranks[0].instance, "decode0");
    EXPECT_EQ(back->stopping, "stopped by SIGTERM");
    EXPECT_FALSE(back->report_written);
}

// A death cuts the last line; a recovery may append the report's mark after it.
TEST(JournalFormat, ALastLineCutByADeathIsSkipped) {
    const std::string text = to_text(sample());
    StatusOr<Contents> cut = parse(text + R"({"phase":"disagg","id":4,"ok":tr)", "j.jsonl");
    ASSERT_OK(cut.status());
    EXPECT_EQ(cut->records.size(), 2u);
    StatusOr<Contents> marked =
        parse(text + "{\"phase\n" + text::dump_json(report_written_line()) + "\n", "j.jsonl");
    ASSERT_OK(marked.status());
    EXPECT_TRUE(marked->report_written);
    // The same line anywhere else is an error naming it.
    EXPECT_THAT(parse(text + "{\"phase\n" + text::dump_json(stopping_line("x")), "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:6: not a JSON object")));
}

TEST(JournalFormat, BadLinesAreNamed) {
    const Contents c = sample();
    const std::string head = text::dump_json(head_line(c.head, c.flags)) + "\n";
    auto with_line = [&](json line) { return parse(head + line.dump() + "\n", "j.jsonl"); };
    json bad_id = record_line(c.records[0]);
    bad_id["id"] = 5;
    EXPECT_THAT(with_line(bad_id), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr("j.jsonl:2: id 5 outside [0, 5)")));
    json bad_phase = record_line(c.records[0]);
    bad_phase["phase"] = "prefill";
    EXPECT_THAT(with_line(bad_phase),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:2: phase \"prefill\"")));
    json bad_len = record_line(c.records[0]);
    bad_len["input_len"] = 1.5;
    EXPECT_THAT(with_line(bad_len), StatusIs(StatusCode::kInvalidArgument,
                                             HasSubstr("j.jsonl:2: input_len is not an integer")));
    json huge = record_line(c.records[0]);
    huge["input_len"] = int64_t{1} << 40;
    EXPECT_THAT(with_line(huge),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:2: input_len")));
    json text_time = record_line(c.records[0]);
    text_time["arrival_ms"] = "soon";
    EXPECT_THAT(with_line(text_time), StatusIs(StatusCode::kInvalidArgument,
                                               HasSubstr("j.jsonl:2: arrival_ms is not a number")));
    // JSON has no infinity; nlohmann's reader refuses 1e999 as a number out of range.
    EXPECT_THAT(parse(head + R"({"phase":"disagg","id":0,"arrival_ms":1e999})" + "\n" +
                          text::dump_json(stopping_line("x")),
                      "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:2: not a JSON object")));
    json dead = dead_rank_line(c.dead_ranks[0]);
    dead["dead_rank"] = -1;
    EXPECT_THAT(with_line(dead),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:2: dead_rank -1 out")));
}

TEST(JournalFormat, BadHeadersAreNamed) {
    EXPECT_THAT(parse("", "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:1: empty journal")));
    EXPECT_THAT(parse("{\"id\": 1}\n", "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("j.jsonl:1: not a pdsim testbed journal")));
    json head = head_line(sample().head, "");
    head["run"]["mode"] = "prefill";
    EXPECT_THAT(
        parse(head.dump(), "j.jsonl"),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:1: run.mode \"prefill\"")));
    head = head_line(sample().head, "");
    head["run"].erase("slo_ttft_ms");
    EXPECT_THAT(parse(head.dump(), "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("j.jsonl:1: no \"slo_ttft_ms\"")));
    head = head_line(sample().head, "");
    head["requests_submitted"] = -2;
    EXPECT_THAT(parse(head.dump(), "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("j.jsonl:1: requests_submitted -2 out of")));
    head = head_line(sample().head, "");
    head["run"]["report_path"] = "";
    EXPECT_THAT(parse(head.dump(), "j.jsonl"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("run.report_path is empty")));
}

}  // namespace
}  // namespace pdsim::testbed::journal
