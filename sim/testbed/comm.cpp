#include "sim/testbed/comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>
#include <thread>

#include "common/mpi_check.h"
#include "sim/testbed/protocol.h"

namespace pdsim::testbed {

using Clock = std::chrono::steady_clock;

double now_us() {
    return to_us(Clock::now());
}

double to_us(Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
}

// ---- Mailbox (stash) ----
StatusOr<std::optional<Message>> Mailbox::recv(Channel channel, std::chrono::microseconds timeout) {
    {
        std::lock_guard<std::mutex> lock(stash_mu_);
        auto& st = stash_[static_cast<int>(channel)];
        if (!st.empty()) {
            Message m = std::move(st.front());
            st.pop_front();
            return std::optional<Message>(std::move(m));
        }
    }
    return recv_raw(channel, timeout);
}

StatusOr<std::optional<Message>> Mailbox::recv_kind(Channel channel, std::string_view kind,
                                                    std::chrono::microseconds timeout) {
    {
        std::lock_guard<std::mutex> lock(stash_mu_);
        auto& st = stash_[static_cast<int>(channel)];
        for (auto it = st.begin(); it != st.end(); ++it) {
            if (it->kind() == kind) {
                Message m = std::move(*it);
                st.erase(it);
                return std::optional<Message>(std::move(m));
            }
        }
    }
    const auto deadline = Clock::now() + timeout;
    while (true) {
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
        if (left.count() <= 0) return std::optional<Message>();
        PDSIM_ASSIGN_OR_RETURN(std::optional<Message> m, recv_raw(channel, left));
        if (!m) return std::optional<Message>();
        if (m->kind() == kind) return m;
        std::lock_guard<std::mutex> lock(stash_mu_);
        stash_[static_cast<int>(channel)].push_back(std::move(*m));
    }
}

// ---- MPI mailbox ----
StatusOr<std::unique_ptr<MpiMailbox>> MpiMailbox::create() {
    std::unique_ptr<MpiMailbox> m(new MpiMailbox());
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &m->comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(m->comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(m->comm_, &m->rank_));
    MPI_CHECK(MPI_Comm_size(m->comm_, &m->size_));
    return m;
}

MpiMailbox::~MpiMailbox() {
    drain(std::chrono::milliseconds(2000));
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : pending_) {
        MPI_Cancel(&p.req);
        MPI_Request_free(&p.req);
    }
    pending_.clear();
    if (comm_ != MPI_COMM_NULL) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Comm_free(&comm_);
    }
}

void MpiMailbox::reap_locked() {
    for (size_t i = 0; i < pending_.size();) {
        int done = 0;
        MPI_Test(&pending_[i].req, &done, MPI_STATUS_IGNORE);
        if (done) {
            pending_[i] = std::move(pending_.back());
            pending_.pop_back();
        } else {
            ++i;
        }
    }
}

void MpiMailbox::drain(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            reap_locked();
            if (pending_.empty()) return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

Status MpiMailbox::send(int dst, Channel channel, const nlohmann::json& body) {
    if (dst < 0 || dst >= size_)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "mailbox: bad rank {}", dst);
    auto buf = std::make_shared<std::vector<uint8_t>>(nlohmann::json::to_cbor(body));
    if (buf->size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "mailbox: message of {} bytes",
                           buf->size());
    }
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
    Pending p{MPI_REQUEST_NULL, buf};
    MPI_CHECK(MPI_Isend(buf->data(), static_cast<int>(buf->size()), MPI_BYTE, dst,
                        static_cast<int>(channel), comm_, &p.req));
    pending_.push_back(std::move(p));
    return {};
}

StatusOr<std::optional<Message>> MpiMailbox::recv_raw(Channel channel,
                                                      std::chrono::microseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    int polls = 0;
    while (true) {
        int flag = 0;
        MPI_Message msg;
        MPI_Status status;
        MPI_CHECK(
            MPI_Improbe(MPI_ANY_SOURCE, static_cast<int>(channel), comm_, &flag, &msg, &status));
        if (flag) {
            int count = 0;
            MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
            std::vector<uint8_t> bytes(static_cast<size_t>(count));
            MPI_CHECK(MPI_Mrecv(bytes.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE));
            Message m;
            m.src = status.MPI_SOURCE;
            StatusOr<nlohmann::json> body = decode_cbor(bytes);
            if (!body.ok()) {
                return PDSIM_ERROR(StatusCode::kDataLoss,
                                   "mailbox: garbled message from rank {}: {}", m.src,
                                   body.status().message());
            }
            m.body = std::move(*body);
            return std::optional<Message>(std::move(m));
        }
        if (Clock::now() >= deadline) return std::optional<Message>();
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!pending_.empty()) reap_locked();
        }
        // Poll fast for a moment (lockstep TP ranks wait on each other's messages), then back off.
        if (++polls < 64) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 20 : 200));
        }
    }
}

