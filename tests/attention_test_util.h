// Shared helpers of the attention backend tests (cpu_attention_test, attention_backend_test,
// attention_graph_test): random paged batches, KV pools poisoned with NaN, fp32 host views of test
// buffers (forward_host), a runner that drives a backend from the registry on its own CpuStream,
// output and pool comparisons with readable failure messages, a naive fp64 oracle independent of
// every backend, and a stream gate.
//
// Poisoning. Pools are filled with 0xFF bytes (NaN in fp32 and bf16) and then only the KV a batch
// legitimately owns is written, into layer Shape::layer_id; the other layers, page 0, a "trap"
// page that the unused tail of every page-table row points to, and the slots past seq_len in each
// request's last page all stay NaN. A kernel that reads anything it should not (a wrong layer,
// a page-table entry past the request's pages, a slot past seq_len, even with a zero softmax
// weight) produces NaN and fails the comparison. Output buffers are NaN before every run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/cpu_stream.h"
#include "backends/runtime/device.h"
#include "backends/runtime/tensor.h"
#include "common/bf16.h"
#include "tests/host_backed_cuda_runtime.h"

namespace pdsim::attn::test {

inline constexpr std::chrono::milliseconds kSyncTimeout{300'000};
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Static shape of the layer under test and of its pool.
struct Shape {
    int num_q_heads = 1;
    int num_kv_heads = 1;
    int head_dim = 64;
    int page_size = 16;
    kv::KVDtype dtype = kv::KVDtype::kF32;
    int num_layers = 2;
    int layer_id = 1;     // the layer the forwards run on; the other layers stay NaN
    float scaling = 0.f;  // 0: 1/sqrt(head_dim)

    [[nodiscard]] LayerSpec layer() const {
        return LayerSpec{layer_id, num_q_heads, num_kv_heads, head_dim, 0, scaling};
    }
    [[nodiscard]] size_t kv_width() const {
        return static_cast<size_t>(num_kv_heads) * static_cast<size_t>(head_dim);
    }
    [[nodiscard]] size_t q_width() const {
        return static_cast<size_t>(num_q_heads) * static_cast<size_t>(head_dim);
    }
    [[nodiscard]] std::string describe() const {
        std::ostringstream os;
        os << "q_heads=" << num_q_heads << " kv_heads=" << num_kv_heads << " head_dim=" << head_dim
           << " page_size=" << page_size << " kv=" << kv::dtype_name(dtype)
           << " scaling=" << (scaling > 0.f ? std::to_string(scaling) : "default");
        return os.str();
    }
};

// One request: `prefix` cached KV tokens, then `new_tokens` new ones (its queries).
struct Req {
    int prefix = 0;
    int new_tokens = 1;
};

// A batch and all of its data. Request i's logical KV is req_k[i] / req_v[i]
// ([seq_len][kv_heads * head_dim] floats, not rounded); its last extend_lens[i] tokens are new.
struct Batch {
    ForwardMode mode = ForwardMode::kExtend;
    int bs = 0;
    std::vector<int32_t> seq_lens, extend_lens, page_table;
    int stride = 0;
    int num_pages = 0;  // pool pages this batch needs: null page 0, the trap page, data, spares
    int trap_page = 0;
    int num_tokens = 0;
    std::vector<float> q, k, v;  // new tokens, in batch order
    std::vector<int32_t> locs;   // out_cache_loc of the new tokens
    std::vector<std::vector<float>> req_k, req_v;

    [[nodiscard]] ForwardBatch forward_batch() const {
        ForwardBatch fb;
        fb.mode = mode;
        fb.bs = bs;
        fb.seq_lens = seq_lens;
        if (mode != ForwardMode::kDecode) fb.extend_lens = extend_lens;
        fb.page_table = page_table;
        fb.page_table_stride = stride;
        return fb;
    }
    [[nodiscard]] int64_t slot(int i, int t, int page_size) const {
        const int32_t page = page_table[static_cast<size_t>(i) * static_cast<size_t>(stride) +
                                        static_cast<size_t>(t / page_size)];
        return static_cast<int64_t>(page) * page_size + t % page_size;
    }
    [[nodiscard]] std::string describe() const {
        std::ostringstream os;
        os << forward_mode_name(mode) << " bs=" << bs << " (prefix+new):";
        for (int i = 0; i < bs; ++i) {
            os << (i ? "," : " ")
               << seq_lens[static_cast<size_t>(i)] - extend_lens[static_cast<size_t>(i)] << "+"
               << extend_lens[static_cast<size_t>(i)];
        }
        return os.str();
    }
};

// Builds a random batch. Pages are a shuffled permutation of [1, pool_pages) (non-contiguous page
// tables); the unused tail of each page-table row (`extra_stride` entries at least) points to the
// trap page. pool_pages = 0: just enough for this batch (+ spares).
// data_seed (0: seed) draws q, k, v only, so batches that share `seed` share their layout.
inline Batch make_batch(const Shape& s, ForwardMode mode, const std::vector<Req>& reqs,
                        uint64_t seed, int extra_stride = 2, int pool_pages = 0, int min_stride = 0,
                        uint64_t data_seed = 0) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    Batch b;
    b.mode = mode;
    b.bs = static_cast<int>(reqs.size());
    const int ps = s.page_size;
    int data_pages = 0, max_pages = 0;
    for (const Req& r : reqs) {
        const int seq = r.prefix + r.new_tokens;
        b.seq_lens.push_back(seq);
        b.extend_lens.push_back(r.new_tokens);
        const int n = (seq + ps - 1) / ps;
        data_pages += n;
        max_pages = std::max(max_pages, n);
        b.num_tokens += r.new_tokens;
    }
    b.stride = std::max(max_pages + extra_stride, min_stride);
    b.num_pages = std::max(pool_pages, data_pages + 2 + 3);
    std::vector<int32_t> perm(static_cast<size_t>(b.num_pages - 1));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i + 1);
    std::shuffle(perm.begin(), perm.end(), rng);
    b.trap_page = perm[0];
    size_t next = 1;
    b.page_table.assign(static_cast<size_t>(b.bs) * static_cast<size_t>(b.stride), b.trap_page);
    for (int i = 0; i < b.bs; ++i) {
        const int n = (b.seq_lens[static_cast<size_t>(i)] + ps - 1) / ps;
        for (int p = 0; p < n; ++p) {
            b.page_table[static_cast<size_t>(i) * static_cast<size_t>(b.stride) +
                         static_cast<size_t>(p)] = perm.at(next++);
        }
    }
    const size_t kvw = s.kv_width();
    if (data_seed != 0) rng.seed(data_seed);
    for (int i = 0; i < b.bs; ++i) {
        const size_t seq = static_cast<size_t>(b.seq_lens[static_cast<size_t>(i)]);
        std::vector<float> k(seq * kvw), v(seq * kvw);
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        b.req_k.push_back(std::move(k));
        b.req_v.push_back(std::move(v));
    }
    b.q.resize(static_cast<size_t>(b.num_tokens) * s.q_width());
    for (auto& x : b.q) x = nd(rng);
    for (int i = 0; i < b.bs; ++i) {
        const int seq = b.seq_lens[static_cast<size_t>(i)];
        const int ql = b.extend_lens[static_cast<size_t>(i)];
        for (int t = seq - ql; t < seq; ++t) {
            b.locs.push_back(static_cast<int32_t>(b.slot(i, t, ps)));
            const auto& rk = b.req_k[static_cast<size_t>(i)];
            const auto& rv = b.req_v[static_cast<size_t>(i)];
            b.k.insert(b.k.end(), rk.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(t) * kvw),
                       rk.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(t + 1) * kvw));
            b.v.insert(b.v.end(), rv.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(t) * kvw),
                       rv.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(t + 1) * kvw));
        }
    }
    return b;
}

