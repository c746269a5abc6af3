#include "sim/testbed/server.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/logging.h"
#include "sim/testbed/rank_builder.h"
#include "sim/testbed/server_internal.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::testbed {

std::string_view phase_name(Phase phase) {
    return phase == Phase::kColocated ? "colocated" : "disagg";
}

namespace detail {

using std::chrono::microseconds;
using std::chrono::milliseconds;

Server::Server(RankContext& ctx, Phase phase, KvTransports kv)
    : ctx_(ctx), cfg_(*ctx.config), o_(ctx.config->options), phase_(phase), kv_(kv) {
    if (phase == Phase::kColocated) {
        role_ = Role::kColocated;
    } else {
        role_ = ctx.info.role == topo::Role::kPrefill ? Role::kPrefill : Role::kDecode;
    }
    num_layers_ = cfg_.model.num_layers;
    timeout_ = milliseconds(static_cast<int64_t>(o_.request_timeout_s * 1000));
}

Server::~Server() {
    if (ctx_.cpu_model != nullptr) ctx_.cpu_model->set_layer_hook(nullptr);
    // Before the phase's pool and backend go (members, destroyed after this body): nothing may
    // still run on them, and the decode graphs captured on them are not replayed again.
    if (ctx_.gpu != nullptr) ctx_.gpu->end_phase();
    shutdown_engines();
}

Status Server::setup() {
    const model::ModelConfig& m = cfg_.model;
    const int tp = ctx_.info.tp_size;
    // CPU ranks: fp32 KV in host memory; GPU ranks: bf16 KV on the GPU (the cuda backend's).
    const kv::KVDtype kv_dtype = ctx_.gpu != nullptr ? kv::KVDtype::kBF16 : kv::KVDtype::kF32;
    const int64_t pages = kv_pool_pages(m, tp, o_.page_size, o_.kv_pool_mb, kv_dtype);
    RankBuildOptions build;
    build.model = &m;
    build.tp_size = tp;
    build.tp_rank = ctx_.info.tp_rank;
    build.threads = ctx_.threads;
    build.backend = o_.backend;
    build.page_size = o_.page_size;
    build.num_pages = static_cast<int>(pages);
    build.stream_name = fmt::format("compute-r{}", ctx_.rank);
    build.stream_timeout = timeout_ + milliseconds(5000);
    build.stream = ctx_.gpu != nullptr ? &ctx_.gpu->stream() : nullptr;
    // One state slot per request that can hold KV pages at once (at most one per page), capped.
    build.state_slots = static_cast<int>(std::min<int64_t>(pages, kMaxStateSlots));
    build.kv_dtype = kv_dtype;
    build.step_counter = role_ == Role::kPrefill;
    build.validator = role_ != Role::kColocated;
    build.validator_rank = ctx_.rank;
    PDSIM_ASSIGN_OR_RETURN(RankParts parts, build_rank_parts(build));
    const bool gpu = ctx_.gpu != nullptr;
    PdBackendSide side;
    side.prefill = role_ == Role::kPrefill;
    side.fault = role_ == Role::kPrefill ? o_.fault : Fault::kNone;
    side.max_bs = std::max(o_.max_batch_tokens, o_.max_decode_batch);
    side.max_pages_per_seq = build.num_pages;
    if (!gpu) {
        side.on_record = [this](int layer, double t) {
            timeline_.instant(kTidRecord, fmt::format("record L{}", layer), "record", t);
        };
    } else {
        // GPU ranks: the pages' checksums (the activations are on the device); records without
        // timeline callbacks (each a host round trip); stale graph metadata lives in the decode
        // ranks' graphs (below), late writes are stream fills.
        side.checksums = ChecksumSource::kPages;
        if (side.fault == Fault::kStaleGraphMetadata) side.fault = Fault::kNone;
        if (side.fault == Fault::kLateWrite) {
            side.fill = [g = ctx_.gpu](void* dst, int byte, size_t bytes) {
                return g->enqueue_fill(dst, byte, bytes);
            };
        }
    }
    auto backend = build_pd_backend(build, parts, side);
    // Members in the parts' order (the stream outlives what enqueues on it), built or not.
    owned_stream_ = std::move(parts.owned_stream);
    stream_ = parts.stream;
    pool_ = std::move(parts.pool);
    states_ = std::move(parts.states);
    counter_ = std::move(parts.counter);
    validator_ = std::move(parts.validator);
    state_validator_ = std::move(parts.state_validator);
    PDSIM_ASSIGN_OR_RETURN(backend_, std::move(backend));
    if (states_ != nullptr) {
        if (ctx_.cpu_model == nullptr) {
            return PDSIM_ERROR(StatusCode::kInternal, "recurrent layers without a CPU model");
        }
        PDSIM_RETURN_IF_ERROR(ctx_.cpu_model->attach_state_pool(states_.get()));
    }

    layer_t0_.assign(static_cast<size_t>(m.num_layers), 0.0);
    if (ctx_.cpu_model != nullptr) {
        ctx_.cpu_model->set_layer_hook([this](int layer, bool begin) {
            const double t = now_us();
            if (begin) {
                layer_t0_[static_cast<size_t>(layer)] = t;
            } else {
                const double t0 = layer_t0_[static_cast<size_t>(layer)];
                timeline_.slice(kTidCompute, fmt::format("L{} {}", layer, hook_label_), "compute",
                                t0, t - t0);
            }
        });
    }
    if (gpu) {
        // Decode graphs on this phase's backend and pool; layer timing by device events.
        PDSIM_RETURN_IF_ERROR(ctx_.gpu->begin_phase(*backend_, *pool_));
        // --fault stale-graph-metadata on GPU ranks: the decode instances' graph replays skip the
        // metadata refresh (end_phase() turns it off).
        if (role_ == Role::kDecode && o_.fault == Fault::kStaleGraphMetadata) {
            ctx_.gpu->set_stale_graph_metadata(true);
        }
    }

    if (role_ != Role::kColocated) {
        if (kv_.control == nullptr)
            return PDSIM_ERROR(StatusCode::kInternal, "disaggregated phase without a KV transport");
        PDSIM_ASSIGN_OR_RETURN(transfer::KvLayout layout,
                               kv_engine_layout(*pool_, m, tp, ctx_.info.tp_rank));
        auto hook = [this](const transfer::TransferEvent& ev) { on_engine_event(ev); };
        // --fault state-not-sent: neither side runs the states' engine (the deployed bug: the
        // recurrent layers are left out of the transfer), so the decode side continues from
        // whatever its state slot holds.
        const bool state_engine = states_ != nullptr && o_.fault != Fault::kStateNotSent;
        transfer::Transport* control = kv_.control;
        transfer::Transport* data = kv_.data;
        transfer::Transport* state_control = nullptr;
        transfer::Transport* state_data = nullptr;
        if (state_engine) {
            constexpr transfer::Tag kMinTagSpace = 1024;
            PDSIM_ASSIGN_OR_RETURN(control_spaces_,
                                   transfer::split_tag_space(*kv_.control, 2, kMinTagSpace));
            control = control_spaces_[0].get();
            state_control = control_spaces_[1].get();
            if (kv_.data != nullptr && kv_.data != kv_.control) {
                PDSIM_ASSIGN_OR_RETURN(data_spaces_,
                                       transfer::split_tag_space(*kv_.data, 2, kMinTagSpace));
                data = data_spaces_[0].get();
                state_data = data_spaces_[1].get();
            }
        }
        if (ctx_.gpu == nullptr) {
            digest_kv_layout_ = layout;
            if (states_ != nullptr) {
                PDSIM_ASSIGN_OR_RETURN(digest_state_layout_,
                                       state_layout(*states_, m, tp, ctx_.info.tp_rank));
            }
        }
        transfer::KvLayout states_layout;
        if (state_engine) {
            PDSIM_ASSIGN_OR_RETURN(states_layout, state_layout(*states_, m, tp, ctx_.info.tp_rank));
            if (role_ == Role::kPrefill && o_.fault == Fault::kStateTpMisslice) {
                PDSIM_ASSIGN_OR_RETURN(states_layout, misslice(states_layout));
            }
        }
        if (role_ == Role::kPrefill) {
            transfer::SenderOptions so;
            so.request_timeout = timeout_;
            so.validator = validator_.get();
            so.on_event = hook;
            so.num_workers = 1;
            so.data_transport = data;
            so.device_gate = cfg_.options.device_gate;
            if (states_ != nullptr) so.layer_steps = attention_layers(m);
            PDSIM_ASSIGN_OR_RETURN(sender_,
                                   transfer::KvSender::create(*control, layout, *counter_, so));
            if (state_engine) {
                so.validator = state_validator_.get();
                so.data_transport = state_data;
                so.layer_steps = recurrent_layers(m);
                so.on_event = nullptr;  // the KV engine's layer events are the timeline's
                PDSIM_ASSIGN_OR_RETURN(
                    state_sender_,
                    transfer::KvSender::create(*state_control, states_layout, *counter_, so));
            }
        } else {
            transfer::ReceiverOptions ro;
            ro.request_timeout = timeout_;
            ro.validator = validator_.get();
            ro.on_event = hook;
            ro.num_workers = 1;
            ro.data_transport = data;
            PDSIM_ASSIGN_OR_RETURN(receiver_, transfer::KvReceiver::create(*control, layout, ro));
            if (state_engine) {
                ro.validator = state_validator_.get();
                ro.data_transport = state_data;
                ro.on_event = nullptr;  // the KV engine's layer events are the timeline's
                PDSIM_ASSIGN_OR_RETURN(state_receiver_, transfer::KvReceiver::create(
                                                            *state_control, states_layout, ro));
            }
        }
    }
    return {};
}

// --fault state-tp-misslice: the prefill side addresses every state slot one head early (the
// offset a rank of another TP size would use), so each head it sends is the previous head's bytes
// (the first head takes the previous slot's last head). Slot 0 is never a request's, so the
// shifted addresses stay inside the pool.
StatusOr<transfer::KvLayout> Server::misslice(const transfer::KvLayout& layout) {
    std::vector<std::byte*> bases;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (int b = 0; b < layout.buffer_count(); ++b) {
            bases.push_back(layout.base(l, b) - layout.head_bytes(b));
        }
    }
    return transfer::KvLayout::create(layout.summary(), layout.num_pages(), std::move(bases),
                                      layout.device());
}

