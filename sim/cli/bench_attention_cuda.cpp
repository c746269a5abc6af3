// The GPU run of `pdsim bench attention --backend cuda` (what it measures and how: the file
// comment of sim/cli/bench_attention_cuda.h). Compiled only when pdsim is built with CUDA and
// FlashInfer; plain C++ against cudart (g++), no kernels of its own.
#include "sim/cli/bench_attention_cuda.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/cuda_synthetic_model.h"
#include "backends/cuda/gemm.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/device.h"
#include "common/bf16.h"
#include "common/cuda_check.h"
#include "common/stats.h"
#include "common/thread_pool.h"
#include "sim/cli/cli_util.h"

namespace pdsim::cli {

namespace {

using runtime::DeviceBuffer;
using runtime::DType;

constexpr std::chrono::milliseconds kSyncTimeout{120'000};
// q values are uniform in [-kQScale, kQScale), K and V in [-1, 1): with scores this spread the
// softmax is peaked (a handful of keys dominate), so reading a wrong KV row changes the output by
// O(0.1..1) while bf16 rounding changes it by O(1e-3); the oracle tolerance sits between.
constexpr float kQScale = 8.f;
constexpr double kOracleAbsTol = 0.03;
constexpr double kOracleRelTol = 0.03;
// Value streams of the generated inputs (each element is a pure function of seed, stream, index).
enum ValueStream : uint64_t {
    kDecodeK = 1,
    kDecodeV,
    kDecodeQ,
    kExtendK,
    kExtendV,
    kExtendQ,
    kGemmX,
    kGemmW,
    kTokens
};

// ---- generated values ---------------------------------------------------------------------------

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Element `index` of `stream`: uniform in [-scale, scale), rounded to bf16.
bf16_t value_bits(uint64_t seed, uint64_t stream, uint64_t index, float scale) {
    const uint64_t h = splitmix64(splitmix64(seed * 0x100000001B3ull + stream) + index);
    const float u = static_cast<float>(h >> 40) * (2.f / 16777216.f) - 1.f;
    return float_to_bf16(u * scale);
}

double value(uint64_t seed, uint64_t stream, uint64_t index, float scale) {
    return bf16_to_float(value_bits(seed, stream, index, scale));
}

// Fills `elems` bf16 elements of device memory `dst` with stream `stream`'s values, generated on
// the host in 32 MiB chunks (synchronous copies).
Status fill_device(void* dst, size_t elems, uint64_t seed, uint64_t stream, float scale,
                   ThreadPool& threads) {
    constexpr size_t kChunk = size_t{16} << 20;
    std::vector<bf16_t> host(std::min(kChunk, elems));
    for (size_t base = 0; base < elems; base += kChunk) {
        const size_t n = std::min(kChunk, elems - base);
        threads.parallel_for(
            n,
            [&](size_t lo, size_t hi, int) {
                for (size_t i = lo; i < hi; ++i)
                    host[i] = value_bits(seed, stream, base + i, scale);
            },
            size_t{1} << 16);
        CUDA_CHECK(cudaMemcpy(static_cast<bf16_t*>(dst) + base, host.data(), n * sizeof(bf16_t),
                              cudaMemcpyHostToDevice));
    }
    return {};
}

bool finite_bits(bf16_t b) {
    return (b & 0x7F80u) != 0x7F80u;  // exponent all ones: inf or NaN
}

// ---- device and timing --------------------------------------------------------------------------

StatusOr<CudaBenchDevice> open_device(int index) {
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                           runtime::device_runtime(runtime::DeviceKind::kCuda));
    const int count = rt->device_count();
    if (count == 0) {
        return Status(StatusCode::kUnavailable,
                      "bench attention --backend cuda: " + rt->unavailable_reason());
    }
    if (index >= count) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("bench attention --backend cuda: no device: GPU {} requested, "
                                  "{} visible",
                                  index, count));
    }
    CUDA_CHECK(cudaSetDevice(index));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    CudaBenchDevice d;
    d.index = index;
    d.name = prop.name;
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    d.sms = prop.multiProcessorCount;
    d.memory_gib = static_cast<double>(prop.totalGlobalMem) / (1u << 30);
    d.l2_mib = static_cast<double>(prop.l2CacheSize) / (1u << 20);
    CUDA_CHECK(cudaDriverGetVersion(&d.driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime));
    d.spec = match_gpu_spec(d.name);
    return d;
}

