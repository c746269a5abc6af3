#include "transfer/engine/kv_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/logging.h"
#include "common/thread_info.h"
#include "transfer/engine/control.h"
#include "transfer/engine/ordering_validator.h"
#include "transfer/engine/request_table.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer {

namespace {

int64_t ms_since(Clock::time_point since, Clock::time_point now) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count();
}

// One prefill rank of a request.
struct SourceState {
    int world_rank = -1;
    bool acked = false;
    KvLayoutSummary layout;
    std::optional<Fragment> frag;  // nullopt: this prefill rank sends this decode rank nothing
    int64_t max_run = 1;
    int64_t next_token = 0;  // the next chunk must start here
    uint32_t next_chunk = 0;
    bool last_header = false;
    bool completed = false;  // its completion message arrived
    CompletionMsg completion;
};

// A request of this rank; the lifecycle (id, deadline, state, reason) is the table's.
struct RecvReq : RequestLifecycle {
    int64_t num_tokens = 0;
    std::vector<int32_t> dst_pages;
    std::vector<int> prefill_ranks;
    uint32_t slot = 0;
    Tag tag = 0;

    // Under the table's mutex (Impl::table_.mu()).
    std::vector<SourceState> sources;  // by prefill TP rank
    int acks = 0;
    int frag_sources = 0;
    int last_headers = 0;
    int completions = 0;
    std::vector<int64_t> layer_pending;  // receives (+ scatters) not yet done, per layer
    std::vector<uint8_t> arrived;
    int layers_arrived = 0;
    int64_t ops_outstanding = 0;
    std::vector<RequestHandle> handles;
    bool finalizing = false;  // every message matched: the tag slot can be reused
    bool pins_released = false;
    bool slot_settled = false;
    bool has_first_token = false;
    int32_t first_token = -1;
    uint64_t bytes = 0;
};

struct ScatterJob {
    std::shared_ptr<RecvReq> req;
    Fragment frag;
    int layer = 0;
    int buf = 0;
    TokenRun run;
    std::shared_ptr<std::vector<std::byte>> staging;
};

// One receive to post (computed under the lock, posted outside it).
struct RecvOp {
    int layer = -1;  // -1: the completion message
    int buf = 0;
    TokenRun run;
    void* ptr = nullptr;
    size_t bytes = 0;
    std::shared_ptr<std::vector<std::byte>> staging;
    std::shared_ptr<Bytes> completion;
};

}  // namespace

class KvReceiver::Impl : public ControlListener, public std::enable_shared_from_this<Impl> {
    using Table = RequestTable<RecvReq>;

public:
    Impl(Transport& transport, KvLayout layout, ReceiverOptions options)
        : transport_(transport),
          layout_(std::move(layout)),
          opt_(std::move(options)),
          pins_(transport.rank(), opt_.validator),
          table_(RequestTableNames{"receiver", transport.rank()}) {
        const Capabilities caps = transport.capabilities();
        max_msg_ = std::min(opt_.max_message_bytes, caps.max_message_bytes);
        slot_capacity_ = static_cast<uint32_t>(
            std::min<uint64_t>(uint64_t{caps.max_tag} - kDataTagBase + 1, uint64_t{1} << 30));
    }

    Status start() {
        ControlOptions co;
        co.heartbeat_interval = opt_.heartbeat_interval;
        co.tick = opt_.tick;
        co.max_control_bytes = opt_.max_control_bytes;
        channel_ = ControlChannel::create(transport_, co);
        PDSIM_RETURN_IF_ERROR(channel_->start(this));
        const int n = std::max(1, opt_.num_workers);
        for (int i = 0; i < n; ++i)
            workers_.emplace_back([this] {
                set_thread_name("pdsim-kvrecv");
                worker_loop();
            });
        return {};
    }

    // ---- public API ----

