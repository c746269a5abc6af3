// Every `--fault` kind on GPU ranks (label cuda): `pdsim testbed --backend cuda` on gpu-1p1d, tiny,
// 4 synthetic requests, every rank a thread, KV over cuda_ipc (docs/testbed.md "GPU rank"). Each is
// planted on the device stream and caught as on CPU ranks: exit 1 (not 2), and the report says
// why, with requests_completed + requests_failed == requests_submitted:
//   record-before-write   the record kernel before the write (a 3 ms host-function window): the
//                         sender reads stale KV -> violations (or failed requests);
//   skip-record / double-record  the device StepCounter publishes L -/+ 1 steps per forward: the
//                         instance fails (record violations, failed requests);
//   free-before-transfer  PagePins refuses the free: a violation;
//   late-write            a cudaMemsetAsync of layer 0's K after its record: the sender's re-hash
//                         after the sends -> violations;
//   stale-graph-metadata  decode graph replays without the metadata refresh (--mode both): the
//                         KV is right, the tokens are not -> outputs_match false.
// Until the transfer engine moves device KV layouts, its refusal at set-up ends each run at once
// (exit 1, kUnimplemented): checked to be prompt, then skipped with that message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/cli_test_util.h"
#include "tests/testbed_gpu_util.h"

namespace pdsim::test {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

class TestbedGpuFault : public ::testing::TestWithParam<std::string> {};

TEST_P(TestbedGpuFault, IsCaught) {
    if (std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    if (!first_engine_refusal().empty()) {
        FAIL() << "the transfer engine refused device layouts: " << first_engine_refusal();
    }
    const std::string fault = GetParam();
    TempDir dir("tb_gpu_fault");
    GpuPdRun run;
    run.fault = fault;
    run.requests = 4;
    run.mode = fault == "stale-graph-metadata" ? "both" : "disagg";
    double wall_s = 0;
    const CmdResult r = run_gpu_pdsim(run.args(dir), 90, &wall_s);
    if (const std::string refusal = engine_refusal(r); !refusal.empty()) {
        EXPECT_LT(wall_s, kRefusalBoundS) << "the refusal must stop the run at set-up";
        first_engine_refusal() = refusal;
        FAIL() << "the transfer engine refused device layouts: " << refusal;
    }
    EXPECT_EQ(r.rc, 1) << r.describe();
    EXPECT_THAT(r.err, HasSubstr("testbed:"));
    const json rep = load_json(dir.str("report.json"));
    ASSERT_TRUE(rep.is_object()) << r.describe();
    const int violations = rep["ordering"].value("violations", 0);
    const int failed = rep.value("requests_failed", 0);
    EXPECT_EQ(rep.value("requests_completed", -1) + failed, rep.value("requests_submitted", -2));
    if (fault == "stale-graph-metadata") {
        EXPECT_EQ(rep.value("outputs_match", true), false) << rep.dump(1).substr(0, 4000);
        EXPECT_THAT(r.err, HasSubstr("disaggregated outputs differ from colocated"));
        ASSERT_TRUE(rep["ranks"].is_array());
        // The decode rank replayed its graphs (stale): the fault was planted where it claims.
        EXPECT_GT(rep["ranks"][1]["stats"].value("graph_forwards", 0), 0);
        return;
    }
    EXPECT_GT(violations + failed, 0) << rep.dump(1).substr(0, 4000);
    if (fault == "skip-record" || fault == "double-record") {
        EXPECT_GT(rep["ranks"][0]["stats"].value("record_violations", 0), 0);
        EXPECT_GT(failed, 0);
    }
    if (fault == "free-before-transfer" || fault == "late-write") {
        EXPECT_GT(violations, 0);
    }
}

INSTANTIATE_TEST_SUITE_P(Kinds, TestbedGpuFault,
                         ::testing::Values("record-before-write", "skip-record", "double-record",
                                           "stale-graph-metadata", "free-before-transfer",
                                           "late-write"),
                         [](const auto& param_info) {
                             std::string n = param_info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

}  // namespace
}  // namespace pdsim::test
