// The testbed server's own parts, shared by its translation units only (not an interface: include
// sim/testbed/server.h instead). One rank's serving loop is the class Server, split by role:
//   server.cpp          setup (the rank's parts, the engine), the engine event hook, the follower
//                       loop, run() and what the rank reports (result()), PhaseServer;
//   server_forward.cpp  one forward on this rank (execute: batch, StepCounter steps, the chunks
//                       handed to the KV sender) and polling the engine's request states;
//   server_leader.cpp   the instance leader: submissions, admission, extend/decode scheduling,
//                       engine outcomes, reports to the router, the leader loop.
// The behaviour is documented in server.h (roles, scheduling, TP, reports).
//
// Thread-safety: a Server runs on the rank's main thread; the engine's event hook and the
// model's layer hook run on engine / stream threads and only append to locked buffers
// (LocalTimeline, engine_events_ under ev_mu_).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/kv/state_pool.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/stream.h"
#include "common/status.h"
#include "common/thread_info.h"
#include "sim/policy/batching.h"
#include "sim/testbed/pd_backend.h"
#include "sim/testbed/protocol.h"
#include "sim/testbed/server.h"
#include "transfer/engine/kv_receiver.h"
#include "transfer/engine/kv_sender.h"
#include "transfer/engine/ordering_validator.h"
#include "transfer/tag_space_transport.h"

namespace pdsim::testbed::detail {

using json = nlohmann::json;

// Timeline threads (tid) of a rank's events.
constexpr int kTidSched = 0, kTidCompute = 1, kTidRecord = 2, kTidSend = 3, kTidRecv = 4;
constexpr size_t kMaxTimelineEvents = 300000;
constexpr size_t kMaxEngineEvents = 2000000;

enum class Role { kColocated, kPrefill, kDecode };

// Timeline events on this rank's clock: [tid, name, cat, ts_us, dur_us (-1: instant), args].
// Thread-safe; at most kMaxTimelineEvents are kept (later ones are dropped).
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

// One request as its instance leader tracks it.
struct Req {
    uint64_t id = 0;
    int32_t in = 0, out = 0;
    std::vector<int64_t> hash;
    int p_inst = -1, d_inst = -1;
    std::vector<int32_t> prompt;
    std::vector<int32_t> pages;
    // Models whose sliding layers have their own pool: its ring of pages there (window.h).
    std::vector<int32_t> window_ring;
    int32_t state_slot = 0;  // models with recurrent layers: its state pool slot (0: none)
    bool pages_freed = false;
    int64_t prefilled = 0;
    std::vector<int32_t> tokens;
    std::vector<double> token_t;
    double t_prefill_start = -1;
    double t_first = -1;
    bool terminal = false;
    bool cancelled = false;
    bool engine_aborted = false;     // the leader aborted its engine request (try_free)
    bool followers_aborted = false;  // the leader sent its followers EngineAbortMsg
    // TP followers (indices in instance_ranks) whose pages of the request are idle: the leader
    // frees the pages only once every follower is.
    std::set<int> followers_idle;
    // disaggregated prefill: TP ranks whose sender finished the request (ok or not)
    std::set<int> sent;
    bool last_submitted = false;
    bool send_failed = false;
    // disaggregated decode: TP ranks whose receiver has everything
    std::set<int> ready;
    bool receive_failed = false;
    int32_t first_token = -1;
    uint64_t bytes = 0;
    uint64_t kv_digest = 0;  // the sum of the TP ranks' parts (kv_digest.h)
    std::string error;
};

// The StepCounter steps of one prefill forward (server_forward.cpp).
struct PrefillSteps {
    int64_t begin = 0;         // the forward's first layer step
    int64_t aux_begin = 0;     // the aux step the first tokens are published at
    int64_t ready_before = 0;  // the ready step before the forward
};

class Server {
public:
    Server(RankContext& ctx, Phase phase, KvTransports kv);
    ~Server();

    Status setup();
    Status run();
    RankResult result();
    void shutdown_engines() {
        if (sender_) sender_->shutdown(transfer::ShutdownMode::kGraceful);
        if (receiver_) receiver_->shutdown(transfer::ShutdownMode::kGraceful);
        for (GroupEngine* g : {&window_, &state_}) {
            if (g->sender) g->sender->shutdown(transfer::ShutdownMode::kGraceful);
            if (g->receiver) g->receiver->shutdown(transfer::ShutdownMode::kGraceful);
        }
    }

private:
    // ---- shared (server.cpp, server_forward.cpp) ----
    Status execute(const Plan& plan, std::vector<int32_t>* next);
    // A GPU rank, after a forward's stream synchronized at host time t_done_us: the compute
    // track's slices from the forward's device events.
    void add_gpu_compute_slices(const std::string& label, double t_done_us);
    PrefillSteps begin_prefill_forward(const Plan& plan, bool any_last);
    Status publish_first_tokens(const Plan& plan,
                                const std::shared_ptr<std::vector<int32_t>>& sampled);
    void submit_chunks(const Plan& plan, const PrefillSteps& steps, bool known_first);
    Status finish_prefill_forward(const Plan& plan, const PrefillSteps& steps, double t_done);
    json forward_args(const Plan& plan) const;
    void on_engine_event(const transfer::TransferEvent& ev);
    void poll_engine(std::vector<EngineOutcomeFields>* out);
    // Decode side: orders the compute stream behind request `id`'s arrival words, for every
    // receiver that has targets for it (poll_engine, once the request succeeded).
    void order_behind_arrival(uint64_t id);
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