    Status submit(const ReceiveRequestSpec& spec) {
        const int world = transport_.world_size();
        if (spec.prefill_ranks.empty()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: no prefill ranks",
                               spec.request_id);
        }
        for (size_t i = 0; i < spec.prefill_ranks.size(); ++i) {
            const int p = spec.prefill_ranks[i];
            if (p < 0 || p >= world || p == transport_.rank() ||
                std::count(spec.prefill_ranks.begin(), spec.prefill_ranks.end(), p) != 1) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "request {}: bad prefill rank {} (world {}, this rank {})",
                                   spec.request_id, p, world, transport_.rank());
            }
        }
        if (spec.num_tokens < 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: {} tokens",
                               spec.request_id, spec.num_tokens);
        }
        PDSIM_RETURN_IF_ERROR(layout_.check_pages(spec.dst_pages, spec.num_tokens)
                                  .with_context(fmt::format("request {}", spec.request_id)));
        std::shared_ptr<RecvReq> r;
        {
            MutexLock lock(table_.mu());
            PDSIM_RETURN_IF_ERROR(table_.check_addable_locked(spec.request_id));
            uint32_t slot;
            if (!free_slots_.empty()) {
                slot = free_slots_.back();
                free_slots_.pop_back();
            } else if (next_slot_ < slot_capacity_) {
                slot = next_slot_++;
            } else {
                return PDSIM_ERROR(StatusCode::kResourceExhausted,
                                   "request {}: all {} data tags of rank {} are in use ({} "
                                   "quarantined after failures)",
                                   spec.request_id, slot_capacity_, transport_.rank(),
                                   stats_.tags_quarantined);
            }
            r = std::make_shared<RecvReq>();
            r->id = spec.request_id;
            r->num_tokens = spec.num_tokens;
            const int ps = layout_.page_size();
            r->dst_pages.assign(spec.dst_pages.begin(),
                                spec.dst_pages.begin() + (spec.num_tokens + ps - 1) / ps);
            r->prefill_ranks = spec.prefill_ranks;
            r->started = Clock::now();
            r->timeout = spec.timeout.count() > 0 ? spec.timeout : opt_.request_timeout;
            r->deadline = r->started + r->timeout;
            r->slot = slot;
            r->tag = kDataTagBase + slot;
            r->sources.resize(spec.prefill_ranks.size());
            for (size_t i = 0; i < spec.prefill_ranks.size(); ++i) {
                r->sources[i].world_rank = spec.prefill_ranks[i];
            }
            r->layer_pending.assign(static_cast<size_t>(layout_.num_layers()), 0);
            r->arrived.assign(static_cast<size_t>(layout_.num_layers()), 0);
            pins_.pin(r->id, r->dst_pages);
            table_.insert_locked(r);
        }
        BootstrapMsg m;
        m.request_id = r->id;
        m.decode_rank = transport_.rank();
        m.decode_tp_rank = layout_.summary().tp_rank;
        m.decode_tp_size = layout_.summary().tp_size;
        m.data_tag = r->tag;
        m.num_tokens = r->num_tokens;
        m.max_message_bytes = max_msg_;
        m.layout = layout_.summary();
        m.dst_pages = r->dst_pages;
        Bytes bytes = encode(m);
        if (bytes.size() > opt_.max_control_bytes) {
            fail(r,
                 fmt::format("request {}: bootstrap of {} bytes exceeds max_control_bytes {}",
                             r->id, bytes.size(), opt_.max_control_bytes),
                 false);
            return {};
        }
        for (int p : r->prefill_ranks) channel_->send(p, bytes);
        return {};
    }

    Status wait_layer(uint64_t id, int layer, std::chrono::nanoseconds timeout) const {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
        if (layer < 0 || layer >= layout_.num_layers()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: layer {} of {}", id,
                               layer, layout_.num_layers());
        }
        const auto l = static_cast<size_t>(layer);
        const bool done = table_.wait_for_locked(
            timeout, [&] { return r->arrived[l] != 0 || r->state == RequestState::kFailed; });
        if (r->state == RequestState::kFailed) {
            return Status(StatusCode::kAborted, r->reason);
        }
        if (!done) {
            return PDSIM_ERROR(
                StatusCode::kDeadlineExceeded,
                "request {}: layer {} not arrived after {} ms ({} of {} layers "
                "arrived; awaiting {})",
                id, layer, std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(),
                r->layers_arrived, layout_.num_layers(), describe_awaiting_locked(*r, -1));
        }
        return {};
    }

    bool layer_arrived(uint64_t id, int layer) const {
        MutexLock lock(table_.mu());
        std::shared_ptr<RecvReq> r = table_.find_locked(id);
        if (!r || layer < 0 || layer >= layout_.num_layers()) return false;
        return r->arrived[static_cast<size_t>(layer)] != 0;
    }

    StatusOr<RequestStatus> wait_done(uint64_t id, std::chrono::nanoseconds timeout) const {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
        if (!table_.wait_terminal_locked(*r, timeout)) {
            return Table::wait_timed_out(*r, timeout, describe_awaiting_locked(*r, -1));
        }
        return status_locked(*r);
    }

    StatusOr<RequestStatus> status(uint64_t id) const {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
        return status_locked(*r);
    }

    Status release(uint64_t id) { return table_.release(id); }

    PagePins& pins() { return pins_; }
    const KvLayout& layout() const { return layout_; }
    EngineStats stats() const {
        MutexLock lock(table_.mu());
        EngineStats stats = stats_;
        table_.copy_counts_locked(stats);
        return stats;
    }

    void shutdown(ShutdownMode mode) {
        std::optional<std::vector<std::shared_ptr<RecvReq>>> active = table_.begin_shutdown();
        if (!active) return;
        const bool graceful = mode == ShutdownMode::kGraceful;
        for (auto& r : *active) {
            fail(r,
                 fmt::format("request {}: decode rank {} shut down{}", r->id, transport_.rank(),
                             graceful ? "" : " abruptly"),
                 graceful);
        }
        {
            std::lock_guard<std::mutex> lock(jobs_mu_);
            stopping_ = true;
            jobs_.clear();
        }
        jobs_cv_.notify_all();
        for (auto& t : workers_) {
            if (t.joinable()) t.join();
        }
        if (channel_) channel_->stop(graceful);
    }

    // ---- ControlListener (control thread) ----

    void on_control(int peer, std::span<const uint8_t> bytes) override {
        auto type = peek_type(bytes);
        if (!type.ok()) {
            PDSIM_LOG_WARN("receiver rank {}: bad control message from rank {}: {}",
                           transport_.rank(), peer, type.status().to_string());
            return;
        }
        switch (*type) {
            case MsgType::kAck: {
                auto m = decode_ack(bytes);
                if (m.ok()) handle_ack(peer, *m);
                return;
            }
            case MsgType::kChunk: {
                auto m = decode_chunk(bytes);
                if (m.ok()) handle_chunk(peer, *m);
                return;
            }
            case MsgType::kAbort: {
                auto m = decode_abort(bytes);
                if (!m.ok()) return;
                auto r = table_.find(m->request_id);
                if (r) {
                    fail(r,
                         fmt::format("request {}: prefill rank {} aborted it: {}", r->id, peer,
                                     m->reason),
                         true);
                }
                return;
            }
            case MsgType::kHeartbeat:
                return;
            default:
                PDSIM_LOG_WARN("receiver rank {}: unexpected {} message from rank {}",
                               transport_.rank(), msg_type_name(*type), peer);
        }
    }

    void on_peer_failed(int peer, const Status& st) override {
        std::vector<std::pair<std::shared_ptr<RecvReq>, std::string>> to_fail;
        {
            MutexLock lock(table_.mu());
            for (auto& [id, r] : table_.requests_locked()) {
                if (is_terminal(r->state)) continue;
                const int src = source_index(*r, peer);
                if (src < 0) continue;
                to_fail.emplace_back(
                    r, fmt::format("request {}: prefill rank {} unreachable while awaiting {}: {}",
                                   id, peer, describe_awaiting_locked(*r, src), st.message()));
            }
        }
        for (auto& [r, why] : to_fail) fail(r, why, true);
    }

    void on_tick(Clock::time_point now) override {
        std::vector<std::pair<std::shared_ptr<RecvReq>, std::string>> to_fail;
        std::vector<uint8_t> interest(static_cast<size_t>(transport_.world_size()), 0);
        {
            MutexLock lock(table_.mu());
            for (auto& [id, r] : table_.requests_locked()) {
                if (is_terminal(r->state)) continue;
                for (int p : r->prefill_ranks) interest[static_cast<size_t>(p)] = 1;
                if (Table::past_deadline(*r, now)) {
                    to_fail.emplace_back(
                        r, Table::timed_out_reason(*r, describe_awaiting_locked(*r, -1)));
                    continue;
                }
                for (size_t i = 0; i < r->sources.size(); ++i) {
                    const SourceState& s = r->sources[i];
                    if (!source_pending(*r, s)) continue;
                    auto heard = std::max(channel_->last_heard(s.world_rank), r->started);
                    if (now - heard > opt_.peer_timeout) {
                        to_fail.emplace_back(
                            r, fmt::format("request {}: prefill rank {} silent for {} ms while "
                                           "awaiting {}",
                                           id, s.world_rank, ms_since(heard, now),
                                           describe_awaiting_locked(*r, static_cast<int>(i))));
                        break;
                    }
                }
            }
        }
        channel_->set_interest(std::move(interest));
        for (auto& [r, why] : to_fail) fail(r, why, true);
    }

