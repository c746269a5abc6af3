// The GPU synthetic model's kernels: seeded weight generation, embedding gather, RMSNorm, RoPE,
// SiLU-gated MLP activation, residual add, last-token gather and greedy argmax, each the GPU
// counterpart of one step of the CPU model (backends/model/synthetic_model.{h,cpp}). A
// CudaSyntheticModel is assembled from these and the projections of backends/cuda/gemm.h.
//
// Plain C++: no CUDA headers, so any translation unit may include it. Device memory is passed as
// raw pointers; bf16 values are their uint16_t bits (common/bf16.h), activations are bf16 with fp32
// arithmetic inside every kernel.
//
// Streams: every launch takes the pdsim Stream it runs on (a CudaStream, backends/cuda/); work is
// enqueued in stream order and the call returns at once. A stream that is not a CUDA stream is
// kInvalidArgument. Launches are capturable into a CUDA graph (no host synchronization, no
// allocation).
//
// Errors: parameters are checked on the host before anything is enqueued; a bad one is
// kInvalidArgument naming the field (sizes, null pointers, 16-byte alignment where a kernel loads
// 8 bf16 at once). A failed launch is kUnavailable with the CUDA error (CUDA_CHECK). Device-side
// bad data cannot return a Status: a kernel that meets an out-of-range token id, position or empty
// request writes NaN (or token -1, see argmax) so the error is visible in its output.
//
// Batch invariance: every kernel computes each row from that row alone, with a reduction order
// fixed by the row's length (hidden, vocab), never by the number of rows: no cross-row reduction,
// no atomics, block sizes that depend on the row length only. So row r of a batch of T is
// bit-identical to row r computed alone.
//
// Thread-safety: the functions hold no state; call them from any thread. The memory they touch
// follows the stream order of its writers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "backends/runtime/stream.h"
#include "backends/runtime/tensor.h"
#include "common/bf16.h"
#include "common/status.h"

namespace pdsim::model::cuda {

// ---------------------------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------------------------

// The sizes one rank of a TP group of `tp_size` works with, and where its slices sit in the full
// tensors. Derived once from a ModelConfig by make_model_dims().
struct ModelDims {
    uint64_t seed = 0;
    int hidden = 0;
    int head_dim = 0;
    int vocab = 0;
    int num_layers = 0;
    float rms_eps = 0.f;
    double rope_theta = 0.0;
    int tp_size = 1;
    int tp_rank = 0;
    // Whole model.
    int total_q_heads = 0;
    int total_kv_heads = 0;
    int total_intermediate = 0;
    // This rank (the CPU model's slices s0 .. s0 + ns of every TP-sliced tensor are one contiguous
    // column range of the full tensor, so a rank's slice is [col0, col0 + cols)).
    int q_heads = 0;
    int kv_heads = 0;
    int intermediate = 0;
    int64_t q_cols = 0;        // q_heads * head_dim
    int64_t kv_cols = 0;       // kv_heads * head_dim
    int64_t qkv_cols = 0;      // q_cols + 2 * kv_cols: the fused QKV projection's output row
    int64_t gate_up_cols = 0;  // 2 * intermediate: the fused gate/up projection's output row
    int64_t q_col0 = 0;        // tp_rank * q_cols
    int64_t kv_col0 = 0;       // tp_rank * kv_cols
    int64_t inter_col0 = 0;    // tp_rank * intermediate
};

// Validates `config` for the GPU kernels and derives a rank's sizes. kInvalidArgument naming the
// field when: validate_model or check_tp fails; tp_rank is outside [0, tp_size); the intermediate
// size does not split over tp_size; hidden, head_dim, intermediate / tp_size or vocab is not a
// multiple of 8 (rows of 16-byte bf16 packs, as the kernels and cuBLASLt need). kUnimplemented for
// MLA or sliding-window layers (as the CPU model).
[[nodiscard]] StatusOr<ModelDims> make_model_dims(const ModelConfig& config, int tp_size = 1,
                                                  int tp_rank = 0);

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

// The CPU model's tensor kinds (backends/model/synthetic_model.cpp, TensorKind), same values.
enum class WeightKind : uint64_t {
    kWq = 1,
    kWk,
    kWv,
    kWo,
    kGate,
    kUp,
    kDown,
    kNorm1,
    kNorm2,
    kEmbed,
    kFinalNorm,
    kLmHead,
};

// The generator's tensor id of `kind` in `layer` (-1: embedding, final norm, LM head), as the CPU
// model derives it: (layer + 1) << 8 | kind.
[[nodiscard]] constexpr uint64_t weight_tensor_id(int layer, WeightKind kind) {
    return (static_cast<uint64_t>(layer + 1) << 8) | static_cast<uint64_t>(kind);
}

// The CPU model's generator scales (float, computed as it does): 1/sqrt(hidden) for Wq, Wk, Wv,
// gate, up and the LM head; 1/sqrt(total q heads * head_dim) for Wo; 1/sqrt(total intermediate)
// for down; 1 for the embedding; 0.1 for norm weights, which are 1 + value.
[[nodiscard]] float weight_scale(const ModelDims& dims, WeightKind kind);

// A rectangle of one generated tensor, placed in a destination matrix. Element (r, c) of the block
// (r < rows, c < cols) lands at destination (row0 + r, col0 + c) and holds
//   offset + SyntheticModel::weight_value(seed, tensor, index_base + r * index_row_stride
//                                                        + c * index_col_stride, scale)
// computed in fp32 with one rounding per operation (no fused multiply-add; the offset is added
// only when non-zero), then stored as fp32 or rounded to bf16 (nearest even, common/bf16.h).
struct WeightBlock {
    uint64_t tensor = 0;
    float scale = 1.f;
    float offset = 0.f;
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t row0 = 0;
    int64_t col0 = 0;
    uint64_t index_base = 0;
    int64_t index_row_stride = 0;
    int64_t index_col_stride = 0;

