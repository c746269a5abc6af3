// The ordering validator: proves, byte for byte, that what the transfer engine read on the
// prefill side and what landed on the decode side is what the compute stream wrote before it
// recorded the layer's step.
//
// Checksum. For one (request, layer, buffer, global head h) the checksum is
//     sum over tokens t of kv_hash(bytes of head h of token t, seed = t)   (mod 2^64)
// kv_hash is a 64-bit xxHash64-style hash. Because it is a sum of per-(token, head) terms keyed by
// the token index, it does not depend on the page layout, the page size, the TP split, the chunk
// boundaries or the order the tokens were written in: the compute stream (per chunk), the sender
// (per chunk and fragment) and the receiver (over its pages, any TP/page size) all compute the
// same number for the same bytes.
//
// Where each side checks:
//  1. Compute (the truth): enqueue_layer_checksum() is enqueued on the compute stream right after
//     a layer's KV write; in stream order it sums the tokens that write produced and records them
//     as the expected checksums of (request, layer, buffer, head) for this rank's heads (on a
//     device layout the sums are taken by the KV memory ops, kv_memory_ops.h).
//  2. Sender: hashes what it reads from the pages at send time (before each post), per
//     destination; with the last chunk it compares that to the expected sums. A read before the
//     write finished (record-before-write, double-record), or after a late overwrite, differs.
//     After all sends of a request completed it re-hashes its pages (verify_after_send): a write
//     after the record (late write) or a page freed/reused while in flight shows up here even when
//     the read itself raced ahead of it.
//  3. Receiver: the expected sums travel in the completion message; once everything landed the
//     receiver hashes its pages and compares.
// On a device layout the sender's and the receiver's hashing runs through the engine's KV memory
// ops on its comm stream (kv_sender.h, "Device memory"): the same sums, bit for bit.
// Every mismatch is a Violation naming request, layer, buffer, rank and what differed.
//
// Thread-safety: OrderingValidator is internally synchronized; any thread (stream tasks, engine
// threads) may call it. One validator per rank: its expected sums are that rank's heads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "backends/runtime/stream.h"
#include "common/status.h"
#include "transfer/engine/kv_layout.h"

namespace pdsim::transfer {

class KvMemoryOps;

// 64-bit hash of `bytes` bytes (xxHash64 construction; not the reference xxHash output). The
// function is kv_hash_inline (kv_hash.h), which CUDA kernels compile too.
[[nodiscard]] uint64_t kv_hash(const void* data, size_t bytes, uint64_t seed);

// Per-head checksums of tokens [t0, t1) of (layer, buf) for heads [head_begin, head_begin + count)
// (global indices; must be inside the layout's heads), reading slots from `pages`.
[[nodiscard]] std::vector<uint64_t> kv_checksums(const KvLayout& layout,
                                                 std::span<const int32_t> pages, int layer, int buf,
                                                 int64_t t0, int64_t t1, int head_begin,
                                                 int head_count);
// Adds the checksum terms of `count` tokens starting at token_begin, whose slots are slot0,
// slot0 + 1, ... on `layout`'s side, reading head_count heads from byte `offset` of each slot,
// into sums[0..head_count).
void kv_checksums_add_run(const KvLayout& layout, int layer, int buf, int64_t token_begin,
                          int64_t count, int64_t slot0, size_t offset, int head_count,
                          uint64_t* sums);

struct Violation {
    uint64_t request = 0;
    int layer = -1;  // -1: not about one layer (e.g. a pinned page freed)
    int buffer = -1;
    int rank = -1;
    std::string what;
    [[nodiscard]] std::string to_string() const;
};

struct OrderingReport {
    // Number of (request, layer) pairs whose bytes were compared against the compute stream's
    // checksums, counted once per comparing rank and side (sender / receiver / after-send).
    uint64_t checked_layers = 0;
    std::vector<Violation> violations;
    void merge(const OrderingReport& other);
    [[nodiscard]] std::string to_string(size_t max_listed = 20) const;
};

class OrderingValidator {
public:
    explicit OrderingValidator(int rank) : rank_(rank) {}
    OrderingValidator(const OrderingValidator&) = delete;
    OrderingValidator& operator=(const OrderingValidator&) = delete;

    [[nodiscard]] int rank() const { return rank_; }

    // Compute side: adds the sums of tokens [t0, t1) of (request, layer, buf) for heads
    // [head_begin, head_begin + sums.size()). Recording a token twice is a Violation (the layer
    // was written/recorded twice).
    void record_expected(uint64_t request, int layer, int buf, int head_begin,
                         std::span<const uint64_t> sums, int64_t t0, int64_t t1);

    // Blocks until tokens [0, num_tokens) of (request, layer, buf) have been recorded, then
    // returns the sums of heads [head_begin, head_begin + head_count). kDeadlineExceeded after
    // `timeout` (naming how many tokens were recorded).
    [[nodiscard]] StatusOr<std::vector<uint64_t>> wait_expected(
        uint64_t request, int layer, int buf, int64_t num_tokens, int head_begin, int head_count,
        std::chrono::nanoseconds timeout) const;

    // Compares `observed` to `expected` head by head; each mismatch adds a Violation whose `what`
    // is "<side>: head h checksum <observed> != recorded <expected>". Returns the mismatches.
    // (Callers count checked layers with add_checked_layers.)
    size_t compare(uint64_t request, int layer, int buf, int head_begin,
                   std::span<const uint64_t> observed, std::span<const uint64_t> expected,
                   std::string_view side);

    void add_violation(Violation v);
    void add_checked_layers(uint64_t n);
    [[nodiscard]] OrderingReport report() const;
    [[nodiscard]] size_t violation_count() const;
    // Drops the expected sums of `request` (call once no side needs them any more).
    void forget(uint64_t request);

private:
    struct Entry {
        std::map<int, uint64_t> sums;                     // global head -> sum
        std::vector<std::pair<int64_t, int64_t>> ranges;  // recorded token ranges
        int64_t covered = 0;
    };
    using Key = std::tuple<uint64_t, int, int>;

    const int rank_;
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    std::map<Key, Entry> expected_;
    OrderingReport report_;
};

// Enqueues, on the compute stream, the checksum of tokens [token_begin, token_end) of every
// buffer of `layer` for the rank's heads (record_expected). Call it right after enqueueing the
// layer's KV write (before or after the step record: the sender waits for the sums, bounded by
// its request timeout). `pages` is the request's page table (copied).
//   Host layout: one stream task hashes the pages (kv_checksums) and records them; `ops` is
//   ignored.
//   Device layout: `ops` (of the layout's memory kind; the caller keeps it alive until the stream
//   has passed the work) enqueue the checksums (plan_page_checksums) into sums memory of the ops
//   (allocate_sums), then one host task on the same stream records them. On a CudaStream that
//   host task is a host round trip per layer (cudaLaunchHostFunc: the stream waits for it); a
//   later step may replace it with a record on the device. The sums memory is given back by the
//   task itself (no device call: kv_memory_ops.h). Not in a graph capture with the CUDA ops
//   (kFailedPrecondition, theirs).
// Errors (nothing enqueued): kInvalidArgument for a bad layer, token range or page table, a
// device layout without `ops` or with ops of another memory kind (naming `ops`); the ops'
// errors.
[[nodiscard]] Status enqueue_layer_checksum(runtime::Stream& stream, OrderingValidator& validator,
                                            const KvLayout& layout, uint64_t request_id, int layer,
                                            std::vector<int32_t> pages, int64_t token_begin,
                                            int64_t token_end, KvMemoryOps* ops = nullptr);

}  // namespace pdsim::transfer
