// "nccl": two-sided ncclSend/ncclRecv over one two-rank communicator per pair of ranks, each on
// its own comm stream, with stream-ordered sends and a watchdog (see gpu_transports.h).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_stream.h"
#include "common/cuda_check.h"
#include "common/mpi_check.h"
#include "common/nccl_check.h"
#include "common/thread_info.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/nccl/nccl_comm_finalize.h"
#include "transfer/nccl/nccl_pair_ids.h"

namespace pdsim::transfer {

namespace {

using Clock = std::chrono::steady_clock;

// At most this many operations in one ncclGroupStart/End (NCCL's limit is 2048).
constexpr size_t kMaxGroupOps = 256;
// close(): how long a clean communicator may take to finalize before it is aborted instead.
constexpr auto kFinalizeTimeout = std::chrono::seconds(5);

struct Post {
    bool send = false;
    int peer = -1;
    void* buf = nullptr;
    size_t bytes = 0;
    std::shared_ptr<OpState> op;
    // post_send_after: the transport's own event, recorded on the pair's gate stream after it
    // waited on the caller's `ready` (its record as of the post). The comm stream waits on it
    // before this post's group. Owned by the post (destroyed once waited on, or when dropped).
    cudaEvent_t gate = nullptr;
    Clock::time_point posted;
};

// One ncclGroupStart/End of one pair and the event recorded after it.
struct Segment {
    cudaEvent_t done = nullptr;
    std::vector<Post> posts;
};

// One peer: its two-rank communicator and streams.
struct Pair {
    int peer = -1;
    RankPair ranks;
    std::string comm_name;  // config.commName (NCCL keeps the pointer during init)
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;       // the comm stream
    cudaStream_t gate_stream = nullptr;  // post_send_after's capture of `ready` (under gate_mu)
    std::mutex gate_mu;

    // Under NcclTransport::mu_:
    std::deque<Post> incoming;  // posted, not yet issued (cancel withdraws from here)
    Status dead;                // non-OK once the pair was aborted: later posts fail with it

    // Progress thread only (and init/close while it does not run):
    std::optional<Segment> issuing;  // ncclGroupEnd returned ncclInProgress: not yet enqueued
    std::deque<Segment> in_flight;   // enqueued, in stream order
    bool aborted = false;
};

void destroy_gate(Post& p) {
    if (p.gate != nullptr) {
        cudaEventDestroy(p.gate);
        p.gate = nullptr;
    }
}

class NcclTransport final : public Transport {
public:
    NcclTransport(int rank, int world, int device, std::chrono::milliseconds op_timeout)
        : rank_(rank), world_(world), device_(device), op_timeout_(op_timeout) {}
    ~NcclTransport() override { close(); }

    // Creates the pairs and starts the progress thread. On failure every communicator made so far
    // is aborted (by the destructor's close()).
    Status init(const TransportOptions& o, bool use_mpi) {
        Status st = init_pairs(o, use_mpi);
        if (!st.ok()) {
            for (auto& pair : pairs_) {
                if (pair) pair->aborted = true;
            }
            return st;
        }
        progress_ = std::thread([this] {
            set_thread_name("pdsim-nccl-prog");
            progress_loop();
        });
        return {};
    }

