// One forward on a testbed rank (Server::execute) and the engine's request states
// (Server::poll_engine); see server_internal.h for how the server is split.
#include <fmt/format.h>

#include <cmath>

#include "backends/attention/attention_backend.h"
#include "common/logging.h"
#include "common/thread_info.h"
#include "sim/testbed/kv_digest.h"
#include "sim/testbed/rank_builder.h"
#include "sim/testbed/server_internal.h"
#include "sim/testbed/window.h"

namespace pdsim::testbed::detail {

using std::chrono::milliseconds;

// The batch a forward slice describes, in the calibrated model's features (sim/cost/calibrated.h),
// so that `pdsim calibrate --from-timeline` can fit the testbed's own forwards; tp_rank tells a
// TP follower's copy of the forward from its leader's.
json Server::forward_args(const Plan& plan) const {
    json a = {{"instance", ctx_.info.instance},
              {"tp", ctx_.info.tp_size},
              {"tp_rank", ctx_.info.tp_rank},
              {"threads", ctx_.threads},
              {"device", ctx_.gpu != nullptr ? "gpu" : "cpu"}};
    if (attn::is_decode(plan.mode)) {
        int64_t kv = 0;
        for (const auto& e : plan.entries) kv += e.t1;
        a["batch"] = plan.entries.size();
        a["kv_tokens"] = kv;
        return a;
    }
    int64_t tokens = 0;
    double pairs = 0;
    json items = json::array();
    for (const auto& e : plan.entries) {
        const int64_t n = e.t1 - e.t0;
        tokens += n;
        const double nd = static_cast<double>(n);
        pairs += nd * (static_cast<double>(e.t0) + (nd + 1) / 2);
        items.push_back({n, e.t0});
    }
    a["num_requests"] = plan.entries.size();
    a["new_tokens"] = tokens;
    a["attn_pairs"] = pairs;
    a["items"] = std::move(items);  // [new, cached] per request
    return a;
}

// One forward of `plan` on this rank; `next` receives the sampled token of each entry.
Status Server::execute(const Plan& plan, std::vector<int32_t>* next) {
    std::vector<ForwardEntry> entries;
    entries.reserve(plan.entries.size());
    for (const auto& e : plan.entries) {
        entries.push_back({e.id, e.t0, e.t1, e.tokens, e.pages, e.state_slot, e.last, e.input_len,
                           e.window_ring});
    }
    auto segs = std::make_shared<Segments>();
    StatusOr<model::StepBatch> built =
        build_step_batch(plan.mode, entries, o_.page_size, segs.get(), cfg_.model.sliding_window);
    if (!built.ok()) {
        mark_broken(built.status());
        return built.status();
    }
    model::StepBatch& b = *built;
    const auto off = static_cast<int64_t>(b.out_cache_loc.size());
    const bool prefill = role_ == Role::kPrefill && !attn::is_decode(plan.mode);
    backend_->set_segments(prefill ? segs : nullptr);

    bool any_last = false;
    for (const auto& e : plan.entries) any_last |= e.last;
    PrefillSteps steps;
    if (prefill) steps = begin_prefill_forward(plan, any_last);
    const std::string label = attn::is_decode(plan.mode)
                                  ? fmt::format("decode bs={}", plan.entries.size())
                                  : fmt::format("extend bs={} T={}", plan.entries.size(), off);
    if (ctx_.cpu_model != nullptr) {
        // The CPU model's layer hook names its slices with the label of the forward it runs.
        PDSIM_RETURN_IF_ERROR(stream_->enqueue([this, label] {
            hook_label_ = label;
            return Status();
        }));
    }
    auto out = std::make_shared<std::vector<int32_t>>(plan.entries.size(), -1);
    const ThreadUsage usage_start = this_thread_usage();
    const double t_start = now_us();
    Status st = ctx_.model->forward(b, *backend_, *pool_, out->data());
    if (st.ok() && prefill && any_last) st = publish_first_tokens(plan, out);
    if (st.ok() && prefill && o_.layerwise) submit_chunks(plan, steps, false);
    // Always synchronize, also after a forward that failed part-way: what it enqueued writes
    // `out`, and a sticky stream error (a CUDA fault, non-finite logits) surfaces here.
    const Status synced = stream_->synchronize(timeout_ + milliseconds(5000));
    if (st.ok()) st = synced;
    const double t_done = now_us();
    if (synced.code() == StatusCode::kDeadlineExceeded) {
        abandoned_outputs_.push_back(out);  // the stream may still write it
    }
    ++forwards_;
    ctx_.note_progress();
    forward_tokens_ += off;
    compute_us_ += t_done - t_start;
    json args = forward_args(plan);
    if (ctx_.gpu == nullptr) {
        // The rank's thread ran the forward (--stream-sync caller) or slept through it (worker):
        // its CPU time and preemptions tell the forward's own time from its wait for the core.
        const ThreadUsage usage_done = this_thread_usage();
        args["thread_cpu_us"] = std::round(usage_done.cpu_us - usage_start.cpu_us);
        args["preemptions"] = usage_done.preemptions - usage_start.preemptions;
    }
    timeline_.slice(kTidSched, label, "forward", t_start, t_done - t_start, std::move(args));
    if (!st.ok()) {
        mark_broken(st);
        return st;
    }
    if (ctx_.gpu != nullptr) add_gpu_compute_slices(label, t_done);
    if (prefill) PDSIM_RETURN_IF_ERROR(finish_prefill_forward(plan, steps, t_done));
    if (prefill && digest_kv_layout_) {
        // The KV (and states) the decode side must end up with: final once the last chunk ran.
        for (const auto& e : plan.entries) {
            if (!e.last) continue;
            kv_digests_[e.id] = digest_of(e.pages, e.window_ring, e.t1, e.state_slot);
        }
    }
    *next = *out;
    return {};
}

// The compute track of a GPU rank: the forward's device events (one slice per layer of an eager
// forward, one for a graph replay), placed so that the forward ends at t_done_us, the host time
// its synchronize returned (late by that poll's interval and the token copy: microseconds).
void Server::add_gpu_compute_slices(const std::string& label, double t_done_us) {
    StatusOr<GpuForwardTiming> timing = ctx_.gpu->last_forward_timing();
    if (!timing.ok()) {
        if (!timing_warned_) {
            PDSIM_LOG_WARN("rank {}: no compute slices: forward timing: {}", ctx_.rank,
                           timing.status().to_string());
        }
        timing_warned_ = true;
        return;
    }
    const double t0 = t_done_us - 1e3 * timing->total_ms;
    if (timing->graph) {
        ++graph_forwards_;
        timeline_.slice(kTidCompute,
                        fmt::format("{} (graph bucket {})", label, ctx_.gpu->last_forward_bucket()),
                        "compute", t0, 1e3 * timing->total_ms);
        return;
    }
    for (size_t l = 0; l < timing->layer_begin_ms.size(); ++l) {
        const double b = 1e3 * timing->layer_begin_ms[l];
        const double e = 1e3 * timing->layer_end_ms[l];
        timeline_.slice(kTidCompute, fmt::format("L{} {}", l, label), "compute", t0 + b, e - b);
    }
}

// Before a prefill forward: new requests join the sender (each gets a first-token slot), and the
// StepCounter advances by the forward's layers (and one aux step when a last chunk is in it).
PrefillSteps Server::begin_prefill_forward(const Plan& plan, bool any_last) {
    for (const auto& e : plan.entries) {
        if (!e.first) continue;
        Status st = sender_->add_request({e.id, e.input_len, timeout_});
        if (!st.ok() && st.code() != StatusCode::kAlreadyExists) {
            PDSIM_LOG_WARN("rank {}: add_request {}: {}", ctx_.rank, e.id, st.to_string());
        }
        for (GroupEngine* g : groups()) {
            // The window's tokens (window.h), or the states' one "token", its slot; both sent
            // with the request's last chunk.
            const int64_t tokens =
                g == &window_ ? e.input_len - window_start(e.input_len, cfg_.model.sliding_window,
                                                           o_.page_size)
                              : 1;
            st = g->sender->add_request({e.id, tokens, timeout_});
            if (!st.ok() && st.code() != StatusCode::kAlreadyExists) {
                PDSIM_LOG_WARN("rank {}: add_request {} ({}): {}", ctx_.rank, e.id, g->what,
                               st.to_string());
            }
        }
        engine_active_.insert(e.id);
        first_slots_[e.id] = std::make_unique<int32_t>(-1);
    }
    PrefillSteps steps;
    steps.ready_before = counter_->query_ready_cache_step();
    steps.aux_begin = counter_->current_aux_step();
    steps.begin = counter_->advance_step(num_layers_, any_last ? 1 : 0);
    return steps;
}

// The first sampled tokens travel with the last chunks: copy them (on the stream, after the
// forward) where the sender reads them, then publish the aux step.
Status Server::publish_first_tokens(const Plan& plan,
                                    const std::shared_ptr<std::vector<int32_t>>& sampled) {
    std::vector<std::pair<size_t, int32_t*>> dst;
    for (size_t i = 0; i < plan.entries.size(); ++i) {
        if (plan.entries[i].last) dst.emplace_back(i, first_slots_[plan.entries[i].id].get());
    }
    PDSIM_RETURN_IF_ERROR(stream_->enqueue([sampled, dst] {
        for (auto& [i, p] : dst) *p = (*sampled)[i];
        return Status();
    }));
    return counter_->record_aux();
}

// Hands every chunk of a prefill forward to the sender. `known_first`: the forward has completed,
// so a last chunk carries its first token by value; else the sender reads it from the slot once
// the aux step is published.
void Server::submit_chunks(const Plan& plan, const PrefillSteps& steps, bool known_first) {
    for (const PlanEntry& e : plan.entries) {
        transfer::SendChunk c;
        c.request_id = e.id;
        c.src_pages = e.pages;
        c.token_begin = e.t0;
        c.token_end = e.t1;
        c.begin_step = steps.begin;
        c.is_last = e.last;
        if (e.last) {
            if (known_first) {
                c.first_token = *first_slots_[e.id];
            } else {
                c.first_token_src = first_slots_[e.id].get();
                c.first_token_aux_step = steps.aux_begin;
            }
        }
        for (GroupEngine* g : groups()) {
            if (!e.last) break;
            // Its layers are final once the last chunk ran: one chunk of the window's tokens (or
            // of the state slot), its layers ready at their records in this forward.
            transfer::SendChunk gc = c;
            gc.token_begin = 0;
            if (g == &window_) {
                gc.src_pages = window_pages(e.window_ring, e.input_len);
                gc.token_end = e.input_len -
                               window_start(e.input_len, cfg_.model.sliding_window, o_.page_size);
            } else {
                gc.src_pages = {e.state_slot};
                gc.token_end = 1;
            }
            std::vector<int32_t> sent_pages = gc.src_pages;
            Status gs = g->sender->submit_chunk(std::move(gc));
            if (!gs.ok()) {
                PDSIM_LOG_WARN("rank {}: submit_chunk {} ({}): {}", ctx_.rank, e.id, g->what,
                               gs.to_string());
            }
            if (g == &window_ && o_.fault == Fault::kWindowFreeInFlight) {
                // The planted bug: the window frees its pages as soon as they are handed over,
                // while their transfer is in flight (PagePins refuses it and records a violation;
                // a free that went through is recorded here).
                Status fs = g->sender->pins().free_pages(window_pool_->allocator(), sent_pages);
                if (fs.ok()) {
                    transfer::Violation v;
                    v.request = e.id;
                    v.rank = ctx_.rank;
                    v.what = "the window freed pages whose transfer had not completed";
                    window_validator_->add_violation(v);
                }
            }
        }
        Status cs = sender_->submit_chunk(std::move(c));
        if (!cs.ok())
            PDSIM_LOG_WARN("rank {}: submit_chunk {}: {}", ctx_.rank, e.id, cs.to_string());
    }
}

// After a prefill forward completed: the StepCounter must have published one step per layer (a
// violation breaks the instance), chunks go to the sender now unless layerwise, and the last
// chunks' prefill end times are kept.
Status Server::finish_prefill_forward(const Plan& plan, const PrefillSteps& steps, double t_done) {
    const int64_t ready_after = counter_->query_ready_cache_step();
    const int64_t delta = pd::StepCounter::wrap(ready_after - steps.ready_before);
    if (delta != num_layers_) {
        transfer::Violation v;
        v.request = plan.entries.front().id;
        v.rank = ctx_.rank;
        v.what = fmt::format("extend forward at step {} ({} layers) published {} StepCounter steps",
                             steps.begin, num_layers_, delta);
        validator_->add_violation(v);
        ++record_violations_;
        mark_broken(
            Status(StatusCode::kDataLoss, "StepCounter out of step with the KV writes: " + v.what));
    }
    if (!o_.layerwise) submit_chunks(plan, steps, true);
    for (const auto& e : plan.entries) {
        if (e.last) prefill_end_[e.id] = t_done;
    }
    if (delta != num_layers_) return Status(StatusCode::kDataLoss, broken_reason_);
    return {};
}

// The request's KV digest on this rank (kv_digest.h): the full layers' prompt, the sliding
// layers' sent window, the recurrent states.
uint64_t Server::digest_of(const std::vector<int32_t>& pages, std::span<const int32_t> window_ring,
                           int64_t input_len, int32_t state_slot) const {
    uint64_t sum =
        request_kv_digest(*digest_kv_layout_, pages, input_len,
                          digest_state_layout_ ? &*digest_state_layout_ : nullptr, state_slot);
    if (digest_window_layout_) {
        const int64_t first = window_start(input_len, cfg_.model.sliding_window, o_.page_size);
        sum += request_kv_digest(*digest_window_layout_, window_pages(window_ring, input_len),
                                 input_len - first, nullptr, 0);
    }
    return sum;
}

// Terminal engine states of this rank's active requests (id, ok, error, first token, bytes);
// each leaves engine_active_ once reported.
void Server::poll_engine(std::vector<EngineOutcomeFields>* out) {
    for (auto it = engine_active_.begin(); it != engine_active_.end();) {
        StatusOr<transfer::RequestStatus> s = engine_status(*it);
        if (!s.ok()) {
            out->push_back({.id = *it, .ok = false, .error = s.status().message()});
            it = engine_active_.erase(it);
            continue;
        }
        if (!transfer::is_terminal(s->state)) {
            ++it;
            continue;
        }
        const bool ok = s->state == transfer::RequestState::kSuccess;
        if (ok && receiver_ && !sender_) order_behind_arrival(*it);
        uint64_t digest = 0;
        if (auto d = kv_digests_.find(*it); d != kv_digests_.end()) {
            digest = d->second;
            kv_digests_.erase(d);
        }
        if (auto ri = receive_info_.find(*it); ri != receive_info_.end()) {
            // Decode side: everything landed and no decode forward has run on it yet.
            if (ok && digest_kv_layout_) {
                digest = digest_of(ri->second.pages, ri->second.window_ring, ri->second.input_len,
                                   ri->second.state_slot);
            }
            receive_info_.erase(ri);
        }
        out->push_back({.id = *it,
                        .ok = ok,
                        .error = s->reason,
                        .first_token = s->has_first_token ? s->first_token : -1,
                        .bytes = s->bytes,
                        .kv_digest = digest});
        it = engine_active_.erase(it);
    }
}

void Server::order_behind_arrival(uint64_t id) {
    std::vector<transfer::KvReceiver*> receivers = {receiver_.get()};
    for (GroupEngine* g : groups()) {
        if (g->receiver) receivers.push_back(g->receiver.get());
    }
    bool ordered = false;
    for (transfer::KvReceiver* r : receivers) {
        const Status st = r->enqueue_arrival_wait(id, *stream_, timeout_);
        if (st.ok()) {
            ordered = true;
        } else if (st.code() != StatusCode::kFailedPrecondition && !arrival_wait_warned_) {
            // No targets (kFailedPrecondition) is the normal case of planes without words.
            arrival_wait_warned_ = true;
            PDSIM_LOG_WARN(
                "rank {}: the compute stream cannot wait on arrival words ({}); "
                "wait_done's host-side proof stands alone",
                ctx_.rank, st.to_string());
        }
    }
    if (ordered) ++arrival_waits_;
}

}  // namespace pdsim::testbed::detail