// Timing events, destroyed with the object.
class Events {
public:
    Events() = default;
    Events(const Events&) = delete;
    Events& operator=(const Events&) = delete;
    ~Events() {
        for (cudaEvent_t e : events_) cudaEventDestroy(e);
    }
    Status grow(size_t n) {
        while (events_.size() < n) {
            cudaEvent_t e = nullptr;
            CUDA_CHECK(cudaEventCreate(&e));
            events_.push_back(e);
        }
        return {};
    }
    cudaEvent_t operator[](size_t i) const { return events_[i]; }

private:
    std::vector<cudaEvent_t> events_;
};

// Device seconds of every run of each workload, over the timed rounds.
using Samples = std::vector<std::vector<double>>;

// One timed workload: `run` enqueues ONE run on the stream and returns; `prep`, when set, is
// enqueued untimed right before every timed run (e.g. a read-mostly run that leaves the L2 holding
// clean lines, so the run does not pay for writing back what the previous workload left dirty).
struct Workload {
    std::function<Status()> run;
    std::function<Status()> prep;
};

// Runs each workload once, synchronizing (kernel loading, buffers that grow), then
// `warmup + reps` rounds back to back without synchronizing in between: events around every run,
// so each sample is that run's device time alone, and the host stays ahead of the device (no
// launch gap is timed). The warm-up rounds are dropped.
StatusOr<Samples> time_rounds(runtime::Stream& stream, const std::vector<Workload>& work,
                              int warmup, int reps) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    for (const Workload& w : work) PDSIM_RETURN_IF_ERROR(w.run());
    PDSIM_RETURN_IF_ERROR(stream.synchronize(kSyncTimeout));
    const size_t rounds = static_cast<size_t>(warmup + reps);
    Events ev;
    PDSIM_RETURN_IF_ERROR(ev.grow(2 * rounds * work.size()));
    for (size_t r = 0; r < rounds; ++r) {
        for (size_t i = 0; i < work.size(); ++i) {
            const size_t e = 2 * (r * work.size() + i);
            if (work[i].prep) PDSIM_RETURN_IF_ERROR(work[i].prep());
            CUDA_CHECK(cudaEventRecord(ev[e], s));
            PDSIM_RETURN_IF_ERROR(work[i].run());
            CUDA_CHECK(cudaEventRecord(ev[e + 1], s));
        }
    }
    PDSIM_RETURN_IF_ERROR(stream.synchronize(kSyncTimeout));
    Samples out(work.size());
    for (size_t r = static_cast<size_t>(warmup); r < rounds; ++r) {
        for (size_t i = 0; i < work.size(); ++i) {
            const size_t e = 2 * (r * work.size() + i);
            float ms = 0.f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, ev[e], ev[e + 1]));
            out[i].push_back(static_cast<double>(ms) * 1e-3);
        }
    }
    return out;
}

// Synchronizes `stream` when it goes out of scope: declared after the buffers and plans a
// function enqueues work on, it is destroyed first, so an early error return never frees memory
// that queued work still uses.
class DrainOnExit {
public:
    explicit DrainOnExit(runtime::Stream& stream) : stream_(stream) {}
    DrainOnExit(const DrainOnExit&) = delete;
    DrainOnExit& operator=(const DrainOnExit&) = delete;
    ~DrainOnExit() { stream_.synchronize(kSyncTimeout).ignore_error(); }

private:
    runtime::Stream& stream_;
};

