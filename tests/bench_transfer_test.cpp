// `pdsim bench transfer` end to end (the real binary, tiny sizes): it runs, prints the table and
// writes the JSON keys docs/design.md "bench JSON" promises. Figures are not checked here
// (machine-dependent).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
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

// Under mpirun -np 2 the bench measures rank 0 to rank 1 (two processes), against a raw socket
// stream between the same two processes, and says so; one JSON and one table (rank 0's). A
// transport that cannot cross processes is refused there.
TEST(BenchTransfer, TcpUnderMpirunMeasuresTheTwoProcesses) {
    const std::string file = json_path("tcp_np2");
    const std::string out = file + ".out";
    const std::string mpirun =
        std::string("timeout 300 ") + PDSIM_MPIEXEC + " --oversubscribe -np 2 ";
    std::string cmd = mpirun + PDSIM_BINARY +
                      " bench transfer --transport tcp --sizes 64K,1M --reps 1 "
                      "--mib-per-round 4 --json " +
                      file + " > " + out;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    {
        std::ifstream in(file);
        ASSERT_TRUE(in) << file;
        auto j = nlohmann::json::parse(in);
        EXPECT_NE(j.at("setup").get<std::string>().find("two processes (mpirun -np 2)"),
                  std::string::npos)
            << j.dump();
        EXPECT_NE(j.at("baseline").get<std::string>().find("between the two processes"),
                  std::string::npos)
            << j.dump();
    }
    expect_report(file, "tcp", 2);
    std::ifstream printed(out);
    std::string text((std::istreambuf_iterator<char>(printed)), std::istreambuf_iterator<char>());
    std::filesystem::remove(out);
    size_t headers = 0;
    for (size_t at = text.find("pdsim bench transfer:"); at != std::string::npos;
         at = text.find("pdsim bench transfer:", at + 1)) {
        ++headers;
    }
    EXPECT_EQ(headers, 1u) << text;

    cmd = mpirun + PDSIM_BINARY + " bench transfer --transport local > /dev/null 2>&1";
    const int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc));
    EXPECT_NE(WEXITSTATUS(rc), 0) << "local cannot cross processes";
}

TEST(BenchTransfer, BadInputExitsWith2) {
    std::string cmd = std::string("timeout 60 ") + PDSIM_BINARY +
                      " bench transfer --transport local --sizes 12Q > /dev/null 2>&1";
    int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc));
    EXPECT_EQ(WEXITSTATUS(rc), 2);
}

}  // namespace
