#include "transfer/engine/kv_sender.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/logging.h"
#include "common/thread_info.h"
#include "transfer/engine/control.h"
#include "transfer/engine/kv_sender_impl.h"
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

KvSender::Impl::Impl(Transport& transport, DataPlaneChoice plane, KvLayout layout,
                     pd::StepCounter& counter, SenderOptions options,
                     std::unique_ptr<KvCommStream> comm)
    : transport_(transport),
      data_(*plane.data),
      plane_(plane.plane),
      layout_(std::move(layout)),
      counter_(counter),
      opt_(std::move(options)),
      comm_(std::move(comm)),
      pins_(transport.rank(), opt_.validator),
      table_(RequestTableNames{"sender", transport.rank()}) {
    max_msg_ = std::min(opt_.max_message_bytes, data_.capabilities().max_message_bytes);
    gate_ahead_ = comm_ != nullptr && opt_.device_gate && data_.capabilities().stream_ordered &&
                  counter_.stream().device() == layout_.device();
    if (ordered()) {
        for (int p = 0; p < transport.world_size(); ++p) {
            ordered_peers_.push_back(std::make_unique<OrderedPeer>());
        }
    }
}

Status KvSender::Impl::start() {
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

Status KvSender::Impl::add_request(const SendRequestSpec& spec) {
    if (spec.num_tokens < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: {} tokens", spec.request_id,
                           spec.num_tokens);
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
        r->deadline.set(r->started + r->timeout);
        table_.insert_locked(r);
        if (auto ab = aborted_.find(r->id); ab != aborted_.end()) {
            failures.emplace_back(r, ab->second.first);
            aborted_.erase(ab);
        } else if (!no_peer_left_.empty()) {
            failures.emplace_back(r, fmt::format("request {}: {}", r->id, no_peer_left_));
        }
        auto pend = pending_bootstraps_.find(r->id);
        if (pend != pending_bootstraps_.end()) {
            for (const PendingBootstrap& pb : pend->second) {
                std::string err = attach_locked(*r, pb.peer, pb.msg, pb.regions, tasks);
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

Status KvSender::Impl::submit_chunk(SendChunk c) {
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
        r.touch();  // a chunk computed, or the decode side attached it: progress
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

StatusOr<RequestStatus> KvSender::Impl::status(uint64_t id) const {
    MutexLock lock(table_.mu());
    PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<SendReq> r, table_.get_locked(id));
    return status_locked(*r);
}

StatusOr<RequestStatus> KvSender::Impl::wait(uint64_t id, std::chrono::nanoseconds timeout) const {
    MutexLock lock(table_.mu());
    PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<SendReq> r, table_.get_locked(id));
    if (!table_.wait_terminal_locked(*r, timeout)) {
        return Table::wait_timed_out(*r, timeout, describe_awaiting_locked(*r));
    }
    return status_locked(*r);
}

Status KvSender::Impl::release(uint64_t id) {
    PDSIM_RETURN_IF_ERROR(table_.release(id));
    if (opt_.validator != nullptr) opt_.validator->forget(id);
    return {};
}

EngineStats KvSender::Impl::stats() const {
    MutexLock lock(table_.mu());
    EngineStats stats = stats_;
    table_.copy_counts_locked(stats);
    return stats;
}

void KvSender::Impl::shutdown(ShutdownMode mode) {
    std::optional<std::vector<std::shared_ptr<SendReq>>> active = table_.begin_shutdown();
    if (!active) return;
    const bool graceful = mode == ShutdownMode::kGraceful;
    // Write mode, graceful, with requests that are not quiet (active ones, which fail now, or
    // failed ones with writes in flight): the workers let go of their tasks on the way out, so
    // that those requests turn quiet and their decode ranks hear Quiesced before the channel
    // stops.
    bool unquiet = false;
    if (write_mode() && graceful) {
        MutexLock lock(table_.mu());
        for (auto& [id, r] : table_.requests_locked()) unquiet |= !r->pins_released;
    }
    quiesce_on_exit_.store(unquiet);
    stopping_.store(true);
    for (auto& r : *active) {
        fail(r,
             fmt::format("request {}: prefill rank {} shut down{}", r->id, transport_.rank(),
                         graceful ? "" : " abruptly"),
             graceful);
    }
    for (auto& w : workers_) {
        if (!quiesce_on_exit_.load()) {
            MutexLock lock(w->mu);
            w->queue.clear();
        }
        w->cv.notify_all();
    }
    for (auto& w : workers_) {
        if (w->thread.joinable()) w->thread.join();
    }
    if (quiesce_on_exit_.load()) {
        // Bounded: a write that never completes keeps its request (and its pins) busy.
        MutexLock lock(table_.mu());
        (void)table_.wait_for_locked(opt_.peer_timeout, [&]() PDSIM_REQUIRES(table_.mu()) {
            for (auto& [id, r] : table_.requests_locked()) {
                if (r->state == RequestState::kFailed && !r->pins_released) return false;
            }
            return true;
        });
    }
    // Write mode: the Quiesced messages (those just posted, and those posted earlier that a
    // decode rank has not matched yet) are what the decode ranks wait for before they free
    // pages; give the control sends a moment to reach a live peer (one that is gone or stuck
    // counts as dead after its peer timeout anyway: our heartbeats stop). stop() lingers only
    // while sends are still unmatched.
    if (channel_) {
        channel_->stop(graceful, write_mode() && graceful ? std::chrono::milliseconds(200)
                                                          : std::chrono::milliseconds(0));
    }
    // Sends still posted (an ordered plane's announced ones, kv_sender.h) complete when their
    // decode rank receives them or the data transport is closed, maybe long after this: their
    // callbacks reach the hook no more.
    events_.close();
}

void KvSender::Impl::on_control(int peer, std::span<const uint8_t> bytes) {
    auto type = peek_type(bytes);
    if (!type.ok()) {
        PDSIM_LOG_WARN("sender rank {}: bad control message from rank {}: {}", transport_.rank(),
                       peer, type.status().to_string());
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
            if (m.ok()) handle_abort(peer, *m);
            return;
        }
        case MsgType::kRegions: {
            auto m = decode_regions(bytes);
            if (!m.ok()) {
                PDSIM_LOG_WARN("sender rank {}: {}", transport_.rank(), m.status().to_string());
                peer_regions_[peer] = PeerRegions{DecodeRegions{}, m.status()};
                return;
            }
            handle_regions(peer, *m);
            return;
        }
        case MsgType::kHeartbeat:
            return;
        default:
            PDSIM_LOG_WARN("sender rank {}: unexpected {} message from rank {}", transport_.rank(),
                           msg_type_name(*type), peer);
    }
}

void KvSender::Impl::handle_abort(int peer, const AbortMsg& m) {
    std::shared_ptr<SendReq> r;
    bool reply_now = false;
    std::string reason;
    const std::string why =
        fmt::format("request {}: decode rank {} aborted it: {}", m.request_id, peer, m.reason);
    {
        MutexLock lock(table_.mu());
        auto pend = pending_bootstraps_.find(m.request_id);
        if (pend != pending_bootstraps_.end()) pending_bootstraps_.erase(pend);
        r = table_.find_locked(m.request_id);
        if (!r) {
            aborted_[m.request_id] = {why, Clock::now()};
            // Never attached here: nothing of ours writes into its pages.
            reply_now = true;
            reason = why;
        } else if (is_terminal(r->state) && r->pins_released) {
            // Quiet already: failed and let go, or succeeded (every write completed).
            reply_now = true;
            reason = r->state == RequestState::kFailed ? r->reason : "it completed here";
        } else {
            // Quiesced goes to this rank too once the request is quiet.
            r->abort_peers.push_back(peer);
        }
    }
    if (reply_now) {
        if (write_mode()) {
            channel_->send(peer,
                           encode(QuiescedMsg{m.request_id, layout_.summary().tp_rank, reason}));
        }
        return;
    }
    fail(r, why, true);
}

void KvSender::Impl::handle_regions(int peer, const RegionsMsg& m) {
    PeerRegions pr;
    if (!write_mode()) {
        pr.error = PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "decode rank {} expects one-sided writes; this prefill rank's data "
                               "plane ('{}') is two-sided",
                               peer, data_.name());
    } else if (m.num_layers != layout_.num_layers() || m.buffer_count != layout_.buffer_count() ||
               m.decode_rank != peer) {
        pr.error = PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "regions of decode rank {} (claims rank {}) are {} layers x {} "
                               "buffers; this rank has {} x {}",
                               peer, m.decode_rank, m.num_layers, m.buffer_count,
                               layout_.num_layers(), layout_.buffer_count());
    } else {
        // Once per (decode engine, prefill rank): importing may be slow (cuda_ipc opens an IPC
        // handle), so it happens here and never per request.
        for (size_t i = 0; i < m.descriptor_bytes.size(); ++i) {
            auto region = data_.import_remote(peer, m.descriptor(i));
            if (!region.ok()) {
                pr.error = region.status().with_context(
                    fmt::format("importing region {} (layer {} buffer {}) of decode rank {}", i,
                                i / static_cast<size_t>(m.buffer_count),
                                i % static_cast<size_t>(m.buffer_count), peer));
                pr.regions.kv.clear();
                break;
            }
            pr.regions.kv.push_back(*region);
        }
        // Arrival words: only a data transport with write signals can add to them; without one
        // this rank tells each Bootstrap's Ack that it signals nothing.
        if (pr.error.ok() && m.arrival_slots > 0 && data_.capabilities().write_signals) {
            auto arrival = data_.import_remote(peer, m.arrival_descriptor);
            const uint64_t need = static_cast<uint64_t>(m.arrival_slots) *
                                  static_cast<uint64_t>(m.num_layers) * sizeof(uint64_t);
            if (!arrival.ok()) {
                pr.error = arrival.status().with_context(
                    fmt::format("importing the arrival region of decode rank {}", peer));
                pr.regions.kv.clear();
            } else if (arrival->bytes < need) {
                pr.error = PDSIM_ERROR(StatusCode::kInvalidArgument,
                                       "the arrival region of decode rank {} has {} bytes, {} "
                                       "slots x {} layers need {}",
                                       peer, arrival->bytes, m.arrival_slots, m.num_layers, need);
                pr.regions.kv.clear();
            } else if (StatusOr<RequestHandle> probe = data_.post_signal(*arrival, 0, 0);
                       !probe.ok()) {
                // An add of 0 changes no word; a transport that cannot reach the region at all
                // (cuda_ipc without peer access to that GPU) says so at once: then this rank
                // signals nothing, and its Acks say so.
                PDSIM_LOG_WARN("sender rank {}: no arrival signals to decode rank {}: {}",
                               transport_.rank(), peer, probe.status().to_string());
            } else {
                pr.regions.arrival = *arrival;
                pr.regions.arrival_slots = m.arrival_slots;
            }
        }
    }
    if (!pr.error.ok()) {
        PDSIM_LOG_WARN("sender rank {}: {}", transport_.rank(), pr.error.to_string());
    }
    peer_regions_[peer] = std::move(pr);
}

