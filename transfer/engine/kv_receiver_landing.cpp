// KvReceiver's landing path: acks, chunk headers and the receives they post, scatters, arrival,
// completions and the final check (kv_receiver_impl.h).

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/logging.h"
#include "transfer/engine/kv_receiver_impl.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::transfer {

bool KvReceiver::Impl::headers_complete_locked(const RecvReq& r) const {
    return r.acks == static_cast<int>(r.sources.size()) && r.last_headers == r.frag_sources;
}

std::vector<int> KvReceiver::Impl::sweep_arrivals_locked(RecvReq& r) {
    std::vector<int> newly;
    if (!headers_complete_locked(r) || r.state != RequestState::kTransferring) return newly;
    for (size_t l = 0; l < r.arrived.size(); ++l) {
        if (r.arrived[l] == 0 && r.layer_pending[l] == 0) {
            r.arrived[l] = 1;
            ++r.layers_arrived;
            ++stats_.layers;
            newly.push_back(static_cast<int>(l));
        }
    }
    return newly;
}

bool KvReceiver::Impl::maybe_finish_locked(RecvReq& r) {
    if (r.state != RequestState::kTransferring || r.finalizing || !headers_complete_locked(r) ||
        r.layers_arrived != layout_.num_layers() || r.completions != r.frag_sources ||
        r.ops_outstanding != 0) {
        return false;
    }
    r.finalizing = true;
    return true;
}

bool KvReceiver::Impl::maybe_settle_locked(RecvReq& r) {
    if (r.state != RequestState::kFailed) return false;
    if (write_mode()) {
        // Nothing of ours can write the pages; a source's one-sided writes can, until it
        // quiesced, completed or is known dead (kv_receiver.h, "Page safety").
        for (const SourceState& s : r.sources) {
            if (!s.settled()) return false;
        }
        if (r.arrival_slot >= 0) {
            // A source given up as dead may still add to the words (it may only be stopped):
            // such a slot is never handed out again. Otherwise take() reads its words first.
            const bool maybe_live = std::any_of(r.sources.begin(), r.sources.end(), [](auto& s) {
                return s.dead && !s.quiesced && !s.completed && !s.detached;
            });
            if (maybe_live) {
                arrival_->quarantine(r.arrival_slot);
            } else {
                arrival_->give_back_unread(r.arrival_slot);
            }
            r.arrival_slot = -1;
        }
    } else if (r.ops_outstanding > 0) {
        return false;
    }
    bool released = false;
    if (!r.pins_released) {
        r.pins_released = true;
        pins_.unpin_request(r.id);
        released = true;
    }
    if (!r.slot_settled) {
        r.slot_settled = true;
        if (r.finalizing) {
            free_slots_.push_back(r.slot);
        } else {
            // Messages of this request may still be in flight (or queued as unexpected at
            // the transport) on this tag: never hand it out again.
            ++stats_.tags_quarantined;
        }
    }
    return released;
}

void KvReceiver::Impl::after_change(const std::shared_ptr<RecvReq>& r, std::vector<int> newly) {
    for (int l : newly) emit(TransferEvent::Kind::kLayerArrived, r->id, l, -1, 0);
    if (!newly.empty()) table_.notify_waiters();
}

void KvReceiver::Impl::handle_ack(int peer, const AckMsg& m) {
    std::string why;
    std::shared_ptr<RecvReq> r;
    std::vector<int> newly;
    bool finish = false;
    {
        MutexLock lock(table_.mu());
        r = table_.find_locked(m.request_id);
        if (r) r->touch();  // a message of the request: progress
        if (!r || is_terminal(r->state)) return;
        const int src = source_index(*r, peer);
        if (src < 0 || m.prefill_tp_rank != src ||
            m.prefill_tp_size != static_cast<int>(r->sources.size())) {
            why = fmt::format(
                "request {}: ack from rank {} as prefill TP rank {} of {} does "
                "not match the request's prefill ranks",
                r->id, peer, m.prefill_tp_rank, m.prefill_tp_size);
        } else if (!m.ok) {
            // It refused the bootstrap, so it never attached the request: it writes nothing.
            r->sources[static_cast<size_t>(src)].detached = true;
            why = fmt::format("request {}: prefill rank {} refused: {}", r->id, peer, m.reason);
        } else if (Status c = check_compatible(m.layout, layout_.summary()); !c.ok()) {
            why = fmt::format("request {}: prefill rank {}: {}", r->id, peer, c.message());
        } else if (m.layout.tp_rank != src || m.layout.tp_size != m.prefill_tp_size) {
            why = fmt::format("request {}: prefill rank {} layout is TP {} of {}", r->id, peer,
                              m.layout.tp_rank, m.layout.tp_size);
        } else {
            SourceState& s = r->sources[static_cast<size_t>(src)];
            if (s.acked) return;  // duplicate
            s.acked = true;
            s.signals = m.arrival_signals && r->arrival_slot >= 0;
            s.layout = m.layout;
            s.frag = make_fragment(m.layout, layout_.summary());
            if (s.frag) {
                const size_t agreed = std::min<uint64_t>(max_msg_, m.max_message_bytes);
                s.max_run = max_run_tokens(*s.frag, layout_.buffer_count(), agreed);
                ++r->frag_sources;
            }
            ++r->acks;
            if (why.empty() && r->acks == static_cast<int>(r->sources.size())) {
                r->state = RequestState::kTransferring;
                newly = sweep_arrivals_locked(*r);
                finish = maybe_finish_locked(*r);
            }
        }
    }
    if (!why.empty()) {
        fail(r, why, true);
        return;
    }
    after_change(r, std::move(newly));
    if (finish) finalize(r);
}

