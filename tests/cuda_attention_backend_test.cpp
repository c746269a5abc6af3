// The CUDA attention backend ("cuda", backends/cuda/cuda_attention_backend.h) on a GPU, against
// cpu_ref on identical bf16 inputs (the same bf16 q/k/v bits, a CUDA pool and a host pool holding
// the same bf16 KV) and against the fp64 oracle of tests/attention_test_util.h (naive_attention,
// written independently of every backend). Pools are NaN-poisoned except for the KV a batch owns
// (attention_test_util.h), outputs are NaN before every run, pages are shuffled; after each run
// the device pool must equal the host pool byte for byte (the KV write). Covered: decode across
// batch sizes, lengths around the page size, GQA groups and head dims; extend with cached
// prefixes, chunk after chunk, a whole prefill, page sizes 1/16/64; mixed batches (decode rows
// bit-identical to a pure decode batch); the prewrite path; CUDA graphs (replays bit-identical to
// eager runs under one captured max_bs; a replay without the metadata refresh, the
// stale-graph-metadata fault, differs); the record rule with the device StepCounter (every
// branch, one record per layer after its KV write); a copy gated on the record on another stream
// sees the KV; the argument checks.
// Skips with the CUDA runtime's reason where there is no GPU, or "FlashInfer not built".
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/device_step_counter.h"
#include "backends/kv/kv_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "common/bf16.h"
#include "tests/attention_test_util.h"

namespace pdsim::attn::test {
namespace {

using namespace std::chrono_literals;
using pd::StepCounter;
using runtime::DeviceBuffer;
using runtime::DType;
using ::testing::HasSubstr;

// ---- skipping and device plumbing -----------------------------------------------------------
std::string skip_reason() {
#if !defined(PDSIM_HAVE_FLASHINFER)
    return "FlashInfer not built: the cuda backend needs it (run scripts/bootstrap.sh)";
#else
    auto rt = runtime::device_runtime(runtime::DeviceKind::kCuda);
    if (!rt.ok()) return rt.status().to_string();
    if ((*rt)->device_count() == 0) return (*rt)->unavailable_reason();
    return "";
#endif
}

#define SKIP_WITHOUT_CUDA_BACKEND()                            \
    do {                                                       \
        const std::string pdsim_skip_ = skip_reason();         \
        if (!pdsim_skip_.empty()) GTEST_SKIP() << pdsim_skip_; \
    } while (0)

#define ASSERT_OK(expr)                                       \
    do {                                                      \
        const ::pdsim::Status pdsim_st_ = (expr);             \
        ASSERT_TRUE(pdsim_st_.ok()) << pdsim_st_.to_string(); \
    } while (0)

constexpr runtime::Device kGpu{runtime::DeviceKind::kCuda, 0};
constexpr bf16_t kNaNBits = 0xFFFF;

runtime::DeviceRuntime& cuda_runtime() {
    return **runtime::device_runtime(runtime::DeviceKind::kCuda);
}

std::vector<bf16_t> to_bf16(const std::vector<float>& x) {
    std::vector<bf16_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_bf16(x[i]);
    return out;
}

std::vector<float> from_bf16(const std::vector<bf16_t>& x) {
    std::vector<float> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_float(x[i]);
    return out;
}

// Every value of the batch made bf16-representable, so the fp64 oracle, cpu_ref and the GPU see
// the same numbers.
void round_to_bf16(Batch& b) {
    for (auto* v : {&b.q, &b.k, &b.v}) {
        for (float& x : *v) x = round_bf16(x);
    }
    for (auto* reqs : {&b.req_k, &b.req_v}) {
        for (auto& r : *reqs) {
            for (float& x : r) x = round_bf16(x);
        }
    }
}

Batch make_bf16_batch(const Shape& s, ForwardMode mode, const std::vector<Req>& reqs, uint64_t seed,
                      int extra_stride = 2, int pool_pages = 0, int min_stride = 0) {
    Batch b = make_batch(s, mode, reqs, seed, extra_stride, pool_pages, min_stride);
    round_to_bf16(b);
    return b;
}

Shape bf16_shape(int num_q_heads, int num_kv_heads, int head_dim, int page_size) {
    Shape s;
    s.num_q_heads = num_q_heads;
    s.num_kv_heads = num_kv_heads;
    s.head_dim = head_dim;
    s.page_size = page_size;
    s.dtype = kv::KVDtype::kBF16;
    return s;
}

AttentionConfig config_for(const Shape& s, runtime::Stream& stream) {
    AttentionConfig c;
    c.num_q_heads = s.num_q_heads;
    c.num_kv_heads = s.num_kv_heads;
    c.head_dim = s.head_dim;
    c.kv_dtype = s.dtype;
    c.stream = &stream;
    return c;
}

std::unique_ptr<kv::MHATokenToKVPool> make_device_pool(const Shape& s, int num_pages) {
    return make_pool(s, num_pages, kGpu);
}

size_t buffer_bytes(const kv::KVPool& p, int layer, int buf) {
    return p.token_bytes(layer, buf) * static_cast<size_t>(p.num_pages()) *
           static_cast<size_t>(p.page_size());
}

// Synchronous whole-pool copies between a host pool and a device pool of the same shape (the
// runtime's copy waits for the copy; call with the compute streams idle).
Status copy_pool(const kv::KVPool& src, kv::KVPool& dst) {
    for (int l = 0; l < src.num_layers(); ++l) {
        for (int buf = 0; buf < src.buffer_count(); ++buf) {
            PDSIM_RETURN_IF_ERROR(
                cuda_runtime().copy(dst.data(l, buf), src.data(l, buf), buffer_bytes(src, l, buf)));
        }
    }
    return {};
}

// The poisoned host pool for `b` (prefix, plus the new tokens when `with_new`) and a device copy.
struct PoolPair {
    std::unique_ptr<kv::MHATokenToKVPool> host, device;
};
PoolPair make_pools(const Shape& s, const Batch& b, bool with_new) {
    PoolPair p;
    p.host = make_pool(s, b.num_pages);
    p.device = make_device_pool(s, b.num_pages);
    if (!p.host || !p.device) return {};
    init_pool(*p.host, s, b, with_new);
    Status st = copy_pool(*p.host, *p.device);
    if (!st.ok()) {
        ADD_FAILURE() << st.to_string();
        return {};
    }
    return p;
}

// The device pool's contents equal the host pool's, byte for byte (names the first difference).
::testing::AssertionResult device_pool_equals(const kv::MHATokenToKVPool& device,
                                              const kv::MHATokenToKVPool& host, const Shape& s) {
    auto mirror = make_pool(s, host.num_pages());
    if (!mirror) return ::testing::AssertionFailure() << "no mirror pool";
    Status st = copy_pool(device, *mirror);
    if (!st.ok()) return ::testing::AssertionFailure() << st.to_string();
    return pools_equal(*mirror, host);
}

// Largest |got - ref| / max(1, |ref|) (inf if either is not finite).
double max_error(const std::vector<float>& got, const std::vector<float>& ref) {
    double worst = 0;
    for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
        const double g = got[i], r = ref[i];
        if (!std::isfinite(g) || !std::isfinite(r)) return std::numeric_limits<double>::infinity();
        worst = std::max(worst, std::fabs(g - r) / std::max(1.0, std::fabs(r)));
    }
    return worst;
}

// bf16 device views [rows][heads][dim] and an int32 [rows] one.
runtime::ConstTensorView dev_rows(const DeviceBuffer& b, int64_t rows, int heads, int dim) {
    return runtime::make_view(static_cast<const void*>(b.data()), DType::kBF16, kGpu,
                              {rows, heads, dim});
}
runtime::TensorView dev_rows_mut(const DeviceBuffer& b, int64_t rows, int heads, int dim) {
    return runtime::make_view(b.data(), DType::kBF16, kGpu, {rows, heads, dim});
}
runtime::ConstTensorView dev_locs(const DeviceBuffer& b, int64_t rows) {
    return runtime::make_view(static_cast<const void*>(b.data()), DType::kI32, kGpu, {rows});
}

StatusOr<DeviceBuffer> upload(const void* data, size_t bytes) {
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer b,
                           DeviceBuffer::allocate(kGpu, std::max<size_t>(bytes, 16)));
    if (bytes > 0) PDSIM_RETURN_IF_ERROR(b.copy_from_host(data, bytes));
    return b;
}

