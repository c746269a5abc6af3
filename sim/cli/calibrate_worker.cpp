// The worker of `pdsim calibrate` (sim/cli/calibrate_cmd.cpp's comment, "Compute"): one TP group
// of testbed ranks as threads of this process, timing the grid of extend and decode forwards.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "backends/model/synthetic_model.h"
#include "common/check.h"
#include "common/stats.h"
#include "common/thread_info.h"
#include "sim/cli/calibrate.h"
#include "sim/cli/cli_util.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/pd_backend.h"
#include "sim/testbed/rank_builder.h"
#include "sim/testbed/server.h"

namespace pdsim::cli::calibration {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The testbed's defaults (sim/testbed/options.h) that bound the grid.
constexpr int kMaxBatchTokens = 2048;
constexpr int kMaxDecodeBatch = 64;
constexpr int kDecodeSamplesPerRound = 3;

// ---- the grid ----

struct Point {
    bool decode = false;
    int requests = 1;
    int new_tokens = 1;  // extend: per request
    int cached = 0;      // extend: per request
    int kv_per_req = 0;  // decode: KV tokens of each request (the new one included)

    [[nodiscard]] int seq_len() const { return decode ? kv_per_req : cached + new_tokens; }
    [[nodiscard]] int new_len() const { return decode ? 1 : new_tokens; }
    [[nodiscard]] int tokens() const { return requests * new_len(); }
};

std::vector<Point> make_grid(bool quick, int threads) {
    std::vector<Point> g;
    auto extend = [&](int r, std::initializer_list<int> ns, std::initializer_list<int> cs) {
        for (int n : ns) {
            for (int c : cs) {
                if (r * n <= kMaxBatchTokens) g.push_back({false, r, n, c, 0});
            }
        }
    };
    // Decode batches stay under the testbed's KV cap, except that one request always fits.
    const int64_t cap = testbed::kMaxDecodeKvTokensPerThread * threads;
    auto decode = [&](std::initializer_list<int> bs, std::initializer_list<int> ks) {
        for (int b : bs) {
            for (int k : ks) {
                if (b == 1 || static_cast<int64_t>(b) * k <= cap) g.push_back({true, b, 1, 0, k});
            }
        }
    };
    if (quick) {
        extend(1, {16, 128, 512}, {0, 512});
        extend(2, {64, 256}, {0});
        extend(4, {128}, {0});
        decode({1, 2, 3, 4, 16}, {32, 256, 1024});
        return g;
    }
    extend(1, {16, 64, 128, 256, 512, 1024, 2048}, {0, 512, 1536});
    extend(2, {32, 256, 512, 1024}, {0, 512});
    extend(4, {16, 128, 512}, {0, 512});
    extend(8, {64, 256}, {0});
    decode({1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64}, {16, 64, 256, 1024, 2048});
    return g;
}

// ---- worker: one TP group of `tp` rank threads ----

// A reusable barrier for the TP rank threads; abort() releases every waiter for good (a rank
// that failed never arrives again).
class Barrier {
public:
    explicit Barrier(int n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(mu_);
        if (aborted_) return;
        const uint64_t gen = gen_;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++gen_;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return gen_ != gen || aborted_; });
        }
    }
    void abort() {
        std::lock_guard<std::mutex> lock(mu_);
        aborted_ = true;
        cv_.notify_all();
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    int n_;
    int arrived_ = 0;
    uint64_t gen_ = 0;
    bool aborted_ = false;
};

// What one testbed rank builds (sim/testbed/rank_builder.h, as Server::setup uses it), with
// both sides' backends: extend forwards run on the prefill side's (StepCounter and ordering
// checksums), decode forwards on one without. Declaration order is the reverse of destruction.
struct Rig {
    testbed::RankParts parts;
    std::unique_ptr<testbed::PdAttentionBackend> prefill;
    std::unique_ptr<testbed::PdAttentionBackend> decode;
    std::unique_ptr<model::SyntheticModel> model;
};

