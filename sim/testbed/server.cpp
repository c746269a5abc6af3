#include "sim/testbed/server.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/cpu_stream.h"
#include "common/logging.h"
#include "common/thread_info.h"
#include "sim/policy/batching.h"
#include "sim/testbed/pd_backend.h"
#include "sim/testbed/prompt.h"
#include "sim/testbed/protocol.h"
#include "sim/testbed/rank_builder.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/kv_receiver.h"
#include "transfer/engine/kv_sender.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::testbed {

std::string_view phase_name(Phase phase) {
    return phase == Phase::kColocated ? "colocated" : "disagg";
}

namespace {

using json = nlohmann::json;
using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr int kTidSched = 0, kTidCompute = 1, kTidRecord = 2, kTidSend = 3, kTidRecv = 4;
constexpr size_t kMaxTimelineEvents = 300000;
constexpr size_t kMaxEngineEvents = 2000000;

enum class Role { kColocated, kPrefill, kDecode };

// Timeline events on this rank's clock: [tid, name, cat, ts_us, dur_us (-1: instant), args].
class LocalTimeline {
public:
    void slice(int tid, std::string name, const char* cat, double ts, double dur,
               json args = json()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (events_.size() >= kMaxTimelineEvents) return;
        events_.push_back({tid, std::move(name), cat, ts, std::max(0.0, dur), std::move(args)});
    }
    void instant(int tid, std::string name, const char* cat, double ts) {
        std::lock_guard<std::mutex> lock(mu_);
        if (events_.size() >= kMaxTimelineEvents) return;
        events_.push_back({tid, std::move(name), cat, ts, -1.0, json()});
    }
    std::vector<TimelineRecord> take() {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<TimelineRecord> out = std::move(events_);
        events_.clear();
        return out;
    }

private:
    std::mutex mu_;
    std::vector<TimelineRecord> events_;
};

struct Req {
    uint64_t id = 0;
    int32_t in = 0, out = 0;
    std::vector<int64_t> hash;
    int p_inst = -1, d_inst = -1;
    std::vector<int32_t> prompt;
    std::vector<int32_t> pages;
    bool pages_freed = false;
    int64_t prefilled = 0;
    std::vector<int32_t> tokens;
    std::vector<double> token_t;
    double t_prefill_start = -1;
    double t_first = -1;
    bool terminal = false;
    bool cancelled = false;
    // disaggregated prefill: TP ranks whose sender finished the request (ok or not)
    std::set<int> sent;
    bool last_submitted = false;
    bool send_failed = false;
    // disaggregated decode: TP ranks whose receiver has everything
    std::set<int> ready;
    bool receive_failed = false;
    int32_t first_token = -1;
    uint64_t bytes = 0;
    std::string error;
};

class Server {
public:
    Server(RankContext& ctx, Phase phase, transfer::Transport* kv)
        : ctx_(ctx), cfg_(*ctx.config), o_(ctx.config->options), phase_(phase), kv_(kv) {
        if (phase == Phase::kColocated) {
            role_ = Role::kColocated;
        } else {
            role_ = ctx.info.role == topo::Role::kPrefill ? Role::kPrefill : Role::kDecode;
        }
        num_layers_ = cfg_.model.num_layers;
        timeout_ = milliseconds(static_cast<int64_t>(o_.request_timeout_s * 1000));
    }

    ~Server() {
        ctx_.model->set_layer_hook(nullptr);
        shutdown_engines();
    }