// ---- cpu_ref on bf16 host views -------------------------------------------------------------
// Runs `b` on cpu_ref over the host pool (writing its new KV when save_kv), bf16 activations.
StatusOr<std::vector<float>> run_cpu_ref(const Shape& s, const Batch& b, kv::MHATokenToKVPool& pool,
                                         bool save_kv) {
    runtime::CpuStream stream("cpu_ref");
    PDSIM_ASSIGN_OR_RETURN(auto backend,
                           create_attention_backend("cpu_ref", config_for(s, stream)));
    const std::vector<bf16_t> q = to_bf16(b.q), k = to_bf16(b.k), v = to_bf16(b.v);
    std::vector<bf16_t> out(static_cast<size_t>(b.num_tokens) * s.q_width(), kNaNBits);
    const runtime::Device host{};
    const int64_t n = b.num_tokens;
    PDSIM_RETURN_IF_ERROR(backend->init_forward_metadata(b.forward_batch()));
    PDSIM_RETURN_IF_ERROR(backend->forward(
        runtime::make_view(q.data(), DType::kBF16, host, {n, s.num_q_heads, s.head_dim}),
        runtime::make_view(k.data(), DType::kBF16, host, {n, s.num_kv_heads, s.head_dim}),
        runtime::make_view(v.data(), DType::kBF16, host, {n, s.num_kv_heads, s.head_dim}),
        s.layer(), locs_view(b.locs.data(), n), pool, b.mode, b.bs,
        runtime::make_view(out.data(), DType::kBF16, host, {n, s.num_q_heads, s.head_dim}),
        save_kv));
    PDSIM_RETURN_IF_ERROR(stream.synchronize(kSyncTimeout));
    return from_bf16(out);
}

// ---- the cuda backend on its own CudaStream ----------------------------------------------------
class CudaRunner {
public:
    explicit CudaRunner(const Shape& s) : shape_(s) {
        auto stream = cuda_runtime().create_stream(0, "cuda-compute");
        if (!stream.ok()) {
            status_ = stream.status();
            return;
        }
        stream_ = std::move(stream).value();
        auto backend = create_attention_backend("cuda", config_for(s, *stream_));
        if (!backend.ok()) {
            status_ = backend.status();
            return;
        }
        backend_ = std::move(backend).value();
    }
    // Work still queued (an early test exit) reads the buffers: drain first.
    ~CudaRunner() {
        if (stream_) stream_->synchronize(kSyncTimeout).ignore_error();
        backend_.reset();
    }
    CudaRunner(const CudaRunner&) = delete;
    CudaRunner& operator=(const CudaRunner&) = delete;

    [[nodiscard]] const Status& status() const { return status_; }
    [[nodiscard]] runtime::Stream& stream() { return *stream_; }
    [[nodiscard]] AttentionBackend& backend() { return *backend_; }

    // Uploads the batch's new tokens, poisons out, then init_forward_metadata + forward (not
    // waited for). save_kv == false hands the backend NaN k/v: a backend that writes them into
    // the pool (or reads them) is caught.
    [[nodiscard]] Status launch(const Batch& b, kv::KVPool& pool, bool save_kv,
                                std::optional<bool> record = std::nullopt) {
        PDSIM_RETURN_IF_ERROR(stage(b, save_kv));
        return launch_staged(b, pool, save_kv, record);
    }
    // init_forward_metadata + forward over buffers stage() filled: no allocation, no free (which
    // may synchronize the device), so it may run while a test holds the stream.
    [[nodiscard]] Status launch_staged(const Batch& b, kv::KVPool& pool, bool save_kv,
                                       std::optional<bool> record = std::nullopt) {
        PDSIM_RETURN_IF_ERROR(backend_->init_forward_metadata(b.forward_batch()));
        return forward(b, pool, save_kv, record);
    }
    // Uploads the batch's new tokens (q, k, v or NaN decoys, slots) and poisons out.
    [[nodiscard]] Status stage(const Batch& b, bool save_kv) {
        rows_ = b.num_tokens;
        const std::vector<bf16_t> q = to_bf16(b.q);
        std::vector<bf16_t> k = to_bf16(b.k), v = to_bf16(b.v);
        if (!save_kv) {
            std::fill(k.begin(), k.end(), kNaNBits);
            std::fill(v.begin(), v.end(), kNaNBits);
        }
        PDSIM_ASSIGN_OR_RETURN(q_, upload(q.data(), q.size() * sizeof(bf16_t)));
        PDSIM_ASSIGN_OR_RETURN(k_, upload(k.data(), k.size() * sizeof(bf16_t)));
        PDSIM_ASSIGN_OR_RETURN(v_, upload(v.data(), v.size() * sizeof(bf16_t)));
        PDSIM_ASSIGN_OR_RETURN(locs_, upload(b.locs.data(), b.locs.size() * sizeof(int32_t)));
        PDSIM_ASSIGN_OR_RETURN(
            out_,
            DeviceBuffer::allocate(
                kGpu, std::max<size_t>(static_cast<size_t>(rows_) * shape_.q_width() * 2, 16)));
        return out_.fill(0xFF);
    }
    // forward() of layer shape_.layer_id over the staged buffers.
    [[nodiscard]] Status forward(const Batch& b, kv::KVPool& pool, bool save_kv,
                                 std::optional<bool> record = std::nullopt) {
        const Shape& s = shape_;
        return backend_->forward(dev_rows(q_, rows_, s.num_q_heads, s.head_dim),
                                 dev_rows(k_, rows_, s.num_kv_heads, s.head_dim),
                                 dev_rows(v_, rows_, s.num_kv_heads, s.head_dim), s.layer(),
                                 dev_locs(locs_, rows_), pool, b.mode, b.bs,
                                 dev_rows_mut(out_, rows_, s.num_q_heads, s.head_dim), save_kv,
                                 record);
    }
    [[nodiscard]] Status wait() { return stream_->synchronize(kSyncTimeout); }
    [[nodiscard]] StatusOr<std::vector<float>> out() const {
        std::vector<bf16_t> host(static_cast<size_t>(rows_) * shape_.q_width());
        PDSIM_RETURN_IF_ERROR(out_.copy_to_host(host.data(), host.size() * sizeof(bf16_t)));
        return from_bf16(host);
    }
    [[nodiscard]] StatusOr<std::vector<bf16_t>> out_bits() const {
        std::vector<bf16_t> host(static_cast<size_t>(rows_) * shape_.q_width());
        PDSIM_RETURN_IF_ERROR(out_.copy_to_host(host.data(), host.size() * sizeof(bf16_t)));
        return host;
    }

private:
    Shape shape_;
    Status status_;
    std::unique_ptr<runtime::Stream> stream_;
    std::unique_ptr<AttentionBackend> backend_;
    DeviceBuffer q_, k_, v_, locs_, out_;
    int64_t rows_ = 0;
};

