// Every command's flags checked before any work (issue 14, docs/inputs.md "Flags and
// environment"): each row spawns the real binary with one bad flag and expects exit 2, a one-line
// message naming the flag, and a quick return (the check runs while the command line is parsed,
// or in the testbed's option resolution before any rank starts).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A bad flag is rejected while parsing: no file is read, so these need not exist.
const std::vector<std::string> kSim = {"simulate", "--topology", "t.yaml", "--trace", "t.jsonl"};
const std::vector<std::string> kSearch = {"search",    "--gpus",        "8",  "--model",
                                          "llama3-8b", "--synthetic",   "10", "--slo-ttft-ms",
                                          "1000",      "--slo-tpot-ms", "50"};
const std::vector<std::string> kCalibrate = {"calibrate", "--model", "tiny", "--out", "c.json"};

struct Row {
    std::vector<std::string> base;
    std::vector<std::string> bad;
    std::string mention;  // the flag (or variable) the message names
};

std::vector<std::string> concat(const std::vector<std::string>& a,
                                const std::vector<std::string>& b) {
    std::vector<std::string> out = a;
    out.insert(out.end(), b.begin(), b.end());
    return out;
}

std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& a : v) s += (s.empty() ? "" : " ") + a;
    return s;
}

// Exit 2 within a few seconds, one "pdsim: error:" line naming `mention`.
void expect_rejected(const std::vector<std::string>& args, const std::string& mention) {
    const auto t0 = std::chrono::steady_clock::now();
    const CmdResult r = run_pdsim(args, 30);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string what = "pdsim " + join(args) + "\n" + r.describe();
    EXPECT_EQ(r.rc, 2) << what;
    EXPECT_THAT(r.err, HasSubstr("pdsim: error: ")) << what;
    EXPECT_THAT(r.err, HasSubstr(mention)) << what;
    EXPECT_LT(s, 10.0) << what;
}

void expect_rows(const std::vector<Row>& rows) {
    for (const Row& row : rows) expect_rejected(concat(row.base, row.bad), row.mention);
}

TEST(FlagsCli, TransportFaultSpecsAreStrict) {
    expect_rows({
        {{"testbed"}, {"--transport-fault", "delay"}, "--transport-fault"},
        {{"testbed"}, {"--transport-fault", ";;;"}, "--transport-fault"},
        {{"testbed"}, {"--transport-fault", ""}, "--transport-fault"},
        {{"testbed"}, {"--transport-fault", "drop:p=nan"}, "--transport-fault"},
        // --mode both: rejected before the colocated phase runs.
        {{"testbed", "--mode", "both"}, {"--transport-fault", "bogus:x=1"}, "--transport-fault"},
    });
}

TEST(FlagsCli, TestbedChoicesNameTheFlag) {
    expect_rows({
        {{"testbed"}, {"--stream-sync", "maybe"}, "--stream-sync"},
        {{"testbed"}, {"--layerwise", "yes"}, "--layerwise"},
        {{"testbed"}, {"--device-gate", "1"}, "--device-gate"},
    });
}

TEST(FlagsCli, EmptyStringsAreRejected) {
    expect_rows({
        {{"testbed"}, {"--model", ""}, "--model"},
        {kSim, {"--model", ""}, "--model"},
        {kSim, {"--cost-model", ""}, "--cost-model"},
        {kSearch, {"--input-len", ""}, "--input-len"},
        {{"testbed"}, {"--trace", ""}, "--trace"},
        {{"topology", "show", "t.yaml"}, {"--model", ""}, "--model"},
    });
}

TEST(FlagsCli, ValuesThatUsedToAbortOrHang) {
    expect_rows({
        {kSim, {"--time-scale", "1e308"}, "--time-scale"},
        {kSearch, {"--cv", "1e308"}, "--cv"},
        {{"testbed"}, {"--request-timeout-s", "1e10"}, "--request-timeout-s"},
        {{"testbed"}, {"--threads", "100000"}, "--threads"},
        {{"testbed"}, {"--max-batch-tokens", "2147483647"}, "--max-batch-tokens"},
        {kSim, {"--max-decode-batch", "2147483647"}, "--max-decode-batch"},
        {{"testbed"}, {"--synthetic", "2147483647"}, "--synthetic"},
        {kSearch, {"--rate", "inf"}, "--rate"},
        {kSim, {"--slo-ttft-ms", "nan"}, "--slo-ttft-ms"},
    });
}

TEST(FlagsCli, ZeroAndNegativeCounts) {
    expect_rows({
        {kSim, {"--layers", "0"}, "--layers"},
        {{"testbed"}, {"--layers", "-1"}, "--layers"},
        {kSim, {"--max-requests", "0"}, "--max-requests"},
        {{"testbed"}, {"--sample", "0"}, "--sample"},
        {{"testbed"}, {"--synthetic", "0"}, "--synthetic"},
        {kCalibrate, {"--repeats", "0"}, "--repeats"},
        {kCalibrate, {"--node-cpus", "-1"}, "--node-cpus"},
        {{"bench", "transfer"}, {"--window", "0"}, "--window"},
        {{"testbed"}, {"--time-scale", "0"}, "--time-scale"},
        {{"topology", "hostfile", "t.yaml"}, {"--cpus", "0"}, "--cpus"},
    });
}

TEST(FlagsCli, OutputPathsCheckedBeforeTheRun) {
    TempDir dir("flags");
    const std::string missing = "/proc/nonexistent-pdsim/out.json";
    expect_rows({
        {kSim, {"--report", missing}, "--report"},
        {kSim, {"--timeline", dir.str()}, "--timeline"},
        {kSim, {"--requests", missing}, "--requests"},
        {{"testbed"}, {"--report", missing}, "--report"},
        {kSearch, {"--json", missing}, "--json"},
        {{"bench", "transfer"}, {"--json", missing}, "--json"},
        {{"bench", "simulate"}, {"--json", missing}, "--json"},
        {{"bench", "attention"}, {"--json", missing}, "--json"},
        {{"calibrate", "--model", "tiny"}, {"--out", missing}, "--out"},
    });
}

TEST(FlagsCli, AllocationCaps) {
    expect_rows({
        {{"bench", "attention"},
         {"--decode-batch", "4096", "--decode-len", "1048576"},
         "--decode-batch"},
        {{"bench", "transfer"}, {"--window", "1024", "--sizes", "1024M"}, "--window"},
    });
}

// Checked once the topology is known, still before any rank runs.
TEST(FlagsCli, TransportFaultRankWithinTheTopology) {
    expect_rejected(
        {"testbed", "--transport-fault", "disconnect:after=3", "--transport-fault-rank", "5"},
        "--transport-fault-rank 5");
}

TEST(FlagsCli, MessagesQuoteABoundedExcerpt) {
    const std::string huge(300, 'x');
    const CmdResult r = run_pdsim({"testbed", "--transport-fault", huge}, 30);
    EXPECT_EQ(r.rc, 2) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("..."));
    EXPECT_THAT(r.err, Not(HasSubstr(std::string(81, 'x'))));
}

TEST(FlagsCli, HelpShowsTheRanges) {
    const CmdResult r = run_pdsim({"testbed", "--help"}, 30);
    EXPECT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("in [1, 512]"));  // --threads
}

}  // namespace
}  // namespace pdsim::test