// The host-backed "CUDA" runtime (tests/host_backed_cuda_runtime.h), under its old names here.
using runtime::testing::HostBackedCudaRuntime;
using runtime::testing::install_host_backed_cuda_runtime;

// fp32 host views [tokens][heads][dim] of test buffers (a null pointer gives a null view).
inline runtime::ConstTensorView rows_view(const float* p, int64_t tokens, int heads, int dim) {
    return runtime::host_view(p, {tokens, heads, dim});
}
inline runtime::TensorView rows_view(float* p, int64_t tokens, int heads, int dim) {
    return runtime::host_view(p, {tokens, heads, dim});
}
inline runtime::ConstTensorView locs_view(const int32_t* p, int64_t tokens) {
    return runtime::host_view(p, {tokens});
}

// forward() over fp32 host buffers of `tokens` rows shaped by `layer` (q, k, v, out as in
// attention_backend.h; null pointers become null views).
inline Status forward_host(AttentionBackend& backend, const float* q, const float* k,
                           const float* v, const LayerSpec& layer, const int32_t* locs,
                           int64_t tokens, kv::KVPool& pool, ForwardMode mode, int bs, float* out,
                           bool save_kv_cache = true,
                           std::optional<bool> record_kv_cache = std::nullopt) {
    const int dv = v_dim(layer);
    return backend.forward(
        rows_view(q, tokens, layer.num_q_heads, layer.head_dim),
        rows_view(k, tokens, layer.num_kv_heads, layer.head_dim),
        rows_view(v, tokens, layer.num_kv_heads, dv), layer, locs_view(locs, tokens), pool, mode,
        bs, rows_view(out, tokens, layer.num_q_heads, dv), save_kv_cache, record_kv_cache);
}