// ---- MPI TP comm ----
StatusOr<std::unique_ptr<MpiTpComm>> MpiTpComm::create(int color, int key,
                                                       std::chrono::milliseconds timeout) {
    std::unique_ptr<MpiTpComm> c(new MpiTpComm());
    c->timeout_ = timeout;
    MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &c->comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(c->comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(c->comm_, &c->rank_));
    MPI_CHECK(MPI_Comm_size(c->comm_, &c->size_));
    return c;
}

MpiTpComm::~MpiTpComm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

Status MpiTpComm::allgather(const float* mine, size_t count, float* out) {
    if (count > static_cast<size_t>(std::numeric_limits<int>::max())) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "allgather of {} floats", count);
    }
    MPI_Request req;
    MPI_CHECK(MPI_Iallgather(mine, static_cast<int>(count), MPI_FLOAT, out, static_cast<int>(count),
                             MPI_FLOAT, comm_, &req));
    const auto deadline = Clock::now() + timeout_;
    int polls = 0;
    while (true) {
        int done = 0;
        MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
        if (done) return {};
        if (Clock::now() >= deadline) {
            // The collective cannot be withdrawn; the rank is unusable from here on.
            return PDSIM_ERROR(
                StatusCode::kDeadlineExceeded,
                "TP allgather ({} ranks) not complete after {} ms: a TP peer is stuck or gone",
                size_, timeout_.count());
        }
        if (++polls < 256) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
}

// ---- in-process ----
namespace {
class LocalMailbox final : public Mailbox {
public:
    LocalMailbox(LocalHub* hub, int rank) : hub_(hub), rank_(rank) {}
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] int size() const override { return hub_->size(); }
    [[nodiscard]] Status send(int dst, Channel channel, const nlohmann::json& body) override {
        if (dst < 0 || dst >= hub_->size()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "mailbox: bad rank {}", dst);
        }
        hub_->push(dst, channel, Message{rank_, body});
        return {};
    }

protected:
    [[nodiscard]] StatusOr<std::optional<Message>> recv_raw(
        Channel channel, std::chrono::microseconds timeout) override {
        return hub_->pop(rank_, channel, timeout);
    }

private:
    LocalHub* hub_;
    int rank_;
};
}  // namespace

LocalHub::LocalHub(int size) : size_(size) {
    for (int i = 0; i < size * kNumChannels; ++i) queues_.push_back(std::make_unique<Queue>());
}

std::unique_ptr<Mailbox> LocalHub::mailbox(int rank) {
    return std::make_unique<LocalMailbox>(this, rank);
}

void LocalHub::push(int dst, Channel channel, Message m) {
    Queue& q = *queues_[static_cast<size_t>(dst * kNumChannels + static_cast<int>(channel))];
    {
        std::lock_guard<std::mutex> lock(q.mu);
        q.q.push_back(std::move(m));
    }
    q.cv.notify_all();
}

std::optional<Message> LocalHub::pop(int rank, Channel channel, std::chrono::microseconds timeout) {
    Queue& q = *queues_[static_cast<size_t>(rank * kNumChannels + static_cast<int>(channel))];
    std::unique_lock<std::mutex> lock(q.mu);
    if (!q.cv.wait_for(lock, timeout, [&] { return !q.q.empty(); })) return std::nullopt;
    Message m = std::move(q.q.front());
    q.q.pop_front();
    return m;
}

class LocalTpGroup::Member final : public model::TpComm {
public:
    Member(LocalTpGroup* g, int r) : g_(g), r_(r) {}
    [[nodiscard]] int size() const override { return g_->n_; }
    [[nodiscard]] int rank() const override { return r_; }
    [[nodiscard]] Status allgather(const float* mine, size_t count, float* out) override {
        return g_->gather(r_, mine, count, out);
    }

private:
    LocalTpGroup* g_;
    int r_;
};

LocalTpGroup::LocalTpGroup(int size, std::chrono::milliseconds timeout)
    : n_(size), timeout_(timeout), slots_(static_cast<size_t>(size)) {
    for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<Member>(this, r));
}

LocalTpGroup::~LocalTpGroup() = default;