    Status init_pairs(const TransportOptions& o, bool use_mpi) {
        const auto deadline = Clock::now() + o.connect_timeout;
        CUDA_CHECK(cudaSetDevice(device_));
        pairs_.resize(static_cast<size_t>(world_));
        auto make_id = [](const RankPair&) -> StatusOr<std::string> {
            ncclUniqueId id{};
            NCCL_CHECK(ncclGetUniqueId(&id));
            return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
        };
        StatusOr<std::vector<std::string>> ids =
            use_mpi ? exchange_pair_ids_via_mpi(rank_, world_, sizeof(ncclUniqueId), make_id,
                                                o.connect_timeout)
                    : exchange_pair_ids_via_files(o.get<GpuTransportOptions>().rendezvous_dir,
                                                  rank_, world_, sizeof(ncclUniqueId), make_id,
                                                  o.connect_timeout);
        if (!ids.ok()) return ids.status();

        // Start every pair's init (non-blocking), then poll them together.
        for (const RankPair& rp : pairs_of(rank_, world_)) {
            const int peer = rp.low == rank_ ? rp.high : rp.low;
            auto pair = std::make_unique<Pair>();
            pair->peer = peer;
            pair->ranks = rp;
            pair->comm_name = fmt::format("pdsim-nccl-{}-{}", rp.low, rp.high);
            CUDA_CHECK(cudaStreamCreateWithFlags(&pair->stream, cudaStreamNonBlocking));
            CUDA_CHECK(cudaStreamCreateWithFlags(&pair->gate_stream, cudaStreamNonBlocking));
            ncclUniqueId id{};
            std::memcpy(&id, (*ids)[static_cast<size_t>(peer)].data(), sizeof(id));
            ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
            config.blocking = 0;
            config.commName = pair->comm_name.c_str();
            const ncclResult_t rc =
                ncclCommInitRankConfig(&pair->comm, 2, id, rank_in_pair(rp, rank_), &config);
            pairs_[static_cast<size_t>(peer)] = std::move(pair);
            if (rc != ncclSuccess && rc != ncclInProgress) {
                return PDSIM_ERROR(StatusCode::kUnavailable,
                                   "nccl rank {}: ncclCommInitRankConfig with rank {} failed: {}",
                                   rank_, peer, ncclGetErrorString(rc));
            }
        }
        for (;;) {
            std::vector<int> waiting;
            for (auto& pair : pairs_) {
                if (!pair) continue;
                ncclResult_t state = ncclSuccess;
                const ncclResult_t rc = ncclCommGetAsyncError(pair->comm, &state);
                if (rc != ncclSuccess) state = rc;
                if (state == ncclInProgress) {
                    waiting.push_back(pair->peer);
                } else if (state != ncclSuccess) {
                    return PDSIM_ERROR(StatusCode::kUnavailable,
                                       "nccl rank {}: communicator with rank {} failed to "
                                       "initialize: {} ({})",
                                       rank_, pair->peer, ncclGetErrorString(state),
                                       ncclGetLastError(pair->comm));
                }
            }
            if (waiting.empty()) break;
            if (Clock::now() >= deadline) {
                for (int peer : waiting) {
                    Pair& pair = *pairs_[static_cast<size_t>(peer)];
                    ncclCommAbort(pair.comm);
                    pair.comm = nullptr;
                }
                return Status(StatusCode::kDeadlineExceeded,
                              init_timeout_message(rank_, waiting, o.connect_timeout));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return {};
    }

    std::string_view name() const override { return "nccl"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_; }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = true;
        c.device_memory = true;
        c.host_memory = false;
        c.tag_matching = false;
        c.stream_ordered = true;
        c.max_tag = std::numeric_limits<Tag>::max();  // accepted, not matched
        c.max_message_bytes = std::numeric_limits<size_t>::max();
        return c;
    }

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
        PDSIM_RETURN_IF_ERROR(
            enqueue(Post{true, peer, const_cast<void*>(buf), bytes, op, nullptr, Clock::now()}));
        return RequestHandle(std::move(op));
    }

