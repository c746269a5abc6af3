#include "sim/testbed/rank_builder.h"

#include <algorithm>

#include "backends/attention/attention_backend.h"
#include "backends/attention/hybrid_backend.h"
#include "backends/runtime/cpu_stream.h"
#include "sim/testbed/window.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::testbed {

StatusOr<RankParts> build_rank_parts(const RankBuildOptions& options) {
    const model::ModelConfig& m = *options.model;
    RankParts parts;
    if (options.stream != nullptr) {
        parts.stream = options.stream;
    } else {
        parts.owned_stream = std::make_unique<runtime::CpuStream>(
            options.stream_name,
            runtime::CpuStreamOptions{.wait_timeout = options.stream_timeout,
                                      .caller_runs = options.stream_caller_runs});
        parts.stream = parts.owned_stream.get();
    }
    kv::MHAPoolConfig pc;
    pc.num_layers = m.num_layers;
    pc.page_size = options.page_size;
    pc.num_kv_heads = m.num_kv_heads / options.tp_size;
    pc.head_dim = m.head_dim;
    pc.num_pages = options.num_pages;
    pc.dtype = options.kv_dtype;
    pc.device = parts.stream->device();
    if (has_cache_groups(m)) {
        pc.layers = layers_of(m, model::LayerKind::kFullAttention);
        if (pc.layers.empty()) {
            return PDSIM_ERROR(StatusCode::kUnimplemented,
                               "model {}: a hybrid model needs full-attention layers (its KV "
                               "engine's)",
                               m.name);
        }
    }
    PDSIM_ASSIGN_OR_RETURN(parts.pool, kv::MHATokenToKVPool::create(pc));
    if (has_cache_groups(m) && m.count_layers(model::LayerKind::kSlidingWindow) > 0) {
        kv::MHAPoolConfig wc = pc;
        wc.layers = layers_of(m, model::LayerKind::kSlidingWindow);
        wc.num_pages = options.window_pages;
        auto window_pool = kv::MHATokenToKVPool::create(wc);
        if (!window_pool.ok()) return window_pool.status().with_context("the sliding layers' pool");
        parts.window_pool = std::move(*window_pool);
    }
    const int recurrent = m.count_layers(model::LayerKind::kRecurrent);
    if (recurrent > 0) {
        if (parts.stream->device().kind != runtime::DeviceKind::kCpu) {
            return PDSIM_ERROR(StatusCode::kUnimplemented,
                               "model {}: recurrent layers run on CPU ranks only", m.name);
        }
        PDSIM_ASSIGN_OR_RETURN(parts.states,
                               kv::StatePool::create({.num_layers = recurrent,
                                                      .num_slots = options.state_slots,
                                                      .num_heads = m.state_heads / options.tp_size,
                                                      .head_dim = m.state_head_dim,
                                                      .conv_kernel = m.conv_kernel}));
    }
    if (options.step_counter) {
        // The stream's device picks the implementation (a CUDA stream: the device counter).
        PDSIM_ASSIGN_OR_RETURN(parts.counter, pd::StepCounter::create(*parts.stream));
    }
    if (options.validator) {
        parts.validator = std::make_unique<transfer::OrderingValidator>(options.validator_rank);
        if (parts.states != nullptr) {
            parts.state_validator =
                std::make_unique<transfer::OrderingValidator>(options.validator_rank);
        }
        if (m.count_layers(model::LayerKind::kSlidingWindow) > 0 && has_cache_groups(m)) {
            parts.window_validator =
                std::make_unique<transfer::OrderingValidator>(options.validator_rank);
        }
    }
    return parts;
}

std::vector<int> layers_of(const model::ModelConfig& model, model::LayerKind kind) {
    std::vector<int> layers;
    for (int l = 0; l < model.num_layers; ++l) {
        if (model.layer_kind(l) == kind) layers.push_back(l);
    }
    return layers;
}

