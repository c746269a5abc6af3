// sim/cost/timeline_fit.h without a subprocess: forward records generated from known cost
// coefficients (the features computed here by hand from docs/cost-models.md's forms, not with
// the library's), fitted, and the coefficients recovered; the overlap and interference rules; and
// the parser's errors, which name the file and the field. Also `pdsim cost-check`'s library
// (sim/cost/forward_check.h) on forwards whose predictions are worked by hand.
#include "sim/cost/timeline_fit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "common/check.h"
#include "sim/cost/forward_check.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::cost {
namespace {

using json = nlohmann::json;

// const, per token, per attention pair, per request (extend); const, per request, per weight
// pass, per KV token (decode).
constexpr std::array<double, 4> kExtend = {1.5e-3, 8.0e-5, 4.0e-8, 3.0e-4};
constexpr std::array<double, 4> kDecode = {3.0e-4, 2.0e-5, 2.5e-4, 2.0e-8};

double extend_seconds(const std::vector<ExtendItem>& items) {
    double tokens = 0, pairs = 0;
    for (const ExtendItem& it : items) {
        const double n = static_cast<double>(it.new_tokens);
        tokens += n;
        pairs += n * (static_cast<double>(it.cached_tokens) + (n + 1) / 2);
    }
    return kExtend[0] + kExtend[1] * tokens + kExtend[2] * pairs +
           kExtend[3] * static_cast<double>(items.size());
}

double decode_seconds(int64_t batch, int64_t kv_tokens) {
    const double passes = static_cast<double>(batch / 4 + batch % 4);
    return kDecode[0] + kDecode[1] * static_cast<double>(batch) + kDecode[2] * passes +
           kDecode[3] * static_cast<double>(kv_tokens);
}

// Deterministic multiplicative noise in [1 - amplitude, 1 + amplitude].
class Noise {
public:
    explicit Noise(double amplitude) : amplitude_(amplitude) {}
    double next() {
        state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
        const double u = static_cast<double>(state_ >> 11) / 9007199254740992.0;  // [0, 1)
        return 1 + amplitude_ * (2 * u - 1);
    }

private:
    double amplitude_;
    uint64_t state_ = 42;
};

// Appends forwards one after another, 10 s apart: none overlaps another (not even a TP
// follower's copy 3x as long).
struct Recorder {
    std::vector<TimelineForward> forwards;
    double now_us = 0;

