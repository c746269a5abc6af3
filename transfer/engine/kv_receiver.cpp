#include "transfer/engine/kv_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/logging.h"
#include "common/thread_info.h"
#include "transfer/engine/control.h"
#include "transfer/engine/kv_receiver_impl.h"
#include "transfer/engine/ordering_validator.h"
#include "transfer/engine/request_table.h"
#include "transfer/engine/transfer_plan.h"

namespace pdsim::transfer {

KvReceiver::Impl::Impl(Transport& transport, DataPlaneChoice plane, KvLayout layout,
                       ReceiverOptions options, std::unique_ptr<KvCommStream> comm)
    : transport_(transport),
      data_(*plane.data),
      plane_(plane.plane),
      layout_(std::move(layout)),
      opt_(std::move(options)),
      comm_(std::move(comm)),
      pins_(transport.rank(), opt_.validator),
      table_(RequestTableNames{"receiver", transport.rank()}) {
    const Capabilities caps = data_.capabilities();
    max_msg_ = std::min(opt_.max_message_bytes, caps.max_message_bytes);
    slot_capacity_ = plane_ != DataPlane::kTwoSided
                         ? 0
                         : static_cast<uint32_t>(std::min<uint64_t>(
                               uint64_t{caps.max_tag} - kDataTagBase + 1, uint64_t{1} << 30));
}

Status KvReceiver::Impl::start() {
    if (write_mode()) {
        // One region per (layer, buffer): on a GPU each is its own allocation, which cuda_ipc
        // needs (it registers the start of an allocation).
        regions_msg_.decode_rank = transport_.rank();
        regions_msg_.num_layers = layout_.num_layers();
        regions_msg_.buffer_count = layout_.buffer_count();
        for (int l = 0; l < layout_.num_layers(); ++l) {
            for (int b = 0; b < layout_.buffer_count(); ++b) {
                const size_t bytes =
                    static_cast<size_t>(layout_.num_pages()) * layout_.page_bytes(b);
                auto region = data_.register_memory(layout_.base(l, b), bytes);
                if (!region.ok()) {
                    for (const MemoryRegion& m : regions_) {
                        data_.deregister_memory(m.id).ignore_error();
                    }
                    regions_.clear();
                    return region.status().with_context(
                        fmt::format("receiver rank {}: registering layer {} buffer {} ({} bytes) "
                                    "with data transport '{}'",
                                    transport_.rank(), l, b, bytes, data_.name()));
                }
                regions_msg_.add(region->descriptor);
                regions_.push_back(std::move(region).value());
            }
        }
        if (data_.capabilities().write_signals && opt_.arrival_slots > 0) {
            auto arrival = ArrivalWords::create(data_, layout_.device(), opt_.arrival_slots,
                                                layout_.num_layers());
            if (!arrival.ok()) {
                for (const MemoryRegion& m : regions_) {
                    data_.deregister_memory(m.id).ignore_error();
                }
                regions_.clear();
                return arrival.status().with_context(
                    fmt::format("receiver rank {}", transport_.rank()));
            }
            arrival_ = std::move(arrival).value();
            regions_msg_.arrival_slots = arrival_->slots();
            regions_msg_.arrival_descriptor = arrival_->region().descriptor;
        }
        const size_t n = encode(regions_msg_).size();
        if (n > opt_.max_control_bytes) {
            for (const MemoryRegion& m : regions_) data_.deregister_memory(m.id).ignore_error();
            regions_.clear();
            if (arrival_) arrival_->deregister();
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "receiver rank {}: the regions message of {} bytes exceeds "
                               "max_control_bytes {}",
                               transport_.rank(), n, opt_.max_control_bytes);
        }
        MutexLock lock(bootstrap_mu_);
        regions_sent_.assign(static_cast<size_t>(transport_.world_size()), 0);
    }
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

Status KvReceiver::Impl::submit(const ReceiveRequestSpec& spec) {
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
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: {} tokens", spec.request_id,
                           spec.num_tokens);
    }
    PDSIM_RETURN_IF_ERROR(layout_.check_pages(spec.dst_pages, spec.num_tokens)
                              .with_context(fmt::format("request {}", spec.request_id)));
    // Arrival words: the slot is taken before the engine lock (take() may read device memory).
    ArrivalWords::Slot arrival;
    if (arrival_) {
        StatusOr<ArrivalWords::Slot> taken = arrival_->take();
        if (!taken.ok()) {
            return taken.status().with_context(
                fmt::format("request {}: receiver rank {}", spec.request_id, transport_.rank()));
        }
        arrival = std::move(taken).value();
    }
    std::shared_ptr<RecvReq> r;
    {
        MutexLock lock(table_.mu());
        if (Status addable = table_.check_addable_locked(spec.request_id); !addable.ok()) {
            if (arrival.index >= 0) arrival_->give_back(arrival.index, std::move(arrival.base));
            return addable;
        }
        uint32_t slot = 0;
        if (plane_ != DataPlane::kTwoSided) {
            // No data tag: the write mode and the ordered plane take no slot.
        } else if (!free_slots_.empty()) {
            slot = free_slots_.back();
            free_slots_.pop_back();
        } else if (next_slot_ < slot_capacity_) {
            slot = next_slot_++;
        } else {
            if (arrival.index >= 0) arrival_->give_back(arrival.index, std::move(arrival.base));
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
        r->deadline.set(r->started + r->timeout);
        r->slot = slot;
        r->tag = write_mode() ? kControlTag
                 : ordered()  ? kOrderedDataTag  // in the Bootstrap; data is posted untagged
                              : kDataTagBase + slot;
        r->slot_settled = plane_ != DataPlane::kTwoSided;
        r->arrival_slot = arrival.index;
        r->arrival_base = std::move(arrival.base);
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
    m.arrival_slot = r->arrival_slot;
    Bytes bytes = encode(m);
    if (bytes.size() > opt_.max_control_bytes) {
        {
            // Never sent: no prefill rank attached the request, none writes into its pages.
            MutexLock lock(table_.mu());
            for (SourceState& s : r->sources) s.detached = true;
        }
        fail(r,
             fmt::format("request {}: bootstrap of {} bytes exceeds max_control_bytes {}", r->id,
                         bytes.size(), opt_.max_control_bytes),
             false);
        return {};
    }
    send_bootstrap(*r, bytes);
    return {};
}

void KvReceiver::Impl::send_bootstrap(const RecvReq& r, const Bytes& bootstrap) {
    if (!write_mode()) {
        for (int p : r.prefill_ranks) channel_->send(p, bootstrap);
        return;
    }
    // Control messages to one peer are non-overtaking, and the sends below are posted in this
    // order under bootstrap_mu_: the Regions message reaches the prefill rank before any
    // Bootstrap of this engine.
    MutexLock lock(bootstrap_mu_);
    for (int p : r.prefill_ranks) {
        uint8_t& sent = regions_sent_[static_cast<size_t>(p)];
        if (sent == 0) {
            sent = 1;
            RegionsMsg m = regions_msg_;
            m.request_id = r.id;
            channel_->send(p, encode(m));
        }
        channel_->send(p, bootstrap);
    }
}

Status KvReceiver::Impl::enqueue_arrival_wait(uint64_t id, runtime::Stream& stream,
                                              std::chrono::milliseconds timeout) const {
    std::vector<uint64_t> targets;
    int32_t slot = -1;
    {
        MutexLock lock(table_.mu());
        PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
        if (r->state != RequestState::kSuccess) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "request {}: arrival wait on a request that is {} (only a request "
                               "that succeeded has its arrival targets)",
                               id, request_state_name(r->state));
        }
        if (r->arrival_target.empty()) {
            return PDSIM_ERROR(
                StatusCode::kFailedPrecondition,
                "request {}: no arrival targets ({}): wait_done is the proof of "
                "arrival",
                id,
                !arrival_ ? fmt::format("data transport '{}', {} plane, {} slots", data_.name(),
                                        data_plane_name(plane_), opt_.arrival_slots)
                          : std::string("a prefill rank did not signal, or the "
                                        "words disagreed"));
        }
        targets = r->arrival_target;
        slot = r->arrival_slot;
    }
    KvMemoryOps* ops = comm_ ? &comm_->ops() : nullptr;
    HostKvMemoryOps host_ops;
    if (ops == nullptr) ops = &host_ops;
    for (int l = 0; l < layout_.num_layers(); ++l) {
        PDSIM_RETURN_IF_ERROR(ops->enqueue_wait_value(stream, arrival_->word(slot, l),
                                                      targets[static_cast<size_t>(l)], timeout)
                                  .with_context(fmt::format("request {} layer {}", id, l)));
    }
    return {};
}

