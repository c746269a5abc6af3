// "nccl": two-sided ncclSend/ncclRecv on a dedicated comm stream (see gpu_transports.h).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "common/cuda_check.h"
#include "common/mpi_check.h"
#include "common/nccl_check.h"
#include "common/thread_info.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/rendezvous.h"

namespace pdsim::transfer {

namespace {

struct Post {
    bool send;
    int peer;
    void* buf;
    size_t bytes;
    std::shared_ptr<OpState> op;
};

// One ncclGroupStart/End batch and the event recorded after it.
struct Batch {
    cudaEvent_t event;
    std::vector<Post> posts;
};

// Rank 0 creates the id; the others get it over MPI or from the bootstrap directory.
Status exchange_unique_id(const TransportOptions& o, int rank, bool use_mpi, ncclUniqueId* id) {
    const std::string dir = o.get<GpuTransportOptions>().rendezvous_dir;
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(id));
    if (use_mpi) {
        MPI_CHECK(MPI_Bcast(id, sizeof(*id), MPI_BYTE, 0, MPI_COMM_WORLD));
        return {};
    }
    if (dir.empty()) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "nccl: no bootstrap: run under MPI or set GpuTransportOptions.rendezvous_dir");
    }
    const FileRendezvous rendezvous(dir, "nccl-id");
    if (rank == 0) {
        return rendezvous
            .publish(0, std::string_view(reinterpret_cast<const char*>(id), sizeof(*id)))
            .with_context("nccl");
    }
    const int root = 0;
    auto published = rendezvous.collect(std::span<const int>(&root, 1), o.connect_timeout);
    if (!published.ok()) return published.status().with_context(fmt::format("nccl rank {}", rank));
    const std::string& bytes = published->front();
    if (bytes.size() != sizeof(*id)) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "nccl rank {}: {} holds {} bytes, not {}", rank,
                           rendezvous.path_of(0), bytes.size(), sizeof(*id));
    }
    std::memcpy(id, bytes.data(), sizeof(*id));
    return {};
}

class NcclTransport final : public Transport {
public:
    NcclTransport(int rank, int world, int device) : rank_(rank), world_(world), device_(device) {}
    ~NcclTransport() override { close(); }

    Status init(const TransportOptions& o, bool use_mpi) {
        CUDA_CHECK(cudaSetDevice(device_));
        ncclUniqueId id{};
        PDSIM_RETURN_IF_ERROR(exchange_unique_id(o, rank_, use_mpi, &id));
        NCCL_CHECK(ncclCommInitRank(&comm_, world_, id, rank_));
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        progress_ = std::thread([this] {
            set_thread_name("pdsim-nccl-prog");
            progress_loop();
        });
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
        c.max_tag = std::numeric_limits<Tag>::max();  // accepted, not matched
        c.max_message_bytes = std::numeric_limits<size_t>::max();
        return c;
    }

    StatusOr<RequestHandle> post_send(int peer, Tag tag, const void* buf, size_t bytes) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, bytes, /*is_send=*/true));
        auto op = std::make_shared<OpState>(OpKind::kSend, peer, tag, bytes);
        PDSIM_RETURN_IF_ERROR(enqueue(Post{true, peer, const_cast<void*>(buf), bytes, op}));
        return RequestHandle(std::move(op));
    }

    StatusOr<RequestHandle> post_recv(int peer, Tag tag, void* buf, size_t capacity) override {
        PDSIM_RETURN_IF_ERROR(check_post(peer, tag, buf, capacity, /*is_send=*/false));
        auto op = std::make_shared<OpState>(OpKind::kRecv, peer, tag, capacity);
        PDSIM_RETURN_IF_ERROR(enqueue(Post{false, peer, buf, capacity, op}));
        return RequestHandle(std::move(op));
    }

    Status cancel(const RequestHandle& handle) override {
        if (!handle.valid()) return PDSIM_ERROR(StatusCode::kInvalidArgument, "nccl: cancel");
        bool withdrawn = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = std::find_if(incoming_.begin(), incoming_.end(),
                                   [&](const Post& p) { return p.op == handle.state(); });
            if (it != incoming_.end()) {
                incoming_.erase(it);
                withdrawn = true;
            }
        }
        if (withdrawn) {
            handle.state()->complete(Status(StatusCode::kAborted, "nccl: cancelled"), 0);
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
        if (comm_ != nullptr) {
            // Abort rather than destroy when operations may still be waiting for a peer.
            if (aborted_) {
                ncclCommAbort(comm_);
            } else {
                ncclCommDestroy(comm_);
            }
            comm_ = nullptr;
        }
        if (stream_ != nullptr) {
            cudaStreamDestroy(stream_);
            stream_ = nullptr;
        }
    }

