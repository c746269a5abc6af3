// The nccl transport's per-pair id exchange and messages (see nccl_pair_ids.h).
#include "transfer/nccl/nccl_pair_ids.h"

#include <mpi.h>

#include <memory>
#include <optional>
#include <thread>

#include "transfer/nccl/gpu_transports.h"
#include "transfer/rendezvous.h"

namespace pdsim::transfer {

namespace {

std::string join_ranks(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
}

Status check_world(int rank, int world) {
    if (world < 1 || rank < 0 || rank >= world) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "nccl: rank {} / world {} invalid", rank,
                           world);
    }
    return {};
}

// make_id's id for `pair`, checked for size.
StatusOr<std::string> make_checked(const MakePairId& make_id, const RankPair& pair,
                                   size_t id_bytes) {
    auto id = make_id(pair);
    if (!id.ok()) {
        return id.status().with_context(
            fmt::format("nccl: creating the id of pair {}-{}", pair.low, pair.high));
    }
    if (id->size() != id_bytes) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "nccl: the id of pair {}-{} has {} bytes, not {}",
                           pair.low, pair.high, id->size(), id_bytes);
    }
    return id;
}

}  // namespace

StatusOr<RankPair> rank_pair(int a, int b) {
    if (a < 0 || b < 0 || a == b) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "nccl: ranks {} and {} do not make a pair (two distinct ranks >= 0)", a,
                           b);
    }
    return RankPair{std::min(a, b), std::max(a, b)};
}

int rank_in_pair(const RankPair& pair, int self) {
    return self == pair.low ? 0 : 1;
}

std::vector<RankPair> pairs_of(int rank, int world) {
    std::vector<RankPair> out;
    for (int peer = 0; peer < world; ++peer) {
        if (peer != rank) out.push_back({std::min(rank, peer), std::max(rank, peer)});
    }
    return out;
}

std::string pair_id_key(const RankPair& pair) {
    return fmt::format("nccl-pair-{}-{}", pair.low, pair.high);
}

std::string pair_id_path(const std::string& directory, const RankPair& pair) {
    return FileRendezvous(directory, pair_id_key(pair)).path_of(pair.low);
}