void KvReceiver::Impl::handle_chunk(int peer, const ChunkMsg& m) {
    std::string why;
    std::shared_ptr<RecvReq> r;
    std::vector<RecvOp> ops;
    Fragment frag;
    {
        MutexLock lock(table_.mu());
        r = table_.find_locked(m.request_id);
        if (r) r->touch();  // a message of the request: progress
        if (!r || is_terminal(r->state)) return;
        const int src = source_index(*r, peer);
        SourceState* s = src < 0 ? nullptr : &r->sources[static_cast<size_t>(src)];
        const int64_t sps = s == nullptr ? 1 : s->layout.page_size;
        if (s == nullptr || !s->acked || !s->frag || s->last_header ||
            m.chunk_index != s->next_chunk || m.token_begin != s->next_token ||
            m.token_end <= m.token_begin || m.token_end > r->num_tokens ||
            m.is_last != (m.token_end == r->num_tokens) ||
            m.src_first_page != m.token_begin / sps ||
            static_cast<int64_t>(m.src_pages.size()) <
                (m.token_end + sps - 1) / sps - m.src_first_page) {
            why = fmt::format(
                "request {}: protocol error: unexpected chunk {} [{}, {}) "
                "is_last={} ({} prefill pages from index {}) from rank {}",
                m.request_id, m.chunk_index, m.token_begin, m.token_end, m.is_last,
                m.src_pages.size(), m.src_first_page, peer);
        } else {
            frag = *s->frag;
            s->next_chunk = m.chunk_index + 1;
            s->next_token = m.token_end;
            if (write_mode()) {
                // No receives: the chunk's data arrives as one LayerWritten per layer (each
                // counted as one outstanding op of its layer), then (last chunk) the completion.
                const int L = layout_.num_layers();
                s->chunk_tokens.push_back(m.token_end - m.token_begin);
                s->written.resize(s->written.size() + static_cast<size_t>(L), 0);
                for (int l = 0; l < L; ++l) {
                    ++r->layer_pending[static_cast<size_t>(l)];
                    ++r->ops_outstanding;
                }
                if (m.is_last) ++r->ops_outstanding;
            } else {
                ops = plan_chunk_locked(*r, *s, m, why);
                if (why.empty() && ordered() && m.is_last) {
                    // The completion comes on the control channel, after the last DataPosted.
                    s->completion_pending = true;
                    ++r->ops_outstanding;
                }
            }
            if (why.empty() && m.is_last) {
                s->last_header = true;
                ++r->last_headers;
            }
        }
    }
    if (!why.empty()) {
        fail(r, why, true);
        return;
    }
    // Device layouts: the chunk's staging memory (the ops' allocate_staging), outside the lock.
    std::shared_ptr<DeviceStaging> staging;
    for (const RecvOp& op : ops) {
        if (op.device_staging) staging = op.device_staging;
    }
    if (staging) {
        StatusOr<KvOpsMemory> memory = comm_->ops().allocate_staging(staging->plan.staging_bytes);
        if (memory.ok()) {
            staging->memory = std::move(memory).value();
            for (RecvOp& op : ops) {
                if (!op.device_staging) continue;
                op.ptr = staging->memory.data() + staging->plan.messages[op.message].staging_offset;
            }
        } else {
            // post_ops withdraws every receive of the failed request.
            fail(r,
                 fmt::format("request {}: staging memory of {} bytes for chunk {} from prefill "
                             "rank {}: {}",
                             r->id, staging->plan.staging_bytes, m.chunk_index, peer,
                             memory.status().message()),
                 true);
        }
    }
    if (ordered()) {
        // Posted once a DataPosted announces them (handle_data_posted).
        MutexLock lock(table_.mu());
        const int src = source_index(*r, peer);
        if (is_terminal(r->state)) {
            // Failed meanwhile (fail() withdrew what it saw): never posted.
            for (const RecvOp& op : ops) {
                --r->ops_outstanding;
                if (op.layer >= 0) --r->layer_pending[static_cast<size_t>(op.layer)];
            }
            maybe_settle_locked(*r);
        } else {
            std::deque<RecvOp>& q = r->sources[static_cast<size_t>(src)].unposted;
            for (RecvOp& op : ops) q.push_back(std::move(op));
        }
        ops.clear();
    }
    // Posted from this (the control) thread only, in plan order: per (source, tag) the k-th
    // receive matches the source's k-th send.
    post_ops(r, peer, frag, std::move(ops));
    std::vector<int> newly;
    bool finish;
    {
        MutexLock lock(table_.mu());
        newly = sweep_arrivals_locked(*r);
        finish = maybe_finish_locked(*r);
    }
    after_change(r, std::move(newly));
    if (finish) finalize(r);
}