double best_of(const std::vector<double>& v) {
    return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

// ---- paged attention cases ----------------------------------------------------------------------

// One batch on its own single-layer bf16 pool in device memory: generated K/V in every page,
// generated q (kept on the host for the oracle), out poisoned. Pages in the allocator's order.
struct PagedCase {
    attn::ForwardMode mode = attn::ForwardMode::kDecode;
    int bs = 0;
    int q_len = 0;  // query rows per request (decode: 1)
    int num_tokens = 0;
    int stride = 0;
    std::vector<int32_t> seq_lens, q_lens, page_table;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    uint64_t k_stream = 0, v_stream = 0;
    std::vector<bf16_t> host_q;
    DeviceBuffer q, out;
};

StatusOr<PagedCase> make_paged_case(const CudaBenchOptions& o, attn::ForwardMode mode, int bs,
                                    int seq_len, int q_len, uint64_t k_stream, uint64_t v_stream,
                                    uint64_t q_stream, ThreadPool& threads) {
    const runtime::Device gpu{runtime::DeviceKind::kCuda, o.device};
    PagedCase c;
    c.mode = mode;
    c.bs = bs;
    c.q_len = q_len;
    c.num_tokens = bs * q_len;
    c.stride = (seq_len + o.page_size - 1) / o.page_size;
    c.seq_lens.assign(static_cast<size_t>(bs), seq_len);
    c.q_lens.assign(static_cast<size_t>(bs), q_len);
    c.k_stream = k_stream;
    c.v_stream = v_stream;
    kv::MHAPoolConfig pc;
    pc.num_layers = 1;
    pc.num_pages = bs * c.stride + 1;
    pc.page_size = o.page_size;
    pc.num_kv_heads = o.kv_heads;
    pc.head_dim = o.head_dim;
    pc.dtype = DType::kBF16;
    pc.device = gpu;
    PDSIM_ASSIGN_OR_RETURN(c.pool, kv::MHATokenToKVPool::create(pc));
    PDSIM_ASSIGN_OR_RETURN(c.page_table, c.pool->allocator().alloc(bs * c.stride));
    const size_t kv_elems = static_cast<size_t>(pc.num_pages) * pc.page_size * pc.num_kv_heads *
                            static_cast<size_t>(pc.head_dim);
    PDSIM_RETURN_IF_ERROR(
        fill_device(c.pool->data(0, 0), kv_elems, o.seed, k_stream, 1.f, threads));
    PDSIM_RETURN_IF_ERROR(
        fill_device(c.pool->data(0, 1), kv_elems, o.seed, v_stream, 1.f, threads));
    const size_t rows = static_cast<size_t>(c.num_tokens) * o.q_heads * o.head_dim;
    c.host_q.resize(rows);
    threads.parallel_for(
        rows,
        [&](size_t lo, size_t hi, int) {
            for (size_t i = lo; i < hi; ++i) c.host_q[i] = value_bits(o.seed, q_stream, i, kQScale);
        },
        size_t{1} << 16);
    PDSIM_ASSIGN_OR_RETURN(c.q, DeviceBuffer::allocate(gpu, rows * sizeof(bf16_t)));
    PDSIM_RETURN_IF_ERROR(c.q.copy_from_host(c.host_q.data(), rows * sizeof(bf16_t)));
    PDSIM_ASSIGN_OR_RETURN(c.out, DeviceBuffer::allocate(gpu, rows * sizeof(bf16_t)));
    PDSIM_RETURN_IF_ERROR(c.out.fill(0xFF));  // poison: bf16 0xFFFF is a NaN
    return c;
}

Status set_metadata(attn::AttentionBackend& backend, const PagedCase& c) {
    attn::ForwardBatch fb;
    fb.mode = c.mode;
    fb.bs = c.bs;
    fb.seq_lens = c.seq_lens;
    fb.extend_lens = c.q_lens;
    fb.page_table = c.page_table;
    fb.page_table_stride = c.stride;
    return backend.init_forward_metadata(fb);
}

// One forward of the case's layer 0; the KV is already in the pool (save_kv_cache = false: no
// KV write, and no StepCounter is registered, so nothing but the attention kernels runs).
Status run_attention(attn::AttentionBackend& backend, PagedCase& c, const CudaBenchOptions& o) {
    const runtime::Device gpu{runtime::DeviceKind::kCuda, o.device};
    const attn::LayerSpec layer{0, o.q_heads, o.kv_heads, o.head_dim, 0, 0.f};
    const int64_t n = c.num_tokens;
    return backend.forward(
        runtime::make_view(static_cast<const void*>(c.q.data()), DType::kBF16, gpu,
                           {n, o.q_heads, o.head_dim}),
        {}, {}, layer, {}, *c.pool, c.mode, c.bs,
        runtime::make_view(c.out.data(), DType::kBF16, gpu, {n, o.q_heads, o.head_dim}),
        /*save_kv_cache=*/false);
}

// The fp64 attention of query row `row` (request `request`, at position `pos`: it attends keys
// 0..pos) for every q head, from the generated values: out[h][e].
std::vector<double> oracle_row(const PagedCase& c, const CudaBenchOptions& o, int request, int row,
                               int pos) {
    const int group = o.q_heads / o.kv_heads;
    const int d = o.head_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> out(static_cast<size_t>(o.q_heads) * d, 0.0);
    const int keys = pos + 1;
    std::vector<double> k(static_cast<size_t>(keys) * d), v(k.size()), s(static_cast<size_t>(keys));
    for (int g = 0; g < o.kv_heads; ++g) {
        for (int t = 0; t < keys; ++t) {
            const int64_t page = c.page_table[static_cast<size_t>(request) * c.stride +
                                              static_cast<size_t>(t / o.page_size)];
            const int64_t slot = page * o.page_size + t % o.page_size;
            const uint64_t base = static_cast<uint64_t>((slot * o.kv_heads + g) * d);
            for (int e = 0; e < d; ++e) {
                k[static_cast<size_t>(t) * d + e] = value(o.seed, c.k_stream, base + e, 1.f);
                v[static_cast<size_t>(t) * d + e] = value(o.seed, c.v_stream, base + e, 1.f);
            }
        }
        for (int h = g * group; h < (g + 1) * group; ++h) {
            const size_t q0 = (static_cast<size_t>(row) * o.q_heads + h) * d;
            double m = -1e300;
            for (int t = 0; t < keys; ++t) {
                double dot = 0;
                for (int e = 0; e < d; ++e) {
                    dot += bf16_to_float(c.host_q[q0 + e]) * k[static_cast<size_t>(t) * d + e];
                }
                s[static_cast<size_t>(t)] = dot * scale;
                m = std::max(m, s[static_cast<size_t>(t)]);
            }
            double sum = 0;
            for (int t = 0; t < keys; ++t) {
                s[static_cast<size_t>(t)] = std::exp(s[static_cast<size_t>(t)] - m);
                sum += s[static_cast<size_t>(t)];
            }
            double* o_h = out.data() + static_cast<size_t>(h) * d;
            for (int t = 0; t < keys; ++t) {
                const double p = s[static_cast<size_t>(t)] / sum;
                for (int e = 0; e < d; ++e) o_h[e] += p * v[static_cast<size_t>(t) * d + e];
            }
        }
    }
    return out;
}

// Checks the case's output (after its last run): every element finite, and the rows
// (request, position) equal to the fp64 oracle within the stated tolerance. Returns the largest
// absolute difference seen; kDataLoss naming the first bad element otherwise.
StatusOr<double> check_output(const PagedCase& c, const CudaBenchOptions& o, const char* what,
                              const std::vector<std::pair<int, int>>& rows) {
    const size_t width = static_cast<size_t>(o.q_heads) * o.head_dim;
    std::vector<bf16_t> got(static_cast<size_t>(c.num_tokens) * width);
    PDSIM_RETURN_IF_ERROR(c.out.copy_to_host(got.data(), got.size() * sizeof(bf16_t)));
    for (size_t i = 0; i < got.size(); ++i) {
        if (!finite_bits(got[i])) {
            return Status(StatusCode::kDataLoss,
                          fmt::format("bench attention --backend cuda: {} output element {} (row "
                                      "{}) is not finite (0x{:04x}; outputs are poisoned with NaN "
                                      "before the first run)",
                                      what, i, i / width, got[i]));
        }
    }
    double worst = 0;
    for (auto [request, pos] : rows) {
        const int row = request * c.q_len + (c.q_len == 1 ? 0 : pos);
        const std::vector<double> ref = oracle_row(c, o, request, row, pos);
        for (size_t j = 0; j < width; ++j) {
            const double g = bf16_to_float(got[static_cast<size_t>(row) * width + j]);
            const double err = std::fabs(g - ref[j]);
            worst = std::max(worst, err);
            if (err > kOracleAbsTol + kOracleRelTol * std::fabs(ref[j])) {
                return Status(
                    StatusCode::kDataLoss,
                    fmt::format("bench attention --backend cuda: {} output of request {} position "
                                "{} head {} dim {} is {:.5f}, the fp64 host oracle says {:.5f} "
                                "(tolerance {} + {} x |ref|)",
                                what, request, pos, j / static_cast<size_t>(o.head_dim),
                                j % static_cast<size_t>(o.head_dim), g, ref[j], kOracleAbsTol,
                                kOracleRelTol));
            }
        }
    }
    return worst;
}

StatusOr<std::unique_ptr<attn::AttentionBackend>> make_backend(runtime::Stream& stream, int q_heads,
                                                               int kv_heads, int head_dim) {
    attn::AttentionConfig ac;
    ac.num_q_heads = q_heads;
    ac.num_kv_heads = kv_heads;
    ac.head_dim = head_dim;
    ac.kv_dtype = DType::kBF16;
    ac.stream = &stream;
    return attn::create_attention_backend("cuda", ac);
}

// ---- the three figures --------------------------------------------------------------------------

StatusOr<CudaDecodeResult> bench_decode(const CudaBenchOptions& o, runtime::Stream& stream,
                                        ThreadPool& threads) {
    const runtime::Device gpu{runtime::DeviceKind::kCuda, o.device};
    std::fprintf(stderr, "bench attention: decode %d x %d KV tokens vs a device-to-device copy\n",
                 o.decode_batch, o.decode_len);
    PDSIM_ASSIGN_OR_RETURN(
        PagedCase c, make_paged_case(o, attn::ForwardMode::kDecode, o.decode_batch, o.decode_len, 1,
                                     kDecodeK, kDecodeV, kDecodeQ, threads));
    CudaDecodeResult r;
    r.bytes = decode_traffic_bytes(o.decode_batch, o.decode_len, o.q_heads, o.kv_heads, o.head_dim,
                                   o.head_dim);
    r.kv_bytes = static_cast<double>(o.decode_batch) * o.decode_len * o.kv_heads *
                 (o.head_dim + o.head_dim) * sizeof(bf16_t);
    const auto copy_bytes =
        static_cast<size_t>(o.copy_bytes > 0 ? o.copy_bytes : decode_copy_bytes(r.bytes));
    r.copy_bytes = 2.0 * static_cast<double>(copy_bytes);  // read + write
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer src, DeviceBuffer::allocate(gpu, copy_bytes));
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer dst, DeviceBuffer::allocate(gpu, copy_bytes));
    PDSIM_RETURN_IF_ERROR(src.fill(0x3C));
    PDSIM_RETURN_IF_ERROR(dst.fill(0));
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    PDSIM_ASSIGN_OR_RETURN(auto backend, make_backend(stream, o.q_heads, o.kv_heads, o.head_dim));
    const DrainOnExit drain(stream);
    PDSIM_RETURN_IF_ERROR(set_metadata(*backend, c));
    auto decode = [&]() { return run_attention(*backend, c, o); };
    auto copy = [&]() -> Status {
        CUDA_CHECK(
            cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
        return {};
    };
    // An untimed decode before each timed one: the copy leaves the L2 full of dirty lines, which
    // the timed decode would otherwise write back; a decode leaves clean ones for the copy.
    PDSIM_ASSIGN_OR_RETURN(Samples t,
                           time_rounds(stream, {{decode, decode}, {copy, {}}}, o.warmup, o.reps));
    r.seconds_median = stats::median(t[0]);
    r.seconds_best = best_of(t[0]);
    r.copy_seconds_median = stats::median(t[1]);
    r.copy_seconds_best = best_of(t[1]);
    r.gbps = r.bytes / r.seconds_median / 1e9;
    r.baseline_gbps = r.copy_bytes / r.copy_seconds_median / 1e9;
    r.ratio = r.gbps / r.baseline_gbps;
    std::vector<std::pair<int, int>> rows{{0, o.decode_len - 1}};
    if (o.decode_batch > 1) rows.emplace_back(o.decode_batch - 1, o.decode_len - 1);
    PDSIM_ASSIGN_OR_RETURN(r.max_abs_error, check_output(c, o, "decode", rows));
    return r;
}