    // ---- this rank's transfer engines (server.cpp) ----
    // A disaggregated rank runs the KV engine (sender_ or receiver_: the full-attention layers,
    // or every layer of a model without cache groups) and, for a hybrid model, one engine per
    // other cache group (groups()): the sliding layers' window (window_: its request's tokens are
    // the window's positions, window.h) and the recurrent states (state_: one "token" per
    // request, its state slot), each on its own tag space of the shared transports
    // (transfer/tag_space_transport.h). A request's engine outcome is every engine's together.
    struct GroupEngine {
        const char* what;  // for messages: "sliding window", "recurrent states"
        bool on = false;   // this phase runs it
        transfer::KvLayout layout;
        std::vector<int> layer_steps;  // its layers' model layers
        transfer::OrderingValidator* validator = nullptr;
        transfer::Transport* control = nullptr;
        transfer::Transport* data = nullptr;  // null: the control transport carries the data
        std::unique_ptr<transfer::KvSender> sender;
        std::unique_ptr<transfer::KvReceiver> receiver;
        [[nodiscard]] transfer::PagePins* pins();  // null without an engine
    };
    std::vector<GroupEngine*> groups();  // the group engines this phase runs
    [[nodiscard]] bool has_engine() const { return sender_ || receiver_; }
    // Every engine's status of `id` as one: Failed when any failed (the others are aborted),
    // Success when all succeeded, else in progress; bytes and pages_in_use of all.
    StatusOr<transfer::RequestStatus> engine_status(uint64_t id);
    Status engine_abort(uint64_t id, const std::string& why);
    void engine_release(uint64_t id);
    // The pages of a request's window ring (window.h) the window engine moves: the logical pages
    // from window_start on.
    std::vector<int32_t> window_pages(std::span<const int32_t> ring, int64_t input_len) const;
    // A request's ring size in the sliding layers' pool on this rank (window_ring_pages).
    int window_ring_size(int64_t tokens) const;
    // This rank's part of a request's KV digest (kv_digest.h; CPU disaggregated ranks).
    uint64_t digest_of(const std::vector<int32_t>& pages, std::span<const int32_t> window_ring,
                       int64_t input_len, int32_t state_slot) const;
    // Frees `pages`, the window ring and the state slot (when > 0) through the engines' pins:
    // kFailedPrecondition while a transfer pins any of them (nothing is freed then).
    Status engine_free(const std::vector<int32_t>& pages, const std::vector<int32_t>& window_ring,
                       int32_t state_slot);
    // Submits a decode request's KV (and window, and state) receive.
    Status engine_submit_receive(uint64_t id, const std::vector<int>& prefill_ranks,
                                 const std::vector<int32_t>& pages,
                                 const std::vector<int32_t>& window_ring, int64_t input_len,
                                 int32_t state_slot);
    // Frees a group's pages of `pool` outside the engines (colocated ranks, groups no engine
    // moves, failures before any transfer); a refused free is logged naming `what`.
    void free_unpinned(kv::KVPool* pool, std::span<const int32_t> pages, const char* what);
    // Pages the sliding layers' pool can hand out (0 without one).
    int window_pool_capacity() const {
        return window_pool_ != nullptr ? window_pool_->allocator().capacity() : 0;
    }
    // --fault state-tp-misslice's layout (server.cpp).
    static StatusOr<transfer::KvLayout> misslice(const transfer::KvLayout& layout);

    // ---- leader (server_leader.cpp) ----
    Status leader_loop();
    Status drain_leader_messages(std::chrono::microseconds wait);
    Status on_leader_message(const Message& m);
    Status on_submit(const SubmitMsg& msg);
    Status on_cancel(const CancelMsg& msg);
    void on_follower_outcome(const EngineOutcomeFields& outcome, bool sent, int src);
    void apply_engine_outcome(const EngineOutcomeFields& outcome, bool sent, int tp_index,
                              int world_rank);
    Status run_one_forward();
    Status fail_all_if_broken();
    Status admit();
    Status start_receive(Req& r);
    Status schedule_extend(bool* did);
    Status after_extend(const Plan& plan, const std::vector<int32_t>& next);
    void free_before_transfer(Req& r);
    Status schedule_decode(bool* did);
    Status after_engine_poll();
    Status fail_request(Req& r, const std::string& why);
    Status finish_request(Req& r);
    Status try_free(Req& r);
    Status report_first(Req& r);
    // The cpu backend's bound (see server.h); none on a GPU rank (0).
    int64_t decode_kv_cap() const {
        if (ctx_.gpu != nullptr) return 0;
        return kMaxDecodeKvTokensPerThread * std::max(1, ctx_.threads);
    }
    policy::BatchingOptions batching() const {
        return {o_.chunk_size, o_.max_batch_tokens, o_.max_decode_batch, decode_kv_cap()};
    }