    void extend(int instance, int tp_rank, std::vector<ExtendItem> items, double seconds) {
        TimelineForward f = place(instance, tp_rank, seconds);
        f.items = std::move(items);
        forwards.push_back(std::move(f));
    }
    void decode(int instance, int64_t batch, int64_t kv_tokens, double seconds) {
        TimelineForward f = place(instance, 0, seconds);
        f.decode = true;
        f.batch = batch;
        f.kv_tokens = kv_tokens;
        forwards.push_back(std::move(f));
    }
    TimelineForward place(int instance, int tp_rank, double seconds) {
        now_us += 1e7;
        TimelineForward f;
        f.begin_us = now_us;
        f.duration_us = seconds * 1e6;
        f.end_us = f.begin_us + f.duration_us;
        f.instance = instance;
        f.tp_rank = tp_rank;
        f.compute_threads = 1;
        return f;
    }
};

// A TP-1 instance's extend forwards over (requests, new, cached) and decode forwards over
// (batch, KV per request), each time scaled by noise.next().
Recorder grid_of_forwards(Noise& noise) {
    Recorder rec;
    for (int requests : {1, 2, 3, 6}) {
        for (int new_tokens : {8, 64, 300, 900}) {
            for (int cached : {0, 256, 1024}) {
                std::vector<ExtendItem> items(static_cast<size_t>(requests), {new_tokens, cached});
                items.back().new_tokens += 5;  // unequal requests
                rec.extend(0, 0, items, extend_seconds(items) * noise.next());
            }
        }
    }
    for (int64_t batch : {1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 24}) {
        for (int64_t kv : {32, 400, 2000}) {
            rec.decode(1, batch, batch * kv, decode_seconds(batch, batch * kv) * noise.next());
        }
    }
    return rec;
}

const json* fit_of(const json& part, int tp, int threads) {
    for (const json& f : part.at("fits")) {
        if (f.at("tp") == tp && f.at("threads") == threads) return &f;
    }
    return nullptr;
}

void expect_coefficients(const json& fit, double relative_tolerance) {
    for (size_t i = 0; i < kExtendKeys.size(); ++i) {
        EXPECT_NEAR(fit["extend"][kExtendKeys[i]].get<double>(), kExtend[i],
                    relative_tolerance * kExtend[i])
            << kExtendKeys[i];
    }
    for (size_t i = 0; i < kDecodeKeys.size(); ++i) {
        EXPECT_NEAR(fit["decode"][kDecodeKeys[i]].get<double>(), kDecode[i],
                    relative_tolerance * kDecode[i])
            << kDecodeKeys[i];
    }
}

// overlap_splits: a leader forward that another instance's leader overlapped for half its time
// ran alone for the other half, and over the shared half got min(1, cpus / threads running) of a
// core; followers and forwards nothing overlapped are not listed.
// A forward slice of `instance`'s TP rank `tp_rank` (one compute thread) from begin for dur.
TimelineForward rank_forward(int instance, int tp_rank, double begin_us, double dur_us) {
    TimelineForward f;
    f.instance = instance;
    f.tp_rank = tp_rank;
    f.begin_us = begin_us;
    f.duration_us = dur_us;
    f.end_us = begin_us + dur_us;
    f.compute_threads = 1;
    return f;
}

TEST(OverlapSplits, AloneAndSharedTimeAsTheContentionModelSeesThem) {
    const std::vector<TimelineForward> forwards = {
        rank_forward(0, 0, 0, 1000),     // 0: instance 1 overlaps its second half
        rank_forward(1, 0, 500, 1000),   // 1: instance 0 overlaps its first half
        rank_forward(1, 1, 500, 1000),   // 2: a follower: not listed, and not a competitor
        rank_forward(0, 0, 5000, 100)};  // 3: alone
    for (const double cpus : {2.0, 1.0}) {
        const std::vector<OverlapSplit> splits = overlap_splits(forwards, cpus);
        ASSERT_EQ(splits.size(), 2u) << cpus;
        EXPECT_EQ(splits[0].index, 0u);
        EXPECT_EQ(splits[1].index, 1u);
        for (const OverlapSplit& o : splits) {
            EXPECT_NEAR(o.alone_s, 500e-6, 1e-12);
            EXPECT_NEAR(o.shared_core_s, 500e-6 * std::min(1.0, cpus / 2), 1e-12) << cpus;
        }
    }
    // Bound ranks (the simulator's --cpu-binding model): instance 0's ranks on cores 0 and 1,
    // instance 1's on core 0: both run at half pace while they overlap (core 0's two threads);
    // on cores of their own, at full pace, whatever the node's cores.
    for (const auto& [cores, pace] : {std::pair{std::vector<std::vector<int>>{{0, 1}, {0}}, 0.5},
                                      std::pair{std::vector<std::vector<int>>{{0}, {1}}, 1.0}}) {
        const std::vector<OverlapSplit> splits = overlap_splits(forwards, 1.0, cores);
        ASSERT_EQ(splits.size(), 2u);
        for (const OverlapSplit& o : splits) {
            EXPECT_NEAR(o.alone_s, 500e-6, 1e-12);
            EXPECT_NEAR(o.shared_core_s, 500e-6 * pace, 1e-12) << pace;
        }
    }
}

TEST(TimelineFit, RecoversExactCoefficients) {
    Noise none(0);
    Recorder rec = grid_of_forwards(none);
    TimelineFitter fitter({});
    auto summary = fitter.add_timeline("run.json", rec.forwards);
    ASSERT_OK(summary);
    EXPECT_EQ(summary->forwards, rec.forwards.size());
    EXPECT_EQ(summary->overlapped_skipped, 0u);
    auto part = fitter.fit(nullptr);
    ASSERT_OK(part);
    const json* fit = fit_of(*part, 1, 1);
    ASSERT_NE(fit, nullptr) << part->dump();
    expect_coefficients(*fit, 1e-6);
    EXPECT_EQ((*fit)["extend"]["num_points"], 48);
    EXPECT_EQ((*fit)["decode"]["num_points"], 33);
    EXPECT_EQ((*fit)["extend"]["source"], "timeline");
    EXPECT_EQ((*part)["source"]["files"][0]["path"], "run.json");
    // Exact times: no noise in any quantile.
    for (const auto& q : (*part)["noise"]["decode"]["fast_quantiles"]) {
        EXPECT_NEAR(q.get<double>(), 1, 1e-9);
    }
}

// GPU ranks' forwards (device "gpu" in their slices) make a cost file for GPU devices; one fit
// never mixes the two kinds.
TEST(TimelineFit, RecordsTheDeviceKindAndRefusesAMix) {
    Noise none(0);
    Recorder rec = grid_of_forwards(none);
    TimelineFitter cpu({});
    ASSERT_OK(cpu.add_timeline("cpu.json", rec.forwards));
    auto cpu_part = cpu.fit(nullptr);
    ASSERT_OK(cpu_part);
    EXPECT_EQ((*cpu_part)["device"], "cpu");

    Recorder gpu = grid_of_forwards(none);
    for (TimelineForward& f : gpu.forwards) f.device = "gpu";
    TimelineFitter fitter({});
    ASSERT_OK(fitter.add_timeline("gpu.json", gpu.forwards));
    auto part = fitter.fit(nullptr);
    ASSERT_OK(part);
    EXPECT_EQ((*part)["device"], "gpu");

    TimelineFitter mixed({});
    ASSERT_OK(mixed.add_timeline("gpu.json", gpu.forwards));
    ASSERT_OK(mixed.add_timeline("cpu.json", rec.forwards));
    EXPECT_THAT(mixed.fit(nullptr),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("mix CPU and GPU")));
}

