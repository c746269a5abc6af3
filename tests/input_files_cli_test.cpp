// `pdsim simulate` end to end on hostile input files (docs/inputs.md): each one exits 2 with a
// one-line message naming the file (and line), fast, without reading a FIFO or /dev/zero; a trace
// whose name holds a non-UTF-8 byte still gets a valid JSON report.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::test {
namespace {

const std::string kDgx =
    std::string(PDSIM_SOURCE_DIR) + "/topology/examples/dgx-h100-2node-1p1d-tp8.yaml";

void write(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
}

std::string one_request(const std::string& in, const std::string& out) {
    return "{\"timestamp\": 0, \"input_length\": " + in + ", \"output_length\": " + out + "}\n";
}

TEST(InputFilesCli, BadTraceTopologyAndCostFilesExitTwoNamingFileAndLine) {
    TempDir dir("inputs_cli");
    const std::string good = dir.str("good.jsonl");
    write(good, one_request("100", "4"));
    const std::string float_len = dir.str("float.jsonl");
    write(float_len, one_request("100", "4") + one_request("-3.0", "4"));
    const std::string huge_len = dir.str("huge.jsonl");
    write(huge_len, one_request("100", "1e19"));
    const std::string azure = dir.str("big.csv");
    write(azure,
          "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,99999999999999,2\n");
    const std::string two_docs = dir.str("two.yaml");
    write(two_docs, slurp(kDgx) + "---\nname: second\n");
    const std::string fifo = dir.str("fifo");
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    struct Case {
        std::string topology, trace;
        std::vector<std::string> more;
        std::string needle;
    };
    const std::vector<Case> cases = {
        {kDgx, float_len, {}, "float.jsonl:2: input_length: -3.0 is not an integer"},
        {kDgx, huge_len, {}, "huge.jsonl:1: output_length: 1e+19 is not an integer"},
        {kDgx, azure, {}, "big.csv:2: ContextTokens: '99999999999999' must be an integer"},
        {kDgx, "/dev/zero", {}, "/dev/zero: is a character device, not a regular file"},
        {kDgx, fifo, {}, "fifo: is a FIFO, not a regular file"},
        {fifo, good, {}, "fifo: is a FIFO"},
        {two_docs, good, {}, "two.yaml:"},
        {kDgx, good, {"--cost-model", "/dev/zero"}, "/dev/zero: is a character device"},
    };
    for (const Case& c : cases) {
        std::vector<std::string> args = {"simulate", "--topology", c.topology, "--trace", c.trace};
        args.insert(args.end(), c.more.begin(), c.more.end());
        const auto t0 = std::chrono::steady_clock::now();
        const CmdResult r = run_pdsim(args, 30);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_EQ(r.rc, 2) << r.describe();
        EXPECT_THAT(r.err, HasSubstr("pdsim: error: INVALID_ARGUMENT: ")) << r.describe();
        EXPECT_THAT(r.err, HasSubstr(c.needle)) << r.describe();
        EXPECT_LT(r.err.size(), 1000u) << r.describe();
        EXPECT_LT(s, 10.0) << c.needle;
    }
}

TEST(InputFilesCli, ATraceNameWithAnInvalidByteStillGetsAValidReport) {
    TempDir dir("inputs_cli_utf8");
    const std::string trace = dir.str("t\xFF.jsonl");
    write(trace, one_request("100", "4") + one_request("200", "3"));
    const std::string report = dir.str("report.json");
    const CmdResult r =
        run_pdsim({"simulate", "--topology", kDgx, "--trace", trace, "--report", report}, 120);
    ASSERT_EQ(r.rc, 0) << r.describe();
    const std::string text = slurp(report);
    ASSERT_FALSE(text.empty());
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(text)) << text;
    EXPECT_EQ(j["requests_completed"], 2);
    EXPECT_THAT(text, HasSubstr("t\xEF\xBF\xBD.jsonl"));  // the name, with U+FFFD for the byte
}

}  // namespace
}  // namespace pdsim::test
