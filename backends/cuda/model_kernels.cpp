// Host side of the GPU synthetic model's kernels (model_kernels.h): sizes, weight layouts, the
// RoPE table, and the checked launches, which derive each kernel's flat arguments once and hand
// them to the launchers in model_kernels.cu (model_kernels_launch.h).
#include "backends/cuda/model_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/model_kernels_launch.h"
#include "common/align.h"
#include "common/cuda_check.h"

namespace pdsim::model::cuda {

namespace {

using runtime::DType;

constexpr int kPack = 8;  // bf16 per 16-byte pack

// ---- host helpers ----

// The stream's cudaStream_t, with its device made current (a launch on another device's stream
// fails).
StatusOr<cudaStream_t> launch_stream(runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    CUDA_CHECK(cudaSetDevice(stream.device().index));
    return s;
}

// A bf16 matrix operand moved in 16-byte packs: pointer aligned, row stride a multiple of 8 and at
// least the row length. `what` is "kernel: field".
Status check_packed(const char* what, const void* p, int64_t ld, int64_t row_len) {
    if (p == nullptr) return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} is null", what);
    if (!is_aligned(p, 16)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} is not 16-byte aligned", what);
    }
    if (ld < row_len || ld % kPack != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{}: row stride {} must be >= the row length {} and a multiple of 8",
                           what, ld, row_len);
    }
    return {};
}

Status check_positive_multiple(const char* what, int64_t v) {
    if (v <= 0 || v % kPack != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} {} must be a positive multiple of 8",
                           what, v);
    }
    return {};
}

Status check_rows(const char* what, int rows) {
    if (rows < 0)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{} {} must be >= 0", what, rows);
    return {};
}

Status check_multiple_of_8(const ModelConfig& c, const char* field, int64_t v) {
    if (v % kPack != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: {} {} must be a multiple of 8 for the GPU kernels (rows of "
                           "16-byte bf16 packs, as cuBLASLt needs too)",
                           c.name, field, v);
    }
    return {};
}

WeightBlock block(uint64_t tensor, float scale, int64_t rows, int64_t cols, int64_t row0,
                  uint64_t base, int64_t row_stride, int64_t col_stride) {
    WeightBlock b;
    b.tensor = tensor;
    b.scale = scale;
    b.rows = rows;
    b.cols = cols;
    b.row0 = row0;
    b.index_base = base;
    b.index_row_stride = row_stride;
    b.index_col_stride = col_stride;
    return b;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Sizes and layouts
// ---------------------------------------------------------------------------------------------

StatusOr<ModelDims> make_model_dims(const ModelConfig& config, int tp_size, int tp_rank) {
    PDSIM_RETURN_IF_ERROR(validate_model(config));
    if (config.attention != AttentionKind::kMha) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "model {}: the GPU synthetic model runs MHA/GQA attention only",
                           config.name);
    }
    for (LayerKind k : config.layer_kinds) {
        if (k != LayerKind::kFullAttention) {
            return PDSIM_ERROR(StatusCode::kUnimplemented,
                               "model {}: sliding-window layers are not built yet", config.name);
        }
    }
    PDSIM_RETURN_IF_ERROR(check_tp(config, tp_size).with_context("model " + config.name + ": tp"));
    if (tp_rank < 0 || tp_rank >= tp_size) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tp_rank {} outside [0, tp_size {})",
                           tp_rank, tp_size);
    }
    if (config.intermediate % tp_size != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: intermediate {} does not split over tp {}", config.name,
                           config.intermediate, tp_size);
    }
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(config, "hidden", config.hidden));
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(config, "head_dim", config.head_dim));
    PDSIM_RETURN_IF_ERROR(
        check_multiple_of_8(config, "intermediate / tp", config.intermediate / tp_size));
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(config, "vocab", config.vocab));
    ModelDims d;
    d.seed = config.seed;
    d.hidden = config.hidden;
    d.head_dim = config.head_dim;
    d.vocab = config.vocab;
    d.num_layers = config.num_layers;
    d.rms_eps = config.rms_eps;
    d.rope_theta = config.rope_theta;
    d.tp_size = tp_size;
    d.tp_rank = tp_rank;
    d.total_q_heads = config.num_q_heads;
    d.total_kv_heads = config.num_kv_heads;
    d.total_intermediate = config.intermediate;
    d.q_heads = config.num_q_heads / tp_size;
    d.kv_heads = config.num_kv_heads / tp_size;
    d.intermediate = config.intermediate / tp_size;
    d.q_cols = static_cast<int64_t>(d.q_heads) * d.head_dim;
    d.kv_cols = static_cast<int64_t>(d.kv_heads) * d.head_dim;
    d.qkv_cols = d.q_cols + 2 * d.kv_cols;
    d.gate_up_cols = 2 * static_cast<int64_t>(d.intermediate);
    d.q_col0 = tp_rank * d.q_cols;
    d.kv_col0 = tp_rank * d.kv_cols;
    d.inter_col0 = static_cast<int64_t>(tp_rank) * d.intermediate;
    return d;
}

