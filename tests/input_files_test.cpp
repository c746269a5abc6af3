// Every input file validated at the edge (docs/inputs.md): the common helpers (common/text.h,
// common/input_file.h), the trace readers, the topology loader, model and cost files, and the
// report writers, which must never fail on content.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "backends/model/model_config.h"
#include "common/input_file.h"
#include "common/text.h"
#include "common/yaml_documents.h"
#include "sim/cost/cost_model.h"
#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "sim/workload/workload.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"
#include "topology/loader.h"

namespace pdsim {
namespace {

using test::TempDir;

void write(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
}

std::string make_fifo(const TempDir& dir) {
    const std::string path = dir.str("fifo");
    EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0);
    return path;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- common/text.h ----

TEST(Utf8, ValidPrefixStopsAtTheFirstBadByte) {
    EXPECT_EQ(text::valid_utf8_prefix(""), 0u);
    EXPECT_EQ(text::valid_utf8_prefix("abc"), 3u);
    EXPECT_TRUE(text::is_valid_utf8("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"));
    EXPECT_EQ(text::valid_utf8_prefix("ab\xFF"
                                      "cd"),
              2u);
    EXPECT_FALSE(text::is_valid_utf8("\xC0\xAF"));          // overlong '/'
    EXPECT_FALSE(text::is_valid_utf8("\xE0\x80\xAF"));      // overlong
    EXPECT_FALSE(text::is_valid_utf8("\xED\xA0\x80"));      // surrogate U+D800
    EXPECT_FALSE(text::is_valid_utf8("\xF4\x90\x80\x80"));  // above U+10FFFF
    EXPECT_FALSE(text::is_valid_utf8("\xE2\x82"));          // truncated at the end
    EXPECT_FALSE(text::is_valid_utf8("\x80"));              // a lone continuation byte
}

TEST(Utf8, SanitizeReplacesEachBadByteAndKeepsValidText) {
    EXPECT_EQ(text::sanitize_utf8("caf\xC3\xA9"), "caf\xC3\xA9");
    EXPECT_EQ(text::sanitize_utf8("a\xFF"
                                  "b"),
              "a\xEF\xBF\xBD"
              "b");
    EXPECT_EQ(text::sanitize_utf8("\xE2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD");
    EXPECT_TRUE(text::is_valid_utf8(text::sanitize_utf8("\xC0\xAF\xED\xA0\x80\xFE")));
}

TEST(Excerpt, IsBoundedOneLineAndValidUtf8) {
    const std::string huge(100 << 20, '7');
    const std::string e = text::excerpt(huge);
    EXPECT_EQ(e, std::string(80, '7') + "...");
    EXPECT_EQ(text::excerpt("short"), "short");
    EXPECT_EQ(text::excerpt("a\nb\tc\x01"), "a\\nb\\tc\\x01");
    EXPECT_EQ(text::excerpt("\xFF"
                            "x"),
              "\xEF\xBF\xBD"
              "x");
    // A multi-byte character is not cut in two.
    EXPECT_EQ(text::excerpt("ab\xE2\x82\xAC", 3), "ab...");
}

TEST(DumpJson, NeverThrowsOnInvalidUtf8) {
    nlohmann::json j = {{"name", std::string("trace\xFF.jsonl")}, {std::string("k\xFE"), 1}};
    EXPECT_THROW((void)j.dump(), nlohmann::json::type_error);
    std::string out;
    ASSERT_NO_THROW(out = text::dump_json(j, 2));
    const nlohmann::json back = nlohmann::json::parse(out);
    EXPECT_EQ(back["name"], "trace\xEF\xBF\xBD.jsonl");
}

TEST(YamlDocuments, FindsTheSecondDocumentWithoutLoadAll) {
    EXPECT_EQ(yaml::second_document_line("a: 1\n"), std::nullopt);
    EXPECT_EQ(yaml::second_document_line("---\na: 1\n...\n"), std::nullopt);
    EXPECT_EQ(yaml::second_document_line("a: 1\n---\nb: 2\n"), 2);
    EXPECT_EQ(yaml::second_document_line("a: 1\n---\n"), 2);
    EXPECT_TRUE(yaml::second_document_line("a: 1\n---\n[\n").has_value());  // a broken one
    EXPECT_EQ(yaml::second_document_line("a: [\n"), std::nullopt);  // YAML::Load reports this one
}

// ---- common/input_file.h ----

TEST(InputFile, RefusesAFifoWithoutBlocking) {
    TempDir dir("input_fifo");
    const std::string fifo = make_fifo(dir);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THAT(files::read_input_file(fifo, files::kMaxConfigFileBytes),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(fifo + ": is a FIFO")));
    EXPECT_LT(seconds_since(t0), 2.0);
}

TEST(InputFile, RefusesDevicesAndDirectories) {
    EXPECT_THAT(files::read_input_file("/dev/zero", files::kMaxConfigFileBytes),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("/dev/zero: is a character device, not a regular file")));
    TempDir dir("input_dir");
    EXPECT_THAT(files::InputFile::open(dir.str(), files::kMaxTraceFileBytes),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is a directory")));
    EXPECT_THAT(files::InputFile::open(dir.str("missing"), files::kMaxTraceFileBytes),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("missing: cannot open")));
}

TEST(InputFile, CapsTheSizeAndReadsRegularFiles) {
    TempDir dir("input_cap");
    const std::string path = dir.str("f.txt");
    write(path, std::string(100, 'x'));
    EXPECT_THAT(files::read_input_file(path, 99),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("100 bytes is larger than the 99 bytes limit")));
    ASSERT_OK_AND_ASSIGN(std::string text, files::read_input_file(path, 100));
    EXPECT_EQ(text, std::string(100, 'x'));
    EXPECT_EQ(files::format_byte_limit(files::kMaxTraceFileBytes), "4 GiB");
    EXPECT_EQ(files::format_byte_limit(files::kMaxConfigFileBytes), "16 MiB");
}