std::vector<receiver_detail::RecvOp> KvReceiver::Impl::plan_chunk_locked(RecvReq& r,
                                                                         const SourceState& s,
                                                                         const ChunkMsg& m,
                                                                         std::string& why) {
    const Fragment& f = *s.frag;
    const std::vector<TokenRun> runs =
        make_runs(m.src_pages, s.layout.page_size, m.src_first_page, r.dst_pages,
                  layout_.page_size(), m.token_begin, m.token_end, s.max_run);
    std::vector<RecvOp> ops;
    const int L = layout_.num_layers();
    const int B = layout_.buffer_count();
    // Device layouts: messages that fill part of a decode slot land in one staging buffer of the
    // chunk (same message order and sizes), which the comm stream scatters.
    std::shared_ptr<DeviceStaging> device_staging;
    if (comm_) {
        bool partial = false;
        for (int b = 0; b < B; ++b) partial = partial || !f.dst_contiguous[static_cast<size_t>(b)];
        if (partial) {
            StatusOr<KvStagingPlan> plan = plan_scatter(layout_, f, runs, 0, L);
            if (!plan.ok()) {
                why =
                    fmt::format("request {}: the scatter plan of chunk {} from prefill rank {}: {}",
                                r.id, m.chunk_index, s.world_rank, plan.status().message());
                return {};
            }
            device_staging = std::make_shared<DeviceStaging>();
            device_staging->plan = std::move(plan).value();
        }
    }
    ops.reserve(static_cast<size_t>(L * B) * runs.size() + 1);
    for (int l = 0; l < L; ++l) {
        for (int b = 0; b < B; ++b) {
            for (size_t k = 0; k < runs.size(); ++k) {
                const TokenRun& run = runs[k];
                RecvOp op;
                op.layer = l;
                op.chunk = m.chunk_index;
                op.buf = b;
                op.run = run;
                op.bytes = message_bytes(f, b, run);
                if (f.dst_contiguous[static_cast<size_t>(b)]) {
                    op.ptr = layout_.slot_addr(l, b, run.dst_slot);
                } else if (device_staging) {
                    // op.ptr is set once the staging memory is allocated (handle_chunk).
                    op.device_staging = device_staging;
                    op.message =
                        (static_cast<size_t>(l) * static_cast<size_t>(B) + static_cast<size_t>(b)) *
                            runs.size() +
                        k;
                } else {
                    op.staging = std::make_shared<std::vector<std::byte>>(op.bytes);
                    op.ptr = op.staging->data();
                }
                ++r.layer_pending[static_cast<size_t>(l)];
                ++r.ops_outstanding;
                ops.push_back(std::move(op));
            }
        }
    }
    if (m.is_last && !ordered()) {
        RecvOp op;
        op.layer = -1;
        op.completion = std::make_shared<Bytes>(completion_capacity(L, B, f.head_count));
        op.ptr = op.completion->data();
        op.bytes = op.completion->size();
        ++r.ops_outstanding;
        ops.push_back(std::move(op));
    }
    return ops;
}

void KvReceiver::Impl::post_ops(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                                std::vector<RecvOp> ops, bool announced) {
    std::weak_ptr<Impl> weak = weak_from_this();
    const Tag tag = ordered() ? kOrderedPostTag : r->tag;
    for (size_t i = 0; i < ops.size(); ++i) {
        bool failed;
        {
            MutexLock lock(table_.mu());
            failed = r->state == RequestState::kFailed;
        }
        if (failed && !announced) {
            // The request failed meanwhile: the rest is never posted (and counted as done).
            for (size_t j = i; j < ops.size(); ++j) op_done(r, ops[j].layer, 0, "withdrawn");
            return;
        }
        auto op = std::make_shared<RecvOp>(std::move(ops[i]));
        auto h = data_.post_recv(peer, tag, op->ptr, op->bytes);
        if (!h.ok() && announced) {
            // The announced message stays unmatched: the pair's stream is out of step from here
            // (a transport refuses a post when it is closed or the peer is gone, in practice).
            op_done(r, op->layer, 0,
                    fmt::format("request {}: posting the receive of an announced message of layer "
                                "{} from prefill rank {} failed: {}",
                                r->id, op->layer, peer, h.status().message()));
            continue;
        }
        if (!h.ok()) {
            // This op and the ones never posted are done (failed) as far as accounting goes.
            for (size_t j = i; j < ops.size(); ++j) {
                const RecvOp& rest = j == i ? *op : ops[j];
                op_done(r, rest.layer, 0,
                        fmt::format("request {}: posting a receive from prefill rank {} "
                                    "failed: {}",
                                    r->id, peer, h.status().message()));
            }
            return;
        }
        bool cancel_now = false;
        {
            MutexLock lock(table_.mu());
            if (r->state == RequestState::kFailed && !announced) {
                // fail() already withdrew the handles it knew of; this one came later.
                cancel_now = true;
            } else {
                r->handles.push_back(*h);
                if (r->handles.size() > 256 &&
                    r->handles.size() > 2 * static_cast<size_t>(r->ops_outstanding)) {
                    std::erase_if(r->handles, [](const RequestHandle& x) { return x.done(); });
                }
            }
        }
        if (cancel_now) data_.cancel(*h).ignore_error();
        h->on_complete([weak, r, peer, frag, op](const Status& st, size_t n) {
            if (auto self = weak.lock()) self->on_recv_complete(r, peer, frag, op, st, n);
        });
    }
}

