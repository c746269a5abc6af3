#include "sim/testbed/rank_builder.h"

#include <algorithm>

#include "backends/attention/attention_backend.h"
#include "backends/runtime/cpu_stream.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::testbed {

StatusOr<RankParts> build_rank_parts(const RankBuildOptions& options) {
    const model::ModelConfig& m = *options.model;
    RankParts parts;
    if (options.stream != nullptr) {
        parts.stream = options.stream;
    } else {
        parts.owned_stream =
            std::make_unique<runtime::CpuStream>(options.stream_name, options.stream_timeout);
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
    PDSIM_ASSIGN_OR_RETURN(parts.pool, kv::MHATokenToKVPool::create(pc));
    if (options.step_counter) {
        // The stream's device picks the implementation (a CUDA stream: the device counter).
        PDSIM_ASSIGN_OR_RETURN(parts.counter, pd::StepCounter::create(*parts.stream));
    }
    if (options.validator) {
        parts.validator = std::make_unique<transfer::OrderingValidator>(options.validator_rank);
    }
    return parts;
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
    if (side.checksums == ChecksumSource::kPages) {
        PDSIM_ASSIGN_OR_RETURN(bo.layout,
                               transfer::KvLayout::from_mha_pool(*parts.pool, options.tp_size,
                                                                 options.tp_rank, m.num_kv_heads));
    }
    return PdAttentionBackend::create(std::move(inner), bo);
}

model::StepBatch build_step_batch(attn::ForwardMode mode, std::span<const ForwardEntry> entries,
                                  int page_size, Segments* segments) {
    const int ps = page_size;
    model::StepBatch b;
    b.mode = mode;
    int stride = 1;
    for (const auto& e : entries) stride = std::max<int>(stride, static_cast<int>(e.pages.size()));
    b.page_table_stride = stride;
    int64_t off = 0;
    for (const auto& e : entries) {
        for (int64_t t = e.t0; t < e.t1; ++t) {
            b.out_cache_loc.push_back(e.pages[static_cast<size_t>(t / ps)] * ps +
                                      static_cast<int32_t>(t % ps));
        }
        b.tokens.insert(b.tokens.end(), e.tokens.begin(), e.tokens.end());
        b.seq_lens.push_back(static_cast<int32_t>(e.t1));
        b.extend_lens.push_back(static_cast<int32_t>(e.t1 - e.t0));
        for (int p = 0; p < stride; ++p) {
            b.page_table.push_back(
                p < static_cast<int>(e.pages.size()) ? e.pages[static_cast<size_t>(p)] : 0);
        }
        segments->push_back({.request = e.request,
                             .t0 = e.t0,
                             .t1 = e.t1,
                             .batch_offset = off,
                             .pages = std::vector<int32_t>(e.pages.begin(), e.pages.end())});
        off += e.t1 - e.t0;
    }
    return b;
}

}  // namespace pdsim::testbed
