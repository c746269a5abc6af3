// Every file in tests/data/topology/bad/ must be rejected with exit status 2 by the real binary
// (`pdsim topology validate F`) and with kInvalidArgument by the library, the message naming the
// file, the line and the path of the bad field. Each file's first line is
// "# expect: <substring of the message>" (it starts with the field path); an optional second
// line "# line: N" pins the line the message must name.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/status_matchers.h"
#include "tests/topology_process.h"
#include "topology/loader.h"

namespace pdsim::topo {
namespace {

namespace fs = std::filesystem;

const std::string kBadDir = std::string(PDSIM_SOURCE_DIR) + "/tests/data/topology/bad";

struct BadFile {
    std::string path;
    std::string expect;
    int line = 0;
};

std::vector<BadFile> bad_files() {
    std::vector<BadFile> out;
    for (const auto& e : fs::directory_iterator(kBadDir)) {
        if (e.path().extension() != ".yaml") continue;
        BadFile b;
        b.path = e.path().string();
        const std::string text = test::slurp(e.path());
        const std::string first = text.substr(0, text.find('\n'));
        const std::string tag = "# expect: ";
        if (first.rfind(tag, 0) == 0) b.expect = first.substr(tag.size());
        const size_t second = text.find('\n');
        if (second != std::string::npos && text.compare(second + 1, 8, "# line: ") == 0) {
            b.line = std::stoi(text.substr(second + 9));
        }
        out.push_back(b);
    }
    std::sort(out.begin(), out.end(),
              [](const BadFile& a, const BadFile& b) { return a.path < b.path; });
    return out;
}

void PrintTo(const BadFile& b, std::ostream* os) {
    *os << b.path;
}

std::string name_of(const ::testing::TestParamInfo<BadFile>& info) {
    std::string n = fs::path(info.param.path).stem().string();
    std::replace_if(
        n.begin(), n.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); },
        '_');
    return n;
}

class MalformedTopology : public ::testing::TestWithParam<BadFile> {};

TEST_P(MalformedTopology, LibraryRejectsWithPath) {
    const BadFile& b = GetParam();
    ASSERT_FALSE(b.expect.empty()) << b.path << ": first line must be '# expect: ...'";
    auto t = load_topology(b.path);
    ASSERT_FALSE(t.ok()) << b.path << " was accepted";
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().to_string();
    const std::string msg = t.status().message();
    EXPECT_EQ(msg.rfind(b.path + ":", 0), 0u) << "message does not start with the file: " << msg;
    EXPECT_THAT(msg, HasSubstr(b.expect)) << "expected '" << b.expect << "' in: " << msg;
    if (b.line > 0) {
        EXPECT_EQ(msg.rfind(b.path + ":" + std::to_string(b.line) + ": ", 0), 0u)
            << "expected line " << b.line << " in: " << msg;
    }
}

TEST_P(MalformedTopology, BinaryExitsTwoWithPath) {
    const BadFile& b = GetParam();
    const test::RunResult r = test::run_command(test::shell_quote(PDSIM_BINARY) +
                                                " topology validate " + test::shell_quote(b.path));
    EXPECT_EQ(r.rc, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(b.expect)) << "expected '" << b.expect << "' in: " << r.err;
    EXPECT_THAT(r.err, HasSubstr(b.path + ":"));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("OK"))) << r.out;
}

INSTANTIATE_TEST_SUITE_P(BadFiles, MalformedTopology, ::testing::ValuesIn(bad_files()), name_of);

TEST(MalformedTopologyCorpus, HasAtLeastTwentyFiles) {
    EXPECT_GE(bad_files().size(), 20u);
}

TEST(MalformedTopologyCli, UsageErrorsExitTwo) {
    const std::string bin = test::shell_quote(PDSIM_BINARY);
    EXPECT_EQ(test::run_command(bin + " topology validate").rc, 2);
    EXPECT_EQ(test::run_command(bin + " topology").rc, 2);
    const test::RunResult missing = test::run_command(bin + " topology validate /nonexistent.yaml");
    EXPECT_EQ(missing.rc, 2);
    EXPECT_THAT(missing.err, HasSubstr("/nonexistent.yaml: cannot open"));
    const test::RunResult model = test::run_command(
        bin + " topology validate --model llama9 " +
        test::shell_quote(std::string(PDSIM_SOURCE_DIR) + "/topology/examples/cpu-1p1d.yaml"));
    EXPECT_EQ(model.rc, 2) << model.err;
}

}  // namespace
}  // namespace pdsim::topo