StatusOr<transfer::KvLayout> kv_engine_layout(const kv::MHATokenToKVPool& pool,
                                              const model::ModelConfig& model, int tp_size,
                                              int tp_rank, model::LayerKind kind) {
    if (!has_cache_groups(model)) {
        return transfer::KvLayout::from_mha_pool(pool, tp_size, tp_rank, model.num_kv_heads);
    }
    const std::vector<int> layers = layers_of(model, kind);
    if (layers.empty()) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "model {}: no {} layers for its KV engine (a hybrid model needs "
                           "full-attention layers)",
                           model.name, topo::layer_kind_name(kind));
    }
    return transfer::KvLayout::from_mha_pool(pool, tp_size, tp_rank, model.num_kv_heads, layers);
}

StatusOr<transfer::KvLayout> state_layout(const kv::StatePool& states,
                                          const model::ModelConfig& model, int tp_size,
                                          int tp_rank) {
    PDSIM_ASSIGN_OR_RETURN(transfer::HeadSlice slice,
                           transfer::kv_head_slice(model.state_heads, tp_size, tp_rank));
    if (slice.count != states.num_heads()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "state pool of {} heads, TP rank {} of {} holds {}", states.num_heads(),
                           tp_rank, tp_size, slice.count);
    }
    transfer::KvLayoutSummary sum;
    sum.kind = transfer::KvKind::kMHA;
    sum.num_layers = states.num_layers();
    sum.buffer_count = 2;
    sum.page_size = 1;
    sum.dtype_bytes = 4;
    sum.tp_size = tp_size;
    sum.tp_rank = tp_rank;
    sum.total_kv_heads = model.state_heads;
    sum.head_begin = slice.begin;
    sum.local_heads = slice.count;
    sum.head_bytes = {static_cast<uint64_t>(states.state_elems_per_head()) * 4,
                      static_cast<uint64_t>(states.conv_elems_per_head()) * 4};
    std::vector<std::byte*> bases;
    for (int l = 0; l < states.num_layers(); ++l) {
        for (int b = 0; b < 2; ++b) bases.push_back(static_cast<std::byte*>(states.data(l, b)));
    }
    return transfer::KvLayout::create(sum, states.num_pages(), std::move(bases));
}

StatusOr<std::unique_ptr<PdAttentionBackend>> build_pd_backend(const RankBuildOptions& options,
                                                               const RankParts& parts,
                                                               PdBackendSide side) {
    const model::ModelConfig& m = *options.model;
    attn::AttentionConfig ac;
    ac.num_q_heads = m.num_q_heads / options.tp_size;
    ac.num_kv_heads = m.num_kv_heads / options.tp_size;
    ac.head_dim = m.head_dim;
    ac.stream = parts.stream;
    ac.num_threads = options.threads;
    ac.kv_dtype = options.kv_dtype;
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<attn::AttentionBackend> inner,
                           attn::create_attention_backend(options.backend, ac));
    if (parts.states != nullptr) {
        // The composite backend of a hybrid model: one record per model layer, whatever its kind.
        PDSIM_ASSIGN_OR_RETURN(
            std::unique_ptr<attn::HybridBackend> hybrid,
            attn::HybridBackend::create(std::move(inner), attn::make_cpu_recurrent_mixer()));
        hybrid->plant_child_records(side.prefill && side.fault == Fault::kHybridDoubleRecord);
        inner = std::move(hybrid);
    }
    PdBackendOptions bo;
    bo.fault = side.fault;
    bo.counter = side.prefill ? parts.counter.get() : nullptr;
    bo.validator = side.prefill ? parts.validator.get() : nullptr;
    PDSIM_ASSIGN_OR_RETURN(
        transfer::HeadSlice slice,
        transfer::kv_head_slice(m.num_kv_heads, options.tp_size, options.tp_rank));
    bo.head_begin = slice.begin;
    bo.num_layers = m.num_layers;
    bo.max_bs = side.max_bs;
    bo.max_pages_per_seq = side.max_pages_per_seq;
    bo.on_record = std::move(side.on_record);
    bo.checksums = side.checksums;
    bo.fill = std::move(side.fill);
    if (has_cache_groups(m)) {
        // Each group's engine numbers its own layers (kv_engine_layout): the checksums too.
        auto index_of = [&](model::LayerKind kind) {
            std::vector<int> index(static_cast<size_t>(m.num_layers), -1);
            const std::vector<int> layers = layers_of(m, kind);
            for (size_t i = 0; i < layers.size(); ++i) {
                index[static_cast<size_t>(layers[i])] = static_cast<int>(i);
            }
            return index;
        };
        bo.engine_layer = index_of(model::LayerKind::kFullAttention);
        bo.window_layer = index_of(model::LayerKind::kSlidingWindow);
        bo.window_validator = side.prefill ? parts.window_validator.get() : nullptr;
        bo.page_size = options.page_size;
    }
    if (parts.states != nullptr) {
        bo.state_validator = side.prefill ? parts.state_validator.get() : nullptr;
        PDSIM_ASSIGN_OR_RETURN(bo.state_layout,
                               state_layout(*parts.states, m, options.tp_size, options.tp_rank));
    }
    if (side.checksums == ChecksumSource::kPages) {
        PDSIM_ASSIGN_OR_RETURN(bo.layout,
                               transfer::KvLayout::from_mha_pool(*parts.pool, options.tp_size,
                                                                 options.tp_rank, m.num_kv_heads));
    }
    return PdAttentionBackend::create(std::move(inner), bo);
}

