// pdsim bench attention: the `cpu` attention backend's decode and extend throughput, each against a
// baseline measured in the same run, on the same number of threads (docs/design.md "Performance
// targets", "bench JSON").
//
//   decode  GB/s = KV bytes read (sum over requests of seq_len * kv_heads * (head_dim + v_head_dim)
//           * dtype size) / time of one decode forward over a batch of long-KV requests. Pages
//           in the allocator's order (what a fresh pool hands out: each request's pages
//           consecutive); the same batch over shuffled pages (a fragmented pool) is reported too,
//           as decode_fragmented. Baseline: a STREAM-style copy (b[i] = a[i], ordinary stores,
//           arrays far larger than the last-level cache) run by a pdsim::ThreadPool of the same
//           size; GB/s counts read + write bytes, as STREAM does. Target ratio >= 0.60.
//   extend  GFLOP/s = causal work actually attended: 2 * (head_dim + v_head_dim) * num_q_heads *
//           sum over queries of the keys they attend (QK^T and PV), / time of one extend forward
//           (prefill, no cached prefix). Baseline: OpenBLAS cblas_sgemm on the same products done
//           densely (per request and query head: S = Q K^T with M = q_len, N = seq_len,
//           K = head_dim, then O = S V with M = q_len, N = v_head_dim, K = seq_len) with
//           openblas_set_num_threads(threads); GFLOP/s counts 2*M*N*K per call. Target >= 0.40.
// Each figure and its baseline are timed in interleaved rounds (so a change in machine load hits
// both; decode and copy runs start from caches holding no dirty lines); a figure is the best round
// after warm-up (medians in the JSON).
//
// --backend cuda is another bench with its own defaults (llama3-8b shapes, bf16, on one GPU):
// sim/cli/bench_attention_cuda.h. This file only maps the flags onto it.
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>

#include "backends/attention/attention_backend.h"
#include "backends/attention/cpu_kernels.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/cpu_stream.h"
#include "common/bf16.h"
#include "common/stats.h"
#include "common/thread_pool.h"
#include "sim/cli/bench_attention_cuda.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"