// Runs `like` once on a zeroed scratch pool of the same geometry, so that the backend's adapters
// exist and cover it: a later launch of `like` allocates nothing and never has to grow an adapter
// (which synchronizes the stream). Tests that hold the stream with a host function need that.
void warm_up(CudaRunner& r, const Shape& s, const Batch& like) {
    auto scratch = make_device_pool(s, like.num_pages);
    ASSERT_TRUE(scratch);
    ASSERT_OK(scratch->fill(0));
    ASSERT_OK(r.launch(like, *scratch, true));
    ASSERT_OK(r.wait());
}

// Runs `b` on cpu_ref and on cuda over identical pools; compares the outputs (and, if asked, with
// the fp64 oracle) and the pools after the forward. Prints the worst error.
void compare_with_cpu_ref(const Shape& s, const Batch& b, bool save_kv, bool check_oracle,
                          double tol = 1e-2) {
    SCOPED_TRACE(s.describe() + " " + b.describe() + (save_kv ? " save" : " prewrite"));
    PoolPair pools = make_pools(s, b, /*with_new=*/!save_kv);
    ASSERT_TRUE(pools.host && pools.device);
    auto ref = run_cpu_ref(s, b, *pools.host, save_kv);
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    CudaRunner r(s);
    ASSERT_OK(r.status());
    ASSERT_OK(r.launch(b, *pools.device, save_kv));
    ASSERT_OK(r.wait());
    auto got = r.out();
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    std::printf("[ cuda vs cpu_ref ] %-52s %-36s max error %.3g\n", s.describe().c_str(),
                b.describe().substr(0, 36).c_str(), max_error(*got, *ref));
    EXPECT_TRUE(outputs_close(*got, *ref, tol, s, b)) << "vs cpu_ref";
    if (check_oracle) {
        EXPECT_TRUE(outputs_close(*got, naive_attention(s, b), tol, s, b)) << "vs the fp64 oracle";
    }
    EXPECT_TRUE(device_pool_equals(*pools.device, *pools.host, s));
}

// Requests [first, first + count) of `u` as a batch of `mode` (same pages, same data).
Batch select_requests(const Batch& u, int first, int count, ForwardMode mode) {
    Batch b;
    b.mode = mode;
    b.bs = count;
    b.stride = u.stride;
    b.num_pages = u.num_pages;
    b.trap_page = u.trap_page;
    const size_t width_q = u.num_tokens > 0 ? u.q.size() / static_cast<size_t>(u.num_tokens) : 0;
    const size_t width_kv = u.num_tokens > 0 ? u.k.size() / static_cast<size_t>(u.num_tokens) : 0;
    int64_t row = 0;
    for (int i = 0; i < u.bs; ++i) {
        const int ql = u.extend_lens[static_cast<size_t>(i)];
        if (i >= first && i < first + count) {
            b.seq_lens.push_back(u.seq_lens[static_cast<size_t>(i)]);
            b.extend_lens.push_back(ql);
            b.page_table.insert(b.page_table.end(), u.page_table.begin() + i * u.stride,
                                u.page_table.begin() + (i + 1) * u.stride);
            b.req_k.push_back(u.req_k[static_cast<size_t>(i)]);
            b.req_v.push_back(u.req_v[static_cast<size_t>(i)]);
            const auto r0 = static_cast<ptrdiff_t>(row), r1 = static_cast<ptrdiff_t>(row + ql);
            b.q.insert(b.q.end(), u.q.begin() + r0 * static_cast<ptrdiff_t>(width_q),
                       u.q.begin() + r1 * static_cast<ptrdiff_t>(width_q));
            b.k.insert(b.k.end(), u.k.begin() + r0 * static_cast<ptrdiff_t>(width_kv),
                       u.k.begin() + r1 * static_cast<ptrdiff_t>(width_kv));
            b.v.insert(b.v.end(), u.v.begin() + r0 * static_cast<ptrdiff_t>(width_kv),
                       u.v.begin() + r1 * static_cast<ptrdiff_t>(width_kv));
            b.locs.insert(b.locs.end(), u.locs.begin() + r0, u.locs.begin() + r1);
            b.num_tokens += ql;
        }
        row += ql;
    }
    return b;
}

// Request i of `whole` (all of its tokens new) cut to tokens [cuts[i].first, cuts[i].second): a
// chunk of a chunked prefill, with the earlier tokens as its cached prefix.
Batch chunk_of(const Batch& whole, const std::vector<std::pair<int, int>>& cuts) {
    Batch b;
    b.mode = ForwardMode::kExtend;
    b.bs = whole.bs;
    b.stride = whole.stride;
    b.num_pages = whole.num_pages;
    b.trap_page = whole.trap_page;
    b.page_table = whole.page_table;
    const size_t width_q = whole.q.size() / static_cast<size_t>(whole.num_tokens);
    const size_t width_kv = whole.k.size() / static_cast<size_t>(whole.num_tokens);
    int64_t row = 0;
    for (int i = 0; i < whole.bs; ++i) {
        const auto [t0, t1] = cuts[static_cast<size_t>(i)];
        b.seq_lens.push_back(t1);
        b.extend_lens.push_back(t1 - t0);
        b.req_k.emplace_back(whole.req_k[static_cast<size_t>(i)].begin(),
                             whole.req_k[static_cast<size_t>(i)].begin() +
                                 static_cast<ptrdiff_t>(static_cast<size_t>(t1) * width_kv));
        b.req_v.emplace_back(whole.req_v[static_cast<size_t>(i)].begin(),
                             whole.req_v[static_cast<size_t>(i)].begin() +
                                 static_cast<ptrdiff_t>(static_cast<size_t>(t1) * width_kv));
        const auto r0 = static_cast<ptrdiff_t>(row + t0), r1 = static_cast<ptrdiff_t>(row + t1);
        b.q.insert(b.q.end(), whole.q.begin() + r0 * static_cast<ptrdiff_t>(width_q),
                   whole.q.begin() + r1 * static_cast<ptrdiff_t>(width_q));
        b.k.insert(b.k.end(), whole.k.begin() + r0 * static_cast<ptrdiff_t>(width_kv),
                   whole.k.begin() + r1 * static_cast<ptrdiff_t>(width_kv));
        b.v.insert(b.v.end(), whole.v.begin() + r0 * static_cast<ptrdiff_t>(width_kv),
                   whole.v.begin() + r1 * static_cast<ptrdiff_t>(width_kv));
        b.locs.insert(b.locs.end(), whole.locs.begin() + r0, whole.locs.begin() + r1);
        b.num_tokens += t1 - t0;
        row += whole.extend_lens[static_cast<size_t>(i)];
    }
    return b;
}

// ---- decode ---------------------------------------------------------------------------------
TEST(CudaBackendDecode, MatchesCpuRefAcrossBatchSizesLengthsGroupsAndHeadDims) {
    SKIP_WITHOUT_CUDA_BACKEND();
    uint64_t seed = 100;
    for (int head_dim : {128, 64}) {
        for (int group : {1, 4, 8}) {
            for (int bs : {1, 7, 64}) {
                if (head_dim == 64 && bs == 64) continue;  // the long lengths at d 128 suffice
                for (int kv_len : {1, 15, 16, 17, 1000, 4097}) {
                    const Shape s = bf16_shape(2 * group, 2, head_dim, 16);
                    const std::vector<Req> reqs(static_cast<size_t>(bs),
                                                Req{.prefix = kv_len - 1, .new_tokens = 1});
                    const Batch b = make_bf16_batch(s, ForwardMode::kDecode, reqs, ++seed);
                    compare_with_cpu_ref(s, b, /*save_kv=*/true, /*check_oracle=*/bs <= 7);
                    if (HasFatalFailure()) return;
                }
            }
        }
    }
}