StatusOr<model::StepBatch> build_step_batch(attn::ForwardMode mode,
                                            std::span<const ForwardEntry> entries, int page_size,
                                            Segments* segments, int window) {
    const int ps = page_size;
    model::StepBatch b;
    b.mode = mode;
    int stride = 1;
    for (const auto& e : entries) stride = std::max<int>(stride, static_cast<int>(e.pages.size()));
    b.page_table_stride = stride;
    const bool rings = !entries.empty() && !entries.front().window_ring.empty();
    if (rings) b.window_page_table_stride = stride;
    // One entry's slots of [t0, t1) and its page table padded with page 0, from `table`
    // (table[t / page_size] holds position t).
    auto append = [&](const ForwardEntry& e, std::span<const int32_t> table,
                      std::vector<int32_t>* locs, std::vector<int32_t>* page_table) {
        for (int64_t t = e.t0; t < e.t1; ++t) {
            locs->push_back(table[static_cast<size_t>(t / ps)] * ps + static_cast<int32_t>(t % ps));
        }
        for (int p = 0; p < stride; ++p) {
            page_table->push_back(p < static_cast<int>(table.size()) ? table[static_cast<size_t>(p)]
                                                                     : 0);
        }
    };
    int64_t off = 0;
    for (const auto& e : entries) {
        if (e.window_ring.empty() == rings) {
            return PDSIM_ERROR(StatusCode::kInternal,
                               "request {}: a window ring on some entries of a forward only",
                               e.request);
        }
        if (rings) {
            // The pages this forward touches must be distinct ring slots (window.h).
            const int64_t touched =
                e.t1 > e.t0 ? (e.t1 - 1) / ps - std::max<int64_t>(0, e.t0 - window + 1) / ps + 1
                            : 0;
            if (window < 1 || touched > static_cast<int64_t>(e.window_ring.size())) {
                return PDSIM_ERROR(StatusCode::kInternal,
                                   "request {}: positions [{}, {}) touch {} pages of window {}, "
                                   "its ring has {}",
                                   e.request, e.t0, e.t1, touched, window, e.window_ring.size());
            }
            // The sliding layers' page table: the request's logical pages laid on its ring.
            const std::vector<int32_t> table =
                ring_pages(e.window_ring, 0, static_cast<int64_t>(e.pages.size()));
            append(e, table, &b.window_out_cache_loc, &b.window_page_table);
        }
        append(e, e.pages, &b.out_cache_loc, &b.page_table);
        b.tokens.insert(b.tokens.end(), e.tokens.begin(), e.tokens.end());
        b.seq_lens.push_back(static_cast<int32_t>(e.t1));
        b.extend_lens.push_back(static_cast<int32_t>(e.t1 - e.t0));
        b.state_slots.push_back(e.state_slot);
        segments->push_back({.request = e.request,
                             .t0 = e.t0,
                             .t1 = e.t1,
                             .batch_offset = off,
                             .pages = std::vector<int32_t>(e.pages.begin(), e.pages.end()),
                             .state_slot = e.state_slot,
                             .last = e.last,
                             .input_len = e.input_len});
        off += e.t1 - e.t0;
    }
    return b;
}

}  // namespace pdsim::testbed