StatusOr<transfer::RequestStatus> Server::engine_status(uint64_t id) {
    StatusOr<transfer::RequestStatus> kv = sender_ ? sender_->status(id) : receiver_->status(id);
    if (!kv.ok() || (!state_sender_ && !state_receiver_)) return kv;
    StatusOr<transfer::RequestStatus> st =
        state_sender_ ? state_sender_->status(id) : state_receiver_->status(id);
    if (!st.ok()) return st.status().with_context("the recurrent states' transfer");
    using transfer::RequestState;
    transfer::RequestStatus out = *kv;
    out.bytes += st->bytes;
    out.pages_in_use = kv->pages_in_use || st->pages_in_use;
    if (kv->state == RequestState::kFailed || st->state == RequestState::kFailed) {
        out.state = RequestState::kFailed;
        out.reason = kv->state == RequestState::kFailed
                         ? kv->reason
                         : "the recurrent states' transfer: " + st->reason;
        // The other engine's side of the request ends too (a no-op once terminal).
        engine_abort(id, out.reason).ignore_error();
    } else if (kv->state != RequestState::kSuccess) {
        out.state = kv->state;
    } else {
        out.state = st->state;
    }
    return out;
}

Status Server::engine_abort(uint64_t id, const std::string& why) {
    Status st;
    if (sender_) st = sender_->abort(id, why);
    if (receiver_) st = receiver_->abort(id, why);
    if (state_sender_) state_sender_->abort(id, why).ignore_error();
    if (state_receiver_) state_receiver_->abort(id, why).ignore_error();
    return st;
}

