// KvSender's workers: the tasks of a chunk, posted layer by layer as the StepCounter says their KV
// is written, the completion message, and the send completions (kv_sender_impl.h).

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "transfer/engine/kv_sender_impl.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::transfer {

void KvSender::Impl::enqueue(std::vector<Task> tasks) {
    for (Task& t : tasks) {
        Worker& w = *workers_[static_cast<size_t>(t.dest->world_rank) % workers_.size()];
        {
            MutexLock lock(w.mu);
            w.queue.push_back(std::move(t));
        }
        w.cv.notify_one();
    }
}

int64_t KvSender::Impl::next_target(const Active& a) const {
    const int l1 = std::min(layout_.num_layers(), a.next_l0 + a.t.interval);
    return pd::StepCounter::wrap(a.t.begin_step + step_offset(l1 - 1));
}

void KvSender::Impl::worker_loop(int index) {
    Worker& w = *workers_[static_cast<size_t>(index)];
    std::deque<Active> tasks;
    while (true) {
        {
            MutexLock lock(w.mu);
            if (tasks.empty()) {
                w.cv.wait(w.mu, [&]() PDSIM_REQUIRES(w.mu) {
                    return stopping_.load() || !w.queue.empty();
                });
            }
            if (stopping_.load()) {
                if (quiesce_on_exit_.load()) {
                    // Let go of every task (none posts any more: stopping_), so that their
                    // requests can turn quiet.
                    while (!w.queue.empty()) {
                        Active a;
                        a.t = std::move(w.queue.front());
                        w.queue.pop_front();
                        tasks.push_back(std::move(a));
                    }
                } else {
                    return;
                }
            }
            while (!w.queue.empty()) {
                Active a;
                a.t = std::move(w.queue.front());
                w.queue.pop_front();
                tasks.push_back(std::move(a));
            }
        }
        if (stopping_.load()) {
            for (Active& a : tasks) finish_task(a);
            return;
        }
        bool moved = false;
        // What to block on if nothing moves (copied: the deque is compacted below).
        std::optional<std::pair<int64_t, Clock::duration>> data_wait;
        std::optional<std::pair<int64_t, Clock::duration>> aux_wait;
        std::optional<std::pair<const Active*, Clock::duration>> sums_wait;
        // Device gating: a step posted ahead (its kLayerReady pending) or a comm-stream pass
        // the completion's sums wait for.
        std::optional<std::pair<int64_t, Clock::duration>> ahead_wait;
        std::optional<std::pair<runtime::Event*, Clock::duration>> event_wait;
        int64_t best_distance = 0;
        const int64_t ready = counter_.query_ready_cache_step();
        for (Active& a : tasks) {
            // Chunk order per (request, destination): the data tag is non-overtaking.
            if (a.t.chunk_index != a.t.dest->next_chunk_to_post) continue;
            moved |= step_task(a);
            if (a.finished) continue;
            if (!a.ahead.empty() && !ahead_wait) {
                ahead_wait.emplace(a.ahead.front().target, wait_slice(a));
            }
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
            } else if (!a.t.dest->pending_sums.empty()) {
                if (!event_wait) {
                    event_wait.emplace(a.t.dest->pending_sums.front().passed.get(), wait_slice(a));
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
        } else if (data_wait && gate_ahead_) {
            // The next interval goes out once its record is enqueued (device gating).
            (void)counter_.wait_until_enqueued(data_wait->first, data_wait->second);
        } else if (data_wait) {
            counter_.wait_until_ready(data_wait->first, data_wait->second).ignore_error();
        } else if (ahead_wait) {
            counter_.wait_until_ready(ahead_wait->first, ahead_wait->second).ignore_error();
        } else if (event_wait) {
            const auto slice =
                std::chrono::duration_cast<std::chrono::milliseconds>(event_wait->second);
            event_wait->first->synchronize(std::max(slice, std::chrono::milliseconds(1)))
                .ignore_error();
        } else if (sums_wait && opt_.validator != nullptr) {
            const Active& a = *sums_wait->first;
            const Fragment& f = *a.t.dest->frag;
            opt_.validator
                ->wait_expected(a.t.req->id, layout_.num_layers() - 1, layout_.buffer_count() - 1,
                                a.t.req->num_tokens, f.head_begin, f.head_count, sums_wait->second)
                .status()
                .ignore_error();
        } else {
            MutexLock lock(w.mu);
            (void)w.cv.wait_for(w.mu, opt_.cancel_check, [&]() PDSIM_REQUIRES(w.mu) {
                return stopping_.load() || !w.queue.empty();
            });
        }
    }
}

Clock::duration KvSender::Impl::wait_slice(const Active& a) const {
    auto left =
        std::max<Clock::duration>(a.t.req->deadline.get() - Clock::now(), Clock::duration::zero());
    return std::min<Clock::duration>(left + std::chrono::milliseconds(1), opt_.cancel_check);
}

void KvSender::Impl::set_awaiting(SendReq& r, std::string what) {
    MutexLock lock(table_.mu());
    r.awaiting = std::move(what);
}

bool KvSender::Impl::step_task(Active& a) {
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
    moved |= note_ready_ahead(a, counter_.query_ready_cache_step());
    while (!a.data_done) {
        const int l0 = a.next_l0;
        const int l1 = std::min(L, l0 + a.t.interval);
        const int64_t target = next_target(a);
        const bool ready =
            pd::StepCounter::is_step_ready(counter_.query_ready_cache_step(), target);
        // Device gating: the comm stream waits for the record on the device, so the interval
        // may go out as soon as the record is enqueued -- one interval ahead per task: what a
        // transport queues behind an interval whose record has not landed (the next request's
        // ready layers, on the same peer's stream) waits for it, so looking further ahead would
        // delay them by more than one layer's compute.
        const bool may_go_ahead =
            gate_ahead_ && a.ahead.empty() && counter_.is_step_enqueued(target);
        if (!ready && !may_go_ahead) {
            if (Clock::now() >= r.deadline.get()) {
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
            set_awaiting(
                r, fmt::format("step {} (layers {}..{}) from the StepCounter", target, l0, l1 - 1));
            return moved;
        }
        // Host path: the acquire load in query_ready_cache_step() synchronizes with the
        // record's release store: every KV write enqueued before the record is visible here.
        // Device gating: the comm stream's gate orders the reads after the record instead.
        if (gate_ahead_ && !ready) a.ahead.push_back({l0, l1, target});
        if (!post_interval(a, l0, l1)) {
            finish_task(a);
            return true;
        }
        a.next_l0 = l1;
        a.data_done = l1 >= L;
        moved = true;
        // Device gating: one interval per task and pass, so the comm stream (and the transport's
        // stream) see the batch's requests layer by layer; posting a request's every enqueued
        // layer at once would queue the next request's layer 0 behind this one's last record.
        if (gate_ahead_ && !a.data_done) return true;
    }
    if (!a.t.is_last) {
        // Device gating: stay until the host has seen the steps posted ahead (their
        // kLayerReady); the late ones are given up at the deadline.
        if (!a.ahead.empty() && Clock::now() < r.deadline.get()) return moved;
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

void KvSender::Impl::start_task(Active& a) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    const int ps = layout_.page_size();
    a.started = true;
    ChunkMsg cm{r.id, a.t.chunk_index, a.t.t0, a.t.t1, a.t.is_last, a.t.t0 / ps, {}};
    cm.src_pages.assign(a.t.src_pages.begin() + a.t.t0 / ps,
                        a.t.src_pages.begin() + (a.t.t1 + ps - 1) / ps);
    channel_->send(d.world_rank, encode(cm));
    a.runs =
        make_runs(a.t.src_pages, ps, 0, d.dst_pages, d.layout.page_size, a.t.t0, a.t.t1, d.max_run);
    a.progress =
        std::make_shared<TaskProgress>(layout_.num_layers(), r.id, d.world_rank, a.t.chunk_index);
    a.progress->req = a.t.req;
    a.progress->dest = a.t.dest;
}

bool KvSender::Impl::run_device_interval(Active& a, int l0, int l1, DeviceInterval& out) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    const Fragment& f = *d.frag;
    const int B = layout_.buffer_count();
    OrderingValidator* v = opt_.validator;
    KvMemoryOps& ops = comm_->ops();
    bool gathers = false;
    for (int b = 0; b < B; ++b) {
        const auto bi = static_cast<size_t>(b);
        // As on the host: a message (two-sided) or a write of whole decode slots taking part of
        // this rank's slots goes out from a gathered copy; per-token writes read the pages.
        out.gathered[bi] = !f.src_contiguous[bi] && (!write_mode() || f.dst_contiguous[bi]);
        gathers = gathers || out.gathered[bi];
    }
    // Device gating: even with nothing to gather or hash, the sends read the pages, so they wait
    // for the gate through the comm stream's event.
    if (!gathers && v == nullptr && !gate_ahead_) return true;
    const std::string what =
        fmt::format("{}{}of layers {}..{} for decode rank {}", gathers ? "gathers " : "",
                    gathers && v != nullptr ? "and checksums "
                    : v != nullptr          ? "checksums "
                                            : "",
                    l0, l1 - 1, d.world_rank);
    set_awaiting(r, fmt::format("the {} ({})", comm_->describe(), what));
    std::shared_ptr<KvOpsMemory> sums;
    bool enqueued = false;
    // Gives up the interval: whatever was enqueued may still run, so its memory stays alive until
    // the stream has passed it. The request fails unless it already has (or the sender stops).
    auto give_up = [&](const Status& st) {
        if (enqueued) {
            comm_->retire(
                std::make_shared<
                    std::pair<std::shared_ptr<KvOpsMemory>, std::shared_ptr<KvOpsMemory>>>(
                    out.staging, sums),
                nullptr);
        }
        out.staging.reset();
        if (r.cancelled.load() || stopping_.load()) return false;
        const bool late = st.code() == StatusCode::kDeadlineExceeded;
        fail(a.t.req,
             fmt::format("request {}: {} awaiting the {} ({}): {}", r.id,
                         late ? fmt::format("timed out after {} ms", r.timeout.count())
                              : std::string("failed"),
                         comm_->describe(), what, st.message()),
             true);
        return false;
    };
    if (gate_ahead_) {
        // Everything enqueued on the comm stream from here on runs after the record of the
        // interval's last layer (an event wait: the record is enqueued; step_counter.h).
        const int64_t target = pd::StepCounter::wrap(a.t.begin_step + step_offset(l1 - 1));
        StatusOr<pd::GatePath> gated = counter_.gate(comm_->stream(), target);
        if (!gated.ok()) return give_up(gated.status());
    }
    if (gathers) {
        StatusOr<KvStagingPlan> plan = plan_gather(layout_, f, a.runs, l0, l1);
        if (!plan.ok()) return give_up(plan.status());
        std::vector<KvCopyOp> copies;
        copies.reserve(plan->ops.size());
        for (size_t i = 0; i < plan->ops.size(); ++i) {
            if (out.gathered[static_cast<size_t>(plan->messages[i].buf)]) {
                copies.push_back(plan->ops[i]);
            }
        }
        StatusOr<KvOpsMemory> staging = ops.allocate_staging(plan->staging_bytes);
        if (!staging.ok()) return give_up(staging.status());
        out.staging = std::make_shared<KvOpsMemory>(std::move(staging).value());
        if (Status st = ops.enqueue_gather(comm_->stream(), layout_, copies, out.staging->data());
            !st.ok()) {
            return give_up(st);
        }
        enqueued = true;
        out.plan = std::move(plan).value();
    }
    if (v != nullptr) {
        // What this rank reads now is what the sends carry (the transport reads the same bytes
        // later unless someone writes them meanwhile, which the after-send verification catches):
        // in stream order with the gathers.
        StatusOr<KvChecksumPlan> plan =
            plan_fragment_checksums(layout_, KvSide::kSource, f, a.runs, l0, l1);
        if (!plan.ok()) return give_up(plan.status());
        if (plan->sum_count != d.observed.size()) {
            return give_up(PDSIM_ERROR(StatusCode::kInternal,
                                       "the checksum plan has {} sums, the fragment {}",
                                       plan->sum_count, d.observed.size()));
        }
        StatusOr<KvOpsMemory> memory = ops.allocate_sums(plan->sum_count);
        if (!memory.ok()) return give_up(memory.status());
        sums = std::make_shared<KvOpsMemory>(std::move(memory).value());
        if (Status st =
                ops.enqueue_checksums(comm_->stream(), layout_, plan->ops, sums->as<uint64_t>());
            !st.ok()) {
            return give_up(st);
        }
        enqueued = true;
    }
    if (gate_ahead_) {
        // No host wait: the sends start on the device once the comm stream passed this event;
        // the sums are added before the completion (settle_pending_sums).
        std::unique_ptr<runtime::Event> event = comm_->stream().create_event();
        if (event == nullptr) {
            return give_up(
                PDSIM_ERROR(StatusCode::kUnavailable, "no event on {}", comm_->describe()));
        }
        if (Status st = comm_->stream().record(*event); !st.ok()) return give_up(st);
        out.after = std::shared_ptr<runtime::Event>(std::move(event));
        // Whatever becomes of the sends (a failed post, a failed request), the gathers and sums
        // may still run: their memory stays alive until the comm stream has passed them.
        comm_->retire(
            std::make_shared<std::pair<std::shared_ptr<KvOpsMemory>, std::shared_ptr<KvOpsMemory>>>(
                out.staging, sums),
            nullptr);
        if (sums) d.pending_sums.push_back({out.after, std::move(sums)});
        return true;
    }
    // The host path: a host wait for the gathers and sums, then the posts.
    Status waited = comm_->wait(r.deadline.get(), opt_.cancel_check,
                                [&] { return r.cancelled.load() || stopping_.load(); });
    if (!waited.ok()) return give_up(waited);
    if (sums) {
        // Sums of layers outside [l0, l1) are 0: the array accumulates over the intervals.
        const uint64_t* read = sums->as<uint64_t>();
        for (size_t i = 0; i < d.observed.size(); ++i) d.observed[i] += read[i];
    }
    return true;
}

bool KvSender::Impl::post_interval(Active& a, int l0, int l1) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    const Fragment& f = *d.frag;
    const int B = layout_.buffer_count();
    // Device layouts hash and gather on the comm stream first (run_device_interval).
    OrderingValidator* v = comm_ ? nullptr : opt_.validator;
    DeviceInterval dev;
    if (comm_) {
        // Posted ahead of its step (device gating): kLayerReady comes when the host sees it.
        const bool ahead = !a.ahead.empty() && a.ahead.back().l0 == l0;
        for (int l = l0; l < l1 && !ahead; ++l) {
            emit(TransferEvent::Kind::kLayerReady, r.id, l, d.world_rank, a.t.chunk_index, 0);
        }
        if (!run_device_interval(a, l0, l1, dev)) return false;
    }
    set_awaiting(r,
                 fmt::format("posting layers {}..{} to decode rank {}", l0, l1 - 1, d.world_rank));
    uint64_t staged = 0;
    bool ok = true;
    std::vector<OrderedSend> batch;  // ordered plane: the interval's sends, in post order
    for (int l = l0; ok && l < l1; ++l) {
        if (!comm_) {
            emit(TransferEvent::Kind::kLayerReady, r.id, l, d.world_rank, a.t.chunk_index, 0);
        }
        a.progress->pending[static_cast<size_t>(l)].store(1);  // the posting guard
        // Write mode: this (chunk, layer) owes the destination one LayerWritten (or gives up).
        if (write_mode()) d.notices_pending.fetch_add(1);
        uint64_t layer_bytes = 0;  // write mode: what this (chunk, layer) writes
        for (int b = 0; ok && b < B; ++b) {
            const auto bi = static_cast<size_t>(b);
            uint64_t* obs =
                v == nullptr
                    ? nullptr
                    : d.observed.data() + (static_cast<size_t>(l) * static_cast<size_t>(B) + bi) *
                                              static_cast<size_t>(f.head_count);
            for (size_t k = 0; k < a.runs.size(); ++k) {
                const TokenRun& run = a.runs[k];
                if (r.cancelled.load() || stopping_.load()) {
                    ok = false;
                    break;
                }
                // What this rank reads now is what the send carries (the transport reads
                // the same bytes later unless someone writes them meanwhile, which the
                // after-send verification catches).
                if (obs != nullptr) {
                    kv_checksums_add_run(layout_, l, b, run.token_begin, run.count, run.src_slot,
                                         f.src_offset[bi], f.head_count, obs);
                }
                const std::byte* gathered = dev.address(l, b, k);
                if (write_mode()) {
                    layer_bytes += message_bytes(f, b, run);
                    if (!post_run_writes(a, l, b, run, staged, gathered, dev)) ok = false;
                    continue;
                }
                const size_t bytes = message_bytes(f, b, run);
                std::shared_ptr<void> keep;
                const void* ptr;
                if (f.src_contiguous[bi]) {
                    ptr = layout_.slot_addr(l, b, run.src_slot);
                } else if (comm_) {
                    // The comm stream's gathered copy (run_device_interval).
                    ptr = gathered;
                    keep = dev.staging;
                    staged += bytes;
                } else {
                    // Copy: the decode rank holds only part of this rank's heads.
                    auto staging = std::make_shared<std::vector<std::byte>>(bytes);
                    gather_run(layout_, f, l, b, run, staging->data());
                    ptr = staging->data();
                    keep = std::move(staging);
                    staged += bytes;
                }
                if (ordered()) {
                    // Announced first, posted below (post_ordered).
                    batch.push_back({l, ptr, bytes, std::move(keep)});
                } else if (!post_data(a.t, l, ptr, bytes, std::move(keep), a.progress, dev.after)) {
                    ok = false;
                }
            }
        }
        // Write mode with arrival words: the layer's bytes added to its word, behind its writes
        // (the data transport orders the add after them). Part of the layer's operations, so
        // its LayerWritten follows the add too.
        if (ok && write_mode() && d.arrival) ok = post_arrival_signal(a, l, layer_bytes);
        if (ordered()) continue;  // the guards drop once the batch is posted
        r.touch();                // a layer posted: progress
        emit(TransferEvent::Kind::kLayerPosted, r.id, l, d.world_rank, a.t.chunk_index, 0);
        layer_op_done(a.progress, l);  // drop the guard
    }
    if (ordered()) {
        const int posted_end = ok ? l1 : l0;
        if (ok) ok = post_ordered(a, l0, l1, batch, dev.after);
        for (int l = l0; l < l1; ++l) {
            if (a.progress->pending[static_cast<size_t>(l)].load() == 0) continue;  // never guarded
            if (l < posted_end) {
                emit(TransferEvent::Kind::kLayerPosted, r.id, l, d.world_rank, a.t.chunk_index, 0);
            }
            layer_op_done(a.progress, l);  // drop the guard
        }
    }
    if (staged > 0) {
        MutexLock lock(table_.mu());
        stats_.staged_bytes += staged;
    }
    return ok;
}

bool KvSender::Impl::post_ordered(Active& a, int l0, int l1, std::vector<OrderedSend>& sends,
                                  const std::shared_ptr<runtime::Event>& after) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    OrderedPeer& peer = *ordered_peers_[static_cast<size_t>(d.world_rank)];
    MutexLock lock(peer.mu);
    if (!peer.broken.empty()) {
        fail(a.t.req,
             fmt::format("request {}: the ordered data stream to decode rank {} is out of step "
                         "({}); layers {}..{} cannot be sent",
                         r.id, d.world_rank, peer.broken, l0, l1 - 1),
             true);
        return false;
    }
    // Nothing announced for a request that failed: its decode rank need not match anything more.
    // (It may fail from here on: what is announced is posted all the same.)
    if (r.cancelled.load() || stopping_.load()) return false;
    DataPostedMsg m;
    m.request_id = r.id;
    m.src_tp_rank = layout_.summary().tp_rank;
    m.chunk_index = a.t.chunk_index;
    m.layer_begin = l0;
    m.layer_end = l1;
    m.sizes.reserve(sends.size());
    for (const OrderedSend& s : sends) m.sizes.push_back(s.bytes);
    channel_->send(d.world_rank, encode(m));
    bool ok = true;
    for (OrderedSend& s : sends) {
        std::shared_ptr<void> keep = std::move(s.keep);
        if (after) {
            keep =
                std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<runtime::Event>>>(
                    keep, after);
        }
        Status post_error;
        const bool posted = post_op(
            a.t, s.layer, OpKind::kSend, std::move(keep), a.progress,
            [&]() -> StatusOr<RequestHandle> {
                StatusOr<RequestHandle> h =
                    after ? data_.post_send_after(*after, d.world_rank, d.tag, s.ptr, s.bytes)
                          : data_.post_send(d.world_rank, d.tag, s.ptr, s.bytes);
                if (!h.ok()) post_error = h.status();
                return h;
            },
            /*announced=*/true);
        if (!posted && !post_error.ok() && peer.broken.empty()) {
            // The decode rank posts a receive for this message that no send of ours will match:
            // every later message to it would land in the wrong receive. (A transport refuses a
            // post when it is closed or the peer is gone, in practice.)
            peer.broken = fmt::format("posting a message of request {} layer {} failed: {}", r.id,
                                      s.layer, post_error.message());
            PDSIM_LOG_WARN(
                "sender rank {}: the ordered data stream to decode rank {} is out of "
                "step: {}",
                transport_.rank(), d.world_rank, peer.broken);
        }
        ok = ok && posted;
    }
    return ok;
}

