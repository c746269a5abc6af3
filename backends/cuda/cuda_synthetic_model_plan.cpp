// Host logic of the GPU synthetic model (see cuda_synthetic_model_plan.h). No CUDA here.
#include "backends/cuda/cuda_synthetic_model_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "backends/runtime/device.h"

namespace pdsim::model::cuda {

namespace {

constexpr int kPack = 8;                  // bf16 per 16-byte pack
constexpr size_t kBufferAlignment = 256;  // workspace buffers
constexpr int64_t kInputAlignment = 4;    // int32 elements: 16 bytes

int64_t round_up(int64_t v, int64_t m) {
    return (v + m - 1) / m * m;
}

Status check_multiple_of_8(const ModelConfig& c, const char* field, int64_t v) {
    if (v % kPack != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: {} {} must be a multiple of 8 for the GPU model (rows of "
                           "16-byte bf16 packs, as its kernels and cuBLASLt need)",
                           c.name, field, v);
    }
    return {};
}

Status check_option(const char* name, int64_t value, int64_t min) {
    if (value < min) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "options.{} {} must be >= {}", name, value,
                           min);
    }
    return {};
}

}  // namespace

Status check_cuda_model_config(const ModelConfig& c, int tp_size, const CudaModelOptions& o) {
    PDSIM_RETURN_IF_ERROR(validate_model(c));
    if (c.attention != AttentionKind::kMha) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "model {}: the GPU synthetic model runs MHA/GQA attention only (MLA is "
                           "not built yet)",
                           c.name);
    }
    for (LayerKind k : c.layer_kinds) {
        if (k != LayerKind::kFullAttention) {
            return PDSIM_ERROR(StatusCode::kUnimplemented,
                               "model {}: sliding-window layers are not built yet", c.name);
        }
    }
    if (tp_size < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "model {}: tp {} must be >= 1", c.name,
                           tp_size);
    }
    PDSIM_RETURN_IF_ERROR(
        check_tp(c, tp_size).with_context(fmt::format("model {}: tp {}", c.name, tp_size)));
    if (c.intermediate % tp_size != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "model {}: intermediate {} does not split over tp {}", c.name,
                           c.intermediate, tp_size);
    }
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(c, "hidden", c.hidden));
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(c, "head_dim", c.head_dim));
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(
        c, tp_size == 1 ? "intermediate" : "intermediate / tp", c.intermediate / tp_size));
    PDSIM_RETURN_IF_ERROR(check_multiple_of_8(c, "vocab", c.vocab));
    if (uses_sliced_reduction(tp_size, o)) {
        if (c.intermediate % c.num_kv_heads != 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "model {}: intermediate {} does not split into num_kv_heads {} (the "
                               "canonical reduction slices of a TP-invariant model)",
                               c.name, c.intermediate, c.num_kv_heads);
        }
        PDSIM_RETURN_IF_ERROR(check_multiple_of_8(c,
                                                  "intermediate / num_kv_heads (a reduction "
                                                  "slice)",
                                                  c.intermediate / c.num_kv_heads));
    }
    PDSIM_RETURN_IF_ERROR(check_option("device", o.device, 0));
    PDSIM_RETURN_IF_ERROR(check_option("max_tokens", o.max_tokens, 1));
    PDSIM_RETURN_IF_ERROR(check_option("max_bs", o.max_bs, 1));
    PDSIM_RETURN_IF_ERROR(check_option("max_positions", o.max_positions, 1));
    PDSIM_RETURN_IF_ERROR(check_option("staging_slots", o.staging_slots, 1));
    if (o.max_bs > o.max_tokens) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "options.max_bs {} must be <= options.max_tokens {} (a decode forward "
                           "of max_bs requests has max_bs tokens)",
                           o.max_bs, o.max_tokens);
    }
    return {};
}

WeightMemory estimate_weight_memory(const ModelConfig& c, int tp_size) {
    const int tp = std::max(tp_size, 1);
    const int64_t H = c.hidden, D = c.head_dim, I = c.intermediate / tp, V = c.vocab;
    const int64_t q_cols = static_cast<int64_t>(c.num_q_heads / tp) * D;
    const int64_t kv_cols = static_cast<int64_t>(c.num_kv_heads / tp) * D;
    constexpr int64_t kBf16 = 2, kF32 = 4;
    WeightMemory m;
    m.qkv = (q_cols + 2 * kv_cols) * H * kBf16;
    m.o_proj = H * q_cols * kBf16;
    m.gate_up = 2 * I * H * kBf16;
    m.down = H * I * kBf16;
    m.norms = 2 * H * kF32;
    m.per_layer = m.qkv + m.o_proj + m.gate_up + m.down + m.norms;
    m.embedding = V * H * kBf16;
    m.lm_head = V * H * kBf16;
    m.final_norm = H * kF32;
    m.total = m.per_layer * c.num_layers + m.embedding + m.lm_head + m.final_norm;
    return m;
}