void KvSender::Impl::on_peer_failed(int peer, const Status& st) {
    std::vector<std::pair<std::shared_ptr<SendReq>, std::string>> to_fail;
    // No other rank left to bootstrap a request: a request still awaiting its bootstrap would
    // wait for ever (its wait has no timeout: the decode side's admission queue).
    bool no_peer_left = true;
    for (int p = 0; p < transport_.world_size(); ++p) {
        if (p != transport_.rank() && !channel_->peer_failed(p)) no_peer_left = false;
    }
    {
        MutexLock lock(table_.mu());
        if (no_peer_left && no_peer_left_.empty()) {
            no_peer_left_ = fmt::format(
                "no decode rank can bootstrap it: the control links to every other rank failed "
                "(the last, to rank {}: {})",
                peer, st.message());
        }
        for (auto& [id, r] : table_.requests_locked()) {
            if (is_terminal(r->state)) continue;
            bool failed = false;
            for (auto& [tp, d] : r->dests) {
                if (d->world_rank != peer) continue;
                to_fail.emplace_back(
                    r, fmt::format("request {}: decode rank {} unreachable while awaiting "
                                   "{}: {}",
                                   id, peer, describe_awaiting_locked(*r), st.message()));
                failed = true;
                break;
            }
            if (!failed && no_peer_left) {
                to_fail.emplace_back(r, fmt::format("request {} awaiting {}: {}", id,
                                                    describe_awaiting_locked(*r), no_peer_left_));
            }
        }
        // Bootstraps of requests not added yet: the request's add_request must fail at once,
        // not wait for a bootstrap the dead rank already sent (its Ack went out on receipt).
        const auto now = Clock::now();
        for (auto it = pending_bootstraps_.begin(); it != pending_bootstraps_.end();) {
            const uint64_t id = it->first;
            if (std::erase_if(it->second,
                              [&](const PendingBootstrap& p) { return p.peer == peer; }) > 0) {
                aborted_.try_emplace(
                    id,
                    fmt::format("request {}: decode rank {} unreachable before this rank "
                                "scheduled the request: {}",
                                id, peer, st.message()),
                    now);
            }
            it = it->second.empty() ? pending_bootstraps_.erase(it) : std::next(it);
        }
    }
    for (auto& [r, why] : to_fail) fail(r, why, true);
}