    StatusOr<RequestHandle> post_send_after(const runtime::Event& ready, int peer, Tag tag,
                                            const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        auto native = runtime::cuda::native_event_of(ready);
        if (!native.ok()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "nccl rank {}: post_send_after: the ready event is not a CUDA "
                               "event",
                               rank_);
        }
        if (native->device != device_) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "nccl rank {}: post_send_after: the ready event belongs to GPU {}, "
                               "the transport works on GPU {} (GpuTransportOptions.device_index)",
                               rank_, native->device, device_);
        }
        Pair& pair = *pairs_[static_cast<size_t>(peer)];
        cudaEvent_t gate = nullptr;
        {
            runtime::cuda::ScopedDevice on(device_);
            PDSIM_RETURN_IF_ERROR(on.status());
            CUDA_CHECK(cudaEventCreateWithFlags(&gate, cudaEventDisableTiming));
            std::lock_guard<std::mutex> lock(pair.gate_mu);
            cudaError_t rc = cudaStreamWaitEvent(pair.gate_stream, native->event, 0);
            if (rc == cudaSuccess) rc = cudaEventRecord(gate, pair.gate_stream);
            if (rc != cudaSuccess) {
                cudaEventDestroy(gate);
                return PDSIM_ERROR(StatusCode::kUnavailable,
                                   "nccl rank {}: post_send_after: capturing the ready event: {}",
                                   rank_, cudaGetErrorString(rc));
            }
        }
        auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
        Post p{true, peer, const_cast<void*>(buf), bytes, op, gate, Clock::now()};
        Status st = enqueue(std::move(p));
        if (!st.ok()) {
            cudaEventDestroy(gate);
            return st;
        }
        return RequestHandle(std::move(op));
    }

    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
        auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        PDSIM_RETURN_IF_ERROR(enqueue(Post{false, peer, buf, capacity, op, nullptr, Clock::now()}));
        return RequestHandle(std::move(op));
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) return PDSIM_ERROR(StatusCode::kInvalidArgument, "nccl: cancel");
        const int peer = handle.peer();
        std::optional<Post> withdrawn;
        if (peer >= 0 && peer < world_ && pairs_[static_cast<size_t>(peer)]) {
            Pair& pair = *pairs_[static_cast<size_t>(peer)];
            std::lock_guard<std::mutex> lock(mu_);
            auto it = std::find_if(pair.incoming.begin(), pair.incoming.end(),
                                   [&](const Post& p) { return p.op == handle.state(); });
            if (it != pair.incoming.end()) {
                withdrawn = std::move(*it);
                pair.incoming.erase(it);
            }
        }
        if (withdrawn) {
            destroy_gate(*withdrawn);
            withdrawn->op->complete(Status(StatusCode::kAborted, "nccl: cancelled"), 0);
            return {};
        }
        if (handle.done()) return {};
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "nccl: an operation already on the stream cannot be cancelled");
    }

    void close() override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) return;
            stop_ = true;
        }
        cv_.notify_one();
        if (progress_.joinable()) progress_.join();
        // The progress thread failed every pending operation; what is left is the teardown.
        std::vector<Post> dropped;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (auto& pair : pairs_) {
                if (!pair) continue;
                for (Post& p : pair->incoming) dropped.push_back(std::move(p));
                pair->incoming.clear();
            }
        }
        fail_posts(dropped, Status(StatusCode::kUnavailable,
                                   fmt::format("nccl rank {}: transport closed", rank_)));
        for (auto& pair : pairs_) {
            if (!pair) continue;
            teardown(*pair);
        }
    }

