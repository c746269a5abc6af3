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
    counter_ = std::move(parts.counter);
    validator_ = std::move(parts.validator);
    PDSIM_ASSIGN_OR_RETURN(backend_, std::move(backend));

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
        PDSIM_ASSIGN_OR_RETURN(
            transfer::KvLayout layout,
            transfer::KvLayout::from_mha_pool(*pool_, tp, ctx_.info.tp_rank, m.num_kv_heads));
        auto hook = [this](const transfer::TransferEvent& ev) { on_engine_event(ev); };
        if (role_ == Role::kPrefill) {
            transfer::SenderOptions so;
            so.request_timeout = timeout_;
            so.validator = validator_.get();
            so.on_event = hook;
            so.num_workers = 1;
            so.data_transport = kv_.data;
            so.device_gate = cfg_.options.device_gate;
            PDSIM_ASSIGN_OR_RETURN(sender_,
                                   transfer::KvSender::create(*kv_.control, layout, *counter_, so));
        } else {
            transfer::ReceiverOptions ro;
            ro.request_timeout = timeout_;
            ro.validator = validator_.get();
            ro.on_event = hook;
            ro.num_workers = 1;
            ro.data_transport = kv_.data;
            PDSIM_ASSIGN_OR_RETURN(receiver_,
                                   transfer::KvReceiver::create(*kv_.control, layout, ro));
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
        transfer::ReceiveRequestSpec spec;
        spec.request_id = admit.id;
        spec.prefill_ranks = std::move(admit.prefill_ranks);
        spec.dst_pages = std::move(admit.pages);
        spec.num_tokens = admit.input_len;
        spec.timeout = timeout_;
        Status st = receiver_->submit(spec);
        if (st.ok()) {
            engine_active_.insert(spec.request_id);
        } else {
            ReadyReport report;
            report.id = spec.request_id;
            report.ok = false;
            report.error = "receiver submit: " + st.message();
            PDSIM_RETURN_IF_ERROR(
                ctx_.mbox->send(ctx_.leader(), Channel::kInstance, encode_message(report)));
        }
    } else if (k == ReleaseMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(ReleaseMsg release, decode_message<ReleaseMsg>(m.body));
        const uint64_t id = release.id;
        if (receiver_) receiver_->release(id).ignore_error();
        if (sender_) sender_->release(id).ignore_error();
        first_slots_.erase(id);
    } else if (k == EngineAbortMsg::kKind) {
        PDSIM_ASSIGN_OR_RETURN(EngineAbortMsg abort, decode_message<EngineAbortMsg>(m.body));
        Status st = Status();
        if (receiver_) st = receiver_->abort(abort.id, "its instance leader gave up on it");
        if (sender_) st = sender_->abort(abort.id, "its instance leader gave up on it");
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
            StatusOr<transfer::RequestStatus> es =
                sender_ ? sender_->status(outcome.id) : receiver_->status(outcome.id);
            outcome.pages_idle = !(es.ok() && es->pages_in_use);
        }
        const json report =
            sender_ ? encode_message(SentReport{outcome}) : encode_message(ReadyReport{outcome});
        PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance, report));
        if (!outcome.pages_idle) {
            quiescing_.insert(outcome.id);
        } else if (sender_) {
            sender_->release(outcome.id).ignore_error();
            first_slots_.erase(outcome.id);
        }
    }
    for (auto it = quiescing_.begin(); it != quiescing_.end();) {
        StatusOr<transfer::RequestStatus> es =
            sender_ ? sender_->status(*it) : receiver_->status(*it);
        if (es.ok() && es->pages_in_use) {
            ++it;
            continue;
        }
        PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance,
                                              encode_message(PagesIdleMsg{.id = *it})));
        if (sender_) {
            sender_->release(*it).ignore_error();
            first_slots_.erase(*it);
        }
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