InputLayout input_layout(int max_tokens, int max_bs) {
    InputLayout l;
    const int64_t t = std::max(max_tokens, 0), b = std::max(max_bs, 0);
    l.tokens = 0;
    l.out_cache_loc = round_up(l.tokens + t, kInputAlignment);
    l.seq_lens = round_up(l.out_cache_loc + t, kInputAlignment);
    l.qo_indptr = round_up(l.seq_lens + b, kInputAlignment);
    l.total = round_up(l.qo_indptr + b + 1, kInputAlignment);
    return l;
}

WorkspaceLayout plan_workspace(const ModelConfig& c, const CudaModelOptions& o, int tp_size) {
    const size_t tp = static_cast<size_t>(std::max(tp_size, 1));
    const size_t T = static_cast<size_t>(o.max_tokens), B = static_cast<size_t>(o.max_bs);
    const size_t H = static_cast<size_t>(c.hidden), D = static_cast<size_t>(c.head_dim);
    const size_t q_cols = static_cast<size_t>(c.num_q_heads) / tp * D;
    const size_t kv_cols = static_cast<size_t>(c.num_kv_heads) / tp * D;
    const size_t I = static_cast<size_t>(c.intermediate) / tp, V = static_cast<size_t>(c.vocab);
    WorkspaceLayout w;
    size_t at = 0;
    auto take = [&](size_t bytes) {
        const size_t off = at;
        at = static_cast<size_t>(round_up(static_cast<int64_t>(at + bytes), kBufferAlignment));
        return off;
    };
    w.hidden = take(T * H * 2);
    w.normed = take(T * H * 2);
    w.qkv = take(T * (q_cols + 2 * kv_cols) * 2);
    w.q = take(T * q_cols * 2);
    w.k = take(T * kv_cols * 2);
    w.v = take(T * kv_cols * 2);
    w.attn = take(T * q_cols * 2);
    w.gate_up = take(T * 2 * I * 2);
    w.act = take(T * I * 2);
    w.positions = take(T * 4);
    w.last = take(B * H * 2);
    w.last_normed = take(B * H * 2);
    w.logits = take(B * V * 4);
    w.sampled = take(B * 4);
    w.input = input_layout(o.max_tokens, o.max_bs);
    w.inputs = take(static_cast<size_t>(w.input.total) * 4);
    if (uses_sliced_reduction(tp_size, o)) {
        // The slice-major GEMM input holds every local slice of O's (q_cols) or down's (I) K.
        const size_t slices = static_cast<size_t>(std::max(c.num_kv_heads, 1));
        const size_t local = slices / tp;
        w.slice_in = take(T * std::max(q_cols, I) * 2);
        w.partials_bytes = local * T * H * 4;
        w.partials = take(w.partials_bytes);
        if (tp > 1) {
            w.gathered_bytes = slices * T * H * 4;
            w.gathered = take(w.gathered_bytes);
        }
    }
    w.total_bytes = at;
    return w;
}

