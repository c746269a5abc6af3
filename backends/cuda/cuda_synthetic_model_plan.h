// Host logic of the GPU synthetic model (backends/cuda/cuda_synthetic_model.h), kept free of CUDA
// so that it builds everywhere and its unit tests run on machines without a GPU: the shape and
// option checks, the weight-memory estimate, the device workspace and input layouts, the batch
// checks, the decode CUDA-graph buckets and their padding, and the KV digest.
//
// Everything here is a pure function of its arguments except read_request_kv /
// request_kv_digest, which copy a pool's memory to the host through its DeviceRuntime
// (synchronous; see there). Thread-safety: no shared state; call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/model/model.h"
#include "backends/model/model_config.h"
#include "common/status.h"

namespace pdsim::model::cuda {

// How a CudaSyntheticModel is sized. Every buffer is allocated once, at create().
struct CudaModelOptions {
    int device = 0;            // CUDA device index
    int max_tokens = 2048;     // new tokens per forward (T, all requests together)
    int max_bs = 64;           // requests per forward, and the largest decode graph bucket
    int max_positions = 8192;  // rows of the RoPE table: every seq_len must be <= this
    int staging_slots = 4;     // pinned input slots: forwards enqueued ahead of the GPU
    // Run the O and down projections as one GEMM per canonical slice, summed in slice order (the
    // TP-invariant reduction, cuda_synthetic_model.h "Tensor parallelism"). Always on for
    // tp_size > 1; a TP 1 rank that must produce a TP > 1 rank's bits (a colocated run beside a
    // TP 2 instance) turns it on.
    bool sliced_reduction = false;
};

// Whether a rank of a TP group of `tp_size` runs the TP-invariant reduction.
[[nodiscard]] inline bool uses_sliced_reduction(int tp_size, const CudaModelOptions& options) {
    return tp_size > 1 || options.sliced_reduction;
}

// Checks that the GPU model can run `config` on a TP group of `tp_size` with `options`:
//  - validate_model fails: its kInvalidArgument;
//  - MLA attention or a sliding-window layer: kUnimplemented (as the CPU model);
//  - tp_size < 1, or a TP split check_tp refuses (heads), or intermediate not divisible by
//    tp_size: kInvalidArgument;
//  - hidden, head_dim, intermediate / tp_size or vocab not a multiple of 8 (rows of 16-byte bf16
//    packs, as the kernels and cuBLASLt need): kInvalidArgument naming the field;
//  - with the sliced reduction (uses_sliced_reduction): intermediate not divisible by
//    num_kv_heads, or intermediate / num_kv_heads not a multiple of 8: kInvalidArgument;
//  - options: device < 0, max_tokens / max_bs / max_positions / staging_slots < 1, or
//    max_bs > max_tokens (a decode graph of max_bs requests has max_bs rows): kInvalidArgument
//    naming the option.
[[nodiscard]] Status check_cuda_model_config(const ModelConfig& config, int tp_size,
                                             const CudaModelOptions& options);

// Bytes of one rank's GPU model weights in a TP group of `tp_size`: bf16 projections (fused QKV,
// O, fused gate/up, down: 1 / tp_size of each), bf16 embedding and LM head, fp32 norm weights
// (whole on every rank).
struct WeightMemory {
    int64_t qkv = 0;      // per layer
    int64_t o_proj = 0;   // per layer
    int64_t gate_up = 0;  // per layer
    int64_t down = 0;     // per layer
    int64_t norms = 0;    // per layer: the two RMSNorm weights
    int64_t per_layer = 0;
    int64_t embedding = 0;
    int64_t lm_head = 0;
    int64_t final_norm = 0;
    int64_t total = 0;  // per_layer * num_layers + embedding + lm_head + final_norm
};
[[nodiscard]] WeightMemory estimate_weight_memory(const ModelConfig& config, int tp_size = 1);

// The model's int32 inputs as one block, in elements (the device block and every pinned staging
// slot share this layout):
//   tokens [max_tokens] | out_cache_loc [max_tokens] | seq_lens [max_bs] | qo_indptr [max_bs + 1]
// Each region starts on a 16-byte (4-element) boundary.
struct InputLayout {
    int64_t tokens = 0;
    int64_t out_cache_loc = 0;
    int64_t seq_lens = 0;
    int64_t qo_indptr = 0;
    int64_t total = 0;  // elements of the block
};
[[nodiscard]] InputLayout input_layout(int max_tokens, int max_bs);

// The activation workspace: byte offsets into one device allocation, each buffer 256-byte aligned
// (cuBLASLt and the 16-byte pack kernels need 16). Rows are max_tokens (T) or max_bs (B):
//   hidden   bf16 [T][hidden]       the residual stream
//   normed   bf16 [T][hidden]       RMSNorm output, then the O / down projection output
//   qkv      bf16 [T][qkv_cols]     fused QKV projection (RoPE applied in place)
//   q, k, v  bf16 [T][heads * head_dim], contiguous copies for the attention backend
//   attn     bf16 [T][q_heads * head_dim]   attention output
//   gate_up  bf16 [T][2 * intermediate]
//   act      bf16 [T][intermediate]         silu(gate) * up
//   positions int32 [T]
//   last, last_normed bf16 [B][hidden]      each request's last token, then its final norm
//   logits   fp32 [B][vocab]
//   sampled  int32 [B]
//   inputs   int32, input_layout(T, B)
// Head and intermediate counts are this rank's (1 / tp_size of the model's). With the sliced
// reduction (uses_sliced_reduction), qkv and gate_up hold their slice GEMMs' outputs slice-major
// ([local slices][T][slice columns], the same bytes), and there are also:
//   slice_in  bf16 [local slices][T][slice K]  the O / down GEMM input, slice-major (contiguous)
//   partials  fp32 [local slices][T][hidden]   each O / down slice GEMM's output
//   gathered  fp32 [slices][T][hidden]         every rank's partials (tp_size > 1 only)
// and the partials and gathered blocks again in pinned host memory (partials_bytes,
// gathered_bytes) for the TP group's exchange. Unused buffers have 0 bytes.
struct WorkspaceLayout {
    size_t hidden = 0, normed = 0, qkv = 0, q = 0, k = 0, v = 0, attn = 0, gate_up = 0, act = 0;
    size_t positions = 0, last = 0, last_normed = 0, logits = 0, sampled = 0, inputs = 0;
    size_t slice_in = 0, partials = 0, gathered = 0;
    size_t partials_bytes = 0, gathered_bytes = 0;
    size_t total_bytes = 0;
    InputLayout input;
};
// Precondition: check_cuda_model_config(config, tp_size, options) passed.
[[nodiscard]] WorkspaceLayout plan_workspace(const ModelConfig& config,
                                             const CudaModelOptions& options, int tp_size = 1);

// The pool a batch is checked against.
struct PoolGeometry {
    int num_pages = 0;
    int page_size = 0;
};

// Checks `batch` before anything is enqueued, as the CPU model does and more. kInvalidArgument
// naming the field when: T = tokens.size() > options.max_tokens or bs = seq_lens.size() >
// options.max_bs; out_cache_loc or extend_lens do not have T / bs entries; an extend_len is < 1,
// or larger than its seq_len, or they do not sum to T; a decode batch has an extend_len != 1; an
// idle batch has requests; a seq_len exceeds options.max_positions; a token id is outside
// [0, vocab); a slot is outside [0, num_pages * page_size); the page table is narrower than
// ceil(seq_len / page_size) pages, shorter than bs * stride entries, or holds a page outside
// [0, num_pages).
[[nodiscard]] Status check_step_batch(const StepBatch& batch, const ModelConfig& config,
                                      const CudaModelOptions& options, const PoolGeometry& pool);

// Writes `batch`'s inputs into `slot` (input_layout's elements; only the used prefix of each
// region is written): tokens, out_cache_loc, seq_lens, and qo_indptr = the exclusive prefix sum
// of extend_lens (bs + 1 entries). Precondition: check_step_batch passed and `slot` has
// layout.total elements.
void pack_inputs(const StepBatch& batch, const InputLayout& layout, std::span<int32_t> slot);

// ---- decode CUDA graphs -----------------------------------------------------------------------

// 1, 2, 4, ... (powers of two below max_bs), then max_bs: the default decode graph buckets.
// Empty for max_bs < 1.
[[nodiscard]] std::vector<int> default_decode_buckets(int max_bs);
// kInvalidArgument unless `buckets` is non-empty, strictly increasing, >= 1 and <= max_bs.
[[nodiscard]] Status check_decode_buckets(std::span<const int> buckets, int max_bs);
// The smallest bucket >= bs, or nullopt when bs is larger than every bucket (run it eagerly).
// Precondition: check_decode_buckets passed, bs >= 1.
[[nodiscard]] std::optional<int> choose_bucket(std::span<const int> buckets, int bs);
// `batch` (decode, bs <= bucket, checked) padded to `bucket` requests: each padding request has
// token 0, slot 0 (the pool's null page 0), seq_len 1, extend_len 1 and a page-table row of
// zeros, so it reads and writes the null page only and its token is ignored.
// kInvalidArgument when batch is not decode or has more than `bucket` requests.
[[nodiscard]] StatusOr<StepBatch> pad_decode_batch(const StepBatch& batch, int bucket);
// The batch a decode graph of `bucket` requests is warmed up and captured with: `bucket` padding
// requests (as above).
[[nodiscard]] StepBatch padding_decode_batch(int bucket);

// ---- KV digest ----------------------------------------------------------------------------------

inline constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ULL;
// FNV-1a, 64 bit, over `bytes`, continuing from `hash`.
[[nodiscard]] uint64_t fnv1a64(std::span<const std::byte> bytes, uint64_t hash = kFnvOffsetBasis);

// The bytes of one request's KV in buffer `buf` (0 = K, 1 = V) of `layer`: its tokens 0 ..
// seq_len - 1 in order (token t in page pages[t / page_size], slot t % page_size), token_bytes
// each. Independent of which physical pages the request got. Copies whole pages to the host with
// the pool's DeviceRuntime (for a CUDA pool: synchronous cudaMemcpy, which does NOT order after
// the non-blocking compute stream: synchronize that stream first). kInvalidArgument for a bad
// layer, buf, seq_len (< 0, or more tokens than `pages` hold) or page id.
[[nodiscard]] StatusOr<std::vector<std::byte>> read_request_kv(const kv::KVPool& pool, int layer,
                                                               int buf,
                                                               std::span<const int32_t> pages,
                                                               int seq_len);
// Per layer, fnv1a64 of the request's K bytes then its V bytes (read_request_kv): equal digests
// mean bit-identical KV. Same preconditions and errors as read_request_kv.
[[nodiscard]] StatusOr<std::vector<uint64_t>> request_kv_digest(const kv::KVPool& pool,
                                                                std::span<const int32_t> pages,
                                                                int seq_len);

}  // namespace pdsim::model::cuda