void Server::engine_release(uint64_t id) {
    if (sender_) sender_->release(id).ignore_error();
    if (receiver_) receiver_->release(id).ignore_error();
    if (state_sender_) state_sender_->release(id).ignore_error();
    if (state_receiver_) state_receiver_->release(id).ignore_error();
    first_slots_.erase(id);
}

Status Server::engine_free(const std::vector<int32_t>& pages, int32_t state_slot) {
    transfer::PagePins& pins = sender_ ? sender_->pins() : receiver_->pins();
    if (state_slot > 0 && (state_sender_ || state_receiver_)) {
        transfer::PagePins& state_pins =
            state_sender_ ? state_sender_->pins() : state_receiver_->pins();
        const std::vector<int32_t> slot = {state_slot};
        PDSIM_RETURN_IF_ERROR(state_pins.free_pages(states_->allocator(), slot));
    } else if (state_slot > 0) {
        free_state_slot(state_slot);
    }
    return pins.free_pages(pool_->allocator(), pages);
}

void Server::free_state_slot(int32_t slot) {
    if (slot <= 0 || states_ == nullptr) return;
    const std::vector<int32_t> one = {slot};
    Status st = states_->allocator().free(one);
    if (!st.ok())
        PDSIM_LOG_WARN("rank {}: free state slot {}: {}", ctx_.rank, slot, st.to_string());
}