Status check_step_batch(const StepBatch& b, const ModelConfig& c, const CudaModelOptions& o,
                        const PoolGeometry& pool) {
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    const int64_t bs = static_cast<int64_t>(b.seq_lens.size());
    if (T > o.max_tokens) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.tokens: {} tokens, the model's workspace holds max_tokens {}", T,
                           o.max_tokens);
    }
    if (bs > o.max_bs) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.seq_lens: {} requests, the model holds max_bs {}", bs, o.max_bs);
    }
    if (static_cast<int64_t>(b.out_cache_loc.size()) != T) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.out_cache_loc: {} slots for {} tokens", b.out_cache_loc.size(),
                           T);
    }
    if (static_cast<int64_t>(b.extend_lens.size()) != bs) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.extend_lens: {} entries for {} requests", b.extend_lens.size(),
                           bs);
    }
    if (attn::is_idle(b.mode) && bs != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch.mode: idle with {} requests", bs);
    }
    int64_t sum = 0;
    for (int64_t i = 0; i < bs; ++i) {
        const int32_t e = b.extend_lens[static_cast<size_t>(i)];
        const int32_t s = b.seq_lens[static_cast<size_t>(i)];
        if (e < 1 || e > s) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.extend_lens[{}] {} with seq_len {} (need 1 <= extend_len <= "
                               "seq_len)",
                               i, e, s);
        }
        if (attn::is_decode(b.mode) && e != 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.extend_lens[{}] {}: a decode batch has 1 token per request",
                               i, e);
        }
        if (s > o.max_positions) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.seq_lens[{}] {} exceeds options.max_positions {} (the RoPE "
                               "table)",
                               i, s, o.max_positions);
        }
        sum += e;
    }
    if (sum != T) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.extend_lens sum to {}, the batch has {} tokens", sum, T);
    }
    for (int64_t t = 0; t < T; ++t) {
        const int32_t tok = b.tokens[static_cast<size_t>(t)];
        if (tok < 0 || tok >= c.vocab) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.tokens[{}]: token id {} outside the vocabulary [0, {})", t,
                               tok, c.vocab);
        }
    }
    const int64_t slots = static_cast<int64_t>(pool.num_pages) * pool.page_size;
    for (int64_t t = 0; t < T; ++t) {
        const int32_t loc = b.out_cache_loc[static_cast<size_t>(t)];
        if (loc < 0 || loc >= slots) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.out_cache_loc[{}]: slot {} outside the pool's [0, {})", t,
                               loc, slots);
        }
    }
    if (bs == 0) return {};
    const int stride = b.page_table_stride;
    if (stride < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch.page_table_stride {} must be >= 1",
                           stride);
    }
    if (static_cast<int64_t>(b.page_table.size()) < bs * stride) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch.page_table: {} entries, need bs {} x stride {}",
                           b.page_table.size(), bs, stride);
    }
    for (int64_t i = 0; i < bs; ++i) {
        const int64_t pages =
            (b.seq_lens[static_cast<size_t>(i)] + pool.page_size - 1) / std::max(pool.page_size, 1);
        if (pages > stride) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch.page_table_stride {}: request {} has seq_len {}, {} pages of "
                               "{}",
                               stride, i, b.seq_lens[static_cast<size_t>(i)], pages,
                               pool.page_size);
        }
        for (int64_t p = 0; p < pages; ++p) {
            const int32_t page = b.page_table[static_cast<size_t>(i * stride + p)];
            if (page < 0 || page >= pool.num_pages) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "batch.page_table[{}][{}]: page {} outside the pool's [0, {})",
                                   i, p, page, pool.num_pages);
            }
        }
    }
    return {};
}

void pack_inputs(const StepBatch& b, const InputLayout& l, std::span<int32_t> slot) {
    const size_t bs = b.seq_lens.size();
    std::copy(b.tokens.begin(), b.tokens.end(), slot.begin() + l.tokens);
    std::copy(b.out_cache_loc.begin(), b.out_cache_loc.end(), slot.begin() + l.out_cache_loc);
    std::copy(b.seq_lens.begin(), b.seq_lens.end(), slot.begin() + l.seq_lens);
    int32_t* indptr = slot.data() + l.qo_indptr;
    indptr[0] = 0;
    for (size_t i = 0; i < bs; ++i) indptr[i + 1] = indptr[i] + b.extend_lens[i];
}

std::vector<int> default_decode_buckets(int max_bs) {
    std::vector<int> out;
    for (int b = 1; b < max_bs; b *= 2) out.push_back(b);
    if (max_bs >= 1) out.push_back(max_bs);
    return out;
}

Status check_decode_buckets(std::span<const int> buckets, int max_bs) {
    if (buckets.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "decode graph buckets: none given");
    }
    for (size_t i = 0; i < buckets.size(); ++i) {
        if (buckets[i] < 1 || buckets[i] > max_bs) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "decode graph buckets[{}] {} outside [1, max_bs {}]", i, buckets[i],
                               max_bs);
        }
        if (i > 0 && buckets[i] <= buckets[i - 1]) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "decode graph buckets must increase: buckets[{}] {} after {}", i,
                               buckets[i], buckets[i - 1]);
        }
    }
    return {};
}