void KvReceiver::Impl::on_recv_complete(const std::shared_ptr<RecvReq>& r, int peer,
                                        const Fragment& frag, const std::shared_ptr<RecvOp>& op,
                                        const Status& st, size_t n) {
    r->touch();  // a receive landed (or failed): progress
    if (!st.ok()) {
        op_done(r, op->layer, 0,
                fmt::format("request {}: receive of {} from prefill rank {} failed: {}", r->id,
                            op->layer >= 0 ? fmt::format("layer {}", op->layer)
                                           : std::string("the completion message"),
                            peer, st.message()));
        return;
    }
    if (op->layer < 0) {
        // Decoding and bookkeeping of the completion happen on the control thread.
        channel_->post([self = shared_from_this(), r, peer, frag, op, n] {
            self->handle_completion(
                r, peer, frag,
                decode_completion(std::span<const uint8_t>(op->completion->data(), n)));
        });
        return;
    }
    if (n != op->bytes) {
        op_done(r, op->layer, 0,
                fmt::format("request {}: protocol error: layer {} buffer {} message from "
                            "prefill rank {} has {} bytes, expected {}",
                            r->id, op->layer, op->buf, peer, n, op->bytes));
        return;
    }
    if (op->staging || op->device_staging) {
        {
            MutexLock lock(jobs_mu_);
            if (!stopping_) {
                jobs_.push_back(ScatterJob{r, frag, op->layer, op->buf, op->run, op->staging,
                                           op->device_staging, op->message});
            }
        }
        jobs_cv_.notify_one();
        return;
    }
    op_done(r, op->layer, n, "");
}

void KvReceiver::Impl::handle_completion(const std::shared_ptr<RecvReq>& r, int peer,
                                         const Fragment& frag, StatusOr<CompletionMsg> m) {
    std::string why;
    if (!m.ok()) {
        why = fmt::format("request {}: bad completion message from prefill rank {}: {}", r->id,
                          peer, m.status().message());
    } else if (m->request_id != r->id || m->num_layers != layout_.num_layers() ||
               m->buffer_count != layout_.buffer_count() || m->head_begin != frag.head_begin ||
               m->head_count != frag.head_count || m->src_tp_rank != frag.src_tp_rank) {
        why = fmt::format(
            "request {}: completion from prefill rank {} does not match the "
            "plan (request {}, {} layers, {} buffers, heads [{}, +{}), tp {})",
            r->id, peer, m->request_id, m->num_layers, m->buffer_count, m->head_begin,
            m->head_count, m->src_tp_rank);
    } else {
        std::optional<Violation> token_mismatch;
        {
            MutexLock lock(table_.mu());
            const int src = source_index(*r, peer);
            SourceState& s = r->sources[static_cast<size_t>(src)];
            s.completed = true;
            ++r->completions;
            if (m->has_first_token) {
                if (!r->has_first_token) {
                    r->has_first_token = true;
                    r->first_token = m->first_token;
                } else if (r->first_token != m->first_token) {
                    token_mismatch = Violation{
                        r->id, -1, -1, transport_.rank(),
                        fmt::format("first token {} from prefill rank {} != {} from another "
                                    "prefill rank",
                                    m->first_token, peer, r->first_token)};
                }
            }
            s.completion = std::move(m).value();
        }
        if (token_mismatch && opt_.validator != nullptr) {
            opt_.validator->add_violation(*token_mismatch);
        }
    }
    op_done(r, -1, 0, why);
}

void KvReceiver::Impl::op_done(const std::shared_ptr<RecvReq>& r, int layer, size_t bytes,
                               const std::string& why, uint64_t messages) {
    std::vector<int> newly;
    bool finish;
    bool failing = false;
    bool released;
    {
        MutexLock lock(table_.mu());
        if (why.empty()) r->touch();  // a receive / scatter / written layer done: progress
        --r->ops_outstanding;
        if (layer >= 0) {
            --r->layer_pending[static_cast<size_t>(layer)];
            if (why.empty()) {
                r->bytes += bytes;
                stats_.bytes += bytes;
                stats_.messages += messages;
            }
        }
        failing = !why.empty() && !is_terminal(r->state);
        newly = sweep_arrivals_locked(*r);
        finish = maybe_finish_locked(*r);
        released = maybe_settle_locked(*r);
    }
    if (released) table_.notify_waiters();
    if (failing) fail(r, why, true);
    after_change(r, std::move(newly));
    if (finish) {
        std::weak_ptr<Impl> weak = weak_from_this();
        channel_->post([weak, r] {
            if (auto self = weak.lock()) self->finalize(r);
        });
    }
}

