// The instance leader of a testbed rank: submissions, admission, extend/decode scheduling, the
// engine's outcomes, the reports to the router, and the leader loop (see server.h for the rules,
// server_internal.h for how the server is split).
#include <fmt/format.h>

#include <algorithm>

#include "common/logging.h"
#include "sim/testbed/prompt.h"
#include "sim/testbed/server_internal.h"

namespace pdsim::testbed::detail {

using std::chrono::microseconds;

Status Server::on_submit(const SubmitMsg& msg) {
    Req r;
    r.id = msg.id;
    r.in = msg.input_len;
    r.out = msg.output_len;
    r.hash = msg.hash;
    r.p_inst = msg.prefill_instance;
    r.d_inst = msg.decode_instance;
    auto [it, inserted] = reqs_.emplace(r.id, std::move(r));
    Req& q = it->second;
    if (!inserted) return PDSIM_ERROR(StatusCode::kInternal, "request {} submitted twice", q.id);
    if (broken_) return fail_request(q, broken_reason_);
    if (role_ != Role::kDecode)
        q.prompt = make_prompt(static_cast<int64_t>(q.id), q.in, q.hash, cfg_.model.vocab, o_.seed);
    admit_q_.push_back(q.id);
    return {};
}

// The router gave up on a request: it is dropped (no report) and its pages freed.
Status Server::on_cancel(const CancelMsg& msg) {
    auto it = reqs_.find(msg.id);
    if (it != reqs_.end() && !it->second.terminal) {
        it->second.terminal = true;
        it->second.cancelled = true;
        PDSIM_RETURN_IF_ERROR(try_free(it->second));
    }
    return {};
}

Status Server::fail_request(Req& r, const std::string& why) {
    if (r.terminal) return {};
    r.terminal = true;
    r.error = why;
    if (role_ == Role::kPrefill) {
        PrefillDoneReport report;
        report.id = r.id;
        report.ok = false;
        report.error = why;
        report.t_us = now_us();
        report.prefill_start_us = r.t_prefill_start;
        PDSIM_RETURN_IF_ERROR(send_router(std::move(report)));
    } else {
        RequestDoneReport report;
        report.id = r.id;
        report.ok = false;
        report.error = why;
        report.t_us = now_us();
        PDSIM_RETURN_IF_ERROR(send_router(std::move(report)));
    }
    return try_free(r);
}

// Frees the request's pages once no transfer can touch them, else retried (the leader loop calls
// it again for every terminal request whose pages are not freed yet). An engine request that is
// still active when the request ended here (the router cancelled it, or the instance failed it)
// is aborted in the engine first; a failed engine request keeps its pages pinned until no
// send / receive / write of it can land (RequestStatus::pages_in_use): the pages stay
// quarantined until then, and free_pages is never tried on pinned pages (a refused free is a
// free-before-transfer violation).
Status Server::try_free(Req& r) {
    if (r.pages_freed || r.pages.empty()) {
        r.pages_freed = true;
        return {};
    }
    if (has_engine()) {
        if (engine_active_.count(r.id) != 0) {
            if (!r.engine_aborted) {
                r.engine_aborted = true;
                const std::string why = r.cancelled ? std::string("cancelled by the router")
                                                    : "failed on instance leader: " + r.error;
                Status ab = engine_abort(r.id, why);
                if (!ab.ok() && ab.code() != StatusCode::kNotFound) {
                    PDSIM_LOG_WARN("rank {}: abort request {}: {}", ctx_.rank, r.id,
                                   ab.to_string());
                }
                if (ctx_.instance_ranks.size() > 1 && !r.followers_aborted) {
                    r.followers_aborted = true;
                    PDSIM_RETURN_IF_ERROR(send_followers(EngineAbortMsg{.id = r.id}));
                }
            }
            return {};  // still in flight: retried once the engine has it terminal
        }
        StatusOr<transfer::RequestStatus> es = engine_status(r.id);
        if (es.ok() && es->pages_in_use) return {};  // quarantined: a transfer may still land
        // The followers' copies of the pages too: each must say that no transfer of its own can
        // still reach them (its engine's outcome, or a PagesIdleMsg); one that has not is told to
        // abort the request, once.
        const int followers = static_cast<int>(ctx_.instance_ranks.size()) - 1;
        if (static_cast<int>(r.followers_idle.size()) < followers) {
            if (!r.followers_aborted) {
                r.followers_aborted = true;
                PDSIM_RETURN_IF_ERROR(send_followers(EngineAbortMsg{.id = r.id}));
            }
            return {};
        }
        Status st = engine_free(r.pages, r.window_ring, r.state_slot);
        if (st.code() == StatusCode::kFailedPrecondition) return {};  // pinned: later
        r.state_slot = 0;
        r.window_ring.clear();
        engine_release(r.id);
        if (!st.ok())
            PDSIM_LOG_WARN("rank {}: free pages of request {}: {}", ctx_.rank, r.id,
                           st.to_string());
    } else {
        Status st = pool_->allocator().free(r.pages);
        if (!st.ok())
            PDSIM_LOG_WARN("rank {}: free pages of request {}: {}", ctx_.rank, r.id,
                           st.to_string());
        const int32_t slot[] = {r.state_slot};
        free_unpinned(states_.get(), std::span(slot, r.state_slot > 0 ? 1 : 0), "state slot");
        r.state_slot = 0;
        free_unpinned(window_pool_.get(), r.window_ring, "sliding-window page");
        r.window_ring.clear();
    }
    r.pages_freed = true;
    if (role_ == Role::kDecode && ctx_.instance_ranks.size() > 1) {
        PDSIM_RETURN_IF_ERROR(send_followers(ReleaseMsg{.id = r.id}));
    }
    return {};
}

Status Server::report_first(Req& r) {
    r.t_first = now_us();
    FirstTokenReport report;
    report.id = r.id;
    report.t_us = r.t_first;
    report.prefill_start_us = r.t_prefill_start;
    return send_router(std::move(report));
}

Status Server::finish_request(Req& r) {
    r.terminal = true;
    RequestDoneReport report;
    report.id = r.id;
    report.ok = true;
    report.t_us = r.token_t.empty() ? now_us() : r.token_t.back();
    report.tokens = r.tokens;
    report.token_t_us = r.token_t;
    report.bytes = r.bytes;
    report.kv_digest = r.kv_digest;
    PDSIM_RETURN_IF_ERROR(send_router(std::move(report)));
    return try_free(r);
}

Status Server::admit() {
    while (!admit_q_.empty()) {
        Req& r = reqs_.at(admit_q_.front());
        if (r.terminal) {
            admit_q_.pop_front();
            continue;
        }
        const int64_t tokens = role_ == Role::kPrefill ? r.in : static_cast<int64_t>(r.in) + r.out;
        const int pages = static_cast<int>((tokens + o_.page_size - 1) / o_.page_size);
        if (pages > pool_->allocator().capacity()) {
            admit_q_.pop_front();
            PDSIM_RETURN_IF_ERROR(fail_request(
                r, fmt::format("needs {} KV pages, the pool has {} (raise --kv-pool-mb)", pages,
                               pool_->allocator().capacity())));
            continue;
        }
        // The sliding layers' ring (window.h), in their own pool.
        const int ring = window_pool_ != nullptr ? window_ring_size(tokens) : 0;
        if (ring > window_pool_capacity()) {
            admit_q_.pop_front();
            PDSIM_RETURN_IF_ERROR(fail_request(
                r, fmt::format("needs {} sliding-window pages, their pool has {} (raise "
                               "--kv-pool-mb)",
                               ring, window_pool_capacity())));
            continue;
        }
        if (states_ != nullptr && states_->allocator().available() < 1) return {};  // FCFS: slots
        if (ring > 0 && window_pool_->allocator().available() < ring) return {};    // FCFS: ring
        auto got = pool_->allocator().alloc(pages);
        if (!got.ok()) return {};  // FCFS: wait for pages
        r.pages = std::move(*got);
        if (ring > 0) r.window_ring = window_pool_->allocator().alloc(ring).value();
        if (states_ != nullptr) r.state_slot = states_->allocator().alloc(1).value().front();
        const kv::KVPool* pools[] = {pool_.get(), window_pool_.get(), states_.get()};
        for (size_t i = 0; i < std::size(pools); ++i) {
            if (pools[i] == nullptr) continue;
            const kv::PageAllocator& a = pools[i]->allocator();
            peak_pages_[i] = std::max<int64_t>(peak_pages_[i], a.capacity() - a.available());
        }
        admit_q_.pop_front();
        if (role_ == Role::kDecode) {
            PDSIM_RETURN_IF_ERROR(start_receive(r));
        } else {
            prefill_q_.push_back(r.id);
        }
    }
    return {};
}

// A decode request has its pages: the followers and this rank's receiver start receiving its KV
// from the prefill instance's ranks (a refused submit fails the request).
Status Server::start_receive(Req& r) {
    std::vector<int> pranks;
    const int first = cfg_.topology.rank_map().first_rank(r.p_inst);
    for (int i = 0; i < cfg_.topology.instances[static_cast<size_t>(r.p_inst)].tp; ++i)
        pranks.push_back(first + i);
    PDSIM_RETURN_IF_ERROR(send_followers(AdmitMsg{.id = r.id,
                                                  .pages = r.pages,
                                                  .input_len = r.in,
                                                  .prefill_ranks = pranks,
                                                  .state_slot = r.state_slot,
                                                  .window_ring = r.window_ring}));
    Status st = engine_submit_receive(r.id, pranks, r.pages, r.window_ring, r.in, r.state_slot);
    if (!st.ok()) return fail_request(r, "receiver submit: " + st.message());
    engine_active_.insert(r.id);
    receiving_.push_back(r.id);
    return {};
}

Status Server::schedule_extend(bool* did) {
    *did = false;
    Plan plan;
    plan.mode = attn::ForwardMode::kExtend;
    policy::ExtendPlanner planner(batching());
    for (uint64_t id : prefill_q_) {
        if (planner.full()) break;
        Req& r = reqs_.at(id);
        if (r.terminal) continue;
        const int64_t n = planner.take(r.in - r.prefilled);
        if (n <= 0) continue;
        PlanEntry e;
        e.id = id;
        e.t0 = r.prefilled;
        e.t1 = r.prefilled + n;
        e.tokens.assign(r.prompt.begin() + e.t0, r.prompt.begin() + e.t1);
        e.pages = r.pages;
        e.state_slot = r.state_slot;
        e.window_ring = r.window_ring;
        e.first = e.t0 == 0;
        e.last = e.t1 == r.in;
        e.input_len = r.in;
        plan.entries.push_back(std::move(e));
    }
    if (plan.entries.empty()) return {};
    *did = true;
    const double t0 = now_us();
    for (const auto& e : plan.entries) {
        Req& r = reqs_.at(e.id);
        if (r.t_prefill_start < 0) r.t_prefill_start = t0;
    }
    PDSIM_RETURN_IF_ERROR(send_followers(plan));
    std::vector<int32_t> next;
    Status st = execute(plan, &next);
    if (!st.ok()) {
        for (const auto& e : plan.entries)
            PDSIM_RETURN_IF_ERROR(fail_request(reqs_.at(e.id), broken_reason_));
        return {};
    }
    PDSIM_RETURN_IF_ERROR(after_extend(plan, next));
    // Drop finished prefills from the queue.
    std::erase_if(prefill_q_, [&](uint64_t id) {
        const Req& r = reqs_.at(id);
        return r.terminal || r.prefilled >= r.in;
    });
    return {};
}

// After an extend forward: requests whose prompt is done get their first token (colocated: and
// decode next) or wait for the sender (disaggregated prefill).
Status Server::after_extend(const Plan& plan, const std::vector<int32_t>& next) {
    for (size_t i = 0; i < plan.entries.size(); ++i) {
        const PlanEntry& e = plan.entries[i];
        Req& r = reqs_.at(e.id);
        r.prefilled = e.t1;
        if (!e.last || r.terminal) continue;
        if (role_ == Role::kColocated) {
            r.tokens.push_back(next[i]);
            r.token_t.push_back(now_us());
            PDSIM_RETURN_IF_ERROR(report_first(r));
            if (static_cast<int32_t>(r.tokens.size()) >= r.out) {
                PDSIM_RETURN_IF_ERROR(finish_request(r));
            } else {
                running_.push_back(r.id);
            }
        } else {
            r.last_submitted = true;
            if (o_.fault == Fault::kFreeBeforeTransfer) free_before_transfer(r);
        }
    }
    return {};
}

// The planted bug of --fault free-before-transfer: the pages go back to the pool while the
// sender may still read them (the validator records it when the free was not refused).
void Server::free_before_transfer(Req& r) {
    Status fs = sender_->pins().free_pages(pool_->allocator(), r.pages);
    if (!fs.ok()) return;
    r.pages_freed = true;
    const bool in_flight = engine_active_.count(r.id) != 0;
    if (in_flight) {
        transfer::Violation v;
        v.request = r.id;
        v.rank = ctx_.rank;
        v.what = "pages freed while the transfer was in flight (the free was not refused)";
        validator_->add_violation(v);
    }
}

Status Server::schedule_decode(bool* did) {
    *did = false;
    Plan plan;
    plan.mode = attn::ForwardMode::kDecode;
    policy::DecodePlanner planner(batching());
    for (uint64_t id : running_) {
        Req& r = reqs_.at(id);
        if (r.terminal) continue;
        const int64_t pos = r.in + static_cast<int64_t>(r.tokens.size()) - 1;
        if (!planner.take(pos + 1)) break;
        PlanEntry e;
        e.id = id;
        e.t0 = pos;
        e.t1 = pos + 1;
        e.tokens = {r.tokens.back()};
        e.pages = r.pages;
        e.state_slot = r.state_slot;
        e.window_ring = r.window_ring;
        e.input_len = r.in;
        plan.entries.push_back(std::move(e));
    }
    if (plan.entries.empty()) return {};
    *did = true;
    PDSIM_RETURN_IF_ERROR(send_followers(plan));
    std::vector<int32_t> next;
    Status st = execute(plan, &next);
    if (!st.ok()) {
        for (const auto& e : plan.entries)
            PDSIM_RETURN_IF_ERROR(fail_request(reqs_.at(e.id), broken_reason_));
        return {};
    }
    const double t = now_us();
    for (size_t i = 0; i < plan.entries.size(); ++i) {
        Req& r = reqs_.at(plan.entries[i].id);
        if (r.terminal) continue;
        r.tokens.push_back(next[i]);
        r.token_t.push_back(t);
        if (static_cast<int32_t>(r.tokens.size()) >= r.out)
            PDSIM_RETURN_IF_ERROR(finish_request(r));
    }
    std::erase_if(running_, [&](uint64_t id) { return reqs_.at(id).terminal; });
    return {};
}

// Applies this rank's engine outcomes (and the followers' reports) to the requests.
Status Server::after_engine_poll() {
    const int tp = static_cast<int>(ctx_.instance_ranks.size());
    for (auto& [id, r] : reqs_) {
        if (r.terminal) {
            if (!r.pages_freed) PDSIM_RETURN_IF_ERROR(try_free(r));
            continue;
        }
        if (role_ == Role::kPrefill) {
            if (r.send_failed) {
                PDSIM_RETURN_IF_ERROR(fail_request(r, r.error));
                continue;
            }
            if (r.last_submitted && static_cast<int>(r.sent.size()) == tp) {
                r.terminal = true;
                PrefillDoneReport report;
                report.id = r.id;
                report.ok = true;
                report.t_us = now_us();
                report.prefill_start_us = r.t_prefill_start;
                report.kv_digest = r.kv_digest;
                PDSIM_RETURN_IF_ERROR(send_router(std::move(report)));
                PDSIM_RETURN_IF_ERROR(try_free(r));
            }
        } else if (role_ == Role::kDecode) {
            if (r.receive_failed) {
                PDSIM_RETURN_IF_ERROR(fail_request(r, r.error));
                continue;
            }
            if (!r.pages.empty() && r.tokens.empty() && static_cast<int>(r.ready.size()) == tp) {
                r.tokens.push_back(r.first_token);
                r.token_t.push_back(now_us());
                PDSIM_RETURN_IF_ERROR(report_first(r));
                if (static_cast<int32_t>(r.tokens.size()) >= r.out) {
                    PDSIM_RETURN_IF_ERROR(finish_request(r));
                } else {
                    running_.push_back(r.id);
                }
            }
        }
    }
    std::erase_if(receiving_, [&](uint64_t id) {
        return reqs_.at(id).terminal || !reqs_.at(id).tokens.empty();
    });
    return {};
}

// A TP follower's engine outcome (`sent`: its sender's, else its receiver's) from world rank src.
void Server::on_follower_outcome(const EngineOutcomeFields& outcome, bool sent, int src) {
    const int from =
        static_cast<int>(std::find(ctx_.instance_ranks.begin(), ctx_.instance_ranks.end(), src) -
                         ctx_.instance_ranks.begin());
    apply_engine_outcome(outcome, sent, from, src);
}

// The engine outcome of the instance's TP rank `tp_index` (world rank `world_rank`, which names
// it in errors): its sender finished the request, or its receiver has it (its first token must
// agree with the other TP ranks'), or it failed. Unknown requests are ignored.
void Server::apply_engine_outcome(const EngineOutcomeFields& outcome, bool sent, int tp_index,
                                  int world_rank) {
    auto it = reqs_.find(outcome.id);
    if (it == reqs_.end()) return;
    Req& r = it->second;
    if (tp_index > 0 && outcome.pages_idle) r.followers_idle.insert(tp_index);
    if (outcome.ok) r.kv_digest += outcome.kv_digest;  // the TP ranks' parts (kv_digest.h)
    if (!outcome.ok) {
        (sent ? r.send_failed : r.receive_failed) = true;
        if (r.error.empty()) r.error = fmt::format("rank {}: {}", world_rank, outcome.error);
    } else if (sent) {
        r.sent.insert(tp_index);
    } else {
        const int32_t tok = outcome.first_token;
        if (!r.ready.empty() && tok != r.first_token) {
            r.receive_failed = true;
            r.error = fmt::format("first token differs across decode TP ranks ({} vs {})", tok,
                                  r.first_token);
        }
        r.first_token = tok;
        r.bytes += outcome.bytes;
        r.ready.insert(tp_index);
    }
}

// Every message already there, waiting up to `wait` for the first one only.
Status Server::drain_leader_messages(microseconds wait) {
    bool first_msg = true;
    while (true) {
        PDSIM_ASSIGN_OR_RETURN(
            std::optional<Message> m,
            ctx_.mbox->recv(Channel::kInstance, first_msg ? wait : microseconds(0)));
        first_msg = false;
        if (!m) return {};
        PDSIM_RETURN_IF_ERROR(on_leader_message(*m));
    }
}

Status Server::on_leader_message(const Message& m) {
    const std::string k = m.kind();
    if (k == SubmitMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(SubmitMsg submit, decode_message<SubmitMsg>(m.body));
        return on_submit(submit);
    }
    if (k == CancelMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(CancelMsg cancel, decode_message<CancelMsg>(m.body));
        return on_cancel(cancel);
    }
    if (k == SentReport::kKind) {
        PDSIM_ASSIGN_OR_RETURN(SentReport sent, decode_message<SentReport>(m.body));
        on_follower_outcome(sent, true, m.src);
    } else if (k == ReadyReport::kKind) {
        PDSIM_ASSIGN_OR_RETURN(ReadyReport ready, decode_message<ReadyReport>(m.body));
        on_follower_outcome(ready, false, m.src);
    } else if (k == PagesIdleMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(PagesIdleMsg idle, decode_message<PagesIdleMsg>(m.body));
        auto it = reqs_.find(idle.id);
        const auto pos = std::find(ctx_.instance_ranks.begin(), ctx_.instance_ranks.end(), m.src);
        if (it != reqs_.end() && pos != ctx_.instance_ranks.begin() &&
            pos != ctx_.instance_ranks.end()) {
            it->second.followers_idle.insert(static_cast<int>(pos - ctx_.instance_ranks.begin()));
        }
    } else if (k == EndMsg::kKind) {
        ended_ = true;
    } else {
        PDSIM_LOG_WARN("rank {}: unexpected message '{}' from rank {}", ctx_.rank, k, m.src);
    }
    return {};
}

// One forward per leader iteration: extend or decode (policy::choose_forward alternates them).
Status Server::run_one_forward() {
    bool did = false;
    const bool want_extend = !prefill_q_.empty();
    const bool want_decode = !running_.empty();
    if (policy::choose_forward(want_extend, want_decode, last_was_extend_) ==
        policy::ForwardKind::kExtend) {
        PDSIM_RETURN_IF_ERROR(schedule_extend(&did));
        last_was_extend_ = did;
    }
    if (!did && want_decode) {
        PDSIM_RETURN_IF_ERROR(schedule_decode(&did));
        last_was_extend_ = false;
    }
    return {};
}

// A broken instance fails every request it still has, and schedules nothing more.
Status Server::fail_all_if_broken() {
    if (!broken_) return {};
    for (auto& [id, r] : reqs_) {
        if (!r.terminal) PDSIM_RETURN_IF_ERROR(fail_request(r, broken_reason_));
    }
    prefill_q_.clear();
    running_.clear();
    admit_q_.clear();
    return {};
}

Status Server::leader_loop() {
    const int self = ctx_.info.tp_rank;
    std::vector<EngineOutcomeFields> outcomes;
    while (!ended_) {
        const bool busy = !prefill_q_.empty() || !running_.empty();
        const bool waiting = !receiving_.empty() || !engine_active_.empty();
        const auto wait =
            busy ? microseconds(0) : (waiting ? microseconds(200) : microseconds(2000));
        PDSIM_RETURN_IF_ERROR(drain_leader_messages(wait));
        if (ended_) break;
        // Engine outcomes on this rank.
        if (sender_ || receiver_) {
            outcomes.clear();
            poll_engine(&outcomes);
            for (const EngineOutcomeFields& outcome : outcomes) {
                apply_engine_outcome(outcome, sender_ != nullptr, self, ctx_.rank);
            }
        }
        PDSIM_RETURN_IF_ERROR(after_engine_poll());
        PDSIM_RETURN_IF_ERROR(admit());
        PDSIM_RETURN_IF_ERROR(run_one_forward());
        PDSIM_RETURN_IF_ERROR(fail_all_if_broken());
    }
    return send_followers(EndMsg{});
}

}  // namespace pdsim::testbed::detail