namespace pdsim::cli {

namespace {

constexpr double kDecodeTarget = 0.60;
constexpr double kExtendTarget = 0.40;

constexpr int64_t kMaxBenchKvBytes = int64_t{16} << 30;  // the decode's or the extend's KV cache

struct BenchAttentionOptions {
    std::string json_path;
    int threads = 0;
    bool quick = false;
    std::string dtype = "fp32";
    std::string backend = "cpu";
    int q_heads = 8;
    int kv_heads = 2;
    int head_dim = 128;
    int page_size = 16;
    int decode_batch = 16;
    int decode_len = 4096;
    int extend_batch = 4;
    int extend_len = 0;  // 0: 2048 (--quick: 512)
    int reps = 0;        // 0: 7 (--quick: 3)
    int copy_mib = 256;  // per array
    uint64_t seed = 1;
};

using Timing = stats::BestAndMedian;

// xorshift64*: fills large buffers quickly with values in [-1, 1).
struct FastRng {
    uint64_t x;
    float next() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        return static_cast<float>((x * 0x2545F4914F6CDD1Dull) >> 40) * (2.f / 16777216.f) - 1.f;
    }
};

// One paged batch on its own pool: random KV in every page, random q. page_table holds each
// request's pages in the allocator's order (consecutive ids), shuffled_page_table the same pages
// shuffled over the whole batch (a fragmented pool, as after a while of serving).
struct AttnCase {
    attn::ForwardMode mode = attn::ForwardMode::kDecode;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::vector<int32_t> seq_lens, q_lens, page_table, shuffled_page_table;
    int stride = 0;
    std::vector<float> q, out;
    int num_tokens = 0;
};

StatusOr<AttnCase> make_case(const BenchAttentionOptions& o, kv::KVDtype dtype,
                             attn::ForwardMode mode, int bs, int seq_len, int q_len,
                             uint64_t seed) {
    AttnCase c;
    c.mode = mode;
    c.seq_lens.assign(static_cast<size_t>(bs), seq_len);
    c.q_lens.assign(static_cast<size_t>(bs), q_len);
    c.stride = (seq_len + o.page_size - 1) / o.page_size;
    kv::MHAPoolConfig pc;
    pc.num_layers = 1;
    pc.num_pages = bs * c.stride + 1;
    pc.page_size = o.page_size;
    pc.num_kv_heads = o.kv_heads;
    pc.head_dim = o.head_dim;
    pc.dtype = dtype;
    PDSIM_ASSIGN_OR_RETURN(c.pool, kv::MHATokenToKVPool::create(pc));
    PDSIM_ASSIGN_OR_RETURN(std::vector<int32_t> pages, c.pool->allocator().alloc(bs * c.stride));
    c.page_table = pages;
    std::mt19937_64 rng(seed);
    std::shuffle(pages.begin(), pages.end(), rng);
    c.shuffled_page_table = pages;
    FastRng fr{seed * 0x9E3779B97F4A7C15ull + 1};
    for (int b = 0; b < 2; ++b) {
        const size_t n =
            c.pool->page_bytes(0, b) * static_cast<size_t>(pc.num_pages) / kv::dtype_size(dtype);
        if (dtype == kv::KVDtype::kF32) {
            float* p = static_cast<float*>(c.pool->data(0, b));
            for (size_t i = 0; i < n; ++i) p[i] = fr.next();
        } else {
            bf16_t* p = static_cast<bf16_t*>(c.pool->data(0, b));
            for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(fr.next());
        }
    }
    c.num_tokens = bs * q_len;
    c.q.resize(static_cast<size_t>(c.num_tokens) * o.q_heads * o.head_dim);
    for (float& x : c.q) x = fr.next();
    c.out.assign(static_cast<size_t>(c.num_tokens) * o.q_heads * o.head_dim, 0.f);
    return c;
}

// Runs forward() once for the case through `backend` (KV already in the pool, so
// save_kv_cache = false) and waits for it. init_forward_metadata first selects the page table:
// the allocator-order one or the shuffled one.
Status set_batch(attn::AttentionBackend& backend, AttnCase& c, bool shuffled) {
    attn::ForwardBatch fb;
    fb.mode = c.mode;
    fb.bs = static_cast<int>(c.seq_lens.size());
    fb.seq_lens = c.seq_lens;
    fb.extend_lens = c.q_lens;
    fb.page_table = shuffled ? c.shuffled_page_table : c.page_table;
    fb.page_table_stride = c.stride;
    return backend.init_forward_metadata(fb);
}

Status run_forward(attn::AttentionBackend& backend, runtime::Stream& stream, AttnCase& c,
                   const BenchAttentionOptions& o) {
    const attn::LayerSpec layer{0, o.q_heads, o.kv_heads, o.head_dim, 0, 0.f};
    const int64_t n = c.num_tokens;
    PDSIM_RETURN_IF_ERROR(backend.forward(
        runtime::host_view(static_cast<const float*>(c.q.data()), {n, o.q_heads, o.head_dim}), {},
        {}, layer, {}, *c.pool, c.mode, static_cast<int>(c.seq_lens.size()),
        runtime::host_view(c.out.data(), {n, o.q_heads, o.head_dim}),
        /*save_kv_cache=*/false));
    return stream.synchronize();
}

// STREAM "Copy": b[i] = a[i]. A plain loop (the compiler vectorizes it; the optimize attribute
// stops GCC from turning it into a memcpy call, which may use non-temporal stores).
__attribute__((optimize("no-tree-loop-distribute-patterns"))) void copy_chunk(
    const float* __restrict a, float* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) b[i] = a[i];
}

struct CopyBuffers {
    struct Free {
        void operator()(float* p) const { std::free(p); }
    };
    std::unique_ptr<float, Free> a, b;
    size_t n = 0;
};

// One copy of the whole array on `pool`, in 1 MiB chunks handed out dynamically.
void run_copy(ThreadPool& pool, CopyBuffers& buf) {
    constexpr size_t kChunk = (1u << 20) / sizeof(float);
    const float* a = buf.a.get();
    float* b = buf.b.get();
    const size_t n = buf.n;
    pool.parallel_for((n + kChunk - 1) / kChunk, [&](size_t c0, size_t c1, int) {
        for (size_t c = c0; c < c1; ++c) {
            const size_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
            copy_chunk(a + lo, b + lo, hi - lo);
        }
    });
}

