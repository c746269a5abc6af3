// `pdsim calibrate`: measures, on this machine and with the testbed's own code, what the calibrated
// cost model (sim/cost/calibrated.h) needs, fits it, and writes the cost file
// (docs/cost-models.md).
//
// Compute. For each requested TP size and thread count, a worker process (this binary again,
// `calibrate --worker TP:THREADS`, so that the process-wide projection ThreadPool gets the size a
// testbed rank has: PDSIM_NUM_THREADS = threads, as mpirun'd testbed ranks set it) builds what a
// testbed rank builds (server.cpp): the synthetic model, a CpuStream, an fp32 MHA pool of
// --page-size pages, the attention backend (--backend) with `threads` kernel threads wrapped in
// the testbed's PdAttentionBackend (extend: with the prefill side's StepCounter and ordering
// checksums; decode: without, as on a decode rank). TP > 1: the TP ranks are threads of the worker
// sharing a LocalTpGroup (how `pdsim testbed` runs without mpirun), each with its own model,
// stream, pool and backend, running every forward together; rank 0 is timed. A forward is timed
// like the testbed's Server::execute: enqueue the model's forward, synchronize the stream.
// Grid: extend forwards over (requests, new tokens, cached tokens) and decode forwards over
// (batch, KV tokens per request) inside the testbed's limits (2048 tokens per extend forward,
// kMaxDecodeKvTokensPerThread x threads KV tokens per decode batch). One warm-up round, then
// --repeats rounds over the whole grid (round-robin, so a burst of background load spreads over
// all points); each point's time is its median.
//
// Transports. local and tcp: two endpoints in this process, one message at a time, time from
// post_send to the receive's completion. mpi: only under `mpirun -np 2` (ping-pong, half the round
// trip); otherwise skipped with a note. Messages are KV-sized (page runs of one layer's K buffer);
// latency and bandwidth come from a fit of time = latency + bytes / bandwidth.
#include <fmt/format.h>
#include <mpi.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/model_config.h"
#include "backends/model/synthetic_model.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "common/mpi_check.h"
#include "common/stats.h"
#include "sim/cli/command.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/timeline_fit.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/pd_backend.h"
#include "sim/testbed/rank_builder.h"
#include "sim/testbed/server.h"
#include "transfer/engine/ordering_validator.h"
#include "transfer/local/local_transport.h"
#include "transfer/transport.h"

extern char** environ;

namespace pdsim::cli {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The testbed's defaults (sim/testbed/options.h) that bound the grid.
constexpr int kMaxBatchTokens = 2048;
constexpr int kMaxDecodeBatch = 64;
constexpr int kDecodeSamplesPerRound = 3;

struct CalibrateOptions {
    std::string backend = "cpu";
    std::string model;
    std::string tp = "1";
    std::string threads;  // "": per TP size, max(1, cores / (2 tp))
    std::string transport = "local,tcp,mpi";
    bool quick = false;
    std::string out;
    int page_size = 16;
    int repeats = 0;     // 0: 7, --quick 3
    std::string worker;  // hidden: "TP:THREADS" (a worker process)
    std::string from_timeline;  // comma-separated testbed timelines: fit those forwards instead
    std::string base;           // a cost file for the (tp, kind) the timelines have no forwards of
    bool include_overlapped = false;
    double node_cpus = 0;  // --from-timeline: cores of the machine the timelines ran on (0: this)
};

int cores() {
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int default_threads(int tp) {
    return std::max(1, cores() / (2 * tp));
}

int repeats_of(const CalibrateOptions& o) {
    return o.repeats > 0 ? o.repeats : (o.quick ? 3 : 7);
}

StatusOr<std::vector<int>> parse_int_list(const std::string& flag, const std::string& text) {
    std::vector<int> out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item.empty()) continue;
        size_t used = 0;
        int v = 0;
        try {
            v = std::stoi(item, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != item.size() || v < 1) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("{}: '{}' is not a positive integer", flag, item));
        }
        if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
    if (out.empty()) return Status(StatusCode::kInvalidArgument, flag + ": empty list");
    return out;
}