model::TpComm* LocalTpGroup::member(int r) {
    return members_.at(static_cast<size_t>(r)).get();
}

Status LocalTpGroup::gather(int r, const float* mine, size_t count, float* out) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto broken = [&] {
        return PDSIM_ERROR(StatusCode::kUnavailable, "TP allgather: the TP group broke earlier: {}",
                           broken_why_);
    };
    const auto fail = [&](std::string why) {
        broken_ = true;
        broken_why_ = why;
        cv_.notify_all();
        return Status(StatusCode::kDeadlineExceeded, std::move(why));
    };
    if (broken_) return broken();
    // A previous round's readers must all have left before a new round starts.
    if (!cv_.wait_for(lock, timeout_, [&] { return readers_ == 0 || broken_; })) {
        return fail(fmt::format("TP allgather: rank {}: the previous round never finished", r));
    }
    if (broken_) return broken();
    const uint64_t gen = gen_;
    slots_[static_cast<size_t>(r)] = mine;
    if (++arrived_ == n_) {
        arrived_ = 0;
        ++gen_;
        readers_ = n_;
        cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return gen_ != gen || broken_; })) {
        return fail(
            fmt::format("TP allgather ({} ranks) timed out after {} ms on rank {}: a TP "
                        "peer is stuck or gone",
                        n_, timeout_.count(), r));
    }
    if (gen_ == gen) return broken();
    for (int k = 0; k < n_; ++k) {
        std::memcpy(out + static_cast<size_t>(k) * count, slots_[static_cast<size_t>(k)],
                    count * sizeof(float));
    }
    if (--readers_ == 0) {
        cv_.notify_all();
    } else {
        cv_.wait_for(lock, timeout_, [&] { return readers_ == 0 || gen_ != gen + 1; });
    }
    return {};
}

// ---- clock and barrier ----
StatusOr<std::vector<double>> estimate_offsets(Mailbox& mbox, int rounds,
                                               std::chrono::milliseconds timeout) {
    const int n = mbox.size();
    if (mbox.rank() != 0) {
        for (int i = 0; i < rounds; ++i) {
            PDSIM_ASSIGN_OR_RETURN(auto m, mbox.recv_kind(Channel::kCollect, "ping", timeout));
            if (!m)
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "clock sync: no ping from rank 0");
            PDSIM_RETURN_IF_ERROR(
                mbox.send(0, Channel::kCollect, {{"k", "pong"}, {"t", now_us()}}));
        }
        return std::vector<double>();
    }
    std::vector<double> offsets(static_cast<size_t>(n), 0.0);
    for (int r = 1; r < n; ++r) {
        double best_rtt = std::numeric_limits<double>::infinity();
        for (int i = 0; i < rounds; ++i) {
            const double t0 = now_us();
            PDSIM_RETURN_IF_ERROR(mbox.send(r, Channel::kCollect, {{"k", "ping"}}));
            PDSIM_ASSIGN_OR_RETURN(auto m, mbox.recv_kind(Channel::kCollect, "pong", timeout));
            const double t1 = now_us();
            if (!m)
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "clock sync: no answer from rank {}", r);
            if (m->src != r) {
                return PDSIM_ERROR(StatusCode::kInternal,
                                   "clock sync: pong from rank {}, expected {}", m->src, r);
            }
            const double rtt = t1 - t0;
            if (rtt < best_rtt) {
                best_rtt = rtt;
                offsets[static_cast<size_t>(r)] = m->body.at("t").get<double>() - (t0 + t1) / 2;
            }
        }
    }
    return offsets;
}

Status barrier(Mailbox& mbox, const std::string& name, std::chrono::milliseconds timeout) {
    const std::string arrive = "barrier-in:" + name, leave = "barrier-out:" + name;
    if (mbox.rank() != 0) {
        PDSIM_RETURN_IF_ERROR(mbox.send(0, Channel::kCollect, {{"k", arrive}}));
        PDSIM_ASSIGN_OR_RETURN(auto m, mbox.recv_kind(Channel::kCollect, leave, timeout));
        if (!m)
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "barrier {}: rank 0 never released it", name);
        if (m->body.contains("stopped")) {
            return PDSIM_ERROR(StatusCode::kUnavailable, "barrier {}: rank 0 stopped the run: {}",
                               name, m->body.value("stopped", std::string()));
        }
        return {};
    }
    const auto deadline = Clock::now() + timeout;
    std::vector<bool> arrived(static_cast<size_t>(mbox.size()), false);
    arrived[0] = true;
    for (int i = 1; i < mbox.size(); ++i) {
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
        PDSIM_ASSIGN_OR_RETURN(auto m,
                               mbox.recv_kind(Channel::kCollect, arrive,
                                              std::max(left, std::chrono::microseconds(0))));
        if (!m) {
            std::string missing;
            for (size_t r = 0; r < arrived.size(); ++r) {
                if (!arrived[r]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
            }
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "barrier {}: only {} of {} ranks arrived within {} s; rank{} {} "
                               "did not (dead or hung)",
                               name, i, mbox.size(), timeout.count() / 1000,
                               mbox.size() - i > 1 ? "s" : "", missing);
        }
        if (m->src > 0 && m->src < mbox.size()) arrived[static_cast<size_t>(m->src)] = true;
    }
    for (int r = 1; r < mbox.size(); ++r)
        PDSIM_RETURN_IF_ERROR(mbox.send(r, Channel::kCollect, {{"k", leave}}));
    return {};
}

