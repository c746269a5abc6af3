#include "sim/testbed/pd_backend.h"

#include <algorithm>
#include <thread>

#include "backends/kv/kv_pool.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/window.h"

namespace pdsim::testbed {

PdAttentionBackend::PdAttentionBackend(std::unique_ptr<attn::AttentionBackend> inner,
                                       PdBackendOptions options)
    : attn::AttentionBackend(inner->config()),
      opts_(std::move(options)),
      inner_(std::move(inner)) {}

PdAttentionBackend::~PdAttentionBackend() {
    stream().synchronize().ignore_error();
}

StatusOr<std::unique_ptr<PdAttentionBackend>> PdAttentionBackend::create(
    std::unique_ptr<attn::AttentionBackend> inner, PdBackendOptions options) {
    if (inner == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "PdAttentionBackend: no backend");
    const runtime::Device device = inner->stream().device();
    const bool pages = options.checksums == ChecksumSource::kPages;
    if (device.kind != runtime::DeviceKind::kCpu) {
        // What reads or writes KV (or graph buffers) in host memory.
        std::string host_only;
        if (!pages && options.validator != nullptr) host_only = "activation checksums";
        if (!pages && options.fault == Fault::kLateWrite) host_only = "--fault late-write";
        if (options.fault == Fault::kStaleGraphMetadata) {
            host_only = "--fault stale-graph-metadata (GPU ranks plant it in the decode graphs)";
        }
        if (!host_only.empty()) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "PdAttentionBackend: {} read and write host memory: CPU streams "
                               "only, and stream {} is on {}:{}",
                               host_only, inner->stream().name(),
                               runtime::device_kind_name(device.kind), device.index);
        }
    }
    if (pages && !options.layout &&
        (options.validator != nullptr || options.fault == Fault::kLateWrite)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "PdAttentionBackend: page checksums and late writes need the rank's "
                           "KV layout (options.layout)");
    }
    if (pages && options.fault == Fault::kLateWrite && !options.fill) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "PdAttentionBackend: --fault late-write with page checksums needs a "
                           "stream fill (options.fill)");
    }
    if (pages && options.validator != nullptr && options.layout && !options.layout->is_host() &&
        options.memory_ops == nullptr) {
        PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<transfer::KvMemoryOps> ops,
                               transfer::make_kv_memory_ops(options.layout->device()));
        options.memory_ops = std::move(ops);
    }
    std::unique_ptr<PdAttentionBackend> b(
        new PdAttentionBackend(std::move(inner), std::move(options)));
    if (b->opts_.counter != nullptr && !b->owns_records()) {
        b->inner_->register_step_counter(b->opts_.counter);
    }
    b->graph_seq_lens_.assign(static_cast<size_t>(b->opts_.max_bs), 0);
    return b;
}

bool PdAttentionBackend::owns_records() const {
    return opts_.fault == Fault::kRecordBeforeWrite || opts_.fault == Fault::kSkipRecord ||
           opts_.fault == Fault::kDoubleRecord ||
           (opts_.checksums == ChecksumSource::kPages && opts_.counter != nullptr);
}

Status PdAttentionBackend::init_forward_metadata(const attn::ForwardBatch& batch) {
    if (opts_.fault != Fault::kStaleGraphMetadata || attn::is_decode(batch.mode) ||
        opts_.counter == nullptr) {
        return inner_->init_forward_metadata(batch);
    }
    // The caller's half of a graph replay: refresh the aliased seq_lens buffer, in stream order.
    auto seq = std::make_shared<std::vector<int32_t>>(batch.seq_lens.begin(), batch.seq_lens.end());
    PDSIM_RETURN_IF_ERROR(stream().enqueue([this, seq] {
        std::copy(seq->begin(), seq->begin() + std::min(seq->size(), graph_seq_lens_.size()),
                  graph_seq_lens_.begin());
        return Status();
    }));
    if (!graph_installed_) {
        attn::GraphStateExtras extras;
        extras.max_pages_per_seq = opts_.max_pages_per_seq;
        PDSIM_RETURN_IF_ERROR(attn::init_backend_cuda_graph_state(*inner_, opts_.max_bs,
                                                                  graph_seq_lens_.data(), extras));
        graph_installed_ = true;
        return inner_->init_forward_metadata_replay_cuda_graph(batch);
    }
    // The bug: replay the captured graph without init_forward_metadata_replay_cuda_graph, so the
    // kernels read the first batch's q_lens / page table / bs with this batch's seq_lens.
    return inner_->init_forward_metadata_capture_cuda_graph(opts_.max_bs, batch.mode);
}