    Status setup();
    Status run();
    RankResult result();
    void shutdown_engines() {
        if (sender_) sender_->shutdown(transfer::ShutdownMode::kGraceful);
        if (receiver_) receiver_->shutdown(transfer::ShutdownMode::kGraceful);
    }

private:
    // ---- shared ----
    Status execute(const Plan& plan, std::vector<int32_t>* next);
    json forward_args(const Plan& plan) const;
    void on_engine_event(const transfer::TransferEvent& ev);
    void poll_engine(std::vector<std::tuple<uint64_t, bool, std::string, int32_t, uint64_t>>* out);
    template <class Report>
    Status send_router(Report report) {
        report.phase = phase_name(phase_);
        return ctx_.mbox->send(0, Channel::kRouter, encode_message(report));
    }
    template <class Msg>
    Status send_followers(const Msg& msg) {
        const json j = encode_message(msg);
        for (size_t i = 1; i < ctx_.instance_ranks.size(); ++i) {
            PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.instance_ranks[i], Channel::kInstance, j));
        }
        return {};
    }
    void mark_broken(const Status& st);

    // ---- leader ----
    Status leader_loop();
    Status on_submit(const SubmitMsg& msg);
    void on_follower_outcome(const EngineOutcomeFields& outcome, bool sent, int src);
    Status admit();
    Status schedule_extend(bool* did);
    Status schedule_decode(bool* did);
    Status after_engine_poll();
    Status fail_request(Req& r, const std::string& why);
    Status finish_request(Req& r);
    Status try_free(Req& r);
    Status report_first(Req& r);
    int64_t decode_kv_cap() const {
        return kMaxDecodeKvTokensPerThread * std::max(1, ctx_.threads);
    }
    policy::BatchingOptions batching() const {
        return {o_.chunk_size, o_.max_batch_tokens, o_.max_decode_batch, decode_kv_cap()};
    }

    // ---- follower ----
    Status follower_loop();

    RankContext& ctx_;
    const ResolvedConfig& cfg_;
    const TestbedOptions& o_;
    Phase phase_;
    Role role_;
    transfer::Transport* kv_;
    int num_layers_ = 1;
    milliseconds timeout_;

    // Per-phase device objects (declaration order = reverse destruction order).
    std::unique_ptr<runtime::CpuStream> stream_;
    std::unique_ptr<kv::MHATokenToKVPool> pool_;
    std::unique_ptr<pd::StepCounter> counter_;
    std::unique_ptr<transfer::OrderingValidator> validator_;
    std::unique_ptr<PdAttentionBackend> backend_;
    std::unique_ptr<transfer::KvSender> sender_;
    std::unique_ptr<transfer::KvReceiver> receiver_;
    std::map<uint64_t, std::unique_ptr<int32_t>> first_slots_;

    // Engine bookkeeping of this rank (leader and followers).
    std::set<uint64_t> engine_active_;  // added to the sender / submitted to the receiver

    // Leader state.
    std::map<uint64_t, Req> reqs_;
    std::deque<uint64_t> admit_q_, prefill_q_, running_;
    std::vector<uint64_t> receiving_;
    bool last_was_extend_ = false;
    bool broken_ = false;
    std::string broken_reason_;
    bool ended_ = false;

    // Metrics.
    LocalTimeline timeline_;
    std::mutex ev_mu_;
    std::vector<EngineEventRecord> engine_events_;
    std::map<uint64_t, double> prefill_end_;
    std::vector<double> layer_t0_;
    std::string hook_label_;
    int64_t forwards_ = 0, forward_tokens_ = 0;
    double compute_us_ = 0;
    int64_t record_violations_ = 0;
    // CPU seconds per thread name over run() (the testbed's own threads compete with the compute
    // threads for the node's cores: the report shows how much).
    std::vector<ThreadCpu> cpu_at_start_;
    std::map<std::string, double> thread_cpu_s_;
};

