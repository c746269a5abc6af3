// The host-side setup of the "nccl" transport's per-pair communicators (transfer/nccl/
// gpu_transports.h): which pairs a rank belongs to, its rank inside each two-rank communicator,
// how each pair's ncclUniqueId travels, and the texts of the transport's timeouts. Plain C++ (no
// CUDA or NCCL headers, built with or without CUDA): the id is opaque bytes made by a callback, so
// all of this is unit-tested without a GPU (tests/nccl_pair_ids_test.cpp).
//
// Pairs: one communicator per unordered pair of ranks {low, high}, low < high; inside it `low` is
// rank 0 and `high` rank 1. The low rank creates the pair's id and hands it to the high one:
//   - through a directory (exchange_pair_ids_via_files): one file per pair, the FileRendezvous
//     (transfer/rendezvous.h) value "<dir>/rank-<low>.nccl-pair-<low>-<high>" published by the
//     low rank and read by the high one. Use a fresh directory per run: a stale id from an
//     earlier run is read as valid and that pair's communicator init then times out.
//   - over MPI (exchange_pair_ids_via_mpi): MPI_Isend from low to high on MPI_COMM_WORLD with tag
//     kPairIdMpiTag, MPI_Irecv on the high side, polled with MPI_Testall until the deadline.
//
// Thread-safety: the functions are pure or touch only their arguments, the directory, and MPI
// (the MPI exchange must not run concurrently with other MPI calls of the process unless MPI
// was initialized with MPI_THREAD_MULTIPLE). Blocking: the exchanges poll (every 2-10 ms) until
// every id is through or `timeout` has passed; nothing waits without that bound.
// Errors: kInvalidArgument  bad ranks / world, empty directory;
//         kDeadlineExceeded  the timeout passed: the message names this rank, the peers whose id
//         did
//                            not arrive (and, for files, the directory and the files), and the
//                            timeout;
//         kDataLoss          an id of the wrong size; kUnavailable: a file or MPI call failed;
//         any error of make_id, with context.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim::transfer {

// The pair {a, b} ordered: low < high.
struct RankPair {
    int low = 0;
    int high = 0;
    friend bool operator==(const RankPair&, const RankPair&) = default;
};

// The pair of two distinct non-negative ranks, in either order; kInvalidArgument otherwise.
[[nodiscard]] StatusOr<RankPair> rank_pair(int a, int b);
// `self`'s rank inside the pair's two-rank communicator: 0 for low, 1 for high (self must be one
// of the two). The peer's is 1 minus it.
[[nodiscard]] int rank_in_pair(const RankPair& pair, int self);
// True when `self` creates the pair's id (it is the low rank).
[[nodiscard]] inline bool creates_pair_id(const RankPair& pair, int self) {
    return self == pair.low;
}
// The pairs `rank` belongs to in a world of `world`, ordered by peer (world - 1 of them).
[[nodiscard]] std::vector<RankPair> pairs_of(int rank, int world);

// The FileRendezvous key of a pair's id: "nccl-pair-<low>-<high>".
[[nodiscard]] std::string pair_id_key(const RankPair& pair);
// The file that carries a pair's id in `directory`: "<directory>/rank-<low>.nccl-pair-<low>-<high>"
// (FileRendezvous(directory, pair_id_key(pair)).path_of(pair.low)).
[[nodiscard]] std::string pair_id_path(const std::string& directory, const RankPair& pair);

// The MPI tag of the id messages (on MPI_COMM_WORLD; the mpi transport uses its own communicator).
inline constexpr int kPairIdMpiTag = 0x6e63;  // "nc"

// Makes a new id (ncclGetUniqueId's bytes) for the pair; called once per pair this rank creates.
using MakePairId = std::function<StatusOr<std::string>(const RankPair& pair)>;

// The id of every pair of `rank`, indexed by peer (the entry of `rank` itself stays empty). Each
// id is `id_bytes` long. Creates (make_id) and publishes the ids of the pairs where `rank` is low
// first, then reads the others.
[[nodiscard]] StatusOr<std::vector<std::string>> exchange_pair_ids_via_files(
    const std::string& directory, int rank, int world, size_t id_bytes, const MakePairId& make_id,
    std::chrono::milliseconds timeout);
// As exchange_pair_ids_via_files, over MPI_COMM_WORLD (MPI must be initialized; `rank` and
// `world` are MPI_COMM_WORLD's). On timeout the outstanding requests are cancelled and freed.
[[nodiscard]] StatusOr<std::vector<std::string>> exchange_pair_ids_via_mpi(
    int rank, int world, size_t id_bytes, const MakePairId& make_id,
    std::chrono::milliseconds timeout);

// "1 s", "0.25 s", "120 s": a duration in seconds as the transport's messages print it.
[[nodiscard]] std::string seconds_text(std::chrono::milliseconds d);
// The watchdog's error (GpuTransportOptions::op_timeout): "nccl: op to/from rank <peer> pending
// > <T> s; communicator aborted".
[[nodiscard]] std::string op_timeout_message(int peer, std::chrono::milliseconds op_timeout);
// Communicator init past the connect timeout: "nccl rank <rank>: communicator with rank(s) <peers>
// not initialized after <T> s (TransportOptions::connect_timeout; did the peer start, with the
// same rendezvous?); aborted".
[[nodiscard]] std::string init_timeout_message(int rank, const std::vector<int>& peers,
                                               std::chrono::milliseconds connect_timeout);

}  // namespace pdsim::transfer