Status PdAttentionBackend::init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                                 const attn::GraphStateExtras& extras) {
    return inner_->init_cuda_graph_state(max_bs, seq_lens_buf, extras);
}

Status PdAttentionBackend::init_forward_metadata_capture_cuda_graph(int bs,
                                                                    attn::ForwardMode mode) {
    return inner_->init_forward_metadata_capture_cuda_graph(bs, mode);
}

Status PdAttentionBackend::init_forward_metadata_replay_cuda_graph(
    const attn::ForwardBatch& batch) {
    return inner_->init_forward_metadata_replay_cuda_graph(batch);
}

Status PdAttentionBackend::record(int layer) {
    PDSIM_RETURN_IF_ERROR(opts_.counter->record_cache());
    if (opts_.on_record) {
        PDSIM_RETURN_IF_ERROR(stream().enqueue([cb = opts_.on_record, layer] {
            cb(layer, now_us());
            return Status();
        }));
    }
    return {};
}

Status PdAttentionBackend::race_window() {
    const auto window = opts_.race_window;
    return stream().enqueue([window] {
        std::this_thread::sleep_for(window);
        return Status();
    });
}

Status PdAttentionBackend::enqueue_checksums(const attn::ForwardArgs& args) {
    if ((opts_.validator == nullptr && opts_.window_validator == nullptr) || segments_ == nullptr ||
        segments_->empty()) {
        return {};
    }
    const auto* mha = dynamic_cast<const kv::MHATokenToKVPool*>(args.pool);
    if (mha == nullptr || mha->dtype() != kv::KVDtype::kF32) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "checksums need an fp32 MHA pool");
    }
    const int hkv = mha->num_kv_heads();
    const int d = mha->head_dim();
    const int dv = mha->v_head_dim() > 0 ? mha->v_head_dim() : d;
    if (args.k.dtype != runtime::DType::kF32 || args.v.dtype != runtime::DType::kF32 ||
        args.k.empty() || args.v.empty()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "checksums need the layer's K and V as fp32 views");
    }
    // The engine the layer's KV goes over, and the tokens it sends: a sliding layer's window engine
    // sends positions [window_start, input_len) as its tokens 0, 1, ... (rank_builder.h).
    const size_t model_layer = static_cast<size_t>(args.layer.layer_id);
    const bool windowed = !opts_.window_layer.empty() && opts_.window_layer[model_layer] >= 0;
    transfer::OrderingValidator* validator = windowed ? opts_.window_validator : opts_.validator;
    if (validator == nullptr) return {};
    const int layer = windowed                     ? opts_.window_layer[model_layer]
                      : opts_.engine_layer.empty() ? args.layer.layer_id
                                                   : opts_.engine_layer[model_layer];
    const int window = windowed ? args.layer.sliding_window : 0;
    return stream().enqueue([validator, segs = segments_, k = args.k.as<float>(),
                             v = args.v.as<float>(), hkv, d, dv, layer, window,
                             page_size = opts_.page_size, head_begin = opts_.head_begin] {
        for (const BatchSegment& s : *segs) {
            const int64_t base = window > 0 ? window_start(s.input_len, window, page_size) : 0;
            const int64_t t0 = std::max(s.t0, base);
            if (t0 >= s.t1) continue;  // before the window: never sent
            for (int buf = 0; buf < 2; ++buf) {
                const float* src = buf == 0 ? k : v;
                const int dim = buf == 0 ? d : dv;
                std::vector<uint64_t> sums(static_cast<size_t>(hkv), 0);
                for (int64_t t = t0; t < s.t1; ++t) {
                    const float* tok =
                        src + static_cast<size_t>(s.batch_offset + t - s.t0) * hkv * dim;
                    for (int h = 0; h < hkv; ++h) {
                        sums[static_cast<size_t>(h)] +=
                            transfer::kv_hash(tok + static_cast<size_t>(h) * dim,
                                              sizeof(float) * static_cast<size_t>(dim),
                                              static_cast<uint64_t>(t - base));
                    }
                }
                validator->record_expected(s.request, layer, buf, head_begin, sums, t0 - base,
                                           s.t1 - base);
            }
        }
        return Status();
    });
}

Status PdAttentionBackend::enqueue_page_checksums(int layer) {
    if (opts_.validator == nullptr || segments_ == nullptr) return {};
    for (const BatchSegment& s : *segments_) {
        PDSIM_RETURN_IF_ERROR(
            transfer::enqueue_layer_checksum(stream(), *opts_.validator, *opts_.layout, s.request,
                                             layer, s.pages, s.t0, s.t1, opts_.memory_ops.get()));
    }
    return {};
}