TEST(TimelineFit, RecoversCoefficientsUnderSmallNoise) {
    Noise noise(0.01);  // +-1%
    Recorder rec = grid_of_forwards(noise);
    TimelineFitter fitter({});
    ASSERT_OK(fitter.add_timeline("run.json", rec.forwards));
    auto part = fitter.fit(nullptr);
    ASSERT_OK(part);
    const json* fit = fit_of(*part, 1, 1);
    ASSERT_NE(fit, nullptr);
    expect_coefficients(*fit, 0.1);
    EXPECT_GT((*fit)["extend"]["r2"].get<double>(), 0.999);
    // Uniform noise of +-1% has cv 0.01 / sqrt(3).
    EXPECT_NEAR((*part)["noise"]["extend"]["fast_cv"].get<double>(), 0.01 / std::sqrt(3.0), 0.003);
}

TEST(TimelineFit, FollowersAreNotFittedAndOverlappedForwardsAreSetAside) {
    Noise none(0);
    Recorder rec = grid_of_forwards(none);
    // A follower's copy of every extend, 3x slow: counted, it would show in the fit.
    const size_t leaders = rec.forwards.size();
    for (size_t i = 0; i < leaders; ++i) {
        if (rec.forwards[i].decode) continue;
        TimelineForward follower = rec.forwards[i];
        follower.tp_rank = 1;
        follower.duration_us *= 3;
        follower.end_us = follower.begin_us + follower.duration_us;
        follower.items.clear();
        rec.forwards.push_back(follower);
    }
    // A 10x slow extend of instance 0 with a decode of instance 1 inside it: both overlapped.
    rec.extend(0, 0, {{300, 0}}, extend_seconds({{300, 0}}) * 10);
    TimelineForward inside = rec.forwards.back();
    inside.instance = 1;
    inside.begin_us += 10;
    inside.duration_us = 100;
    inside.end_us = inside.begin_us + inside.duration_us;
    inside.items.clear();
    inside.decode = true;
    inside.batch = 2;
    inside.kv_tokens = 100;
    rec.forwards.push_back(inside);
    std::stable_sort(
        rec.forwards.begin(), rec.forwards.end(),
        [](const TimelineForward& a, const TimelineForward& b) { return a.begin_us < b.begin_us; });
    TimelineFitter fitter({});
    auto summary = fitter.add_timeline("run.json", rec.forwards);
    ASSERT_OK(summary);
    EXPECT_EQ(summary->forwards, leaders);
    EXPECT_EQ(summary->overlapped_skipped, 2u);
    auto part = fitter.fit(nullptr);
    ASSERT_OK(part);
    expect_coefficients(*fit_of(*part, 1, 1), 1e-6);
}

// An extend of instance 0 and a decode of instance 1 that overlap, timed as the simulator's model
// says for interference x_e, x_d on 2 cores (no core sharing): the decode runs inside the extend,
// (1 + x_d) slower all along; the extend is (1 + x_e) slower while the decode runs.
TEST(TimelineFit, MeasuresInterference) {
    constexpr double kXe = 0.2, kXd = 0.3;
    Noise none(0);
    Recorder rec = grid_of_forwards(none);
    for (int k = 0; k < 10; ++k) {
        const std::vector<ExtendItem> items = {{200 + 50 * k, 0}};
        const double d_obs = decode_seconds(2, 600) * (1 + kXd);
        const double e_obs = extend_seconds(items) - d_obs / (1 + kXe) + d_obs;
        rec.extend(0, 0, items, e_obs);
        const double begin = rec.forwards.back().begin_us + 10;
        rec.decode(1, 2, 600, d_obs);
        rec.forwards.back().begin_us = begin;
        rec.forwards.back().end_us = begin + d_obs * 1e6;
    }
    TimelineFitOptions options;
    options.node_cpus = 2;
    TimelineFitter fitter(options);
    auto summary = fitter.add_timeline("run.json", rec.forwards);
    ASSERT_OK(summary);
    EXPECT_EQ(summary->overlapped_skipped, 20u);
    auto part = fitter.fit(nullptr);
    ASSERT_OK(part);
    const json& interference = (*part)["interference"];
    EXPECT_NEAR(interference["extend"].get<double>(), kXe, 1e-6) << interference.dump();
    EXPECT_NEAR(interference["decode"].get<double>(), kXd, 1e-6) << interference.dump();
    EXPECT_EQ(interference["overlapped_forwards"]["decode"], 10);
    EXPECT_EQ(interference["node_cpus"], 2.0);
}