TEST(CudaBackendDecode, MixedLengthsInOneBatchAndThePrewritePath) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(16, 2, 128, 16);
    std::vector<Req> reqs;
    for (int i = 0; i < 33; ++i) reqs.push_back({(i * 397) % 2100, 1});
    const Batch b = make_bf16_batch(s, ForwardMode::kDecode, reqs, 7);
    compare_with_cpu_ref(s, b, /*save_kv=*/true, /*check_oracle=*/true);
    compare_with_cpu_ref(s, b, /*save_kv=*/false, /*check_oracle=*/true);
    // Page sizes 1 and 64.
    for (int page : {1, 64}) {
        const Shape sp = bf16_shape(8, 2, 64, page);
        compare_with_cpu_ref(
            sp, make_bf16_batch(sp, ForwardMode::kDecode, {{0, 1}, {63, 1}, {64, 1}, {200, 1}}, 8),
            true, true);
    }
}

// ---- extend ---------------------------------------------------------------------------------
TEST(CudaBackendExtend, ChunksWithCachedPrefixesMatchCpuRef) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const std::vector<Req> reqs = {{100, 37}, {0, 64}, {513, 1}, {30, 200}, {16, 16}, {15, 17}};
    uint64_t seed = 200;
    for (int head_dim : {64, 128}) {
        for (int group : {1, 4, 8}) {
            const Shape s = bf16_shape(2 * group, 2, head_dim, 16);
            compare_with_cpu_ref(s, make_bf16_batch(s, ForwardMode::kExtend, reqs, ++seed), true,
                                 true);
            if (HasFatalFailure()) return;
        }
    }
    for (int page : {1, 64}) {
        const Shape s = bf16_shape(8, 2, 128, page);
        compare_with_cpu_ref(s, make_bf16_batch(s, ForwardMode::kExtend, reqs, ++seed), true, true);
    }
    // The prewrite path: the new tokens' KV is in the pool already; k and v are NaN decoys.
    const Shape s = bf16_shape(8, 2, 128, 16);
    compare_with_cpu_ref(s, make_bf16_batch(s, ForwardMode::kExtend, reqs, ++seed), false, true);
    // target_verify and draft_extend are extend-kind batches.
    for (ForwardMode m : {ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
        compare_with_cpu_ref(s, make_bf16_batch(s, m, {{40, 4}, {7, 4}}, ++seed), true, true);
    }
}

TEST(CudaBackendExtend, AWholePrefill) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(32, 8, 128, 16);
    compare_with_cpu_ref(
        s, make_bf16_batch(s, ForwardMode::kExtend, {{0, 300}, {0, 1}, {0, 129}}, 31), true, true);
}

// A chunked prefill: chunk 1 then chunk 2 of the same requests on one backend and one pool; the
// second chunk attends to the KV the first one wrote.
TEST(CudaBackendExtend, ChunkAfterChunkOnOneBackend) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(8, 2, 64, 16);
    const Batch whole = make_bf16_batch(s, ForwardMode::kExtend, {{0, 190}, {0, 42}, {0, 5}}, 41);
    const Batch first = chunk_of(whole, {{0, 100}, {0, 37}, {0, 5}});
    // Request 2 is complete after chunk 1 (a chunk needs >= 1 token): chunk 2 has requests 0, 1.
    const Batch second = select_requests(chunk_of(whole, {{100, 190}, {37, 42}, {5, 5}}), 0, 2,
                                         ForwardMode::kExtend);
    PoolPair pools = make_pools(s, first, /*with_new=*/false);
    ASSERT_TRUE(pools.host && pools.device);
    CudaRunner r(s);
    ASSERT_OK(r.status());
    for (const Batch* b : {&first, &second}) {
        SCOPED_TRACE(b->describe());
        auto ref = run_cpu_ref(s, *b, *pools.host, true);
        ASSERT_TRUE(ref.ok()) << ref.status().to_string();
        ASSERT_OK(r.launch(*b, *pools.device, true));
        ASSERT_OK(r.wait());
        auto got = r.out();
        ASSERT_TRUE(got.ok());
        EXPECT_TRUE(outputs_close(*got, *ref, 1e-2, s, *b));
        EXPECT_TRUE(outputs_close(*got, naive_attention(s, *b), 1e-2, s, *b));
        EXPECT_TRUE(device_pool_equals(*pools.device, *pools.host, s));
    }
}

// ---- mixed ----------------------------------------------------------------------------------
// A mixed batch matches cpu_ref, and its decode requests produce exactly the bits a pure decode
// batch of those requests produces (they go through the decode plan), with the decode run at the
// end (SGLang's layout) or at the start (vLLM's).
TEST(CudaBackendMixed, DecodeRowsEqualAPureDecodeBatchBitForBit) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(16, 2, 128, 16);
    struct Layout {
        std::vector<Req> reqs;
        int decode_first, decode_count;
    };
    const std::vector<Layout> layouts = {
        {{{100, 37}, {0, 50}, {40, 1}, {300, 1}, {17, 1}, {999, 1}}, 2, 4},  // the 1-token chunk
        {{{300, 1}, {17, 1}, {999, 1}, {100, 37}, {0, 50}}, 0, 3},
    };
    uint64_t seed = 300;
    for (const Layout& layout : layouts) {
        Batch mixed = make_bf16_batch(s, ForwardMode::kMixed, layout.reqs, ++seed);
        SCOPED_TRACE(mixed.describe());
        // With the decode run trailing, the 1-token chunk before it ({40, 1}) is a decode request
        // too: the trailing run is every 1-token request at the end.
        compare_with_cpu_ref(s, mixed, true, true);
        if (HasFatalFailure()) return;
        PoolPair pools = make_pools(s, mixed, /*with_new=*/true);
        ASSERT_TRUE(pools.host && pools.device);
        CudaRunner r(s);
        ASSERT_OK(r.status());
        ASSERT_OK(r.launch(mixed, *pools.device, true));
        ASSERT_OK(r.wait());
        auto mixed_bits = r.out_bits();
        ASSERT_TRUE(mixed_bits.ok());
        const Batch decode =
            select_requests(mixed, layout.decode_first, layout.decode_count, ForwardMode::kDecode);
        ASSERT_OK(r.launch(decode, *pools.device, true));
        ASSERT_OK(r.wait());
        auto decode_bits = r.out_bits();
        ASSERT_TRUE(decode_bits.ok());
        int64_t row = 0;
        for (int i = 0; i < layout.decode_first; ++i)
            row += mixed.extend_lens[static_cast<size_t>(i)];
        const size_t w = s.q_width();
        const std::vector<bf16_t> rows(
            mixed_bits->begin() + static_cast<ptrdiff_t>(row * w),
            mixed_bits->begin() + static_cast<ptrdiff_t>((row + layout.decode_count) * w));
        EXPECT_EQ(rows, *decode_bits)
            << "decode rows of the mixed batch differ from a decode batch";
    }
}