StatusOr<std::vector<std::string>> parse_transports(const std::string& text) {
    std::vector<std::string> out;
    if (text == "none") return out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item.empty()) continue;
        if (item != "local" && item != "tcp" && item != "mpi") {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--transport: unknown transport '{}' (local, tcp, mpi, or "
                                      "none)",
                                      item));
        }
        if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
    }
    return out;
}

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
    return testbed::build_step_batch(
        p.decode ? attn::ForwardMode::kDecode : attn::ForwardMode::kExtend, entries, ps, segs);
}

struct Shared {
    std::vector<Point> grid;
    int rounds = 0;  // timed rounds (plus one warm-up)
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
    return {};
}

Status run_worker(const CalibrateOptions& o, const model::ModelConfig& m, int tp, int threads) {
    Shared sh;
    sh.grid = make_grid(o.quick, threads);
    sh.rounds = repeats_of(o);
    sh.samples.resize(sh.grid.size());
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
    std::ofstream f(o.out);
    f << json{{"tp", tp}, {"threads", threads}, {"points", points}}.dump() << "\n";
    if (!f) return Status(StatusCode::kInvalidArgument, "--out " + o.out + ": cannot write");
    return {};
}

// ---- parent: spawns the workers, fits, measures transports, writes the file ----

StatusOr<json> spawn_worker(const CalibrateOptions& o, int tp, int threads,
                            const std::string& tmp) {
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    std::vector<std::string> args = {exe,           "calibrate",
                                     "--model",     o.model,
                                     "--backend",   o.backend,
                                     "--page-size", std::to_string(o.page_size),
                                     "--repeats",   std::to_string(repeats_of(o)),
                                     "--worker",    fmt::format("{}:{}", tp, threads),
                                     "--out",       tmp};
    if (o.quick) args.push_back("--quick");
    // A testbed rank under mpirun gets PDSIM_NUM_THREADS = its thread count (testbed.cpp), its own
    // projection pool. TP ranks here are threads of one process sharing the process-wide pool:
    // with 1 thread each the pool is the calling thread (exactly what each rank has); with more,
    // the ranks' projections take turns on a pool of threads x tp (about the same throughput).
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
        if (std::string_view(*e).rfind("PDSIM_NUM_THREADS=", 0) != 0) env.emplace_back(*e);
    }
    env.push_back(fmt::format("PDSIM_NUM_THREADS={}", threads == 1 ? 1 : threads * tp));
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    if (int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data());
        rc != 0) {
        return PDSIM_ERROR(StatusCode::kInternal, "cannot start a calibrate worker: {}",
                           std::strerror(rc));
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return PDSIM_ERROR(StatusCode::kInternal, "waitpid failed");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return Status(code == 2 ? StatusCode::kInvalidArgument : StatusCode::kInternal,
                      fmt::format("calibrate worker for tp {} threads {} failed (exit {})", tp,
                                  threads, code));
    }
    std::ifstream in(tmp);
    json j;
    try {
        in >> j;
    } catch (const json::exception& e) {
        return PDSIM_ERROR(StatusCode::kInternal, "calibrate worker output {}: {}", tmp, e.what());
    }
    return j;
}