void KvSender::Impl::on_stall(Clock::time_point now) {
    // This process did not run (stopped, starved): no request's progress clock counts the gap.
    MutexLock lock(table_.mu());
    for (auto& [id, r] : table_.requests_locked()) {
        if (!is_terminal(r->state)) r->touch(now);
    }
}

Status KvSender::Impl::abort(uint64_t id, const std::string& reason) {
    std::shared_ptr<SendReq> r = table_.find(id);
    if (!r) return request_table_detail::not_known_error(id);
    fail(r, fmt::format("request {}: aborted here: {}", id, reason), true);
    return {};
}

void KvSender::Impl::on_tick(Clock::time_point now) {
    // Device layouts: memory of comm-stream work whose wait failed, once the stream passed it.
    if (comm_) comm_->sweep();
    std::vector<std::pair<std::shared_ptr<SendReq>, std::string>> to_fail;
    std::vector<uint8_t> interest(static_cast<size_t>(transport_.world_size()), 0);
    {
        MutexLock lock(table_.mu());
        for (auto& [id, r] : table_.requests_locked()) {
            if (write_mode() && r->state == RequestState::kFailed && !r->pins_released) {
                // Writes may still land at its destinations: stay audibly alive to them, so
                // they keep the pages pinned until our Quiesced instead of declaring us dead.
                for (auto& [tp, d] : r->dests) interest[static_cast<size_t>(d->world_rank)] = 1;
            }
            if (is_terminal(r->state)) continue;
            for (auto& [tp, d] : r->dests) interest[static_cast<size_t>(d->world_rank)] = 1;
            // Not bootstrapped by every decode rank yet: the request waits for the decode
            // instance's admission (a queue, no fault) -- the progress clock does not run.
            if (r->decode_tp_size < 0 || static_cast<int>(r->dests.size()) < r->decode_tp_size) {
                r->touch(now);
            }
            if (Table::past_deadline(*r, now)) {
                to_fail.emplace_back(r, Table::timed_out_reason(*r, describe_awaiting_locked(*r)));
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
        // Aborts of requests not added yet: kept long enough for a request that waited in the
        // prefill queue (add_request comes at its first forward) to find its abort.
        std::erase_if(aborted_, [&](const auto& kv) {
            return now - kv.second.second > kAbortMemory * opt_.request_timeout;
        });
        // Bootstraps for requests this rank has not scheduled yet (they wait in its queue, which
        // is no fault): kept while their decode rank lives (heard within the peer timeout; an
        // Abort drops them too).
        for (auto it = pending_bootstraps_.begin(); it != pending_bootstraps_.end();) {
            const uint64_t id = it->first;
            std::string silent;  // why the first dropped bootstrap's decode rank is gone
            std::erase_if(it->second, [&](const PendingBootstrap& p) {
                const auto heard = std::max(channel_->last_heard(p.peer), p.at);
                if (now - heard <= opt_.peer_timeout) return false;
                if (silent.empty()) {
                    silent = fmt::format(
                        "request {}: decode rank {} silent for {} ms before "
                        "this rank scheduled the request",
                        id, p.peer, ms_since(heard, now));
                }
                return true;
            });
            // As on_peer_failed: the request, once added, fails at once.
            if (!silent.empty()) aborted_.try_emplace(id, std::move(silent), now);
            it = it->second.empty() ? pending_bootstraps_.erase(it) : std::next(it);
        }
    }
    channel_->set_interest(std::move(interest));
    for (auto& [r, why] : to_fail) fail(r, why, true);
}

RequestStatus KvSender::Impl::status_locked(const SendReq& r) const {
    RequestStatus s;
    s.state = r.state;
    s.reason = r.reason;
    s.bytes = r.bytes;
    s.started = r.started;
    s.finished = r.finished;
    s.pages_in_use = !r.pins_released;
    return s;
}

std::string KvSender::Impl::describe_awaiting_locked(const SendReq& r) const {
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
        if (write_mode()) {
            return fmt::format("{} writes to decode rank(s) {} to complete", r.ops_outstanding,
                               ranks);
        }
        return fmt::format("{} sends to decode rank(s) {} to complete (matching receives)",
                           r.ops_outstanding, ranks);
    }
    return "finalization";
}

void KvSender::Impl::emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer,
                          uint32_t chunk, uint64_t bytes) const {
    if (!events_.has_hook()) return;
    TransferEvent e;
    e.kind = kind;
    e.request = req;
    e.layer = layer;
    e.peer = peer;
    e.chunk = chunk;
    e.bytes = bytes;
    e.time = Clock::now();
    events_.emit(e);
}