// Layer 0's K of every token of the batch, overwritten by the stream fill: one fill per run of
// consecutive slots.
Status PdAttentionBackend::enqueue_page_late_write() {
    if (segments_ == nullptr) return {};
    const transfer::KvLayout& layout = *opts_.layout;
    const int64_t ps = layout.page_size();
    const size_t token_bytes = layout.token_bytes(0);
    for (const BatchSegment& s : *segments_) {
        PDSIM_RETURN_IF_ERROR(layout.check_pages(s.pages, s.t1));
        int64_t run_begin = -1, run_len = 0;
        auto flush = [&]() -> Status {
            if (run_len == 0) return {};
            return opts_.fill(layout.slot_addr(0, 0, run_begin), kLateWriteByte,
                              token_bytes * static_cast<size_t>(run_len));
        };
        for (int64_t t = s.t0; t < s.t1; ++t) {
            const int64_t slot = int64_t{s.pages[static_cast<size_t>(t / ps)]} * ps + t % ps;
            if (run_len > 0 && slot == run_begin + run_len) {
                ++run_len;
                continue;
            }
            PDSIM_RETURN_IF_ERROR(flush());
            run_begin = slot;
            run_len = 1;
        }
        PDSIM_RETURN_IF_ERROR(flush());
    }
    return {};
}

Status PdAttentionBackend::enqueue_late_write(const attn::ForwardArgs& args) {
    if (segments_ == nullptr) return {};
    if (!args.pool->holds_layer(0)) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "late-write: layer 0 is in another cache group's pool than layer {}",
                           args.layer.layer_id);
    }
    int64_t n = 0;
    for (const auto& s : *segments_) n += s.t1 - s.t0;
    return stream().enqueue([pool = args.pool, locs = args.out_cache_loc.as<int32_t>(), n] {
        std::vector<float> row(static_cast<size_t>(pool->token_elems(0)));
        for (int64_t t = 0; t < n; ++t) {
            pool->read_token(0, 0, locs[t], row.data());
            for (float& x : row) x += 1.0f;
            pool->write_token(0, 0, locs[t], row.data());
        }
        return Status();
    });
}

Status PdAttentionBackend::call_inner(const attn::ForwardArgs& args) {
    // Records are either the inner backend's (its counter) or ours (record_kv_cache = false).
    std::optional<bool> rec;
    if (owns_records()) rec = false;
    return inner_->forward(args.q, args.k, args.v, args.layer, args.out_cache_loc, *args.pool,
                           args.mode, args.bs, args.out, args.save_kv_cache, rec);
}

Status PdAttentionBackend::forward_recurrent_impl(const attn::RecurrentArgs& args) {
    PDSIM_RETURN_IF_ERROR(inner_->forward_recurrent(args, /*record_kv_cache=*/false));
    const bool extend = !attn::is_decode(args.mode) && !attn::is_idle(args.mode);
    if (opts_.state_validator != nullptr && extend && segments_ != nullptr) {
        for (const BatchSegment& seg : *segments_) {
            if (!seg.last || seg.state_slot <= 0) continue;
            PDSIM_RETURN_IF_ERROR(transfer::enqueue_layer_checksum(
                stream(), *opts_.state_validator, *opts_.state_layout, seg.request,
                args.layer.state_layer, {seg.state_slot}, 0, 1));
        }
    }
    if (opts_.counter == nullptr || !extend) return {};
    const int layer = args.layer.layer_id;
    if (opts_.fault == Fault::kSkipRecord && layer == opts_.num_layers - 1) return {};
    PDSIM_RETURN_IF_ERROR(record(layer));
    if (opts_.fault == Fault::kDoubleRecord && layer == 0) {
        PDSIM_RETURN_IF_ERROR(record(layer));
        PDSIM_RETURN_IF_ERROR(race_window());
    }
    return {};
}

Status PdAttentionBackend::forward_decode(const attn::ForwardArgs& args) {
    return call_inner(args);
}