Status Server::setup() {
    const model::ModelConfig& m = cfg_.model;
    const int tp = ctx_.info.tp_size;
    const int hkv = m.num_kv_heads / tp;
    const int64_t page_bytes =
        static_cast<int64_t>(m.num_layers) * 2 * hkv * m.head_dim * 4 * o_.page_size;
    const int64_t pages =
        std::max<int64_t>(2, (o_.kv_pool_mb << 20) / std::max<int64_t>(1, page_bytes) + 1);
    RankBuildOptions build;
    build.model = &m;
    build.tp_size = tp;
    build.tp_rank = ctx_.info.tp_rank;
    build.threads = ctx_.threads;
    build.backend = o_.backend;
    build.page_size = o_.page_size;
    build.num_pages = static_cast<int>(std::min<int64_t>(pages, 1 << 24));
    build.stream_name = fmt::format("compute-r{}", ctx_.rank);
    build.stream_timeout = timeout_ + milliseconds(5000);
    build.step_counter = role_ == Role::kPrefill;
    build.validator = role_ != Role::kColocated;
    build.validator_rank = ctx_.rank;
    PDSIM_ASSIGN_OR_RETURN(RankParts parts, build_rank_parts(build));
    PdBackendSide side;
    side.prefill = role_ == Role::kPrefill;
    side.fault = role_ == Role::kPrefill ? o_.fault : Fault::kNone;
    side.max_bs = std::max(o_.max_batch_tokens, o_.max_decode_batch);
    side.max_pages_per_seq = build.num_pages;
    side.on_record = [this](int layer, double t) {
        timeline_.instant(kTidRecord, fmt::format("record L{}", layer), "record", t);
    };
    auto backend = build_pd_backend(build, parts, side);
    // Members in the parts' order (the stream outlives what enqueues on it), built or not.
    stream_ = std::move(parts.stream);
    pool_ = std::move(parts.pool);
    counter_ = std::move(parts.counter);
    validator_ = std::move(parts.validator);
    PDSIM_ASSIGN_OR_RETURN(backend_, std::move(backend));

    layer_t0_.assign(static_cast<size_t>(m.num_layers), 0.0);
    ctx_.model->set_layer_hook([this](int layer, bool begin) {
        const double t = now_us();
        if (begin) {
            layer_t0_[static_cast<size_t>(layer)] = t;
        } else {
            const double t0 = layer_t0_[static_cast<size_t>(layer)];
            timeline_.slice(kTidCompute, fmt::format("L{} {}", layer, hook_label_), "compute", t0,
                            t - t0);
        }
    });

    if (role_ != Role::kColocated) {
        if (kv_ == nullptr)
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
            PDSIM_ASSIGN_OR_RETURN(sender_,
                                   transfer::KvSender::create(*kv_, layout, *counter_, so));
        } else {
            transfer::ReceiverOptions ro;
            ro.request_timeout = timeout_;
            ro.validator = validator_.get();
            ro.on_event = hook;
            ro.num_workers = 1;
            PDSIM_ASSIGN_OR_RETURN(receiver_, transfer::KvReceiver::create(*kv_, layout, ro));
        }
    }
    return {};
}