void KvReceiver::Impl::handle_layer_written(int peer, const LayerWrittenMsg& m) {
    std::string why;
    std::shared_ptr<RecvReq> r;
    {
        MutexLock lock(table_.mu());
        r = table_.find_locked(m.request_id);
        if (r) r->touch();  // a message of the request: progress
        if (!r || is_terminal(r->state)) return;
        const int L = layout_.num_layers();
        const int src = source_index(*r, peer);
        SourceState* s = src < 0 ? nullptr : &r->sources[static_cast<size_t>(src)];
        const size_t at = static_cast<size_t>(m.chunk_index) * static_cast<size_t>(L) +
                          static_cast<size_t>(std::max(m.layer, 0));
        if (s == nullptr || !s->acked || !s->frag || m.src_tp_rank != src ||
            m.chunk_index >= s->chunk_tokens.size() || m.layer < 0 || m.layer >= L ||
            s->written[at] != 0) {
            why = fmt::format(
                "request {}: protocol error: unexpected layer-written message (chunk {}, layer "
                "{}, tp rank {}) from rank {}",
                m.request_id, m.chunk_index, m.layer, m.src_tp_rank, peer);
        } else {
            const uint64_t want = token_bytes(*s->frag, layout_.buffer_count()) *
                                  static_cast<uint64_t>(s->chunk_tokens[m.chunk_index]);
            if (m.bytes != want) {
                why = fmt::format(
                    "request {}: protocol error: prefill rank {} wrote {} bytes of chunk {} "
                    "layer {}, expected {}",
                    m.request_id, peer, m.bytes, m.chunk_index, m.layer, want);
            } else {
                s->written[at] = 1;
            }
        }
    }
    if (!why.empty()) {
        fail(r, why, true);
        return;
    }
    // The sender sent this after its writes completed (visible here), and the control message
    // that told us synchronizes with it: the layer's bytes of this chunk are in the pages.
    op_done(r, m.layer, m.bytes, "", m.writes);
}

void KvReceiver::Impl::handle_control_completion(int peer, std::span<const uint8_t> bytes) {
    StatusOr<CompletionMsg> m = decode_completion(bytes);
    if (!m.ok()) {
        PDSIM_LOG_WARN("receiver rank {}: bad completion message from rank {}: {}",
                       transport_.rank(), peer, m.status().to_string());
        return;
    }
    std::shared_ptr<RecvReq> r = table_.find(m->request_id);
    if (r) r->touch();  // a message of the request: progress
    if (!r) return;
    std::string why;
    Fragment frag;
    bool released = false;
    bool terminal;
    {
        MutexLock lock(table_.mu());
        const int src = source_index(*r, peer);
        if (src < 0) return;
        SourceState& s = r->sources[static_cast<size_t>(src)];
        terminal = is_terminal(r->state);
        if (terminal) {
            // It sent everything it had: none of its writes can land any more.
            s.completed = true;
            released = maybe_settle_locked(*r);
        } else if (ordered()) {
            if (!s.frag || !s.last_header || !s.unposted.empty() || !s.completion_pending) {
                why = fmt::format(
                    "request {}: protocol error: completion from prefill rank {} before every "
                    "message of every chunk was announced",
                    r->id, peer);
            } else {
                s.completion_pending = false;  // handle_completion's op_done counts it
                frag = *s.frag;
            }
        } else if (!s.frag || !s.last_header ||
                   std::find(s.written.begin(), s.written.end(), 0) != s.written.end()) {
            why = fmt::format(
                "request {}: protocol error: completion from prefill rank {} before every "
                "layer of every chunk was reported written",
                r->id, peer);
        } else {
            frag = *s.frag;
        }
    }
    if (released) table_.notify_waiters();
    if (terminal) return;
    if (!why.empty()) {
        fail(r, why, true);
        return;
    }
    handle_completion(r, peer, frag, std::move(m));
}

void KvReceiver::Impl::handle_data_posted(int peer, const DataPostedMsg& m) {
    std::shared_ptr<RecvReq> r;
    std::vector<RecvOp> ops;
    Fragment frag;
    std::string why;
    {
        MutexLock lock(table_.mu());
        r = table_.find_locked(m.request_id);
        if (r) r->touch();  // a message of the request: progress
        if (r && !is_terminal(r->state)) {
            const int src = source_index(*r, peer);
            SourceState* s = src < 0 ? nullptr : &r->sources[static_cast<size_t>(src)];
            if (s == nullptr || !s->frag || m.src_tp_rank != src) {
                why = fmt::format(
                    "request {}: protocol error: unexpected data-posted message (chunk {}, "
                    "layers {}..{}, tp rank {}) from rank {}",
                    m.request_id, m.chunk_index, m.layer_begin, m.layer_end - 1, m.src_tp_rank,
                    peer);
            } else {
                // The plan's receives of the announced (chunk, layer interval): the front of
                // what the chunk headers planned, in the same (layer, buffer, run) order.
                const std::deque<RecvOp>& q = s->unposted;
                size_t n = 0;
                while (n < q.size() && q[n].chunk == m.chunk_index && q[n].layer >= m.layer_begin &&
                       q[n].layer < m.layer_end) {
                    ++n;
                }
                const bool covers =
                    n > 0 && q.front().layer == m.layer_begin && q[n - 1].layer == m.layer_end - 1;
                size_t diff = 0;  // the first message whose size disagrees
                while (diff < std::min(n, m.sizes.size()) && q[diff].bytes == m.sizes[diff]) {
                    ++diff;
                }
                if (!covers || n != m.sizes.size() || diff != n) {
                    const int layer = diff < n ? q[diff].layer : m.layer_begin;
                    const Status loss = PDSIM_ERROR(
                        StatusCode::kDataLoss,
                        "request {}: prefill rank {} announced {} messages of chunk {} layers "
                        "{}..{}, the plan expects {}{} (first difference: message {}, layer {}: "
                        "announced {} bytes, planned {})",
                        r->id, peer, m.sizes.size(), m.chunk_index, m.layer_begin, m.layer_end - 1,
                        n, covers ? "" : " for that interval", diff, layer,
                        diff < m.sizes.size() ? m.sizes[diff] : 0, diff < n ? q[diff].bytes : 0);
                    why = loss.to_string();
                } else {
                    for (size_t i = 0; i < n; ++i) {
                        ops.push_back(std::move(s->unposted.front()));
                        s->unposted.pop_front();
                    }
                    frag = *s->frag;
                }
            }
        }
    }
    if (!why.empty()) fail(r, why, true);
    if (ops.empty()) {
        drain_announced(peer, m);
        return;
    }
    // From this (the control) thread only, in announcement order: the k-th receive posted for
    // this source matches its k-th send.
    post_ops(r, peer, frag, std::move(ops), /*announced=*/true);
}