TEST(TimelineFit, FitErrorsNameTheTimelinesAndWhatIsMissing) {
    Noise none(0);
    Recorder few;
    for (int n = 1; n <= 3; ++n) few.extend(0, 0, {{64 * n, 0}}, extend_seconds({{64 * n, 0}}));
    TimelineFitOptions options;
    options.timelines_label = "a.json,b.json";
    TimelineFitter fitter(options);
    ASSERT_OK(fitter.add_timeline("a.json", few.forwards));
    auto part = fitter.fit(nullptr);
    ASSERT_FALSE(part.ok());
    EXPECT_EQ(part.status().code(), StatusCode::kInvalidArgument);
    // The extend forwards are too few; decode is missing altogether and reported first.
    EXPECT_THAT(part.status().message(), HasSubstr("a.json,b.json"));
    EXPECT_THAT(part.status().message(), HasSubstr("too few"));

    // A file whose only leader forward overlaps another instance's: nothing to fit.
    Recorder overlapping;
    overlapping.extend(0, 0, {{64, 0}}, 0.01);
    TimelineForward other = overlapping.forwards.back();
    other.instance = 1;
    overlapping.forwards.push_back(other);
    TimelineFitter second({});
    auto added = second.add_timeline("c.json", overlapping.forwards);
    ASSERT_FALSE(added.ok());
    EXPECT_THAT(added.status().message(), HasSubstr("--from-timeline c.json"));
    EXPECT_THAT(added.status().message(), HasSubstr("(2 did)"));
}

// ---- the parser ----

json slice(double ts, double dur, json args) {
    return {{"name", "forward"}, {"cat", "forward"}, {"ph", "X"},  {"pid", 0},
            {"tid", 0},          {"ts", ts},         {"dur", dur}, {"args", std::move(args)}};
}

std::string write(const test::TempDir& dir, const std::string& name, const std::string& text) {
    const std::string path = dir.str(name);
    std::ofstream(path) << text;
    return path;
}

TEST(TimelineParser, ReadsForwardsSortedByBegin) {
    test::TempDir dir("timeline-fit");
    json events = json::array();
    events.push_back({{"name", "L0"}, {"cat", "compute"}, {"ph", "X"}, {"ts", 0}, {"dur", 5}});
    events.push_back(slice(300, 40,
                           {{"instance", 1},
                            {"tp", 2},
                            {"tp_rank", 0},
                            {"threads", 3},
                            {"batch", 4},
                            {"kv_tokens", 800},
                            {"thread_cpu_us", 31}}));
    events.push_back(slice(100, 50,
                           {{"instance", 0},
                            {"tp", 1},
                            {"tp_rank", 0},
                            {"threads", 1},
                            {"items", {{16, 0}, {32, 64}}}}));
    events.push_back(slice(200, 50, {{"instance", 1}, {"tp", 2}, {"tp_rank", 1}, {"threads", 3}}));
    events.push_back(slice(250, 50, {{"tp", 1}}));  // an older timeline's slice: skipped
    const std::string path = write(dir, "tl.json", json{{"traceEvents", events}}.dump());
    auto forwards = read_timeline_forwards(path);
    ASSERT_OK(forwards);
    ASSERT_EQ(forwards->size(), 3u);
    const TimelineForward& extend = (*forwards)[0];
    EXPECT_EQ(extend.begin_us, 100);
    EXPECT_EQ(extend.end_us, 150);
    EXPECT_FALSE(extend.decode);
    ASSERT_EQ(extend.items.size(), 2u);
    EXPECT_EQ(extend.items[1].new_tokens, 32);
    EXPECT_EQ(extend.items[1].cached_tokens, 64);
    const TimelineForward& follower = (*forwards)[1];
    EXPECT_EQ(follower.tp_rank, 1);
    EXPECT_EQ(follower.compute_threads, 6);
    const TimelineForward& decode = (*forwards)[2];
    EXPECT_TRUE(decode.decode);
    EXPECT_EQ(decode.batch, 4);
    EXPECT_EQ(decode.kv_tokens, 800);
    EXPECT_EQ(decode.tp, 2);
    EXPECT_EQ(decode.threads, 3);
    EXPECT_EQ(decode.thread_cpu_us, 31);
    EXPECT_EQ(extend.thread_cpu_us, -1) << "a slice without thread_cpu_us";
    // A bare array of events reads the same.
    auto bare = read_timeline_forwards(write(dir, "bare.json", events.dump()));
    ASSERT_OK(bare);
    EXPECT_EQ(bare->size(), 3u);
}