StatusOr<std::unique_ptr<Rig>> make_rig(const CalibrateOptions& o, const model::ModelConfig& m,
                                        model::TpComm* tp_comm, int tp, int tp_rank, int threads,
                                        int num_pages, int max_tokens, int max_pages_per_seq) {
    auto rig = std::make_unique<Rig>();
    testbed::RankBuildOptions ro;
    ro.model = &m;
    ro.tp_size = tp;
    ro.tp_rank = tp_rank;
    ro.threads = threads;
    ro.backend = o.backend;
    ro.page_size = o.page_size;
    ro.num_pages = num_pages;
    ro.stream_name = fmt::format("calibrate-r{}", tp_rank);
    ro.stream_caller_runs = o.stream_sync == "caller";  // as the testbed's --stream-sync
    ro.step_counter = true;
    ro.validator = true;
    ro.validator_rank = tp_rank;
    PDSIM_ASSIGN_OR_RETURN(rig->parts, testbed::build_rank_parts(ro));
    for (bool prefill : {true, false}) {
        testbed::PdBackendSide side;
        side.prefill = prefill;
        side.max_bs = max_tokens;
        side.max_pages_per_seq = max_pages_per_seq;
        PDSIM_ASSIGN_OR_RETURN(auto b, testbed::build_pd_backend(ro, rig->parts, side));
        (prefill ? rig->prefill : rig->decode) = std::move(b);
    }
    PDSIM_ASSIGN_OR_RETURN(
        rig->model, model::SyntheticModel::create(m, tp > 1 ? tp_comm : nullptr, max_tokens));
    return rig;
}

// The forward of `p` as the testbed's scheduler builds it: request i owns a contiguous run of
// pages after request i - 1's.
model::StepBatch make_batch(const Point& p, int ps, int vocab, uint64_t first_id,
                            testbed::Segments* segs) {
    const int pages_per_req = (p.seq_len() + ps - 1) / ps;
    const int t0 = p.seq_len() - p.new_len();
    std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(p.requests));
    std::vector<std::vector<int32_t>> pages(static_cast<size_t>(p.requests));
    std::vector<testbed::ForwardEntry> entries;
    for (int i = 0; i < p.requests; ++i) {
        const auto r = static_cast<size_t>(i);
        for (int t = t0; t < p.seq_len(); ++t) {
            tokens[r].push_back(static_cast<int32_t>((7919LL * i + 31LL * t + 11) % vocab));
        }
        const int base = 1 + i * pages_per_req;
        for (int k = 0; k < pages_per_req; ++k) pages[r].push_back(base + k);
        entries.push_back(
            {first_id + static_cast<uint64_t>(i), t0, p.seq_len(), tokens[r], pages[r]});
    }
    StatusOr<model::StepBatch> b = testbed::build_step_batch(
        p.decode ? attn::ForwardMode::kDecode : attn::ForwardMode::kExtend, entries, ps, segs);
    PDSIM_CHECK(b.ok());  // no window rings (calibrate refuses hybrid models): cannot fail
    return std::move(*b);
}

// The wake-up measurement (calibrate.h, "Wake-up"): kWakeRounds times, every rank idles
// kWakeIdle, then runs kWakeForwards decode forwards of kWakePoint back to back, each timed.
constexpr int kWakeRounds = 12;
constexpr int kWakeForwards = 16;
constexpr auto kWakeIdle = std::chrono::milliseconds(60);
constexpr Point kWakePoint = {true, 1, 1, 0, 256};

struct Shared {
    std::vector<Point> grid;
    std::vector<std::vector<double>> wake;  // rank 0: [forward index] -> samples
    int rounds = 0;                         // timed rounds (plus one warm-up)
    Barrier* barrier = nullptr;
    std::mutex mu;
    Status error;
    std::atomic<bool> failed{false};
    std::vector<std::vector<double>> samples;  // rank 0, per point
    std::string label;
};

