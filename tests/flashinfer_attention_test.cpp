// FlashInferAttention (backends/cuda/flashinfer_attention.h) and kv_append
// (backends/cuda/kv_append.h) on a GPU, against an oracle written here: naive softmax attention in
// double over the same bf16-rounded inputs. Outputs are poisoned (0xFF bytes: bf16 NaN) before
// every run; unused pages and the slots past seq_len in each request's last page hold a large
// finite poison, so a kernel that reads KV it does not own is off by far more than the tolerance.
// Without a GPU (or without a CUDA driver) the GPU tests skip with the CUDA runtime's reason; the
// argument checks that need no device still run.
#include "backends/cuda/flashinfer_attention.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/kv_append.h"
#include "common/bf16.h"

namespace pdsim::attn::cuda {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// CUDA plumbing

std::string gpu_unavailable_reason() {
    int n = 0;
    const cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess) {
        return std::string("CUDA runtime: ") + cudaGetErrorString(rc) + " (" +
               cudaGetErrorName(rc) + ")";
    }
    if (n == 0) return "CUDA runtime: no device";
    return "";
}

#define SKIP_WITHOUT_GPU()                                                   \
    do {                                                                     \
        const std::string pdsim_skip_reason_ = gpu_unavailable_reason();     \
        if (!pdsim_skip_reason_.empty()) GTEST_SKIP() << pdsim_skip_reason_; \
    } while (0)

#define ASSERT_CUDA(call)                                                                    \
    do {                                                                                     \
        const cudaError_t pdsim_rc_ = (call);                                                \
        ASSERT_EQ(pdsim_rc_, cudaSuccess) << #call << ": " << cudaGetErrorString(pdsim_rc_); \
    } while (0)

#define ASSERT_OK(expr)                                       \
    do {                                                      \
        const ::pdsim::Status pdsim_st_ = (expr);             \
        ASSERT_TRUE(pdsim_st_.ok()) << pdsim_st_.to_string(); \
    } while (0)