// The dense products of the extend case, through cblas_sgemm.
struct GemmCase {
    int bs = 0, q_len = 0, seq_len = 0, heads = 0, d = 0, dv = 0;
    std::vector<float> q, k, v, s, o;
};

// Returns the flops done.
double run_gemms(GemmCase& g) {
    double flops = 0;
    for (int r = 0; r < g.bs; ++r) {
        for (int h = 0; h < g.heads; ++h) {
            // S[q_len][seq] = Q[q_len][d] K[seq][d]^T ; O[q_len][dv] = S V[seq][dv]
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g.q_len, g.seq_len, g.d, 1.f,
                        g.q.data(), g.d, g.k.data(), g.d, 0.f, g.s.data(), g.seq_len);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.q_len, g.dv, g.seq_len, 1.f,
                        g.s.data(), g.seq_len, g.v.data(), g.dv, 0.f, g.o.data(), g.dv);
            flops += 2.0 * g.q_len * g.seq_len * g.d + 2.0 * g.q_len * g.dv * g.seq_len;
        }
    }
    return flops;
}

// A workload of time_interleaved: `prep` runs untimed before each timed `run`.
struct Workload {
    std::function<Status()> run;
    std::function<void()> prep = [] {};
};

// Times several workloads in rounds (each round runs each once), so that a change in machine
// load during the run affects a figure and its baseline alike. After `warmup` untimed rounds,
// returns each workload's best and median over `reps` rounds.
StatusOr<std::vector<Timing>> time_interleaved(const std::vector<Workload>& work, int warmup,
                                               int reps) {
    std::vector<std::vector<double>> t(work.size());
    for (int r = 0; r < warmup + reps; ++r) {
        for (size_t i = 0; i < work.size(); ++i) {
            work[i].prep();
            const auto t0 = std::chrono::steady_clock::now();
            PDSIM_RETURN_IF_ERROR(work[i].run());
            const double dt =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (r >= warmup) t[i].push_back(dt);
        }
    }
    std::vector<Timing> out;
    for (auto& v : t) out.push_back(stats::best_and_median(std::move(v)));
    return out;
}

// Reads `n` floats on `pool` (the result is kept so the reads stay).
float read_all(ThreadPool& pool, const float* a, size_t n) {
    constexpr size_t kChunk = (1u << 20) / sizeof(float);
    std::vector<float> partial(static_cast<size_t>(pool.size()), 0.f);
    pool.parallel_for((n + kChunk - 1) / kChunk, [&](size_t c0, size_t c1, int w) {
        float acc = 0.f;
        for (size_t i = c0 * kChunk; i < std::min(n, c1 * kChunk); i += 16) acc += a[i];
        partial[static_cast<size_t>(w)] += acc;
    });
    return std::accumulate(partial.begin(), partial.end(), 0.f);
}

const char* verdict(double ratio, double target) {
    return ratio >= target ? "PASS" : "BELOW";
}

// Decode over allocator-order and shuffled pages, and the copy baseline, in interleaved rounds.
struct DecodeFigures {
    std::vector<Timing> t;  // decode, decode over shuffled pages, copy
    double decode_bytes = 0, copy_bytes = 0;
    [[nodiscard]] double gbps() const { return decode_bytes / t[0].best / 1e9; }
    [[nodiscard]] double fragmented_gbps() const { return decode_bytes / t[1].best / 1e9; }
    [[nodiscard]] double copy_gbps() const { return copy_bytes / t[2].best / 1e9; }
};

