// FileRendezvous: how the ranks of a transport find each other through a shared directory.
//
// Each rank publishes one small value (an address, an NCCL unique id: any bytes) as the file
// "<directory>/rank-<r>.<key>"; the others read it. Publishing is atomic (a temporary file renamed
// into place), so a reader sees either no file or the whole value. The directory may be local
// (ranks on one host) or on a file system every host shares. tcp publishes each rank's listening
// address under key "addr" (transfer/tcp/tcp_transport.h), nccl each rank pair's unique id under
// "nccl-pair-<low>-<high>", published by the lower rank (transfer/nccl/nccl_pair_ids.h).
//
// Thread-safety: the object is immutable; every method may be called from any thread at once.
// Blocking: publish and try_read do a few file-system calls; only collect waits (polling every
// 10 ms until its timeout).
// Errors: kUnavailable  the directory or a file cannot be created, written or renamed (named);
//         kDeadlineExceeded  collect's timeout passed: the message names the directory, the key
//                            and the ranks that had not published.
#pragma once

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pdsim::transfer {

class FileRendezvous {
public:
    // `directory` is created (with its parents) by the first publish. `key`: a file-name-safe
    // word that tells this exchange from others in the same directory.
    FileRendezvous(std::string directory, std::string key);

    [[nodiscard]] const std::string& directory() const { return directory_; }
    // "<directory>/rank-<rank>.<key>".
    [[nodiscard]] std::string path_of(int rank) const;

    // Publishes `value` as `rank`'s (replacing an earlier one).
    [[nodiscard]] Status publish(int rank, std::string_view value) const;
    // `rank`'s value, or nullopt while it has not been published.
    [[nodiscard]] std::optional<std::string> try_read(int rank) const;
    // The values of `ranks`, in that order, once all are published; kDeadlineExceeded after
    // `timeout` naming the ranks still missing.
    [[nodiscard]] StatusOr<std::vector<std::string>> collect(
        std::span<const int> ranks, std::chrono::milliseconds timeout) const;

private:
    std::string directory_;
    std::string key_;
};

}  // namespace pdsim::transfer