bool KvSender::Impl::post_run_writes(Active& a, int l, int b, const TokenRun& run, uint64_t& staged,
                                     const std::byte* gathered, const DeviceInterval& dev) {
    const DestState& d = *a.t.dest;
    const Fragment& f = *d.frag;
    const auto bi = static_cast<size_t>(b);
    const size_t dst_token_bytes = static_cast<size_t>(d.layout.token_bytes(b));
    if (f.dst_contiguous[bi]) {
        // Whole decode token slots: the run is one contiguous range there, one write.
        const size_t bytes = message_bytes(f, b, run);
        std::shared_ptr<void> keep;
        const void* ptr;
        if (f.src_contiguous[bi]) {
            ptr = layout_.slot_addr(l, b, run.src_slot);
        } else if (comm_) {
            // The comm stream's gathered copy (run_device_interval).
            ptr = gathered;
            keep = dev.staging;
            staged += bytes;
        } else {
            // Copy: the decode rank holds only part of this rank's heads (host gather).
            auto staging = std::make_shared<std::vector<std::byte>>(bytes);
            gather_run(layout_, f, l, b, run, staging->data());
            ptr = staging->data();
            keep = std::move(staging);
            staged += bytes;
        }
        return post_write(a.t, l, b, static_cast<size_t>(run.dst_slot) * dst_token_bytes, ptr,
                          bytes, std::move(keep), a.progress, dev.after);
    }
    // The decode slot holds more heads than this fragment: one write per token, from the page
    // bytes straight to its place in the slot (correct, but many small writes; a device-side
    // packing kernel would make it one).
    const size_t bytes = f.bytes[bi];
    for (int64_t i = 0; i < run.count; ++i) {
        const std::byte* src = layout_.slot_addr(l, b, run.src_slot + i) + f.src_offset[bi];
        const size_t offset =
            static_cast<size_t>(run.dst_slot + i) * dst_token_bytes + f.dst_offset[bi];
        if (!post_write(a.t, l, b, offset, src, bytes, nullptr, a.progress, dev.after)) {
            return false;
        }
    }
    return true;
}