private:
    Status enqueue(Post p) {
        Pair& pair = *pairs_[static_cast<size_t>(p.peer)];
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) return PDSIM_ERROR(StatusCode::kUnavailable, "nccl: transport closed");
            if (!pair.dead.ok()) return pair.dead;
            pair.incoming.push_back(std::move(p));
        }
        cv_.notify_one();
        return {};
    }

    static void fail_posts(std::vector<Post>& posts, const Status& st) {
        for (Post& p : posts) {
            destroy_gate(p);
            p.op->complete(st, 0);
        }
        posts.clear();
    }

    // Progress thread (or close() after it): ends the pair's communicator.
    void teardown(Pair& pair) {
        if (pair.comm != nullptr) {
            const bool clean = !pair.aborted && !pair.issuing && pair.in_flight.empty() &&
                               finalize_nccl_comm(pair.comm, kFinalizeTimeout);
            if (clean) {
                ncclCommDestroy(pair.comm);
            } else {
                ncclCommAbort(pair.comm);
            }
            pair.comm = nullptr;
        }
        for (Segment& s : pair.in_flight) cudaEventDestroy(s.done);
        pair.in_flight.clear();
        pair.issuing.reset();
        for (cudaStream_t* s : {&pair.stream, &pair.gate_stream}) {
            if (*s != nullptr) {
                cudaStreamDestroy(*s);
                *s = nullptr;
            }
        }
    }

    // Aborts the pair: every pending operation completes with `ops_status`, later posts fail
    // with kUnavailable `dead`. Progress thread only.
    void abort_pair(Pair& pair, const Status& ops_status, const Status& dead) {
        std::vector<Post> pending;
        {
            std::lock_guard<std::mutex> lock(mu_);
            pair.dead = dead;
            for (Post& p : pair.incoming) pending.push_back(std::move(p));
            pair.incoming.clear();
        }
        if (pair.comm != nullptr) {
            ncclCommAbort(pair.comm);
            pair.comm = nullptr;
        }
        pair.aborted = true;
        std::vector<Post> issued;
        if (pair.issuing) {
            for (Post& p : pair.issuing->posts) issued.push_back(std::move(p));
            pair.issuing.reset();
        }
        for (Segment& s : pair.in_flight) {
            cudaEventDestroy(s.done);
            for (Post& p : s.posts) issued.push_back(std::move(p));
        }
        pair.in_flight.clear();
        // In post order: what was issued first.
        fail_posts(issued, ops_status);
        fail_posts(pending, ops_status);
    }

    void fail_pair(Pair& pair, const std::string& what) {
        const Status st(StatusCode::kUnavailable,
                        fmt::format("nccl rank {}: communicator with rank {}: {}; communicator "
                                    "aborted",
                                    rank_, pair.peer, what));
        abort_pair(pair, st, st);
    }

    // Takes the next group of the pair from `incoming` (under mu_): the first post (gated or
    // not) and the ungated ones after it.
    static std::vector<Post> take_segment(Pair& pair) {
        std::vector<Post> posts;
        while (!pair.incoming.empty() && posts.size() < kMaxGroupOps) {
            if (!posts.empty() && pair.incoming.front().gate != nullptr) break;
            posts.push_back(std::move(pair.incoming.front()));
            pair.incoming.pop_front();
        }
        return posts;
    }

    // Issues one group on the pair's stream (after its gate, if any).
    void issue(Pair& pair, std::vector<Post> posts) {
        if (posts.front().gate != nullptr) {
            const cudaError_t ce = cudaStreamWaitEvent(pair.stream, posts.front().gate, 0);
            destroy_gate(posts.front());  // the wait holds what it needs
            if (ce != cudaSuccess) {
                // This group is not issued, so the peer's receives would match the sends after it
                // (no tags): the pair cannot stay in step. Fail it whole, in post order (the
                // group goes back in front of what was posted after it).
                {
                    std::lock_guard<std::mutex> lock(mu_);
                    for (auto it = posts.rbegin(); it != posts.rend(); ++it) {
                        pair.incoming.push_front(std::move(*it));
                    }
                }
                fail_pair(pair,
                          fmt::format("waiting on the ready event: {}", cudaGetErrorString(ce)));
                return;
            }
        }
        const int peer_in_comm = 1 - rank_in_pair(pair.ranks, rank_);
        ncclResult_t rc = ncclGroupStart();
        for (const Post& p : posts) {
            if (rc != ncclSuccess && rc != ncclInProgress) break;
            rc = p.send ? ncclSend(p.buf, p.bytes, ncclUint8, peer_in_comm, pair.comm, pair.stream)
                        : ncclRecv(p.buf, p.bytes, ncclUint8, peer_in_comm, pair.comm, pair.stream);
        }
        const ncclResult_t end = ncclGroupEnd();
        if (rc == ncclSuccess || rc == ncclInProgress) rc = end;
        pair.issuing = Segment{nullptr, std::move(posts)};
        if (rc == ncclInProgress) return;  // enqueued in the background: polled by advance()
        if (rc != ncclSuccess) {
            fail_pair(pair, std::string("ncclSend/ncclRecv group failed: ") +
                                ncclGetErrorString(rc) + " (" + ncclGetLastError(pair.comm) + ")");
            return;
        }
        record_issued(pair);
    }

    // The issuing group is on the stream: record its event.
    void record_issued(Pair& pair) {
        cudaEvent_t ev = nullptr;
        cudaError_t ce = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev, pair.stream);
        if (ce != cudaSuccess) {
            if (ev != nullptr) cudaEventDestroy(ev);
            fail_pair(pair, std::string("recording the group's event: ") + cudaGetErrorString(ce));
            return;
        }
        pair.issuing->done = ev;
        pair.in_flight.push_back(std::move(*pair.issuing));
        pair.issuing.reset();
    }

    // The oldest pending post of the pair, or nullopt.
    std::optional<Clock::time_point> oldest(const Pair& pair) {
        if (!pair.in_flight.empty()) return pair.in_flight.front().posts.front().posted;
        if (pair.issuing) return pair.issuing->posts.front().posted;
        std::lock_guard<std::mutex> lock(mu_);
        if (!pair.incoming.empty()) return pair.incoming.front().posted;
        return std::nullopt;
    }

    // One round over one pair; true when it has work on the device or being enqueued.
    bool advance(Pair& pair) {
        if (pair.aborted) return false;
        // Asynchronous errors (and the end of a background enqueue).
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(pair.comm, &state);
        if (q != ncclSuccess) state = q;
        if (state != ncclSuccess && state != ncclInProgress) {
            fail_pair(pair, std::string("asynchronous NCCL error: ") + ncclGetErrorString(state) +
                                " (" + ncclGetLastError(pair.comm) + ")");
            return false;
        }
        if (pair.issuing && state == ncclSuccess) record_issued(pair);
        if (pair.aborted) return false;
        // Completed groups, in stream order.
        while (!pair.in_flight.empty()) {
            const cudaError_t rc = cudaEventQuery(pair.in_flight.front().done);
            if (rc == cudaErrorNotReady) break;
            if (rc != cudaSuccess) {
                fail_pair(pair, std::string("the comm stream failed: ") + cudaGetErrorString(rc));
                return false;
            }
            Segment s = std::move(pair.in_flight.front());
            pair.in_flight.pop_front();
            cudaEventDestroy(s.done);
            for (Post& p : s.posts) p.op->complete({}, p.bytes);
        }
        // The watchdog.
        if (op_timeout_.count() > 0) {
            const auto since = oldest(pair);
            if (since && Clock::now() - *since > op_timeout_) {
                const std::string msg = op_timeout_message(pair.peer, op_timeout_);
                abort_pair(pair, Status(StatusCode::kDeadlineExceeded, msg),
                           Status(StatusCode::kUnavailable,
                                  fmt::format("nccl rank {}: communicator with rank {} was "
                                              "aborted by the watchdog ({})",
                                              rank_, pair.peer, msg)));
                return false;
            }
        }
        // The next group, once the previous one is enqueued.
        if (!pair.issuing) {
            std::vector<Post> posts;
            {
                std::lock_guard<std::mutex> lock(mu_);
                posts = take_segment(pair);
            }
            if (!posts.empty()) issue(pair, std::move(posts));
        }
        return !pair.aborted && (pair.issuing || !pair.in_flight.empty());
    }

    bool any_incoming() const {  // under mu_
        for (const auto& pair : pairs_) {
            if (pair && !pair->incoming.empty()) return true;
        }
        return false;
    }

    void progress_loop() {
        cudaSetDevice(device_);
        bool busy = false;
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mu_);
                if (!busy) cv_.wait(lock, [&] { return stop_ || any_incoming(); });
                if (stop_) break;
            }
            busy = false;
            for (auto& pair : pairs_) {
                if (pair && advance(*pair)) busy = true;
            }
            {
                // Incoming posts that a busy pair could not take yet keep the loop polling.
                std::lock_guard<std::mutex> lock(mu_);
                if (any_incoming()) busy = true;
            }
            if (busy) std::this_thread::sleep_for(std::chrono::microseconds(10));
        }
        // Closing: fail everything still pending.
        const Status closed(StatusCode::kUnavailable,
                            fmt::format("nccl rank {}: transport closed", rank_));
        for (auto& pair : pairs_) {
            if (!pair) continue;
            if ((pair->issuing || !pair->in_flight.empty()) && pair->comm != nullptr) {
                // Its kernels may still read or write these posts' buffers, and a failed handle
                // has released its buffer (transport.h): stop them first.
                ncclCommAbort(pair->comm);
                pair->comm = nullptr;
                pair->aborted = true;
            }
            std::vector<Post> pending;
            if (pair->issuing) {
                for (Post& p : pair->issuing->posts) pending.push_back(std::move(p));
                pair->issuing->posts.clear();
            }
            for (Segment& s : pair->in_flight) {
                for (Post& p : s.posts) pending.push_back(std::move(p));
                s.posts.clear();
            }
            fail_posts(pending, closed);
        }
    }

    const int rank_;
    const int world_;
    const int device_;
    const std::chrono::milliseconds op_timeout_;

    // Indexed by peer (null for this rank); built by init() before the progress thread starts,
    // then fixed.
    std::vector<std::unique_ptr<Pair>> pairs_;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;  // under mu_
    std::thread progress_;
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_nccl_transport(const TransportOptions& options) {
    const GpuTransportOptions gpu = options.get<GpuTransportOptions>();
    PDSIM_RETURN_IF_ERROR(validate_gpu_transport_options(gpu));
    PDSIM_RETURN_IF_ERROR(check_cuda_device(gpu.device_index));
    int rank = options.rank;
    int world = options.world_size;
    int mpi_up = 0;
    MPI_Initialized(&mpi_up);
    int mpi_down = 0;
    MPI_Finalized(&mpi_down);
    const bool use_mpi = mpi_up && !mpi_down && gpu.rendezvous_dir.empty();
    if (use_mpi) {
        MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
        MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
    }
    if (world < 1 || rank < 0 || rank >= world) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "nccl: rank {} / world {} invalid", rank,
                           world);
    }
    if (!use_mpi && world > 1 && gpu.rendezvous_dir.empty()) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "nccl: no bootstrap: run under MPI or set GpuTransportOptions.rendezvous_dir");
    }
    auto t = std::make_unique<NcclTransport>(rank, world, gpu.device_index, gpu.op_timeout);
    PDSIM_RETURN_IF_ERROR(t->init(options, use_mpi));
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
