#include "sim/testbed/server.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "common/speed_probe.h"
#include "common/thread_info.h"
#include "sim/testbed/gpu_rank.h"
#include "sim/testbed/rank_builder.h"
#include "sim/testbed/router.h"
#include "sim/testbed/server_internal.h"
#include "sim/testbed/window.h"
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
    // The model outlives the phase; its sliding layers must not keep this phase's pool.
    if (ctx_.cpu_model != nullptr && window_pool_ != nullptr) {
        ctx_.cpu_model->attach_window_pool(nullptr).ignore_error();
    }
}

Status Server::setup() {
    // GPU ranks of one process set up one at a time (gpu_rank.h gpu_setup_mutex: the decode
    // graphs' capture must not run beside another rank's allocations).
    std::unique_lock<std::mutex> gpu_setup;
    if (ctx_.gpu != nullptr) gpu_setup = std::unique_lock<std::mutex>(gpu_setup_mutex());
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
    build.stream_caller_runs = o_.stream_caller_runs;
    build.stream = ctx_.gpu != nullptr ? &ctx_.gpu->stream() : nullptr;
    // The per-request pools are sized by the requests the instance runs at once: the router
    // keeps at most effective_max_inflight() in flight per instance, and a prefill instance holds
    // a request's state and ring a while longer, until its transfer completes (twice that, then;
    // admission waits for a free slot beyond it). Never more than one per page of the full
    // layers' pool: a request holds at least one.
    const int64_t running = std::min<int64_t>(pages - 1, 2 * effective_max_inflight(cfg_));
    build.state_slots = static_cast<int>(1 + running);
    if (has_cache_groups(m) && m.count_layers(model::LayerKind::kSlidingWindow) > 0) {
        // The sliding layers' pool: a ring each, never more pages than the full layers' pool.
        build.window_pages = static_cast<int>(
            1 + std::min<int64_t>(pages - 1, running * window_ring_size(int64_t{1} << 40)));
    }
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
    window_pool_ = std::move(parts.window_pool);
    states_ = std::move(parts.states);
    counter_ = std::move(parts.counter);
    validator_ = std::move(parts.validator);
    state_validator_ = std::move(parts.state_validator);
    window_validator_ = std::move(parts.window_validator);
    PDSIM_ASSIGN_OR_RETURN(backend_, std::move(backend));
    if (states_ != nullptr) {
        if (ctx_.cpu_model == nullptr) {
            return PDSIM_ERROR(StatusCode::kInternal, "recurrent layers without a CPU model");
        }
        PDSIM_RETURN_IF_ERROR(ctx_.cpu_model->attach_state_pool(states_.get()));
    }
    if (window_pool_ != nullptr) {
        if (ctx_.cpu_model == nullptr) {
            return PDSIM_ERROR(StatusCode::kInternal, "a sliding layers' pool without a CPU model");
        }
        PDSIM_RETURN_IF_ERROR(ctx_.cpu_model->attach_window_pool(window_pool_.get()));
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
        // The cache groups beside the KV engine's full-attention layers (docs/design.md "Hybrid
        // models"): the sliding layers' window and the recurrent states, each its own engine.
        // --fault state-not-sent: neither side runs the states' engine (the deployed bug: the
        // recurrent layers are left out of the transfer), so the decode side continues from
        // whatever its state slot holds.
        window_.on = has_cache_groups(m) && m.count_layers(model::LayerKind::kSlidingWindow) > 0;
        state_.on = states_ != nullptr && o_.fault != Fault::kStateNotSent;
        const int engines = 1 + (window_.on ? 1 : 0) + (state_.on ? 1 : 0);
        transfer::Transport* control = nullptr;
        transfer::Transport* data = nullptr;
        if (engines > 1) {
            // The engines share the rank's transports, each on its own tag space.
            constexpr transfer::Tag kMinTagSpace = 1024;
            PDSIM_ASSIGN_OR_RETURN(control_spaces_,
                                   transfer::split_tag_space(*kv_.control, engines, kMinTagSpace));
            if (kv_.data != nullptr && kv_.data != kv_.control) {
                PDSIM_ASSIGN_OR_RETURN(data_spaces_,
                                       transfer::split_tag_space(*kv_.data, engines, kMinTagSpace));
            }
        }
        // Engine i's control and data transports (data null: the control transport carries it).
        auto transports_of = [&](int i) -> std::pair<transfer::Transport*, transfer::Transport*> {
            if (engines == 1) return {kv_.control, kv_.data};
            const bool own_data = kv_.data != nullptr && kv_.data != kv_.control;
            return {control_spaces_[static_cast<size_t>(i)].get(),
                    own_data ? data_spaces_[static_cast<size_t>(i)].get() : nullptr};
        };
        int next_space = 0;
        auto take_space = [&](GroupEngine* g) {
            auto [c, d] = transports_of(next_space++);
            if (g == nullptr) {
                control = c;
                data = d;
            } else {
                g->control = c;
                g->data = d;
            }
        };
        take_space(nullptr);
        if (window_.on) {
            take_space(&window_);
            if (window_pool_ == nullptr) {
                return PDSIM_ERROR(StatusCode::kInternal, "sliding layers without their pool");
            }
            PDSIM_ASSIGN_OR_RETURN(window_.layout,
                                   kv_engine_layout(*window_pool_, m, tp, ctx_.info.tp_rank,
                                                    model::LayerKind::kSlidingWindow));
            window_.layer_steps = layers_of(m, model::LayerKind::kSlidingWindow);
            window_.validator = window_validator_.get();
        }
        if (state_.on) {
            take_space(&state_);
            PDSIM_ASSIGN_OR_RETURN(state_.layout, state_layout(*states_, m, tp, ctx_.info.tp_rank));
            if (role_ == Role::kPrefill && o_.fault == Fault::kStateTpMisslice) {
                PDSIM_ASSIGN_OR_RETURN(state_.layout, misslice(state_.layout));
            }
            state_.layer_steps = layers_of(m, model::LayerKind::kRecurrent);
            state_.validator = state_validator_.get();
        }
        if (ctx_.gpu == nullptr) {
            digest_kv_layout_ = layout;
            if (window_.on) digest_window_layout_ = window_.layout;
            if (states_ != nullptr) {
                PDSIM_ASSIGN_OR_RETURN(digest_state_layout_,
                                       state_layout(*states_, m, tp, ctx_.info.tp_rank));
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
            if (has_cache_groups(m))
                so.layer_steps = layers_of(m, model::LayerKind::kFullAttention);
            PDSIM_ASSIGN_OR_RETURN(sender_,
                                   transfer::KvSender::create(*control, layout, *counter_, so));
            for (GroupEngine* g : groups()) {
                so.validator = g->validator;
                so.data_transport = g->data;
                so.layer_steps = g->layer_steps;
                so.on_event = nullptr;  // the KV engine's layer events are the timeline's
                PDSIM_ASSIGN_OR_RETURN(
                    g->sender, transfer::KvSender::create(*g->control, g->layout, *counter_, so));
            }
        } else {
            transfer::ReceiverOptions ro;
            ro.request_timeout = timeout_;
            ro.validator = validator_.get();
            ro.on_event = hook;
            ro.num_workers = 1;
            ro.data_transport = data;
            PDSIM_ASSIGN_OR_RETURN(receiver_, transfer::KvReceiver::create(*control, layout, ro));
            for (GroupEngine* g : groups()) {
                ro.validator = g->validator;
                ro.data_transport = g->data;
                ro.on_event = nullptr;
                PDSIM_ASSIGN_OR_RETURN(g->receiver,
                                       transfer::KvReceiver::create(*g->control, g->layout, ro));
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

std::vector<Server::GroupEngine*> Server::groups() {
    std::vector<GroupEngine*> out;
    for (GroupEngine* g : {&window_, &state_}) {
        if (g->on) out.push_back(g);
    }
    return out;
}

StatusOr<transfer::RequestStatus> Server::engine_status(uint64_t id) {
    StatusOr<transfer::RequestStatus> kv = sender_ ? sender_->status(id) : receiver_->status(id);
    if (!kv.ok()) return kv;
    using transfer::RequestState;
    transfer::RequestStatus out = *kv;
    for (GroupEngine* g : groups()) {
        if (!g->sender && !g->receiver) continue;
        StatusOr<transfer::RequestStatus> st =
            g->sender ? g->sender->status(id) : g->receiver->status(id);
        if (!st.ok()) return st.status().with_context(fmt::format("the {}' transfer", g->what));
        out.bytes += st->bytes;
        out.pages_in_use = out.pages_in_use || st->pages_in_use;
        if (out.state == RequestState::kFailed) continue;
        if (st->state == RequestState::kFailed) {
            out.state = RequestState::kFailed;
            out.reason = fmt::format("the {}' transfer: {}", g->what, st->reason);
        } else if (out.state == RequestState::kSuccess) {
            out.state = st->state;  // in progress until every group succeeded
        }
    }
    if (out.state == RequestState::kFailed) {
        // The other engines' side of the request ends too (a no-op once terminal).
        engine_abort(id, out.reason).ignore_error();
    }
    return out;
}

Status Server::engine_abort(uint64_t id, const std::string& why) {
    Status st;
    if (sender_) st = sender_->abort(id, why);
    if (receiver_) st = receiver_->abort(id, why);
    for (GroupEngine* g : groups()) {
        if (g->sender) g->sender->abort(id, why).ignore_error();
        if (g->receiver) g->receiver->abort(id, why).ignore_error();
    }
    return st;
}

void Server::engine_release(uint64_t id) {
    if (sender_) sender_->release(id).ignore_error();
    if (receiver_) receiver_->release(id).ignore_error();
    for (GroupEngine* g : groups()) {
        if (g->sender) g->sender->release(id).ignore_error();
        if (g->receiver) g->receiver->release(id).ignore_error();
    }
    first_slots_.erase(id);
}

transfer::PagePins* Server::GroupEngine::pins() {
    if (sender) return &sender->pins();
    if (receiver) return &receiver->pins();
    return nullptr;
}

Status Server::engine_free(const std::vector<int32_t>& pages,
                           const std::vector<int32_t>& window_ring, int32_t state_slot) {
    // Each cache group's part: its engine's pins (null: no engine moves that group), its pool
    // and the request's pages there.
    struct Part {
        transfer::PagePins* pins;
        kv::KVPool* pool;
        std::span<const int32_t> pages;
        const char* what;
    };
    const int32_t slot[] = {state_slot};
    const Part parts[] = {
        {state_.pins(), states_.get(), std::span(slot, state_slot > 0 ? 1 : 0), "state slot"},
        {window_.pins(), window_pool_.get(), window_ring, "sliding-window page"},
        {sender_ ? &sender_->pins() : &receiver_->pins(), pool_.get(), pages, "page"}};
    // Nothing is freed while any engine still pins a page, a ring page or the slot: checked
    // first, so that a retry finds everything as it was.
    for (const Part& part : parts) {
        if (part.pins == nullptr) continue;
        for (int32_t page : part.pages) {
            if (part.pins->is_pinned(page)) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition, "{} {} is in flight", part.what,
                                   page);
            }
        }
    }
    for (const Part& part : parts) {
        if (part.pages.empty()) continue;
        if (part.pins != nullptr) {
            PDSIM_RETURN_IF_ERROR(part.pins->free_pages(part.pool->allocator(), part.pages));
        } else {
            free_unpinned(part.pool, part.pages, part.what);
        }
    }
    return {};
}

void Server::free_unpinned(kv::KVPool* pool, std::span<const int32_t> pages, const char* what) {
    if (pages.empty() || pool == nullptr) return;
    Status st = pool->allocator().free(pages);
    if (!st.ok()) {
        PDSIM_LOG_WARN("rank {}: free {}s {}: {}", ctx_.rank, what, fmt::join(pages, ","),
                       st.to_string());
    }
}

std::vector<int32_t> Server::window_pages(std::span<const int32_t> ring, int64_t input_len) const {
    const int64_t ps = o_.page_size;
    const int64_t first = window_start(input_len, cfg_.model.sliding_window, o_.page_size);
    return ring_pages(ring, first / ps, (input_len + ps - 1) / ps);
}

int Server::window_ring_size(int64_t tokens) const {
    // A decode rank extends by one position per forward; the others by up to a chunk.
    const int64_t max_extend = role_ == Role::kDecode ? 1 : o_.chunk_size;
    return window_ring_pages(cfg_.model.sliding_window, o_.page_size, max_extend,
                             std::max<int64_t>(1, tokens));
}

Status Server::engine_submit_receive(uint64_t id, const std::vector<int>& prefill_ranks,
                                     const std::vector<int32_t>& pages,
                                     const std::vector<int32_t>& window_ring, int64_t input_len,
                                     int32_t state_slot) {
    transfer::ReceiveRequestSpec spec;
    spec.request_id = id;
    spec.prefill_ranks = prefill_ranks;
    spec.dst_pages = pages;
    spec.num_tokens = input_len;
    spec.timeout = timeout_;
    PDSIM_RETURN_IF_ERROR(receiver_->submit(spec));
    receive_info_[id] = {pages, window_ring, input_len, state_slot};
    for (GroupEngine* g : groups()) {
        if (!g->receiver) continue;
        if (g == &window_) {
            // The sliding layers' tokens: the window's positions only (window.h).
            const int64_t first = window_start(input_len, cfg_.model.sliding_window, o_.page_size);
            spec.dst_pages = window_pages(window_ring, input_len);
            spec.num_tokens = input_len - first;
        } else {
            spec.dst_pages = {state_slot};
            spec.num_tokens = 1;
        }
        Status st = g->receiver->submit(spec);
        if (!st.ok()) {
            engine_abort(id, fmt::format("the {}' receive was refused", g->what)).ignore_error();
            return st.with_context(fmt::format("the {}' receive", g->what));
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
                                          admit.window_ring, admit.input_len, admit.state_slot);
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
    const int probe_ms = o_.speed_probe_ms;
    std::optional<SpeedSampler> speed;
    if (ctx_.gpu == nullptr && probe_ms > 0) {
        speed.emplace(std::chrono::milliseconds(probe_ms));
        speed->start();
    }
    cpu_at_start_ = thread_cpu_times();
    Status st = ctx_.is_leader() ? leader_loop() : follower_loop();
    if (speed) {
        speed->stop();
        speed_samples_ms_ = speed->samples_ms();
    }
    const std::vector<ThreadCpu> at_end = thread_cpu_times();
    thread_cpu_s_ = cpu_by_name(cpu_at_start_, at_end);
    thread_wait_s_ = wait_by_name(cpu_at_start_, at_end);
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
    // The other cache groups' checks (their layers numbered within the group, counted apart).
    for (auto [validator, what] : {std::pair{window_validator_.get(), "sliding window: "},
                                   std::pair{state_validator_.get(), "recurrent states: "}}) {
        if (validator == nullptr) continue;
        transfer::OrderingReport rep = validator->report();
        r.ordering.checked_layers += rep.checked_layers;
        for (const auto& v : rep.violations) {
            r.ordering.violations.push_back(what + v.to_string());
        }
    }
    json stats = {{"forwards", forwards_},
                  {"forward_tokens", forward_tokens_},
                  {"compute_us", compute_us_},
                  {"record_violations", record_violations_},
                  {"threads", ctx_.threads},
                  // Where the rank ran (`pdsim simulate --like` binds its ranks the same way).
                  {"cpus", allowed_cpus()},
                  {"online_cpus", std::thread::hardware_concurrency()},
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
    if (receiver_) {
        stats["receiver"] = engine_stats(receiver_->stats());
        stats["arrival_waits"] = arrival_waits_;
    }
    for (GroupEngine* g : {&window_, &state_}) {
        const std::string key = g == &window_ ? "window_" : "state_";
        if (g->sender) stats[key + "sender"] = engine_stats(g->sender->stats());
        if (g->receiver) stats[key + "receiver"] = engine_stats(g->receiver->stats());
    }
    // Each cache group's pool: pages, bytes, and the most pages its requests held at once (the
    // instance leader allocates them; a TP follower's pools mirror its leader's).
    auto pool_stats = [](const kv::KVPool& pool, int64_t peak) {
        return json{{"layers", pool.held_layers().size()},
                    {"pages", pool.allocator().capacity()},
                    {"page_size", pool.page_size()},
                    {"bytes", pool.total_bytes()},
                    {"peak_pages", peak}};
    };
    if (pool_ != nullptr) {
        json pools = {{"full", pool_stats(*pool_, peak_pages_[0])}};
        if (window_pool_ != nullptr) pools["sliding"] = pool_stats(*window_pool_, peak_pages_[1]);
        if (states_ != nullptr) pools["states"] = pool_stats(*states_, peak_pages_[2]);
        stats["kv_pools"] = std::move(pools);
    }
    if (ctx_.gpu == nullptr && o_.speed_probe_ms > 0) {
        stats["speed_probe"] =
            speed_probe_json(speed_samples_ms_, std::chrono::milliseconds(o_.speed_probe_ms));
    }
    json threads = json::object();
    for (const auto& [name, cpu] : thread_cpu_s_) threads[name] = cpu;
    stats["thread_cpu_s"] = std::move(threads);
    json waits = json::object();
    for (const auto& [name, wait] : thread_wait_s_) waits[name] = wait;
    stats["thread_wait_s"] = std::move(waits);
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