void Server::on_engine_event(const transfer::TransferEvent& ev) {
    using K = transfer::TransferEvent::Kind;
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

// The batch a forward slice describes, in the calibrated model's features (sim/cost/calibrated.h),
// so that `pdsim calibrate --from-timeline` can fit the testbed's own forwards; tp_rank tells a
// TP follower's copy of the forward from its leader's.
json Server::forward_args(const Plan& plan) const {
    json a = {{"instance", ctx_.info.instance},
              {"tp", ctx_.info.tp_size},
              {"tp_rank", ctx_.info.tp_rank},
              {"threads", ctx_.threads}};
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
    for (const auto& e : plan.entries) entries.push_back({e.id, e.t0, e.t1, e.tokens, e.pages});
    auto segs = std::make_shared<Segments>();
    model::StepBatch b = build_step_batch(plan.mode, entries, o_.page_size, segs.get());
    const auto off = static_cast<int64_t>(b.out_cache_loc.size());
    const bool prefill = role_ == Role::kPrefill && !attn::is_decode(plan.mode);
    backend_->set_segments(prefill ? segs : nullptr);

    int64_t begin = 0, aux_begin = 0, ready_before = 0;
    bool any_last = false;
    for (const auto& e : plan.entries) any_last |= e.last;
    std::vector<const PlanEntry*> chunks;
    if (prefill) {
        for (const auto& e : plan.entries) {
            if (e.first) {
                Status st = sender_->add_request({e.id, e.input_len, timeout_});
                if (!st.ok() && st.code() != StatusCode::kAlreadyExists) {
                    PDSIM_LOG_WARN("rank {}: add_request {}: {}", ctx_.rank, e.id, st.to_string());
                }
                engine_active_.insert(e.id);
                first_slots_[e.id] = std::make_unique<int32_t>(-1);
            }
            chunks.push_back(&e);
        }
        ready_before = counter_->query_ready_cache_step();
        aux_begin = counter_->current_aux_step();
        begin = counter_->advance_step(num_layers_, any_last ? 1 : 0);
    }
    const std::string label = attn::is_decode(plan.mode)
                                  ? fmt::format("decode bs={}", plan.entries.size())
                                  : fmt::format("extend bs={} T={}", plan.entries.size(), off);
    PDSIM_RETURN_IF_ERROR(stream_->enqueue([this, label] {
        hook_label_ = label;
        return Status();
    }));
    auto out = std::make_shared<std::vector<int32_t>>(plan.entries.size(), -1);
    const double t_start = now_us();
    Status st = ctx_.model->forward(b, *backend_, *pool_, out->data());
    if (st.ok() && prefill && any_last) {
        // The first sampled tokens travel with the last chunks: copy them where the sender reads
        // them, then publish the aux step.
        std::vector<std::pair<size_t, int32_t*>> dst;
        for (size_t i = 0; i < plan.entries.size(); ++i) {
            if (plan.entries[i].last) dst.emplace_back(i, first_slots_[plan.entries[i].id].get());
        }
        st = stream_->enqueue([out, dst] {
            for (auto& [i, p] : dst) *p = (*out)[i];
            return Status();
        });
        if (st.ok()) st = counter_->record_aux();
    }
    auto submit_chunks = [&](bool known_first) {
        for (const PlanEntry* e : chunks) {
            transfer::SendChunk c;
            c.request_id = e->id;
            c.src_pages = e->pages;
            c.token_begin = e->t0;
            c.token_end = e->t1;
            c.begin_step = begin;
            c.is_last = e->last;
            if (e->last) {
                if (known_first) {
                    c.first_token = *first_slots_[e->id];
                } else {
                    c.first_token_src = first_slots_[e->id].get();
                    c.first_token_aux_step = aux_begin;
                }
            }
            Status cs = sender_->submit_chunk(std::move(c));
            if (!cs.ok())
                PDSIM_LOG_WARN("rank {}: submit_chunk {}: {}", ctx_.rank, e->id, cs.to_string());
        }
    };
    if (st.ok() && prefill && o_.layerwise) submit_chunks(false);
    if (st.ok()) st = stream_->synchronize(timeout_ + milliseconds(5000));
    const double t_done = now_us();
    ++forwards_;
    forward_tokens_ += off;
    compute_us_ += t_done - t_start;
    timeline_.slice(kTidSched, label, "forward", t_start, t_done - t_start, forward_args(plan));
    if (!st.ok()) {
        mark_broken(st);
        return st;
    }
    if (prefill) {
        const int64_t ready_after = counter_->query_ready_cache_step();
        const int64_t delta = pd::StepCounter::wrap(ready_after - ready_before);
        if (delta != num_layers_) {
            transfer::Violation v;
            v.request = plan.entries.front().id;
            v.rank = ctx_.rank;
            v.what =
                fmt::format("extend forward at step {} ({} layers) published {} StepCounter steps",
                            begin, num_layers_, delta);
            validator_->add_violation(v);
            ++record_violations_;
            mark_broken(Status(StatusCode::kDataLoss,
                               "StepCounter out of step with the KV writes: " + v.what));
        }
        if (!o_.layerwise) submit_chunks(true);
        for (const auto& e : plan.entries) {
            if (e.last) prefill_end_[e.id] = t_done;
        }
        if (delta != num_layers_) return Status(StatusCode::kDataLoss, broken_reason_);
    }
    *next = *out;
    return {};
}

// Terminal engine states of this rank's active requests: (id, ok, error, first token, bytes).
void Server::poll_engine(
    std::vector<std::tuple<uint64_t, bool, std::string, int32_t, uint64_t>>* out) {
    for (auto it = engine_active_.begin(); it != engine_active_.end();) {
        StatusOr<transfer::RequestStatus> s =
            sender_ ? sender_->status(*it) : receiver_->status(*it);
        if (!s.ok()) {
            out->emplace_back(*it, false, s.status().message(), -1, 0);
            it = engine_active_.erase(it);
            continue;
        }
        if (!transfer::is_terminal(s->state)) {
            ++it;
            continue;
        }
        const bool ok = s->state == transfer::RequestState::kSuccess;
        out->emplace_back(*it, ok, s->reason, s->has_first_token ? s->first_token : -1, s->bytes);
        it = engine_active_.erase(it);
    }
}

// ---------------------------------------------------------------------------------------------
// Leader
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

// Frees the request's pages once no transfer can touch them (pinned pages are refused: retried).
Status Server::try_free(Req& r) {
    if (r.pages_freed || r.pages.empty()) {
        r.pages_freed = true;
        return {};
    }
    if (sender_ || receiver_) {
        if (engine_active_.count(r.id) != 0) return {};  // still in flight: retried later
        transfer::PagePins& pins = sender_ ? sender_->pins() : receiver_->pins();
        Status st = pins.free_pages(pool_->allocator(), r.pages);
        if (st.code() == StatusCode::kFailedPrecondition) return {};  // pinned: later
        if (sender_) sender_->release(r.id).ignore_error();
        if (receiver_) receiver_->release(r.id).ignore_error();
        first_slots_.erase(r.id);
        if (!st.ok())
            PDSIM_LOG_WARN("rank {}: free pages of request {}: {}", ctx_.rank, r.id,
                           st.to_string());
    } else {
        Status st = pool_->allocator().free(r.pages);
        if (!st.ok())
            PDSIM_LOG_WARN("rank {}: free pages of request {}: {}", ctx_.rank, r.id,
                           st.to_string());
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
        auto got = pool_->allocator().alloc(pages);
        if (!got.ok()) return {};  // FCFS: wait for pages
        r.pages = std::move(*got);
        admit_q_.pop_front();
        if (role_ == Role::kDecode) {
            std::vector<int> pranks;
            const int first = cfg_.topology.rank_map().first_rank(r.p_inst);
            for (int i = 0; i < cfg_.topology.instances[static_cast<size_t>(r.p_inst)].tp; ++i)
                pranks.push_back(first + i);
            PDSIM_RETURN_IF_ERROR(send_followers(AdmitMsg{
                .id = r.id, .pages = r.pages, .input_len = r.in, .prefill_ranks = pranks}));
            transfer::ReceiveRequestSpec spec;
            spec.request_id = r.id;
            spec.prefill_ranks = pranks;
            spec.dst_pages = r.pages;
            spec.num_tokens = r.in;
            spec.timeout = timeout_;
            Status st = receiver_->submit(spec);
            if (!st.ok()) {
                PDSIM_RETURN_IF_ERROR(fail_request(r, "receiver submit: " + st.message()));
                continue;
            }
            engine_active_.insert(r.id);
            receiving_.push_back(r.id);
        } else {
            prefill_q_.push_back(r.id);
        }
    }
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
            if (o_.fault == Fault::kFreeBeforeTransfer) {
                // The bug: the pages go back to the pool while the sender may still read them.
                Status fs = sender_->pins().free_pages(pool_->allocator(), r.pages);
                if (fs.ok()) {
                    r.pages_freed = true;
                    const bool in_flight = engine_active_.count(r.id) != 0;
                    if (in_flight) {
                        transfer::Violation v;
                        v.request = r.id;
                        v.rank = ctx_.rank;
                        v.what =
                            "pages freed while the transfer was in flight (the free was not "
                            "refused)";
                        validator_->add_violation(v);
                    }
                }
            }
        }
    }
    // Drop finished prefills from the queue.
    std::erase_if(prefill_q_, [&](uint64_t id) {
        const Req& r = reqs_.at(id);
        return r.terminal || r.prefilled >= r.in;
    });
    return {};
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
    auto it = reqs_.find(outcome.id);
    if (it == reqs_.end()) return;
    Req& r = it->second;
    const int from =
        static_cast<int>(std::find(ctx_.instance_ranks.begin(), ctx_.instance_ranks.end(), src) -
                         ctx_.instance_ranks.begin());
    if (!outcome.ok) {
        (sent ? r.send_failed : r.receive_failed) = true;
        if (r.error.empty()) r.error = fmt::format("rank {}: {}", src, outcome.error);
    } else if (sent) {
        r.sent.insert(from);
    } else {
        const int32_t tok = outcome.first_token;
        if (!r.ready.empty() && tok != r.first_token) {
            r.receive_failed = true;
            r.error = fmt::format("first token differs across decode TP ranks ({} vs {})", tok,
                                  r.first_token);
        }
        r.first_token = tok;
        r.bytes += outcome.bytes;
        r.ready.insert(from);
    }
}