// dispatch_waits: requests that reached their prefill instance idle, split by whether another
// instance's forward (any TP rank) ran on one of its cores; queued requests are not counted.
TEST(DispatchWaits, SplitByWhetherAnotherInstanceComputedOnASharedCore) {
    // Instance 0 on cores {0, 1}, instance 1 on {0}, instance 2 on {2}.
    const std::vector<std::vector<int>> cores = {{0, 1}, {0}, {2}};
    const std::vector<TimelineForward> forwards = {
        rank_forward(1, 0, 1000, 1000),  // instance 1 computes on core 0 from 1 to 2 ms
        rank_forward(0, 1, 5000, 1000),  // instance 0's follower from 5 to 6 ms
        rank_forward(2, 0, 8000, 1000),  // instance 2, on a core of its own
    };
    const std::vector<DispatchRequest> requests = {
        {.arrival_us = 0, .prefill_start_us = 200, .instance = 0},      // idle node
        {.arrival_us = 1500, .prefill_start_us = 7500, .instance = 0},  // instance 1 busy on 0
        {.arrival_us = 1600, .prefill_start_us = 7600, .instance = 0},  // queued behind it
        {.arrival_us = 5500, .prefill_start_us = 6000, .instance = 0},  // its own forward runs
        {.arrival_us = 8500, .prefill_start_us = 8600, .instance = 0},  // instance 2: not shared
        {.arrival_us = 5200, .prefill_start_us = 5300, .instance = 1},  // instance 0 on core 0
        {.arrival_us = 9500, .prefill_start_us = 9400, .instance = 1},  // started before: bad
    };
    const DispatchWaits w = dispatch_waits(requests, forwards, cores);
    ASSERT_EQ(w.core_busy_s.size(), 2u);
    EXPECT_NEAR(w.core_busy_s[0], 6000e-6, 1e-12);
    EXPECT_NEAR(w.core_busy_s[1], 100e-6, 1e-12);
    ASSERT_EQ(w.idle_s.size(), 2u);
    EXPECT_NEAR(w.idle_s[0], 200e-6, 1e-12);
    EXPECT_NEAR(w.idle_s[1], 100e-6, 1e-12);
    // Without core lists nothing is shared.
    const DispatchWaits unknown = dispatch_waits(requests, forwards, {});
    EXPECT_TRUE(unknown.core_busy_s.empty());
    EXPECT_EQ(unknown.idle_s.size(), 4u);
}

TimelineForward decode_forward(int instance, int tp_rank, double begin_us, double dur_us) {
    TimelineForward f = rank_forward(instance, tp_rank, begin_us, dur_us);
    f.decode = true;
    f.batch = 1;
    return f;
}

// decode_step_gaps: the gap between consecutive decode forwards of an instance's leader, by how
// many other instances sharing one of its cores had a forward in flight when the first ended.
TEST(DecodeStepGaps, GapsByTheInstancesComputingOnItsCores) {
    // Instance 0 (decode) on core {0}; instances 1 and 2 (prefill, TP 2) on {0, 1}; 3 on {2}.
    const std::vector<std::vector<int>> cores = {{0}, {0, 1}, {0, 1}, {2}};
    const std::vector<TimelineForward> forwards = {
        decode_forward(0, 0, 0, 1000),      // ends at 1000 with nobody computing
        decode_forward(0, 0, 1100, 1000),   // gap 0.1 ms; ends at 2100: 1 and 2 compute
        rank_forward(1, 0, 1500, 5000),     // instance 1 from 1.5 to 6.5 ms
        rank_forward(2, 1, 2000, 1000),     // instance 2's follower (core 1) from 2 to 3 ms
        rank_forward(2, 0, 2000, 1000),     // and its leader: one competitor, not two
        decode_forward(0, 0, 5100, 1000),   // gap 3 ms; ends at 6100: only 1 computes
        decode_forward(0, 0, 6300, 500),    // gap 0.2 ms; ends at 6800, followed too late
        rank_forward(3, 0, 6000, 2000),     // instance 3 on a core of its own: not counted
        decode_forward(0, 0, 40000, 1000),  // 33 ms later: waited for work, not counted
        decode_forward(0, 1, 41500, 100),   // a follower's forwards are not the leader's steps
        decode_forward(0, 1, 41700, 100),
        rank_forward(0, 0, 41100, 300),  // an extend between: neither pair counts
        decode_forward(0, 0, 41500, 400),
    };
    std::vector<StepGap> gaps = decode_step_gaps(forwards, cores);
    std::sort(gaps.begin(), gaps.end(),
              [](const StepGap& a, const StepGap& b) { return a.gap_s < b.gap_s; });
    ASSERT_EQ(gaps.size(), 3u);
    EXPECT_EQ(gaps[0].competitors, 0);
    EXPECT_NEAR(gaps[0].gap_s, 100e-6, 1e-12);
    EXPECT_EQ(gaps[1].competitors, 1);
    EXPECT_NEAR(gaps[1].gap_s, 200e-6, 1e-12);
    EXPECT_EQ(gaps[2].competitors, 2);
    EXPECT_NEAR(gaps[2].gap_s, 3000e-6, 1e-12);
    EXPECT_NEAR(gaps[2].next_s, 1000e-6, 1e-12);
    EXPECT_NEAR(gaps[1].next_s, 500e-6, 1e-12);
    // Fed out of order, the same.
    std::vector<TimelineForward> reversed(forwards.rbegin(), forwards.rend());
    EXPECT_EQ(decode_step_gaps(reversed, cores).size(), 3u);
    // Without core lists no instance shares one.
    for (const StepGap& g : decode_step_gaps(forwards, {})) EXPECT_EQ(g.competitors, 0);
}