// A pool of shape `s` on `device` (host memory by default); null, with a test failure, when the
// pool cannot be created.
inline std::unique_ptr<kv::MHATokenToKVPool> make_pool(const Shape& s, int num_pages,
                                                       runtime::Device device = {}) {
    kv::MHAPoolConfig pc;
    pc.num_layers = s.num_layers;
    pc.num_pages = num_pages;
    pc.page_size = s.page_size;
    pc.num_kv_heads = s.num_kv_heads;
    pc.head_dim = s.head_dim;
    pc.dtype = s.dtype;
    pc.device = device;
    auto pool = kv::MHATokenToKVPool::create(pc);
    if (!pool.ok()) {
        ADD_FAILURE() << "pool: " << pool.status().to_string();
        return nullptr;
    }
    return std::move(pool).value();
}

// Poisons the whole pool, then writes the batch's cached prefix (and, with `with_new`, its new
// tokens: the prewrite of save_kv_cache = false) into layer s.layer_id. Host-side: the pool's
// stream must be idle.
inline void init_pool(kv::MHATokenToKVPool& pool, const Shape& s, const Batch& b, bool with_new,
                      bool poison = true) {
    if (poison) {
        ASSERT_TRUE(pool.fill(0xFF).ok());
    }
    const size_t kvw = s.kv_width();
    for (int i = 0; i < b.bs; ++i) {
        const int seq = b.seq_lens[static_cast<size_t>(i)];
        const int end = with_new ? seq : seq - b.extend_lens[static_cast<size_t>(i)];
        for (int t = 0; t < end; ++t) {
            const int64_t slot = b.slot(i, t, s.page_size);
            pool.write_token(s.layer_id, 0, slot,
                             b.req_k[static_cast<size_t>(i)].data() + static_cast<size_t>(t) * kvw);
            pool.write_token(s.layer_id, 1, slot,
                             b.req_v[static_cast<size_t>(i)].data() + static_cast<size_t>(t) * kvw);
        }
    }
}

// Byte-compares every buffer of two pools of the same shape; names the first differing slot.
inline ::testing::AssertionResult pools_equal(const kv::MHATokenToKVPool& got,
                                              const kv::MHATokenToKVPool& want) {
    for (int l = 0; l < want.num_layers(); ++l) {
        for (int buf = 0; buf < 2; ++buf) {
            const size_t tb = want.token_bytes(l, buf);
            const size_t slots =
                static_cast<size_t>(want.num_pages()) * static_cast<size_t>(want.page_size());
            const auto* g = static_cast<const uint8_t*>(got.data(l, buf));
            const auto* w = static_cast<const uint8_t*>(want.data(l, buf));
            if (std::memcmp(g, w, tb * slots) == 0) continue;
            for (size_t sl = 0; sl < slots; ++sl) {
                if (std::memcmp(g + sl * tb, w + sl * tb, tb) != 0) {
                    std::vector<float> gv(static_cast<size_t>(want.token_elems(buf)));
                    std::vector<float> wv(gv.size());
                    got.read_token(l, buf, static_cast<int64_t>(sl), gv.data());
                    want.read_token(l, buf, static_cast<int64_t>(sl), wv.data());
                    size_t e = 0;
                    while (e < gv.size() && std::memcmp(&gv[e], &wv[e], 4) == 0) ++e;
                    return ::testing::AssertionFailure()
                           << "KV pool differs: layer " << l << " " << (buf == 0 ? "K" : "V")
                           << " slot " << sl << " (page "
                           << sl / static_cast<size_t>(want.page_size()) << " offset "
                           << sl % static_cast<size_t>(want.page_size()) << ") element " << e
                           << ": got " << (e < gv.size() ? gv[e] : 0.f) << ", want "
                           << (e < wv.size() ? wv[e] : 0.f) << " (NaN = poison, never written)";
                }
            }
        }
    }
    return ::testing::AssertionSuccess();
}