bool KvSender::Impl::note_ready_ahead(Active& a, int64_t ready) {
    bool any = false;
    while (!a.ahead.empty() && pd::StepCounter::is_step_ready(ready, a.ahead.front().target)) {
        const Active::Ahead& x = a.ahead.front();
        for (int l = x.l0; l < x.l1; ++l) {
            emit(TransferEvent::Kind::kLayerReady, a.t.req->id, l, a.t.dest->world_rank,
                 a.t.chunk_index, 0);
        }
        a.ahead.pop_front();
        any = true;
    }
    return any;
}

KvSender::Impl::Progress KvSender::Impl::settle_pending_sums(Active& a, bool late) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    while (!d.pending_sums.empty()) {
        const DestState::PendingSums& p = d.pending_sums.front();
        if (!p.passed->query()) {
            Status st = comm_->stream().error();
            if (st.ok() && !late) {
                set_awaiting(r, fmt::format("the {} (read checksums of layers posted ahead of "
                                            "their records, for decode rank {})",
                                            comm_->describe(), d.world_rank));
                return Progress::kWaiting;
            }
            // The work may still run: run_device_interval retired its memory, kept until the
            // stream has passed it.
            d.pending_sums.clear();
            fail(a.t.req,
                 fmt::format("request {}: {} awaiting the {} (read checksums for decode rank "
                             "{}){}",
                             r.id,
                             st.ok() ? fmt::format("timed out after {} ms", r.timeout.count())
                                     : std::string("failed"),
                             comm_->describe(), d.world_rank,
                             st.ok() ? std::string() : ": " + st.message()),
                 true);
            return Progress::kFailed;
        }
        const uint64_t* read = p.sums->as<uint64_t>();
        for (size_t i = 0; i < d.observed.size(); ++i) d.observed[i] += read[i];
        d.pending_sums.erase(d.pending_sums.begin());
    }
    return Progress::kDone;
}