Status run_rank(const CalibrateOptions& o, const model::ModelConfig& m, Shared& sh,
                testbed::LocalTpGroup* group, int tp, int rank, int threads, int num_pages,
                int max_tokens, int max_pages) {
    auto fail = [&](const Status& st) {
        {
            std::lock_guard<std::mutex> lock(sh.mu);
            if (sh.error.ok()) sh.error = st;
            sh.failed = true;
        }
        sh.barrier->abort();
        return st;
    };
    if (o.bind == "core") {
        // As mpirun --map-by core --bind-to core:overload-allowed: rank r on `threads` cores of
        // its own, round-robin over the cores this process may use (shared when there are fewer).
        // Before the rig, so that the threads it starts inherit the binding.
        const std::vector<int> allowed = allowed_cpus();
        std::vector<int> mine;
        for (int k = 0; k < threads && !allowed.empty(); ++k) {
            mine.push_back(allowed[static_cast<size_t>(rank * threads + k) % allowed.size()]);
        }
        if (!bind_this_thread(mine)) {
            return fail(PDSIM_ERROR(StatusCode::kUnavailable,
                                    "{} rank {}: cannot bind to cores {} (--bind none skips it)",
                                    sh.label, rank, fmt::join(mine, ",")));
        }
    }
    auto rig_or = make_rig(o, m, group != nullptr ? group->member(rank) : nullptr, tp, rank,
                           threads, num_pages, max_tokens, max_pages);
    if (!rig_or.ok()) return fail(rig_or.status());
    sh.barrier->wait();
    if (sh.failed) return Status(StatusCode::kAborted, "another TP rank failed");
    Rig& rig = **rig_or;
    uint64_t next_id = 1;
    const auto t_start = Clock::now();
    for (int round = 0; round <= sh.rounds; ++round) {
        for (size_t i = 0; i < sh.grid.size(); ++i) {
            const Point& p = sh.grid[i];
            auto segs = std::make_shared<testbed::Segments>();
            model::StepBatch b = make_batch(p, o.page_size, m.vocab, next_id, segs.get());
            next_id += static_cast<uint64_t>(p.requests);
            testbed::PdAttentionBackend& backend = p.decode ? *rig.decode : *rig.prefill;
            // Decode forwards are milliseconds: more samples of them per round. The first forwards
            // after a switch between extend and decode are not timed (a testbed rank in the
            // disaggregated phase runs one kind only): after a large extend, the first decodes
            // read the weights from memory rather than cache, measured ~2x slower for 2-3 of them.
            const size_t n = sh.grid.size();
            const bool switched =
                (round > 0 || i > 0) && sh.grid[(i + n - 1) % n].decode != p.decode;
            const int samples = p.decode ? kDecodeSamplesPerRound : 1;
            const int untimed = !switched ? 0 : (p.decode ? kDecodeSamplesPerRound : 1);
            for (int k = -untimed; k < samples; ++k) {
                // The untimed forward records no checksums (its tokens would be recorded twice).
                backend.set_segments(p.decode || k < 0 ? nullptr : segs);
                if (!p.decode) rig.parts.counter->advance_step(m.num_layers, 0);
                std::vector<int32_t> next(static_cast<size_t>(p.requests), -1);
                sh.barrier->wait();
                if (sh.failed) return Status(StatusCode::kAborted, "another TP rank failed");
                const auto t0 = Clock::now();
                Status st = rig.model->forward(b, backend, *rig.parts.pool, next.data());
                if (st.ok()) st = rig.parts.stream->synchronize();
                const double s = std::chrono::duration<double>(Clock::now() - t0).count();
                if (!st.ok()) {
                    return fail(st.with_context(fmt::format("{} rank {}", sh.label, rank)));
                }
                if (rank == 0 && round > 0 && k >= 0) sh.samples[i].push_back(s);
            }
            for (const auto& seg : *segs) rig.parts.validator->forget(seg.request);
        }
        if (rank == 0) {
            const double el = std::chrono::duration<double>(Clock::now() - t_start).count();
            if (round == 0) {
                std::fprintf(stderr, "calibrate: %s: warm-up round %.1f s, %d timed rounds to go\n",
                             sh.label.c_str(), el, sh.rounds);
            } else {
                std::fprintf(stderr, "calibrate: %s: round %d/%d (%.1f s)\n", sh.label.c_str(),
                             round, sh.rounds, el);
            }
        }
    }
    // Wake-up: decode forwards after an idle period (the testbed's decode rank between requests).
    for (int round = 0; round < kWakeRounds; ++round) {
        sh.barrier->wait();
        if (sh.failed) return Status(StatusCode::kAborted, "another TP rank failed");
        std::this_thread::sleep_for(kWakeIdle);
        testbed::Segments segs;
        model::StepBatch b = make_batch(kWakePoint, o.page_size, m.vocab, next_id, &segs);
        ++next_id;
        rig.decode->set_segments(nullptr);
        for (int k = 0; k < kWakeForwards; ++k) {
            std::vector<int32_t> next(1, -1);
            const auto t0 = Clock::now();
            Status st = rig.model->forward(b, *rig.decode, *rig.parts.pool, next.data());
            if (st.ok()) st = rig.parts.stream->synchronize();
            const double s = std::chrono::duration<double>(Clock::now() - t0).count();
            if (!st.ok()) return fail(st.with_context(fmt::format("{} rank {}", sh.label, rank)));
            if (rank == 0) sh.wake[static_cast<size_t>(k)].push_back(s);
        }
    }
    return {};
}

}  // namespace