float weight_scale(const ModelDims& dims, WeightKind kind) {
    switch (kind) {
        case WeightKind::kWq:
        case WeightKind::kWk:
        case WeightKind::kWv:
        case WeightKind::kGate:
        case WeightKind::kUp:
        case WeightKind::kLmHead:
            return 1.0f / std::sqrt(static_cast<float>(dims.hidden));
        case WeightKind::kWo:
            return 1.0f / std::sqrt(static_cast<float>(dims.total_q_heads * dims.head_dim));
        case WeightKind::kDown:
            return 1.0f / std::sqrt(static_cast<float>(dims.total_intermediate));
        case WeightKind::kEmbed:
            return 1.0f;
        case WeightKind::kNorm1:
        case WeightKind::kNorm2:
        case WeightKind::kFinalNorm:
            return 0.1f;
    }
    return 0.f;
}

WeightLayout qkv_weight_layout(const ModelDims& d, int layer) {
    WeightLayout l{fmt::format("layer {} qkv", layer), d.qkv_cols, d.hidden, {}};
    const int64_t q_full = static_cast<int64_t>(d.total_q_heads) * d.head_dim;
    const int64_t kv_full = static_cast<int64_t>(d.total_kv_heads) * d.head_dim;
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kWq),
                             weight_scale(d, WeightKind::kWq), d.q_cols, d.hidden, 0,
                             static_cast<uint64_t>(d.q_col0), 1, q_full));
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kWk),
                             weight_scale(d, WeightKind::kWk), d.kv_cols, d.hidden, d.q_cols,
                             static_cast<uint64_t>(d.kv_col0), 1, kv_full));
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kWv),
                             weight_scale(d, WeightKind::kWv), d.kv_cols, d.hidden,
                             d.q_cols + d.kv_cols, static_cast<uint64_t>(d.kv_col0), 1, kv_full));
    return l;
}

WeightLayout o_proj_weight_layout(const ModelDims& d, int layer) {
    WeightLayout l{fmt::format("layer {} o_proj", layer), d.hidden, d.q_cols, {}};
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kWo),
                             weight_scale(d, WeightKind::kWo), d.hidden, d.q_cols, 0,
                             static_cast<uint64_t>(d.q_col0 * d.hidden), 1, d.hidden));
    return l;
}

WeightLayout gate_up_weight_layout(const ModelDims& d, int layer) {
    WeightLayout l{fmt::format("layer {} gate_up", layer), d.gate_up_cols, d.hidden, {}};
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kGate),
                             weight_scale(d, WeightKind::kGate), d.intermediate, d.hidden, 0,
                             static_cast<uint64_t>(d.inter_col0), 1, d.total_intermediate));
    l.blocks.push_back(block(
        weight_tensor_id(layer, WeightKind::kUp), weight_scale(d, WeightKind::kUp), d.intermediate,
        d.hidden, d.intermediate, static_cast<uint64_t>(d.inter_col0), 1, d.total_intermediate));
    return l;
}

WeightLayout down_weight_layout(const ModelDims& d, int layer) {
    WeightLayout l{fmt::format("layer {} down", layer), d.hidden, d.intermediate, {}};
    l.blocks.push_back(block(weight_tensor_id(layer, WeightKind::kDown),
                             weight_scale(d, WeightKind::kDown), d.hidden, d.intermediate, 0,
                             static_cast<uint64_t>(d.inter_col0 * d.hidden), 1, d.hidden));
    return l;
}

WeightLayout norm_weight_layout(const ModelDims& d, int layer, WeightKind kind) {
    WeightLayout l{fmt::format("layer {} norm {}", layer, static_cast<int>(kind)), 1, d.hidden, {}};
    WeightBlock b =
        block(weight_tensor_id(layer, kind), weight_scale(d, kind), 1, d.hidden, 0, 0, 0, 1);
    b.offset = 1.0f;
    l.blocks.push_back(b);
    return l;
}

WeightLayout embedding_layout(const ModelDims& d) {
    WeightLayout l{"embedding", d.vocab, d.hidden, {}};
    l.blocks.push_back(block(weight_tensor_id(-1, WeightKind::kEmbed),
                             weight_scale(d, WeightKind::kEmbed), d.vocab, d.hidden, 0, 0, d.hidden,
                             1));
    return l;
}