StatusOr<CudaExtendResult> bench_extend(const CudaBenchOptions& o, runtime::Stream& stream,
                                        ThreadPool& threads) {
    const runtime::Device gpu{runtime::DeviceKind::kCuda, o.device};
    CudaExtendResult r;
    r.flops = extend_causal_flops(o.extend_batch, o.extend_len, o.q_heads, o.head_dim, o.head_dim);
    PDSIM_ASSIGN_OR_RETURN(r.gemm, gemm_dims_for_flops(r.flops));
    std::fprintf(stderr,
                 "bench attention: extend %d x %d tokens (causal) vs a cuBLASLt bf16 GEMM "
                 "%lld x %lld x %lld\n",
                 o.extend_batch, o.extend_len, static_cast<long long>(r.gemm.m),
                 static_cast<long long>(r.gemm.n), static_cast<long long>(r.gemm.k));
    PDSIM_ASSIGN_OR_RETURN(
        PagedCase c, make_paged_case(o, attn::ForwardMode::kExtend, o.extend_batch, o.extend_len,
                                     o.extend_len, kExtendK, kExtendV, kExtendQ, threads));
    model::cuda::GemmShape shape;
    shape.k = r.gemm.k;
    shape.n = r.gemm.n;
    shape.out_dtype = DType::kBF16;
    model::cuda::GemmOptions go;
    go.device = o.device;
    go.workspace_bytes = size_t{32} << 20;  // what cuBLAS's heuristic may want at this size
    PDSIM_ASSIGN_OR_RETURN(auto gemm, model::cuda::HeuristicGemm::create(r.gemm.m, shape, go));
    r.gemm_algo = gemm->algo().to_string();
    const auto m = static_cast<size_t>(r.gemm.m), n = static_cast<size_t>(r.gemm.n),
               k = static_cast<size_t>(r.gemm.k);
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::allocate(gpu, m * k * sizeof(bf16_t)));
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::allocate(gpu, n * k * sizeof(bf16_t)));
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer y, DeviceBuffer::allocate(gpu, m * n * sizeof(bf16_t)));
    PDSIM_RETURN_IF_ERROR(fill_device(x.data(), m * k, o.seed, kGemmX, 1.f, threads));
    PDSIM_RETURN_IF_ERROR(fill_device(w.data(), n * k, o.seed, kGemmW, 1.f, threads));
    PDSIM_ASSIGN_OR_RETURN(auto backend, make_backend(stream, o.q_heads, o.kv_heads, o.head_dim));
    const DrainOnExit drain(stream);
    PDSIM_RETURN_IF_ERROR(set_metadata(*backend, c));
    auto extend = [&]() { return run_attention(*backend, c, o); };
    auto matmul = [&]() { return gemm->run(x.as<bf16_t>(), w.as<bf16_t>(), y.data(), stream); };
    PDSIM_ASSIGN_OR_RETURN(Samples t,
                           time_rounds(stream, {{extend, {}}, {matmul, {}}}, o.warmup, o.reps));
    r.seconds_median = stats::median(t[0]);
    r.seconds_best = best_of(t[0]);
    r.gemm_seconds_median = stats::median(t[1]);
    r.gemm_seconds_best = best_of(t[1]);
    r.gflops = r.flops / r.seconds_median / 1e9;
    r.baseline_gflops = gemm->flops() / r.gemm_seconds_median / 1e9;
    r.ratio = r.gflops / r.baseline_gflops;
    const int last = o.extend_len - 1;
    std::vector<std::pair<int, int>> rows{{0, 0}, {0, last / 2}, {0, last}};
    if (o.extend_batch > 1) rows.emplace_back(o.extend_batch - 1, last);
    PDSIM_ASSIGN_OR_RETURN(r.max_abs_error, check_output(c, o, "extend", rows));
    return r;
}