private:
    static int source_index(const RecvReq& r, int world_rank) {
        for (size_t i = 0; i < r.prefill_ranks.size(); ++i) {
            if (r.prefill_ranks[i] == world_rank) return static_cast<int>(i);
        }
        return -1;
    }

    // Whether the request still waits for something from source `s`.
    static bool source_pending(const RecvReq& /*r*/, const SourceState& s) {
        return !s.acked || (s.frag && !s.completed);
    }

    RequestStatus status_locked(const RecvReq& r) const {
        RequestStatus s;
        s.state = r.state;
        s.reason = r.reason;
        s.has_first_token = r.has_first_token;
        s.first_token = r.first_token;
        s.bytes = r.bytes;
        s.layers_arrived = r.layers_arrived;
        s.started = r.started;
        s.finished = r.finished;
        s.pages_in_use = !r.pins_released;
        return s;
    }

    // What the request awaits from source `src` (-1: from the first source it awaits anything).
    std::string describe_awaiting_locked(const RecvReq& r, int src) const {
        const int L = layout_.num_layers();
        for (size_t i = 0; i < r.sources.size(); ++i) {
            if (src >= 0 && static_cast<int>(i) != src) continue;
            const SourceState& s = r.sources[i];
            if (!s.acked) {
                return fmt::format("the bootstrap ack from prefill rank {}", s.world_rank);
            }
            if (!s.frag) continue;
            if (!s.last_header) {
                return fmt::format(
                    "KV chunks from prefill rank {} ({} of {} tokens announced, "
                    "{} of {} layers arrived)",
                    s.world_rank, s.next_token, r.num_tokens, r.layers_arrived, L);
            }
            if (r.layers_arrived < L) {
                return fmt::format("KV data from prefill rank {} ({} of {} layers arrived)",
                                   s.world_rank, r.layers_arrived, L);
            }
            if (!s.completed) {
                return fmt::format("the completion message from prefill rank {}", s.world_rank);
            }
        }
        return r.layers_arrived < L
                   ? fmt::format("KV data ({} of {} layers arrived)", r.layers_arrived, L)
                   : std::string("finalization");
    }

    void emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer, uint64_t bytes) const {
        if (!opt_.on_event) return;
        TransferEvent e;
        e.kind = kind;
        e.request = req;
        e.layer = layer;
        e.peer = peer;
        e.bytes = bytes;
        e.time = Clock::now();
        opt_.on_event(e);
    }

    bool headers_complete_locked(const RecvReq& r) const {
        return r.acks == static_cast<int>(r.sources.size()) && r.last_headers == r.frag_sources;
    }

    // Marks layers whose data is complete; returns them (for events).
    std::vector<int> sweep_arrivals_locked(RecvReq& r) {
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

    bool maybe_finish_locked(RecvReq& r) {
        if (r.state != RequestState::kTransferring || r.finalizing || !headers_complete_locked(r) ||
            r.layers_arrived != layout_.num_layers() || r.completions != r.frag_sources ||
            r.ops_outstanding != 0) {
            return false;
        }
        r.finalizing = true;
        return true;
    }

    // Pins and the tag slot are released only once no receive can write into the pages or match
    // on the tag any more.
    void maybe_settle_locked(RecvReq& r) {
        if (r.state != RequestState::kFailed || r.ops_outstanding > 0) return;
        if (!r.pins_released) {
            r.pins_released = true;
            pins_.unpin_request(r.id);
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
    }

    void after_change(const std::shared_ptr<RecvReq>& r, std::vector<int> newly) {
        for (int l : newly) emit(TransferEvent::Kind::kLayerArrived, r->id, l, -1, 0);
        if (!newly.empty()) table_.notify_waiters();
    }

    void handle_ack(int peer, const AckMsg& m) {
        std::string why;
        std::shared_ptr<RecvReq> r;
        std::vector<int> newly;
        bool finish = false;
        {
            MutexLock lock(table_.mu());
            r = table_.find_locked(m.request_id);
            if (!r || is_terminal(r->state)) return;
            const int src = source_index(*r, peer);
            if (src < 0 || m.prefill_tp_rank != src ||
                m.prefill_tp_size != static_cast<int>(r->sources.size())) {
                why = fmt::format(
                    "request {}: ack from rank {} as prefill TP rank {} of {} does "
                    "not match the request's prefill ranks",
                    r->id, peer, m.prefill_tp_rank, m.prefill_tp_size);
            } else if (!m.ok) {
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
                s.layout = m.layout;
                s.frag = make_fragment(m.layout, layout_.summary());
                if (s.frag) {
                    const size_t agreed = std::min<uint64_t>(max_msg_, m.max_message_bytes);
                    s.max_run = max_run_tokens(*s.frag, layout_.buffer_count(), agreed);
                    ++r->frag_sources;
                }
                ++r->acks;
                if (r->acks == static_cast<int>(r->sources.size())) {
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

    void handle_chunk(int peer, const ChunkMsg& m) {
        std::string why;
        std::shared_ptr<RecvReq> r;
        std::vector<RecvOp> ops;
        Fragment frag;
        {
            MutexLock lock(table_.mu());
            r = table_.find_locked(m.request_id);
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
                ops = plan_chunk_locked(*r, *s, m);
                if (m.is_last) {
                    s->last_header = true;
                    ++r->last_headers;
                }
            }
        }
        if (!why.empty()) {
            fail(r, why, true);
            return;
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

    // The receives of one chunk in plan order (layer, buffer, run), then (last chunk) the
    // completion message. Counts them as outstanding before any is posted, so the arrival state
    // can never look complete while a chunk is half posted.
    std::vector<RecvOp> plan_chunk_locked(RecvReq& r, const SourceState& s, const ChunkMsg& m) {
        const Fragment& f = *s.frag;
        const std::vector<TokenRun> runs =
            make_runs(m.src_pages, s.layout.page_size, m.src_first_page, r.dst_pages,
                      layout_.page_size(), m.token_begin, m.token_end, s.max_run);
        std::vector<RecvOp> ops;
        const int L = layout_.num_layers();
        const int B = layout_.buffer_count();
        ops.reserve(static_cast<size_t>(L * B) * runs.size() + 1);
        for (int l = 0; l < L; ++l) {
            for (int b = 0; b < B; ++b) {
                for (const TokenRun& run : runs) {
                    RecvOp op;
                    op.layer = l;
                    op.buf = b;
                    op.run = run;
                    op.bytes = message_bytes(f, b, run);
                    if (f.dst_contiguous[static_cast<size_t>(b)]) {
                        op.ptr = layout_.slot_addr(l, b, run.dst_slot);
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
        if (m.is_last) {
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

    void post_ops(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                  std::vector<RecvOp> ops) {
        std::weak_ptr<Impl> weak = weak_from_this();
        for (size_t i = 0; i < ops.size(); ++i) {
            bool failed;
            {
                MutexLock lock(table_.mu());
                failed = r->state == RequestState::kFailed;
            }
            if (failed) {
                // The request failed meanwhile: the rest is never posted (and counted as done).
                for (size_t j = i; j < ops.size(); ++j) op_done(r, ops[j].layer, 0, "withdrawn");
                return;
            }
            auto op = std::make_shared<RecvOp>(std::move(ops[i]));
            auto h = transport_.post_recv(peer, r->tag, op->ptr, op->bytes);
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
                if (r->state == RequestState::kFailed) {
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
            if (cancel_now) transport_.cancel(*h).ignore_error();
            h->on_complete([weak, r, peer, frag, op](const Status& st, size_t n) {
                if (auto self = weak.lock()) self->on_recv_complete(r, peer, frag, op, st, n);
            });
        }
    }

    // Any thread (transport callbacks included): never re-enters the transport.
    void on_recv_complete(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                          const std::shared_ptr<RecvOp>& op, const Status& st, size_t n) {
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
                self->handle_completion(r, peer, frag, *op->completion, n);
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
        if (op->staging) {
            {
                std::lock_guard<std::mutex> lock(jobs_mu_);
                if (!stopping_) {
                    jobs_.push_back(ScatterJob{r, frag, op->layer, op->buf, op->run, op->staging});
                }
            }
            jobs_cv_.notify_one();
            return;
        }
        op_done(r, op->layer, n, "");
    }

    void handle_completion(const std::shared_ptr<RecvReq>& r, int peer, const Fragment& frag,
                           const Bytes& buf, size_t n) {
        auto m = decode_completion(std::span<const uint8_t>(buf.data(), n));
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

    // One receive (or scatter) finished. `why` non-empty: it failed.
    void op_done(const std::shared_ptr<RecvReq>& r, int layer, size_t bytes,
                 const std::string& why) {
        std::vector<int> newly;
        bool finish;
        bool failing = false;
        {
            MutexLock lock(table_.mu());
            --r->ops_outstanding;
            if (layer >= 0) {
                --r->layer_pending[static_cast<size_t>(layer)];
                if (why.empty()) {
                    r->bytes += bytes;
                    stats_.bytes += bytes;
                    ++stats_.messages;
                }
            }
            failing = !why.empty() && !is_terminal(r->state);
            newly = sweep_arrivals_locked(*r);
            finish = maybe_finish_locked(*r);
            maybe_settle_locked(*r);
        }
        if (failing) fail(r, why, true);
        after_change(r, std::move(newly));
        if (finish) {
            std::weak_ptr<Impl> weak = weak_from_this();
            channel_->post([weak, r] {
                if (auto self = weak.lock()) self->finalize(r);
            });
        }
    }

    // Control thread: checks what landed against the compute stream's checksums, then Success.
    void finalize(const std::shared_ptr<RecvReq>& r) {
        std::vector<SourceState> sources;
        {
            MutexLock lock(table_.mu());
            if (is_terminal(r->state)) return;
            sources = r->sources;
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
            checked = true;
            for (int l = 0; l < L; ++l) {
                for (int b = 0; b < B; ++b) {
                    std::vector<uint64_t> landed = kv_checksums(
                        layout_, r->dst_pages, l, b, 0, r->num_tokens, f.head_begin, f.head_count);
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
                        first_bad = fmt::format("layer {} buffer {} from prefill rank {}", l, b,
                                                s.world_rank);
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
        uint64_t bytes;
        {
            MutexLock lock(table_.mu());
            if (!table_.mark_succeeded_locked(*r)) return;
            r->pins_released = true;
            pins_.unpin_request(r->id);
            r->slot_settled = true;
            free_slots_.push_back(r->slot);
            bytes = r->bytes;
        }
        table_.notify_waiters();
        emit(TransferEvent::Kind::kRequestDone, r->id, -1, -1, bytes);
    }

    // Any thread. Marks the request Failed (once); on the control thread, withdraws its receives
    // and tells the prefill ranks.
    void fail(const std::shared_ptr<RecvReq>& r, std::string reason, bool notify_peers) {
        std::vector<RequestHandle> handles;
        {
            MutexLock lock(table_.mu());
            if (!table_.mark_failed_locked(*r, reason)) return;
            handles.swap(r->handles);
            maybe_settle_locked(*r);
        }
        PDSIM_LOG_DEBUG("receiver rank {}: {}", transport_.rank(), reason);
        table_.notify_waiters();
        emit(TransferEvent::Kind::kRequestFailed, r->id, -1, -1, 0);
        if (!notify_peers) return;
        Transport* t = &transport_;
        std::shared_ptr<ControlChannel> ch = channel_;
        std::vector<int> peers = r->prefill_ranks;
        const uint64_t id = r->id;
        channel_->post([t, ch, handles = std::move(handles), peers, id, reason] {
            for (const RequestHandle& h : handles) {
                if (!h.done()) t->cancel(h).ignore_error();
            }
            for (int p : peers) {
                if (!ch->peer_failed(p)) ch->send(p, encode(AbortMsg{id, reason}));
            }
        });
    }

    void worker_loop() {
        while (true) {
            ScatterJob job;
            {
                std::unique_lock<std::mutex> lock(jobs_mu_);
                jobs_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
                if (stopping_) return;
                job = std::move(jobs_.front());
                jobs_.pop_front();
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

    Transport& transport_;
    const KvLayout layout_;
    const ReceiverOptions opt_;
    size_t max_msg_ = 0;
    uint32_t slot_capacity_ = 0;
    std::shared_ptr<ControlChannel> channel_;
    PagePins pins_;
    std::vector<std::thread> workers_;

    std::mutex jobs_mu_;
    std::condition_variable jobs_cv_;
    std::deque<ScatterJob> jobs_;
    bool stopping_ = false;  // under jobs_mu_

    // The requests and the engine lock: table_.mu() guards what is below and the requests'
    // bookkeeping (see request_table.h).
    RequestTable<RecvReq> table_;
    uint32_t next_slot_ = 0;
    std::vector<uint32_t> free_slots_;
    EngineStats stats_;
};

// ---- KvReceiver ----

StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::create(Transport& transport, KvLayout layout,
                                                         ReceiverOptions options) {
    const Capabilities caps = transport.capabilities();
    if (!caps.two_sided || !caps.tag_matching) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "the KV receiver needs a two-sided, tag-matching transport; '{}' is "
                           "not",
                           transport.name());
    }
    if (caps.max_tag < kDataTagBase) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "transport '{}' max_tag {} leaves no data tags (need >= {})",
                           transport.name(), caps.max_tag, kDataTagBase);
    }
    if (options.validator != nullptr && options.validator->rank() != transport.rank()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "validator of rank {} given to the receiver of rank {}",
                           options.validator->rank(), transport.rank());
    }
    auto impl = std::make_shared<Impl>(transport, std::move(layout), std::move(options));
    PDSIM_RETURN_IF_ERROR(impl->start());
    return std::unique_ptr<KvReceiver>(new KvReceiver(std::move(impl)));
}

KvReceiver::KvReceiver(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvReceiver::~KvReceiver() {
    impl_->shutdown(ShutdownMode::kGraceful);
}

Status KvReceiver::submit(const ReceiveRequestSpec& spec) {
    return impl_->submit(spec);
}
Status KvReceiver::wait_layer(uint64_t id, int layer, std::chrono::nanoseconds timeout) const {
    return impl_->wait_layer(id, layer, timeout);
}
bool KvReceiver::layer_arrived(uint64_t id, int layer) const {
    return impl_->layer_arrived(id, layer);
}
StatusOr<RequestStatus> KvReceiver::wait_done(uint64_t id, std::chrono::nanoseconds timeout) const {
    return impl_->wait_done(id, timeout);
}
StatusOr<RequestStatus> KvReceiver::status(uint64_t id) const {
    return impl_->status(id);
}
Status KvReceiver::release(uint64_t id) {
    return impl_->release(id);
}
PagePins& KvReceiver::pins() {
    return impl_->pins();
}
EngineStats KvReceiver::stats() const {
    return impl_->stats();
}
const KvLayout& KvReceiver::layout() const {
    return impl_->layout();
}
void KvReceiver::shutdown(ShutdownMode mode) {
    impl_->shutdown(mode);
}

}  // namespace pdsim::transfer
