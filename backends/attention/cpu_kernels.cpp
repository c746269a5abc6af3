#include "backends/attention/cpu_kernels.h"

// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsics (they start from
// _mm512_undefined_*); the locations are in the header, so silence it for the header only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#include "backends/attention/cpu_kernel_common.h"
#include "common/bf16.h"

namespace pdsim::attn::cpu {

// First key the query at position `pos` attends: pos - W + 1 (at least 0) with a window W > 0,
// else 0.
inline int window_start(int pos, int window) {
    return window > 0 ? std::max(0, pos - window + 1) : 0;
}

// Per-worker scratch: a few independent 64-byte-aligned buffers, grown on demand (contents are
// unspecified after growth), reused across calls so a steady state allocates nothing.
struct CpuAttentionKernels::Scratch {
    static constexpr int kSlots = 2;

    float* floats(size_t n, int slot = 0) { return grow(f_[slot], fcap_[slot], n); }
    int32_t* ints(size_t n) { return grow(i_, icap_, n); }
    int64_t* slots(size_t n) { return grow(l_, lcap_, n); }

private:
    struct Free {
        void operator()(void* p) const { std::free(p); }
    };
    template <typename T>
    static T* grow(std::unique_ptr<T[], Free>& buf, size_t& cap, size_t n) {
        if (n > cap) {
            size_t bytes = (std::max<size_t>(n, 16) * sizeof(T) + 63) / 64 * 64;
            buf.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
            cap = bytes / sizeof(T);
        }
        return buf.get();
    }
    std::unique_ptr<float[], Free> f_[kSlots];
    size_t fcap_[kSlots] = {};
    std::unique_ptr<int32_t[], Free> i_;
    size_t icap_ = 0;
    std::unique_ptr<int64_t[], Free> l_;
    size_t lcap_ = 0;
};

AttnProblem make_problem(const ForwardArgs& args, const BatchView& view) {
    const kv::KVPool& pool = *args.pool;
    AttnProblem p;
    p.view = view;
    p.q = args.q.as<float>();
    p.out = args.out.as<float>();
    p.k_cache = pool.data(args.layer.layer_id, 0);
    p.v_cache = pool.data(args.layer.layer_id, 1);
    p.kv_dtype = pool.dtype();
    p.page_size = pool.page_size();
    p.num_q_heads = args.layer.num_q_heads;
    p.num_kv_heads = args.layer.num_kv_heads;
    p.head_dim = args.layer.head_dim;
    p.v_head_dim = v_dim(args.layer);
    p.scale = layer_scaling(args.layer);
    p.sliding_window = args.layer.sliding_window;
    return p;
}

namespace {

using Scratch = CpuAttentionKernels::Scratch;

constexpr float kLog2e = 1.4426950408889634f;

// Query tokens [j0, j1) of request req against KV head kh (extend kernel).
struct ExtendTask {
    int req, kh, j0, j1;
};
// KV tokens [t0, t1) of decode request req; the unnormalized result goes to m, l, acc.
struct DecodeTask {
    int req, t0, t1;
    float* m;
    float* l;
    float* acc;
};

}  // namespace

// ---- ISA-specific kernels (cpu_kernels_isa.inc, once per ISA) -----------------------------------
// The target pragmas apply to every function defined in the region and to nothing else; the
// anonymous namespaces keep each ISA's copies internal to this file. The blocking constants are
// per ISA: AVX2 has 16 vector registers (S tile 3x4, PV tile 3x4 vectors), AVX-512 32 (2x8, 2x8).
// (GCC: push_options/target. Clang ignores those and takes `#pragma clang attribute` instead.)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace {
namespace k_avx2 {
#define PDSIM_ISA_AVX512 0
constexpr int kMR = 3, kNR = 4, kNE = 4, kBc = 48, kPanels = 3;
#include "backends/attention/cpu_kernels_isa.inc"
#undef PDSIM_ISA_AVX512
}  // namespace k_avx2
}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
#endif
namespace {
namespace k_avx512 {
#define PDSIM_ISA_AVX512 1
constexpr int kMR = 2, kNR = 8, kNE = 8, kBc = 64, kPanels = 2;
#include "backends/attention/cpu_kernels_isa.inc"
#undef PDSIM_ISA_AVX512
}  // namespace k_avx512
}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace {

// Scalar fallback (CPUs without AVX2): the extend work item with plain loops, fp32 accumulation,
// two passes over the keys per query row (keys [lo, pos]: its window, or every key up to pos; the
// row's own key is always among them, so its max is finite).
template <typename KT>
void scalar_extend_item_t(const AttnProblem& p, const ExtendTask& t, Scratch& s) {
    const BatchView& view = p.view;
    const int H = p.num_q_heads, Hkv = p.num_kv_heads, G = H / Hkv, d = p.head_dim,
              dv = p.v_head_dim;
    const int seq = view.seq_lens[t.req], ql = view.q_lens[t.req];
    const KT* kc = static_cast<const KT*>(p.k_cache);
    const KT* vc = static_cast<const KT*>(p.v_cache);
    auto f = [](KT x) {
        if constexpr (std::is_same_v<KT, float>)
            return x;
        else
            return bf16_to_float(x);
    };
    float* sc = s.floats(static_cast<size_t>(seq) + static_cast<size_t>(dv));
    float* acc = sc + seq;
    for (int j = t.j0; j < t.j1; ++j) {
        const int pos = seq - ql + j;
        const int lo = window_start(pos, p.sliding_window);
        const int tok = view.q_start[t.req] + j;
        for (int g = 0; g < G; ++g) {
            const int h = t.kh * G + g;
            const float* qv = p.q + (static_cast<size_t>(tok) * H + h) * d;
            float mx = -std::numeric_limits<float>::infinity();
            for (int k = lo; k <= pos; ++k) {
                const KT* kr =
                    kc +
                    (static_cast<size_t>(kv_slot(view, t.req, k, p.page_size)) * Hkv + t.kh) * d;
                float dot = 0.f;
                for (int e = 0; e < d; ++e) dot += qv[e] * f(kr[e]);
                sc[k] = dot * p.scale;
                mx = std::max(mx, sc[k]);
            }
            float sum = 0.f;
            std::fill_n(acc, dv, 0.f);
            for (int k = lo; k <= pos; ++k) {
                const float w = std::exp(sc[k] - mx);
                sum += w;
                const KT* vr =
                    vc +
                    (static_cast<size_t>(kv_slot(view, t.req, k, p.page_size)) * Hkv + t.kh) * dv;
                for (int e = 0; e < dv; ++e) acc[e] += w * f(vr[e]);
            }
            float* o = p.out + (static_cast<size_t>(tok) * H + h) * dv;
            for (int e = 0; e < dv; ++e) o[e] = acc[e] / sum;
        }
    }
}

void scalar_extend_item(const AttnProblem& p, const ExtendTask& t, Scratch& s) {
    if (p.kv_dtype == kv::KVDtype::kBF16) {
        scalar_extend_item_t<bf16_t>(p, t, s);
    } else {
        scalar_extend_item_t<float>(p, t, s);
    }
}

// One unit of scheduled work. Items are sorted by estimated cost (largest first) and claimed one
// at a time by the workers, so the causal tiles (whose cost grows with position) balance.
struct WorkItem {
    double cost;
    bool decode;
    int req;
    int a, b;       // decode: KV tokens [a, b); extend: query tokens [a, b)
    int kh;         // extend: KV head
    int64_t state;  // decode: offset of (m, l, acc) in partials_, or -1 (single chunk: scratch)
};

// Heads padded to the decode kernel's 8-head blocks.
int padded_heads(int h) {
    return (h + 7) / 8 * 8;
}

}  // namespace