WeightLayout lm_head_weight_layout(const ModelDims& d) {
    WeightLayout l{"lm_head", d.vocab, d.hidden, {}};
    l.blocks.push_back(block(weight_tensor_id(-1, WeightKind::kLmHead),
                             weight_scale(d, WeightKind::kLmHead), d.vocab, d.hidden, 0, 0, 1,
                             d.vocab));
    return l;
}

std::vector<float> rope_cos_sin_cache(double rope_theta, int head_dim, int max_positions) {
    if (head_dim <= 0 || head_dim % 2 != 0 || max_positions <= 0) return {};
    const int half = head_dim / 2;
    std::vector<float> inv_freq(static_cast<size_t>(half));
    for (int i = 0; i < half; ++i) {
        inv_freq[static_cast<size_t>(i)] =
            static_cast<float>(std::pow(rope_theta, -2.0 * i / static_cast<double>(head_dim)));
    }
    std::vector<float> cache(static_cast<size_t>(max_positions) * static_cast<size_t>(head_dim));
    for (int p = 0; p < max_positions; ++p) {
        float* row = &cache[static_cast<size_t>(p) * static_cast<size_t>(head_dim)];
        for (int i = 0; i < half; ++i) {
            const double ang = static_cast<double>(p) * inv_freq[static_cast<size_t>(i)];
            row[i] = static_cast<float>(std::cos(ang));
            row[half + i] = static_cast<float>(std::sin(ang));
        }
    }
    return cache;
}

// ---------------------------------------------------------------------------------------------
// Launches
// ---------------------------------------------------------------------------------------------

Status generate_weights(uint64_t seed, const WeightLayout& layout, void* out, runtime::DType dtype,
                        runtime::Stream& stream) {
    if (dtype != DType::kF32 && dtype != DType::kBF16) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "generate_weights {}: dtype {}, expected fp32 or bf16", layout.name,
                           runtime::dtype_name(dtype));
    }
    if (out == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "generate_weights {}: out is null",
                           layout.name);
    for (size_t i = 0; i < layout.blocks.size(); ++i) {
        const WeightBlock& b = layout.blocks[i];
        if (b.rows < 0 || b.cols < 0 || b.row0 < 0 || b.col0 < 0 || b.row0 + b.rows > layout.rows ||
            b.col0 + b.cols > layout.cols) {
            return PDSIM_ERROR(
                StatusCode::kInvalidArgument,
                "generate_weights {}: block {} ({} x {} at ({}, {})) outside the {} x {} matrix",
                layout.name, i, b.rows, b.cols, b.row0, b.col0, layout.rows, layout.cols);
        }
    }
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    const size_t elem = runtime::dtype_size(dtype);
    for (const WeightBlock& b : layout.blocks) {
        if (b.rows == 0 || b.cols == 0) continue;
        detail::WeightGenArgs a{};
        a.seed = seed;
        a.tensor = b.tensor;
        a.scale = b.scale;
        a.offset = b.offset;
        a.rows = b.rows;
        a.cols = b.cols;
        a.index_base = b.index_base;
        a.index_row_stride = static_cast<uint64_t>(b.index_row_stride);
        a.index_col_stride = static_cast<uint64_t>(b.index_col_stride);
        a.out = static_cast<char*>(out) + static_cast<size_t>(b.row0 * layout.cols + b.col0) * elem;
        a.out_ld = layout.cols;
        a.bf16 = dtype == DType::kBF16;
        CUDA_CHECK(detail::launch_weight_gen(a, s));
    }
    return {};
}

Status embedding_gather(const EmbeddingParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("embedding_gather: rows", p.rows));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("embedding_gather: hidden", p.hidden));
    if (p.vocab <= 0)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "embedding_gather: vocab {} must be > 0",
                           p.vocab);
    PDSIM_RETURN_IF_ERROR(check_packed("embedding_gather: table", p.table, p.hidden, p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("embedding_gather: out", p.out, p.out_ld, p.hidden));
    if (p.tokens == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "embedding_gather: tokens is null");
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::EmbeddingArgs a{};
    a.table = reinterpret_cast<const uint4*>(p.table);
    a.tokens = p.tokens;
    a.out = reinterpret_cast<uint4*>(p.out);
    a.out_ld_packs = p.out_ld / kPack;
    a.packs = p.hidden / kPack;
    a.total = static_cast<int64_t>(p.rows) * a.packs;
    a.vocab = p.vocab;
    CUDA_CHECK(detail::launch_embedding(a, s));
    return {};
}