StatusOr<std::vector<std::string>> exchange_pair_ids_via_files(const std::string& directory,
                                                               int rank, int world, size_t id_bytes,
                                                               const MakePairId& make_id,
                                                               std::chrono::milliseconds timeout) {
    PDSIM_RETURN_IF_ERROR(check_world(rank, world));
    if (directory.empty()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "nccl: no rendezvous directory (GpuTransportOptions.rendezvous_dir)");
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<std::string> ids(static_cast<size_t>(world));
    std::vector<RankPair> awaited;
    for (const RankPair& pair : pairs_of(rank, world)) {
        if (!creates_pair_id(pair, rank)) {
            awaited.push_back(pair);
            continue;
        }
        auto id = make_checked(make_id, pair, id_bytes);
        if (!id.ok()) return id.status();
        PDSIM_RETURN_IF_ERROR(FileRendezvous(directory, pair_id_key(pair))
                                  .publish(pair.low, *id)
                                  .with_context(fmt::format("nccl rank {}", rank)));
        ids[static_cast<size_t>(pair.high)] = std::move(*id);
    }
    for (;;) {
        std::vector<RankPair> still;
        for (const RankPair& pair : awaited) {
            std::optional<std::string> got =
                FileRendezvous(directory, pair_id_key(pair)).try_read(pair.low);
            if (!got) {
                still.push_back(pair);
                continue;
            }
            if (got->size() != id_bytes) {
                return PDSIM_ERROR(StatusCode::kDataLoss, "nccl rank {}: {} holds {} bytes, not {}",
                                   rank, pair_id_path(directory, pair), got->size(), id_bytes);
            }
            ids[static_cast<size_t>(pair.low)] = std::move(*got);
        }
        awaited = std::move(still);
        if (awaited.empty()) return ids;
        if (std::chrono::steady_clock::now() >= deadline) {
            std::vector<int> peers;
            std::string files;
            for (const RankPair& pair : awaited) {
                peers.push_back(pair.low);
                files += (files.empty() ? "" : ", ") + pair_id_path(directory, pair);
            }
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "nccl rank {}: no pair id from rank(s) {} after {} "
                               "(TransportOptions::connect_timeout); waited for {}",
                               rank, join_ranks(peers), seconds_text(timeout), files);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
}

StatusOr<std::vector<std::string>> exchange_pair_ids_via_mpi(int rank, int world, size_t id_bytes,
                                                             const MakePairId& make_id,
                                                             std::chrono::milliseconds timeout) {
    PDSIM_RETURN_IF_ERROR(check_world(rank, world));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // The ids are the requests' buffers. A request given up on (cancelled and freed) may still
    // complete in the background (a send already under way, a receive matched meanwhile), so
    // then the buffers are leaked rather than freed (world x 128 bytes, once, on a failed setup).
    auto owned = std::make_unique<std::vector<std::string>>(static_cast<size_t>(world));
    std::vector<std::string>& ids = *owned;
    std::vector<MPI_Request> requests;
    std::vector<int> request_peer;  // the peer of each request
    auto release = [&] {
        bool active = false;
        for (MPI_Request& r : requests) {
            if (r == MPI_REQUEST_NULL) continue;
            active = true;
            MPI_Cancel(&r);
            MPI_Request_free(&r);
        }
        if (active) static_cast<void>(owned.release());
    };
    for (const RankPair& pair : pairs_of(rank, world)) {
        const int peer = pair.low == rank ? pair.high : pair.low;
        std::string& slot = ids[static_cast<size_t>(peer)];
        MPI_Request req = MPI_REQUEST_NULL;
        int rc = MPI_SUCCESS;
        if (creates_pair_id(pair, rank)) {
            auto id = make_checked(make_id, pair, id_bytes);
            if (!id.ok()) {
                release();
                return id.status();
            }
            slot = std::move(*id);
            rc = MPI_Isend(slot.data(), static_cast<int>(id_bytes), MPI_BYTE, peer, kPairIdMpiTag,
                           MPI_COMM_WORLD, &req);
        } else {
            slot.assign(id_bytes, '\0');
            rc = MPI_Irecv(slot.data(), static_cast<int>(id_bytes), MPI_BYTE, peer, kPairIdMpiTag,
                           MPI_COMM_WORLD, &req);
        }
        if (rc != MPI_SUCCESS) {
            release();
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "nccl rank {}: MPI_I{} of the id for {} "
                               "failed (MPI error {})",
                               rank, creates_pair_id(pair, rank) ? "send" : "recv", peer, rc);
        }
        requests.push_back(req);
        request_peer.push_back(peer);
    }
    for (;;) {
        int all_done = 0;
        if (requests.empty()) return ids;
        const int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &all_done,
                                   MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
            release();
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "nccl rank {}: MPI_Testall on the pair ids failed (MPI error {})",
                               rank, rc);
        }
        if (all_done) return ids;
        if (std::chrono::steady_clock::now() >= deadline) {
            std::vector<int> peers;
            for (size_t i = 0; i < requests.size(); ++i) {
                int done = 0;
                if (requests[i] != MPI_REQUEST_NULL) {
                    MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE);
                } else {
                    done = 1;
                }
                if (!done) peers.push_back(request_peer[i]);
            }
            release();
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "nccl rank {}: pair id exchange over MPI with rank(s) {} not done "
                               "after {} (TransportOptions::connect_timeout)",
                               rank, join_ranks(peers), seconds_text(timeout));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

Status validate_gpu_transport_options(const GpuTransportOptions& options) {
    if (options.op_timeout.count() < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "GpuTransportOptions.op_timeout must be >= 0 ms (0 turns nccl's "
                           "watchdog off), got {} ms",
                           options.op_timeout.count());
    }
    if (options.device_index < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "GpuTransportOptions.device_index must be >= 0, got {}",
                           options.device_index);
    }
    return {};
}

std::string seconds_text(std::chrono::milliseconds d) {
    return fmt::format("{:g} s", static_cast<double>(d.count()) / 1000.0);
}

std::string op_timeout_message(int peer, std::chrono::milliseconds op_timeout) {
    return fmt::format("nccl: op to/from rank {} pending > {}; communicator aborted", peer,
                       seconds_text(op_timeout));
}

std::string init_timeout_message(int rank, const std::vector<int>& peers,
                                 std::chrono::milliseconds connect_timeout) {
    return fmt::format(
        "nccl rank {}: communicator with rank(s) {} not initialized after {} "
        "(TransportOptions::connect_timeout; did the peer start, with the same rendezvous?); "
        "aborted",
        rank, join_ranks(peers), seconds_text(connect_timeout));
}

}  // namespace pdsim::transfer