// ---- trace readers ----

StatusOr<std::vector<workload::Request>> mooncake(const std::string& text) {
    std::istringstream in(text);
    return workload::parse_mooncake(in, "t.jsonl", {});
}

StatusOr<std::vector<workload::Request>> azure(const std::string& rows) {
    std::istringstream in("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows);
    return workload::parse_azure(in, "t.csv", {});
}

std::string mooncake_line(const std::string& in, const std::string& out,
                          const std::string& extra = "") {
    return "{\"timestamp\": 0, \"input_length\": " + in + ", \"output_length\": " + out + extra +
           "}\n";
}

TEST(TraceLengths, JsonFloatsNegativesAndOverflowAreRefusedWithFileAndLine) {
    const std::string ok = mooncake_line("10", "2");
    struct Case {
        std::string line, expect;
    } cases[] = {
        {mooncake_line("-3.0", "2"), "t.jsonl:2: input_length: -3.0 is not an integer"},
        {mooncake_line("3.0", "2"), "t.jsonl:2: input_length: 3.0 is not an integer"},
        {mooncake_line("10", "-100.0"), "t.jsonl:2: output_length: -100.0 is not an integer"},
        {mooncake_line("1e19", "2"), "t.jsonl:2: input_length: 1e+19 is not an integer"},
        {mooncake_line("10", "1e300"), "t.jsonl:2: output_length: 1e+300 is not an integer"},
        {mooncake_line("-3", "2"), "t.jsonl:2: input_length: -3 must be >= 1 and <= 1073741823"},
        {mooncake_line("1073741824", "2"), "t.jsonl:2: input_length: 1073741824 must be >= 1"},
        {mooncake_line("10", "18446744073709551615"),
         "t.jsonl:2: output_length: 18446744073709551615 must be >= 1"},
        {mooncake_line("10", "0"), "t.jsonl:2: output_length: 0 must be >= 1"},
        {"{\"timestamp\": -1, \"input_length\": 3, \"output_length\": 2}\n",
         "t.jsonl:2: timestamp: -1 must be a finite number >= 0"},
        {"{\"timestamp\": \"soon\", \"input_length\": 3, \"output_length\": 2}\n",
         "t.jsonl:2: timestamp: \"soon\" must be"},
    };
    for (const Case& c : cases) {
        EXPECT_THAT(mooncake(ok + c.line),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr(c.expect)))
            << c.line;
    }
    ASSERT_OK_AND_ASSIGN(auto reqs, mooncake(mooncake_line("1073741823", "1073741823")));
    EXPECT_EQ(reqs.front().input_len, workload::kMaxTraceTokens);
}