Status rms_norm(const RmsNormParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("rms_norm: rows", p.rows));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("rms_norm: hidden", p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("rms_norm: in", p.in, p.in_ld, p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("rms_norm: out", p.out, p.out_ld, p.hidden));
    if (p.weight == nullptr || !is_aligned(p.weight, 16)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "rms_norm: weight is null or not 16-byte aligned");
    }
    if (!(p.eps >= 0.f))
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "rms_norm: eps {} must be >= 0", p.eps);
    if (p.in == p.out && p.in_ld != p.out_ld) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "rms_norm: in place needs in_ld == out_ld ({} != {})", p.in_ld,
                           p.out_ld);
    }
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::RmsNormArgs a{};
    a.in = reinterpret_cast<const uint4*>(p.in);
    a.in_ld_packs = p.in_ld / kPack;
    a.weight = reinterpret_cast<const float4*>(p.weight);
    a.out = reinterpret_cast<uint4*>(p.out);
    a.out_ld_packs = p.out_ld / kPack;
    a.packs = p.hidden / kPack;
    a.rows = p.rows;
    // The block size is a function of hidden only, and the reduction order with it.
    a.threads = std::min((a.packs + 31) / 32 * 32, 1024);
    a.hidden = static_cast<float>(p.hidden);
    a.eps = p.eps;
    CUDA_CHECK(detail::launch_rms_norm(a, s));
    return {};
}

Status apply_rope(const RopeParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("apply_rope: rows", p.rows));
    if (p.head_dim <= 0 || p.head_dim % 2 != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "apply_rope: head_dim {} must be even and > 0", p.head_dim);
    }
    if (p.q_heads < 0 || p.k_heads < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "apply_rope: q_heads {} / k_heads {} must be >= 0", p.q_heads,
                           p.k_heads);
    }
    if (p.q_heads > 0 &&
        (p.q == nullptr || p.q_ld < static_cast<int64_t>(p.q_heads) * p.head_dim)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "apply_rope: q is null or q_ld {} < q_heads * head_dim {}", p.q_ld,
                           static_cast<int64_t>(p.q_heads) * p.head_dim);
    }
    if (p.k_heads > 0 &&
        (p.k == nullptr || p.k_ld < static_cast<int64_t>(p.k_heads) * p.head_dim)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "apply_rope: k is null or k_ld {} < k_heads * head_dim {}", p.k_ld,
                           static_cast<int64_t>(p.k_heads) * p.head_dim);
    }
    if (p.positions == nullptr || p.cos_sin == nullptr || p.max_positions <= 0) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "apply_rope: positions and cos_sin must be set and max_positions ({}) > 0",
            p.max_positions);
    }
    if (p.rows == 0 || p.q_heads + p.k_heads == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::RopeArgs a{};
    a.q = p.q;
    a.q_ld = p.q_ld;
    a.k = p.k;
    a.k_ld = p.k_ld;
    a.positions = p.positions;
    a.cos_sin = p.cos_sin;
    a.q_heads = p.q_heads;
    a.heads = p.q_heads + p.k_heads;
    a.head_dim = p.head_dim;
    a.half = p.head_dim / 2;
    a.max_positions = p.max_positions;
    a.total = static_cast<int64_t>(p.rows) * a.heads * a.half;
    CUDA_CHECK(detail::launch_rope(a, s));
    return {};
}

Status token_positions(const PositionsParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("token_positions: requests", p.requests));
    if (p.qo_indptr == nullptr || p.seq_lens == nullptr || p.positions == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "token_positions: qo_indptr, seq_lens and positions must be set");
    }
    if (p.requests == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::PositionsArgs a{p.qo_indptr, p.seq_lens, p.requests, p.positions};
    CUDA_CHECK(detail::launch_positions(a, s));
    return {};
}

Status silu_mul(const SiluMulParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("silu_mul: rows", p.rows));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("silu_mul: intermediate", p.intermediate));
    PDSIM_RETURN_IF_ERROR(check_packed("silu_mul: gate_up", p.gate_up, p.gate_up_ld,
                                       2 * static_cast<int64_t>(p.intermediate)));
    PDSIM_RETURN_IF_ERROR(check_packed("silu_mul: out", p.out, p.out_ld, p.intermediate));
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::SiluMulArgs a{};
    a.gate_up = reinterpret_cast<const uint4*>(p.gate_up);
    a.gate_up_ld_packs = p.gate_up_ld / kPack;
    a.out = reinterpret_cast<uint4*>(p.out);
    a.out_ld_packs = p.out_ld / kPack;
    a.packs = p.intermediate / kPack;
    a.total = static_cast<int64_t>(p.rows) * a.packs;
    CUDA_CHECK(detail::launch_silu_mul(a, s));
    return {};
}