Status Server::leader_loop() {
    const int self = ctx_.info.tp_rank;
    std::vector<std::tuple<uint64_t, bool, std::string, int32_t, uint64_t>> outcomes;
    while (!ended_) {
        const bool busy = !prefill_q_.empty() || !running_.empty();
        const bool waiting = !receiving_.empty() || !engine_active_.empty();
        const auto wait =
            busy ? microseconds(0) : (waiting ? microseconds(200) : microseconds(2000));
        // Messages: everything that is already there, waiting only when idle.
        bool first_msg = true;
        while (true) {
            PDSIM_ASSIGN_OR_RETURN(
                std::optional<Message> m,
                ctx_.mbox->recv(Channel::kInstance, first_msg ? wait : microseconds(0)));
            first_msg = false;
            if (!m) break;
            const std::string k = m->kind();
            if (k == SubmitMsg::kKind) {
                PDSIM_ASSIGN_OR_RETURN(SubmitMsg submit, decode_message<SubmitMsg>(m->body));
                PDSIM_RETURN_IF_ERROR(on_submit(submit));
            } else if (k == CancelMsg::kKind) {
                PDSIM_ASSIGN_OR_RETURN(CancelMsg cancel, decode_message<CancelMsg>(m->body));
                auto it = reqs_.find(cancel.id);
                if (it != reqs_.end() && !it->second.terminal) {
                    it->second.terminal = true;
                    it->second.cancelled = true;
                    PDSIM_RETURN_IF_ERROR(try_free(it->second));
                }
            } else if (k == SentReport::kKind) {
                PDSIM_ASSIGN_OR_RETURN(SentReport sent, decode_message<SentReport>(m->body));
                on_follower_outcome(sent, true, m->src);
            } else if (k == ReadyReport::kKind) {
                PDSIM_ASSIGN_OR_RETURN(ReadyReport ready, decode_message<ReadyReport>(m->body));
                on_follower_outcome(ready, false, m->src);
            } else if (k == EndMsg::kKind) {
                ended_ = true;
            } else {
                PDSIM_LOG_WARN("rank {}: unexpected message '{}' from rank {}", ctx_.rank, k,
                               m->src);
            }
        }
        if (ended_) break;
        // Engine outcomes on this rank.
        if (sender_ || receiver_) {
            outcomes.clear();
            poll_engine(&outcomes);
            for (auto& [id, ok, err, tok, bytes] : outcomes) {
                auto it = reqs_.find(id);
                if (it == reqs_.end()) continue;
                Req& r = it->second;
                if (!ok) {
                    (sender_ ? r.send_failed : r.receive_failed) = true;
                    if (r.error.empty()) r.error = fmt::format("rank {}: {}", ctx_.rank, err);
                } else if (sender_) {
                    r.sent.insert(self);
                } else {
                    if (!r.ready.empty() && tok != r.first_token) {
                        r.receive_failed = true;
                        r.error =
                            fmt::format("first token differs across decode TP ranks ({} vs {})",
                                        tok, r.first_token);
                    }
                    r.first_token = tok;
                    r.bytes += bytes;
                    r.ready.insert(self);
                }
            }
        }
        PDSIM_RETURN_IF_ERROR(after_engine_poll());
        PDSIM_RETURN_IF_ERROR(admit());
        // One forward per iteration.
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
        if (broken_) {
            for (auto& [id, r] : reqs_) {
                if (!r.terminal) PDSIM_RETURN_IF_ERROR(fail_request(r, broken_reason_));
            }
            prefill_q_.clear();
            running_.clear();
            admit_q_.clear();
        }
    }
    return send_followers(EndMsg{});
}