// ---- CUDA graphs ----------------------------------------------------------------------------
// Static buffers for max_bs decode rows, filled per replay with a sub-batch of a universe batch.
class GraphRig {
public:
    GraphRig(const Shape& s, int max_bs) : s_(s), max_bs_(max_bs) {
        const auto rows = static_cast<size_t>(max_bs);
        auto alloc = [&](size_t bytes) {
            auto b = DeviceBuffer::allocate(kGpu, bytes);
            if (!b.ok()) status_ = b.status();
            return b.ok() ? std::move(b).value() : DeviceBuffer();
        };
        q_ = alloc(rows * s.q_width() * 2);
        k_ = alloc(rows * s.kv_width() * 2);
        v_ = alloc(rows * s.kv_width() * 2);
        out_ = alloc(rows * s.q_width() * 2);
        locs_ = alloc(rows * 4);
    }
    [[nodiscard]] const Status& status() const { return status_; }
    // Rows [0, b.bs) hold `b`'s tokens, rows past them slots -1 (the KV write skips them).
    [[nodiscard]] Status fill(const Batch& b) {
        std::vector<int32_t> locs(static_cast<size_t>(max_bs_), -1);
        std::copy(b.locs.begin(), b.locs.end(), locs.begin());
        std::vector<bf16_t> q(static_cast<size_t>(max_bs_) * s_.q_width(), 0);
        const std::vector<bf16_t> bq = to_bf16(b.q), bk = to_bf16(b.k), bv = to_bf16(b.v);
        std::copy(bq.begin(), bq.end(), q.begin());
        std::vector<bf16_t> k(static_cast<size_t>(max_bs_) * s_.kv_width(), 0), v = k;
        std::copy(bk.begin(), bk.end(), k.begin());
        std::copy(bv.begin(), bv.end(), v.begin());
        PDSIM_RETURN_IF_ERROR(q_.copy_from_host(q.data(), q.size() * 2));
        PDSIM_RETURN_IF_ERROR(k_.copy_from_host(k.data(), k.size() * 2));
        PDSIM_RETURN_IF_ERROR(v_.copy_from_host(v.data(), v.size() * 2));
        PDSIM_RETURN_IF_ERROR(locs_.copy_from_host(locs.data(), locs.size() * 4));
        return out_.fill(0xFF);
    }
    [[nodiscard]] Status forward(AttentionBackend& backend, kv::KVPool& pool) {
        const int64_t n = max_bs_;
        return backend.forward(dev_rows(q_, n, s_.num_q_heads, s_.head_dim),
                               dev_rows(k_, n, s_.num_kv_heads, s_.head_dim),
                               dev_rows(v_, n, s_.num_kv_heads, s_.head_dim), s_.layer(),
                               dev_locs(locs_, n), pool, ForwardMode::kDecode, max_bs_,
                               dev_rows_mut(out_, n, s_.num_q_heads, s_.head_dim));
    }
    [[nodiscard]] StatusOr<std::vector<bf16_t>> out_bits() const {
        std::vector<bf16_t> host(static_cast<size_t>(max_bs_) * s_.q_width());
        PDSIM_RETURN_IF_ERROR(out_.copy_to_host(host.data(), host.size() * 2));
        return host;
    }

private:
    Shape s_;
    int max_bs_;
    Status status_;
    DeviceBuffer q_, k_, v_, out_, locs_;
};

TEST(CudaBackendGraph, ReplaysEqualEagerRunsBitForBitAndAStaleReplayDiffers) {
    SKIP_WITHOUT_CUDA_BACKEND();
    constexpr int kMaxBs = 16;
    const Shape s = bf16_shape(8, 2, 128, 16);
    std::vector<Req> reqs;
    for (int i = 0; i < 40; ++i) reqs.push_back({(i * 211 + 5) % 900, 1});
    const Batch universe = make_bf16_batch(s, ForwardMode::kDecode, reqs, 51);
    PoolPair pools = make_pools(s, universe, /*with_new=*/false);
    ASSERT_TRUE(pools.host && pools.device);
    CudaRunner eager(s);  // the reference: a separate backend, eager only
    ASSERT_OK(eager.status());
    CudaRunner graph_runner(s);
    ASSERT_OK(graph_runner.status());
    AttentionBackend& backend = graph_runner.backend();
    runtime::Stream& stream = graph_runner.stream();
    GraphRig rig(s, kMaxBs);
    ASSERT_OK(rig.status());

    auto eager_bits = [&](const Batch& b) -> std::vector<bf16_t> {
        EXPECT_TRUE(eager.launch(b, *pools.device, true).ok());
        EXPECT_TRUE(eager.wait().ok());
        auto bits = eager.out_bits();
        EXPECT_TRUE(bits.ok());
        return bits.ok() ? *bits : std::vector<bf16_t>{};
    };
    // Replayed rows equal the eager run's; rows past the batch stay poisoned.
    auto check_rows = [&](const std::vector<bf16_t>& all, const Batch& b, const char* what) {
        const size_t w = s.q_width();
        const std::vector<bf16_t> want = eager_bits(b);
        const std::vector<bf16_t> got(all.begin(), all.begin() + static_cast<ptrdiff_t>(b.bs * w));
        EXPECT_EQ(got, want) << what << " bs " << b.bs << ": graph output != eager output";
        for (size_t i = static_cast<size_t>(b.bs) * w; i < all.size(); ++i) {
            ASSERT_EQ(all[i], kNaNBits) << what << ": row " << i / w << " past the batch written";
        }
    };

    std::vector<int32_t> seq_lens_buf(kMaxBs, 1);
    GraphStateExtras extras;
    extras.max_pages_per_seq = universe.stride;
    ASSERT_OK(init_backend_cuda_graph_state(backend, kMaxBs, seq_lens_buf.data(), extras));
    // A replay batch planned before the graph adapter exists is planned by the warm-up forward.
    const Batch first = select_requests(universe, 3, 9, ForwardMode::kDecode);
    ASSERT_OK(rig.fill(first));
    ASSERT_OK(backend.init_forward_metadata_replay_cuda_graph(first.forward_batch()));
    ASSERT_OK(backend.init_forward_metadata_capture_cuda_graph(kMaxBs, ForwardMode::kDecode));
    ASSERT_OK(rig.forward(backend, *pools.device));  // the warm-up, outside the capture
    ASSERT_OK(stream.synchronize(kSyncTimeout));
    {
        auto bits = rig.out_bits();
        ASSERT_TRUE(bits.ok());
        check_rows(*bits, first, "warm-up");
    }
    // Capture one forward.
    ASSERT_OK(stream.begin_capture());
    const Status captured = rig.forward(backend, *pools.device);
    auto graph = stream.end_capture();
    ASSERT_OK(captured);
    ASSERT_TRUE(graph.ok()) << graph.status().to_string();

    struct Replay {
        int first, bs;
    };
    for (const Replay& rp :
         {Replay{0, 16}, Replay{20, 5}, Replay{7, 1}, Replay{24, 16}, Replay{1, 11}}) {
        const Batch b = select_requests(universe, rp.first, rp.bs, ForwardMode::kDecode);
        ASSERT_OK(rig.fill(b));
        ASSERT_OK(backend.init_forward_metadata_replay_cuda_graph(b.forward_batch()));
        ASSERT_OK((*graph)->launch(stream));
        ASSERT_OK(stream.synchronize(kSyncTimeout));
        auto bits = rig.out_bits();
        ASSERT_TRUE(bits.ok());
        check_rows(*bits, b, "replay");
    }
    // The stale-graph-metadata fault: new inputs, no refresh. The replay reads the previous
    // batch's lengths and pages, so its output differs from the eager run of the new batch.
    const Batch previous = select_requests(universe, 30, 8, ForwardMode::kDecode);
    ASSERT_OK(rig.fill(previous));
    ASSERT_OK(backend.init_forward_metadata_replay_cuda_graph(previous.forward_batch()));
    ASSERT_OK((*graph)->launch(stream));
    ASSERT_OK(stream.synchronize(kSyncTimeout));
    const Batch next = select_requests(universe, 10, 8, ForwardMode::kDecode);
    ASSERT_OK(rig.fill(next));
    ASSERT_OK((*graph)->launch(stream));  // init_forward_metadata_replay_cuda_graph skipped
    ASSERT_OK(stream.synchronize(kSyncTimeout));
    auto stale = rig.out_bits();
    ASSERT_TRUE(stale.ok());
    const std::vector<bf16_t> want = eager_bits(next);
    const std::vector<bf16_t> got(stale->begin(),
                                  stale->begin() + static_cast<ptrdiff_t>(next.bs * s.q_width()));
    EXPECT_NE(got, want) << "a replay without its metadata refresh must not match the new batch";
}

