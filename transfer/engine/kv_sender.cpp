#include "transfer/engine/kv_sender.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
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

std::string_view transfer_event_name(TransferEvent::Kind kind) {
    switch (kind) {
        case TransferEvent::Kind::kLayerReady:
            return "layer_ready";
        case TransferEvent::Kind::kLayerPosted:
            return "layer_posted";
        case TransferEvent::Kind::kLayerSent:
            return "layer_sent";
        case TransferEvent::Kind::kLayerArrived:
            return "layer_arrived";
        case TransferEvent::Kind::kRequestDone:
            return "request_done";
        case TransferEvent::Kind::kRequestFailed:
            return "request_failed";
    }
    return "?";
}

namespace {

int64_t ms_since(Clock::time_point since, Clock::time_point now) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count();
}

// One decode rank of a request.
struct DestState {
    int world_rank = -1;
    int tp_rank = 0;
    Tag tag = 0;
    KvLayoutSummary layout;
    std::vector<int32_t> dst_pages;
    std::optional<Fragment> frag;
    int64_t max_run = 1;
    // Touched only by the destination's worker (every task of one destination runs on one
    // worker), so no lock: what this rank read, [layer][buf][fragment head], and the chunk whose
    // task may post next (tasks can reach the queue out of order: they are queued outside the
    // engine lock by the scheduler thread and, for chunks held until the bootstrap, the control
    // thread).
    std::vector<uint64_t> observed;
    uint32_t next_chunk_to_post = 0;
};

// A request of this rank; the lifecycle (id, deadline, state, reason) is the table's.
struct SendReq : RequestLifecycle {
    int64_t num_tokens = 0;
    // Set (under the table's mutex) when the request turns terminal-failed; read by workers without
    // the lock to stop early. A stale false only costs one more post, which post_data re-checks.
    std::atomic<bool> cancelled{false};

    // Everything below is under the table's mutex (Impl::table_.mu()).
    int decode_tp_size = -1;
    std::map<int, std::shared_ptr<DestState>> dests;  // by decode TP rank
    std::deque<SendChunk> held;                       // submitted before the bootstrap finished
    int64_t computed_end = 0;                         // tokens computed by submitted chunks
    int64_t sent_end = 0;                             // tokens handed to workers
    bool last_submitted = false;
    bool last_dispatched = false;
    uint32_t next_chunk = 0;
    std::vector<int32_t> pages;  // the latest page table
    int tasks_outstanding = 0;
    int64_t ops_outstanding = 0;
    bool finalizing = false;
    bool pins_released = false;
    std::vector<RequestHandle> handles;  // posted sends (for cancellation)
    std::string awaiting;                // what a worker is blocked on
    uint64_t bytes = 0;
};

// Per (task, layer) sends not yet completed, plus a guard of 1 while the layer is being posted,
// so the count can only reach 0 once every send of the layer was posted and completed.
struct TaskProgress {
    explicit TaskProgress(int layers, uint64_t req, int peer, uint32_t chunk)
        : pending(std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(layers))),
          bytes(std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(layers))),
          request(req),
          peer(peer),
          chunk(chunk) {
        for (int l = 0; l < layers; ++l) {
            pending[static_cast<size_t>(l)].store(0);
            bytes[static_cast<size_t>(l)].store(0);
        }
    }
    std::unique_ptr<std::atomic<int64_t>[]> pending;
    std::unique_ptr<std::atomic<uint64_t>[]> bytes;
    const uint64_t request;
    const int peer;
    const uint32_t chunk;
};

struct Task {
    std::shared_ptr<SendReq> req;
    std::shared_ptr<DestState> dest;
    uint32_t chunk_index = 0;
    int64_t t0 = 0;
    int64_t t1 = 0;
    int64_t begin_step = 0;
    int interval = 1;
    bool is_last = false;
    std::vector<int32_t> src_pages;
    int32_t first_token = -1;
    const int32_t* first_token_src = nullptr;
    int64_t first_token_aux_step = 0;
};

struct Worker {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;
    std::thread thread;
};

}  // namespace

class KvSender::Impl : public ControlListener, public std::enable_shared_from_this<Impl> {
    using Table = RequestTable<SendReq>;

public:
    Impl(Transport& transport, KvLayout layout, pd::StepCounter& counter, SenderOptions options)
        : transport_(transport),
          layout_(std::move(layout)),
          counter_(counter),
          opt_(std::move(options)),
          pins_(transport.rank(), opt_.validator),
          table_(RequestTableNames{"sender", transport.rank()}) {
        max_msg_ = std::min(opt_.max_message_bytes, transport.capabilities().max_message_bytes);
    }

    Status start() {
        ControlOptions co;
        co.heartbeat_interval = opt_.heartbeat_interval;
        co.tick = opt_.tick;
        co.max_control_bytes = opt_.max_control_bytes;
        channel_ = ControlChannel::create(transport_, co);
        PDSIM_RETURN_IF_ERROR(channel_->start(this));
        const int n = std::max(1, opt_.num_workers);
        for (int i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker>());
        for (int i = 0; i < n; ++i) {
            workers_[static_cast<size_t>(i)]->thread = std::thread([this, i] {
                set_thread_name("pdsim-kvsend");
                worker_loop(i);
            });
        }
        return {};
    }

    // ---- public API ----