Status residual_add(const ResidualAddParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("residual_add: rows", p.rows));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("residual_add: hidden", p.hidden));
    PDSIM_RETURN_IF_ERROR(
        check_packed("residual_add: residual", p.residual, p.residual_ld, p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("residual_add: delta", p.delta, p.delta_ld, p.hidden));
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::ResidualArgs a{};
    a.residual = reinterpret_cast<uint4*>(p.residual);
    a.residual_ld_packs = p.residual_ld / kPack;
    a.delta = reinterpret_cast<const uint4*>(p.delta);
    a.delta_ld_packs = p.delta_ld / kPack;
    a.packs = p.hidden / kPack;
    a.total = static_cast<int64_t>(p.rows) * a.packs;
    CUDA_CHECK(detail::launch_residual_add(a, s));
    return {};
}

Status slice_reduce_residual(const SliceReduceParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("slice_reduce_residual: rows", p.rows));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("slice_reduce_residual: hidden", p.hidden));
    PDSIM_RETURN_IF_ERROR(
        check_packed("slice_reduce_residual: residual", p.residual, p.residual_ld, p.hidden));
    if (p.slices < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "slice_reduce_residual: slices {} must be >= 1", p.slices);
    }
    if (p.partials == nullptr || !is_aligned(p.partials, 16)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "slice_reduce_residual: partials is null or not 16-byte aligned");
    }
    if (p.partial_ld < p.hidden || p.partial_ld % 4 != 0 || p.slice_stride % 4 != 0 ||
        (p.slices > 1 && p.slice_stride < static_cast<int64_t>(p.rows) * p.partial_ld)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "slice_reduce_residual: partial_ld {} must be >= hidden {} and "
                           "slice_stride {} >= rows x partial_ld, both multiples of 4",
                           p.partial_ld, p.hidden, p.slice_stride);
    }
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::SliceReduceArgs a{};
    a.partials = reinterpret_cast<const float4*>(p.partials);
    a.slice_stride_quads = p.slice_stride / 4;
    a.partial_ld_quads = p.partial_ld / 4;
    a.slices = p.slices;
    a.residual = reinterpret_cast<uint4*>(p.residual);
    a.residual_ld_packs = p.residual_ld / kPack;
    a.packs = p.hidden / kPack;
    a.total = static_cast<int64_t>(p.rows) * a.packs;
    CUDA_CHECK(detail::launch_slice_reduce(a, s));
    return {};
}

Status gather_last_tokens(const LastTokenParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("gather_last_tokens: requests", p.requests));
    PDSIM_RETURN_IF_ERROR(check_positive_multiple("gather_last_tokens: hidden", p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("gather_last_tokens: in", p.in, p.in_ld, p.hidden));
    PDSIM_RETURN_IF_ERROR(check_packed("gather_last_tokens: out", p.out, p.out_ld, p.hidden));
    if (p.qo_indptr == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "gather_last_tokens: qo_indptr is null");
    if (p.requests == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::LastTokenArgs a{};
    a.in = reinterpret_cast<const uint4*>(p.in);
    a.in_ld_packs = p.in_ld / kPack;
    a.qo_indptr = p.qo_indptr;
    a.out = reinterpret_cast<uint4*>(p.out);
    a.out_ld_packs = p.out_ld / kPack;
    a.packs = p.hidden / kPack;
    a.total = static_cast<int64_t>(p.requests) * a.packs;
    CUDA_CHECK(detail::launch_last_token(a, s));
    return {};
}

Status argmax(const ArgmaxParams& p, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_rows("argmax: rows", p.rows));
    if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "argmax: logits dtype {}, expected fp32 or bf16",
                           runtime::dtype_name(p.dtype));
    }
    if (p.vocab <= 0 || p.ld < p.vocab) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "argmax: vocab {} must be > 0 and <= ld {}", p.vocab, p.ld);
    }
    if (p.logits == nullptr || p.tokens == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "argmax: logits and tokens must be set");
    }
    if (p.rows == 0) return {};
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, launch_stream(stream));
    detail::ArgmaxArgs a{p.logits, p.ld, p.rows, p.vocab, p.dtype == DType::kF32, p.tokens};
    CUDA_CHECK(detail::launch_argmax(a, s));
    return {};
}

}  // namespace pdsim::model::cuda