TEST(CudaBackendGraph, MisuseIsRefused) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(8, 2, 64, 16);
    const Batch b = make_bf16_batch(s, ForwardMode::kDecode, {{10, 1}, {3, 1}}, 61);
    PoolPair pools = make_pools(s, b, false);
    ASSERT_TRUE(pools.host && pools.device);
    CudaRunner r(s);
    ASSERT_OK(r.status());
    AttentionBackend& backend = r.backend();
    std::vector<int32_t> seq_lens_buf(4, 1);
    EXPECT_EQ(backend.init_forward_metadata_replay_cuda_graph(b.forward_batch()).code(),
              StatusCode::kFailedPrecondition);
    ASSERT_OK(init_backend_cuda_graph_state(backend, 4, seq_lens_buf.data(), {}));
    EXPECT_EQ(backend.init_forward_metadata_capture_cuda_graph(4, ForwardMode::kMixed).code(),
              StatusCode::kUnimplemented);
    Batch mixed = b;
    mixed.mode = ForwardMode::kMixed;
    EXPECT_EQ(backend.init_forward_metadata_replay_cuda_graph(mixed.forward_batch()).code(),
              StatusCode::kUnimplemented);
    Batch too_many = make_bf16_batch(s, ForwardMode::kDecode,
                                     std::vector<Req>(5, Req{.prefix = 3, .new_tokens = 1}), 62);
    EXPECT_THAT(backend.init_forward_metadata_replay_cuda_graph(too_many.forward_batch()).message(),
                HasSubstr("batch: bs 5 > graph max_bs 4"));
    // A capture before the warm-up: the graph adapter does not exist yet.
    ASSERT_OK(r.stage(b, true));
    ASSERT_OK(backend.init_forward_metadata_capture_cuda_graph(2, ForwardMode::kDecode));
    ASSERT_OK(r.stream().begin_capture());
    const Status during = r.forward(b, *pools.device, true);
    auto g = r.stream().end_capture();
    EXPECT_EQ(during.code(), StatusCode::kFailedPrecondition) << during.to_string();
    EXPECT_THAT(during.message(), HasSubstr("warm up first"));
    // An eager forward during a capture.
    ASSERT_OK(backend.init_forward_metadata(b.forward_batch()));
    ASSERT_OK(r.stream().begin_capture());
    const Status eager_during = r.forward(b, *pools.device, true);
    auto g2 = r.stream().end_capture();
    EXPECT_EQ(eager_during.code(), StatusCode::kFailedPrecondition) << eager_during.to_string();
    ASSERT_OK(r.wait());
}

// ---- the record rule with the device StepCounter ---------------------------------------------
// For every branch: the record count, and (save_kv) that a host thread woken by
// StepCounter::wait_until_ready already sees the new tokens' KV in the device pool.
using RuleParam =
    std::tuple<ForwardMode, bool /*save_kv*/, std::optional<bool>, bool /*registered*/>;

class CudaRecordRule : public ::testing::TestWithParam<RuleParam> {};

bool expect_record(ForwardMode mode, std::optional<bool> record_kv, bool registered) {
    const bool want = record_kv.has_value() ? *record_kv : (!is_decode(mode) && !is_idle(mode));
    return want && registered;
}

// True when every new token of `b` is in the device pool (layer s.layer_id), as bf16.
bool new_kv_in_device_pool(const kv::MHATokenToKVPool& device, const Shape& s, const Batch& b) {
    auto mirror = make_pool(s, device.num_pages());
    if (!mirror || !copy_pool(device, *mirror).ok()) return false;
    const size_t kvw = s.kv_width();
    std::vector<float> got(kvw);
    for (size_t t = 0; t < b.locs.size(); ++t) {
        for (int buf = 0; buf < 2; ++buf) {
            mirror->read_token(s.layer_id, buf, b.locs[t], got.data());
            const float* want = (buf == 0 ? b.k.data() : b.v.data()) + t * kvw;
            for (size_t e = 0; e < kvw; ++e) {
                if (!(got[e] == want[e])) return false;
            }
        }
    }
    return true;
}

TEST_P(CudaRecordRule, RecordsOnceAfterTheKvIsInThePool) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const auto [mode, save_kv, record_kv, registered] = GetParam();
    const bool record = expect_record(mode, record_kv, registered);
    const Shape s = bf16_shape(8, 2, 64, 16);
    std::vector<Req> reqs;
    if (mode == ForwardMode::kDecode) reqs = {{40, 1}, {3, 1}};
    if (mode == ForwardMode::kExtend) reqs = {{40, 20}, {0, 17}};
    const Batch b = make_bf16_batch(s, mode, reqs, 3);
    PoolPair pools = make_pools(s, b, /*with_new=*/!save_kv);
    ASSERT_TRUE(pools.host && pools.device);
    CudaRunner r(s);
    ASSERT_OK(r.status());
    auto counter = StepCounter::create(r.stream(), 1000);
    ASSERT_TRUE(counter.ok()) << counter.status().to_string();
    if (registered) r.backend().register_step_counter(counter->get());
    const int64_t begin = (*counter)->advance_step(1);
    warm_up(r, s, b);
    ASSERT_OK(r.stage(b, save_kv));

    Gate gate;  // a host function holding the compute stream before the forward
    ASSERT_OK(gate.enqueue(r.stream()));
    ASSERT_OK(r.launch_staged(b, *pools.device, save_kv, record_kv));
    ASSERT_TRUE(gate.wait_reached());
    EXPECT_FALSE(StepCounter::is_step_ready((*counter)->query_ready_cache_step(), begin));
    if (save_kv && b.num_tokens > 0) {
        EXPECT_FALSE(new_kv_in_device_pool(*pools.device, s, b))
            << "KV written before the stream ran";
    }
    std::atomic<int> observer_result{-1};  // -1 not woken, 0 woke without the KV, 1 with it
    std::thread observer;
    if (record) {
        observer = std::thread([&] {
            if ((*counter)->wait_until_ready(begin, 30s).ok()) {
                observer_result = new_kv_in_device_pool(*pools.device, s, b) ? 1 : 0;
            }
        });
    }
    gate.release();
    if (observer.joinable()) observer.join();
    ASSERT_OK(r.wait());
    EXPECT_EQ((*counter)->records_published(), record ? 1u : 0u);
    EXPECT_EQ((*counter)->query_ready_cache_step(), record ? 1001 : 1000);
    if (record) {
        EXPECT_EQ(observer_result.load(), 1) << "a host woken by the record must see the KV";
    }
    EXPECT_TRUE(new_kv_in_device_pool(*pools.device, s, b));
    if (b.num_tokens > 0) {
        auto got = r.out();
        ASSERT_TRUE(got.ok());
        EXPECT_TRUE(outputs_close(*got, naive_attention(s, b), 1e-2, s, b));
    }
}

std::string rule_name(const ::testing::TestParamInfo<RuleParam>& info) {
    const auto [mode, save_kv, record_kv, registered] = info.param;
    const std::string rec = !record_kv.has_value() ? "unset" : (*record_kv ? "true" : "false");
    return std::string(forward_mode_name(mode)) + (save_kv ? "_save" : "_prewrite") + "_record_" +
           rec + (registered ? "_counter" : "_nocounter");
}

