// FileRendezvous (transfer/rendezvous.h): threads act as ranks over a temporary directory.
#include "transfer/rendezvous.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;

class RendezvousTest : public ::testing::Test {
protected:
    void SetUp() override {
        std::string tmpl =
            (std::filesystem::temp_directory_path() / "pdsim-rendezvous-XXXXXX").string();
        ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
        root_ = tmpl;
        dir_ = root_ + "/nested/dir";  // publish creates it
    }
    void TearDown() override {
        std::error_code ec;
        std::filesystem::remove_all(root_, ec);
    }
    std::string root_;
    std::string dir_;
};

// Each rank's value: distinct, and with bytes a text read would mangle.
std::string value_of(int rank) {
    std::string v = "rank " + std::to_string(rank) + " at host:" + std::to_string(4000 + rank);
    v.push_back('\0');
    v.push_back('\n');
    v.push_back(static_cast<char>(0xff - rank));
    return v;
}

TEST_F(RendezvousTest, EveryRankCollectsEveryOthersValue) {
    constexpr int kRanks = 5;
    std::vector<std::vector<std::string>> seen(kRanks);
    std::vector<Status> errors(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
        threads.emplace_back([&, r] {
            FileRendezvous rv(dir_, "addr");
            // Stagger the publications so that collectors really wait for late ranks.
            std::this_thread::sleep_for(std::chrono::milliseconds(15 * (kRanks - r)));
            errors[r] = rv.publish(r, value_of(r));
            if (!errors[r].ok()) return;
            std::vector<int> others;
            for (int p = 0; p < kRanks; ++p) {
                if (p != r) others.push_back(p);
            }
            auto got = rv.collect(others, 10s);
            if (!got.ok()) {
                errors[r] = got.status();
                return;
            }
            seen[r] = std::move(got).value();
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
        ASSERT_OK(errors[r]);
        std::vector<std::string> expected;
        for (int p = 0; p < kRanks; ++p) {
            if (p != r) expected.push_back(value_of(p));
        }
        EXPECT_EQ(seen[r], expected) << "rank " << r;
    }
}

TEST_F(RendezvousTest, TryReadSeesNothingBeforeAndTheValueAfter) {
    FileRendezvous rv(dir_, "nccl-id");
    EXPECT_FALSE(rv.try_read(0).has_value());
    ASSERT_OK(rv.publish(0, value_of(0)));
    ASSERT_TRUE(rv.try_read(0).has_value());
    EXPECT_EQ(*rv.try_read(0), value_of(0));
    EXPECT_EQ(rv.path_of(0), dir_ + "/rank-0.nccl-id");
    // Another key in the same directory is another exchange.
    EXPECT_FALSE(FileRendezvous(dir_, "addr").try_read(0).has_value());
    // A later publish replaces the value.
    ASSERT_OK(rv.publish(0, "second"));
    EXPECT_EQ(*rv.try_read(0), "second");
}

TEST_F(RendezvousTest, TimeoutNamesTheDirectoryAndTheMissingRanks) {
    FileRendezvous rv(dir_, "addr");
    ASSERT_OK(rv.publish(1, value_of(1)));
    const std::vector<int> wanted = {1, 2, 3};
    const auto t0 = std::chrono::steady_clock::now();
    auto got = rv.collect(wanted, 100ms);
    const auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_THAT(got, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr(dir_)));
    EXPECT_THAT(got.status().message(), HasSubstr("rank(s) 2, 3 did not publish 'addr'"));
    EXPECT_GE(waited, 100ms);
}

TEST_F(RendezvousTest, UnwritableDirectoryIsUnavailable) {
    // A regular file where the directory should be.
    const std::string file = root_ + "/plain-file";
    { std::ofstream(file) << "x"; }
    FileRendezvous rv(file + "/sub", "addr");
    EXPECT_THAT(rv.publish(0, "v"), StatusIs(StatusCode::kUnavailable, HasSubstr(file)));
}

}  // namespace
}  // namespace pdsim::transfer
