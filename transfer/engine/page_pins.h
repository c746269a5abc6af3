// PagePins: the pages a transfer is reading (prefill) or writing (decode) right now.
//
// The engine pins a request's pages when it takes the request (decode: at submit; prefill: when
// a chunk is submitted) and unpins them only when no transfer operation on them can still run
// (every send/receive completed or was cancelled). Freeing a pinned page is the
// "free-before-transfer" bug: free_pages() refuses it (kFailedPrecondition naming the page and
// the request that pins it), frees nothing, and records a Violation in the validator (if any).
// The pool's own allocator knows nothing of pins: callers that free through
// kv::PageAllocator::free directly bypass this check (the checksums then catch a page that was
// reused while in flight).
//
// Thread-safety: internally synchronized.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "common/status.h"

namespace pdsim::transfer {

class OrderingValidator;

class PagePins {
public:
    // `rank` and `validator` (not owned, may be null) are for the Violation of a refused free.
    explicit PagePins(int rank, OrderingValidator* validator = nullptr)
        : rank_(rank), validator_(validator) {}
    PagePins(const PagePins&) = delete;
    PagePins& operator=(const PagePins&) = delete;

    // Pins `pages` for `request` (pages already pinned by that request are not pinned twice).
    void pin(uint64_t request, std::span<const int32_t> pages);
    // Drops every pin of `request`.
    void unpin_request(uint64_t request);

    [[nodiscard]] bool is_pinned(int32_t page) const;
    [[nodiscard]] size_t pinned_pages() const;

    // Frees `pages` through `allocator` unless one of them is pinned (see the header note).
    [[nodiscard]] Status free_pages(kv::PageAllocator& allocator, std::span<const int32_t> pages);

private:
    const int rank_;
    OrderingValidator* const validator_;
    mutable std::mutex mu_;
    std::unordered_map<int32_t, std::vector<uint64_t>> owners_;      // page -> requests
    std::unordered_map<uint64_t, std::vector<int32_t>> by_request_;  // request -> pages
};

}  // namespace pdsim::transfer