void KvSender::Impl::finish_task(Active& a) {
    if (a.finished) return;
    if (!a.ahead.empty()) note_ready_ahead(a, counter_.query_ready_cache_step());
    a.finished = true;
    a.t.dest->next_chunk_to_post = a.t.chunk_index + 1;
    SendReq& r = *a.t.req;
    bool finish;
    bool quiet;
    {
        MutexLock lock(table_.mu());
        --r.tasks_outstanding;
        if (r.tasks_outstanding == 0) r.awaiting.clear();
        finish = maybe_finish_locked(r);
        quiet = maybe_release_pins_locked(r);
    }
    if (finish) post_finalize(r.id);
    if (quiet) post_quiesced(a.t.req);
}

KvSender::Impl::Progress KvSender::Impl::try_completion(Active& a) {
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    const Fragment& f = *d.frag;
    const int L = layout_.num_layers();
    const int B = layout_.buffer_count();
    const bool late = Clock::now() >= r.deadline.get();
    if (a.t.first_token_src != nullptr && !a.has_first_token) {
        const int64_t target = pd::StepCounter::wrap(a.t.first_token_aux_step);
        if (!pd::StepCounter::is_step_ready(counter_.query_ready_aux_step(), target)) {
            if (late) {
                fail(a.t.req,
                     fmt::format("request {}: timed out after {} ms awaiting the first token "
                                 "(aux step {}, last ready {})",
                                 r.id, r.timeout.count(), target, counter_.query_ready_aux_step()),
                     true);
                return Progress::kFailed;
            }
            set_awaiting(r, fmt::format("the first token (aux step {})", target));
            return Progress::kWaiting;
        }
        // The aux record published (release) after the stream wrote the token; the acquire
        // load above makes that write visible.
        const int32_t token = *a.t.first_token_src;
        if (token < 0) {
            // The step is ready but the token was never written: on a CUDA stream the record is
            // a kernel and still runs after a failed host task skipped the token's copy. Sending
            // it would make the decode rank embed an invalid token.
            fail(a.t.req,
                 fmt::format("request {}: the first token is {} once aux step {} is ready: the "
                             "compute stream's task that writes it did not run (a failed "
                             "stream?)",
                             r.id, token, target),
                 true);
            return Progress::kFailed;
        }
        a.has_first_token = true;
        a.first_token = token;
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
    if (const Progress settled = settle_pending_sums(a, late); settled != Progress::kDone) {
        return settled;
    }
    if (const Progress sums = add_checksums(a, late, m); sums != Progress::kDone) return sums;
    if (write_mode()) {
        // On the control tag, after every LayerWritten of the request to this destination:
        // armed here, sent by whoever sends the last of them (notice_done).
        {
            MutexLock lock(table_.mu());
            if (is_terminal(r.state)) return Progress::kFailed;
            ++r.ops_outstanding;  // until it is sent (or given up)
        }
        d.completion = std::make_shared<Bytes>(encode(m));
        notice_done(a.t.req, a.t.dest);  // drops the arming guard
        return Progress::kDone;
    }
    if (ordered()) {
        // On the control tag, after every DataPosted of the request to this destination (this
        // worker sent them all, in order): the decode rank has posted every receive by then.
        {
            MutexLock lock(table_.mu());
            if (is_terminal(r.state)) return Progress::kFailed;
        }
        channel_->send(d.world_rank, encode(m));
        return Progress::kDone;
    }
    auto buf = std::make_shared<Bytes>(encode(m));
    const void* ptr = buf->data();
    const size_t n = buf->size();
    return post_data(a.t, -1, ptr, n, std::move(buf), nullptr) ? Progress::kDone
                                                               : Progress::kFailed;
}

KvSender::Impl::Progress KvSender::Impl::add_checksums(Active& a, bool late, CompletionMsg& m) {
    OrderingValidator* v = opt_.validator;
    if (v == nullptr) return Progress::kDone;
    SendReq& r = *a.t.req;
    DestState& d = *a.t.dest;
    const Fragment& f = *d.frag;
    const int L = layout_.num_layers();
    const int B = layout_.buffer_count();
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
    return Progress::kDone;
}

bool KvSender::Impl::post_data(const Task& t, int layer, const void* ptr, size_t bytes,
                               std::shared_ptr<void> keep,
                               const std::shared_ptr<TaskProgress>& progress,
                               const std::shared_ptr<runtime::Event>& after) {
    const int peer = t.dest->world_rank;
    const Tag tag = t.dest->tag;
    if (after)
        keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<runtime::Event>>>(
            keep, after);
    return post_op(t, layer, OpKind::kSend, std::move(keep), progress, [&] {
        return after ? data_.post_send_after(*after, peer, tag, ptr, bytes)
                     : data_.post_send(peer, tag, ptr, bytes);
    });
}

bool KvSender::Impl::post_write(const Task& t, int layer, int buf, size_t offset, const void* ptr,
                                size_t bytes, std::shared_ptr<void> keep,
                                const std::shared_ptr<TaskProgress>& progress,
                                const std::shared_ptr<runtime::Event>& after) {
    const RemoteRegion& region =
        t.dest->regions[static_cast<size_t>(layer) * static_cast<size_t>(layout_.buffer_count()) +
                        static_cast<size_t>(buf)];
    if (after)
        keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<runtime::Event>>>(
            keep, after);
    return post_op(t, layer, OpKind::kWrite, std::move(keep), progress, [&] {
        return after ? data_.post_write_after(*after, region, offset, ptr, bytes)
                     : data_.post_write(region, offset, ptr, bytes);
    });
}

bool KvSender::Impl::post_arrival_signal(Active& a, int layer, uint64_t bytes) {
    const DestState& d = *a.t.dest;
    const size_t offset =
        (static_cast<size_t>(d.arrival_slot) * static_cast<size_t>(layout_.num_layers()) +
         static_cast<size_t>(layer)) *
        sizeof(uint64_t);
    const RemoteRegion& region = *d.arrival;
    return post_op(a.t, layer, OpKind::kSignal, nullptr, a.progress,
                   [&] { return data_.post_signal(region, offset, bytes); });
}

bool KvSender::Impl::post_op(const Task& t, int layer, OpKind kind, std::shared_ptr<void> keep,
                             const std::shared_ptr<TaskProgress>& progress,
                             const std::function<StatusOr<RequestHandle>()>& post, bool announced) {
    SendReq& r = *t.req;
    const int peer = t.dest->world_rank;
    {
        MutexLock lock(table_.mu());
        if (is_terminal(r.state) && !announced) return false;
        ++r.ops_outstanding;
    }
    if (layer >= 0) progress->pending[static_cast<size_t>(layer)].fetch_add(1);
    auto h = post();
    if (!h.ok()) {
        on_op_done(t.req, progress, layer, peer, kind, h.status(), 0);
        return false;
    }
    bool cancel_now = false;
    {
        MutexLock lock(table_.mu());
        if (is_terminal(r.state) && !announced) {
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
    if (cancel_now) data_.cancel(*h).ignore_error();
    std::weak_ptr<Impl> weak = weak_from_this();
    h->on_complete(
        [weak, req = t.req, progress, layer, peer, kind, keep](const Status& st, size_t n) {
            if (auto self = weak.lock()) self->on_op_done(req, progress, layer, peer, kind, st, n);
        });
    return true;
}

void KvSender::Impl::on_op_done(const std::shared_ptr<SendReq>& r,
                                const std::shared_ptr<TaskProgress>& p, int layer, int peer,
                                OpKind kind, const Status& st, size_t n) {
    std::string why;
    {
        MutexLock lock(table_.mu());
        --r->ops_outstanding;
        if (st.ok()) {
            if (layer >= 0 && kind != OpKind::kSignal) {  // a signal carries no KV bytes
                r->bytes += n;
                stats_.bytes += n;
                ++stats_.messages;
            }
        } else if (!is_terminal(r->state)) {
            why = fmt::format(
                "request {}: {} of {} to decode rank {} failed: {}", r->id, op_kind_name(kind),
                layer >= 0 ? fmt::format("layer {}", layer) : std::string("the completion message"),
                peer, st.message());
        }
    }
    if (layer >= 0) {
        if (st.ok()) {
            if (kind != OpKind::kSignal) {
                p->bytes[static_cast<size_t>(layer)].fetch_add(n);
                p->ops[static_cast<size_t>(layer)].fetch_add(1);
            }
        } else {
            p->failed.store(true);
        }
        layer_op_done(p, layer);
    }
    // fail() posts the cancellation to the control thread, so it is safe from a callback.
    if (!why.empty()) fail(r, why, true);
    bool finish;
    bool quiet;
    {
        MutexLock lock(table_.mu());
        finish = maybe_finish_locked(*r);
        quiet = maybe_release_pins_locked(*r);
    }
    if (finish) post_finalize(r->id);
    if (quiet) post_quiesced(r);
}

void KvSender::Impl::layer_op_done(const std::shared_ptr<TaskProgress>& p, int layer) {
    if (p->pending[static_cast<size_t>(layer)].fetch_sub(1) != 1) return;
    {
        MutexLock lock(table_.mu());
        ++stats_.layers;
        if (std::shared_ptr<SendReq> r = table_.find_locked(p->request)) r->touch();  // progress
    }
    const uint64_t bytes = p->bytes[static_cast<size_t>(layer)].load();
    if (write_mode()) {
        // Every write of this (chunk, layer) completed: the bytes are visible at the decode
        // rank. Tell it -- unless a write failed or the request failed (then it learns that).
        if (!p->failed.load() && !p->req->cancelled.load()) {
            LayerWrittenMsg m;
            m.request_id = p->request;
            m.src_tp_rank = layout_.summary().tp_rank;
            m.chunk_index = p->chunk;
            m.layer = layer;
            m.writes = p->ops[static_cast<size_t>(layer)].load();
            m.bytes = bytes;
            channel_->send(p->peer, encode(m));
        }
    }
    emit(TransferEvent::Kind::kLayerSent, p->request, layer, p->peer, p->chunk, bytes);
    if (write_mode()) notice_done(p->req, p->dest);
}

void KvSender::Impl::notice_done(const std::shared_ptr<SendReq>& r,
                                 const std::shared_ptr<DestState>& d) {
    if (d->notices_pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    // Every LayerWritten of the request to this destination went out (or was given up) and the
    // completion is armed: it follows them on the control tag.
    bool send;
    {
        MutexLock lock(table_.mu());
        send = !is_terminal(r->state);
    }
    if (send) channel_->send(d->world_rank, *d->completion);
    bool finish;
    bool quiet;
    {
        MutexLock lock(table_.mu());
        --r->ops_outstanding;
        finish = maybe_finish_locked(*r);
        quiet = maybe_release_pins_locked(*r);
    }
    if (finish) post_finalize(r->id);
    if (quiet) post_quiesced(r);
}

}  // namespace pdsim::transfer