StatusOr<json> fit_points(const json& worker) {
    std::vector<std::vector<double>> ex, dx;
    std::vector<double> ey, dy;
    for (const auto& p : worker.at("points")) {
        if (p.at("kind") == "extend") {
            std::vector<cost::ExtendItem> items(
                p.at("requests").get<size_t>(),
                {p.at("new_tokens").get<int64_t>(), p.at("cached_tokens").get<int64_t>()});
            const auto f = cost::extend_features(items);
            ex.emplace_back(f.begin(), f.end());
            ey.push_back(p.at("s").get<double>());
        } else {
            const auto f = cost::decode_features(p.at("batch").get<int64_t>(),
                                                 p.at("kv_tokens").get<int64_t>());
            dx.emplace_back(f.begin(), f.end());
            dy.push_back(p.at("s").get<double>());
        }
    }
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit e, cost::fit_nonnegative(ex, ey));
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit d, cost::fit_nonnegative(dx, dy));
    return json{{"tp", worker.at("tp")},
                {"threads", worker.at("threads")},
                {"extend", cost::fit_to_json(cost::kExtendKeys, e, ey.size())},
                {"decode", cost::fit_to_json(cost::kDecodeKeys, d, dy.size())},
                {"points", worker.at("points")}};
}

// ---- transports ----

std::vector<size_t> message_sizes(const CalibrateOptions& o, const model::ModelConfig& m) {
    // One layer's K buffer for a run of pages (fp32 pool, TP 1), as the KV sender moves it.
    const size_t page = static_cast<size_t>(o.page_size) * m.num_kv_heads * m.head_dim * 4;
    std::vector<size_t> out;
    for (size_t pages :
         o.quick ? std::vector<size_t>{1, 16, 64} : std::vector<size_t>{1, 4, 16, 64, 256}) {
        out.push_back(page * pages);
    }
    return out;
}

int message_reps(const CalibrateOptions& o) {
    return o.quick ? 10 : 30;
}

StatusOr<json> link_fit(const std::vector<size_t>& sizes, const std::vector<double>& secs) {
    std::vector<std::vector<double>> x;
    json pts = json::array();
    for (size_t i = 0; i < sizes.size(); ++i) {
        x.push_back({1.0, static_cast<double>(sizes[i])});
        pts.push_back({{"bytes", sizes[i]}, {"s", secs[i]}});
    }
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit f, cost::fit_nonnegative(x, secs));
    // A zero slope (latency-bound at every size) would mean infinite bandwidth: take the
    // largest message's throughput instead.
    const double gbps = f.coef[1] > 0 ? 1.0 / f.coef[1] / 1e9
                                      : static_cast<double>(sizes.back()) / secs.back() / 1e9;
    return json{{"gbps", gbps},
                {"latency_us", f.coef[0] * 1e6},
                {"r2", f.r2},
                {"max_rel_err", f.max_rel_err},
                {"points", pts}};
}

constexpr auto kWait = std::chrono::seconds(60);

StatusOr<json> measure_in_process(const std::string& name, const std::vector<size_t>& sizes,
                                  int reps) {
    transfer::TransportOptions to;
    to.world_size = 2;
    to.connect_timeout = std::chrono::seconds(20);
    std::string dir;
    if (name == "local") {
        to.local_world = transfer::make_local_world(2);
    } else {
        dir = (std::filesystem::temp_directory_path() /
               fmt::format("pdsim-calibrate-{}-{}", ::getpid(), name))
                  .string();
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
        to.tcp.bootstrap_dir = dir;
    }
    StatusOr<std::unique_ptr<transfer::Transport>> made[2] = {Status(StatusCode::kInternal, ""),
                                                              Status(StatusCode::kInternal, "")};
    std::thread other([&] {
        transfer::TransportOptions o1 = to;
        o1.rank = 1;
        made[1] = transfer::create_transport(name, o1);
    });
    made[0] = transfer::create_transport(name, to);
    other.join();
    auto cleanup = [&] {
        std::error_code ec;
        if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    };
    for (auto& t : made) {
        if (!t.ok()) {
            cleanup();
            return t.status().with_context("calibrate transport " + name);
        }
    }
    transfer::Transport& tx = **made[0];
    transfer::Transport& rx = **made[1];
    std::vector<double> secs;
    Status st;
    for (size_t bytes : sizes) {
        std::vector<uint8_t> src(bytes, 0x5a), dst(bytes);
        std::vector<double> v;
        for (int i = 0; i < reps + 3 && st.ok(); ++i) {
            auto r = rx.post_recv(0, 1, dst.data(), bytes);
            if (!r.ok()) {
                st = r.status();
                break;
            }
            const auto t0 = Clock::now();
            auto s = tx.post_send(1, 1, src.data(), bytes);
            if (!s.ok()) {
                st = s.status();
                break;
            }
            st = rx.wait(*r, kWait);
            const double el = std::chrono::duration<double>(Clock::now() - t0).count();
            if (st.ok()) st = tx.wait(*s, kWait);
            if (i >= 3) v.push_back(el);
        }
        if (!st.ok()) break;
        secs.push_back(stats::median(v));
    }
    tx.close();
    rx.close();
    cleanup();
    PDSIM_RETURN_IF_ERROR(st.with_context("calibrate transport " + name));
    return link_fit(sizes, secs);
}