void KvReceiver::Impl::drain_announced(int peer, const DataPostedMsg& m) {
    std::weak_ptr<Impl> weak = weak_from_this();
    for (const uint64_t bytes : m.sizes) {
        // Memory the data transport reaches: the ops' staging memory on device layouts.
        std::shared_ptr<void> keep;
        void* ptr = nullptr;
        if (comm_) {
            StatusOr<KvOpsMemory> memory = comm_->ops().allocate_staging(bytes);
            if (memory.ok()) {
                auto owned = std::make_shared<KvOpsMemory>(std::move(memory).value());
                ptr = owned->data();
                keep = std::move(owned);
            } else {
                PDSIM_LOG_WARN(
                    "receiver rank {}: no scratch memory of {} bytes for a message "
                    "of request {} from rank {} (the stream is out of step): {}",
                    transport_.rank(), bytes, m.request_id, peer, memory.status().to_string());
                continue;
            }
        } else {
            auto owned = std::make_shared<std::vector<std::byte>>(bytes);
            ptr = owned->data();
            keep = std::move(owned);
        }
        auto h = data_.post_recv(peer, kOrderedPostTag, ptr, bytes);
        if (!h.ok()) {
            PDSIM_LOG_WARN("receiver rank {}: draining a message of request {} from rank {}: {}",
                           transport_.rank(), m.request_id, peer, h.status().to_string());
            continue;
        }
        h->on_complete([weak, keep](const Status& st, size_t) {
            auto self = weak.lock();
            if (!self || !st.ok()) return;
            MutexLock lock(self->table_.mu());
            ++self->stats_.messages_drained;
        });
    }
}

void KvReceiver::Impl::handle_quiesced(int peer, const QuiescedMsg& m) {
    std::shared_ptr<RecvReq> r = table_.find(m.request_id);
    if (r) r->touch();  // a message of the request: progress
    if (!r) return;
    bool active;
    bool released = false;
    {
        MutexLock lock(table_.mu());
        const int src = source_index(*r, peer);
        if (src < 0) return;
        r->sources[static_cast<size_t>(src)].quiesced = true;
        active = !is_terminal(r->state);
        if (!active) released = maybe_settle_locked(*r);
    }
    if (released) table_.notify_waiters();
    // A source quiesces only a request that failed there (its Abort may still be on the way).
    if (active) {
        fail(r, fmt::format("request {}: prefill rank {} aborted it: {}", r->id, peer, m.reason),
             true);
    }
}