Status Server::engine_submit_receive(uint64_t id, const std::vector<int>& prefill_ranks,
                                     const std::vector<int32_t>& pages, int64_t input_len,
                                     int32_t state_slot) {
    transfer::ReceiveRequestSpec spec;
    spec.request_id = id;
    spec.prefill_ranks = prefill_ranks;
    spec.dst_pages = pages;
    spec.num_tokens = input_len;
    spec.timeout = timeout_;
    PDSIM_RETURN_IF_ERROR(receiver_->submit(spec));
    receive_info_[id] = {pages, input_len, state_slot};
    if (state_receiver_) {
        spec.dst_pages = {state_slot};
        spec.num_tokens = 1;
        Status st = state_receiver_->submit(spec);
        if (!st.ok()) {
            receiver_->abort(id, "the recurrent states' receive was refused").ignore_error();
            return st.with_context("the recurrent states' receive");
        }
    }
    return {};
}

void Server::on_engine_event(const transfer::TransferEvent& ev) {
    using K = transfer::TransferEvent::Kind;
    ctx_.note_progress();
    const double t = to_us(ev.time);
    {
        std::lock_guard<std::mutex> lock(ev_mu_);
        if (engine_events_.size() < kMaxEngineEvents) {
            engine_events_.push_back(
                {ev.kind, ev.request, ev.layer, ev.peer, ev.chunk, ev.bytes, t});
        }
    }
    if (ev.kind == K::kLayerArrived) {
        timeline_.instant(kTidRecv, fmt::format("arrived r{} L{}", ev.request, ev.layer), "receive",
                          t);
    } else if (ev.kind == K::kRequestFailed) {
        timeline_.instant(ev.peer >= 0 ? kTidSend : kTidRecv, fmt::format("failed r{}", ev.request),
                          "transfer", t);
    }
}

void Server::mark_broken(const Status& st) {
    if (broken_) return;
    broken_ = true;
    broken_reason_ =
        fmt::format("instance {} (rank {}) is broken: {}",
                    cfg_.topology.instances[static_cast<size_t>(ctx_.info.instance)].id, ctx_.rank,
                    st.message());
    PDSIM_LOG_ERROR("{}", broken_reason_);
}