TEST(TraceHashIds, MustBeInt64AndNoMoreThanTheInputHasBlocks) {
    EXPECT_THAT(mooncake(mooncake_line("10", "2", ", \"hash_ids\": [18446744073709551615]")),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("t.jsonl:1: hash_ids[0]: 18446744073709551615 is out of the "
                                   "int64 range")));
    EXPECT_THAT(mooncake(mooncake_line("1000", "2", ", \"hash_ids\": [1, 2, 3]")),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("t.jsonl:1: hash_ids: 3 blocks for input_length 1000 (at most "
                                   "2 blocks")));
    EXPECT_THAT(mooncake(mooncake_line("10", "2", ", \"hash_ids\": [1.5]")),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("t.jsonl:1: hash_ids[0]: 1.5 is not an integer")));
    ASSERT_OK_AND_ASSIGN(auto reqs,
                         mooncake(mooncake_line("1025", "2",
                                                ", \"hash_ids\": [-9223372036854775808, 0, "
                                                "9223372036854775807]")));
    EXPECT_EQ(reqs.front().hash_ids.size(), 3u);
    EXPECT_EQ(reqs.front().hash_ids.back(), INT64_MAX);
}

TEST(TraceAzure, NumbersAreStrictWithTheSameRangeAndNoClamp) {
    struct Case {
        std::string row, expect;
    } cases[] = {
        {"2023-11-16 18:17:03.97,1e14,2\n",
         "t.csv:2: ContextTokens: '1e14' must be an integer from 1 to 1073741823"},
        {"2023-11-16 18:17:03.97,99999999999999,2\n", "t.csv:2: ContextTokens: '99999999999999'"},
        {"2023-11-16 18:17:03.97,1073741824,2\n", "t.csv:2: ContextTokens: '1073741824'"},
        {"2023-11-16 18:17:03.97,-5,2\n", "t.csv:2: ContextTokens: '-5'"},
        {"2023-11-16 18:17:03.97,+5,2\n", "t.csv:2: ContextTokens: '+5'"},
        {"2023-11-16 18:17:03.97,10,3.0\n", "t.csv:2: GeneratedTokens: '3.0'"},
        {"2023-11-16 18:17:03.97,10,99999999999999999999999\n", "t.csv:2: GeneratedTokens"},
    };
    for (const Case& c : cases) {
        EXPECT_THAT(azure(c.row), StatusIs(StatusCode::kInvalidArgument, HasSubstr(c.expect)))
            << c.row;
    }
    ASSERT_OK_AND_ASSIGN(auto reqs, azure("2023-11-16 18:17:03.97, 1073741823 ,7\r\n"));
    EXPECT_EQ(reqs.front().input_len, workload::kMaxTraceTokens);
}

// Found by trace_azure_fuzz (fuzz/regressions/trace_azure_fuzz/): sscanf's %lf reads "nan" as the
// seconds, which passed the range check and gave a NaN arrival; a year far from 1900 overflowed
// Y - 1900 (UBSan).
TEST(TraceAzure, TimestampSecondsNaNAndYearOutOfRangeAreRefused) {
    for (const char* row : {"2023-11-16 18:17:nan,10,2\n", "2023-11-16 18:17:NAN(1),10,2\n",
                            "-2147483648-11-16 18:17:03.97,10,2\n",
                            "2147483647-11-16 18:17:03.97,10,2\n", "0-11-16 18:17:03.97,10,2\n"}) {
        EXPECT_THAT(azure(row),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("t.csv:2: TIMESTAMP: ")))
            << row;
    }
    ASSERT_OK(azure("9999-12-31 23:59:60.5,10,2\n0001-01-01 00:00:00,10,2\n"));
}

