// The testbed's own coordination between ranks (not the KV data path, which is the transfer
// engine's Transport): a Mailbox of small JSON messages per channel, the TP group's allgather for
// the synthetic model, and the clock.
//
// Two implementations of each:
//  - MPI (one process per rank, under mpirun): the mailbox is MPI point-to-point on its own
//    duplicated communicator (tag = channel, matched probes, so any source can be received
//    without a posted receive per peer); the TP allgather is MPI_Iallgather on a communicator
//    split per instance (MPI_Comm_split), bounded by a timeout. MPI must be initialized with
//    MPI_THREAD_MULTIPLE: the allgather runs on the compute stream's thread while the scheduler
//    thread uses the mailbox.
//  - Local (every rank a thread of one process): in-process queues and a rendezvous.
//
// Messages: a JSON object with a string field "k" (the kind), serialized as CBOR. Channels
// separate consumers that run on different threads of one rank: kInstance (the rank's scheduler
// loop), kRouter (the router thread on rank 0), kCollect (rank 0's end-of-phase gathering and the
// clock sync). Messages from one source on one channel arrive in send order.
//
// Clock: now_us() is CLOCK_MONOTONIC in microseconds (what MPI_Wtime reads on Linux); ranks on
// other hosts are put on rank 0's clock with an offset estimated at start (estimate_offsets()).
//
// Thread-safety: send() may be called from any thread; recv() on one channel from one thread at
// a time. TpComm::allgather from one thread per rank (the compute stream).
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "backends/model/synthetic_model.h"
#include "common/status.h"

namespace pdsim::testbed {

// Monotonic clock, microseconds.
[[nodiscard]] double now_us();
// steady_clock time point -> now_us() scale.
[[nodiscard]] double to_us(std::chrono::steady_clock::time_point t);

// kHeartbeat: every rank but 0 tells rank 0's router once a second that it is alive, and rank 0
// pulses every other rank under mpirun (router.h, "Liveness").
enum class Channel : int { kInstance = 1, kRouter = 2, kCollect = 3, kHeartbeat = 4 };
inline constexpr int kNumChannels = 5;  // indices 0 .. kHeartbeat

struct Message {
    int src = -1;
    nlohmann::json body;
    [[nodiscard]] std::string kind() const { return body.value("k", std::string()); }
};

class Mailbox {
public:
    virtual ~Mailbox() = default;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int size() const = 0;
    // Sends `body` to `dst` (may be this rank) on `channel`. Never blocks on the peer.
    [[nodiscard]] virtual Status send(int dst, Channel channel, const nlohmann::json& body) = 0;
    // The next message on `channel` from any source, or nullopt after `timeout`.
    [[nodiscard]] StatusOr<std::optional<Message>> recv(Channel channel,
                                                        std::chrono::microseconds timeout);
    // The next message of kind `kind` on `channel`; other messages are kept, in order, for later
    // recv() calls. nullopt after `timeout`.
    [[nodiscard]] StatusOr<std::optional<Message>> recv_kind(Channel channel, std::string_view kind,
                                                             std::chrono::microseconds timeout);

protected:
    [[nodiscard]] virtual StatusOr<std::optional<Message>> recv_raw(
        Channel channel, std::chrono::microseconds timeout) = 0;

private:
    std::mutex stash_mu_;
    std::deque<Message> stash_[kNumChannels];
};

// ---- MPI ----
class MpiMailbox final : public Mailbox {
public:
    // Duplicates MPI_COMM_WORLD (collective).
    [[nodiscard]] static StatusOr<std::unique_ptr<MpiMailbox>> create();
    ~MpiMailbox() override;
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] Status send(int dst, Channel channel, const nlohmann::json& body) override;
    // Waits (bounded) for the sends still in flight; call before MPI_Finalize.
    void drain(std::chrono::milliseconds timeout);

protected:
    [[nodiscard]] StatusOr<std::optional<Message>> recv_raw(
        Channel channel, std::chrono::microseconds timeout) override;

private:
    MpiMailbox() = default;
    void reap_locked();

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
    std::mutex mu_;
    struct Pending {
        MPI_Request req;
        std::shared_ptr<std::vector<uint8_t>> buf;
    };
    std::vector<Pending> pending_;
};