// kPages: write -> checksum -> record (see the file comment), faults included.
Status PdAttentionBackend::forward_extend_pages(const attn::ForwardArgs& args) {
    const int layer = args.layer.layer_id;
    if (opts_.counter == nullptr) {
        // No records here (decode or colocated ranks); checksums only when asked.
        PDSIM_RETURN_IF_ERROR(call_inner(args));
        return enqueue_page_checksums(layer);
    }
    const bool late_write = opts_.fault == Fault::kLateWrite;
    if (!args.save_kv_cache) {
        // The KV is in the pages already: its checksum and record come before the attention.
        if (opts_.fault != Fault::kNone && opts_.fault != Fault::kFreeBeforeTransfer) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "--fault {} on a forward whose KV was written before it "
                               "(save_kv_cache = false)",
                               fault_name(opts_.fault));
        }
        PDSIM_RETURN_IF_ERROR(enqueue_page_checksums(layer));
        PDSIM_RETURN_IF_ERROR(record(layer));
        return call_inner(args);
    }
    switch (opts_.fault) {
        case Fault::kRecordBeforeWrite:
            PDSIM_RETURN_IF_ERROR(record(layer));
            PDSIM_RETURN_IF_ERROR(race_window());
            PDSIM_RETURN_IF_ERROR(call_inner(args));
            return enqueue_page_checksums(layer);
        case Fault::kSkipRecord:
            PDSIM_RETURN_IF_ERROR(call_inner(args));
            PDSIM_RETURN_IF_ERROR(enqueue_page_checksums(layer));
            if (layer != opts_.num_layers - 1) PDSIM_RETURN_IF_ERROR(record(layer));
            return {};
        case Fault::kDoubleRecord:
            PDSIM_RETURN_IF_ERROR(call_inner(args));
            PDSIM_RETURN_IF_ERROR(enqueue_page_checksums(layer));
            PDSIM_RETURN_IF_ERROR(record(layer));
            if (layer == 0) {
                PDSIM_RETURN_IF_ERROR(record(layer));
                PDSIM_RETURN_IF_ERROR(race_window());
            }
            return {};
        default:
            break;
    }
    if (late_write && layer == opts_.num_layers - 1 && opts_.num_layers > 1) {
        PDSIM_RETURN_IF_ERROR(enqueue_page_late_write());
    }
    PDSIM_RETURN_IF_ERROR(call_inner(args));
    PDSIM_RETURN_IF_ERROR(enqueue_page_checksums(layer));
    PDSIM_RETURN_IF_ERROR(record(layer));
    if (late_write && opts_.num_layers == 1) PDSIM_RETURN_IF_ERROR(enqueue_page_late_write());
    return {};
}

Status PdAttentionBackend::forward_extend(const attn::ForwardArgs& args) {
    if (opts_.checksums == ChecksumSource::kPages) return forward_extend_pages(args);
    const int layer = args.layer.layer_id;
    const bool records = opts_.counter != nullptr;
    PDSIM_RETURN_IF_ERROR(enqueue_checksums(args));
    if (!records || !owns_records()) {
        if (records && opts_.fault == Fault::kLateWrite && layer == opts_.num_layers - 1 &&
            opts_.num_layers > 1) {
            PDSIM_RETURN_IF_ERROR(enqueue_late_write(args));
        }
        PDSIM_RETURN_IF_ERROR(call_inner(args));
        if (records && opts_.fault == Fault::kLateWrite && opts_.num_layers == 1) {
            PDSIM_RETURN_IF_ERROR(enqueue_late_write(args));
        }
        if (records && opts_.on_record) {
            // Runs right after the inner backend's record (the last task it enqueued).
            PDSIM_RETURN_IF_ERROR(stream().enqueue([cb = opts_.on_record, layer] {
                cb(layer, now_us());
                return Status();
            }));
        }
        return {};
    }
    switch (opts_.fault) {
        case Fault::kRecordBeforeWrite:
            PDSIM_RETURN_IF_ERROR(record(layer));
            PDSIM_RETURN_IF_ERROR(race_window());
            return call_inner(args);
        case Fault::kSkipRecord:
            PDSIM_RETURN_IF_ERROR(call_inner(args));
            if (layer != opts_.num_layers - 1) PDSIM_RETURN_IF_ERROR(record(layer));
            return {};
        case Fault::kDoubleRecord:
            PDSIM_RETURN_IF_ERROR(call_inner(args));
            PDSIM_RETURN_IF_ERROR(record(layer));
            if (layer == 0) {
                PDSIM_RETURN_IF_ERROR(record(layer));
                PDSIM_RETURN_IF_ERROR(race_window());
            }
            return {};
        default:
            return PDSIM_ERROR(StatusCode::kInternal, "unexpected fault {}",
                               fault_name(opts_.fault));
    }
}

}  // namespace pdsim::testbed