StatusOr<DecodeFigures> bench_decode(const BenchAttentionOptions& o, kv::KVDtype dtype, int threads,
                                     attn::AttentionBackend& backend, runtime::CpuStream& stream) {
    std::fprintf(stderr, "bench attention: decode %d x %d KV tokens vs copy 2 x %d MiB ...\n",
                 o.decode_batch, o.decode_len, o.copy_mib);
    PDSIM_ASSIGN_OR_RETURN(AttnCase dc, make_case(o, dtype, attn::ForwardMode::kDecode,
                                                  o.decode_batch, o.decode_len, 1, o.seed));
    ThreadPool copy_pool(threads);
    CopyBuffers cb;
    cb.n = static_cast<size_t>(o.copy_mib) * (1u << 20) / sizeof(float);
    cb.a.reset(static_cast<float*>(std::aligned_alloc(64, cb.n * sizeof(float))));
    cb.b.reset(static_cast<float*>(std::aligned_alloc(64, cb.n * sizeof(float))));
    if (!cb.a || !cb.b) {
        return Status(StatusCode::kResourceExhausted, "bench attention: copy arrays");
    }
    // First touch by the copying pool, so the pages are mapped before timing.
    copy_pool.parallel_for(cb.n, [&](size_t lo, size_t hi, int) {
        for (size_t i = lo; i < hi; ++i) {
            cb.a.get()[i] = static_cast<float>(i & 1023);
            cb.b.get()[i] = 0.f;
        }
    });
    // Every timed run starts from caches full of clean, unrelated lines (an untimed read of
    // 64 MiB, more than a last-level cache), so a decode never pays for writing back the dirty
    // lines the copy left.
    std::vector<float> scrub((64u << 20) / sizeof(float), 1.f);
    float sink = 0.f;
    auto clean_caches = [&] { sink += read_all(copy_pool, scrub.data(), scrub.size()); };
    auto decode_with = [&](bool shuffled) {
        return [&, shuffled] {
            PDSIM_RETURN_IF_ERROR(set_batch(backend, dc, shuffled));
            return run_forward(backend, stream, dc, o);
        };
    };
    DecodeFigures d;
    PDSIM_ASSIGN_OR_RETURN(d.t, time_interleaved({{decode_with(false), clean_caches},
                                                  {decode_with(true), clean_caches},
                                                  {[&] {
                                                       run_copy(copy_pool, cb);
                                                       return Status();
                                                   },
                                                   clean_caches}},
                                                 /*warmup=*/2, o.reps));
    volatile float keep = sink;  // the scrub reads must not be optimized away
    (void)keep;
    d.decode_bytes = static_cast<double>(o.decode_batch) * o.decode_len * o.kv_heads *
                     (2.0 * o.head_dim) * kv::dtype_size(dtype);
    d.copy_bytes = 2.0 * static_cast<double>(cb.n) * sizeof(float);
    return d;
}

// Extend (causal, no cached prefix) and the dense sgemm baseline, in interleaved rounds.
struct ExtendFigures {
    std::vector<Timing> t;  // extend, sgemm
    double flops = 0, gemm_flops = 0;
    [[nodiscard]] double gflops() const { return flops / t[0].best / 1e9; }
    [[nodiscard]] double sgemm_gflops() const { return gemm_flops / t[1].best / 1e9; }
};

StatusOr<ExtendFigures> bench_extend(const BenchAttentionOptions& o, kv::KVDtype dtype, int threads,
                                     attn::AttentionBackend& backend, runtime::CpuStream& stream) {
    std::fprintf(stderr, "bench attention: extend %d x %d tokens (causal) vs sgemm ...\n",
                 o.extend_batch, o.extend_len);
    PDSIM_ASSIGN_OR_RETURN(
        AttnCase ec, make_case(o, dtype, attn::ForwardMode::kExtend, o.extend_batch, o.extend_len,
                               o.extend_len, o.seed + 1));
    PDSIM_RETURN_IF_ERROR(set_batch(backend, ec, /*shuffled=*/false));
    openblas_set_num_threads(threads);
    GemmCase g;
    g.bs = o.extend_batch;
    g.q_len = g.seq_len = o.extend_len;
    g.heads = o.q_heads;
    g.d = g.dv = o.head_dim;
    FastRng fr{o.seed + 7};
    g.q.resize(static_cast<size_t>(g.q_len) * g.d);
    g.k.resize(static_cast<size_t>(g.seq_len) * g.d);
    g.v.resize(static_cast<size_t>(g.seq_len) * g.dv);
    for (auto* vec : {&g.q, &g.k, &g.v}) {
        for (float& x : *vec) x = fr.next();
    }
    g.s.assign(static_cast<size_t>(g.q_len) * g.seq_len, 0.f);
    g.o.assign(static_cast<size_t>(g.q_len) * g.dv, 0.f);
    ExtendFigures e;
    PDSIM_ASSIGN_OR_RETURN(
        e.t, time_interleaved({{[&] { return run_forward(backend, stream, ec, o); }}, {[&] {
                                   e.gemm_flops = run_gemms(g);
                                   return Status();
                               }}},
                              /*warmup=*/1, std::max(3, o.reps / 2)));
    // Query j (0-based) of a request with no cached prefix attends j + 1 keys.
    const double attended =
        static_cast<double>(o.extend_batch) * o.extend_len * (o.extend_len + 1.0) / 2.0;
    e.flops = 2.0 * (o.head_dim + o.head_dim) * o.q_heads * attended;
    return e;
}