void KvSender::Impl::handle_bootstrap(int peer, BootstrapMsg m) {
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
    // Signals go where the decode rank named a slot and this rank could import its arrival
    // region (its data transport has write signals).
    ack.arrival_signals =
        write_mode() && m.arrival_slot >= 0 && peer_regions_.at(peer).regions.arrival.has_value();
    // The ack goes out before the request can dispatch chunks for this peer, so on the
    // control tag it precedes every Chunk header (the decode side needs our layout first).
    channel_->send(peer, encode(ack));
    std::vector<Task> tasks;
    std::shared_ptr<SendReq> failed_req;
    std::string why;
    std::optional<std::string> abort_reason;
    bool finish = false;
    DecodeRegions regions;
    if (write_mode()) regions = peer_regions_.at(peer).regions;  // validate_bootstrap: present
    {
        MutexLock lock(table_.mu());
        std::shared_ptr<SendReq> found = table_.find_locked(m.request_id);
        if (!found) {
            pending_bootstraps_[m.request_id].push_back(
                {peer, std::move(m), Clock::now(), std::move(regions)});
            return;
        }
        SendReq& r = *found;
        r.touch();  // a chunk computed, or the decode side attached it: progress
        if (r.state == RequestState::kFailed) {
            abort_reason = r.reason;
        } else if (!is_terminal(r.state)) {
            why = attach_locked(r, peer, m, std::move(regions), tasks);
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

Status KvSender::Impl::validate_bootstrap(int peer, const BootstrapMsg& m) const {
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
    StatusOr<DataPlane> theirs = data_plane_of_tag(m.data_tag);
    if (!theirs.ok()) return theirs.status().with_context(fmt::format("decode rank {}", peer));
    if (*theirs != plane_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "decode rank {} uses the {} data plane (data tag {}); this prefill "
                           "rank's data plane is {} (data transport '{}')",
                           peer, data_plane_name(*theirs), m.data_tag, data_plane_name(plane_),
                           data_.name());
    }
    if (plane_ == DataPlane::kTwoSided && m.data_tag > data_.capabilities().max_tag) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "data tag {} outside [{}, {}]", m.data_tag,
                           kDataTagBase, data_.capabilities().max_tag);
    }
    const int64_t ps = m.layout.page_size;
    if (m.num_tokens < 1 ||
        static_cast<int64_t>(m.dst_pages.size()) < (m.num_tokens + ps - 1) / ps) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{} destination pages of {} tokens cannot hold {} tokens",
                           m.dst_pages.size(), ps, m.num_tokens);
    }
    if (write_mode()) {
        auto it = peer_regions_.find(peer);
        if (it == peer_regions_.end()) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "no memory regions from decode rank {} (its Regions message "
                               "precedes its first Bootstrap to this engine)",
                               peer);
        }
        PDSIM_RETURN_IF_ERROR(it->second.error);
        const std::vector<RemoteRegion>& regions = it->second.regions.kv;
        if (it->second.regions.arrival &&
            (m.arrival_slot < -1 || m.arrival_slot >= it->second.regions.arrival_slots)) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "arrival slot {} of decode rank {}, which has {}", m.arrival_slot,
                               peer, it->second.regions.arrival_slots);
        }
        int32_t top = 0;
        for (int64_t i = 0; i < (m.num_tokens + ps - 1) / ps; ++i) {
            top = std::max(top, m.dst_pages[static_cast<size_t>(i)]);
        }
        if (std::any_of(m.dst_pages.begin(), m.dst_pages.end(), [](int32_t p) { return p < 0; })) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "negative destination page");
        }
        for (size_t i = 0; i < regions.size(); ++i) {
            const int b = static_cast<int>(i % static_cast<size_t>(layout_.buffer_count()));
            const uint64_t need = (static_cast<uint64_t>(top) + 1) * m.layout.token_bytes(b) *
                                  static_cast<uint64_t>(ps);
            if (regions[i].bytes < need) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "destination page {} lies outside decode rank {}'s region of "
                                   "layer {} buffer {} ({} bytes)",
                                   top, peer, i / static_cast<size_t>(layout_.buffer_count()), b,
                                   regions[i].bytes);
            }
        }
    }
    return {};
}