// ---------------------------------------------------------------------------------------------
// Follower: runs the leader's forwards, and reports its engine's outcomes.
Status Server::follower_loop() {
    std::vector<int32_t> next;
    while (!ended_) {
        const auto wait = engine_active_.empty() ? microseconds(2000) : microseconds(200);
        PDSIM_ASSIGN_OR_RETURN(std::optional<Message> m, ctx_.mbox->recv(Channel::kInstance, wait));
        if (m) {
            PDSIM_RETURN_IF_ERROR(on_follower_message(*m, &next));
            if (ended_) break;
        }
        if (sender_ || receiver_) PDSIM_RETURN_IF_ERROR(report_engine_outcomes_to_leader());
    }
    return {};
}

// A message from the leader: a forward to run, a decode request to receive, a request to release,
// or the end of the phase (ended_).
Status Server::on_follower_message(const Message& m, std::vector<int32_t>* next) {
    const std::string k = m.kind();
    if (k == Plan::kKind) {
        PDSIM_ASSIGN_OR_RETURN(Plan plan, decode_message<Plan>(m.body));
        if (!broken_) {
            Status st = execute(plan, next);
            if (!st.ok()) PDSIM_LOG_WARN("rank {}: forward failed: {}", ctx_.rank, st.to_string());
        }
    } else if (k == AdmitMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(AdmitMsg admit, decode_message<AdmitMsg>(m.body));
        Status st = engine_submit_receive(admit.id, admit.prefill_ranks, admit.pages,
                                          admit.input_len, admit.state_slot);
        if (st.ok()) {
            engine_active_.insert(admit.id);
        } else {
            ReadyReport report;
            report.id = admit.id;
            report.ok = false;
            report.error = "receiver submit: " + st.message();
            PDSIM_RETURN_IF_ERROR(
                ctx_.mbox->send(ctx_.leader(), Channel::kInstance, encode_message(report)));
        }
    } else if (k == ReleaseMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(ReleaseMsg release, decode_message<ReleaseMsg>(m.body));
        engine_release(release.id);
    } else if (k == EngineAbortMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(EngineAbortMsg abort, decode_message<EngineAbortMsg>(m.body));
        Status st = engine_abort(abort.id, "its instance leader gave up on it");
        if (!st.ok() && st.code() != StatusCode::kNotFound) {
            PDSIM_LOG_WARN("rank {}: abort request {}: {}", ctx_.rank, abort.id, st.to_string());
        }
        // Its outcome (and idleness) comes from the engine when the engine holds it; else the
        // pages are idle now (never submitted, or already finished and reported).
        if (engine_active_.count(abort.id) == 0 && quiescing_.count(abort.id) == 0) {
            PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance,
                                                  encode_message(PagesIdleMsg{.id = abort.id})));
        }
    } else if (k == EndMsg::kKind) {
        ended_ = true;
    }
    return {};
}

// Each request this rank's engine finished goes to the leader (a sender's request is released
// here at once; a receiver's when the leader frees its pages).
// A failed request whose pages are still in use is quiesced: kept in quiescing_ until no transfer
// of it can land, then reported idle (PagesIdleMsg) and, for a sender, released.
Status Server::report_engine_outcomes_to_leader() {
    std::vector<EngineOutcomeFields> outcomes;
    poll_engine(&outcomes);
    for (EngineOutcomeFields& outcome : outcomes) {
        if (!outcome.ok) {
            StatusOr<transfer::RequestStatus> es = engine_status(outcome.id);
            outcome.pages_idle = !(es.ok() && es->pages_in_use);
        }
        const json report =
            sender_ ? encode_message(SentReport{outcome}) : encode_message(ReadyReport{outcome});
        PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance, report));
        if (!outcome.pages_idle) {
            quiescing_.insert(outcome.id);
        } else if (sender_) {
            engine_release(outcome.id);
        }
    }
    for (auto it = quiescing_.begin(); it != quiescing_.end();) {
        StatusOr<transfer::RequestStatus> es = engine_status(*it);
        if (es.ok() && es->pages_in_use) {
            ++it;
            continue;
        }
        PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance,
                                              encode_message(PagesIdleMsg{.id = *it})));
        if (sender_) engine_release(*it);
        it = quiescing_.erase(it);
    }
    return {};
}

