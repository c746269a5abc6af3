// `pdsim bench transfer` end to end (the real binary, tiny sizes): it runs, prints the table and
// writes the JSON keys docs/design.md "bench JSON" promises. Figures are not checked here
// (machine-dependent).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

std::string json_path(const std::string& tag) {
    return (std::filesystem::temp_directory_path() /
            ("pdsim_bench_transfer_" + tag + "_" + std::to_string(::getpid()) + ".json"))
        .string();
}

void expect_report(const std::string& file, const std::string& transport, size_t rows) {
    std::ifstream in(file);
    ASSERT_TRUE(in) << file;
    auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j.at("transport"), transport);
    ASSERT_EQ(j.at("rows").size(), rows);
    for (const auto& row : j.at("rows")) {
        for (const char* key : {"bytes", "gbps", "baseline_gbps", "ratio"}) {
            EXPECT_TRUE(row.contains(key)) << key;
        }
        EXPECT_GT(row.at("gbps").get<double>(), 0);
        EXPECT_GT(row.at("baseline_gbps").get<double>(), 0);
    }
    std::filesystem::remove(file);
}

TEST(BenchTransfer, LocalAndTcpWriteTheJson) {
    for (std::string transport : {"local", "tcp"}) {
        std::string file = json_path(transport);
        std::string cmd = std::string("timeout 300 ") + PDSIM_BINARY +
                          " bench transfer --transport " + transport +
                          " --sizes 64K,1M --reps 1 --mib-per-round 4 --json " + file +
                          " > /dev/null";
        ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
        expect_report(file, transport, 2);
    }
}

TEST(BenchTransfer, BadInputExitsWith2) {
    std::string cmd = std::string("timeout 60 ") + PDSIM_BINARY +
                      " bench transfer --transport local --sizes 12Q > /dev/null 2>&1";
    int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc));
    EXPECT_EQ(WEXITSTATUS(rc), 2);
}

}  // namespace