struct Launcher {
    bool under_mpirun = false;
    int world = 1;
    int rank = 0;
};

Launcher detect_launcher() {
    Launcher l;
    auto env_int = [](const char* n) {
        const char* v = std::getenv(n);
        return v != nullptr && *v != '\0' ? std::atoi(v) : -1;
    };
    if (env_int("OMPI_COMM_WORLD_SIZE") > 0) {
        l = {true, env_int("OMPI_COMM_WORLD_SIZE"), std::max(0, env_int("OMPI_COMM_WORLD_RANK"))};
    } else if (env_int("PMI_SIZE") > 0) {
        l = {true, env_int("PMI_SIZE"), std::max(0, env_int("PMI_RANK"))};
    }
    return l;
}

// Both ranks of `mpirun -np 2`: rank 0 ping-pongs each size with rank 1. Returns the fit on rank
// 0, null on rank 1.
StatusOr<json> measure_mpi(const std::vector<size_t>& sizes, int reps) {
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
        int provided = 0;
        MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    }
    int rank = 0;
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    std::vector<double> secs;
    Status st;
    {
        auto t = transfer::create_transport("mpi", transfer::TransportOptions{});
        if (!t.ok()) {
            st = t.status();
        } else {
            transfer::Transport& tr = **t;
            const int peer = 1 - rank;
            for (size_t bytes : sizes) {
                std::vector<uint8_t> src(bytes, 0x5a), dst(bytes);
                std::vector<double> v;
                for (int i = 0; i < reps + 3 && st.ok(); ++i) {
                    const auto t0 = Clock::now();
                    if (rank == 0) {
                        auto r = tr.post_recv(peer, 1, dst.data(), bytes);
                        auto s = tr.post_send(peer, 1, src.data(), bytes);
                        st = !s.ok() ? s.status() : tr.wait(*s, kWait);
                        if (st.ok()) st = !r.ok() ? r.status() : tr.wait(*r, kWait);
                    } else {
                        auto r = tr.post_recv(peer, 1, dst.data(), bytes);
                        st = !r.ok() ? r.status() : tr.wait(*r, kWait);
                        if (st.ok()) {
                            auto s = tr.post_send(peer, 1, src.data(), bytes);
                            st = !s.ok() ? s.status() : tr.wait(*s, kWait);
                        }
                    }
                    const double el = std::chrono::duration<double>(Clock::now() - t0).count();
                    if (i >= 3) v.push_back(el / 2);
                }
                if (!st.ok()) break;
                secs.push_back(stats::median(v));
            }
            MPI_Barrier(MPI_COMM_WORLD);
            tr.close();
        }
    }
    MPI_Finalize();
    PDSIM_RETURN_IF_ERROR(st.with_context("calibrate transport mpi"));
    if (rank != 0) return json();
    return link_fit(sizes, secs);
}

std::string cpu_model_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const size_t c = line.find(':');
            if (c != std::string::npos) {
                size_t b = line.find_first_not_of(' ', c + 1);
                return b == std::string::npos ? "" : line.substr(b);
            }
        }
    }
    return "unknown";
}

