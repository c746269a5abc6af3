// Routing and batch planning (sim/policy): the testbed's rules, checked against hand-worked cases.
#include <gtest/gtest.h>

#include <vector>

#include "sim/policy/batching.h"
#include "sim/policy/routing.h"

namespace pdsim::policy {
namespace {

TEST(PickLeastLoaded, LeastLoadWinsAndTiesGoRoundRobinAfterTheLastChoice) {
    const std::vector<int> cand = {0, 1, 2};
    const std::vector<double> load = {3, 1, 1};
    int last = -1;
    EXPECT_EQ(pick_least_loaded(cand, load, &last), 1);  // scan from 0: 1 is the first minimum
    EXPECT_EQ(last, 1);
    EXPECT_EQ(pick_least_loaded(cand, load, &last), 2);  // scan from 2: 2 ties 1 and comes first
    EXPECT_EQ(pick_least_loaded(cand, load, &last), 1);  // scan from 0 again
    const std::vector<double> equal = {5, 5, 5};
    last = -1;
    std::vector<int> seq;
    for (int i = 0; i < 4; ++i) seq.push_back(pick_least_loaded(cand, equal, &last));
    EXPECT_EQ(seq, (std::vector<int>{0, 1, 2, 0}));
}

TEST(PickLeastLoaded, CandidatesAreInstanceIndicesIntoTheLoadVector) {
    const std::vector<int> cand = {3, 5};
    const std::vector<double> load = {0, 0, 0, 7, 0, 2};
    int last = 3;
    EXPECT_EQ(pick_least_loaded(cand, load, &last), 5);
    EXPECT_EQ(pick_least_loaded({}, load, &last), -1);
}

TEST(LoadBalancer, DisaggregatedCountsUnprefilledInputAndUnfinishedKv) {
    // Instances 0, 1 prefill; 2 decode.
    LoadBalancer lb({true, true, false}, /*colocated=*/false);
    const Assignment a = lb.assign(100, 10);
    EXPECT_EQ(a.prefill, 0);
    EXPECT_EQ(a.decode, 2);
    EXPECT_EQ(lb.load_a(0), 100);
    EXPECT_EQ(lb.load_b(2), 110);
    const Assignment b = lb.assign(50, 5);  // prefill 1 is empty
    EXPECT_EQ(b.prefill, 1);
    const Assignment c = lb.assign(10, 1);  // 100 vs 50: prefill 1
    EXPECT_EQ(c.prefill, 1);
    EXPECT_EQ(lb.load_a(1), 60);
    lb.prefill_done(a, 100);
    EXPECT_EQ(lb.load_a(0), 0);
    EXPECT_EQ(lb.load_b(2), 110 + 55 + 11);
    lb.finished(a, 100, 10, /*prefill_released=*/true);
    lb.finished(b, 50, 5, /*prefill_released=*/false);  // releases its input too
    EXPECT_EQ(lb.load_a(1), 10);
    EXPECT_EQ(lb.load_b(2), 11);
}

TEST(LoadBalancer, ColocatedCountsInputUntilFirstTokenAndOutputUntilTerminal) {
    LoadBalancer lb({true, false}, /*colocated=*/true);
    const Assignment a = lb.assign(100, 10);
    EXPECT_EQ(a.prefill, 0);
    EXPECT_EQ(a.decode, 0);
    EXPECT_EQ(lb.load_a(0), 110);
    const Assignment b = lb.assign(20, 200);
    EXPECT_EQ(b.decode, 1);
    lb.prefill_done(a, 100);
    EXPECT_EQ(lb.load_a(0), 10);
    EXPECT_EQ(lb.assign(1, 1).decode, 0);  // 10 < 220
    lb.finished(a, 100, 10, true);
    EXPECT_EQ(lb.load_a(0), 2);
}

TEST(ExtendPlanner, FcfsChunksUntilTheTokenBudgetIsSpent) {
    BatchingOptions o;  // chunk 512, budget 2048
    ExtendPlanner p(o);
    std::vector<int64_t> got;
    for (int64_t rem : {1000, 300, 5000, 700, 100, 50}) {
        if (p.full()) break;
        got.push_back(p.take(rem));
    }
    // 512 + 300 + 512 + 512 = 1836; then min(100, 512, 212) = 100; then min(50, 512, 112) = 50.
    EXPECT_EQ(got, (std::vector<int64_t>{512, 300, 512, 512, 100, 50}));
    EXPECT_EQ(p.tokens(), 1986);
    EXPECT_FALSE(p.full());

    ExtendPlanner q(o);
    got.clear();
    for (int64_t rem : {3000, 3000, 3000, 3000, 3000}) {
        if (q.full()) break;
        got.push_back(q.take(rem));
    }
    EXPECT_EQ(got, (std::vector<int64_t>{512, 512, 512, 512}));
    EXPECT_TRUE(q.full());

    o.chunk_size = 100;
    o.max_batch_tokens = 250;
    ExtendPlanner r(o);
    EXPECT_EQ(r.take(0), 0);  // nothing left: skipped, budget untouched
    EXPECT_EQ(r.take(1000), 100);
    EXPECT_EQ(r.take(1000), 100);
    EXPECT_EQ(r.take(1000), 50);
    EXPECT_TRUE(r.full());
}

TEST(DecodePlanner, BatchSizeAndKvBoundsCloseTheBatch) {
    BatchingOptions o;
    o.max_decode_batch = 3;
    DecodePlanner p(o);
    EXPECT_TRUE(p.take(10));
    EXPECT_TRUE(p.take(10));
    EXPECT_TRUE(p.take(10));
    EXPECT_FALSE(p.take(10));
    EXPECT_EQ(p.count(), 3);
    EXPECT_EQ(p.kv_tokens(), 30);

    o.max_decode_batch = 64;
    o.max_decode_kv_tokens = 100;
    DecodePlanner q(o);
    EXPECT_TRUE(q.take(500));  // the first request always fits
    EXPECT_FALSE(q.take(1));
    DecodePlanner r(o);
    EXPECT_TRUE(r.take(60));
    EXPECT_FALSE(r.take(50));  // 110 > 100
    EXPECT_EQ(r.count(), 1);
}

TEST(ChooseForward, ExtendAndDecodeAlternateWhenBothAreWaiting) {
    EXPECT_EQ(choose_forward(false, false, false), ForwardKind::kNone);
    EXPECT_EQ(choose_forward(false, false, true), ForwardKind::kNone);
    EXPECT_EQ(choose_forward(true, false, true), ForwardKind::kExtend);
    EXPECT_EQ(choose_forward(true, false, false), ForwardKind::kExtend);
    EXPECT_EQ(choose_forward(false, true, true), ForwardKind::kDecode);
    EXPECT_EQ(choose_forward(true, true, false), ForwardKind::kExtend);
    EXPECT_EQ(choose_forward(true, true, true), ForwardKind::kDecode);
}

}  // namespace
}  // namespace pdsim::policy