INSTANTIATE_TEST_SUITE_P(
    AllBranches, CudaRecordRule,
    ::testing::Combine(::testing::Values(ForwardMode::kExtend, ForwardMode::kDecode,
                                         ForwardMode::kIdle),
                       ::testing::Bool(),
                       ::testing::Values(std::optional<bool>(), std::optional<bool>(true),
                                         std::optional<bool>(false)),
                       ::testing::Bool()),
    rule_name);

// L layers of one extend forward: while the stream is held after layer l, exactly layers 0..l
// are ready and (save_kv) exactly their KV is in the pool.
TEST(CudaRecordPerLayer, OneRecordPerLayerAfterItsKvWrite) {
    SKIP_WITHOUT_CUDA_BACKEND();
    constexpr int kLayers = 4;
    for (bool save_kv : {true, false}) {
        SCOPED_TRACE(save_kv ? "save" : "prewrite");
        Shape base = bf16_shape(4, 2, 64, 16);
        base.num_layers = kLayers;
        std::vector<Shape> shapes;
        std::vector<Batch> batches;
        for (int l = 0; l < kLayers; ++l) {
            shapes.push_back(base);
            shapes.back().layer_id = l;
            Batch b = make_batch(shapes.back(), ForwardMode::kExtend, {{50, 30}, {0, 9}}, 21, 2, 0,
                                 0, 500 + static_cast<uint64_t>(l));
            round_to_bf16(b);
            batches.push_back(std::move(b));
        }
        auto host = make_pool(base, batches[0].num_pages);
        auto device = make_device_pool(base, batches[0].num_pages);
        ASSERT_TRUE(host && device);
        for (int l = 0; l < kLayers; ++l) init_pool(*host, shapes[l], batches[l], !save_kv, l == 0);
        ASSERT_OK(copy_pool(*host, *device));

        CudaRunner r(base);
        ASSERT_OK(r.status());
        warm_up(r, base, batches[0]);
        AttentionBackend& backend = r.backend();
        runtime::Stream& stream = r.stream();
        auto counter = StepCounter::create(stream, StepCounter::kCountMax - 2);  // crosses the wrap
        ASSERT_TRUE(counter.ok());
        backend.register_step_counter(counter->get());
        const int64_t begin = (*counter)->advance_step(kLayers);

        struct Views {
            DeviceBuffer q, k, v, locs, out;
        };
        std::vector<Views> views(kLayers);
        for (int l = 0; l < kLayers; ++l) {
            const Batch& b = batches[l];
            std::vector<bf16_t> q = to_bf16(b.q), k = to_bf16(b.k), v = to_bf16(b.v);
            if (!save_kv) {
                std::fill(k.begin(), k.end(), kNaNBits);
                std::fill(v.begin(), v.end(), kNaNBits);
            }
            auto qb = upload(q.data(), q.size() * 2), kb = upload(k.data(), k.size() * 2),
                 vb = upload(v.data(), v.size() * 2), lb = upload(b.locs.data(), b.locs.size() * 4);
            auto ob = DeviceBuffer::allocate(kGpu, q.size() * 2);
            ASSERT_TRUE(qb.ok() && kb.ok() && vb.ok() && lb.ok() && ob.ok());
            ASSERT_OK(ob->fill(0xFF));
            views[l] = {std::move(*qb), std::move(*kb), std::move(*vb), std::move(*lb),
                        std::move(*ob)};
        }
        Gate start;
        std::vector<std::unique_ptr<Gate>> gates;
        ASSERT_OK(start.enqueue(stream));
        ASSERT_OK(backend.init_forward_metadata(batches[0].forward_batch()));
        for (int l = 0; l < kLayers; ++l) {
            const Batch& b = batches[l];
            const Shape& sl = shapes[l];
            const int64_t n = b.num_tokens;
            ASSERT_OK(backend.forward(
                dev_rows(views[l].q, n, sl.num_q_heads, sl.head_dim),
                dev_rows(views[l].k, n, sl.num_kv_heads, sl.head_dim),
                dev_rows(views[l].v, n, sl.num_kv_heads, sl.head_dim), sl.layer(),
                dev_locs(views[l].locs, n), *device, ForwardMode::kExtend, b.bs,
                dev_rows_mut(views[l].out, n, sl.num_q_heads, sl.head_dim), save_kv));
            gates.push_back(std::make_unique<Gate>());
            ASSERT_OK(gates.back()->enqueue(stream));
        }
        EXPECT_FALSE(StepCounter::is_step_ready((*counter)->query_ready_cache_step(), begin));
        start.release();
        for (int l = 0; l < kLayers; ++l) {
            ASSERT_TRUE(gates[l]->wait_reached()) << "layer " << l;
            const int64_t ready = (*counter)->query_ready_cache_step();
            for (int m = 0; m < kLayers; ++m) {
                EXPECT_EQ(StepCounter::is_step_ready(ready, StepCounter::wrap(begin + m)), m <= l)
                    << "held after layer " << l << ": layer " << m;
                if (save_kv) {
                    EXPECT_EQ(new_kv_in_device_pool(*device, shapes[m], batches[m]), m <= l)
                        << "held after layer " << l << ": KV of layer " << m;
                }
            }
            EXPECT_EQ((*counter)->records_published(), static_cast<uint64_t>(l + 1));
            gates[l]->release();
        }
        ASSERT_OK(stream.synchronize(kSyncTimeout));
        EXPECT_EQ((*counter)->query_ready_cache_step(), StepCounter::wrap(begin + kLayers));
        for (int l = 0; l < kLayers; ++l) {
            std::vector<bf16_t> out(static_cast<size_t>(batches[l].num_tokens) * base.q_width());
            ASSERT_OK(views[l].out.copy_to_host(out.data(), out.size() * 2));
            EXPECT_TRUE(outputs_close(from_bf16(out), naive_attention(shapes[l], batches[l]), 1e-2,
                                      shapes[l], batches[l]))
                << "layer " << l;
        }
        backend.register_step_counter(nullptr);
    }
}