    // The generator index of element (r, c) of the block.
    [[nodiscard]] uint64_t index(int64_t r, int64_t c) const {
        return index_base + static_cast<uint64_t>(r) * static_cast<uint64_t>(index_row_stride) +
               static_cast<uint64_t>(c) * static_cast<uint64_t>(index_col_stride);
    }
};

// A dense row-major [rows][cols] device matrix made of disjoint blocks that cover it.
struct WeightLayout {
    std::string name;  // e.g. "layer 2 qkv", for messages
    int64_t rows = 0;
    int64_t cols = 0;
    std::vector<WeightBlock> blocks;
};

// The layouts of the GPU model's weights on one rank. Projection weights are [N][K] ("out x in",
// the layout backends/cuda/gemm.h multiplies by): row n holds the K inputs of output column n.
//  - qkv:     [qkv_cols][hidden], rows q (this rank's q heads) | k | v: ONE fused GEMM whose
//             output row is [q | k | v]; element (n, k) of the q block is the CPU model's
//             Wq[k][q_col0 + n], and likewise k and v.
//  - o_proj:  [hidden][q_cols]: Wo[q_col0 + k][n] (this rank's rows of Wo: a K slice, whose
//             partial sums the TP group reduces).
//  - gate_up: [2 * intermediate][hidden], rows gate | up: ONE fused GEMM whose output row is
//             [gate | up] (silu_mul's input); element (n, k) of gate is Wgate[k][inter_col0 + n].
//  - down:    [hidden][intermediate]: Wdown[inter_col0 + k][n] (a K slice, as o_proj).
//  - norm:    [1][hidden], 1 + value (kNorm1 / kNorm2 of `layer`, or kFinalNorm with layer -1).
//  - embedding: [vocab][hidden], row v is token v's embedding (not a GEMM operand).
//  - lm_head: [vocab][hidden]: Wlm[k][n].
[[nodiscard]] WeightLayout qkv_weight_layout(const ModelDims& dims, int layer);
[[nodiscard]] WeightLayout o_proj_weight_layout(const ModelDims& dims, int layer);
[[nodiscard]] WeightLayout gate_up_weight_layout(const ModelDims& dims, int layer);
[[nodiscard]] WeightLayout down_weight_layout(const ModelDims& dims, int layer);
[[nodiscard]] WeightLayout norm_weight_layout(const ModelDims& dims, int layer, WeightKind kind);
[[nodiscard]] WeightLayout embedding_layout(const ModelDims& dims);
[[nodiscard]] WeightLayout lm_head_weight_layout(const ModelDims& dims);

// Fills the dense [layout.rows][layout.cols] matrix at `out` (device memory of the stream's
// device, fp32 or bf16) with the layout's generated values. kInvalidArgument for another dtype, a
// null `out`, or a block outside the matrix (the message names the layout and the block).
[[nodiscard]] Status generate_weights(uint64_t seed, const WeightLayout& layout, void* out,
                                      runtime::DType dtype, runtime::Stream& stream);

// ---------------------------------------------------------------------------------------------
// Per-token kernels. `rows` is the number of tokens (or requests) T; a row stride ("_ld") is in
// elements, >= the row length; rows == 0 enqueues nothing.
// ---------------------------------------------------------------------------------------------

// out[t][:] = table[tokens[t]][:]. table is [vocab][hidden] bf16 (embedding_layout), contiguous.
// A token outside [0, vocab) gives a NaN row (the CPU model rejects it on the host: the caller
// checks host tokens before uploading them).
struct EmbeddingParams {
    const bf16_t* table = nullptr;
    const int32_t* tokens = nullptr;
    bf16_t* out = nullptr;
    int64_t out_ld = 0;
    int rows = 0;
    int hidden = 0;
    int vocab = 0;
};
[[nodiscard]] Status embedding_gather(const EmbeddingParams& params, runtime::Stream& stream);

// out[t][i] = bf16(x[t][i] * inv_rms(t) * weight[i]), inv_rms(t) = 1 / sqrt(mean_i x[t][i]^2 +
// eps): the CPU model's RMSNorm (eps inside the square root, added to the mean of squares), with
// the sum of squares accumulated in fp32 in an order fixed by `hidden`. `weight` is fp32 [hidden]
// (norm_weight_layout). In-place (out == in, same ld) is allowed.
struct RmsNormParams {
    const bf16_t* in = nullptr;
    int64_t in_ld = 0;
    const float* weight = nullptr;
    bf16_t* out = nullptr;
    int64_t out_ld = 0;
    int rows = 0;
    int hidden = 0;
    float eps = 0.f;
};
[[nodiscard]] Status rms_norm(const RmsNormParams& params, runtime::Stream& stream);

// The CPU model's RoPE table, [max_positions][head_dim] fp32: row p holds cos(p * inv_freq[i]) for
// i < head_dim / 2, then sin(p * inv_freq[i]), with inv_freq[i] = float(theta^(-2i / head_dim))
// and the angle and cos/sin in double, rounded to float: bit-identical to the values the CPU model
// computes per token. Upload it once; apply_rope reads it. Preconditions: head_dim even and > 0,
// max_positions >= 0.
[[nodiscard]] std::vector<float> rope_cos_sin_cache(double rope_theta, int head_dim,
                                                    int max_positions);

// Rotates, in place, every head of q and k of token t by position positions[t], NeoX style (the
// CPU model's convention: pairs (i, i + head_dim / 2)):
//   a' = a * cos - b * sin,  b' = a * sin + b * cos   (fp32, one rounding per operation)
// q is [rows][q_heads * head_dim] with row stride q_ld (likewise k); in the fused QKV output q
// starts at column 0 and k at column q_cols, both with ld qkv_cols. cos_sin is rope_cos_sin_cache
// on the device. A position outside [0, max_positions) gives NaN for that token's heads.
// Positions are per token: seq_len - extend_len + j for the j-th new token of a request
// (token_positions below).
struct RopeParams {
    bf16_t* q = nullptr;
    int64_t q_ld = 0;
    int q_heads = 0;
    bf16_t* k = nullptr;
    int64_t k_ld = 0;
    int k_heads = 0;
    int head_dim = 0;
    const int32_t* positions = nullptr;
    const float* cos_sin = nullptr;
    int max_positions = 0;
    int rows = 0;
};
[[nodiscard]] Status apply_rope(const RopeParams& params, runtime::Stream& stream);

// positions[qo_indptr[i] + j] = seq_lens[i] - (qo_indptr[i + 1] - qo_indptr[i]) + j for
// j < qo_indptr[i + 1] - qo_indptr[i]: the positions of each request's new tokens. qo_indptr is
// [requests + 1] (qo_indptr[0] = 0, non-decreasing), seq_lens [requests], both int32 on the
// device; positions has qo_indptr[requests] entries.
struct PositionsParams {
    const int32_t* qo_indptr = nullptr;
    const int32_t* seq_lens = nullptr;
    int requests = 0;
    int32_t* positions = nullptr;
};
[[nodiscard]] Status token_positions(const PositionsParams& params, runtime::Stream& stream);

// out[t][i] = bf16(silu(g) * u), g = gate_up[t][i], u = gate_up[t][intermediate + i],
// silu(g) = g / (1 + exp(-g)) in fp32: the CPU model's activation over the fused gate/up output.
struct SiluMulParams {
    const bf16_t* gate_up = nullptr;
    int64_t gate_up_ld = 0;
    bf16_t* out = nullptr;
    int64_t out_ld = 0;
    int rows = 0;
    int intermediate = 0;
};
[[nodiscard]] Status silu_mul(const SiluMulParams& params, runtime::Stream& stream);

// residual[t][i] = bf16(residual[t][i] + delta[t][i]) (fp32 add): the residual connection.
struct ResidualAddParams {
    bf16_t* residual = nullptr;
    int64_t residual_ld = 0;
    const bf16_t* delta = nullptr;
    int64_t delta_ld = 0;
    int rows = 0;
    int hidden = 0;
};
[[nodiscard]] Status residual_add(const ResidualAddParams& params, runtime::Stream& stream);

// The TP-invariant reduction's last step:
//   delta = partials[0][t][i] + partials[1][t][i] + ... + partials[slices - 1][t][i]
//   residual[t][i] = bf16(residual[t][i] + bf16(delta))
// with the sum in fp32 from slice 0 upwards (one rounding per add) and the residual add as
// residual_add's. partials is fp32, slice s at partials + s * slice_stride, rows with stride
// partial_ld (both in elements, multiples of 4, the pointer 16-byte aligned). The same partials
// give the same bits whichever rank computed each slice: that is what makes a TP-2 rank's hidden
// states equal a TP-1 rank's.
struct SliceReduceParams {
    const float* partials = nullptr;
    int64_t slice_stride = 0;
    int64_t partial_ld = 0;
    int slices = 0;
    bf16_t* residual = nullptr;
    int64_t residual_ld = 0;
    int rows = 0;
    int hidden = 0;
};
[[nodiscard]] Status slice_reduce_residual(const SliceReduceParams& params,
                                           runtime::Stream& stream);

// out[i][:] = in[qo_indptr[i + 1] - 1][:]: each request's last token (the rows the final norm and
// the LM head run on). A request with no tokens gives a NaN row.
struct LastTokenParams {
    const bf16_t* in = nullptr;
    int64_t in_ld = 0;
    const int32_t* qo_indptr = nullptr;
    int requests = 0;
    bf16_t* out = nullptr;
    int64_t out_ld = 0;
    int hidden = 0;
};
[[nodiscard]] Status gather_last_tokens(const LastTokenParams& params, runtime::Stream& stream);

// tokens[r] = the greedy next token of logits row r (bf16 or fp32, [rows][vocab], row stride ld):
// the lowest index among the maximum values, NaNs ignored, as the CPU model's scan. Where the CPU
// model fails the forward (kDataLoss: the maximum is not finite, logit 0 is NaN, or every logit is
// NaN) the token is -1; the caller turns it into that error.
struct ArgmaxParams {
    const void* logits = nullptr;
    runtime::DType dtype = runtime::DType::kBF16;
    int64_t ld = 0;
    int rows = 0;
    int vocab = 0;
    int32_t* tokens = nullptr;
};
[[nodiscard]] Status argmax(const ArgmaxParams& params, runtime::Stream& stream);

}  // namespace pdsim::model::cuda