    Status add_request(const SendRequestSpec& spec) {
        if (spec.num_tokens < 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: {} tokens",
                               spec.request_id, spec.num_tokens);
        }
        std::vector<Task> tasks;
        std::vector<std::pair<std::shared_ptr<SendReq>, std::string>> failures;
        bool finish = false;
        {
            MutexLock lock(table_.mu());
            PDSIM_RETURN_IF_ERROR(table_.check_addable_locked(spec.request_id));
            auto r = std::make_shared<SendReq>();
            r->id = spec.request_id;
            r->num_tokens = spec.num_tokens;
            r->started = Clock::now();
            r->timeout = spec.timeout.count() > 0 ? spec.timeout : opt_.request_timeout;
            r->deadline = r->started + r->timeout;
            table_.insert_locked(r);
            if (auto ab = aborted_.find(r->id); ab != aborted_.end()) {
                failures.emplace_back(r, ab->second.first);
                aborted_.erase(ab);
            }
            auto pend = pending_bootstraps_.find(r->id);
            if (pend != pending_bootstraps_.end()) {
                for (const PendingBootstrap& pb : pend->second) {
                    std::string err = attach_locked(*r, pb.peer, pb.msg, tasks);
                    if (!err.empty()) {
                        failures.emplace_back(r, std::move(err));
                        break;
                    }
                }
                pending_bootstraps_.erase(pend);
            }
            finish = maybe_finish_locked(*r);
        }
        enqueue(std::move(tasks));
        for (auto& [r, why] : failures) fail(r, why, true);
        if (finish) post_finalize(spec.request_id);
        return {};
    }

    Status submit_chunk(SendChunk c) {
        const int ps = layout_.page_size();
        if (c.layer_interval < 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: layer interval {}",
                               c.request_id, c.layer_interval);
        }
        PDSIM_RETURN_IF_ERROR(layout_.check_pages(c.src_pages, c.token_end)
                                  .with_context(fmt::format("request {}", c.request_id)));
        const uint64_t id = c.request_id;
        std::vector<Task> tasks;
        bool finish = false;
        {
            MutexLock lock(table_.mu());
            std::shared_ptr<SendReq> found = table_.find_locked(c.request_id);
            if (!found) {
                return PDSIM_ERROR(StatusCode::kNotFound, "request {} was not added", c.request_id);
            }
            SendReq& r = *found;
            if (r.state == RequestState::kFailed) {
                return PDSIM_ERROR(StatusCode::kAborted, "request {} failed: {}", r.id, r.reason);
            }
            if (r.state == RequestState::kSuccess || r.last_submitted) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                   "request {}: chunk after the last chunk", r.id);
            }
            if (c.token_begin != r.computed_end || c.token_end <= c.token_begin ||
                c.token_end > r.num_tokens || (c.token_end == r.num_tokens) != c.is_last) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "request {}: chunk [{}, {}) is_last={} does not continue "
                                   "[0, {}) of {} tokens",
                                   r.id, c.token_begin, c.token_end, c.is_last, r.computed_end,
                                   r.num_tokens);
            }
            const auto used = static_cast<size_t>((c.token_end + ps - 1) / ps);
            pins_.pin(r.id, std::span<const int32_t>(c.src_pages.data(), used));
            r.computed_end = c.token_end;
            r.last_submitted = c.is_last;
            if (r.state == RequestState::kTransferring) {
                dispatch_locked(r, c, tasks);
                finish = maybe_finish_locked(r);
            } else {
                r.held.push_back(std::move(c));
            }
        }
        enqueue(std::move(tasks));
        if (finish) post_finalize(id);
        return {};
    }

    StatusOr<RequestStatus> status(uint64_t id) const {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<SendReq> r, table_.get_locked(id));
        return status_locked(*r);
    }

    StatusOr<RequestStatus> wait(uint64_t id, std::chrono::nanoseconds timeout) const {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<SendReq> r, table_.get_locked(id));
        if (!table_.wait_terminal_locked(*r, timeout)) {
            return Table::wait_timed_out(*r, timeout, describe_awaiting_locked(*r));
        }
        return status_locked(*r);
    }

    Status release(uint64_t id) {
        PDSIM_RETURN_IF_ERROR(table_.release(id));
        if (opt_.validator != nullptr) opt_.validator->forget(id);
        return {};
    }

    PagePins& pins() { return pins_; }
    const KvLayout& layout() const { return layout_; }

    EngineStats stats() const {
        MutexLock lock(table_.mu());
        EngineStats stats = stats_;
        table_.copy_counts_locked(stats);
        return stats;
    }

    void shutdown(ShutdownMode mode) {
        std::optional<std::vector<std::shared_ptr<SendReq>>> active = table_.begin_shutdown();
        if (!active) return;
        stopping_.store(true);
        const bool graceful = mode == ShutdownMode::kGraceful;
        for (auto& r : *active) {
            fail(r,
                 fmt::format("request {}: prefill rank {} shut down{}", r->id, transport_.rank(),
                             graceful ? "" : " abruptly"),
                 graceful);
        }
        for (auto& w : workers_) {
            {
                std::lock_guard<std::mutex> lock(w->mu);
                w->queue.clear();
            }
            w->cv.notify_all();
        }
        for (auto& w : workers_) {
            if (w->thread.joinable()) w->thread.join();
        }
        if (channel_) channel_->stop(graceful);
    }

    // ---- ControlListener (control thread) ----

    void on_control(int peer, std::span<const uint8_t> bytes) override {
        auto type = peek_type(bytes);
        if (!type.ok()) {
            PDSIM_LOG_WARN("sender rank {}: bad control message from rank {}: {}",
                           transport_.rank(), peer, type.status().to_string());
            return;
        }
        switch (*type) {
            case MsgType::kBootstrap: {
                auto m = decode_bootstrap(bytes);
                if (!m.ok()) {
                    PDSIM_LOG_WARN("sender rank {}: {}", transport_.rank(), m.status().to_string());
                    return;
                }
                handle_bootstrap(peer, std::move(m).value());
                return;
            }
            case MsgType::kAbort: {
                auto m = decode_abort(bytes);
                if (!m.ok()) return;
                std::shared_ptr<SendReq> r;
                const std::string why = fmt::format("request {}: decode rank {} aborted it: {}",
                                                    m->request_id, peer, m->reason);
                {
                    MutexLock lock(table_.mu());
                    auto pend = pending_bootstraps_.find(m->request_id);
                    if (pend != pending_bootstraps_.end()) pending_bootstraps_.erase(pend);
                    r = table_.find_locked(m->request_id);
                    if (!r) aborted_[m->request_id] = {why, Clock::now()};
                }
                if (r) fail(r, why, true);
                return;
            }
            case MsgType::kHeartbeat:
                return;
            default:
                PDSIM_LOG_WARN("sender rank {}: unexpected {} message from rank {}",
                               transport_.rank(), msg_type_name(*type), peer);
        }
    }

    void on_peer_failed(int peer, const Status& st) override {
        std::vector<std::pair<std::shared_ptr<SendReq>, std::string>> to_fail;
        {
            MutexLock lock(table_.mu());
            for (auto& [id, r] : table_.requests_locked()) {
                if (is_terminal(r->state)) continue;
                for (auto& [tp, d] : r->dests) {
                    if (d->world_rank != peer) continue;
                    to_fail.emplace_back(
                        r, fmt::format("request {}: decode rank {} unreachable while awaiting "
                                       "{}: {}",
                                       id, peer, describe_awaiting_locked(*r), st.message()));
                    break;
                }
            }
            for (auto it = pending_bootstraps_.begin(); it != pending_bootstraps_.end();) {
                std::erase_if(it->second,
                              [&](const PendingBootstrap& p) { return p.peer == peer; });
                it = it->second.empty() ? pending_bootstraps_.erase(it) : std::next(it);
            }
        }
        for (auto& [r, why] : to_fail) fail(r, why, true);
    }

    void on_tick(Clock::time_point now) override {
        std::vector<std::pair<std::shared_ptr<SendReq>, std::string>> to_fail;
        std::vector<uint8_t> interest(static_cast<size_t>(transport_.world_size()), 0);
        {
            MutexLock lock(table_.mu());
            for (auto& [id, r] : table_.requests_locked()) {
                if (is_terminal(r->state)) continue;
                for (auto& [tp, d] : r->dests) interest[static_cast<size_t>(d->world_rank)] = 1;
                if (Table::past_deadline(*r, now)) {
                    to_fail.emplace_back(r,
                                         Table::timed_out_reason(*r, describe_awaiting_locked(*r)));
                    continue;
                }
                for (auto& [tp, d] : r->dests) {
                    auto heard = std::max(channel_->last_heard(d->world_rank), r->started);
                    if (now - heard > opt_.peer_timeout) {
                        to_fail.emplace_back(
                            r, fmt::format("request {}: decode rank {} silent for {} ms while "
                                           "awaiting {}",
                                           id, d->world_rank, ms_since(heard, now),
                                           describe_awaiting_locked(*r)));
                        break;
                    }
                }
            }
            std::erase_if(aborted_, [&](const auto& kv) {
                return now - kv.second.second > opt_.request_timeout;
            });
            // Bootstraps for requests this rank never scheduled: the decode side times out on
            // its own; drop them after one request timeout.
            for (auto it = pending_bootstraps_.begin(); it != pending_bootstraps_.end();) {
                std::erase_if(it->second, [&](const PendingBootstrap& p) {
                    return now - p.at > opt_.request_timeout;
                });
                it = it->second.empty() ? pending_bootstraps_.erase(it) : std::next(it);
            }
        }
        channel_->set_interest(std::move(interest));
        for (auto& [r, why] : to_fail) fail(r, why, true);
    }