// `bs` requests of `len` tokens each on `pool`, of which the last `new_tokens` are this forward's:
// fresh pages, random tokens, their slots, and the page table.
StatusOr<model::StepBatch> make_step_batch(kv::MHATokenToKVPool& pool, attn::ForwardMode mode,
                                           int bs, int len, int new_tokens, int vocab,
                                           uint64_t seed) {
    model::StepBatch b;
    b.mode = mode;
    const int ps = pool.page_size();
    b.page_table_stride = (len + ps - 1) / ps;
    std::mt19937_64 rng(splitmix64(seed + kTokens));
    std::uniform_int_distribution<int32_t> token(0, vocab - 1);
    for (int r = 0; r < bs; ++r) {
        PDSIM_ASSIGN_OR_RETURN(const std::vector<int32_t> pages,
                               pool.allocator().alloc(b.page_table_stride));
        for (int t = len - new_tokens; t < len; ++t) {
            b.tokens.push_back(token(rng));
            b.out_cache_loc.push_back(pages[static_cast<size_t>(t / ps)] * ps + t % ps);
        }
        b.seq_lens.push_back(len);
        b.extend_lens.push_back(new_tokens);
        b.page_table.insert(b.page_table.end(), pages.begin(), pages.end());
    }
    return b;
}

// Times `batch` with layer timing: per round a lead forward then the timed one, back to back, so
// the timed forward is fully enqueued before the device reaches it.
StatusOr<CudaModelPhase> time_model(model::cuda::CudaSyntheticModel& m,
                                    const model::StepBatch& batch, attn::AttentionBackend& backend,
                                    kv::KVPool& pool, runtime::Stream& stream,
                                    const CudaBenchOptions& o) {
    std::vector<int32_t> next(batch.seq_lens.size(), -1);
    m.set_layer_timing(true);
    std::vector<double> per_layer, forward;
    std::vector<std::vector<double>> layers;
    for (int r = 0; r < o.warmup + o.reps; ++r) {
        PDSIM_RETURN_IF_ERROR(m.forward(batch, backend, pool, next.data()));
        PDSIM_RETURN_IF_ERROR(m.forward(batch, backend, pool, next.data()));
        PDSIM_ASSIGN_OR_RETURN(model::cuda::ForwardTiming t, m.last_forward_timing());
        if (r < o.warmup) continue;
        if (t.layer_begin_ms.size() != static_cast<size_t>(m.config().num_layers) ||
            t.layer_end_ms.size() != t.layer_begin_ms.size()) {
            return Status(StatusCode::kInternal,
                          fmt::format("bench attention --backend cuda: the model timed {} layers "
                                      "of {} (graph replay: {})",
                                      t.layer_begin_ms.size(), m.config().num_layers, t.graph));
        }
        std::vector<double> l;
        double sum = 0;
        for (size_t i = 0; i < t.layer_begin_ms.size(); ++i) {
            l.push_back(t.layer_end_ms[i] - t.layer_begin_ms[i]);
            sum += l.back();
        }
        per_layer.push_back(sum / static_cast<double>(l.size()));
        forward.push_back(t.total_ms);
        layers.push_back(std::move(l));
    }
    m.set_layer_timing(false);
    PDSIM_RETURN_IF_ERROR(stream.synchronize(kSyncTimeout));  // kDataLoss for non-finite logits
    const int vocab = m.config().vocab;
    for (int32_t tok : next) {
        if (tok < 0 || tok >= vocab) {
            return Status(StatusCode::kDataLoss,
                          fmt::format("bench attention --backend cuda: the model sampled token "
                                      "{} (vocab {})",
                                      tok, vocab));
        }
    }
    CudaModelPhase p;
    p.per_layer_ms = stats::median(per_layer);
    p.forward_ms = stats::median(forward);
    const auto at = std::find(per_layer.begin(), per_layer.end(), p.per_layer_ms);
    p.layer_ms = layers[static_cast<size_t>(at - per_layer.begin())];
    return p;
}