void print_attention_table(const BenchAttentionOptions& o, int threads, const std::string& isa,
                           const DecodeFigures& d, const ExtendFigures& e) {
    const double decode_ratio = d.gbps() / d.copy_gbps();
    const double extend_ratio = e.gflops() / e.sgemm_gflops();
    fmt::print(
        "pdsim bench attention: backend {}, {} threads, KV {}, isa {}, {}q/{}kv heads, "
        "head_dim {}, page {}\n",
        o.backend, threads, o.dtype, isa, o.q_heads, o.kv_heads, o.head_dim, o.page_size);
    fmt::print("{:<36} {:>15} {:>21} {:>6} {:>7}\n", "figure", "measured", "baseline", "ratio",
               "target");
    const std::string dshape = fmt::format("{}x{} KV tokens", o.decode_batch, o.decode_len);
    fmt::print("{:<36} {:>10.1f} GB/s {:>5} {:>10.1f} GB/s {:>6.2f} {:>7.2f}  {}\n",
               "decode " + dshape, d.gbps(), "copy", d.copy_gbps(), decode_ratio, kDecodeTarget,
               verdict(decode_ratio, kDecodeTarget));
    fmt::print("{:<36} {:>10.1f} GB/s {:>5} {:>10.1f} GB/s {:>6.2f} {:>7}\n",
               "  same, pages shuffled (fragmented)", d.fragmented_gbps(), "copy", d.copy_gbps(),
               d.fragmented_gbps() / d.copy_gbps(), "(info)");
    fmt::print("{:<36} {:>7.1f} GFLOP/s {:>5} {:>7.1f} GFLOP/s {:>6.2f} {:>7.2f}  {}\n",
               fmt::format("extend {}x{} tokens causal", o.extend_batch, o.extend_len), e.gflops(),
               "sgemm", e.sgemm_gflops(), extend_ratio, kExtendTarget,
               verdict(extend_ratio, kExtendTarget));
}

nlohmann::json attention_json(const BenchAttentionOptions& o, int threads, const std::string& isa,
                              const DecodeFigures& d, const ExtendFigures& e) {
    const std::vector<Timing>& dt = d.t;
    const std::vector<Timing>& et = e.t;
    const double decode_ratio = d.gbps() / d.copy_gbps();
    const double extend_ratio = e.gflops() / e.sgemm_gflops();
    return {{"decode",
             {{"gbps", d.gbps()},
              {"baseline_gbps", d.copy_gbps()},
              {"ratio", decode_ratio},
              {"target", kDecodeTarget},
              {"pass", decode_ratio >= kDecodeTarget},
              {"batch", o.decode_batch},
              {"kv_len", o.decode_len},
              {"pages", "allocator_order"},
              {"kv_bytes", d.decode_bytes},
              {"seconds_best", dt[0].best},
              {"seconds_median", dt[0].median},
              {"gbps_median", d.decode_bytes / dt[0].median / 1e9},
              {"baseline", "stream_copy"},
              {"baseline_bytes", d.copy_bytes},
              {"baseline_seconds_best", dt[2].best},
              {"baseline_gbps_median", d.copy_bytes / dt[2].median / 1e9}}},
            {"decode_fragmented",
             {{"gbps", d.fragmented_gbps()},
              {"baseline_gbps", d.copy_gbps()},
              {"ratio", d.fragmented_gbps() / d.copy_gbps()},
              {"pages", "shuffled"},
              {"seconds_best", dt[1].best},
              {"seconds_median", dt[1].median}}},
            {"extend",
             {{"gflops", e.gflops()},
              {"baseline_gflops", e.sgemm_gflops()},
              {"ratio", extend_ratio},
              {"target", kExtendTarget},
              {"pass", extend_ratio >= kExtendTarget},
              {"batch", o.extend_batch},
              {"q_len", o.extend_len},
              {"flops", e.flops},
              {"seconds_best", et[0].best},
              {"seconds_median", et[0].median},
              {"gflops_median", e.flops / et[0].median / 1e9},
              {"baseline", "openblas_sgemm"},
              {"baseline_flops", e.gemm_flops},
              {"baseline_seconds_best", et[1].best},
              {"baseline_gflops_median", e.gemm_flops / et[1].median / 1e9}}},
            {"backend", o.backend},
            {"threads", threads},
            {"dtype", o.dtype},
            {"isa", isa},
            {"num_q_heads", o.q_heads},
            {"num_kv_heads", o.kv_heads},
            {"head_dim", o.head_dim},
            {"page_size", o.page_size},
            {"reps", o.reps},
            {"quick", o.quick}};
}