TEST(TraceMessages, QuoteAtMostABoundedExcerpt) {
    const std::string field(100 << 20, '9');  // 100 MB, as in the probe
    auto csv = azure("2023-11-16 18:17:03.97," + field + ",2\n");
    EXPECT_THAT(csv, StatusIs(StatusCode::kInvalidArgument, HasSubstr("t.csv:2: ContextTokens")));
    EXPECT_LT(csv.status().message().size(), 300u);
    const std::string json_field(1 << 20, '9');  // 1 MB: the JSON parser is slower per byte
    auto jsonl = mooncake("{\"timestamp\": \"" + json_field + "\", \"input_length\": 1}\n");
    EXPECT_THAT(jsonl, StatusIs(StatusCode::kInvalidArgument, HasSubstr("t.jsonl:1: timestamp")));
    EXPECT_LT(jsonl.status().message().size(), 300u);
    auto garbage = mooncake("x" + json_field + "\n");
    EXPECT_THAT(garbage,
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("t.jsonl:1: not a JSON object")));
    EXPECT_LT(garbage.status().message().size(), 300u);
}

TEST(TraceFiles, OnlyRegularFilesAreRead) {
    TempDir dir("trace_files");
    const std::string fifo = make_fifo(dir);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THAT(workload::load_trace(fifo, workload::TraceFormat::kAuto, {}),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is a FIFO")));
    EXPECT_LT(seconds_since(t0), 2.0);
    EXPECT_THAT(workload::load_trace("/dev/zero", workload::TraceFormat::kAuto, {}),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("/dev/zero: is a character")));
    // Format detection by the first character still works through the checked file.
    const std::string noext = dir.str("trace");
    write(noext, mooncake_line("10", "2"));
    ASSERT_OK_AND_ASSIGN(auto reqs, workload::load_trace(noext, workload::TraceFormat::kAuto, {}));
    EXPECT_EQ(reqs.size(), 1u);
}

// ---- topology loader ----

const std::string kTopologyText =
    std::string("name: t\nnodes:\n  - id: n0\n    devices:\n      - {id: g0, type: h100}\n") +
    "instances:\n  - {id: p0, role: prefill, tp: 1, devices: [n0/g0]}\n";

TEST(TopologyFile, OneYamlDocumentOnly) {
    auto two = topo::parse_topology(kTopologyText + "---\nname: second\n", "x.yaml",
                                    topo::Format::kAuto, {.validate = false});
    EXPECT_THAT(two, StatusIs(StatusCode::kInvalidArgument,
                              HasSubstr("x.yaml:8: a second YAML document starts here")));
    ASSERT_OK(topo::parse_topology("---\n" + kTopologyText, "x.yaml", topo::Format::kAuto,
                                   {.validate = false}));
}

TEST(TopologyFile, StringsAndKeysMustBeValidUtf8) {
    std::string bad_name = kTopologyText;
    bad_name.replace(bad_name.find("name: t"), 7, "name: t\xFF");
    EXPECT_THAT(topo::parse_topology(bad_name, "x.yaml", topo::Format::kAuto, {.validate = false}),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("x.yaml:1: name: \"t\\xff\" is not valid UTF-8")));
    std::string bad_id = kTopologyText;
    bad_id.replace(bad_id.find("id: n0"), 6, "id: n\xC0\xAF");
    EXPECT_THAT(topo::parse_topology(bad_id, "x.yaml", topo::Format::kAuto, {.validate = false}),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("x.yaml:3: nodes[0].id: \"n\\xc0\\xaf\" is not valid UTF-8")));
    EXPECT_THAT(topo::parse_topology("{\"name\": \"t\xFF\"}", "x.json"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("x.json:1:")));
}

TEST(TopologyFile, OnlyRegularFilesAreRead) {
    TempDir dir("topology_files");
    const std::string fifo = make_fifo(dir);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THAT(topo::load_topology(fifo),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(fifo + ": is a FIFO")));
    EXPECT_LT(seconds_since(t0), 2.0);
    EXPECT_THAT(topo::load_topology("/dev/zero"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("/dev/zero: is a character")));
}

