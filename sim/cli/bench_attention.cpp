// pdsim bench attention: the `cpu` attention backend's decode and extend throughput, each against a
// baseline measured in the same run, on the same number of threads (DESIGN.md "Performance
// targets", "bench JSON").
//
//   decode  GB/s = KV bytes read (sum over requests of seq_len * kv_heads * (head_dim + v_head_dim)
//           * dtype size) / time of one decode forward (batch of long-KV requests, shuffled pages).
//           Baseline: a STREAM-style copy (a[i] -> b[i], ordinary stores, arrays far larger than
//           the last-level cache) run by a pdsim::ThreadPool of the same size; GB/s counts read +
//           write bytes, as STREAM does. Target ratio >= 0.60.
//   extend  GFLOP/s = causal work actually attended: 2 * (head_dim + v_head_dim) * num_q_heads *
//           sum over queries of the keys they attend (QK^T and PV), / time of one extend forward
//           (prefill, no cached prefix). Baseline: OpenBLAS cblas_sgemm on the same products done
//           densely (per request and query head: S = Q K^T with M = q_len, N = seq_len,
//           K = head_dim, then O = S V with M = q_len, N = v_head_dim, K = seq_len) with
//           openblas_set_num_threads(threads); GFLOP/s counts 2*M*N*K per call. Target >= 0.40.
// Each figure is the best of several repetitions after a warm-up (the median is in the JSON too).
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
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
#include "common/thread_pool.h"
#include "sim/cli/command.h"