Status run_bench_attention(BenchAttentionOptions o) {
    PDSIM_RETURN_IF_ERROR(check_kv_bytes("--decode-batch x --decode-len x --kv-heads x --head-dim",
                                         o.decode_batch, o.decode_len, o.kv_heads, o.head_dim,
                                         kMaxBenchKvBytes));
    PDSIM_RETURN_IF_ERROR(check_kv_bytes("--extend-batch x --extend-len x --kv-heads x --head-dim",
                                         o.extend_batch, std::max(o.extend_len, 2048), o.kv_heads,
                                         o.head_dim, kMaxBenchKvBytes));
    PDSIM_ASSIGN_OR_RETURN(kv::KVDtype dtype, kv::parse_dtype(o.dtype));
    if (o.q_heads % o.kv_heads != 0) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads, o.kv_heads));
    }
    if (!o.json_path.empty() && !std::ofstream(o.json_path)) {  // fail before the long part
        return Status(StatusCode::kInvalidArgument,
                      "--json " + o.json_path + ": cannot open for writing");
    }
    if (o.extend_len == 0) o.extend_len = o.quick ? 512 : 2048;
    if (o.reps == 0) o.reps = o.quick ? 3 : 7;
    const int threads = o.threads > 0
                            ? o.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    runtime::CpuStream stream("bench-attention");
    attn::AttentionConfig ac;
    ac.num_q_heads = o.q_heads;
    ac.num_kv_heads = o.kv_heads;
    ac.head_dim = o.head_dim;
    ac.kv_dtype = dtype;
    ac.stream = &stream;
    ac.num_threads = threads;
    PDSIM_ASSIGN_OR_RETURN(auto backend, attn::create_attention_backend(o.backend, ac));
    const std::string isa(attn::cpu::isa_name(attn::cpu::detect_isa()));
    std::fprintf(stderr, "bench attention: backend %s, %d threads, KV %s, isa %s, %d reps\n",
                 o.backend.c_str(), threads, o.dtype.c_str(), isa.c_str(), o.reps);
    PDSIM_ASSIGN_OR_RETURN(DecodeFigures d, bench_decode(o, dtype, threads, *backend, stream));
    PDSIM_ASSIGN_OR_RETURN(ExtendFigures e, bench_extend(o, dtype, threads, *backend, stream));
    print_attention_table(o, threads, isa, d, e);
    if (!o.json_path.empty()) {
        PDSIM_RETURN_IF_ERROR(
            write_json_file("--json", o.json_path, attention_json(o, threads, isa, d, e)));
    }
    return {};
}

// The flags whose defaults differ for --backend cuda (or that it refuses), and those that only it
// reads: what was given on the command line decides.
struct AttentionFlags {
    CLI::Option *dtype, *threads, *q_heads, *kv_heads, *head_dim, *page_size, *decode_batch,
        *decode_len, *extend_batch, *extend_len, *reps, *copy_mib;
    CLI::Option *layers, *model, *model_prefill, *warmup;
};