    // ---- follower (server.cpp) ----
    Status follower_loop();
    Status on_follower_message(const Message& m, std::vector<int32_t>* next);
    Status report_engine_outcomes_to_leader();

    RankContext& ctx_;
    const ResolvedConfig& cfg_;
    const TestbedOptions& o_;
    Phase phase_;
    Role role_;
    KvTransports kv_;
    int num_layers_ = 1;
    std::chrono::milliseconds timeout_;

    // Token buffers of forwards whose stream did not finish in time (a stream task may still
    // write them): kept until the server goes, after the device objects below.
    std::vector<std::shared_ptr<std::vector<int32_t>>> abandoned_outputs_;
    // Per-phase device objects (declaration order = reverse destruction order). A GPU rank's
    // stream is the GpuRank's (owned_stream_ null), which outlives the server.
    std::unique_ptr<runtime::Stream> owned_stream_;
    runtime::Stream* stream_ = nullptr;
    std::unique_ptr<kv::MHATokenToKVPool> pool_;
    // Models with cache groups and sliding layers: the sliding layers' own pool (rank_builder.h).
    std::unique_ptr<kv::MHATokenToKVPool> window_pool_;
    std::unique_ptr<kv::StatePool> states_;  // models with recurrent layers
    std::unique_ptr<pd::StepCounter> counter_;
    std::unique_ptr<transfer::OrderingValidator> validator_;
    std::unique_ptr<transfer::OrderingValidator> state_validator_;
    std::unique_ptr<transfer::OrderingValidator> window_validator_;
    std::unique_ptr<PdAttentionBackend> backend_;
    // The tag spaces of the shared KV transports when two engines share them ([0]: KV, [1]:
    // states); the engines below use them, so they go after the engines.
    std::vector<std::unique_ptr<transfer::TagSpaceTransport>> control_spaces_, data_spaces_;
    std::unique_ptr<transfer::KvSender> sender_;
    std::unique_ptr<transfer::KvReceiver> receiver_;
    GroupEngine window_{"sliding window"};
    GroupEngine state_{"recurrent states"};
    std::map<uint64_t, std::unique_ptr<int32_t>> first_slots_;
    // KV digests (kv_digest.h) of CPU disaggregated ranks: the engine layouts they read, the
    // prefill side's parts taken after a last chunk (until its outcome reports them), and what the
    // decode side needs to take its part once a receive completes.
    std::optional<transfer::KvLayout> digest_kv_layout_, digest_window_layout_,
        digest_state_layout_;
    std::map<uint64_t, uint64_t> kv_digests_;
    struct ReceiveInfo {
        std::vector<int32_t> pages;
        std::vector<int32_t> window_ring;
        int64_t input_len = 0;
        int32_t state_slot = 0;
    };
    std::map<uint64_t, ReceiveInfo> receive_info_;

    // Engine bookkeeping of this rank (leader and followers).
    std::set<uint64_t> engine_active_;  // added to the sender / submitted to the receiver
    // Decode side, arrival words (kv_receiver.h): requests whose landed layers the compute
    // stream was ordered behind (enqueue_arrival_wait), and whether a failure to do so was
    // logged (it is not fatal: wait_done already proved the arrival on the host).
    uint64_t arrival_waits_ = 0;
    bool arrival_wait_warned_ = false;
    // Follower: failed requests whose pages a transfer may still reach (reported idle later).
    std::set<uint64_t> quiescing_;

    // Leader state.
    std::map<uint64_t, Req> reqs_;
    std::deque<uint64_t> admit_q_, prefill_q_, running_;
    std::vector<uint64_t> receiving_;
    bool last_was_extend_ = false;
    bool broken_ = false;
    std::string broken_reason_;
    bool ended_ = false;  // the phase's EndMsg arrived (leader and followers)

    // Metrics.
    LocalTimeline timeline_;
    std::mutex ev_mu_;
    std::vector<EngineEventRecord> engine_events_;
    std::map<uint64_t, double> prefill_end_;
    std::vector<double> layer_t0_;
    std::string hook_label_;
    int64_t forwards_ = 0, forward_tokens_ = 0;
    // The most pages in use at once in the full layers' pool, the sliding layers' pool and the
    // state pool (leader: after each admission).
    int64_t peak_pages_[3] = {0, 0, 0};
    int64_t graph_forwards_ = 0;  // GPU rank: decode forwards that replayed a CUDA graph
    bool timing_warned_ = false;  // GPU rank: a forward's device times could not be read
    double compute_us_ = 0;
    int64_t record_violations_ = 0;
    // CPU seconds per thread name over run() (the testbed's own threads compete with the compute
    // threads for the node's cores: the report shows how much).
    std::vector<ThreadCpu> cpu_at_start_;
    std::map<std::string, double> thread_cpu_s_;
    std::map<std::string, double> thread_wait_s_;  // run-queue wait per thread name
    // CPU ranks: the machine-speed probe's samples over run() (common/speed_probe.h).
    std::vector<double> speed_samples_ms_;
};

}  // namespace pdsim::testbed::detail