std::string iso_now() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

// ---- --from-timeline: the testbed's own forwards (the fit: sim/cost/timeline_fit.h) ----

std::vector<std::string> split_paths(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

StatusOr<std::optional<cost::CostFile>> load_base(const CalibrateOptions& o,
                                                  const model::ModelConfig& m) {
    if (o.base.empty()) return std::optional<cost::CostFile>();
    auto b = cost::CostFile::load(o.base);
    if (!b.ok()) return b.status().with_context("--base");
    if (b->json().at("model").get<std::string>() != m.name) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--base {}: calibrated for model '{}', not '{}'", o.base,
                                  b->json().at("model").get<std::string>(), m.name));
    }
    return std::optional<cost::CostFile>(std::move(*b));
}

StatusOr<json> calibrate_from_timelines(const CalibrateOptions& o, const model::ModelConfig& m) {
    const std::vector<std::string> paths = split_paths(o.from_timeline);
    if (paths.empty()) return Status(StatusCode::kInvalidArgument, "--from-timeline: empty list");
    cost::TimelineFitOptions fo;
    fo.include_overlapped = o.include_overlapped;
    fo.node_cpus = o.node_cpus > 0 ? o.node_cpus : static_cast<double>(cores());
    fo.timelines_label = o.from_timeline;
    fo.base_path = o.base;
    cost::TimelineFitter fitter(fo);
    for (const std::string& p : paths) {
        PDSIM_ASSIGN_OR_RETURN(std::vector<cost::TimelineForward> forwards,
                               cost::read_timeline_forwards(p));
        PDSIM_RETURN_IF_ERROR(fitter.add_timeline(p, forwards).status());
    }
    PDSIM_ASSIGN_OR_RETURN(std::optional<cost::CostFile> base, load_base(o, m));
    return fitter.fit(base ? &*base : nullptr);
}