private:
    struct PendingBootstrap {
        int peer;
        BootstrapMsg msg;
        Clock::time_point at;
    };

    RequestStatus status_locked(const SendReq& r) const {
        RequestStatus s;
        s.state = r.state;
        s.reason = r.reason;
        s.bytes = r.bytes;
        s.started = r.started;
        s.finished = r.finished;
        s.pages_in_use = !r.pins_released;
        return s;
    }

    std::string describe_awaiting_locked(const SendReq& r) const {
        if (r.state == RequestState::kBootstrapping) {
            return fmt::format(
                "the bootstrap from the decode side ({} of {} decode ranks)", r.dests.size(),
                r.decode_tp_size < 0 ? std::string("?") : std::to_string(r.decode_tp_size));
        }
        if (!r.last_submitted) {
            return fmt::format(
                "the next chunk from the prefill scheduler ({} of {} tokens "
                "computed)",
                r.computed_end, r.num_tokens);
        }
        if (r.tasks_outstanding > 0 && !r.awaiting.empty()) return r.awaiting;
        if (r.ops_outstanding > 0) {
            std::string ranks;
            for (auto& [tp, d] : r.dests) {
                if (!d->frag) continue;
                if (!ranks.empty()) ranks.push_back(',');
                ranks.append(std::to_string(d->world_rank));
            }
            return fmt::format("{} sends to decode rank(s) {} to complete (matching receives)",
                               r.ops_outstanding, ranks);
        }
        return "finalization";
    }

    void emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer, uint32_t chunk,
              uint64_t bytes) const {
        if (!opt_.on_event) return;
        TransferEvent e;
        e.kind = kind;
        e.request = req;
        e.layer = layer;
        e.peer = peer;
        e.chunk = chunk;
        e.bytes = bytes;
        e.time = Clock::now();
        opt_.on_event(e);
    }

    void handle_bootstrap(int peer, BootstrapMsg m) {
        AckMsg ack;
        ack.request_id = m.request_id;
        ack.prefill_tp_rank = layout_.summary().tp_rank;
        ack.prefill_tp_size = layout_.summary().tp_size;
        ack.max_message_bytes = max_msg_;
        ack.layout = layout_.summary();
        Status valid = validate_bootstrap(peer, m);
        if (!valid.ok()) {
            ack.ok = false;
            ack.reason = fmt::format("prefill rank {} refused the bootstrap of request {}: {}",
                                     transport_.rank(), m.request_id, valid.message());
            channel_->send(peer, encode(ack));
            return;
        }
        // The ack goes out before the request can dispatch chunks for this peer, so on the
        // control tag it precedes every Chunk header (the decode side needs our layout first).
        channel_->send(peer, encode(ack));
        std::vector<Task> tasks;
        std::shared_ptr<SendReq> failed_req;
        std::string why;
        std::optional<std::string> abort_reason;
        bool finish = false;
        {
            MutexLock lock(table_.mu());
            std::shared_ptr<SendReq> found = table_.find_locked(m.request_id);
            if (!found) {
                pending_bootstraps_[m.request_id].push_back({peer, std::move(m), Clock::now()});
                return;
            }
            SendReq& r = *found;
            if (r.state == RequestState::kFailed) {
                abort_reason = r.reason;
            } else if (!is_terminal(r.state)) {
                why = attach_locked(r, peer, m, tasks);
                if (!why.empty()) failed_req = found;
                // A rank with nothing to send (e.g. MLA with more prefill than decode ranks)
                // is done as soon as the last chunk is dispatched.
                finish = maybe_finish_locked(r);
            }
        }
        if (abort_reason) {
            channel_->send(peer, encode(AbortMsg{m.request_id, *abort_reason}));
        }
        enqueue(std::move(tasks));
        if (failed_req) fail(failed_req, why, true);
        if (finish) post_finalize(m.request_id);
    }

    Status validate_bootstrap(int peer, const BootstrapMsg& m) const {
        PDSIM_RETURN_IF_ERROR(check_compatible(layout_.summary(), m.layout));
        if (m.decode_rank != peer) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "bootstrap from rank {} claims decode rank {}", peer, m.decode_rank);
        }
        if (m.decode_tp_size < 1 || m.decode_tp_rank < 0 || m.decode_tp_rank >= m.decode_tp_size ||
            m.layout.tp_rank != m.decode_tp_rank || m.layout.tp_size != m.decode_tp_size) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "bad decode TP rank {} of {}",
                               m.decode_tp_rank, m.decode_tp_size);
        }
        const Tag max_tag = transport_.capabilities().max_tag;
        if (m.data_tag < kDataTagBase || m.data_tag > max_tag) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "data tag {} outside [{}, {}]",
                               m.data_tag, kDataTagBase, max_tag);
        }
        const int64_t ps = m.layout.page_size;
        if (m.num_tokens < 1 ||
            static_cast<int64_t>(m.dst_pages.size()) < (m.num_tokens + ps - 1) / ps) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "{} destination pages of {} tokens cannot hold {} tokens",
                               m.dst_pages.size(), ps, m.num_tokens);
        }
        return {};
    }

    // Adds decode rank `peer` to `r`; once every decode rank is in, the request is Transferring
    // and its held chunks are dispatched. Returns a failure reason, or "".
    std::string attach_locked(SendReq& r, int peer, const BootstrapMsg& m, std::vector<Task>& out) {
        if (m.num_tokens != r.num_tokens) {
            return fmt::format("request {}: decode rank {} expects {} tokens, prefill has {}", r.id,
                               peer, m.num_tokens, r.num_tokens);
        }
        if (r.decode_tp_size < 0) r.decode_tp_size = m.decode_tp_size;
        if (m.decode_tp_size != r.decode_tp_size || r.dests.count(m.decode_tp_rank) != 0) {
            return fmt::format(
                "request {}: inconsistent bootstrap from decode rank {} (tp {} of "
                "{}; already have {} of {})",
                r.id, peer, m.decode_tp_rank, m.decode_tp_size, r.dests.size(), r.decode_tp_size);
        }
        auto d = std::make_shared<DestState>();
        d->world_rank = peer;
        d->tp_rank = m.decode_tp_rank;
        d->tag = m.data_tag;
        d->layout = m.layout;
        d->dst_pages = m.dst_pages;
        d->frag = make_fragment(layout_.summary(), m.layout);
        if (d->frag) {
            const size_t agreed = std::min<uint64_t>(max_msg_, m.max_message_bytes);
            d->max_run = max_run_tokens(*d->frag, layout_.buffer_count(), agreed);
            d->observed.assign(static_cast<size_t>(layout_.num_layers()) *
                                   static_cast<size_t>(layout_.buffer_count()) *
                                   static_cast<size_t>(d->frag->head_count),
                               0);
        }
        r.dests[m.decode_tp_rank] = std::move(d);
        if (static_cast<int>(r.dests.size()) == r.decode_tp_size) {
            r.state = RequestState::kTransferring;
            while (!r.held.empty()) {
                dispatch_locked(r, r.held.front(), out);
                r.held.pop_front();
            }
        }
        return {};
    }

    // Turns a chunk into one task per destination that receives a fragment from this rank.
    void dispatch_locked(SendReq& r, const SendChunk& c, std::vector<Task>& out) {
        const int64_t t0 = r.sent_end;
        const int64_t t1 = sendable_end(c.token_end, layout_.page_size(), c.is_last);
        r.pages = c.src_pages;
        if (c.is_last) r.last_dispatched = true;
        if (t1 <= t0 && !c.is_last) return;  // no full page completed by this chunk
        r.sent_end = t1;
        const uint32_t idx = r.next_chunk++;
        for (auto& [tp, d] : r.dests) {
            if (!d->frag) continue;
            Task t;
            t.req = table_.find_locked(r.id);
            t.dest = d;
            t.chunk_index = idx;
            t.t0 = t0;
            t.t1 = t1;
            t.begin_step = c.begin_step;
            t.interval = c.layer_interval;
            t.is_last = c.is_last;
            t.src_pages = c.src_pages;
            t.first_token = c.first_token;
            t.first_token_src = c.first_token_src;
            t.first_token_aux_step = c.first_token_aux_step;
            ++r.tasks_outstanding;
            out.push_back(std::move(t));
        }
    }

    void enqueue(std::vector<Task> tasks) {
        for (Task& t : tasks) {
            Worker& w = *workers_[static_cast<size_t>(t.dest->world_rank) % workers_.size()];
            {
                std::lock_guard<std::mutex> lock(w.mu);
                w.queue.push_back(std::move(t));
            }
            w.cv.notify_one();
        }
    }

    // True when every send of the request completed: the caller posts the finalization.
    bool maybe_finish_locked(SendReq& r) {
        if (r.state != RequestState::kTransferring || !r.last_dispatched ||
            r.tasks_outstanding > 0 || r.ops_outstanding > 0 || r.finalizing) {
            return false;
        }
        r.finalizing = true;
        return true;
    }

    void maybe_release_pins_locked(SendReq& r) {
        // Only once nothing can read the pages any more: no task may post and no send is live.
        if (r.pins_released || r.tasks_outstanding > 0 || r.ops_outstanding > 0) return;
        if (r.state != RequestState::kFailed) return;  // Success releases in finalize
        r.pins_released = true;
        pins_.unpin_request(r.id);
    }

    void post_finalize(uint64_t id) {
        std::weak_ptr<Impl> weak = weak_from_this();
        channel_->post([weak, id] {
            if (auto self = weak.lock()) self->finalize(id);
        });
    }

    // Control thread: after-send verification, then Success.
    void finalize(uint64_t id) {
        std::shared_ptr<SendReq> r;
        int lo = -1;
        int hi = -1;
        std::vector<int32_t> pages;
        {
            MutexLock lock(table_.mu());
            r = table_.find_locked(id);
            if (!r || is_terminal(r->state)) return;
            for (auto& [tp, d] : r->dests) {
                if (!d->frag) continue;
                lo = lo < 0 ? d->frag->head_begin : std::min(lo, d->frag->head_begin);
                hi = std::max(hi, d->frag->head_begin + d->frag->head_count);
            }
            pages = r->pages;
        }
        OrderingValidator* v = opt_.validator;
        if (v != nullptr && opt_.verify_after_send && lo >= 0) {
            // Every send completed, so the pages are what the decode side got -- unless the
            // compute stream (or a new owner of a reused page) wrote them after the record.
            for (int l = 0; l < layout_.num_layers(); ++l) {
                for (int b = 0; b < layout_.buffer_count(); ++b) {
                    auto expected = v->wait_expected(id, l, b, r->num_tokens, lo, hi - lo,
                                                     std::chrono::milliseconds(0));
                    if (!expected.ok()) continue;  // the workers already reported it
                    auto now = kv_checksums(layout_, pages, l, b, 0, r->num_tokens, lo, hi - lo);
                    v->compare(id, l, b, lo, now, *expected,
                               fmt::format("after-send (prefill rank {}: pages changed after "
                                           "they were sent: late write or reuse in flight)",
                                           transport_.rank()));
                }
            }
            v->add_checked_layers(static_cast<uint64_t>(layout_.num_layers()));
        }
        uint64_t bytes;
        {
            MutexLock lock(table_.mu());
            if (!table_.mark_succeeded_locked(*r)) return;
            r->pins_released = true;
            pins_.unpin_request(r->id);
            bytes = r->bytes;
        }
        table_.notify_waiters();
        emit(TransferEvent::Kind::kRequestDone, id, -1, -1, 0, bytes);
    }

    // Any thread. Marks the request Failed (once) and, on the control thread, withdraws its
    // sends and tells the decode ranks.
    void fail(const std::shared_ptr<SendReq>& r, std::string reason, bool notify_peers) {
        std::vector<RequestHandle> handles;
        std::vector<int> peers;
        {
            MutexLock lock(table_.mu());
            if (!table_.mark_failed_locked(*r, reason)) return;
            r->cancelled.store(true);
            handles.swap(r->handles);
            for (auto& [tp, d] : r->dests) peers.push_back(d->world_rank);
            maybe_release_pins_locked(*r);
        }
        PDSIM_LOG_DEBUG("sender rank {}: {}", transport_.rank(), reason);
        table_.notify_waiters();
        emit(TransferEvent::Kind::kRequestFailed, r->id, -1, -1, 0, 0);
        if (!notify_peers) return;
        // Cancelling re-enters the transport: never from inside a transport callback, so it runs
        // on the control thread.
        Transport* t = &transport_;
        std::shared_ptr<ControlChannel> ch = channel_;
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

    // ---- workers ----

    // A task as its worker tracks it.
    struct Active {
        Task t;
        std::vector<TokenRun> runs;
        std::shared_ptr<TaskProgress> progress;
        int next_l0 = 0;         // first layer of the next interval to send
        bool started = false;    // Chunk header sent, runs cut
        bool data_done = false;  // every interval posted
        bool finished = false;
        bool has_first_token = false;
        int32_t first_token = -1;
    };

    int64_t next_target(const Active& a) const {
        const int l1 = std::min(layout_.num_layers(), a.next_l0 + a.t.interval);
        return pd::StepCounter::wrap(a.t.begin_step + l1 - 1);
    }

    // The worker interleaves its tasks in step order: every pass services each task whose next
    // interval is ready (so a batch's requests all go out layer by layer, overlapping the
    // forward), keeping one rule: per (request, destination) only the task of the next chunk may
    // post, so a request's messages on its data tag follow chunk order. When no task can move,
    // it blocks on the StepCounter (aux counter for first tokens) for the soonest target.
    void worker_loop(int index) {
        Worker& w = *workers_[static_cast<size_t>(index)];
        std::deque<Active> tasks;
        while (true) {
            {
                std::unique_lock<std::mutex> lock(w.mu);
                if (tasks.empty()) {
                    w.cv.wait(lock, [&] { return stopping_.load() || !w.queue.empty(); });
                }
                if (stopping_.load()) return;
                while (!w.queue.empty()) {
                    Active a;
                    a.t = std::move(w.queue.front());
                    w.queue.pop_front();
                    tasks.push_back(std::move(a));
                }
            }
            bool moved = false;
            // What to block on if nothing moves (copied: the deque is compacted below).
            std::optional<std::pair<int64_t, Clock::duration>> data_wait;
            std::optional<std::pair<int64_t, Clock::duration>> aux_wait;
            std::optional<std::pair<const Active*, Clock::duration>> sums_wait;
            int64_t best_distance = 0;
            const int64_t ready = counter_.query_ready_cache_step();
            for (Active& a : tasks) {
                // Chunk order per (request, destination): the data tag is non-overtaking.
                if (a.t.chunk_index != a.t.dest->next_chunk_to_post) continue;
                moved |= step_task(a);
                if (a.finished) continue;
                if (!a.data_done) {
                    const int64_t target = next_target(a);
                    const int64_t distance = pd::StepCounter::wrap(target - ready);
                    if (!data_wait || distance < best_distance) {
                        data_wait.emplace(target, wait_slice(a));
                        best_distance = distance;
                    }
                } else if (a.t.first_token_src != nullptr && !a.has_first_token) {
                    if (!aux_wait) {
                        aux_wait.emplace(pd::StepCounter::wrap(a.t.first_token_aux_step),
                                         wait_slice(a));
                    }
                } else if (!sums_wait) {
                    sums_wait.emplace(&a, wait_slice(a));
                }
            }
            if (moved || tasks.empty()) {
                std::erase_if(tasks, [](const Active& a) { return a.finished; });
                continue;
            }
            // Nothing could move: block (bounded, so shutdown, cancellation, deadlines and tasks
            // queued meanwhile are noticed within cancel_check). The aux record of a forward
            // comes after its cache records, so a pending first token is waited for first.
            if (aux_wait) {
                counter_.wait_until_aux_ready(aux_wait->first, aux_wait->second).ignore_error();
            } else if (data_wait) {
                counter_.wait_until_ready(data_wait->first, data_wait->second).ignore_error();
            } else if (sums_wait && opt_.validator != nullptr) {
                const Active& a = *sums_wait->first;
                const Fragment& f = *a.t.dest->frag;
                opt_.validator
                    ->wait_expected(a.t.req->id, layout_.num_layers() - 1,
                                    layout_.buffer_count() - 1, a.t.req->num_tokens, f.head_begin,
                                    f.head_count, sums_wait->second)
                    .status()
                    .ignore_error();
            } else {
                std::unique_lock<std::mutex> lock(w.mu);
                w.cv.wait_for(lock, opt_.cancel_check,
                              [&] { return stopping_.load() || !w.queue.empty(); });
            }
        }
    }

    Clock::duration wait_slice(const Active& a) const {
        auto left =
            std::max<Clock::duration>(a.t.req->deadline - Clock::now(), Clock::duration::zero());
        return std::min<Clock::duration>(left + std::chrono::milliseconds(1), opt_.cancel_check);
    }

    void set_awaiting(SendReq& r, std::string what) {
        MutexLock lock(table_.mu());
        r.awaiting = std::move(what);
    }

    // Moves one task as far as it can without blocking. Returns whether it did anything.
    bool step_task(Active& a) {
        SendReq& r = *a.t.req;
        DestState& d = *a.t.dest;
        const int L = layout_.num_layers();
        if (r.cancelled.load() || stopping_.load()) {
            finish_task(a);
            return true;
        }
        bool moved = false;
        if (!a.started) {
            start_task(a);
            moved = true;
        }
        while (!a.data_done) {
            const int l0 = a.next_l0;
            const int l1 = std::min(L, l0 + a.t.interval);
            const int64_t target = next_target(a);
            if (!pd::StepCounter::is_step_ready(counter_.query_ready_cache_step(), target)) {
                if (Clock::now() >= r.deadline) {
                    fail(a.t.req,
                         fmt::format("request {}: timed out after {} ms awaiting step {} (layers "
                                     "{}..{}) from the StepCounter (last ready step {}) to send "
                                     "to decode rank {}",
                                     r.id, r.timeout.count(), target, l0, l1 - 1,
                                     counter_.query_ready_cache_step(), d.world_rank),
                         true);
                    finish_task(a);
                    return true;
                }
                set_awaiting(r, fmt::format("step {} (layers {}..{}) from the StepCounter", target,
                                            l0, l1 - 1));
                return moved;
            }
            // The acquire load in query_ready_cache_step() synchronizes with the record's
            // release store: every KV write enqueued before the record is visible here.
            if (!post_interval(a, l0, l1)) {
                finish_task(a);
                return true;
            }
            a.next_l0 = l1;
            a.data_done = l1 >= L;
            moved = true;
        }
        if (!a.t.is_last) {
            finish_task(a);
            return true;
        }
        switch (try_completion(a)) {
            case Progress::kDone:
                finish_task(a);
                return true;
            case Progress::kWaiting:
                return moved;
            case Progress::kFailed:
                finish_task(a);
                return true;
        }
        return moved;
    }

    void start_task(Active& a) {
        SendReq& r = *a.t.req;
        DestState& d = *a.t.dest;
        const int ps = layout_.page_size();
        a.started = true;
        ChunkMsg cm{r.id, a.t.chunk_index, a.t.t0, a.t.t1, a.t.is_last, a.t.t0 / ps, {}};
        cm.src_pages.assign(a.t.src_pages.begin() + a.t.t0 / ps,
                            a.t.src_pages.begin() + (a.t.t1 + ps - 1) / ps);
        channel_->send(d.world_rank, encode(cm));
        a.runs = make_runs(a.t.src_pages, ps, 0, d.dst_pages, d.layout.page_size, a.t.t0, a.t.t1,
                           d.max_run);
        a.progress = std::make_shared<TaskProgress>(layout_.num_layers(), r.id, d.world_rank,
                                                    a.t.chunk_index);
    }

    // Posts every send of layers [l0, l1) (plan order: layer, buffer, run). False: stop the task.
    bool post_interval(Active& a, int l0, int l1) {
        SendReq& r = *a.t.req;
        DestState& d = *a.t.dest;
        const Fragment& f = *d.frag;
        const int B = layout_.buffer_count();
        OrderingValidator* v = opt_.validator;
        set_awaiting(
            r, fmt::format("posting layers {}..{} to decode rank {}", l0, l1 - 1, d.world_rank));
        uint64_t staged = 0;
        bool ok = true;
        for (int l = l0; ok && l < l1; ++l) {
            emit(TransferEvent::Kind::kLayerReady, r.id, l, d.world_rank, a.t.chunk_index, 0);
            a.progress->pending[static_cast<size_t>(l)].store(1);  // the posting guard
            for (int b = 0; ok && b < B; ++b) {
                const auto bi = static_cast<size_t>(b);
                uint64_t* obs = v == nullptr
                                    ? nullptr
                                    : d.observed.data() +
                                          (static_cast<size_t>(l) * static_cast<size_t>(B) + bi) *
                                              static_cast<size_t>(f.head_count);
                for (const TokenRun& run : a.runs) {
                    if (r.cancelled.load() || stopping_.load()) {
                        ok = false;
                        break;
                    }
                    // What this rank reads now is what the send carries (the transport reads
                    // the same bytes later unless someone writes them meanwhile, which the
                    // after-send verification catches).
                    if (obs != nullptr) {
                        kv_checksums_add_run(layout_, l, b, run.token_begin, run.count,
                                             run.src_slot, f.src_offset[bi], f.head_count, obs);
                    }
                    const size_t bytes = message_bytes(f, b, run);
                    std::shared_ptr<void> keep;
                    const void* ptr;
                    if (f.src_contiguous[bi]) {
                        ptr = layout_.slot_addr(l, b, run.src_slot);
                    } else {
                        // Copy: the decode rank holds only part of this rank's heads.
                        auto staging = std::make_shared<std::vector<std::byte>>(bytes);
                        gather_run(layout_, f, l, b, run, staging->data());
                        ptr = staging->data();
                        keep = std::move(staging);
                        staged += bytes;
                    }
                    if (!post_data(a.t, l, ptr, bytes, std::move(keep), a.progress)) ok = false;
                }
            }
            emit(TransferEvent::Kind::kLayerPosted, r.id, l, d.world_rank, a.t.chunk_index, 0);
            layer_op_done(a.progress, l);  // drop the guard
        }
        if (staged > 0) {
            MutexLock lock(table_.mu());
            stats_.staged_bytes += staged;
        }
        return ok;
    }

    void finish_task(Active& a) {
        if (a.finished) return;
        a.finished = true;
        a.t.dest->next_chunk_to_post = a.t.chunk_index + 1;
        SendReq& r = *a.t.req;
        bool finish;
        {
            MutexLock lock(table_.mu());
            --r.tasks_outstanding;
            if (r.tasks_outstanding == 0) r.awaiting.clear();
            finish = maybe_finish_locked(r);
            maybe_release_pins_locked(r);
        }
        if (finish) post_finalize(r.id);
    }

    enum class Progress { kDone, kWaiting, kFailed };

    // The last chunk's completion message: first token (aux step), the compute stream's
    // checksums (compared with what this rank read), then the send. Never blocks.
    Progress try_completion(Active& a) {
        SendReq& r = *a.t.req;
        DestState& d = *a.t.dest;
        const Fragment& f = *d.frag;
        const int L = layout_.num_layers();
        const int B = layout_.buffer_count();
        const bool late = Clock::now() >= r.deadline;
        if (a.t.first_token_src != nullptr && !a.has_first_token) {
            const int64_t target = pd::StepCounter::wrap(a.t.first_token_aux_step);
            if (!pd::StepCounter::is_step_ready(counter_.query_ready_aux_step(), target)) {
                if (late) {
                    fail(a.t.req,
                         fmt::format("request {}: timed out after {} ms awaiting the first token "
                                     "(aux step {}, last ready {})",
                                     r.id, r.timeout.count(), target,
                                     counter_.query_ready_aux_step()),
                         true);
                    return Progress::kFailed;
                }
                set_awaiting(r, fmt::format("the first token (aux step {})", target));
                return Progress::kWaiting;
            }
            // The aux record published (release) after the stream wrote the token; the acquire
            // load above makes that write visible.
            a.has_first_token = true;
            a.first_token = *a.t.first_token_src;
        } else if (a.t.first_token_src == nullptr && a.t.first_token >= 0) {
            a.has_first_token = true;
            a.first_token = a.t.first_token;
        }
        CompletionMsg m;
        m.request_id = r.id;
        m.src_tp_rank = layout_.summary().tp_rank;
        m.num_layers = L;
        m.buffer_count = B;
        m.head_begin = f.head_begin;
        m.head_count = f.head_count;
        m.chunks = a.t.chunk_index + 1;
        m.has_first_token = a.has_first_token;
        m.first_token = a.first_token;
        OrderingValidator* v = opt_.validator;
        if (v != nullptr) {
            std::vector<std::vector<uint64_t>> expected;
            for (int l = 0; l < L; ++l) {
                for (int b = 0; b < B; ++b) {
                    auto e = v->wait_expected(r.id, l, b, r.num_tokens, f.head_begin, f.head_count,
                                              std::chrono::nanoseconds(0));
                    if (e.ok()) {
                        expected.push_back(std::move(e).value());
                        continue;
                    }
                    if (!late) {
                        set_awaiting(r, "the compute stream's checksums (enqueue_layer_checksum)");
                        return Progress::kWaiting;
                    }
                    fail(a.t.req,
                         fmt::format("request {}: timed out awaiting the compute stream's "
                                     "checksums for decode rank {}: {}",
                                     r.id, d.world_rank, e.status().message()),
                         true);
                    return Progress::kFailed;
                }
            }
            m.has_checksums = true;
            m.checksums.reserve(static_cast<size_t>(L * B * f.head_count));
            size_t i = 0;
            for (int l = 0; l < L; ++l) {
                for (int b = 0; b < B; ++b, ++i) {
                    const size_t at = i * static_cast<size_t>(f.head_count);
                    v->compare(r.id, l, b, f.head_begin,
                               std::span<const uint64_t>(d.observed.data() + at,
                                                         static_cast<size_t>(f.head_count)),
                               expected[i],
                               fmt::format("sender read (prefill rank {} -> decode rank {})",
                                           transport_.rank(), d.world_rank));
                    m.checksums.insert(m.checksums.end(), expected[i].begin(), expected[i].end());
                }
            }
            v->add_checked_layers(static_cast<uint64_t>(L));
        }
        auto buf = std::make_shared<Bytes>(encode(m));
        const void* ptr = buf->data();
        const size_t n = buf->size();
        return post_data(a.t, -1, ptr, n, std::move(buf), nullptr) ? Progress::kDone
                                                                   : Progress::kFailed;
    }

    // Posts one send of the request on its data tag. layer < 0: the completion message.
    bool post_data(const Task& t, int layer, const void* ptr, size_t bytes,
                   std::shared_ptr<void> keep, const std::shared_ptr<TaskProgress>& progress) {
        SendReq& r = *t.req;
        const int peer = t.dest->world_rank;
        {
            MutexLock lock(table_.mu());
            if (is_terminal(r.state)) return false;
            ++r.ops_outstanding;
        }
        if (layer >= 0) progress->pending[static_cast<size_t>(layer)].fetch_add(1);
        auto h = transport_.post_send(peer, t.dest->tag, ptr, bytes);
        if (!h.ok()) {
            on_send_done(t.req, progress, layer, peer, h.status(), 0);
            return false;
        }
        bool cancel_now = false;
        {
            MutexLock lock(table_.mu());
            if (is_terminal(r.state)) {
                // fail() already withdrew the handles it knew of; this one came later.
                cancel_now = true;
            } else {
                r.handles.push_back(*h);
                if (r.handles.size() > 256 &&
                    r.handles.size() > 2 * static_cast<size_t>(r.ops_outstanding)) {
                    std::erase_if(r.handles, [](const RequestHandle& x) { return x.done(); });
                }
            }
        }
        if (cancel_now) transport_.cancel(*h).ignore_error();
        std::weak_ptr<Impl> weak = weak_from_this();
        h->on_complete(
            [weak, req = t.req, progress, layer, peer, keep](const Status& st, size_t n) {
                if (auto self = weak.lock()) self->on_send_done(req, progress, layer, peer, st, n);
            });
        return true;
    }

    // Any thread (transport callbacks included): never re-enters the transport.
    void on_send_done(const std::shared_ptr<SendReq>& r, const std::shared_ptr<TaskProgress>& p,
                      int layer, int peer, const Status& st, size_t n) {
        std::string why;
        {
            MutexLock lock(table_.mu());
            --r->ops_outstanding;
            if (st.ok()) {
                if (layer >= 0) {
                    r->bytes += n;
                    stats_.bytes += n;
                    ++stats_.messages;
                }
            } else if (!is_terminal(r->state)) {
                why = fmt::format("request {}: send of {} to decode rank {} failed: {}", r->id,
                                  layer >= 0 ? fmt::format("layer {}", layer)
                                             : std::string("the completion message"),
                                  peer, st.message());
            }
        }
        if (st.ok() && layer >= 0) p->bytes[static_cast<size_t>(layer)].fetch_add(n);
        if (layer >= 0) layer_op_done(p, layer);
        // fail() posts the cancellation to the control thread, so it is safe from a callback.
        if (!why.empty()) fail(r, why, true);
        bool finish;
        {
            MutexLock lock(table_.mu());
            finish = maybe_finish_locked(*r);
            maybe_release_pins_locked(*r);
        }
        if (finish) post_finalize(r->id);
    }

    void layer_op_done(const std::shared_ptr<TaskProgress>& p, int layer) {
        if (p->pending[static_cast<size_t>(layer)].fetch_sub(1) != 1) return;
        {
            MutexLock lock(table_.mu());
            ++stats_.layers;
        }
        emit(TransferEvent::Kind::kLayerSent, p->request, layer, p->peer, p->chunk,
             p->bytes[static_cast<size_t>(layer)].load());
    }

    Transport& transport_;
    const KvLayout layout_;
    pd::StepCounter& counter_;
    const SenderOptions opt_;
    size_t max_msg_ = 0;
    std::shared_ptr<ControlChannel> channel_;
    PagePins pins_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::atomic<bool> stopping_{false};

    // The requests and the engine lock: table_.mu() guards what is below and the requests'
    // bookkeeping (see request_table.h).
    RequestTable<SendReq> table_;
    std::unordered_map<uint64_t, std::vector<PendingBootstrap>> pending_bootstraps_;
    // Requests a decode rank aborted before this rank scheduled them (id -> reason, when): a
    // later add_request fails at once instead of waiting for a bootstrap that will not come.
    std::unordered_map<uint64_t, std::pair<std::string, Clock::time_point>> aborted_;
    EngineStats stats_;
};