// fit_step_wait: per count from 1 while enough gaps saw it, the share of gaps over one slice
// (1 ms), their mean, and what such a step adds over the others (gap + next forward).
TEST(DecodeStepGaps, FitsTheChanceAndWhatAWaitedStepAdds) {
    const auto gap = [](int n, double gap_ms, double next_ms) {
        return StepGap{.competitors = n, .gap_s = gap_ms * 1e-3, .next_s = next_ms * 1e-3};
    };
    std::vector<StepGap> gaps;
    for (int k = 0; k < 10; ++k) gaps.push_back(gap(0, 0.1, 2));
    // One competitor: 3 of 4 short (steps of 0.2 + 4 ms on average), 1 of 4 a 3 ms slice
    // followed by a faster forward (3 ms): a waited step adds 6 - 4.2 = 1.8 ms.
    for (int k = 0; k < 2; ++k) {
        for (const double ms : {0.1, 0.2, 0.3}) gaps.push_back(gap(1, ms, 4));
        gaps.push_back(gap(1, 3.0, 3));
    }
    // Two: half over a slice (2 and 4 ms, then 5 ms forwards: steps of 8) against steps of 6.5.
    for (const auto& [g, next] : {std::pair{0.5, 6.0}, {2.0, 5.0}, {0.5, 6.0}, {4.0, 5.0}}) {
        gaps.push_back(gap(2, g, next));
    }
    // Three: too few.
    gaps.push_back(gap(3, 5, 1));
    const json fit = fit_step_wait(gaps, 4);
    ASSERT_EQ(fit["decode"].size(), 2u) << fit.dump();
    EXPECT_EQ(fit["decode"][0]["competitors"], 1);
    EXPECT_EQ(fit["decode"][0]["gaps"], 8);
    EXPECT_DOUBLE_EQ(fit["decode"][0]["chance"].get<double>(), 0.25);
    EXPECT_NEAR(fit["decode"][0]["slice_ms"].get<double>(), 3.0, 1e-9);
    EXPECT_NEAR(fit["decode"][0]["wait_ms"].get<double>(), 1.8, 1e-9);
    EXPECT_NEAR(fit["decode"][0]["mean_gap_ms"].get<double>(), 0.9, 1e-9);
    EXPECT_EQ(fit["decode"][1]["competitors"], 2);
    EXPECT_DOUBLE_EQ(fit["decode"][1]["chance"].get<double>(), 0.5);
    EXPECT_NEAR(fit["decode"][1]["slice_ms"].get<double>(), 3.0, 1e-9);
    EXPECT_NEAR(fit["decode"][1]["wait_ms"].get<double>(), 1.5, 1e-9);
    EXPECT_EQ(fit["idle"]["gaps"], 10);
    EXPECT_NEAR(fit["idle"]["mean_gap_ms"].get<double>(), 0.1, 1e-9);
    // Too few with one competitor: no rows at all, even where two had enough.
    EXPECT_TRUE(fit_step_wait(gaps, 9)["decode"].empty());
    EXPECT_TRUE(fit_step_wait({}, 1)["decode"].empty());
    // A waited step no longer than the others adds nothing; every gap a slice: the slice.
    const std::vector<StepGap> even = {gap(1, 0.2, 5), gap(1, 2.0, 3)};
    EXPECT_DOUBLE_EQ(fit_step_wait(even, 1)["decode"][0]["wait_ms"].get<double>(), 0.0);
    const std::vector<StepGap> all = {gap(1, 2.0, 3), gap(1, 4.0, 3)};
    EXPECT_NEAR(fit_step_wait(all, 1)["decode"][0]["wait_ms"].get<double>(), 3.0, 1e-9);
}

