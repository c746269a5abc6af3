#include "transfer/engine/page_pins.h"

#include <fmt/format.h>

#include <algorithm>

#include "transfer/engine/ordering_validator.h"

namespace pdsim::transfer {

void PagePins::pin(uint64_t request, std::span<const int32_t> pages) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int32_t>& mine = by_request_[request];
    for (int32_t p : pages) {
        std::vector<uint64_t>& owners = owners_[p];
        if (std::find(owners.begin(), owners.end(), request) != owners.end()) continue;
        owners.push_back(request);
        mine.push_back(p);
    }
}

void PagePins::unpin_request(uint64_t request) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_request_.find(request);
    if (it == by_request_.end()) return;
    for (int32_t p : it->second) {
        auto o = owners_.find(p);
        if (o == owners_.end()) continue;
        std::erase(o->second, request);
        if (o->second.empty()) owners_.erase(o);
    }
    by_request_.erase(it);
}

bool PagePins::is_pinned(int32_t page) const {
    std::lock_guard<std::mutex> lock(mu_);
    return owners_.count(page) != 0;
}

size_t PagePins::pinned_pages() const {
    std::lock_guard<std::mutex> lock(mu_);
    return owners_.size();
}

Status PagePins::free_pages(kv::PageAllocator& allocator, std::span<const int32_t> pages) {
    {
        // The check and the free are not atomic with respect to a concurrent pin() of the same
        // pages; that would be a caller pinning pages it is freeing at the same time, which no
        // correct caller does. The lock only keeps the map consistent.
        std::lock_guard<std::mutex> lock(mu_);
        for (int32_t p : pages) {
            auto it = owners_.find(p);
            if (it == owners_.end()) continue;
            const uint64_t req = it->second.front();
            Status st = PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                    "rank {}: free of page {} refused: pinned by the in-flight "
                                    "transfer of request {}",
                                    rank_, p, req);
            if (validator_ != nullptr) {
                validator_->add_violation(Violation{
                    req, -1, -1, rank_,
                    fmt::format("free-before-transfer: page {} freed while its transfer was in "
                                "flight (refused)",
                                p)});
            }
            return st;
        }
    }
    return allocator.free(pages);
}

}  // namespace pdsim::transfer