// Element-wise: |got - ref| <= tol * max(1, |ref|), NaN never passes. Names the first few
// mismatching (request, query position, head, element) and the worst error.
inline ::testing::AssertionResult outputs_close(const std::vector<float>& got,
                                                const std::vector<float>& ref, double tol,
                                                const Shape& s, const Batch& b) {
    if (got.size() != ref.size()) {
        return ::testing::AssertionFailure()
               << "output sizes differ: " << got.size() << " vs " << ref.size();
    }
    const size_t d = static_cast<size_t>(s.head_dim);
    const size_t hq = static_cast<size_t>(s.num_q_heads);
    std::vector<int> req_of_token, pos_of_token;
    for (int i = 0; i < b.bs; ++i) {
        for (int j = 0; j < b.extend_lens[static_cast<size_t>(i)]; ++j) {
            req_of_token.push_back(i);
            pos_of_token.push_back(b.seq_lens[static_cast<size_t>(i)] -
                                   b.extend_lens[static_cast<size_t>(i)] + j);
        }
    }
    size_t bad = 0;
    double worst = 0.0;
    std::ostringstream first;
    for (size_t idx = 0; idx < got.size(); ++idx) {
        const double g = got[idx], r = ref[idx];
        const double err = std::fabs(g - r);
        const bool ok =
            std::isfinite(g) && std::isfinite(r) && err <= tol * std::max(1.0, std::fabs(r));
        if (!ok) {
            if (bad < 5) {
                const size_t token = idx / (hq * d);
                const size_t h = (idx / d) % hq;
                first << "\n  token " << token << " (request " << req_of_token.at(token)
                      << ", position " << pos_of_token.at(token) << " of seq_len "
                      << b.seq_lens[static_cast<size_t>(req_of_token.at(token))] << ") head " << h
                      << " elem " << idx % d << ": got " << g << ", ref " << r;
            }
            ++bad;
        }
        if (!std::isfinite(err)) {
            worst = std::numeric_limits<double>::infinity();
        } else {
            worst = std::max(worst, err / std::max(1.0, std::fabs(r)));
        }
    }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << bad << " of " << got.size() << " output elements outside |got-ref| <= " << tol
           << " * max(1, |ref|); worst " << worst << first.str();
}

// Drives one backend from the registry on its own CpuStream.
class Runner {
public:
    Runner(const std::string& backend, const Shape& s, int num_threads = 0)
        : shape_(s), stream_(backend + "-stream") {
        AttentionConfig c;
        c.num_q_heads = s.num_q_heads;
        c.num_kv_heads = s.num_kv_heads;
        c.head_dim = s.head_dim;
        c.kv_dtype = s.dtype;
        c.stream = &stream_;
        c.num_threads = num_threads;
        auto b = create_attention_backend(backend, c);
        if (!b.ok()) {
            create_status_ = b.status();
        } else {
            backend_ = std::move(b).value();
        }
    }
    // Work still queued (an early test exit) may point at the backend's metadata: drain first.
    ~Runner() { stream_.synchronize(kSyncTimeout).ignore_error(); }
    Runner(const Runner&) = delete;
    Runner& operator=(const Runner&) = delete;

    [[nodiscard]] const Status& create_status() const { return create_status_; }
    [[nodiscard]] AttentionBackend& backend() { return *backend_; }
    [[nodiscard]] runtime::CpuStream& stream() { return stream_; }
    [[nodiscard]] std::vector<float>& out() { return out_; }

    // init_forward_metadata + forward (not waited for). With save_kv == false the k/v handed to
    // the backend are NaN decoys: a backend that writes or reads them anyway is caught.
    [[nodiscard]] Status launch(const Batch& b, kv::MHATokenToKVPool& pool, bool save_kv,
                                std::optional<bool> record = std::nullopt) {
        PDSIM_RETURN_IF_ERROR(create_status_);
        out_.assign(static_cast<size_t>(b.num_tokens) * shape_.q_width(), kNaN);
        decoy_k_.assign(b.k.size(), kNaN);
        decoy_v_.assign(b.v.size(), kNaN);
        PDSIM_RETURN_IF_ERROR(backend_->init_forward_metadata(b.forward_batch()));
        return forward_host(*backend_, b.q.data(), save_kv ? b.k.data() : decoy_k_.data(),
                            save_kv ? b.v.data() : decoy_v_.data(), shape_.layer(), b.locs.data(),
                            b.num_tokens, pool, b.mode, b.bs, out_.data(), save_kv, record);
    }
    [[nodiscard]] Status wait() { return stream_.synchronize(kSyncTimeout); }
    [[nodiscard]] Status run(const Batch& b, kv::MHATokenToKVPool& pool, bool save_kv) {
        PDSIM_RETURN_IF_ERROR(launch(b, pool, save_kv));
        return wait();
    }

private:
    Shape shape_;
    runtime::CpuStream stream_;
    Status create_status_;
    std::unique_ptr<AttentionBackend> backend_;
    std::vector<float> out_, decoy_k_, decoy_v_;
};