StatusOr<CudaModelResult> bench_model(const CudaBenchOptions& o, const CudaBenchDevice& dev,
                                      runtime::Stream& stream) {
    CudaModelResult r;
    PDSIM_ASSIGN_OR_RETURN(r.config, bench_model_config(o));
    const model::ModelConfig& cfg = r.config;
    std::fprintf(stderr,
                 "bench attention: model %s, %d layers: prefill %d tokens, decode %d x %d\n",
                 cfg.name.c_str(), cfg.num_layers, o.model_prefill, o.decode_batch, o.decode_len);
    const int ps = o.page_size;
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_pages =
        1 + (o.model_prefill + ps - 1) / ps + o.decode_batch * ((o.decode_len + ps - 1) / ps);
    pc.page_size = ps;
    pc.num_kv_heads = cfg.num_kv_heads;
    pc.head_dim = cfg.head_dim;
    pc.dtype = DType::kBF16;
    pc.device = {runtime::DeviceKind::kCuda, o.device};
    PDSIM_ASSIGN_OR_RETURN(auto pool, kv::MHATokenToKVPool::create(pc));
    // The decode requests' context: bf16 0x3C3C (0.0115) everywhere, finite (what attention
    // reads does not change its time); the forwards write their own tokens' KV over it.
    PDSIM_RETURN_IF_ERROR(pool->fill(0x3C));
    PDSIM_ASSIGN_OR_RETURN(auto backend,
                           make_backend(stream, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim));
    PDSIM_ASSIGN_OR_RETURN(
        auto m, model::cuda::CudaSyntheticModel::create(cfg, nullptr, bench_model_options(o)));
    const DrainOnExit drain(stream);
    r.weight_bytes = m->weight_bytes();
    PDSIM_RETURN_IF_ERROR(m->fill_workspace(0xFF));  // poison what a forward must overwrite
    PDSIM_ASSIGN_OR_RETURN(const model::StepBatch prefill,
                           make_step_batch(*pool, attn::ForwardMode::kExtend, 1, o.model_prefill,
                                           o.model_prefill, cfg.vocab, o.seed));
    PDSIM_ASSIGN_OR_RETURN(const model::StepBatch decode,
                           make_step_batch(*pool, attn::ForwardMode::kDecode, o.decode_batch,
                                           o.decode_len, 1, cfg.vocab, o.seed + 1));
    PDSIM_ASSIGN_OR_RETURN(r.prefill, time_model(*m, prefill, *backend, *pool, stream, o));
    PDSIM_ASSIGN_OR_RETURN(r.decode, time_model(*m, decode, *backend, *pool, stream, o));
    if (dev.spec.spec == nullptr) {
        r.roofline = "no roofline: " + dev.spec.reason;
        return r;
    }
    const std::string gpu(dev.spec.spec->name);
    const int64_t kv_tokens = int64_t{o.decode_batch} * o.decode_len;
    PDSIM_ASSIGN_OR_RETURN(LayerRoofline roof, roofline_per_layer(cfg, gpu, o.model_prefill,
                                                                  o.decode_batch, kv_tokens));
    PDSIM_ASSIGN_OR_RETURN(
        LayerRoofline peak,
        roofline_per_layer(cfg, gpu, o.model_prefill, o.decode_batch, kv_tokens, 1.0, 1.0));
    r.have_roofline = true;
    r.roofline = roof.describe;
    r.prefill.roofline_ms = roof.prefill_s * 1e3;
    r.prefill.roofline_peak_ms = peak.prefill_s * 1e3;
    r.decode.roofline_ms = roof.decode_s * 1e3;
    r.decode.roofline_peak_ms = peak.decode_s * 1e3;
    return r;
}

}  // namespace