// ---------------------------------------------------------------------------------------------
// Follower: runs the leader's forwards, and reports its engine's outcomes.
Status Server::follower_loop() {
    std::vector<std::tuple<uint64_t, bool, std::string, int32_t, uint64_t>> outcomes;
    std::vector<int32_t> next;
    while (true) {
        const auto wait = engine_active_.empty() ? microseconds(2000) : microseconds(200);
        PDSIM_ASSIGN_OR_RETURN(std::optional<Message> m, ctx_.mbox->recv(Channel::kInstance, wait));
        if (m) {
            const std::string k = m->kind();
            if (k == Plan::kKind) {
                PDSIM_ASSIGN_OR_RETURN(Plan plan, decode_message<Plan>(m->body));
                if (!broken_) {
                    Status st = execute(plan, &next);
                    if (!st.ok())
                        PDSIM_LOG_WARN("rank {}: forward failed: {}", ctx_.rank, st.to_string());
                }
            } else if (k == AdmitMsg::kKind) {
                PDSIM_ASSIGN_OR_RETURN(AdmitMsg admit, decode_message<AdmitMsg>(m->body));
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
                PDSIM_ASSIGN_OR_RETURN(ReleaseMsg release, decode_message<ReleaseMsg>(m->body));
                const uint64_t id = release.id;
                if (receiver_) receiver_->release(id).ignore_error();
                if (sender_) sender_->release(id).ignore_error();
                first_slots_.erase(id);
            } else if (k == EndMsg::kKind) {
                return {};
            }
        }
        if (sender_ || receiver_) {
            outcomes.clear();
            poll_engine(&outcomes);
            for (auto& [id, ok, err, tok, bytes] : outcomes) {
                EngineOutcomeFields outcome;
                outcome.id = id;
                outcome.ok = ok;
                outcome.error = err;
                outcome.first_token = tok;
                outcome.bytes = bytes;
                const json report = sender_ ? encode_message(SentReport{outcome})
                                            : encode_message(ReadyReport{outcome});
                PDSIM_RETURN_IF_ERROR(ctx_.mbox->send(ctx_.leader(), Channel::kInstance, report));
                if (sender_) {
                    sender_->release(id).ignore_error();
                    first_slots_.erase(id);
                }
            }
        }
    }
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
                  {"broken", broken_ ? broken_reason_ : ""}};
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

}  // namespace

Status run_server(RankContext& ctx, Phase phase, transfer::Transport* kv, RankResult* result) {
    auto server = std::make_unique<Server>(ctx, phase, kv);
    Status st;
    try {
        st = server->setup();
        if (st.ok()) st = server->run();
    } catch (const std::exception& e) {
        // Messages are decoded without exceptions (protocol.h); what is left is nlohmann::json's
        // own (e.g. the forward arguments).
        st = PDSIM_ERROR(StatusCode::kInternal, "rank {}: {}", ctx.rank, e.what());
    }
    server->shutdown_engines();
    *result = server->result();
    if (!st.ok()) result->error = st.to_string();
    return st;
}

}  // namespace pdsim::testbed
