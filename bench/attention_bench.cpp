// Google Benchmark microbenchmarks of the `cpu` attention backend next to its baselines:
//   BM_Decode   decode forward over long paged KV; counter KV_bytes/s = KV bytes read
//   BM_Copy     STREAM-style copy on a pdsim::ThreadPool of the same size; bytes/s = read + write
//   BM_Extend   causal prefill forward; counter FLOP/s = causal QK^T + PV work attended
//   BM_Sgemm    OpenBLAS sgemm on the same products done densely; FLOP/s
// Threads: PDSIM_NUM_THREADS (default: all cores), for the backend, the copy and OpenBLAS alike.
// `pdsim bench attention` is the end-to-end measurement with targets; these are for profiling
// and quick A/B comparisons (e.g. --benchmark_filter=Decode).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/cpu_stream.h"
#include "common/bf16.h"
#include "common/thread_pool.h"

namespace {

using namespace pdsim;

constexpr int kQHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;

int bench_threads() {
    if (const char* env = std::getenv("PDSIM_NUM_THREADS")) {
        if (int n = std::atoi(env); n > 0) return n;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// A paged batch (random KV; each request's pages in the allocator's order, or shuffled over the
// pool: a fragmented pool) and a cpu backend.
struct Fixture {
    runtime::CpuStream stream{"attention-bench"};
    std::unique_ptr<attn::AttentionBackend> backend;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    std::vector<int32_t> seq_lens, q_lens, page_table;
    std::vector<float> q, out;
    attn::ForwardMode mode;
    attn::LayerSpec layer;
    int bs;

    Fixture(attn::ForwardMode m, kv::KVDtype dtype, int kv_heads, int batch, int seq_len, int q_len,
            bool shuffle_pages = false)
        : mode(m), layer{0, kQHeads, kv_heads, kHeadDim, 0, 0.f}, bs(batch) {
        attn::AttentionConfig ac;
        ac.num_q_heads = kQHeads;
        ac.num_kv_heads = kv_heads;
        ac.head_dim = kHeadDim;
        ac.kv_dtype = dtype;
        ac.stream = &stream;
        ac.num_threads = bench_threads();
        backend = std::move(attn::create_attention_backend("cpu", ac)).value();
        const int stride = (seq_len + kPageSize - 1) / kPageSize;
        kv::MHAPoolConfig pc;
        pc.num_pages = batch * stride + 1;
        pc.page_size = kPageSize;
        pc.num_kv_heads = kv_heads;
        pc.head_dim = kHeadDim;
        pc.dtype = dtype;
        pool = std::move(kv::MHATokenToKVPool::create(pc)).value();
        page_table = std::move(pool->allocator().alloc(batch * stride)).value();
        std::mt19937_64 rng(1);
        if (shuffle_pages) std::shuffle(page_table.begin(), page_table.end(), rng);
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        for (int b = 0; b < 2; ++b) {
            const size_t n =
                pool->page_bytes(0, b) * static_cast<size_t>(pc.num_pages) / kv::dtype_size(dtype);
            if (dtype == kv::KVDtype::kF32) {
                float* p = static_cast<float*>(pool->data(0, b));
                for (size_t i = 0; i < n; ++i) p[i] = u(rng);
            } else {
                bf16_t* p = static_cast<bf16_t*>(pool->data(0, b));
                for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(u(rng));
            }
        }
        seq_lens.assign(static_cast<size_t>(batch), seq_len);
        q_lens.assign(static_cast<size_t>(batch), q_len);
        q.resize(static_cast<size_t>(batch) * q_len * kQHeads * kHeadDim);
        for (float& x : q) x = u(rng);
        out.resize(q.size());
        attn::ForwardBatch fb{mode, batch, seq_lens, q_lens, page_table, stride};
        if (!backend->init_forward_metadata(fb).ok()) std::abort();
    }

    void forward() {
        const int64_t n = static_cast<int64_t>(q.size()) / (kQHeads * kHeadDim);
        if (!backend
                 ->forward(runtime::host_view(static_cast<const float*>(q.data()),
                                              {n, kQHeads, kHeadDim}),
                           {}, {}, layer, {}, *pool, mode, bs,
                           runtime::host_view(out.data(), {n, kQHeads, kHeadDim}), false)
                 .ok() ||
            !stream.synchronize().ok()) {
            std::abort();
        }
    }
};

kv::KVDtype dtype_arg(int64_t a) {
    return a == 0 ? kv::KVDtype::kF32 : kv::KVDtype::kBF16;
}

// Args: dtype (0 fp32, 1 bf16), kv heads, batch, KV length, pages shuffled (0/1).
void BM_Decode(benchmark::State& state) {
    const kv::KVDtype dtype = dtype_arg(state.range(0));
    const int kv_heads = static_cast<int>(state.range(1)), bs = static_cast<int>(state.range(2));
    const int len = static_cast<int>(state.range(3));
    Fixture f(attn::ForwardMode::kDecode, dtype, kv_heads, bs, len, 1, state.range(4) != 0);
    for (auto _ : state) f.forward();
    const double bytes =
        static_cast<double>(bs) * len * kv_heads * 2.0 * kHeadDim * kv::dtype_size(dtype);
    state.counters["KV_bytes"] = benchmark::Counter(
        bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Decode)
    ->ArgNames({"bf16", "kv_heads", "bs", "len", "shuffled"})
    ->Args({0, 2, 16, 4096, 0})
    ->Args({0, 2, 16, 4096, 1})
    ->Args({1, 2, 16, 4096, 0})
    ->Args({1, 2, 16, 4096, 1})
    ->Args({0, 8, 16, 4096, 0})
    ->Args({1, 8, 16, 4096, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Arg: MiB per array.
void BM_Copy(benchmark::State& state) {
    const size_t n = static_cast<size_t>(state.range(0)) << 18;  // floats
    std::vector<float> a(n, 1.f), b(n, 0.f);
    ThreadPool pool(bench_threads());
    constexpr size_t kChunk = 1 << 18;
    for (auto _ : state) {
        pool.parallel_for((n + kChunk - 1) / kChunk, [&](size_t c0, size_t c1, int) {
            const size_t lo = c0 * kChunk, hi = std::min(n, c1 * kChunk);
            std::copy(a.data() + lo, a.data() + hi, b.data() + lo);
        });
        benchmark::DoNotOptimize(b.data());
    }
    state.counters["bytes"] =
        benchmark::Counter(2.0 * n * sizeof(float), benchmark::Counter::kIsIterationInvariantRate,
                           benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Copy)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

// Args: dtype, kv heads, batch, new tokens per request (no cached prefix).
void BM_Extend(benchmark::State& state) {
    const kv::KVDtype dtype = dtype_arg(state.range(0));
    const int kv_heads = static_cast<int>(state.range(1)), bs = static_cast<int>(state.range(2));
    const int len = static_cast<int>(state.range(3));
    Fixture f(attn::ForwardMode::kExtend, dtype, kv_heads, bs, len, len);
    for (auto _ : state) f.forward();
    const double flops = 4.0 * kHeadDim * kQHeads * bs * (len * (len + 1.0) / 2.0);
    state.counters["FLOP"] = benchmark::Counter(
        flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Extend)
    ->ArgNames({"bf16", "kv_heads", "bs", "len"})
    ->Args({0, 2, 4, 1024})
    ->Args({1, 2, 4, 1024})
    ->Args({0, 8, 4, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Args: batch, tokens per request: per request and query head S = Q K^T (len x len x head_dim)
// and O = S V (len x head_dim x len), dense.
void BM_Sgemm(benchmark::State& state) {
    const int bs = static_cast<int>(state.range(0)), len = static_cast<int>(state.range(1));
    openblas_set_num_threads(bench_threads());
    // One buffer: Q, K, V, O ([len][head_dim] each), then S ([len][len]).
    const size_t m = static_cast<size_t>(len) * kHeadDim;
    std::vector<float> buf(4 * m + static_cast<size_t>(len) * len, 0.5f);
    const float* q = buf.data();
    const float* k = q + m;
    const float* v = k + m;
    float* o = buf.data() + 3 * m;
    float* s = o + m;
    for (auto _ : state) {
        for (int i = 0; i < bs * kQHeads; ++i) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, len, len, kHeadDim, 1.f, q,
                        kHeadDim, k, kHeadDim, 0.f, s, len);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, kHeadDim, len, 1.f, s, len,
                        v, kHeadDim, 0.f, o, kHeadDim);
        }
        benchmark::DoNotOptimize(o);
    }
    const double flops = 4.0 * bs * kQHeads * static_cast<double>(len) * len * kHeadDim;
    state.counters["FLOP"] = benchmark::Counter(
        flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Sgemm)
    ->ArgNames({"bs", "len"})
    ->Args({4, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