size_t grid_points(bool quick, int threads) {
    return make_grid(quick, threads).size();
}

Status run_worker(const CalibrateOptions& o, const model::ModelConfig& m, int tp, int threads) {
    Shared sh;
    sh.grid = make_grid(o.quick, threads);
    sh.rounds = repeats_of(o);
    sh.samples.resize(sh.grid.size());
    sh.wake.resize(kWakeForwards);
    sh.label = fmt::format("tp {} threads {}", tp, threads);
    int max_pages = 1, num_pages = 2, max_tokens = std::max(kMaxBatchTokens, kMaxDecodeBatch);
    for (const Point& p : sh.grid) {
        const int per = (p.seq_len() + o.page_size - 1) / o.page_size;
        max_pages = std::max(max_pages, per);
        num_pages = std::max(num_pages, 1 + per * p.requests);
        max_tokens = std::max(max_tokens, p.tokens());
    }
    Barrier barrier(tp);
    sh.barrier = &barrier;
    std::unique_ptr<testbed::LocalTpGroup> group;
    if (tp > 1) group = std::make_unique<testbed::LocalTpGroup>(tp, std::chrono::seconds(120));
    std::vector<std::thread> others;
    std::vector<Status> st(static_cast<size_t>(tp));
    for (int r = 1; r < tp; ++r) {
        others.emplace_back([&, r] {
            st[static_cast<size_t>(r)] =
                run_rank(o, m, sh, group.get(), tp, r, threads, num_pages, max_tokens, max_pages);
        });
    }
    st[0] = run_rank(o, m, sh, group.get(), tp, 0, threads, num_pages, max_tokens, max_pages);
    for (auto& t : others) t.join();
    if (!sh.error.ok()) return sh.error;
    json points = json::array();
    for (size_t i = 0; i < sh.grid.size(); ++i) {
        const Point& p = sh.grid[i];
        const std::vector<double>& v = sh.samples[i];
        json j;
        if (p.decode) {
            j = {{"kind", "decode"},
                 {"batch", p.requests},
                 {"kv_per_request", p.kv_per_req},
                 {"kv_tokens", static_cast<int64_t>(p.requests) * p.kv_per_req}};
        } else {
            j = {{"kind", "extend"},
                 {"requests", p.requests},
                 {"new_tokens", p.new_tokens},
                 {"cached_tokens", p.cached},
                 {"tokens", p.tokens()}};
        }
        j["s"] = stats::median(v);
        j["min_s"] = *std::min_element(v.begin(), v.end());
        j["samples_s"] = sh.samples[i];
        points.push_back(std::move(j));
    }
    json wake = {{"idle_s", std::chrono::duration<double>(kWakeIdle).count()},
                 {"batch", kWakePoint.requests},
                 {"kv_per_request", kWakePoint.kv_per_req},
                 {"median_s", json::array()}};
    for (const auto& v : sh.wake) wake["median_s"].push_back(stats::median(v));
    return write_json_file(
        "--out", o.out, json{{"tp", tp}, {"threads", threads}, {"points", points}, {"wake", wake}},
        -1);
}

}  // namespace pdsim::cli::calibration