// ---- model files ----

TEST(ModelFile, RegularFileOneDocumentValidUtf8) {
    TempDir dir("model_files");
    EXPECT_THAT(model::resolve_model("/dev/zero"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("/dev/zero: is a character")));
    const std::string fifo = make_fifo(dir);
    EXPECT_THAT(model::resolve_model(fifo),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is a FIFO")));
    const std::string two = dir.str("two.yaml");
    write(two, "base: tiny\n---\nbase: llama3-8b\n");
    EXPECT_THAT(model::resolve_model(two),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("two.yaml:2: a second YAML document starts here")));
    const std::string bad = dir.str("bad.yaml");
    write(bad, "base: tiny\nname: m\xFF\n");
    EXPECT_THAT(model::resolve_model(bad),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("bad.yaml:2: name: 'm\xEF\xBF\xBD' is not valid UTF-8")));
    const std::string good = dir.str("good.yaml");
    write(good, "base: tiny\nname: caf\xC3\xA9\nnum_layers: 2\n");
    ASSERT_OK_AND_ASSIGN(model::ModelConfig m, model::resolve_model(good));
    EXPECT_EQ(m.num_layers, 2);
}

// ---- cost-model files ----

TEST(CostFile, RegularFileAndSyntaxErrorsNameTheLine) {
    TempDir dir("cost_files");
    EXPECT_THAT(cost::CostFile::load("/dev/zero"),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("/dev/zero: is a character")));
    const std::string fifo = make_fifo(dir);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THAT(cost::CostFile::load(fifo),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is a FIFO")));
    EXPECT_LT(seconds_since(t0), 2.0);
    const std::string broken = dir.str("c.json");
    write(broken, "{\n  \"model\": \"x\",\n  oops\n}\n");
    EXPECT_THAT(cost::CostFile::load(broken),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("c.json:3: not valid JSON")));
}

// Found by cost_file_fuzz (fuzz/regressions/cost_file_fuzz/): a number that overflows a double
// makes nlohmann's parse throw out_of_range (406), not parse_error; it escaped load and
// terminated the process.
TEST(CostFile, ANumberThatOverflowsADoubleIsAnError) {
    TempDir dir("cost_overflow");
    const std::string f = dir.str("c.json");
    write(f, "{\"schema_version\": 11e308, \"model\": \"tiny\"}\n");
    EXPECT_THAT(cost::CostFile::load(f),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("c.json: not valid JSON")));
}

// ---- report writers ----

TEST(ReportWriters, InvalidUtf8NeverFailsAWriter) {
    TempDir dir("report_utf8");
    metrics::Report report;
    report.mode = "simulate";
    report.topology = "topo\xFF";
    report.model = "m";
    report.failures = {"transport said \xC0\xAF"};
    report.extra["trace"] = std::string("/tmp/t\xFF.jsonl");
    const std::string path = dir.str("report.json");
    ASSERT_OK(metrics::write_report(path, report));
    const nlohmann::json back = nlohmann::json::parse(test::slurp(path));  // throws if invalid
    EXPECT_EQ(back["topology"], "topo\xEF\xBF\xBD");
    EXPECT_EQ(back["trace"], "/tmp/t\xEF\xBF\xBD.jsonl");

    metrics::Timeline timeline;
    timeline.name_process(1, "instance \xFF");
    const std::string tl = dir.str("timeline.json");
    ASSERT_OK(timeline.write(tl));
    nlohmann::json timeline_back;
    EXPECT_NO_THROW(timeline_back = nlohmann::json::parse(test::slurp(tl)));
    EXPECT_TRUE(timeline_back.contains("traceEvents"));

    metrics::RequestRecord failed{.id = 0, .ok = false, .error = "bad \xFF byte"};
    const std::string csv = dir.str("requests.csv");
    ASSERT_OK(metrics::write_requests_csv(csv, {failed}));
    EXPECT_TRUE(text::is_valid_utf8(test::slurp(csv)));
}

}  // namespace
}  // namespace pdsim