void KvReceiver::Impl::finalize(const std::shared_ptr<RecvReq>& r) {
    std::vector<SourceState> sources;
    ArrivalWords::Slot arrival;  // a failure meanwhile hands the request's slot back
    {
        MutexLock lock(table_.mu());
        if (is_terminal(r->state)) return;
        sources = r->sources;
        arrival.index = r->arrival_slot;
        arrival.base = r->arrival_base;
    }
    OrderingValidator* v = opt_.validator;
    const int L = layout_.num_layers();
    const int B = layout_.buffer_count();
    size_t bad = 0;
    std::string first_bad;
    bool checked = false;
    for (const SourceState& s : sources) {
        if (!s.frag || !s.completed || !s.completion.has_checksums) continue;
        const Fragment& f = *s.frag;
        // Device layouts: the landed pages are hashed by the KV memory ops on the comm stream;
        // this (control) thread waits for it, bounded by the request's deadline.
        KvChecksumPlan device_plan;
        std::vector<uint64_t> device_sums;
        if (comm_) {
            StatusOr<KvChecksumPlan> plan = plan_page_checksums(
                layout_, r->dst_pages, 0, r->num_tokens, 0, L, f.head_begin, f.head_count);
            StatusOr<std::vector<uint64_t>> sums =
                plan.ok() ? comm_->checksums(layout_, *plan, r->deadline.get(), opt_.tick,
                                             [this] { return stopping(); })
                          : StatusOr<std::vector<uint64_t>>(plan.status());
            if (!sums.ok()) {
                const bool late = sums.status().code() == StatusCode::kDeadlineExceeded;
                fail(r,
                     fmt::format("request {}: {} awaiting the {} (the landed-bytes checksums of "
                                 "layers 0..{} from prefill rank {}): {}",
                                 r->id,
                                 late ? fmt::format("timed out after {} ms", r->timeout.count())
                                      : std::string("failed"),
                                 comm_->describe(), L - 1, s.world_rank, sums.status().message()),
                     true);
                return;
            }
            device_plan = std::move(plan).value();
            device_sums = std::move(sums).value();
        }
        checked = true;
        for (int l = 0; l < L; ++l) {
            for (int b = 0; b < B; ++b) {
                std::vector<uint64_t> landed;
                if (comm_) {
                    const auto at = static_cast<std::ptrdiff_t>(device_plan.sum_index(l, b));
                    landed.assign(device_sums.begin() + at,
                                  device_sums.begin() + at + f.head_count);
                } else {
                    landed = kv_checksums(layout_, r->dst_pages, l, b, 0, r->num_tokens,
                                          f.head_begin, f.head_count);
                }
                std::vector<uint64_t> expected(static_cast<size_t>(f.head_count));
                for (int h = 0; h < f.head_count; ++h) {
                    expected[static_cast<size_t>(h)] = s.completion.checksum(l, b, h);
                }
                size_t n = 0;
                if (v != nullptr) {
                    n = v->compare(r->id, l, b, f.head_begin, landed, expected,
                                   fmt::format("receiver landed (decode rank {} from prefill "
                                               "rank {})",
                                               transport_.rank(), s.world_rank));
                } else {
                    n = static_cast<size_t>(landed != expected);
                }
                if (n > 0 && first_bad.empty()) {
                    first_bad =
                        fmt::format("layer {} buffer {} from prefill rank {}", l, b, s.world_rank);
                }
                bad += n;
            }
        }
    }
    if (checked && v != nullptr) v->add_checked_layers(static_cast<uint64_t>(L));
    if (bad > 0 && opt_.fail_on_violation) {
        fail(r,
             fmt::format("request {}: {} checksum mismatches in the KV received by decode "
                         "rank {} (first: {})",
                         r->id, bad, transport_.rank(), first_bad),
             true);
        return;
    }
    // Arrival words: every source that signals has added each layer's bytes behind its writes.
    std::vector<uint64_t> words;
    std::vector<uint64_t> targets;
    if (arrival.index >= 0) {
        std::string why = check_arrival_words(*r, arrival, sources, words, targets);
        if (!why.empty() && opt_.fail_on_violation) {
            fail(r, std::move(why), true);
            return;
        }
    }
    uint64_t bytes;
    {
        MutexLock lock(table_.mu());
        if (!table_.mark_succeeded_locked(*r)) return;
        r->pins_released = true;
        pins_.unpin_request(r->id);
        if (!r->slot_settled) {  // the write mode takes no slot
            r->slot_settled = true;
            free_slots_.push_back(r->slot);
        }
        if (r->arrival_slot >= 0) {
            // Every source completed: nothing adds to the words any more. Waits for the targets
            // stay satisfied whoever takes the slot next (the words only grow).
            r->arrival_target = std::move(targets);
            if (words.empty()) {
                arrival_->give_back_unread(r->arrival_slot);
            } else {
                arrival_->give_back(r->arrival_slot, std::move(words));
            }
        }
        bytes = r->bytes;
    }
    table_.notify_waiters();
    emit(TransferEvent::Kind::kRequestDone, r->id, -1, -1, bytes);
}

std::string KvReceiver::Impl::check_arrival_words(const RecvReq& r, const ArrivalWords::Slot& slot,
                                                  const std::vector<SourceState>& sources,
                                                  std::vector<uint64_t>& words,
                                                  std::vector<uint64_t>& targets) {
    uint64_t per_token = 0;  // bytes of one token of one layer, from every source
    for (const SourceState& s : sources) {
        if (!s.frag) continue;
        if (!s.signals) return {};  // a source that does not signal: no targets to check
        per_token += token_bytes(*s.frag, layout_.buffer_count());
    }
    StatusOr<std::vector<uint64_t>> now = arrival_->read(slot.index);
    if (!now.ok()) {
        return fmt::format("request {}: reading its arrival words (slot {}) on decode rank {}: {}",
                           r.id, slot.index, transport_.rank(), now.status().message());
    }
    words = std::move(now).value();
    const uint64_t expected = per_token * static_cast<uint64_t>(r.num_tokens);
    std::string first_bad;
    int bad = 0;
    for (int l = 0; l < layout_.num_layers(); ++l) {
        const auto li = static_cast<size_t>(l);
        const uint64_t target = slot.base[li] + expected;
        targets.push_back(target);
        if (words[li] == target) continue;
        ++bad;
        const std::string what = fmt::format(
            "receiver arrival word (decode rank {}, slot {}): {} bytes landed, the writes carried "
            "{}",
            transport_.rank(), slot.index, words[li] - slot.base[li], expected);
        if (first_bad.empty()) first_bad = fmt::format("layer {}: {}", l, what);
        if (opt_.validator != nullptr) {
            opt_.validator->add_violation(Violation{r.id, l, -1, transport_.rank(), what});
        }
    }
    if (bad == 0) return {};
    targets.clear();
    return fmt::format(
        "request {}: {} layers' arrival words disagree with the bytes written (first "
        "{})",
        r.id, bad, first_bad);
}