Status KvReceiver::Impl::wait_layer(uint64_t id, int layer,
                                    std::chrono::nanoseconds timeout) const {
    MutexLock lock(table_.mu());
    PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
    if (layer < 0 || layer >= layout_.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "request {}: layer {} of {}", id, layer,
                           layout_.num_layers());
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

bool KvReceiver::Impl::layer_arrived(uint64_t id, int layer) const {
    MutexLock lock(table_.mu());
    std::shared_ptr<RecvReq> r = table_.find_locked(id);
    if (!r || layer < 0 || layer >= layout_.num_layers()) return false;
    return r->arrived[static_cast<size_t>(layer)] != 0;
}

StatusOr<RequestStatus> KvReceiver::Impl::wait_done(uint64_t id,
                                                    std::chrono::nanoseconds timeout) const {
    MutexLock lock(table_.mu());
    PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
    if (!table_.wait_terminal_locked(*r, timeout)) {
        return Table::wait_timed_out(*r, timeout, describe_awaiting_locked(*r, -1));
    }
    return status_locked(*r);
}

StatusOr<RequestStatus> KvReceiver::Impl::status(uint64_t id) const {
    MutexLock lock(table_.mu());
    PDSIM_ASSIGN_OR_RETURN(std::shared_ptr<RecvReq> r, table_.get_locked(id));
    return status_locked(*r);
}

EngineStats KvReceiver::Impl::stats() const {
    MutexLock lock(table_.mu());
    EngineStats stats = stats_;
    table_.copy_counts_locked(stats);
    return stats;
}

void KvReceiver::Impl::shutdown(ShutdownMode mode) {
    std::optional<std::vector<std::shared_ptr<RecvReq>>> active = table_.begin_shutdown();
    if (!active) return;
    const bool graceful = mode == ShutdownMode::kGraceful;
    for (auto& r : *active) {
        fail(r,
             fmt::format("request {}: decode rank {} shut down{}", r->id, transport_.rank(),
                         graceful ? "" : " abruptly"),
             graceful);
    }
    if (write_mode() && graceful) {
        // Within one peer timeout every source has quiesced or counts as dead.
        wait_settled(opt_.peer_timeout + 2 * opt_.tick);
    }
    {
        MutexLock lock(jobs_mu_);
        stopping_ = true;
        jobs_.clear();
    }
    jobs_cv_.notify_all();
    for (auto& t : workers_) {
        if (t.joinable()) t.join();
    }
    // Device layouts: scatters whose wait failed write the pages until the stream passes them;
    // their requests release the pages then (bounded: what the stream has not passed by then
    // keeps its pages pinned).
    if (comm_) comm_->drain(graceful ? opt_.peer_timeout : std::chrono::milliseconds(0));
    if (channel_) channel_->stop(graceful);
    // Graceful: writes that may still arrive (requests whose pages stay in use) now fail where
    // the transport checks registrations (local). Abrupt (a crash, or a hung process): the
    // regions stay as they are. Either way the caller closes the data transport before it frees
    // the pool (kv_receiver.h).
    if (graceful) {
        for (const MemoryRegion& m : regions_) data_.deregister_memory(m.id).ignore_error();
        regions_.clear();
        if (arrival_) arrival_->deregister();
    }
    // Receives still posted (an ordered plane's, a stopped request's) may complete later, until
    // the data transport is closed: their callbacks reach the hook no more.
    events_.close();
}

void KvReceiver::Impl::wait_settled(std::chrono::nanoseconds timeout) {
    MutexLock lock(table_.mu());
    (void)table_.wait_for_locked(timeout, [&]() PDSIM_REQUIRES(table_.mu()) {
        for (auto& [id, r] : table_.requests_locked()) {
            if (r->state == RequestState::kFailed && !r->pins_released) return false;
        }
        return true;
    });
}

void KvReceiver::Impl::on_control(int peer, std::span<const uint8_t> bytes) {
    auto type = peek_type(bytes);
    if (!type.ok()) {
        PDSIM_LOG_WARN("receiver rank {}: bad control message from rank {}: {}", transport_.rank(),
                       peer, type.status().to_string());
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
        case MsgType::kLayerWritten: {
            if (!write_mode()) break;
            auto m = decode_layer_written(bytes);
            if (m.ok()) handle_layer_written(peer, *m);
            return;
        }
        case MsgType::kCompletion:
            if (!write_mode() && !ordered()) break;
            handle_control_completion(peer, bytes);
            return;
        case MsgType::kDataPosted: {
            if (!ordered()) break;
            auto m = decode_data_posted(bytes);
            if (!m.ok()) {
                // The announced messages cannot be matched: the pair's stream is lost from here
                // (a garbled control frame; the control transport checks its frames).
                PDSIM_LOG_WARN("receiver rank {}: bad data-posted message from rank {}: {}",
                               transport_.rank(), peer, m.status().to_string());
                return;
            }
            handle_data_posted(peer, *m);
            return;
        }
        case MsgType::kQuiesced: {
            if (!write_mode()) break;
            auto m = decode_quiesced(bytes);
            if (m.ok()) handle_quiesced(peer, *m);
            return;
        }
        default:
            break;
    }
    PDSIM_LOG_WARN("receiver rank {}: unexpected {} message from rank {}", transport_.rank(),
                   msg_type_name(*type), peer);
}

void KvReceiver::Impl::on_peer_failed(int peer, const Status& st) {
    std::vector<std::pair<std::shared_ptr<RecvReq>, std::string>> to_fail;
    bool released = false;
    {
        MutexLock lock(table_.mu());
        for (auto& [id, r] : table_.requests_locked()) {
            const int src = source_index(*r, peer);
            if (src < 0) continue;
            // Write mode: a dead source writes no more (its pages may be released).
            if (write_mode()) r->sources[static_cast<size_t>(src)].dead = true;
            if (is_terminal(r->state)) {
                released |= maybe_settle_locked(*r);
                continue;
            }
            to_fail.emplace_back(
                r, fmt::format("request {}: prefill rank {} unreachable while awaiting {}: {}", id,
                               peer, describe_awaiting_locked(*r, src), st.message()));
        }
    }
    if (released) table_.notify_waiters();
    for (auto& [r, why] : to_fail) fail(r, why, true);
}

void KvReceiver::Impl::on_tick(Clock::time_point now) {
    // Device layouts: scatters whose wait failed, once the comm stream passed them.
    if (comm_) comm_->sweep();
    std::vector<std::pair<std::shared_ptr<RecvReq>, std::string>> to_fail;
    std::vector<uint8_t> interest(static_cast<size_t>(transport_.world_size()), 0);
    bool released = false;
    {
        MutexLock lock(table_.mu());
        for (auto& [id, r] : table_.requests_locked()) {
            if (write_mode() && r->state == RequestState::kFailed && !r->pins_released) {
                // A source that may still write and has been silent past the peer timeout
                // counts as dead: its writes can no longer be told apart from a crash.
                for (SourceState& s : r->sources) {
                    if (s.settled()) continue;
                    auto heard = std::max(channel_->last_heard(s.world_rank), r->started);
                    if (now - heard > opt_.peer_timeout) s.dead = true;
                }
                released |= maybe_settle_locked(*r);
            }
            if (is_terminal(r->state)) continue;
            for (int p : r->prefill_ranks) interest[static_cast<size_t>(p)] = 1;
            // The progress clock runs only while announced data is in flight (receives, scatters,
            // written layers, the completion after the last chunk header). Not started by any
            // prefill rank yet (no chunk header), or everything announced landed and the next
            // chunk is not announced yet: the request waits for the prefill instance's scheduler
            // (its queue, other requests' chunks), which is no fault; a dead or hung prefill rank
            // is the peer timeout's (below).
            if (!started_locked(*r) || r->ops_outstanding == 0) r->touch(now);
            if (Table::past_deadline(*r, now)) {
                to_fail.emplace_back(r,
                                     Table::timed_out_reason(*r, describe_awaiting_locked(*r, -1)));
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
                    if (write_mode()) r->sources[i].dead = true;
                    break;
                }
            }
        }
    }
    channel_->set_interest(std::move(interest));
    if (released) table_.notify_waiters();
    for (auto& [r, why] : to_fail) fail(r, why, true);
}