Status run_calibrate(const CalibrateOptions& o) {
    auto resolved = model::resolve_model(o.model);
    if (!resolved.ok()) return resolved.status().with_context("--model");
    const model::ModelConfig m = *resolved;
    if (m.attention != model::AttentionKind::kMHA || !m.layer_kinds.empty()) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--model {}: the CPU testbed runs MHA/GQA full-attention models "
                                  "only (no MLA or sliding-window layers)",
                                  o.model));
    }
    if (!o.worker.empty()) {
        int tp = 0, threads = 0;
        if (std::sscanf(o.worker.c_str(), "%d:%d", &tp, &threads) != 2 || tp < 1 || threads < 1) {
            return Status(StatusCode::kInvalidArgument, "--worker: expected TP:THREADS");
        }
        return run_worker(o, m, tp, threads);
    }
    PDSIM_ASSIGN_OR_RETURN(std::vector<int> tps, parse_int_list("--tp", o.tp));
    for (int tp : tps) {
        PDSIM_RETURN_IF_ERROR(
            model::check_tp(m, tp).with_context(fmt::format("--tp {}: model {}", tp, m.name)));
    }
    std::vector<int> thread_list;
    if (!o.threads.empty()) {
        PDSIM_ASSIGN_OR_RETURN(thread_list, parse_int_list("--threads", o.threads));
    }
    PDSIM_ASSIGN_OR_RETURN(std::vector<std::string> transports, parse_transports(o.transport));
    {
        const bool existed = std::filesystem::exists(o.out);
        std::ofstream probe(o.out, std::ios::app);
        if (!probe) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--out {}: cannot open for writing", o.out));
        }
        probe.close();
        std::error_code ec;
        if (!existed) std::filesystem::remove(o.out, ec);
    }
    const auto t_start = Clock::now();
    json fits = json::array();
    json transport_json = json::object();
    json notes = json::array();
    json source = {{"kind", "microbenchmark"}};
    json interference = json::object();
    json noise = json::object();
    if (!o.from_timeline.empty()) {
        PDSIM_ASSIGN_OR_RETURN(json part, calibrate_from_timelines(o, m));
        fits = part["fits"];
        transport_json = part["transports"];
        source = part["source"];
        interference = part["interference"];
        noise = part["noise"];
    } else {
        const Launcher launcher = detect_launcher();
        const auto sizes = message_sizes(o, m);
        const bool want_mpi =
            std::find(transports.begin(), transports.end(), "mpi") != transports.end();
        if (want_mpi && launcher.under_mpirun && launcher.world == 2) {
            PDSIM_ASSIGN_OR_RETURN(json mpi, measure_mpi(sizes, message_reps(o)));
            if (launcher.rank != 0) return {};  // rank 1 only took part in the MPI measurement
            transport_json["mpi"] = mpi;
        } else if (want_mpi) {
            notes.push_back(
                launcher.under_mpirun
                    ? fmt::format("mpi: skipped (launched with {} ranks; measuring it needs "
                                  "mpirun -np 2)",
                                  launcher.world)
                    : "mpi: skipped (not launched under mpirun -np 2)");
        }
        if (launcher.under_mpirun && launcher.rank != 0) return {};

        const std::string tmp = (std::filesystem::temp_directory_path() /
                                 fmt::format("pdsim-calibrate-{}.json", ::getpid()))
                                    .string();
        for (int tp : tps) {
            std::vector<int> ths =
                thread_list.empty() ? std::vector<int>{default_threads(tp)} : thread_list;
            for (int threads : ths) {
                std::fprintf(stderr,
                             "calibrate: model %s tp %d threads %d: %zu points x %d rounds\n",
                             m.name.c_str(), tp, threads, make_grid(o.quick, threads).size(),
                             repeats_of(o));
                auto w = spawn_worker(o, tp, threads, tmp);
                std::error_code ec;
                std::filesystem::remove(tmp, ec);
                if (!w.ok()) return w.status();
                PDSIM_ASSIGN_OR_RETURN(json fit, fit_points(*w));
                fits.push_back(std::move(fit));
            }
        }
        for (const auto& name : transports) {
            if (name == "mpi") continue;
            std::fprintf(stderr, "calibrate: transport %s\n", name.c_str());
            PDSIM_ASSIGN_OR_RETURN(json t, measure_in_process(name, sizes, message_reps(o)));
            transport_json[name] = t;
        }
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t_start).count();
    json out = {{"schema_version", cost::kCostSchemaVersion},
                {"machine", {{"cpu", cpu_model_name()}, {"cores", cores()}}},
                {"created", iso_now()},
                {"model", m.name},
                {"model_config",
                 {{"num_layers", m.num_layers},
                  {"hidden", m.hidden},
                  {"num_q_heads", m.num_q_heads},
                  {"num_kv_heads", m.num_kv_heads},
                  {"head_dim", m.head_dim},
                  {"intermediate", m.intermediate},
                  {"vocab", m.vocab}}},
                {"backend", o.backend},
                {"kv_dtype", "fp32"},
                {"page_size", o.page_size},
                {"source", source},
                {"grid", !o.from_timeline.empty() ? "testbed" : o.quick ? "quick" : "default"},
                {"repeats", o.from_timeline.empty() ? json(repeats_of(o)) : json()},
                {"fits", fits},
                {"transports", transport_json},
                {"notes", notes},
                {"wall_s", wall}};
    if (!interference.empty()) out["interference"] = interference;
    if (!noise.empty()) out["noise"] = noise;
    // What we write must load.
    PDSIM_RETURN_IF_ERROR(cost::CostFile::from_json(out, o.out).status().with_context("internal"));
    {
        std::ofstream f(o.out, std::ios::trunc);
        f << out.dump(2) << "\n";
        if (!f) return Status(StatusCode::kInvalidArgument, "--out " + o.out + ": write failed");
    }
    std::string s = fmt::format(
        "pdsim calibrate: model {}, backend {}, fp32 KV, page size {}; {} ({} cores); {:.1f} s\n",
        m.name, o.backend, o.page_size, cpu_model_name(), cores(), wall);
    s += fmt::format(
        "  extend_s = const + per_token * tokens + per_pair * attn_pairs + per_req * "
        "requests\n  decode_s = const + per_req * batch + per_pass * weight_passes + "
        "per_kvtok * kv_tokens\n");
    s += fmt::format(
        "  {:>2} {:>7} | {:>6} {:>6} {:>6} {:>6} {:>6} {:>7} | {:>6} {:>6} {:>6} "
        "{:>6} {:>6} {:>7}\n",
        "tp", "threads", "ext ms", "us/tok", "ns/pr", "us/req", "R^2", "max err", "dec ms",
        "us/req", "us/pas", "ns/kvt", "R^2", "max err");
    // A part taken from --base may lack the fit statistics (nan) or optional keys (0).
    auto num = [](const json& j, const char* key) {
        const bool stat = std::strcmp(key, "r2") == 0 || std::strcmp(key, "max_rel_err") == 0;
        return j.contains(key) && j[key].is_number() ? j[key].get<double>()
                                                     : (stat ? std::nan("") : 0.0);
    };
    for (const auto& f : fits) {
        const json& e = f["extend"];
        const json& d = f["decode"];
        s += fmt::format(
            "  {:>2} {:>7} | {:>6.3f} {:>6.1f} {:>6.2f} {:>6.1f} {:>6.4f} {:>6.1f}% | {:>6.3f} "
            "{:>6.1f} {:>6.1f} {:>6.1f} {:>6.4f} {:>6.1f}%\n",
            f["tp"].get<int>(), f["threads"].get<int>(), num(e, "const_s") * 1e3,
            num(e, "per_token_s") * 1e6, num(e, "per_attn_pair_s") * 1e9,
            num(e, "per_request_s") * 1e6, num(e, "r2"), num(e, "max_rel_err") * 100,
            num(d, "const_s") * 1e3, num(d, "per_request_s") * 1e6,
            num(d, "per_weight_pass_s") * 1e6, num(d, "per_kv_token_s") * 1e9, num(d, "r2"),
            num(d, "max_rel_err") * 100);
    }
    std::string ts;
    for (const auto& [name, t] : transport_json.items()) {
        ts += fmt::format("{}{} {:.2f} GB/s + {:.1f} us", ts.empty() ? "" : "; ", name,
                          t["gbps"].get<double>(), t["latency_us"].get<double>());
    }
    for (const auto& n : notes) ts += (ts.empty() ? "" : "; ") + n.get<std::string>();
    s += "  transports: " + (ts.empty() ? std::string("none") : ts) + "\n";
    if (!o.from_timeline.empty()) {
        for (const auto& f : source["files"]) {
            s += fmt::format("  from {} leader forwards of {} ({} overlapping another "
                             "instance's left out)\n",
                             f["forwards"].get<size_t>(), f["path"].get<std::string>(),
                             f["overlapped_skipped"].get<size_t>());
        }
        if (!o.base.empty()) s += "  missing parts from " + o.base + "\n";
        for (const auto& l : source.value("run_levels", json::array())) {
            auto pct = [](const json& v) {
                return v.is_number() ? fmt::format("{:+.1f}%", (v.get<double>() - 1) * 100)
                                     : std::string("-");
            };
            s += fmt::format("  run level of {} (vs the median run): extend {}, decode {}\n",
                             l["path"].get<std::string>(), pct(l["extend"]), pct(l["decode"]));
        }
        if (!interference.empty()) {
            s += fmt::format(
                "  interference (slower than their core share while another instance computes, "
                "{} cpus): extend +{:.1f}% ({} forwards), decode +{:.1f}% ({} forwards)\n",
                interference["node_cpus"].get<double>(),
                interference["extend"].get<double>() * 100,
                interference["overlapped_forwards"]["extend"].get<size_t>(),
                interference["decode"].get<double>() * 100,
                interference["overlapped_forwards"]["decode"].get<size_t>());
        }
        for (const auto& [kind, n] : noise.items()) {
            s += fmt::format(
                "  {} noise: slow cv {:.1f}% (redrawn every {:.0f} ms), fast cv {:.1f}% "
                "({} forwards, {} windows)\n",
                kind, n["slow_cv"].get<double>() * 100, cost::kNoiseWindowS * 1e3,
                n["fast_cv"].get<double>() * 100, n["points"].get<size_t>(),
                n["windows"].get<size_t>());
        }
    }
    s += "  wrote " + o.out + "\n";
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    return {};
}

}  // namespace