inline float round_bf16(float x) {
    // Round to nearest even, independent of common/bf16.h (finite inputs only).
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    float y;
    std::memcpy(&y, &u, 4);
    return y;
}

// The naive fp64 oracle, from the batch's logical data (no pool, no page table): query j of
// request i sits at position seq_len - q_len + j and attends keys 0..position (with a sliding
// window W > 0, keys max(0, position - W + 1)..position); query head h reads KV head
// h / (q_heads / kv_heads). bf16 pools: K and V rounded to bf16 first.
inline std::vector<float> naive_attention(const Shape& s, const Batch& b, int window = 0) {
    const int hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
    const double scale = s.scaling > 0.f ? s.scaling : 1.0 / std::sqrt(static_cast<double>(d));
    const bool bf = s.dtype == kv::KVDtype::kBF16;
    std::vector<float> out(static_cast<size_t>(b.num_tokens) * s.q_width());
    int token = 0;
    for (int i = 0; i < b.bs; ++i) {
        const int seq = b.seq_lens[static_cast<size_t>(i)],
                  ql = b.extend_lens[static_cast<size_t>(i)];
        auto kv_at = [&](const std::vector<float>& a, int t, int h, int e) -> double {
            const float x = a[(static_cast<size_t>(t) * hkv + h) * d + e];
            return bf ? round_bf16(x) : x;
        };
        for (int j = 0; j < ql; ++j, ++token) {
            const int pos = seq - ql + j;
            const int lo = window > 0 ? std::max(0, pos - window + 1) : 0;
            for (int h = 0; h < hq; ++h) {
                const int kh = h / (hq / hkv);
                const float* qv = &b.q[(static_cast<size_t>(token) * hq + h) * d];
                std::vector<double> sc(static_cast<size_t>(pos - lo) + 1);
                double mx = -1e300;
                for (int t = lo; t <= pos; ++t) {
                    double dot = 0;
                    for (int e = 0; e < d; ++e)
                        dot += qv[e] * kv_at(b.req_k[static_cast<size_t>(i)], t, kh, e);
                    sc[static_cast<size_t>(t - lo)] = dot * scale;
                    mx = std::max(mx, sc[static_cast<size_t>(t - lo)]);
                }
                double sum = 0;
                for (auto& x : sc) sum += (x = std::exp(x - mx));
                for (int e = 0; e < d; ++e) {
                    double acc = 0;
                    for (int t = lo; t <= pos; ++t) {
                        acc += sc[static_cast<size_t>(t - lo)] *
                               kv_at(b.req_v[static_cast<size_t>(i)], t, kh, e);
                    }
                    out[(static_cast<size_t>(token) * hq + h) * d + e] =
                        static_cast<float>(acc / sum);
                }
            }
        }
    }
    return out;
}

// A stream task that blocks until released: holds the stream so the host can look at the state
// "before" the work queued behind it runs. Releasing is idempotent; the destructor releases, and
// the task gives up (failing the stream) after `max_hold`, so a failing test never hangs.
class Gate {
public:
    explicit Gate(std::chrono::milliseconds max_hold = std::chrono::milliseconds(60'000))
        : st_(std::make_shared<State>()), max_hold_(max_hold) {}
    ~Gate() { release(); }
    Gate(const Gate&) = delete;
    Gate& operator=(const Gate&) = delete;

    [[nodiscard]] Status enqueue(runtime::Stream& stream) {
        auto st = st_;
        auto hold = max_hold_;
        return stream.enqueue([st, hold] {
            std::unique_lock<std::mutex> lock(st->mu);
            st->reached = true;
            st->cv.notify_all();
            if (!st->cv.wait_for(lock, hold, [&] { return st->released; })) {
                return Status(StatusCode::kDeadlineExceeded, "test gate never released");
            }
            return Status();
        });
    }
    void release() {
        {
            std::lock_guard<std::mutex> lock(st_->mu);
            st_->released = true;
        }
        st_->cv.notify_all();
    }
    // True once the stream has reached the gate (waits up to `timeout`).
    [[nodiscard]] bool wait_reached(
        std::chrono::milliseconds timeout = std::chrono::milliseconds(30'000)) {
        std::unique_lock<std::mutex> lock(st_->mu);
        return st_->cv.wait_for(lock, timeout, [&] { return st_->reached; });
    }

private:
    struct State {
        std::mutex mu;
        std::condition_variable cv;
        bool reached = false;
        bool released = false;
    };
    std::shared_ptr<State> st_;
    std::chrono::milliseconds max_hold_;
};

}  // namespace pdsim::attn::test