void stop_barrier(Mailbox& mbox, const std::string& name, const std::vector<int>& ranks,
                  const std::string& why) {
    for (int r : ranks) {
        mbox.send(r, Channel::kCollect, {{"k", "barrier-out:" + name}, {"stopped", why}})
            .ignore_error();
    }
}

Status agree(Mailbox& mbox, const std::string& name, const Status& mine,
             std::chrono::milliseconds timeout) {
    const std::string arrive = "agree-in:" + name, verdict = "agree-out:" + name;
    auto encode = [](std::string_view kind, const Status& st) {
        return nlohmann::json{{"k", kind},
                              {"code", static_cast<int>(st.code())},
                              {"msg", st.ok() ? std::string() : st.message()}};
    };
    auto decode = [](const nlohmann::json& j) -> Status {
        const int code = j.value("code", static_cast<int>(StatusCode::kInternal));
        if (code == 0) return {};
        const bool known = code > 0 && code <= static_cast<int>(StatusCode::kInternal);
        return Status(known ? static_cast<StatusCode>(code) : StatusCode::kInternal,
                      j.value("msg", std::string("?")));
    };
    if (mbox.rank() != 0) {
        PDSIM_RETURN_IF_ERROR(mbox.send(0, Channel::kCollect, encode(arrive, mine)));
        // Twice rank 0's bound: when rank 0 gives up on a missing rank, its verdict gets here.
        PDSIM_ASSIGN_OR_RETURN(auto m, mbox.recv_kind(Channel::kCollect, verdict, 2 * timeout));
        if (!m) {
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "agreement {}: no verdict from rank 0", name);
        }
        return decode(m->body);
    }
    // Rank 0: the lowest failing rank decides.
    std::vector<Status> outcome(static_cast<size_t>(mbox.size()));
    std::vector<bool> arrived(static_cast<size_t>(mbox.size()), false);
    outcome[0] = mine;
    arrived[0] = true;
    const auto deadline = Clock::now() + timeout;
    Status verdict_status;
    for (int got = 1; got < mbox.size();) {
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
        PDSIM_ASSIGN_OR_RETURN(auto m,
                               mbox.recv_kind(Channel::kCollect, arrive,
                                              std::max(left, std::chrono::microseconds(0))));
        if (!m) {
            std::string missing;
            for (int r = 1; r < mbox.size(); ++r) {
                if (!arrived[static_cast<size_t>(r)]) {
                    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                }
            }
            verdict_status = Status(StatusCode::kDeadlineExceeded,
                                    fmt::format("agreement {}: rank(s) {} did not report within "
                                                "{} ms",
                                                name, missing, timeout.count()));
            break;
        }
        if (m->src <= 0 || m->src >= mbox.size() || arrived[static_cast<size_t>(m->src)]) continue;
        arrived[static_cast<size_t>(m->src)] = true;
        outcome[static_cast<size_t>(m->src)] = decode(m->body);
        ++got;
    }
    if (verdict_status.ok()) {
        for (int r = 0; r < mbox.size(); ++r) {
            const Status& st = outcome[static_cast<size_t>(r)];
            if (!st.ok()) {
                verdict_status = Status(st.code(), fmt::format("rank {}: {}", r, st.message()));
                break;
            }
        }
    }
    for (int r = 1; r < mbox.size(); ++r) {
        if (!arrived[static_cast<size_t>(r)]) continue;
        PDSIM_RETURN_IF_ERROR(mbox.send(r, Channel::kCollect, encode(verdict, verdict_status)));
    }
    return verdict_status;
}

}  // namespace pdsim::testbed
