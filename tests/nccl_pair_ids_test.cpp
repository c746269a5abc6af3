// The nccl transport's host-side pair setup (transfer/nccl/nccl_pair_ids.h) and the GPU option
// block's validation: pair ordering, file names, the file exchange with threads as ranks, its
// timeout message. No GPU, no NCCL: the ids are made-up bytes.
#include "transfer/nccl/nccl_pair_ids.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/status_matchers.h"
#include "transfer/nccl/gpu_transports.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using ::testing::ElementsAre;

constexpr size_t kIdBytes = 128;  // sizeof(ncclUniqueId)

class PairIdsTest : public ::testing::Test {
protected:
    void SetUp() override {
        std::string tmpl =
            (std::filesystem::temp_directory_path() / "pdsim-pair-ids-XXXXXX").string();
        ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
        dir_ = tmpl;
    }
    void TearDown() override {
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    std::string dir_;
};

// A pair's id: distinct per pair, full of bytes a text read would mangle.
std::string id_of(const RankPair& p) {
    std::string id(kIdBytes, '\0');
    for (size_t i = 0; i < kIdBytes; ++i) {
        id[i] = static_cast<char>(
            (i * 31 + static_cast<size_t>(p.low) * 7 + static_cast<size_t>(p.high) * 13) & 0xff);
    }
    id[5] = '\n';
    id[6] = '\0';
    return id;
}

TEST(RankPair, OrdersTheTwoRanksAndRefusesBadOnes) {
    ASSERT_OK(rank_pair(3, 1));
    EXPECT_EQ(*rank_pair(3, 1), (RankPair{1, 3}));
    EXPECT_EQ(*rank_pair(1, 3), (RankPair{1, 3}));
    EXPECT_THAT(rank_pair(2, 2), StatusIs(StatusCode::kInvalidArgument, HasSubstr("2 and 2")));
    EXPECT_THAT(rank_pair(-1, 2), StatusIs(StatusCode::kInvalidArgument));
}

TEST(RankPair, TheLowRankIsRankZeroAndCreatesTheId) {
    const RankPair p{2, 5};
    EXPECT_EQ(rank_in_pair(p, 2), 0);
    EXPECT_EQ(rank_in_pair(p, 5), 1);
    EXPECT_TRUE(creates_pair_id(p, 2));
    EXPECT_FALSE(creates_pair_id(p, 5));
}

TEST(RankPair, EachRankHasOnePairPerPeerAndBothSidesAgree) {
    EXPECT_THAT(pairs_of(1, 4), ElementsAre(RankPair{0, 1}, RankPair{1, 2}, RankPair{1, 3}));
    EXPECT_TRUE(pairs_of(0, 1).empty());
    // Every pair is seen by exactly its two members.
    std::map<std::pair<int, int>, int> seen;
    for (int r = 0; r < 5; ++r) {
        for (const RankPair& p : pairs_of(r, 5)) {
            EXPECT_LT(p.low, p.high);
            EXPECT_TRUE(p.low == r || p.high == r);
            ++seen[{p.low, p.high}];
        }
    }
    EXPECT_EQ(seen.size(), 10u);
    for (const auto& [pair, n] : seen) EXPECT_EQ(n, 2) << pair.first << "-" << pair.second;
}

TEST(RankPair, FileNamesNameBothRanksAndTheLowOnePublishes) {
    EXPECT_EQ(pair_id_key({1, 3}), "nccl-pair-1-3");
    EXPECT_EQ(pair_id_path("/tmp/x", {1, 3}), "/tmp/x/rank-1.nccl-pair-1-3");
    EXPECT_NE(pair_id_path("/tmp/x", {1, 3}), pair_id_path("/tmp/x", {1, 2}));
}

TEST(PairIdMessages, SayWhatTimedOutAndForHowLong) {
    EXPECT_EQ(seconds_text(1000ms), "1 s");
    EXPECT_EQ(seconds_text(250ms), "0.25 s");
    EXPECT_EQ(seconds_text(120'000ms), "120 s");
    EXPECT_EQ(op_timeout_message(3, 1000ms),
              "nccl: op to/from rank 3 pending > 1 s; communicator aborted");
    const std::string init = init_timeout_message(0, {1, 4}, 1500ms);
    EXPECT_THAT(init, HasSubstr("nccl rank 0: communicator with rank(s) 1, 4 not initialized"));
    EXPECT_THAT(init, HasSubstr("after 1.5 s"));
    EXPECT_THAT(init, HasSubstr("connect_timeout"));
}

// Four threads as ranks: every rank ends with the id of each of its pairs, the one the pair's low
// rank made; each id was made once, by its low rank.
TEST_F(PairIdsTest, FileExchangeGivesBothSidesOfEveryPairTheSameId) {
    constexpr int kWorld = 4;
    std::mutex mu;
    std::map<std::pair<int, int>, int> made;  // pair -> the rank that made it
    std::vector<StatusOr<std::vector<std::string>>> got(kWorld, std::vector<std::string>{});
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
        threads.emplace_back([&, r] {
            // The high ranks start first: they must wait for the files, not find them.
            std::this_thread::sleep_for(std::chrono::milliseconds(10 * (kWorld - r)));
            auto make = [&, r](const RankPair& p) -> StatusOr<std::string> {
                std::lock_guard<std::mutex> lock(mu);
                made[{p.low, p.high}] = r;
                return id_of(p);
            };
            got[static_cast<size_t>(r)] =
                exchange_pair_ids_via_files(dir_, r, kWorld, kIdBytes, make, 10s);
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(made.size(), 6u);
    for (const auto& [pair, maker] : made) EXPECT_EQ(maker, pair.first);
    for (int r = 0; r < kWorld; ++r) {
        ASSERT_OK(got[static_cast<size_t>(r)]);
        const std::vector<std::string>& ids = *got[static_cast<size_t>(r)];
        ASSERT_EQ(ids.size(), static_cast<size_t>(kWorld));
        EXPECT_TRUE(ids[static_cast<size_t>(r)].empty());
        for (int peer = 0; peer < kWorld; ++peer) {
            if (peer == r) continue;
            EXPECT_EQ(ids[static_cast<size_t>(peer)], id_of(*rank_pair(r, peer)))
                << "rank " << r << " peer " << peer;
        }
    }
    // One file per pair, named by it.
    size_t files = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
        (void)entry;
        ++files;
    }
    EXPECT_EQ(files, 6u);
    EXPECT_TRUE(std::filesystem::exists(pair_id_path(dir_, {2, 3})));
}

// Rank 2 of 3 alone: ranks 0 and 1 never publish; the error names them, the files and the
// timeout, and comes after about the timeout.
TEST_F(PairIdsTest, FileExchangeTimesOutNamingTheMissingPeers) {
    auto make = [](const RankPair& p) -> StatusOr<std::string> { return id_of(p); };
    const auto start = std::chrono::steady_clock::now();
    auto ids = exchange_pair_ids_via_files(dir_, 2, 3, kIdBytes, make, 300ms);
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_THAT(ids, StatusIs(StatusCode::kDeadlineExceeded,
                              HasSubstr("nccl rank 2: no pair id from rank(s) 0, 1 after 0.3 s")));
    EXPECT_THAT(ids.status().message(), HasSubstr(pair_id_path(dir_, {0, 2})));
    EXPECT_THAT(ids.status().message(), HasSubstr(pair_id_path(dir_, {1, 2})));
    EXPECT_GE(took, 300ms);
    EXPECT_LT(took, 5s);
}

// Rank 0 creates every id: it never waits, even alone.
TEST_F(PairIdsTest, TheLowestRankDoesNotWait) {
    auto make = [](const RankPair& p) -> StatusOr<std::string> { return id_of(p); };
    auto ids = exchange_pair_ids_via_files(dir_, 0, 3, kIdBytes, make, 0ms);
    ASSERT_OK(ids);
    EXPECT_EQ((*ids)[1], id_of({0, 1}));
    EXPECT_EQ((*ids)[2], id_of({0, 2}));
}

TEST_F(PairIdsTest, AnIdOfTheWrongSizeIsDataLoss) {
    {
        std::filesystem::create_directories(dir_);
        std::ofstream(pair_id_path(dir_, {0, 1})) << "short";
    }
    auto make = [](const RankPair& p) -> StatusOr<std::string> { return id_of(p); };
    EXPECT_THAT(exchange_pair_ids_via_files(dir_, 1, 2, kIdBytes, make, 1s),
                StatusIs(StatusCode::kDataLoss, HasSubstr("holds 5 bytes, not 128")));
}

TEST_F(PairIdsTest, BadArgumentsAndMakerErrorsAreReported) {
    auto make = [](const RankPair& p) -> StatusOr<std::string> { return id_of(p); };
    EXPECT_THAT(exchange_pair_ids_via_files("", 0, 2, kIdBytes, make, 1s),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("rendezvous_dir")));
    EXPECT_THAT(exchange_pair_ids_via_files(dir_, 2, 2, kIdBytes, make, 1s),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 2 / world 2")));
    auto failing = [](const RankPair&) -> StatusOr<std::string> {
        return Status(StatusCode::kUnavailable, "no NCCL here");
    };
    EXPECT_THAT(exchange_pair_ids_via_files(dir_, 0, 2, kIdBytes, failing, 1s),
                StatusIs(StatusCode::kUnavailable, HasSubstr("no NCCL here")));
    auto wrong = [](const RankPair&) -> StatusOr<std::string> { return std::string("x"); };
    EXPECT_THAT(exchange_pair_ids_via_files(dir_, 0, 2, kIdBytes, wrong, 1s),
                StatusIs(StatusCode::kDataLoss, HasSubstr("pair 0-1 has 1 bytes")));
}

TEST(GpuTransportOptions, OpTimeoutDefaultsTo120SecondsAndNegativeIsRefused) {
    GpuTransportOptions o;
    EXPECT_EQ(o.op_timeout, 120s);
    EXPECT_OK(validate_gpu_transport_options(o));
    o.op_timeout = 0ms;  // off
    EXPECT_OK(validate_gpu_transport_options(o));
    o.op_timeout = -1ms;
    EXPECT_THAT(validate_gpu_transport_options(o),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("GpuTransportOptions.op_timeout must be >= 0 ms")));
    o.op_timeout = 1s;
    o.device_index = -1;
    EXPECT_THAT(validate_gpu_transport_options(o),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("device_index")));
}

// The factories check the block before anything else (with or without a GPU, built or not).
TEST(GpuTransportOptions, TheFactoriesRefuseANegativeOpTimeout) {
    for (const char* name : {"nccl", "cuda_ipc"}) {
        TransportOptions o;
        o.edit<GpuTransportOptions>().op_timeout = -5ms;
        auto t = create_transport(name, o);
        if (!t.ok() && ::testing::Value(t.status().message(), HasSubstr("not built"))) continue;
        EXPECT_THAT(t, StatusIs(StatusCode::kInvalidArgument, HasSubstr("op_timeout"))) << name;
    }
}

}  // namespace
}  // namespace pdsim::transfer