class MpiTpComm final : public model::TpComm {
public:
    // Collective over MPI_COMM_WORLD: ranks with the same `color` form a group ordered by `key`.
    [[nodiscard]] static StatusOr<std::unique_ptr<MpiTpComm>> create(
        int color, int key, std::chrono::milliseconds timeout);
    ~MpiTpComm() override;
    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] Status allgather(const float* mine, size_t count, float* out) override;

private:
    MpiTpComm() = default;
    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
    std::chrono::milliseconds timeout_{60'000};
};

// ---- in-process ----
class LocalHub {
public:
    explicit LocalHub(int size);
    [[nodiscard]] std::unique_ptr<Mailbox> mailbox(int rank);
    void push(int dst, Channel channel, Message m);
    [[nodiscard]] std::optional<Message> pop(int rank, Channel channel,
                                             std::chrono::microseconds timeout);
    [[nodiscard]] int size() const { return size_; }

private:
    struct Queue {
        std::mutex mu;
        std::condition_variable cv;
        std::deque<Message> q;
    };
    int size_;
    std::vector<std::unique_ptr<Queue>> queues_;  // [rank * kNumChannels + channel]
};

// In-process TP groups: allgather waits (bounded) for every member's contribution of the round and
// returns once every member has copied them. A member's timeout breaks the group for good (every
// later allgather of every member is kUnavailable naming the first failure), since the rounds can
// no longer be matched.
class LocalTpGroup {
public:
    LocalTpGroup(int size, std::chrono::milliseconds timeout);
    ~LocalTpGroup();
    // The member for TP rank `r` (owned by the group).
    [[nodiscard]] model::TpComm* member(int r);

private:
    class Member;
    Status gather(int r, const float* mine, size_t count, float* out);
    int n_;
    std::chrono::milliseconds timeout_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<const float*> slots_;
    int arrived_ = 0, readers_ = 0;
    uint64_t gen_ = 0;
    // A member timed out: the rounds are out of step (its arrival and its buffer pointer stay
    // behind), so every later gather of every member fails at once with `broken_why_`.
    bool broken_ = false;
    std::string broken_why_;
    std::vector<std::unique_ptr<Member>> members_;
};

// Clock offsets of every rank relative to rank 0 (remote clock - rank 0 clock), estimated by
// ping-pong on kCollect: rank 0 returns them (others an empty vector). Collective.
[[nodiscard]] StatusOr<std::vector<double>> estimate_offsets(Mailbox& mbox, int rounds,
                                                             std::chrono::milliseconds timeout);
// Every rank sends a token to rank 0, which answers once it has them all. Bounded.
// A rank other than 0 released with stop_barrier() returns kUnavailable "barrier N: rank 0
// stopped the run: <why>".
[[nodiscard]] Status barrier(Mailbox& mbox, const std::string& name,
                             std::chrono::milliseconds timeout);
// Rank 0, ending the run early (a peer is dead): releases `ranks` from barrier `name` at once with
// `why`, so that the live ranks end now instead of at the barrier's timeout. Best effort (sends
// that fail are ignored); does not block.
void stop_barrier(Mailbox& mbox, const std::string& name, const std::vector<int>& ranks,
                  const std::string& why);
// A barrier that carries each rank's outcome: every rank sends `mine` to rank 0, which answers
// every rank with the verdict, and every rank returns it: OK when every rank's was OK, else the
// failure of the lowest failing rank, with its code and "rank R: <its message>" (so that every
// rank stops the same way when one could not, e.g., set up a phase). Collective on kCollect (its
// messages carry `name`: agreements and barriers of other names are kept for their own calls).
// Bounded: rank 0 waits `timeout` for the others, then answers the ranks that arrived with
// kDeadlineExceeded naming the missing ones (and returns it); another rank waits 2 x `timeout`
// for the verdict (so that rank 0's reaches it), then returns kDeadlineExceeded.
[[nodiscard]] Status agree(Mailbox& mbox, const std::string& name, const Status& mine,
                           std::chrono::milliseconds timeout);

}  // namespace pdsim::testbed