TEST(TimelineParser, ReadsRequestArrivals) {
    test::TempDir dir("timeline-fit");
    json events = json::array();
    events.push_back({{"name", "r7 to first token"},
                      {"cat", "request"},
                      {"ph", "X"},
                      {"ts", 1500},
                      {"dur", 30}});
    events.push_back(
        {{"name", "r7 decode"}, {"cat", "request"}, {"ph", "X"}, {"ts", 1530}, {"dur", 9}});
    events.push_back({{"name", "r12 to first token"},
                      {"cat", "request"},
                      {"ph", "X"},
                      {"ts", 2500.5},
                      {"dur", 30}});
    events.push_back({{"name", "rx to first token"}, {"cat", "request"}, {"ph", "X"}, {"ts", 1}});
    events.push_back(slice(100, 50, {{"instance", 0}, {"tp", 1}, {"tp_rank", 0}, {"threads", 1}}));
    auto arrivals =
        read_timeline_arrivals(write(dir, "tl.json", json{{"traceEvents", events}}.dump()));
    ASSERT_OK(arrivals);
    EXPECT_EQ(*arrivals, (std::map<int64_t, double>{{7, 1500}, {12, 2500.5}}));
    EXPECT_THAT(read_timeline_arrivals(write(dir, "bad.json", "{")).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad.json")));
}

TEST(TimelineParser, ErrorsNameTheFileAndTheField) {
    test::TempDir dir("timeline-fit");
    const json leader = {{"instance", 0}, {"tp", 1}, {"tp_rank", 0}, {"threads", 1}};
    json no_items = leader;
    json bad_dur = slice(7, 1, leader);
    bad_dur["dur"] = "long";
    json bad_batch = leader;
    bad_batch["kv_tokens"] = 10;
    json bad_cpu = leader;
    bad_cpu["items"] = json::array();
    bad_cpu["thread_cpu_us"] = -3;
    struct Case {
        std::string name, text, mention;
    };
    const std::vector<Case> cases = {
        {"notjson.json", "{\"traceEvents\": [\n  {\"ph\": \"X\",,}\n]}", "line 2"},
        {"noevents.json", json{{"other", 1}}.dump(), "no traceEvents array"},
        {"baddur.json", json{{"traceEvents", {bad_dur}}}.dump(), "forward slice: "},
        {"noitems.json", json{{"traceEvents", {slice(5, 2, no_items)}}}.dump(),
         "forward slice at ts 5: "},
        {"nobatch.json", json{{"traceEvents", {slice(9, 2, bad_batch)}}}.dump(), "'batch'"},
        {"badcpu.json", json{{"traceEvents", {slice(4, 2, bad_cpu)}}}.dump(),
         "forward slice at ts 4: thread_cpu_us -3: expected a number >= 0"},
    };
    for (const Case& c : cases) {
        const std::string path = write(dir, c.name, c.text);
        auto r = read_timeline_forwards(path);
        ASSERT_FALSE(r.ok()) << c.name;
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.name;
        EXPECT_THAT(r.status().message(), HasSubstr("--from-timeline " + path + ": "));
        EXPECT_THAT(r.status().message(), HasSubstr(c.mention));
    }
    EXPECT_THAT(read_timeline_forwards(dir.str("items_of_follower_unread.json")).status().message(),
                HasSubstr("cannot open"));
    // A follower's batch is not read: no items is no error.
    json follower = leader;
    follower["tp_rank"] = 1;
    auto ok = read_timeline_forwards(
        write(dir, "follower.json", json{{"traceEvents", {slice(5, 2, follower)}}}.dump()));
    EXPECT_OK(ok);
}

// ---- pdsim cost-check (sim/cost/forward_check.h) ---------------------------------------------

// A hand-written cost file (tp 1, 1 thread): the predictions below are worked by hand.
CostFile check_cost_file() {
    auto f = CostFile::from_json(json::parse(R"({
      "schema_version": 1, "model": "tiny",
      "fits": [{"tp": 1, "threads": 1,
        "extend": {"const_s": 0.001, "per_token_s": 2e-5, "per_attn_pair_s": 3e-9,
                   "per_request_s": 4e-4},
        "decode": {"const_s": 5e-4, "per_request_s": 1e-5, "per_weight_pass_s": 3e-4,
                   "per_kv_token_s": 2e-8}}],
      "transports": {}})"),
                                 "check.json");
    PDSIM_CHECK_OK(f.status());
    return std::move(*f);
}

TimelineForward forward(double begin_us, double dur_us, int instance, bool decode) {
    TimelineForward f;
    f.begin_us = begin_us;
    f.duration_us = dur_us;
    f.end_us = begin_us + dur_us;
    f.instance = instance;
    f.decode = decode;
    if (decode) {
        f.batch = 1;
        f.kv_tokens = 1000;
    } else {
        f.items = {{100, 0}};
    }
    return f;
}

TEST(ForwardCheck, GapsBetweenAnInstancesForwardsSplitByWhetherOthersComputed) {
    // Decode instance 0: forwards [0, 1), [1.5, 2.5), [3, 4) ms, then idle 6 ms (not counted),
    // [10, 11), [11.2, 12). Instance 1's extend [1.2, 3.2) ms covers the middles of the first two
    // gaps (1.25 and 2.75 ms); the last gap (11.1 ms) has nobody else computing. A TP follower of
    // instance 1 at [11, 11.5) is not "another instance computing" (leaders only).
    std::vector<TimelineForward> fs = {
        forward(0, 1000, 0, true),    forward(1200, 2000, 1, false), forward(1500, 1000, 0, true),
        forward(3000, 1000, 0, true), forward(10000, 1000, 0, true), forward(11200, 800, 0, true),
    };
    TimelineForward follower = forward(11000, 500, 1, false);
    follower.tp_rank = 1;
    fs.push_back(follower);
    std::sort(fs.begin(), fs.end(),
              [](const auto& a, const auto& b) { return a.begin_us < b.begin_us; });
    const std::vector<ForwardGapRow> rows = forward_gaps(fs);
    ASSERT_EQ(rows.size(), 2u);  // instance 1 has a single forward: no gap
    EXPECT_EQ(rows[0].instance, 0);
    EXPECT_TRUE(rows[0].decode);
    EXPECT_FALSE(rows[0].others_computing);
    EXPECT_EQ(rows[0].count, 1u);
    EXPECT_NEAR(rows[0].gap_ms_sum, 0.2, 1e-9);
    EXPECT_TRUE(rows[1].others_computing);
    EXPECT_EQ(rows[1].count, 2u);
    EXPECT_NEAR(rows[1].gap_ms_sum, 1.0, 1e-9);
    EXPECT_NEAR(rows[1].gap_ms_mean, 0.5, 1e-9);
    EXPECT_NEAR(rows[1].gap_ms_p50, 0.5, 1e-9);
    EXPECT_NEAR(rows[1].forward_ms_sum, 4.8, 1e-9);
    EXPECT_THAT(forward_gap_table(rows), HasSubstr("| 0 | decode | yes | 2 | 0.500 / 0.500"));
}

