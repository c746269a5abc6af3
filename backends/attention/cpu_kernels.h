// The kernels of the `cpu` attention backend: paged attention over an MHA KV pool, fp32 or bf16 KV,
// causal over each request's last q_len positions (decode, extend, cached prefix, chunked prefill),
// GQA (query head h reads KV head h / (num_q_heads / num_kv_heads)), optionally a sliding window
// (the query at position p attends keys [max(0, p - W + 1), p] for AttnProblem::sliding_window W).
//
// Two kernels, chosen per request:
//   decode (q_len == 1): memory-bound. One work item is a (request, KV-token chunk) pair that reads
//     each token's K and V rows once for all heads (token-major: the pool's order) in blocks of 8
//     tokens, keeps every query head's online-softmax state (lane-wise over heads), and prefetches
//     K/V in software along the page table (the hardware prefetchers cannot follow a page table).
//     Long requests are split over several chunks ("split-KV") whose partial states the last
//     chunk to finish merges. With a window, only the window's tokens [seq - W, seq) are
//     planned into chunks: the tokens before it are never read.
//   extend (q_len > 1, or head dims the decode kernel's vectors do not divide): compute-bound. One
//     work item is (request, KV head, tile of query tokens); all query heads of the KV group are
//     rows of the tile, so each K/V element is loaded once per group. Flash-attention style: K/V
//     blocks are gathered into contiguous fp32 scratch, then S^T = K Q^T and O^T += V^T P^T run
//     as register-blocked micro-kernels whose vectors run along the query rows (so the
//     online-softmax max/sum are lane-wise, never horizontal). With a window, the key loop starts
//     at the tile's first window start, blocks before every row's window are skipped per panel,
//     and keys before a row's window are masked to -inf like future keys (a row whose every key
//     so far is masked keeps a -inf max: its rescale and probabilities are 0, never NaN).
// Both accumulate in fp32 (bf16 KV is widened on load: a 16-bit shift) and use exp2 with log2(e)
// folded into the query scale. Work items are sorted by estimated cost and claimed one at a time
// by the pool's workers.
//
// ISA: AVX2+FMA and AVX-512 (F/BW/DQ/VL) kernels compiled side by side (whatever PDSIM_CPU_ARCH
// the rest is built with) and selected at run time (__builtin_cpu_supports); a scalar fallback
// covers CPUs without AVX2. PDSIM_CPU_ISA=scalar|avx2|avx512 lowers (never raises) the choice,
// e.g. to test every path on one machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "common/thread_pool.h"

namespace pdsim::attn::cpu {

// One attention call as the kernels see it, resolved when the kernel runs (the batch comes from the
// metadata buffers at that moment, so graph replays see the current batch).
struct AttnProblem {
    BatchView view{};
    const float* q = nullptr;       // [num_tokens][num_q_heads][head_dim]
    float* out = nullptr;           // [num_tokens][num_q_heads][v_head_dim]
    const void* k_cache = nullptr;  // [num_pages][page_size][num_kv_heads][head_dim] (kv_dtype)
    const void* v_cache = nullptr;  // [num_pages][page_size][num_kv_heads][v_head_dim]
    kv::KVDtype kv_dtype = kv::KVDtype::kF32;
    int page_size = 1;
    int num_q_heads = 1;
    int num_kv_heads = 1;
    int head_dim = 0;
    int v_head_dim = 0;
    float scale = 1.f;  // softmax scale applied to q.k
    // W > 0: the query at position p attends keys [max(0, p - W + 1), p]; 0: keys [0, p].
    int sliding_window = 0;
};

// Builds the problem of one forward from its arguments and the view read at run time.
// Precondition: args.q and args.out are fp32 host views (cpu::with_fp32_activations).
[[nodiscard]] AttnProblem make_problem(const ForwardArgs& args, const BatchView& view);

enum class Isa { kScalar, kAvx2, kAvx512 };

[[nodiscard]] std::string_view isa_name(Isa isa);
// The best ISA this CPU supports, lowered by PDSIM_CPU_ISA when set.
[[nodiscard]] Isa detect_isa();

// Runs attention problems on a thread pool. Owns the pool and the per-worker scratch (grown on
// demand, never shrunk). Not thread-safe: one stream drives it, one run() at a time.
class CpuAttentionKernels {
public:
    // num_threads <= 0: every core. isa: clamped to what the CPU supports.
    explicit CpuAttentionKernels(int num_threads, Isa isa = detect_isa());
    ~CpuAttentionKernels();
    CpuAttentionKernels(const CpuAttentionKernels&) = delete;
    CpuAttentionKernels& operator=(const CpuAttentionKernels&) = delete;

    // Writes out[] for every query token of p.view. Precondition: p has been validated
    // (cpu::validate_view: page ids in range, q_len <= seq_len, heads divide) and its pointers are
    // valid for the shapes it states.
    void run(const AttnProblem& p);

    [[nodiscard]] ThreadPool& pool() { return *pool_; }
    [[nodiscard]] Isa isa() const { return isa_; }

    struct Scratch;  // per-worker scratch (cpu_kernels.cpp)

private:
    Isa isa_;
    std::unique_ptr<ThreadPool> pool_;
    std::vector<std::unique_ptr<Scratch>> scratch_;  // one per pool worker
    std::vector<float> partials_;                    // split-KV partial results of decode chunks
};

}  // namespace pdsim::attn::cpu