namespace pdsim::cli {

namespace {

constexpr double kDecodeTarget = 0.60;
constexpr double kExtendTarget = 0.40;

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
    int reps = 0;        // 0: 5 (--quick: 3)
    int copy_mib = 256;  // per array
    uint64_t seed = 1;
};

struct Timing {
    double best = 0;
    double median = 0;
};

// Runs f() `warmup` times, then `reps` timed times.
template <typename F>
StatusOr<Timing> time_reps(int warmup, int reps, F&& f) {
    std::vector<double> s;
    for (int i = 0; i < warmup + reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        PDSIM_RETURN_IF_ERROR(f());
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (i >= warmup) s.push_back(dt);
    }
    std::sort(s.begin(), s.end());
    return Timing{s.front(), s[s.size() / 2]};
}

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

// One paged batch on its own pool: random KV in every page, each request's pages drawn at random
// (a fragmented pool, as after a while of serving), random q.
struct AttnCase {
    attn::ForwardMode mode = attn::ForwardMode::kDecode;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::vector<int32_t> seq_lens, q_lens, page_table;
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
    std::mt19937_64 rng(seed);
    std::shuffle(pages.begin(), pages.end(), rng);
    c.page_table = pages;
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

// Times forward() of the case through `backend` (KV already in the pool: save_kv_cache = false).
StatusOr<Timing> time_forward(attn::AttentionBackend& backend, runtime::Stream& stream, AttnCase& c,
                              const BenchAttentionOptions& o, int warmup, int reps) {
    attn::ForwardBatch fb;
    fb.mode = c.mode;
    fb.bs = static_cast<int>(c.seq_lens.size());
    fb.seq_lens = c.seq_lens;
    fb.extend_lens = c.q_lens;
    fb.page_table = c.page_table;
    fb.page_table_stride = c.stride;
    PDSIM_RETURN_IF_ERROR(backend.init_forward_metadata(fb));
    const attn::LayerSpec layer{0, o.q_heads, o.kv_heads, o.head_dim, 0, 0.f};
    return time_reps(warmup, reps, [&]() -> Status {
        PDSIM_RETURN_IF_ERROR(backend.forward(c.q.data(), nullptr, nullptr, layer, nullptr, *c.pool,
                                              c.mode, fb.bs, c.out.data(),
                                              /*save_kv_cache=*/false));
        return stream.synchronize();
    });
}

// STREAM "Copy" on `pool`: b[i] = a[i] in 1 MiB chunks handed out dynamically. A plain loop (the
// compiler vectorizes it; the optimize attribute stops GCC from turning it into a memcpy call).
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

StatusOr<Timing> time_copy(ThreadPool& pool, CopyBuffers& buf, int warmup, int reps) {
    constexpr size_t kChunk = (1u << 20) / sizeof(float);
    const size_t nchunks = (buf.n + kChunk - 1) / kChunk;
    const float* a = buf.a.get();
    float* b = buf.b.get();
    const size_t n = buf.n;
    return time_reps(warmup, reps, [&]() -> Status {
        pool.parallel_for(nchunks, [&](size_t c0, size_t c1, int) {
            for (size_t c = c0; c < c1; ++c) {
                const size_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
                copy_chunk(a + lo, b + lo, hi - lo);
            }
        });
        return Status();
    });
}

// The dense products of the extend case, through cblas_sgemm.
struct GemmCase {
    int bs, q_len, seq_len, heads, d, dv;
    std::vector<float> q, k, v, s, o;
};

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

const char* verdict(double ratio, double target) {
    return ratio >= target ? "PASS" : "BELOW";
}

Status run_bench_attention(BenchAttentionOptions o) {
    PDSIM_ASSIGN_OR_RETURN(kv::KVDtype dtype, kv::parse_dtype(o.dtype));
    if (o.q_heads % o.kv_heads != 0) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads, o.kv_heads));
    }
    if (o.extend_len == 0) o.extend_len = o.quick ? 512 : 2048;
    if (o.reps == 0) o.reps = o.quick ? 3 : 5;
    const int threads = o.threads > 0
                            ? o.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int warmup = 1;
    const double esize = static_cast<double>(kv::dtype_size(dtype));

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

    // ---- decode vs copy ----
    std::fprintf(stderr, "bench attention: decode %d x %d KV tokens ...\n", o.decode_batch,
                 o.decode_len);
    PDSIM_ASSIGN_OR_RETURN(AttnCase dc, make_case(o, dtype, attn::ForwardMode::kDecode,
                                                  o.decode_batch, o.decode_len, 1, o.seed));
    PDSIM_ASSIGN_OR_RETURN(Timing dt, time_forward(*backend, stream, dc, o, warmup + 1, o.reps));
    const double decode_bytes = static_cast<double>(o.decode_batch) * o.decode_len * o.kv_heads *
                                (2.0 * o.head_dim) * esize;
    dc = AttnCase();  // free the pool before the copy arrays

    std::fprintf(stderr, "bench attention: copy 2 x %d MiB ...\n", o.copy_mib);
    ThreadPool copy_pool(threads);
    CopyBuffers cb;
    cb.n = static_cast<size_t>(o.copy_mib) * (1u << 20) / sizeof(float);
    cb.a.reset(static_cast<float*>(std::aligned_alloc(64, cb.n * sizeof(float))));
    cb.b.reset(static_cast<float*>(std::aligned_alloc(64, cb.n * sizeof(float))));
    if (!cb.a || !cb.b)
        return Status(StatusCode::kResourceExhausted, "bench attention: copy arrays");
    // First touch by the copying pool, so pages are faulted in before timing.
    copy_pool.parallel_for(cb.n, [&](size_t lo, size_t hi, int) {
        for (size_t i = lo; i < hi; ++i) {
            cb.a.get()[i] = static_cast<float>(i & 1023);
            cb.b.get()[i] = 0.f;
        }
    });
    PDSIM_ASSIGN_OR_RETURN(Timing ct, time_copy(copy_pool, cb, warmup + 1, std::max(o.reps, 5)));
    const double copy_bytes = 2.0 * static_cast<double>(cb.n) * sizeof(float);
    cb = CopyBuffers();

    const double decode_gbps = decode_bytes / dt.best / 1e9;
    const double copy_gbps = copy_bytes / ct.best / 1e9;
    const double decode_ratio = decode_gbps / copy_gbps;

    // ---- extend vs sgemm ----
    std::fprintf(stderr, "bench attention: extend %d x %d tokens (causal) ...\n", o.extend_batch,
                 o.extend_len);
    PDSIM_ASSIGN_OR_RETURN(
        AttnCase ec, make_case(o, dtype, attn::ForwardMode::kExtend, o.extend_batch, o.extend_len,
                               o.extend_len, o.seed + 1));
    PDSIM_ASSIGN_OR_RETURN(Timing et, time_forward(*backend, stream, ec, o, warmup, o.reps));
    // Query j (0-based) of a request with no cached prefix attends j + 1 keys.
    const double attended =
        static_cast<double>(o.extend_batch) * o.extend_len * (o.extend_len + 1.0) / 2.0;
    const double extend_flops = 2.0 * (o.head_dim + o.head_dim) * o.q_heads * attended;
    ec = AttnCase();

    std::fprintf(stderr, "bench attention: sgemm baseline ...\n");
    openblas_set_num_threads(threads);
    GemmCase g{o.extend_batch,
               o.extend_len,
               o.extend_len,
               o.q_heads,
               o.head_dim,
               o.head_dim,
               {},
               {},
               {},
               {},
               {}};
    FastRng fr{o.seed + 7};
    for (auto* vec : {&g.q, &g.k, &g.v}) {
        const size_t n =
            vec == &g.q ? static_cast<size_t>(g.q_len) * g.d : static_cast<size_t>(g.seq_len) * g.d;
        vec->resize(n);
        for (float& x : *vec) x = fr.next();
    }
    g.s.assign(static_cast<size_t>(g.q_len) * g.seq_len, 0.f);
    g.o.assign(static_cast<size_t>(g.q_len) * g.dv, 0.f);
    double gemm_flops = 0;
    PDSIM_ASSIGN_OR_RETURN(Timing gt, time_reps(warmup, o.reps, [&]() -> Status {
                               gemm_flops = run_gemms(g);
                               return Status();
                           }));
    const double extend_gflops = extend_flops / et.best / 1e9;
    const double sgemm_gflops = gemm_flops / gt.best / 1e9;
    const double extend_ratio = extend_gflops / sgemm_gflops;

    // ---- report ----
    const std::string shape = fmt::format("{}q/{}kv heads, head_dim {}, page {}", o.q_heads,
                                          o.kv_heads, o.head_dim, o.page_size);
    fmt::print("pdsim bench attention: backend {}, {} threads, KV {}, isa {}, {}\n", o.backend,
               threads, o.dtype, isa, shape);
    fmt::print("{:<34} {:>14} {:>22} {:>7} {:>7}  {}\n", "figure", "measured", "baseline", "ratio",
               "target", "");
    fmt::print("{:<34} {:>9.1f} GB/s {:>9} {:>7.1f} GB/s {:>7.2f} {:>7.2f}  {}\n",
               fmt::format("decode {}x{} KV tokens", o.decode_batch, o.decode_len), decode_gbps,
               "copy", copy_gbps, decode_ratio, kDecodeTarget,
               verdict(decode_ratio, kDecodeTarget));
    fmt::print("{:<34} {:>6.1f} GFLOP/s {:>6} {:>6.1f} GFLOP/s {:>7.2f} {:>7.2f}  {}\n",
               fmt::format("extend {}x{} tokens causal", o.extend_batch, o.extend_len),
               extend_gflops, "sgemm", sgemm_gflops, extend_ratio, kExtendTarget,
               verdict(extend_ratio, kExtendTarget));

    if (!o.json_path.empty()) {
        nlohmann::json j = {{"decode",
                             {{"gbps", decode_gbps},
                              {"baseline_gbps", copy_gbps},
                              {"ratio", decode_ratio},
                              {"target", kDecodeTarget},
                              {"pass", decode_ratio >= kDecodeTarget},
                              {"batch", o.decode_batch},
                              {"kv_len", o.decode_len},
                              {"kv_bytes", decode_bytes},
                              {"seconds_best", dt.best},
                              {"seconds_median", dt.median},
                              {"gbps_median", decode_bytes / dt.median / 1e9},
                              {"baseline", "stream_copy"},
                              {"baseline_bytes", copy_bytes},
                              {"baseline_seconds_best", ct.best},
                              {"baseline_gbps_median", copy_bytes / ct.median / 1e9}}},
                            {"extend",
                             {{"gflops", extend_gflops},
                              {"baseline_gflops", sgemm_gflops},
                              {"ratio", extend_ratio},
                              {"target", kExtendTarget},
                              {"pass", extend_ratio >= kExtendTarget},
                              {"batch", o.extend_batch},
                              {"q_len", o.extend_len},
                              {"flops", extend_flops},
                              {"seconds_best", et.best},
                              {"seconds_median", et.median},
                              {"gflops_median", extend_flops / et.median / 1e9},
                              {"baseline", "openblas_sgemm"},
                              {"baseline_flops", gemm_flops},
                              {"baseline_seconds_best", gt.best},
                              {"baseline_gflops_median", gemm_flops / gt.median / 1e9}}},
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
        std::ofstream f(o.json_path);
        if (!f)
            return Status(StatusCode::kInvalidArgument,
                          "--json " + o.json_path + ": cannot open for writing");
        f << j.dump(2) << "\n";
        if (!f)
            return Status(StatusCode::kInvalidArgument, "--json " + o.json_path + ": write failed");
    }
    return {};
}

}  // namespace