struct CudaOnlyFlags {
    std::string model = "llama3-8b";
    int layers = 4;
    int model_prefill = 4096;
    int warmup = 3;
};

// The cuda bench's options: each flag given on the command line, else the cuda default
// (bench_attention_cuda.h). --dtype other than bf16 and --threads are refused (exit 2).
StatusOr<CudaBenchOptions> cuda_options(const BenchAttentionOptions& o, const CudaOnlyFlags& c,
                                        const AttentionFlags& f) {
    if (f.dtype->count() > 0 && o.dtype != "bf16") {
        return Status(StatusCode::kInvalidArgument,
                      "--dtype " + o.dtype +
                          ": --backend cuda measures bf16 KV only (FlashInfer has no fp32-KV "
                          "kernels)");
    }
    if (f.threads->count() > 0) {
        return Status(StatusCode::kInvalidArgument,
                      "--threads: the cpu backends' kernel threads; --backend cuda has none");
    }
    CudaBenchOptions g;
    g.json_path = o.json_path;
    auto take = [](const CLI::Option* flag, int given, int& field) {
        if (flag->count() > 0 && given > 0) field = given;
    };
    take(f.q_heads, o.q_heads, g.q_heads);
    take(f.kv_heads, o.kv_heads, g.kv_heads);
    take(f.head_dim, o.head_dim, g.head_dim);
    take(f.page_size, o.page_size, g.page_size);
    take(f.decode_batch, o.decode_batch, g.decode_batch);
    take(f.decode_len, o.decode_len, g.decode_len);
    take(f.extend_batch, o.extend_batch, g.extend_batch);
    take(f.extend_len, o.extend_len, g.extend_len);
    if (o.quick) {
        g.reps = 5;
        g.warmup = 1;
    }
    take(f.reps, o.reps, g.reps);
    if (f.warmup->count() > 0) g.warmup = c.warmup;
    if (f.copy_mib->count() > 0) g.copy_bytes = int64_t{o.copy_mib} << 20;
    g.model = c.model;
    g.layers = c.layers;
    g.model_prefill = c.model_prefill;
    g.seed = o.seed;
    PDSIM_RETURN_IF_ERROR(check_cuda_bench_options(g));
    return g;
}

// The attention shape, as the backends see it.
void add_shape_flags(CLI::App* a, BenchAttentionOptions& o, AttentionFlags* f) {
    f->q_heads = a->add_option("--q-heads", o.q_heads, "Query heads (cuda: 32)")
                     ->check(CLI::Range(1, 256))
                     ->capture_default_str();
    f->kv_heads = a->add_option("--kv-heads", o.kv_heads, "KV heads (cuda: 8)")
                      ->check(CLI::Range(1, 256))
                      ->capture_default_str();
    f->head_dim = a->add_option("--head-dim", o.head_dim, "Head dimension (K and V)")
                      ->check(CLI::Range(1, 1024))
                      ->capture_default_str();
    f->page_size = a->add_option("--page-size", o.page_size, "Tokens per KV page")
                       ->check(CLI::Range(1, 1024))
                       ->capture_default_str();
}

// The decode and extend batches, the rounds and the copy baseline.
void add_workload_flags(CLI::App* a, BenchAttentionOptions& o, AttentionFlags* f) {
    f->decode_batch = a->add_option("--decode-batch", o.decode_batch, "Decode requests (cuda: 64)")
                          ->check(CLI::Range(1, 4096))
                          ->capture_default_str();
    f->decode_len = a->add_option("--decode-len", o.decode_len, "KV tokens per decode request")
                        ->check(CLI::Range(1, 1 << 20))
                        ->capture_default_str();
    f->extend_batch = a->add_option("--extend-batch", o.extend_batch, "Prefill requests")
                          ->check(CLI::Range(1, 4096))
                          ->capture_default_str();
    f->extend_len = a->add_option("--extend-len", o.extend_len,
                                  "New tokens per prefill request (0: 2048, --quick 512; cuda: "
                                  "4096)")
                        ->check(CLI::Range(0, 1 << 16))
                        ->capture_default_str();
    f->reps = a->add_option("--reps", o.reps,
                            "Timed rounds (0: 7, --quick 3; extend uses half, at least 3; cuda: "
                            "20, --quick 5)")
                  ->check(CLI::Range(0, 1000))
                  ->capture_default_str();
    f->copy_mib = a->add_option("--copy-mib", o.copy_mib,
                                "MiB per array of the copy baseline (cuda: the decode's bytes, at "
                                "least 256)")
                      ->check(CLI::Range(64, 1 << 16))
                      ->capture_default_str();
    a->add_option("--seed", o.seed, "Random seed")->capture_default_str();
}