// ---- KvSender ----

StatusOr<std::unique_ptr<KvSender>> KvSender::create(Transport& transport, KvLayout layout,
                                                     pd::StepCounter& counter,
                                                     SenderOptions options) {
    const Capabilities caps = transport.capabilities();
    if (!caps.two_sided || !caps.tag_matching) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "the KV sender needs a two-sided, tag-matching transport; '{}' is not",
                           transport.name());
    }
    if (caps.max_tag < kDataTagBase) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "transport '{}' max_tag {} leaves no data tags (need >= {})",
                           transport.name(), caps.max_tag, kDataTagBase);
    }
    if (layout.num_layers() < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "empty KV layout");
    }
    if (options.validator != nullptr && options.validator->rank() != transport.rank()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "validator of rank {} given to the sender of rank {}",
                           options.validator->rank(), transport.rank());
    }
    auto impl = std::make_shared<Impl>(transport, std::move(layout), counter, std::move(options));
    PDSIM_RETURN_IF_ERROR(impl->start());
    return std::unique_ptr<KvSender>(new KvSender(std::move(impl)));
}

KvSender::KvSender(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvSender::~KvSender() {
    impl_->shutdown(ShutdownMode::kGraceful);
}

Status KvSender::add_request(const SendRequestSpec& spec) {
    return impl_->add_request(spec);
}
Status KvSender::submit_chunk(SendChunk chunk) {
    return impl_->submit_chunk(std::move(chunk));
}
StatusOr<RequestStatus> KvSender::status(uint64_t id) const {
    return impl_->status(id);
}
StatusOr<RequestStatus> KvSender::wait(uint64_t id, std::chrono::nanoseconds timeout) const {
    return impl_->wait(id, timeout);
}
Status KvSender::release(uint64_t id) {
    return impl_->release(id);
}
PagePins& KvSender::pins() {
    return impl_->pins();
}
EngineStats KvSender::stats() const {
    return impl_->stats();
}
const KvLayout& KvSender::layout() const {
    return impl_->layout();
}
void KvSender::shutdown(ShutdownMode mode) {
    impl_->shutdown(mode);
}

}  // namespace pdsim::transfer