std::string_view isa_name(Isa isa) {
    switch (isa) {
        case Isa::kScalar:
            return "scalar";
        case Isa::kAvx2:
            return "avx2";
        case Isa::kAvx512:
            return "avx512";
    }
    return "unknown";
}

Isa detect_isa() {
    __builtin_cpu_init();
    Isa best = Isa::kScalar;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
    if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl")) {
        best = Isa::kAvx512;
    }
    if (const char* env = std::getenv("PDSIM_CPU_ISA")) {
        const std::string want(env);
        Isa asked = best;
        if (want == "scalar") asked = Isa::kScalar;
        if (want == "avx2") asked = Isa::kAvx2;
        if (want == "avx512") asked = Isa::kAvx512;
        best = std::min(best, asked);
    }
    return best;
}

CpuAttentionKernels::CpuAttentionKernels(int num_threads, Isa isa)
    : isa_(std::min(isa, detect_isa())), pool_(std::make_unique<ThreadPool>(num_threads)) {
    for (int i = 0; i < pool_->size(); ++i) scratch_.push_back(std::make_unique<Scratch>());
}

CpuAttentionKernels::~CpuAttentionKernels() = default;

void CpuAttentionKernels::run(const AttnProblem& p) {
    const BatchView& view = p.view;
    if (view.bs <= 0 || view.num_tokens <= 0) return;
    const int H = p.num_q_heads, Hkv = p.num_kv_heads, G = H / Hkv;
    const int d = p.head_dim, dv = p.v_head_dim, Hp = padded_heads(H);
    const int threads = pool_->size();
    // Decode kernel: the widest ISA whose vector width divides both head dims; otherwise the
    // extend kernel takes the q_len == 1 requests too.
    Isa decode_isa = Isa::kScalar;
    if (isa_ >= Isa::kAvx2 && d % 8 == 0 && dv % 8 == 0) decode_isa = Isa::kAvx2;
    if (isa_ >= Isa::kAvx512 && d % 16 == 0 && dv % 16 == 0) decode_isa = Isa::kAvx512;
    const bool vec_decode = decode_isa != Isa::kScalar;
    const double esize = static_cast<double>(kv::dtype_size(p.kv_dtype));
    const int W = p.sliding_window;

    // Split-KV chunk length for decode requests: enough chunks over the batch to feed every
    // worker several items, but never under kMinChunk tokens (each chunk re-reads q and writes a
    // partial state of H * (dv + 2) floats).
    constexpr int64_t kMinChunk = 256;
    int64_t decode_tokens = 0;
    for (int i = 0; i < view.bs; ++i) {
        if (vec_decode && view.q_lens[i] == 1) {
            decode_tokens += view.seq_lens[i] - window_start(view.seq_lens[i] - 1, W);
        }
    }
    const int64_t chunk =
        std::max<int64_t>(kMinChunk, (decode_tokens + 8 * threads - 1) / (8 * threads));

    // Rows per extend tile: the ISA's panel count times its panel height.
    int tile_rows = 16;
    if (isa_ == Isa::kAvx2) tile_rows = k_avx2::kPanels * k_avx2::kP;
    if (isa_ == Isa::kAvx512) tile_rows = k_avx512::kPanels * k_avx512::kP;
    const int tile_tokens = std::max(1, tile_rows / G);

    std::vector<WorkItem> items;
    std::vector<int> split_chunks(static_cast<size_t>(view.bs), 0);
    std::vector<int64_t> split_base(static_cast<size_t>(view.bs), -1);
    const int64_t state_floats = 2 * static_cast<int64_t>(Hp) + static_cast<int64_t>(Hp) * dv;
    int64_t partial_floats = 0;
    for (int i = 0; i < view.bs; ++i) {
        const int s = view.seq_lens[i], ql = view.q_lens[i];
        if (vec_decode && ql == 1) {
            // The KV the query sees: [ws, s), its window (or all of it).
            const int ws = window_start(s - 1, W);
            const int nc = static_cast<int>((s - ws + chunk - 1) / chunk);
            if (nc > 1) {
                split_chunks[static_cast<size_t>(i)] = nc;
                split_base[static_cast<size_t>(i)] = partial_floats;
            }
            for (int c = 0; c < nc; ++c) {
                const int t0 = static_cast<int>(ws + c * chunk),
                          t1 = static_cast<int>(std::min<int64_t>(s, ws + (c + 1) * chunk));
                // Bytes read at ~20 GB/s (memory-bound).
                const double cost = (t1 - t0) * Hkv * (d + dv) * esize / 20e9;
                items.push_back({cost, true, i, t0, t1, 0, nc > 1 ? partial_floats : -1});
                if (nc > 1) partial_floats += state_floats;
            }
            continue;
        }
        for (int kh = 0; kh < Hkv; ++kh) {
            for (int j0 = 0; j0 < ql; j0 += tile_tokens) {
                const int j1 = std::min(ql, j0 + tile_tokens);
                const int rows = (j1 - j0) * G;
                // Keys the tile reads: from its first row's window start to its last position.
                const int keys = s - ql + j1 - window_start(s - ql + j0, W);
                // Flops at ~50 GFLOP/s (compute-bound; padded rows cost as much as real ones).
                const double cost = 2.0 * ((rows + 15) / 16 * 16) * keys * (d + dv) / 50e9;
                items.push_back({cost, false, i, j0, j1, kh, -1});
            }
        }
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
    if (partials_.size() < static_cast<size_t>(partial_floats))
        partials_.resize(static_cast<size_t>(partial_floats));
    std::unique_ptr<std::atomic<int>[]> remaining(
        new std::atomic<int>[static_cast<size_t>(view.bs)]);
    for (int i = 0; i < view.bs; ++i)
        remaining[static_cast<size_t>(i)].store(split_chunks[static_cast<size_t>(i)]);

    // Decode result of request i, state (m, l, acc) -> out rows.
    auto finish_single = [&](int i, const float* l, const float* acc) {
        float* o = p.out + static_cast<size_t>(view.q_start[i]) * H * dv;
        for (int h = 0; h < H; ++h) {
            const float inv = 1.f / l[h];
            for (int e = 0; e < dv; ++e)
                o[static_cast<size_t>(h) * dv + e] = acc[static_cast<size_t>(h) * dv + e] * inv;
        }
    };
    // Merges the split-KV partial states of request i (run by the last chunk to finish).
    auto merge_split = [&](int i) {
        const int nc = split_chunks[static_cast<size_t>(i)];
        const float* base = partials_.data() + split_base[static_cast<size_t>(i)];
        float* o = p.out + static_cast<size_t>(view.q_start[i]) * H * dv;
        for (int h = 0; h < H; ++h) {
            float mx = -std::numeric_limits<float>::infinity();
            for (int c = 0; c < nc; ++c) mx = std::max(mx, base[c * state_floats + h]);
            float lsum = 0.f;
            for (int c = 0; c < nc; ++c)
                lsum +=
                    base[c * state_floats + Hp + h] * std::exp2(base[c * state_floats + h] - mx);
            float* oh = o + static_cast<size_t>(h) * dv;
            std::fill_n(oh, dv, 0.f);
            for (int c = 0; c < nc; ++c) {
                const float* st = base + c * state_floats;
                const float wc = std::exp2(st[h] - mx) / lsum;
                const float* acc = st + 2 * Hp + static_cast<size_t>(h) * dv;
                for (int e = 0; e < dv; ++e) oh[e] += wc * acc[e];
            }
        }
    };

    std::atomic<size_t> next{0};
    const Isa isa = isa_;
    pool_->parallel_for(
        static_cast<size_t>(threads),
        [&](size_t, size_t, int worker) {
            Scratch& s = *scratch_[static_cast<size_t>(worker)];
            for (;;) {
                const size_t k = next.fetch_add(1, std::memory_order_relaxed);
                if (k >= items.size()) break;
                const WorkItem& it = items[k];
                if (!it.decode) {
                    const ExtendTask t{it.req, it.kh, it.a, it.b};
                    switch (isa) {
                        case Isa::kAvx512:
                            k_avx512::extend_item(p, t, s);
                            break;
                        case Isa::kAvx2:
                            k_avx2::extend_item(p, t, s);
                            break;
                        case Isa::kScalar:
                            scalar_extend_item(p, t, s);
                            break;
                    }
                    continue;
                }
                float* state = it.state >= 0 ? partials_.data() + it.state
                                             : s.floats(static_cast<size_t>(state_floats), 1);
                const DecodeTask t{it.req, it.a, it.b, state, state + Hp, state + 2 * Hp};
                if (decode_isa == Isa::kAvx512) {
                    k_avx512::decode_item(p, t, s);
                } else {
                    k_avx2::decode_item(p, t, s);
                }
                if (it.state < 0) {
                    finish_single(it.req, t.l, t.acc);
                } else if (remaining[static_cast<size_t>(it.req)].fetch_sub(
                               1, std::memory_order_acq_rel) == 1) {
                    merge_split(it.req);
                }
            }
        },
        1);
}

}  // namespace pdsim::attn::cpu