std::string KvSender::Impl::attach_locked(SendReq& r, int peer, const BootstrapMsg& m,
                                          DecodeRegions regions, std::vector<Task>& out) {
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
    // The ordered plane posts untagged (the transport ignores tags).
    d->tag = plane_ == DataPlane::kOrdered ? kOrderedPostTag : m.data_tag;
    d->layout = m.layout;
    d->dst_pages = m.dst_pages;
    d->regions = std::move(regions.kv);
    if (regions.arrival && m.arrival_slot >= 0) {
        d->arrival = regions.arrival;
        d->arrival_slot = m.arrival_slot;
    }
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

void KvSender::Impl::dispatch_locked(SendReq& r, const SendChunk& c, std::vector<Task>& out) {
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

bool KvSender::Impl::maybe_finish_locked(SendReq& r) {
    if (r.state != RequestState::kTransferring || !r.last_dispatched || r.tasks_outstanding > 0 ||
        r.ops_outstanding > 0 || r.finalizing) {
        return false;
    }
    r.finalizing = true;
    return true;
}

bool KvSender::Impl::maybe_release_pins_locked(SendReq& r) {
    // Only once nothing can read the pages any more: no task may post and no send is live.
    if (r.pins_released || r.tasks_outstanding > 0 || r.ops_outstanding > 0) return false;
    if (r.state != RequestState::kFailed) return false;  // Success releases in finalize
    r.pins_released = true;
    pins_.unpin_request(r.id);
    return true;
}

void KvSender::Impl::post_quiesced(const std::shared_ptr<SendReq>& r) {
    if (!write_mode()) return;
    table_.notify_waiters();  // a graceful shutdown waits for quiet requests
    std::weak_ptr<Impl> weak = weak_from_this();
    channel_->post([weak, r] {
        auto self = weak.lock();
        if (!self) return;
        std::vector<int> peers;
        std::string reason;
        {
            MutexLock lock(self->table_.mu());
            for (auto& [tp, d] : r->dests) peers.push_back(d->world_rank);
            peers.insert(peers.end(), r->abort_peers.begin(), r->abort_peers.end());
            reason = r->reason;
        }
        std::sort(peers.begin(), peers.end());
        peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
        const Bytes msg = encode(QuiescedMsg{r->id, self->layout_.summary().tp_rank, reason});
        for (int p : peers) {
            if (!self->channel_->peer_failed(p)) self->channel_->send(p, msg);
        }
    });
}

void KvSender::Impl::post_finalize(uint64_t id) {
    std::weak_ptr<Impl> weak = weak_from_this();
    channel_->post([weak, id] {
        if (auto self = weak.lock()) self->finalize(id);
    });
}

void KvSender::Impl::finalize(uint64_t id) {
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
        // Device layouts: the pages are hashed by the KV memory ops on the comm stream, and this
        // (control) thread waits for it, bounded by the request's deadline.
        KvChecksumPlan device_plan;
        std::vector<uint64_t> device_sums;
        if (comm_) {
            const int L = layout_.num_layers();
            StatusOr<KvChecksumPlan> plan =
                plan_page_checksums(layout_, pages, 0, r->num_tokens, 0, L, lo, hi - lo);
            StatusOr<std::vector<uint64_t>> sums =
                plan.ok() ? comm_->checksums(layout_, *plan, r->deadline.get(), opt_.cancel_check,
                                             [this] { return stopping_.load(); })
                          : StatusOr<std::vector<uint64_t>>(plan.status());
            if (!sums.ok()) {
                const bool late = sums.status().code() == StatusCode::kDeadlineExceeded;
                fail(r,
                     fmt::format("request {}: {} awaiting the {} (the after-send checksums of "
                                 "layers 0..{}): {}",
                                 id,
                                 late ? fmt::format("timed out after {} ms", r->timeout.count())
                                      : std::string("failed"),
                                 comm_->describe(), L - 1, sums.status().message()),
                     true);
                return;
            }
            device_plan = std::move(plan).value();
            device_sums = std::move(sums).value();
        }
        for (int l = 0; l < layout_.num_layers(); ++l) {
            for (int b = 0; b < layout_.buffer_count(); ++b) {
                auto expected = v->wait_expected(id, l, b, r->num_tokens, lo, hi - lo,
                                                 std::chrono::milliseconds(0));
                if (!expected.ok()) continue;  // the workers already reported it
                std::vector<uint64_t> now;
                if (comm_) {
                    const auto at = static_cast<std::ptrdiff_t>(device_plan.sum_index(l, b));
                    now.assign(device_sums.begin() + at, device_sums.begin() + at + (hi - lo));
                } else {
                    now = kv_checksums(layout_, pages, l, b, 0, r->num_tokens, lo, hi - lo);
                }
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

void KvSender::Impl::fail(const std::shared_ptr<SendReq>& r, std::string reason,
                          bool notify_peers) {
    std::vector<RequestHandle> handles;
    std::vector<int> peers;
    bool quiet;
    {
        MutexLock lock(table_.mu());
        if (!table_.mark_failed_locked(*r, reason)) return;
        r->cancelled.store(true);
        // Ordered plane: an announced send is never withdrawn (the decode rank posts its receive
        // whatever becomes of the request; withdrawing would put the pair's stream out of step).
        if (!ordered()) handles.swap(r->handles);
        for (auto& [tp, d] : r->dests) peers.push_back(d->world_rank);
        quiet = maybe_release_pins_locked(*r);
    }
    PDSIM_LOG_DEBUG("sender rank {}: {}", transport_.rank(), reason);
    table_.notify_waiters();
    emit(TransferEvent::Kind::kRequestFailed, r->id, -1, -1, 0, 0);
    if (!notify_peers) {
        // Abrupt: send nothing (a crash); the decode ranks find out by our silence.
        return;
    }
    // Cancelling re-enters the transport: never from inside a transport callback, so it runs
    // on the control thread.
    Transport* t = &data_;
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
    if (quiet) post_quiesced(r);
}

// ---- KvSender ----

StatusOr<std::unique_ptr<KvSender>> KvSender::create(Transport& transport, KvLayout layout,
                                                     pd::StepCounter& counter,
                                                     SenderOptions options) {
    PDSIM_ASSIGN_OR_RETURN(
        DataPlaneChoice plane,
        choose_data_plane("KV sender", transport, options.data_transport, layout));
    if (layout.num_layers() < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "empty KV layout");
    }
    if (!options.layer_steps.empty()) {
        bool increasing = options.layer_steps.size() == static_cast<size_t>(layout.num_layers()) &&
                          options.layer_steps[0] >= 0;
        for (size_t l = 1; increasing && l < options.layer_steps.size(); ++l) {
            increasing = options.layer_steps[l] > options.layer_steps[l - 1];
        }
        if (!increasing) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "layer_steps: {} entries, need {} (one per layout layer), "
                               "strictly increasing from >= 0",
                               options.layer_steps.size(), layout.num_layers());
        }
    }
    if (options.validator != nullptr && options.validator->rank() != transport.rank()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "validator of rank {} given to the sender of rank {}",
                           options.validator->rank(), transport.rank());
    }
    std::unique_ptr<KvCommStream> comm;
    if (!layout.is_host()) {
        PDSIM_ASSIGN_OR_RETURN(comm, KvCommStream::create("KV sender", layout, options));
    }
    auto impl = std::make_shared<Impl>(transport, plane, std::move(layout), counter,
                                       std::move(options), std::move(comm));
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
Status KvSender::abort(uint64_t id, const std::string& reason) {
    return impl_->abort(id, reason);
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