Status Server::run() {
    cpu_at_start_ = thread_cpu_times();
    Status st = ctx_.is_leader() ? leader_loop() : follower_loop();
    thread_cpu_s_ = cpu_by_name(cpu_at_start_, thread_cpu_times());
    return st;
}

RankResult Server::result() {
    RankResult r;
    r.rank = ctx_.rank;
    r.phase = phase_name(phase_);
    r.timeline = timeline_.take();
    {
        std::lock_guard<std::mutex> lock(ev_mu_);
        r.engine_events = std::move(engine_events_);
        engine_events_.clear();
    }
    r.prefill_end_us = prefill_end_;
    if (validator_) {
        transfer::OrderingReport rep = validator_->report();
        r.ordering.checked_layers = rep.checked_layers;
        for (const auto& v : rep.violations) r.ordering.violations.push_back(v.to_string());
    }
    if (state_validator_) {
        // The recurrent states' checks (their layers are the recurrent layers, counted apart).
        transfer::OrderingReport rep = state_validator_->report();
        r.ordering.checked_layers += rep.checked_layers;
        for (const auto& v : rep.violations) {
            r.ordering.violations.push_back("recurrent states: " + v.to_string());
        }
    }
    json stats = {{"forwards", forwards_},
                  {"forward_tokens", forward_tokens_},
                  {"compute_us", compute_us_},
                  {"record_violations", record_violations_},
                  {"threads", ctx_.threads},
                  {"decode_kv_cap", decode_kv_cap()},  // 0: none (`pdsim simulate --like`)
                  {"broken", broken_ ? broken_reason_ : ""}};
    if (ctx_.gpu != nullptr) {
        const GpuInfo& g = ctx_.gpu->info();
        stats["device"] = fmt::format("cuda:{} ({})", g.device, g.name);
        stats["decode_graphs"] = ctx_.gpu->decode_graphs_state();
        stats["graph_forwards"] = graph_forwards_;
    }
    auto engine_stats = [](const transfer::EngineStats& s) {
        return json{{"submitted", s.requests_submitted},
                    {"completed", s.requests_completed},
                    {"failed", s.requests_failed},
                    {"bytes", s.bytes},
                    {"messages", s.messages},
                    {"staged_bytes", s.staged_bytes},
                    {"layers", s.layers}};
    };
    if (sender_) stats["sender"] = engine_stats(sender_->stats());
    if (receiver_) stats["receiver"] = engine_stats(receiver_->stats());
    if (state_sender_) stats["state_sender"] = engine_stats(state_sender_->stats());
    if (state_receiver_) stats["state_receiver"] = engine_stats(state_receiver_->stats());
    json threads = json::object();
    for (const auto& [name, cpu] : thread_cpu_s_) threads[name] = cpu;
    stats["thread_cpu_s"] = std::move(threads);
    r.stats = std::move(stats);
    return r;
}

}  // namespace detail

PhaseServer::PhaseServer(RankContext& ctx, Phase phase, KvTransports kv)
    : server_(std::make_unique<detail::Server>(ctx, phase, kv)) {}

PhaseServer::~PhaseServer() = default;

// Messages are decoded without exceptions (protocol.h); what is left is nlohmann::json's own
// (e.g. the forward arguments): an error of this rank.
Status PhaseServer::setup() {
    try {
        return server_->setup();
    } catch (const std::exception& e) {
        return PDSIM_ERROR(StatusCode::kInternal, "set-up: {}", e.what());
    }
}

Status PhaseServer::run() {
    try {
        return server_->run();
    } catch (const std::exception& e) {
        return PDSIM_ERROR(StatusCode::kInternal, "{}", e.what());
    }
}

RankResult PhaseServer::finish(const Status& error) {
    server_->shutdown_engines();
    RankResult result = server_->result();
    if (!error.ok()) result.error = error.to_string();
    return result;
}

}  // namespace pdsim::testbed