void add_bench_attention_command(CLI::App& bench, CommandSet& commands) {
    auto o = std::make_shared<BenchAttentionOptions>();
    CLI::App* a = bench.add_subcommand(
        "attention",
        "CPU attention throughput vs in-run baselines on the same threads: decode GB/s vs a\n"
        "STREAM-style copy (target >= 0.60x), causal extend GFLOP/s vs OpenBLAS sgemm on the same\n"
        "products (target >= 0.40x). Prints a table; exits 0 whether or not targets are met.");
    a->add_option("--json", o->json_path, "Write the results as JSON to this file");
    a->add_option("--threads", o->threads,
                  "Threads for the backend and the baselines (0 = all cores)")
        ->check(CLI::Range(0, 1024))
        ->capture_default_str();
    a->add_flag("--quick", o->quick, "Fewer repetitions and a shorter extend (for CI)");
    a->add_option("--dtype", o->dtype, "KV cache dtype: fp32 or bf16")
        ->check(CLI::IsMember({"fp32", "bf16"}))
        ->capture_default_str();
    a->add_option("--backend", o->backend, "Attention backend to measure")->capture_default_str();
    a->add_option("--q-heads", o->q_heads, "Query heads")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    a->add_option("--kv-heads", o->kv_heads, "KV heads")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    a->add_option("--head-dim", o->head_dim, "Head dimension (K and V)")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    a->add_option("--page-size", o->page_size, "Tokens per KV page")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    a->add_option("--decode-batch", o->decode_batch, "Decode requests")
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    a->add_option("--decode-len", o->decode_len, "KV tokens per decode request")
        ->check(CLI::Range(1, 1 << 20))
        ->capture_default_str();
    a->add_option("--extend-batch", o->extend_batch, "Prefill requests")
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    a->add_option("--extend-len", o->extend_len,
                  "New tokens per prefill request (0: 2048, --quick 512)")
        ->check(CLI::Range(0, 1 << 16))
        ->capture_default_str();
    a->add_option("--reps", o->reps, "Timed repetitions per figure (0: 5, --quick 3)")
        ->check(CLI::Range(0, 1000))
        ->capture_default_str();
    a->add_option("--copy-mib", o->copy_mib, "MiB per array of the copy baseline")
        ->check(CLI::Range(64, 1 << 16))
        ->capture_default_str();
    a->add_option("--seed", o->seed, "Random seed")->capture_default_str();
    commands.add(a, [o] { return run_bench_attention(*o); });
}

}  // namespace pdsim::cli