// --backend cuda only.
void add_cuda_only_flags(CLI::App* a, CudaOnlyFlags& c, AttentionFlags* f) {
    f->model = a->add_option("--model", c.model,
                             "cuda: the GPU model to time per layer (a name or a model file)")
                   ->check(non_empty())
                   ->capture_default_str();
    f->layers = a->add_option("--layers", c.layers, "cuda: layers of the GPU model")
                    ->check(CLI::Range(1, 256))
                    ->capture_default_str();
    f->model_prefill = a->add_option("--model-prefill", c.model_prefill,
                                     "cuda: tokens of the model's prefill (one request; its decode "
                                     "step is --decode-batch x --decode-len)")
                           ->check(CLI::Range(1, 1 << 16))
                           ->capture_default_str();
    f->warmup = a->add_option("--warmup", c.warmup,
                              "cuda: rounds run and dropped before the timed ones (after one "
                              "synchronized run)")
                    ->check(CLI::Range(0, 100))
                    ->capture_default_str();
}

}  // namespace

void add_bench_attention_command(CLI::App& bench, CommandSet& commands) {
    auto o = std::make_shared<BenchAttentionOptions>();
    auto c = std::make_shared<CudaOnlyFlags>();
    AttentionFlags f{};
    CLI::App* a = bench.add_subcommand(
        "attention",
        "CPU attention throughput vs in-run baselines on the same threads: decode GB/s vs a\n"
        "STREAM-style copy (target >= 0.60x), causal extend GFLOP/s vs OpenBLAS sgemm on the same\n"
        "products (target >= 0.40x). Prints a table; exits 0 whether or not targets are met.\n"
        "--backend cuda (one GPU, llama3-8b shapes by default, bf16): decode GB/s vs a\n"
        "device-to-device cudaMemcpyAsync (target >= 0.75x), causal extend FLOP/s vs a cuBLASLt\n"
        "bf16 GEMM of the same FLOPs (target >= 0.40x), and the GPU model's time per layer vs the\n"
        "roofline cost model; medians of --reps rounds; \"no device\" (exit 1) without a GPU.");
    a->add_option("--json", o->json_path, "Write the results as JSON to this file")
        ->check(output_file());
    f.threads = a->add_option("--threads", o->threads,
                              "Threads for the backend and the baselines (0 = all cores; cpu "
                              "backends only)")
                    ->check(CLI::Range(0, 1024))
                    ->capture_default_str();
    a->add_flag("--quick", o->quick,
                "Fewer repetitions and a shorter extend (for CI; cuda: 5 rounds, 1 warm-up)");
    f.dtype = a->add_option("--dtype", o->dtype, "KV cache dtype: fp32 or bf16 (cuda: bf16)")
                  ->check(CLI::IsMember({"fp32", "bf16"}))
                  ->capture_default_str();
    a->add_option("--backend", o->backend, "Attention backend to measure: cpu, cpu_ref or cuda")
        ->check(non_empty())
        ->capture_default_str();
    add_shape_flags(a, *o, &f);
    add_workload_flags(a, *o, &f);
    add_cuda_only_flags(a, *c, &f);
    commands.add(a, [o, c, f]() -> Status {
        if (o->backend == "cuda") {
            PDSIM_ASSIGN_OR_RETURN(const CudaBenchOptions g, cuda_options(*o, *c, f));
            return run_bench_attention_cuda(g);
        }
        for (const CLI::Option* only : {f.model, f.layers, f.model_prefill, f.warmup}) {
            if (only->count() > 0) {
                return Status(StatusCode::kInvalidArgument,
                              only->get_name() + ": only with --backend cuda");
            }
        }
        return run_bench_attention(*o);
    });
}

}  // namespace pdsim::cli