bool KvReceiver::Impl::stopping() const {
    MutexLock lock(jobs_mu_);
    return stopping_;
}

void KvReceiver::Impl::scatter_on_device(std::vector<ScatterJob> jobs) {
    KvMemoryOps& ops = comm_->ops();
    size_t begin = 0;
    while (begin < jobs.size()) {
        // One request at a time: its deadline bounds the wait.
        size_t end = begin + 1;
        while (end < jobs.size() && jobs[end].req == jobs[begin].req) ++end;
        const std::shared_ptr<RecvReq> r = jobs[begin].req;
        std::set<int> layer_set;
        for (size_t i = begin; i < end; ++i) layer_set.insert(jobs[i].layer);
        std::string layers;
        for (int l : layer_set) {
            if (!layers.empty()) layers.push_back(',');
            layers.append(std::to_string(l));
        }
        const std::string what =
            fmt::format("the {} (scatters of layer(s) {})", comm_->describe(), layers);
        Status st;
        bool enqueued = false;
        // One enqueue per staging buffer (chunk): its ops in arrival order.
        for (size_t i = begin; st.ok() && i < end;) {
            const std::shared_ptr<DeviceStaging>& staging = jobs[i].device_staging;
            std::vector<KvCopyOp> copies;
            for (; i < end && jobs[i].device_staging == staging; ++i) {
                copies.push_back(staging->plan.ops[jobs[i].message]);
            }
            st = ops.enqueue_scatter(comm_->stream(), layout_, copies, staging->memory.data());
            enqueued = enqueued || st.ok();
        }
        // A host wait (a later step may let the arrival wait on the stream's event instead).
        if (st.ok()) {
            {
                MutexLock lock(table_.mu());
                r->awaiting_comm = what;  // the watchdog's timeout reason names it too
            }
            st = comm_->wait(r->deadline.get(), opt_.tick, [this] { return stopping(); });
            MutexLock lock(table_.mu());
            r->awaiting_comm.clear();
        }
        if (st.ok()) {
            uint64_t staged = 0;
            for (size_t i = begin; i < end; ++i) {
                staged += jobs[i].device_staging->plan.messages[jobs[i].message].bytes;
            }
            {
                MutexLock lock(table_.mu());
                stats_.staged_bytes += staged;
            }
            for (size_t i = begin; i < end; ++i) {
                op_done(r, jobs[i].layer,
                        jobs[i].device_staging->plan.messages[jobs[i].message].bytes, "");
            }
            begin = end;
            continue;
        }
        const bool late = st.code() == StatusCode::kDeadlineExceeded;
        const std::string why = fmt::format(
            "request {}: {} awaiting {}: {}", r->id,
            late ? fmt::format("timed out after {} ms", r->timeout.count()) : std::string("failed"),
            what, st.message());
        if (!stopping()) fail(r, why, true);
        auto done = std::make_shared<std::vector<ScatterJob>>(
            std::make_move_iterator(jobs.begin() + static_cast<std::ptrdiff_t>(begin)),
            std::make_move_iterator(jobs.begin() + static_cast<std::ptrdiff_t>(end)));
        auto finish = [weak = weak_from_this(), done, why] {
            auto self = weak.lock();
            if (!self) return;
            for (const ScatterJob& job : *done) self->op_done(job.req, job.layer, 0, why);
        };
        if (enqueued) {
            // The scatters may still write the pages: they stay outstanding (the pages pinned)
            // until the stream has passed them.
            comm_->retire(done, finish);
        } else {
            finish();
        }
        begin = end;
    }
}

void KvReceiver::Impl::worker_loop() {
    while (true) {
        ScatterJob job;
        std::vector<ScatterJob> device_jobs;
        {
            MutexLock lock(jobs_mu_);
            jobs_cv_.wait(jobs_mu_,
                          [&]() PDSIM_REQUIRES(jobs_mu_) { return stopping_ || !jobs_.empty(); });
            if (stopping_) return;
            if (comm_) {
                // Device layouts: everything queued, in one pass of the comm stream.
                device_jobs.assign(std::make_move_iterator(jobs_.begin()),
                                   std::make_move_iterator(jobs_.end()));
                jobs_.clear();
            } else {
                job = std::move(jobs_.front());
                jobs_.pop_front();
            }
        }
        if (comm_) {
            scatter_on_device(std::move(device_jobs));
            continue;
        }
        scatter_run(layout_, job.frag, job.layer, job.buf, job.run, job.staging->data());
        const size_t n = job.staging->size();
        {
            MutexLock lock(table_.mu());
            stats_.staged_bytes += n;
        }
        op_done(job.req, job.layer, n, "");
    }
}

}  // namespace pdsim::transfer