// ---- a copy on another stream, gated on the record, sees the KV -----------------------------
TEST(CudaGatedCopy, ACopyGatedOnTheRecordSeesTheKv) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(8, 2, 128, 16);
    const Batch b = make_bf16_batch(s, ForwardMode::kExtend, {{200, 300}, {0, 64}}, 71);
    for (bool gate_before_forward : {false, true}) {
        SCOPED_TRACE(gate_before_forward ? "gate before the forward (value wait)"
                                         : "gate after the forward (event)");
        if (gate_before_forward && !pd::cuda::device_value_wait_support(0).ok()) {
            std::printf("[ skipped ] value-wait gate: %s\n",
                        pd::cuda::device_value_wait_support(0).to_string().c_str());
            continue;
        }
        PoolPair pools = make_pools(s, b, false);
        ASSERT_TRUE(pools.host && pools.device);
        CudaRunner r(s);
        ASSERT_OK(r.status());
        auto other = cuda_runtime().create_stream(0, "cuda-copy");
        ASSERT_TRUE(other.ok());
        auto counter = StepCounter::create(r.stream());
        ASSERT_TRUE(counter.ok());
        r.backend().register_step_counter(counter->get());
        const int64_t begin = (*counter)->advance_step(1);
        auto native_other = runtime::cuda::native_stream(**other);
        ASSERT_TRUE(native_other.ok());
        const size_t bytes = buffer_bytes(*pools.device, s.layer_id, 0);
        auto copy_k = DeviceBuffer::allocate(kGpu, bytes);
        auto copy_v = DeviceBuffer::allocate(kGpu, bytes);
        ASSERT_TRUE(copy_k.ok() && copy_v.ok());

        warm_up(r, s, b);
        ASSERT_OK(r.stage(b, true));
        Gate hold;
        ASSERT_OK(hold.enqueue(r.stream()));
        auto enqueue_copy = [&]() {
            ASSERT_EQ(cudaMemcpyAsync(copy_k->data(), pools.device->data(s.layer_id, 0), bytes,
                                      cudaMemcpyDeviceToDevice, *native_other),
                      cudaSuccess);
            ASSERT_EQ(cudaMemcpyAsync(copy_v->data(), pools.device->data(s.layer_id, 1), bytes,
                                      cudaMemcpyDeviceToDevice, *native_other),
                      cudaSuccess);
        };
        pd::GatePath path;
        if (gate_before_forward) {
            auto p = (*counter)->gate(**other, begin);
            ASSERT_TRUE(p.ok()) << p.status().to_string();
            path = *p;
            enqueue_copy();
            ASSERT_OK(r.launch_staged(b, *pools.device, true));
        } else {
            ASSERT_OK(r.launch_staged(b, *pools.device, true));
            auto p = (*counter)->gate(**other, begin);
            ASSERT_TRUE(p.ok()) << p.status().to_string();
            path = *p;
            enqueue_copy();
        }
        EXPECT_EQ(path, gate_before_forward ? pd::GatePath::kValueWait : pd::GatePath::kEvent);
        ASSERT_TRUE(hold.wait_reached());
        std::this_thread::sleep_for(50ms);
        EXPECT_EQ(cudaStreamQuery(*native_other), cudaErrorNotReady)
            << "the gated copy ran before the record";
        hold.release();
        ASSERT_OK((*other)->synchronize(kSyncTimeout));
        // The copy holds the forward's KV: compare it as a pool.
        auto copied = make_pool(s, pools.device->num_pages());
        ASSERT_TRUE(copied);
        ASSERT_OK(copied->fill(0xFF));
        ASSERT_OK(copy_k->copy_to_host(copied->data(s.layer_id, 0), bytes));
        ASSERT_OK(copy_v->copy_to_host(copied->data(s.layer_id, 1), bytes));
        const size_t kvw = s.kv_width();
        std::vector<float> got(kvw);
        bool all = true;
        for (size_t t = 0; t < b.locs.size() && all; ++t) {
            for (int buf = 0; buf < 2 && all; ++buf) {
                copied->read_token(s.layer_id, buf, b.locs[t], got.data());
                const float* want = (buf == 0 ? b.k.data() : b.v.data()) + t * kvw;
                for (size_t e = 0; e < kvw; ++e) all = all && got[e] == want[e];
            }
        }
        EXPECT_TRUE(all) << "the gated copy missed KV the forward wrote";
        ASSERT_OK(r.wait());
    }
}

// ---- argument checks ------------------------------------------------------------------------
TEST(CudaBackendChecks, WhatTheBackendRefuses) {
    SKIP_WITHOUT_CUDA_BACKEND();
    const Shape s = bf16_shape(8, 2, 64, 16);
    const Batch b = make_bf16_batch(s, ForwardMode::kExtend, {{3, 2}, {0, 3}}, 81);
    PoolPair pools = make_pools(s, b, false);
    ASSERT_TRUE(pools.host && pools.device);
    CudaRunner r(s);
    ASSERT_OK(r.status());
    auto counter = StepCounter::create(r.stream());
    ASSERT_TRUE(counter.ok());
    r.backend().register_step_counter(counter->get());
    const BackendCapabilities caps = r.backend().capabilities();
    EXPECT_EQ(caps.activation_dtypes, std::vector<DType>{DType::kBF16});
    EXPECT_EQ(caps.kv_dtypes, std::vector<DType>{DType::kBF16});
    EXPECT_EQ(caps.devices, std::vector<runtime::DeviceKind>{runtime::DeviceKind::kCuda});

    // A forward before any metadata.
    ASSERT_OK(r.stage(b, true));
    EXPECT_EQ(r.forward(b, *pools.device, true).code(), StatusCode::kFailedPrecondition);
    // Rows that are not the batch's: nothing recorded, nothing written.
    ASSERT_OK(r.backend().init_forward_metadata(b.forward_batch()));
    Batch short_batch = b;
    short_batch.num_tokens = b.num_tokens - 1;
    short_batch.q.resize(static_cast<size_t>(short_batch.num_tokens) * s.q_width());
    short_batch.k.resize(static_cast<size_t>(short_batch.num_tokens) * s.kv_width());
    short_batch.v.resize(short_batch.k.size());
    short_batch.locs.pop_back();
    ASSERT_OK(r.stage(short_batch, true));
    Status st = r.forward(b, *pools.device, true);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr("q: shape [4, 8, 64], expected [5, 8, 64]"));
    ASSERT_OK(r.wait());
    EXPECT_EQ((*counter)->records_published(), 0u);
    EXPECT_TRUE(device_pool_equals(*pools.device, *pools.host, s)) << "a refused forward wrote KV";
    // Host views.
    std::vector<float> hq(b.q), hk(b.k), hv(b.v), hout(b.q.size());
    st = forward_host(r.backend(), hq.data(), hk.data(), hv.data(), s.layer(), b.locs.data(),
                      b.num_tokens, *pools.device, b.mode, b.bs, hout.data());
    EXPECT_THAT(st.message(), HasSubstr("q: dtype fp32, backend 'cuda' accepts bf16"));
    // A layer of another shape.
    ASSERT_OK(r.stage(b, true));
    LayerSpec wide = s.layer();
    wide.head_dim = 128;
    // (the base class checks the views against the layer first: give it matching views)
    auto q128 = DeviceBuffer::allocate(kGpu, static_cast<size_t>(b.num_tokens) * 8 * 128 * 2);
    auto kv128 = DeviceBuffer::allocate(kGpu, static_cast<size_t>(b.num_tokens) * 2 * 128 * 2);
    auto locs = upload(b.locs.data(), b.locs.size() * 4);
    ASSERT_TRUE(q128.ok() && kv128.ok() && locs.ok());
    const int64_t n = b.num_tokens;
    st = r.backend().forward(dev_rows(*q128, n, 8, 128), dev_rows(*kv128, n, 2, 128),
                             dev_rows(*kv128, n, 2, 128), wide, dev_locs(*locs, n), *pools.device,
                             b.mode, b.bs, dev_rows_mut(*q128, n, 8, 128));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("the cuda backend was configured for 8, 2, 64/64"));
    // fp32 KV: refused at creation and per forward.
    Shape f32 = s;
    f32.dtype = kv::KVDtype::kF32;
    auto made = create_attention_backend("cuda", config_for(f32, r.stream()));
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(made.status().message(), HasSubstr("config.kv_dtype fp32, it accepts bf16"));
    auto f32_pool = make_device_pool(f32, 4);
    ASSERT_TRUE(f32_pool);
    st = r.forward(b, *f32_pool, true);
    EXPECT_THAT(st.message(), HasSubstr("pool: dtype fp32, backend 'cuda' accepts bf16"));
    // MLA's absorbed shape (one latent head of 512 + 64, values of 512) is not built (and MLA
    // pools are refused per forward: cuda_attention_plan_test).
    AttentionConfig mla_config = config_for(s, r.stream());
    mla_config.num_kv_heads = 1;
    mla_config.head_dim = 576;
    mla_config.v_head_dim = 512;
    EXPECT_EQ(create_attention_backend("cuda", mla_config).status().code(),
              StatusCode::kUnimplemented);
    // A non-CUDA stream.
    runtime::CpuStream cpu("cpu");
    made = create_attention_backend("cuda", config_for(s, cpu));
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(made.status().message(), HasSubstr("not a CUDA stream"));
    ASSERT_OK(r.wait());
    EXPECT_EQ((*counter)->records_published(), 0u);
}

}  // namespace
}  // namespace pdsim::attn::test