bool KvReceiver::Impl::started_locked(const RecvReq& r) {
    for (const SourceState& s : r.sources) {
        if (s.next_chunk > 0 || s.last_header || s.completed) return true;
    }
    return false;
}

void KvReceiver::Impl::on_stall(Clock::time_point now) {
    // This process did not run (stopped, starved): no request's progress clock counts the gap.
    MutexLock lock(table_.mu());
    for (auto& [id, r] : table_.requests_locked()) {
        if (!is_terminal(r->state)) r->touch(now);
    }
}

Status KvReceiver::Impl::abort(uint64_t id, const std::string& reason) {
    std::shared_ptr<RecvReq> r = table_.find(id);
    if (!r) return request_table_detail::not_known_error(id);
    fail(r, fmt::format("request {}: aborted here: {}", id, reason), true);
    return {};
}

int KvReceiver::Impl::source_index(const RecvReq& r, int world_rank) {
    for (size_t i = 0; i < r.prefill_ranks.size(); ++i) {
        if (r.prefill_ranks[i] == world_rank) return static_cast<int>(i);
    }
    return -1;
}

bool KvReceiver::Impl::source_pending(const RecvReq& /*r*/, const SourceState& s) {
    return !s.acked || (s.frag && !s.completed);
}

RequestStatus KvReceiver::Impl::status_locked(const RecvReq& r) const {
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

std::string KvReceiver::Impl::describe_awaiting_locked(const RecvReq& r, int src) const {
    if (!r.awaiting_comm.empty()) return r.awaiting_comm;
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

void KvReceiver::Impl::emit(TransferEvent::Kind kind, uint64_t req, int layer, int peer,
                            uint64_t bytes) const {
    if (!events_.has_hook()) return;
    TransferEvent e;
    e.kind = kind;
    e.request = req;
    e.layer = layer;
    e.peer = peer;
    e.bytes = bytes;
    e.time = Clock::now();
    events_.emit(e);
}

void KvReceiver::Impl::fail(const std::shared_ptr<RecvReq>& r, std::string reason,
                            bool notify_peers) {
    std::vector<RequestHandle> handles;
    {
        MutexLock lock(table_.mu());
        if (!table_.mark_failed_locked(*r, reason)) return;
        if (ordered()) {
            // Posted receives stay (each matches an announced message; withdrawing one would put
            // the pair's stream out of step); what no DataPosted announced yet is never posted,
            // nor is the completion awaited any more.
            for (SourceState& s : r->sources) {
                for (const RecvOp& op : s.unposted) {
                    --r->ops_outstanding;
                    if (op.layer >= 0) --r->layer_pending[static_cast<size_t>(op.layer)];
                }
                s.unposted.clear();
                if (s.completion_pending) {
                    s.completion_pending = false;
                    --r->ops_outstanding;
                }
            }
        } else {
            handles.swap(r->handles);
        }
        maybe_settle_locked(*r);
    }
    PDSIM_LOG_DEBUG("receiver rank {}: {}", transport_.rank(), reason);
    table_.notify_waiters();
    emit(TransferEvent::Kind::kRequestFailed, r->id, -1, -1, 0);
    if (!notify_peers) return;
    Transport* t = &data_;
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

// ---- KvReceiver ----

StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::create(Transport& transport, KvLayout layout,
                                                         ReceiverOptions options) {
    PDSIM_ASSIGN_OR_RETURN(
        DataPlaneChoice plane,
        choose_data_plane("KV receiver", transport, options.data_transport, layout));
    if (options.validator != nullptr && options.validator->rank() != transport.rank()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "validator of rank {} given to the receiver of rank {}",
                           options.validator->rank(), transport.rank());
    }
    std::unique_ptr<KvCommStream> comm;
    if (!layout.is_host()) {
        PDSIM_ASSIGN_OR_RETURN(comm, KvCommStream::create("KV receiver", layout, options));
    }
    auto impl = std::make_shared<Impl>(transport, plane, std::move(layout), std::move(options),
                                       std::move(comm));
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
Status KvReceiver::enqueue_arrival_wait(uint64_t id, runtime::Stream& stream,
                                        std::chrono::milliseconds timeout) const {
    return impl_->enqueue_arrival_wait(id, stream, timeout);
}
Status KvReceiver::release(uint64_t id) {
    return impl_->release(id);
}
Status KvReceiver::abort(uint64_t id, const std::string& reason) {
    return impl_->abort(id, reason);
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