Status run_bench_attention_cuda(const CudaBenchOptions& o) {
    CudaBenchResults r;
    PDSIM_ASSIGN_OR_RETURN(r.device, open_device(o.device));
    if (!o.json_path.empty() && !std::ofstream(o.json_path)) {  // fail before the long part
        return Status(StatusCode::kInvalidArgument,
                      "--json " + o.json_path + ": cannot open for writing");
    }
    std::fprintf(stderr, "bench attention: backend cuda on %s (cuda:%d), %d rounds (+%d warm-up)\n",
                 r.device.name.c_str(), r.device.index, o.reps, o.warmup);
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                           runtime::device_runtime(runtime::DeviceKind::kCuda));
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Stream> stream,
                           rt->create_stream(o.device, "bench-attention"));
    ThreadPool threads(0);
    PDSIM_ASSIGN_OR_RETURN(r.decode, bench_decode(o, *stream, threads));
    PDSIM_ASSIGN_OR_RETURN(r.extend, bench_extend(o, *stream, threads));
    PDSIM_ASSIGN_OR_RETURN(r.model, bench_model(o, r.device, *stream));
    print_cuda_bench(o, r);
    if (o.json_path.empty()) return {};
    return write_json_file("--json", o.json_path, cuda_bench_json(o, r));
}

}  // namespace pdsim::cli