std::optional<int> choose_bucket(std::span<const int> buckets, int bs) {
    auto it = std::lower_bound(buckets.begin(), buckets.end(), bs);
    if (it == buckets.end()) return std::nullopt;
    return *it;
}

StatusOr<StepBatch> pad_decode_batch(const StepBatch& batch, int bucket) {
    if (!attn::is_decode(batch.mode)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "pad_decode_batch: mode {}, not decode",
                           attn::forward_mode_name(batch.mode));
    }
    const int bs = static_cast<int>(batch.seq_lens.size());
    if (bs > bucket) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pad_decode_batch: {} requests do not fit bucket {}", bs, bucket);
    }
    StepBatch p = batch;
    const int stride = std::max(batch.page_table_stride, 1);
    p.page_table_stride = stride;
    p.page_table.resize(static_cast<size_t>(bs) * static_cast<size_t>(stride), 0);
    const size_t pad = static_cast<size_t>(bucket - bs);
    p.tokens.insert(p.tokens.end(), pad, 0);
    p.out_cache_loc.insert(p.out_cache_loc.end(), pad, 0);
    p.seq_lens.insert(p.seq_lens.end(), pad, 1);
    p.extend_lens.insert(p.extend_lens.end(), pad, 1);
    p.page_table.insert(p.page_table.end(), pad * static_cast<size_t>(stride), 0);
    return p;
}

StepBatch padding_decode_batch(int bucket) {
    StepBatch empty;
    empty.mode = attn::ForwardMode::kDecode;
    empty.page_table_stride = 1;
    return *pad_decode_batch(empty, std::max(bucket, 0));
}

uint64_t fnv1a64(std::span<const std::byte> bytes, uint64_t hash) {
    constexpr uint64_t kPrime = 0x100000001b3ULL;
    for (std::byte b : bytes) {
        hash ^= static_cast<uint64_t>(b);
        hash *= kPrime;
    }
    return hash;
}

StatusOr<std::vector<std::byte>> read_request_kv(const kv::KVPool& pool, int layer, int buf,
                                                 std::span<const int32_t> pages, int seq_len) {
    if (layer < 0 || layer >= pool.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "read_request_kv: layer {} outside [0, {})", layer, pool.num_layers());
    }
    if (buf < 0 || buf >= pool.buffer_count()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "read_request_kv: buf {} outside [0, {})",
                           buf, pool.buffer_count());
    }
    const int page_size = pool.page_size();
    const int64_t needed = (static_cast<int64_t>(seq_len) + page_size - 1) / page_size;
    if (seq_len < 0 || needed > static_cast<int64_t>(pages.size())) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "read_request_kv: seq_len {} needs {} pages of {}, {} given", seq_len,
                           needed, page_size, pages.size());
    }
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                           runtime::device_runtime(pool.device().kind));
    const size_t token_bytes = pool.token_bytes(layer, buf);
    const size_t page_bytes = pool.page_bytes(layer, buf);
    std::vector<std::byte> out(static_cast<size_t>(seq_len) * token_bytes);
    std::vector<std::byte> page(page_bytes);
    const auto* base = static_cast<const std::byte*>(pool.data(layer, buf));
    for (int64_t p = 0; p < needed; ++p) {
        const int32_t id = pages[static_cast<size_t>(p)];
        if (id < 0 || id >= pool.num_pages()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "read_request_kv: pages[{}] {} outside [0, {})", p, id,
                               pool.num_pages());
        }
        PDSIM_RETURN_IF_ERROR(
            rt->copy(page.data(), base + static_cast<size_t>(id) * page_bytes, page_bytes));
        const int64_t first = p * page_size;
        const int64_t count = std::min<int64_t>(page_size, seq_len - first);
        std::memcpy(out.data() + static_cast<size_t>(first) * token_bytes, page.data(),
                    static_cast<size_t>(count) * token_bytes);
    }
    return out;
}

StatusOr<std::vector<uint64_t>> request_kv_digest(const kv::KVPool& pool,
                                                  std::span<const int32_t> pages, int seq_len) {
    std::vector<uint64_t> digest;
    for (int layer = 0; layer < pool.num_layers(); ++layer) {
        uint64_t h = kFnvOffsetBasis;
        for (int buf = 0; buf < pool.buffer_count(); ++buf) {
            PDSIM_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                                   read_request_kv(pool, layer, buf, pages, seq_len));
            h = fnv1a64(bytes, h);
        }
        digest.push_back(h);
    }
    return digest;
}

}  // namespace pdsim::model::cuda