class GpuBuffer {
public:
    GpuBuffer() = default;
    explicit GpuBuffer(size_t bytes) : bytes_(std::max<size_t>(bytes, 16)) {
        if (cudaMalloc(&p_, bytes_) != cudaSuccess) p_ = nullptr;
    }
    ~GpuBuffer() {
        if (p_ != nullptr) cudaFree(p_);
    }
    GpuBuffer(GpuBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
    GpuBuffer& operator=(GpuBuffer&& o) noexcept {
        std::swap(p_, o.p_);
        std::swap(bytes_, o.bytes_);
        return *this;
    }
    GpuBuffer(const GpuBuffer&) = delete;
    GpuBuffer& operator=(const GpuBuffer&) = delete;

    [[nodiscard]] void* get() const { return p_; }
    [[nodiscard]] size_t bytes() const { return bytes_; }
    // cudaMemcpy / cudaMemset run on the legacy default stream, which the tests' non-blocking
    // streams do not wait for: upload() and poison() finish before they return.
    template <typename T>
    void upload(const std::vector<T>& host) {
        ASSERT_LE(host.size() * sizeof(T), bytes_);
        ASSERT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    template <typename T>
    std::vector<T> download(size_t count) const {
        std::vector<T> host(count);
        EXPECT_EQ(cudaMemcpy(host.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        return host;
    }
    void poison() {
        EXPECT_EQ(cudaMemset(p_, 0xFF, bytes_), cudaSuccess);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }

private:
    void* p_ = nullptr;
    size_t bytes_ = 0;
};

class GpuStream {
public:
    GpuStream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
    ~GpuStream() {
        cudaStreamSynchronize(s_);
        cudaStreamDestroy(s_);
    }
    GpuStream(const GpuStream&) = delete;
    GpuStream& operator=(const GpuStream&) = delete;
    [[nodiscard]] cudaStream_t get() const { return s_; }
    [[nodiscard]] void* handle() const { return static_cast<void*>(s_); }
    [[nodiscard]] cudaError_t sync() const { return cudaStreamSynchronize(s_); }

private:
    cudaStream_t s_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Data: a deterministic generator, the pool, batches

constexpr float kPoison = 512.f;     // finite poison for KV nobody owns (exact in bf16)
constexpr bf16_t kNaNBits = 0xFFFF;  // what GpuBuffer::poison() leaves in a bf16

class Rng {
public:
    explicit Rng(uint64_t seed) : s_(seed) {}
    uint64_t next() {  // splitmix64
        uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) {
        return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.f / 16777216.f);
    }
    bf16_t bf16(float lo, float hi) { return float_to_bf16(uniform(lo, hi)); }

private:
    uint64_t s_;
};

struct Layer {
    int num_qo_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;
    int page_size = 0;
    [[nodiscard]] int group() const { return num_qo_heads / num_kv_heads; }
    [[nodiscard]] AttentionShape shape() const {
        return {num_qo_heads, num_kv_heads, head_dim, page_size, runtime::DType::kBF16};
    }
};

// A paged bf16 K/V pool on the host and the device: every slot starts as kPoison; a batch's
// owned tokens are then written with random values (the host copy is the oracle's view).
struct Pool {
    Layer layer;
    int num_pages = 0;
    std::vector<bf16_t> k, v;
    GpuBuffer dk, dv;

    Pool(const Layer& l, int pages) : layer(l), num_pages(pages) {
        const size_t n = elems();
        k.assign(n, float_to_bf16(kPoison));
        v.assign(n, float_to_bf16(kPoison));
        dk = GpuBuffer(n * sizeof(bf16_t));
        dv = GpuBuffer(n * sizeof(bf16_t));
    }
    [[nodiscard]] size_t token_elems() const {
        return static_cast<size_t>(layer.num_kv_heads) * static_cast<size_t>(layer.head_dim);
    }
    [[nodiscard]] size_t elems() const {
        return static_cast<size_t>(num_pages) * static_cast<size_t>(layer.page_size) *
               token_elems();
    }
    // Element offset of (page, slot, kv head).
    [[nodiscard]] size_t at(int page, int slot, int head) const {
        return ((static_cast<size_t>(page) * layer.page_size + slot) * layer.num_kv_heads + head) *
               layer.head_dim;
    }
    void upload() {
        dk.upload(k);
        dv.upload(v);
    }
};

struct Request {
    int seq_len = 0;
    int q_len = 0;
    std::vector<int32_t> pages;
};

// A batch over `pool`: pages drawn from a shuffled free list (never page 0), the owned tokens
// filled with random K/V, queries random. `rows` are the batch's query rows in order.
struct Batch {
    std::vector<Request> reqs;
    std::vector<int32_t> seq_lens, q_lens, page_table;
    int stride = 0;
    std::vector<int32_t> qo_indptr;
    std::vector<bf16_t> q;  // [rows][qo][hd] with row stride q_row_stride
    int64_t q_row_stride = 0;
    [[nodiscard]] int rows() const { return qo_indptr.back(); }
    [[nodiscard]] PagedBatch view(bool decode) const {
        PagedBatch b;
        b.seq_lens = seq_lens;
        if (!decode) b.q_lens = q_lens;
        b.page_table = page_table;
        b.page_table_stride = stride;
        return b;
    }
};

class PageSource {
public:
    PageSource(int num_pages, uint64_t seed) {
        free_.resize(static_cast<size_t>(num_pages - 1));
        std::iota(free_.begin(), free_.end(), 1);
        std::mt19937_64 rng(seed);
        std::shuffle(free_.begin(), free_.end(), rng);
    }
    int32_t take() {
        EXPECT_LT(next_, free_.size()) << "test pool too small";
        return next_ < free_.size() ? free_[next_++] : 0;
    }

private:
    std::vector<int32_t> free_;
    size_t next_ = 0;
};

// Builds a batch with the given (seq_len, q_len) pairs, writes its KV into the host pool (the
// caller uploads), and random queries with `q_pad` extra elements per row.
Batch make_batch(Pool& pool, PageSource& pages, const std::vector<std::pair<int, int>>& lens,
                 Rng& rng, int q_pad = 0, bool fill_kv = true) {
    const Layer& l = pool.layer;
    Batch b;
    b.qo_indptr.push_back(0);
    for (auto [seq, q] : lens) {
        Request r;
        r.seq_len = seq;
        r.q_len = q;
        const int n_pages = (seq + l.page_size - 1) / l.page_size;
        for (int p = 0; p < n_pages; ++p) r.pages.push_back(pages.take());
        b.stride = std::max(b.stride, n_pages);
        b.seq_lens.push_back(seq);
        b.q_lens.push_back(q);
        b.qo_indptr.push_back(b.qo_indptr.back() + q);
        b.reqs.push_back(std::move(r));
    }
    b.stride = std::max(b.stride, 1) + 1;  // one spare entry per row: never read
    b.page_table.assign(b.reqs.size() * static_cast<size_t>(b.stride), 0);
    for (size_t i = 0; i < b.reqs.size(); ++i) {
        const Request& r = b.reqs[i];
        for (size_t p = 0; p < r.pages.size(); ++p) {
            b.page_table[i * static_cast<size_t>(b.stride) + p] = r.pages[p];
        }
        b.page_table[i * static_cast<size_t>(b.stride) + r.pages.size()] = 1 << 30;  // garbage
        if (!fill_kv) continue;
        for (int t = 0; t < r.seq_len; ++t) {
            const int page = r.pages[static_cast<size_t>(t / l.page_size)];
            const size_t base = pool.at(page, t % l.page_size, 0);
            for (size_t e = 0; e < pool.token_elems(); ++e) {
                pool.k[base + e] = rng.bf16(-1.f, 1.f);
                pool.v[base + e] = rng.bf16(-1.f, 1.f);
            }
        }
    }
    b.q_row_stride = static_cast<int64_t>(l.num_qo_heads) * l.head_dim + q_pad;
    b.q.assign(static_cast<size_t>(b.rows()) * static_cast<size_t>(b.q_row_stride),
               float_to_bf16(kPoison));
    for (int row = 0; row < b.rows(); ++row) {
        for (int e = 0; e < l.num_qo_heads * l.head_dim; ++e) {
            b.q[static_cast<size_t>(row) * static_cast<size_t>(b.q_row_stride) +
                static_cast<size_t>(e)] = rng.bf16(-2.f, 2.f);
        }
    }
    return b;
}

// ---------------------------------------------------------------------------------------------
// The oracle: causal softmax attention in double over the bf16 values.

void parallel_for(int n, const std::function<void(int)>& fn) {
    const int workers =
        std::max(1, std::min<int>(n, static_cast<int>(std::thread::hardware_concurrency())));
    std::atomic<int> next{0};
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
        threads.emplace_back([&] {
            for (int i = next++; i < n; i = next++) fn(i);
        });
    }
    for (auto& t : threads) t.join();
}

// [rows][qo][hd] in double.
std::vector<double> reference(const Pool& pool, const Batch& b) {
    const Layer& l = pool.layer;
    const int hd = l.head_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    std::vector<double> out(static_cast<size_t>(b.rows()) * l.num_qo_heads * hd, 0.0);
    const int tasks = static_cast<int>(b.reqs.size()) * l.num_kv_heads;
    parallel_for(tasks, [&](int task) {
        const size_t ri = static_cast<size_t>(task / l.num_kv_heads);
        const int kvh = task % l.num_kv_heads;
        const Request& r = b.reqs[ri];
        // The request's K and V of this KV head, gathered through its pages (exact in float).
        std::vector<float> k(static_cast<size_t>(r.seq_len) * hd), v(k.size());
        for (int t = 0; t < r.seq_len; ++t) {
            const size_t base =
                pool.at(r.pages[static_cast<size_t>(t / l.page_size)], t % l.page_size, kvh);
            for (int d = 0; d < hd; ++d) {
                k[static_cast<size_t>(t) * hd + d] = bf16_to_float(pool.k[base + d]);
                v[static_cast<size_t>(t) * hd + d] = bf16_to_float(pool.v[base + d]);
            }
        }
        std::vector<double> s(static_cast<size_t>(r.seq_len)), qd(static_cast<size_t>(hd));
        std::vector<double> acc(static_cast<size_t>(hd));
        for (int h = kvh * l.group(); h < (kvh + 1) * l.group(); ++h) {
            for (int j = 0; j < r.q_len; ++j) {
                const int row = b.qo_indptr[ri] + j;
                const bf16_t* qrow =
                    &b.q[static_cast<size_t>(row) * b.q_row_stride + static_cast<size_t>(h) * hd];
                for (int d = 0; d < hd; ++d) qd[d] = bf16_to_float(qrow[d]);
                const int last = r.seq_len - r.q_len + j;  // attends to tokens [0, last]
                double m = -INFINITY;
                for (int t = 0; t <= last; ++t) {
                    const float* kt = &k[static_cast<size_t>(t) * hd];
                    double dot = 0;
                    for (int d = 0; d < hd; ++d) dot += qd[d] * kt[d];
                    s[static_cast<size_t>(t)] = dot * scale;
                    m = std::max(m, s[static_cast<size_t>(t)]);
                }
                std::fill(acc.begin(), acc.end(), 0.0);
                double den = 0;
                for (int t = 0; t <= last; ++t) {
                    const double p = std::exp(s[static_cast<size_t>(t)] - m);
                    den += p;
                    const float* vt = &v[static_cast<size_t>(t) * hd];
                    for (int d = 0; d < hd; ++d) acc[d] += p * vt[d];
                }
                double* o = &out[(static_cast<size_t>(row) * l.num_qo_heads + h) * hd];
                for (int d = 0; d < hd; ++d) o[d] = acc[d] / den;
            }
        }
    });
    return out;
}

struct Comparison {
    double max_err = 0;
    int64_t bad = 0;
    int64_t non_finite = 0;
    std::string first_bad;
};

// bf16 output vs the oracle; tolerance atol + rtol * |ref| (bf16 output rounding is 2^-9).
Comparison compare(const std::vector<bf16_t>& got, const std::vector<double>& want, int heads,
                   int hd, double atol = 1e-2, double rtol = 1e-2) {
    Comparison c;
    for (size_t i = 0; i < want.size(); ++i) {
        const double g = bf16_to_float(got[i]);
        if (!std::isfinite(g)) {
            if (c.non_finite++ == 0 && c.first_bad.empty()) {
                c.first_bad = "row " + std::to_string(i / (heads * hd)) + " head " +
                              std::to_string((i / hd) % heads) + ": not finite";
            }
            continue;
        }
        const double err = std::abs(g - want[i]);
        c.max_err = std::max(c.max_err, err);
        if (err > atol + rtol * std::abs(want[i])) {
            if (c.bad++ == 0 && c.first_bad.empty()) {
                c.first_bad = "row " + std::to_string(i / (heads * hd)) + " head " +
                              std::to_string((i / hd) % heads) + " dim " + std::to_string(i % hd) +
                              ": got " + std::to_string(g) + ", want " + std::to_string(want[i]);
            }
        }
    }
    return c;
}

// Runs one eager plan + run of `attn` over `b` and returns the output rows.
struct RunResult {
    Status status;
    std::vector<bf16_t> out;
};

RunResult plan_and_run(FlashInferAttention& attn, Pool& pool, const Batch& b, GpuStream& stream,
                       size_t out_rows = 0) {
    const Layer& l = pool.layer;
    const bool decode = attn.config().kind == AttentionKind::kDecode;
    RunResult r;
    const size_t row_elems = static_cast<size_t>(l.num_qo_heads) * l.head_dim;
    const size_t rows = std::max<size_t>(out_rows, static_cast<size_t>(b.rows()));
    GpuBuffer dq(b.q.size() * sizeof(bf16_t)), dout(rows * row_elems * sizeof(bf16_t));
    dq.upload(b.q);
    dout.poison();
    r.status = attn.plan(b.view(decode), stream.handle());
    if (!r.status.ok()) return r;
    AttentionRunArgs args;
    args.q = dq.get();
    args.q_stride_token = b.q_row_stride;
    args.k_cache = pool.dk.get();
    args.v_cache = pool.dv.get();
    args.o = dout.get();
    r.status = attn.run(args, stream.handle());
    if (!r.status.ok()) return r;
    const cudaError_t rc = stream.sync();
    if (rc != cudaSuccess) {
        r.status = Status(StatusCode::kUnavailable, cudaGetErrorString(rc));
        return r;
    }
    r.out = dout.download<bf16_t>(static_cast<size_t>(b.rows()) * row_elems);
    return r;
}

std::unique_ptr<FlashInferAttention> make_attention(AttentionKind kind, const Layer& l,
                                                    PlanCapacity cap, int num_pages,
                                                    bool graph = false) {
    FlashInferConfig cfg;
    cfg.kind = kind;
    cfg.shape = l.shape();
    cfg.capacity = cap;
    cfg.num_pages = num_pages;
    cfg.cuda_graph = graph;
    auto a = FlashInferAttention::create(cfg);
    EXPECT_TRUE(a.ok()) << a.status().to_string();
    return a.ok() ? std::move(*a) : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Checks that need no device

TEST(FlashInferAttentionConfig, BadShapesAndCapacitiesFailBeforeTouchingTheGpu) {
    FlashInferConfig cfg;
    cfg.kind = AttentionKind::kDecode;
    cfg.shape = {10, 2, 128, 16, runtime::DType::kBF16};  // decode group 5
    cfg.capacity = {8, 0, 64};
    auto a = FlashInferAttention::create(cfg);
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kUnimplemented);
    EXPECT_THAT(a.status().message(), HasSubstr("group size 5"));

    cfg.shape = {8, 2, 128, 16, runtime::DType::kF32};
    a = FlashInferAttention::create(cfg);
    ASSERT_FALSE(a.ok());
    EXPECT_THAT(a.status().message(), HasSubstr("fp32"));

    cfg.shape = {8, 2, 128, 16, runtime::DType::kBF16};
    cfg.staging_slots = 0;
    a = FlashInferAttention::create(cfg);
    ASSERT_FALSE(a.ok());
    EXPECT_THAT(a.status().message(), HasSubstr("config.staging_slots"));

    cfg.staging_slots = 2;
    cfg.capacity = {0, 0, 64};
    a = FlashInferAttention::create(cfg);
    ASSERT_FALSE(a.ok());
    EXPECT_THAT(a.status().message(), HasSubstr("capacity.max_bs"));
}

TEST(KvAppendParamsCheck, BadParametersAreRejectedBeforeAnyLaunch) {
    KvAppendParams p;
    int dummy = 0;
    p.k = p.v = p.k_cache = p.v_cache = &dummy;
    p.out_cache_loc = reinterpret_cast<const int32_t*>(&dummy);
    p.num_slots = 16;
    p.num_kv_heads = 2;
    p.head_dim = 64;
    p.n = 1;
    p.src_dtype = runtime::DType::kF16;
    Status st = kv_append(p, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("params.src_dtype: fp16"));
    p.src_dtype = runtime::DType::kF32;
    p.cache_dtype = runtime::DType::kFP8E4M3;
    st = kv_append(p, nullptr);
    EXPECT_THAT(st.message(), HasSubstr("params.cache_dtype: fp8_e4m3"));
    p.cache_dtype = runtime::DType::kBF16;
    p.k_row_stride = 100;  // < 2 * 64
    st = kv_append(p, nullptr);
    EXPECT_THAT(st.message(), HasSubstr("params.k_row_stride: 100 is shorter than a row (128"));
    p.k_row_stride = 0;
    p.v = nullptr;
    st = kv_append(p, nullptr);
    EXPECT_THAT(st.message(), HasSubstr("params.v: null"));
    p.v = &dummy;
    p.num_kv_heads = 0;
    st = kv_append(p, nullptr);
    EXPECT_THAT(st.message(), HasSubstr("params.num_kv_heads"));
    p.num_kv_heads = 2;
    p.n = 0;
    p.k = nullptr;  // nothing to do: not even pointers are needed
    EXPECT_TRUE(kv_append(p, nullptr).ok());
}

// ---------------------------------------------------------------------------------------------
// Decode

TEST(FlashInferDecode, MatchesTheOracleAcrossBatchSizesLengthsGroupsAndHeadDims) {
    SKIP_WITHOUT_GPU();
    const std::vector<int> kv_lens = {1, 15, 16, 17, 1000, 4097};
    const std::vector<int> batch_sizes = {1, 7, 64};
    double worst = 0;
    int configs = 0;
    for (int hd : {64, 128}) {
        // One pool per head dim, big enough for the largest batch (64 x 4097 tokens), filled with
        // random KV once (the KV layout does not depend on the number of query heads). Page-table
        // tails and the slots past seq_len are covered by the other tests' poison.
        const int pages = 64 * ((4097 + 15) / 16) + 2;
        Pool pool(Layer{.num_qo_heads = 2, .num_kv_heads = 2, .head_dim = hd, .page_size = 16},
                  pages);
        Rng rng(1000 + static_cast<uint64_t>(hd));
        for (size_t i = 0; i < pool.k.size(); ++i) {
            pool.k[i] = rng.bf16(-1.f, 1.f);
            pool.v[i] = rng.bf16(-1.f, 1.f);
        }
        pool.upload();
        for (int group : {1, 4, 8}) {
            pool.layer.num_qo_heads = 2 * group;
            const Layer& l = pool.layer;
            auto attn = make_attention(AttentionKind::kDecode, l, {64, 0, pages}, pages);
            ASSERT_NE(attn, nullptr);
            GpuStream stream;
            for (int bs : batch_sizes) {
                for (int kv : kv_lens) {
                    PageSource source(pages, static_cast<uint64_t>(bs * 7919 + kv));
                    std::vector<std::pair<int, int>> lens;
                    for (int i = 0; i < bs; ++i) lens.emplace_back(std::max(1, kv - i % 3), 1);
                    Batch b = make_batch(pool, source, lens, rng, 0, /*fill_kv=*/false);
                    RunResult r = plan_and_run(*attn, pool, b, stream);
                    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
                    const Comparison c = compare(r.out, reference(pool, b), l.num_qo_heads, hd);
                    worst = std::max(worst, c.max_err);
                    ++configs;
                    EXPECT_EQ(c.bad + c.non_finite, 0)
                        << "hd " << hd << " group " << group << " bs " << bs << " kv " << kv << ": "
                        << c.first_bad << " (max err " << c.max_err << ")";
                }
            }
        }
    }
    std::printf("decode: max |error| vs the fp64 oracle over %d configurations: %.3g\n", configs,
                worst);
}

TEST(FlashInferDecode, PageSizesOneAndSixtyFourAndStridedQueries) {
    SKIP_WITHOUT_GPU();
    for (int page_size : {1, 64}) {
        const Layer l{8, 2, 128, page_size};
        const int pages = 7 * ((1000 + page_size - 1) / page_size) + 8;
        Pool pool(l, pages);
        auto attn = make_attention(AttentionKind::kDecode, l, {7, 0, pages}, pages);
        ASSERT_NE(attn, nullptr);
        GpuStream stream;
        Rng rng(77 + static_cast<uint64_t>(page_size));
        for (int kv : {1, 63, 64, 65, 1000}) {
            PageSource source(pages, static_cast<uint64_t>(kv));
            std::vector<std::pair<int, int>> lens;
            for (int i = 0; i < 7; ++i) lens.emplace_back(std::max(1, kv - 5 * i), 1);
            Batch b = make_batch(pool, source, lens, rng, /*q_pad=*/24);
            pool.upload();
            RunResult r = plan_and_run(*attn, pool, b, stream);
            ASSERT_TRUE(r.status.ok()) << r.status.to_string();
            const Comparison c = compare(r.out, reference(pool, b), l.num_qo_heads, 128);
            EXPECT_EQ(c.bad + c.non_finite, 0)
                << "page size " << page_size << " kv " << kv << ": " << c.first_bad;
            std::printf("decode page size %d kv %d: max |error| %.3g\n", page_size, kv, c.max_err);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Extend

const std::vector<std::pair<int, int>> kExtendLens = {
    // (seq_len, q_len): pure prefills, extends over cached prefixes, single-token extends.
    {1, 1}, {17, 17}, {135, 130}, {400, 300}, {1064, 64}, {38, 1}, {257, 257}};

TEST(FlashInferExtend, MatchesTheOracleWithPrefixesGroupsPageSizesAndHeadDims) {
    SKIP_WITHOUT_GPU();
    double worst = 0;
    for (int hd : {64, 128}) {
        for (int group : {1, 4, 8}) {
            for (int page_size : {1, 16, 64}) {
                const Layer l{2 * group, 2, hd, page_size};
                int pages = 2;
                int tokens = 0;
                for (auto [seq, q] : kExtendLens) {
                    pages += (seq + page_size - 1) / page_size;
                    tokens += q;
                }
                Pool pool(l, pages);
                auto attn =
                    make_attention(AttentionKind::kExtend, l,
                                   {static_cast<int>(kExtendLens.size()), tokens, pages}, pages);
                ASSERT_NE(attn, nullptr);
                GpuStream stream;
                Rng rng(static_cast<uint64_t>(hd * 100 + group * 10 + page_size));
                PageSource source(pages, static_cast<uint64_t>(page_size));
                Batch b = make_batch(pool, source, kExtendLens, rng,
                                     /*q_pad=*/page_size == 64 ? 8 : 0);
                pool.upload();
                RunResult r = plan_and_run(*attn, pool, b, stream);
                ASSERT_TRUE(r.status.ok()) << r.status.to_string();
                const Comparison c = compare(r.out, reference(pool, b), l.num_qo_heads, hd);
                worst = std::max(worst, c.max_err);
                EXPECT_EQ(c.bad + c.non_finite, 0)
                    << "hd " << hd << " group " << group << " page size " << page_size << ": "
                    << c.first_bad << " (max err " << c.max_err << ")";
            }
        }
    }
    std::printf("extend: max |error| vs the fp64 oracle over 18 configurations: %.3g\n", worst);
}

TEST(FlashInferExtend, TwoChunksEqualOneWholeExtend) {
    SKIP_WITHOUT_GPU();
    const Layer l{16, 4, 128, 16};
    const int seq = 700, first = 300;
    const int pages = seq / 16 + 4;
    Pool pool(l, pages);
    Rng rng(5);
    PageSource source(pages, 11);
    Batch whole = make_batch(pool, source, {{seq, seq}}, rng);
    pool.upload();
    // The two chunks read the same pages and the same query rows as the whole extend.
    auto chunk = [&](int seq_len, int q_len, int row0) {
        Batch c = whole;
        c.seq_lens = {seq_len};
        c.q_lens = {q_len};
        c.reqs[0].seq_len = seq_len;
        c.reqs[0].q_len = q_len;
        c.qo_indptr = {0, q_len};
        c.q.assign(whole.q.begin() + static_cast<int64_t>(row0) * whole.q_row_stride,
                   whole.q.begin() + static_cast<int64_t>(row0 + q_len) * whole.q_row_stride);
        return c;
    };
    const Batch c1 = chunk(first, first, 0), c2 = chunk(seq, seq - first, first);
    auto attn = make_attention(AttentionKind::kExtend, l, {1, seq, pages}, pages);
    ASSERT_NE(attn, nullptr);
    GpuStream stream;
    RunResult rw = plan_and_run(*attn, pool, whole, stream);
    RunResult r1 = plan_and_run(*attn, pool, c1, stream);
    RunResult r2 = plan_and_run(*attn, pool, c2, stream);
    ASSERT_TRUE(rw.status.ok() && r1.status.ok() && r2.status.ok())
        << rw.status.to_string() << r1.status.to_string() << r2.status.to_string();
    std::vector<bf16_t> chunked = r1.out;
    chunked.insert(chunked.end(), r2.out.begin(), r2.out.end());
    ASSERT_EQ(chunked.size(), rw.out.size());
    std::vector<double> whole_as_double(rw.out.size());
    for (size_t i = 0; i < rw.out.size(); ++i) whole_as_double[i] = bf16_to_float(rw.out[i]);
    const Comparison c = compare(chunked, whole_as_double, l.num_qo_heads, 128, 4e-3, 4e-3);
    int64_t differing = 0;
    for (size_t i = 0; i < chunked.size(); ++i) differing += chunked[i] != rw.out[i] ? 1 : 0;
    EXPECT_EQ(c.bad + c.non_finite, 0) << c.first_bad;
    const Comparison vs_oracle = compare(rw.out, reference(pool, whole), l.num_qo_heads, 128);
    EXPECT_EQ(vs_oracle.bad + vs_oracle.non_finite, 0) << vs_oracle.first_bad;
    std::printf(
        "chunked (300 + 400) vs whole extend of 700: max |diff| %.3g, %lld of %zu values "
        "differ in their bits\n",
        c.max_err, static_cast<long long>(differing), chunked.size());
}

// ---------------------------------------------------------------------------------------------
// Batch invariance: one request alone and inside a batch of 64 gives the same bits.

TEST(FlashInferBatchInvariance, ARequestAloneAndInABatchOf64GiveIdenticalBits) {
    SKIP_WITHOUT_GPU();
    const Layer l{16, 4, 128, 16};
    for (AttentionKind kind : {AttentionKind::kDecode, AttentionKind::kExtend}) {
        const bool decode = kind == AttentionKind::kDecode;
        const std::pair<int, int> mine = decode ? std::pair{1000, 1} : std::pair{500, 300};
        Rng lens_rng(3);
        std::vector<std::pair<int, int>> lens;
        for (int i = 0; i < 64; ++i) {
            const int seq = 1 + static_cast<int>(lens_rng.next() % 1000);
            const int q = decode ? 1 : 1 + static_cast<int>(lens_rng.next() % std::min(seq, 64));
            lens.emplace_back(seq, q);
        }
        const int at = 37;
        lens[at] = mine;
        int pages = 2, tokens = 0;
        for (auto [seq, q] : lens) {
            pages += (seq + 15) / 16;
            tokens += q;
        }
        Pool pool(l, 2 * pages);
        Rng rng(9);
        PageSource source(2 * pages, 13);
        Batch big = make_batch(pool, source, lens, rng);
        // The same request alone: same pages, same KV, same queries.
        Batch alone;
        alone.reqs = {big.reqs[at]};
        alone.seq_lens = {mine.first};
        alone.q_lens = {mine.second};
        alone.stride = big.stride;
        alone.page_table.assign(big.page_table.begin() + at * big.stride,
                                big.page_table.begin() + (at + 1) * big.stride);
        alone.qo_indptr = {0, mine.second};
        alone.q_row_stride = big.q_row_stride;
        alone.q.assign(big.q.begin() + big.qo_indptr[at] * big.q_row_stride,
                       big.q.begin() + big.qo_indptr[at + 1] * big.q_row_stride);
        pool.upload();
        auto attn = make_attention(kind, l, {64, tokens, pages}, 2 * pages);
        ASSERT_NE(attn, nullptr);
        GpuStream stream;
        RunResult rb = plan_and_run(*attn, pool, big, stream);
        RunResult ra = plan_and_run(*attn, pool, alone, stream);
        ASSERT_TRUE(rb.status.ok() && ra.status.ok())
            << rb.status.to_string() << ra.status.to_string();
        const size_t row = static_cast<size_t>(l.num_qo_heads) * 128;
        const std::vector<bf16_t> in_batch(
            rb.out.begin() + static_cast<int64_t>(big.qo_indptr[at] * row),
            rb.out.begin() + static_cast<int64_t>(big.qo_indptr[at + 1] * row));
        ASSERT_EQ(in_batch.size(), ra.out.size());
        EXPECT_EQ(std::memcmp(in_batch.data(), ra.out.data(), ra.out.size() * sizeof(bf16_t)), 0)
            << attention_kind_name(kind) << ": the request's output depends on its batch";
        const Comparison c = compare(rb.out, reference(pool, big), l.num_qo_heads, 128);
        EXPECT_EQ(c.bad + c.non_finite, 0) << attention_kind_name(kind) << ": " << c.first_bad;
    }
}

// ---------------------------------------------------------------------------------------------
// Graph mode: capture run() once, refresh the plan in place, replay.

TEST(FlashInferGraph, ReplaysSeeTheMetadataRefreshedInPlace) {
    SKIP_WITHOUT_GPU();
    const Layer l{16, 4, 128, 16};
    for (AttentionKind kind : {AttentionKind::kDecode, AttentionKind::kExtend}) {
        const bool decode = kind == AttentionKind::kDecode;
        const int max_bs = 16, max_tokens = decode ? 16 : 1024, max_pages = 16 * 40;
        const int pool_pages = 4 * max_pages;
        Pool pool(l, pool_pages);
        auto graph = make_attention(kind, l, {max_bs, max_tokens, max_pages}, pool_pages, true);
        auto eager = make_attention(kind, l, {max_bs, max_tokens, max_pages}, pool_pages, false);
        ASSERT_NE(graph, nullptr);
        ASSERT_NE(eager, nullptr);
        const void* metadata = graph->device_metadata();
        GpuStream stream;
        const size_t row = static_cast<size_t>(l.num_qo_heads) * 128;
        // Fixed buffers the captured kernel reads: q rows and o rows for the capacity.
        GpuBuffer dq(static_cast<size_t>(max_tokens) * row * sizeof(bf16_t));
        GpuBuffer dout(static_cast<size_t>(max_tokens) * row * sizeof(bf16_t));
        AttentionRunArgs args;
        args.q = dq.get();
        args.k_cache = pool.dk.get();
        args.v_cache = pool.dv.get();
        args.o = dout.get();

        Rng rng(21);
        auto make = [&](int bs, uint64_t seed) {
            PageSource source(pool_pages, seed);
            std::vector<std::pair<int, int>> lens;
            int budget = max_tokens;
            for (int i = 0; i < bs; ++i) {
                const int seq = 1 + static_cast<int>(rng.next() % 600);
                int q = decode ? 1 : 1 + static_cast<int>(rng.next() % std::min(seq, 120));
                q = std::min(q, budget - (bs - 1 - i));
                budget -= q;
                lens.emplace_back(seq, q);
            }
            return make_batch(pool, source, lens, rng);
        };

        // Warm-up outside the capture (loads the kernels), then capture one run().
        Batch warm = make(3, 1);
        pool.upload();
        dq.upload(warm.q);
        ASSERT_OK(graph->plan(warm.view(decode), stream.handle()));
        ASSERT_OK(graph->run(args, stream.handle()));
        ASSERT_CUDA(stream.sync());
        cudaGraph_t g = nullptr;
        ASSERT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
        const Status during = graph->plan(warm.view(decode), stream.handle());
        ASSERT_OK(graph->run(args, stream.handle()));
        ASSERT_CUDA(cudaStreamEndCapture(stream.get(), &g));
        EXPECT_EQ(during.code(), StatusCode::kFailedPrecondition) << during.to_string();
        cudaGraphExec_t exec = nullptr;
        ASSERT_CUDA(cudaGraphInstantiate(&exec, g, 0));

        for (int bs : {max_bs, 5, 11, 1}) {
            Batch b = make(bs, static_cast<uint64_t>(100 + bs));
            pool.upload();
            ASSERT_EQ(b.q_row_stride, static_cast<int64_t>(row));
            dq.upload(b.q);
            dout.poison();
            ASSERT_OK(graph->plan(b.view(decode), stream.handle()));
            EXPECT_EQ(graph->device_metadata(), metadata);
            ASSERT_CUDA(cudaGraphLaunch(exec, stream.get()));
            ASSERT_CUDA(stream.sync());
            const auto all = dout.download<bf16_t>(static_cast<size_t>(max_tokens) * row);
            const std::vector<bf16_t> got(all.begin(),
                                          all.begin() + static_cast<int64_t>(b.rows() * row));
            // Rows past the batch stay untouched.
            for (size_t i = got.size(); i < all.size(); ++i) {
                ASSERT_EQ(all[i], kNaNBits) << "graph replay wrote past the batch at " << i;
            }
            const Comparison c = compare(got, reference(pool, b), l.num_qo_heads, 128);
            EXPECT_EQ(c.bad + c.non_finite, 0)
                << attention_kind_name(kind) << " bs " << bs << ": " << c.first_bad;
            RunResult e = plan_and_run(*eager, pool, b, stream);
            ASSERT_TRUE(e.status.ok()) << e.status.to_string();
            EXPECT_EQ(std::memcmp(e.out.data(), got.data(), got.size() * sizeof(bf16_t)), 0)
                << attention_kind_name(kind) << " bs " << bs << ": graph replay != eager run";
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(g);
    }
}

TEST(FlashInferRun, MisuseIsReportedNotLaunched) {
    SKIP_WITHOUT_GPU();
    const Layer l{8, 2, 64, 16};
    auto attn = make_attention(AttentionKind::kDecode, l, {4, 0, 16}, 32);
    ASSERT_NE(attn, nullptr);
    GpuStream stream;
    GpuBuffer buf(1 << 16);
    AttentionRunArgs args;
    args.q = args.k_cache = args.v_cache = buf.get();
    args.o = buf.get();
    Status st = attn->run(args, stream.handle());
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), HasSubstr("no plan yet"));

    const std::vector<int32_t> seq{20}, table{3, 4};
    PagedBatch b;
    b.seq_lens = seq;
    b.page_table = table;
    b.page_table_stride = 2;
    ASSERT_OK(attn->plan(b, stream.handle()));
    args.o = nullptr;
    st = attn->run(args, stream.handle());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("args.o: null"));
    args.o = static_cast<char*>(buf.get()) + 2;
    st = attn->run(args, stream.handle());
    EXPECT_THAT(st.message(), HasSubstr("args.o"));
    EXPECT_THAT(st.message(), HasSubstr("16-byte aligned"));
    args.o = buf.get();
    args.q_stride_token = 12;
    st = attn->run(args, stream.handle());
    EXPECT_THAT(st.message(), HasSubstr("args.q_stride_token: 12"));

    const std::vector<int32_t> bad_table{3, 40};  // page 40 >= num_pages 32
    b.page_table = bad_table;
    st = attn->plan(b, stream.handle());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("page 40 of request 0 is out of range [0, 32)"));
    ASSERT_CUDA(stream.sync());
}

// ---------------------------------------------------------------------------------------------
// MLA decode: kv_lora_rank 512 + rope 64 in one latent buffer per token (MLATokenToKVPool).

TEST(FlashInferMlaDecode, MatchesTheOracle) {
    SKIP_WITHOUT_GPU();
    constexpr int kCkv = kMlaKvLoraRank, kKpe = kMlaRopeDim, kTok = kCkv + kKpe;
    struct Case {
        int heads, page_size, bs;
        std::vector<int> kv_lens;
    };
    const std::vector<Case> cases = {
        {16, 64, 33, {1, 17, 1000}},  // one CTA of 16 heads per request
        {20, 1, 7, {1, 64, 300}},     // a partial second head tile; one token per page
        {128, 64, 3, {1, 1000}},      // DeepSeek-V3's 128 heads (TP 1)
    };
    double worst = 0;
    for (const Case& c : cases) {
        AttentionShape shape{c.heads, 1, kCkv, c.page_size, runtime::DType::kBF16, kKpe};
        for (int kv : c.kv_lens) {
            const int per_req = (kv + c.page_size - 1) / c.page_size;
            const int pages = c.bs * per_req + 2;
            FlashInferConfig cfg;
            cfg.kind = AttentionKind::kDecode;
            cfg.shape = shape;
            cfg.capacity = {c.bs, 0, c.bs * per_req};
            cfg.num_pages = pages;
            auto attn = FlashInferAttention::create(cfg);
            ASSERT_TRUE(attn.ok()) << attn.status().to_string();

            Rng rng(static_cast<uint64_t>(c.heads * 1000 + kv));
            std::vector<bf16_t> cache(static_cast<size_t>(pages) * c.page_size * kTok,
                                      float_to_bf16(kPoison));
            PageSource source(pages, static_cast<uint64_t>(kv));
            std::vector<int32_t> seq_lens, table(static_cast<size_t>(c.bs) * (per_req + 1), 0);
            std::vector<std::vector<int32_t>> req_pages(static_cast<size_t>(c.bs));
            for (int i = 0; i < c.bs; ++i) {
                const int seq = std::max(1, kv - i % 4);
                seq_lens.push_back(seq);
                for (int p = 0; p < (seq + c.page_size - 1) / c.page_size; ++p) {
                    const int32_t page = source.take();
                    req_pages[static_cast<size_t>(i)].push_back(page);
                    table[static_cast<size_t>(i) * (per_req + 1) + p] = page;
                }
                for (int t = 0; t < seq; ++t) {
                    const size_t base =
                        (static_cast<size_t>(req_pages[static_cast<size_t>(i)]
                                                      [static_cast<size_t>(t / c.page_size)]) *
                             c.page_size +
                         t % c.page_size) *
                        kTok;
                    for (int e = 0; e < kTok; ++e) cache[base + e] = rng.bf16(-1.f, 1.f);
                }
            }
            std::vector<bf16_t> q_nope(static_cast<size_t>(c.bs) * c.heads * kCkv);
            std::vector<bf16_t> q_pe(static_cast<size_t>(c.bs) * c.heads * kKpe);
            for (bf16_t& x : q_nope) x = rng.bf16(-2.f, 2.f);
            for (bf16_t& x : q_pe) x = rng.bf16(-2.f, 2.f);

            GpuBuffer dcache(cache.size() * 2), dq(q_nope.size() * 2), dqpe(q_pe.size() * 2);
            GpuBuffer dout(static_cast<size_t>(c.bs) * c.heads * kCkv * 2);
            dcache.upload(cache);
            dq.upload(q_nope);
            dqpe.upload(q_pe);
            dout.poison();
            GpuStream stream;
            PagedBatch b;
            b.seq_lens = seq_lens;
            b.page_table = table;
            b.page_table_stride = per_req + 1;
            ASSERT_OK((*attn)->plan(b, stream.handle()));
            AttentionRunArgs args;
            args.q = dq.get();
            args.q_pe = dqpe.get();
            args.k_cache = dcache.get();
            args.o = dout.get();
            const Status no_scale = (*attn)->run(args, stream.handle());
            EXPECT_THAT(no_scale.message(), HasSubstr("MLA needs the model's scale"));
            const double scale = 1.0 / std::sqrt(192.0);  // DeepSeek-V3, absorbed
            args.sm_scale = static_cast<float>(scale);
            ASSERT_OK((*attn)->run(args, stream.handle()));
            ASSERT_CUDA(stream.sync());
            const auto got = dout.download<bf16_t>(static_cast<size_t>(c.bs) * c.heads * kCkv);

            // Oracle: logits over the whole latent (ckv and kpe), values = ckv.
            std::vector<double> want(got.size());
            parallel_for(c.bs * c.heads, [&](int task) {
                const int i = task / c.heads, h = task % c.heads;
                const int seq = seq_lens[static_cast<size_t>(i)];
                const size_t qrow = static_cast<size_t>(i) * c.heads + h;
                std::vector<double> s(static_cast<size_t>(seq)), acc(kCkv, 0.0);
                double m = -INFINITY;
                for (int t = 0; t < seq; ++t) {
                    const size_t base =
                        (static_cast<size_t>(req_pages[static_cast<size_t>(i)]
                                                      [static_cast<size_t>(t / c.page_size)]) *
                             c.page_size +
                         t % c.page_size) *
                        kTok;
                    double dot = 0;
                    for (int d = 0; d < kCkv; ++d) {
                        dot += static_cast<double>(bf16_to_float(q_nope[qrow * kCkv + d])) *
                               bf16_to_float(cache[base + d]);
                    }
                    for (int d = 0; d < kKpe; ++d) {
                        dot += static_cast<double>(bf16_to_float(q_pe[qrow * kKpe + d])) *
                               bf16_to_float(cache[base + kCkv + d]);
                    }
                    s[static_cast<size_t>(t)] = dot * scale;
                    m = std::max(m, s[static_cast<size_t>(t)]);
                }
                double den = 0;
                for (int t = 0; t < seq; ++t) {
                    const size_t base =
                        (static_cast<size_t>(req_pages[static_cast<size_t>(i)]
                                                      [static_cast<size_t>(t / c.page_size)]) *
                             c.page_size +
                         t % c.page_size) *
                        kTok;
                    const double p = std::exp(s[static_cast<size_t>(t)] - m);
                    den += p;
                    for (int d = 0; d < kCkv; ++d) acc[d] += p * bf16_to_float(cache[base + d]);
                }
                for (int d = 0; d < kCkv; ++d) want[qrow * kCkv + d] = acc[d] / den;
            });
            const Comparison cmp = compare(got, want, c.heads, kCkv);
            worst = std::max(worst, cmp.max_err);
            EXPECT_EQ(cmp.bad + cmp.non_finite, 0)
                << "heads " << c.heads << " page size " << c.page_size << " bs " << c.bs << " kv "
                << kv << ": " << cmp.first_bad;
        }
    }
    std::printf("MLA decode: max |error| vs the fp64 oracle: %.3g\n", worst);
}

// ---------------------------------------------------------------------------------------------
// KV append

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
    std::vector<uint8_t> out(v.size() * sizeof(T));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
}

TEST(KvAppend, WritesExactlyTheGivenSlotsAndNothingElse) {
    SKIP_WITHOUT_GPU();
    struct Case {
        runtime::DType src, cache;
        int heads, head_dim, v_head_dim;
        int64_t pad;  // extra source elements per row
    };
    const std::vector<Case> cases = {
        {runtime::DType::kBF16, runtime::DType::kBF16, 8, 128, 128, 0},
        {runtime::DType::kF32, runtime::DType::kBF16, 2, 64, 64, 4},
        {runtime::DType::kBF16, runtime::DType::kF32, 2, 128, 64, 8},
        {runtime::DType::kF32, runtime::DType::kF32, 1, 64, 64, 0},
        {runtime::DType::kF32, runtime::DType::kBF16, 3, 5, 3, 1},  // odd sizes: scalar path
    };
    const int page_size = 16, num_pages = 9;
    const int64_t slots = static_cast<int64_t>(page_size) * num_pages;
    for (const Case& c : cases) {
        const size_t src_size = c.src == runtime::DType::kBF16 ? 2 : 4;
        const size_t dst_size = c.cache == runtime::DType::kBF16 ? 2 : 4;
        const int64_t krow = static_cast<int64_t>(c.heads) * c.head_dim;
        const int64_t vrow = static_cast<int64_t>(c.heads) * c.v_head_dim;
        // Slots: distinct, shuffled, some on the null page 0, plus two out of range (skipped).
        std::vector<int32_t> locs(static_cast<size_t>(slots));
        std::iota(locs.begin(), locs.end(), 0);
        std::mt19937 shuffle_rng(static_cast<unsigned>(krow + vrow));
        std::shuffle(locs.begin(), locs.end(), shuffle_rng);
        locs.resize(37);
        if (std::find(locs.begin(), locs.end(), 2) == locs.end()) locs[3] = 2;  // null page
        locs.push_back(-1);
        locs.push_back(static_cast<int32_t>(slots));
        const int n = static_cast<int>(locs.size());

        Rng rng(static_cast<uint64_t>(krow * 31 + vrow));
        const int64_t kstride = krow + c.pad, vstride = vrow + c.pad;
        std::vector<float> kf(static_cast<size_t>(n * kstride)),
            vf(static_cast<size_t>(n * vstride));
        for (float& x : kf) x = rng.uniform(-3.f, 3.f);
        for (float& x : vf) x = rng.uniform(-3.f, 3.f);
        auto as_src = [&](const std::vector<float>& f) {
            if (c.src == runtime::DType::kF32) return bytes_of(f);
            std::vector<bf16_t> h(f.size());
            for (size_t i = 0; i < f.size(); ++i) h[i] = float_to_bf16(f[i]);
            return bytes_of(h);
        };
        const std::vector<uint8_t> ksrc = as_src(kf), vsrc = as_src(vf);
        GpuBuffer dk(ksrc.size()), dv(vsrc.size()), dloc(locs.size() * 4);
        GpuBuffer kc(static_cast<size_t>(slots * krow) * dst_size);
        GpuBuffer vc(static_cast<size_t>(slots * vrow) * dst_size);
        dk.upload(ksrc);
        dv.upload(vsrc);
        dloc.upload(locs);
        kc.poison();
        vc.poison();

        KvAppendParams p;
        p.k = dk.get();
        p.v = dv.get();
        p.src_dtype = c.src;
        p.k_row_stride = kstride;
        p.v_row_stride = vstride;
        p.k_cache = kc.get();
        p.v_cache = vc.get();
        p.cache_dtype = c.cache;
        p.num_slots = slots;
        p.num_kv_heads = c.heads;
        p.head_dim = c.head_dim;
        p.v_head_dim = c.v_head_dim;
        p.out_cache_loc = static_cast<const int32_t*>(dloc.get());
        p.n = n;
        GpuStream stream;
        ASSERT_OK(kv_append(p, stream.handle()));
        ASSERT_CUDA(stream.sync());

        // Expected bytes: 0xFF everywhere except the written slots.
        auto expect = [&](const std::vector<uint8_t>& src_bytes, int64_t row, int64_t stride) {
            std::vector<uint8_t> want(static_cast<size_t>(slots * row) * dst_size, 0xFF);
            for (int i = 0; i < n; ++i) {
                const int32_t loc = locs[static_cast<size_t>(i)];
                if (loc < 0 || loc >= slots) continue;
                for (int64_t e = 0; e < row; ++e) {
                    const uint8_t* s = &src_bytes[static_cast<size_t>(i * stride + e) * src_size];
                    uint8_t* d = &want[static_cast<size_t>(loc * row + e) * dst_size];
                    float f;
                    if (src_size == 4) {
                        std::memcpy(&f, s, 4);
                    } else {
                        bf16_t h;
                        std::memcpy(&h, s, 2);
                        f = bf16_to_float(h);
                    }
                    if (dst_size == 4) {
                        std::memcpy(d, &f, 4);
                    } else {
                        const bf16_t h = float_to_bf16(f);
                        std::memcpy(d, &h, 2);
                    }
                }
            }
            return want;
        };
        const auto kgot = kc.download<uint8_t>(static_cast<size_t>(slots * krow) * dst_size);
        const auto vgot = vc.download<uint8_t>(static_cast<size_t>(slots * vrow) * dst_size);
        const auto kwant = expect(ksrc, krow, kstride), vwant = expect(vsrc, vrow, vstride);
        EXPECT_TRUE(kgot == kwant)
            << runtime::dtype_name(c.src) << " -> " << runtime::dtype_name(c.cache) << " K, "
            << c.heads << "x" << c.head_dim;
        EXPECT_TRUE(vgot == vwant)
            << runtime::dtype_name(c.src) << " -> " << runtime::dtype_name(c.cache) << " V, "
            << c.heads << "x" << c.v_head_dim;
    }
}

}  // namespace
}  // namespace pdsim::attn::cuda