void add_calibrate_command(CLI::App& app, CommandSet& commands) {
    auto o = std::make_shared<CalibrateOptions>();
    CLI::App* a = app.add_subcommand(
        "calibrate",
        "Measure this machine's CPU testbed forwards (the synthetic model on the testbed's\n"
        "backend, per TP size and thread count) and KV transports, fit the calibrated cost\n"
        "model and write the cost file for `pdsim simulate --cost-model` (docs/cost-models.md).");
    a->add_option("--backend", o->backend, "Attention backend the testbed runs: cpu | cpu_ref")
        ->check(CLI::IsMember({"cpu", "cpu_ref"}))
        ->capture_default_str();
    a->add_option("--model", o->model, "Built-in model name or a model file")->required();
    a->add_option("--tp", o->tp, "Comma-separated TP sizes (ranks as threads of one process)")
        ->capture_default_str();
    a->add_option("--threads", o->threads,
                  "Comma-separated compute threads per rank (default per TP size: the testbed's "
                  "cores / ranks on the node for one prefill and one decode instance of that TP, "
                  "max(1, cores / (2 tp)))");
    a->add_option("--transport", o->transport,
                  "Comma-separated KV transports to measure: local, tcp, mpi (mpi only under "
                  "mpirun -np 2), or none")
        ->capture_default_str();
    a->add_flag("--quick", o->quick, "A small grid and fewer repeats (well under a minute)");
    a->add_option("--page-size", o->page_size, "KV page size (tokens), as the testbed's")
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    a->add_option("--repeats", o->repeats, "Timed rounds over the grid (0: 7, --quick 3)")
        ->check(CLI::Range(0, 100))
        ->capture_default_str();
    a->add_option("--out", o->out, "Cost file to write (JSON)")->required();
    a->add_option("--from-timeline", o->from_timeline,
                  "Comma-separated timelines of `pdsim testbed --timeline` runs: fit the forwards "
                  "the testbed's instance leaders ran (keyed by their tp and threads) instead of "
                  "microbenchmarking; --tp, --threads, --transport, --repeats are not used");
    a->add_flag("--include-overlapped", o->include_overlapped,
                "With --from-timeline: also fit forwards that overlap another instance's forward "
                "(by default left out: the simulator's CPU contention model adds that slowdown)");
    a->add_option("--node-cpus", o->node_cpus,
                  "With --from-timeline: cores of the machine the timelines were recorded on (default: "
                  "this machine's), for the interference fit: how much slower than their share of "
                  "the cores forwards ran while another instance computed")
        ->check(CLI::NonNegativeNumber);
    a->add_option("--base", o->base,
                  "With --from-timeline: a cost file whose fits supply the (tp, threads, extend | "
                  "decode) the timelines have no forwards of, and whose transports are copied");
    a->add_option("--worker", o->worker, "internal: measure one TP:THREADS group")->group("");
    commands.add(a, [o] { return run_calibrate(*o); });
}

}  // namespace pdsim::cli
