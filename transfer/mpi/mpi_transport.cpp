#include "transfer/mpi/mpi_transport.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/mpi_check.h"
#include "common/thread_info.h"

namespace pdsim::transfer {

namespace {

constexpr auto kStallAfter = std::chrono::milliseconds(100);
constexpr auto kStallSleep = std::chrono::microseconds(200);
constexpr auto kCancelWait = std::chrono::seconds(10);
// close(): how long matched sends still in flight may take to finish (shutdown_active).
constexpr auto kCloseDrain = std::chrono::seconds(2);

std::string_view thread_level_name(int level) {
    switch (level) {
        case MPI_THREAD_SINGLE:
            return "MPI_THREAD_SINGLE";
        case MPI_THREAD_FUNNELED:
            return "MPI_THREAD_FUNNELED";
        case MPI_THREAD_SERIALIZED:
            return "MPI_THREAD_SERIALIZED";
        case MPI_THREAD_MULTIPLE:
            return "MPI_THREAD_MULTIPLE";
        default:
            return "?";
    }
}

Status ensure_mpi_initialized() {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    int finalized = 0;
    MPI_CHECK(MPI_Finalized(&finalized));
    if (finalized) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "mpi: MPI is already finalized");
    }
    int provided = 0;
    if (!initialized) {
        MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
        std::atexit([] {
            int done = 0;
            MPI_Finalized(&done);
            if (!done) MPI_Finalize();
        });
    } else {
        MPI_CHECK(MPI_Query_thread(&provided));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "mpi: MPI provides {}; the mpi transport's progress thread needs at "
                           "least MPI_THREAD_SERIALIZED (initialize MPI with MPI_Init_thread("
                           "MPI_THREAD_MULTIPLE))",
                           thread_level_name(provided));
    }
    if (provided < MPI_THREAD_MULTIPLE) {
        static std::once_flag warned;
        std::call_once(warned, [&] {
            PDSIM_LOG_WARN(
                "mpi: MPI provides {}: the application must not call MPI while an mpi "
                "transport is alive",
                thread_level_name(provided));
        });
    }
    return {};
}

// An operation handed to the progress thread.
struct Post {
    enum class What : uint8_t { kSend, kRecv, kCancel };
    What what;
    int peer = 0;
    Tag tag = 0;
    void* buf = nullptr;  // const for sends (MPI_Isend takes const void*)
    int count = 0;
    std::shared_ptr<OpState> op;
};

class MpiTransport final : public Transport {
public:
    MpiTransport() = default;
    ~MpiTransport() override { close(); }

    Status init() {
        MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
        MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
        MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
        MPI_CHECK(MPI_Comm_size(comm_, &world_));
        void* attr = nullptr;
        int flag = 0;
        MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &flag));
        tag_ub_ = flag && attr != nullptr ? *static_cast<int*>(attr) : 32767;
        progress_ = std::thread([this] {
            set_thread_name("pdsim-mpi-prog");
            progress_loop();
        });
        return {};
    }

    std::string_view name() const override { return "mpi"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_; }
    Capabilities capabilities() const override {
        Capabilities c;
        c.two_sided = true;
        c.host_memory = true;
        c.detects_peer_failure = false;
        c.max_tag = static_cast<Tag>(tag_ub_);
        c.max_message_bytes = INT_MAX;
        return c;
    }

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
        PDSIM_RETURN_IF_ERROR(enqueue(Post{Post::What::kSend, peer, tag, const_cast<void*>(buf),
                                           static_cast<int>(bytes), op}));
        return RequestHandle(std::move(op));
    }

    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
        auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        // Messages are at most INT_MAX bytes, so a larger buffer is never needed in full.
        int count = static_cast<int>(std::min<size_t>(capacity, INT_MAX));
        PDSIM_RETURN_IF_ERROR(enqueue(Post{Post::What::kRecv, peer, tag, buf, count, op}));
        return RequestHandle(std::move(op));
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "mpi: cancel of an invalid handle");
        }
        const std::shared_ptr<OpState>& op = handle.state();
        bool withdrawn = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            // Not yet handed to MPI: withdraw it here.
            auto it = std::find_if(incoming_.begin(), incoming_.end(),
                                   [&](const Post& p) { return p.op == op; });
            if (it != incoming_.end()) {
                incoming_.erase(it);
                withdrawn = true;
            }
        }
        if (withdrawn) {
            // Completed outside mu_: callbacks may post again.
            op->complete(Status(StatusCode::kAborted, fmt::format("mpi rank {}: {} cancelled",
                                                                  rank_, op_kind_name(op->kind()))),
                         0);
            return {};
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (op->done()) return {};
            if (op->kind() != OpKind::kRecv) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                   "mpi rank {}: a send already handed to MPI cannot be cancelled",
                                   rank_);
            }
            if (stop_) return PDSIM_ERROR(StatusCode::kUnavailable, "mpi: transport closed");
            incoming_.push_back(Post{Post::What::kCancel, op->peer(), op->tag(), nullptr, 0, op});
        }
        cv_.notify_one();
        // MPI_Cancel of a receive completes it promptly: cancelled, or with its data if it was
        // already matched. Either way the buffer is released once done.
        auto deadline = std::chrono::steady_clock::now() + kCancelWait;
        if (!op->wait_until(deadline)) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "mpi rank {}: receive still in flight after MPI_Cancel", rank_);
        }
        return {};
    }

    void close() override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) return;
            stop_ = true;
        }
        cv_.notify_one();
        if (progress_.joinable()) progress_.join();
        if (comm_ != MPI_COMM_NULL) {
            int finalized = 0;
            MPI_Finalized(&finalized);
            if (!finalized) MPI_Comm_free(&comm_);
            comm_ = MPI_COMM_NULL;
        }
    }