private:
    Status enqueue(Post p) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stop_) return PDSIM_ERROR(StatusCode::kUnavailable, "nccl: transport closed");
            incoming_.push_back(std::move(p));
        }
        cv_.notify_one();
        return {};
    }

    // Issues one group; on failure completes its posts with the error.
    void issue(std::vector<Post> posts) {
        auto fail = [&](const std::string& what) {
            Status st(StatusCode::kUnavailable, fmt::format("nccl rank {}: {}", rank_, what));
            for (auto& p : posts) p.op->complete(st, 0);
        };
        ncclResult_t rc = ncclGroupStart();
        for (const Post& p : posts) {
            if (rc != ncclSuccess) break;
            rc = p.send ? ncclSend(p.buf, p.bytes, ncclUint8, p.peer, comm_, stream_)
                        : ncclRecv(p.buf, p.bytes, ncclUint8, p.peer, comm_, stream_);
        }
        ncclResult_t end = ncclGroupEnd();
        if (rc == ncclSuccess) rc = end;
        if (rc != ncclSuccess) {
            fail(std::string("ncclSend/ncclRecv group failed: ") + ncclGetErrorString(rc));
            return;
        }
        cudaEvent_t ev = nullptr;
        cudaError_t ce = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev, stream_);
        if (ce != cudaSuccess) {
            fail(std::string("event: ") + cudaGetErrorString(ce));
            return;
        }
        batches_.push_back(Batch{ev, std::move(posts)});
    }

    void fail_all(const Status& st) {
        for (auto& b : batches_) {
            cudaEventDestroy(b.event);
            for (auto& p : b.posts) p.op->complete(st, 0);
        }
        batches_.clear();
    }

    void progress_loop() {
        cudaSetDevice(device_);
        for (;;) {
            std::vector<Post> posts;
            bool stopping = false;
            {
                std::unique_lock<std::mutex> lock(mu_);
                if (batches_.empty()) cv_.wait(lock, [&] { return stop_ || !incoming_.empty(); });
                posts.assign(std::make_move_iterator(incoming_.begin()),
                             std::make_move_iterator(incoming_.end()));
                incoming_.clear();
                stopping = stop_;
            }
            if (stopping) {
                Status closed(StatusCode::kUnavailable,
                              fmt::format("nccl rank {}: transport closed", rank_));
                for (auto& p : posts) p.op->complete(closed, 0);
                aborted_ = !batches_.empty();
                fail_all(closed);
                return;
            }
            if (!posts.empty()) issue(std::move(posts));
            // Batches on one stream finish in order.
            while (!batches_.empty()) {
                cudaError_t rc = cudaEventQuery(batches_.front().event);
                if (rc == cudaErrorNotReady) break;
                Batch b = std::move(batches_.front());
                batches_.pop_front();
                cudaEventDestroy(b.event);
                Status st;
                if (rc != cudaSuccess) {
                    st = Status(StatusCode::kUnavailable,
                                fmt::format("nccl rank {}: {}", rank_, cudaGetErrorString(rc)));
                }
                for (auto& p : b.posts) p.op->complete(st, st.ok() ? p.bytes : 0);
            }
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm_, &async);
            if (async != ncclSuccess && async != ncclInProgress) {
                aborted_ = true;
                fail_all(Status(StatusCode::kUnavailable,
                                fmt::format("nccl rank {}: communicator error: {}", rank_,
                                            ncclGetErrorString(async))));
            }
            if (!batches_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(10));
        }
    }

    const int rank_;
    const int world_;
    const int device_;
    ncclComm_t comm_ = nullptr;
    cudaStream_t stream_ = nullptr;

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Post> incoming_;  // under mu_
    bool stop_ = false;          // under mu_

    std::deque<Batch> batches_;  // progress thread only
    bool aborted_ = false;       // progress thread, read by close() after join
    std::thread progress_;
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> make_nccl_transport(const TransportOptions& options) {
    const GpuTransportOptions gpu = options.get<GpuTransportOptions>();
    PDSIM_RETURN_IF_ERROR(check_cuda_device(gpu.device_index));
    int rank = options.rank;
    int world = options.world_size;
    int mpi_up = 0;
    MPI_Initialized(&mpi_up);
    int mpi_down = 0;
    MPI_Finalized(&mpi_down);
    bool use_mpi = mpi_up && !mpi_down && gpu.rendezvous_dir.empty();
    if (use_mpi) {
        MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
        MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
    }
    if (world < 1 || rank < 0 || rank >= world) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "nccl: rank {} / world {} invalid", rank,
                           world);
    }
    auto t = std::make_unique<NcclTransport>(rank, world, gpu.device_index);
    PDSIM_RETURN_IF_ERROR(t->init(options, use_mpi));
    return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pdsim::transfer
