// The `pdsim` command line, run as a process: --help and --version exit 0 and print usage; every
// subcommand (found by walking the help output, so new ones are covered automatically) answers
// --help with its usage; bad input (unknown flag, unknown subcommand, bad value, no subcommand)
// exits 2 with a message on stderr.
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::test {
namespace {

std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
    return s;
}

// Names listed under "Subcommands:" in a CLI11 help text.
std::vector<std::string> subcommands_in(const std::string& help) {
    std::vector<std::string> names;
    std::istringstream in(help);
    std::string line;
    bool in_section = false;
    while (std::getline(in, line)) {
        if (line.rfind("Subcommands:", 0) == 0) {
            in_section = true;
            continue;
        }
        if (!in_section) continue;
        if (line.empty()) break;
        // "  name      description"; continuation lines are indented further.
        if (line.size() > 2 && line[0] == ' ' && line[1] == ' ' && line[2] != ' ') {
            names.push_back(line.substr(2, line.find(' ', 2) - 2));
        }
    }
    return names;
}

// Every subcommand path ({"attn-dump"}, {"bench"}, {"bench", "attention"}, ...).
std::vector<std::vector<std::string>> all_subcommands() {
    std::vector<std::vector<std::string>> out;
    std::function<void(const std::vector<std::string>&)> walk =
        [&](const std::vector<std::string>& path) {
            std::vector<std::string> args = path;
            args.push_back("--help");
            CmdResult r = run_pdsim(args, 60);
            EXPECT_EQ(r.rc, 0) << "pdsim " << join(args) << "\n" << r.describe();
            for (const auto& name : subcommands_in(r.out)) {
                std::vector<std::string> sub = path;
                sub.push_back(name);
                out.push_back(sub);
                walk(sub);
            }
        };
    walk({});
    return out;
}

TEST(Cli, HelpPrintsUsageAndSubcommands) {
    CmdResult r = run_pdsim({"--help"}, 60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_THAT(r.out, HasSubstr("Usage: pdsim"));
    EXPECT_THAT(r.out, HasSubstr("--version"));
    const auto subs = subcommands_in(r.out);
    EXPECT_NE(std::find(subs.begin(), subs.end(), "attn-dump"), subs.end()) << r.out;
    EXPECT_NE(std::find(subs.begin(), subs.end(), "bench"), subs.end()) << r.out;
    EXPECT_EQ(run_pdsim({"-h"}, 60).out, r.out) << "-h and --help differ";
}

TEST(Cli, VersionPrintsTheProjectVersion) {
    CmdResult r = run_pdsim({"--version"}, 60);
    ASSERT_EQ(r.rc, 0) << r.describe();
    EXPECT_EQ(r.out, std::string("pdsim ") + PDSIM_VERSION + "\n");
}

TEST(Cli, EverySubcommandHasHelp) {
    const auto subs = all_subcommands();
    ASSERT_GE(subs.size(), 3u) << "expected at least attn-dump, bench, bench attention";
    for (const auto& path : subs) {
        std::vector<std::string> args = path;
        args.push_back("--help");
        CmdResult r = run_pdsim(args, 60);
        EXPECT_EQ(r.rc, 0) << "pdsim " << join(args) << "\n" << r.describe();
        EXPECT_THAT(r.out, HasSubstr("Usage: pdsim " + join(path)))
            << "pdsim " << join(args) << " does not print its usage\n"
            << r.out;
        EXPECT_THAT(r.out, HasSubstr("--help")) << "pdsim " << join(args);
    }
}

void expect_usage_error(const std::vector<std::string>& args,
                        const std::string& must_mention = "") {
    CmdResult r = run_pdsim(args, 60);
    EXPECT_EQ(r.rc, 2) << "pdsim " << join(args) << "\n" << r.describe();
    EXPECT_FALSE(r.err.empty()) << "pdsim " << join(args) << ": no message on stderr";
    if (!must_mention.empty()) {
        EXPECT_THAT(r.err, HasSubstr(must_mention))
            << "pdsim " << join(args) << ": stderr does not mention '" << must_mention << "'\n"
            << r.err;
    }
}

TEST(Cli, NoSubcommandExits2) {
    expect_usage_error({});
}

TEST(Cli, UnknownSubcommandExits2) {
    expect_usage_error({"frobnicate"});
    expect_usage_error({"bench", "frobnicate"});
}

TEST(Cli, UnknownFlagExits2) {
    expect_usage_error({"--no-such-flag"});
    TempDir dir("cli");
    expect_usage_error({"attn-dump", "--out", dir.str(), "--no-such-flag"}, "--no-such-flag");
    expect_usage_error({"bench", "attention", "--no-such-flag"}, "--no-such-flag");
    // Every subcommand rejects an unknown flag.
    for (const auto& path : all_subcommands()) {
        std::vector<std::string> args = path;
        args.push_back("--no-such-flag");
        expect_usage_error(args);
    }
}

TEST(Cli, BadValueExits2) {
    TempDir dir("cli");
    expect_usage_error({"--log-level", "loud", "attn-dump", "--out", dir.str()}, "--log-level");
    expect_usage_error({"attn-dump", "--out", dir.str(), "--mode", "sideways"}, "--mode");
    expect_usage_error({"attn-dump", "--out", dir.str(), "--page-size", "0"}, "--page-size");
    expect_usage_error({"attn-dump", "--out", dir.str(), "--head-dim", "x"}, "--head-dim");
}

}  // namespace
}  // namespace pdsim::test