private:
    struct Active {
        Post::What what;
        int count;
        std::shared_ptr<OpState> op;
    };

    Status enqueue(Post post) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) {
                return PDSIM_ERROR(StatusCode::kUnavailable, "mpi rank {}: transport closed",
                                   rank_);
            }
            incoming_.push_back(std::move(post));
        }
        cv_.notify_one();
        return {};
    }

    Status mpi_error(int rc, std::string_view what, const OpState& op) const {
        int cls = rc;
        MPI_Error_class(rc, &cls);
        if (cls == MPI_ERR_TRUNCATE) {
            return Status(StatusCode::kOutOfRange,
                          fmt::format("mpi rank {}: message from rank {} (tag {}) does not fit the "
                                      "receive buffer of {} bytes",
                                      rank_, op.peer(), op.tag(), op.posted_bytes()));
        }
        return Status(StatusCode::kUnavailable,
                      fmt::format("mpi rank {}: {} (peer {}, tag {}) failed: {}", rank_, what,
                                  op.peer(), op.tag(), detail::mpi_error_string(rc)));
    }

    // Progress thread only.
    void start(Post& p) {
        if (p.what == Post::What::kCancel) {
            for (size_t i = 0; i < active_.size(); ++i) {
                if (active_[i].op == p.op && reqs_[i] != MPI_REQUEST_NULL) {
                    int rc = MPI_Cancel(&reqs_[i]);
                    if (rc != MPI_SUCCESS) {
                        PDSIM_LOG_WARN("mpi rank {}: MPI_Cancel failed: {}", rank_,
                                       detail::mpi_error_string(rc));
                    }
                    return;  // MPI_Testsome completes it (cancelled or not)
                }
            }
            return;  // already complete
        }
        MPI_Request req = MPI_REQUEST_NULL;
        int rc =
            p.what == Post::What::kSend
                ? MPI_Isend(p.buf, p.count, MPI_BYTE, p.peer, static_cast<int>(p.tag), comm_, &req)
                : MPI_Irecv(p.buf, p.count, MPI_BYTE, p.peer, static_cast<int>(p.tag), comm_, &req);
        if (rc != MPI_SUCCESS) {
            p.op->complete(
                mpi_error(rc, p.what == Post::What::kSend ? "MPI_Isend" : "MPI_Irecv", *p.op), 0);
            return;
        }
        reqs_.push_back(req);
        active_.push_back(Active{p.what, p.count, std::move(p.op)});
    }

    void finish(const Active& a, MPI_Status& st, bool error_in_status) {
        if (a.what == Post::What::kRecv) {
            int cancelled = 0;
            MPI_Test_cancelled(&st, &cancelled);
            if (cancelled) {
                a.op->complete(
                    Status(StatusCode::kAborted, fmt::format("mpi rank {}: recv cancelled", rank_)),
                    0);
                return;
            }
        }
        int err = error_in_status ? st.MPI_ERROR : MPI_SUCCESS;
        if (err != MPI_SUCCESS) {
            a.op->complete(mpi_error(err, a.what == Post::What::kSend ? "send" : "recv", *a.op), 0);
            return;
        }
        size_t bytes = static_cast<size_t>(a.count);
        if (a.what == Post::What::kRecv) {
            int count = 0;
            MPI_Get_count(&st, MPI_BYTE, &count);
            bytes = static_cast<size_t>(count);
        }
        a.op->complete({}, bytes);
    }

    void progress_loop() {
        std::vector<Post> batch;
        std::vector<int> indices;
        std::vector<MPI_Status> statuses;
        auto last_activity = std::chrono::steady_clock::now();
        for (;;) {
            bool stopping = false;
            {
                std::unique_lock<std::mutex> lock(mu_);
                auto ready = [&] { return stop_ || !incoming_.empty(); };
                if (active_.empty()) {
                    cv_.wait(lock, ready);
                } else if (std::chrono::steady_clock::now() - last_activity > kStallAfter) {
                    // Waiting on the peer, not moving data: stop burning a core.
                    cv_.wait_for(lock, kStallSleep, ready);
                }
                batch.assign(std::make_move_iterator(incoming_.begin()),
                             std::make_move_iterator(incoming_.end()));
                incoming_.clear();
                stopping = stop_;
            }
            if (!batch.empty()) {
                last_activity = std::chrono::steady_clock::now();
                for (Post& p : batch) start(p);
                batch.clear();
            }
            if (stopping) {
                shutdown_active();
                return;
            }
            if (active_.empty()) continue;
            int n = static_cast<int>(reqs_.size());
            indices.resize(reqs_.size());
            statuses.resize(reqs_.size());
            int outcount = 0;
            int rc = MPI_Testsome(n, reqs_.data(), &outcount, indices.data(), statuses.data());
            if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
                // The call itself failed: nothing can be trusted any more; fail everything.
                Status st(StatusCode::kUnavailable,
                          fmt::format("mpi rank {}: MPI_Testsome failed: {}", rank_,
                                      detail::mpi_error_string(rc)));
                for (auto& a : active_) a.op->complete(st, 0);
                for (auto& r : reqs_) {
                    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
                }
                active_.clear();
                reqs_.clear();
                continue;
            }
            if (outcount == MPI_UNDEFINED || outcount == 0) {
                std::this_thread::yield();
                continue;
            }
            last_activity = std::chrono::steady_clock::now();
            for (int i = 0; i < outcount; ++i) {
                finish(active_[static_cast<size_t>(indices[static_cast<size_t>(i)])],
                       statuses[static_cast<size_t>(i)], rc == MPI_ERR_IN_STATUS);
            }
            // Testsome set the completed requests to MPI_REQUEST_NULL: compact both arrays,
            // keeping the order of the rest.
            size_t w = 0;
            for (size_t r = 0; r < reqs_.size(); ++r) {
                if (reqs_[r] == MPI_REQUEST_NULL) continue;
                reqs_[w] = reqs_[r];
                active_[w] = std::move(active_[r]);
                ++w;
            }
            reqs_.resize(w);
            active_.resize(w);
        }
    }

    void shutdown_active() {
        Status closed(StatusCode::kUnavailable,
                      fmt::format("mpi rank {}: transport closed", rank_));
        // A send still in flight may be read by MPI until it completes, and its caller frees the
        // buffer once its handle completes here. A send whose receive the peer has matched
        // finishes within moments once the peer runs (a peer that was stopped and continued
        // acknowledges the rendezvous late: freeing before that made MPI copy from unmapped
        // memory, a SIGSEGV). Give those up to kCloseDrain; a send that no receive matched is
        // never read again, so releasing it after the bound is safe.
        const auto drain_until = std::chrono::steady_clock::now() + kCloseDrain;
        for (size_t i = 0; i < active_.size(); ++i) {
            if (active_[i].what != Post::What::kSend || reqs_[i] == MPI_REQUEST_NULL) continue;
            for (;;) {
                int done = 0;
                MPI_Status st;
                if (MPI_Test(&reqs_[i], &done, &st) != MPI_SUCCESS) break;
                if (done) {
                    finish(active_[i], st, /*error_in_status=*/false);
                    break;
                }
                if (std::chrono::steady_clock::now() >= drain_until) break;
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
        }
        for (size_t i = 0; i < active_.size(); ++i) {
            if (reqs_[i] == MPI_REQUEST_NULL) continue;  // drained above
            if (active_[i].what == Post::What::kRecv) {
                // Unmatched receives cancel promptly; a matched one finishes its data first.
                MPI_Cancel(&reqs_[i]);
                MPI_Status st;
                MPI_Wait(&reqs_[i], &st);
            } else {
                // Sends cannot be cancelled (see the header): release the request.
                MPI_Request_free(&reqs_[i]);
            }
            active_[i].op->complete(closed, 0);
        }
        active_.clear();
        reqs_.clear();
        std::deque<Post> left;
        {
            std::lock_guard<std::mutex> lock(mu_);
            left.swap(incoming_);
        }
        for (Post& p : left) {
            if (p.what != Post::What::kCancel) p.op->complete(closed, 0);
        }
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int world_ = 1;
    int tag_ub_ = 32767;

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Post> incoming_;  // under mu_
    bool stop_ = false;          // under mu_

    // Progress thread only: reqs_[i] belongs to active_[i].
    std::vector<MPI_Request> reqs_;
    std::vector<Active> active_;
    std::thread progress_;
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_mpi_transport(const TransportOptions& /*options*/) {
    PDSIM_RETURN_IF_ERROR(ensure_mpi_initialized());
    auto t = std::make_unique<MpiTransport>();
    PDSIM_RETURN_IF_ERROR(t->init());
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