TEST(ForwardCheck, RatiosPerKindBucketAndOverlap) {
    // extend of 100 new tokens: 0.001 + 100 * 2e-5 + 5050 pairs * 3e-9 + 4e-4 = 3.41515 ms.
    // decode of 1 request, 1000 KV tokens: 5e-4 + 1e-5 + 3e-4 (one weight pass) + 2e-5 = 0.83 ms.
    const double extend_ms = 3.41515, decode_ms = 0.83;
    std::vector<TimelineForward> fs = {
        forward(0, 2 * extend_ms * 1000, 0, false),      // alone, twice as slow as predicted
        forward(20000, decode_ms * 1000, 1, true),       // alone, as predicted
        forward(40000, 3 * extend_ms * 1000, 0, false),  // overlapped by the next
        forward(41000, 1.5 * decode_ms * 1000, 1, true),
    };
    fs[1].thread_cpu_us = decode_ms * 1000;  // its thread had the core all along
    fs[3].thread_cpu_us = decode_ms * 1000;  // it waited half as long again for the core
    TimelineForward follower = forward(60000, 1000, 0, false);
    follower.tp_rank = 1;  // a TP follower times the same forward again: not counted
    fs.push_back(follower);
    auto rows = check_forwards(fs, check_cost_file(), *model::resolve_model("tiny"));
    ASSERT_OK(rows);
    auto find = [&](bool decode, bool overlapped, const std::string& bucket) {
        for (const ForwardCheckRow& r : *rows) {
            if (r.decode == decode && r.overlapped == overlapped && r.bucket == bucket) return r;
        }
        ADD_FAILURE() << "no row " << decode << " " << overlapped << " " << bucket;
        return ForwardCheckRow{};
    };
    const ForwardCheckRow e = find(false, false, "new tokens 64-255");
    EXPECT_EQ(e.count, 1u);
    EXPECT_NEAR(e.predicted_ms_p50, extend_ms, 1e-9);
    EXPECT_NEAR(e.ratio_p50, 2.0, 1e-9);
    EXPECT_NEAR(find(false, false, "all").ratio_p50, 2.0, 1e-9);
    const ForwardCheckRow d = find(true, false, "batch 1");
    EXPECT_NEAR(d.predicted_ms_p50, decode_ms, 1e-9);
    EXPECT_NEAR(d.ratio_p50, 1.0, 1e-9);
    EXPECT_NEAR(find(false, true, "all").ratio_p50, 3.0, 1e-9);
    EXPECT_NEAR(find(true, true, "batch 1").ratio_p50, 1.5, 1e-9);
    EXPECT_NEAR(d.wall_over_cpu_p50, 1.0, 1e-9);
    EXPECT_NEAR(find(true, true, "batch 1").wall_over_cpu_p50, 1.5, 1e-9);
    EXPECT_EQ(e.wall_over_cpu_p50, 0) << "no forward of the row carries its thread's CPU time";
    size_t counted = 0;
    for (const ForwardCheckRow& r : *rows) counted += r.bucket == "all" ? r.count : 0;
    EXPECT_EQ(counted, 4u);  // the follower's forward is not one of them
    EXPECT_THAT(forward_check_table(*rows), HasSubstr("| extend | 1 | 1 | no | all | 1 |"));
    EXPECT_THAT(forward_check_table(*rows), HasSubstr("| 67% | 1.50 |"));
    EXPECT_THAT(forward_check_table(*rows), HasSubstr("% | - |"));
}

TEST(ForwardCheck, ErrorsNameWhatIsMissing) {
    const model::ModelConfig tiny = *model::resolve_model("tiny");
    EXPECT_THAT(check_forwards({}, check_cost_file(), tiny),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("no instance leader forward")));
    std::vector<TimelineForward> fs = {forward(0, 1000, 0, false)};
    fs[0].tp = 4;
    EXPECT_THAT(check_forwards(fs, check_cost_file(), tiny),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp 4")));
}

}  // namespace
}  // namespace pdsim::cost
